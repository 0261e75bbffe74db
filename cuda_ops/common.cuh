// Device helpers shared by the kernels in this directory (included with #include "common.cuh";
// cuda_ops/build.py hashes it into every includer's cache key). Today: E4M3 decode and the
// NVFP4 activation block, the operations of rejax.nvfp4.quantize_activation for one 16-element
// block, for the kernels that write a W4A4 linear's input (the quantizer, the fused GEMV and the
// SwiGLU epilogue in nvfp4_gemv.cu, the decode attention's quantized output in
// decode_attention.cu); and E2M1 codes to int8 with the exact W4A4 block dots of the GEMV
// (nvfp4_gemv.cu, experiments/kernels/nvfp4_gemv_tma.cu).
//
// Per block with global scale g (and ig = div_rn(1, g)):
//   SF = E4M3_satfinite(min(div_rn(div_rn(amax, 6), g), 448));
//   os = div_rn(ig, float(SF)), or 0 when SF == 0;
//   code = E2M1_rn_sat(v * os), the sign bit from v's sign bit (-0.0 -> code 8).
// CUDA's __fdiv_rn is the correctly rounded division the reference emulates; div_rn adds its
// flush of operands and results below 2^-126 to 0 (nvfp4._div_rn).
//
// The including file defines u16 and u32 first.

#pragma once

// two E4M3 bytes (low, high) -> two floats, exact (E4M3 fits in fp16)
__device__ __forceinline__ float2 e4m3x2_to_float2(u32 v) {
  u32 h;
  asm("{ .reg .b16 t; cvt.u16.u32 t, %1; cvt.rn.f16x2.e4m3x2 %0, t; }" : "=r"(h) : "r"(v));
  float lo, hi;
  asm("{ .reg .b16 l, u; mov.b32 {l, u}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, u; }"
      : "=f"(lo), "=f"(hi)
      : "r"(h));
  return make_float2(lo, hi);
}

// a / b correctly rounded, operands and results below 2^-126 flushed to 0 (nvfp4._div_rn)
__device__ __forceinline__ float div_rn(float a, float b) {
  constexpr float F32_MIN = 1.17549435e-38f;
  if (a < F32_MIN) return 0.f;
  const float q = __fdiv_rn(a, b);
  return q < F32_MIN ? 0.f : q;
}

// E2M1 magnitude code of a = |v| in [0, 6] (RNE: ties 0.25, 1.25, 2.5, 5 round down, 0.75,
// 1.75, 3.5 up; nvfp4._e2m1_magnitude's thresholds). One add rounds a onto the E2M1 grid: the
// grid's spacing is 0.5 below 2, 1 below 4 and 2 above, the ulp of 2^22, 2^23 and 2^24, so
// a + 2^E (round to nearest even) is 2^E + u spacings, and u's parity is the code's (the grid's
// ties go to the even code). The sum's bits are then 2^E's plus u, and the code is u plus the
// codes below the range (0, 2, 4): one subtraction. Equal to the thresholds for every float in
// [0, 6] (tests/test_quant_xhat.py checks all of them).
__device__ __forceinline__ u32 e2m1_mag(float a) {
  const bool lo = a < 2.0f, mid = a < 4.0f;
  const float magic = lo ? 4194304.0f : mid ? 8388608.0f : 16777216.0f;  // 2^22, 2^23, 2^24
  const u32 base = lo ? 0x4A800000u : mid ? 0x4B000000u - 2u : 0x4B800000u - 4u;
  return __float_as_uint(__fadd_rn(a, magic)) - base;
}

