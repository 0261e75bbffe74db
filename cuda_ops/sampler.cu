// The fused GPU sampler: temperature (or ReSET's entropy policy) + exact top-p + a Gumbel-max draw.
//
// Three kernels over B rows of V float32 (or bfloat16) logits, each a grid of CHUNKS x B blocks
// (one chunk of a row per block) whose last block to finish a row (an atomic ticket, no grid
// sync) combines it:
//
//   rejax_sample_stats    max, first / last argmax, the entropy's sums and the softmax
//                         denominators at both candidate temperatures; the last block picks the
//                         row's temperature (high = h >= thr || h > alt) -> stats [B, 4], arg [B, 2]
//   rejax_sample_hist     per token p = exp((z - m) / t) / denom, its integer mass q (units of
//                         2**-30) and a histogram of q over NB bins of p's bit pattern (ties share
//                         a bin), plus the best Gumbel score per bin; the last block finds the
//                         boundary bin b (the lowest bin whose top-ranked token is kept) -> plan
//   rejax_sample_resolve  collects the tokens of bin b (at most NMAX), sorts them by (p, id) and
//                         applies the exact keep rule; the draw is the best score over the bins
//                         above b and the kept tokens of b. A bin of more than NMAX tokens is
//                         resolved by the last block alone (two finer histograms, then the tie
//                         group cut by id).
//
// With TOP_K = k > 0 (top-k, then top-p on the renormalised top-k softmax, as rejax.sampling):
// the histogram counts tokens per bin of the tempered logit and finds the bin of the k-th
// largest; resolve collects every token in that bin or above (a superset of the top k), sorts
// them, cuts at the k-th largest value (ties kept), renormalises and applies top-p to the list
// exactly. More than NMAX of them: the last block selects the k-th largest by three histogram
// levels over V, and for a tie group larger than the list runs top-p over V restricted to the
// top-k set by itself.
//
// The keep rule is rejax.sampling's: a token is kept iff f32(mass ranked above it) < f32(top_p) *
// f32(total mass), ranked by p with ties ordered by id (the higher id ranks above). Scratch
// lives in module globals that each row's last block clears again, so every launch starts clean.
// Compile-time constants (-D): B_ROWS, V_SIZE, CHUNKS, CH (chunk length), NTHREADS, NMAX, TOP_K,
// and CLUSTER: 0 builds the three kernels above ("split"); > 0 builds rejax_sample_cluster
// instead (the "cluster" variant, at the end of this file: the same sampler in one launch).
// LOGITS_BF16 = 1 builds any variant for bfloat16 logits, each read as its exact float32 value
// (the same results as the float32 build on the cast logits, from half the bytes).

typedef unsigned int u32;
typedef unsigned long long u64;

#ifndef CLUSTER
#define CLUSTER 0
#endif
#ifndef TOPP_SUBHIST  // the "merge" variant's top-p (draw_subhist; the histogram's pruning)
#define TOPP_SUBHIST 0
#endif
#ifndef TOPK_MERGE  // the "merge" variant's top-k (per-block candidate lists)
#define TOPK_MERGE 0
#endif
#ifndef GRIDSYNC  // the "grid" variant: one launch, a grid of CTAs per row (end of this file)
#define GRIDSYNC 0
#endif
#ifndef REJECT  // the "reject" variant: the cluster kernel with a first draw over every token
#define REJECT 0
#endif
#ifndef LOGITS_BF16  // bfloat16 logits (each read as its exact float32)
#define LOGITS_BF16 0
#endif

#define NB 2048                      // bins of the top-p histogram (and of the finer levels)
#define BPT (NB / NTHREADS)          // bins per thread in the last block
#define NWARPS (NTHREADS / 32)
#define KEY_LO ((127u - 31u) << 23)  // bit pattern of 2**-31: larger patterns have mass >= 1
#define BIN_BITS 17                  // key bits below the bin index
#define GREEDY_EPS 1e-6f
// A token can win the draw only if its tempered logit is >= FLOOR: the top-ranked token (always
// kept, zt within 2**-24 of 0) scores >= -3.66 (the smallest Gumbel value gumbel_of() returns,
// -log(56 log 2)) and no token scores above zt + 38.82 (the largest, 56 log 2), so
// FLOOR = -(38.82 + 3.66) less a margin.
#define FLOOR (-43.0f)
#define MASS_SCALE 1073741824.0f     // 2**30
#define INT_BIG 0x7fffffff
#define INFINITY __int_as_float(0x7f800000)

// ----------------------------------------------------------------------------- helpers

// The logits of a row, float32 or (LOGITS_BF16) bfloat16 read as the float32 of the same value
// (exact), so every variant computes the same from either.
#if LOGITS_BF16
typedef unsigned short logit_t;
__device__ __forceinline__ float logit_f(u32 h) { return __uint_as_float(h << 16); }
#else
typedef float logit_t;
#endif
struct Logits {
    const logit_t* p;
#if LOGITS_BF16
    __device__ __forceinline__ float operator[](int i) const { return logit_f(__ldg(p + i)); }
#else
    __device__ __forceinline__ float operator[](int i) const { return p[i]; }
#endif
};

// The four logits z[j0, j0 + 4) of a chunk that ends at hi (-inf past it).
__device__ __forceinline__ void load4(Logits z, int j0, int hi, float (&x)[4]) {
#if V_SIZE % 4 == 0  // CH % 4 == 0 and rows of V % 4 == 0 logits: aligned vector loads
#if LOGITS_BF16
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(z.p + j0));
    x[0] = __uint_as_float(v.x << 16);
    x[1] = __uint_as_float(v.x & 0xFFFF0000u);
    x[2] = __uint_as_float(v.y << 16);
    x[3] = __uint_as_float(v.y & 0xFFFF0000u);
#else
    const float4 v = __ldg(reinterpret_cast<const float4*>(z.p + j0));
    x[0] = v.x;
    x[1] = v.y;
    x[2] = v.z;
    x[3] = v.w;
#endif
#else
#pragma unroll
    for (int q = 0; q < 4; ++q) x[q] = j0 + q < hi ? z[j0 + q] : -INFINITY;
#endif
}

__device__ __forceinline__ u32 rotl(u32 x, int r) { return (x << r) | (x >> (32 - r)); }

// Philox-4x32-10 (Random123's constants), the 4 output words for counter (c0, c1, c2, c3).
__device__ __forceinline__ uint4 philox(u32 c0, u32 c1, u32 c2, u32 c3, u32 k0, u32 k1) {
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        if (r) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const u32 lo0 = 0xD2511F53u * c0, hi0 = __umulhi(0xD2511F53u, c0);
        const u32 lo1 = 0xCD9E8D57u * c2, hi1 = __umulhi(0xCD9E8D57u, c2);
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
    }
    return make_uint4(c0, c1, c2, c3);
}

// jax.random.fold_in(key, data) of a threefry key (k0, k1), JAX's default key: Threefry-2x32
// with 20 rounds of (k0, k1) on the counter pair (0, data); the new key is the output pair.
// Integer operations only, so the grid kernel's row keys are the bits XLA's fold_in makes.
__device__ __forceinline__ void threefry_fold_in(u32 k0, u32 k1, u32 data, u32& o0, u32& o1) {
    const u32 ks[3] = {k0, k1, k0 ^ k1 ^ 0x1BD11BDAu};
    const int rot[2][4] = {{13, 15, 26, 6}, {17, 29, 16, 24}};
    u32 x0 = 0u + ks[0], x1 = data + ks[1];
#pragma unroll
    for (int i = 0; i < 5; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            x0 += x1;
            x1 = rotl(x1, rot[i & 1][j]);
            x1 ^= x0;
        }
        x0 += ks[(i + 1) % 3];
        x1 += ks[(i + 2) % 3] + (u32)(i + 1);
    }
    o0 = x0;
    o1 = x1;
}

// Gumbel noise from 55 random bits, a word hi and the top 23 bits of a word lo: u = (hi * 2**23
// + (lo >> 9) + 1/2) / 2**55 and the noise is -log(E) of the exponential E = -log(1 - u). Each
// end comes from the half of u's range nearer to it, so nothing is lost to rounding u near 1:
// x = min(u, 1 - u) (the complement is the bitwise one of the 55 bits), E = -log1p(-x) for
// u < 1/2 and -log(x) otherwise. The noise spans [-3.66, 38.82] and P(noise > t) is right to
// float rounding (23-bit uniforms stop at 16.6, which draws tokens ~1e-7 of the top one about
// half as often as they should be). With a >= 2**24 the lo term is below half an ulp of
// a * 2**-32, so x does not depend on lo: callers may pass lo = 0 then (need_lo()).
__device__ __forceinline__ float gumbel_of(u32 hi, u32 lo) {
    const bool upper = hi >= 0x80000000u;
    const u32 a = upper ? ~hi : hi, b = (upper ? ~lo : lo) >> 9;
    const float x = (float)a * 2.3283064365386963e-10f               // 2**-32
                    + ((float)b + 0.5f) * 2.7755575615628914e-17f;  // 2**-55; x in (0, 1/2]
    const float e = upper ? -logf(x) : -log1pf(-x);
    return -logf(e);
}
__device__ __forceinline__ bool need_lo(u32 hi) {  // whether gumbel_of(hi, lo) depends on lo
    return (hi >= 0x80000000u ? ~hi : hi) < 0x01000000u;
}
__device__ __forceinline__ u32 word(uint4 w, int i) {
    return i == 0 ? w.x : i == 1 ? w.y : i == 2 ? w.z : w.w;
}
// Token id's noise under the row key: hi = word id % 4 of Philox at counter (id / 4, 0, 0, 0),
// lo = word id % 4 of Philox at counter (id / 4, 1, 0, 0) (computed only when it matters).
__device__ __forceinline__ float gumbel(u32 k0, u32 k1, int id) {
    const u32 hi = word(philox((u32)id >> 2, 0u, 0u, 0u, k0, k1), id & 3);
    const u32 lo = need_lo(hi) ? word(philox((u32)id >> 2, 1u, 0u, 0u, k0, k1), id & 3) : 0u;
    return gumbel_of(hi, lo);
}

// The top-ranked token is always kept; its tempered logit is within 2.5e-7 of 0 and its noise is
// >= -log(56 log 2) = -3.65883 (gumbel_of's least value), so the best kept score is >= -3.6589:
// a token whose score cannot reach PRUNE_SCORE (0.011 lower, for rounding) never wins.
#define PRUNE_SCORE (-3.67f)
// An upper bound of gumbel_of(hi, lo) over every lo, from the word hi alone: u >= 1/2 gives
// E >= log 2; below it E = -log1p(-x) >= x >= hi 2**-32. The 1e-4 covers __logf's error (~1e-6).
__device__ __forceinline__ float gumbel_bound(u32 hi) {
    if (hi >= 0x80000000u) return 0.36652f;  // -log(log 2) = 0.366513
    if (hi == 0u) return INFINITY;
    return 22.18071f + 1e-4f - __logf((float)hi);  // 32 log 2 - log(hi)
}

// (score, id) packed so that a larger u64 is a larger score, then the lower id; 0 = none.
__device__ __forceinline__ u64 pack(float s, int id) {
    u32 b = __float_as_uint(s);
    b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((u64)b << 32) | (u64)(0xFFFFFFFFu - (u32)id);
}
__device__ __forceinline__ int unpack_id(u64 p) { return (int)(0xFFFFFFFFu - (u32)(p & 0xFFFFFFFFu)); }

__device__ __forceinline__ u32 mass_of_key(u32 key) {
    return (u32)rintf(__uint_as_float(key) * MASS_SCALE);
}

// The token's tempered logit and the bit pattern of its probability (the same code in every
// kernel, so all of them see identical values): multiplies by the row's 1 / t and 1 / denominator.
__device__ __forceinline__ float tempered(float z, float m, float inv_t) { return (z - m) * inv_t; }
__device__ __forceinline__ u32 prob_key(float zt, float inv_den) {
    return __float_as_uint(expf(zt) * inv_den);
}
__device__ __forceinline__ int bin_of(u32 key) {
    return key > KEY_LO ? (int)((key - KEY_LO - 1u) >> BIN_BITS) + 1 : 0;
}
__device__ __forceinline__ u32 bin_lo(int b) { return KEY_LO + 1u + ((u32)(b - 1) << BIN_BITS); }

// Reductions: an associative operation with its identity, over a warp (butterfly shuffles) or
// a block (every thread gets the result; `red` is NWARPS words of scratch). The order of the
// operations is fixed, so every block of a row reduces the same way.
struct Sum {
    __device__ static float identity() { return 0.0f; }
    __device__ static float apply(float a, float b) { return a + b; }
};
struct MaxF {
    __device__ static float identity() { return -INFINITY; }
    __device__ static float apply(float a, float b) { return fmaxf(a, b); }
};
struct MinI {
    __device__ static int identity() { return INT_BIG; }
    __device__ static int apply(int a, int b) { return min(a, b); }
};
struct MaxI {
    __device__ static int identity() { return -1; }
    __device__ static int apply(int a, int b) { return max(a, b); }
};
struct MaxU64 {
    __device__ static u64 identity() { return 0ull; }
    __device__ static u64 apply(u64 a, u64 b) { return b > a ? b : a; }
};

template <typename Op, typename T>
__device__ __forceinline__ T warp_reduce(T x) {
    for (int o = 16; o; o >>= 1) x = Op::apply(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

template <typename Op, typename T>
__device__ T block_reduce(T x, T* red) {
    x = warp_reduce<Op>(x);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = x;
    __syncthreads();
    x = threadIdx.x < NWARPS ? red[threadIdx.x] : Op::identity();
    if (threadIdx.x < 32) x = warp_reduce<Op>(x);
    if (threadIdx.x == 0) red[0] = x;
    __syncthreads();
    return red[0];
}
// Inclusive prefix sum over threads in thread order (u32, or u64 for the "cdf" weights);
// *total gets the block's sum. `red` holds NWARPS values.
template <typename T>
__device__ T block_scan(T x, T* red, T* total) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    for (int o = 1; o < 32; o <<= 1) {
        const T y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    __syncthreads();
    if (lane == 31) red[w] = x;
    __syncthreads();
    if (w == 0) {
        T s = lane < NWARPS ? red[lane] : (T)0;
        for (int o = 1; o < 32; o <<= 1) {
            const T y = __shfl_up_sync(0xffffffffu, s, o);
            if (lane >= o) s += y;
        }
        if (lane < NWARPS) red[lane] = s;
    }
    __syncthreads();
    const T out = x + (w > 0 ? red[w - 1] : (T)0);
    *total = red[NWARPS - 1];
    __syncthreads();
    return out;
}

// The last block to arrive for row r (after every block's writes are visible).
__device__ bool last_arrival(u32* counter, int* flag) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) *flag = atomicAdd(counter, 1u) == (u32)(CHUNKS - 1);
    __syncthreads();
    if (*flag) __threadfence();
    return *flag;
}

// Boundary of a histogram (NB bins, bin NB-1 ranked highest) whose bins sit below `base` mass:
// the lowest non-empty bin whose top-ranked token is kept, (float)(mass above it) < limit. All
// threads get (*b, *above); *b = INT_BIG if no bin qualifies.
__device__ void find_boundary(const u32* hm, const u32* hc, u32 base, float limit, u32* red,
                              int* ired, int* b, u32* above_b) {
    __shared__ u32 s_above;
    const int i0 = threadIdx.x * BPT;
    u32 mine = 0;
    for (int k = 0; k < BPT; ++k) mine += hm[i0 + k];
    u32 total;
    const u32 incl = block_scan(mine, red, &total);
    u32 above = base + (total - incl);
    int cand = INT_BIG;
    u32 cand_above = 0;
    for (int k = BPT - 1; k >= 0; --k) {
        const int i = i0 + k;
        if (hc[i] && (float)above < limit) {
            cand = i;
            cand_above = above;
        }
        above += hm[i];
    }
    const int best = block_reduce<MinI>(cand, ired);
    if (cand == best && best != INT_BIG) s_above = cand_above;
    __syncthreads();
    *b = best;
    *above_b = best != INT_BIG ? s_above : 0u;
    __syncthreads();
}

// ----------------------------------------------------------------------------- 1: statistics

#if !CLUSTER && !GRIDSYNC  // the split variant's kernels and scratch (the one-launch kernels
                           // are at the end)
__device__ u32 g_stats_done[B_ROWS];
__device__ float g_stats_part[B_ROWS * CHUNKS * 5];
__device__ int g_stats_arg[B_ROWS * CHUNKS * 2];

