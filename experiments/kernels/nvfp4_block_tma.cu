// EXPERIMENT (not the product): the batch-1 NVFP4 W4A4 post-attention block of a Qwen decoder
// layer in one launch, its weights streamed with TMA as in nvfp4_gemv_tma.cu (beside this file):
//
//   y1 = h + o_proj(a)                                   (a: the attention output, NVFP4)
//   g  = quantize(rms_norm(y1, nw), xgu)                 (gate_up's NVFP4 input)
//   d  = quantize(silu(gate_up(g)[:F]) * gate_up(g)[F:], xgd)   (down_proj's NVFP4 input)
//   y2 = y1 + down_proj(d)
//
// Why. In the decode step at batch 1 these are four launches today (the o GEMV with its residual
// epilogue, gate_up's quantizer with the RMSNorm prologue, the gate_up GEMV with its SwiGLU
// epilogue, the down GEMV with its residual epilogue), and a launch of a GEMV costs about 2 us
// more than its bytes at full bandwidth (KERNEL_NOTES log 13; the four GEMVs of a layer take 39
// us in a CUDA graph against 26 us for their 108.6 MB at 4.2 TB/s). Each launch ramps up and
// drains: the weight stream stops between them. Here the weights never depend on the
// activations, so one producer warp per CTA streams the CTA's share of o, then gate_up, then
// down through one ring of STAGES stages without a pause; only the consumer warps wait, at two
// grid-wide barriers (all of y1 before the RMSNorm, all of d before down), while the ring keeps
// filling with the next matrix's rows.
//
// Numerics: each phase is nvfp4_gemv_tma.cu's GEMV (production's exact block dots, the fp32 sums
// per lane over its 16-byte units, then a butterfly) with production's epilogues: XLA's bf16
// residual add, production's SwiGLU epilogue arithmetic and block quantization (common.cuh's
// block_codes). The RMSNorm + quantization of y1 is production's quantizer kernel's (PRO = 1):
// the mean square summed in its order (128 threads, each its elements 8t + 1024i .. + 7 with fma;
// a butterfly in each warp; the warps in order), each element rbf16(w * rbf16(y1 * rs)). Every
// CTA computes it for itself from y1 (L2) into its shared memory; CTA 0 also writes it (gp, gs)
// for the check. So y1 equals nvfp4_gemv_tma's residual build of o's shape bit for bit, g the
// quantizer kernel's bytes of that y1, d nvfp4_gemv_tma's SwiGLU build on g, and y2 its residual
// build of down on d (experiments/kernels/check_block_tma.py compares them).
//
// Operands (production's stacked layouts; the layer an int32 on the device): a's codes, block
// scales, global scale [1] (ap, as, ag: o's input quantizer's outputs), or with A_BF16 the bf16
// attention output a [KO] and o's static input scale xgo [L], quantized in every CTA as the
// quantizer kernel does (no prologue: each block on its own, so no launch of its own is
// needed; one fewer launch a layer); the residual stream h
// [D]; o_proj wo_p [L, D, KO/2], wo_s [L, D, KO/16], wo_g [L] (GW_ROWS_O: [L, D]); the norm
// weight nw [L, D] (bf16) and gate_up's static input scale xgu [L]; gate_up wgu_* [L, 2F, D/2]
// ... ([L] or [L, 2F]); down's static input scale xgd [L]; down_proj wd_* [L, D, F/2] ... ([L] or
// [L, D]); the layer. GW_ROWS_O / _GU / _D: which matrices have one global scale a row. Results: y2 [D] and y1 [D] (bf16), gp [D/2], gs [D/16], dp [F/2], ds
// [F/16] (y1, dp and ds are also the barriers' exchange buffers).
//
// -D constants (nvfp4_block_tma.py plans them): D_MODEL, K_O, F_FF, KCH (code bytes of a row a
// stage, dividing K_O / 2, D_MODEL / 2 and F_FF / 2), STAGES, GRID (CTAs: at most one per SM,
// all resident, since the barriers wait for every CTA), PRODUCER and EF as nvfp4_gemv_tma.cu's,
// GW_ROWS_O / _GU / _D, A_BF16, NORM_EPS.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#ifndef EF
#define EF 0
#endif
#ifndef PRODUCER
#define PRODUCER 0
#endif
#ifndef GW_ROWS_O  // one weight global scale a row ([L, N]) instead of one a matrix ([L]),
#define GW_ROWS_O 0  // per matrix: a checkpoint's fused gate_up has one a shard, so one a row
#endif
#ifndef GW_ROWS_GU
#define GW_ROWS_GU 0
#endif
#ifndef GW_ROWS_D
#define GW_ROWS_D 0
#endif
#ifndef A_BF16
#define A_BF16 0  // o's input in bf16 (quantized in every CTA) instead of as NVFP4 codes
#endif
#ifndef NORM_EPS
#define NORM_EPS 1e-6f
#endif

