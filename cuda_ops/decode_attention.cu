// Flash-decoding attention of one new token per row over the live slots of one layer of the
// stacked bf16 KV cache, in ONE launch (rejax/ops/decode_attention.py, impl="cuda"):
//
//   out[b, n, :] = sum_s softmax_s(q[b, n] . k[layer, b, s, n / G] * H**-0.5) v[layer, b, s, n / G]
//
// over the keys s < live with 0 <= k_positions[b, s] <= q_positions[b]; zeros for a row with no
// visible key. Grid (P, KV_HEADS, B_ROWS): one CTA per (split p, kv head, row b) takes the G
// query heads that share the kv head (GQA: each K/V row is loaded once for G heads) over its
// split of [0, live). The split plan is computed on the device from `live` (the same integers
// as `flash_split_plan` in cuda_ops/decode_attention.py), so the compiled program does not
// depend on it. Each active CTA writes its float32 partial (m, l, acc[G, H]) to a workspace
// (the call's second and third outputs); the last active CTA of a (row, kv head) to finish (an
// atomicInc ticket in a module-global counter, after a __threadfence) reads the partials in
// split order and writes the bf16 output. atomicInc wraps the counter back to 0 on that last
// arrival, so the next launch (or graph replay) starts clean; no grid sync, no second launch.
// When the live range has one split (a short range), that CTA writes the output itself: no
// workspace round trip, no ticket (the same bits: a one-split combine is the identity).
//
// Numerics, step by step, as the emulation `emulate` in cuda_ops/decode_attention.py (the CPU
// tests compare it with the reference; the numbered comments E1..E9 below point at its lines):
// scores are float32 q.k times H**-0.5 * log2(e) (the softmax in base 2: exp2f(x log2 e) =
// exp(x), to float rounding), hidden keys are skipped, the unnormalised weight exp(s - m) is
// rounded to bf16 before it multiplies v (as the Pallas kernel) while l sums the float32
// weights, and every merge of partials is "rescale to the common max, then add in a fixed
// order" (deterministic: the same inputs give the same bits on every call).
//
// Layout of the work inside a CTA: a K/V row (H bf16) is read by LPR = H / 8 lanes with one
// 16-byte load each, so a warp reads KPW = 32 / LPR rows per load; lane = r * LPR + c holds
// elements [8c, 8c + 8) of row group r. A warp step issues UNROLL such loads of K and of V (and
// the positions) before any math, so UNROLL * KPW rows per warp are in flight; the WARPS warps
// of the CTA take consecutive groups of UNROLL * KPW slots of a tile of TILE = WARPS * UNROLL *
// KPW slots. Each row group r of a warp is one online-softmax stream; streams are merged across
// row groups (shuffles), then warps (shared memory), then splits (the last CTA).
//
// Constants (-D, cuda_ops/decode_attention.py): B_ROWS, N_LAYERS, S_SLOTS, KV_HEADS, GQA (G),
// HEAD_DIM (a power of two in [16, 256]), SPLITS (P), WARPS, UNROLL, MIN_TILES (a split walks
// at least this many tiles), SCORE_SCALE (float literal), MIN_CTAS (launch bounds), PREFETCH
// (1: a warp's next step of K / V loads is issued before its current step's math), MMA (1: the
// tensor-core main loop below, with STAGES cp.async stages per warp), POISON (1: one more
// operand per output, NaN-filled buffers aliased to the outputs, for the GPU tests), QUANT_OUT
// (1: the output is o_proj's NVFP4 input, below), XG_STACK (QUANT_OUT: the static input scale
// is stacked [L], read at the layer; 0: xg[0]).
//
// QUANT_OUT = 1 writes, instead of the bf16 out, the W4A4 GEMV's operands for o_proj: the row's
// N*H outputs quantized with a static global scale g (an operand after live): codes uint8 [B,
// N*H/2], E4M3 block scales uint8 [B, N*H/16] and g per row float32 [B], the bytes of
// rejax.nvfp4.quantize_activation(out as bf16, g) (common.cuh). With a static g a 16-element
// block needs only its own values, and the CTA that stores a (row, kv head) holds its G heads'
// G*H contiguous outputs: a block is 4 float4 columns, held by 4 consecutive lanes of the store
// loop (col % 4 == tid % 4), which find its amax with two shuffles in their group. The values
// quantized are the bf16 outputs the QUANT_OUT = 0 build stores, so its bytes are
// quantize_activation of that build's output. The o_proj quantizer launch goes away.
//
// MMA = 1 replaces the main loop (E3-E6) and keeps the rest. Each warp streams chunks of CH = 16
// slots (K, V and positions) of its kv head through a private ring of STAGES shared-memory
// stages filled by cp.async (16-byte pieces, XOR-swizzled so that ldmatrix is conflict-free;
// slots at or past the split's end are zero-filled, never read). Per chunk, S^T = Q K^T is one
// m16n8k16 bf16 mma per 8 slots and 16 dims (A = the G query rows of the kv head, rows G..15
// zero; B = K rows by ldmatrix), the online softmax runs on the mma's accumulator fragment (rows
// are query heads, a row's max and sum over the 4 lanes of a quad), and O += P V is one mma per
// 8 output columns (A = exp2(s - m) rounded to bf16, from the score fragment in place; B = V
// rows by ldmatrix.trans). The warp's partial then goes through the same merges as above. The
// scores and P.V are float32 sums in the tensor cores' order, not the element order of E4, so
// the kernel is within rounding of `emulate`, not equal to it; hidden slots inside the live
// range get their V rows zeroed before the P.V mma (0 * NaN of a stale slot would be NaN).
// Dynamic shared memory: WARPS * STAGES * (2 * CH * H * 2 + CH * 4) bytes. The last CTA of a
// (row, kv head) copies the partials' acc into those idle rings (cp.async) in the same round
// trip as their (m, l), when they fit.
// Operands: q [B, N, H] bf16, k_cache, v_cache [L, B, S, K, H]
// bf16, layer [] i32, q_positions [B] i32, k_positions [B, S] i32, live [] i32 (QUANT_OUT: then
// xg [L] or [1] f32); outputs: out [B, N, H] bf16 (QUANT_OUT: xp [B, N*H/2] u8, xs [B, N*H/16]
// u8, xg_out [B] f32), ws_acc [B, K, P, G, H] f32, ws_ml [B, K, P, 2, G] f32 (garbage on entry:
// every partial the last CTA reads was written in the same launch).

