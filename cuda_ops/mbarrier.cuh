// Shared-memory mbarriers and bulk (non-tensor TMA) copies, for kernels that stream a ring of
// stages with one producer thread: the producer arms a stage's "full" barrier with the bytes
// it expects (arrive.expect_tx), issues cp.async.bulk copies that count those bytes down, and
// the consumers wait on the barrier's phase parity; the consumers' arrivals on an "empty"
// barrier hand the slot back; cp.async copies join a phase through cp.async.mbarrier.arrive.
// Used by nvfp4_gemm_wgmma.cu (BULK) and the TMA experiments.
//
// The including file defines u32 and u64 first.

#pragma once

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

// makes the initialised barriers visible to the async proxy (the bulk copies' complete_tx);
// the CTA still needs a barrier before another thread uses them
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("{ .reg .b64 st; mbarrier.arrive.shared::cta.b64 st, [%0]; }" ::"r"(bar)
               : "memory");
}

// one arrival that also raises the phase's expected transaction count by `bytes`
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

// A phase that never completes (a wrong transaction count, a copy that faults) traps after
// WAIT_TRIES polls instead of hanging the device.
#ifndef WAIT_TRIES
#define WAIT_TRIES (1u << 26)
#endif
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  for (u32 n = 0; !mbar_try_wait(bar, parity); ++n) {
    if (n == WAIT_TRIES) __trap();
  }
}

// `bytes` (a multiple of 16; both addresses 16-byte aligned) global -> shared memory of this
// CTA; the bytes count down `bar`'s expected transaction count as they land
__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}

// ---------------------------------------------------------------------------- warp-uniform forms
// For code between a warpgroup's wgmma.mma_async and its wait: ptxas serializes the wgmmas
// (C7518) when a divergent branch lies there, so these keep the control flow warp-uniform. The
// wait loop exits on a warp vote (every lane sees the phase complete), and the one-thread
// operations are predicated instructions, not branches.

__device__ __forceinline__ void mbar_wait_warp(u32 bar, u32 parity) {
  for (u32 n = 0; !__all_sync(0xffffffffu, mbar_try_wait(bar, parity)); ++n) {
    if (n == WAIT_TRIES) __trap();
  }
}

__device__ __forceinline__ void mbar_arrive_if(bool p, u32 bar) {
  asm volatile(
      "{ .reg .pred p; .reg .b64 st; setp.ne.u32 p, %1, 0; "
      "@p mbarrier.arrive.shared::cta.b64 st, [%0]; }" ::"r"(bar),
      "r"((u32)p)
      : "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx_if(bool p, u32 bar, u32 bytes) {
  asm volatile(
      "{ .reg .pred p; .reg .b64 st; setp.ne.u32 p, %2, 0; "
      "@p mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1; }" ::"r"(bar),
      "r"(bytes), "r"((u32)p)
      : "memory");
}

__device__ __forceinline__ void bulk_copy_if(bool p, u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile(
      "{ .reg .pred p; setp.ne.u32 p, %4, 0; "
      "@p cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3]; }" ::
          "r"(dst),
      "l"(src), "r"(bytes), "r"(bar), "r"((u32)p)
      : "memory");
}

// one arrival on `bar` once all of this thread's earlier cp.async copies have landed (.noinc:
// the barrier's expected count must include it)
__device__ __forceinline__ void cp_async_arrive(u32 bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
