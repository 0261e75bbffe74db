"""Host side of the NVFP4 W4A4 tensor-core GEMM (`nvfp4_gemm.cu`): options, plan, build, launch.

GEMM letters: M tokens, N out features, K in features. The kernel serves the M above the GEMV's
range (decode batches > 8, prefill); which one runs is decided in `rejax.ops.linear`. Nothing here
imports cuda-python at module import; NVRTC and the driver are reached only by `build` and the
launch methods.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import pathlib
import threading
from typing import ClassVar

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
from cuda_ops.nvfp4_gemv import (
    SMEM_LIMIT,
    _cdiv,
    _device_ptr,
    _drv_check,
)

__all__ = [
    "DEFAULT_OPTIONS",
    "ENTRY",
    "FINISH_ENTRY",
    "GemmKernel",
    "GemmOptions",
    "GemmPlan",
    "KernelError",
    "build",
    "check_shape",
    "plan",
    "prebuild",
]

SOURCE = "nvfp4_gemm.cu"
ENTRY = "nvfp4_gemm_w4a4"
# operands: x_hat fp16 [M, K] (permuted), xg f32 [M], wp, ws, wg (stacked or not), layer int32 [];
# then the output (bf16 [M, N], or float32 partial sums [SPLITK, M, N])
N_INPUTS = 6
# the split-K epilogue: (partials, xg, wg, layer), then y bf16 [M, N]
FINISH_ENTRY = "nvfp4_gemm_finish"
FINISH_INPUTS = 4
# built with `residual=True` (-DEPI_RES=1) both entries take res bf16 [M, N] right after xg and
# store res + y: (x_hat, xg, res, wp, ws, wg, layer) and (partials, xg, res, wg, layer)
FINISH_THREADS = 256
KTS = (128, 256)
# The default KT where "fill" plans is 256 for tiles of at most this many tokens (K a multiple
# of 256): on the H200
# (`bench_gemm.py --variants gemm,gemm_kt256`, experiments/results/h200_r/) KT 256 took 9.5%,
# 9.1%, 12.6% and 12.6% off the four Qwen3-8B shapes at M = 16 (geomean x bf16 1.91 against
# 1.70) and lost at M = 32 and 64, where its larger stages leave fewer of them.
KT256_MAX_TM = 16
REDUCES = ("finish", "cluster")
# How the plan fills the GPU at small M (see `plan`): "base" (about two CTAs per SM, the K split
# capped by the partials' traffic) or "wide" (for M <= 64: 64-row weight tiles up to M = 16 and
# a K split aimed at four CTAs per SM, no traffic cap). "wide" picks about the winners of the
# occupancy sweep on the H200 (experiments/results/h200_e/: geomean x bf16 over the four
# Qwen3-8B shapes about 1.9 / 1.6 / 1.5 / 1.2 at M = 8 / 16 / 32 / 64, against 1.82 / 1.34 /
# 1.50 / 1.03 for "base"); the 36-layer NVFP4 decode measured 4.428 against 4.674 ms/token at
# batch 8 (experiments/results/h200_f/).
# "fill" (M <= 64) balances the grid over the SMs: Nsight Compute on the H200
# (experiments/results/h200_p/) found the "wide" plan of the M = 64 gate_up GEMM at 2 resident
# CTAs per SM, held there by its 89 KB of pipeline stages (registers allow 3), with a grid of
# 2.18 waves: 12.5% occupancy, 0.58 eligible warps per scheduler, DRAM 23% busy. "fill" takes
# the K split that minimises a balance model of the time (`fill_splitk`), then the deepest
# pipeline (2..4 stages) that keeps each SM's CTAs resident at once (`ctas_per_sm`); below
# FILL_MIN_M rows it plans as "wide". It is the default: kernel alone, geomean x bf16 over the
# four Qwen3-8B shapes 1.65 / 1.66 / 1.27 at M = 16 / 32 / 64 ("wide" 1.70 / 1.51 / 1.19), and
# the 36-layer NVFP4 decode 4.259 / 7.118 ms/token at batch 16 / 64 against 4.669 / 7.520 for
# "wide" (one call, experiments/results/h200_p/); its GPU tests pass.
# "fill16" is "fill" with every M below 16 planned as M = 16 (a 16-token tile, the rows past M
# masked): inside the 8-layer decode step on an H100 the four 8-row GEMMs took 18.2 us a launch
# against 14.5 for 16 rows, though kernel alone they take the same time
# (experiments/results/h100_s34/). It is the default since the thirty-sixth session: the
# 36-layer NVFP4 decode at batch 8 (1024 new tokens, one process on an H100) measured 3.733
# against 4.341 ms/token for "fill" (bf16 6.294), and the 8-layer profile's GEMMs 59.5 against
# 76.3 us a layer (experiments/results/fill16_prefill_h100/); from 16 rows on it is "fill".
OCCUPANCIES = ("base", "wide", "fill", "fill16")
FILL16_M = 16
# Hopper per-SM limits the "fill" plan counts resident CTAs with (sm_90: 228 KB of shared
# memory, 1 KB of it reserved per CTA; 64K registers, allocated per warp in units of 256)
SM_SMEM = 228 * 1024
CTA_SMEM_RESERVED = 1024
SM_REGS = 65536
SM_THREADS = 2048
# How a fused linear (rejax.ops.fused_linear, kernels "two") quantizes its activations for this
# GEMM: "xla" (up to the GEMV's 8 rows the quantizer kernel's codes, above them XLA's prologue
# and quantize_activation; then gemm_x_operand's fp16 x_hat as XLA ops) or "kernel" (the
# quantizer kernel's x_hat form writes the GEMM's operand itself: one launch, no XLA op on the
# activations). "kernel" measured faster on the H200 (8-layer Qwen3-8B decode at batch 64:
# 2.112 against 2.346 ms/token, the 24 XLA fusions per layer gone; experiments/results/h200_m/),
# and is the default (GemmOptions.x_quant).
X_QUANTS = ("xla", "kernel")
# how a fused linear in front of the wgmma GEMM builds its x_hat stage tiles: the same two
# (the quantizer kernel's "xhat_tiles" form the default, GemmOptions.wgmma_x_quant)
WGMMA_X_QUANTS = ("xla", "kernel")
# How the dot path hands the activations' bf16 values to its dot: "fused" (XLA may fuse their
# decode from codes and scales into the GEMM, e.g. a Triton GEMM that decodes them again for
# every output tile), "materialized" (behind an optimization barrier: written once, the dot
# alone, as bf16's) or "kernel" (a fused linear's quantizer kernel writes them, its
# "xhat_bf16" form: no XLA op on the activations; plain linears as "materialized"). A profile
# of the 8-layer prefill at 4096 rows (H100) showed three of the four linears as XLA GEMM
# fusions taking 1171 us a layer where bf16's cuBLAS dots take 828. "kernel" is the default:
# the 36-layer 512-token prefill at batch 8 took 154.7 ms against 163.7 ("fused") and 164.0
# ("materialized"), bf16 133.7 (H100, experiments/results/dot_x_h100/).
DOT_XS = ("fused", "materialized", "kernel")
# Where the dot path's dequantizer kernel runs: "main" (XLA's compute stream, in the order of
# its program: the weight's decode right before its dot) or "side" (its call marked for XLA's
# stream 1, `compute_on("gpu_stream:1")`, so that the decode, which depends on the weights and
# the layer index only, might run beside an earlier dot). "side" measured slower: JAX 0.11.2's
# XLA emits no async start / done pair for it and the batch-8 prefill took 153.8 against
# 152.3 ms (experiments/stream_overlap_probe.py, experiments/results/dot_finish_h100_s44/).
DOT_STREAMS = ("main", "side")
# GemmOptions.wgmma_tm: the wgmma GEMM's token tile, or "auto" (per shape)
WGMMA_TMS = (128, 256, "auto")
# How the dot path (above `max_m` rows) forms the weight's bf16 values e2m1 * SFw: "xla" (XLA's
# fusions of `rejax.nvfp4._scaled_values`) or "kernel" (`cuda_ops.nvfp4_dequant`: one launch
# that reads a stacked weight in place). The same bytes. Inside the 36-layer prefill the dot
# path's decode costs about as much as the dot itself at 512 rows (experiments/DECODE_NOTES.md,
# thirty-sixth session); "kernel" is opt-in until measured.
DOT_DEQUANTS = ("xla", "kernel")
WIDE_WR1_MAX_M = 16
MAX_TM = 64  # tokens per warp (8 mma tiles)
MAX_SPLITK = 8
DEFAULT_MIN_M = 8  # the GEMV handles M <= 7
# Above this M (prefill), outside the wgmma range (`DEFAULT_WGMMA_MIN_M` .. `DEFAULT_WGMMA_MAX_M`,
# tried first), `nvfp4_linear`'s "auto" dispatch takes the dot reference (the weight
# dequantized to bf16, one cuBLAS dot) instead of the GEMM: kernel alone at M = 256 the GEMM is
# 0.51x bf16 (experiments/results/h200_c/), about the dequantization's cost, and the 512-token
# prefill of the 36-layer model measured 41.0 / 275 ms (GEMM, batch 1 / 8) against 34.1 / 163 ms
# (dot) (experiments/results/h200_e/, h200_f/).
DEFAULT_MAX_M = 256
# The rows that take the warpgroup-MMA GEMM (cuda_ops.nvfp4_gemm_wgmma, sm_90) by default. Kernel
# alone on an H100 (four Qwen3-8B shapes, experiments/results/wgmma_bulk_h100/): against this
# GEMM 1.01x at M = 64, 1.95x at 128, 1.91x at 256; against the dot path (the dequantizer and a
# bf16 dot) 1.08 / 1.00 / 0.83 / 0.77x bf16 against 0.59 / 0.74 / 0.76 / 0.86x at M = 512 /
# 1024 / 2048 / 4096.
DEFAULT_WGMMA_MIN_M = 128
DEFAULT_WGMMA_MAX_M = 2048
DEFAULT_W_SHIFT = 7  # decoded weights carry 2^(W_SHIFT - 14): see nvfp4_gemm.cu's numerics
# How a stage's global -> shared copies are written (nvfp4_gemm.cu, STATIC_COPIES): "loop"
# (loops whose trip count depends on the thread: they do not unroll, about 19 instructions a
# 16-byte copy), "static" (compile-time trip counts: unrolled, no bounds checks where N or M is
# a multiple of the tile; the kernel then takes __maxnreg__ at the most registers that keep the
# plan's resident CTAs, `max_registers`) or "auto" (static from STATIC_MIN_TM-token tiles on).
# Kernel alone on the H200 (experiments/results/h200_x/gemm_xor.json, the four Qwen3-8B shapes,
# every output bitwise equal): static took the geomean from 2.02 / 1.67 / 1.24x bf16 to 2.27 /
# 1.82 / 1.34x at M = 16 / 32 / 64 (every shape faster; an H100 agreed, h100_a/) and lost at
# M = 8 (2.17 -> 1.96x), though its stage there executes 218 instructions against 561 and no
# register cap binds (54 registers): why is open (experiments/KERNEL_NOTES.md). The 36-layer
# decode: 3.64 / 7.31 ms/token at batch 16 / 64 against 3.99 / 7.52 with the loops.
COPIES = ("auto", "loop", "static")
STATIC_MIN_TM = 16


@dataclasses.dataclass(frozen=True)
class GemmOptions:
    """Kernel choices, passed explicitly (never read from the environment). None: the plan's.

    Attributes:
        min_m: the smallest M (after folding leading dims) that `nvfp4_linear` sends to this
            GEMM; below it the GEMV runs (the dispatch's crossover, chosen by measurement).
        max_m: the largest M that the "auto" dispatch sends to this GEMM; above it the dot
            reference runs (faster there, `DEFAULT_MAX_M`). None: no bound. impl="cuda" takes
            the GEMM at any M it supports.
        tm: tokens per CTA tile (a multiple of 8 * wm, at most 64 * wm).
        wm: warps along M (splitting the CTA's tokens; each decodes its weight rows).
        wr: 16-row weight tiles per warp.
        warps: warps per CTA (warps / wm along N).
        kt: K elements per pipeline stage (128 or 256; None: where "fill" plans (9 <= M), 256
            for tiles of <= 16 tokens when K is a multiple of 256, else 128, `KT256_MAX_TM`).
        stages: cp.async pipeline depth (>= 2).
        splitk: K split across CTAs (1..8).
        split_m: plan the K split (when `splitk` is None) as for this many rows instead of M:
            every M that runs with the same split_m then adds each output's K in the same
            split order, so a row's result does not depend on how many rows run with it
            (the K order inside a split never depends on the tiles along M). Slot decoding
            that moves rows into smaller programs sets it to its slot count.
        reduce: how a K split meets: "finish" (float32 partials in a workspace, added in split
            order by a second small kernel) or "cluster" (the split's CTAs form a thread-block
            cluster and add their partials through distributed shared memory: one kernel).
        w_shift: the decoded fp16 weights are e2m1 x SFw x 2^(w_shift - 14) (0..7, exact for
            all; larger keeps more of them out of the fp16 subnormal range).
        occupancy: how the plan chooses wr, stages and splitk when they are None: "base",
            "wide", "fill" or "fill16" (the default: "fill", M < 16 planned as 16 rows)
            (`OCCUPANCIES`).
        x_quant: how a fused linear in front of this GEMM quantizes its activations: "kernel"
            (the default: the quantizer kernel writes the GEMM's x_hat operand) or "xla" (XLA's
            quantizer and `gemm_x_operand` fusions) (`X_QUANTS`); the GEMM itself is the same.
        copies: how a stage's copies are written: "auto" (the default: "static" for tiles of
            >= STATIC_MIN_TM tokens, else "loop"), "loop" or "static" (`COPIES`).
        max_regs: registers per thread at most, as `__maxnreg__` (a multiple of 8 in 24..248),
            0 for no cap (`__launch_bounds__(threads)`), or None (the default: with the static
            copies the most that keep the plan's resident CTAs, `max_registers`; else no cap).
        wgmma_min_m, wgmma_max_m: W4A4 linears of wgmma_min_m .. wgmma_max_m rows run the
            warpgroup-MMA GEMM (`cuda_ops.nvfp4_gemm_wgmma`, sm_90: `wgmma_tm`-token tiles,
            each weight decoded once per tile, the stage copies on mbarriers) instead of this
            GEMM or, above `max_m`, the dot. Defaults 128 and 2048 (`DEFAULT_WGMMA_MIN_M`, the
            measured crossovers); wgmma_min_m None: never; wgmma_max_m None: no bound. Off
            sm_90, or where the kernel cannot be built, the usual dispatch runs (a warning
            only for a range other than the default).
        wgmma_tm: that GEMM's token tile, "auto" (the default: per shape,
            `nvfp4_gemm_wgmma.auto_tm`, 256 where it fills whole waves without a K split;
            512-token prefill at batch 1 23.2 against 24.4 ms with 128 on an H100), 128 or 256.
        wgmma_raster: the order that GEMM's CTAs take their tiles (`nvfp4_gemm_wgmma.
            raster_tiles`): 0 (the default: the grid's), or groups of that many token tiles
            (an experiment for thousands of rows; the same tiles and bits; at 4096 rows on an
            H100 0.95x against 0.90x jitted bf16 kernel alone, groups of 4 at 256 tokens).
        wgmma_x_quant: how a fused linear in front of the wgmma GEMM builds its x_hat stage
            tiles: "kernel" (the default: the quantizer kernel's "xhat_tiles" form writes them;
            36-layer prefill of 512 tokens 24.3 against 26.2 ms at batch 1 on an H100) or
            "xla" (XLA's prologue and quantizer, `wgmma_x_operand`, `to_stage_tiles`)
            (`WGMMA_X_QUANTS`).
        dot_dequant: how the dot path above `max_m` rows decodes the weight to bf16:
            "kernel" (the default: the dequantizer kernel; 512-token prefill 29.6 against
            31.2 ms at batch 1 on an H100) or "xla" (XLA's fusions) (`DOT_DEQUANTS`).
        dot_x: how the dot path with the dequantizer kernel takes the activations' bf16
            values: "kernel" (the default: a fused linear's quantizer kernel writes them;
            plain linears as "materialized"; 512-token prefill at batch 8 154.7 against 163.7
            ms for "fused" on an H100), "fused" (XLA may fuse their decode into its GEMM) or
            "materialized" (an optimization barrier: written once, then the dot alone)
            (`DOT_XS`).
        dot_stream: where the dot path's dequantizer kernel runs: "main" (the default, the
            compute stream) or "side" (XLA's stream 1, so that it may overlap an earlier dot)
            (`DOT_STREAMS`). The same bytes.
        source: path of another revision of the kernel source (experiments only).
        defines: extra (name, value) -D constants (experiments only).
    """

    min_m: int = DEFAULT_MIN_M
    max_m: int | None = DEFAULT_MAX_M
    tm: int | None = None
    wm: int | None = None
    wr: int | None = None
    warps: int | None = None
    kt: int | None = None
    stages: int | None = None
    splitk: int | None = None
    split_m: int | None = None
    reduce: str = "finish"
    w_shift: int = DEFAULT_W_SHIFT
    occupancy: str = "fill16"
    x_quant: str = "kernel"
    copies: str = "auto"
    max_regs: int | None = None
    wgmma_min_m: int | None = DEFAULT_WGMMA_MIN_M
    wgmma_max_m: int | None = DEFAULT_WGMMA_MAX_M
    wgmma_tm: int | str = "auto"
    wgmma_raster: int = 0
    wgmma_x_quant: str = "kernel"
    dot_dequant: str = "kernel"
    dot_x: str = "kernel"
    dot_stream: str = "main"
    source: str | None = None
    defines: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        if not isinstance(self.w_shift, int) or not 0 <= self.w_shift <= 7:
            raise KernelError(f"GemmOptions.w_shift={self.w_shift!r}, expected an int in 0..7")
        if self.reduce not in REDUCES:
            raise KernelError(f"GemmOptions.reduce={self.reduce!r}, expected one of {REDUCES}")
        if self.x_quant not in X_QUANTS:
            raise KernelError(f"GemmOptions.x_quant={self.x_quant!r}, expected one of {X_QUANTS}")
        if self.copies not in COPIES:
            raise KernelError(f"GemmOptions.copies={self.copies!r}, expected one of {COPIES}")
        if self.max_regs is not None and (
            not isinstance(self.max_regs, int)
            or not (self.max_regs == 0 or (24 <= self.max_regs <= 248 and self.max_regs % 8 == 0))
        ):
            raise KernelError(
                f"GemmOptions.max_regs={self.max_regs!r}, expected None, 0 or a multiple of 8 "
                "in 24..248"
            )
        if self.occupancy not in OCCUPANCIES:
            raise KernelError(
                f"GemmOptions.occupancy={self.occupancy!r}, expected one of {OCCUPANCIES}"
            )
        if not isinstance(self.min_m, int) or self.min_m < 1:
            raise KernelError(f"GemmOptions.min_m={self.min_m!r}, expected an int >= 1")
        if self.wgmma_min_m is not None and (
            not isinstance(self.wgmma_min_m, int) or self.wgmma_min_m < 1
        ):
            raise KernelError(
                f"GemmOptions.wgmma_min_m={self.wgmma_min_m!r}, expected None or an int >= 1"
            )
        low = self.wgmma_min_m or 1
        if self.wgmma_max_m is not None and (
            not isinstance(self.wgmma_max_m, int) or self.wgmma_max_m < low
        ):
            raise KernelError(
                f"GemmOptions.wgmma_max_m={self.wgmma_max_m!r}, expected None or an int >= "
                f"wgmma_min_m={self.wgmma_min_m}"
            )
        if self.dot_x not in DOT_XS:
            raise KernelError(f"GemmOptions.dot_x={self.dot_x!r}, expected one of {DOT_XS}")
        if self.dot_stream not in DOT_STREAMS:
            raise KernelError(
                f"GemmOptions.dot_stream={self.dot_stream!r}, expected one of {DOT_STREAMS}"
            )
        if self.dot_dequant not in DOT_DEQUANTS:
            raise KernelError(
                f"GemmOptions.dot_dequant={self.dot_dequant!r}, expected one of {DOT_DEQUANTS}"
            )
        if self.wgmma_x_quant not in WGMMA_X_QUANTS:
            raise KernelError(
                f"GemmOptions.wgmma_x_quant={self.wgmma_x_quant!r}, expected one of "
                f"{WGMMA_X_QUANTS}"
            )
        if self.wgmma_tm not in WGMMA_TMS:
            raise KernelError(
                f"GemmOptions.wgmma_tm={self.wgmma_tm!r}, expected one of {WGMMA_TMS}"
            )
        if (
            not isinstance(self.wgmma_raster, int)
            or isinstance(self.wgmma_raster, bool)
            or self.wgmma_raster < 0
        ):
            raise KernelError(
                f"GemmOptions.wgmma_raster={self.wgmma_raster!r}, expected an int >= 0"
            )
        if self.split_m is not None and (not isinstance(self.split_m, int) or self.split_m < 1):
            raise KernelError(f"GemmOptions.split_m={self.split_m!r}, expected None or an int >= 1")
        if self.max_m is not None and (not isinstance(self.max_m, int) or self.max_m < self.min_m):
            raise KernelError(
                f"GemmOptions.max_m={self.max_m!r}, expected None or an int >= min_m={self.min_m}"
            )
        checks = {
            "tm": lambda v: v % 8 == 0 and 8 <= v <= 4 * MAX_TM,
            "wm": lambda v: 1 <= v <= 4,
            "wr": lambda v: 1 <= v <= 4,
            "warps": lambda v: 1 <= v <= 16,
            "kt": lambda v: v in KTS,
            "stages": lambda v: 2 <= v <= 8,
            "splitk": lambda v: 1 <= v <= MAX_SPLITK,
        }
        expect = {
            "tm": f"a multiple of 8 in 8..{4 * MAX_TM}",
            "wm": "1..4",
            "wr": "1..4",
            "warps": "1..16",
            "kt": f"one of {KTS}",
            "stages": "2..8",
            "splitk": f"1..{MAX_SPLITK}",
        }
        for name, ok in checks.items():
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not ok(value)):
                raise KernelError(f"GemmOptions.{name}={value!r}, expected None or {expect[name]}")


DEFAULT_OPTIONS = GemmOptions()


@dataclasses.dataclass(frozen=True)
class GemmPlan:
    """Compile-time launch geometry for one (M, N, K)."""

    m: int
    n: int
    k: int
    tm: int
    wm: int
    wr: int
    warps: int
    kt: int
    stages: int
    splitk: int
    reduce: str = "finish"
    w_shift: int = DEFAULT_W_SHIFT
    gw_rows: bool = False
    residual: bool = False  # res [M, N] operand after xg of both entries, y = res + y
    static_copies: bool = False  # STATIC_COPIES
    max_regs: int = 0  # > 0: __maxnreg__(max_regs) instead of __launch_bounds__

    @property
    def n_inputs(self) -> int:
        """Operands of the GEMM entry before its output."""
        return N_INPUTS + int(self.residual)

    @property
    def finish_inputs(self) -> int:
        """Operands of the split-K epilogue entry before its output."""
        return FINISH_INPUTS + int(self.residual)

    @property
    def partials(self) -> bool:
        """The kernel writes float32 partials [splitk, M, N] for the finish kernel."""
        return self.splitk > 1 and self.reduce == "finish"

    @property
    def tile_n(self) -> int:
        return 16 * self.wr * (self.warps // self.wm)

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def grid(self) -> tuple[int, int, int]:
        return (_cdiv(self.m, self.tm), _cdiv(self.n, self.tile_n), self.splitk)

    @property
    def stage_bytes(self) -> int:
        return self.tile_n * (self.kt // 2 + self.kt // 16) + self.tm * (2 * self.kt + 64)

    @property
    def smem(self) -> int:
        red = self.tm * (self.tile_n + 4) * 4 if self.splitk > 1 and self.reduce == "cluster" else 0
        return max(self.stages * self.stage_bytes, red)

    @property
    def out_shape(self) -> tuple[int, ...]:
        return (self.splitk, self.m, self.n) if self.partials else (self.m, self.n)

    def defines(self) -> dict:
        # EPI_RES, STATIC_COPIES and MAX_REGS only when set: the kernels without them keep
        # their cache keys
        extra = {"EPI_RES": 1} if self.residual else {}
        if self.static_copies:
            extra["STATIC_COPIES"] = 1
        if self.max_regs:
            extra["MAX_REGS"] = self.max_regs
        return extra | {
            "M_TOK": self.m,
            "N_OUT": self.n,
            "K_IN": self.k,
            "TM": self.tm,
            "WM": self.wm,
            "WR": self.wr,
            "NWARPS": self.warps,
            "KT": self.kt,
            "STAGES": self.stages,
            "SPLITK": self.splitk,
            "CLUSTER_RED": int(self.splitk > 1 and self.reduce == "cluster"),
            "SMEM_BYTES": self.smem,
            "W_SHIFT": self.w_shift,
            "GW_ROWS": int(self.gw_rows),
        }


# Split-K writes SPLITK x M x N float32 partials; keep them under this fraction of the weight
# bytes (0.5625 per weight), so splitting never costs more traffic than it hides latency.
SPLIT_TRAFFIC = 0.25


# ptxas's registers per thread of the main kernel (sm_90, NVRTC 13.0-13.5) by its accumulator
# floats per thread (wr * tm / 2): (tm, wr) = (8, 1), (16, 1), (32, 2), (64, 2)
_REGISTERS_BY_ACC = ((4, 80), (8, 82), (32, 128), (64, 168))


def est_registers(tm: int, wr: int) -> int:
    """Registers per thread the GEMM's main kernel takes, estimated from its accumulators
    (wr * tm / 2 floats per thread) by interpolating ptxas's reports (`_REGISTERS_BY_ACC`;
    beyond the table the last slope), rounded up to the allocation unit of 8."""
    acc = wr * tm / 2
    pts = _REGISTERS_BY_ACC
    if acc <= pts[0][0]:
        est = pts[0][1]
    else:
        (a0, r0), (a1, r1) = next(
            ((p, q) for p, q in itertools.pairwise(pts) if acc <= q[0]), (pts[-2], pts[-1])
        )
        est = r0 + (r1 - r0) * (acc - a0) / (a1 - a0)
    return min(255, _cdiv(math.ceil(est), 8) * 8)


def max_registers(smem: int, threads: int, tm: int, wr: int) -> int:
    """The most registers per thread (a multiple of 8, <= 248) at which a kernel of this shared
    memory and block size keeps the resident CTAs per SM that the plan counts on (those of
    `est_registers(tm, wr)`)."""
    want = ctas_per_sm(smem, threads, est_registers(tm, wr))
    fits = [
        r
        for r in range(24, 256, 8)
        if ctas_per_sm(smem, threads, r) >= want and r * threads <= SM_REGS
    ]
    if not fits:
        raise KernelError(f"no register count keeps {want} CTAs of {threads} threads per SM")
    return max(fits)


def ctas_per_sm(smem: int, threads: int, registers: int) -> int:
    """Resident CTAs per SM of a kernel with this shared memory, block size and registers per
    thread on sm_90 (the smallest of the shared-memory, register-file and thread limits)."""
    by_smem = SM_SMEM // (smem + CTA_SMEM_RESERVED)
    per_warp = _cdiv(registers * 32, 256) * 256
    by_regs = SM_REGS // (per_warp * _cdiv(threads, 32))
    return max(1, min(by_smem, by_regs, SM_THREADS // threads, 32))


# The balance model of `fill_splitk`, fitted on the H200 (experiments/results/h200_p/): the
# GEMM is bound by each SM's instruction stream (weight decode and mma.sync), so its time is
# that of the SM with the most CTAs, ceil(CTAs / SMs), each CTA's share of the weight bytes
# (0.5625 per weight) taking 1 / FILL_SM_RATE seconds per byte; an SM with a single CTA runs it
# no faster than two (one CTA's 4 warps cannot hide their latencies). A split (s > 1) adds the
# float32 partials (8 * M * N bytes per split: written, then read by the finish kernel) at
# FILL_BANDWIDTH and the finish kernel's FILL_FINISH_S. For the M = 64 gate_up GEMM (24576 x
# 4096) at K splits 3 / 2 / 1 the model gives 67.4 / 58.3 / 65.5 us, and the kernels (with their
# finish kernel) measured 66.9 / 55.7 / 65.5 us.
FILL_SM_RATE = 9e9
# Below this M "fill" plans as "wide": at M = 8 the kernel is latency bound, not SM bound, and the
# balance model's smaller splits measured slower (4096 x 12288: 20.2 against 16.4 us).
FILL_MIN_M = 9
FILL_BANDWIDTH = 3.5e12
FILL_FINISH_S = 2e-6


def fill_splitk(m: int, n: int, k: int, tiles: int, num_sms: int, max_split: int) -> int:
    """The K split (1..max_split) that minimises the balance model (see FILL_SM_RATE) of the
    GEMM's time: with s splits, tiles * s CTAs over `num_sms` SMs. Ties go to the smaller
    split."""
    weights = 0.5625 * n * k

    def cost(s: int) -> float:
        ctas = tiles * s
        t = max(_cdiv(ctas, num_sms), 2) * weights / ctas / FILL_SM_RATE
        if s > 1:
            t += 8.0 * m * n * s / FILL_BANDWIDTH + FILL_FINISH_S
        return t

    return min(range(1, max(1, max_split) + 1), key=lambda s: (cost(s), s))


def plan(
    m: int,
    n: int,
    k: int,
    num_sms: int = DEFAULT_SMS,
    options: GemmOptions = DEFAULT_OPTIONS,
    *,
    gw_rows: bool = False,
) -> GemmPlan:
    """The launch plan: M tiles of up to 64 tokens (grid x; M rounded up to 8), 4 warps along N
    of 2 x 16 weight rows each (128-row weight tiles, grid y): with x_hat at 2 bytes and weights
    at 0.56 bytes per element, a tall weight tile re-reads x_hat least often per MAC. K runs in
    128-element stages through a 3-4 deep cp.async pipeline, split across CTAs (grid z) when the
    tiles alone would leave SMs idle (about two CTAs per SM wanted) and the float32 partials
    stay small next to the weights. `options.wm` = 2 puts two warps along M (8 warps, 128-token
    tiles of 64-row weight tiles by default: more warps per SM, more x_hat traffic).
    `options.occupancy` = "wide" (M <= 64) takes 64-row weight tiles up to M = 16 and aims the K
    split at about four CTAs per SM without the traffic cap. "fill" (9 <= M <= 64,
    "wide" below) keeps "wide"'s tiles, takes the K split of `fill_splitk`'s balance model and
    then the deepest pipeline (2..4 stages) that keeps each SM's share of the grid resident.
    "fill16" (the default) plans M < 16 rows as "fill" plans 16 (the same kernel, its tile's
    rows past M masked) and is "fill" from 16 rows on."""
    if options.occupancy == "fill16":
        as_fill = dataclasses.replace(options, occupancy="fill")
        if m >= FILL16_M:
            return plan(m, n, k, num_sms, as_fill, gw_rows=gw_rows)
        return dataclasses.replace(plan(FILL16_M, n, k, num_sms, as_fill, gw_rows=gw_rows), m=m)
    fill = options.occupancy == "fill" and FILL_MIN_M <= m <= MAX_TM
    wide = options.occupancy in ("wide", "fill") and m <= MAX_TM  # one M tile: decode batches
    wm = options.wm or 1
    tm = options.tm or (MAX_TM * wm if m > MAX_TM * wm else _cdiv(m, 8 * wm) * 8 * wm)
    tm = _cdiv(max(tm, 8 * wm), 8 * wm) * 8 * wm
    wr = options.wr or (1 if wm > 1 or (wide and m <= WIDE_WR1_MAX_M) else 2)
    warps = options.warps or 4 * wm
    kt = options.kt or (256 if fill and tm <= KT256_MAX_TM and k % 256 == 0 else 128)
    tile_n = 16 * wr * max(1, warps // wm)
    stage = tile_n * (kt // 2 + kt // 16) + tm * (2 * kt + 64)
    stages = options.stages or max(2, min(4 if tm <= 32 else 3, SMEM_LIMIT // stage))
    nkt = max(1, k // kt)
    threads = 32 * warps
    if options.splitk is not None:
        splitk = options.splitk
    elif options.split_m is not None and options.split_m != m:
        # the split that split_m rows would take (same n, k and choices)
        plain = dataclasses.replace(options, split_m=None)
        splitk = plan(options.split_m, n, k, num_sms, plain, gw_rows=gw_rows).splitk
    elif fill and options.reduce == "finish":
        tiles = _cdiv(m, tm) * _cdiv(n, tile_n)
        splitk = fill_splitk(m, n, k, tiles, num_sms, min(MAX_SPLITK, max(1, nkt // 4)))
    else:
        tiles = _cdiv(m, tm) * _cdiv(n, tile_n)
        by_traffic = int(SPLIT_TRAFFIC * 0.5625 * k / (4 * m))
        if options.reduce == "cluster" or wide:  # partials on chip, or the traffic accepted
            by_traffic = MAX_SPLITK
        per_sm = 4 if wide else 2
        splitk = max(1, min(_cdiv(per_sm * num_sms, tiles), by_traffic, nkt // 4, MAX_SPLITK))
    splitk = min(splitk, nkt)
    if fill and options.stages is None:
        # the deepest pipeline (up to 4) that keeps an SM's share of the grid resident at once
        # (or as much of it as the shallowest pipeline can)
        regs = est_registers(tm, wr)
        tiles = _cdiv(m, tm) * _cdiv(n, tile_n)
        need = min(_cdiv(tiles * splitk, num_sms), ctas_per_sm(2 * stage, threads, regs))
        stages = max(
            [2] + [d for d in range(3, 5) if d * stage <= SMEM_LIMIT and ctas_per_sm(d * stage, threads, regs) >= need]
        )  # fmt: skip
    p = GemmPlan(
        m=m, n=n, k=k, tm=tm, wm=wm, wr=wr, warps=warps, kt=kt, stages=stages, splitk=splitk,
        reduce=options.reduce, w_shift=options.w_shift, gw_rows=bool(gw_rows),
    )  # fmt: skip
    static = options.copies == "static" or (options.copies == "auto" and tm >= STATIC_MIN_TM)
    if options.max_regs is not None:
        regs = options.max_regs
    else:
        regs = max_registers(p.smem, threads, tm, wr) if static else 0
    return dataclasses.replace(p, static_copies=static, max_regs=regs)


def check_shape(m: int, n: int, k: int, options: GemmOptions = DEFAULT_OPTIONS) -> tuple[bool, str]:
    """(True, "") if the GEMM supports this W4A4 problem, else (False, why)."""
    if m < 1:
        return False, f"M={m} (expected >= 1)"
    if n < 1:
        return False, f"N={n} (expected >= 1)"
    p = plan(m, n, k, options=options)
    if p.warps % p.wm or p.tm > MAX_TM * p.wm:
        return False, f"warps={p.warps}, wm={p.wm}, tm={p.tm}: wm must divide warps, tm <= 64 * wm"
    if k < p.kt or k % p.kt:
        return False, f"K={k} (the GEMM needs a positive multiple of {p.kt})"
    if p.smem > SMEM_LIMIT:
        return False, f"the GEMM's tiles need {p.smem} B of shared memory (limit {SMEM_LIMIT})"
    return True, ""


@dataclasses.dataclass(frozen=True, eq=False)
class GemmKernel:
    """A compiled GEMM specialisation and how to launch it: its main entry (`entry`) and, with a
    K split, the finish entry (`finish_entry`, FINISH_THREADS a CTA) that adds the float32
    partials (the wgmma GEMM, cuda_ops.nvfp4_gemm_wgmma, launches the same way)."""

    plan: GemmPlan
    ptx: str
    entry: str = ENTRY
    finish_entry: ClassVar[str] = FINISH_ENTRY

    @property
    def n(self) -> int:
        return self.plan.n

    @property
    def finish_grid(self) -> int:
        return _cdiv(self.plan.m * self.plan.n, FINISH_THREADS)

    def backend_config(self, entry: str | None = None) -> str:
        """MLIR dictionary text for XLA's `__gpu$xla.gpu.ptx` custom kernel call of `entry`
        (None: the GEMM's `self.entry`; or with a K split its epilogue `self.finish_entry`)."""
        entry = entry or self.entry
        p = self.plan
        if entry == self.entry:
            (gx, gy, gz), block, smem, out = p.grid, p.threads, p.smem, p.n_inputs
        elif entry == self.finish_entry:
            (gx, gy, gz), block, smem = (self.finish_grid, 1, 1), FINISH_THREADS, 0
            out = p.finish_inputs
        else:
            raise KernelError(f"entry={entry!r}, expected {self.entry!r} or {self.finish_entry!r}")
        return ptx_backend_config(
            entry, escape_mlir(self.ptx), grid=(gx, gy, gz), block=block, outputs=(out,), smem=smem
        )

    def callback(self, entry: str | None = None):
        """A `buffer_callback` target launching `entry` (None: `self.entry`) on XLA's stream (no
        sync or allocation)."""
        entry = entry or self.entry

        def launch(ctx, out, *args):
            ptrs = [_device_ptr(a) for a in args] + [_device_ptr(out)]
            self._launch(entry, ctx.stream, ptrs)

        return launch

    def launch(self, stream: int, pointers: list[int], workspace: int | None = None) -> None:
        """Launches on `stream`: pointers to the 6 operands (7 with the residual, res after
        xg), then the bf16 output [M, N]. With a K split through partials (`plan.partials`),
        `workspace` points to float32 [SPLITK, M, N] for them, and the epilogue kernel follows
        on the same stream."""
        n_in = self.plan.n_inputs
        if len(pointers) != n_in + 1:
            raise KernelError(f"{self.entry} takes {n_in + 1} pointers, got {len(pointers)}")
        if not self.plan.partials:
            self._launch(self.entry, stream, pointers)
            return
        if workspace is None:
            raise KernelError(
                f"SPLITK={self.plan.splitk}: pass a float32 workspace {self.plan.out_shape}"
            )
        xh, xg, *res, wp, ws, wg, layer, y = pointers  # res: [] or [residual]
        self._launch(self.entry, stream, [xh, xg, *res, wp, ws, wg, layer, workspace])
        self._launch(self.finish_entry, stream, [workspace, xg, *res, wg, layer, y])

    def _launch(self, entry: str, stream: int, pointers: list[int]) -> None:
        import ctypes

        from cuda.bindings import driver

        p = self.plan
        if entry == self.entry:
            (gx, gy, gz), block, smem = p.grid, p.threads, p.smem
        else:
            (gx, gy, gz), block, smem = (self.finish_grid, 1, 1), FINISH_THREADS, 0
        fn = _function(self, entry)
        params = (tuple(pointers), tuple(ctypes.c_void_p for _ in pointers))
        _drv_check(
            driver.cuLaunchKernel(fn, gx, gy, gz, block, 1, 1, smem, stream, params, 0),
            "cuLaunchKernel",
        )


_FUNCTIONS: dict = {}
_LOCK = threading.Lock()


def _function(kernel: GemmKernel, entry: str):
    """CUfunction of `entry` of `kernel` in the current CUDA context (module loaded once)."""
    from cuda.bindings import driver

    ctx = _drv_check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
    key = (int(ctx), id(kernel))
    with _LOCK:
        if key not in _FUNCTIONS:
            module = _drv_check(driver.cuModuleLoadData(kernel.ptx.encode() + b"\0"), "load")
            fns = {}
            for name in (kernel.entry, kernel.finish_entry):
                fns[name] = _drv_check(
                    driver.cuModuleGetFunction(module, name.encode()), "cuModuleGetFunction"
                )
            if kernel.plan.smem > 48 * 1024:
                attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                _drv_check(
                    driver.cuFuncSetAttribute(fns[kernel.entry], attr, kernel.plan.smem), "smem"
                )
            _FUNCTIONS[key] = (module, fns, kernel)  # the kernel stays alive with its id() key
        return _FUNCTIONS[key][1][entry]


def _job(m, n, k, num_sms, options: GemmOptions, gw_rows: bool, residual: bool = False):
    p = dataclasses.replace(plan(m, n, k, num_sms, options, gw_rows=gw_rows), residual=residual)
    if options.source is not None:  # experiments only: another revision of the source
        alt = pathlib.Path(options.source)
        if not alt.is_file():
            raise KernelError(f"GemmOptions.source={options.source!r}: no such file")
        source = alt.read_text()
    else:
        source = read_source(SOURCE)
    extra = tuple(f"-D{name}={value}" for name, value in options.defines)
    return p, source, extra


@functools.cache
def _build_cached(
    m, n, k, arch, num_sms, options: GemmOptions, gw_rows: bool, residual: bool = False
) -> GemmKernel:
    p, source, extra = _job(m, n, k, num_sms, options, gw_rows, residual)
    ptx = compile_ptx(source, name=SOURCE, defines=p.defines(), arch=arch, options=extra)
    entries = ptx_entries(ptx)
    if entries.get(ENTRY) != p.n_inputs + 1 or entries.get(FINISH_ENTRY) != p.finish_inputs + 1:
        raise KernelError(f"PTX entries {ENTRY} / {FINISH_ENTRY} missing or wrong: {entries}")
    return GemmKernel(plan=p, ptx=ptx)


def build(
    m: int,
    n: int,
    k: int,
    *,
    arch: str | None = None,
    num_sms: int | None = None,
    options: GemmOptions = DEFAULT_OPTIONS,
    gw_rows: bool = False,
    residual: bool = False,
) -> GemmKernel:
    """Plans and compiles (NVRTC, disk-cached) the GEMM for one W4A4 problem shape.

    Args:
        m, n, k: problem size (GEMM letters).
        arch: `compute_XY` (None: the present GPU's, compute_90 without one).
        num_sms: SM count the plan targets (None: the present GPU's, 132 without one).
        options: kernel choices (defaults: the plan's).
        gw_rows: the weight carries one global scale per output row ([L, N]).
        residual: both entries take a bf16 residual res [M, N] after xg and store res + y
            (-DEPI_RES=1; the bf16 add of XLA, in the epilogue or the split-K finish).

    Raises KernelError when NVRTC is missing, the GPU arch is too old, or the shape is
    unsupported.
    """
    if not isinstance(options, GemmOptions):
        raise KernelError(f"options must be a GemmOptions, got {type(options).__name__}")
    ok, why = check_shape(m, n, k, options)
    if not ok:
        raise KernelError(f"unsupported shape: {why}")
    if not isinstance(residual, bool):
        raise KernelError(f"residual={residual!r}, expected a bool")
    arch = arch or device_arch()
    return _build_cached(m, n, k, arch, num_sms or device_sms(), options, bool(gw_rows), residual)


def prebuild(
    problems: list[dict], *, arch: str | None = None, workers: int | None = None
) -> list[GemmKernel]:
    """Builds many GEMMs at once (NVRTC in threads; it releases the GIL), each as `build` does.

    Args:
        problems: `build` keyword arguments per kernel: m, n, k and optionally options, gw_rows,
            residual.
        arch: as in `build`.
        workers: threads (None: the CPU count, at most 16).
    """
    import concurrent.futures
    import os

    arch = arch or device_arch()
    num_sms = device_sms()
    keys = []
    for prob in problems:
        options = prob.get("options", DEFAULT_OPTIONS)
        ok, why = check_shape(prob["m"], prob["n"], prob["k"], options)
        if not ok:
            raise KernelError(f"unsupported shape {prob}: {why}")
        flags = (bool(prob.get("gw_rows", False)), bool(prob.get("residual", False)))
        keys.append((prob["m"], prob["n"], prob["k"], arch, num_sms, options, *flags))
    workers = workers or min(16, os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda key: _build_cached(*key), dict.fromkeys(keys)))
    return [_build_cached(*key) for key in keys]