typedef unsigned short u16;
typedef unsigned int u32;

#ifndef POISON
#define POISON 0
#endif
#ifndef MIN_CTAS  // resident CTAs per SM asked of ptxas (a register cap)
#define MIN_CTAS 1
#endif
#ifndef PREFETCH  // 1: each warp loads its next step's K / V while it computes this one
#define PREFETCH 0
#endif
#ifndef MMA  // 1: the tensor-core main loop (mma.sync bf16, cp.async stages)
#define MMA 0
#endif
#ifndef STAGES  // cp.async stages per warp (MMA only)
#define STAGES 3
#endif
#ifndef QUANT_OUT  // 1: o_proj's NVFP4 input (codes, scales, global scale) instead of bf16 out
#define QUANT_OUT 0
#endif
#ifndef XG_STACK  // QUANT_OUT: the static input scale is stacked [L] (read at the layer)
#define XG_STACK 0
#endif

constexpr int H = HEAD_DIM;
constexpr int G = GQA;
constexpr int N_HEADS = KV_HEADS * G;
constexpr int LPR = H / 8;            // lanes per K/V row (one 16-byte load each)
constexpr int KPW = 32 / LPR;         // rows per warp load = row groups (streams) per warp
constexpr int CH = 16;                // MMA: slots per warp step (two 8-slot n-tiles)
constexpr int TILE = MMA ? WARPS * CH : WARPS * UNROLL * KPW;
constexpr int NT = WARPS * 32;
constexpr int H4 = H / 4;             // float4 columns per head
constexpr int C4 = G * H4;            // float4 columns of a [G, H] partial
constexpr int J = (NT / C4) > 1 ? (NT / C4) : 1;  // split groups per column in the combine
constexpr float NEG = -1e30f;         // initial max and hidden score: finite, exp2f(NEG - NEG) = 1
static_assert(H >= 16 && H <= 256 && (H & (H - 1)) == 0, "HEAD_DIM: a power of two in [16, 256]");
static_assert(G >= 1 && G <= 8, "GQA must be in [1, 8]");

// Module globals: one arrival counter per (row, kv head), zero at module load and wrapped back to
// zero by the last arrival of every launch.
__device__ u32 g_arrivals[B_ROWS * KV_HEADS];