#define WARPS 16  // consumer warps = rows a stage (gate_up's SwiGLU unit is 16 rows)
#define CONSUMERS (WARPS * 32)
#define NTHREADS (CONSUMERS + 32)
#define NORM_THREADS 128  // the quantizer kernel's threads (its mean-square order)
#define SCH (KCH / 8)
#define UNITS (KCH / 16)
#define UPL ((UNITS + 31) / 32)
#define STAGE_CODES (WARPS * KCH)
#define STAGE_BYTES (WARPS * (KCH + SCH))
#define RING_BYTES (STAGES * STAGE_BYTES)
#ifndef QKV_BLOCK
#define QKV_BLOCK 0  // 1: the pre-attention entry nvfp4_qkv_tma instead (end of this file)
#endif
#if QKV_BLOCK
#define K_MAX D_MODEL
#define N_QKV ((N_HEADS + 2 * KV_HEADS) * HEAD_DIM)
#define CH_QKV (D_MODEL / 2 / KCH)
static_assert((D_MODEL / 2) % KCH == 0 && D_MODEL % 256 == 0, "KCH divides D / 2, D % 256 == 0");
static_assert(HEAD_DIM % 32 == 0 && N_QKV % 16 == 0, "HEAD_DIM: a multiple of 32");
#else
#define K_MAX (K_O > D_MODEL ? (K_O > F_FF ? K_O : F_FF) : (D_MODEL > F_FF ? D_MODEL : F_FF))
#define CH_O (K_O / 2 / KCH)
#define CH_GU (D_MODEL / 2 / KCH)
#define CH_D (F_FF / 2 / KCH)
static_assert((K_O / 2) % KCH == 0 && (D_MODEL / 2) % KCH == 0 && (F_FF / 2) % KCH == 0,
              "KCH divides every K / 2");
static_assert(K_O % 256 == 0 && D_MODEL % 256 == 0 && F_FF % 256 == 0,
              "K_O, D_MODEL, F_FF: multiples of 256");
#endif
static_assert(KCH % 128 == 0, "KCH: a multiple of 128");
static_assert(STAGES >= 2, "at least two stages");

#include "common.cuh"    // production's E2M1 tables, act_to_s8, decode_row, row_dot, block_codes
#include "tma_ring.cuh"  // mbarriers, bulk and cp.async copies, bf16 rounding, stage row dots,
                         // the SwiGLU epilogue (shared with nvfp4_gemv_tma.cu)

// ---------------------------------------------------------------------------- grid barrier

// Consumers of every CTA meet here (the producer warps never wait). A sense-reversing barrier on
// two module-global words: each CTA's thread 0 reads the generation, releases its CTA's stores
// (__threadfence) and arrives; the last to arrive clears the count and advances the generation,
// the others poll it. All GRID CTAs are resident (one per SM at most), so every arrival comes.
__device__ u32 g_block_count, g_block_gen;

__device__ __forceinline__ void grid_barrier(int tid) {
  asm volatile("bar.sync 1, %0;" ::"n"(CONSUMERS) : "memory");
  if (tid == 0) {
    const u32 gen = *(volatile u32*)&g_block_gen;
    __threadfence();
    if (atomicAdd(&g_block_count, 1u) == GRID - 1) {
      atomicExch(&g_block_count, 0u);
      __threadfence();
      atomicAdd(&g_block_gen, 1u);
    } else {
      for (u32 n = 0; *(volatile u32*)&g_block_gen == gen; ++n) {
        if (n == WAIT_TRIES) __trap();
      }
    }
    __threadfence();
  }
  asm volatile("bar.sync 1, %0;" ::"n"(CONSUMERS) : "memory");
}

