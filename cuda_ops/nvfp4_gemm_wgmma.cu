// NVFP4 W4A4 GEMM on Hopper warpgroup tensor cores (sm_90a, wgmma.mma_async), for many rows:
// y[M, N] = x[M, K] . W[N, K]^T, bf16. A variant of nvfp4_gemm.cu (read its header first: the
// operands, the numerics and the decode are the same); only the MMA, the x_hat order and the
// shared-memory layout of the x_hat tile differ. Host side: nvfp4_gemm_wgmma.py. The model's
// GEMM from 128 to 2048 rows (GemmOptions.wgmma_min_m / wgmma_max_m) with 128-token tiles and
// BULK 3: each weight decoded once per tile; with 8-64-token tiles it measured slower than
// nvfp4_gemm.cu unless BULK 1 (experiments/KERNEL_NOTES.md).
//
// GEMM letters: M tokens (rows of x), N out features (rows of W), K in features. W is NVFP4
// (codes uint8 [N, K/2], E4M3 block scales uint8 [N, K/16], float32 global scale [] or per row
// [N], optionally stacked [L, ...] with a device int32 layer index). x arrives as fp16 x_hat =
// e2m1(code) * SFx [M, K], exact, in the WGMMA K ORDER below (not the production kernel's).
//
// Shape constants (-D, planned by nvfp4_gemm_wgmma.py):
//   M_TOK, N_OUT, K_IN   problem size (K_IN % KT == 0; any M, N >= 1)
//   TM                   tokens per CTA tile = the wgmma N (8, 16, 32, 64, 128 or 256); grid x =
//                        ceil(M / TM). 128 and 256 (64 / 128 accumulators a thread a tile) decode
//                        each weight once per 128 / 256 tokens: the large-M (prefill) variant
//   WR                   64-row weight tiles per warpgroup (one m64nTMk16 wgmma each per k16 step)
//   NWG                  warpgroups per CTA (4 warps each): TILE_N = 64 * WR * NWG rows,
//                        grid y = ceil(N / TILE_N)
//   KT                   K elements per pipeline stage (128 or 256)
//   STAGES               shared-memory ring depth (>= 3): STAGES - 2 stages are loaded ahead of
//                        the one computed, one slot is slack for the wgmmas still reading it
//   SPLITK               K split across CTAs (grid z); > 1 writes float32 partials [SPLITK, M, N]
//                        that nvfp4_gemm_finish adds in split order and scales (as production)
//   GW_ROWS, W_SHIFT     as in production
//   DESC_SWAP            diagnostic only: swap the descriptor's two byte offsets (see below)
//   MIN_BLOCKS           __launch_bounds__ minimum CTAs per SM (register cap), default 1
//   RASTER               the order CTAs take tiles (cta_tile below): 0 (default) grid x the token
//                        tile, y the weight tile, so CTAs launched together run every token
//                        tile of a few weight tiles and reread all of x_hat each wave; G > 0
//                        walks groups of G token tiles, every weight tile within a group, so
//                        the CTAs resident at once share G x_hat tiles in L2 (the same tiles,
//                        the same bits; an experiment for M in the thousands)
//   GROUP_WORDS          code words (2 k16 steps each) per wgmma commit group: 1 (default), 2, 4
//                        (4 measured 2-7% slower than 1 on an H100, experiments/KERNEL_NOTES.md)
//   STATIC_COPIES        the stage copies with compile-time trip counts (gemm_common.cuh's
//                        copy_pieces; the x tile's where the CTA's threads divide its chunks
//                        evenly): unrolled, affine addresses. 0: loops from each thread's index
//                        (the form first measured; about 2.3x the instructions a stage at TM 128)
//   BULK                 the stage copies on mbarriers, no block barrier in the K loop (KT 128):
//                        1: every operand arrives PRE-TILED (below) and thread 0 fills each
//                        ring slot with three cp.async.bulk copies on its "full" mbarrier; the
//                        warps wait on its phase and hand the slot back through an "empty"
//                        mbarrier (one arrival a warp). 3 (the model's): only x_hat pre-tiled
//                        (thread 0's bulk copy); the weights' 16 / 8-byte pieces copied with
//                        cp.async by every thread as BULK 0 does, joining the phase through
//                        cp.async.mbarrier.arrive. 0: every thread copies 16-byte pieces with
//                        cp.async, a __syncthreads a stage. (A form with a bulk copy per
//                        weight row lost: experiments/KERNEL_NOTES.md.)
//
// Numerics: identical to production. w' = e2m1 * SFw * 2^(W_SHIFT - 14) and x_hat are exact in
// fp16, every product is exact in fp32, the tensor cores add in fp32 (only the order of the
// fp32 additions differs from mma.sync), the epilogue multiplies by 2^(14 - W_SHIFT) then by
// global_w[n] * global_x[m] and rounds once to bf16.
//
// Design: Y^T = W X^T. A warpgroup (warps q = 0..3) owns WR tiles of 64 weight rows; warp q
// decodes rows 16q .. 16q + 15 of each tile into registers exactly as a production warp decodes
// its 16-row tile, and the four warps' m16n8k16-style A fragments stacked ARE the register A
// fragment of wgmma.m64nNk16 (thread (g = lane / 4, t = lane % 4) of warp q holds A[16q + g]
// [2t, 2t+1], A[16q + g + 8][2t, 2t+1], A[16q + g][2t+8, 2t+9], A[16q + g + 8][2t+8, 2t+9]).
// The tokens are the wgmma's N (B, from shared memory through a matrix descriptor).
// * The K order. Lane (g, t) reads the 16-byte code chunk t (32 elements) of its rows per
//   128-element sub-chunk c; word u (u = 0..3, elements 32t + 8u .. + 7) decodes to the f16x2
//   pairs P_i = (e_i, e_{i+4}), i = 0..3 (decode8, as production). k16 step s = 2u + v (v = 0, 1)
//   of sub-chunk c takes (P_{2v}, P_{2v+1}) of rows g, g + 8 as its four A registers, so its
//   logical k = 8b + 2t + j (b, j in {0, 1}) is the physical element
//     p(c, s, k) = 128c + 32t + 8u + 2v + b + 4j.
//   The B operand must hold x_hat in that logical order, and a wgmma core matrix row is 8
//   consecutive logical k (16 bytes) of one token, so the host stores
//     x_w[m, 128c + 16s + 8b + 2t + j] = x_hat[m, 128c + 32t + 8u + 2v + b + 4j]
//   (a permutation inside each 128-element chunk: nvfp4_gemm_wgmma.to_wgmma_order; the
//   production order interleaves the 4 lanes' pairs differently and cannot serve as B).
// * The x_hat tile in shared memory: K-major, NO swizzle ("interleave"): 8 x 16-byte core
//   matrices (8 tokens x 8 logical k, rows of 16 bytes, 128 contiguous bytes). Column q (8
//   logical k, q = 0 .. KT/8 - 1) of token m sits at
//     off(m, q) = q * (16 TM) + (m / 8) * 128 + (m % 8) * 16
//   so a k16 step sigma (q = 2 sigma, 2 sigma + 1) is one contiguous 32 TM-byte block. In the
//   PTX ISA's canonical K-major no-swizzle layout ((8,n),(8,2)):((8 el, SBO),(1 el, LBO)) that is
//     LBO (leading dimension byte offset: between the two core matrices along K) = 16 TM bytes
//     SBO (stride dimension byte offset: between 8-token groups along N)           = 128 bytes
//   descriptor: bits 0-13 start address >> 4, 16-29 LBO >> 4, 32-45 SBO >> 4, 49-51 base offset
//   0, 62-63 swizzle 0 (none). Step sigma's descriptor = the stage's x tile + 32 TM sigma bytes.
//   cp.async fills it with 16-byte chunks, 8 consecutive threads taking the 8 tokens of one
//   core matrix (column q of one 8-token group: 128 contiguous bytes per 8 lanes, no bank
//   conflicts; the wgmma reads whole 128-byte core matrices).
//   A global x_w row is the stage's KT logical k in steps: columns q of a stage are the 16-byte
//   chunks KT/8 * kt + q of the row, so the copy is a plain 16-byte gather (no repacking).
// * Weight codes and scales: the production stage layout (64-byte code rows per sub-chunk,
//   KT = 256 swaps odd rows' halves), read with the production lanes' pattern (conflict free).
// * Per stage, per 128-element sub-chunk, per word u (two k16 steps):
//     decode word u of all WR tiles (8 A registers per tile);
//     wgmma.fence;                       (orders the new A registers before the wgmmas read them)
//     2 x WR wgmma.mma_async (v = 0, 1; same-shape accumulator chains need no fence in between);
//     wgmma.commit_group; wgmma.wait_group 1;
//   so at most one group is in flight while the next word is decoded. The A registers of an
//   in-flight wgmma must not be rewritten before a wait_group covering it; they are fresh
//   values in the PTX and ptxas keeps their physical registers until that wait (where it
//   cannot, it serializes the wgmmas and says so: warning C7515, which the CPU test forbids).
//   The SASS (sm_90a) shows ptxas hoisting most of a sub-chunk's decode ahead of its HGMMAs.
// * Stage ring: at iteration i, cp.async.wait_group (stage i landed), fence.proxy.async (the
//   generic-proxy cp.async writes become visible to the async proxy that wgmma reads through),
//   __syncthreads, then stage i + STAGES - 2 is loaded into the slot that stage i - 2 used: every
//   warpgroup's wgmmas of stage i - 2 completed at its last wait_group 1 of stage i - 1, before
//   this barrier. After the loop wait_group 0, then the accumulators are pinned after the wait
//   (empty volatile asm) before the epilogue reads them.
// * BULK: each piece a bulk copy takes is contiguous in global memory, its shared-memory
//   image. x_hat: [ceil(M / TM), K / KT, TM * KT] fp16 (nvfp4_gemm_wgmma.to_stage_tiles of the
//   wgmma-order x_hat; the tile's rows past M are zeros). BULK 1, codes and scale bytes:
//   [L][ceil(N / TILE_N)][K / KT][TILE_N][KT / 2 or KT / 16] (weight_stage_tiles; rows past N
//   zero). Ring slot s has full[s] and empty[s]. full[s] takes thread 0's arrival with
//   expect_tx of the stage's bulk bytes (BULK 1 all of STAGE_BYTES, BULK 3 the x tile's), then
//   the copies' bytes; with BULK 3 also every thread's cp.async arrival. empty[s] takes 4 NWG
//   arrivals: lane 0 of each warp after its first wait_group of the NEXT stage, which retires
//   every wgmma of this one (its shared loads of the stage came before them). At iteration i
//   every warp waits for empty of the slot that stage i - 2 used, the warps refill it with
//   stage i + STAGES - 2, then wait for full of stage i: a warp waits only for the others to
//   be one group into stage i - 1. mbarrier completion makes the bulk and cp.async writes
//   visible to both the shared loads and wgmma. The waits exit on a warp vote and the
//   one-thread parts are predicated: a divergent branch between a wgmma and its wait makes
//   ptxas serialize the wgmmas (C7518).
// * Accumulators: wgmma m64nTMk16 f32 D fragment, TM / 2 floats per thread per tile: d[4j + e] is
//   row 16q + g + 8 (e / 2), token 8j + 2t + (e % 2) (j < TM / 8), i.e. production's acc[r][j][e].

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

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
#ifndef WR
#define WR 1
#endif
#ifndef NWG
#define NWG 1
#endif
#ifndef W_SHIFT
#define W_SHIFT 7
#endif
#ifndef DESC_SWAP
#define DESC_SWAP 0
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 1
#endif
#ifndef GROUP_WORDS
#define GROUP_WORDS 1
#endif
#ifndef RASTER
#define RASTER 0
#endif
static_assert(RASTER >= 0, "RASTER: 0, or the token tiles of a group");
static_assert(GROUP_WORDS == 1 || GROUP_WORDS == 2 || GROUP_WORDS == 4, "GROUP_WORDS: 1, 2 or 4");
// PIPE: commit groups a warpgroup keeps in flight while it decodes the next word. 1 (default):
// wait_group 1 after every commit. 2: wait_group 2 after the commits inside a stage, 1 after
// its first and last group, so that no group of the previous stage is in flight past the
// loop's back edge (where ptxas may reuse its A registers; see one_group_stage) and the
// release of a stage's slot still follows the next stage's first wait. Needs >= 3 groups a
// stage (GROUP_WORDS 1, or 2 with KT 256).
#ifndef PIPE
#define PIPE 1
#endif
static_assert(PIPE == 1 || (PIPE == 2 && 4 * (KT / 128) / GROUP_WORDS >= 3),
              "PIPE: 1, or 2 with three or more commit groups a stage");