__device__ __forceinline__ float bf16_lo(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(u32 w) { return __uint_as_float(w & 0xFFFF0000u); }

// round to nearest even (inputs finite or NaN)
__device__ __forceinline__ u32 f32_to_bf16(float f) {
  const u32 u = __float_as_uint(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (u >> 16) | 0x40u;
  return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}
__device__ __forceinline__ float rbf16(float f) { return __uint_as_float(f32_to_bf16(f) << 16); }

#if QUANT_OUT
typedef unsigned char u8;
#include "common.cuh"
#endif

// K/V rows are read once: stream them past L1.
__device__ __forceinline__ uint4 ld_stream(const u16* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ void unpack8(const uint4 w, float (&f)[8]) {
  f[0] = bf16_lo(w.x); f[1] = bf16_hi(w.x); f[2] = bf16_lo(w.y); f[3] = bf16_hi(w.y);
  f[4] = bf16_lo(w.z); f[5] = bf16_hi(w.z); f[6] = bf16_lo(w.w); f[7] = bf16_hi(w.w);
}

__device__ __forceinline__ int clampi(int x, int lo, int hi) { return min(max(x, lo), hi); }

// One warp step's loads (E3): unroll u of row group r reads slot t0 + u * KPW + r; slots >= end
// (= the live range's end for this split) are never read: zeros and position -1 instead.
__device__ __forceinline__ void load_step(int t0, int end, int r, const u16* kb, const u16* vb,
                                          const int* kp, size_t slot_stride, uint4 (&kr)[UNROLL],
                                          uint4 (&vr)[UNROLL], int (&kpv)[UNROLL]) {
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    const int s = t0 + u * KPW + r;
    if (s < end) {
      kr[u] = ld_stream(kb + (size_t)s * slot_stride);
      vr[u] = ld_stream(vb + (size_t)s * slot_stride);
      kpv[u] = __ldg(kp + s);
    } else {
      kr[u] = vr[u] = make_uint4(0u, 0u, 0u, 0u);
      kpv[u] = -1;
    }
  }
}

#if MMA
// ---- the tensor-core path's helpers (sm_80+ instructions; the H200 is sm_90)
constexpr int NCH = H / 8;                       // 16-byte pieces per K / V row
constexpr int SWZ = (NCH < 8 ? NCH : 8) - 1;     // piece c of row r sits at c ^ (r & SWZ)
constexpr int KV_BYTES = CH * H * 2;             // one stage's K (or V) rows
constexpr int STAGE_BYTES = 2 * KV_BYTES + CH * 4;  // K, V, then the CH positions
constexpr int PIECES = CH * NCH / 32;            // 16-byte copies per lane for K (and for V)
static_assert(H >= 32, "MMA needs HEAD_DIM >= 32 (ldmatrix.x4 takes two 16-dim k-steps)");
static_assert(G <= 8, "MMA: the G query rows are rows 0..7 of the mma's A operand");
static_assert(STAGES >= 2 && STAGES <= 8, "STAGES must be in [2, 8]");

__device__ __forceinline__ u32 smem_addr(const void* p) {
  return static_cast<u32>(__cvta_generic_to_shared(p));
}
// 16 bytes global -> shared, asynchronously; src_bytes = 0 zero-fills and reads nothing
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async4(u32 dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ void ldsm_x4(u32 addr, u32 (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void ldsm_x4_trans(u32 addr, u32 (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
// d (rows 0..7 of the m16n8 accumulator: this lane's two columns) += A B, with A's rows 8..15
// zero (a0: this lane's row, k 0..7 pair; a2: k 8..15 pair); the rows 8..15 result is dropped
__device__ __forceinline__ void mma_top(float& d0, float& d1, u32 a0, u32 a2, u32 b0, u32 b1) {
  float x2, x3;
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%10, %11, %12, %13};"
      : "=f"(d0), "=f"(d1), "=f"(x2), "=f"(x3)
      : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1), "f"(d0), "f"(d1), "f"(0.f),
        "f"(0.f));
}
#endif

// Where a CTA's output goes: the bf16 out, or (QUANT_OUT) the codes, block scales and the
// static global scale with its reciprocal.
struct OutRef {
#if QUANT_OUT
  u8* xp;
  u8* xs;
  const float* g;   // the static global scale (global memory, read-only in this launch)
  const float* ig;  // div_rn(1, g), in shared memory
#else
  u16* out;
#endif
};

// E9's last step: out[b, kvh G + g, 4 h4 .. 4 h4 + 3] = bf16(a / tot), zeros when tot == 0.
// QUANT_OUT: those 4 bf16 values quantized instead; the 4 lanes tid % 4 = 0..3 of one block
// (4 h4 .. 4 h4 + 15 of a head: H4 is a multiple of 4) call it together.
__device__ __forceinline__ void store_out4(const OutRef& o_, int b, int kvh, int g, int h4,
                                           float4 a, float tot) {
  float o[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) o[i] = tot > 0.f ? __fdiv_rn(o[i], tot) : 0.f;
  const u32 lo = f32_to_bf16(o[0]) | (f32_to_bf16(o[1]) << 16);
  const u32 hi = f32_to_bf16(o[2]) | (f32_to_bf16(o[3]) << 16);
  const size_t e0 = ((size_t)b * N_HEADS + kvh * G + g) * H + 4 * h4;  // element in out [B, N*H]
#if QUANT_OUT
  // the bf16 values (what QUANT_OUT = 0 stores), then rejax.nvfp4.quantize_activation's block
  const float v[4] = {bf16_lo(lo), bf16_hi(lo), bf16_lo(hi), bf16_hi(hi)};
  const unsigned group = 0xFu << (threadIdx.x & 28);  // the block's 4 lanes
  float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
  amax = fmaxf(amax, __shfl_xor_sync(group, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(group, amax, 2));
  u32 scale;
  const u32 c = block_codes(v, amax, o_.g, o_.ig, scale);
  *reinterpret_cast<u16*>(o_.xp + e0 / 2) = (u16)c;
  if ((threadIdx.x & 3) == 0) o_.xs[e0 / 16] = (u8)scale;
#else
  *reinterpret_cast<uint2*>(o_.out + e0) = make_uint2(lo, hi);
#endif
}

extern "C" __global__ void __launch_bounds__(NT, MIN_CTAS)
    rejax_flash_decode(const u16* __restrict__ q, const u16* __restrict__ k_cache,
                       const u16* __restrict__ v_cache, const int* __restrict__ layer_p,
                       const int* __restrict__ q_positions, const int* __restrict__ k_positions,
                       const int* __restrict__ live_p,
#if QUANT_OUT
                       const float* __restrict__ xg,
#endif
#if POISON
#if QUANT_OUT
                       const u8* xp_in, const u8* xs_in, const float* xgo_in,
#else
                       const u16* out_in,
#endif
                       const float* acc_in, const float* ml_in,
#endif
#if QUANT_OUT
                       u8* __restrict__ xp, u8* __restrict__ xs, float* __restrict__ xg_out,
#else
                       u16* __restrict__ out,
#endif
                       float* ws_acc, float* ws_ml) {
#if POISON
#if QUANT_OUT
  (void)xp_in;  // aliased to the outputs: NaN on entry
  (void)xs_in;
  (void)xgo_in;
#else
  (void)out_in;  // aliased to the outputs: NaN on entry
#endif
  (void)acc_in;
  (void)ml_in;
#endif
  const int p = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int bk = b * KV_HEADS + kvh;
  // E1: the split plan (flash_split_plan): tiles of TILE slots, at least MIN_TILES per split;
  // split 0 is active even when live == 0 (it then writes the empty partial, and the combine
  // returns zeros), so every (row, kv head) always has a last CTA that writes its output.
  // the three scalars a CTA needs, loaded together (one memory round trip, not three)
  const int live_in = *live_p, layer_in = *layer_p, qpos = q_positions[b];
  const int live = clampi(live_in, 0, S_SLOTS);
  const int tiles = (live + TILE - 1) / TILE;
  const int per = max((tiles + SPLITS - 1) / SPLITS, MIN_TILES);
  const int active = max((tiles + per - 1) / per, 1);
  if (p >= active) return;  // beyond the live range: no partial, no arrival
  const int layer = clampi(layer_in, 0, N_LAYERS - 1);
  const int start = p * per * TILE;
  const int end = min(start + per * TILE, live);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int r = lane / LPR, c = lane % LPR;
  const float scale = SCORE_SCALE;  // E2: H**-0.5 * log2(e) in float32 (flash_score_scale)

  __shared__ float4 sm_acc[WARPS][G][H4];
  __shared__ float sm_m[WARPS][G], sm_l[WARPS][G], sm_c[WARPS][G];
#if !MMA
  float qf[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g)
    unpack8(*reinterpret_cast<const uint4*>(q + ((size_t)b * N_HEADS + kvh * G + g) * H + 8 * c),
            qf[g]);

  float m[G], l[G], acc[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = NEG;
    l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[g][e] = 0.f;
  }

  const size_t slot_stride = (size_t)KV_HEADS * H;  // elements between consecutive slots
  const size_t base = (((size_t)layer * B_ROWS + b) * S_SLOTS) * slot_stride + (size_t)kvh * H +
                      8 * c;
  const u16* kb = k_cache + base;
  const u16* vb = v_cache + base;
  const int* kp = k_positions + (size_t)b * S_SLOTS;

  // E3: warp `warp`, step t0, unroll u, row group r reads slot t0 + u * KPW + r
#if PREFETCH
  // software pipeline: the next step's K, V and positions are loaded before this step's math,
  // so a warp keeps its loads in flight while it computes (the same values, the same order)
  uint4 kn[UNROLL], vn[UNROLL];
  int kpn[UNROLL];
  load_step(start + warp * UNROLL * KPW, end, r, kb, vb, kp, slot_stride, kn, vn, kpn);
#endif
  for (int t0 = start + warp * UNROLL * KPW; t0 < end; t0 += TILE) {
    uint4 kr[UNROLL], vr[UNROLL];
    int kpv[UNROLL];
#if PREFETCH
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      kr[u] = kn[u];
      vr[u] = vn[u];
      kpv[u] = kpn[u];
    }
    if (t0 + TILE < end)
      load_step(t0 + TILE, end, r, kb, vb, kp, slot_stride, kn, vn, kpn);
#else
    load_step(t0, end, r, kb, vb, kp, slot_stride, kr, vr, kpv);
#endif
    // E4: score partials over this lane's 8 elements (a product, then fmas in element order),
    // then a butterfly over the row group's LPR lanes (offsets 1, 2, .., LPR / 2; a + b is
    // commutative, so every lane of the group holds the same sum)
    float sc[UNROLL][G];
    bool vis[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      float kf[8];
      unpack8(kr[u], kf);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float d = __fmul_rn(qf[g][0], kf[0]);
#pragma unroll
        for (int e = 1; e < 8; ++e) d = fmaf(qf[g][e], kf[e], d);
        sc[u][g] = d;
      }
      vis[u] = kpv[u] >= 0 && kpv[u] <= qpos;  // slots past `end` hold -1
    }
#pragma unroll
    for (int o = 1; o < LPR; o <<= 1)
#pragma unroll
      for (int u = 0; u < UNROLL; ++u)
#pragma unroll
        for (int g = 0; g < G; ++g)
          sc[u][g] = __fadd_rn(sc[u][g], __shfl_xor_sync(0xffffffffu, sc[u][g], o));
    // E5: the online-softmax update of this stream, keys in unroll order
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float mn = m[g];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        sc[u][g] = vis[u] ? __fmul_rn(sc[u][g], scale) : NEG;
        mn = fmaxf(mn, sc[u][g]);
      }
      const float alpha = exp2f(m[g] - mn);
      m[g] = mn;
      float lg = __fmul_rn(alpha, l[g]);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[g][e] = __fmul_rn(alpha, acc[g][e]);
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        if (vis[u]) {  // hidden keys add nothing (not even a NaN of a stale slot)
          const float w = exp2f(sc[u][g] - mn);
          lg = __fadd_rn(lg, w);
          const float wb = rbf16(w);  // as the Pallas kernel: exp(s - m) in bf16 times v
          float vf[8];
          unpack8(vr[u], vf);
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[g][e] = fmaf(wb, vf[e], acc[g][e]);
        }
      }
      l[g] = lg;
    }
  }

  // E6: merge the KPW row groups of the warp: common max (exact), rescale, then a butterfly of
  // adds over offsets LPR, 2 LPR, .., 16 (commutative: every row group ends with the same sums)
#pragma unroll
  for (int g = 0; g < G; ++g) {
    float mx = m[g];
#pragma unroll
    for (int o = LPR; o < 32; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    const float cf = exp2f(m[g] - mx);
    m[g] = mx;
    l[g] = __fmul_rn(cf, l[g]);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[g][e] = __fmul_rn(cf, acc[g][e]);
#pragma unroll
    for (int o = LPR; o < 32; o <<= 1) {
      l[g] = __fadd_rn(l[g], __shfl_xor_sync(0xffffffffu, l[g], o));
#pragma unroll
      for (int e = 0; e < 8; ++e)
        acc[g][e] = __fadd_rn(acc[g][e], __shfl_xor_sync(0xffffffffu, acc[g][e], o));
    }
  }

  if (r == 0) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      sm_acc[warp][g][2 * c] = make_float4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
      sm_acc[warp][g][2 * c + 1] = make_float4(acc[g][4], acc[g][5], acc[g][6], acc[g][7]);
      if (c == 0) {
        sm_m[warp][g] = m[g];
        sm_l[warp][g] = l[g];
      }
    }
  }
