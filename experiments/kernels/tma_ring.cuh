// EXPERIMENT helpers shared by the TMA-streamed kernels beside this file (nvfp4_gemv_tma.cu,
// nvfp4_block_tma.cu): mbarriers, bulk and 16-byte asynchronous copies into shared memory,
// bf16 rounding, and the consumers' work on a ring stage (a row's block dots, gate_up's SwiGLU
// epilogue). The including file defines u8, u16, u32 and u64 and the stage geometry (KCH,
// UNITS, UPL: code bytes of a row a stage, its 16-byte units, units a lane) first, and includes
// common.cuh; the host builds pass this directory to NVRTC (cuda_ops.build.compile_ptx's
// header_dirs).

#pragma once

// ---------------------------------------------------------------------------- mbarrier / TMA

#include "mbarrier.cuh"  // cuda_ops/: mbar_init / arrive / wait, bulk_copy

__device__ __forceinline__ u32 smem_addr(const void* p) {
  return (u32)__cvta_generic_to_shared(p);
}

// The ring's STAGES "full" barriers (one arrival each: the producer's expect_tx, or with the
// cp.async producer its 32 lanes' arrivals) and "empty" ones (one arrival per consumer warp),
// initialised by thread 0 before a __syncthreads of the whole CTA
__device__ __forceinline__ void ring_init(u32 full0, u32 empty0, u32 full_arrivals,
                                          u32 consumer_warps) {
  for (int s = 0; s < STAGES; ++s) {
    mbar_init(full0 + 8 * s, full_arrivals);
    mbar_init(empty0 + 8 * s, consumer_warps);
  }
  mbar_init_fence();
}

// `bytes` (a multiple of 16, both addresses 16-byte aligned) from global to shared memory; the
// transfer's bytes count against `bar`'s expected transaction count
__device__ __forceinline__ void bulk_g2s(u32 dst, const void* src, u32 bytes, u32 bar, u64 pol) {
#if EF
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint "
      "[%0], [%1], %2, [%3], %4;" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar), "l"(pol)
      : "memory");
#else
  (void)pol;
  bulk_copy(dst, src, bytes, bar);
#endif
}

// PRODUCER = 1: 16 bytes global -> shared through L2 only (then mbarrier.cuh's cp_async_arrive)
__device__ __forceinline__ void cp_async16(u32 dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}

// ---------------------------------------------------------------------------- bf16

__device__ __forceinline__ u16 f32_to_bf16(float f) {
  u16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return r;
}

__device__ __forceinline__ float rbf16(float f) {
  return __uint_as_float((u32)f32_to_bf16(f) << 16);
}

// ---------------------------------------------------------------------------- consumers

// acc += the exact block dots of one row's chunk c in a stage (its KCH code bytes `codes` and
// KCH / 8 scale bytes `scales`) with x (int8 sx, E4M3 scales sxs): lane l takes the 16-byte
// units l, l + 32, ... (production's decode_row and row_dot, common.cuh)
__device__ __forceinline__ void stage_row_dot(float& acc, const u8* codes, const u8* scales,
                                              const u8* sx, const u8* sxs, int c, int lane) {
#pragma unroll
  for (int t = 0; t < UPL; ++t) {
    const int unit = lane + 32 * t;
    if (UNITS % 32 != 0 && unit >= UNITS) break;
    const uint4 q = *(const uint4*)(codes + 16 * unit);
    const int elem = 2 * KCH * c + 32 * unit;
    const uint4 xa = *(const uint4*)(sx + elem), xb = *(const uint4*)(sx + elem + 16);
    const u32 xw[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
    const float2 sw = e4m3x2_to_float2(*(const u16*)(scales + 2 * unit));
    const float2 sxf = e4m3x2_to_float2(*(const u16*)(sxs + elem / 16));
    u32 wpos[8], wneg[8];
    decode_row(wpos, wneg, q);
    row_dot(acc, wpos, wneg, xw, sw, sxf);
  }
}

// gate_up's SwiGLU epilogue for one unit (production's swiglu_epilogue arithmetic): 16 warps
// (`nthreads` threads, named barrier 2), warp w holding the sums of gate row 16u + w (`gate`)
// and up row F + 16u + w (`up`) and their output scales; the 16 values h = silu(g) * up meet in
// hbuf[parity] (parity: the unit's, so the next unit writes the other half, and the one after
// this half only past the next unit's barrier, which warp 0 reaches after its reads), and 4
// lanes of warp 0 quantize the block with down_proj's static scale *gd (*igd = 1 / *gd) into
// its codes dp and E4M3 scales ds.
template <int nthreads>
__device__ __forceinline__ void swiglu_unit(float gate, float up, float scale_g, float scale_u,
                                            int unit, int parity, int warp, int lane,
                                            float (&hbuf)[2][16], const float* gd,
                                            const float* igd, u8* dp, u8* ds) {
  const float g = rbf16((gate * 0.25f) * scale_g);
  const float u = rbf16((up * 0.25f) * scale_u);
  const float sig = rbf16(1.0f / (1.0f + expf(-g)));  // jax.nn.sigmoid
  if (lane == 0) hbuf[parity][warp] = rbf16(rbf16(g * sig) * u);
  asm volatile("bar.sync 2, %0;" ::"n"(nthreads) : "memory");
  if (warp == 0 && lane < 4) {  // 4 lanes x 4 elements, as production's epilogue
    float v[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) v[e] = hbuf[parity][4 * lane + e];
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
    amax = fmaxf(amax, __shfl_xor_sync(0xFu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xFu, amax, 2));
    u32 scale;
    const u32 code = block_codes(v, amax, gd, igd, scale);
    const int j0 = unit * 16 + 4 * lane;  // element of down_proj's input
    *reinterpret_cast<u16*>(dp + j0 / 2) = (u16)code;
    if (lane == 0) ds[j0 / 16] = (u8)scale;
  }
}
