// The fused GPU sampler: temperature (or ReSET's entropy policy) + exact top-p + a Gumbel-max draw.
//
// Three kernels over B rows of V float32 logits, each a grid of CHUNKS x B blocks (one chunk of a
// row per block) whose last block to finish a row (an atomic ticket, no grid sync) combines it:
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
// Compile-time constants (-D): B_ROWS, V_SIZE, CHUNKS, CH (chunk length), NTHREADS, NMAX, TOP_K.

typedef unsigned int u32;
typedef unsigned long long u64;

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
// Inclusive prefix sum over threads in thread order; *total gets the block's sum.
__device__ u32 block_scan(u32 x, u32* red, u32* total) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    for (int o = 1; o < 32; o <<= 1) {
        const u32 y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    __syncthreads();
    if (lane == 31) red[w] = x;
    __syncthreads();
    if (w == 0) {
        u32 s = lane < NWARPS ? red[lane] : 0u;
        for (int o = 1; o < 32; o <<= 1) {
            const u32 y = __shfl_up_sync(0xffffffffu, s, o);
            if (lane >= o) s += y;
        }
        if (lane < NWARPS) red[lane] = s;
    }
    __syncthreads();
    const u32 out = x + (w > 0 ? red[w - 1] : 0u);
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

__device__ u32 g_stats_done[B_ROWS];
__device__ float g_stats_part[B_ROWS * CHUNKS * 5];
__device__ int g_stats_arg[B_ROWS * CHUNKS * 2];

extern "C" __global__ void __launch_bounds__(NTHREADS)
rejax_sample_stats(const float* __restrict__ logits, const float* __restrict__ thr,
                   const float* __restrict__ alt, const float* __restrict__ t_a,
                   const float* __restrict__ t_b, float* __restrict__ stats,
                   int* __restrict__ arg) {
    __shared__ float red[NWARPS];
    __shared__ int ired[NWARPS];
    __shared__ int is_last;
    const int r = blockIdx.y, c = blockIdx.x, tid = threadIdx.x;
    const float* z = logits + (size_t)r * V_SIZE;
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
    if (mc > -INFINITY) {
        for (int j = lo + tid; j < hi; j += NTHREADS) {
            const float d = z[j] - mc;
            const float e = expf(d);
            s += e;
            if (e > 0.0f) u += e * d;
            sa += expf(d * ia);
            sb += expf(d * ib);
        }
    }
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

// ----------------------------------------------------------------------------- 2: histogram

// ----------------------------------------------------------------------------- 2: histogram

__device__ u32 g_hist_done[B_ROWS];
__device__ u32 g_hist_mass[B_ROWS * NB];
__device__ u32 g_hist_cnt[B_ROWS * NB];
__device__ u64 g_hist_best[B_ROWS * NB];

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

extern "C" __global__ void __launch_bounds__(NTHREADS)
rejax_sample_hist(const float* __restrict__ logits, const float* __restrict__ stats,
                  const int* __restrict__ arg, const float* __restrict__ top_p,
                  const u32* __restrict__ keys, int* __restrict__ plan) {
    __shared__ u32 hm[NB], hc[NB];
    __shared__ u64 hb[NB];
    __shared__ u32 red[NWARPS];
    __shared__ int ired[NWARPS];
    __shared__ u64 ured[NWARPS];
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
    const float* z = logits + (size_t)r * V_SIZE;
    const int lo = c * CH, hi = min(lo + CH, V_SIZE);
    // four consecutive tokens per thread: one Philox call gives the noise of all four
    for (int j0 = lo + 4 * tid; j0 < hi; j0 += 4 * NTHREADS) {
        float x[4];
#if V_SIZE % 4 == 0
        const float4 v4 = *reinterpret_cast<const float4*>(z + j0);  // CH % 4 == 0: aligned
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
            if (zt[q] >= floor_score)
                atomicMax(&hb[b], pack(zt[q] + gumbel_of(word(w, q), word(wl, q)), j0 + q));
        }
#endif
    }
    __syncthreads();
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
#if TOP_K > 0
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

// ----------------------------------------------------------------------------- 3: resolve

__device__ u32 g_res_done[B_ROWS];
__device__ u32 g_res_n[B_ROWS];
__device__ u64 g_res_list[B_ROWS * NMAX];

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
                           const float* z, float m, float it, u32 k0, u32 k1, float floor_score,
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

// The kept tokens among those with tempered logit >= zmin whose probability bits lie in
// [lo, lo + 2**bits), ranked below `above` mass, by the last block alone: histograms of up to 11
// bits a level over V until one bit pattern remains, then that tie group cut by id (contiguous
// id ranges per thread, the higher ids ranking above). Returns the best packed score among them.
__device__ u64 resolve_range(const float* z, float m, float it, float iden, float zmin, u32 k0,
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
__device__ int topk_draw(u64* list, int n, float tp, const float* z, float m, float it, u32 k0,
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

extern "C" __global__ void __launch_bounds__(NTHREADS)
rejax_sample_resolve(const float* __restrict__ logits, const float* __restrict__ stats,
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
    const float* z = logits + (size_t)r * V_SIZE;
    const u32 klo = bin_lo(b);
    if (nb <= (u32)NMAX) {  // collect: top-p, the tokens of bin b; top-k, of the bins >= b
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
    const int token = topk_draw(list, (int)nb, top_p[r], z, m, it, k0, k1, floor_score, hm, hc,
                                red, ired, ured, fred);
#else
    const u32 above_b = (u32)pl[3];
    const float limit = __int_as_float(pl[5]);
    u64 best = ((u64)(u32)pl[7] << 32) | (u64)(u32)pl[6];
    u64 inb;
    if (nb <= (u32)NMAX) {
        const int n2 = pow2_at_least((int)nb);
        for (int i = (int)nb + tid; i < n2; i += NTHREADS) list[i] = 0ull;
        __syncthreads();
        sort_desc(list, n2);  // rank order: probability, then id
        inb = draw_sorted(list, (int)nb, above_b, limit, false, z, m, it, k0, k1, floor_score, red,
                          ured);
    } else {
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