extern "C" __global__ void __launch_bounds__(NTHREADS)
rejax_sample_stats(const logit_t* __restrict__ logits, const float* __restrict__ thr,
                   const float* __restrict__ alt, const float* __restrict__ t_a,
                   const float* __restrict__ t_b, float* __restrict__ stats,
                   int* __restrict__ arg) {
    __shared__ float red[NWARPS];
    __shared__ int ired[NWARPS];
    __shared__ int is_last;
    const int r = blockIdx.y, c = blockIdx.x, tid = threadIdx.x;
    const Logits z{logits + (size_t)r * V_SIZE};
    const int lo = c * CH, hi = min(lo + CH, V_SIZE);
    const float ta_raw = t_a[r], tb_raw = t_b[r];
    const float ia = 1.0f / (ta_raw <= GREEDY_EPS ? 1.0f : ta_raw);
    const float ib = 1.0f / (tb_raw <= GREEDY_EPS ? 1.0f : tb_raw);

    float m = -INFINITY;
    int first = INT_BIG, last = -1;
    for (int j = lo + tid; j < hi; j += NTHREADS) {
        const float x = z[j];
        if (x > m) {
            m = x;
            first = j;
            last = j;
        } else if (x == m) {
            first = min(first, j);
            last = j;
        }
    }
    const float mc = block_reduce<MaxF>(m, red);
    first = block_reduce<MinI>(m == mc ? first : INT_BIG, ired);
    last = block_reduce<MaxI>(m == mc ? last : -1, ired);
    float s = 0.0f, u = 0.0f, sa = 0.0f, sb = 0.0f;
#if TOPK_MERGE || TOPP_SUBHIST  // "merge": one tempered sum when both temperatures are one
    const bool two = ib != ia;
#else
    const bool two = true;
#endif
    if (mc > -INFINITY) {
        for (int j = lo + tid; j < hi; j += NTHREADS) {
            const float d = z[j] - mc;
            const float e = expf(d);
            s += e;
            if (e > 0.0f) u += e * d;
            sa += expf(d * ia);
            if (two) sb += expf(d * ib);
        }
    }
    if (!two) sb = sa;  // the same terms in the same order: the same sum
    s = block_reduce<Sum>(s, red);
    u = block_reduce<Sum>(u, red);
    sa = block_reduce<Sum>(sa, red);
    sb = block_reduce<Sum>(sb, red);
    if (tid == 0) {
        float* p = g_stats_part + (size_t)(r * CHUNKS + c) * 5;
        p[0] = mc;
        p[1] = s;
        p[2] = u;
        p[3] = sa;
        p[4] = sb;
        g_stats_arg[(r * CHUNKS + c) * 2] = first;
        g_stats_arg[(r * CHUNKS + c) * 2 + 1] = last;
    }
    if (!last_arrival(&g_stats_done[r], &is_last)) return;
    if (tid >= 32) return;
    // one warp combines the row's chunks (rescaling each chunk's sums to the row max)
    const float* part = g_stats_part + (size_t)r * CHUNKS * 5;
    float mw = -INFINITY;
    for (int i = tid; i < CHUNKS; i += 32) mw = fmaxf(mw, __ldcg(part + i * 5));
    mw = warp_reduce<MaxF>(mw);
    float S = 0.0f, U = 0.0f, SA = 0.0f, SB = 0.0f;
    int f = INT_BIG, l = -1;
    for (int i = tid; i < CHUNKS; i += 32) {
        const float mi = __ldcg(part + i * 5), si = __ldcg(part + i * 5 + 1);
        if (mi == mw) {
            f = min(f, __ldcg(g_stats_arg + (r * CHUNKS + i) * 2));
            l = max(l, __ldcg(g_stats_arg + (r * CHUNKS + i) * 2 + 1));
        }
        if (si > 0.0f) {
            const float dm = mi - mw, w = expf(dm);
            S += si * w;
            U += w * (__ldcg(part + i * 5 + 2) + si * dm);
            SA += __ldcg(part + i * 5 + 3) * expf(dm * ia);
            SB += __ldcg(part + i * 5 + 4) * expf(dm * ib);
        }
    }
    S = warp_reduce<Sum>(S);
    U = warp_reduce<Sum>(U);
    SA = warp_reduce<Sum>(SA);
    SB = warp_reduce<Sum>(SB);
    f = warp_reduce<MinI>(f);
    l = warp_reduce<MaxI>(l);
    if (tid == 0) {
        const float h = logf(S) - U / S;
        const bool high = (h >= thr[r]) || (h > alt[r]);
        stats[r * 4 + 0] = mw;
        stats[r * 4 + 1] = high ? ta_raw : tb_raw;
        stats[r * 4 + 2] = high ? SA : SB;
        stats[r * 4 + 3] = h;
        arg[r * 2 + 0] = f == INT_BIG ? 0 : f;
        arg[r * 2 + 1] = l < 0 ? 0 : l;
        g_stats_done[r] = 0u;
    }
}
#endif  // !CLUSTER

// ----------------------------------------------------------------------------- 2: histogram

#if !CLUSTER && !GRIDSYNC
__device__ u32 g_hist_done[B_ROWS];
__device__ u32 g_hist_mass[B_ROWS * NB];
__device__ u32 g_hist_cnt[B_ROWS * NB];
__device__ u64 g_hist_best[B_ROWS * NB];
#endif

// plan [B, 8] ints: 0 mode (0: token final in slot 1; 1: resolve top-p bin b; 2: top-k), 1 token,
// 2 bin b (top-k: the bin of the k-th largest), 3 mass above b, 4 tokens in b (top-k: in bins
// >= b), 5 limit (float bits), 6 / 7 best score above b (lo / hi word)
#define PLAN 8

// Top-k bins: a monotone function of the tempered logit itself (equal values share a bin), 1/64
// of a raw logit unit wide, the highest bin holding the maximum; gaps beyond 32 share bin 0.
__device__ __forceinline__ int topk_bin(float zt, float t) {
    const float x = -zt * (t * 64.0f);
    return NB - 1 - (x < (float)(NB - 1) ? (int)x : NB - 1);
}

// TOPK_MERGE (the "merge" variant, top-k <= 32): each hist block also lists its chunk's top-k
// candidates, every token in a bin at or above the chunk's own k-th largest (CAND at most).
// The row's k-th largest is at least any chunk's, so the candidates in bins >= the row's bin b
// are exactly the tokens resolve would collect. Hist's last block finds b, gathers the
// candidates in bins >= b and draws (topk_draw) itself, so the plan holds the token (mode 0)
// and resolve exits at once: no sweep over V and no second last-block ticket. (The draw stays
// in this kernel because each custom call loads its own copy of the module, so resolve would
// see other g_cand globals.) A chunk with more than CAND candidates (ties), or more than NMAX
// of them in all, sends the row down the split path (mode 2).
#if TOP_K > 0 && TOPK_MERGE && !CLUSTER && !GRIDSYNC
#define CAND 64
static_assert(TOP_K <= CAND / 2 && NMAX <= NB, "merge: k <= 32, and the list fits hb");
__device__ u32 g_cand_over[B_ROWS];
__device__ u32 g_cand_n[B_ROWS * CHUNKS];
__device__ u64 g_cand[B_ROWS * CHUNKS * CAND];
__device__ __forceinline__ u32 ord_of(float f);
__device__ __forceinline__ float float_of_ord(u32 o);
__device__ int topk_draw(u64* list, int n, float tp, Logits z, float m, float it, u32 k0,
                         u32 k1, float floor_score, u32* hm, u32* hc, u32* red, int* ired,
                         u64* ured, float* fred);

// The highest bin b of a top-k histogram whose count from the top reaches TOP_K, and the count
// in bins >= b; with fewer than TOP_K counted tokens, b = 0 and the whole count. Every thread
// gets both. (The split variant's last block keeps its own inline copy of this search, so
// that its code stays the one measured on the H200 until "merge" replaces it.)
__device__ void topk_boundary(const u32* hc, u32* red, int* ired, int* b_out, u32* n_ge) {
    __shared__ u32 s_ge;
    const int i0 = threadIdx.x * BPT;
    u32 mine = 0;
    for (int k = 0; k < BPT; ++k) mine += hc[i0 + k];
    u32 total;
    const u32 incl = block_scan(mine, red, &total);
    u32 s = total - incl;
    int cand = -1;
    u32 cand_s = 0;
    for (int k = BPT - 1; k >= 0; --k) {
        s += hc[i0 + k];
        if (cand < 0 && s >= (u32)TOP_K) {
            cand = i0 + k;
            cand_s = s;
        }
    }
    const int b = block_reduce<MaxI>(cand, ired);
    if (b >= 0 && cand == b) s_ge = cand_s;
    __syncthreads();
    *b_out = b < 0 ? 0 : b;
    *n_ge = b < 0 ? total : s_ge;
    __syncthreads();
}
#endif

#if !CLUSTER && !GRIDSYNC
extern "C" __global__ void __launch_bounds__(NTHREADS)
rejax_sample_hist(const logit_t* __restrict__ logits, const float* __restrict__ stats,
                  const int* __restrict__ arg, const float* __restrict__ top_p,
                  const u32* __restrict__ keys, int* __restrict__ plan) {
    __shared__ u32 hm[NB], hc[NB];
    __shared__ u64 hb[NB];
    __shared__ u32 red[NWARPS];
    __shared__ int ired[NWARPS];
    __shared__ u64 ured[NWARPS];
#if TOP_K > 0 && TOPK_MERGE
    __shared__ float fred[NWARPS];
#endif
    __shared__ int is_last;
    const int r = blockIdx.y, c = blockIdx.x, tid = threadIdx.x;
    const float m = stats[r * 4], t = stats[r * 4 + 1], den = stats[r * 4 + 2];
    int* pl = plan + r * PLAN;
    if (t <= GREEDY_EPS) {  // greedy row: the first argmax of the raw logits
        if (c == 0 && tid == 0) {
            pl[0] = 0;
            pl[1] = arg[r * 2];
        }
        return;
    }
    const float tp = top_p[r];
    const float it = 1.0f / t, iden = 1.0f / den;
    const u32 k0 = keys[r * 2], k1 = keys[r * 2 + 1];
    const float floor_score = FLOOR;
    for (int i = tid; i < NB; i += NTHREADS) {
        hm[i] = 0u;
        hc[i] = 0u;
        hb[i] = 0ull;
    }
    __syncthreads();
    const Logits z{logits + (size_t)r * V_SIZE};
    const int lo = c * CH, hi = min(lo + CH, V_SIZE);
    // four consecutive tokens per thread: one Philox call gives the noise of all four
    for (int j0 = lo + 4 * tid; j0 < hi; j0 += 4 * NTHREADS) {
        float x[4];
#if LOGITS_BF16
        load4(z, j0, hi, x);
#elif V_SIZE % 4 == 0
        const float4 v4 = *reinterpret_cast<const float4*>(z.p + j0);  // CH % 4 == 0: aligned
        x[0] = v4.x;
        x[1] = v4.y;
        x[2] = v4.z;
        x[3] = v4.w;
#else
        for (int q = 0; q < 4; ++q) x[q] = j0 + q < hi ? z[j0 + q] : -INFINITY;
#endif
#if TOP_K > 0
        for (int q = 0; q < 4; ++q) {
            const float zt = tempered(x[q], m, it);
            if (zt > -INFINITY) atomicAdd(&hc[topk_bin(zt, t)], 1u);
        }
#else
        float zt[4];
        bool any = false;
        for (int q = 0; q < 4; ++q) {
            zt[q] = tempered(x[q], m, it);
            any |= zt[q] >= floor_score;
        }
        const uint4 w = any ? philox((u32)j0 >> 2, 0u, 0u, 0u, k0, k1) : make_uint4(0, 0, 0, 0);
        // the low words, only if some token's noise depends on them (about 3% of threads)
        bool lo_needed = false;
        for (int q = 0; q < 4; ++q) lo_needed |= zt[q] >= floor_score && need_lo(word(w, q));
        const uint4 wl = lo_needed ? philox((u32)j0 >> 2, 1u, 0u, 0u, k0, k1)
                                   : make_uint4(0, 0, 0, 0);
        for (int q = 0; q < 4; ++q) {
            if (!(zt[q] > -INFINITY)) continue;  // masked (and NaN) logits are never drawn
            const u32 key = prob_key(zt[q], iden);
            const int b = bin_of(key);
            if (b > 0) {
                atomicAdd(&hm[b], mass_of_key(key));
                atomicAdd(&hc[b], 1u);
            }
#if TOPP_SUBHIST  // "merge": no noise for a token that cannot win (the cluster kernel's bound)
            if (zt[q] >= floor_score && zt[q] + gumbel_bound(word(w, q)) >= PRUNE_SCORE)
#else
            if (zt[q] >= floor_score)
#endif
                atomicMax(&hb[b], pack(zt[q] + gumbel_of(word(w, q), word(wl, q)), j0 + q));
        }
#endif
    }
    __syncthreads();
#if TOP_K > 0 && TOPK_MERGE
    {  // this chunk's candidates: its tokens in bins at or above its own k-th largest's
        int bl;
        u32 nl;
        topk_boundary(hc, red, ired, &bl, &nl);
        if (nl <= (u32)CAND) {
            __shared__ u32 s_cnt;
            if (tid == 0) s_cnt = 0u;
            __syncthreads();
            u64* cand = g_cand + (size_t)(r * CHUNKS + c) * CAND;
            for (int j = lo + tid; j < hi; j += NTHREADS) {
                const float zt = tempered(z[j], m, it);
                if (zt > -INFINITY && topk_bin(zt, t) >= bl) {
                    const u32 slot = atomicAdd(&s_cnt, 1u);
                    if (slot < (u32)CAND) cand[slot] = ((u64)ord_of(zt) << 32) | (u32)j;
                }
            }
            __syncthreads();
            if (tid == 0) g_cand_n[r * CHUNKS + c] = min(s_cnt, (u32)CAND);
        } else if (tid == 0) {
            atomicOr(&g_cand_over[r], 1u);
        }
    }
#endif
    for (int i = tid; i < NB; i += NTHREADS) {
        if (hc[i]) {
            atomicAdd(&g_hist_mass[r * NB + i], hm[i]);
            atomicAdd(&g_hist_cnt[r * NB + i], hc[i]);
        }
        if (hb[i]) atomicMax(&g_hist_best[r * NB + i], hb[i]);
    }
    if (!last_arrival(&g_hist_done[r], &is_last)) return;
    // the row's histogram, cleared behind us for the next launch
    for (int i = tid; i < NB; i += NTHREADS) {
        hm[i] = __ldcg(&g_hist_mass[r * NB + i]);
        hc[i] = __ldcg(&g_hist_cnt[r * NB + i]);
        hb[i] = __ldcg(&g_hist_best[r * NB + i]);
        g_hist_mass[r * NB + i] = 0u;
        g_hist_cnt[r * NB + i] = 0u;
        g_hist_best[r * NB + i] = 0ull;
    }
    __syncthreads();
    if (tid == 0) g_hist_done[r] = 0u;
#if TOP_K > 0 && TOPK_MERGE
    {  // the row's b, then the draw from the chunks' candidates in bins >= b, here (mode 0)
        int b;
        u32 n_ge;
        topk_boundary(hc, red, ired, &b, &n_ge);
        __shared__ int s_split;
        __shared__ u32 s_m;
        if (tid == 0) {
            s_split = __ldcg(&g_cand_over[r]) != 0u || n_ge > (u32)NMAX;
            g_cand_over[r] = 0u;
            s_m = 0u;
        }
        __syncthreads();
        if (s_split) {  // the split path: resolve sweeps V for the tokens in bins >= b
            if (tid == 0) {
                pl[0] = 2;
                pl[2] = b;
                pl[4] = (int)n_ge;
            }
            return;
        }
        u64* list = hb;  // NMAX <= NB; the top-k histogram kernel leaves hb unused
        for (int i = tid; i < CHUNKS * CAND; i += NTHREADS) {
            const int cc = i / CAND, q = i - cc * CAND;
            if ((u32)q >= __ldcg(&g_cand_n[r * CHUNKS + cc])) continue;
            const u64 e = __ldcg(&g_cand[(size_t)(r * CHUNKS + cc) * CAND + q]);
            if (topk_bin(float_of_ord((u32)(e >> 32)), t) >= b) {
                const u32 slot = atomicAdd(&s_m, 1u);
                if (slot < (u32)NMAX) list[slot] = e;
            }
        }
        __syncthreads();
        // s_m == n_ge <= NMAX: the candidates in bins >= b are the tokens counted there
        const int token = topk_draw(list, (int)min(s_m, (u32)NMAX), tp, z, m, it, k0, k1, floor_score, hm, hc,
                                    red, ired, ured, fred);
        if (tid == 0) {
            pl[0] = 0;
            pl[1] = token;
        }
        return;
    }
#elif TOP_K > 0
    {  // b = the highest bin whose count from the top reaches k (0: fewer than k live tokens)
        const int i0 = tid * BPT;
        u32 mine = 0;
        for (int k = 0; k < BPT; ++k) mine += hc[i0 + k];
        u32 total;
        const u32 incl = block_scan(mine, red, &total);
        u32 s = total - incl;
        int cand = -1;
        u32 cand_s = 0;
        for (int k = BPT - 1; k >= 0; --k) {
            s += hc[i0 + k];
            if (cand < 0 && s >= (u32)TOP_K) {
                cand = i0 + k;
                cand_s = s;
            }
        }
        const int b = block_reduce<MaxI>(cand, ired);
        if (b < 0 && tid == 0) {
            pl[0] = 2;
            pl[2] = 0;
            pl[4] = (int)total;
        }
        if (b >= 0 && cand == b) {
            pl[0] = 2;
            pl[2] = b;
            pl[4] = (int)cand_s;
        }
        return;
    }
#endif
    if (tp >= 1.0f) {  // every token is kept
        u64 best = 0ull;
        for (int i = tid; i < NB; i += NTHREADS) best = hb[i] > best ? hb[i] : best;
        best = block_reduce<MaxU64>(best, ured);
        if (tid == 0) {
            pl[0] = 0;
            pl[1] = unpack_id(best);
        }
        return;
    }
    u32 mine = 0;
    for (int i = tid; i < NB; i += NTHREADS) mine += hm[i];
    u32 total;
    block_scan(mine, red, &total);
    const float limit = tp * (float)total;
    int b;
    u32 above_b;
    find_boundary(hm, hc, 0u, limit, red, ired, &b, &above_b);
    if (b == INT_BIG) b = NB - 1;  // unreachable for finite logits (the top bin qualifies)
    u64 best = 0ull;
    for (int i = tid; i < NB; i += NTHREADS)
        if (i > b && hb[i] > best) best = hb[i];
    best = block_reduce<MaxU64>(best, ured);
    if (tid == 0) {
        const u32 nb = hc[b], mb = hm[b];
        // bin b is kept whole if even its lowest token (mass >= its lower edge's) is kept
        const bool whole = nb == 1u || (float)(above_b + mb - mass_of_key(bin_lo(b))) < limit;
        if (whole) {
            pl[0] = 0;
            pl[1] = unpack_id(hb[b] > best ? hb[b] : best);
        } else {
            pl[0] = 1;
            pl[2] = b;
            pl[3] = (int)above_b;
            pl[4] = (int)nb;
            pl[5] = __float_as_int(limit);
            pl[6] = (int)(u32)(best & 0xFFFFFFFFull);
            pl[7] = (int)(u32)(best >> 32);
        }
    }
}
#endif  // !CLUSTER