#ifndef STATIC_COPIES
#define STATIC_COPIES 0
#endif
#ifndef BULK
#define BULK 0
#endif
static_assert(BULK == 0 || ((BULK == 1 || BULK == 3) && KT == 128), "BULK: 0, or 1 / 3 with KT 128");
static_assert(W_SHIFT >= 0 && W_SHIFT <= 7, "SFw * 2^W_SHIFT must stay below the fp16 max");
constexpr u32 W_SCALE2 = (u32)((15 + W_SHIFT) << 10) * 0x10001u;  // f16x2 (2^W_SHIFT, 2^W_SHIFT)
constexpr float W_UNSCALE = (float)(1 << (14 - W_SHIFT));
constexpr bool PARTIALS = SPLITK > 1;  // float32 partials for the finish kernel

constexpr int NT = 128 * NWG;
constexpr int TILE_N = 64 * WR * NWG;
constexpr int NACC = TM / 2;         // accumulator floats per thread per 64-row tile
constexpr int SUB = KT / 128;        // 128-element sub-chunks per stage
constexpr int NKT = K_IN / KT;       // stages over the whole K
constexpr int W_PITCH = KT / 2;      // code bytes per row per stage
constexpr int S_PITCH = KT / 16;     // scale bytes per row per stage
constexpr int W_BYTES = TILE_N * W_PITCH;
constexpr int S_BYTES = TILE_N * S_PITCH;
constexpr int X_COL = TM * 16;       // one 8-k column of the x tile (all tokens): the LBO
constexpr int X_STEP = 2 * X_COL;    // one k16 step of the x tile
constexpr int X_BYTES = TM * KT * 2;
constexpr int STAGE_BYTES = W_BYTES + S_BYTES + X_BYTES;
constexpr int N_TILES = (N_OUT + TILE_N - 1) / TILE_N;
constexpr int BAR_BYTES = BULK ? 16 * STAGES : 0;  // BULK: full[STAGES], empty[STAGES] after the ring
constexpr u32 DESC_LBO = DESC_SWAP ? 128u : (u32)X_COL;
constexpr u32 DESC_SBO = DESC_SWAP ? (u32)X_COL : 128u;

