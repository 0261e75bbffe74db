// NVFP4 W4A4 GEMM on Hopper tensor cores (sm_90, mma.sync): y[M, N] = x[M, K] . W[N, K]^T, bf16.
//
// GEMM letters: M tokens (rows of x), N out features (rows of W), K in features.
// W is NVFP4 (rejax.nvfp4.Nvfp4Tensor): codes uint8 [N, K/2] (element 2j in the low nibble of
// byte j), E4M3 block scales uint8 [N, K/16], float32 global scale [] or per row [N], optionally
// stacked [L, ...] with a device int32 layer index (pointers are offset by the layer, nothing is
// copied). x arrives already dequantized without its global scale, x_hat = e2m1(code) * SFx, as
// fp16 [M, K] in the permuted K order described below: written by the quantizer kernel's x_hat
// form (nvfp4_quantize_bf16 with XHAT_OUT, in front of a fused linear), or built by XLA ops from
// rejax.nvfp4.quantize_activation's codes and scales (rejax.ops.linear.gemm_x_operand).
//
// Shape constants come in as -D at NVRTC time (cuda_ops/nvfp4_gemm.py plans them):
//   M_TOK, N_OUT, K_IN   problem size (K_IN % KT == 0; any M, N >= 1)
//   TM                   tokens per CTA tile (a multiple of 8 WM, <= 64 WM); grid x = ceil(M / TM)
//   WM                   warps along M (each takes TM / WM tokens; WM > 1 decodes a weight
//                        tile once per warp row, for large M where more warps per SM pay)
//   WR                   16-row weight tiles per warp; a CTA has NWARPS / WM warps along N, so
//                        it owns TILE_N = 16 * WR * NWARPS / WM rows: grid y = ceil(N / TILE_N)
//   KT                   K elements per pipeline stage (128 or 256)
//   STAGES               cp.async pipeline depth
//   SPLITK               K split across CTAs (grid z); > 1 writes float32 partials [SPLITK, M, N]
//                        that a second kernel, nvfp4_gemm_finish, adds in split order and
//                        scales (deterministic, no atomics, no counters to reset)
//   CLUSTER_RED          with SPLITK > 1: the SPLITK CTAs of a K split form one thread-block
//                        cluster (compile-time cluster dims) and add their partials through
//                        distributed shared memory, in split order: one kernel, bf16 out
//   GW_ROWS              the weight global scale is per row ([L, N]) instead of per matrix
//   EPI_RES              both entries take a bf16 residual res [M, N] after xg and store
//                        res + y (the decoder's residual add, XLA's bf16 add: the two bf16
//                        values added in fp32, rounded once); the partials are unchanged
//   STATIC_COPIES        the stage copies with compile-time trip counts (below); else loops
//                        whose trip count depends on the thread
//   MAX_REGS             > 0: registers per thread at most (__maxnreg__, in place of
//                        __launch_bounds__(NT)); the plan gives the most that keep its resident
//                        CTAs per SM
//
// Numerics (exact until the fp32 accumulation): a weight e2m1 * SFw has at most 6 significant
// bits and is a multiple of 2^-10 (at most 2688), so w' = e2m1 * SFw * 2^(W_SHIFT - 14) is exact
// in fp16 for W_SHIFT = 0..7 (normal or subnormal; the fp16 bit trick gives e2m1 * 2^-14 and the
// block scale is multiplied by 2^W_SHIFT first: with the default 7, w' is normal unless
// e2m1 * SFw < 2^-7, i.e. only with tiny block scales); x_hat = e2m1 * SFx (2^-10 .. 2688) is
// exact in fp16; the fp16 x fp16 products are exact in fp32 and the tensor cores add them in
// fp32. The epilogue multiplies by 2^(14 - W_SHIFT) (exact) and then by global_w[n] *
// global_x[m], and rounds once to bf16, like rejax.nvfp4.nvfp4_matmul_q (only the fp32
// summation order differs).
//
// Design: Y^T = W X^T, so weight rows are the mma's 16-row A operand (decoded in registers) and
// tokens its 8-wide B operand (m16n8k16, fp16 in, fp32 accumulate).
// * Each stage, the CTA copies TILE_N rows x KT/2 bytes of codes, TILE_N x KT/16 scale bytes and
//   TM tokens x KT x 2 bytes of x_hat global -> shared with 16-byte (codes, x) and 8-byte
//   (scales) cp.async, STAGES - 1 stages in flight; rows past N and tokens past M zero-fill.
//   The weights are read from HBM once per M tile (CTAs of the same weight tile are adjacent in
//   launch order, so further M tiles read them from L2).
// * Since every element is pre-scaled, the mma's 16 k need not be one NVFP4 block: any
//   permutation of K works if A and B use the same one. Lane (g = lane / 4, t = lane % 4) of a
//   warp reads one 16-byte chunk t (32 elements) of each of its rows g and g + 8 per 128-element
//   sub-chunk, i.e. 4 words of 8 codes. Word u yields the fragments of two mmas: the fp16 bit
//   trick turns nibbles (i, i + 4) of a word into one f16x2 register, P_i, for i = 0..3, and
//   mma 2u takes (P0, P1) of rows g, g + 8 as its A, mma 2u + 1 takes (P2, P3). The B operand of
//   lane (g, t) must hold x_hat at the same elements, in the order (e0, e4, e1, e5, e2, e6, e3,
//   e7) of word u: the host lays x_hat out so that these 8 values are 16 contiguous bytes, and
//   the 4 lanes t of one word u are adjacent (slot 4u + t of a 128-element sub-chunk):
//     x_perm[m, 128c + 32u + 8t + j] = x_hat[m, 128c + 32t + 8u + (j / 2) + 4 (j % 2)].
//   One word's block scale is byte (u / 2) of the lane's two scale bytes (blocks 2t, 2t + 1).
// * Shared-memory reads are bank-conflict free: code rows are 64 bytes per sub-chunk (a phase
//   of 8 lanes reads rows g, g + 1 = 128 contiguous bytes; with KT = 256 odd rows swap their two
//   64-byte halves), x_hat token rows are padded to a pitch of 64 mod 128 bytes.
// * No host allocation or sync, one launch: graph-safe.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;