// ---------------------------------------------------------------------------- pieces

// x codes [K/2] and E4M3 scales [K/16] -> int8 (2 x E2M1 value) and the scales in shared memory
// (L2 reads where another CTA wrote them in this launch)
template <int K, bool CG>
__device__ __forceinline__ void stage_codes(u8* sx, u8* sxs, const u8* xp, const u8* xs, int tid) {
  for (int u = tid; u < K / 32; u += CONSUMERS) {
    const uint4 q = CG ? __ldcg((const uint4*)(xp + 16 * u)) : *(const uint4*)(xp + 16 * u);
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
  for (int u = tid; u < K / 256; u += CONSUMERS) {
    *(uint4*)(sxs + 16 * u) = CG ? __ldcg((const uint4*)(xs + 16 * u)) : *(const uint4*)(xs + 16 * u);
  }
}

// A linear's NVFP4 input from bf16 x [K], as the quantizer kernel writes it, into shared memory
// as int8 and scales (CTA 0 also stores the codes and scales where gp is given), with the
// static global scale *g. NORM (gate_up's input, x = y1, past the first barrier: L2 reads): its
// RMSNorm prologue (PRO = 1) with the norm weight nw; else (A_BF16: o's input, the attention
// output) none (PRO = 0).
template <int K, bool NORM>
__device__ __forceinline__ void quant_in(u8* sx, u8* sxs, const u16* x, const u16* nw,
                                         const float* g, u8* gp, u8* gs, int tid) {
  __shared__ float s_red[NORM_THREADS / 32], s_rs, s_ig;
  const int lane = tid & 31, warp = tid >> 5;
  if (NORM && tid < NORM_THREADS) {
    float s = 0.f;
    for (int e = 8 * tid; e < K; e += 8 * NORM_THREADS) {
      const uint4 q = __ldcg(reinterpret_cast<const uint4*>(x + e));
      const u32 w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float lo = __uint_as_float(w[i] << 16), hi = __uint_as_float(w[i] & 0xFFFF0000u);
        s = fmaf(lo, lo, s);
        s = fmaf(hi, hi, s);
      }
    }
#pragma unroll
    for (int b = 16; b >= 1; b >>= 1) s = s + __shfl_xor_sync(0xffffffffu, s, b);
    if (lane == 0) s_red[warp] = s;
  }
  if (NORM) asm volatile("bar.sync 1, %0;" ::"n"(CONSUMERS) : "memory");
  if (tid == 0) {
    if (NORM) {
      float t = 0.f;
      for (int w = 0; w < NORM_THREADS / 32; ++w) t = t + s_red[w];
      s_rs = rsqrtf(t / (float)K + NORM_EPS);
    }
    s_ig = div_rn(1.0f, *g);
  }
  asm volatile("bar.sync 1, %0;" ::"n"(CONSUMERS) : "memory");
  // 4 elements a thread a round; the 4 consecutive threads of a block find its amax together
  for (int i = tid; i < K / 4; i += CONSUMERS) {
    const int e0 = 4 * i;
    const uint2 q = NORM ? __ldcg(reinterpret_cast<const uint2*>(x + e0))
                         : *reinterpret_cast<const uint2*>(x + e0);
    float v[4] = {__uint_as_float(q.x << 16), __uint_as_float(q.x & 0xFFFF0000u),
                  __uint_as_float(q.y << 16), __uint_as_float(q.y & 0xFFFF0000u)};
    if (NORM) {
      const uint2 u = *reinterpret_cast<const uint2*>(nw + e0);
      const float wf[4] = {__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xFFFF0000u),
                           __uint_as_float(u.y << 16), __uint_as_float(u.y & 0xFFFF0000u)};
      const float rs = s_rs;
#pragma unroll
      for (int j = 0; j < 4; ++j) v[j] = rbf16(wf[j] * rbf16(v[j] * rs));  // quant4's PRO = 1
    }
    const unsigned group = 0xFu << (tid & 28);
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
    amax = fmaxf(amax, __shfl_xor_sync(group, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(group, amax, 2));
    u32 scale;
    const u32 c = block_codes(v, amax, g, &s_ig, scale);
    *reinterpret_cast<u32*>(sx + e0) = act_to_s8(c);
    if ((i & 3) == 0) sxs[e0 / 16] = (u8)scale;
    if (gp != nullptr && blockIdx.x == 0) {
      *reinterpret_cast<u16*>(gp + e0 / 2) = (u16)c;
      if ((i & 3) == 0) gs[e0 / 16] = (u8)scale;
    }
  }
}