static_assert(TM == 8 || TM == 16 || TM == 32 || TM == 64 || TM == 128 || TM == 256,
              "TM (the wgmma N) must be 8/16/32/64/128/256");
static_assert(KT == 128 || KT == 256, "KT must be 128 or 256");
static_assert(K_IN % KT == 0, "K must be a multiple of KT");
static_assert(WR >= 1 && WR <= 2 && NWG >= 1 && NWG <= 2, "WR and NWG must be 1 or 2");
static_assert(STAGES >= 3, "the ring needs a slack slot for the wgmmas in flight");
static_assert(SPLITK >= 1 && SPLITK <= NKT, "SPLITK must be in 1..K/KT");
static_assert((W_BYTES + S_BYTES) % 128 == 0 && STAGE_BYTES % 128 == 0,
              "the x tile must stay 128-byte aligned");
static_assert(STAGES * STAGE_BYTES < (1 << 18), "descriptor addresses have 18 bits");
#ifdef SMEM_BYTES  // the launch's dynamic shared memory (the host plans it)
static_assert(STAGES * STAGE_BYTES + BAR_BYTES <= SMEM_BYTES,
              "the pipeline must fit in shared memory");
#endif

// GROUP_WORDS == 4 at KT == 128 makes a stage ONE commit group, so the group in flight during a
// decode (wait_group 1) is the previous stage's, and in the rolled stage loop both are the same
// PTX registers: writing the A registers of an in-flight wgmma is undefined (PTX ISA), and ptxas
// does reuse them (and more) right after the back edge (SASS: the next stage's address and
// decode writes land in the in-flight HGMMAs' A registers; device: NaN outputs). Two remedies:
//   1  the stage loop unrolled by two: even and odd stages decode into two register sets, one
//      group still in flight during each decode (2 x 32 WR A registers besides the WR x NACC
//      accumulators; used where that stays within about 192)
//   2  wait_group 0 at the end of each stage: no own group in flight during a decode (one set)
// 0: several groups a stage (GROUP_WORDS 1 or 2, or KT 256): consecutive groups are distinct
// unrolled code, hence distinct registers. (A function, not a constant: no PTX global.)
constexpr int one_group_stage() {
  return GROUP_WORDS != 4 * SUB ? 0 : WR * (NACC + 64) <= 192 ? 1 : 2;
}