#else  // MMA: the tensor-core main loop (the header's last paragraph)
  (void)r;
  (void)c;
  const int quad = lane & 3, grp = lane >> 2;  // the mma fragments' thread-in-group and group
  const int qg = grp < G ? grp : 0;            // rows >= G of A are zero
  // A fragments of Q (rows = the G query heads of this kv head), per 16-dim k-step
  constexpr int KSTEPS = H / 16;
  u32 qa[KSTEPS][2];
  {
    const u32* qrow = reinterpret_cast<const u32*>(q + ((size_t)b * N_HEADS + kvh * G + qg) * H);
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) {
      qa[kk][0] = grp < G ? qrow[(kk * 16 + 2 * quad) / 2] : 0u;
      qa[kk][1] = grp < G ? qrow[(kk * 16 + 8 + 2 * quad) / 2] : 0u;
    }
  }
  float m = NEG, l = 0.f;      // this lane's query row (grp): max; l sums this lane's columns
  float o[H / 8][2];           // O rows 0..7 (query heads), columns 8 d + 2 quad + {0, 1}
#pragma unroll
  for (int d = 0; d < H / 8; ++d) o[d][0] = o[d][1] = 0.f;

  const size_t slot_stride = (size_t)KV_HEADS * H;
  const size_t base = (((size_t)layer * B_ROWS + b) * S_SLOTS) * slot_stride + (size_t)kvh * H;
  const u16* kb = k_cache + base;
  const u16* vb = v_cache + base;
  const int* kp = k_positions + (size_t)b * S_SLOTS;
  extern __shared__ __align__(128) unsigned char dsm[];
  const u32 ring = smem_addr(dsm) + warp * (STAGES * STAGE_BYTES);
  unsigned char* ring_p = dsm + warp * (STAGES * STAGE_BYTES);
  const int wstart = start + warp * CH;  // warp `warp` takes chunks wstart + i * TILE
  const int nmy = wstart < end ? (end - wstart + TILE - 1) / TILE : 0;

  auto issue = [&](int i) {  // chunk i's K, V, positions into stage i % STAGES; always commits
    if (i < nmy) {
      const int t0 = wstart + i * TILE;
      const u32 st = ring + (i % STAGES) * STAGE_BYTES;
#pragma unroll
      for (int pc = 0; pc < PIECES; ++pc) {
        const int piece = lane + 32 * pc, row = piece / NCH, col = piece % NCH;
        const int sl = t0 + row;
        const bool in = sl < end;
        const size_t off = (size_t)(in ? sl : start) * slot_stride + 8 * col;
        const u32 dst = st + row * (H * 2) + ((col ^ (row & SWZ)) << 4);
        cp_async16(dst, kb + off, in ? 16 : 0);
        cp_async16(dst + KV_BYTES, vb + off, in ? 16 : 0);
      }
      if (lane < CH) {
        const int sl = t0 + lane;
        const bool in = sl < end;
        cp_async4(st + 2 * KV_BYTES + 4 * lane, kp + (in ? sl : start), in ? 4 : 0);
      }
    }
    cp_commit();
  };