// one stage: 16 rows from row0, chunk c (KCH code bytes and their SCH scale bytes of each row)
__device__ __forceinline__ void produce(u8* st, u32 full, const u8* wp, const u8* ws, int row0,
                                        int c, int row_codes, int row_scales, u64 pol, int lane) {
#if PRODUCER
  (void)pol;
#pragma unroll 4
  for (int piece = lane; piece < WARPS * KCH / 16; piece += 32) {
    const int r = piece / (KCH / 16), off = 16 * (piece % (KCH / 16));
    cp_async16(smem_addr(st + r * KCH + off),
               wp + (size_t)(row0 + r) * row_codes + c * KCH + off);
  }
  for (int piece = lane; piece < WARPS * SCH / 16; piece += 32) {
    const int r = piece / (SCH / 16), off = 16 * (piece % (SCH / 16));
    cp_async16(smem_addr(st + STAGE_CODES + r * SCH + off),
               ws + (size_t)(row0 + r) * row_scales + c * SCH + off);
  }
  cp_async_arrive(full);
#else
  if (lane == 0) mbar_arrive_expect_tx(full, STAGE_BYTES);
  __syncwarp();
  const int row = row0 + lane % WARPS;
  if (lane < WARPS) {
    bulk_g2s(smem_addr(st + lane * KCH), wp + (size_t)row * row_codes + c * KCH, KCH, full, pol);
  } else {
    bulk_g2s(smem_addr(st + STAGE_CODES + (lane - WARPS) * SCH),
             ws + (size_t)row * row_scales + c * SCH, SCH, full, pol);
  }
#endif
}

#if !QKV_BLOCK
// ---------------------------------------------------------------------------- kernel

