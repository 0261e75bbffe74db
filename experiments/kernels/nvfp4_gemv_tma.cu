// EXPERIMENT (not the product): a batch-1 NVFP4 W4A4 GEMV for Hopper (sm_90) that streams the
// weights into shared memory with TMA bulk copies, y[N] = x[K] . W[N, K]^T, bf16 out. Host side,
// plans and the device check: nvfp4_gemv_tma.py and check_gemv_tma.py beside this file.
//
// Why. KERNEL_NOTES log 16: production's M = 1 GEMV (cuda_ops/nvfp4_gemv.cu) runs at the read
// floor of its own occupancy (one 512-thread CTA per SM, ~112 registers): a plain read launched
// that way takes 11.3 us for Qwen3-8B's down_proj against 8.8 us at 4 CTAs per SM, and the
// cp.async ring (4 steps in flight per warp) got the loads only to 10.6 us. The bytes a CTA has
// in flight are bounded by its threads' registers or ring slots. Here one producer warp keeps
// STAGES stages of the CTA's weights in flight with cp.async.bulk (no registers, no per-thread
// load instructions; 70-150 KB per SM), and the consumer warps decode from shared memory.
//
// Operands, layout and numerics are production's plain W4A4 GEMV's (nvfp4_gemv_w4a4 at M = 1):
// xp, xs, xg, with EPI_RES the bf16 residual res [N] (y = res + y, XLA's bf16 add), the stacked
// weights wp [L, N, K/2] (element 2j in the low nibble of byte j), ws [L, N, K/16] (E4M3 block
// scales), wg [L] (one float32 global scale a layer; with GW_ROWS [L, N], one a row), the layer
// (int32 on the device), y [N]. x is decoded once per CTA to int8 (2 x E2M1 value) in shared
// memory; each 16-element block dot is an exact integer from dp4a on (positive, negative) weight
// words (the same prmt tables), scaled by SFw * SFx (exact in fp32) and accumulated in fp32; y =
// (acc / 4) * (gw * gx), rounded once to bf16. Only the fp32 summation order differs from
// production (per lane over its 16-byte units, then a butterfly over the lanes), so outputs
// agree with it to fp32 rounding, not bitwise.
//
// Work: a stage is WARPS rows x KCH code bytes (and their KCH / 8 scale bytes); consumer warp w
// takes row w of each stage, lane l its 16-byte units l, l + 32, ... A CTA owns a contiguous
// range of row groups (WARPS rows each) and streams them chunk by chunk (K_IN / 2 / KCH stages a
// group). Stage s has a "full" mbarrier (the producer's arrive.expect_tx, then the bulk copies'
// complete_tx) and an "empty" one (one arrive per consumer warp once it has read the stage).
//
// -D constants (nvfp4_gemv_tma.py plans them): EPI_RES, SWIGLU_OUT and XGD_STACK (below), N_OUT,
// K_IN, KCH (code bytes of a row a stage: a multiple of 128 dividing K_IN / 2), WARPS (consumer
// warps, <= 16), STAGES, GRID (CTAs), MIN_CTAS (launch bounds), EF (1: the bulk copies carry an
// L2 evict_first policy), NOMATH (1: diagnostic, the decode and dot replaced by an xor of the
// codes: the streaming rate alone), PRODUCER (0: TMA bulk copies, one per row and chunk; 1: the
// second design, the producer warp's 32 lanes fill a stage with 16-byte cp.async copies, each
// lane's completing through cp.async.mbarrier.arrive.noinc on the stage's "full" barrier, which
// then counts 32 arrivals instead of bytes: the same ring with the load-store unit instead of
// the copy engine).

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#ifndef EF
#define EF 0
#endif
#ifndef NOMATH
#define NOMATH 0
#endif
#ifndef MIN_CTAS
#define MIN_CTAS 1
#endif
#ifndef PRODUCER
#define PRODUCER 0
#endif
#ifndef EPI_RES
#define EPI_RES 0
#endif
#ifndef SWIGLU_OUT
#define SWIGLU_OUT 0  // gate_up: down_proj's NVFP4 input instead of y (below)
#endif
#ifndef XGD_STACK
#define XGD_STACK 0  // SWIGLU_OUT: down_proj's static input scale is stacked [L]
#endif
#ifndef GW_ROWS
#define GW_ROWS 0  // the weight's global scales are per output row, wg [L, N]
#endif

#define ROW_CODES (K_IN / 2)
#define ROW_SCALES (K_IN / 16)
#define SCH (KCH / 8)
#define CHUNKS (ROW_CODES / KCH)
#define GROUPS (N_OUT / WARPS)
#define UNITS (KCH / 16)          // 16-byte code units of a row a stage
#define UPL ((UNITS + 31) / 32)   // per lane (the last round partial when UNITS % 32 != 0)
#define STAGE_CODES (WARPS * KCH)
#define STAGE_BYTES (WARPS * (KCH + SCH))
#define RING_BYTES (STAGES * STAGE_BYTES)
#define NTHREADS ((WARPS + 1) * 32)