// ----------------------------------------------------------------------------- 3: resolve

#if !CLUSTER && !GRIDSYNC
__device__ u32 g_res_done[B_ROWS];
__device__ u32 g_res_n[B_ROWS];
__device__ u64 g_res_list[B_ROWS * NMAX];
#endif

__device__ __forceinline__ u32 ord_of(float f) {  // order-preserving bits of a float
    const u32 b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float float_of_ord(u32 o) {
    return __uint_as_float((o & 0x80000000u) ? (o & 0x7FFFFFFFu) : ~o);
}

// Bitonic sort of list[0, n2) (n2 a power of two), descending.
__device__ void sort_desc(u64* list, int n2) {
    for (int k = 2; k <= n2; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = threadIdx.x; i < n2; i += NTHREADS) {
                const int ixj = i ^ j;
                if (ixj > i) {
                    const u64 a = list[i], bb = list[ixj];
                    if ((i & k) == 0 ? a < bb : a > bb) {
                        list[i] = bb;
                        list[ixj] = a;
                    }
                }
            }
            __syncthreads();
        }
    }
}

__device__ __forceinline__ int pow2_at_least(int n) {
    int n2 = 1;
    while (n2 < n) n2 <<= 1;
    return n2;
}

// list[0, n) holds (probability bits << 32 | id) in rank order below `base` mass: the best packed
// score among the kept ones (all of them if `full`).
__device__ u64 draw_sorted(const u64* list, int n, u32 base, float limit, bool full,
                           Logits z, float m, float it, u32 k0, u32 k1, float floor_score,
                           u32* red, u64* ured) {
    const int per = NMAX / NTHREADS, i0 = threadIdx.x * per;
    u32 mine = 0;
    for (int k = 0; k < per; ++k)
        if (i0 + k < n) mine += mass_of_key((u32)(list[i0 + k] >> 32));
    u32 total;
    u32 run = base + block_scan(mine, red, &total) - mine;
    u64 best = 0ull;
    for (int k = 0; k < per; ++k) {
        const int i = i0 + k;
        if (i >= n) break;
        const u32 key = (u32)(list[i] >> 32);
        const int id = (int)(u32)(list[i] & 0xFFFFFFFFull);
        if (full || (float)run < limit) {
            const float zt = tempered(z[id], m, it);
            if (zt >= floor_score) {
                const u64 p = pack(zt + gumbel(k0, k1, id), id);
                best = p > best ? p : best;
            }
        }
        run += mass_of_key(key);
    }
    return block_reduce<MaxU64>(best, ured);
}

#define FULL_MASK 0xffffffffu

// Bitonic sort of one u64 per lane over the warp, descending (sort_desc's network on 32 entries).
__device__ __forceinline__ u64 warp_sort_desc(u64 v) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int k = 2; k <= 32; k <<= 1)
#pragma unroll
        for (int j = k >> 1; j > 0; j >>= 1) {
            const u64 o = __shfl_xor_sync(FULL_MASK, v, j);
            const bool keep_max = ((lane & j) == 0) == ((lane & k) == 0);
            v = keep_max ? (o > v ? o : v) : (o < v ? o : v);
        }
    return v;
}
__device__ __forceinline__ u32 warp_excl_scan(u32 x) {
    const int lane = threadIdx.x & 31;
    u32 s = x;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u32 y = __shfl_up_sync(FULL_MASK, s, o);
        if (lane >= o) s += y;
    }
    return s - x;
}
// draw_sorted over list[0, n), n <= 32, in one warp: sorted in-warp, the same keep rule, the same
// scores. Returns the best packed score (every lane).
__device__ u64 warp_draw(const u64* list, int n, u32 base, float limit, bool full, Logits z,
                         float m, float it, u32 k0, u32 k1) {
    const int lane = threadIdx.x & 31;
    const u64 v = warp_sort_desc(lane < n ? list[lane] : 0ull);
    const u32 q = lane < n ? mass_of_key((u32)(v >> 32)) : 0u;
    const u32 run = base + warp_excl_scan(q);
    u64 best = 0ull;
    if (lane < n && (full || (float)run < limit)) {
        const int id = (int)(u32)(v & 0xFFFFFFFFull);
        const float zt = tempered(z[id], m, it);
        if (zt >= FLOOR) best = pack(zt + gumbel(k0, k1, id), id);
    }
    return warp_reduce<MaxU64>(best);
}

#if TOPP_SUBHIST && TOP_K == 0
// TOPP_SUBHIST (the "merge" variant): resolve's collected bin b without the block-wide sort.
// list[0, n) holds (probability bits << 32 | id) of bin b's tokens, keys in [klo, klo +
// 2**BIN_BITS), all below `above` mass. A histogram of NB sub-bins of 64 key units gives the
// lowest sub-bin s whose top-ranked token is kept: every token of the sub-bins above it is
// kept, none below it, and only s's tokens are ranked, in one warp (warp_draw), when they are
// at most 32. Returns the best packed score among the kept tokens, the one draw_sorted finds
// over the sorted list; *ok = false (every thread) when s holds more than 32 tokens.
__device__ u64 draw_subhist(const u64* list, int n, u32 klo, u32 above, float limit,
                            Logits z, float m, float it, u32 k0, u32 k1, float floor_score,
                            u32* hm, u32* hc, u32* red, int* ired, u64* ured, bool* ok) {
    __shared__ u64 s_tie[32];
    __shared__ u32 s_cnt;
    const int tid = threadIdx.x, shift = BIN_BITS - 11;  // NB = 2**11 sub-bins
    for (int i = tid; i < NB; i += NTHREADS) {
        hm[i] = 0u;
        hc[i] = 0u;
    }
    if (tid == 0) s_cnt = 0u;
    __syncthreads();
    for (int i = tid; i < n; i += NTHREADS) {
        const u32 key = (u32)(list[i] >> 32);
        const int sb = (int)((key - klo) >> shift);
        atomicAdd(&hm[sb], mass_of_key(key));
        atomicAdd(&hc[sb], 1u);
    }
    __syncthreads();
    int sb_cut;
    u32 above_s;
    find_boundary(hm, hc, above, limit, red, ired, &sb_cut, &above_s);
    *ok = sb_cut != INT_BIG && hc[sb_cut] <= 32u;
    if (!*ok) return 0ull;
    u64 best = 0ull;
    for (int i = tid; i < n; i += NTHREADS) {
        const u64 e = list[i];
        const int sb = (int)(((u32)(e >> 32) - klo) >> shift);
        if (sb > sb_cut) {  // kept whole
            const int id = (int)(u32)(e & 0xFFFFFFFFull);
            const float zt = tempered(z[id], m, it);
            if (zt >= floor_score) {
                const u64 p = pack(zt + gumbel(k0, k1, id), id);
                best = p > best ? p : best;
            }
        } else if (sb == sb_cut) {
            s_tie[atomicAdd(&s_cnt, 1u)] = e;
        }
    }
    __syncthreads();
    if (tid < 32) {
        const u64 w = warp_draw(s_tie, (int)s_cnt, above_s, limit, false, z, m, it, k0, k1);
        best = w > best ? w : best;
    }
    return block_reduce<MaxU64>(best, ured);
}
#endif

// The kept tokens among those with tempered logit >= zmin whose probability bits lie in
// [lo, lo + 2**bits), ranked below `above` mass, by the last block alone: histograms of up to 11
// bits a level over V until one bit pattern remains, then that tie group cut by id (contiguous
// id ranges per thread, the higher ids ranking above). Returns the best packed score among them.
__device__ u64 resolve_range(Logits z, float m, float it, float iden, float zmin, u32 k0,
                             u32 k1, float floor_score, u32 lo, int bits, u32 above, float limit,
                             u32* hm, u32* hc, u32* red, int* ired, u64* ured) {
    const int tid = threadIdx.x;
    const u32 khi = lo + (1u << bits);  // bits <= 17: no overflow
    while (bits > 0) {
        const int d = bits < 11 ? bits : 11, shift = bits - d;
        for (int i = tid; i < NB; i += NTHREADS) {
            hm[i] = 0u;
            hc[i] = 0u;
        }
        __syncthreads();
        for (int j = tid; j < V_SIZE; j += NTHREADS) {
            const float zt = tempered(z[j], m, it);
            if (!(zt > -INFINITY) || zt < zmin) continue;
            const u32 key = prob_key(zt, iden);
            if (key >= lo && ((key - lo) >> bits) == 0u) {
                const int i = (int)((key - lo) >> shift);
                atomicAdd(&hm[i], mass_of_key(key));
                atomicAdd(&hc[i], 1u);
            }
        }
        __syncthreads();
        int b;
        u32 ab;
        find_boundary(hm, hc, above, limit, red, ired, &b, &ab);
        lo += (u32)b << shift;
        above = ab;
        bits = shift;
    }
    const u32 kb = lo, qb = mass_of_key(kb);
    const int per = (V_SIZE + NTHREADS - 1) / NTHREADS;
    const int j0 = tid * per, j1 = min(j0 + per, V_SIZE);
    u32 ties = 0;
    for (int j = j0; j < j1; ++j) {
        const float zt = tempered(z[j], m, it);
        if (zt > -INFINITY && zt >= zmin && prob_key(zt, iden) == kb) ++ties;
    }
    u32 n_tie;
    const u32 incl = block_scan(ties, red, &n_tie);
    u32 rank = n_tie - incl;  // tied tokens at higher ids (they rank above)
    // n_keep = #{j in [0, n_tie): (float)(above + j qb) < limit}, a prefix of j (j = 0 is kept)
    u32 lo_j = 0, hi_j = n_tie;  // invariant: lo_j kept; hi_j = n_tie or dropped
    while (hi_j - lo_j > 1) {
        const u32 mid = lo_j + (hi_j - lo_j) / 2;
        if ((float)(above + mid * qb) < limit) lo_j = mid;
        else hi_j = mid;
    }
    const u32 n_keep = lo_j + 1;
    u64 best = 0ull;
    for (int j = j1 - 1; j >= j0; --j) {
        const float zt = tempered(z[j], m, it);
        if (!(zt > -INFINITY) || zt < zmin) continue;
        const u32 key = prob_key(zt, iden);
        bool kept = key > kb && key < khi;
        if (key == kb) kept = rank++ < n_keep;
        if (kept && zt >= floor_score) {
            const u64 p = pack(zt + gumbel(k0, k1, j), j);
            best = p > best ? p : best;
        }
    }
    return block_reduce<MaxU64>(best, ured);
}

#if TOP_K > 0
// Top-k then top-p by the last block. list[0, n) holds (order bits of zt << 32 | id) of a superset
// of the top-k tokens (every token >= the k-th largest); or, with n > NMAX, nothing yet: the k-th
// largest is then found by histograms over V first.
__device__ int topk_draw(u64* list, int n, float tp, Logits z, float m, float it, u32 k0,
                         u32 k1, float floor_score, u32* hm, u32* hc, u32* red, int* ired,
                         u64* ured, float* fred) {
    __shared__ u32 s_n;
    const int tid = threadIdx.x;
    if (n > NMAX) {  // select the k-th largest order key bit by bit (11, 11, 10 bits)
        u32 prefix = 0, need = TOP_K, cnt_at = 0;
        bool found = true;
        for (int level = 0; level < 3 && found; ++level) {
            const int width = level < 2 ? 11 : 10, shift = 32 - 11 * level - width;
            const int hi_shift = shift + width;  // bits above this level must match the prefix
            for (int i = tid; i < NB; i += NTHREADS) hc[i] = 0u;
            __syncthreads();
            for (int j = tid; j < V_SIZE; j += NTHREADS) {
                const float zt = tempered(z[j], m, it);
                if (!(zt > -INFINITY)) continue;
                const u32 o = ord_of(zt);
                if (hi_shift == 32 || (o >> hi_shift) == (prefix >> hi_shift))
                    atomicAdd(&hc[(o >> shift) & ((1u << width) - 1u)], 1u);
            }
            __syncthreads();
            const int i0 = tid * BPT;
            u32 mine = 0;
            for (int k = 0; k < BPT; ++k) mine += hc[i0 + k];
            u32 total;
            const u32 incl = block_scan(mine, red, &total);
            u32 s = total - incl;
            int cand = -1;
            u32 cand_above = 0, cand_cnt = 0;
            for (int k = BPT - 1; k >= 0; --k) {
                const u32 before = s;
                s += hc[i0 + k];
                if (cand < 0 && s >= need) {
                    cand = i0 + k;
                    cand_above = before;
                    cand_cnt = hc[i0 + k];
                }
            }
            const int b = block_reduce<MaxI>(cand, ired);
            if (b < 0) {
                found = false;  // fewer than k live tokens: all of them are kept
            } else {
                if (cand == b) {
                    hm[0] = cand_above;
                    hm[1] = cand_cnt;
                }
                __syncthreads();
                prefix |= (u32)b << shift;
                need -= hm[0];
                cnt_at = hm[1];
                __syncthreads();
            }
        }
        const u32 vk = found ? prefix : 0u;
        const u32 n_ge = found ? (TOP_K - need) + cnt_at : 0xFFFFFFFFu;
        if (n_ge <= (u32)NMAX) {  // collect every token >= the k-th largest
            if (tid == 0) s_n = 0u;
            __syncthreads();
            for (int j = tid; j < V_SIZE; j += NTHREADS) {
                const float zt = tempered(z[j], m, it);
                if (zt > -INFINITY && ord_of(zt) >= vk) {
                    const u32 slot = atomicAdd(&s_n, 1u);
                    list[slot] = ((u64)ord_of(zt) << 32) | (u32)j;
                }
            }
            __syncthreads();
            n = (int)s_n;
        } else {  // a tie group larger than the list: top-p over V restricted to zt >= v_k
            const float zmin = found ? float_of_ord(vk) : -INFINITY;
            float s = 0.0f;
            for (int j = tid; j < V_SIZE; j += NTHREADS) {
                const float zt = tempered(z[j], m, it);
                if (zt > -INFINITY && zt >= zmin) s += expf(zt);
            }
            const float iden = 1.0f / block_reduce<Sum>(s, fred);
            u64* hb = list;  // NB words: the list is not used on this path
            for (int i = tid; i < NB; i += NTHREADS) {
                hm[i] = 0u;
                hc[i] = 0u;
                hb[i] = 0ull;
            }
            __syncthreads();
            for (int j = tid; j < V_SIZE; j += NTHREADS) {
                const float zt = tempered(z[j], m, it);
                if (!(zt > -INFINITY) || zt < zmin) continue;
                const u32 key = prob_key(zt, iden);
                const int b = bin_of(key);
                if (b > 0) {
                    atomicAdd(&hm[b], mass_of_key(key));
                    atomicAdd(&hc[b], 1u);
                }
                if (zt >= floor_score) atomicMax(&hb[b], pack(zt + gumbel(k0, k1, j), j));
            }
            __syncthreads();
            u64 best = 0ull;
            if (tp >= 1.0f) {
                for (int i = tid; i < NB; i += NTHREADS) best = hb[i] > best ? hb[i] : best;
                return unpack_id(block_reduce<MaxU64>(best, ured));
            }
            u32 mine = 0;
            for (int i = tid; i < NB; i += NTHREADS) mine += hm[i];
            u32 total;
            block_scan(mine, red, &total);
            const float limit = tp * (float)total;
            int b;
            u32 above_b;
            find_boundary(hm, hc, 0u, limit, red, ired, &b, &above_b);
            if (b == INT_BIG) b = NB - 1;
            for (int i = tid; i < NB; i += NTHREADS)
                if (i >= b && hb[i] > best) best = hb[i];  // bin b: cut below if it is split
            if (tid == 0) s_n = hc[b];
            best = block_reduce<MaxU64>(best, ured);
            const u32 nb = s_n;
            const bool whole = nb == 1u ||
                               (float)(above_b + hm[b] - mass_of_key(bin_lo(b))) < limit;
            if (!whole) {  // the bins above b, then the kept part of b
                u64 above_best = 0ull;
                for (int i = tid; i < NB; i += NTHREADS)
                    if (i > b && hb[i] > above_best) above_best = hb[i];
                above_best = block_reduce<MaxU64>(above_best, ured);
                const u64 inb = resolve_range(z, m, it, iden, zmin, k0, k1, floor_score, bin_lo(b),
                                              BIN_BITS, above_b, limit, hm, hc, red, ired, ured);
                best = inb > above_best ? inb : above_best;
            }
            return unpack_id(best);
        }
    }
    const int n2 = pow2_at_least(n);
    for (int i = n + tid; i < n2; i += NTHREADS) list[i] = 0ull;
    __syncthreads();
    sort_desc(list, n2);
    // n_k: the entries >= the k-th largest (ties at it kept); the denominator over them
    const u32 vk = n >= TOP_K ? (u32)(list[TOP_K - 1] >> 32) : 0u;
    int nk = 0;
    for (int i = tid; i < n; i += NTHREADS)
        if ((u32)(list[i] >> 32) >= vk) nk = max(nk, i + 1);
    nk = block_reduce<MaxI>(nk, ired);
    float s = 0.0f;
    for (int i = tid; i < nk; i += NTHREADS) s += expf(float_of_ord((u32)(list[i] >> 32)));
    const float iden = 1.0f / block_reduce<Sum>(s, fred);
    for (int i = tid; i < n2; i += NTHREADS) {
        const u64 e = list[i];
        list[i] = i < nk ? ((u64)prob_key(float_of_ord((u32)(e >> 32)), iden) << 32) |
                               (e & 0xFFFFFFFFull)
                         : 0ull;
    }
    __syncthreads();
    sort_desc(list, n2);  // rank order: probability, then id
    u32 mine = 0;
    for (int i = tid; i < nk; i += NTHREADS) mine += mass_of_key((u32)(list[i] >> 32));
    u32 total;
    block_scan(mine, red, &total);
    const float limit = tp * (float)total;
    const u64 best = draw_sorted(list, nk, 0u, limit, tp >= 1.0f, z, m, it, k0, k1, floor_score,
                                 red, ured);
    return unpack_id(best);
}
#endif