extern "C" __global__ void __launch_bounds__(NTHREADS, 1)
    nvfp4_block_tma(
#if A_BF16  // o's input as bf16 [KO] and its static scale [L]: quantized here
                    const u16* __restrict__ a, const float* __restrict__ xgo_all,
#else  // o's input quantized: codes, block scales, global scale
                    const u8* __restrict__ ap, const u8* __restrict__ as_,
                    const float* __restrict__ ag,
#endif
                    const u16* __restrict__ h,
                    const u8* __restrict__ wo_p, const u8* __restrict__ wo_s,
                    const float* __restrict__ wo_g, const u16* __restrict__ nw_all,
                    const float* __restrict__ xgu_all, const u8* __restrict__ wgu_p,
                    const u8* __restrict__ wgu_s, const float* __restrict__ wgu_g,
                    const float* __restrict__ xgd_all, const u8* __restrict__ wd_p,
                    const u8* __restrict__ wd_s, const float* __restrict__ wd_g,
                    const int* __restrict__ layer, u16* y2, u16* y1, u8* gp, u8* gs, u8* dp,
                    u8* ds) {
  const size_t l = (size_t)*layer;
  // the layer's matrices: rows of K / 2 code bytes and K / 16 scale bytes
  const u8* const o_p = wo_p + l * D_MODEL * (K_O / 2);
  const u8* const o_s = wo_s + l * D_MODEL * (K_O / 16);
  const u8* const gu_p = wgu_p + l * 2 * F_FF * (D_MODEL / 2);
  const u8* const gu_s = wgu_s + l * 2 * F_FF * (D_MODEL / 16);
  const u8* const d_p = wd_p + l * D_MODEL * (F_FF / 2);
  const u8* const d_s = wd_s + l * D_MODEL * (F_FF / 16);
  extern __shared__ __align__(128) u8 smem[];
  u8* ring = smem;
  u8* sx = smem + RING_BYTES;          // the phase's x as int8, up to K_MAX bytes
  u8* sxs = sx + K_MAX;                // its E4M3 block scales
  u64* bars = (u64*)(sxs + K_MAX / 16);  // full[STAGES], empty[STAGES]
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  // the CTA's work: row groups [a0, a1) of o and of down (16 rows each), gate_up units [b0, b1)
  // (16 gate rows 16u.. and the 16 up rows F + 16u..: one block of down's input)
  const int a0 = (int)((long long)blockIdx.x * (D_MODEL / 16) / GRID);
  const int a1 = (int)((long long)(blockIdx.x + 1) * (D_MODEL / 16) / GRID);
  const int b0 = (int)((long long)blockIdx.x * (F_FF / 16) / GRID);
  const int b1 = (int)((long long)(blockIdx.x + 1) * (F_FF / 16) / GRID);
  const int items_o = (a1 - a0) * CH_O, items_gu = 2 * (b1 - b0) * CH_GU;
  const int items_d = (a1 - a0) * CH_D;
  auto gu_row = [&](int q) { return (q & 1) * F_FF + (b0 + q / 2) * 16; };  // q: the group
  const u32 full0 = smem_addr(bars), empty0 = smem_addr(bars + STAGES);

  if (tid == 0) ring_init(full0, empty0, PRODUCER ? 32 : 1, WARPS);
  __syncthreads();

  if (warp == WARPS) {  // the producer: o's rows, gate_up's, down's, STAGES stages in flight
    u64 pol = 0;
#if EF
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
#endif
    int i = 0;
    auto next = [&]() {  // the ring slot of item i, free again
      const int s = i % STAGES;
      const u32 round = (u32)(i / STAGES);
      if (round > 0) mbar_wait(empty0 + 8 * s, (round - 1) & 1);
      return s;
    };
    for (int j = 0; j < items_o; ++j, ++i) {
      const int s = next();
      produce(ring + s * STAGE_BYTES, full0 + 8 * s, o_p, o_s, (a0 + j / CH_O) * 16, j % CH_O,
              K_O / 2, K_O / 16, pol, lane);
    }
    for (int j = 0; j < items_gu; ++j, ++i) {
      const int s = next();
      produce(ring + s * STAGE_BYTES, full0 + 8 * s, gu_p, gu_s, gu_row(j / CH_GU), j % CH_GU,
              D_MODEL / 2, D_MODEL / 16, pol, lane);
    }
    for (int j = 0; j < items_d; ++j, ++i) {
      const int s = next();
      produce(ring + s * STAGE_BYTES, full0 + 8 * s, d_p, d_s, (a0 + j / CH_D) * 16, j % CH_D,
              F_FF / 2, F_FF / 16, pol, lane);
    }
#if PRODUCER
    asm volatile("cp.async.wait_all;" ::: "memory");  // no thread leaves copies in flight
#endif
    return;
  }

  // consumers. The ring's items run on across the phases (i counts all of them).
  int i = 0;
  float acc = 0.f;
  // a phase's GEMV: `items` stages of `chunks` per row group; row_done(q, total) once a row
  // group q's sums are complete (every lane holds its warp's row total)
  auto gemv = [&](int items, int chunks, auto&& row_done) {
    for (int j = 0; j < items; ++j, ++i) {
      const int s = i % STAGES, c = j % chunks;
      mbar_wait(full0 + 8 * s, (u32)(i / STAGES) & 1);
      const u8* st = ring + s * STAGE_BYTES;
      const u8* codes = st + warp * KCH;
      const u8* scales = st + STAGE_CODES + warp * SCH;
      stage_row_dot(acc, codes, scales, sx, sxs, c, lane);
      __syncwarp();
      if (lane == 0) mbar_arrive(empty0 + 8 * s);
      if (c == chunks - 1) {  // the row is done: its lanes' sums, in a fixed butterfly order
#pragma unroll
        for (int b = 16; b >= 1; b >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, b);
        row_done(j / chunks, acc);
        acc = 0.f;
      }
    }
  };
  // production's output scale gw(n) * gx: one global scale a matrix, or (per_row) one a row
  auto gw = [&](const float* wg, bool per_row, int rows, int n) {
    return per_row ? wg[l * rows + n] : wg[l];
  };

  // 1. o_proj + the residual: y1 = h + y (XLA's bf16 add: both bf16, added in fp32, rounded once)
#if A_BF16
  const float* go = xgo_all + l;
  quant_in<K_O, false>(sx, sxs, a, nullptr, go, nullptr, nullptr, tid);
  const float xg_o = *go;
#else
  stage_codes<K_O, false>(sx, sxs, ap, as_, tid);
  const float xg_o = ag[0];
#endif
  asm volatile("bar.sync 1, %0;" ::"n"(CONSUMERS) : "memory");
  gemv(items_o, CH_O, [&](int q, float total) {
    if (lane == 0) {
      const int n = (a0 + q) * 16 + warp;
      const float out = (total * 0.25f) * (gw(wo_g, GW_ROWS_O, D_MODEL, n) * xg_o);
      y1[n] = f32_to_bf16(__uint_as_float((u32)h[n] << 16) + rbf16(out));
    }
  });
  grid_barrier(tid);

  // 2. gate_up on quantize(rms_norm(y1)), production's SwiGLU epilogue: down's input blocks
  const float* gu = xgu_all + l;
  const float* gd = xgd_all + l;
  quant_in<D_MODEL, true>(sx, sxs, y1, nw_all + l * D_MODEL, gu, gp, gs, tid);
  __shared__ float s_igd, hbuf[2][16];  // 1 / down's scale; a unit's h, by unit parity
  if (tid == 0) s_igd = div_rn(1.0f, *gd);
  asm volatile("bar.sync 1, %0;" ::"n"(CONSUMERS) : "memory");
  const float xg_gu = *gu;
  float gate = 0.f;
  gemv(items_gu, CH_GU, [&](int q, float total) {
    if ((q & 1) == 0) {
      gate = total;
      return;
    }
    const int unit = b0 + q / 2, n = unit * 16 + warp;  // gate row n, up row F + n
    swiglu_unit<CONSUMERS>(gate, total, gw(wgu_g, GW_ROWS_GU, 2 * F_FF, n) * xg_gu,
                           gw(wgu_g, GW_ROWS_GU, 2 * F_FF, F_FF + n) * xg_gu, unit, (q >> 1) & 1,
                           warp, lane, hbuf, gd, &s_igd, dp, ds);
  });
  grid_barrier(tid);

  // 3. down_proj on d + the residual: y2 = y1 + y
  stage_codes<F_FF, true>(sx, sxs, dp, ds, tid);
  asm volatile("bar.sync 1, %0;" ::"n"(CONSUMERS) : "memory");
  const float xg_d = *gd;
  gemv(items_d, CH_D, [&](int q, float total) {
    if (lane == 0) {
      const int n = (a0 + q) * 16 + warp;
      const float out = (total * 0.25f) * (gw(wd_g, GW_ROWS_D, D_MODEL, n) * xg_d);
      y2[n] = f32_to_bf16(__uint_as_float((u32)__ldcg(y1 + n) << 16) + rbf16(out));
    }
  });
}
#endif  // !QKV_BLOCK

