// Small-M NVFP4 GEMV for Hopper (sm_90; runs on sm_89+): y[M, N] = x[M, K] . W[N, K]^T, bf16 out.
//
// GEMM letters: M decode tokens (rows of x), N out features (rows of W), K in features.
// W is NVFP4 (rejax.nvfp4.Nvfp4Tensor): codes uint8 [N, K/2] (element 2j in the low nibble of
// byte j), E4M3 block scales uint8 [N, K/16], a float32 global scale. Two activation modes:
//   W4A4  (nvfp4_gemv_w4a4):  x NVFP4 too (codes [M, K/2], scales [M, K/16], global scale [M]);
//   with EPI_RES it takes a bf16 residual res [M, N] after the global scale and returns
//   res + y, the decoder's residual add (the bf16 add XLA would run after it);
//   W4A16 (nvfp4_gemv_w4a16): x bf16 [M, K];
//   W4A4 with X_BF16 (nvfp4_gemv_w4a4_bf16): x bf16, quantized to NVFP4 inside the kernel
//   (exactly rejax.nvfp4.quantize_activation), after an optional RMSNorm or SwiGLU prologue and
//   with an optional residual add (see "in-kernel x quant" below);
//   with QUANT_ONLY, that quantizer alone (nvfp4_quantize_bf16, any number of rows, each split
//   in QCHUNK-element chunks over the grid), for the plain W4A4 GEMV (codes and scales) or,
//   with XHAT_OUT, for the tensor-core GEMM (its fp16 x_hat operand); with XHAT_OUT and
//   FIN_SPLITK, that quantizer on a K-split GEMM's finish of its partials
//   (nvfp4_finish_quantize: the finish and the next linear's quantizer in one launch), or with
//   XHAT_OUT 3, FIN_SPLITK 1 and FIN_W_SHIFT 14 on the dot path's float32 sum (its bf16 values).
//
// Shape constants come in as -D at NVRTC time (cuda_ops/nvfp4_gemv.py plans them):
//   M_TOK, N_OUT, K_IN      problem size (1 <= M_TOK <= 8, K_IN % 256 == 0)
//   R_ROWS                  weight rows a warp streams together (divides N_OUT)
//   SPP                     1024-element K steps per work item (split-K inside a CTA)
//   GRID, NTHREADS          CTAs (persistent: MIN_CTAS per SM, default one) and threads per CTA
//   GEMV_STREAM             0: the persistent design below; 1: the streaming variant (M <= 4,
//                           see the end of this comment), which uses KSPLIT (warps per row
//                           group splitting K) instead of SPP and GRID
//   RING_D                  persistent: cp.async ring slots per warp (0: register prefetch)
//   SIGNED_W                W4A4 at M > 2 (default): weights decoded to signed int8
//   EPI_RES                 W4A4: add the bf16 residual operand res [M, N] in the epilogue
//   SWIGLU_OUT              W4A4 persistent: the epilogue writes down_proj's NVFP4 input
//                           (SwiGLU of the gate / up outputs, quantized) instead of y; below
//   NORM_OUT                W4A4 with EPI_RES: the last CTA to finish also writes the next
//                           linear's NVFP4 input, rms_norm(y) quantized (below)
// The host plan (nvfp4_gemv.py) picks per shape what measured faster on the H200: streaming for
// M <= 2 on layers of <= 16 MiB, else persistent; the ring at M = 8.
//
// Design (see experiments/KERNEL_NOTES.md):
// * One CTA per SM owns a contiguous range of row groups (R_ROWS rows each). Its warps take work
//   items (row group, K part) round robin; lane l of a warp reads 16 B of codes (32 elements,
//   two scale blocks) of each of the R_ROWS rows per step, so a warp reads 512 contiguous bytes
//   per row per step. Weights are read exactly once for all M tokens (the token loop is inside).
// * Weight loads are 128-bit and do not allocate in L1 (streamed once). Either the next step's
//   loads are issued into registers before the current step's math (two steps in flight per
//   warp), or (RING_D > 0) each lane copies its 16 B per row with cp.async into a per-warp ring
//   of RING_D step slots in shared memory, RING_D steps in flight. The first loads are issued
//   before x is staged.
// * W4A4: x is decoded once per CTA into shared memory as signed int8 (2 * E2M1 value), with its
//   E4M3 scales beside it. Weight codes become int8 by byte permutes (prmt table lookups, no
//   local-memory tables, no E2M1 convert: sm_90 has none): at M <= 2 a (positive, negative) pair
//   of words per 4 codes and two dp4a each, at M > 2 (SIGNED_W) one signed word per 4 codes and
//   one dp4a, more decode work but half the dp4a per token. Each 16-element block dot is an
//   exact integer (|sum| <= 2304 in 4x units). Blocks are scaled in fp32 (SFw * SFx is exact in
//   fp32) and accumulated in fp32 across blocks; the output is
//   (acc / 4) * (global_x[m] * global_w), rounded once to bf16.
// * W4A16: weight codes become fp16 with an exact bit trick (value * 2^-14), are widened to fp32
//   and multiplied with the bf16 activations (read through L1) in fp32; x 2^14 is folded into
//   the output scale.
// * Partial sums of a work item are reduced across the 32 lanes with shuffles and stored to a
//   per-(K part, row, token) slot in shared memory; the CTA adds the parts in a fixed order, so
//   results are deterministic (no atomics). No host allocation or sync: one launch, graph-safe.
//
// Streaming variant (GEMV_STREAM=1): no persistent CTAs, no x staging and no barrier before the
// math. A warp owns one row group (R_ROWS rows) and one of KSPLIT K slices; each lane issues
// every load of its share at once (CPL 16-byte chunks per row plus the matching x chunks, read
// through L1 where all warps of the SM share them), then decodes and multiplies. Many small CTAs
// fill the SMs in a few waves, so a small layer is one round of loads per warp instead of a
// pipeline that never reaches steady state. K slices of a row group are added in slice order
// through shared memory (deterministic).


typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;

// Cache hints. Weights are streamed once: non-coherent loads that do not allocate in L1. On
// sm_90 ptxas accepts the .L2::evict_first / evict_last qualifiers only on 256-bit loads
// (sm_100), so there is no L2 priority here; activations use plain non-coherent loads.
#ifndef LDW_HINT
#define LDW_HINT ".L1::no_allocate"
#endif
#ifndef LDX_HINT
#define LDX_HINT ""
#endif

#ifndef GEMV_STREAM
#define GEMV_STREAM 0
#endif
#ifndef MIN_CTAS
#define MIN_CTAS 1  // persistent: resident CTAs per SM to compile for (GRID = MIN_CTAS x #SMs)
#endif
#ifndef RING_D
#define RING_D 0
#endif
#ifndef X_BF16
#define X_BF16 0  // W4A4 entry nvfp4_gemv_w4a4_bf16: bf16 x quantized in the kernel (below)
#endif
#ifndef XG_STACK
#define XG_STACK 0  // with X_BF16: the static input scale is stacked [L], read at the layer
#endif
#ifndef QUANT_ONLY
#define QUANT_ONLY 0  // with X_BF16: only the quantizer entry nvfp4_quantize_bf16 (below)
#endif
#ifndef EPI_RES
#define EPI_RES 0  // W4A4 entries: y = res + y, a bf16 residual [M, N] added in the epilogue
#endif

#ifndef SWIGLU_OUT
#define SWIGLU_OUT 0  // plain W4A4 persistent: the SwiGLU + quantizer epilogue (see below)
#endif
#ifndef XGD_STACK
#define XGD_STACK 0  // SWIGLU_OUT: down_proj's static input scale is stacked [L]
#endif
#ifndef NORM_OUT
#define NORM_OUT 0  // plain W4A4 with EPI_RES: the next linear's NVFP4 input too (see below)
#endif
#ifndef NWN_STACK
#define NWN_STACK 0  // NORM_OUT: the norm weight is stacked [L, N]
#endif
#ifndef XGN_STACK
#define XGN_STACK 0  // NORM_OUT: the next linear's static input scale is stacked [L]
#endif
#ifndef NORM_THREADS
#define NORM_THREADS 128  // NORM_OUT: the quantizer kernel's threads (its mean-square order)
#endif

constexpr int NWARPS = NTHREADS / 32;
constexpr int NGROUPS = N_OUT / R_ROWS;
#if GEMV_STREAM
constexpr int NCH = K_IN / 32;                     // 16-byte (32-element) chunks per row
constexpr int CPS = (NCH + KSPLIT - 1) / KSPLIT;   // chunks per K slice
constexpr int CPL = (CPS + 31) / 32;               // chunks per lane
constexpr int GPB = NWARPS / KSPLIT;               // row groups per CTA
static_assert(NWARPS % KSPLIT == 0, "KSPLIT must divide the warps of a CTA");
static_assert(M_TOK <= 4, "the streaming variant handles M <= 4");
#else
constexpr int STEP = 1024;  // K elements per warp step: 32 lanes x 32 elements
constexpr int NSTEPS = (K_IN + STEP - 1) / STEP;
constexpr int KPARTS = (NSTEPS + SPP - 1) / SPP;
#if SWIGLU_OUT
// SwiGLU epilogue (gate_up_proj, y = [gate | up], N = 2F): a unit is 16 gate rows and the 16 up
// rows of the same outputs, (16u .. 16u + 15) and F + (16u .. 16u + 15), i.e. one 16-element
// NVFP4 block of down_proj's input. A CTA owns whole units; its row groups run through each
// unit's gate rows, then its up rows (group_row), so its partial sums hold both halves.
constexpr int GPU_ = 32 / R_ROWS;                  // row groups per unit
constexpr int NUNITS = N_OUT / 32;
constexpr int GPC = (NUNITS + GRID - 1) / GRID * GPU_;  // max row groups per CTA
static_assert(N_OUT % 32 == 0 && R_ROWS <= 16, "SWIGLU_OUT: N a multiple of 32, R_ROWS <= 16");
static_assert(!EPI_RES, "SWIGLU_OUT has no residual");
#else
constexpr int GPC = (NGROUPS + GRID - 1) / GRID;  // max row groups per CTA
#endif
constexpr int RPC = GPC * R_ROWS;                  // max rows per CTA

// first weight row of row group g
__device__ __forceinline__ int group_row(int g) {
#if SWIGLU_OUT
  const int unit = g / GPU_, sub = g % GPU_, half = sub / (GPU_ / 2);
  return half * (N_OUT / 2) + unit * 16 + (sub % (GPU_ / 2)) * R_ROWS;
#else
  return g * R_ROWS;
#endif
}
// cp.async ring (RING_D > 0): per warp RING_D slots of one step's tile, R_ROWS rows of
// 32 lanes x 16 B of codes, then R_ROWS x 64 B of block scales
constexpr int SLOT_CODES = R_ROWS * 32 * 16;
constexpr int SLOT_BYTES = SLOT_CODES + R_ROWS * 64;
static_assert(RING_D == 0 || RING_D >= 2, "the ring needs at least two slots");
#endif
constexpr int NV = R_ROWS * M_TOK;                 // partial sums per lane per item
constexpr int VP = NV <= 1 ? 1 : NV <= 2 ? 2 : NV <= 4 ? 4 : NV <= 8 ? 8 : NV <= 16 ? 16 : 32;
static_assert(NV <= 32, "R_ROWS * M_TOK must be <= 32");
static_assert(K_IN % 256 == 0, "K must be a multiple of 256");
static_assert(N_OUT % R_ROWS == 0, "R_ROWS must divide N");
static_assert(M_TOK >= 1 && M_TOK <= 8, "M must be 1..8");

// Stacked weights (rejax stacks every decoder layer's matrix of one kind in one buffer):
// codes [L][N][K/2], scales [L][N][K/16], global scales [L] (one per matrix) or [L][N]
// (GW_ROWS = 1: one per output row, e.g. fused q/k/v shards quantized with their own scale).
// `layer` is a device int32, so one compiled kernel serves every layer of a scanned decoder
// without copying a layer's bytes out of the stack.
#ifndef GW_ROWS
#define GW_ROWS 0
#endif
struct Layer {
  const u8* wp;
  const u8* ws;
  const float* wg;
};

__device__ __forceinline__ Layer layer_of(const u8* wp, const u8* ws, const float* wg,
                                          const int* layer) {
  const size_t l = (size_t)(unsigned)*layer;
  return {wp + l * N_OUT * (K_IN / 2), ws + l * N_OUT * (K_IN / 16),
          wg + l * (GW_ROWS ? N_OUT : 1)};
}

__device__ __forceinline__ float gw_of(const float* wg, int n) { return GW_ROWS ? wg[n] : wg[0]; }

// ---------------------------------------------------------------------------- loads

#ifndef LDW_EF
#define LDW_EF 0  // 1: weight loads carry an L2 evict_first policy (see "L2 prefetch" below)
#endif

#if LDW_EF
// An L2 cache policy that marks the lines a load brings in as first to evict. Not volatile: the
// compiler may compute it once per thread.
__device__ __forceinline__ unsigned long long evict_first_policy() {
  unsigned long long pol;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}
#endif