#if !CLUSTER && !GRIDSYNC
extern "C" __global__ void __launch_bounds__(NTHREADS)
rejax_sample_resolve(const logit_t* __restrict__ logits, const float* __restrict__ stats,
                     const int* __restrict__ arg, const float* __restrict__ top_p,
                     const u32* __restrict__ keys, const int* __restrict__ plan,
                     int* __restrict__ tokens) {
    __shared__ u64 list[NMAX > NB ? NMAX : NB];
    __shared__ u32 hm[NB], hc[NB];
    __shared__ u32 red[NWARPS];
    __shared__ int ired[NWARPS];
    __shared__ u64 ured[NWARPS];
    __shared__ float fred[NWARPS];
    __shared__ int is_last;
    const int r = blockIdx.y, c = blockIdx.x, tid = threadIdx.x;
    const int* pl = plan + r * PLAN;
    if (pl[0] == 0) {
        if (c == 0 && tid == 0) tokens[r] = pl[1];
        return;
    }
    const float m = stats[r * 4], t = stats[r * 4 + 1], den = stats[r * 4 + 2];
    const float it = 1.0f / t, iden = 1.0f / den;
    const int b = pl[2];
    const u32 nb = (u32)pl[4];
    const Logits z{logits + (size_t)r * V_SIZE};
    const u32 klo = bin_lo(b);
    if (nb <= (u32)NMAX) {  // collect: top-p, the tokens of bin b; top-k, of bins >= b
        const int lo = c * CH, hi = min(lo + CH, V_SIZE);
        for (int j = lo + tid; j < hi; j += NTHREADS) {
            const float zt = tempered(z[j], m, it);
            if (!(zt > -INFINITY)) continue;
#if TOP_K > 0
            const bool in = topk_bin(zt, t) >= b;
            const u32 key = ord_of(zt);
#else
            const u32 key = prob_key(zt, iden);
            const bool in = key >= klo && key - klo < (1u << BIN_BITS);
#endif
            if (in) {
                const u32 slot = atomicAdd(&g_res_n[r], 1u);
                if (slot < (u32)NMAX) g_res_list[r * NMAX + slot] = ((u64)key << 32) | (u32)j;
            }
        }
    }
    if (!last_arrival(&g_res_done[r], &is_last)) return;
    const u32 k0 = keys[r * 2], k1 = keys[r * 2 + 1];
    const float floor_score = FLOOR;
    if (nb <= (u32)NMAX) {
        for (int i = tid; i < (int)nb; i += NTHREADS) list[i] = __ldcg(&g_res_list[r * NMAX + i]);
        __syncthreads();
    }
#if TOP_K > 0
    const int token = topk_draw(list, (int)nb, top_p[r], z, m, it, k0, k1, floor_score, hm,
                                hc, red, ired, ured, fred);
#else
    const u32 above_b = (u32)pl[3];
    const float limit = __int_as_float(pl[5]);
    u64 best = ((u64)(u32)pl[7] << 32) | (u64)(u32)pl[6];
    u64 inb = 0ull;
    bool drawn = false;
#if TOPP_SUBHIST
    if (nb <= (u32)NMAX)
        inb = draw_subhist(list, (int)nb, klo, above_b, limit, z, m, it, k0, k1, floor_score, hm,
                           hc, red, ired, ured, &drawn);
#endif
    if (!drawn && nb <= (u32)NMAX) {
        const int n2 = pow2_at_least((int)nb);
        for (int i = (int)nb + tid; i < n2; i += NTHREADS) list[i] = 0ull;
        __syncthreads();
        sort_desc(list, n2);  // rank order: probability, then id
        inb = draw_sorted(list, (int)nb, above_b, limit, false, z, m, it, k0, k1, floor_score, red,
                          ured);
    } else if (!drawn) {
        inb = resolve_range(z, m, it, iden, -INFINITY, k0, k1, floor_score, klo, BIN_BITS, above_b,
                            limit, hm, hc, red, ired, ured);
    }
    const int token = unpack_id(inb > best ? inb : best);
    (void)fred;
#endif
    if (tid == 0) {
        tokens[r] = token;
        g_res_n[r] = 0u;
        g_res_done[r] = 0u;
    }
}
#endif  // !CLUSTER

#if CLUSTER > 0 || GRIDSYNC
// ============================================================================= cluster variant
//
// rejax_sample_cluster computes what the three kernels above compute, in one launch: a
// thread-block cluster of CLUSTER CTAs per row (grid CLUSTER x B, cluster dims CLUSTER x 1 x 1;
// CTA c owns chunk c of the row). A cluster's CTAs are co-scheduled, so the hardware cluster
// barrier orders the phases, and each CTA reads the others' partials where they lie, in their
// shared memory (DSMEM): no global scratch, no atomics across CTAs, no last-arrival tickets, and
// each combine is split over the cluster (CTA c combines bins [c SLICE, (c + 1) SLICE)).
//
//   1. the chunk's statistics as rejax_sample_stats computes them (a max sweep, a sums sweep);
//      after a barrier every CTA combines the CLUSTER partials the same way, so all of them hold
//      the same row max, temperature, denominator and entropy.
//   2. top-p < 1: one sweep builds the chunk's histogram of the positive-mass tokens (the others
//      are never kept: the mass ranked above them is the row's total) and the best Gumbel score
//      per bin; the combined slices give the boundary bin b and the best score above it. A whole
//      bin b ends the row. Otherwise a collect sweep gathers bin b's tokens into CTA 0, which
//      resolves them (one warp for <= 32 tokens, else sort_desc + draw_sorted); a bin of more than
//      NMAX tokens CTA 0 resolves over V alone (resolve_range), as the split kernels do.
//      top-p = 1: one sweep, the Gumbel-max over every live token.
//      top-k: the sweep counts topk_bin; the combined slices give the bin of the k-th largest; a
//      collect sweep gathers the tokens at or above it into CTA 0 (one warp, or topk_draw).
//
// Sweeps over a chunk: top-p 3 (4 when bin b is collected), top-k 4; the first reads HBM, the
// others mostly L2.
// The noise (Philox by token id), the bins, the keep rule and the draw are the split kernels', so
// the tokens are theirs for the same key, up to the float rounding of the statistics (summed
// here over CLUSTER chunks). What the split kernels spend on tokens that cannot win is skipped:
// the expf of tokens too far below to have mass (zt < zt_cut), and the logarithms of the noise
// unless gumbel_bound, from the Philox word alone, lets the token reach PRUNE_SCORE.

#if CLUSTER > 0
#define SLICE (NB / CLUSTER)  // bins of the combined histogram that each CTA owns
static_assert(NB % CLUSTER == 0 && CLUSTER <= 8, "a portable cluster holds at most 8 CTAs");
static_assert(SLICE <= NTHREADS && NMAX <= NB, "one bin per thread; the list reuses hb");

__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;"
                 ::: "memory");
}
// The shared-memory word at `p` (this CTA's address of it) in the CTA of cluster rank `rank`.
__device__ __forceinline__ u32 peer_addr(const void* p, int rank) {
    u32 a;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
                 : "=r"(a) : "r"((u32)__cvta_generic_to_shared(p)), "r"(rank));
    return a;
}
__device__ __forceinline__ u32 ld_peer32(const void* p, int rank) {
    u32 v;
    asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(v) : "r"(peer_addr(p, rank)) : "memory");
    return v;
}
__device__ __forceinline__ u64 ld_peer64(const void* p, int rank) {
    u64 v;
    asm volatile("ld.shared::cluster.u64 %0, [%1];" : "=l"(v) : "r"(peer_addr(p, rank)) : "memory");
    return v;
}
__device__ __forceinline__ float ld_peerf(const void* p, int rank) {
    return __uint_as_float(ld_peer32(p, rank));
}
#endif  // CLUSTER > 0


// The packed scores of tokens j0 + q (j0 % 4 == 0) where cand[q], 0 where a token cannot reach
// `floor` (PRUNE_SCORE: cannot win): one Philox call for the four words, the low words only
// where they matter (need_lo), and the logarithms only where gumbel_bound lets the token reach
// the floor.
__device__ __forceinline__ void scores4(const float (&zt)[4], const bool (&cand)[4], int j0,
                                        u32 k0, u32 k1, float floor, u64 (&out)[4]) {
    const uint4 w = philox((u32)j0 >> 2, 0u, 0u, 0u, k0, k1);
    bool go[4], lo_needed = false;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        go[q] = cand[q] && zt[q] + gumbel_bound(word(w, q)) >= floor;
        lo_needed |= go[q] && need_lo(word(w, q));
    }
    const uint4 wl = lo_needed ? philox((u32)j0 >> 2, 1u, 0u, 0u, k0, k1) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int q = 0; q < 4; ++q)
        out[q] = go[q] ? pack(zt[q] + gumbel_of(word(w, q), word(wl, q)), j0 + q) : 0ull;
}


// load4 for a lane of a warp-uniform loop: a group at or past hi reads nothing (-inf logits).
__device__ __forceinline__ void load4_or_inf(Logits z, int j0, int hi, float (&x)[4]) {
    if (j0 < hi) {
        load4(z, j0, hi, x);
    } else {
#pragma unroll
        for (int q = 0; q < 4; ++q) x[q] = -INFINITY;
    }
}

// The grid kernel's sweeps load each trip's logits AHEAD trips ahead (those loads are in
// flight while this trip computes): Ahead4 holds them as loaded and expands them exactly as
// load4 / load4_or_inf do (-inf past hi), so the sweeps see the same values in the same order.
// A sweep over j0 = start, start + 4 NTHREADS, ... calls `start` once and `next` every trip.
#ifndef AHEAD
#define AHEAD 1
#endif
static_assert(AHEAD >= 1 && AHEAD <= 4, "trips loaded ahead");
struct Ahead4 {
#if V_SIZE % 4 == 0 && LOGITS_BF16
    uint2 v[AHEAD];
    __device__ __forceinline__ void load(int d, Logits z, int j0, int hi) {
        v[d] = j0 < hi ? __ldg(reinterpret_cast<const uint2*>(z.p + j0))
                       : make_uint2(0xFF80FF80u, 0xFF80FF80u);  // four bfloat16 -inf
    }
    __device__ __forceinline__ void take(float (&x)[4]) {
        x[0] = __uint_as_float(v[0].x << 16);
        x[1] = __uint_as_float(v[0].x & 0xFFFF0000u);
        x[2] = __uint_as_float(v[0].y << 16);
        x[3] = __uint_as_float(v[0].y & 0xFFFF0000u);
#pragma unroll
        for (int d = 0; d + 1 < AHEAD; ++d) v[d] = v[d + 1];
    }
#else
    float y[AHEAD][4];
    __device__ __forceinline__ void load(int d, Logits z, int j0, int hi) {
        load4_or_inf(z, j0, hi, y[d]);
    }
    __device__ __forceinline__ void take(float (&x)[4]) {
#pragma unroll
        for (int q = 0; q < 4; ++q) x[q] = y[0][q];
#pragma unroll
        for (int d = 0; d + 1 < AHEAD; ++d)
#pragma unroll
            for (int q = 0; q < 4; ++q) y[d][q] = y[d + 1][q];
    }
#endif
    __device__ __forceinline__ void start(Logits z, int j0, int hi) {
#pragma unroll
        for (int d = 0; d < AHEAD; ++d) load(d, z, j0 + d * 4 * NTHREADS, hi);
    }
    // x = the logits of the trip at j0; then the loads of the trip AHEAD after it
    __device__ __forceinline__ void next(Logits z, int j0, int hi, float (&x)[4]) {
        take(x);
        load(AHEAD - 1, z, j0 + AHEAD * 4 * NTHREADS, hi);
    }
};

struct SumU {
    __device__ static u32 identity() { return 0u; }
    __device__ static u32 apply(u32 a, u32 b) { return a + b; }
};

#if TOP_K > 0
// topk_draw's list path for n <= 32 in one warp (the same sums in the same order, so the same
// denominator, kept set and token).
__device__ int warp_topk_draw(const u64* list, int n, float tp, Logits z, float m, float it,
                              u32 k0, u32 k1) {
    const int lane = threadIdx.x & 31;
    u64 v = warp_sort_desc(lane < n ? list[lane] : 0ull);  // tempered logit, then id
    u32 vk = 0u;  // the k-th largest (ties at it kept); 0: fewer than k entries, all of them
    if (TOP_K <= 32 && n >= TOP_K) vk = (u32)(__shfl_sync(FULL_MASK, v, (TOP_K - 1) & 31) >> 32);
    const u32 o = (u32)(v >> 32);
    const bool in = lane < n && o >= vk;  // a prefix: the first nk lanes
    const float e = in ? expf(float_of_ord(o)) : 0.0f;
    const float iden = 1.0f / warp_reduce<Sum>(e);
    v = in ? ((u64)prob_key(float_of_ord(o), iden) << 32) | (v & 0xFFFFFFFFull) : 0ull;
    v = warp_sort_desc(v);  // rank order: probability, then id
    const u32 q = v ? mass_of_key((u32)(v >> 32)) : 0u;
    const float limit = tp * (float)warp_reduce<SumU>(q);
    const u32 run = warp_excl_scan(q);
    u64 best = 0ull;
    if (v && (tp >= 1.0f || (float)run < limit)) {
        const int id = (int)(u32)(v & 0xFFFFFFFFull);
        const float zt = tempered(z[id], m, it);
        if (zt >= FLOOR) best = pack(zt + gumbel(k0, k1, id), id);
    }
    return unpack_id(warp_reduce<MaxU64>(best));
}
#endif

#if CLUSTER > 0
// What a CTA publishes for the others to read (through DSMEM, after a cluster barrier).
struct Pub {
    float st[5];     // the chunk's max, s, u, sa, sb (rejax_sample_stats' partials)
    int arg[2];      // the chunk's first / last argmax
    u32 total;       // the slice's mass (top-k: count)
    int cand;        // the slice's candidate bin (top-p: lowest kept non-empty; top-k: highest
                     // whose count from the top reaches k), INT_BIG / -1 for none
    u32 cand_above;  // top-p: mass above the candidate; top-k: count at or above it
    u32 cand_n;      // tokens in the candidate bin
    u32 cand_mass;   // their mass
    u32 n_list;      // tokens this CTA collected
    u64 cand_best;   // best score in the candidate bin
    u64 above_best;  // best score in the slice's bins above the candidate
    u64 slice_best;  // best score in the slice (top-p = 1: in the chunk)
    u32 rej_mass;    // REJECT: the chunk's mass, and the part of it ranked above the first draw
    u32 rej_above;
};