#if QKV_BLOCK
// ---------------------------------------------------------------------------- pre-attention

// EXPERIMENT, the same idea before the attention (QKV_BLOCK = 1): at batch 1 the decode step
// runs qkv's input quantizer (RMSNorm prologue), the qkv GEMV and qk_norm_rope_cache
// (cuda_ops/rope_cache.cu) as three launches; here every CTA quantizes the layer's input x
// itself (the quantizer kernel's bytes, as phase 2 above) while its producer streams its rows
// of qkv, the GEMV writes qkv [N_QKV] (bf16, the TMA GEMV's arithmetic), and past one grid
// barrier one warp a head does rope_cache's work: Qwen3's q / k RMSNorm (QK_NORM), the rotation,
// q out and k, v into the stacked cache at the layer's slot, in place (the caches are operands
// aliased to results). Numerics: rope_cache.cu's, operation for operation.
// Operands: x [D] bf16, nw [L, D] (input_layernorm), xg [L] (qkv's static input scale), wp
// [L, N_QKV, D/2], ws [L, N_QKV, D/16], wg [L] (GW_ROWS_O: [L, N_QKV]), layer, q_norm [L, H],
// k_norm [L, H], positions [1], index [1], inv_freq [H/2] f32, k_cache, v_cache [L, 1, S, KV,
// H]; results: q_out [N_HEADS, H], k_cache, v_cache (aliased), qkv [N_QKV], gp [D/2], gs [D/16].
// -D: D_MODEL, N_HEADS, KV_HEADS, HEAD_DIM, S_SLOTS, QK_NORM, INDEX_ROWS (as rope_cache.cu's,
// one row), KCH, STAGES, GRID, PRODUCER, EF, GW_ROWS_O, NORM_EPS.

