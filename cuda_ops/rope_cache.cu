// The decode step's attention prologue in one launch (one new token per row):
//   q      = rope(rms_norm(q_heads, q_norm[layer]))           -> q_out [B, N, H]
//   k      = rope(rms_norm(k_heads, k_norm[layer]))           -> k_cache[layer, b, slot[b]]
//   v      = v_heads                                          -> v_cache[layer, b, slot[b]]
// from the fused qkv projection's output [B, (N + 2 * KV) * H] (q heads, then k, then v).
// In XLA this is about seven launches per layer (two norms with their reductions, the cos/sin
// concatenation, the two rotations, the two cache writes); here one warp takes one head of one
// row. The KV cache is written in place: k_cache / v_cache are operands aliased to the outputs
// of the same position (the custom call declares the aliasing), so the kernel writes the one
// new slot per row and leaves every other slot as it is.
//
// Numerics follow the composition rejax.layers.rms_norm -> rejax.layers.rope (the reference in
// rejax/ops/rope_cache.py), with its bf16 roundings: the norm is
//   rbf16(w * rbf16(x * rsqrt(mean(x^2) + eps)))
// (the mean square summed in this kernel's order: a lane's elements, then a butterfly), and the
// rotation with cos / sin rounded to bf16 is rbf16(rbf16(x * cos) + rbf16(rot(x) * sin)), the
// angle float(position) * inv_freq[j] with inv_freq handed in (the reference's own values) and
// CUDA's cosf / sinf.
//
// Constants (-D at NVRTC time, cuda_ops/rope_cache.py):
//   B_ROWS, N_HEADS, KV_HEADS, HEAD_DIM, S_SLOTS   shapes (HEAD_DIM % 32 == 0)
//   QK_NORM     1: Qwen3's per-head RMSNorm of q and k before the rotation; 0: none (Qwen2)
//   NORM_EPS    the norm's epsilon (float literal)
//   INDEX_ROWS  1: the write slot is index[b] per row (a negative slot counts from the end once,
//               then one outside [0, S) is dropped, as the reference's scatter with
//               mode="drop"); 0: one slot index[0] for every row,
//               clamped to [0, S - 1] like dynamic_update_slice
//   WARPS       warps per CTA
//   FIN_SPLITK  > 0: qkv is not an operand but the qkv GEMM's split-K finish of its float32
//               partials (nvfp4_gemm_finish's arithmetic, below; FIN_W_SHIFT, FIN_GW_ROWS as
//               that GEMM's W_SHIFT, GW_ROWS): the GEMM's finish and this kernel in one launch
// Operands: qkv, q_norm [L, H], k_norm [L, H], layer [], positions [B], index [1] / [B],
// inv_freq f32 [H / 2], k_cache, v_cache [L, B, S, KV, H]; outputs q_out, k_cache, v_cache.
// With FIN_SPLITK, qkv is replaced by three operands: the partials f32 [FIN_SPLITK, B, (N +
// 2 KV) H], the GEMM's activation global scale xgp f32 [B] and its weight global scale(s) wg
// f32 [L] or [L, (N + 2 KV) H] (11 operands).

typedef unsigned short u16;
typedef unsigned int u32;

#ifndef QK_NORM
#define QK_NORM 1
#endif
#ifndef INDEX_ROWS
#define INDEX_ROWS 0
#endif
#ifndef NORM_EPS
#define NORM_EPS 1e-6f
#endif
#ifndef WARPS
#define WARPS 4
#endif
#ifndef FIN_SPLITK
#define FIN_SPLITK 0
#endif
#ifndef FIN_W_SHIFT
#define FIN_W_SHIFT 7
#endif
#ifndef FIN_GW_ROWS
#define FIN_GW_ROWS 0
#endif

constexpr int E = HEAD_DIM / 32;  // elements per lane, contiguous: lane l holds [E l, E l + E)
constexpr int HEADS = N_HEADS + 2 * KV_HEADS;
constexpr int QKV_COLS = HEADS * HEAD_DIM;
static_assert(HEAD_DIM % 32 == 0, "HEAD_DIM must be a multiple of 32");

__device__ __forceinline__ float bf16f(u16 h) { return __uint_as_float((u32)h << 16); }