// ---------------------------------------------------------------------------- small helpers

#include "gemm_common.cuh"
#include "mbarrier.cuh"  // BULK's ring barriers and copies

template <int PENDING>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory");
}

// this thread's completed generic-proxy writes to shared memory become visible to the async
// proxy (the wgmma operand reads)
__device__ __forceinline__ void fence_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// 16-byte chunk c of code row r inside a stage (production's layout)
__device__ __forceinline__ int wchunk(int r, int c) { return SUB == 2 ? c ^ ((r & 1) << 2) : c; }

// ---------------------------------------------------------------------------- wgmma

__device__ __forceinline__ void wg_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wg_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int PENDING>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(PENDING) : "memory");
}

// the matrix descriptor of the x tile at shared address `addr` (K-major, no swizzle)
__device__ __forceinline__ u64 x_desc(u32 addr) {
  return (u64)((addr & 0x3FFFFu) >> 4) | ((u64)(DESC_LBO >> 4) << 16) |
         ((u64)(DESC_SBO >> 4) << 32);
}

// This CTA's token tile mt and weight tile nt (RASTER in the header). RASTER G: the linear CTA
// index p = x + y * X (X = ceil(M / TM) token tiles, Y weight tiles) walks groups of G token
// tiles (the last group may be smaller: s of them); inside group g, r = p - g * G * Y gives
// mt = g * G + r % s and nt = r / s. A bijection onto the X x Y tiles (nvfp4_gemm_wgmma.
// raster_tiles is the same map in Python; tests check it is one).
__device__ __forceinline__ void cta_tile(int& mt, int& nt) {
  if constexpr (RASTER == 0) {
    mt = blockIdx.x;
    nt = blockIdx.y;
  } else {
    const int tiles_m = gridDim.x, tiles_n = gridDim.y;
    const int p = blockIdx.x + blockIdx.y * tiles_m, per_group = RASTER * tiles_n;
    const int g = p / per_group, first = g * RASTER;
    const int size = min(tiles_m - first, RASTER), r = p - g * per_group;
    mt = first + r % size;
    nt = r / size;
  }
}