// CTA 0 appends the other CTAs' lists (list[0, n_list) in each) to its own n0 entries, up to
// NMAX; returns the count (called by CTA 0 after a barrier that follows every n_list).
__device__ int gather_lists(u64* list, u32 n0, const Pub* pub) {
    u32 off = n0;
    for (int q = 1; q < CLUSTER; ++q) {
        const u32 nq = ld_peer32(&pub->n_list, q);
        for (u32 i = threadIdx.x; i < nq && off + i < (u32)NMAX; i += NTHREADS)
            list[off + i] = ld_peer64(&list[i], q);
        off += nq;
    }
    __syncthreads();
    return (int)off;
}
#endif  // CLUSTER > 0

// The best packed score (Gumbel-max) over the live tokens of chunk [lo, hi) whose tempered
// logit is >= FLOOR, reduced over the block (every thread gets it; `ured`: NWARPS words).
__device__ u64 chunk_best(Logits z, int lo, int hi, float m, float it, u32 k0, u32 k1,
                          u64* ured) {
    const int tid = threadIdx.x;
    u64 best = 0ull;
    for (int j0 = lo + 4 * tid; j0 < hi; j0 += 4 * NTHREADS) {
        float x[4], zt[4];
        bool cand[4], any = false;
        load4(z, j0, hi, x);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            zt[q] = tempered(x[q], m, it);
            cand[q] = zt[q] >= FLOOR;
            any |= cand[q];
        }
        if (any) {
            u64 sc[4];
            scores4(zt, cand, j0, k0, k1, PRUNE_SCORE, sc);
#pragma unroll
            for (int q = 0; q < 4; ++q) best = sc[q] > best ? sc[q] : best;
        }
    }
    return block_reduce<MaxU64>(best, ured);
}

#if CLUSTER > 0
extern "C" __global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(NTHREADS, MIN_CTAS)
rejax_sample_cluster(const logit_t* __restrict__ logits, const float* __restrict__ thr,
                     const float* __restrict__ alt, const float* __restrict__ t_a,
                     const float* __restrict__ t_b, const float* __restrict__ top_p,
                     const u32* __restrict__ keys, int* __restrict__ tokens,
                     float* __restrict__ entropy, float* __restrict__ temperature) {
    __shared__ union {
        u64 packed[NB];  // top-p histogram: count << 32 | mass (both < 2**32 over a row)
        u32 w[2 * NB];   // hm = w, hc = w + NB (top-k counts; resolve_range and topk_draw)
    } hist;
    __shared__ u64 hb[NB];  // best packed score per bin; then the collected list
    __shared__ Pub pub;
    __shared__ u32 red[NWARPS];
    __shared__ int ired[NWARPS];
    __shared__ u64 ured[NWARPS];
    __shared__ float fred[NWARPS];
    __shared__ float rowf[3];  // the row's max, temperature, denominator
    __shared__ int rowi[2];    // the row's first / last argmax
    __shared__ u32 tot[CLUSTER];
    __shared__ u32 s_n, s_cnt;
    __shared__ int s_b;
    u32* const hm = hist.w;
    u32* const hc = hist.w + NB;
    const int r = blockIdx.y, c = blockIdx.x, tid = threadIdx.x;
    const Logits z{logits + (size_t)r * V_SIZE};
    const int lo = min(c * CH, V_SIZE), hi = min(lo + CH, V_SIZE);

    // ---- 1. the chunk's statistics (rejax_sample_stats), combined in every CTA
    const float ta_raw = t_a[r], tb_raw = t_b[r];
    const float ia = 1.0f / (ta_raw <= GREEDY_EPS ? 1.0f : ta_raw);
    const float ib = 1.0f / (tb_raw <= GREEDY_EPS ? 1.0f : tb_raw);
    {
        float m = -INFINITY;
        int first = INT_BIG, last = -1;
#pragma unroll 4
        for (int j0 = lo + 4 * tid; j0 < hi; j0 += 4 * NTHREADS) {
            float x[4];
            load4(z, j0, hi, x);
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                if (x[q] > m) {
                    m = x[q];
                    first = j0 + q;
                    last = j0 + q;
                } else if (x[q] == m && j0 + q < hi) {
                    first = min(first, j0 + q);
                    last = j0 + q;
                }
            }
        }
        const float mc = block_reduce<MaxF>(m, fred);
        first = block_reduce<MinI>(m == mc ? first : INT_BIG, ired);
        last = block_reduce<MaxI>(m == mc ? last : -1, ired);
        float s = 0.0f, u = 0.0f, sa = 0.0f, sb = 0.0f;
        // t_a == t_b (Temperature): one denominator; top-k sums its own over the top k
        const bool two = TOP_K == 0 && ib != ia;
        if (mc > -INFINITY) {
#pragma unroll 2
            for (int j0 = lo + 4 * tid; j0 < hi; j0 += 4 * NTHREADS) {
                float x[4];
                load4(z, j0, hi, x);
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const float d = x[q] - mc;
                    const float e = expf(d);
                    s += e;
                    if (e > 0.0f) u += e * d;
                    if (TOP_K == 0) sa += expf(d * ia);
                    if (two) sb += expf(d * ib);
                }
            }
        }
        s = block_reduce<Sum>(s, fred);
        u = block_reduce<Sum>(u, fred);
        if (TOP_K == 0) sa = block_reduce<Sum>(sa, fred);
        sb = two ? block_reduce<Sum>(sb, fred) : sa;
        if (tid == 0) {
            pub.st[0] = mc;
            pub.st[1] = s;
            pub.st[2] = u;
            pub.st[3] = sa;
            pub.st[4] = sb;
            pub.arg[0] = first;
            pub.arg[1] = last;
        }
    }
    cluster_sync();
    if (tid < 32) {  // rejax_sample_stats' last-block combine, one chunk per lane
        float mi = -INFINITY, si = 0.0f, ui = 0.0f, sai = 0.0f, sbi = 0.0f;
        int fi = INT_BIG, li = -1;
        if (tid < CLUSTER) {
            mi = ld_peerf(&pub.st[0], tid);
            si = ld_peerf(&pub.st[1], tid);
            ui = ld_peerf(&pub.st[2], tid);
            sai = ld_peerf(&pub.st[3], tid);
            sbi = ld_peerf(&pub.st[4], tid);
            fi = (int)ld_peer32(&pub.arg[0], tid);
            li = (int)ld_peer32(&pub.arg[1], tid);
        }
        const float mw = warp_reduce<MaxF>(mi);
        float S = 0.0f, U = 0.0f, SA = 0.0f, SB = 0.0f;
        int f = INT_BIG, l = -1;
        if (tid < CLUSTER) {
            if (mi == mw) {
                f = fi;
                l = li;
            }
            if (si > 0.0f) {
                const float dm = mi - mw, w = expf(dm);
                S = si * w;
                U = w * (ui + si * dm);
                SA = sai * expf(dm * ia);
                SB = sbi * expf(dm * ib);
            }
        }
        S = warp_reduce<Sum>(S);
        U = warp_reduce<Sum>(U);
        SA = warp_reduce<Sum>(SA);
        SB = warp_reduce<Sum>(SB);
        f = warp_reduce<MinI>(f);
        l = warp_reduce<MaxI>(l);
        if (tid == 0) {
            const float h = logf(S) - U / S;
            const bool high = (h >= thr[r]) || (h > alt[r]);
            rowf[0] = mw;
            rowf[1] = high ? ta_raw : tb_raw;
            rowf[2] = high ? SA : SB;
            rowi[0] = f == INT_BIG ? 0 : f;
            rowi[1] = l < 0 ? 0 : l;
            if (c == 0) {
                entropy[r] = h;
                temperature[r] = rowf[1];
            }
        }
    }
    __syncthreads();
    const float m = rowf[0], t = rowf[1], den = rowf[2];
    if (t <= GREEDY_EPS) {  // greedy row: the first argmax of the raw logits
        if (c == 0 && tid == 0) tokens[r] = rowi[0];
        cluster_sync();  // no CTA leaves while another still reads its partials
        return;
    }
    const float it = 1.0f / t, iden = 1.0f / den, tp = top_p[r];
    const u32 k0 = keys[r * 2], k1 = keys[r * 2 + 1];
    const int base = c * SLICE;
    int token = 0;

#if TOP_K == 0
    __shared__ u32 s_above, s_mass;
    __shared__ u64 s_bin_best, s_above_best;
    if (tp >= 1.0f) {  // ---- 2. every live token is kept: the Gumbel-max over them
        const u64 best = chunk_best(z, lo, hi, m, it, k0, k1, ured);
        if (tid == 0) pub.slice_best = best;
        cluster_sync();
        if (c == 0 && tid < 32) {
            u64 b = tid < CLUSTER ? ld_peer64(&pub.slice_best, tid) : 0ull;
            b = warp_reduce<MaxU64>(b);
            if (tid == 0) tokens[r] = unpack_id(b);
        }
        cluster_sync();
        return;
    }

    // zt < zt_cut: p = expf(zt) / den < 2**-31 by a 1% margin, no mass (no expf needed)
    const float zt_cut = logf(den) - 21.487563f - 0.01f;  // log(den 2**-31) - 0.01
#if REJECT
    {  // ---- 2a. rejection: the Gumbel-max x over every live token (the tp = 1 sweep), kept if
       // the keep rule keeps it. Then x is also the best score over the kept tokens, i.e. the
       // token the histogram path below draws with the same noise. Else that path runs.
        __shared__ u64 s_x;
        __shared__ u32 s_keep;
        const u64 best = chunk_best(z, lo, hi, m, it, k0, k1, ured);
        if (tid == 0) pub.slice_best = best;
        cluster_sync();
        if (tid < 32) {
            u64 b = tid < CLUSTER ? ld_peer64(&pub.slice_best, tid) : 0ull;
            b = warp_reduce<MaxU64>(b);
            if (tid == 0) s_x = b;
        }
        __syncthreads();
        const u64 xb = s_x;  // every CTA holds the same x (0: no live token reaches FLOOR)
        const int xid = xb ? unpack_id(xb) : -1;
        // x's probability key (0: none); a token ranks above x iff its key is larger, or equal
        // with a higher id; the mass sums are the histogram's (positive-mass tokens only)
        const u32 kx = xb ? prob_key(tempered(z[xid], m, it), iden) : 0u;
        u32 mass = 0u, above = 0u;
        for (int j0 = lo + 4 * tid; j0 < hi; j0 += 4 * NTHREADS) {
            float x[4];
            load4(z, j0, hi, x);
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const float zt = tempered(x[q], m, it);
                if (zt >= zt_cut) {  // NaN and masked logits fail this too
                    const u32 key = prob_key(zt, iden);
                    const u32 w = key > KEY_LO ? mass_of_key(key) : 0u;
                    mass += w;
                    if (key > kx || (key == kx && j0 + q > xid)) above += w;
                }
            }
        }
        mass = block_reduce<SumU>(mass, red);
        above = block_reduce<SumU>(above, red);
        if (tid == 0) {
            pub.rej_mass = mass;
            pub.rej_above = above;
        }
        cluster_sync();
        if (tid == 0) {  // integer sums: every CTA gets the same totals, hence the same verdict
            u32 total = 0u, ab = 0u;
            for (int q = 0; q < CLUSTER; ++q) {
                total += ld_peer32(&pub.rej_mass, q);
                ab += ld_peer32(&pub.rej_above, q);
            }
            s_keep = xb && kx > KEY_LO && (float)ab < tp * (float)total;
        }
        __syncthreads();
        if (s_keep) {
            if (c == 0 && tid == 0) tokens[r] = xid;
            cluster_sync();  // no CTA leaves while another still reads its partials
            return;
        }
        // rejected: the path below; its barriers order these reads before any later write
    }
#endif
    // ---- 2. the chunk's histogram of positive-mass tokens and best score per bin
    for (int i = tid; i < NB; i += NTHREADS) {
        hist.packed[i] = 0ull;
        hb[i] = 0ull;
    }
    __syncthreads();
    for (int j0 = lo + 4 * tid; j0 < hi; j0 += 4 * NTHREADS) {
        float x[4], zt[4];
        int bin[4];
        bool cand[4], any = false;
        load4(z, j0, hi, x);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            zt[q] = tempered(x[q], m, it);
            bin[q] = 0;
            if (zt[q] >= zt_cut) {  // NaN and masked logits fail this too
                const u32 key = prob_key(zt[q], iden);
                bin[q] = bin_of(key);
                if (bin[q] > 0)
                    atomicAdd(&hist.packed[bin[q]], (1ull << 32) | (u64)mass_of_key(key));
            }
            cand[q] = bin[q] > 0 && zt[q] >= FLOOR;
            any |= cand[q];
        }
        if (any) {
            u64 sc[4];
            scores4(zt, cand, j0, k0, k1, PRUNE_SCORE, sc);
#pragma unroll
            for (int q = 0; q < 4; ++q)
                if (sc[q]) atomicMax(&hb[bin[q]], sc[q]);
        }
    }
    __syncthreads();
    cluster_sync();
    // CTA c combines bins [base, base + SLICE) over the cluster, in place (the others read only
    // their own slices of this CTA's arrays)
    for (int k = tid; k < 2 * SLICE; k += NTHREADS) {
        const int i = base + (k < SLICE ? k : k - SLICE);
        u64 a = 0ull;
        if (k < SLICE) {
#pragma unroll
            for (int q = 0; q < CLUSTER; ++q) a += ld_peer64(&hist.packed[i], q);
            hist.packed[i] = a;
        } else {
#pragma unroll
            for (int q = 0; q < CLUSTER; ++q) {
                const u64 x = ld_peer64(&hb[i], q);
                a = x > a ? x : a;
            }
            hb[i] = a;
        }
    }
    __syncthreads();
    {  // the slice's candidate: bins rank high to low, so the kept non-empty bins are those
       // whose mass above is < limit, a top range of the bins; b is the lowest of them
        const int i = base + tid;
        const u64 mine = tid < SLICE ? hist.packed[i] : 0ull;
        u32 slice_mass;
        const u32 incl = block_scan((u32)mine, red, &slice_mass);
        if (tid == 0) pub.total = slice_mass;
        cluster_sync();
        if (tid < CLUSTER) tot[tid] = ld_peer32(&pub.total, tid);
        __syncthreads();
        u32 total = 0u, above_slice = 0u;
        for (int q = 0; q < CLUSTER; ++q) {
            total += tot[q];
            if (q > c) above_slice += tot[q];
        }
        const float limit = tp * (float)total;
        const u32 above = above_slice + (slice_mass - incl);
        const int cand = tid < SLICE && (mine >> 32) && (float)above < limit ? i : INT_BIG;
        const int cb = block_reduce<MinI>(cand, ired);
        if (cand == cb && cb != INT_BIG) {
            pub.cand_above = above;
            pub.cand_n = (u32)(mine >> 32);
            pub.cand_mass = (u32)mine;
            pub.cand_best = hb[i];
        }
        const u64 above_best = block_reduce<MaxU64>(tid < SLICE && i > cb ? hb[i] : 0ull, ured);
        const u64 slice_best = block_reduce<MaxU64>(tid < SLICE ? hb[i] : 0ull, ured);
        if (tid == 0) {
            pub.cand = cb;
            pub.above_best = above_best;
            pub.slice_best = slice_best;
        }
        cluster_sync();
        if (tid < 32) {  // b: the lowest candidate; the best score above it
            const int cq = tid < CLUSTER ? (int)ld_peer32(&pub.cand, tid) : INT_BIG;
            const int b = warp_reduce<MinI>(cq);
            const int owner = b == INT_BIG ? CLUSTER : b / SLICE;
            u64 sb = tid < CLUSTER && tid > owner ? ld_peer64(&pub.slice_best, tid) : 0ull;
            sb = warp_reduce<MaxU64>(sb);
            if (tid == 0) {
                s_b = b;
                if (b != INT_BIG) {
                    s_above = ld_peer32(&pub.cand_above, owner);
                    s_cnt = ld_peer32(&pub.cand_n, owner);
                    s_mass = ld_peer32(&pub.cand_mass, owner);
                    s_bin_best = ld_peer64(&pub.cand_best, owner);
                    const u64 ab = ld_peer64(&pub.above_best, owner);
                    s_above_best = ab > sb ? ab : sb;
                }
            }
        }
        __syncthreads();
        const int b = s_b;
        if (b == INT_BIG) {  // limit <= 0 (top_p <= 0 or NaN) keeps nothing: the top token
            if (c == 0 && tid == 0) tokens[r] = rowi[1];
            cluster_sync();
            return;
        }
        const u32 nb = s_cnt, above_b = s_above;
        const u64 best = s_above_best;
        // bin b is kept whole if even its lowest token (mass >= its lower edge's) is kept
        if (nb == 1u || (float)(above_b + s_mass - mass_of_key(bin_lo(b))) < limit) {
            if (c == 0 && tid == 0) tokens[r] = unpack_id(s_bin_best > best ? s_bin_best : best);
            cluster_sync();
            return;
        }
        const u32 klo = bin_lo(b);
        u64 inb = 0ull;
        bool resolved = false;
        if (nb <= (u32)NMAX) {  // collect bin b's tokens: a zt window (1e-3 wide margins) first
            const float zlo = logf(__uint_as_float(klo) * den) - 1e-3f;
            const float zhi = logf(__uint_as_float(klo + (1u << BIN_BITS)) * den) + 1e-3f;
            if (tid == 0) s_n = 0u;
            __syncthreads();
            for (int j0 = lo + 4 * tid; j0 < hi; j0 += 4 * NTHREADS) {
                float x[4];
                load4(z, j0, hi, x);
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const float zt = tempered(x[q], m, it);
                    if (!(zt >= zlo && zt <= zhi)) continue;
                    const u32 key = prob_key(zt, iden);
                    if (key >= klo && key - klo < (1u << BIN_BITS)) {
                        const u32 slot = atomicAdd(&s_n, 1u);
                        if (slot < (u32)NMAX) hb[slot] = ((u64)key << 32) | (u32)(j0 + q);
                    }
                }
            }
            __syncthreads();
            if (tid == 0) pub.n_list = s_n;
            cluster_sync();
            int n = 0;
            if (c == 0) n = gather_lists(hb, min(s_n, (u32)NMAX), &pub);
            cluster_sync();  // the others' lists are read: they may leave
            if (c != 0) return;
            if (n == (int)nb) {  // else (never, by the window's margins): over V below
                resolved = true;
                if (n <= 32) {
                    if (tid < 32) inb = warp_draw(hb, n, above_b, limit, false, z, m, it, k0, k1);
                } else {
                    const int n2 = pow2_at_least(n);
                    for (int i = n + tid; i < n2; i += NTHREADS) hb[i] = 0ull;
                    __syncthreads();
                    sort_desc(hb, n2);  // rank order: probability, then id
                    inb = draw_sorted(hb, n, above_b, limit, false, z, m, it, k0, k1, FLOOR, red,
                                      ured);
                }
            }
        } else {
            cluster_sync();  // every read of the others' shared memory is done
            if (c != 0) return;
        }
        if (!resolved)  // CTA 0 alone, over V (the split kernels' large-bin path)
            inb = resolve_range(z, m, it, iden, -INFINITY, k0, k1, FLOOR, klo, BIN_BITS, above_b,
                                limit, hm, hc, red, ired, ured);
        token = unpack_id(inb > best ? inb : best);
    }