// round to nearest even (the inputs are finite or NaN; NaN stays NaN)
__device__ __forceinline__ u16 f32_to_bf16(float f) {
  const u32 u = __float_as_uint(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (u16)((u >> 16) | 0x40u);
  return (u16)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
__device__ __forceinline__ float rbf16(float f) { return bf16f(f32_to_bf16(f)); }

// this lane's E values of a head (16-bit loads: E may be 1)
__device__ __forceinline__ void load_head(float (&v)[E], const u16* p, int lane) {
#pragma unroll
  for (int j = 0; j < E; ++j) v[j] = bf16f(p[E * lane + j]);
}

#if FIN_SPLITK
// this lane's E values of a head as the qkv GEMM's finish stores them (nvfp4_gemm_finish): the
// partials added in split order, times 2^(14 - W_SHIFT), times global_w * global_x, rounded
// once to bf16 (cvt.rn, as there); p: split 0's partials of the head, wg: the layer's scale(s)
// at the head's first column (FIN_GW_ROWS) or the layer's one scale
__device__ __forceinline__ void fin_head(float (&v)[E], const float* p, const float* wg, float xg,
                                         int lane) {
  constexpr float UNSCALE = (float)(1 << (14 - FIN_W_SHIFT));
  constexpr size_t SPLIT = (size_t)B_ROWS * QKV_COLS;
#pragma unroll
  for (int j = 0; j < E; ++j) {
    const int c = E * lane + j;
    float acc = p[c];
#pragma unroll
    for (int s = 1; s < FIN_SPLITK; ++s) acc += p[s * SPLIT + c];
    const float alpha = wg[FIN_GW_ROWS ? c : 0] * xg;
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(acc * UNSCALE * alpha));
    v[j] = bf16f(r);
  }
}
#endif

__device__ __forceinline__ void store_head(u16* p, const float (&v)[E], int lane) {
#pragma unroll
  for (int j = 0; j < E; ++j) p[E * lane + j] = f32_to_bf16(v[j]);
}

// rms_norm over the head (the warp's 32 x E values), then the rotation at `pos`
__device__ __forceinline__ void norm_rope(float (&v)[E], const u16* nw, const float* inv_freq,
                                          int pos, int lane) {
  if constexpr (QK_NORM) {
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < E; ++j) s = fmaf(v[j], v[j], s);
#pragma unroll
    for (int b = 16; b >= 1; b >>= 1) s += __shfl_xor_sync(0xffffffffu, s, b);
    const float rs = rsqrtf(s / (float)HEAD_DIM + NORM_EPS);
#pragma unroll
    for (int j = 0; j < E; ++j) v[j] = rbf16(bf16f(nw[E * lane + j]) * rbf16(v[j] * rs));
  }
  // rotate_half: element i < H/2 pairs with i + H/2 (lane l ^ 16, same j)
  const bool low = lane < 16;
  const float fp = (float)pos;
#pragma unroll
  for (int j = 0; j < E; ++j) {
    const float other = __shfl_xor_sync(0xffffffffu, v[j], 16);
    const float rot = low ? -other : other;
    const float ang = fp * inv_freq[(E * lane + j) % (HEAD_DIM / 2)];
    const float c = rbf16(cosf(ang)), sn = rbf16(sinf(ang));
    v[j] = rbf16(rbf16(v[j] * c) + rbf16(rot * sn));
  }
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
#if FIN_SPLITK
    qk_norm_rope_cache(const float* __restrict__ part, const float* __restrict__ xgp,
                       const float* __restrict__ wg, const u16* __restrict__ q_norm,
#else
    qk_norm_rope_cache(const u16* __restrict__ qkv, const u16* __restrict__ q_norm,
#endif
                       const u16* __restrict__ k_norm, const int* __restrict__ layer,
                       const int* __restrict__ positions, const int* __restrict__ index,
                       const float* __restrict__ inv_freq, const u16* k_cache_in,
                       const u16* v_cache_in, u16* __restrict__ q_out, u16* k_cache,
                       u16* v_cache) {
  (void)k_cache_in;  // aliased to k_cache / v_cache: the outputs are written in place
  (void)v_cache_in;
  const int lane = threadIdx.x & 31;
  const int w = blockIdx.x * WARPS + (threadIdx.x >> 5);
  if (w >= B_ROWS * HEADS) return;
  const int b = w / HEADS, head = w % HEADS;
  const long long li = (long long)(unsigned)*layer;
  float v[E];
#if FIN_SPLITK
  fin_head(v, part + (size_t)b * QKV_COLS + (size_t)head * HEAD_DIM,
           wg + li * (FIN_GW_ROWS ? QKV_COLS : 1) + (FIN_GW_ROWS ? head * HEAD_DIM : 0), xgp[b],
           lane);
#else
  load_head(v, qkv + (size_t)b * QKV_COLS + (size_t)head * HEAD_DIM, lane);
#endif
  if (head < N_HEADS) {
    norm_rope(v, q_norm + li * HEAD_DIM, inv_freq, positions[b], lane);
    store_head(q_out + ((size_t)b * N_HEADS + head) * HEAD_DIM, v, lane);
    return;
  }
  int slot = INDEX_ROWS ? index[b] : index[0];
  if (INDEX_ROWS) {
    if (slot < 0) slot += S_SLOTS;  // jnp indexing wraps a negative index once
    if (slot < 0 || slot >= S_SLOTS) return;  // then drops what is outside, as the scatter
  } else {
    slot = min(max(slot, 0), S_SLOTS - 1);  // dynamic_update_slice's clamp
  }
  const bool is_k = head < N_HEADS + KV_HEADS;
  const int kh = head - N_HEADS - (is_k ? 0 : KV_HEADS);
  if (is_k) norm_rope(v, k_norm + li * HEAD_DIM, inv_freq, positions[b], lane);
  const size_t at = ((((size_t)li * B_ROWS + b) * S_SLOTS + slot) * KV_HEADS + kh) * HEAD_DIM;
  store_head((is_k ? k_cache : v_cache) + at, v, lane);
}