// keeps the compiler from moving reads of an accumulator above the wgmma wait before it
__device__ __forceinline__ void pin(float& f) { asm volatile("" : "+f"(f)::"memory"); }

// D[64 x TM] += A[64 x 16] (registers, fp16) . B[16 x TM] (shared memory, fp16, descriptor),
// fp32 accumulators d (the "+f" outputs %0 .. %(TM/2 - 1)), then a0..a3, desc and scale-d
#define ACC4(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define ACC8(i) ACC4(i), ACC4(i + 4)
#define ACC16(i) ACC8(i), ACC8(i + 8)
#define ACC32(i) ACC16(i), ACC16(i + 16)
#define ACC64(i) ACC32(i), ACC32(i + 32)
__device__ __forceinline__ void wgmma_rs(float (&d)[NACC], u32 a0, u32 a1, u32 a2, u32 a3,
                                         u64 desc) {
  if constexpr (TM == 8) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {"
                 "%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, %8, p, 1, 1, 0;\n}"
                 : ACC4(0)
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(1));
  } else if constexpr (TM == 16) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7}, "
                 "{%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}"
                 : ACC8(0)
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(1));
  } else if constexpr (TM == 32) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, "
                 "%8, %9, %10, %11, %12, %13, %14, %15}, "
                 "{%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}"
                 : ACC16(0)
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(1));
  } else if constexpr (TM == 64) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, "
                 "%8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, "
                 "%24, %25, %26, %27, %28, %29, %30, %31}, "
                 "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}"
                 : ACC16(0), ACC16(16)
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(1));
  } else if constexpr (TM == 128) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
                 "{%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}"
                 : ACC64(0)
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(1));
  } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
                 "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
                 "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
                 "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
                 "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
                 "{%128, %129, %130, %131}, %132, p, 1, 1, 0;\n}"
                 : ACC64(0), ACC64(64)
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(1));
  }
}

// ---------------------------------------------------------------------------- pipeline

__device__ __forceinline__ void load_stage(u32 st, int kt, const u8* wp, const u8* ws,
                                           const u8* xh, int n0, int m0, int tid) {
  const u32 sw = st, ss = st + W_BYTES, sx = st + W_BYTES + S_BYTES;
  if constexpr (STATIC_COPIES) {
    load_weight_stage_static<TILE_N, NT, N_OUT, K_IN, KT>(
        sw, ss, kt, wp, ws, n0, tid, [](int r, int c) { return wchunk(r, c); });
  } else {
    load_weight_stage<TILE_N, NT, N_OUT, K_IN, KT>(sw, ss, kt, wp, ws, n0, tid,
                                                   [](int r, int c) { return wchunk(r, c); });
  }
  // x tile: chunk i is token 8 * mg + (i % 8), column q (8 logical k): 8 consecutive threads
  // write one 128-byte run of a core-matrix column
  constexpr int XCH = KT / 8;  // 16-byte x_hat chunks per token
  if constexpr (STATIC_COPIES && NT % (8 * XCH) == 0 && (TM * XCH) % NT == 0) {
    // the same chunks with compile-time trip counts: thread tid takes chunks tid + j * NT, whose
    // token group advances by NT / (8 XCH) per j while its column and row stay put (unrolled,
    // affine addresses; no bounds check when the tiles divide M)
    constexpr int GROUPS = NT / (8 * XCH);
    const int mr = tid & 7, q = (tid >> 3) % XCH, mg0 = (tid >> 3) / XCH;
    const u8* row0 = xh + (size_t)kt * (KT * 2) + q * 16;
    const u32 dst0 = sx + q * X_COL + mr * 16;
#pragma unroll
    for (int j = 0; j < TM * XCH / NT; ++j) {
      const int mg = mg0 + j * GROUPS, m = m0 + 8 * mg + mr;
      const bool ok = M_TOK % TM == 0 || m < M_TOK;
      cp16(dst0 + mg * 128, row0 + (size_t)(ok ? m : 0) * (K_IN * 2), ok);
    }
  } else {
#pragma unroll
    for (int i = tid; i < TM * XCH; i += NT) {
      const int mr = i & 7, q = (i >> 3) % XCH, mg = (i >> 3) / XCH, m = m0 + 8 * mg + mr;
      const bool ok = m < M_TOK;
      const u8* src = xh + (size_t)(ok ? m : 0) * (K_IN * 2) + (size_t)kt * (KT * 2) + q * 16;
      cp16(sx + q * X_COL + mg * 128 + mr * 16, src, ok);
    }
  }
}

