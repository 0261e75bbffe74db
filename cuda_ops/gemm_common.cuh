// Device helpers shared by the two NVFP4 W4A4 GEMMs (nvfp4_gemm.cu, mma.sync; nvfp4_gemm_wgmma.cu,
// warpgroup MMA), which both include this file (cuda_ops/build.py hashes it into every
// includer's cache key): shared-memory addresses, cp.async copies, shared loads, the E4M3
// block-scale convert and the E2M1 weight decode into fp16 pairs (read nvfp4_gemm.cu's header for
// the numerics). Each GEMM keeps its own cp.async wait (the wgmma one orders memory for the async
// proxy) and its stage layout.
//
// The including file defines u8, u16, u32 first.

#pragma once

__device__ __forceinline__ u32 smem_u32(const void* p) {
  u32 r;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
  return r;
}

// 16-byte copy global -> shared, bypassing L1; `ok` false zero-fills the destination
__device__ __forceinline__ void cp16(u32 dst, const void* src, bool ok) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
               "r"(ok ? 16 : 0));
}

__device__ __forceinline__ void cp8(u32 dst, const void* src, bool ok) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(dst), "l"(src),
               "r"(ok ? 8 : 0));
}

__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }

__device__ __forceinline__ uint4 lds128(u32 addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr));
  return v;
}

__device__ __forceinline__ u32 lds16(u32 addr) {
  u16 v;
  asm volatile("ld.shared.u16 %0, [%1];" : "=h"(v) : "r"(addr));
  return v;
}

__device__ __forceinline__ u32 prmt(u32 lo, u32 hi, u32 sel) {
  u32 d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(lo), "r"(hi), "r"(sel));
  return d;
}

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

__device__ __forceinline__ u16 f32_to_bf16(float f) {
  u16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return r;
}

__device__ __forceinline__ u32 word(const uint4& v, int u) {
  return u == 0 ? v.x : u == 1 ? v.y : u == 2 ? v.z : v.w;
}

// 8 codes (nibble i = element i) -> 4 f16x2 P_i = (e_i, e_{i+4}) * 2^-14 * scale2, exact.
// Nibble (s, e1, e0, m) goes to fp16 bits 15 and 11..9: exponent e1e0, mantissa top bit m,
// which is the E2M1 value times 2^-14 (e = 0 lands on the fp16 subnormal m * 2^-15).
__device__ __forceinline__ void decode8(u32 v, u32 scale2, u32 (&p)[4]) {
  const u32 mag = 0x0E000E00u, sgn = 0x80008000u;
  p[0] = hmul2(((v << 9) & mag) | ((v << 12) & sgn), scale2);
  p[1] = hmul2(((v << 5) & mag) | ((v << 8) & sgn), scale2);
  p[2] = hmul2(((v << 1) & mag) | ((v << 4) & sgn), scale2);
  p[3] = hmul2(((v >> 3) & mag) | (v & sgn), scale2);
}

// One pipeline stage's weight bytes, each thread looping from its own index (a trip count that
// depends on the thread): the codes of rows n0 .. n0 + ROWS_ - 1 of the stage's TKT_ elements
// (TKT_ / 2 bytes a row, 16-byte chunks; chunk c of row r lands at chunk(r, c) of its row) at
// `sw`, then their E4M3 block scales (TKT_ / 16 bytes a row, 8-byte pieces) at `ss`. Rows at or
// past TN_ are zero-filled. TK_ is the weight's K, THREADS_ the CTA's threads.
template <int ROWS_, int THREADS_, int TN_, int TK_, int TKT_, typename Chunk>
__device__ __forceinline__ void load_weight_stage(u32 sw, u32 ss, int kt, const u8* wp,
                                                  const u8* ws, int n0, int tid, Chunk chunk) {
  constexpr int wpitch = TKT_ / 2, spitch = TKT_ / 16, wch = wpitch / 16;
#pragma unroll
  for (int i = tid; i < ROWS_ * wch; i += THREADS_) {
    const int r = i / wch, c = i % wch, n = n0 + r;
    const bool ok = n < TN_;
    const u8* src = wp + (size_t)(ok ? n : 0) * (TK_ / 2) + (size_t)kt * wpitch + c * 16;
    cp16(sw + r * wpitch + chunk(r, c) * 16, src, ok);
  }
#pragma unroll
  for (int i = tid; i < ROWS_ * (spitch / 8); i += THREADS_) {
    const int r = i / (spitch / 8), c = i % (spitch / 8), n = n0 + r;
    const bool ok = n < TN_;
    const u8* src = ws + (size_t)(ok ? n : 0) * (TK_ / 16) + (size_t)kt * spitch + c * 8;
    cp8(ss + r * spitch + c * 8, src, ok);
  }
}

// Copies with compile-time trip counts: every thread takes pieces tid + j * THREADS_ of COUNT
// (PER_ROW a row) for j < ceil(COUNT / THREADS_), so the loops unroll, rows and chunks are
// affine in j, and the bounds checks drop where the tiles divide the problem. A loop from each
// thread's index (`for (i = tid; i < COUNT; i += THREADS_)`, above) does not unroll, and ptxas
// spends about 19 instructions on each 16-byte copy (index, division, bounds, address, branch).
// f(row, chunk) issues one piece.
template <int COUNT, int PER_ROW, int THREADS_, typename F>
__device__ __forceinline__ void copy_pieces(int tid, F&& f) {
  constexpr int TRIPS = (COUNT + THREADS_ - 1) / THREADS_;
#pragma unroll
  for (int j = 0; j < TRIPS; ++j) {
    if (COUNT % THREADS_ != 0 && tid + j * THREADS_ >= COUNT) break;
    if constexpr (THREADS_ % PER_ROW == 0) {
      f(tid / PER_ROW + j * (THREADS_ / PER_ROW), tid % PER_ROW);
    } else {
      f((tid + j * THREADS_) / PER_ROW, (tid + j * THREADS_) % PER_ROW);
    }
  }
}

// `load_weight_stage`'s bytes to the same places with `copy_pieces` (no row check when the
// tiles divide TN_).
template <int ROWS_, int THREADS_, int TN_, int TK_, int TKT_, typename Chunk>
__device__ __forceinline__ void load_weight_stage_static(u32 sw, u32 ss, int kt, const u8* wp,
                                                         const u8* ws, int n0, int tid,
                                                         Chunk chunk) {
  constexpr bool n_full = TN_ % ROWS_ == 0;
  constexpr int wpitch = TKT_ / 2, spitch = TKT_ / 16, wch = wpitch / 16;
  copy_pieces<ROWS_ * wch, wch, THREADS_>(tid, [&](int r, int c) {
    const int n = n0 + r;
    const bool ok = n_full || n < TN_;
    const u8* src = wp + (size_t)(ok ? n : 0) * (TK_ / 2) + (size_t)kt * wpitch + c * 16;
    cp16(sw + r * wpitch + chunk(r, c) * 16, src, ok);
  });
  copy_pieces<ROWS_ * (spitch / 8), spitch / 8, THREADS_>(tid, [&](int r, int c) {
    const int n = n0 + r;
    const bool ok = n_full || n < TN_;
    const u8* src = ws + (size_t)(ok ? n : 0) * (TK_ / 16) + (size_t)kt * spitch + c * 8;
    cp8(ss + r * spitch + c * 8, src, ok);
  });
}