__device__ __forceinline__ uint4 ld_weights(const void* p) {
  uint4 v;
#if LDW_EF
  asm volatile("ld.global.nc" LDW_HINT ".L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p), "l"(evict_first_policy()));
#else
  asm volatile("ld.global.nc" LDW_HINT ".v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
#endif
  return v;
}

__device__ __forceinline__ u32 ld_scales16(const void* p) {
  u16 v;
#if LDW_EF
  asm volatile("ld.global.nc" LDW_HINT ".L2::cache_hint.u16 %0, [%1], %2;"
               : "=h"(v)
               : "l"(p), "l"(evict_first_policy()));
#else
  asm volatile("ld.global.nc" LDW_HINT ".u16 %0, [%1];" : "=h"(v) : "l"(p));
#endif
  return v;
}

// ---------------------------------------------------------------------------- L2 prefetch
//
// A decode step reads every weight once, and between two GEMVs run kernels that barely touch
// HBM (the quantizer, RoPE and the cache write, attention over a short live range) plus the
// launch gaps. With PF_TARGETS = 1 or 2 the W4A4 GEMV also prefetches into L2 the weights of
// the linears that run next (the decoder passes their stacks: qkv -> o, o -> gate_up,
// gate_up -> down, down -> the next layer's qkv), so HBM keeps streaming through those gaps and
// the next GEMV finds (part of) its bytes in L2. Prefetches are hints: they change no result.
// Per target j (compile-time): PFj_N, PFj_K (its shape), PFj_L (layers in its stack), PFj_DL
// (its layer = this GEMV's layer + PFj_DL; nothing past the stack's end), PFj_CB / PFj_SB (the
// leading bytes of each row's codes / block scales to prefetch: a fraction of K, so every CTA
// of the next GEMV, which walks K in order, finds its first steps in L2).
//   PF_AT    0: issued at the kernel's start, 1: after the CTA's main loop (fills the tail)
//   PF_MODE  0: prefetch.global.L2 per 128-byte line; 1: the same with .L2::evict_last;
//            2: cp.async.bulk.prefetch.L2 (the copy engine) per row, or 16 KiB pieces
// LDW_EF (above) makes this GEMV's own streamed lines the first to go, so its 9-57 MB pass does
// not evict what an earlier kernel prefetched.
#ifndef PF_TARGETS
#define PF_TARGETS 0
#endif
#ifndef PF_AT
#define PF_AT 1
#endif
#ifndef PF_MODE
#define PF_MODE 0
#endif

__device__ __forceinline__ void pf_line(const u8* p) {
#if PF_MODE == 1
  asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(p));
#else
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#endif
}

__device__ __forceinline__ void pf_bulk(const u8* p, u32 bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}

// The first ROWB bytes of each of ROWS rows of STRIDE bytes at `base`, spread over the
// nt threads of the grid (this one is t).
template <int ROWS, int STRIDE, int ROWB>
__device__ __forceinline__ void pf_rows(const u8* base, int t, int nt) {
  if constexpr (ROWB > 0) {
    constexpr size_t TOTAL = (size_t)ROWS * STRIDE;
    if constexpr (PF_MODE == 2) {
      if constexpr (ROWB >= STRIDE) {
        constexpr size_t PIECE = 16384;
        for (size_t c = t; c * PIECE < TOTAL; c += nt) {
          const size_t left = TOTAL - c * PIECE;
          pf_bulk(base + c * PIECE, (u32)(left < PIECE ? left : PIECE));
        }
      } else {
        for (int r = t; r < ROWS; r += nt) pf_bulk(base + (size_t)r * STRIDE, ROWB);
      }
    } else if constexpr (ROWB >= STRIDE) {
      for (size_t i = t; i * 128 < TOTAL; i += nt) pf_line(base + i * 128);
    } else {
      constexpr int LPR = (ROWB + 127) / 128;  // lines per row
      for (int i = t; i < ROWS * LPR; i += nt) {
        pf_line(base + (size_t)(i / LPR) * STRIDE + (size_t)(i % LPR) * 128);
      }
    }
  }
}

// One target's codes and scales at layer `l` (skipped past the end of its stack).
template <int N, int K, int L, int CB, int SB>
__device__ __forceinline__ void pf_target(const u8* wp_all, const u8* ws_all, int l) {
  if (l >= L) return;
  const int t = blockIdx.x * NTHREADS + threadIdx.x, nt = gridDim.x * NTHREADS;
  pf_rows<N, K / 2, CB>(wp_all + (size_t)l * N * (K / 2), t, nt);
  pf_rows<N, K / 16, SB>(ws_all + (size_t)l * N * (K / 16), t, nt);
}

// The prefetch operands of the W4A4 GEMV entries, after `layer`.
#if PF_TARGETS >= 1
#define PF_OPS0 , const u8* __restrict__ pf0_wp, const u8* __restrict__ pf0_ws
#else
#define PF_OPS0
#endif
#if PF_TARGETS >= 2
#define PF_OPS1 , const u8* __restrict__ pf1_wp, const u8* __restrict__ pf1_ws
#else
#define PF_OPS1
#endif
#define PF_OPERANDS PF_OPS0 PF_OPS1
#if PF_TARGETS >= 1
#define PF_ISSUE0(li) pf_target<PF0_N, PF0_K, PF0_L, PF0_CB, PF0_SB>(pf0_wp, pf0_ws, (li) + PF0_DL)
#else
#define PF_ISSUE0(li)
#endif
#if PF_TARGETS >= 2
#define PF_ISSUE1(li) pf_target<PF1_N, PF1_K, PF1_L, PF1_CB, PF1_SB>(pf1_wp, pf1_ws, (li) + PF1_DL)
#else
#define PF_ISSUE1(li)
#endif
// issue every target's prefetches for this GEMV at layer li
#define PF_ISSUE(li) \
  do {               \
    PF_ISSUE0(li);   \
    PF_ISSUE1(li);   \
  } while (0)

__device__ __forceinline__ uint4 ld_act(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc" LDX_HINT ".v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// ---------------------------------------------------------------------------- decode

// prmt, the E2M1 -> int8 tables, act_to_s8, decode_row and row_dot (the exact block dots),
// e4m3x2_to_float2, div_rn, e2m1_mag, block_codes (the quantizer's block operations)
#include "common.cuh"

__device__ __forceinline__ u16 f32_to_bf16(float f) {
  u16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return r;
}

__device__ __forceinline__ float bf16f(u16 h) { return __uint_as_float((u32)h << 16); }
__device__ __forceinline__ float rbf16(float f) { return bf16f(f32_to_bf16(f)); }

// ---------------------------------------------------------------------------- reduction

// c ? a : b on values (inline asm, so the compiler cannot turn it into a select of addresses,
// which would move the array to local memory)
__device__ __forceinline__ float selp(float a, float b, bool c) {
  float d;
  asm("{ .reg .pred p; setp.ne.b32 p, %3, 0; selp.f32 %0, %1, %2, p; }"
      : "=f"(d)
      : "f"(a), "f"(b), "r"((int)c));
  return d;
}

// One transpose-reduce step: lanes with `bit` set keep the upper S values, the others the lower
// S, each adding its partner's copy; v[0..S) then holds the kept half.
template <int S, int BIT>
__device__ __forceinline__ void reduce_step(float (&v)[VP], bool upper) {
#pragma unroll
  for (int j = 0; j < S; ++j) {
    const float send = selp(v[j], v[j + S], upper);
    const float keep = selp(v[j + S], v[j], upper);
    v[j] = keep + __shfl_xor_sync(0xffffffffu, send, BIT);
  }
}

// Sums v[0..VP) over the 32 lanes. Afterwards lane l holds the total of value l / (32 / VP)
// when l % (32 / VP) == 0 (transpose-reduce: each step halves the values a lane carries).
__device__ __forceinline__ float warp_reduce(float (&v)[VP], int lane) {
  if constexpr (VP >= 32) reduce_step<16, 16>(v, lane & 16);
  if constexpr (VP >= 16) reduce_step<8, 32 / VP * 8>(v, lane & (32 / VP * 8));
  if constexpr (VP >= 8) reduce_step<4, 32 / VP * 4>(v, lane & (32 / VP * 4));
  if constexpr (VP >= 4) reduce_step<2, 32 / VP * 2>(v, lane & (32 / VP * 2));
  if constexpr (VP >= 2) reduce_step<1, 32 / VP>(v, lane & (32 / VP));
#pragma unroll
  for (int b = 16 / VP; b >= 1; b >>= 1) v[0] += __shfl_xor_sync(0xffffffffu, v[0], b);
  return v[0];
}

#if GEMV_STREAM
// Streaming variant: reduces a warp's sums over its lanes and writes y[m, n] = out(m, n, total),
// directly when K is not split, else through `red` ([group][slice][row][token]), adding the
// slices of a row group in slice order.
template <typename OutScale>
__device__ __forceinline__ void stream_epilogue(float (&acc)[VP], float* red, int lane, int tid,
                                                int lg, int slice, int g, u16* y, OutScale out) {
  const float total = warp_reduce(acc, lane);
  const int idx = lane / (32 / VP);
  const bool holder = lane % (32 / VP) == 0 && idx < NV;
  const int r = idx / M_TOK, m = idx % M_TOK;
  if constexpr (KSPLIT == 1) {
    if (holder && g < NGROUPS) y[(size_t)m * N_OUT + g * R_ROWS + r] = f32_to_bf16(out(m, g * R_ROWS + r, total));
  } else {
    if (holder) red[((lg * KSPLIT + slice) * R_ROWS + r) * M_TOK + m] = total;
    __syncthreads();
    for (int i = tid; i < GPB * NV; i += NTHREADS) {
      const int gl = i / NV, v = i % NV, rr = v / M_TOK, mm = v % M_TOK;
      const int gg = blockIdx.x * GPB + gl;
      if (gg >= NGROUPS) continue;
      float t = 0.f;
#pragma unroll
      for (int sl = 0; sl < KSPLIT; ++sl) t += red[((gl * KSPLIT + sl) * R_ROWS + rr) * M_TOK + mm];
      y[(size_t)mm * N_OUT + gg * R_ROWS + rr] = f32_to_bf16(out(mm, gg * R_ROWS + rr, t));
    }
  }
}

// Row group, K slice and chunk range of this warp.
struct Share {
  int lg, slice, g, c0, c1;
  bool valid;
};

__device__ __forceinline__ Share my_share(int warp) {
  Share s;
  s.lg = warp / KSPLIT;
  s.slice = warp % KSPLIT;
  s.g = blockIdx.x * GPB + s.lg;
  s.valid = s.g < NGROUPS;
  s.c0 = s.slice * CPS;
  s.c1 = s.c0 + CPS < NCH ? s.c0 + CPS : NCH;
  return s;
}

// Issues this lane's weight loads (codes and scales of R_ROWS rows, CPL chunks) at once.
__device__ __forceinline__ void load_share(uint4 (&q)[CPL][R_ROWS], u32 (&sw)[CPL][R_ROWS],
                                           const u8* wp, const u8* ws, const Share& sh,
                                           int lane) {
#pragma unroll
  for (int i = 0; i < CPL; ++i) {
    const int c = sh.c0 + lane + 32 * i;
    const bool ok = sh.valid && c < sh.c1;
#pragma unroll
    for (int r = 0; r < R_ROWS; ++r) {
      const size_t n = (size_t)sh.g * R_ROWS + r;
      q[i][r] = ok ? ld_weights(wp + n * (K_IN / 2) + c * 16) : make_uint4(0, 0, 0, 0);
      sw[i][r] = ok ? ld_scales16(ws + n * (K_IN / 16) + c * 2) : 0u;
    }
  }
}
#endif  // GEMV_STREAM

// ---------------------------------------------------------------------------- work items

#if !GEMV_STREAM

struct Unit {
  int item, step;  // item = local group * KPARTS + part; step = absolute 1024-element step
};

__device__ __forceinline__ int part_end(int part) {
  return (part + 1) * SPP < NSTEPS ? (part + 1) * SPP : NSTEPS;
}

// next unit of this warp after u (item stride NWARPS), or item == -1
__device__ __forceinline__ Unit next_unit(Unit u, int items) {
  if (u.step + 1 < part_end(u.item % KPARTS)) return {u.item, u.step + 1};
  const int it = u.item + NWARPS;
  if (it >= items) return {-1, 0};
  return {it, (it % KPARTS) * SPP};
}

struct WTile {
  uint4 q[R_ROWS];  // 32 codes of each row
  u32 s[R_ROWS];    // their two E4M3 block scales
};

__device__ __forceinline__ void load_tile(WTile& t, const u8* wp, const u8* ws, int row0,
                                          int elem, bool valid) {
#pragma unroll
  for (int r = 0; r < R_ROWS; ++r) {
    if (valid) {
      const size_t n = (size_t)(row0 + r);
      t.q[r] = ld_weights(wp + n * (K_IN / 2) + elem / 2);
      t.s[r] = ld_scales16(ws + n * (K_IN / 16) + elem / 16);
    } else {
      t.q[r] = make_uint4(0, 0, 0, 0);
      t.s[r] = 0;
    }
  }
}

#if RING_D
__device__ __forceinline__ void cp_async16(void* smem_dst, const void* src) {
  const u32 d = (u32)__cvta_generic_to_shared(smem_dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
__device__ __forceinline__ void cp_async_wait_oldest() {  // all but the newest RING_D - 1 groups
  asm volatile("cp.async.wait_group %0;" ::"n"(RING_D - 1) : "memory");
}

// Issues the copies of unit v's tile into `slot` (nothing for v.item < 0) and commits a group
// (always, so every lane has exactly one group per slot). Codes: lane l copies its own 16 B of
// each row; scales: lanes 0..3 copy 16 B (256 elements' worth) each of each row.
__device__ __forceinline__ void ring_issue(u8* slot, const u8* wp, const u8* ws, int row0,
                                           int step, bool valid, int lane) {
  if (valid) {
    const int elem = step * STEP + lane * 32;
    const int selem = step * STEP + lane * 256;
#pragma unroll
    for (int r = 0; r < R_ROWS; ++r) {
      const size_t n = (size_t)(row0 + r);
      if (elem < K_IN) cp_async16(slot + (r * 32 + lane) * 16, wp + n * (K_IN / 2) + elem / 2);
      if (lane < 4 && selem < K_IN) {
        cp_async16(slot + SLOT_CODES + r * 64 + lane * 16, ws + n * (K_IN / 16) + selem / 16);
      }
    }
  }
  cp_async_commit();
}

__device__ __forceinline__ void ring_read(WTile& t, const u8* slot, int lane) {
#pragma unroll
  for (int r = 0; r < R_ROWS; ++r) {
    t.q[r] = *(const uint4*)(slot + (r * 32 + lane) * 16);
    t.s[r] = *(const u16*)(slot + SLOT_CODES + r * 64 + lane * 2);
  }
}
#endif  // RING_D

// A work item is done: reduce its sums over the lanes, store them in the item's (K part, row,
// token) slots, and clear the accumulators.
__device__ __forceinline__ void item_done(float (&acc)[VP], float* ybuf, int item, int lane) {
  const int part = item % KPARTS, lrow = (item / KPARTS) * R_ROWS;
  const float total = warp_reduce(acc, lane);
  const int idx = lane / (32 / VP);
  if (lane % (32 / VP) == 0 && idx < NV) {
    ybuf[(part * RPC + lrow + idx / M_TOK) * M_TOK + idx % M_TOK] = total;
  }
#pragma unroll
  for (int v = 0; v < VP; ++v) acc[v] = 0.f;
}

// Runs this warp's units (item, step) in order: `math(acc, tile, elem)` per step, item_done at
// the end of each item. The first loads are issued before `stage()` (the CTA's x staging and
// barrier), so HBM latency overlaps it. RING_D > 0: a cp.async ring of RING_D slots per warp
// keeps RING_D steps in flight; else registers hold one step ahead.
template <typename Stage, typename Math>
__device__ __forceinline__ void run_units(float* ybuf, u8* ring, const u8* wp, const u8* ws,
                                          int g0, int items, int warp, int lane, Stage stage,
                                          Math math) {
  float acc[VP];
#pragma unroll
  for (int v = 0; v < VP; ++v) acc[v] = 0.f;
  Unit u = {warp < items ? warp : -1, warp < items ? (warp % KPARTS) * SPP : 0};
#if RING_D
  u8* my = ring + (size_t)warp * RING_D * SLOT_BYTES;
  Unit iu = u;  // next unit to issue
#pragma unroll
  for (int sl = 0; sl < RING_D; ++sl) {
    ring_issue(my + sl * SLOT_BYTES, wp, ws, group_row(g0 + iu.item / KPARTS), iu.step,
               iu.item >= 0, lane);
    if (iu.item >= 0) iu = next_unit(iu, items);
  }
  stage();
  int slot = 0;
  while (u.item >= 0) {
    cp_async_wait_oldest();
    __syncwarp();
    WTile cur;
    ring_read(cur, my + slot * SLOT_BYTES, lane);
    __syncwarp();  // every lane has read the slot (scales are shared) before it is refilled
    ring_issue(my + slot * SLOT_BYTES, wp, ws, group_row(g0 + iu.item / KPARTS), iu.step,
               iu.item >= 0, lane);
    if (iu.item >= 0) iu = next_unit(iu, items);
    const int elem = u.step * STEP + lane * 32;
    if (elem < K_IN) math(acc, cur, elem);
    const Unit nu = next_unit(u, items);
    if (nu.item != u.item) item_done(acc, ybuf, u.item, lane);  // reduce, store its slot
    u = nu;
    slot = slot + 1 == RING_D ? 0 : slot + 1;
  }
  asm volatile("cp.async.wait_all;" ::: "memory");
#else
  WTile cur;
  {
    const int elem = u.step * STEP + lane * 32;
    load_tile(cur, wp, ws, group_row(g0 + u.item / KPARTS), elem, u.item >= 0 && elem < K_IN);
  }
  stage();
  while (u.item >= 0) {
    const Unit nu = next_unit(u, items);
    WTile nxt;
    {
      const int elem = nu.step * STEP + lane * 32;
      load_tile(nxt, wp, ws, group_row(g0 + nu.item / KPARTS), elem, nu.item >= 0 && elem < K_IN);
    }
    const int elem = u.step * STEP + lane * 32;
    if (elem < K_IN) math(acc, cur, elem);
    if (nu.item != u.item) item_done(acc, ybuf, u.item, lane);  // reduce, store its slot
    u = nu;
    cur = nxt;
  }
#endif
}

// y[m, n] = out(m, n, sum of the K parts of row n in part order), for the CTA's rows.
template <typename OutScale>
__device__ __forceinline__ void persistent_epilogue(const float* ybuf, u16* y, int g0, int g1,
                                                    int tid, OutScale out) {
  const int rows = (g1 - g0) * R_ROWS;
  for (int i = tid; i < rows * M_TOK; i += NTHREADS) {
    const int m = i / rows, lr = i % rows;
    float s = 0.f;
#pragma unroll 1
    for (int p = 0; p < KPARTS; ++p) s += ybuf[(p * RPC + lr) * M_TOK + m];
    y[(size_t)m * N_OUT + g0 * R_ROWS + lr] = f32_to_bf16(out(m, g0 * R_ROWS + lr, s));
  }
}

#if SWIGLU_OUT
// SwiGLU epilogue: instead of y = [gate | up] (bf16 [M, N]), down_proj's W4A4 input: codes dp
// [M, F/2], E4M3 block scales ds [M, F/16] and the static global scale dg [M] (*gd), F = N / 2:
// the bytes the quantizer kernel with prologue "swiglu" (nvfp4_quant.py) writes from that y.
// Each unit's gate and up values are the bf16 values persistent_epilogue would store, then
// quant4's SwiGLU (its expf and bf16 roundings) and the block quantization (common.cuh). The
// 4 lanes of a unit's block (4 elements each) find its amax with two shuffles in their group.
template <typename OutScale>
__device__ __forceinline__ void swiglu_epilogue(const float* ybuf, int u0, int u1, int tid,
                                                OutScale out, const float* gd, u8* dp, u8* ds,
                                                float* dg) {
  __shared__ float s_igd;
  if (tid == 0) s_igd = div_rn(1.0f, *gd);
  __syncthreads();
  const int units = u1 - u0;
  // 4 consecutive i are one block (NTHREADS % 4 == 0): its lanes run the loop together
  for (int i = tid; i < M_TOK * units * 4; i += NTHREADS) {
    const int m = i / (units * 4), lu = (i / 4) % units, q = i % 4;
    float v[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int li = 4 * q + e, lr = lu * 32 + li;  // local rows: gate lr, up lr + 16
      float tg = 0.f, tu = 0.f;
#pragma unroll 1
      for (int p = 0; p < KPARTS; ++p) {
        tg += ybuf[(p * RPC + lr) * M_TOK + m];
        tu += ybuf[(p * RPC + lr + 16) * M_TOK + m];
      }
      const int n = (u0 + lu) * 16 + li;
      const float g = rbf16(out(m, n, tg)), u = rbf16(out(m, N_OUT / 2 + n, tu));
      const float sig = rbf16(1.0f / (1.0f + expf(-g)));  // quant4's PRO = 2: jax.nn.sigmoid
      v[e] = rbf16(rbf16(g * sig) * u);                   // silu(g) = g * sigmoid(g); * up
    }
    const unsigned group = 0xFu << (threadIdx.x & 28);
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
    amax = fmaxf(amax, __shfl_xor_sync(group, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(group, amax, 2));
    u32 scale;
    const u32 c = block_codes(v, amax, gd, &s_igd, scale);
    const size_t j0 = (size_t)m * (N_OUT / 2) + (u0 + lu) * 16 + 4 * q;  // element of dp's row
    *reinterpret_cast<u16*>(dp + j0 / 2) = (u16)c;
    if (q == 0) ds[j0 / 16] = (u8)scale;
  }
  if (blockIdx.x == 0 && tid < M_TOK) dg[tid] = *gd;
}
#endif  // SWIGLU_OUT

#endif  // !GEMV_STREAM

// ---------------------------------------------------------------------------- W4A4

#if ACT_W4A4

// 32 codes (two blocks) -> 8 signed int8 words (2 * E2M1 value) in element order. Used for x in
// the streaming variant and for weights at M > 2 (SIGNED_W): ~1.6x the integer ops of
// decode_row, but one dp4a per 4 weights and token instead of two.
__device__ __forceinline__ void decode_s8(u32 (&w)[8], uint4 q) {
  const u32 words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    w[2 * i] = act_to_s8(words[i]);
    w[2 * i + 1] = act_to_s8(words[i] >> 16);
  }
}

// 32 int8 activations of token m at `elem` and their two block scales, from shared memory
__device__ __forceinline__ void load_x(u32 (&xw)[8], float2& sxf, const u8* sx, const u8* ssf,
                                       int m, int elem) {
  const uint4 xa = *(const uint4*)(sx + m * K_IN + elem);
  const uint4 xb = *(const uint4*)(sx + m * K_IN + elem + 16);
  xw[0] = xa.x, xw[1] = xa.y, xw[2] = xa.z, xw[3] = xa.w;
  xw[4] = xb.x, xw[5] = xb.y, xw[6] = xb.z, xw[7] = xb.w;
  sxf = e4m3x2_to_float2(*(const u16*)(ssf + m * (K_IN / 16) + elem / 16));
}

// acc[r * M + m] += the 32-element dot of row r's chunk with token m's chunk (x in registers)
__device__ __forceinline__ void chunk_dot(float (&acc)[VP], const uint4 (&q)[R_ROWS],
                                          const u32 (&s)[R_ROWS], const u32 (&xw)[M_TOK][8],
                                          const float2 (&sxf)[M_TOK]) {
#pragma unroll
  for (int r = 0; r < R_ROWS; ++r) {
    u32 wpos[8], wneg[8];
    decode_row(wpos, wneg, q[r]);
    const float2 sw = e4m3x2_to_float2(s[r]);
#pragma unroll
    for (int m = 0; m < M_TOK; ++m) row_dot(acc[r * M_TOK + m], wpos, wneg, xw[m], sw, sxf[m]);
  }
}

// y epilogue value: the GEMV's output, plus the residual with EPI_RES (res [M, N] bf16). XLA's
// bf16 add of res and the bf16 output: the two bf16 values added in fp32, the sum rounded once
// to bf16 by the caller's store.
__device__ __forceinline__ float epi(const u16* res, int m, int n, float out) {
  if constexpr (EPI_RES) return bf16f(res[(size_t)m * N_OUT + n]) + rbf16(out);
  return out;
}

#if NORM_OUT
// NORM_OUT: after o_proj's residual epilogue the next linear (gate_up) reads
// quantize_activation(rms_norm(y, nw)) with its static input scale, which the "split" path
// computes in a quantizer launch of its own (nvfp4_quantize_bf16 with PRO = 1). Here the last
// CTA to store its part of y (an atomicInc ticket in a module-global counter, after a
// __threadfence; the counter wraps back to 0 on that CTA) reads the whole of y back from L2 and
// writes those bytes itself: codes np [M, N/2], E4M3 block scales ns [M, N/16], the global
// scale ng [M]. The row's mean square is summed in the quantizer kernel's order (NORM_THREADS
// threads, each its elements 8t + 8 NORM_THREADS i .. + 7 with fma; a butterfly in each warp;
// the warps in order), and each element goes through quant4's PRO = 1 arithmetic, so the bytes
// are the quantizer kernel's.
static_assert(EPI_RES, "NORM_OUT follows the residual epilogue (EPI_RES)");
static_assert(!SWIGLU_OUT, "NORM_OUT and SWIGLU_OUT are different epilogues");
static_assert(NORM_THREADS % 32 == 0 && NORM_THREADS <= NTHREADS && NTHREADS % 4 == 0,
              "NORM_OUT: NORM_THREADS full warps of the CTA");
static_assert(N_OUT % 256 == 0, "NORM_OUT: N a multiple of 256 (the quantizer kernel's K)");
#ifndef NORM_EPS
#define NORM_EPS 1e-6f
#endif
__device__ u32 g_norm_arrivals;  // CTAs of the current launch that have stored their y

__device__ __forceinline__ void norm_out_tail(const u16* y, const u16* nw, const float* gn,
                                              u8* np, u8* ns, float* ng, int tid) {
  __shared__ u32 s_last;
  __shared__ float s_red[M_TOK * (NORM_THREADS / 32)], s_rs[M_TOK], s_ig;
  __threadfence();  // this CTA's y stores are visible device-wide before its ticket
  __syncthreads();
  if (tid == 0) s_last = atomicInc(&g_norm_arrivals, gridDim.x - 1) == gridDim.x - 1;
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  const int lane = tid & 31, warp = tid >> 5;
  if (tid < NORM_THREADS) {
#pragma unroll
    for (int m = 0; m < M_TOK; ++m) {
      float s = 0.f;
      for (int e = 8 * tid; e < N_OUT; e += 8 * NORM_THREADS) {
        const uint4 q = __ldcg(reinterpret_cast<const uint4*>(y + (size_t)m * N_OUT + e));
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
      if (lane == 0) s_red[m * (NORM_THREADS / 32) + warp] = s;
    }
  }
  __syncthreads();
  if (tid < M_TOK) {
    float t = 0.f;
    for (int w = 0; w < NORM_THREADS / 32; ++w) t = t + s_red[tid * (NORM_THREADS / 32) + w];
    s_rs[tid] = rsqrtf(t / (float)N_OUT + NORM_EPS);
  }
  if (tid == 0) s_ig = div_rn(1.0f, *gn);
  __syncthreads();
  // 4 elements per thread per round; the 4 consecutive threads of a block run the loop
  // together (N % 16 == 0) and find its amax with two shuffles in their group
  for (int i = tid; i < M_TOK * N_OUT / 4; i += NTHREADS) {
    const int m = i / (N_OUT / 4), e0 = (i % (N_OUT / 4)) * 4;
    const uint2 q = __ldcg(reinterpret_cast<const uint2*>(y + (size_t)m * N_OUT + e0));
    const uint2 u = *reinterpret_cast<const uint2*>(nw + e0);
    float v[4] = {__uint_as_float(q.x << 16), __uint_as_float(q.x & 0xFFFF0000u),
                  __uint_as_float(q.y << 16), __uint_as_float(q.y & 0xFFFF0000u)};
    const float wf[4] = {__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xFFFF0000u),
                         __uint_as_float(u.y << 16), __uint_as_float(u.y & 0xFFFF0000u)};
    const float rs = s_rs[m];
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = rbf16(wf[j] * rbf16(v[j] * rs));  // quant4's PRO = 1
    const unsigned group = 0xFu << (threadIdx.x & 28);
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
    amax = fmaxf(amax, __shfl_xor_sync(group, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(group, amax, 2));
    u32 scale;
    const u32 c = block_codes(v, amax, gn, &s_ig, scale);
    *reinterpret_cast<u16*>(np + (size_t)m * (N_OUT / 2) + e0 / 2) = (u16)c;
    if ((i & 3) == 0) ns[(size_t)m * (N_OUT / 16) + e0 / 16] = (u8)scale;
  }
  if (tid < M_TOK) ng[tid] = *gn;
}
#define NORM_OUT_OPERANDS , const u16 *__restrict__ nw_all, const float *__restrict__ xgn
#define NORM_OUT_RESULTS , u8 *__restrict__ np, u8 *__restrict__ ns, float *__restrict__ ng
// the norm weight ([N], or [L, N] read at the layer) and the next linear's static scale ([1] or
// [L])
#define NORM_OUT_TAIL(layer)                                                                \
  norm_out_tail(y, nw_all + (NWN_STACK ? (size_t)(unsigned)(layer) * N_OUT : 0),            \
                xgn + (XGN_STACK ? (size_t)(unsigned)(layer) : 0), np, ns, ng, tid)
#else
#define NORM_OUT_OPERANDS
#define NORM_OUT_RESULTS
#define NORM_OUT_TAIL(layer)
#endif  // NORM_OUT

#if X_BF16
// ---------------------------------------------------------------------------- in-kernel x quant
//
// nvfp4_gemv_w4a4_bf16 reads bf16 activations and quantizes them itself, giving the codes and
// block scales of rejax.nvfp4.quantize_activation (same operations in the same order; CUDA's
// __fdiv_rn is the correctly rounded division the reference emulates, with its flush of
// results and operands below 2^-126 to 0). Before the quantizer an optional prologue builds the
// linear's input from what the decoder holds (each a composition of rejax.layers functions,
// with bf16 roundings where they have them):
//   PRO = 0: x itself, [M, K];
//   PRO = 1: rms_norm(x, nw, NORM_EPS), x [M, K], nw the layer's bf16 norm weight [(L,) K];
//   PRO = 2: swiglu(x[:, :K], x[:, K:]), x the [M, 2K] gate_up output.
// DYN_XG = 0: static global scale xg[0]; 1: per row amax / (6 * 448) (1 for a zero row).
// EPI_RES = 1: y = res + y (bf16 add, res [M, N]), the decoder's residual.
// Row statistics (the norm's mean square, the dynamic scale's amax) are CTA-wide reductions,
// recomputed by every CTA from the small activations; the summation order of the mean square
// is not XLA's, so PRO = 1 is equal to the composition up to the rounding of that sum.

#ifndef PRO
#define PRO 0
#endif
#ifndef DYN_XG
#define DYN_XG 0
#endif
#ifndef NW_STACK
#define NW_STACK 0
#endif
#ifndef NORM_EPS
#define NORM_EPS 1e-6f
#endif
constexpr int X_COLS = PRO == 2 ? 2 * K_IN : K_IN;  // elements per row of x
constexpr int RED_SLOTS = M_TOK * (NTHREADS / 32);  // cta_reduce scratch floats

#ifndef FIN_SPLITK
#define FIN_SPLITK 0  // QUANT_ONLY with XHAT_OUT: > 0, x is a GEMM's split-K finish (below)
#endif
#ifndef FIN_RES
#define FIN_RES 0
#endif
#ifndef FIN_GW_ROWS
#define FIN_GW_ROWS 0
#endif
#ifndef FIN_W_SHIFT
#define FIN_W_SHIFT 7
#endif
#ifndef FIN_STORE_Y
#define FIN_STORE_Y 0
#endif
#ifndef FIN_CACHE
#define FIN_CACHE 0  // FIN_SPLITK, one CTA per row: the row's x formed once, kept in shared memory
#endif
#ifndef FIN_NEXT_LAYERS
#define FIN_NEXT_LAYERS 0  // > 0: the norm weight and input scale are read at layer + 1 (below)
#endif
#ifndef FIN_CLUSTER
#define FIN_CLUSTER 0  // FIN_SPLITK: C = K_IN / QCHUNK CTAs a row as one cluster (below)
#endif

// The activations and their per-row statistics (in shared memory, [M_TOK] each).
struct XRows {
  const u16* x;
  const u16* nw;  // the layer's norm weight (PRO = 1)
  float* rs;      // PRO = 1: rsqrt(mean(x^2) + eps) per row
  float* g;       // global scale per row
  float* ig;      // 1 / g per row
#if FIN_SPLITK
  const float* part;  // this row's float32 partials of split 0 (split s: + s * split)
  size_t split;       // floats from one split's partials to the next: M * X_COLS
  const u16* res;     // FIN_RES: this row's bf16 residual [X_COLS]
  const float* wg;    // the producer GEMM's weight global scale(s) at its layer
  float xgp;          // the producer GEMM's activation global scale of this row
  const u16* hs;      // FIN_CACHE: the row's x as bf16, in shared memory [X_COLS]
#if FIN_CLUSTER
  unsigned hs_addr;  // shared address of each CTA's chunk of x, bf16 [QCHUNK]
#endif
#endif
};

#if FIN_CLUSTER
// A thread-block cluster's barrier (every thread of every CTA; orders shared-memory writes
// before it against distributed shared-memory reads after it)
__device__ __forceinline__ void fin_cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;"
               ::: "memory");
}
// 16 bytes at shared address `addr` of the cluster's CTA of rank `rank`
__device__ __forceinline__ uint4 ld_cluster16(unsigned addr, unsigned rank) {
  unsigned a;
  asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"(addr), "r"(rank));
  uint4 q;  // written before the last cluster barrier (its "memory" clobber orders this read)
  asm volatile("ld.shared::cluster.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(q.x), "=r"(q.y), "=r"(q.z), "=r"(q.w) : "r"(a));
  return q;
}
#endif

// 8 bf16 at p (16-byte aligned) as floats
__device__ __forceinline__ void ld8(float (&v)[8], const u16* p) {
  const uint4 q = ld_act(p);
  const u32 w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = __uint_as_float(w[i] << 16);
    v[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
  }
}

#if FIN_SPLITK
// FIN_W_SHIFT 14: the producer is the dot path's float32 sum (rejax.nvfp4.matmul_x_values, no
// fp16 weight offset): a factor 1, so y = acc * (global_w * global_x) as that function forms it
static_assert((FIN_W_SHIFT >= 0 && FIN_W_SHIFT <= 7) || (FIN_W_SHIFT == 14 && FIN_SPLITK == 1),
              "FIN_W_SHIFT: a GEMM's 0..7, or 14 (the dot path's one float32 sum)");
constexpr float FIN_UNSCALE = (float)(1 << (14 - FIN_W_SHIFT));

// Columns c .. c + 7 of this row of x as the producer GEMM's split-K finish (nvfp4_gemm_finish,
// cuda_ops/nvfp4_gemm.cu) stores them, bf16 values held in floats: the FIN_SPLITK partials
// added in split order, times 2^(14 - W_SHIFT), times global_w * global_x, rounded to bf16;
// with FIN_RES the residual added to that bf16 value in fp32 and the sum rounded once.
__device__ __forceinline__ void fin8(float (&v)[8], const XRows& xr, int c) {
  float acc[8];
  {
    const float* p = xr.part + c;
    const float4 a = __ldg((const float4*)p), b = __ldg((const float4*)(p + 4));
    acc[0] = a.x, acc[1] = a.y, acc[2] = a.z, acc[3] = a.w;
    acc[4] = b.x, acc[5] = b.y, acc[6] = b.z, acc[7] = b.w;
  }
#pragma unroll
  for (int s = 1; s < FIN_SPLITK; ++s) {
    const float* p = xr.part + s * xr.split + c;
    const float4 a = __ldg((const float4*)p), b = __ldg((const float4*)(p + 4));
    acc[0] += a.x, acc[1] += a.y, acc[2] += a.z, acc[3] += a.w;
    acc[4] += b.x, acc[5] += b.y, acc[6] += b.z, acc[7] += b.w;
  }
  float r[8];
  if constexpr (FIN_RES) ld8(r, xr.res + c);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float alpha = xr.wg[FIN_GW_ROWS ? c + j : 0] * xr.xgp;
    const float y = acc[j] * FIN_UNSCALE * alpha;
    v[j] = FIN_RES ? rbf16(r[j] + rbf16(y)) : rbf16(y);
  }
}
#endif

// x[m, c .. c + 7] (bf16 values held in floats), c % 8 == 0: read, or with FIN_SPLITK formed
// from the producer GEMM's partials (m = 0: one row per CTA)
__device__ __forceinline__ void src8(float (&v)[8], const XRows& xr, int m, int c) {
#if FIN_SPLITK
  if constexpr (FIN_CLUSTER || FIN_CACHE) {
    // FIN_CLUSTER: column c is in the chunk of the cluster's CTA of rank c / QCHUNK (the CTA
    // at blockIdx.y = rank: cluster dims (1, C, 1)); FIN_CACHE: this CTA's shared memory
#if FIN_CLUSTER
    const uint4 q = ld_cluster16(xr.hs_addr + 2u * (unsigned)(c % QCHUNK), (unsigned)(c / QCHUNK));
#else
    const uint4 q = *(const uint4*)(xr.hs + c);
#endif
    const u32 w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[2 * i] = __uint_as_float(w[i] << 16);
      v[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
    }
  } else {
    fin8(v, xr, c);
  }
#else
  ld8(v, xr.x + (size_t)m * X_COLS + c);
#endif
}

// the linear's inputs e0 .. e0 + 7 of row m (bf16 values held in floats), e0 % 8 == 0
__device__ __forceinline__ void pro_values8(float (&v)[8], const XRows& xr, int m, int e0) {
  src8(v, xr, m, e0);
  if constexpr (PRO == 1) {
    float w[8];
    ld8(w, xr.nw + e0);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = rbf16(w[j] * rbf16(v[j] * xr.rs[m]));
  } else if constexpr (PRO == 2) {
    float u[8];
#if FIN_SPLITK
    fin8(u, xr, K_IN + e0);
#else
    ld8(u, xr.x + (size_t)m * X_COLS + K_IN + e0);
#endif
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float sig = rbf16(1.0f / (1.0f + expf(-v[j])));  // jax.nn.sigmoid, bf16 out
      v[j] = rbf16(rbf16(v[j] * sig) * u[j]);                // silu(g) = g * sigmoid(g); * up
    }
  }
}

// CTA-wide sum (SUM) or max of one value per row; every thread gets the totals.
template <bool SUM>
__device__ __forceinline__ void cta_reduce(float (&v)[M_TOK], float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int m = 0; m < M_TOK; ++m) {
#pragma unroll
    for (int b = 16; b >= 1; b >>= 1) {
      const float o = __shfl_xor_sync(0xffffffffu, v[m], b);
      v[m] = SUM ? v[m] + o : fmaxf(v[m], o);
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int m = 0; m < M_TOK; ++m) scratch[m * (NTHREADS / 32) + warp] = v[m];
  }
  __syncthreads();
#pragma unroll
  for (int m = 0; m < M_TOK; ++m) {
    float t = SUM ? 0.f : -1.f;
    for (int w = 0; w < NTHREADS / 32; ++w) {  // fixed order: the same total in every CTA
      const float o = scratch[m * (NTHREADS / 32) + w];
      t = SUM ? t + o : fmaxf(t, o);
    }
    v[m] = t;
  }
  __syncthreads();  // scratch is reused
}

// Fills the row statistics of xr (all threads of the CTA call it; ends with a barrier).
__device__ __forceinline__ void row_stats(const XRows& xr, const float* xg, float* scratch) {
  if constexpr (PRO == 1) {
    float s[M_TOK];
#pragma unroll
    for (int m = 0; m < M_TOK; ++m) {
      s[m] = 0.f;
      for (int e = 8 * threadIdx.x; e < K_IN; e += 8 * NTHREADS) {
        float v[8];
        src8(v, xr, m, e);
#pragma unroll
        for (int j = 0; j < 8; ++j) s[m] = fmaf(v[j], v[j], s[m]);
      }
    }
    cta_reduce<true>(s, scratch);
    if (threadIdx.x == 0) {
#pragma unroll
      for (int m = 0; m < M_TOK; ++m) xr.rs[m] = rsqrtf(s[m] / (float)K_IN + NORM_EPS);
    }
    __syncthreads();
  }
  if constexpr (DYN_XG) {
    float a[M_TOK];
#pragma unroll
    for (int m = 0; m < M_TOK; ++m) {
      a[m] = 0.f;
      for (int e = 8 * threadIdx.x; e < K_IN; e += 8 * NTHREADS) {
        float v[8];
        pro_values8(v, xr, m, e);
#pragma unroll
        for (int j = 0; j < 8; ++j) a[m] = fmaxf(a[m], fabsf(v[j]));
      }
    }
    cta_reduce<false>(a, scratch);
    if (threadIdx.x == 0) {
#pragma unroll
      for (int m = 0; m < M_TOK; ++m) {
        const float g = div_rn(a[m], 2688.0f);  // 6 * 448
        xr.g[m] = g > 0.f ? g : 1.0f;
      }
    }
  } else if (threadIdx.x == 0) {
#pragma unroll
    for (int m = 0; m < M_TOK; ++m) xr.g[m] = xg[0];
  }
  __syncthreads();
  if (threadIdx.x == 0) {
#pragma unroll
    for (int m = 0; m < M_TOK; ++m) xr.ig[m] = div_rn(1.0f, xr.g[m]);
  }
  __syncthreads();
}

// Quantizes 4 elements [e0, e0 + 4) of row m; the 4 consecutive lanes holding one 16-element
// block (e0 % 16 = 4 * (lane % 4)) find its amax together with two shuffles, so a CTA quantizes
// its x with 4 elements per thread per round (every lane of the warp must call it). Returns the
// 4 codes in the low 16 bits (element e0 in the lowest nibble); `scale` gets the block's E4M3
// byte.
__device__ __forceinline__ u32 quant4(const XRows& xr, int m, int e0, u32& scale) {
  float v[4];
  {
    const u16* p = xr.x + (size_t)m * X_COLS + e0;
    const uint2 q = *(const uint2*)p;
    v[0] = __uint_as_float(q.x << 16), v[1] = __uint_as_float(q.x & 0xFFFF0000u);
    v[2] = __uint_as_float(q.y << 16), v[3] = __uint_as_float(q.y & 0xFFFF0000u);
    if constexpr (PRO == 1) {
      const uint2 w = *(const uint2*)(xr.nw + e0);
      const float wf[4] = {__uint_as_float(w.x << 16), __uint_as_float(w.x & 0xFFFF0000u),
                           __uint_as_float(w.y << 16), __uint_as_float(w.y & 0xFFFF0000u)};
      const float rs = xr.rs[m];
#pragma unroll
      for (int j = 0; j < 4; ++j) v[j] = rbf16(wf[j] * rbf16(v[j] * rs));
    } else if constexpr (PRO == 2) {
      const uint2 u = *(const uint2*)(p + K_IN);
      const float uf[4] = {__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xFFFF0000u),
                           __uint_as_float(u.y << 16), __uint_as_float(u.y & 0xFFFF0000u)};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float sig = rbf16(1.0f / (1.0f + expf(-v[j])));  // jax.nn.sigmoid, bf16 out
        v[j] = rbf16(rbf16(v[j] * sig) * uf[j]);                // silu(g) = g * sigmoid(g); * up
      }
    }
  }
  float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
  return block_codes(v, amax, xr.g + m, xr.ig + m, scale);
}
#endif  // X_BF16