#if BULK
// BULK: stage kt into ring slot `st` on its full barrier, called by every thread (uniform;
// the one-thread parts predicated, not branched: mbarrier.cuh's warp-uniform forms). Thread 0
// arms the barrier and copies x tile bx. BULK 1: thread 0 also copies weight tile by's two
// pre-tiled pieces. BULK 3: every thread copies its share of the weight stage as BULK 0 does
// (zero-filling rows past N), then arrives once its copies land.
__device__ __forceinline__ void load_stage_bulk(int tid, u32 st, u32 full, int kt, const u8* wp,
                                                const u8* ws, const u8* xh, int n0, int bx) {
  const bool p = tid == 0;
  const u32 sx = st + W_BYTES + S_BYTES;
  const u8* xsrc = xh + ((size_t)bx * NKT + kt) * X_BYTES;
  if constexpr (BULK == 1) {
    const int by = n0 / TILE_N;
    mbar_arrive_expect_tx_if(p, full, STAGE_BYTES);
    bulk_copy_if(p, st, wp + ((size_t)by * NKT + kt) * W_BYTES, W_BYTES, full);
    bulk_copy_if(p, st + W_BYTES, ws + ((size_t)by * NKT + kt) * S_BYTES, S_BYTES, full);
    bulk_copy_if(p, sx, xsrc, X_BYTES, full);
  } else {  // BULK == 3
    mbar_arrive_expect_tx_if(p, full, X_BYTES);
    bulk_copy_if(p, sx, xsrc, X_BYTES, full);
    load_weight_stage_static<TILE_N, NT, N_OUT, K_IN, KT>(
        st, st + W_BYTES, kt, wp, ws, n0, tid, [](int r, int c) { return wchunk(r, c); });
    cp_async_arrive(full);
  }
}
#endif

