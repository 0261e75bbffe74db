"""Host side of the fused sampler (`sampler.cu`): launch plan, build, backend configs.

The three kernels (statistics, top-p histogram, boundary resolution) run one after another on
XLA's stream as `__gpu$xla.gpu.ptx` custom calls; `rejax.ops.sampler` binds them. Nothing here
imports cuda-python at module import; NVRTC is reached only by `build`.
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
    read_source,
)

__all__ = ["ENTRIES", "MAX_BATCH", "MAX_VOCAB", "NMAX", "SamplerKernel", "build", "check_shape"]

SOURCE = "sampler.cu"
# entry -> (number of operands, number of results); parameters are operands then results
ENTRIES = {
    "rejax_sample_stats": (5, 2),  # logits, thr, alt, t_a, t_b -> stats [B, 4], arg [B, 2]
    "rejax_sample_hist": (5, 1),  # logits, stats, arg, top_p, keys -> plan [B, 8]
    "rejax_sample_resolve": (6, 1),  # logits, stats, arg, top_p, keys, plan -> tokens [B]
}
PLAN_WORDS = 8
THREADS = 512
NB = 2048  # histogram bins (sampler.cu); NB / THREADS bins per thread
NMAX = 2048  # the boundary bin is collected and sorted when it holds <= NMAX tokens
MAX_BATCH = 1024  # module-global scratch is sized by the batch: 16 KiB + 16 B * NMAX per row
MAX_VOCAB = 1 << 24
RESIDENT_BLOCKS = 528  # 132 SMs x 4 blocks of 512 threads (the H200); the grid targets one wave
MAX_CHUNKS = 128


def check_shape(batch: int, vocab: int, top_k: int = 0) -> tuple[bool, str]:
    """(True, "") if the kernels support [batch, vocab] logits and top_k, else (False, why)."""
    if not 1 <= batch <= MAX_BATCH:
        return False, f"batch={batch} (the sampler kernel handles 1..{MAX_BATCH} rows)"
    if not 2 <= vocab <= MAX_VOCAB:
        return False, f"V={vocab} (the sampler kernel handles 2..{MAX_VOCAB} tokens)"
    if not 0 <= top_k <= vocab:
        return False, f"top_k={top_k} (expected 0..V={vocab})"
    return True, ""


@dataclasses.dataclass(frozen=True)
class Plan:
    """Launch geometry: a grid of `chunks` x `batch` blocks of `threads` threads."""

    batch: int
    vocab: int
    chunks: int
    chunk: int
    top_k: int = 0
    threads: int = THREADS
    nmax: int = NMAX

    def defines(self) -> dict:
        return {
            "TOP_K": self.top_k,
            "B_ROWS": self.batch,
            "V_SIZE": self.vocab,
            "CHUNKS": self.chunks,
            "CH": self.chunk,
            "NTHREADS": self.threads,
            "NMAX": self.nmax,
        }


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def plan(batch: int, vocab: int, top_k: int = 0) -> Plan:
    """About one wave of blocks over the whole batch, at least 4 chunks per row."""
    chunks = max(4, min(MAX_CHUNKS, RESIDENT_BLOCKS // batch))
    chunks = min(chunks, vocab)
    chunk = _cdiv(_cdiv(vocab, chunks), 4) * 4  # a multiple of 4 (the histogram's float4 loads)
    chunks = _cdiv(vocab, chunk)  # no empty trailing chunk
    return Plan(batch=batch, vocab=vocab, chunks=chunks, chunk=chunk, top_k=top_k)


@dataclasses.dataclass(frozen=True, eq=False)
class SamplerKernel:
    """The compiled kernels for one (batch, vocab) and their launch configs."""

    plan: Plan
    ptx: str

    @functools.cached_property
    def _escaped(self) -> str:
        return escape_mlir(self.ptx)

    def backend_config(self, entry: str) -> str:
        """MLIR dictionary text for XLA's `__gpu$xla.gpu.ptx` call of one entry."""
        n_in, n_out = ENTRIES[entry]
        p = self.plan
        return ptx_backend_config(
            entry,
            self._escaped,
            grid=(p.chunks, p.batch, 1),
            block=p.threads,
            outputs=range(n_in, n_in + n_out),
        )


@functools.cache
def _build_cached(batch: int, vocab: int, top_k: int, arch: str) -> SamplerKernel:
    p = plan(batch, vocab, top_k)
    ptx = compile_ptx(read_source(SOURCE), name=SOURCE, defines=p.defines(), arch=arch)
    return SamplerKernel(plan=p, ptx=ptx)


def build(batch: int, vocab: int, top_k: int = 0, *, arch: str | None = None) -> SamplerKernel:
    """Plans and compiles (NVRTC, disk-cached) the sampler kernels for [batch, vocab] logits
    (top_k > 0: top-k before top-p).

    Raises KernelError when NVRTC is missing or the shape is unsupported.
    """
    ok, why = check_shape(batch, vocab, top_k)
    if not ok:
        raise KernelError(f"unsupported shape: {why}")
    return _build_cached(batch, vocab, top_k, arch or device_arch())