#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) issue(i);
  for (int i = 0; i < nmy; ++i) {
    cp_wait<STAGES - 2>();  // this lane's copies of chunk i have landed
    __syncwarp();           // ... and every lane's; stage (i - 1) % STAGES is free again
    issue(i + STAGES - 1);
    const int t0 = wstart + i * TILE;
    const int st_i = (i % STAGES) * STAGE_BYTES;
    const u32 kst = ring + st_i, vst = kst + KV_BYTES;
    const int* pos = reinterpret_cast<const int*>(ring_p + st_i + 2 * KV_BYTES);
    // hidden slots inside [t0, end): zero their V rows (rare: left padding, holes)
    {
      const int sl = t0 + (lane & (CH - 1));
      const int kpv = pos[lane & (CH - 1)];
      const bool hid = lane < CH && sl < end && !(kpv >= 0 && kpv <= qpos);
      u32 mask = __ballot_sync(0xffffffffu, hid);
      if (mask) {
        while (mask) {
          const int row = __ffs(mask) - 1;
          mask &= mask - 1;
          if (lane < NCH)
            *reinterpret_cast<uint4*>(ring_p + st_i + KV_BYTES + row * (H * 2) + 16 * lane) =
                make_uint4(0u, 0u, 0u, 0u);
        }
        __syncwarp();
      }
    }
    // S^T = Q K^T: n-tile j holds slots 8 j + 2 quad + {0, 1} of query row grp
    float sc[2][2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      sc[j][0] = sc[j][1] = 0.f;
      const int row = 8 * j + (lane & 7);
#pragma unroll
      for (int kk = 0; kk < KSTEPS; kk += 2) {
        const int piece = 2 * kk + (lane >> 3);
        u32 bk[4];
        ldsm_x4(kst + row * (H * 2) + ((piece ^ (row & SWZ)) << 4), bk);
        mma_top(sc[j][0], sc[j][1], qa[kk][0], qa[kk][1], bk[0], bk[1]);
        mma_top(sc[j][0], sc[j][1], qa[kk + 1][0], qa[kk + 1][1], bk[2], bk[3]);
      }
    }
    // the online softmax of row grp over this chunk (max and sum over the quad's 16 slots)
    bool vis[2][2];
    float cm = NEG;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int2 kp2 = *reinterpret_cast<const int2*>(pos + 8 * j + 2 * quad);
      const int sl = t0 + 8 * j + 2 * quad;
      vis[j][0] = sl < end && kp2.x >= 0 && kp2.x <= qpos;
      vis[j][1] = sl + 1 < end && kp2.y >= 0 && kp2.y <= qpos;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        sc[j][e] = vis[j][e] ? __fmul_rn(sc[j][e], scale) : NEG;
        cm = fmaxf(cm, sc[j][e]);
      }
    }
    cm = fmaxf(cm, __shfl_xor_sync(0xffffffffu, cm, 1));
    cm = fmaxf(cm, __shfl_xor_sync(0xffffffffu, cm, 2));
    const float mn = fmaxf(m, cm);
    const float alpha = exp2f(m - mn);
    m = mn;
    float w[2][2];
    float ws = 0.f;
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        w[j][e] = vis[j][e] ? exp2f(sc[j][e] - mn) : 0.f;
        ws = __fadd_rn(ws, w[j][e]);
      }
    l = __fadd_rn(__fmul_rn(alpha, l), ws);
    // P (bf16) as the A operand: k 0..7 = slots 2 quad + {0, 1} of n-tile 0, k 8..15 of n-tile 1
    const u32 pa0 = f32_to_bf16(w[0][0]) | (f32_to_bf16(w[0][1]) << 16);
    const u32 pa2 = f32_to_bf16(w[1][0]) | (f32_to_bf16(w[1][1]) << 16);