// One stage: per 128-element sub-chunk h and GROUP_WORDS code words u, decode, then their
// 2 x GROUP_WORDS k16 steps of WR wgmmas as one commit group; wait_group 1 keeps one group in
// flight during the next decode. Larger groups wait less often per MAC and hold more A
// registers (two groups' worth: the one in flight and the one being decoded). Where a stage is
// one group, see one_group_stage: the kernel's loop or wait_group 0 keeps them apart.
// BULK: `release` (non-zero) is the previous stage's empty barrier, arrived on by lane 0 after
// this stage's first wait_group (which retires every earlier group).
__device__ __forceinline__ void compute_stage(u32 st, float (&acc)[WR][NACC], int wgi, int wq,
                                              int lane, u32 release) {
  const int g = lane >> 2, t = lane & 3;
  const u32 sw = st, ss = st + W_BYTES, sx = st + W_BYTES + S_BYTES;
  const u64 desc0 = x_desc(sx);
#pragma unroll
  for (int h = 0; h < SUB; ++h) {
    uint4 wa[WR], wb[WR];
    u32 sa[WR], sb[WR];
#pragma unroll
    for (int r = 0; r < WR; ++r) {
      const int ra = (wgi * WR + r) * 64 + wq * 16 + g, rb = ra + 8;
      wa[r] = lds128(sw + ra * W_PITCH + wchunk(ra, 4 * h + t) * 16);
      wb[r] = lds128(sw + rb * W_PITCH + wchunk(rb, 4 * h + t) * 16);
      sa[r] = hmul2(e4m3x2_to_f16x2(lds16(ss + ra * S_PITCH + 8 * h + 2 * t)), W_SCALE2);
      sb[r] = hmul2(e4m3x2_to_f16x2(lds16(ss + rb * S_PITCH + 8 * h + 2 * t)), W_SCALE2);
    }
#pragma unroll
    for (int u0 = 0; u0 < 4; u0 += GROUP_WORDS) {
      u32 p[GROUP_WORDS][WR][4], q[GROUP_WORDS][WR][4];
#pragma unroll
      for (int du = 0; du < GROUP_WORDS; ++du) {
        const int u = u0 + du;
        const u32 sel = u < 2 ? 0x1010u : 0x3232u;  // this word's block scale in both halves
#pragma unroll
        for (int r = 0; r < WR; ++r) {
          decode8(word(wa[r], u), prmt(sa[r], 0u, sel), p[du][r]);
          decode8(word(wb[r], u), prmt(sb[r], 0u, sel), q[du][r]);
        }
      }
      wg_fence();
#pragma unroll
      for (int du = 0; du < GROUP_WORDS; ++du) {
#pragma unroll
        for (int v = 0; v < 2; ++v) {
          const u64 desc = desc0 + (u64)(((8 * h + 2 * (u0 + du) + v) * X_STEP) >> 4);
#pragma unroll
          for (int r = 0; r < WR; ++r)
            wgmma_rs(acc[r], p[du][r][2 * v], q[du][r][2 * v], p[du][r][2 * v + 1],
                     q[du][r][2 * v + 1], desc);
        }
      }
      wg_commit();
      // the group's index in the stage (a constant once the loops are unrolled)
      const int gi = h * (4 / GROUP_WORDS) + u0 / GROUP_WORDS;
      if constexpr (one_group_stage() == 2)
        wg_wait<0>();  // the next stage's decode rewrites this group's A registers
      else if (PIPE == 2 && gi != 0 && gi != SUB * 4 / GROUP_WORDS - 1)
        wg_wait<2>();
      else
        wg_wait<1>();
      if constexpr (BULK) {
        if (h == 0 && u0 == 0) mbar_arrive_if(release != 0 && lane == 0, release);
      }
    }
  }
}

// ---------------------------------------------------------------------------- kernel

// xh: fp16 x_hat [M, K] in the wgmma K order (see above); xg: float32 [M] activation global
// scales; wp / ws / wg: weight codes, scales, global scales (stacked); layer: int32 [];
// out: bf16 [M, N] (SPLITK == 1) or float32 partial sums [SPLITK, M, N] without the global
// scales and 2^(14 - W_SHIFT).
extern "C" __global__ void __launch_bounds__(NT, MIN_BLOCKS)
    nvfp4_gemm_w4a4_wgmma(const u16* __restrict__ xh, const float* __restrict__ xg,
                          const u8* __restrict__ wp, const u8* __restrict__ ws,
                          const float* __restrict__ wg, const int* __restrict__ layer,
                          void* out) {
  extern __shared__ __align__(128) u8 smem[];
  const int tid = threadIdx.x, lane = tid & 31, wq = (tid >> 5) & 3, wgi = tid >> 7;
  int mt, nt;
  cta_tile(mt, nt);
  const int m0 = mt * TM, n0 = nt * TILE_N, z = blockIdx.z;
  const size_t l = (size_t)(unsigned)*layer;
  constexpr size_t W_ROWS = BULK == 1 ? (size_t)N_TILES * TILE_N : N_OUT;  // BULK 1: padded
  wp += l * W_ROWS * (size_t)(K_IN / 2);
  ws += l * W_ROWS * (size_t)(K_IN / 16);
  wg += l * (GW_ROWS ? N_OUT : 1);
  const u8* x8 = reinterpret_cast<const u8*>(xh);
  const int kt0 = z * NKT / SPLITK, nk = (z + 1) * NKT / SPLITK - kt0;
  const u32 s0 = smem_u32(smem);

  float acc[WR][NACC];
#pragma unroll
  for (int r = 0; r < WR; ++r)
#pragma unroll
    for (int e = 0; e < NACC; ++e) acc[r][e] = 0.f;

#if BULK
  const u32 full0 = s0 + STAGES * STAGE_BYTES, empty0 = full0 + 8 * STAGES;
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full0 + 8 * s, BULK == 1 ? 1 : 1 + NT);  // BULK 3: + the cp.async arrivals
      mbar_init(empty0 + 8 * s, 4 * NWG);
    }
    mbar_init_fence();
  }
  __syncthreads();
  for (int s = 0; s < STAGES - 2 && s < nk; ++s)
    load_stage_bulk(tid, s0 + s * STAGE_BYTES, full0 + 8 * s, kt0 + s, wp, ws, x8, n0,
                    mt);