#ifndef GW_ROWS
#define GW_ROWS 0
#endif
#ifndef KT
#define KT 128
#endif
#ifndef STAGES
#define STAGES 4
#endif
#ifndef SPLITK
#define SPLITK 1
#endif
#ifndef WM
#define WM 1
#endif
#ifndef CLUSTER_RED
#define CLUSTER_RED 0
#endif
#ifndef W_SHIFT
#define W_SHIFT 7
#endif
#ifndef EPI_RES
#define EPI_RES 0
#endif
#ifndef STATIC_COPIES
#define STATIC_COPIES 0
#endif
#ifndef MAX_REGS
#define MAX_REGS 0
#endif
static_assert(W_SHIFT >= 0 && W_SHIFT <= 7, "SFw * 2^W_SHIFT must stay below the fp16 max");
constexpr u32 W_SCALE2 = (u32)((15 + W_SHIFT) << 10) * 0x10001u;  // f16x2 (2^W_SHIFT, 2^W_SHIFT)
constexpr float W_UNSCALE = (float)(1 << (14 - W_SHIFT));
constexpr bool PARTIALS = SPLITK > 1 && !CLUSTER_RED;  // float32 partials for the finish kernel

constexpr int NT = NWARPS * 32;
constexpr int WN = NWARPS / WM;      // warps along N
constexpr int TILE_N = 16 * WR * WN;
constexpr int WT = TM / (8 * WM);    // 8-token mma tiles per warp
constexpr int SUB = KT / 128;        // 128-element sub-chunks per stage
constexpr int NKT = K_IN / KT;       // stages over the whole K
constexpr int W_PITCH = KT / 2;      // code bytes per row per stage
constexpr int S_PITCH = KT / 16;     // scale bytes per row per stage
constexpr int X_PITCH = KT * 2 + 64; // x_hat bytes per token per stage, padded (64 mod 128)
constexpr int W_BYTES = TILE_N * W_PITCH;
constexpr int S_BYTES = TILE_N * S_PITCH;
constexpr int X_BYTES = TM * X_PITCH;
constexpr int STAGE_BYTES = W_BYTES + S_BYTES + X_BYTES;

static_assert(KT == 128 || KT == 256, "KT must be 128 or 256");
static_assert(K_IN % KT == 0, "K must be a multiple of KT");
static_assert(NWARPS % WM == 0, "WM must divide NWARPS");
static_assert(TM % (8 * WM) == 0 && WT >= 1 && WT <= 8, "TM / WM must be 8, 16, ..., 64");
static_assert(STAGES >= 2, "the pipeline needs two stages");
static_assert(SPLITK >= 1 && SPLITK <= NKT, "SPLITK must be in 1..K/KT");
static_assert(!CLUSTER_RED || (SPLITK > 1 && SPLITK <= 8), "a cluster holds 2..8 CTAs");
constexpr int RED_PITCH = TILE_N + 4;  // float32 partial tile [TM][TILE_N] (+4: no conflicts)
#ifdef SMEM_BYTES  // the launch's dynamic shared memory (the host plans it)
static_assert(STAGES * STAGE_BYTES <= SMEM_BYTES, "the pipeline must fit in shared memory");
static_assert(!CLUSTER_RED || TM * RED_PITCH * 4 <= SMEM_BYTES, "the partial tile must fit");
#endif
static_assert(W_BYTES % 16 == 0 && S_BYTES % 16 == 0, "stage parts must stay 16-byte aligned");

