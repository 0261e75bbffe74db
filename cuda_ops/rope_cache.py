"""Host side of the decode step's attention prologue `qk_norm_rope_cache` (`rope_cache.cu`):
shape checks, build and launch configuration.

One launch per layer turns the fused qkv projection's output of one token per row into the
attention's query (q/k RMSNorm for Qwen3, then the rotation) and writes the rotated key and the
value into the stacked KV cache in place; `rejax.ops.rope_cache` binds it. Nothing here imports
cuda-python at module import; NVRTC is reached only by `build`.
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

__all__ = ["ENTRY", "N_INPUTS", "RopeCacheKernel", "build", "check_shape"]

SOURCE = "rope_cache.cu"
ENTRY = "qk_norm_rope_cache"
# operands: qkv, q_norm, k_norm, layer, positions, index, inv_freq, k_cache, v_cache;
# results: q_out, k_cache, v_cache (the caches aliased to operands 7 and 8)
N_INPUTS = 9
N_OUTPUTS = 3
ALIASES = {7: 1, 8: 2}  # operand -> result
WARPS = 4


@dataclasses.dataclass(frozen=True)
class Shape:
    """The static shapes one kernel is compiled for."""

    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    slots: int
    qk_norm: bool
    eps: float
    index_rows: bool


def check_shape(shape: Shape) -> tuple[bool, str]:
    """(True, "") if the kernel supports these shapes, else (False, why)."""
    if shape.head_dim < 32 or shape.head_dim % 32:
        return False, f"head_dim={shape.head_dim} (the kernel needs a multiple of 32)"
    if shape.batch < 1 or shape.heads < 1 or shape.kv_heads < 1 or shape.slots < 1:
        return False, f"{shape} has an empty dimension"
    if shape.heads % shape.kv_heads:
        return False, f"heads={shape.heads} is not a multiple of kv_heads={shape.kv_heads}"
    return True, ""


@dataclasses.dataclass(frozen=True, eq=False)
class RopeCacheKernel:
    """A compiled specialisation: one warp per (row, head) of q, k and v."""

    shape: Shape
    ptx: str
    warps: int

    @property
    def grid(self) -> int:
        s = self.shape
        return -(-(s.batch * (s.heads + 2 * s.kv_heads)) // self.warps)

    def backend_config(self) -> str:
        """MLIR dictionary text for XLA's `__gpu$xla.gpu.ptx` custom kernel call."""
        return ptx_backend_config(
            ENTRY,
            escape_mlir(self.ptx),
            grid=(self.grid, 1, 1),
            block=32 * self.warps,
            outputs=range(N_INPUTS, N_INPUTS + N_OUTPUTS),
        )


@functools.cache
def _build_cached(shape: Shape, arch: str, warps: int) -> RopeCacheKernel:
    defines = {
        "B_ROWS": shape.batch,
        "N_HEADS": shape.heads,
        "KV_HEADS": shape.kv_heads,
        "HEAD_DIM": shape.head_dim,
        "S_SLOTS": shape.slots,
        "QK_NORM": int(shape.qk_norm),
        "NORM_EPS": f"{float(shape.eps)!r}f",
        "INDEX_ROWS": int(shape.index_rows),
        "WARPS": warps,
    }
    ptx = compile_ptx(read_source(SOURCE), name=SOURCE, defines=defines, arch=arch)
    entries = ptx_entries(ptx)
    if entries.get(ENTRY) != N_INPUTS + N_OUTPUTS:
        raise KernelError(f"PTX entry {ENTRY} missing or with wrong parameters: {entries}")
    return RopeCacheKernel(shape=shape, ptx=ptx, warps=warps)


def build(shape: Shape, *, arch: str | None = None, warps: int = WARPS) -> RopeCacheKernel:
    """Compiles (NVRTC, disk-cached) the kernel for `shape`.

    Raises KernelError when NVRTC is missing or the shape is unsupported.
    """
    ok, why = check_shape(shape)
    if not ok:
        raise KernelError(f"unsupported shape: {why}")
    if not 1 <= warps <= 32:
        raise KernelError(f"warps={warps}: expected 1..32")
    return _build_cached(shape, arch or device_arch(), warps)