#else
#pragma unroll
  for (int s = 0; s < STAGES - 2; ++s) {
    if (s < nk) load_stage(s0 + s * STAGE_BYTES, kt0 + s, wp, ws, x8, n0, m0, tid);
    cp_commit();
  }
#endif
  // a do-while: every split has nk >= 1 stages (SPLITK <= NKT), and no path may skip the loop
  // into the epilogue (ptxas serializes the wgmmas when the zero accumulators of such a path
  // meet the in-flight ones)
  int i = 0;
#if BULK
  const auto step = [&](int i) {
    const int next = i + STAGES - 2;
    if (next < nk) {  // uniform: no divergent branch while the last group is in flight
      const int slot = next % STAGES;
      // the slot's previous stage (next - STAGES = i - 2) released by every warp
      if (next >= STAGES) mbar_wait_warp(empty0 + 8 * slot, (u32)(next / STAGES - 1) & 1);
      load_stage_bulk(tid, s0 + slot * STAGE_BYTES, full0 + 8 * slot, kt0 + next, wp, ws, x8,
                      n0, mt);
    }
    mbar_wait_warp(full0 + 8 * (i % STAGES), (u32)(i / STAGES) & 1);  // stage i landed
    compute_stage(s0 + (i % STAGES) * STAGE_BYTES, acc, wgi, wq, lane,
                  i > 0 ? empty0 + 8 * ((i - 1) % STAGES) : 0u);
  };
#else
  const auto step = [&](int i) {
    cp_wait<STAGES - 3>();  // this thread's copies of stage i landed
    fence_async_shared();   // ... and are visible to the async proxy (wgmma's B reads)
    __syncthreads();        // every thread's; the wgmmas of stage i - 2 are complete
    const int next = i + STAGES - 2;
    if (next < nk)
      load_stage(s0 + (next % STAGES) * STAGE_BYTES, kt0 + next, wp, ws, x8, n0, m0, tid);
    cp_commit();
    compute_stage(s0 + (i % STAGES) * STAGE_BYTES, acc, wgi, wq, lane, 0u);
  };
#endif
  if constexpr (one_group_stage() == 1) {
    // two copies of the stage a trip (one_group_stage above): stage i's group is in flight
    // while stage i + 1 decodes into the other copy's registers
    for (;;) {
      step(i);
      if (++i == nk) break;
      step(i);
      if (++i == nk) break;
    }
  } else {
    do step(i);
    while (++i < nk);
  }
  wg_wait<0>();
#pragma unroll
  for (int r = 0; r < WR; ++r)
#pragma unroll
    for (int e = 0; e < NACC; ++e) pin(acc[r][e]);

  // accumulator 4j + e of tile r: row 16 wq + g + 8 (e / 2), token 8j + 2t + (e % 2)
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int r = 0; r < WR; ++r) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int n = n0 + (wgi * WR + r) * 64 + wq * 16 + g + 8 * (e >> 1);
      if (n >= N_OUT) continue;
      const float gw = wg[GW_ROWS ? n : 0];
#pragma unroll
      for (int j = 0; j < TM / 8; ++j) {
        const int m = m0 + 8 * j + 2 * t + (e & 1);
        if (m >= M_TOK) continue;
        const float a = acc[r][4 * j + e];
        if constexpr (!PARTIALS) {
          static_cast<u16*>(out)[(size_t)m * N_OUT + n] = f32_to_bf16(a * W_UNSCALE * (gw * xg[m]));
        } else {
          static_cast<float*>(out)[((size_t)z * M_TOK + m) * N_OUT + n] = a;
        }
      }
    }
  }
}

// Split-K epilogue (SPLITK > 1), one thread per output: the partials added in split order, then
// the main kernel's epilogue (production's nvfp4_gemm_finish without the residual).
// part: float32 [SPLITK, M, N]; y: bf16 [M, N].
extern "C" __global__ void __launch_bounds__(256)
    nvfp4_gemm_finish(const float* __restrict__ part, const float* __restrict__ xg,
                      const float* __restrict__ wg, const int* __restrict__ layer, u16* y) {
  constexpr size_t MN = (size_t)M_TOK * N_OUT;
  const size_t i = (size_t)blockIdx.x * 256 + threadIdx.x;
  if (i >= MN) return;
  const int m = (int)(i / N_OUT), n = (int)(i % N_OUT);
  wg += (size_t)(unsigned)*layer * (GW_ROWS ? N_OUT : 1);
  float acc = part[i];
#pragma unroll
  for (int s = 1; s < SPLITK; ++s) acc += part[s * MN + i];
  y[i] = f32_to_bf16(acc * W_UNSCALE * (wg[GW_ROWS ? n : 0] * xg[m]));
}