#pragma unroll
    for (int d = 0; d < H / 8; d += 2) {
      u32 bv[4];
      const int row = (lane & 7) + 8 * ((lane >> 3) & 1), piece = d + (lane >> 4);
      ldsm_x4_trans(vst + row * (H * 2) + ((piece ^ (row & SWZ)) << 4), bv);
      o[d][0] = __fmul_rn(alpha, o[d][0]);
      o[d][1] = __fmul_rn(alpha, o[d][1]);
      o[d + 1][0] = __fmul_rn(alpha, o[d + 1][0]);
      o[d + 1][1] = __fmul_rn(alpha, o[d + 1][1]);
      mma_top(o[d][0], o[d][1], pa0, pa2, bv[0], bv[1]);
      mma_top(o[d + 1][0], o[d + 1][1], pa0, pa2, bv[2], bv[3]);
    }
  }
  cp_wait<0>();  // no copy outlives the loop (the empty trailing groups)
  // the quad's column sums of l (every lane of the quad ends with the same sum)
  l = __fadd_rn(l, __shfl_xor_sync(0xffffffffu, l, 1));
  l = __fadd_rn(l, __shfl_xor_sync(0xffffffffu, l, 2));
  if (grp < G) {
    float* sa = reinterpret_cast<float*>(&sm_acc[warp][grp][0]);
#pragma unroll
    for (int d = 0; d < H / 8; ++d)
      *reinterpret_cast<float2*>(sa + 8 * d + 2 * quad) = make_float2(o[d][0], o[d][1]);
    if (quad == 0) {
      sm_m[warp][grp] = m;
      sm_l[warp][grp] = l;
    }
  }