// The codes of N elements v of one block whose amax (over all 16) is `amax`, with global scale
// *g and *ig = div_rn(1, *g): element j in nibble j of the result; `scale` gets the block's E4M3
// byte. (g and ig are pointers, each read where its division needs it: the quantizers keep them
// in shared memory.)
template <int N>
__device__ __forceinline__ u32 block_codes(const float (&v)[N], float amax, const float* g,
                                           const float* ig, u32& scale) {
  const float sf = fminf(div_rn(div_rn(amax, 6.0f), *g), 448.0f);  // >= 0: no lower clamp
  u16 s16;  // E4M3 RNE in the low byte
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(s16) : "f"(0.0f), "f"(sf));
  scale = s16 & 0xFFu;
  const float sd = e4m3x2_to_float2(scale).x;
  const float os = sd > 0.f ? div_rn(*ig, sd) : 0.f;
  u32 c = 0;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const float t = v[j] * os;  // |t| saturates at 6; the sign bit is t's
    c |= (e2m1_mag(fminf(fabsf(t), 6.0f)) | (__float_as_uint(t) >> 31 << 3)) << (4 * j);
  }
  return c;
}

// ---------------------------------------------------------------------------- E2M1 -> int8

__device__ __forceinline__ u32 prmt(u32 lo, u32 hi, u32 sel) {
  u32 d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(lo), "r"(hi), "r"(sel));
  return d;
}

// int8 tables indexed by the low 3 bits of a selector nibble; prmt's sign mode (nibble bit 3,
// the E2M1 sign) replaces the byte with its msb replicated, i.e. 0x00 for these positive bytes.
// Magnitudes of 2 * E2M1 value: codes 0..7 -> 0 1 2 3 4 6 8 12.
#define TM_LO 0x03020100u
#define TM_HI 0x0C080604u
// Weight tables: positive codes look up TP = magnitude + 1 (0 stays 0) in `pos`, and TN (the
// negated magnitudes) in sign mode, which yields 0xFF = -1 for c >= 1; negative codes look up
// TN normally and TP in sign mode (0). So pos + neg == signed 2 * value per byte, and each of
// the two dp4a's takes one of them: dp4a(pos, x) + dp4a(neg, x) == sum(w * x) exactly.
#define TP_LO 0x04030200u
#define TP_HI 0x0D090705u
#define TN_LO 0xFDFEFF00u
#define TN_HI 0xF4F8FAFCu

// 4 codes (low 16 bits of v, nibble i = element i) -> 4 signed int8 2 * E2M1 values.
__device__ __forceinline__ u32 act_to_s8(u32 v) {
  const u32 pos = prmt(TM_LO, TM_HI, v);
  const u32 neg = prmt(TM_LO, TM_HI, v ^ 0x8888u);
  // bytewise pos - neg without borrows (both < 0x80), then back to two's complement
  return ((pos | 0x80808080u) - neg) ^ 0x80808080u;
}

// ---------------------------------------------------------------------------- W4A4 block dots

// 32 weight codes (one row, two blocks) -> 8 (pos, neg) int8 words in element order
__device__ __forceinline__ void decode_row(u32 (&wpos)[8], u32 (&wneg)[8], uint4 q) {
  const u32 words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const u32 vx = words[i] ^ 0x88888888u;
    wpos[2 * i] = prmt(TP_LO, TP_HI, words[i]);
    wneg[2 * i] = prmt(TN_LO, TN_HI, vx);
    wpos[2 * i + 1] = prmt(TP_LO, TP_HI, words[i] >> 16);
    wneg[2 * i + 1] = prmt(TN_LO, TN_HI, vx >> 16);
  }
}

// acc += sum over the two blocks of (exact int8 block dot) * SFw * SFx
__device__ __forceinline__ void row_dot(float& acc, const u32 (&wpos)[8], const u32 (&wneg)[8],
                                        const u32 (&xw)[8], float2 sw, float2 sxf) {
#pragma unroll
  for (int b = 0; b < 2; ++b) {
    // 0x4B400000 = 1.5 * 2^23: the int sum lands in the fp32 mantissa and is read back exactly
    int d = 0x4B400000;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      d = __dp4a((int)wpos[4 * b + j], (int)xw[4 * b + j], d);
      d = __dp4a((int)wneg[4 * b + j], (int)xw[4 * b + j], d);
    }
    const float dot = __int_as_float(d) - 12582912.0f;
    acc = fmaf(dot, (b ? sw.y : sw.x) * (b ? sxf.y : sxf.x), acc);
  }
}