#if QUANT_ONLY
// ---------------------------------------------------------------------------- quantizer alone
//
// nvfp4_quantize_bf16: the in-kernel quantizer above as a kernel of its own (the prologue PRO,
// then rejax.nvfp4.quantize_activation), for a plain W4A4 GEMV or the GEMM to read: one launch
// that does once what the fused GEMV redoes in every CTA. Compiled with M_TOK = 1 and launched
// with any number of rows M (grid x, up to 2^31 - 1): nothing here depends on M. The grid
// spreads each row over the whole GPU: blockIdx.x is the row, blockIdx.y one QCHUNK-element
// chunk of it. Every CTA computes the row's statistics itself (the RMSNorm mean square, the
// dynamic amax: a read of the row from L2, in the same fixed order in every CTA, so all chunks
// agree) and quantizes only its chunk. The output forms (compile time):
//   XHAT_OUT = 0: one quant4 per thread per round; writes the codes xp [M, K/2], the E4M3
//     block scales xs [M, K/16] and the row's global scale xg_out [M] (the static xg[0], or
//     DYN_XG's per-row scale; chunk 0 writes it), what the W4A4 GEMV reads;
//   XHAT_OUT = 1: one quant8 per thread per round (the same codes and scales) turned into the
//     GEMM's fp16 operand x_hat = e2m1(code) * SFx [M, K] in its K order (nvfp4_gemm.cu):
//       x_perm[m, 128c + 32u + 8t + j] = x_hat[m, 128c + 32t + 8u + j / 2 + 4 (j % 2)],
//     so the 8 elements 128c + 32t + 8u .. + 7 of a thread are one 16-byte run at
//     128c + 32u + 8t, in the order (e0, e4, e1, e5, e2, e6, e3, e7); writes x_hat and
//     xg_out [M] (rejax.ops.linear.gemm_x_operand of the codes and scales, bit for bit);
//   XHAT_OUT = 2: the same x_hat values as the wgmma GEMM's stage tiles (nvfp4_gemm_wgmma.cu,
//     BULK; nvfp4_gemm_wgmma.to_stage_tiles of wgmma_x_operand): fp16
//     [ceil(M / XHAT_TM), K / 128, XHAT_TM * 128], the 16-byte core-matrix row of token m and
//     8-element column q of K stage c at ((m / XHAT_TM) K/128 + c) XHAT_TM 128 + q XHAT_TM 8 +
//     (m % XHAT_TM / 8) 64 + (m % 8) 8 elements. A CTA takes 8 rows (M_TOK = 8) so that it
//     stores whole 128-byte core matrices (its kernel below). Launched over
//     ceil(M / XHAT_TM) XHAT_TM / 8 row groups (XHAT_M real rows): the padding rows are zeros;
//   XHAT_OUT = 3: the same values as bf16 [M, K] in natural K order (exact: e2m1 * SFx has at
//     most 6 significant bits), a thread's 8 elements one 16-byte run at e0: the dot path's
//     activation operand (rejax.nvfp4's scaled values of the codes and scales, bit for bit),
//     and xg_out [M].
#ifndef QCHUNK
#define QCHUNK K_IN
#endif
#ifndef XHAT_OUT
#define XHAT_OUT 0
#endif
#if XHAT_OUT == 2
#ifndef XHAT_TM
#define XHAT_TM 128
#endif
static_assert(XHAT_TM % 8 == 0, "XHAT_TM: whole 8-token core matrices");
#ifndef XHAT_M
#error "XHAT_M: the rows of x (the grid also covers the last tile's padding rows)"
#endif
static_assert(!FIN_SPLITK, "the stage-tile form has no finish input");
#endif