static_assert(KCH % 128 == 0 && ROW_CODES % KCH == 0, "KCH: a multiple of 128 dividing K / 2");
static_assert(WARPS >= 1 && WARPS <= 16 && N_OUT % WARPS == 0, "WARPS rows a stage");
static_assert(STAGES >= 2, "at least two stages");
// SWIGLU_OUT (gate_up_proj, y = [gate | up], N = 2F), production's epilogue: a unit is the 16
// gate rows 16u .. 16u + 15 and the 16 up rows F + 16u .., one 16-element NVFP4 block of
// down_proj's input. A CTA owns whole units and streams each unit's gate group, then its up
// group, so consumer warp w ends the unit with gate and up of output 16u + w; the 16 values
// h = silu(gate) * up (production's bf16 rounding points) meet in shared memory and 4 lanes
// quantize the block with down_proj's static input scale (common.cuh's block_codes).
static_assert(!SWIGLU_OUT || (WARPS == 16 && N_OUT % 32 == 0 && !EPI_RES),
              "SWIGLU_OUT: 16 rows a stage (one block), N a multiple of 32, no residual");

// production's (cuda_ops/common.cuh): prmt tables, act_to_s8 (x codes -> int8), decode_row
// (weight codes -> (pos, neg) int8 words), row_dot (two exact block dots, scaled), and
// e4m3x2_to_float2
#include "common.cuh"

// mbarriers, bulk and cp.async copies, bf16 rounding, a stage row's block dots and the SwiGLU
// epilogue (beside this file)
#include "tma_ring.cuh"

// ---------------------------------------------------------------------------- kernel