#else  // TOP_K > 0
    (void)iden;
    // ---- 2. counts per topk_bin (the bin of the tempered logit), combined per slice
    for (int i = tid; i < NB; i += NTHREADS) hc[i] = 0u;
    __syncthreads();
    for (int j0 = lo + 4 * tid; j0 < hi; j0 += 4 * NTHREADS) {
        float x[4];
        load4(z, j0, hi, x);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const float zt = tempered(x[q], m, it);
            if (zt > -INFINITY) atomicAdd(&hc[topk_bin(zt, t)], 1u);
        }
    }
    __syncthreads();
    cluster_sync();
    for (int k = tid; k < SLICE; k += NTHREADS) {
        u32 a = 0u;
#pragma unroll
        for (int q = 0; q < CLUSTER; ++q) a += ld_peer32(&hc[base + k], q);
        hc[base + k] = a;
    }
    __syncthreads();
    u32 n_ge, total = 0u;
    int beta;
    {  // the bin of the k-th largest: the highest bin whose count from the top reaches k
        const u32 mine = tid < SLICE ? hc[base + tid] : 0u;
        u32 slice_cnt;
        const u32 incl = block_scan(mine, red, &slice_cnt);
        if (tid == 0) pub.total = slice_cnt;
        cluster_sync();
        if (tid < CLUSTER) tot[tid] = ld_peer32(&pub.total, tid);
        __syncthreads();
        u32 above_slice = 0u;
        for (int q = 0; q < CLUSTER; ++q) {
            total += tot[q];
            if (q > c) above_slice += tot[q];
        }
        const u32 at_or_above = above_slice + (slice_cnt - incl) + mine;
        const int cand = tid < SLICE && at_or_above >= (u32)TOP_K ? base + tid : -1;
        const int cb = block_reduce<MaxI>(cand, ired);
        if (cand == cb && cb >= 0) pub.cand_above = at_or_above;
        if (tid == 0) pub.cand = cb;
        cluster_sync();
        if (tid == 0) {
            int b = -1;
            for (int q = 0; q < CLUSTER; ++q) b = max(b, (int)ld_peer32(&pub.cand, q));
            s_b = b;
            s_cnt = b < 0 ? total : ld_peer32(&pub.cand_above, b / SLICE);
        }
        __syncthreads();
        beta = max(s_b, 0);  // none: fewer than k live tokens, all of them
        n_ge = s_cnt;
    }
    bool listed = false;
    int n = 0;
    if (n_ge <= (u32)NMAX) {  // collect every token at or above bin beta
        if (tid == 0) s_n = 0u;
        __syncthreads();
        for (int j0 = lo + 4 * tid; j0 < hi; j0 += 4 * NTHREADS) {
            float x[4];
            load4(z, j0, hi, x);
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const float zt = tempered(x[q], m, it);
                if (zt > -INFINITY && topk_bin(zt, t) >= beta) {
                    const u32 slot = atomicAdd(&s_n, 1u);
                    if (slot < (u32)NMAX) hb[slot] = ((u64)ord_of(zt) << 32) | (u32)(j0 + q);
                }
            }
        }
        __syncthreads();
        if (tid == 0) pub.n_list = s_n;
        cluster_sync();
        if (c == 0) n = gather_lists(hb, min(s_n, (u32)NMAX), &pub);
        cluster_sync();  // the others' lists are read: they may leave
        if (c != 0) return;
        listed = n == (int)n_ge;
    } else {
        cluster_sync();  // every read of the others' shared memory is done
        if (c != 0) return;
    }
    if (listed && n <= 32) {
        if (tid < 32) token = warp_topk_draw(hb, n, tp, z, m, it, k0, k1);
    } else {  // topk_draw's list path, or (n > NMAX) its selection over V by CTA 0 alone
        token = topk_draw(hb, listed ? n : NMAX + 1, tp, z, m, it, k0, k1, FLOOR, hm, hc, red,
                          ired, ured, fred);
    }
#endif
    if (tid == 0) tokens[r] = token;
}
#endif  // CLUSTER > 0
#if GRIDSYNC
// ============================================================================= grid variant
//
// rejax_sample_grid: the "reject" variant's sampler (top-p without top-k) in one launch over a
// grid of GRID CTAs per row (grid GRID x B; CTA c owns chunk c of the row), so a batch of one row
// runs on every SM instead of one cluster of 8. The CTAs of a row meet at grid barriers: each
// publishes its partials in global scratch, arrives on the row's counter and waits until every
// CTA of the row has arrived; then each CTA reads all GRID partials and combines them the same
// way (a fixed reduction tree), so all of them hold the same row statistics and verdicts. The
// plan keeps B x GRID CTAs resident at once (launch bounds NTHREADS x MIN_CTAS), which a barrier
// among co-running CTAs needs; the last CTA of a row to leave clears the row's counters.
//
//   1. the chunk's statistics as the cluster kernel computes them (a max sweep, a sums sweep),
//      combined after barrier 1: max, first / last argmax, entropy, temperature, denominator.
//   2. the NC best Gumbel scores over every live token (chunk_best's noise and pruning; each CTA
//      keeps its NC best, the combine takes the row's NC best), after barrier 2. The best one is
//      the draw for top-p = 1, which ends there.
//   3. the NC candidates' keep tests from integer masses in one sweep (order-free sums, so every
//      CTA gets the same verdicts): the mass ranked above each against top_p x the total, after
//      barrier 3. The best-scoring kept candidate is the Gumbel-max over the kept tokens (a kept
//      token with a higher score would be a candidate before it), the token every variant draws.
//      The first draw alone is rejected about 1 - top_p of the time; all NC of them far less
//      often, which matters at many rows, where one rejected row holds the whole launch.
//   4. every candidate rejected: the kept tokens are a prefix of the rank order that ends above
//      all of them, so the draw is the best score among the tokens ranked above the
//      highest-ranked candidate; that token is tested as in 3, and so on. Each round climbs the
//      rank order and the top-ranked token is always kept (when top_p x total > 0; else the
//      row's top token, as the other variants), so it ends.
// Every CTA of a row takes the same branches (they read the same combined values), so all pass
// the same barriers.

#ifndef NC  // the first draw's candidates, whose keep tests run in one sweep
#define NC 4
#endif
#ifndef GRID_CDF  // the "cdf" variant: the first draws by the inverse CDF instead of Gumbel-max
#define GRID_CDF 0
#endif
#if TOP_K > 0  // top-k keeps the grid's own draw (the top-p path below is dead code there)
#undef GRID_CDF
#define GRID_CDF 0
#endif

static_assert(GRID >= 1 && GRID <= NTHREADS, "one partial per thread in the combines");

__device__ float g_gst[B_ROWS * GRID * 5];  // per CTA: max, s, u, sa, sb
__device__ int g_garg[B_ROWS * GRID * 2];   // per CTA: first / last argmax
__device__ u64 g_gbest[B_ROWS * GRID * NC];  // per CTA: its NC best packed scores of the round
__device__ u32 g_gmass[B_ROWS * GRID * (NC + 1)];  // per CTA: mass, the parts above each x
__device__ u32 g_gbar[B_ROWS];              // arrivals at the row's barriers (GRID per round)
#if GRID_CDF
// The "cdf" variant's first draws (step 2 below): each token's weight is its tempered exp
// relative to the row's max, exp((z - m) / t) in [0, 1], in fixed point (cdf_units: 2**40
// units, exact for weights >= 2**-16), the same for every launch plan. The weights sum exactly
// (integers), so the sub-blocks of 128 tokens, the chunks and the row have exact totals in
// vocabulary order, and a draw u in [0, total) finds its chunk, sub-block and token by integer
// prefix sums: the token is a function of the logits, the temperature and the key alone (any
// batch, any plan). The row max is known before the sums: a barrier after the max sweep. Every
// CTA publishes its totals at both candidate temperatures.
static_assert(V_SIZE < (1 << 23), "the weights' sums fit 64 bits");
#define CDF_SUB 128                           // tokens a sub-block: one warp's float4 loads
#define NSUB ((CH + CDF_SUB - 1) / CDF_SUB)  // sub-blocks a chunk
__device__ u64 g_gcdf[B_ROWS * GRID * 2];  // per CTA: its weights' totals at t_a and t_b
__device__ float g_gmax[B_ROWS * GRID];    // per CTA: its chunk's max (before the sums)
__device__ int g_gcand[B_ROWS * NC];       // the row's NC draws (written by the CTA holding each)
__device__ __forceinline__ u64 cdf_units(float e) {  // e in [0, 1] -> 2**40 units (truncated)
    return __float2ull_rz(e * 1099511627776.0f);
}
// The warp's sum of x < 2**42 a lane (two 32-bit reductions of its high and low parts).
__device__ __forceinline__ u64 warp_sum_w(u64 x) {
    const u32 h = __reduce_add_sync(0xffffffffu, (u32)(x >> 20));
    const u32 l = __reduce_add_sync(0xffffffffu, (u32)x & 0xFFFFFu);
    return ((u64)h << 20) + l;
}
struct SumU64 {
    __device__ static u64 identity() { return 0ull; }
    __device__ static u64 apply(u64 a, u64 b) { return a + b; }
};
#endif
__device__ u32 g_gexit[B_ROWS];             // CTAs of the row that have left
#if TOP_K > 0
// Top-k: each CTA publishes the TK_PUB largest of its threads' maxima (distinct tokens, packed
// ord_of(logit) << 32 | id); tau, the k-th largest of the published values, has k distinct
// tokens at or above it, so the tokens >= tau hold the top-k set (a superset, for topk_draw).
#define TK_PUB 8
#define TAU_K_MAX 64  // a larger k skips tau: every live token is listed (topk_draw's V path)
__device__ u64 g_gtop[B_ROWS * GRID * TK_PUB];
__device__ u64 g_glist[B_ROWS * NMAX];  // the row's tokens >= tau (in arrival order)
__device__ u32 g_gln[B_ROWS];           // how many arrived (may pass NMAX)
#endif

__device__ __forceinline__ u32 ld_acquire(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// The row's barrier `round` (1, 2, ...): every write of this CTA before it is visible to every
// CTA of the row after it. Thread 0 arrives with fence.acq_rel then a relaxed add (release
// semantics, cumulative: they cover the CTA's writes __syncthreads ordered before it) and polls
// with acquire loads, whose order __syncthreads passes on to the CTA's later reads (__ldcg, L2);
// no sequentially consistent fence (__threadfence is MEMBAR.SC.GPU on sm_90). Measured against
// __threadfence before the add and after the wait (H100, kernel alone, the same draws bit for
// bit): 1 row 1-2 us faster, 64 rows 1.5-2 us; a release reduction (red.release.gpu) instead
// of the fence and add ties it and spills 4 bytes in the "cdf-state" builds.
__device__ __forceinline__ void grid_barrier(u32* bar, u32 round) {
    __syncthreads();
    if (threadIdx.x == 0) {
        asm volatile("fence.acq_rel.gpu;" ::: "memory");
        atomicAdd(bar, 1u);
        const u32 target = round * (u32)GRID;
        while (ld_acquire(bar) < target) __nanosleep(20);
    }
    __syncthreads();
}

// The score of a packed (score, id) (the inverse of pack's float map).
__device__ __forceinline__ float score_of(u64 p) {
    const u32 b = (u32)(p >> 32);
    return __uint_as_float((b & 0x80000000u) ? (b & 0x7fffffffu) : ~b);
}

// The sweeps below call scores4 with a floor raised to a score the block already holds: a token
// that cannot reach it cannot enter the block's best scores, so those are the ones of scoring
// every token.
#define NOISE_MAX 38.83f  // above gumbel_of's largest value, 56 log 2 = 38.816

// Inserts packed score v into the descending list l[0, NC) if it belongs there.
__device__ __forceinline__ void top_insert(u64 (&l)[NC], u64 v) {
#pragma unroll
    for (int k = 0; k < NC; ++k) {
        const u64 a = l[k];
        const bool take = v > a;
        l[k] = take ? v : a;
        v = take ? a : v;
    }
}

// N values reduced at once over the block, each in block_reduce's order (so each result is
// bitwise block_reduce's), with one round of barriers for all of them; `red` holds N x NWARPS.
template <typename Op, int N, typename T>
__device__ __forceinline__ void block_reduce_n(T (&x)[N], T* red) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
#pragma unroll
    for (int k = 0; k < N; ++k) x[k] = warp_reduce<Op>(x[k]);
    __syncthreads();
    if (lane == 0)
#pragma unroll
        for (int k = 0; k < N; ++k) red[k * NWARPS + w] = x[k];
    __syncthreads();
    if (threadIdx.x < 32) {
#pragma unroll
        for (int k = 0; k < N; ++k) {
            T y = lane < NWARPS ? red[k * NWARPS + lane] : Op::identity();
            y = warp_reduce<Op>(y);
            if (lane == 0) red[k * NWARPS] = y;  // this lane has read its slot k already
        }
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < N; ++k) x[k] = red[k * NWARPS];
}

// Pops v, a warp's largest head (warp_reduce<MaxU64> of l[0]), from its owner's descending list
// l (packed scores, distinct by id; 0 = none): one round of a warp's merge of its lanes' lists.
template <int N>
__device__ __forceinline__ void pop_head(u64 (&l)[N], u64 v) {
    if (v && l[0] == v) {
#pragma unroll
        for (int j = 0; j + 1 < N; ++j) l[j] = l[j + 1];
        l[N - 1] = 0ull;
    }
}

// The NC largest of the block's per-thread descending lists `mine` (every thread gets them, in
// `out`, descending; 0 where fewer): each warp takes its NC largest in NC rounds of a warp max,
// each popping the winner (packed scores are distinct by id) from its owner's list, then warp 0
// takes the NC largest of the warps' lists the same way. `wl` holds NWARPS x NC.
__device__ void block_top(u64 (&mine)[NC], u64* wl, u64 (&out)[NC]) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    __syncthreads();  // the last call's readers of wl are done
#pragma unroll
    for (int k = 0; k < NC; ++k) {
        const u64 v = warp_reduce<MaxU64>(mine[0]);
        if (lane == 0) wl[w * NC + k] = v;
        pop_head(mine, v);
    }
    __syncthreads();
    if (threadIdx.x < 32) {
        u64 l[NC];
#pragma unroll
        for (int k = 0; k < NC; ++k) l[k] = lane < NWARPS ? wl[lane * NC + k] : 0ull;
        __syncwarp();
#pragma unroll
        for (int k = 0; k < NC; ++k) {
            const u64 v = warp_reduce<MaxU64>(l[0]);
            if (lane == 0) wl[k] = v;  // every lane has read its list above
            pop_head(l, v);
        }
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < NC; ++k) out[k] = wl[k];
}

