"""EXPERIMENT: host side of the one-launch batch-1 post-attention block (`nvfp4_block_tma.cu`,
next to this file): o_proj + residual, RMSNorm + quantization, gate_up + SwiGLU + quantization,
down_proj + residual, with one producer warp per CTA streaming all three matrices through one
TMA ring and the consumer warps meeting at two grid-wide barriers. Plan, NVRTC build, ptxas
report; the device check (`check_block_tma.py`) launches it.

Nothing here imports cuda-python or JAX at module import.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pathlib
import re

from cuda_ops.build import DEFAULT_SMS, KernelError, compile_ptx, ptx_entries, ptxas_log
from experiments.kernels.nvfp4_gemv_tma import (
    ARCH,
    PRODUCERS,
    SM_SMEM,
    SMEM_LIMIT,
)

SOURCE = pathlib.Path(__file__).with_name("nvfp4_block_tma.cu")
ENTRY = "nvfp4_block_tma"
HEADER_DIRS = (SOURCE.parent,)  # tma_ring.cuh; common.cuh from cuda_ops/
WARPS = 16  # consumer warps (rows a stage)
# (ap, as, ag, h, wo_p, wo_s, wo_g, nw, xgu, wgu_p, wgu_s, wgu_g, xgd, wd_p, wd_s, wd_g, layer)
N_INPUTS = 17
OUTPUTS = ("y2", "y1", "gp", "gs", "dp", "ds")
STATIC_SMEM = 256  # hbuf, the norm's sums and scales (bound)
QWEN3_8B = (4096, 4096, 12288)  # (D, K_O = heads x head_dim, F)


@dataclasses.dataclass(frozen=True)
class BlockPlan:
    """Compile-time geometry of one block (see the kernel's header)."""

    d: int  # hidden size: o's and down's N, gate_up's K
    ko: int  # o's K (attention heads x head_dim)
    f: int  # intermediate size: gate_up's N / 2, down's K
    kch: int = 1024  # code bytes of a row a stage (`plan`: `default_kch` of every K)
    stages: int = 6
    sms: int = DEFAULT_SMS
    producer: str = "tma"
    ef: bool = False
    gw_rows: bool = False  # one weight global scale a row ([L, N]) instead of one a matrix
    eps: float = 1e-6  # the RMSNorm epsilon

    @property
    def grid(self) -> int:
        """One CTA an SM at most (all resident: the barriers wait for every CTA), none without a
        row group of o."""
        return min(self.sms, self.d // 16)

    @property
    def threads(self) -> int:
        return 32 * (WARPS + 1)

    @property
    def k_max(self) -> int:
        return max(self.ko, self.d, self.f)

    @property
    def stage_bytes(self) -> int:
        return WARPS * (self.kch + self.kch // 8)

    @property
    def smem(self) -> int:
        return self.stages * self.stage_bytes + self.k_max + self.k_max // 16 + 16 * self.stages

    @property
    def weight_bytes(self) -> int:
        """Bytes of o, gate_up and down (codes and block scales) one launch reads."""
        elems = self.d * self.ko + 2 * self.f * self.d + self.d * self.f
        return elems // 2 + elems // 16

    def defines(self) -> dict:
        return {
            "D_MODEL": self.d,
            "K_O": self.ko,
            "F_FF": self.f,
            "KCH": self.kch,
            "STAGES": self.stages,
            "GRID": self.grid,
            "PRODUCER": PRODUCERS.index(self.producer),
            "EF": int(self.ef),
            "GW_ROWS": int(self.gw_rows),
            "NORM_EPS": f"{float(self.eps)!r}f",
        }


def check_plan(p: BlockPlan) -> tuple[bool, str]:
    """Whether the kernel can run the plan (the .cu's static_asserts, shared memory)."""
    for name, k in (("d", p.d), ("ko", p.ko), ("f", p.f)):
        if k <= 0 or k % 256:
            return False, f"{name}={k}: a positive multiple of 256 expected"
    if p.kch <= 0 or p.kch % 128 or any((k // 2) % p.kch for k in (p.d, p.ko, p.f)):
        return False, f"kch={p.kch}: a multiple of 128 dividing d / 2, ko / 2 and f / 2 expected"
    if p.producer not in PRODUCERS:
        return False, f"producer={p.producer!r}: one of {PRODUCERS} expected"
    if p.ef and p.producer != "tma":
        return False, "ef (an L2 policy on the bulk copies) needs producer 'tma'"
    if p.stages < 2:
        return False, f"stages={p.stages}: at least 2 expected"
    if p.sms < 1:
        return False, f"sms={p.sms}: at least 1 expected"
    if p.smem + STATIC_SMEM > SMEM_LIMIT:
        return False, f"{p.smem} B of shared memory do not fit a CTA"
    return True, ""


def plan(d: int, ko: int, f: int, **options) -> BlockPlan:
    """The plan for a block of hidden size d, o's K ko and intermediate size f with `options`
    (BlockPlan's fields): kch defaults to the largest multiple of 128 up to 1024 that divides
    every K / 2, stages to 6 or as many as fit. Raises KernelError for a plan the kernel cannot
    run."""
    if "kch" not in options and all(k > 0 and k % 256 == 0 for k in (d, ko, f)):
        common = math.gcd(d // 2, ko // 2, f // 2)
        options["kch"] = max(c for c in range(128, 1025, 128) if common % c == 0)
    if "stages" not in options:
        p = BlockPlan(d=d, ko=ko, f=f, **options, stages=1)
        room = (SMEM_LIMIT - STATIC_SMEM - p.smem) // (p.stage_bytes + 16)
        options["stages"] = max(2, min(6, room + 1))
    p = BlockPlan(d=d, ko=ko, f=f, **options)
    ok, why = check_plan(p)
    if not ok:
        raise KernelError(f"nvfp4_block_tma: {why}")
    assert p.smem + STATIC_SMEM + 1024 <= SM_SMEM
    return p


def read_source() -> str:
    return SOURCE.read_text()


@dataclasses.dataclass(frozen=True, eq=False)
class BlockKernel:
    plan: BlockPlan
    ptx: str
    entry: str = ENTRY


@functools.cache
def _build_cached(p: BlockPlan) -> BlockKernel:
    ptx = compile_ptx(
        read_source(), name=SOURCE.name, defines=p.defines(), arch=ARCH, header_dirs=HEADER_DIRS
    )
    if ptx_entries(ptx) != {ENTRY: N_INPUTS + len(OUTPUTS)}:
        raise KernelError(f"{SOURCE.name}: unexpected entries {ptx_entries(ptx)}")
    return BlockKernel(plan=p, ptx=ptx)


def build(d: int, ko: int, f: int, **options) -> BlockKernel:
    """Plans and compiles (NVRTC, disk-cached) the block kernel."""
    return _build_cached(plan(d, ko, f, **options))


def ptxas_report(p: BlockPlan) -> dict:
    """ptxas (offline, sm_90) on the plan's PTX: registers, spill bytes, static shared bytes."""
    log = ptxas_log(
        read_source(), p.defines(), name=SOURCE.name, arch="sm_90", header_dirs=HEADER_DIRS
    )
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", log)]
    spill = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    static = [int(x) for x in re.findall(r"(\d+) bytes smem", log)]
    return {
        "registers": max(regs, default=None),
        "spill_bytes": sum(int(a) + int(b) for a, b in spill),
        "static_smem": max(static, default=0),
        "log": log,
    }
