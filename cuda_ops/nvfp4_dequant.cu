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

// E2M1 code (4 bits: sign, 2 exponent, 1 mantissa) -> float32 bits, exact
__device__ __forceinline__ u32 e2m1_bits(u32 c) {
  const u32 mag = c & 7u;
  const u32 bits = mag < 2u ? (mag ? 0x3F000000u : 0u)  // 0, 0.5
                            : (((126u + (mag >> 1)) << 23) | ((mag & 1u) << 22));  // 1 .. 6
  return bits | ((c & 8u) << 28);
}

extern "C" __global__ void __launch_bounds__(NT)
    nvfp4_dequant_bf16(const u8* __restrict__ wp, const u8* __restrict__ ws,
                       const int* __restrict__ layer, u16* __restrict__ out) {
  const long long groups = (long long)N_OUT * (K_IN / 8);
  const long long lo = (long long)(*layer);
  const u32* codes = (const u32*)(wp + lo * ((long long)N_OUT * (K_IN / 2)));
  const u8* scales = ws + lo * ((long long)N_OUT * (K_IN / 16));
  const long long base = (long long)blockIdx.x * (GROUPS * NT) + threadIdx.x;
#pragma unroll
  for (int j = 0; j < GROUPS; ++j) {
    const long long g = base + (long long)j * NT;
    if (g < groups) {
      const u32 c = codes[g];
      const float s = e4m3x2_to_float2((u32)scales[g >> 1]).x;
      u32 h[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float a = __uint_as_float(e2m1_bits((c >> (8 * e)) & 15u)) * s;
        const float b = __uint_as_float(e2m1_bits((c >> (8 * e + 4)) & 15u)) * s;
        // exact in bf16: the upper halves of the float32 bits
        h[e] = (__float_as_uint(a) >> 16) | (__float_as_uint(b) & 0xFFFF0000u);
      }
      ((uint4*)out)[g] = make_uint4(h[0], h[1], h[2], h[3]);
    }
  }
}