// ---------------------------------------------------------------------------- small helpers

#include "gemm_common.cuh"

template <int PENDING>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(PENDING));
}

__device__ __forceinline__ float bf16f(u16 h) { return __uint_as_float((u32)h << 16); }

// the value stored at y[m, n]: the GEMM's y, plus the residual with EPI_RES (y rounded to bf16
// first, as the bf16 output an XLA add would read)
__device__ __forceinline__ float epi(const u16* res, int m, int n, float y) {
  if constexpr (EPI_RES) return bf16f(res[(size_t)m * N_OUT + n]) + bf16f(f32_to_bf16(y));
  return y;
}

__device__ __forceinline__ void mma16816(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                         u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// 16-byte chunk c of code row r inside a stage: with KT = 256 odd rows swap their two 64-byte
// halves, so the 8 lanes of a shared-memory phase (rows g, g + 1) hit different banks
__device__ __forceinline__ int wchunk(int r, int c) { return SUB == 2 ? c ^ ((r & 1) << 2) : c; }

// ---------------------------------------------------------------------------- pipeline

#if STATIC_COPIES
// The stage copies with compile-time trip counts (gemm_common.cuh's copy_pieces): the same bytes
// land in the same places as the loops below. Faster from 16-token tiles on; slower at 8 tokens,
// for reasons not yet measured (nvfp4_gemm.py, COPIES).
__device__ __forceinline__ void load_stage(u32 st, int kt, const u8* wp, const u8* ws,
                                           const u8* xh, int n0, int m0, int tid) {
  const u32 sw = st, ss = st + W_BYTES, sx = st + W_BYTES + S_BYTES;
  constexpr bool M_FULL = M_TOK % TM == 0;
  load_weight_stage_static<TILE_N, NT, N_OUT, K_IN, KT>(sw, ss, kt, wp, ws, n0, tid,
                                                        [](int r, int c) { return wchunk(r, c); });
  constexpr int XCH = KT * 2 / 16;  // 16-byte x_hat chunks per token
  copy_pieces<TM * XCH, XCH, NT>(tid, [&](int r, int c) {
    const int m = m0 + r;
    const bool ok = M_FULL || m < M_TOK;
    const u8* src = xh + (size_t)(ok ? m : 0) * (K_IN * 2) + (size_t)kt * (KT * 2) + c * 16;
    cp16(sx + r * X_PITCH + c * 16, src, ok);
  });
}
#else
__device__ __forceinline__ void load_stage(u32 st, int kt, const u8* wp, const u8* ws,
                                           const u8* xh, int n0, int m0, int tid) {
  const u32 sw = st, ss = st + W_BYTES, sx = st + W_BYTES + S_BYTES;
  load_weight_stage<TILE_N, NT, N_OUT, K_IN, KT>(sw, ss, kt, wp, ws, n0, tid,
                                                 [](int r, int c) { return wchunk(r, c); });
  constexpr int XCH = KT * 2 / 16;  // 16-byte x_hat chunks per token
#pragma unroll
  for (int i = tid; i < TM * XCH; i += NT) {
    const int r = i / XCH, c = i % XCH, m = m0 + r;
    const bool ok = m < M_TOK;
    const u8* src = xh + (size_t)(ok ? m : 0) * (K_IN * 2) + (size_t)kt * (KT * 2) + c * 16;
    cp16(sx + r * X_PITCH + c * 16, src, ok);
  }
}
#endif  // STATIC_COPIES

__device__ __forceinline__ void compute_stage(u32 st, float (&acc)[WR][WT][4], int wn, int wm,
                                              int lane) {
  const int g = lane >> 2, t = lane & 3;
  const u32 sw = st, ss = st + W_BYTES, sx = st + W_BYTES + S_BYTES;
#pragma unroll
  for (int h = 0; h < SUB; ++h) {
    uint4 wa[WR], wb[WR];
    u32 sa[WR], sb[WR];
#pragma unroll
    for (int r = 0; r < WR; ++r) {
      const int ra = (wn * WR + r) * 16 + g, rb = ra + 8;
      wa[r] = lds128(sw + ra * W_PITCH + wchunk(ra, 4 * h + t) * 16);
      wb[r] = lds128(sw + rb * W_PITCH + wchunk(rb, 4 * h + t) * 16);
      sa[r] = hmul2(e4m3x2_to_f16x2(lds16(ss + ra * S_PITCH + 8 * h + 2 * t)), W_SCALE2);
      sb[r] = hmul2(e4m3x2_to_f16x2(lds16(ss + rb * S_PITCH + 8 * h + 2 * t)), W_SCALE2);
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      uint4 xb[WT];
#pragma unroll
      for (int j = 0; j < WT; ++j)
        xb[j] = lds128(sx + ((wm * WT + j) * 8 + g) * X_PITCH + h * 256 + (4 * u + t) * 16);
      const u32 sel = u < 2 ? 0x1010u : 0x3232u;  // this word's block scale in both halves
#pragma unroll
      for (int r = 0; r < WR; ++r) {
        u32 p[4], q[4];
        decode8(word(wa[r], u), prmt(sa[r], 0u, sel), p);
        decode8(word(wb[r], u), prmt(sb[r], 0u, sel), q);
#pragma unroll
        for (int j = 0; j < WT; ++j) {
          mma16816(acc[r][j], p[0], q[0], p[1], q[1], xb[j].x, xb[j].y);
          mma16816(acc[r][j], p[2], q[2], p[3], q[3], xb[j].z, xb[j].w);
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------- kernel

// xh: fp16 x_hat [M, K] (permuted, see above); xg: float32 [M] activation global scales;
// res (EPI_RES only): bf16 [M, N]; wp / ws / wg: weight codes, scales, global scales (stacked);
// layer: int32 []; out: bf16 [M, N] (SPLITK == 1, or the cluster reduction) or float32 partial
// sums [SPLITK, M, N] without the global scales and 2^(14 - W_SHIFT) (res is then read by
// nvfp4_gemm_finish only).
#if CLUSTER_RED
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;"
               ::: "memory");
}

// this shared-memory address in the CTA of cluster rank `rank`
__device__ __forceinline__ u32 map_rank(u32 addr, u32 rank) {
  u32 r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}

__device__ __forceinline__ float ld_cluster(u32 addr) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(addr));
  return v;
}
#define CLUSTER_DIMS __cluster_dims__(1, 1, SPLITK)
#else
#define CLUSTER_DIMS
#endif

#if MAX_REGS > 0
#define GEMM_BOUNDS __maxnreg__(MAX_REGS)
#else
#define GEMM_BOUNDS __launch_bounds__(NT)
#endif

extern "C" __global__ void CLUSTER_DIMS GEMM_BOUNDS
    nvfp4_gemm_w4a4(const u16* __restrict__ xh, const float* __restrict__ xg,
#if EPI_RES
                    const u16* __restrict__ res,
#endif
                    const u8* __restrict__ wp, const u8* __restrict__ ws,
                    const float* __restrict__ wg, const int* __restrict__ layer, void* out) {
#if !EPI_RES
  const u16* const res = nullptr;  // no residual operand: epi() is the GEMM's value
#endif
  extern __shared__ __align__(128) u8 smem[];
  const int tid = threadIdx.x, lane = tid & 31, wn = (tid >> 5) % WN, wm = (tid >> 5) / WN;
  const int m0 = blockIdx.x * TM, n0 = blockIdx.y * TILE_N, z = blockIdx.z;
  const size_t l = (size_t)(unsigned)*layer;
  wp += l * N_OUT * (size_t)(K_IN / 2);
  ws += l * N_OUT * (size_t)(K_IN / 16);
  wg += l * (GW_ROWS ? N_OUT : 1);
  const u8* x8 = reinterpret_cast<const u8*>(xh);
  const int kt0 = z * NKT / SPLITK, nk = (z + 1) * NKT / SPLITK - kt0;
  const u32 s0 = smem_u32(smem);

  float acc[WR][WT][4];
#pragma unroll
  for (int r = 0; r < WR; ++r)
#pragma unroll
    for (int j = 0; j < WT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[r][j][e] = 0.f;

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < nk) load_stage(s0 + s * STAGE_BYTES, kt0 + s, wp, ws, x8, n0, m0, tid);
    cp_commit();
  }
  for (int i = 0; i < nk; ++i) {
    cp_wait<STAGES - 2>();
    __syncthreads();  // stage i landed for every thread; stage i - 1 is free again
    const int next = i + STAGES - 1;
    if (next < nk)
      load_stage(s0 + (next % STAGES) * STAGE_BYTES, kt0 + next, wp, ws, x8, n0, m0, tid);
    cp_commit();
    compute_stage(s0 + (i % STAGES) * STAGE_BYTES, acc, wn, wm, lane);
  }

  // accumulator e of tile (r, j): row g + 8 * (e / 2), token 2t + (e % 2)
  const int g = lane >> 2, t = lane & 3;
#if CLUSTER_RED
  // Each CTA parks its partial tile in its own shared memory; after a cluster barrier CTA z
  // adds slice z of the tile over the cluster's CTAs in rank (= split) order and stores it.
  cp_wait<0>();
  __syncthreads();  // every stage consumed: the pipeline's shared memory is free
  float* red = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int r = 0; r < WR; ++r)
#pragma unroll
    for (int e = 0; e < 4; ++e)
#pragma unroll
      for (int j = 0; j < WT; ++j) {
        const int nl = (wn * WR + r) * 16 + g + 8 * (e >> 1);
        const int ml = (wm * WT + j) * 8 + 2 * t + (e & 1);
        red[ml * RED_PITCH + nl] = acc[r][j][e];
      }
  cluster_sync();
  constexpr int ELEMS = TM * TILE_N;
  const int lo = z * ELEMS / SPLITK, hi = (z + 1) * ELEMS / SPLITK;
  for (int i = lo + tid; i < hi; i += NT) {
    const int ml = i / TILE_N, nl = i % TILE_N, m = m0 + ml, n = n0 + nl;
    const u32 addr = s0 + (u32)(ml * RED_PITCH + nl) * 4u;
    float a = ld_cluster(map_rank(addr, 0));
#pragma unroll
    for (int sr = 1; sr < SPLITK; ++sr) a += ld_cluster(map_rank(addr, sr));
    if (m < M_TOK && n < N_OUT) {
      const float alpha = wg[GW_ROWS ? n : 0] * xg[m];
      static_cast<u16*>(out)[(size_t)m * N_OUT + n] =
          f32_to_bf16(epi(res, m, n, a * W_UNSCALE * alpha));
    }
  }
  cluster_sync();  // no CTA leaves while others still read its shared memory
#else
#pragma unroll
  for (int r = 0; r < WR; ++r) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int n = n0 + (wn * WR + r) * 16 + g + 8 * (e >> 1);
      if (n >= N_OUT) continue;
      const float gw = wg[GW_ROWS ? n : 0];
#pragma unroll
      for (int j = 0; j < WT; ++j) {
        const int m = m0 + (wm * WT + j) * 8 + 2 * t + (e & 1);
        if (m >= M_TOK) continue;
        if constexpr (!PARTIALS) {
          const float alpha = gw * xg[m];
          const float y = acc[r][j][e] * W_UNSCALE * alpha;
          static_cast<u16*>(out)[(size_t)m * N_OUT + n] = f32_to_bf16(epi(res, m, n, y));
        } else {
          static_cast<float*>(out)[((size_t)z * M_TOK + m) * N_OUT + n] = acc[r][j][e];
        }
      }
    }
  }
