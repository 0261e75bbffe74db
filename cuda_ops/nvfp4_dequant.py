"""Host side of the weight dequantizer `nvfp4_dequant_bf16` (`nvfp4_dequant.cu`): shape checks,
build and launch configuration.

The W4A4 dot path (prefill: more rows than `GemmOptions.max_m`) multiplies the exactly
pre-scaled values e2m1 * SFw in one bf16 dot. With `GemmOptions.dot_dequant` "kernel" this
kernel writes those bf16 values [N, K] from the (possibly stacked) NVFP4 operands in one launch,
reading the stack in place through a device layer index; "xla" (the default) leaves the decode
to XLA's fusions (`rejax.nvfp4._scaled_values`). The bytes are the same (every value is exact in
bf16). Nothing here imports cuda-python at module import; NVRTC is reached only by `build`.
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

__all__ = ["ENTRY", "N_INPUTS", "DequantKernel", "build", "check_shape"]

SOURCE = "nvfp4_dequant.cu"
ENTRY = "nvfp4_dequant_bf16"
N_INPUTS = 3  # wp, ws, layer; result: out bf16 [N, K]
THREADS = 256
GROUP = 8  # elements a thread handles per step
GROUPS = 4  # steps a thread (CTA-strided)


def check_shape(n: int, k: int) -> tuple[bool, str]:
    """(True, "") if the kernel takes an [n, k] weight, else (False, why)."""
    if n < 1 or k < 1:
        return False, f"N={n}, K={k} (expected >= 1)"
    if k % 16:
        return False, f"K={k} (expected a multiple of 16, the NVFP4 block)"
    return True, ""


@dataclasses.dataclass(frozen=True, eq=False)
class DequantKernel:
    """A compiled specialisation for one [n, k] weight. `stream`: where its XLA call runs,
    "main" or "side" (`GemmOptions.dot_stream`; the same kernel)."""

    n: int
    k: int
    ptx: str
    groups: int = GROUPS
    stream: str = "main"

    @property
    def grid(self) -> int:
        per_cta = THREADS * self.groups
        return -(-(self.n * self.k // GROUP) // per_cta)

    def backend_config(self) -> str:
        """MLIR dictionary text for XLA's `__gpu$xla.gpu.ptx` custom kernel call."""
        return ptx_backend_config(
            ENTRY,
            escape_mlir(self.ptx),
            grid=(self.grid, 1, 1),
            block=THREADS,
            outputs=(N_INPUTS,),
        )


@functools.cache
def _build_cached(n: int, k: int, arch: str, groups: int) -> DequantKernel:
    defines = {"N_OUT": n, "K_IN": k, "GROUPS": groups}
    ptx = compile_ptx(read_source(SOURCE), name=SOURCE, defines=defines, arch=arch)
    entries = ptx_entries(ptx)
    if entries.get(ENTRY) != N_INPUTS + 1:
        raise KernelError(f"PTX entry {ENTRY} missing or with wrong parameters: {entries}")
    return DequantKernel(n=n, k=k, ptx=ptx, groups=groups)


def build(n: int, k: int, *, arch: str | None = None, groups: int = GROUPS) -> DequantKernel:
    """Compiles (NVRTC, disk-cached) the dequantizer of an [n, k] NVFP4 weight.

    Raises KernelError when NVRTC is missing or the shape is unsupported.
    """
    ok, why = check_shape(n, k)
    if not ok:
        raise KernelError(f"unsupported shape: {why}")
    if not isinstance(groups, int) or not 1 <= groups <= 16:
        raise KernelError(f"groups={groups!r}: expected an int in 1..16")
    return _build_cached(n, k, arch or device_arch(), groups)
