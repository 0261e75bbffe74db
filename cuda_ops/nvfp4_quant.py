"""Host side of the stand-alone activation quantizer `nvfp4_quantize_bf16` (in `nvfp4_gemv.cu`,
compiled with QUANT_ONLY): build and launch configuration.

The kernel runs the fused GEMV's prologue and quantizer once per row of x, each row split into
`chunk`-element pieces over the grid (grid [M, K / chunk], any M >= 1; every CTA recomputes the
row's statistics from L2 and quantizes its piece). Its device code is the fused kernel's
(`Fused` in cuda_ops/nvfp4_gemv.py describes the prologue), so the codes and scales are
`rejax.nvfp4.quantize_activation`'s: bitwise for prologue "none"; "rmsnorm" sums the mean square
in its own order and "swiglu" uses CUDA's expf, so a few bf16 inputs of the quantizer may round
the other way (tests/test_quant_kernel_gpu.py). Two output forms (`OUTS`, a compile-time choice):

* "codes": what the W4A4 GEMV reads, codes uint8 [M, K/2], E4M3 scales uint8 [M, K/16] and the
  global scale float32 [M];
* "xhat" (-DXHAT_OUT=1): what the tensor-core GEMM reads, x_hat = e2m1(code) * SFx as float16
  [M, K] in the GEMM's permuted K order (exactly `rejax.ops.linear.gemm_x_operand` of those
  codes and scales: the values are exact in fp16) and the global scale float32 [M], so no XLA
  fusion builds the GEMM's operand. Each thread quantizes 8 elements per round and stores them
  as one 16-byte run of x_hat.

Measured on the H200 (Qwen3-8B NVFP4; experiments/results/h200_c/ and h200_d/): with one CTA
per row (chunk = K, 256 threads) the "codes" kernel took 6.9 us per call in a profile of the
8-layer decode step, a row's whole quantization serialised on one SM, and linear_fusion "split"
was slower than "unfused" (36 layers, batch 1: 3.580 vs 3.158 ms/token). Spread over the grid
(by default 512 elements per 128-thread CTA where K % 512 == 0, else 256: one quant4 round per
thread) it takes 2.3 us, and "split" became the faster path (2.796 vs 3.018 ms/token). The
"xhat" form takes by default 1024 elements per 128-thread CTA where K % 1024 == 0 (else 512 or
256 with 64 or 32 threads): one quant8 round per thread, as many elements per thread as the
16-byte stores need (not yet measured against other chunkings).
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
from cuda_ops.nvfp4_gemv import K_MULTIPLE, SOURCE, Fused

__all__ = [
    "ENTRY",
    "MAX_ROWS",
    "N_INPUTS",
    "OUTS",
    "QuantKernel",
    "build",
    "check_shape",
    "default_chunk",
    "default_threads",
]

ENTRY = "nvfp4_quantize_bf16"
# operands (x, xg, norm weight, layer) then the outputs: "codes" (codes, scales, global scale
# per row), "xhat" (x_hat, global scale per row)
N_INPUTS = 4
N_OUTPUTS = 3
OUTS = ("codes", "xhat")
XHAT_OUTPUTS = 2
THREADS = 128
# rows are grid x (one CTA row per activation row): CUDA's limit
MAX_ROWS = 2**31 - 1
# the GEMV part of the source is not compiled (QUANT_ONLY), but its constants must be valid
_GEMV_DUMMIES = {
    "ACT_W4A4": 1, "M_TOK": 1, "N_OUT": 1, "R_ROWS": 1, "SPP": 1, "GRID": 1, "GEMV_STREAM": 0,
    "KSPLIT": 1, "RING_D": 0, "GW_ROWS": 0,
}  # fmt: skip


def check_shape(m: int, k: int) -> tuple[bool, str]:
    """(True, "") if the quantizer kernel takes [m, k] activations (any M rows, one grid row of
    CTAs each; K a multiple of 256), else (False, why)."""
    if not 1 <= m <= MAX_ROWS:
        return False, f"M={m} rows (the quantizer kernel takes 1..{MAX_ROWS})"
    if k < K_MULTIPLE or k % K_MULTIPLE:
        return False, f"K={k} (expected a positive multiple of {K_MULTIPLE})"
    return True, ""


def default_chunk(k: int, out: str = "codes") -> int:
    """Elements of a row one CTA quantizes. "codes": 512 where K allows, else 256 (K % 256 ==
    0). "xhat": 1024, 512 or 256, the largest dividing K."""
    sizes = (1024, 512, 256) if out == "xhat" else (512, 256)
    return next(c for c in sizes if k % c == 0)


def default_threads(chunk: int, out: str = "codes") -> int:
    """Threads of a CTA: "codes" 128; "xhat" one per 8 elements of the chunk, at most 128."""
    return min(THREADS, chunk // 8) if out == "xhat" else THREADS


@dataclasses.dataclass(frozen=True, eq=False)
class QuantKernel:
    """A compiled quantizer specialisation: M rows of K inputs, `chunk` elements per CTA, output
    form `out` ("codes" or "xhat")."""

    m: int
    k: int
    fused: Fused
    ptx: str
    chunk: int
    threads: int
    out: str = "codes"

    @property
    def n_outputs(self) -> int:
        """Outputs of the entry, after its N_INPUTS operands."""
        return XHAT_OUTPUTS if self.out == "xhat" else N_OUTPUTS

    def backend_config(self) -> str:
        """MLIR dictionary text for XLA's `__gpu$xla.gpu.ptx` custom kernel call."""
        return ptx_backend_config(
            ENTRY,
            escape_mlir(self.ptx),
            grid=(self.m, self.k // self.chunk, 1),
            block=self.threads,
            outputs=range(N_INPUTS, N_INPUTS + self.n_outputs),
        )


@functools.cache
def _build_cached(m, k, fused, arch, chunk, threads, out="codes") -> QuantKernel:
    if fused.residual:
        raise KernelError("the quantizer has no residual epilogue (Fused.residual=True)")
    sizes = {"K_IN": k, "NTHREADS": threads, "QUANT_ONLY": 1, "QCHUNK": chunk}
    # XHAT_OUT only when set: the "codes" kernels keep their defines and cache keys
    form = {"XHAT_OUT": 1} if out == "xhat" else {}
    defines = _GEMV_DUMMIES | fused.defines() | sizes | form
    ptx = compile_ptx(read_source(SOURCE), name=SOURCE, defines=defines, arch=arch)
    entries = ptx_entries(ptx)
    n_out = XHAT_OUTPUTS if out == "xhat" else N_OUTPUTS
    if entries.get(ENTRY) != N_INPUTS + n_out:
        raise KernelError(f"PTX entry {ENTRY} missing or with wrong parameters: {entries}")
    return QuantKernel(m=m, k=k, fused=fused, ptx=ptx, chunk=chunk, threads=threads, out=out)


def build(
    m: int,
    k: int,
    fused: Fused,
    *,
    arch: str | None = None,
    chunk: int | None = None,
    threads: int | None = None,
    out: str = "codes",
) -> QuantKernel:
    """Compiles (NVRTC, disk-cached) the quantizer for M rows of K inputs after `fused.prologue`
    ("swiglu": x holds 2K columns), static (xg[0]) or per-row dynamic (`fused.dynamic`) global
    scale; each CTA takes `chunk` elements of a row (default `default_chunk(k, out)`; K means
    one CTA per row; "xhat": a multiple of 256) with `threads` threads (a multiple of 32;
    default `default_threads(chunk, out)`). `out`: the output form, "codes" (codes, scales,
    global scale: the GEMV's operands) or "xhat" (the GEMM's fp16 x_hat and the global scale).

    Raises KernelError when NVRTC is missing or the shape, chunking or form is unsupported.
    """
    if out not in OUTS:
        raise KernelError(f"out={out!r}, expected one of {OUTS}")
    ok, why = check_shape(m, k)
    if not ok:
        raise KernelError(f"unsupported shape: {why}")
    if not isinstance(fused, Fused):
        raise KernelError(f"fused must be a Fused, got {type(fused).__name__}")
    chunk = default_chunk(k, out) if chunk is None else chunk
    step = 256 if out == "xhat" else 128  # full warps: 8 (xhat) or 4 elements per thread
    if chunk <= 0 or chunk % step or k % chunk:
        raise KernelError(f"chunk={chunk}: expected a positive multiple of {step} dividing K={k}")
    threads = default_threads(chunk, out) if threads is None else threads
    if threads <= 0 or threads % 32 or threads > 1024:
        raise KernelError(f"threads={threads}: expected a multiple of 32 in [32, 1024]")
    return _build_cached(m, k, fused, arch or device_arch(), chunk, threads, out)
