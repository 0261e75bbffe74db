// EXPERIMENT helpers shared by the TMA-streamed kernels beside this file (nvfp4_gemv_tma.cu,
// nvfp4_block_tma.cu): mbarriers, bulk and 16-byte asynchronous copies into shared memory,
// bf16 rounding. The including file defines u16, u32 and u64 first; the host builds pass this
// directory to NVRTC (cuda_ops.build.compile_ptx's header_dirs).

#pragma once

// ---------------------------------------------------------------------------- mbarrier / TMA

__device__ __forceinline__ u32 smem_addr(const void* p) {
  return (u32)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("{ .reg .b64 st; mbarrier.arrive.shared::cta.b64 st, [%0]; }" ::"r"(bar)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
  asm volatile("{ .reg .b64 st; mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1; }" ::"r"(
                   bar),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ bool mbar_try_wait(u32 bar, u32 parity) {
  u32 ok;
  asm volatile(
      "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
      "selp.u32 %0, 1, 0, p; }"
      : "=r"(ok)
      : "r"(bar), "r"(parity)
      : "memory");
  return ok != 0;
}

// A stage that never completes (a wrong transaction count, a copy that faults) traps after
// WAIT_TRIES polls instead of hanging the device check.
#ifndef WAIT_TRIES
#define WAIT_TRIES (1u << 26)
#endif
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  for (u32 n = 0; !mbar_try_wait(bar, parity); ++n) {
    if (n == WAIT_TRIES) __trap();
  }
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
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
#endif
}

// PRODUCER = 1: 16 bytes global -> shared through L2 only, and an arrive on `bar` (without a
// pending-count increment) once all of this thread's earlier cp.async copies have landed
__device__ __forceinline__ void cp_async16(u32 dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}

__device__ __forceinline__ void cp_async_arrive(u32 bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
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