extern "C" __global__ void __launch_bounds__(NTHREADS, MIN_CTAS)
    nvfp4_gemv_tma(const u8* __restrict__ xp, const u8* __restrict__ xs,
                   const float* __restrict__ xg,
#if EPI_RES
                   const u16* __restrict__ res,
#endif
                   const u8* __restrict__ wp_all, const u8* __restrict__ ws_all,
                   const float* __restrict__ wg_all, const int* __restrict__ layer,
#if SWIGLU_OUT  // down_proj's static input scale in; its codes, block scales, global scale out
                   const float* __restrict__ xgd, u8* __restrict__ dp, u8* __restrict__ ds,
                   float* __restrict__ dg) {
#else
                   u16* __restrict__ y) {
#endif
  // production's operands: the stacked weights of every layer and the layer to read
  const size_t l = (size_t)*layer;
  const u8* __restrict__ wp = wp_all + l * N_OUT * ROW_CODES;
  const u8* __restrict__ ws = ws_all + l * N_OUT * ROW_SCALES;
  extern __shared__ __align__(128) u8 smem[];
  u8* ring = smem;
  u8* sx = smem + RING_BYTES;        // x as int8, K_IN bytes
  u8* sxs = sx + K_IN;               // x's E4M3 block scales, K_IN / 16 bytes
  u64* bars = (u64*)(sxs + ROW_SCALES);  // full[STAGES], empty[STAGES]
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
#if SWIGLU_OUT
  const int u0 = (int)((long long)blockIdx.x * (N_OUT / 32) / GRID);  // the CTA's whole units
  const int u1 = (int)((long long)(blockIdx.x + 1) * (N_OUT / 32) / GRID);
  const int items = 2 * (u1 - u0) * CHUNKS;
  // first row of the CTA's group j: unit u0 + j / 2's gate rows, then its up rows
  auto group_row = [&](int j) { return (j & 1) * (N_OUT / 2) + (u0 + j / 2) * 16; };
#else
  const int g0 = (int)((long long)blockIdx.x * GROUPS / GRID);
  const int g1 = (int)((long long)(blockIdx.x + 1) * GROUPS / GRID);
  const int items = (g1 - g0) * CHUNKS;
  auto group_row = [&](int j) { return (g0 + j) * WARPS; };
#endif
  const u32 full0 = smem_addr(bars), empty0 = smem_addr(bars + STAGES);

  if (tid == 0) ring_init(full0, empty0, PRODUCER ? 32 : 1, WARPS);
  __syncthreads();

  if (warp == WARPS) {  // the producer: every stage of this CTA's rows, STAGES in flight
    u64 pol = 0;
#if EF
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
#endif
    for (int i = 0; i < items; ++i) {
      const int s = i % STAGES;
      const u32 round = (u32)(i / STAGES);
      if (round > 0) mbar_wait(empty0 + 8 * s, (round - 1) & 1);
      u8* st = ring + s * STAGE_BYTES;
#if PRODUCER
      (void)pol;
      const int row0 = group_row(i / CHUNKS), c = i % CHUNKS;
#pragma unroll 4
      for (int piece = lane; piece < WARPS * KCH / 16; piece += 32) {  // codes, row-major
        const int r = piece / (KCH / 16), off = 16 * (piece % (KCH / 16));
        cp_async16(smem_addr(st + r * KCH + off),
                   wp + (size_t)(row0 + r) * ROW_CODES + c * KCH + off);
      }
      for (int piece = lane; piece < WARPS * SCH / 16; piece += 32) {  // their scales
        const int r = piece / (SCH / 16), off = 16 * (piece % (SCH / 16));
        cp_async16(smem_addr(st + STAGE_CODES + r * SCH + off),
                   ws + (size_t)(row0 + r) * ROW_SCALES + c * SCH + off);
      }
      cp_async_arrive(full0 + 8 * s);
#else
      if (lane == 0) mbar_arrive_expect_tx(full0 + 8 * s, STAGE_BYTES);
      __syncwarp();
      const int row = group_row(i / CHUNKS) + lane % WARPS, c = i % CHUNKS;
      if (lane < WARPS) {
        bulk_g2s(smem_addr(st + lane * KCH), wp + (size_t)row * ROW_CODES + c * KCH, KCH,
                 full0 + 8 * s, pol);
      } else if (lane < 2 * WARPS) {
        bulk_g2s(smem_addr(st + STAGE_CODES + (lane - WARPS) * SCH),
                 ws + (size_t)row * ROW_SCALES + c * SCH, SCH, full0 + 8 * s, pol);
      }
#endif
    }
#if PRODUCER
    asm volatile("cp.async.wait_all;" ::: "memory");  // no thread leaves copies in flight
#endif
    return;
  }

  // consumers: x to int8 while the first stages land
  for (int u = tid; u < K_IN / 32; u += WARPS * 32) {
    const uint4 q = *(const uint4*)(xp + 16 * u);
    const u32 words[4] = {q.x, q.y, q.z, q.w};
    u32 out[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[2 * i] = act_to_s8(words[i]);
      out[2 * i + 1] = act_to_s8(words[i] >> 16);
    }
    *(uint4*)(sx + 32 * u) = make_uint4(out[0], out[1], out[2], out[3]);
    *(uint4*)(sx + 32 * u + 16) = make_uint4(out[4], out[5], out[6], out[7]);
  }
  for (int u = tid; u < ROW_SCALES / 16; u += WARPS * 32) {
    *(uint4*)(sxs + 16 * u) = *(const uint4*)(xs + 16 * u);
  }
#if SWIGLU_OUT
  __shared__ float s_igd, hbuf[2][16];  // 1 / down's scale; a unit's h, by unit parity
  const float* gd = xgd + (XGD_STACK ? l : 0);
  if (tid == 0) {
    s_igd = div_rn(1.0f, *gd);
    if (blockIdx.x == 0) dg[0] = *gd;
  }
  float gate = 0.f;  // the unit's gate total (its up group comes next)
#endif
  asm volatile("bar.sync 1, %0;" ::"n"(WARPS * 32) : "memory");

  // production's output scale gw(n) * gx: one global scale a matrix, or (GW_ROWS) one a row
  const float* __restrict__ wg = wg_all + (GW_ROWS ? l * N_OUT : l);
  auto out_scale = [&](int n) { return (GW_ROWS ? wg[n] : wg[0]) * xg[0]; };
  float acc = 0.f;
  for (int i = 0; i < items; ++i) {
    const int s = i % STAGES, c = i % CHUNKS;
    mbar_wait(full0 + 8 * s, (u32)(i / STAGES) & 1);
    const u8* st = ring + s * STAGE_BYTES;
    const u8* codes = st + warp * KCH;
    const u8* scales = st + STAGE_CODES + warp * SCH;
#if NOMATH
#pragma unroll
    for (int t = 0; t < UPL; ++t) {
      const int unit = lane + 32 * t;
      if (UNITS % 32 != 0 && unit >= UNITS) break;
      const uint4 q = *(const uint4*)(codes + 16 * unit);
      acc += __int_as_float((q.x ^ q.y ^ q.z ^ q.w) & 0x3F800000u);
    }
#else
    stage_row_dot(acc, codes, scales, sx, sxs, c, lane);
#endif
    __syncwarp();
    if (lane == 0) mbar_arrive(empty0 + 8 * s);
    if (c == CHUNKS - 1) {  // the row is done: its lanes' sums, in a fixed butterfly order
#pragma unroll
      for (int b = 16; b >= 1; b >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, b);
#if SWIGLU_OUT
      const int j = i / CHUNKS;
      if ((j & 1) == 0) {
        gate = acc;
      } else {  // one unit: gate row n, up row N / 2 + n
        const int unit = u0 + j / 2, n = unit * 16 + warp;
        swiglu_unit<WARPS * 32>(gate, acc, out_scale(n), out_scale(N_OUT / 2 + n), unit,
                                (j >> 1) & 1, warp, lane, hbuf, gd, &s_igd, dp, ds);
      }
#else
      if (lane == 0) {
        const int n = group_row(i / CHUNKS) + warp;
        const float out = (acc * 0.25f) * out_scale(n);
#if EPI_RES  // XLA's bf16 add: both bf16 values added in fp32, rounded once
        y[n] = f32_to_bf16(__uint_as_float((u32)res[n] << 16) +
                           __uint_as_float((u32)f32_to_bf16(out) << 16));
#else
        y[n] = f32_to_bf16(out);
#endif
      }
#endif
      acc = 0.f;
    }
  }
}