#if XHAT_OUT
// two E4M3 bytes (low, high) -> f16x2 (low, high), exact
__device__ __forceinline__ u32 e4m3x2_to_f16x2(u32 v) {
  u32 h;
  asm("{ .reg .b16 t; cvt.u16.u32 t, %1; cvt.rn.f16x2.e4m3x2 %0, t; }" : "=r"(h) : "r"(v));
  return h;
}

__device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
  u32 d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// Quantizes 8 elements [e0, e0 + 8) of the CTA's row (e0 % 8 == 0): quant4's operations on
// each element, with the two consecutive lanes holding one 16-element block (e0 % 16 = 8 *
// (lane % 2)) finding its amax together with one shuffle (every lane of the warp must call
// it). Returns the 8 codes (element e0 in the lowest nibble); `scale` gets the block's E4M3
// byte.
__device__ __forceinline__ u32 quant8(const XRows& xr, int e0, u32& scale) {
  float v[8];
  pro_values8(v, xr, 0, e0);  // the prologue of quant4, 16-byte loads
  float amax = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(v[j]));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  return block_codes(v, amax, xr.g, xr.ig, scale);
}

// fp16 high bytes of the E2M1 magnitudes 0, 0.5, 1, 1.5 (TH_LO) and 2, 3, 4, 6 (TH_HI); the
// low bytes are 0
#define TH_LO 0x3E3C3800u
#define TH_HI 0x46444240u