#endif
  __syncthreads();

  // E7: merge the warps, in warp order: this CTA's partial (m, l, acc) to the workspace (or,
  // when the live range has one split, straight to the output)
  __shared__ float sm_lt[G];
#if QUANT_OUT
  // the static global scale and its reciprocal, for every store of this CTA (E9); the first
  // store of row b's kv head 0 also writes g as the row's global scale
  __shared__ float sm_ig;
  const float* gp = xg + (XG_STACK ? layer : 0);
  if (tid == 0) sm_ig = div_rn(1.0f, *gp);
  const OutRef oref = {xp, xs, gp, &sm_ig};
  if (tid == 0 && kvh == 0 && active == 1) xg_out[b] = *gp;
#else
  const OutRef oref = {out};
#endif
  float* ml = ws_ml + ((size_t)bk * SPLITS + p) * 2 * G;
  if (tid < G) {
    const int g = tid;
    float mx = sm_m[0][g];
    for (int w = 1; w < WARPS; ++w) mx = fmaxf(mx, sm_m[w][g]);
    float lt = 0.f;
    for (int w = 0; w < WARPS; ++w) {
      const float cf = exp2f(sm_m[w][g] - mx);
      sm_c[w][g] = cf;
      lt = fmaf(cf, sm_l[w][g], lt);
    }
    ml[g] = mx;
    ml[G + g] = lt;
    sm_lt[g] = lt;
  }
  __syncthreads();
  float4* acc_out = reinterpret_cast<float4*>(ws_acc) + ((size_t)bk * SPLITS + p) * C4;
  for (int col = tid; col < C4; col += NT) {
    const int g = col / H4, h4 = col % H4;
    float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int w = 0; w < WARPS; ++w) {
      const float cf = sm_c[w][g];
      const float4 x = sm_acc[w][g][h4];
      a = make_float4(fmaf(cf, x.x, a.x), fmaf(cf, x.y, a.y), fmaf(cf, x.z, a.z),
                      fmaf(cf, x.w, a.w));
    }
    if (active == 1)  // E8 with one split is the identity (weight exp2(0) = 1, a + 0): write out
      store_out4(oref, b, kvh, g, h4,
                 make_float4(__fadd_rn(a.x, 0.f), __fadd_rn(a.y, 0.f), __fadd_rn(a.z, 0.f),
                             __fadd_rn(a.w, 0.f)),
                 sm_lt[g]);
    else
      acc_out[col] = a;
  }
  if (active == 1) return;  // no workspace round trip, no ticket: the output is written

  // The last of the `active` CTAs of (b, kvh) combines. Every thread's partial writes are made
  // visible device-wide before thread 0 takes its ticket; the last one fences again before it
  // reads the other CTAs' partials (through L2: __ldcg).
  __shared__ int s_last;
  __threadfence();
  __syncthreads();
  if (tid == 0) s_last = atomicInc(&g_arrivals[bk], (u32)(active - 1)) == (u32)(active - 1);
  __syncthreads();
  if (!s_last) return;
  __threadfence();

  // E8: combine the splits: common max, weights w_p = exp2(m_p - M), total = sum_p w_p l_p in
  // split order; acc summed over the splits p = j, j + J, .. (split order) per group j, then the
  // J group sums added in group order
  __shared__ float sm_pml[SPLITS * 2 * G];  // the active splits' (m, l), read once, in parallel
  __shared__ float sm_pw[SPLITS][G];
  __shared__ float sm_tot[G];
  __shared__ float4 sm_red[J * C4];
  const float* ml_all = ws_ml + (size_t)bk * SPLITS * 2 * G;
  const float4* acc_all = reinterpret_cast<const float4*>(ws_acc) + (size_t)bk * SPLITS * C4;
