"""EXPERIMENT: host side of the TMA-streamed batch-1 NVFP4 W4A4 GEMV (`nvfp4_gemv_tma.cu`,
next to this file): plan, NVRTC build, ptxas report, launch.

The kernel keeps STAGES stages of a CTA's weights in flight with `cp.async.bulk` issued by one
producer warp (or, producer "lsu", that warp's 16-byte cp.async copies), so the bytes in flight
no longer depend on the consumer warps' registers (the limiter of production's M = 1 GEMV,
KERNEL_NOTES log 16). It takes production's plain W4A4 GEMV's operands (stacked weights and the
layer; optionally the residual epilogue, or gate_up's SwiGLU epilogue writing down_proj's NVFP4
input), one token.

Nothing here imports cuda-python or JAX at module import: NVRTC is reached by `build` and
`ptxas_report`, the driver by `launch`.

GEMM letters: M tokens (1 here), N out features, K in features.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import re
import threading

from cuda_ops.build import (
    DEFAULT_SMS,
    KernelError,
    compile_ptx,
    escape_mlir,
    ptx_backend_config,
    ptx_entries,
    ptxas_log,
)
from cuda_ops.nvfp4_gemv import _drv_check

SOURCE = pathlib.Path(__file__).with_name("nvfp4_gemv_tma.cu")
ENTRY = "nvfp4_gemv_tma"
HEADER_DIRS = (SOURCE.parent,)  # tma_ring.cuh; common.cuh from cuda_ops/
# operands as production's plain W4A4 GEMV: (xp, xs, xg, [res], wp, ws, wg, layer), then y
N_INPUTS = 7
ARCH = "compute_90"  # cp.async.bulk and mbarrier transaction counts: sm_90
SMEM_LIMIT = 227 * 1024  # dynamic shared memory a CTA may opt into on sm_90
SM_SMEM = 228 * 1024  # shared memory of an SM (CTAs per SM must fit it, 1 KB reserved each)
# the shapes the device check runs (Qwen3-8B: qkv, o, gate_up, down)
QWEN3_8B_SHAPES = ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288))
PRODUCERS = ("tma", "lsu")  # the .cu's PRODUCER 0 / 1
SWIGLUS = ("scalar", "stacked")
DEFAULT_STAGES = 6
STATIC_SMEM = 512  # static shared memory beside the plan's dynamic bytes (SwiGLU: 256), bound


@dataclasses.dataclass(frozen=True)
class TmaPlan:
    """Compile-time launch geometry for one (N, K) (see the kernel's header)."""

    n: int
    k: int
    kch: int = 1024  # code bytes of a row a stage (`plan`: `default_kch`)
    stages: int = 6  # (`plan`: at most DEFAULT_STAGES, as many as fit)
    warps: int = 16  # consumer warps = rows a stage
    ctas: int = 1  # CTAs per SM
    sms: int = DEFAULT_SMS
    ef: bool = False  # the bulk copies with an L2 evict_first policy
    nomath: bool = False  # diagnostic: no decode or dot, the streaming alone
    producer: str = "tma"  # "tma": bulk copies; "lsu": the producer warp's 16-byte cp.async
    residual: bool = False  # y = res + y (the decoder's residual add, production's EPI_RES)
    # gate_up: down_proj's NVFP4 input instead of y (production's SWIGLU_OUT), with down_proj's
    # static input scale one value ("scalar") or stacked [L] ("stacked")
    swiglu: str | None = None
    gw_rows: bool = False  # the weight's global scales per output row, wg [L, N] (production's)

    @property
    def n_inputs(self) -> int:
        return N_INPUTS + int(self.residual) + int(self.swiglu is not None)

    @property
    def n_outputs(self) -> int:
        """y, or with swiglu down_proj's codes, block scales and global scale."""
        return 1 if self.swiglu is None else 3

    @property
    def threads(self) -> int:
        return 32 * (self.warps + 1)

    @property
    def groups(self) -> int:
        return self.n // self.warps

    @property
    def grid(self) -> int:
        """CTAs: one wave, none without work (rows in groups of `warps`; with swiglu in whole
        32-row units)."""
        work = self.n // 32 if self.swiglu is not None else self.groups
        return min(self.sms * self.ctas, work)

    @property
    def stage_bytes(self) -> int:
        return self.warps * (self.kch + self.kch // 8)

    @property
    def smem(self) -> int:
        # the ring, x as int8 (K bytes), x's scales (K / 16), 2 x STAGES mbarriers of 8 bytes
        return self.stages * self.stage_bytes + self.k + self.k // 16 + 16 * self.stages

    @property
    def in_flight(self) -> int:
        """Weight bytes a CTA can have in flight (its whole ring)."""
        return self.stages * self.stage_bytes

    def defines(self) -> dict:
        return {
            "N_OUT": self.n,
            "K_IN": self.k,
            "KCH": self.kch,
            "WARPS": self.warps,
            "STAGES": self.stages,
            "GRID": self.grid,
            "MIN_CTAS": self.ctas,
            "EF": int(self.ef),
            "NOMATH": int(self.nomath),
            "PRODUCER": PRODUCERS.index(self.producer),
            "EPI_RES": int(self.residual),
            "SWIGLU_OUT": int(self.swiglu is not None),
            "XGD_STACK": int(self.swiglu == "stacked"),
            "GW_ROWS": int(self.gw_rows),
        }


def check_plan(p: TmaPlan) -> tuple[bool, str]:
    """Whether the kernel can run the plan (the .cu's static_asserts, shared memory)."""
    if p.k % 256 or p.k <= 0:
        return False, f"K={p.k}: a positive multiple of 256 expected"
    if p.kch <= 0 or p.kch % 128 or (p.k // 2) % p.kch:
        return False, f"kch={p.kch}: a multiple of 128 dividing K / 2 = {p.k // 2} expected"
    if not 1 <= p.warps <= 16 or p.n % p.warps:
        return False, f"warps={p.warps}: 1..16 dividing N = {p.n} expected"
    if p.producer not in PRODUCERS:
        return False, f"producer={p.producer!r}: one of {PRODUCERS} expected"
    if p.ef and p.producer != "tma":
        return False, "ef (an L2 policy on the bulk copies) needs producer 'tma'"
    if p.swiglu is not None:
        if p.swiglu not in SWIGLUS:
            return False, f"swiglu={p.swiglu!r}: None or one of {SWIGLUS} expected"
        if p.warps != 16 or p.n % 32 or p.residual:
            return False, "swiglu needs warps=16 (a stage is one block), N % 32 == 0, no residual"
    if p.stages < 2:
        return False, f"stages={p.stages}: at least 2 expected"
    static = STATIC_SMEM
    if p.smem + static > SMEM_LIMIT or p.ctas * (p.smem + static + 1024) > SM_SMEM:
        return False, f"{p.ctas} CTA(s) of {p.smem} B shared memory do not fit an SM"
    return True, ""


def default_kch(k: int) -> int:
    """Code bytes of a row a stage: the largest multiple of 128 dividing K / 2 up to 1024 when it
    is at least 512 (whole 16-byte units for every lane), else the smallest from 512 up (e.g.
    Qwen2-7B's K = 18944: 256 or 4736 -> 4736), else the largest."""
    half = k // 2
    divisors = [c for c in range(128, half + 1, 128) if half % c == 0] or [half]
    small = [c for c in divisors if c <= 1024]
    if small and small[-1] >= 512:
        return small[-1]
    big = [c for c in divisors if c >= 512]
    return big[0] if big else divisors[-1]


def plan(n: int, k: int, **options) -> TmaPlan:
    """The plan for [1, K] x [N, K]^T with `options` (TmaPlan's fields); kch defaults to
    `default_kch(K)`, stages to DEFAULT_STAGES or as many as fit the shared memory. Raises
    KernelError for a plan the kernel cannot run."""
    options.setdefault("kch", default_kch(k) if k > 0 and k % 256 == 0 else 1024)
    if "stages" not in options:  # as many as fit, at most DEFAULT_STAGES
        p = TmaPlan(n=n, k=k, **options, stages=1)
        room = (min(SMEM_LIMIT, SM_SMEM // p.ctas - 1024) - STATIC_SMEM - p.smem) // (
            p.stage_bytes + 16
        )
        options["stages"] = max(2, min(DEFAULT_STAGES, room + 1))
    p = TmaPlan(n=n, k=k, **options)
    ok, why = check_plan(p)
    if not ok:
        raise KernelError(f"nvfp4_gemv_tma: {why}")
    return p


def read_source() -> str:
    return SOURCE.read_text()


@dataclasses.dataclass(frozen=True, eq=False)
class TmaKernel:
    plan: TmaPlan
    ptx: str
    entry: str = ENTRY

    @property
    def n(self) -> int:
        return self.plan.n

    def backend_config(self) -> str:
        """MLIR dictionary text for XLA's `__gpu$xla.gpu.ptx` custom kernel call: the operands
        and results of production's GEMV of the same epilogue, so a lowering can take either."""
        p = self.plan
        return ptx_backend_config(
            ENTRY,
            escape_mlir(self.ptx),
            grid=(p.grid, 1, 1),
            block=p.threads,
            outputs=range(p.n_inputs, p.n_inputs + p.n_outputs),
            smem=p.smem,
        )

    def launch(self, stream: int, pointers: list[int]) -> None:
        """Launches on `stream` with device pointers (xp, xs, xg, [res], wp, ws, wg, layer, y),
        with swiglu (..., layer, xgd, dp, ds, dg): production's W4A4 GEMV's operands."""
        import ctypes

        from cuda.bindings import driver

        p = self.plan
        want = p.n_inputs + p.n_outputs
        if len(pointers) != want:
            raise KernelError(f"{ENTRY} takes {want} pointers, got {len(pointers)}")
        params = (tuple(pointers), tuple(ctypes.c_void_p for _ in pointers))
        _drv_check(
            driver.cuLaunchKernel(
                _function(self), p.grid, 1, 1, p.threads, 1, 1, p.smem, stream, params, 0
            ),
            "cuLaunchKernel",
        )

    def attributes(self) -> dict:
        """The driver's view of the loaded kernel: registers, local bytes, max threads."""
        from cuda.bindings import driver

        fn = _function(self)
        a = driver.CUfunction_attribute
        return {
            "registers": _drv_check(
                driver.cuFuncGetAttribute(a.CU_FUNC_ATTRIBUTE_NUM_REGS, fn), "regs"
            ),
            "local_bytes": _drv_check(
                driver.cuFuncGetAttribute(a.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, fn), "local"
            ),
            "max_threads": _drv_check(
                driver.cuFuncGetAttribute(a.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, fn),
                "threads",
            ),
        }


@functools.cache
def _build_cached(p: TmaPlan) -> TmaKernel:
    ptx = compile_ptx(
        read_source(), name=SOURCE.name, defines=p.defines(), arch=ARCH, header_dirs=HEADER_DIRS
    )
    if ptx_entries(ptx) != {ENTRY: p.n_inputs + p.n_outputs}:
        raise KernelError(f"{SOURCE.name}: unexpected entries {ptx_entries(ptx)}")
    return TmaKernel(plan=p, ptx=ptx)


def build(n: int, k: int, **options) -> TmaKernel:
    """Plans and compiles (NVRTC, disk-cached) the kernel for (N, K)."""
    return _build_cached(plan(n, k, **options))


def ptxas_report(p: TmaPlan) -> dict:
    """ptxas (offline, sm_90) on the plan's PTX: registers, spill bytes, static shared bytes."""
    return ptxas_of(read_source(), p.defines(), SOURCE.name)


def ptxas_of(source: str, defines: dict, name: str) -> dict:
    """ptxas (offline, sm_90) on a kernel source of this directory: registers, spill bytes,
    static shared bytes and the log."""
    log = ptxas_log(source, defines, name=name, arch="sm_90", header_dirs=HEADER_DIRS)
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", log)]
    spill = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    static = [int(x) for x in re.findall(r"(\d+) bytes smem", log)]
    return {
        "registers": max(regs, default=None),
        "spill_bytes": sum(int(a) + int(b) for a, b in spill),
        "static_smem": max(static, default=0),
        "log": log,
    }


_FUNCTIONS: dict = {}
_LOCK = threading.Lock()


def _function(kernel: TmaKernel):
    """The loaded CUfunction (one module per kernel, kept for the process), with its dynamic
    shared memory limit raised to the plan's."""
    from cuda.bindings import driver

    with _LOCK:
        fn = _FUNCTIONS.get(id(kernel))
        if fn is None:
            module = _drv_check(driver.cuModuleLoadData(kernel.ptx.encode() + b"\0"), "load")
            fn = _drv_check(driver.cuModuleGetFunction(module, ENTRY.encode()), "function")
            attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            _drv_check(driver.cuFuncSetAttribute(fn, attr, kernel.plan.smem), "smem")
            _FUNCTIONS[id(kernel)] = (fn, module, kernel)
            return fn
        return fn[0]


# ----------------------------------------------------------------------------- experiments


OPTION_TYPES = {"kch": int, "stages": int, "warps": int, "ctas": int, "ef": bool, "producer": str}


def parse_options(text: str, types: dict | None = None) -> dict:
    """'stages=4,producer=lsu,ef=1' -> TmaPlan keyword options (`types`: name -> type, default
    `OPTION_TYPES`; 'default' or '': none). Raises ValueError naming the bad item."""
    types = OPTION_TYPES if types is None else types
    out = {}
    for item in filter(None, text.split(",")):
        if item == "default":
            continue
        key, sep, value = item.partition("=")
        if not sep or key not in types:
            raise ValueError(f"{item!r}: expected NAME=VALUE with NAME in {sorted(types)}")
        try:
            out[key] = bool(int(value)) if types[key] is bool else types[key](value)
        except ValueError:
            raise ValueError(f"{item!r}: {key} takes a {types[key].__name__}") from None
    return out


def install(**options):
    """Experiments only: makes `cuda_ops.nvfp4_gemv.build` return this kernel (with `options`,
    TmaPlan's fields) wherever it can serve, i.e. the W4A4 GEMV at M = 1 without a fused
    prologue, a norm epilogue or prefetch (plain, residual or SwiGLU epilogue; its operands are
    production's), and production's kernel elsewhere. The lowerings call `nvfp4_gemv.build` when
    a computation is lowered, and JAX keeps lowerings, so a process that installs it before its
    first compile (or calls `jax.clear_caches()` after) runs the decode step with these GEMVs
    (experiments/bench_decode.py --gemv-tma). Returns a function that restores production's
    `build`. Raises KernelError for options no plan can take."""
    from cuda_ops import nvfp4_gemv
    from cuda_ops.build import device_sms

    plan(4096, 4096, **options)  # the options themselves are valid
    original = nvfp4_gemv.build

    def build(act, m, n, k, **kw):
        simple = all(kw.get(name) is None for name in ("fused", "prefetch", "norm_out"))
        if act == "w4a4" and m == 1 and simple:
            epilogue = {
                "residual": bool(kw.get("residual")),
                "swiglu": kw.get("swiglu_out"),
                "gw_rows": bool(kw.get("gw_rows")),
            }
            try:
                p = plan(n, k, sms=kw.get("num_sms") or device_sms(), **epilogue, **options)
                return _build_cached(p)
            except KernelError:
                pass  # a shape this kernel does not take: production's
        return original(act, m, n, k, **kw)

    nvfp4_gemv.build = build

    def uninstall():
        nvfp4_gemv.build = original

    return uninstall