// 8 codes c (nibble j = element j) of one block with E4M3 scale byte `scale` -> the 16-byte
// x_hat run (e0, e4, e1, e5, e2, e6, e3, e7) as 4 f16x2 words (e_i, e_{i+4}). Exact: the
// magnitude in fp16 times SFx in fp16 (<= 6 significant bits, 2^-10 .. 2688: no rounding),
// then the code's sign bit, so code 8 (-0) and negative codes of a zero block give -0, as
// e2m1(code) * SFx in float32 does.
__device__ __forceinline__ uint4 xhat8(u32 c, u32 scale) {
  const u32 mag = c & 0x77777777u;
  const u32 lo = prmt(TH_LO, TH_HI, mag);        // high bytes of elements 0..3
  const u32 hi = prmt(TH_LO, TH_HI, mag >> 16);  // and of elements 4..7
  const u32 sf2 = e4m3x2_to_f16x2(scale * 0x101u);  // (SFx, SFx)
  const u32 sgn = c & 0x88888888u;               // sign of element j at bit 4j + 3
  u32 w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    // bytes 1 and 3: lo byte i and hi byte i; bytes 0 and 2 masked off
    const u32 h = prmt(lo, hi, (u32)(i << 4) | (u32)((4 + i) << 12)) & 0xFF00FF00u;
    // element i's sign (bit 4i + 3) -> 15, element i + 4's (bit 4i + 19) -> 31
    w[i] = hmul2(h, sf2) | ((sgn << (12 - 4 * i)) & 0x80008000u);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

static_assert(QCHUNK % 256 == 0 && K_IN % QCHUNK == 0,
              "QCHUNK: a multiple of 256 (full warps of quant8) dividing K");
#if XHAT_OUT == 3
// bf16 bytes of the E2M1 magnitudes 0, 0.5, 1, 1.5 (*_LO) and 2, 3, 4, 6 (*_HI): high bytes BH,
// low bytes BL
#define BH_LO 0x3F3F3F00u
#define BH_HI 0x40404040u
#define BL_LO 0xC0800000u
#define BL_HI 0xC0804000u

__device__ __forceinline__ u32 hmul2_bf16(u32 a, u32 b) {
  u32 d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// 8 codes c (nibble j = element j) of one block with E4M3 scale byte `scale` -> the 8 values
// e2m1(code) * SFx as bf16 in element order (4 words, element 2i low). The magnitudes come
// from byte tables (prmt), times SFx in bf16 (exact: an E4M3 value has 4 significant bits, so
// its float's high half is it, and the product has at most 6), then the code's sign bit: code
// 8 gives -0, a zero block +-0 by the code's sign, as the float product e2m1(code) * SFx does.
__device__ __forceinline__ uint4 xbf8(u32 c, u32 scale) {
  const u32 mag = c & 0x77777777u;
  const u32 sb = __float_as_uint(e4m3x2_to_float2(scale).x) >> 16;
  const u32 sf2 = sb | (sb << 16);
  const u32 c4 = c << 4;  // byte i's msb: element 2i's sign (c's byte i msb: element 2i + 1's)
  u32 w[4];
#pragma unroll
  for (int h = 0; h < 2; ++h) {  // elements 4h .. 4h + 3: byte j of lo / hi is element 4h + j's
    const u32 lo = prmt(BL_LO, BL_HI, mag >> (16 * h)), hi = prmt(BH_LO, BH_HI, mag >> (16 * h));
    w[2 * h] = hmul2_bf16(prmt(lo, hi, 0x5140u), sf2);
    w[2 * h + 1] = hmul2_bf16(prmt(lo, hi, 0x7362u), sf2);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    // sign mode (selector bit 3): byte 1 <- element 2i's sign replicated, byte 3 <- 2i + 1's
    const u32 sgn = prmt(c, c4, (u32)((8 + i) << 12) | (u32)((12 + i) << 4));
    w[i] |= sgn & 0x80008000u;
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}
#endif

#if !FIN_SPLITK && XHAT_OUT != 2
extern "C" __global__ void __launch_bounds__(NTHREADS)
    nvfp4_quantize_bf16(const u16* __restrict__ x, const float* __restrict__ xg,
                        const u16* __restrict__ nw_all, const int* __restrict__ layer,
                        u16* __restrict__ xh, float* __restrict__ xg_out) {
  static_assert(M_TOK == 1, "the quantizer runs one row per CTA");
  __shared__ float scratch[RED_SLOTS], s_rs[1], s_g[1], s_ig[1];
  const size_t row = blockIdx.x;
  // QCHUNK / 8 is a multiple of 32: every warp is full in each round, as quant8's shuffle needs
  const int first = blockIdx.y * (QCHUNK / 8);
  const XRows xr = {x + row * X_COLS, nw_all + (NW_STACK ? (size_t)(unsigned)*layer * K_IN : 0),
                    s_rs, s_g, s_ig};
  row_stats(xr, xg + (XG_STACK ? (size_t)(unsigned)*layer : 0), scratch);
  for (int i = first + threadIdx.x; i < first + QCHUNK / 8; i += NTHREADS) {
    u32 sc;
    const int e0 = 8 * i;  // = 128c + 32t + 8u
    const u32 c = quant8(xr, e0, sc);
#if XHAT_OUT == 3
    *(uint4*)(xh + row * K_IN + e0) = xbf8(c, sc);
#else
    const int at = (e0 & ~127) | (((e0 >> 3) & 3) << 5) | (((e0 >> 5) & 3) << 3);  // 128c+32u+8t
    *(uint4*)(xh + row * K_IN + at) = xhat8(c, sc);
#endif
  }
  if (blockIdx.y == 0 && threadIdx.x == 0) xg_out[row] = s_g[0];
}
#elif XHAT_OUT == 2
// The stage-tile form: a CTA quantizes the QCHUNK-element chunk blockIdx.y of the 8 rows
// 8 blockIdx.x .. + 7 (one 8-token core-matrix group of a tile: M_TOK = 8), so that its stores
// are whole 128-byte core matrices (a row alone owns only 16-byte pieces of the tiles, 2 KiB
// apart: stored from one CTA a row they measured at 7x the bytes' floor, all in L2 write
// requests). The row statistics are row_stats' (the same sums in the same order per row,
// cta_reduce over the 8 rows at once). Each thread item is one 16-element block (row m, stage
// c, 32-element lane group t, half v): both halves' values, their amax in the thread (no
// shuffle), quant8's codes and xhat8's words; word i of piece u = 2v + h is column 4u + i of
// the wgmma K order at f16x2 slot t of row m, written to the chunk's tile image in shared
// memory [stage][column][row][slot] (a warp's 8 rows x 4 slots hit 32 banks). Then the CTA
// stores the image as 128-byte runs (8 rows of one column). Rows at or past XHAT_M (the last
// tile's padding, and the last group's rows when M % 8 != 0) are zeros and read nothing.
// TILE_IMG: the elements of one pass of the image (16 bytes of shared memory each). The whole
// chunk up to 2048; a longer chunk (e.g. a whole row: QCHUNK = K, one CTA an 8-row group, so
// the row statistics are read once instead of once per chunk) is built and stored in passes of
// the largest of 2048, 1024, 512 and 256 that divides it.
#if QCHUNK <= 2048
#define TILE_IMG QCHUNK
#elif QCHUNK % 2048 == 0
#define TILE_IMG 2048
#elif QCHUNK % 1024 == 0
#define TILE_IMG 1024
#elif QCHUNK % 512 == 0
#define TILE_IMG 512
#else
#define TILE_IMG 256
#endif
static_assert(M_TOK == 8, "the stage-tile form quantizes 8 rows a CTA (M_TOK = 8)");
static_assert(XHAT_TM % 8 == 0, "XHAT_TM: whole 8-token groups");
static_assert(TILE_IMG <= 2048 && QCHUNK % TILE_IMG == 0,
              "the image takes TILE_IMG * 16 bytes of shared memory, passes of a whole chunk");
extern "C" __global__ void __launch_bounds__(NTHREADS)
    nvfp4_quantize_bf16(const u16* __restrict__ x, const float* __restrict__ xg,
                        const u16* __restrict__ nw_all, const int* __restrict__ layer,
                        u16* __restrict__ xh, float* __restrict__ xg_out) {
  __shared__ float scratch[RED_SLOTS], s_rs[8], s_g[8], s_ig[8];
  __shared__ __align__(16) u32 s_t[TILE_IMG / 128][16][8][4];
  const int row0 = blockIdx.x * 8;
  const int real = min(8, XHAT_M - row0);  // rows of x in the group (<= 0: padding only)
  const int c0 = blockIdx.y * (QCHUNK / 128);  // the chunk's first stage
  const XRows xr = {x + (size_t)max(row0, 0) * X_COLS,
                    nw_all + (NW_STACK ? (size_t)(unsigned)*layer * K_IN : 0), s_rs, s_g, s_ig};
  // row_stats for the real rows (the padding rows' statistics are never used). The rows are
  // the inner loop, so a thread has its 8 rows' loads of one position in flight together;
  // each row's sum still runs over its elements in row_stats' order (the same bits).
  if constexpr (PRO == 1) {
    float s[8];
#pragma unroll
    for (int m = 0; m < 8; ++m) s[m] = 0.f;
    for (int e = 8 * threadIdx.x; e < K_IN; e += 8 * NTHREADS) {
#pragma unroll
      for (int m = 0; m < 8; ++m) {
        if (m < real) {
          float v[8];
          src8(v, xr, m, e);
#pragma unroll
          for (int j = 0; j < 8; ++j) s[m] = fmaf(v[j], v[j], s[m]);
        }
      }
    }
    cta_reduce<true>(s, scratch);
    if (threadIdx.x == 0) {
#pragma unroll
      for (int m = 0; m < 8; ++m) xr.rs[m] = rsqrtf(s[m] / (float)K_IN + NORM_EPS);
    }
    __syncthreads();
  }
  if constexpr (DYN_XG) {
    float a[8];
#pragma unroll
    for (int m = 0; m < 8; ++m) a[m] = 0.f;
    for (int e = 8 * threadIdx.x; e < K_IN; e += 8 * NTHREADS) {
#pragma unroll
      for (int m = 0; m < 8; ++m) {
        if (m < real) {
          float v[8];
          pro_values8(v, xr, m, e);
#pragma unroll
          for (int j = 0; j < 8; ++j) a[m] = fmaxf(a[m], fabsf(v[j]));
        }
      }
    }
    cta_reduce<false>(a, scratch);
    if (threadIdx.x == 0) {
#pragma unroll
      for (int m = 0; m < 8; ++m) {
        const float g = div_rn(a[m], 2688.0f);  // 6 * 448
        xr.g[m] = g > 0.f ? g : 1.0f;
      }
    }
  } else if (threadIdx.x == 0) {
    const float g = xg[XG_STACK ? (size_t)(unsigned)*layer : 0];
#pragma unroll
    for (int m = 0; m < 8; ++m) xr.g[m] = g;
  }
  __syncthreads();
  if (threadIdx.x < 8) xr.ig[threadIdx.x] = div_rn(1.0f, xr.g[threadIdx.x]);
  __syncthreads();
#if QCHUNK > TILE_IMG
  for (int pass = 0; pass < QCHUNK / TILE_IMG; ++pass) {
    const int cs = c0 + pass * (TILE_IMG / 128);  // this pass's first stage
    if (pass > 0) __syncthreads();  // every thread's stores of the previous image are done
#else
  {
    const int cs = c0;
#endif
  for (int it = threadIdx.x; it < TILE_IMG / 2; it += NTHREADS) {
    const int m = it & 7, t = (it >> 3) & 3, v = (it >> 5) & 1, c = it >> 6;
    uint4 h0 = make_uint4(0u, 0u, 0u, 0u), h1 = h0;
    if (m < real) {
      const int e0 = (cs + c) * 128 + 32 * t + 16 * v;  // pieces u = 2v (e0) and 2v + 1
      float a[8], b[8];
      pro_values8(a, xr, m, e0);
      pro_values8(b, xr, m, e0 + 8);
      float amax = 0.f;
#pragma unroll
      for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fmaxf(fabsf(a[j]), fabsf(b[j])));
      u32 sc;
      const u32 ca = block_codes(a, amax, xr.g + m, xr.ig + m, sc);
      const u32 cb = block_codes(b, amax, xr.g + m, xr.ig + m, sc);
      h0 = xhat8(ca, sc);
      h1 = xhat8(cb, sc);
    }
    u32(*const col)[8][4] = s_t[c] + 8 * v;  // columns 4u + i of pieces u = 2v, 2v + 1
    col[0][m][t] = h0.x, col[1][m][t] = h0.y, col[2][m][t] = h0.z, col[3][m][t] = h0.w;
    col[4][m][t] = h1.x, col[5][m][t] = h1.y, col[6][m][t] = h1.z, col[7][m][t] = h1.w;
  }
  __syncthreads();
  u16* const base = xh + ((size_t)(row0 / XHAT_TM) * (K_IN / 128) + cs) * (XHAT_TM * 128) +
                    (row0 % XHAT_TM) * 8;
  const uint4* const img = (const uint4*)&s_t[0][0][0][0];
  for (int j = threadIdx.x; j < TILE_IMG; j += NTHREADS) {  // [stage][column][row] 16-byte pieces
    const int m = j & 7, q = (j >> 3) & 15, c = j >> 7;
    *(uint4*)(base + (size_t)c * (XHAT_TM * 128) + q * (XHAT_TM * 8) + m * 8) = img[j];
  }
  }  // the passes
  // (int): real is negative in a group of padding rows (an unsigned compare would pass there)
  if (blockIdx.y == 0 && (int)threadIdx.x < real) xg_out[row0 + threadIdx.x] = s_g[threadIdx.x];
}

#else  // FIN_SPLITK
// nvfp4_finish_quantize: a K-split GEMM's finish and the next linear's quantizer in one launch
// (one launch and one pass over y fewer between two GEMMs of a decoder layer). x is what the
// producer GEMM's split-K finish would store (fin8: its partials part [FIN_SPLITK, M, X_COLS],
// its activation global scale xgp [M], its weight global scale(s) wg [(L,) 1 or X_COLS] at
// the layer, and with FIN_RES the residual res [M, X_COLS]); then the prologue PRO and the
// quantizer as nvfp4_quantize_bf16 with XHAT_OUT runs them: the same row statistics in the
// same order (they do not depend on QCHUNK), so x_hat and xg_out are that kernel's bytes on the
// finish's y. XHAT_OUT 1 stores the GEMM's fp16 x_hat, 3 the dot path's bf16 values (xbf8, in K
// order); with FIN_W_SHIFT 14 the producer is the dot path's float32 sum [M, X_COLS] (e.g.
// gate_up's dot read by down's SwiGLU quantizer: no bf16 gate_up output in between). With
// FIN_STORE_Y each CTA also stores its chunk of x as bf16 to y [M, X_COLS] (the finish's y: the
// decoder's residual stream; PRO != 2). Grid (M, K_IN / QCHUNK): M is
// gridDim.x, nothing is compiled for it. With FIN_CACHE (one CTA per row, QCHUNK = K_IN, PRO !=
// 2) the CTA first forms the row's x once into shared memory (and y), and the statistics and
// the codes read it there: each partial is read once, as by the finish kernel.
static_assert(PRO != 2 || !FIN_STORE_Y, "FIN_STORE_Y stores the linear's input rows (PRO 0 or 1)");

// fin8's 8 values as the 16 bytes of bf16 the finish kernel stores (exact: they are bf16 already)
__device__ __forceinline__ uint4 fin8_bf16(const XRows& xr, int c) {
  float h[8];
  fin8(h, xr, c);
  u32 w[4];
#pragma unroll
  for (int j = 0; j < 4; ++j)
    w[j] = (u32)f32_to_bf16(h[2 * j]) | ((u32)f32_to_bf16(h[2 * j + 1]) << 16);
  return make_uint4(w[0], w[1], w[2], w[3]);
}
static_assert(!FIN_CACHE || (QCHUNK == K_IN && PRO != 2 && X_COLS * 2 <= 40960),
              "FIN_CACHE: one CTA per row (QCHUNK = K), PRO 0 or 1, the row in 40 KiB");
// FIN_CLUSTER = C: the row's C CTAs (grid y) are one thread-block cluster. Each forms its own
// chunk of x once into its shared memory (each partial read once, by C CTAs a row instead of
// one); after a cluster barrier the row statistics read the whole row through distributed
// shared memory, in the quantizer's order (the same bytes), and each CTA quantizes its chunk.
static_assert(!FIN_CLUSTER || (FIN_CLUSTER >= 2 && FIN_CLUSTER <= 8 && !FIN_CACHE && PRO != 2 &&
                               K_IN == FIN_CLUSTER * QCHUNK),
              "FIN_CLUSTER: 2..8 CTAs a row (QCHUNK = K / C), PRO 0 or 1");
// (its launch bounds ask for one CTA an SM: left to itself ptxas held a cluster build to 48
// registers and spilled; with them it keeps the statistic loop's distributed loads unrolled.
// A FIN_CACHE build, one CTA a row, likewise: held to 48 registers it spilled 4 bytes)
#if FIN_CLUSTER
#define FIN_BOUNDS __launch_bounds__(NTHREADS, 1) __cluster_dims__(1, FIN_CLUSTER, 1)
#elif FIN_CACHE
#define FIN_BOUNDS __launch_bounds__(NTHREADS, 1)
#else
#define FIN_BOUNDS __launch_bounds__(NTHREADS)
#endif
extern "C" __global__ void FIN_BOUNDS
    nvfp4_finish_quantize(const float* __restrict__ part, const float* __restrict__ xgp,
                          const u16* __restrict__ res, const float* __restrict__ wg,
                          const float* __restrict__ xg, const u16* __restrict__ nw_all,
                          const int* __restrict__ layer, u16* __restrict__ y,
                          u16* __restrict__ xh, float* __restrict__ xg_out) {
  static_assert(M_TOK == 1, "the quantizer runs one row per CTA");
  __shared__ float scratch[RED_SLOTS], s_rs[1], s_g[1], s_ig[1];
  const size_t row = blockIdx.x;
  const unsigned li = (unsigned)*layer;
  // FIN_NEXT_LAYERS = L: the next linear is the next layer's (down_proj -> the next qkv), its
  // norm weight and input scale at layer + 1 of their L-layer stacks (the last layer reads
  // layer L - 1: an x_hat nobody uses)
  const unsigned lc = FIN_NEXT_LAYERS ? min(li + 1u, (unsigned)FIN_NEXT_LAYERS - 1u) : li;
  XRows xr = {nullptr, nw_all + (NW_STACK ? (size_t)lc * K_IN : 0), s_rs, s_g, s_ig};
  xr.part = part + row * X_COLS;
  xr.split = (size_t)gridDim.x * X_COLS;
  xr.res = FIN_RES ? res + row * X_COLS : nullptr;
  xr.wg = wg + (size_t)li * (FIN_GW_ROWS ? X_COLS : 1);
  xr.xgp = xgp[row];
#if FIN_CACHE
  __shared__ __align__(16) u16 s_x[X_COLS];
  for (int e = 8 * threadIdx.x; e < X_COLS; e += 8 * NTHREADS) {
    const uint4 q = fin8_bf16(xr, e);
    *(uint4*)(s_x + e) = q;
    if constexpr (FIN_STORE_Y) *(uint4*)(y + row * X_COLS + e) = q;
  }
  xr.hs = s_x;
  __syncthreads();
#elif FIN_CLUSTER
  __shared__ __align__(16) u16 s_x[QCHUNK];
  {
    const int c0 = blockIdx.y * QCHUNK;
    for (int e = 8 * threadIdx.x; e < QCHUNK; e += 8 * NTHREADS) {
      const uint4 q = fin8_bf16(xr, c0 + e);
      *(uint4*)(s_x + e) = q;
      if constexpr (FIN_STORE_Y) *(uint4*)(y + row * X_COLS + c0 + e) = q;
    }
  }
  xr.hs_addr = (unsigned)__cvta_generic_to_shared(s_x);
  fin_cluster_sync();
#endif
  row_stats(xr, xg + (XG_STACK ? (size_t)lc : 0), scratch);
  const int first = blockIdx.y * (QCHUNK / 8);
  for (int i = first + threadIdx.x; i < first + QCHUNK / 8; i += NTHREADS) {
    u32 sc;
    const int e0 = 8 * i;  // = 128c + 32t + 8u
    if constexpr (FIN_STORE_Y && !FIN_CACHE && !FIN_CLUSTER)
      *(uint4*)(y + row * X_COLS + e0) = fin8_bf16(xr, e0);
    const u32 c = quant8(xr, e0, sc);
#if XHAT_OUT == 3
    *(uint4*)(xh + row * K_IN + e0) = xbf8(c, sc);
#else
    const int at = (e0 & ~127) | (((e0 >> 3) & 3) << 5) | (((e0 >> 5) & 3) << 3);  // 128c+32u+8t
    *(uint4*)(xh + row * K_IN + at) = xhat8(c, sc);
#endif
  }
  if (blockIdx.y == 0 && threadIdx.x == 0) xg_out[row] = s_g[0];
#if FIN_CLUSTER
  fin_cluster_sync();  // no CTA leaves while another still reads its shared memory
#endif
}
#endif  // FIN_SPLITK

#else  // !XHAT_OUT: codes and scales
static_assert(!FIN_SPLITK, "FIN_SPLITK writes the GEMM's x_hat (XHAT_OUT)");
static_assert(QCHUNK % 128 == 0 && K_IN % QCHUNK == 0,
              "QCHUNK: a multiple of 128 (full warps of quant4) dividing K");
extern "C" __global__ void __launch_bounds__(NTHREADS)
    nvfp4_quantize_bf16(const u16* __restrict__ x, const float* __restrict__ xg,
                        const u16* __restrict__ nw_all, const int* __restrict__ layer,
                        u8* __restrict__ xp, u8* __restrict__ xs, float* __restrict__ xg_out) {
  static_assert(M_TOK == 1, "the quantizer runs one row per CTA");
  __shared__ float scratch[RED_SLOTS], s_rs[1], s_g[1], s_ig[1];
  const size_t row = blockIdx.x;
  const XRows xr = {x + row * X_COLS, nw_all + (NW_STACK ? (size_t)(unsigned)*layer * K_IN : 0),
                    s_rs, s_g, s_ig};
  row_stats(xr, xg + (XG_STACK ? (size_t)(unsigned)*layer : 0), scratch);
  // QCHUNK / 4 is a multiple of 32: every warp is full in each round, as quant4's shuffles need
  const int first = blockIdx.y * (QCHUNK / 4);
  for (int i = first + threadIdx.x; i < first + QCHUNK / 4; i += NTHREADS) {
    u32 sc;
    const u32 c = quant4(xr, 0, 4 * i, sc);
    *(u16*)(xp + row * (K_IN / 2) + 2 * i) = (u16)c;
    if ((i & 3) == 0) xs[row * (K_IN / 16) + i / 4] = (u8)sc;
  }
  if (blockIdx.y == 0 && threadIdx.x == 0) xg_out[row] = s_g[0];
}
#endif  // XHAT_OUT
#else  // !QUANT_ONLY: the GEMV entries


#if !GEMV_STREAM

// bytes of the W4A4 kernel's shared memory before ybuf: x staged as int8 and its scales
constexpr int XSTAGE = ((M_TOK * K_IN * 17 / 16 + 15) / 16) * 16;


// acc += sum over the two blocks of (exact int8 block dot) * SFw * SFx, signed weight words
__device__ __forceinline__ void row_dot_s8(float& acc, const u32 (&w)[8], const u32 (&xw)[8],
                                           float2 sw, float2 sxf) {
#pragma unroll
  for (int b = 0; b < 2; ++b) {
    int d = 0x4B400000;  // 1.5 * 2^23, as in row_dot
#pragma unroll
    for (int j = 0; j < 4; ++j) d = __dp4a((int)w[4 * b + j], (int)xw[4 * b + j], d);
    const float dot = __int_as_float(d) - 12582912.0f;
    acc = fmaf(dot, (b ? sw.y : sw.x) * (b ? sxf.y : sxf.x), acc);
  }
}

#ifndef SIGNED_W
#define SIGNED_W (M_TOK > 2)
#endif

// One weight row's 32 codes decoded for many tokens: (positive, negative) int8 word pairs, two
// dp4a per 4 weights, or signed int8 words, one dp4a (SIGNED_W).
struct RowPosNeg {
  u32 pos[8], neg[8];
  __device__ __forceinline__ void decode(uint4 q) { decode_row(pos, neg, q); }
  __device__ __forceinline__ void dot(float& acc, const u32 (&xw)[8], float2 sw, float2 sxf) const {
    row_dot(acc, pos, neg, xw, sw, sxf);
  }
};
struct RowSigned {
  u32 w[8];
  __device__ __forceinline__ void decode(uint4 q) { decode_s8(w, q); }
  __device__ __forceinline__ void dot(float& acc, const u32 (&xw)[8], float2 sw, float2 sxf) const {
    row_dot_s8(acc, w, xw, sw, sxf);
  }
};
template <bool S>
struct RowDecode {
  using type = RowPosNeg;
};
template <>
struct RowDecode<true> {
  using type = RowSigned;
};

// acc += this step's dot products of the tile's rows with the staged x of every token
__device__ __forceinline__ void w4a4_step(float (&acc)[VP], const WTile& cur, int elem,
                                          const u8* sx, const u8* ssf) {
  if constexpr (M_TOK <= 2) {
    // few tokens: x of all tokens in registers, one row decoded at a time
    u32 xw[M_TOK][8];
    float2 sxf[M_TOK];
#pragma unroll
    for (int m = 0; m < M_TOK; ++m) load_x(xw[m], sxf[m], sx, ssf, m, elem);
    chunk_dot(acc, cur.q, cur.s, xw, sxf);
  } else {
    // more tokens: all rows decoded in registers, x read from smem once per token
    using Row = typename RowDecode<SIGNED_W>::type;
    Row w[R_ROWS];
    float2 sw[R_ROWS];
#pragma unroll
    for (int r = 0; r < R_ROWS; ++r) {
      w[r].decode(cur.q[r]);
      sw[r] = e4m3x2_to_float2(cur.s[r]);
    }
#pragma unroll
    for (int m = 0; m < M_TOK; ++m) {
      u32 xw[8];
      float2 sxf;
      load_x(xw, sxf, sx, ssf, m, elem);
#pragma unroll
      for (int r = 0; r < R_ROWS; ++r) w[r].dot(acc[r * M_TOK + m], xw, sw[r], sxf);
    }
  }
}


#if X_BF16
extern "C" __global__ void __launch_bounds__(NTHREADS, MIN_CTAS)
    nvfp4_gemv_w4a4_bf16(const u16* __restrict__ x, const float* __restrict__ xg,
                         const u16* __restrict__ nw_all, const u16* __restrict__ res,
                         const u8* __restrict__ wp_all, const u8* __restrict__ ws_all,
                         const float* __restrict__ wg_all, const int* __restrict__ layer,
                         u16* __restrict__ y) {
  const Layer lw = layer_of(wp_all, ws_all, wg_all, layer);
  const u8* __restrict__ wp = lw.wp;
  const u8* __restrict__ ws = lw.ws;
  const float* __restrict__ wg = lw.wg;
  extern __shared__ __align__(16) u8 smem[];
  u8* sx = smem;                                   // int8 [M][K]: 2 * E2M1 value
  u8* ssf = smem + M_TOK * K_IN;                   // E4M3 [M][K/16]
  float* ybuf = (float*)(smem + XSTAGE);           // [KPARTS][RPC][M]
  u8* ring = smem + XSTAGE + ((KPARTS * RPC * M_TOK * 4 + 15) / 16) * 16;  // [warp][RING_D][slot]
  __shared__ float scratch[RED_SLOTS], s_rs[M_TOK], s_g[M_TOK], s_ig[M_TOK];
  const XRows xr = {x, nw_all + (NW_STACK ? (size_t)(unsigned)*layer * K_IN : 0), s_rs, s_g, s_ig};

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g0 = (int)(((long long)blockIdx.x * NGROUPS) / GRID);
  const int g1 = (int)(((long long)(blockIdx.x + 1) * NGROUPS) / GRID);
  const int items = (g1 - g0) * KPARTS;

  // Stage x: row statistics, then the quantized codes as signed int8 and their scales in smem
  // (while the first weight loads are in flight).
  auto stage = [&]() {
    row_stats(xr, xg + (XG_STACK ? (size_t)(unsigned)*layer : 0), scratch);
    for (int i = tid; i < M_TOK * K_IN / 4; i += NTHREADS) {  // full warps: K / 4 % 64 == 0
      const int m = i / (K_IN / 4), e0 = (i % (K_IN / 4)) * 4;
      u32 sc;
      const u32 c = quant4(xr, m, e0, sc);
      *(u32*)(sx + (size_t)m * K_IN + e0) = act_to_s8(c);
      if ((i & 3) == 0) ssf[(size_t)m * (K_IN / 16) + e0 / 16] = (u8)sc;
    }
    __syncthreads();
  };
  run_units(ybuf, ring, wp, ws, g0, items, warp, lane, stage,
            [&](float (&acc)[VP], const WTile& cur, int elem) {
              w4a4_step(acc, cur, elem, sx, ssf);
            });
  __syncthreads();
  persistent_epilogue(ybuf, y, g0, g1, tid, [&](int m, int n, float t) {
    return epi(res, m, n, (t * 0.25f) * (gw_of(wg, n) * s_g[m]));
  });
}
#else  // !X_BF16
extern "C" __global__ void __launch_bounds__(NTHREADS, MIN_CTAS)
    nvfp4_gemv_w4a4(const u8* __restrict__ xp, const u8* __restrict__ xs,
                    const float* __restrict__ xg,
#if EPI_RES
                    const u16* __restrict__ res,  // [M, N] bf16, added in the epilogue
#endif
                    const u8* __restrict__ wp_all,
                    const u8* __restrict__ ws_all, const float* __restrict__ wg_all,
#if SWIGLU_OUT
                    const int* __restrict__ layer PF_OPERANDS,
                    const float* __restrict__ xgd, u8* __restrict__ dp, u8* __restrict__ ds,
                    float* __restrict__ dg) {
#else
                    const int* __restrict__ layer PF_OPERANDS NORM_OUT_OPERANDS,
                    u16* __restrict__ y NORM_OUT_RESULTS) {
#endif
#if !EPI_RES
  const u16* const res = nullptr;  // no residual operand: epi() is the GEMV's value
#endif
  const Layer lw = layer_of(wp_all, ws_all, wg_all, layer);
  const u8* __restrict__ wp = lw.wp;
  const u8* __restrict__ ws = lw.ws;
  const float* __restrict__ wg = lw.wg;
  extern __shared__ __align__(16) u8 smem[];
  u8* sx = smem;                                   // int8 [M][K]: 2 * E2M1 value
  u8* ssf = smem + M_TOK * K_IN;                   // E4M3 [M][K/16]
  float* ybuf = (float*)(smem + XSTAGE);           // [KPARTS][RPC][M]
  u8* ring = smem + XSTAGE + ((KPARTS * RPC * M_TOK * 4 + 15) / 16) * 16;  // [warp][RING_D][slot]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
#if SWIGLU_OUT
  const int u0 = (int)(((long long)blockIdx.x * NUNITS) / GRID);  // the CTA's whole units
  const int u1 = (int)(((long long)(blockIdx.x + 1) * NUNITS) / GRID);
  const int g0 = u0 * GPU_, g1 = u1 * GPU_;
#else
  const int g0 = (int)(((long long)blockIdx.x * NGROUPS) / GRID);
  const int g1 = (int)(((long long)(blockIdx.x + 1) * NGROUPS) / GRID);
#endif
  const int items = (g1 - g0) * KPARTS;

  // Stage x: codes -> signed int8 in smem (32 codes per thread per iteration), scales copied.
  auto stage = [&]() {
    for (int i = tid; i < M_TOK * K_IN / 32; i += NTHREADS) {
      const uint4 c = ld_act(xp + (size_t)i * 16);
      uint4 lo, hi;
      lo.x = act_to_s8(c.x), lo.y = act_to_s8(c.x >> 16), lo.z = act_to_s8(c.y);
      lo.w = act_to_s8(c.y >> 16);
      hi.x = act_to_s8(c.z), hi.y = act_to_s8(c.z >> 16), hi.z = act_to_s8(c.w);
      hi.w = act_to_s8(c.w >> 16);
      *(uint4*)(sx + (size_t)i * 32) = lo;
      *(uint4*)(sx + (size_t)i * 32 + 16) = hi;
    }
    for (int i = tid; i < M_TOK * K_IN / 64; i += NTHREADS) {
      *(u32*)(ssf + (size_t)i * 4) = *(const u32*)(xs + (size_t)i * 4);
    }
    __syncthreads();
  };
#if PF_TARGETS && PF_AT == 0
  PF_ISSUE(*layer);
#endif
  run_units(ybuf, ring, wp, ws, g0, items, warp, lane, stage,
            [&](float (&acc)[VP], const WTile& cur, int elem) {
              w4a4_step(acc, cur, elem, sx, ssf);
            });
#if PF_TARGETS && PF_AT == 1
  PF_ISSUE(*layer);
#endif
  __syncthreads();

#if SWIGLU_OUT
  swiglu_epilogue(ybuf, u0, u1, tid, [&](int m, int n, float t) {
    return (t * 0.25f) * (gw_of(wg, n) * xg[m]);
  }, xgd + (XGD_STACK ? (size_t)(unsigned)*layer : 0), dp, ds, dg);
#else
  // y[m, n] = (sum over K parts, in order) / 4 * (global_x[m] * global_w) [+ res[m, n]]
  persistent_epilogue(ybuf, y, g0, g1, tid, [&](int m, int n, float t) {
    return epi(res, m, n, (t * 0.25f) * (gw_of(wg, n) * xg[m]));
  });
  NORM_OUT_TAIL(*layer);
#endif
}

#endif  // X_BF16
#else  // GEMV_STREAM

#if X_BF16
extern "C" __global__ void __launch_bounds__(NTHREADS)
    nvfp4_gemv_w4a4_bf16(const u16* __restrict__ x, const float* __restrict__ xg,
                         const u16* __restrict__ nw_all, const u16* __restrict__ res,
                         const u8* __restrict__ wp_all, const u8* __restrict__ ws_all,
                         const float* __restrict__ wg_all, const int* __restrict__ layer,
                         u16* __restrict__ y) {
  const Layer lw = layer_of(wp_all, ws_all, wg_all, layer);
  const u8* __restrict__ wp = lw.wp;
  const u8* __restrict__ ws = lw.ws;
  const float* __restrict__ wg = lw.wg;
  __shared__ float red[KSPLIT > 1 ? GPB * KSPLIT * NV : 1];
  __shared__ __align__(16) u8 sxq[M_TOK * K_IN / 2];  // quantized x codes [M][K/2]
  __shared__ __align__(16) u8 sxs[M_TOK * K_IN / 16];  // and scales [M][K/16]
  __shared__ float scratch[RED_SLOTS], s_rs[M_TOK], s_g[M_TOK], s_ig[M_TOK];
  const XRows xr = {x, nw_all + (NW_STACK ? (size_t)(unsigned)*layer * K_IN : 0), s_rs, s_g, s_ig};
  const int tid = threadIdx.x, lane = tid & 31;
  const Share sh = my_share(tid >> 5);

  // the weight loads of this warp's share first, then x quantized once per CTA into smem
  uint4 q[CPL][R_ROWS];
  u32 sw[CPL][R_ROWS];
  load_share(q, sw, wp, ws, sh, lane);
  row_stats(xr, xg + (XG_STACK ? (size_t)(unsigned)*layer : 0), scratch);
  for (int i = tid; i < M_TOK * K_IN / 4; i += NTHREADS) {  // full warps: K / 4 % 64 == 0
    const int m = i / (K_IN / 4), e0 = (i % (K_IN / 4)) * 4;
    u32 sc;
    const u32 c = quant4(xr, m, e0, sc);
    *(u16*)(sxq + (size_t)m * (K_IN / 2) + e0 / 2) = (u16)c;
    if ((i & 3) == 0) sxs[(size_t)m * (K_IN / 16) + e0 / 16] = (u8)sc;
  }
  __syncthreads();

  float acc[VP];
#pragma unroll
  for (int v = 0; v < VP; ++v) acc[v] = 0.f;
#pragma unroll
  for (int i = 0; i < CPL; ++i) {
    const int c = sh.c0 + lane + 32 * i;
    const bool ok = sh.valid && c < sh.c1;
    u32 xw[M_TOK][8];
    float2 sxf[M_TOK];
#pragma unroll
    for (int m = 0; m < M_TOK; ++m) {
      const uint4 xq = ok ? *(const uint4*)(sxq + m * (K_IN / 2) + c * 16) : make_uint4(0, 0, 0, 0);
      decode_s8(xw[m], xq);
      sxf[m] = e4m3x2_to_float2(ok ? (u32) * (const u16*)(sxs + m * (K_IN / 16) + c * 2) : 0u);
    }
    chunk_dot(acc, q[i], sw[i], xw, sxf);
  }

  stream_epilogue(acc, red, lane, tid, sh.lg, sh.slice, sh.g, y, [&](int m, int n, float t) {
    return epi(res, m, n, (t * 0.25f) * (gw_of(wg, n) * s_g[m]));
  });
}
#else  // !X_BF16

extern "C" __global__ void __launch_bounds__(NTHREADS)
    nvfp4_gemv_w4a4(const u8* __restrict__ xp, const u8* __restrict__ xs,
                    const float* __restrict__ xg,
#if EPI_RES
                    const u16* __restrict__ res,  // [M, N] bf16, added in the epilogue
#endif
                    const u8* __restrict__ wp_all,
                    const u8* __restrict__ ws_all, const float* __restrict__ wg_all,
                    const int* __restrict__ layer PF_OPERANDS NORM_OUT_OPERANDS,
                    u16* __restrict__ y NORM_OUT_RESULTS) {
#if !EPI_RES
  const u16* const res = nullptr;  // no residual operand: epi() is the GEMV's value
#endif
  const Layer lw = layer_of(wp_all, ws_all, wg_all, layer);
  const u8* __restrict__ wp = lw.wp;
  const u8* __restrict__ ws = lw.ws;
  const float* __restrict__ wg = lw.wg;
  __shared__ float red[KSPLIT > 1 ? GPB * KSPLIT * NV : 1];
  const int tid = threadIdx.x, lane = tid & 31;
  const Share sh = my_share(tid >> 5);

  // every load of this warp's share first: weights and their scales, x chunks and scales
  uint4 q[CPL][R_ROWS];
  u32 sw[CPL][R_ROWS];
  load_share(q, sw, wp, ws, sh, lane);
#if PF_TARGETS && PF_AT == 0
  PF_ISSUE(*layer);
#endif
  uint4 xq[CPL][M_TOK];
  u32 sx[CPL][M_TOK];
#pragma unroll
  for (int i = 0; i < CPL; ++i) {
    const int c = sh.c0 + lane + 32 * i;
    const bool ok = sh.valid && c < sh.c1;
#pragma unroll
    for (int m = 0; m < M_TOK; ++m) {
      xq[i][m] = ok ? ld_act(xp + (size_t)m * (K_IN / 2) + c * 16) : make_uint4(0, 0, 0, 0);
      sx[i][m] = ok ? (u32) * (const u16*)(xs + (size_t)m * (K_IN / 16) + c * 2) : 0u;
    }
  }

  float acc[VP];
#pragma unroll
  for (int v = 0; v < VP; ++v) acc[v] = 0.f;
#pragma unroll
  for (int i = 0; i < CPL; ++i) {
    u32 xw[M_TOK][8];
    float2 sxf[M_TOK];
#pragma unroll
    for (int m = 0; m < M_TOK; ++m) {
      decode_s8(xw[m], xq[i][m]);
      sxf[m] = e4m3x2_to_float2(sx[i][m]);  // zero scales for masked chunks: adds 0
    }
    chunk_dot(acc, q[i], sw[i], xw, sxf);
  }
#if PF_TARGETS && PF_AT == 1
  PF_ISSUE(*layer);
#endif

  stream_epilogue(acc, red, lane, tid, sh.lg, sh.slice, sh.g, y, [&](int m, int n, float t) {
    return epi(res, m, n, (t * 0.25f) * (gw_of(wg, n) * xg[m]));
  });
  NORM_OUT_TAIL(*layer);
}

#endif  // X_BF16
#endif  // GEMV_STREAM

#endif  // QUANT_ONLY

#else  // W4A16

// fp16 of E2M1 code c, times 2^-14: magnitude bits (c & 7) -> fp16 bits 9..11, sign -> bit 15.
// Pair (element i, element i + 4) of a 32-bit word of 8 codes lands in (low, high) halves.
__device__ __forceinline__ u32 e2m1_pair_f16(u32 v, int i) {
  const u32 mag = i <= 2 ? (v << (9 - 4 * i)) : (v >> 3);
  const u32 sgn = i <= 2 ? (v << (12 - 4 * i)) : v;
  return (mag & 0x0E000E00u) | (sgn & 0x80008000u);
}

__device__ __forceinline__ float2 half2_to_float2(u32 h) {
  float lo, hi;
  asm("{ .reg .b16 l, u; mov.b32 {l, u}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, u; }"
      : "=f"(lo), "=f"(hi)
      : "r"(h));
  return make_float2(lo, hi);
}

// acc[r * M + m] += the 32-element dot of row r's chunk with token m's bf16 x at `elem`
// (x read through L1: every warp of the SM reads the same activations)
__device__ __forceinline__ void chunk_dot16(float (&acc)[VP], const uint4 (&q)[R_ROWS],
                                            const u32 (&s)[R_ROWS], const u16* x, int elem) {
#pragma unroll
  for (int r = 0; r < R_ROWS; ++r) {
    const u32 words[4] = {q[r].x, q[r].y, q[r].z, q[r].w};
    float w[32];  // element order, times 2^-14
#pragma unroll
    for (int c = 0; c < 4; ++c) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 f = half2_to_float2(e2m1_pair_f16(words[c], i));
        w[8 * c + i] = f.x;
        w[8 * c + i + 4] = f.y;
      }
    }
    const float2 sw = e4m3x2_to_float2(s[r]);
#pragma unroll
    for (int m = 0; m < M_TOK; ++m) {
      const u16* xr = x + (size_t)m * K_IN + elem;
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        const uint4 xa = ld_act(xr + 16 * b);
        const uint4 xb = ld_act(xr + 16 * b + 8);
        const u32 xw[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
        float dot = 0.f;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          dot = fmaf(w[16 * b + 2 * j], __uint_as_float(xw[j] << 16), dot);
          dot = fmaf(w[16 * b + 2 * j + 1], __uint_as_float(xw[j] & 0xFFFF0000u), dot);
        }
        acc[r * M_TOK + m] = fmaf(dot, b ? sw.y : sw.x, acc[r * M_TOK + m]);
      }
    }
  }
}