#endif
}

// Split-K epilogue (SPLITK > 1), one thread per output: the partials added in split order, then
// the main kernel's epilogue. part: float32 [SPLITK, M, N]; res (EPI_RES): bf16 [M, N];
// y: bf16 [M, N].
extern "C" __global__ void __launch_bounds__(256)
    nvfp4_gemm_finish(const float* __restrict__ part, const float* __restrict__ xg,
#if EPI_RES
                      const u16* __restrict__ res,
#endif
                      const float* __restrict__ wg, const int* __restrict__ layer, u16* y) {
#if !EPI_RES
  const u16* const res = nullptr;
#endif
  constexpr size_t MN = (size_t)M_TOK * N_OUT;
  const size_t i = (size_t)blockIdx.x * 256 + threadIdx.x;
  if (i >= MN) return;
  const int m = (int)(i / N_OUT), n = (int)(i % N_OUT);
  wg += (size_t)(unsigned)*layer * (GW_ROWS ? N_OUT : 1);
  float acc = part[i];
#pragma unroll
  for (int s = 1; s < SPLITK; ++s) acc += part[s * MN + i];
  const float alpha = wg[GW_ROWS ? n : 0] * xg[m];
  y[i] = f32_to_bf16(epi(res, m, n, acc * W_UNSCALE * alpha));
}