// chunk_best's sweep keeping the NC best packed scores; the block's NC best in `out`. The floor
// is the block's: NC slots in shared memory (ord_of bits, raised with atomicMax), slot s the
// best score seen by the threads tid % NC == s, hold the scores of NC distinct tokens, so the
// block's NC-th best score is at least their least; so is it at least any thread's own NC-th
// best. A token below the larger of the two cannot be among the block's NC best; a thread's
// list may then miss tokens of its own, but never one of those. Warps skip the noise's
// logarithms far more often than with the thread's own floor (flat logits: a warp computes
// them when any lane needs them).
__device__ void chunk_top(Logits z, int lo, int hi, float m, float it, u32 k0, u32 k1,
                          u64* wl, u32 (&slot)[NC], u64 (&out)[NC]) {
    const int tid = threadIdx.x;
    u64 l[NC];
#pragma unroll
    for (int k = 0; k < NC; ++k) l[k] = 0ull;
    if (tid < NC) slot[tid] = ord_of(PRUNE_SCORE);
    __syncthreads();
    float own = PRUNE_SCORE, best = PRUNE_SCORE;  // this thread's NC-th best and best scores
    for (int j0 = lo + 4 * tid; j0 < hi; j0 += 4 * NTHREADS) {
        u32 least = *(volatile u32*)&slot[0];
#pragma unroll
        for (int k = 1; k < NC; ++k) least = min(least, *(volatile u32*)&slot[k]);
        const float floor = fmaxf(own, float_of_ord(least));
        float x[4], zt[4];
        bool cand[4], any = false;
        load4(z, j0, hi, x);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            zt[q] = tempered(x[q], m, it);
            cand[q] = zt[q] >= FLOOR && zt[q] + NOISE_MAX >= floor;
            any |= cand[q];
        }
        if (any) {
            u64 sc[4];
            scores4(zt, cand, j0, k0, k1, floor, sc);
#pragma unroll
            for (int q = 0; q < 4; ++q)
                if (sc[q] > l[NC - 1]) top_insert(l, sc[q]);
            if (l[NC - 1]) own = fmaxf(own, score_of(l[NC - 1]));
            if (l[0] && score_of(l[0]) > best) {
                best = score_of(l[0]);
                atomicMax(&slot[tid % NC], ord_of(best));
            }
        }
    }
    block_top(l, wl, out);
}

// The best packed score over the tokens of chunk [lo, hi) ranked above (kx, xid) (a larger
// probability key, or the same key and a higher id) whose tempered logit is >= FLOOR, with
// chunk_best's noise and pruning; reduced over the block.
__device__ u64 chunk_best_above(Logits z, int lo, int hi, float m, float it, float iden,
                                u32 kx, int xid, u32 k0, u32 k1, u64* ured) {
    const int tid = threadIdx.x;
    u64 best = 0ull;
    float floor = PRUNE_SCORE;  // the thread's best score so far
    for (int j0 = lo + 4 * tid; j0 < hi; j0 += 4 * NTHREADS) {
        float x[4], zt[4];
        bool cand[4], any = false;
        load4(z, j0, hi, x);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            zt[q] = tempered(x[q], m, it);
            cand[q] = false;
            if (zt[q] >= FLOOR && zt[q] + NOISE_MAX >= floor) {
                const u32 key = prob_key(zt[q], iden);
                cand[q] = key > kx || (key == kx && j0 + q > xid);
            }
            any |= cand[q];
        }
        if (any) {
            u64 sc[4];
            scores4(zt, cand, j0, k0, k1, floor, sc);
#pragma unroll
            for (int q = 0; q < 4; ++q) best = sc[q] > best ? sc[q] : best;
            if (best) floor = fmaxf(PRUNE_SCORE, score_of(best));
        }
    }
    return block_reduce<MaxU64>(best, ured);
}

#if TOP_K > 0
// Publishes the block's TK_PUB largest of the threads' values v (0: none) to out[0, TK_PUB),
// descending: each warp sorts its 32, then warp 0 merges the warps' TK_PUB best in TK_PUB
// rounds of a warp max. `sh` holds NWARPS x TK_PUB.
__device__ void publish_top(u64 v, u64* sh, u64* out) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    v = warp_sort_desc(v);
    __syncthreads();  // earlier readers of sh are done
    if (lane < TK_PUB) sh[w * TK_PUB + lane] = v;
    __syncthreads();
    if (w == 0) {
        u64 l[TK_PUB];
#pragma unroll
        for (int k = 0; k < TK_PUB; ++k) l[k] = lane < NWARPS ? sh[lane * TK_PUB + k] : 0ull;
        u64 mine = 0ull;
#pragma unroll
        for (int k = 0; k < TK_PUB; ++k) {
            const u64 x = warp_reduce<MaxU64>(l[0]);
            if (lane == k) mine = x;
            pop_head(l, x);
        }
        if (lane < TK_PUB) out[lane] = mine;
    }
}

// The TOP_K-th largest of the row's published values g[0, GRID x TK_PUB) (descending lists of
// TK_PUB per CTA; 0 entries are none), or 0 when fewer than TOP_K are published or TOP_K >
// TAU_K_MAX. Every thread gets it. Each warp takes its lanes' lists' TOP_K largest in TOP_K
// rounds of a warp max (into sh, NWARPS x TOP_K), then warp 0 merges those lists the same way.
__device__ u64 kth_published(const u64* g, u64* sh, u64* result) {
    if (TOP_K > TAU_K_MAX || GRID * TK_PUB < TOP_K) return 0ull;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, tid = threadIdx.x;
    u64 l[TK_PUB];
#pragma unroll
    for (int k = 0; k < TK_PUB; ++k) l[k] = tid < GRID ? __ldcg(g + tid * TK_PUB + k) : 0ull;
    __syncthreads();  // earlier readers of sh are done
    for (int k = 0; k < TOP_K; ++k) {
        const u64 x = warp_reduce<MaxU64>(l[0]);
        if (lane == 0) sh[w * TOP_K + k] = x;
        pop_head(l, x);
    }
    __syncthreads();
    if (w == 0) {
        int at = 0;  // lane j < NWARPS walks warp j's list
        u64 x = 0ull;
        for (int k = 0; k < TOP_K; ++k) {
            const u64 head = lane < NWARPS && at < TOP_K ? sh[lane * TOP_K + at] : 0ull;
            x = warp_reduce<MaxU64>(head);
            if (x && head == x) ++at;
        }
        if (lane == 0) *result = x;  // 0 if fewer than TOP_K were published
    }
    __syncthreads();
    return *result;
}
#endif

#ifndef RESET_STATE  // ReSET's state update in the kernel (the "grid-state" method)
#define RESET_STATE 0
#endif
#if RESET_STATE
// rejax.sampling's ReSET state after a token: the entropy h pushed into the ring of W_RING
// entropies and the step / response sums (_push), then the token observed (_observe: a
// double-newline token, or a newline after a newline, ends the step and clears the step's
// sums). Exact integer and float32 operations, as XLA runs them, so the state is bitwise the
// state of the XLA path. Run by every thread of one CTA of the row. The outputs may be the
// inputs' buffers (the op aliases them): each element is read before it is written.
#define RESET_STATE_IN                                                                          \
    const float *__restrict__ ring, const int *__restrict__ n_ring,                             \
        const int *__restrict__ ring_pos, const float *__restrict__ s_sum,                      \
        const int *__restrict__ s_n, const float *__restrict__ g_sum, const int *__restrict__ g_n, \
        const int *__restrict__ y1, const int *__restrict__ y2, const u8 *__restrict__ nl,       \
        const u8 *__restrict__ dnl,
#define RESET_STATE_OUT                                                                         \
    , float *__restrict__ ring_o, int *__restrict__ n_ring_o, int *__restrict__ ring_pos_o,     \
        float *__restrict__ s_sum_o, int *__restrict__ s_n_o, float *__restrict__ g_sum_o,      \
        int *__restrict__ g_n_o, int *__restrict__ y1_o, int *__restrict__ y2_o
typedef unsigned char u8;
__device__ __forceinline__ bool in_mask(const u8* mask, int id) {
    return id >= 0 && id < V_SIZE && mask[id] != 0;
}
__device__ void reset_record(int r, int token, float h, const float* ring, const int* n_ring,
                             const int* ring_pos, const float* s_sum, const int* s_n,
                             const float* g_sum, const int* g_n, const int* y1, const u8* nl,
                             const u8* dnl, float* ring_o, int* n_ring_o, int* ring_pos_o,
                             float* s_sum_o, int* s_n_o, float* g_sum_o, int* g_n_o, int* y1_o,
                             int* y2_o) {
    const int pos = ring_pos[r];
    for (int i = threadIdx.x; i < W_RING; i += NTHREADS)
        ring_o[(size_t)r * W_RING + i] = i == pos ? h : ring[(size_t)r * W_RING + i];
    __syncthreads();  // every thread has read ring_pos before thread 0 writes it (in place)
    if (threadIdx.x == 0) {
        n_ring_o[r] = min(n_ring[r] + 1, W_RING);
        ring_pos_o[r] = (pos + 1) % W_RING;
        g_sum_o[r] = g_sum[r] + h;
        g_n_o[r] = g_n[r] + 1;
        const int before = y1[r];
        const bool boundary = in_mask(dnl, token) || (in_mask(nl, token) && in_mask(nl, before));
        const float s = s_sum[r] + h;
        s_sum_o[r] = boundary ? 0.0f : s;
        s_n_o[r] = boundary ? 0 : s_n[r] + 1;
        y1_o[r] = token;
        y2_o[r] = before;
    }
}
#else
#define RESET_STATE_IN
#define RESET_STATE_OUT
#endif

// FOLD_STEP (the decode loops' step folded into the row keys in the launch instead of an XLA
// fusion before it): `keys` holds the rows' base keys and `step` STEP_ROWS (1: one for every
// row, or B_ROWS) int32 steps; row r draws with fold_in(keys[r], step[r or 0]).
#ifndef FOLD_STEP
#define FOLD_STEP 0
#endif
#if FOLD_STEP
#ifndef STEP_ROWS
#define STEP_ROWS 1
#endif
static_assert(STEP_ROWS == 1 || STEP_ROWS == B_ROWS, "one step, or one a row");
#define STEP_IN const int *__restrict__ step,
#else
#define STEP_IN
#endif
extern "C" __global__ void __launch_bounds__(NTHREADS, MIN_CTAS)
rejax_sample_grid(const logit_t* __restrict__ logits, const float* __restrict__ thr,
                  const float* __restrict__ alt, const float* __restrict__ t_a,
                  const float* __restrict__ t_b, const float* __restrict__ top_p,
                  const u32* __restrict__ keys, RESET_STATE_IN STEP_IN int* __restrict__ tokens,
                  float* __restrict__ entropy, float* __restrict__ temperature RESET_STATE_OUT) {
    __shared__ u32 red[NWARPS];
    __shared__ int ired[NWARPS];
    __shared__ u64 ured[NWARPS];
    __shared__ float fred[NWARPS];
    __shared__ float rowf[3 + RESET_STATE];  // the row's max, temperature, denominator (entropy)
    __shared__ int rowi[2];    // the row's first / last argmax
    __shared__ u32 slot[NC];   // chunk_top's floor
    __shared__ float fred4[4 * NWARPS];  // batched reductions' scratch
    __shared__ int ired2[2 * NWARPS];
    __shared__ u32 ured5[(NC + 1) * NWARPS];
    __shared__ u64 wl[NWARPS * NC];      // block_top's lists
#if GRID_CDF
    __shared__ u64 sub_w[2][NSUB];       // the chunk's sub-block weight totals at t_a, t_b
    __shared__ u64 red64[NWARPS];
    __shared__ u64 cdf_incl[NTHREADS];  // the row's chunk totals, inclusive prefix sums
    __shared__ u64 cdf_v[NC], cdf_rem[NC];
    __shared__ int cdf_claim[NC], cdf_sub[NC];
    __shared__ int row_high;      // the row's choice of t_a
    __shared__ u64 cdf_total_s;   // the row's weight total
    __shared__ float mc_own;  // the row's max (the weights' reference; -inf: a dead chunk)
#endif
#if TOP_K > 0
    __shared__ u64 hb[NMAX];            // CTA 0's list of the row's tokens >= tau; scratch before
    __shared__ u32 hm[NB], hc[NB];      // topk_draw's histograms
    __shared__ u64 tau_s;
    static_assert(NWARPS * TAU_K_MAX <= NMAX && NWARPS * TK_PUB <= NMAX, "hb as scratch");
#endif
    const int r = blockIdx.y, c = blockIdx.x, tid = threadIdx.x;
    const Logits z{logits + (size_t)r * V_SIZE};
    const int lo = min(c * CH, V_SIZE), hi = min(lo + CH, V_SIZE);
    float* const gst = g_gst + (size_t)r * GRID * 5;
    int* const garg = g_garg + (size_t)r * GRID * 2;
    u64* const gbest = g_gbest + (size_t)r * GRID * NC;
#if TOP_K > 0
    u64* const gtop = g_gtop + (size_t)r * GRID * TK_PUB;
#endif
    u32* const gmass = g_gmass + (size_t)r * GRID * (NC + 1);
    u32* const bar = g_gbar + r;
    u32 round = 0;
#if FOLD_STEP
    // the row's key, made while the first sweep loads (read after its block reductions)
    __shared__ u32 key_s[2];
    if (tid == 0)
        threefry_fold_in(keys[r * 2], keys[r * 2 + 1], (u32)step[STEP_ROWS == 1 ? 0 : r],
                         key_s[0], key_s[1]);
    const u32* const rkey = key_s;
#else
    const u32* const rkey = keys + r * 2;
#endif

    // ---- 1. the chunk's statistics, combined in every CTA
    const float ta_raw = t_a[r], tb_raw = t_b[r];
    const float ia = 1.0f / (ta_raw <= GREEDY_EPS ? 1.0f : ta_raw);
    const float ib = 1.0f / (tb_raw <= GREEDY_EPS ? 1.0f : tb_raw);
    {
        float m = -INFINITY;
        int first = INT_BIG, last = -1;
        Ahead4 nx;
        nx.start(z, lo + 4 * tid, hi);
        for (int j0 = lo + 4 * tid; j0 < hi; j0 += 4 * NTHREADS) {
            float x[4];
            nx.next(z, j0, hi, x);
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                if (x[q] > m) {
                    m = x[q];
                    first = j0 + q;
                    last = j0 + q;
                } else if (x[q] == m && j0 + q < hi) {
                    first = min(first, j0 + q);
                    last = j0 + q;
                }
            }
        }
#if TOP_K > 0
        // the thread's max token (first of its ties), one of the CTA's published maxima
        publish_top(m > -INFINITY ? ((u64)ord_of(m) << 32) | (u32)first : 0ull, hb,
                    gtop + c * TK_PUB);
#endif
#if GRID_CDF
        // the sums relative to the row's max (published as every chunk's max, so the combine's
        // rescale is by exp(0) = 1); the first / last argmax only from chunks holding it
        float mc = block_reduce<MaxF>(m, fred);
        if (tid == 0) g_gmax[(size_t)r * GRID + c] = mc;
        grid_barrier(bar, ++round);
        {
            const float mq = tid < GRID ? __ldcg(g_gmax + (size_t)r * GRID + tid) : -INFINITY;
            const float mrow = block_reduce<MaxF>(mq, fred);
            if (mc < mrow) m = -INFINITY;  // this chunk's argmax is not the row's
            mc = mc > -INFINITY ? mrow : mc;
        }
#else
        const float mc = block_reduce<MaxF>(m, fred);
#endif
        float s = 0.0f, u = 0.0f, sa = 0.0f, sb = 0.0f;
        const bool two = ib != ia;  // Temperature: one tempered sum
#if GRID_CDF
        // the same sums, each thread over the same tokens in the same order, plus the weights:
        // every lane of a warp runs every iteration (the reductions), a lane past hi on -inf
        // logits (adding zeros)
        if (tid == 0) mc_own = mc;
        u64 wa_tot = 0ull, wb_tot = 0ull;  // lane 0: its warp's totals
        if (mc > -INFINITY) {
            const int lane = tid & 31, w = tid >> 5;
            int i = 0;
            Ahead4 nx;
            nx.start(z, lo + 4 * tid, hi);
            for (int w0 = lo + 4 * (tid & ~31); w0 < hi; w0 += 4 * NTHREADS, ++i) {
                const int j0 = w0 + 4 * lane;
                float x[4];
                nx.next(z, j0, hi, x);
                u64 la = 0ull, lb = 0ull;
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const float d = x[q] - mc;
                    const float e = expf(d);
                    s += e;
                    if (e > 0.0f) u += e * d;
                    const float ea = expf(d * ia);
                    sa += ea;
                    la += cdf_units(ea);
                    if (two) {
                        const float eb = expf(d * ib);
                        sb += eb;
                        lb += cdf_units(eb);
                    }
                }
                const u64 ta = warp_sum_w(la);
                const u64 tb = two ? warp_sum_w(lb) : ta;
                if (lane == 0) {  // sub-block i * NWARPS + w: tokens [w0, w0 + 128)
                    sub_w[0][i * NWARPS + w] = ta;
                    sub_w[1][i * NWARPS + w] = tb;
                    wa_tot += ta;
                    wb_tot += tb;
                }
            }
        }
        wa_tot = block_reduce<SumU64>(wa_tot, red64);
        wb_tot = block_reduce<SumU64>(wb_tot, red64);
        if (tid == 0) {
            g_gcdf[((size_t)r * GRID + c) * 2 + 0] = wa_tot;
            g_gcdf[((size_t)r * GRID + c) * 2 + 1] = wb_tot;
        }
        if (false) {
#else
        if (mc > -INFINITY) {
#endif
            Ahead4 nx;
            nx.start(z, lo + 4 * tid, hi);
            for (int j0 = lo + 4 * tid; j0 < hi; j0 += 4 * NTHREADS) {
                float x[4];
                nx.next(z, j0, hi, x);
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const float d = x[q] - mc;
                    const float e = expf(d);
                    s += e;
                    if (e > 0.0f) u += e * d;
                    sa += expf(d * ia);
                    if (two) sb += expf(d * ib);
                }
            }
        }
        // the first / last argmax (max as the min of its negation: exact) and the sums, each
        // in block_reduce's order
        int fl[2] = {m == mc ? first : INT_BIG, m == mc ? -last : 1};
        float sums[4] = {s, u, sa, sb};
        block_reduce_n<MinI>(fl, ired2);
        block_reduce_n<Sum>(sums, fred4);
        first = fl[0];
        last = -fl[1];
        s = sums[0];
        u = sums[1];
        sa = sums[2];
        sb = two ? sums[3] : sa;
        if (tid == 0) {
            gst[c * 5 + 0] = mc;
            gst[c * 5 + 1] = s;
            gst[c * 5 + 2] = u;
            gst[c * 5 + 3] = sa;
            gst[c * 5 + 4] = sb;
            garg[c * 2 + 0] = first;
            garg[c * 2 + 1] = last;
        }
    }
    grid_barrier(bar, ++round);
    {  // the cluster kernel's combine over GRID partials, one per thread (a block tree)
        float mi = -INFINITY, si = 0.0f, ui = 0.0f, sai = 0.0f, sbi = 0.0f;
        int fi = INT_BIG, li = -1;
        for (int q = tid; q < GRID; q += NTHREADS) {  // GRID <= NTHREADS (the plan's)
            mi = __ldcg(gst + q * 5 + 0);
            si = __ldcg(gst + q * 5 + 1);
            ui = __ldcg(gst + q * 5 + 2);
            sai = __ldcg(gst + q * 5 + 3);
            sbi = __ldcg(gst + q * 5 + 4);
            fi = __ldcg(garg + q * 2 + 0);
            li = __ldcg(garg + q * 2 + 1);
        }
        const float mw = block_reduce<MaxF>(mi, fred);
        float S = 0.0f, U = 0.0f, SA = 0.0f, SB = 0.0f;
        int f = INT_BIG, l = -1;
        if (tid < GRID) {
            if (mi == mw) {
                f = fi;
                l = li;
            }
            if (si > 0.0f) {
                const float dm = mi - mw, w = expf(dm);
                S = si * w;
                U = w * (ui + si * dm);
                SA = sai * expf(dm * ia);
                SB = sbi * expf(dm * ib);
            }
        }
        float sums[4] = {S, U, SA, SB};
        int fl[2] = {f, -l};
        block_reduce_n<Sum>(sums, fred4);
        block_reduce_n<MinI>(fl, ired2);
        S = sums[0];
        U = sums[1];
        SA = sums[2];
        SB = sums[3];
        f = fl[0];
        l = -fl[1];
        if (tid == 0) {
            const float h = logf(S) - U / S;
            const bool high = (h >= thr[r]) || (h > alt[r]);
#if RESET_STATE
            rowf[3] = h;
#endif
            rowf[0] = mw;
            rowf[1] = high ? ta_raw : tb_raw;
            rowf[2] = high ? SA : SB;
            rowi[0] = f == INT_BIG ? 0 : f;
            rowi[1] = l < 0 ? 0 : l;
            if (c == 0) {
                entropy[r] = h;
                temperature[r] = rowf[1];
            }
#if GRID_CDF
            row_high = high;
#endif
        }
        __syncthreads();
#if GRID_CDF
        {  // the chunks' weight totals at the row's temperature and their inclusive prefix
           // sums in chunk order (integers: the same in every CTA)
            const bool ha = row_high;
            const u64 eq =
                tid < GRID ? __ldcg(g_gcdf + ((size_t)r * GRID + tid) * 2 + (ha ? 0 : 1)) : 0ull;
            u64 total;
            cdf_incl[tid] = block_scan<u64>(eq, red64, &total);
            if (tid == 0) cdf_total_s = total;
            __syncthreads();
        }
#endif
    }
    const float m = rowf[0], t = rowf[1], den = rowf[2];