#if !GEMV_STREAM

extern "C" __global__ void __launch_bounds__(NTHREADS, MIN_CTAS)
    nvfp4_gemv_w4a16(const u16* __restrict__ x, const u8* __restrict__ wp_all,
                     const u8* __restrict__ ws_all, const float* __restrict__ wg_all,
                     const int* __restrict__ layer, u16* __restrict__ y) {
  const Layer lw = layer_of(wp_all, ws_all, wg_all, layer);
  const u8* __restrict__ wp = lw.wp;
  const u8* __restrict__ ws = lw.ws;
  const float* __restrict__ wg = lw.wg;
  extern __shared__ __align__(16) u8 smem[];
  float* ybuf = (float*)smem;  // [KPARTS][RPC][M]
  u8* ring = smem + ((KPARTS * RPC * M_TOK * 4 + 15) / 16) * 16;  // [warp][RING_D][slot]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g0 = (int)(((long long)blockIdx.x * NGROUPS) / GRID);
  const int g1 = (int)(((long long)(blockIdx.x + 1) * NGROUPS) / GRID);
  const int items = (g1 - g0) * KPARTS;

  run_units(ybuf, ring, wp, ws, g0, items, warp, lane, [] {},
            [&](float (&acc)[VP], const WTile& cur, int elem) {
              chunk_dot16(acc, cur.q, cur.s, x, elem);
            });
  __syncthreads();

  persistent_epilogue(ybuf, y, g0, g1, tid,
                      [&](int, int n, float t) { return (t * 16384.0f) * gw_of(wg, n); });
}

