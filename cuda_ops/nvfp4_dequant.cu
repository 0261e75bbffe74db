// NVFP4 weight -> bfloat16 values e2m1(code) * SFw, exact: the weight operand of the W4A4 dot
// path (prefill, above GemmOptions.max_m rows), which then runs one bf16 tensor-core dot and
// applies the global scales after it (rejax.nvfp4's order "dot"). Host side: nvfp4_dequant.py.
//
// Operands: wp uint8 [L, N, K/2] codes (low nibble = even element), ws uint8 [L, N, K/16] E4M3
// block scales, layer int32 [] (which of the L stacked weights; L = 1 unstacked); result out
// bf16 [N, K]. The product of a 2-significant-bit E2M1 value and a 4-significant-bit E4M3
// scale has at most 6 significant bits, so it is exact in float32 and in bf16: the kernel's
// bytes equal rejax.nvfp4._scaled_values(w).astype(bfloat16) (tests/test_dequant_gpu.py).
//
// Shape constants (-D, from nvfp4_dequant.py): N_OUT, K_IN (a multiple of 16), GROUPS (8-element
// groups a thread, CTA-strided so every load and store instruction of a warp is contiguous).
// Each 8-element group is 4 code bytes and half of one 16-element block: thread t of a CTA
// handles groups base + j * NT + t (j < GROUPS): a u32 load of codes, one scale byte, one
// 16-byte store of 8 bf16.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;

#include "common.cuh"

#ifndef GROUPS
#define GROUPS 4
#endif
#define NT 256

// One code byte (low nibble = the even element) -> f16x2 of e2m1 * 2^-14, exact: the nibble's
// exponent and mantissa bits (e1 e0 m) become the fp16 exponent field's low bits and the top
// mantissa bit, so e = 0 is the fp16 subnormal 0.m x 2^-14 and e > 0 is 1.m x 2^(e - 15).
__device__ __forceinline__ u32 e2m1x2_f16x2(u32 b) {
  return ((b & 0x7u) << 9) | ((b & 0x8u) << 12) | ((b & 0x70u) << 21) | ((b & 0x80u) << 24);
}

extern "C" __global__ void __launch_bounds__(NT)
    nvfp4_dequant_bf16(const u8* __restrict__ wp, const u8* __restrict__ ws,
                       const int* __restrict__ layer, u16* __restrict__ out) {
  const long long groups = (long long)N_OUT * (K_IN / 8);
  const long long lo = (long long)(*layer);
  const u32* codes = (const u32*)(wp + lo * ((long long)N_OUT * (K_IN / 2)));
  const u8* scales = ws + lo * ((long long)N_OUT * (K_IN / 16));
  const long long base = (long long)blockIdx.x * (GROUPS * NT) + threadIdx.x;
  // all loads first (independent, in flight together), then the decode and the stores
  u32 c[GROUPS], sb[GROUPS];
#pragma unroll
  for (int j = 0; j < GROUPS; ++j) {
    const long long g = base + (long long)j * NT;
    c[j] = g < groups ? codes[g] : 0u;
    sb[j] = g < groups ? (u32)scales[g >> 1] : 0u;
  }
#pragma unroll
  for (int j = 0; j < GROUPS; ++j) {
    const long long g = base + (long long)j * NT;
    // SF * 2^14, exact in float32 (SF <= 448); times e2m1 * 2^-14 it is e2m1 * SF, exact
    const float s = e4m3x2_to_float2(sb[j]).x * 16384.0f;
    u32 h[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const u32 pair = e2m1x2_f16x2((c[j] >> (8 * e)) & 0xFFu);
      float a, b;
      asm("{ .reg .b16 l, u; mov.b32 {l, u}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, u; }"
          : "=f"(a), "=f"(b)
          : "r"(pair));
      // the products are exact in bf16 (at most 6 significant bits): their upper halves
      h[e] = __byte_perm(__float_as_uint(a * s), __float_as_uint(b * s), 0x7632);
    }
    if (g < groups) ((uint4*)out)[g] = make_uint4(h[0], h[1], h[2], h[3]);
  }
}
