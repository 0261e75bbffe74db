"""Host side of the decode step's attention prologue `qk_norm_rope_cache` (`rope_cache.cu`):
shape checks, build and launch configuration.

One launch per layer turns the fused qkv projection's output of one token per row into the
attention's query (q/k RMSNorm for Qwen3, then the rotation) and writes the rotated key and the
value into the stacked KV cache in place; `rejax.ops.rope_cache` binds it. Built with `finish`
it reads the qkv GEMM's split-K partials instead of qkv (the finish and this kernel in one
launch; `rejax.ops.fused_block.pre_attention_block`). Nothing here imports cuda-python at module
import; NVRTC is reached only by `build`.
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
from cuda_ops.nvfp4_quant import FinishIn

__all__ = ["ENTRY", "N_INPUTS", "RopeCacheKernel", "build", "check_shape"]

SOURCE = "rope_cache.cu"
ENTRY = "qk_norm_rope_cache"
# operands: qkv, q_norm, k_norm, layer, positions, index, inv_freq, k_cache, v_cache;
# results: q_out, k_cache, v_cache (the caches aliased to operands 7 and 8)
N_INPUTS = 9
N_OUTPUTS = 3
ALIASES = {7: 1, 8: 2}  # operand -> result
# with `finish` (FIN_SPLITK): qkv replaced by the qkv GEMM's partials, its activation global
# scale and its weight global scale(s)
FIN_INPUTS = 11
FIN_ALIASES = {9: 1, 10: 2}
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
    finish: FinishIn | None = None

    @property
    def n_inputs(self) -> int:
        return N_INPUTS if self.finish is None else FIN_INPUTS

    @property
    def aliases(self) -> dict[int, int]:
        """Operand -> result positions of the caches (updated in place)."""
        return ALIASES if self.finish is None else FIN_ALIASES

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
            outputs=range(self.n_inputs, self.n_inputs + N_OUTPUTS),
        )


@functools.cache
def _build_cached(shape: Shape, arch: str, warps: int, finish=None) -> RopeCacheKernel:
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
    if finish is not None:  # only when set: the other builds keep their defines and cache keys
        defines |= {"FIN_SPLITK": finish.splitk, "FIN_W_SHIFT": finish.w_shift,
                    "FIN_GW_ROWS": int(finish.gw_rows)}  # fmt: skip
    ptx = compile_ptx(read_source(SOURCE), name=SOURCE, defines=defines, arch=arch)
    kernel = RopeCacheKernel(shape=shape, ptx=ptx, warps=warps, finish=finish)
    entries = ptx_entries(ptx)
    if entries.get(ENTRY) != kernel.n_inputs + N_OUTPUTS:
        raise KernelError(f"PTX entry {ENTRY} missing or with wrong parameters: {entries}")
    return kernel


def build(
    shape: Shape,
    *,
    arch: str | None = None,
    warps: int = WARPS,
    finish: FinishIn | None = None,
) -> RopeCacheKernel:
    """Compiles (NVRTC, disk-cached) the kernel for `shape`. With `finish`
    (`cuda_ops.nvfp4_quant.FinishIn` of the qkv GEMM: its K split, w_shift, gw_rows; no
    residual) the kernel reads that GEMM's float32 partials instead of qkv and forms each value
    as its split-K finish would store it.

    Raises KernelError when NVRTC is missing or the shape or finish is unsupported.
    """
    if finish is not None:
        if not isinstance(finish, FinishIn):
            raise KernelError(f"finish must be a FinishIn, got {type(finish).__name__}")
        if finish.residual or finish.store_y or finish.next_layers:
            raise KernelError(
                f"{finish}: the qkv finish has no residual, stores no y, reads no next layer"
            )
    ok, why = check_shape(shape)
    if not ok:
        raise KernelError(f"unsupported shape: {why}")
    if not 1 <= warps <= 32:
        raise KernelError(f"warps={warps}: expected 1..32")
    return _build_cached(shape, arch or device_arch(), warps, finish)