#else  // GEMV_STREAM

extern "C" __global__ void __launch_bounds__(NTHREADS)
    nvfp4_gemv_w4a16(const u16* __restrict__ x, const u8* __restrict__ wp_all,
                     const u8* __restrict__ ws_all, const float* __restrict__ wg_all,
                     const int* __restrict__ layer, u16* __restrict__ y) {
  const Layer lw = layer_of(wp_all, ws_all, wg_all, layer);
  const u8* __restrict__ wp = lw.wp;
  const u8* __restrict__ ws = lw.ws;
  const float* __restrict__ wg = lw.wg;
  __shared__ float red[KSPLIT > 1 ? GPB * KSPLIT * NV : 1];
  const int tid = threadIdx.x, lane = tid & 31;
  const Share sh = my_share(tid >> 5);
  uint4 q[CPL][R_ROWS];
  u32 sw[CPL][R_ROWS];
  load_share(q, sw, wp, ws, sh, lane);

  float acc[VP];
#pragma unroll
  for (int v = 0; v < VP; ++v) acc[v] = 0.f;
#pragma unroll
  for (int i = 0; i < CPL; ++i) {
    const int c = sh.c0 + lane + 32 * i;
    if (sh.valid && c < sh.c1) chunk_dot16(acc, q[i], sw[i], x, 32 * c);
  }

  stream_epilogue(acc, red, lane, tid, sh.lg, sh.slice, sh.g, y,
                  [&](int, int n, float t) { return (t * 16384.0f) * gw_of(wg, n); });
}

#endif  // GEMV_STREAM

#endif  // ACT_W4A4