#ifndef QK_NORM
#define QK_NORM 1
#endif
#ifndef INDEX_ROWS
#define INDEX_ROWS 0
#endif
#define E_LANE (HEAD_DIM / 32)  // elements of a head a lane holds: [E l, E l + E)
#define HEADS_ALL (N_HEADS + 2 * KV_HEADS)

// rope_cache.cu's norm_rope: rms_norm over the head (the warp's values), then the rotation
__device__ __forceinline__ void head_norm_rope(float (&v)[E_LANE], const u16* nw,
                                               const float* inv_freq, int pos, int lane) {
  if (QK_NORM) {
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < E_LANE; ++j) s = fmaf(v[j], v[j], s);
#pragma unroll
    for (int b = 16; b >= 1; b >>= 1) s += __shfl_xor_sync(0xffffffffu, s, b);
    const float rs = rsqrtf(s / (float)HEAD_DIM + NORM_EPS);
#pragma unroll
    for (int j = 0; j < E_LANE; ++j) {
      v[j] = rbf16(__uint_as_float((u32)nw[E_LANE * lane + j] << 16) * rbf16(v[j] * rs));
    }
  }
  const bool low = lane < 16;  // rotate_half: element i < H/2 pairs with i + H/2 (lane l ^ 16)
  const float fp = (float)pos;
#pragma unroll
  for (int j = 0; j < E_LANE; ++j) {
    const float other = __shfl_xor_sync(0xffffffffu, v[j], 16);
    const float rot = low ? -other : other;
    const float ang = fp * inv_freq[(E_LANE * lane + j) % (HEAD_DIM / 2)];
    const float c = rbf16(cosf(ang)), sn = rbf16(sinf(ang));
    v[j] = rbf16(rbf16(v[j] * c) + rbf16(rot * sn));
  }
}

