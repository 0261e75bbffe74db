"""Host side of the small-M NVFP4 GEMV (`nvfp4_gemv.cu`): shape checks, launch plan, build, launch.

GEMM letters: M decode tokens, N out features, K in features. Nothing here imports cuda-python
at module import; NVRTC and the driver are reached only by `build` and the launch callback.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import pathlib
import threading

import numpy as np

from cuda_ops.build import (
    DEFAULT_SMS,
    KernelError,
    compile_ptx,
    device_arch,
    device_sms,
    escape_mlir,
    ptx_backend_config,
    ptx_entries,
    read_source,
)

__all__ = [
    "DEFAULT_OPTIONS",
    "Fused",
    "GemvKernel",
    "GemvOptions",
    "KernelError",
    "Prefetch",
    "PrefetchTarget",
    "build",
    "check_shape",
    "plan",
    "prebuild",
    "probe_ptx_launch",
]

SOURCE = "nvfp4_gemv.cu"
MAX_M = 8
K_MULTIPLE = 256
SMEM_LIMIT = 227 * 1024  # per-block opt-in limit on sm_90 (sm_89: 99 KiB, checked at build)
SM_SMEM = 228 * 1024  # shared memory of one sm_90 SM (each resident CTA also reserves 1 KiB)
# "w4a4x": W4A4 with bf16 activations quantized inside the kernel (plus a `Fused` prologue /
# epilogue)
ENTRY = {"w4a4": "nvfp4_gemv_w4a4", "w4a16": "nvfp4_gemv_w4a16", "w4a4x": "nvfp4_gemv_w4a4_bf16"}
# number of operands per mode (the output pointer comes last):
# W4A4 (xp, xs, xg, wp, ws, wg, layer), W4A16 (x, wp, ws, wg, layer),
# W4A4X (x, xg, norm weight, residual, wp, ws, wg, layer); unused ones are 1-element dummies.
# W4A4 built with `residual=True` takes one more, res [M, N] bf16 after xg:
# (xp, xs, xg, res, wp, ws, wg, layer).
N_INPUTS = {"w4a4": 7, "w4a16": 5, "w4a4x": 8}
PROLOGUES = ("none", "rmsnorm", "swiglu")
VARIANTS = ("auto", "persistent", "stream")


@dataclasses.dataclass(frozen=True)
class GemvOptions:
    """Kernel choices, passed explicitly (never read from the environment).

    The defaults are what measured fastest on the H200 (experiments/KERNEL_NOTES.md); the other
    values exist for experiments that time variants side by side.

    Attributes:
        variant: "auto" (stream for M <= 2 on layers of <= 16 MiB, else persistent),
            "persistent", or "stream" (M <= 4; persistent elsewhere).
        rows: weight rows per warp step (None: the plan's choice).
        threads: threads per CTA (None: the plan's choice).
        ring: persistent kernel's cp.async slots per warp (None: 4 at M = 8, else 0).
        ctas: persistent kernel's CTAs per SM (None: 1). With c > 1 the grid is c x #SMs and
            the kernel is compiled for c resident CTAs (`__launch_bounds__(threads, c)`: at
            512 threads and c = 2, at most 64 registers per thread); their staged x and
            partial sums must fit c times in an SM's shared memory.
        source: path of another revision of the kernel source (experiments only).
        defines: extra (name, value) -D constants (experiments only, e.g. cache hints).
    """

    variant: str = "auto"
    rows: int | None = None
    threads: int | None = None
    ring: int | None = None
    ctas: int | None = None
    source: str | None = None
    defines: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        if self.variant not in VARIANTS:
            raise KernelError(f"GemvOptions.variant={self.variant!r}, expected one of {VARIANTS}")
        for name in ("rows", "threads", "ring"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise KernelError(f"GemvOptions.{name}={value!r}, expected None or an int >= 0")
        if self.ctas is not None and (not isinstance(self.ctas, int) or not 1 <= self.ctas <= 8):
            raise KernelError(f"GemvOptions.ctas={self.ctas!r}, expected None or an int in 1..8")


DEFAULT_OPTIONS = GemvOptions()


@dataclasses.dataclass(frozen=True)
class Fused:
    """What the "w4a4x" kernel does around the GEMV (compile-time constants).

    Attributes:
        prologue: "none" (x is the linear's input), "rmsnorm" (rms_norm(x, norm weight, eps)) or
            "swiglu" (x is [M, 2K]: silu(x[:, :K]) * x[:, K:]).
        residual: add a bf16 residual [M, N] to the output.
        dynamic: per-row dynamic activation global scale (else the static xg[0]).
        eps: the RMSNorm epsilon.
        norm_stacked: the norm weight is stacked [L, K] (indexed by the layer operand).
        scale_stacked: the static input scale is stacked [L] (indexed by the layer operand), so
            no per-layer slice of it runs as a kernel of its own before the launch.
    """

    prologue: str = "none"
    residual: bool = False
    dynamic: bool = False
    eps: float = 1e-6
    norm_stacked: bool = False
    scale_stacked: bool = False

    def __post_init__(self):
        if self.prologue not in PROLOGUES:
            raise KernelError(f"Fused.prologue={self.prologue!r}, expected one of {PROLOGUES}")

    def defines(self) -> dict:
        return {
            "X_BF16": 1,
            "PRO": PROLOGUES.index(self.prologue),
            "EPI_RES": int(self.residual),
            "DYN_XG": int(self.dynamic),
            "NW_STACK": int(self.norm_stacked),
            "XG_STACK": int(self.scale_stacked),
            "NORM_EPS": f"{float(self.eps)!r}f",
        }


PLAIN = Fused()

PREFETCH_AT = ("start", "end")
PREFETCH_MODES = ("line", "last", "bulk")
MAX_PREFETCH_TARGETS = 2


@dataclasses.dataclass(frozen=True)
class PrefetchTarget:
    """A weight stack whose layer the W4A4 GEMV prefetches into L2 (see `Prefetch`).

    Attributes:
        n, k: its matrices' shape (GEMM letters).
        layers: matrices in its stack (L of codes [L, N, K/2]).
        delta: its layer is the GEMV's layer + delta (0: the same layer; 1: the next one,
            nothing past the stack's end).
        fraction: the leading fraction of each row's K to prefetch, in (0, 1] (codes rounded
            up to 128-byte lines, block scales to 16 bytes).
    """

    n: int
    k: int
    layers: int
    delta: int = 0
    fraction: float = 1.0

    def __post_init__(self):
        for name in ("n", "k", "layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise KernelError(f"PrefetchTarget.{name}={value!r}, expected an int >= 1")
        if self.k % K_MULTIPLE:
            raise KernelError(f"PrefetchTarget.k={self.k}, expected a multiple of {K_MULTIPLE}")
        if not isinstance(self.delta, int) or self.delta < 0:
            raise KernelError(f"PrefetchTarget.delta={self.delta!r}, expected an int >= 0")
        if not 0.0 < self.fraction <= 1.0:
            raise KernelError(f"PrefetchTarget.fraction={self.fraction!r}, expected (0, 1]")

    def row_bytes(self) -> tuple[int, int]:
        """(code bytes, scale bytes) prefetched per row."""
        codes, scales = self.k // 2, self.k // 16
        cb = min(codes, -(-int(np.ceil(self.fraction * codes)) // 128) * 128)
        sb = min(scales, -(-int(np.ceil(self.fraction * scales)) // 16) * 16)
        return cb, sb

    def bytes(self) -> int:
        """Bytes one GEMV prefetches for this target (one layer)."""
        cb, sb = self.row_bytes()
        return self.n * (cb + sb)


@dataclasses.dataclass(frozen=True)
class Prefetch:
    """L2 prefetch of the weights that run next, issued by the plain W4A4 GEMV (compile-time
    constants; nvfp4_gemv.cu, "L2 prefetch"). Prefetches are hints: results are unchanged.

    Attributes:
        targets: up to two `PrefetchTarget`s; the entry takes (codes, scales) of each stack as
            two more operands after `layer`.
        at: "start" (issued before the GEMV's own loads are consumed) or "end" (after its
            CTA's main loop, filling the launch's tail).
        mode: "line" (prefetch.global.L2 per 128-byte line), "last" (the same with
            .L2::evict_last) or "bulk" (cp.async.bulk.prefetch.L2, the copy engine).
        evict_first: the GEMV's own weight loads carry an L2 evict_first policy, so its
            stream does not evict what was prefetched before it (also without targets).
    """

    targets: tuple[PrefetchTarget, ...] = ()
    at: str = "end"
    mode: str = "line"
    evict_first: bool = False

    def __post_init__(self):
        if not isinstance(self.targets, tuple) or not all(
            isinstance(t, PrefetchTarget) for t in self.targets
        ):
            raise KernelError(f"Prefetch.targets={self.targets!r}, expected PrefetchTargets")
        if len(self.targets) > MAX_PREFETCH_TARGETS:
            raise KernelError(
                f"Prefetch.targets has {len(self.targets)} entries, at most {MAX_PREFETCH_TARGETS}"
            )
        if self.at not in PREFETCH_AT:
            raise KernelError(f"Prefetch.at={self.at!r}, expected one of {PREFETCH_AT}")
        if self.mode not in PREFETCH_MODES:
            raise KernelError(f"Prefetch.mode={self.mode!r}, expected one of {PREFETCH_MODES}")

    @property
    def operands(self) -> int:
        """Operands the targets add to the entry (codes and scales of each stack)."""
        return 2 * len(self.targets)

    def defines(self) -> dict:
        out = {
            "PF_TARGETS": len(self.targets),
            "PF_AT": PREFETCH_AT.index(self.at),
            "PF_MODE": PREFETCH_MODES.index(self.mode),
            "LDW_EF": int(self.evict_first),
        }
        for j, t in enumerate(self.targets):
            cb, sb = t.row_bytes()
            out |= {
                f"PF{j}_N": t.n,
                f"PF{j}_K": t.k,
                f"PF{j}_L": t.layers,
                f"PF{j}_DL": t.delta,
                f"PF{j}_CB": cb,
                f"PF{j}_SB": sb,
            }
        return out


@dataclasses.dataclass(frozen=True)
class Plan:
    """Compile-time launch geometry for one (act, M, N, K)."""

    act: str
    m: int
    n: int
    k: int
    rows: int  # R_ROWS: weight rows per warp step
    spp: int  # 1024-element K steps per work item
    grid: int
    threads: int
    smem: int
    variant: str = "persistent"  # or "stream" (M <= 4)
    ksplit: int = 1  # stream: warps of a row group splitting K
    ring: int = 0  # persistent: cp.async ring slots per warp (0: register double buffer)
    ctas: int = 1  # persistent: resident CTAs per SM the kernel is compiled for
    gw_rows: bool = False  # one weight global scale per output row instead of per matrix
    fused: Fused | None = None  # act "w4a4x" only
    residual: bool = False  # act "w4a4" only: res [M, N] operand after xg, y = res + y
    prefetch: Prefetch | None = None  # act "w4a4" only: L2 prefetch, operands after layer
    # act "w4a4" persistent only: the SwiGLU epilogue (SWIGLU_OUT) writes down_proj's NVFP4
    # input with its static scale xgd, "scalar" ([1]) or "stacked" ([L], read at the layer)
    swiglu_out: str | None = None
    # act "w4a4" with residual: the NORM_OUT epilogue (`NormOut`); operands nw_all [(L,) N] and
    # the next linear's static scale after the prefetch operands, results y, codes, scales, g
    norm_out: NormOut | None = None

    @property
    def n_inputs(self) -> int:
        """Operands the entry takes before the output pointer(s)."""
        pf = 0 if self.prefetch is None else self.prefetch.operands
        extra = int(self.swiglu_out is not None) + 2 * int(self.norm_out is not None)
        return N_INPUTS[self.act] + int(self.residual) + pf + extra

    @property
    def n_outputs(self) -> int:
        """Results: y, or with swiglu_out down_proj's codes, block scales and global scale, or
        with norm_out y and the next linear's codes, block scales and global scale."""
        return 3 if self.swiglu_out is not None else 4 if self.norm_out is not None else 1

    @property
    def kparts(self) -> int:
        steps = -(-self.k // 1024)
        return -(-steps // self.spp)

    def defines(self) -> dict:
        extra = {} if self.fused is None else self.fused.defines()
        if self.residual:  # only then: the kernels without it keep their cache keys
            extra = extra | {"EPI_RES": 1}
        if self.prefetch is not None:  # likewise
            extra = extra | self.prefetch.defines()
        if self.swiglu_out is not None:  # likewise
            extra = extra | {"SWIGLU_OUT": 1, "XGD_STACK": int(self.swiglu_out == "stacked")}
        if self.norm_out is not None:  # likewise
            extra = extra | self.norm_out.defines()
        return extra | {
            "ACT_W4A4": int(self.act in ("w4a4", "w4a4x")),
            "M_TOK": self.m,
            "N_OUT": self.n,
            "K_IN": self.k,
            "R_ROWS": self.rows,
            "SPP": self.spp,
            "GRID": self.grid,
            "NTHREADS": self.threads,
            "GEMV_STREAM": int(self.variant == "stream"),
            "KSPLIT": self.ksplit,
            "RING_D": self.ring,
            "GW_ROWS": int(self.gw_rows),
            "MIN_CTAS": self.ctas,
        }


RING_MAX = 4  # cp.async slots per warp (steps in flight)
SLOT_BYTES_PER_ROW = 32 * 16 + 64  # one step of one row: codes of 32 lanes + block scales


def _smem(
    act: str, m: int, n: int, k: int, rows: int, grid: int, kparts: int, units: bool = False
) -> int:
    """Shared memory before the ring: staged x (W4A4) and the per-(part, row, token) sums
    (`units`: each CTA owns whole 32-row SwiGLU units, see `SWIGLU_UNIT`)."""
    groups = n // rows
    rpc = -(-(n // SWIGLU_UNIT) // grid) * SWIGLU_UNIT if units else -(-groups // grid) * rows
    stage = 0 if act == "w4a16" else -(-(m * k * 17 // 16) // 16) * 16  # w4a4 / w4a4x
    return stage + -(-(kparts * rpc * m * 4) // 16) * 16


RING_MIN_M = 8  # the ring measured faster only at M = 8 (experiments/KERNEL_NOTES.md)
# SWIGLU_OUT: rows per unit, 16 gate rows and the 16 up rows of the same outputs (one NVFP4
# block of down_proj's input); a CTA owns whole units
SWIGLU_UNIT = 32
SWIGLU_OUTS = ("scalar", "stacked")


@dataclasses.dataclass(frozen=True)
class NormOut:
    """The NORM_OUT epilogue of a residual W4A4 GEMV (o_proj): besides y = res + x . W^T, the
    next linear's NVFP4 input, quantize_activation(rms_norm(y, norm weight, eps)) with that
    linear's static input scale, written by the last CTA to finish: the bytes of the quantizer
    kernel (`cuda_ops.nvfp4_quant`, prologue "rmsnorm") built with `threads` threads, whose
    mean-square order it repeats.

    Attributes:
        norm_stacked: the norm weight is stacked [L, N] (read at the layer operand), else [N].
        scale_stacked: the next linear's static input scale is stacked [L] (read at the layer
            operand), else one value [1].
        eps: the RMSNorm epsilon.
        threads: the quantizer kernel's threads per CTA (its summation order).
    """

    norm_stacked: bool = False
    scale_stacked: bool = False
    eps: float = 1e-6
    threads: int = 128

    def defines(self) -> dict:
        return {
            "NORM_OUT": 1,
            "NWN_STACK": int(self.norm_stacked),
            "XGN_STACK": int(self.scale_stacked),
            "NORM_THREADS": self.threads,
            "NORM_EPS": f"{float(self.eps)!r}f",
        }


def _ring_depth(base_smem: int, warps: int, rows: int, m: int, want: int | None) -> int:
    """Ring slots per warp: `want`, or by default RING_MAX at M >= RING_MIN_M, else 0 (register
    double buffer). Capped by what fits beside `base_smem`; 0 when fewer than two fit."""
    if want is None:
        want = RING_MAX if m >= RING_MIN_M else 0
    fit = (SMEM_LIMIT - base_smem) // (warps * rows * SLOT_BYTES_PER_ROW)
    depth = min(want, fit)
    return depth if depth >= 2 else 0


def swiglu_unit_rows(n: int, rows: int, grid: int) -> list[np.ndarray]:
    """The SWIGLU_OUT kernel's row order, written out (nvfp4_gemv.cu's u0 / u1 and
    `group_row`): per CTA, the global weight row of each of its local rows, in the order of its
    partial sums. CTA c owns units [c * U / grid, (c + 1) * U / grid) of U = n / 32; a unit's
    groups run through its 16 gate rows, then the 16 up rows of the same outputs (n / 2 on)."""
    per = SWIGLU_UNIT // rows  # row groups per unit
    out = []
    for c in range(grid):
        u0, u1 = c * (n // SWIGLU_UNIT) // grid, (c + 1) * (n // SWIGLU_UNIT) // grid
        order = []
        for g in range(u0 * per, u1 * per):
            unit, sub = divmod(g, per)
            half, part = divmod(sub, per // 2)
            order += [half * (n // 2) + unit * 16 + part * rows + r for r in range(rows)]
        out.append(np.asarray(order, np.int64))
    return out


def check_shape(act: str, m: int, n: int, k: int) -> tuple[bool, str]:
    """(True, "") if the kernel supports this problem, else (False, why)."""
    if act not in ENTRY:
        return False, f"act={act!r} (expected one of {tuple(ENTRY)})"
    if not 1 <= m <= MAX_M:
        return False, f"M={m} tokens (the GEMV handles 1..{MAX_M}; larger M is a GEMM)"
    if n < 1:
        return False, f"N={n} (expected >= 1)"
    if k < K_MULTIPLE or k % K_MULTIPLE:
        return False, f"K={k} (expected a positive multiple of {K_MULTIPLE})"
    p = plan(act, m, n, k)
    if p.smem > SMEM_LIMIT:
        return False, f"M*K={m * k}: staged activations need {p.smem} B of shared memory"
    return True, ""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


STREAM_MAX_M = 4


def plan_stream(
    act: str,
    m: int,
    n: int,
    k: int,
    num_sms: int = DEFAULT_SMS,
    options: GemvOptions = DEFAULT_OPTIONS,
) -> Plan | None:
    """Launch geometry of the streaming variant, or None where it does not apply (M > 4).

    A warp owns R rows and one of KSPLIT K slices and loads all of its CPL chunks per lane at
    once; CPL is capped to bound registers (4 at M <= 2, else 2). KSPLIT (a power of two that
    divides the warps of a CTA) is the smallest meeting that cap, then doubled while the grid
    has fewer than 16 warps per SM and every lane still gets a chunk.
    """
    if m > STREAM_MAX_M:
        return None
    small = m <= 2 if act != "w4a16" else m == 1
    rows = 2 if small and n % 2 == 0 else 1
    if options.rows is not None:
        rows = min(rows, options.rows)
    cpl_max = 4 if small else 2
    nch = k // 32
    threads = options.threads or 256
    ksplit = 1
    while _cdiv(_cdiv(nch, ksplit), 32) > cpl_max:  # chunks per lane
        ksplit *= 2
    threads = max(threads, 32 * ksplit)
    if threads > 1024:
        return None
    warps = threads // 32
    groups = n // rows
    while ksplit * 2 <= warps and groups * ksplit < 16 * num_sms and _cdiv(nch, ksplit * 2) >= 32:
        ksplit *= 2
    gpb = warps // ksplit
    return Plan(
        act=act,
        m=m,
        n=n,
        k=k,
        rows=rows,
        spp=1,
        grid=-(-groups // gpb),
        threads=threads,
        smem=0,
        variant="stream",
        ksplit=ksplit,
    )


# The streaming variant is the default where it measured faster on the H200: M <= 2 and
# layers of at most this many NVFP4 bytes (at M = 1, 7-9 MB layers: 4.8 vs 6.1-6.5 us; at
# 28 MB and above the persistent kernel is as fast or faster).
STREAM_AUTO_MAX_M = 2
STREAM_AUTO_MAX_BYTES = 16 << 20


def plan(
    act: str,
    m: int,
    n: int,
    k: int,
    num_sms: int = DEFAULT_SMS,
    options: GemvOptions = DEFAULT_OPTIONS,
    *,
    gw_rows: bool = False,
) -> Plan:
    """The launch plan. `options.variant` = "auto" (default: stream for M <= 2 and layers of
    at most 16 MiB of NVFP4 bytes, else persistent), "persistent", or "stream" (where it applies,
    M <= 4; else persistent). `gw_rows`: the weight has one global scale per output row."""
    variant = options.variant
    if variant == "auto":
        small = n * k * 9 // 16 <= STREAM_AUTO_MAX_BYTES
        variant = "stream" if m <= STREAM_AUTO_MAX_M and small else "persistent"
    p = plan_stream(act, m, n, k, num_sms, options) if variant == "stream" else None
    if p is None:
        p = plan_persistent(act, m, n, k, num_sms, options)
    return dataclasses.replace(p, gw_rows=bool(gw_rows))


def plan_persistent(
    act: str,
    m: int,
    n: int,
    k: int,
    num_sms: int = DEFAULT_SMS,
    options: GemvOptions = DEFAULT_OPTIONS,
    units: bool = False,
) -> Plan:
    """Launch geometry: one CTA per SM, warps stream R rows x 1024-element K steps.

    R (rows per warp step) trades smem re-reads of x against registers: x is read from shared
    memory once per step for R rows, so R = 4 at larger M; R * M <= 32 keeps the lane reduction
    to one value per lane. K is split into parts inside the CTA so that every warp has work when
    N / #SMs is small. `options.rows` / `options.threads` override (experiments only).
    `units`: the SwiGLU epilogue's plan, each CTA owning whole 32-row units (at most N / 32
    CTAs), with the plain plan's R and K steps per part, so each row's sum is the plain
    kernel's, in the same order.
    """
    # W4A4 at M > 2: R = 2 rows and 512 threads measured faster than R = 4 and 256 threads
    # (two warps per scheduler more to hide the dp4a chains; M = 8: 0.69-0.92x the time)
    rmax = 4 if act != "w4a16" and m <= 2 else 2
    if options.rows is not None:
        rmax = options.rows
    rmax = min(rmax, max(1, 32 // m))
    rows = next(r for r in (8, 4, 2, 1) if r <= rmax and n % r == 0)
    threads = options.threads or (512 if act != "w4a16" else 256)
    ctas = options.ctas or 1
    groups = n // rows
    grid = min(num_sms * ctas, groups)
    steps = -(-k // 1024)
    gpc = -(-groups // grid)
    warps = threads // 32
    # enough items per CTA for its warps (about 3 each), as few K parts as possible
    kparts = min(steps, max(1, -(-3 * warps // gpc)))
    spp = -(-steps // kparts)
    kparts = -(-steps // spp)
    if units:
        grid = min(grid, n // SWIGLU_UNIT)
    base = _smem(act, m, n, k, rows, grid, kparts, units)
    ring = _ring_depth(base, warps, rows, m, options.ring)
    return Plan(
        act=act,
        m=m,
        n=n,
        k=k,
        rows=rows,
        spp=spp,
        grid=grid,
        threads=threads,
        smem=base + ring * warps * rows * SLOT_BYTES_PER_ROW,
        ring=ring,
        ctas=ctas,
    )


@dataclasses.dataclass(frozen=True, eq=False)
class GemvKernel:
    """A compiled GEMV specialisation and how to launch it."""

    plan: Plan
    entry: str
    ptx: str

    @property
    def n(self) -> int:
        return self.plan.n

    def backend_config(self) -> str:
        """MLIR dictionary text for XLA's `__gpu$xla.gpu.ptx` custom kernel call."""
        p = self.plan
        return ptx_backend_config(
            self.entry,
            escape_mlir(self.ptx),
            grid=(p.grid, 1, 1),
            block=p.threads,
            outputs=range(p.n_inputs, p.n_inputs + p.n_outputs),
            smem=p.smem,
        )

    # -- buffer_callback launch path -------------------------------------------------------

    def launch_callback(self, ctx, out, *args) -> None:
        """`buffer_callback` target: launch on XLA's stream (no sync, no allocation)."""
        self.launch(ctx.stream, [_device_ptr(a) for a in args] + [_device_ptr(out)])

    def launch(self, stream: int, pointers: list[int]) -> None:
        """Launches on `stream` with device pointers (operands, then the bf16 output)."""
        from cuda.bindings import driver

        if self.plan.swiglu_out is not None or self.plan.norm_out is not None:
            raise KernelError(
                f"{self.entry} with swiglu_out / norm_out launches through the PTX call only"
            )
        if len(pointers) != self.plan.n_inputs + 1:
            raise KernelError(f"{self.entry} takes {self.plan.n_inputs + 1} pointers")
        fn = _function(self)
        p = self.plan
        params = (tuple(pointers), tuple(ctypes.c_void_p for _ in pointers))
        _drv_check(
            driver.cuLaunchKernel(fn, p.grid, 1, 1, p.threads, 1, 1, p.smem, stream, params, 0),
            "cuLaunchKernel",
        )


def _device_ptr(buf) -> int:
    iface = getattr(buf, "__cuda_array_interface__", None)
    if iface is None:
        raise KernelError(f"buffer {buf!r} exposes no __cuda_array_interface__")
    return int(iface["data"][0])


def _drv_check(result, what: str):
    status, *values = result
    if int(status) != 0:
        raise KernelError(f"{what} failed: {status!r}")
    return values[0] if len(values) == 1 else tuple(values)


_FUNCTIONS: dict = {}
_LOCK = threading.Lock()


def _function(kernel: GemvKernel):
    """CUfunction of `kernel` in the current CUDA context (module loaded once per context)."""
    from cuda.bindings import driver

    ctx = _drv_check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
    key = (int(ctx), id(kernel))
    entry = _FUNCTIONS.get(key)
    if entry is not None:
        return entry[1]
    with _LOCK:
        if key not in _FUNCTIONS:
            module = _drv_check(driver.cuModuleLoadData(kernel.ptx.encode() + b"\0"), "load")
            fn = _drv_check(
                driver.cuModuleGetFunction(module, kernel.entry.encode()), "cuModuleGetFunction"
            )
            if kernel.plan.smem > 48 * 1024:
                attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                _drv_check(driver.cuFuncSetAttribute(fn, attr, kernel.plan.smem), "smem attr")
            _FUNCTIONS[key] = (module, fn)
            # keep the kernel alive as long as its function is cached (id() key)
            _KEEP.append(kernel)
        return _FUNCTIONS[key][1]


_KEEP: list = []


# ----------------------------------------------------------------------------- build


def _compile_job(
    act: str,
    m: int,
    n: int,
    k: int,
    arch: str,
    num_sms: int,
    options: GemvOptions,
    gw_rows: bool,
    fused: Fused | None,
    residual: bool = False,
    prefetch: Prefetch | None = None,
    swiglu_out: str | None = None,
    norm_out: NormOut | None = None,
):
    """(plan, compile_ptx keyword arguments) of one kernel: everything but the compilation."""
    if swiglu_out is not None:  # the persistent kernel's SwiGLU epilogue, whole units per CTA
        p = plan_persistent(act, m, n, k, num_sms, options, units=True)
        p = dataclasses.replace(p, gw_rows=bool(gw_rows), swiglu_out=swiglu_out)
    else:
        p = plan(act, m, n, k, num_sms, options, gw_rows=gw_rows)
    if act == "w4a4x":
        p = dataclasses.replace(p, fused=fused or PLAIN)
    p = dataclasses.replace(p, residual=residual, prefetch=prefetch, norm_out=norm_out)
    if p.smem > SMEM_LIMIT:
        raise KernelError(f"{act} M={m} N={n} K={k}: needs {p.smem} B of shared memory")
    if p.ctas > 1 and p.ctas * (p.smem + 1024) > SM_SMEM:
        raise KernelError(
            f"{act} M={m} N={n} K={k}: {p.ctas} CTAs per SM need {p.ctas} x {p.smem} B of shared "
            f"memory (an SM has {SM_SMEM} B); use fewer GemvOptions.ctas"
        )
    if options.source is not None:  # experiments only: another revision of the source
        alt = pathlib.Path(options.source)
        if not alt.is_file():
            raise KernelError(
                f"GemvOptions.source={options.source!r}: no such file (expected a kernel .cu)"
            )
        source = alt.read_text()
    else:
        source = read_source(SOURCE)
    extra = tuple(f"-D{name}={value}" for name, value in options.defines)
    return p, {
        "name": SOURCE,
        "defines": p.defines(),
        "arch": arch,
        "options": extra,
        "source": source,
    }


@functools.cache
def _build_cached(
    act: str,
    m: int,
    n: int,
    k: int,
    arch: str,
    num_sms: int,
    options: GemvOptions,
    gw_rows: bool,
    fused: Fused | None,
    residual: bool = False,
    prefetch: Prefetch | None = None,
    swiglu_out: str | None = None,
    norm_out: NormOut | None = None,
):
    p, kw = _compile_job(
        act, m, n, k, arch, num_sms, options, gw_rows, fused, residual, prefetch, swiglu_out,
        norm_out,
    )  # fmt: skip
    ptx = compile_ptx(kw.pop("source"), **kw)
    entry = ENTRY[act]
    entries = ptx_entries(ptx)
    if entries.get(entry) != p.n_inputs + p.n_outputs:
        raise KernelError(f"PTX entry {entry} missing or with wrong parameters: {entries}")
    return GemvKernel(plan=p, entry=entry, ptx=ptx)


def prebuild(
    problems: list[dict],
    *,
    arch: str | None = None,
    num_sms: int | None = None,
    workers: int | None = None,
) -> list[GemvKernel]:
    """Builds many kernels at once: NVRTC runs in `workers` threads (it releases the GIL), each
    kernel exactly as `build` makes it (and cached as `build` caches it).

    Warms the kernels a program will lower (a model's layer shapes at several M) in parallel
    instead of one NVRTC compile per first lowering.

    Args:
        problems: `build` keyword arguments per kernel: act, m, n, k and optionally options,
            gw_rows, fused, residual, prefetch, swiglu_out, norm_out.
        arch, num_sms: as in `build` (None: the present GPU's).
        workers: threads (None: the CPU count, at most 16).

    Returns:
        The kernels, in the order of `problems`.
    """
    import concurrent.futures
    import os

    arch = arch or device_arch()
    num_sms = num_sms or device_sms()
    keys = []
    for prob in problems:
        ok, why = check_shape(prob["act"], prob["m"], prob["n"], prob["k"])
        if not ok:
            raise KernelError(f"unsupported shape {prob}: {why}")
        residual = bool(prob.get("residual", False))
        _check_residual(prob["act"], residual)
        _check_prefetch(prob["act"], prob.get("prefetch"))
        _check_swiglu_out(prob["act"], prob["n"], residual, prob.get("swiglu_out"))
        _check_norm_out(prob["act"], prob["n"], residual, prob.get("swiglu_out"),
                        prob.get("norm_out"))  # fmt: skip
        keys.append((
            prob["act"], prob["m"], prob["n"], prob["k"], arch, num_sms,
            prob.get("options", DEFAULT_OPTIONS), bool(prob.get("gw_rows", False)),
            prob.get("fused"), residual, prob.get("prefetch"), prob.get("swiglu_out"),
            prob.get("norm_out"),
        ))  # fmt: skip
    workers = workers or min(16, os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda key: _build_cached(*key), dict.fromkeys(keys)))
    return [_build_cached(*key) for key in keys]


def build(
    act: str,
    m: int,
    n: int,
    k: int,
    *,
    arch: str | None = None,
    num_sms: int | None = None,
    options: GemvOptions = DEFAULT_OPTIONS,
    gw_rows: bool = False,
    fused: Fused | None = None,
    residual: bool = False,
    prefetch: Prefetch | None = None,
    swiglu_out: str | None = None,
    norm_out: NormOut | None = None,
) -> GemvKernel:
    """Plans and compiles (NVRTC, disk-cached) the kernel for one problem shape.

    Args:
        act, m, n, k: mode ("w4a4" / "w4a16" / "w4a4x": W4A4 reading bf16 activations) and
            problem size (GEMM letters; K is the linear's input width, also for "swiglu").
        arch: `compute_XY` (None: the present GPU's, compute_90 without one).
        num_sms: SM count the plan targets (None: the present GPU's, 132 without one).
        options: kernel choices (defaults: what measured fastest).
        gw_rows: the weight carries one global scale per output row ([L, N]), not per matrix.
        fused: "w4a4x" only: the prologue / epilogue (default `PLAIN`: none, static scale).
        residual: "w4a4" only: the entry takes a bf16 residual res [M, N] after xg and returns
            res + y (-DEPI_RES=1; the bf16 add of XLA, in the epilogue). "w4a4x" has its
            residual in `fused`.
        prefetch: "w4a4" only: L2 prefetch of the weights that run next (`Prefetch`; its
            targets' codes and scales are operands after `layer`). None: none (the kernel
            without it, bit for bit the same PTX as before the option existed).
        swiglu_out: "w4a4" only, a gate_up_proj (y = [gate | up], N a multiple of 32): None
            (y), or the persistent kernel's SwiGLU epilogue, which writes down_proj's NVFP4
            input instead (codes [M, N/4], E4M3 scales [M, N/32], global scale [M]) with its
            static input scale, an operand after `layer` (and the prefetch operands): "scalar"
            ([1]) or "stacked" ([L], read at the layer). No residual; PTX launch only.
        norm_out: "w4a4" with residual only (o_proj): None, or a `NormOut`: the last CTA
            also writes the next linear's NVFP4 input, quantize_activation(rms_norm(y)) with
            its static scale (codes [M, N/2], E4M3 scales [M, N/16], global scale [M], after y).
            Extra operands after `layer` (and the prefetch operands): the norm weight
            [(L,) N] (read at the layer) and the scale ([1], or [L] with
            `NormOut.scale_stacked`). N a multiple of 256; PTX launch only.

    Raises KernelError when NVRTC is missing, the GPU arch is too old, or the shape is
    unsupported.
    """
    ok, why = check_shape(act, m, n, k)
    if not ok:
        raise KernelError(f"unsupported shape: {why}")
    if not isinstance(options, GemvOptions):
        raise KernelError(f"options must be a GemvOptions, got {type(options).__name__}")
    if fused is not None and act != "w4a4x":
        raise KernelError(f"fused= is only for act='w4a4x', got act={act!r}")
    _check_residual(act, residual)
    _check_prefetch(act, prefetch)
    _check_swiglu_out(act, n, residual, swiglu_out)
    _check_norm_out(act, n, residual, swiglu_out, norm_out)
    arch = arch or device_arch()
    return _build_cached(
        act, m, n, k, arch, num_sms or device_sms(), options, bool(gw_rows), fused, bool(residual),
        prefetch, swiglu_out, norm_out,
    )  # fmt: skip


def _check_norm_out(act: str, n: int, residual: bool, swiglu_out, norm_out) -> None:
    if norm_out is None:
        return
    if not isinstance(norm_out, NormOut):
        raise KernelError(f"norm_out must be a NormOut or None, got {type(norm_out).__name__}")
    if act != "w4a4" or not residual or swiglu_out is not None:
        raise KernelError(
            f"norm_out is for the residual W4A4 GEMV (act='w4a4', residual=True, no swiglu_out); "
            f"got act={act!r}, residual={residual}, swiglu_out={swiglu_out!r}"
        )
    if n % 256:
        raise KernelError(f"norm_out: N={n} must be a multiple of 256 (the quantizer kernel's K)")
    t = norm_out.threads
    if t <= 0 or t % 32 or t > 1024:
        raise KernelError(f"norm_out threads={t}: expected a multiple of 32 in [32, 1024]")


def _check_swiglu_out(act: str, n: int, residual: bool, swiglu_out) -> None:
    if swiglu_out is None:
        return
    if swiglu_out not in SWIGLU_OUTS:
        raise KernelError(f"swiglu_out={swiglu_out!r}, expected None or one of {SWIGLU_OUTS}")
    if act != "w4a4":
        raise KernelError(f"swiglu_out is only for act='w4a4' (the plain W4A4 GEMV), got {act!r}")
    if n % SWIGLU_UNIT:
        raise KernelError(
            f"swiglu_out: N={n} must be a multiple of {SWIGLU_UNIT} (gate and up halves of whole "
            "16-element blocks)"
        )
    if residual:
        raise KernelError("swiglu_out has no residual epilogue (residual=True)")


def _check_prefetch(act: str, prefetch) -> None:
    if prefetch is None:
        return
    if not isinstance(prefetch, Prefetch):
        raise KernelError(f"prefetch={prefetch!r}, expected None or a Prefetch")
    if act != "w4a4":
        raise KernelError(f"prefetch is only for act='w4a4' (the plain W4A4 GEMV), got {act!r}")


def _check_residual(act: str, residual) -> None:
    if not isinstance(residual, bool):
        raise KernelError(f"residual={residual!r}, expected a bool")
    if residual and act != "w4a4":
        where = "Fused(residual=True)" if act == "w4a4x" else "no residual epilogue"
        raise KernelError(f"residual=True is only for act='w4a4', got act={act!r} ({where})")


def probe_ptx_launch(call) -> None:
    """Runs one tiny GEMV through the PTX custom call and checks it against the reference.

    `call(args, act=..., n=..., k=..., impl=..., launch=...)` binds the primitive. Raises if the
    launch fails or gives a wrong answer, so the caller can fall back to `buffer_callback`.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    m, n, k = 1, 64, 256
    rng = np.random.default_rng(0)
    xp = jnp.asarray(rng.integers(0, 256, (m, k // 2), dtype=np.uint8))
    xs = jnp.full((m, k // 16), 0x38, jnp.uint8)  # E4M3 1.0
    wp = jnp.asarray(rng.integers(0, 256, (n, k // 2), dtype=np.uint8))
    ws = jnp.full((n, k // 16), 0x38, jnp.uint8)
    xg = jnp.ones((m,), jnp.float32)
    wg = jnp.ones((), jnp.float32)
    layer = jnp.zeros((), jnp.int32)
    args = (xp, xs, xg, wp, ws, wg, layer)
    kw = {"act": "w4a4", "n": n, "k": k}
    got = jax.jit(lambda *a: call(a, impl="cuda", launch="ptx", **kw))(*args)
    want = jax.jit(lambda *a: call(a, impl="ref", launch="ptx", **kw), backend="cpu")(
        *jax.device_put(args, jax.devices("cpu")[0])
    )
    if not np.array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32)):
        raise KernelError("PTX custom call gave a wrong result in the probe")