#if MMA
  // the partials' acc into the idle cp.async rings in the same round trip as (m, l)
  float4* acc_sm = reinterpret_cast<float4*>(dsm);
  const bool staged = active * C4 * 16 <= WARPS * STAGES * STAGE_BYTES;
  if (staged) {
    for (int i = tid; i < active * C4; i += NT) cp_async16(smem_addr(acc_sm + i), acc_all + i, 16);
    cp_commit();
  }
#endif
  for (int i = tid; i < active * 2 * G; i += NT) sm_pml[i] = __ldcg(ml_all + i);
#if MMA
  if (staged) cp_wait<0>();
#endif
  __syncthreads();
  if (tid < G) {
    const int g = tid;
    float mx = NEG;
    for (int pp = 0; pp < active; ++pp) mx = fmaxf(mx, sm_pml[pp * 2 * G + g]);
    float tot = 0.f;
    for (int pp = 0; pp < active; ++pp) {
      const float w = exp2f(sm_pml[pp * 2 * G + g] - mx);
      sm_pw[pp][g] = w;
      tot = fmaf(w, sm_pml[pp * 2 * G + G + g], tot);
    }
    sm_tot[g] = tot;
  }
  __syncthreads();
  for (int item = tid; item < J * C4; item += NT) {
    const int col = item % C4, j = item / C4, g = col / H4;
    float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8  // independent L2 loads in flight; only the fma chain is serial
    for (int pp = j; pp < active; pp += J) {
      const float w = sm_pw[pp][g];
#if MMA
      const float4 x = staged ? acc_sm[pp * C4 + col] : __ldcg(acc_all + (size_t)pp * C4 + col);
#else
      const float4 x = __ldcg(acc_all + (size_t)pp * C4 + col);
#endif
      a = make_float4(fmaf(w, x.x, a.x), fmaf(w, x.y, a.y), fmaf(w, x.z, a.z), fmaf(w, x.w, a.w));
    }
    sm_red[item] = a;
  }
  __syncthreads();
  // E9: normalise; total == 0 iff the row saw no visible key -> zeros
  for (int col = tid; col < C4; col += NT) {
    const int g = col / H4, h4 = col % H4;
    float4 a = sm_red[col];
    for (int j = 1; j < J; ++j) {
      const float4 x = sm_red[j * C4 + col];
      a = make_float4(__fadd_rn(a.x, x.x), __fadd_rn(a.y, x.y), __fadd_rn(a.z, x.z),
                      __fadd_rn(a.w, x.w));
    }
    store_out4(oref, b, kvh, g, h4, a, sm_tot[g]);
  }
#if QUANT_OUT
  if (tid == 0 && kvh == 0) xg_out[b] = *oref.g;
#endif
}