extern "C" __global__ void __launch_bounds__(NTHREADS, 1)
    nvfp4_qkv_tma(const u16* __restrict__ x, const u16* __restrict__ nw_all,
                  const float* __restrict__ xg_all, const u8* __restrict__ wp_all,
                  const u8* __restrict__ ws_all, const float* __restrict__ wg,
                  const int* __restrict__ layer, const u16* __restrict__ q_norm,
                  const u16* __restrict__ k_norm, const int* __restrict__ positions,
                  const int* __restrict__ index, const float* __restrict__ inv_freq,
                  const u16* k_cache_in, const u16* v_cache_in, u16* q_out, u16* k_cache,
                  u16* v_cache, u16* qkv, u8* gp, u8* gs) {
  (void)k_cache_in;  // aliased to k_cache / v_cache: written in place
  (void)v_cache_in;
  const size_t l = (size_t)*layer;
  const u8* const w_p = wp_all + l * N_QKV * (D_MODEL / 2);
  const u8* const w_s = ws_all + l * N_QKV * (D_MODEL / 16);
  extern __shared__ __align__(128) u8 smem[];
  u8* ring = smem;
  u8* sx = smem + RING_BYTES;
  u8* sxs = sx + K_MAX;
  u64* bars = (u64*)(sxs + K_MAX / 16);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int a0 = (int)((long long)blockIdx.x * (N_QKV / 16) / GRID);  // the CTA's row groups
  const int a1 = (int)((long long)(blockIdx.x + 1) * (N_QKV / 16) / GRID);
  const int items = (a1 - a0) * CH_QKV;
  const u32 full0 = smem_addr(bars), empty0 = smem_addr(bars + STAGES);

  if (tid == 0) ring_init(full0, empty0, PRODUCER ? 32 : 1, WARPS);
  __syncthreads();

  if (warp == WARPS) {  // the producer: the CTA's rows of qkv
    u64 pol = 0;
#if EF
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
#endif
    for (int i = 0; i < items; ++i) {
      const int s = i % STAGES;
      const u32 round = (u32)(i / STAGES);
      if (round > 0) mbar_wait(empty0 + 8 * s, (round - 1) & 1);
      produce(ring + s * STAGE_BYTES, full0 + 8 * s, w_p, w_s, (a0 + i / CH_QKV) * 16,
              i % CH_QKV, D_MODEL / 2, D_MODEL / 16, pol, lane);
    }
#if PRODUCER
    asm volatile("cp.async.wait_all;" ::: "memory");
#endif
    return;
  }

  // qkv's input: the quantizer kernel's RMSNorm and quantization, in every CTA
  const float* g = xg_all + l;
  quant_in<D_MODEL, true>(sx, sxs, x, nw_all + l * D_MODEL, g, gp, gs, tid);
  asm volatile("bar.sync 1, %0;" ::"n"(CONSUMERS) : "memory");
  const float xg = *g;
  float acc = 0.f;
  for (int i = 0; i < items; ++i) {
    const int s = i % STAGES, c = i % CH_QKV;
    mbar_wait(full0 + 8 * s, (u32)(i / STAGES) & 1);
    const u8* st = ring + s * STAGE_BYTES;
    stage_row_dot(acc, st + warp * KCH, st + STAGE_CODES + warp * SCH, sx, sxs, c, lane);
    __syncwarp();
    if (lane == 0) mbar_arrive(empty0 + 8 * s);
    if (c == CH_QKV - 1) {
#pragma unroll
      for (int b = 16; b >= 1; b >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, b);
      if (lane == 0) {
        const int n = (a0 + i / CH_QKV) * 16 + warp;
        const float gw = GW_ROWS_O ? wg[l * N_QKV + n] : wg[l];
        qkv[n] = f32_to_bf16((acc * 0.25f) * (gw * xg));
      }
      acc = 0.f;
    }
  }
  grid_barrier(tid);

  // rope_cache's work, one warp a head (row 0 only: batch 1)
  const int pos = positions[0];
  int slot = index[0];
  bool write_kv = true;
  if (INDEX_ROWS) {
    if (slot < 0) slot += S_SLOTS;  // jnp indexing wraps a negative index once
    write_kv = slot >= 0 && slot < S_SLOTS;  // then drops what is outside, as the scatter
  } else {
    slot = min(max(slot, 0), S_SLOTS - 1);  // dynamic_update_slice's clamp
  }
  for (int head = blockIdx.x * WARPS + warp; head < HEADS_ALL; head += GRID * WARPS) {
    float v[E_LANE];
#pragma unroll
    for (int j = 0; j < E_LANE; ++j) {
      v[j] = __uint_as_float((u32)__ldcg(qkv + head * HEAD_DIM + E_LANE * lane + j) << 16);
    }
    u16* dst;
    if (head < N_HEADS) {
      head_norm_rope(v, q_norm + l * HEAD_DIM, inv_freq, pos, lane);
      dst = q_out + (size_t)head * HEAD_DIM;
    } else {
      if (!write_kv) continue;
      const bool is_k = head < N_HEADS + KV_HEADS;
      const int kh = head - N_HEADS - (is_k ? 0 : KV_HEADS);
      if (is_k) head_norm_rope(v, k_norm + l * HEAD_DIM, inv_freq, pos, lane);
      dst = (is_k ? k_cache : v_cache) + ((l * S_SLOTS + slot) * KV_HEADS + kh) * HEAD_DIM;
    }
#pragma unroll
    for (int j = 0; j < E_LANE; ++j) dst[E_LANE * lane + j] = f32_to_bf16(v[j]);
  }
}
#endif  // QKV_BLOCK
