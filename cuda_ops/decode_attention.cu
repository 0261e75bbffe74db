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
// (1: a warp's next step of K / V loads is issued before its current step's math), POISON
// (1: three more operands, NaN-filled buffers aliased to the outputs, for the GPU tests).
// Operands: q [B, N, H] bf16, k_cache, v_cache [L, B, S, K, H]
// bf16, layer [] i32, q_positions [B] i32, k_positions [B, S] i32, live [] i32; outputs: out
// [B, N, H] bf16, ws_acc [B, K, P, G, H] f32, ws_ml [B, K, P, 2, G] f32 (garbage on entry:
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

constexpr int H = HEAD_DIM;
constexpr int G = GQA;
constexpr int N_HEADS = KV_HEADS * G;
constexpr int LPR = H / 8;            // lanes per K/V row (one 16-byte load each)
constexpr int KPW = 32 / LPR;         // rows per warp load = row groups (streams) per warp
constexpr int TILE = WARPS * UNROLL * KPW;
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

extern "C" __global__ void __launch_bounds__(NT, MIN_CTAS)
    rejax_flash_decode(const u16* __restrict__ q, const u16* __restrict__ k_cache,
                       const u16* __restrict__ v_cache, const int* __restrict__ layer_p,
                       const int* __restrict__ q_positions, const int* __restrict__ k_positions,
                       const int* __restrict__ live_p,
#if POISON
                       const u16* out_in, const float* acc_in, const float* ml_in,
#endif
                       u16* __restrict__ out, float* ws_acc, float* ws_ml) {
#if POISON
  (void)out_in;  // aliased to the outputs: NaN on entry
  (void)acc_in;
  (void)ml_in;
#endif
  const int p = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int bk = b * KV_HEADS + kvh;
  // E1: the split plan (flash_split_plan): tiles of TILE slots, at least MIN_TILES per split;
  // split 0 is active even when live == 0 (it then writes the empty partial, and the combine
  // returns zeros), so every (row, kv head) always has a last CTA that writes its output.
  const int live = clampi(*live_p, 0, S_SLOTS);
  const int tiles = (live + TILE - 1) / TILE;
  const int per = max((tiles + SPLITS - 1) / SPLITS, MIN_TILES);
  const int active = max((tiles + per - 1) / per, 1);
  if (p >= active) return;  // beyond the live range: no partial, no arrival
  const int layer = clampi(*layer_p, 0, N_LAYERS - 1);
  const int start = p * per * TILE;
  const int end = min(start + per * TILE, live);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int r = lane / LPR, c = lane % LPR;
  const int qpos = q_positions[b];
  const float scale = SCORE_SCALE;  // E2: H**-0.5 * log2(e) in float32 (flash_score_scale)

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

  __shared__ float4 sm_acc[WARPS][G][H4];
  __shared__ float sm_m[WARPS][G], sm_l[WARPS][G], sm_c[WARPS][G];
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
  __syncthreads();

  // E7: merge the warps, in warp order: this CTA's partial (m, l, acc) to the workspace
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
    acc_out[col] = a;
  }

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
  for (int i = tid; i < active * 2 * G; i += NT) sm_pml[i] = __ldcg(ml_all + i);
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
  const float4* acc_all = reinterpret_cast<const float4*>(ws_acc) + (size_t)bk * SPLITS * C4;
  for (int item = tid; item < J * C4; item += NT) {
    const int col = item % C4, j = item / C4, g = col / H4;
    float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8  // independent L2 loads in flight; only the fma chain is serial
    for (int pp = j; pp < active; pp += J) {
      const float w = sm_pw[pp][g];
      const float4 x = __ldcg(acc_all + (size_t)pp * C4 + col);
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
    const float tot = sm_tot[g];
    float o[4] = {a.x, a.y, a.z, a.w};
    u32 pk[2];
#pragma unroll
    for (int i = 0; i < 4; ++i) o[i] = tot > 0.f ? __fdiv_rn(o[i], tot) : 0.f;
    pk[0] = f32_to_bf16(o[0]) | (f32_to_bf16(o[1]) << 16);
    pk[1] = f32_to_bf16(o[2]) | (f32_to_bf16(o[3]) << 16);
    *reinterpret_cast<uint2*>(out + ((size_t)b * N_HEADS + kvh * G + g) * H + 4 * h4) =
        make_uint2(pk[0], pk[1]);
  }
}
