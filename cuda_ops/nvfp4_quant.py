"""Host side of the stand-alone activation quantizer `nvfp4_quantize_bf16` (in `nvfp4_gemv.cu`,
compiled with QUANT_ONLY): build and launch configuration.

The kernel runs the fused GEMV's prologue and quantizer once per row of x, each row split into
`chunk`-element pieces over the grid (grid [M, K / chunk]; every CTA recomputes the row's
statistics from L2 and quantizes its piece), and writes what the W4A4 GEMV or GEMM reads
(codes [M, K/2], E4M3 scales [M, K/16], global scale [M]). Its device code is the fused
kernel's (`Fused` in cuda_ops/nvfp4_gemv.py describes the prologue), so the codes and scales
are `rejax.nvfp4.quantize_activation`'s: bitwise for prologue "none"; "rmsnorm" sums the mean
square in its own order and "swiglu" uses CUDA's expf, so a few bf16 inputs of the quantizer
may round the other way (tests/test_quant_kernel_gpu.py).

Measured on the H200 (Qwen3-8B NVFP4; experiments/results/h200_c/ and h200_d/): with one CTA
per row (chunk = K, 256 threads) the kernel took 6.9 us per call in a profile of the 8-layer
decode step, a row's whole quantization serialised on one SM, and linear_fusion "split" was
slower than "unfused" (36 layers, batch 1: 3.580 vs 3.158 ms/token). Spread over the grid
(by default 512 elements per 128-thread CTA where K % 512 == 0, else 256: one quant4 round per
thread) it takes 2.3 us, and "split" became the faster path (2.796 vs 3.018 ms/token).
"""

from __future__ import annotations

import dataclasses
import functools

from cuda_ops.build import (
    KernelError,
    compile_ptx,
    device_arch,
    escape_mlir,
    ptx_backend_config,
    ptx_entries,
    read_source,
)
from cuda_ops.nvfp4_gemv import K_MULTIPLE, MAX_M, SOURCE, Fused

__all__ = ["ENTRY", "N_INPUTS", "QuantKernel", "build", "check_shape", "default_chunk"]

ENTRY = "nvfp4_quantize_bf16"
# operands (x, xg, norm weight, layer) then outputs (codes, scales, global scale per row)
N_INPUTS = 4
N_OUTPUTS = 3
THREADS = 128
# the GEMV part of the source is not compiled (QUANT_ONLY), but its constants must be valid
_GEMV_DUMMIES = {
    "ACT_W4A4": 1, "M_TOK": 1, "N_OUT": 1, "R_ROWS": 1, "SPP": 1, "GRID": 1, "GEMV_STREAM": 0,
    "KSPLIT": 1, "RING_D": 0, "GW_ROWS": 0,
}  # fmt: skip


def check_shape(m: int, k: int) -> tuple[bool, str]:
    """(True, "") if the quantizer kernel takes [m, k] activations, else (False, why)."""
    if not 1 <= m <= MAX_M:
        return False, f"M={m} rows (the quantizer kernel serves the GEMV's 1..{MAX_M})"
    if k < K_MULTIPLE or k % K_MULTIPLE:
        return False, f"K={k} (expected a positive multiple of {K_MULTIPLE})"
    return True, ""


def default_chunk(k: int) -> int:
    """Elements of a row one CTA quantizes: 512 where K allows, else 256 (K % 256 == 0)."""
    return 512 if k % 512 == 0 else 256


@dataclasses.dataclass(frozen=True, eq=False)
class QuantKernel:
    """A compiled quantizer specialisation: M rows of K inputs, `chunk` elements per CTA."""

    m: int
    k: int
    fused: Fused
    ptx: str
    chunk: int
    threads: int

    def backend_config(self) -> str:
        """MLIR dictionary text for XLA's `__gpu$xla.gpu.ptx` custom kernel call."""
        return ptx_backend_config(
            ENTRY,
            escape_mlir(self.ptx),
            grid=(self.m, self.k // self.chunk, 1),
            block=self.threads,
            outputs=range(N_INPUTS, N_INPUTS + N_OUTPUTS),
        )


@functools.cache
def _build_cached(m, k, fused, arch, chunk, threads) -> QuantKernel:
    if fused.residual:
        raise KernelError("the quantizer has no residual epilogue (Fused.residual=True)")
    sizes = {"K_IN": k, "NTHREADS": threads, "QUANT_ONLY": 1, "QCHUNK": chunk}
    defines = _GEMV_DUMMIES | fused.defines() | sizes
    ptx = compile_ptx(read_source(SOURCE), name=SOURCE, defines=defines, arch=arch)
    entries = ptx_entries(ptx)
    if entries.get(ENTRY) != N_INPUTS + N_OUTPUTS:
        raise KernelError(f"PTX entry {ENTRY} missing or with wrong parameters: {entries}")
    return QuantKernel(m=m, k=k, fused=fused, ptx=ptx, chunk=chunk, threads=threads)


def build(
    m: int,
    k: int,
    fused: Fused,
    *,
    arch: str | None = None,
    chunk: int | None = None,
    threads: int = THREADS,
) -> QuantKernel:
    """Compiles (NVRTC, disk-cached) the quantizer for M rows of K inputs after `fused.prologue`
    ("swiglu": x holds 2K columns), static (xg[0]) or per-row dynamic (`fused.dynamic`) global
    scale; each CTA takes `chunk` elements of a row (default `default_chunk(k)`; K means one CTA
    per row) with `threads` threads (a multiple of 32).

    Raises KernelError when NVRTC is missing or the shape or chunking is unsupported.
    """
    ok, why = check_shape(m, k)
    if not ok:
        raise KernelError(f"unsupported shape: {why}")
    if not isinstance(fused, Fused):
        raise KernelError(f"fused must be a Fused, got {type(fused).__name__}")
    chunk = default_chunk(k) if chunk is None else chunk
    if chunk <= 0 or chunk % 128 or k % chunk:
        raise KernelError(f"chunk={chunk}: expected a positive multiple of 128 dividing K={k}")
    if threads <= 0 or threads % 32 or threads > 1024:
        raise KernelError(f"threads={threads}: expected a multiple of 32 in [32, 1024]")
    return _build_cached(m, k, fused, arch or device_arch(), chunk, threads)