#if RESET_STATE
    int token = 0;  // the row's draw (every thread of every CTA of the row gets it)
#define DRAWN(tok) token = (tok)
#else
#define DRAWN(tok) if (c == 0 && tid == 0) tokens[r] = (tok)
#endif
    if (t <= GREEDY_EPS) {  // greedy row: the first argmax of the raw logits
        DRAWN(rowi[0]);
    } else {
#if TOP_K > 0
        // ---- top-k: the tokens >= tau (a superset of the top-k set) listed, then CTA 0 draws
        // from the list as the split kernels' last block does (topk_draw: the k-th largest,
        // top-p over the kept tokens, the noise of the listed tokens only)
        const float it = 1.0f / t, tp = top_p[r];
        const u32 k0 = rkey[0], k1 = rkey[1];
        const u64 tau = kth_published(gtop, hb, &tau_s);
        const float zt_tau = tau ? tempered(float_of_ord((u32)(tau >> 32)), m, it) : -INFINITY;
        const int lane = tid & 31;
        // every lane of a warp runs the same iterations (the ballots): j0 past hi reads nothing
        for (int w0 = lo + 4 * (tid & ~31); w0 < hi; w0 += 4 * NTHREADS) {
            const int j0 = w0 + 4 * lane;
            float x[4];
            load4_or_inf(z, j0, hi, x);
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const float zt = tempered(x[q], m, it);
                const bool in = zt > -INFINITY && zt >= zt_tau;
                const u32 ballot = __ballot_sync(FULL_MASK, in);
                if (!ballot) continue;
                u32 base = 0u;  // one atomic a warp for its listed tokens
                if (lane == 0) base = atomicAdd(g_gln + r, (u32)__popc(ballot));
                base = __shfl_sync(FULL_MASK, base, 0);
                const u32 at = base + __popc(ballot & ((1u << lane) - 1u));
                if (in && at < (u32)NMAX)
                    g_glist[(size_t)r * NMAX + at] = ((u64)ord_of(zt) << 32) | (u32)(j0 + q);
            }
        }
        grid_barrier(bar, ++round);
        if (c == 0) {
            const u32 n = __ldcg(g_gln + r);
            const int listed = (int)min(n, (u32)NMAX);
            for (int i = tid; i < listed; i += NTHREADS)
                hb[i] = __ldcg(g_glist + (size_t)r * NMAX + i);
            __syncthreads();
            int token = 0;
            if (n <= 32u) {
                if (tid < 32) token = warp_topk_draw(hb, (int)n, tp, z, m, it, k0, k1);
            } else {  // topk_draw's list path, or (n > NMAX) its selection over V
                token = topk_draw(hb, n <= (u32)NMAX ? (int)n : NMAX + 1, tp, z, m, it, k0, k1,
                                  FLOOR, hm, hc, red, ired, ured, fred);
            }
            DRAWN(token);
        }
    }
    if (false) {  // top-k: the top-p path below is dead code
#endif
        const float it = 1.0f / t, iden = 1.0f / den, tp = top_p[r];

        const u32 k0 = rkey[0], k1 = rkey[1];
        u64 cand[NC];
#if GRID_CDF
        // ---- 2. (cdf) NC independent draws over every token by weight, each by the inverse
        // CDF of the weights in vocabulary order: u = floor(r total / 2**64) for 64 random bits
        // r (Philox at counters (0, 2, 0, 0) and (1, 2, 0, 0): words the noise, at (id / 4, 0 or
        // 1, 0, 0), never uses), uniform on [0, total) to 2**-64; the chunk whose prefix
        // interval holds u, then within it the sub-block and the token. The first kept draw
        // (step 3, in draw order) is a draw from the kept tokens by their weights (rejection
        // sampling); when all NC are rejected, step 4's climb draws instead with its own noise.
        static_assert(NC <= 4 && NC <= NWARPS, "two Philox calls; a warp a draw");
        bool first_round = true;
        const bool ha = row_high;
        const float ich = ha ? ia : ib;
        if (tid == 0) {
            const u64 total = cdf_total_s;
            const u64 inc_c = cdf_incl[c], exc_c = c ? cdf_incl[c - 1] : 0ull;
            const uint4 p0 = philox(0u, 2u, 0u, 0u, k0, k1), p1 = philox(1u, 2u, 0u, 0u, k0, k1);
            const u32 wd[8] = {p0.x, p0.y, p0.z, p0.w, p1.x, p1.y, p1.z, p1.w};
#pragma unroll
            for (int k = 0; k < NC; ++k) {
                const u64 uk = __umul64hi(((u64)wd[2 * k] << 32) | wd[2 * k + 1], total);
                const bool cl = exc_c <= uk && uk < inc_c;
                cdf_claim[k] = cl;
                cdf_v[k] = cl ? uk - exc_c : 0ull;
            }
        }
        __syncthreads();
        bool claimed = false;
#pragma unroll
        for (int k = 0; k < NC; ++k) claimed |= cdf_claim[k] != 0;
        if (claimed) {  // this chunk holds some of the draws: their sub-blocks, then tokens
            const u64* subs = sub_w[ha ? 0 : 1];
            const int nsub = (hi - lo + CDF_SUB - 1) / CDF_SUB;
            u64 carry = 0ull;
            for (int s0 = 0; s0 < nsub; s0 += NTHREADS) {
                const int sb = s0 + tid;
                const u64 x = sb < nsub ? subs[sb] : 0ull;
                u64 tot;
                const u64 incl = block_scan<u64>(x, red64, &tot) + carry;
#pragma unroll
                for (int k = 0; k < NC; ++k)
                    if (cdf_claim[k] && sb < nsub && incl - x <= cdf_v[k] && cdf_v[k] < incl) {
                        cdf_sub[k] = sb;
                        cdf_rem[k] = cdf_v[k] - (incl - x);
                    }
                carry += tot;
            }
            __syncthreads();
            const int w = tid >> 5, lane = tid & 31;
            if (w < NC && cdf_claim[w]) {  // warp k walks draw k's sub-block
                const u64 rem = cdf_rem[w];
                const int j0 = lo + CDF_SUB * cdf_sub[w] + 4 * lane;
                float x[4];
                load4_or_inf(z, j0, hi, x);
                u64 wq[4], l4 = 0ull;
#pragma unroll
                for (int q = 0; q < 4; ++q) {  // the sweep's weights, bit for bit
                    wq[q] = cdf_units(expf((x[q] - mc_own) * ich));
                    l4 += wq[q];
                }
                u64 incl = l4;
                for (int o = 1; o < 32; o <<= 1) {
                    const u64 y = __shfl_up_sync(0xffffffffu, incl, o);
                    if (lane >= o) incl += y;
                }
                const u64 excl = incl - l4;
                const bool mine = excl <= rem && rem < incl;  // one lane (exact integers)
                if (mine) {
                    u64 acc = excl;
                    int id = -1;
#pragma unroll
                    for (int q = 0; q < 4; ++q) {
                        if (id < 0 && rem < acc + wq[q]) id = j0 + q;
                        acc += wq[q];
                    }
                    g_gcand[r * NC + w] = id;
                }
                if (!__ballot_sync(0xffffffffu, mine) && lane == 0)  // unreachable: a token
                    g_gcand[r * NC + w] = lo + CDF_SUB * cdf_sub[w];   // all the same
            }
        }
#else
        // ---- 2. the NC best scores over every live token (top list, best first)
        chunk_top(z, lo, hi, m, it, k0, k1, wl, slot, cand);
#endif
        for (;;) {
            u64 xs[NC];  // the row's NC best scores, best first (0: none); cdf: its NC draws
#if GRID_CDF
            if (first_round) {
                grid_barrier(bar, ++round);
                const bool any = cdf_total_s > 0ull;
#pragma unroll
                for (int k = 0; k < NC; ++k)
                    xs[k] = any ? pack(0.0f, __ldcg(g_gcand + r * NC + k)) : 0ull;
            } else
#endif
            {
                if (tid == 0)
#pragma unroll
                    for (int k = 0; k < NC; ++k) gbest[c * NC + k] = cand[k];
                grid_barrier(bar, ++round);
                u64 mine[NC];
#pragma unroll
                for (int k = 0; k < NC; ++k)
                    mine[k] = tid < GRID ? __ldcg(gbest + tid * NC + k) : 0ull;  // sorted lists
                block_top(mine, wl, xs);
            }
            if (tp >= 1.0f) {  // every live token is kept
                DRAWN(unpack_id(xs[0]));
                break;
            }
            // ---- 3. the candidates' keep tests (the cluster kernel's REJECT sums over the
            // positive-mass tokens; a token ranks above x iff its key is larger, or equal with a
            // higher id)
            const float zt_cut = logf(den) - 21.487563f - 0.01f;  // log(den 2**-31) - 0.01
            int xid[NC];
            u32 kx[NC], above[NC];
            u64 rank[NC];
#pragma unroll
            for (int k = 0; k < NC; ++k) {
                xid[k] = xs[k] ? unpack_id(xs[k]) : -1;
                kx[k] = xs[k] ? prob_key(tempered(z[xid[k]], m, it), iden) : 0u;
                rank[k] = ((u64)kx[k] << 32) | (u32)xid[k];  // (key, id): one 64-bit compare
                above[k] = 0u;
            }
            u32 mass = 0u;
            Ahead4 nx;
            nx.start(z, lo + 4 * tid, hi);
            for (int j0 = lo + 4 * tid; j0 < hi; j0 += 4 * NTHREADS) {
                float x[4];
                nx.next(z, j0, hi, x);
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const float zt = tempered(x[q], m, it);
                    if (zt >= zt_cut) {  // NaN and masked logits fail this too
                        const u32 key = prob_key(zt, iden);
                        const u32 w = key > KEY_LO ? mass_of_key(key) : 0u;
                        mass += w;
                        const u64 rq = ((u64)key << 32) | (u32)(j0 + q);
#pragma unroll
                        for (int k = 0; k < NC; ++k) above[k] += rq > rank[k] ? w : 0u;
                    }
                }
            }
            {
                u32 v[NC + 1];
                v[0] = mass;
#pragma unroll
                for (int k = 0; k < NC; ++k) v[1 + k] = above[k];
                block_reduce_n<SumU>(v, ured5);
                mass = v[0];
#pragma unroll
                for (int k = 0; k < NC; ++k) above[k] = v[1 + k];
            }
            if (tid == 0) {
                gmass[c * (NC + 1)] = mass;
#pragma unroll
                for (int k = 0; k < NC; ++k) gmass[c * (NC + 1) + 1 + k] = above[k];
            }
            grid_barrier(bar, ++round);
            u32 total = 0u;
            {  // integers: order-free, exact, the same in every CTA
                u32 v[NC + 1];
#pragma unroll
                for (int k = 0; k <= NC; ++k) v[k] = tid < GRID ? __ldcg(gmass + tid * (NC + 1) + k) : 0u;
                block_reduce_n<SumU>(v, ured5);
                total = v[0];
#pragma unroll
                for (int k = 0; k < NC; ++k) above[k] = v[1 + k];
            }
            const float limit = tp * (float)total;
            // the best-scoring kept candidate is the Gumbel-max over the kept tokens: a kept
            // token of a higher score would be a candidate before it
            int found = -1;  // (scalar selects: no local array indexed at run time)
#pragma unroll
            for (int k = NC - 1; k >= 0; --k)
                if (xs[k] && kx[k] > KEY_LO && (float)above[k] < limit) found = xid[k];
            if (found >= 0) {
                DRAWN(found);
                break;
            }
            if (!(limit > 0.0f) || !xs[0]) {  // nothing is kept (top_p <= 0 or NaN): the top token
                DRAWN(rowi[1]);
                break;
            }
            // ---- 4. every candidate rejected: the kept tokens rank above all of them, so the
            // draw is the best score among the tokens ranked above the highest-ranked one
            u32 hk = kx[0];
            int hid = xid[0];
#pragma unroll
            for (int k = 1; k < NC; ++k)
                if (xs[k] && (kx[k] > hk || (kx[k] == hk && xid[k] > hid))) {
                    hk = kx[k];
                    hid = xid[k];
                }
            cand[0] = chunk_best_above(z, lo, hi, m, it, iden, hk, hid, k0, k1, ured);
#if GRID_CDF
            first_round = false;
#endif
#pragma unroll
            for (int k = 1; k < NC; ++k) cand[k] = 0ull;
        }
    }
#undef DRAWN
#if RESET_STATE
    if (c == 0) {
        if (tid == 0) tokens[r] = token;
        reset_record(r, token, rowf[3], ring, n_ring, ring_pos, s_sum, s_n, g_sum, g_n, y1, nl,
                     dnl, ring_o, n_ring_o, ring_pos_o, s_sum_o, s_n_o, g_sum_o, g_n_o, y1_o,
                     y2_o);
    }
#endif
    // the last CTA of the row to leave clears its counters for the next launch (every CTA has
    // passed its last barrier before it counts itself out)
    __syncthreads();
    if (tid == 0 && atomicAdd(g_gexit + r, 1u) == (u32)(GRID - 1)) {
        g_gbar[r] = 0u;
        g_gexit[r] = 0u;
#if TOP_K > 0
        g_gln[r] = 0u;
#endif
        __threadfence();
    }
}
#endif  // GRIDSYNC
#endif  // CLUSTER > 0 || GRIDSYNC
