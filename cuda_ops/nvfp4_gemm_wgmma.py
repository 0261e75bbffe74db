"""Host side of the Hopper wgmma NVFP4 W4A4 GEMM for many rows (`nvfp4_gemm_wgmma.cu`, next
to this file): plan, x_hat order, NVRTC build, ptxas report, launch, XLA custom-call config.

By default (`GemmOptions.wgmma_min_m` .. `wgmma_max_m`, 128 .. 2048 rows, `rejax.ops.linear`)
W4A4 linears run it with 128-token tiles (`LINEAR_TM`) and the BULK 3 stage copies
(`LINEAR_BULK`) instead of the mma.sync GEMM or the dot. With 8-64-token tiles (the plan's own
choice, kept for the experiments) it measured slower than `nvfp4_gemm` unless its weights are
pre-tiled too (BULK 1; experiments/KERNEL_NOTES.md).

The kernel is production's `cuda_ops/nvfp4_gemm.cu` with `mma.sync.m16n8k16` replaced by
`wgmma.mma_async.m64nNk16` (sm_90a): the decoded weights are the register A operand, the tokens
the shared-memory B operand (N = the token tile TM). Its activation operand is x_hat in another
K order than production's (`to_wgmma_order`), built by XLA ops here (`wgmma_x_operand`). Split K
goes through float32 partials and the finish kernel, as production's "finish" reduce; no
residual epilogue, no cluster reduction.

Nothing here imports cuda-python or JAX at module import: NVRTC is reached by `build` and
`ptxas_report`, the driver by the launch methods, JAX by `wgmma_x_operand`.

GEMM letters: M tokens, N out features, K in features.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import re
from typing import ClassVar

import numpy as np

from cuda_ops.build import KernelError, compile_ptx, ptx_entries, ptxas_log
from cuda_ops.nvfp4_gemm import GemmKernel
from cuda_ops.nvfp4_gemm import _function as gemm_function
from cuda_ops.nvfp4_gemv import _drv_check

SOURCE = pathlib.Path(__file__).with_name("nvfp4_gemm_wgmma.cu")
ENTRY = "nvfp4_gemm_w4a4_wgmma"
FINISH_ENTRY = "nvfp4_gemm_finish"
N_INPUTS = 6  # (x_hat, xg, wp, ws, wg, layer), then the output
FINISH_INPUTS = 4  # (partials, xg, wg, layer), then y
ARCH = "compute_90a"  # PTX target sm_90a: wgmma needs the arch-specific features
CUBIN_ARCH = "sm_90a"
TMS = (8, 16, 32, 64, 128, 256)  # token tiles = the wgmma N
DEFAULT_MAX_TM = 64  # the plan's own choice; 128 / 256 (one decode per 128 / 256 tokens) opt-in
KTS = (128, 256)
CHUNK = 128  # the K order permutes inside 128-element chunks
MAX_SPLITK = 8
DEFAULT_SMS = 132
SMEM_LIMIT = 227 * 1024
DEFAULT_W_SHIFT = 7
# the shapes the device check runs (Qwen3-8B: qkv, o, gate_up, down) and its M
QWEN3_8B_SHAPES = ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288))
CHECK_MS = (16, 32, 64)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ----------------------------------------------------------------------------- plan


@dataclasses.dataclass(frozen=True)
class WgmmaPlan:
    """Compile-time launch geometry for one (M, N, K) (see the kernel's header)."""

    m: int
    n: int
    k: int
    tm: int
    wr: int
    nwg: int
    kt: int
    stages: int
    splitk: int
    w_shift: int = DEFAULT_W_SHIFT
    gw_rows: bool = False
    desc_swap: bool = False  # diagnostic: the descriptor's LBO and SBO swapped
    min_blocks: int = 1
    static_copies: bool = True  # the stage copies unrolled (STATIC_COPIES; False: the first form)
    # code words per wgmma commit group (GROUP_WORDS: 1, 2 or 4; 4 measured 2-7% slower than 1)
    group_words: int = 1
    # commit groups in flight while the next word decodes (PIPE): 1, or 2 inside a stage
    pipe: int = 1
    # BULK (KT 128 only): the stage copies on mbarriers, no block barrier in the K loop. 1: every
    # operand pre-tiled (`to_stage_tiles`, `weight_stage_tiles`), three bulk copies a stage from
    # one thread; 3 (`LINEAR_BULK`): x_hat pre-tiled, the weights in their plain layout, their
    # pieces by cp.async from every thread on the same mbarrier; 0: cp.async by every thread, a
    # block barrier a stage
    bulk: int = 0
    # the order CTAs take tiles (RASTER; `raster_tiles`): 0 token tiles along grid x, G > 0
    # groups of G token tiles, every weight tile within a group (an experiment, M >= 1024)
    raster: int = 0

    n_inputs = N_INPUTS
    finish_inputs = FINISH_INPUTS

    @property
    def tile_n(self) -> int:
        return 64 * self.wr * self.nwg

    @property
    def threads(self) -> int:
        return 128 * self.nwg

    @property
    def grid(self) -> tuple[int, int, int]:
        return (_cdiv(self.m, self.tm), _cdiv(self.n, self.tile_n), self.splitk)

    @property
    def stage_bytes(self) -> int:
        return self.tile_n * (self.kt // 2 + self.kt // 16) + self.tm * self.kt * 2

    @property
    def smem(self) -> int:
        # BULK: a full and an empty mbarrier (8 bytes each) per ring slot after the ring
        return self.stages * self.stage_bytes + (16 * self.stages if self.bulk else 0)

    @property
    def partials(self) -> bool:
        return self.splitk > 1

    @property
    def out_shape(self) -> tuple[int, ...]:
        return (self.splitk, self.m, self.n) if self.partials else (self.m, self.n)

    def defines(self) -> dict:
        return (
            {
                "M_TOK": self.m,
                "N_OUT": self.n,
                "K_IN": self.k,
                "TM": self.tm,
                "WR": self.wr,
                "NWG": self.nwg,
                "KT": self.kt,
                "STAGES": self.stages,
                "SPLITK": self.splitk,
                "SMEM_BYTES": self.smem,
                "W_SHIFT": self.w_shift,
                "GW_ROWS": int(self.gw_rows),
                "DESC_SWAP": int(self.desc_swap),
                "MIN_BLOCKS": self.min_blocks,
                "STATIC_COPIES": int(self.static_copies),
            }
            | ({"GROUP_WORDS": self.group_words} if self.group_words != 1 else {})
            | ({"PIPE": self.pipe} if self.pipe != 1 else {})
            | ({"BULK": self.bulk} if self.bulk else {})
            | ({"RASTER": self.raster} if self.raster else {})
        )


def plan(
    m: int,
    n: int,
    k: int,
    num_sms: int = DEFAULT_SMS,
    *,
    tm: int | None = None,
    wr: int | None = None,
    nwg: int | None = None,
    kt: int | None = None,
    stages: int | None = None,
    splitk: int | None = None,
    w_shift: int = DEFAULT_W_SHIFT,
    gw_rows: bool = False,
    desc_swap: bool = False,
    min_blocks: int = 1,
    static_copies: bool = True,
    group_words: int = 1,
    bulk: int = 0,
    split_rule: str = "fill",
    pipe: int = 1,
    raster: int = 0,
) -> WgmmaPlan:
    """The launch plan, production's "wide" rule transposed to warpgroups: the token tile is the
    smallest wgmma N in `TMS` that holds min(M, 64) (grid x over larger M; `tm` 128 or 256 by
    choice, whose K split only fills one wave); one warpgroup of one
    64-row weight tile up to M = 16, two tiles (128 rows) above; KT = 128; STAGES - 2 stages
    loaded ahead (3 up to TM = 32, 2 at TM = 64, as production's 4 / 3 stage rings; half as
    many stages of KT = 256, at least one); the K split aimed at about four CTAs per SM (at most
    8, at least 4 stages per split). At M <= 64 with the defaults that is production's "wide"
    plan's CTAs: the same weight tiles and K split (experiments/tests/test_gemm_wgmma.py).
    `split_rule` "wave" (128 / 256-token tiles; an experiment, `wave_splitk`) picks the K split
    that leaves the least of the last wave idle instead of splitting only below one wave.
    `raster` (an experiment) is the order the CTAs take their tiles (`raster_tiles`)."""
    if split_rule not in SPLIT_RULES:
        raise KernelError(f"split_rule={split_rule!r}, expected one of {SPLIT_RULES}")
    tm = tm or next(v for v in TMS if v >= min(m, DEFAULT_MAX_TM))
    wr = wr or (1 if m <= 16 else 2)
    nwg = nwg or 1
    kt = kt or 128
    tile_n = 64 * wr * nwg
    stage = tile_n * (kt // 2 + kt // 16) + tm * kt * 2 + (16 if bulk else 0)
    ahead = max(1, (3 if tm <= 32 else 2) * 128 // kt)  # the bytes in flight of KT = 128
    stages = stages or max(3, min(ahead + 2, SMEM_LIMIT // stage))
    nkt = max(1, k // kt)
    if splitk is None:
        tiles = _cdiv(m, tm) * _cdiv(n, tile_n)
        if tm >= 128 and split_rule == "wave":
            splitk = wave_splitk(tiles, nkt, num_sms)
        elif tm >= 128:
            # one CTA per SM (the ring fills shared memory) and float32 partials of M x N per
            # split: split only to fill one wave
            splitk = max(1, min(num_sms // tiles, nkt // 4, MAX_SPLITK))
        else:
            splitk = max(1, min(_cdiv(4 * num_sms, tiles), nkt // 4, MAX_SPLITK))
    splitk = min(splitk, nkt)
    return WgmmaPlan(
        m=m,
        n=n,
        k=k,
        tm=tm,
        wr=wr,
        nwg=nwg,
        kt=kt,
        stages=stages,
        splitk=splitk,
        w_shift=w_shift,
        gw_rows=bool(gw_rows),
        desc_swap=bool(desc_swap),
        min_blocks=min_blocks,
        static_copies=bool(static_copies),
        group_words=group_words,
        bulk=int(bulk),
        pipe=int(pipe),
        raster=int(raster),
    )


SPLIT_RULES = ("fill", "wave")
# the modelled cost of each split beyond the first (its float32 partials written and read by
# the finish), as a fraction of a full-K tile's time; a guess until measured
SPLIT_PENALTY = 0.03


def wave_splitk(tiles: int, nkt: int, num_sms: int) -> int:
    """The K split of `tiles` output tiles of `nkt` stages on `num_sms` SMs, one CTA an SM,
    that minimises waves(tiles x s) / s (the time in full-K tile times; a wave's CTAs take
    1 / s of a tile's stages) + SPLIT_PENALTY (s - 1), s in 1 .. min(MAX_SPLITK, nkt / 4).
    E.g. 80 tiles on 132 SMs: 3 (240 CTAs in 2 waves, 0.67 of a tile's time, against 1.0
    unsplit: 80 CTAs leave 52 SMs idle)."""
    best, best_cost = 1, float("inf")
    for s in range(1, max(1, min(MAX_SPLITK, nkt // 4)) + 1):
        cost = _cdiv(tiles * s, num_sms) / s + SPLIT_PENALTY * (s - 1)
        if cost < best_cost - 1e-9:
            best, best_cost = s, cost
    return best


def check_plan(p: WgmmaPlan) -> tuple[bool, str]:
    """(True, "") if the kernel supports the plan, else (False, why)."""
    if p.m < 1 or p.n < 1:
        return False, f"M={p.m}, N={p.n} (expected >= 1)"
    if p.tm not in TMS:
        return False, f"tm={p.tm} (expected one of {TMS})"
    if p.kt not in KTS or p.k < p.kt or p.k % p.kt:
        return False, f"K={p.k}, kt={p.kt} (K must be a positive multiple of kt in {KTS})"
    if p.wr not in (1, 2) or p.nwg not in (1, 2):
        return False, f"wr={p.wr}, nwg={p.nwg} (expected 1 or 2)"
    if p.stages < 3:
        return False, f"stages={p.stages} (the ring needs >= 3)"
    if not 1 <= p.splitk <= min(MAX_SPLITK, p.k // p.kt):
        return False, f"splitk={p.splitk} (expected 1..min({MAX_SPLITK}, K / kt))"
    if p.smem > SMEM_LIMIT:
        return False, f"the tiles need {p.smem} B of shared memory (limit {SMEM_LIMIT})"
    if not 0 <= p.w_shift <= 7:
        return False, f"w_shift={p.w_shift} (expected 0..7)"
    if p.group_words not in (1, 2, 4):
        return False, f"group_words={p.group_words} (expected 1, 2 or 4)"
    if p.pipe not in (1, 2) or (p.pipe == 2 and 4 * (p.kt // 128) // p.group_words < 3):
        return False, f"pipe={p.pipe!r} (expected 1, or 2 with 3+ commit groups a stage)"
    if p.bulk not in (0, 1, 3):
        return False, f"bulk={p.bulk!r} (expected 0, 1 or 3)"
    if p.bulk and p.kt != 128:
        return False, f"bulk copies with kt={p.kt} (expected 128)"
    if not isinstance(p.raster, int) or p.raster < 0:
        return False, f"raster={p.raster!r} (expected 0 or a positive group of token tiles)"
    return True, ""


def raster_tiles(tiles_m: int, tiles_n: int, raster: int) -> list[tuple[int, int]]:
    """(token tile, weight tile) of each CTA in launch order (x fastest, then y) under RASTER
    `raster`: the kernel's `cta_tile`, the same integer map."""
    out = []
    for y in range(tiles_n):
        for x in range(tiles_m):
            if raster == 0:
                out.append((x, y))
                continue
            p = x + y * tiles_m
            per_group = raster * tiles_n
            g = p // per_group
            first = g * raster
            size = min(tiles_m - first, raster)
            r = p - g * per_group
            out.append((first + r % size, r // size))
    return out


# ----------------------------------------------------------------------------- x_hat K order


def to_wgmma_order(x):
    """x_hat [..., K] in natural K order -> the kernel's order (a numpy or JAX array, any dtype;
    K a multiple of 128). Inside each 128-element chunk c, with the natural element
    p = 32t + 8u + 4j + 2v + b (t, u < 4; j, v, b < 2) going to 16(2u + v) + 8b + 2t + j:
        x_w[..., 128c + 16s + 8b + 2t + j] = x[..., 128c + 32t + 8u + 2v + b + 4j], s = 2u + v.
    Each k16 wgmma step s is then 16 consecutive elements, its logical k = 8b + 2t + j being what
    lane t's decoded pair (P_{2v}, P_{2v+1}) of code word u holds (the kernel's header)."""
    *lead, k = x.shape
    if k % CHUNK:
        raise ValueError(f"K={k} is not a multiple of {CHUNK}")
    n = len(lead)
    # natural chunk axes (t, u, j, v, b) -> (u, v, b, t, j)
    y = x.reshape(*lead, k // CHUNK, 4, 4, 2, 2, 2)
    y = y.transpose(*range(n), n, n + 2, n + 4, n + 5, n + 1, n + 3)
    return y.reshape(*lead, k)


def from_wgmma_order(x):
    """The inverse of `to_wgmma_order`."""
    *lead, k = x.shape
    if k % CHUNK:
        raise ValueError(f"K={k} is not a multiple of {CHUNK}")
    n = len(lead)
    # chunk axes (u, v, b, t, j) -> (t, u, j, v, b)
    y = x.reshape(*lead, k // CHUNK, 4, 2, 2, 4, 2)
    y = y.transpose(*range(n), n, n + 4, n + 1, n + 5, n + 2, n + 3)
    return y.reshape(*lead, k)


def wgmma_x_operand(xp, xs):
    """The kernel's activation operand in JAX (XLA ops): x_hat = e2m1(code) * SFx as float16
    [M, K], exact, in `to_wgmma_order` (the twin of rejax.ops.linear.gemm_x_operand, which
    builds production's order). xp: uint8 [M, K/2] codes; xs: uint8 [M, K/16] E4M3 bytes."""
    import jax
    import jax.numpy as jnp

    from rejax import nvfp4

    m, k = xp.shape[0], 2 * xp.shape[1]
    xq = nvfp4.Nvfp4Tensor(
        packed=xp,
        scales=jax.lax.bitcast_convert_type(xs, jnp.float8_e4m3fn),
        global_scale=jnp.ones((), jnp.float32),
        shape=(m, k),
    )
    return to_wgmma_order(nvfp4._scaled_values(xq).astype(jnp.float16))


# ----------------------------------------------------------------------------- BULK operands


def to_stage_tiles(xw, tm: int, kt: int):
    """The BULK kernel's x operand: x_w [M, K] (`to_wgmma_order`; numpy or JAX, any dtype) ->
    [ceil(M / tm), K / kt, tm * kt], each (token tile, K stage) as the contiguous elements of
    its shared-memory image, so one bulk copy fills a stage. The image is `load_stage`'s: the
    16-byte chunk of token 8 mg + mr of the tile and 8-element column q of the stage sits at
    byte q * X_COL + mg * 128 + mr * 16 (X_COL = tm * 16), i.e.
        tile[q, mg, mr, e] = x_w[m0 + 8 mg + mr, kt * KT + 8 q + e];
    tokens past M are zeros. tm a multiple of 8, kt of 8 dividing K."""
    m, k = xw.shape
    if tm % 8 or tm < 8:
        raise ValueError(f"tm={tm}: expected a positive multiple of 8")
    if kt % 8 or kt < 8 or k % kt:
        raise ValueError(f"kt={kt}: expected a multiple of 8 dividing K={k}")
    mt = _cdiv(m, tm)
    xw = _pad_axis(xw, 0, mt * tm - m)
    # (tile, mg, mr, stage, q, e) -> (tile, stage, q, mg, mr, e)
    y = xw.reshape(mt, tm // 8, 8, k // kt, kt // 8, 8)
    y = y.transpose(0, 3, 4, 1, 2, 5)
    return y.reshape(mt, k // kt, tm * kt)


def from_stage_tiles(tiles, m: int, tm: int, kt: int):
    """The inverse of `to_stage_tiles`: [M, K] again (the padding rows dropped)."""
    mt, stages, size = tiles.shape
    if size != tm * kt:
        raise ValueError(f"tiles of {size} elements, expected tm * kt = {tm * kt}")
    y = tiles.reshape(mt, stages, kt // 8, tm // 8, 8, 8)
    y = y.transpose(0, 3, 4, 1, 2, 5)
    return y.reshape(mt * tm, stages * kt)[:m]


def weight_stage_tiles(wp, ws, tile_n: int, kt: int = 128):
    """The BULK kernel's weight operands: codes [..., N, K/2] and scale bytes [..., N, K/16]
    (uint8; numpy or JAX; leading axes are stacked layers) -> codes [..., ceil(N / tile_n),
    K / kt, tile_n * kt / 2] and scales [..., ceil(N / tile_n), K / kt, tile_n * kt / 16]:
    each (weight tile, K stage) as the contiguous bytes of its shared-memory image, the rows of
    the tile one after another (the KT 128 stage layout, no swizzle). Rows past N are zeros
    (they decode to zero weights and their outputs are not written). A one-time repack at load:
    the kernel reads these bytes exactly once per token tile, as it reads the plain layout."""
    *lead, n, half = wp.shape
    k = 2 * half
    if tuple(ws.shape) != (*lead, n, k // 16):
        raise ValueError(f"scales {tuple(ws.shape)}, expected {(*lead, n, k // 16)} for codes "
                         f"{tuple(wp.shape)}")  # fmt: skip
    if kt % 32 or k % kt:
        raise ValueError(f"kt={kt}: expected a multiple of 32 dividing K={k}")
    if tile_n % 8 or tile_n < 8:
        raise ValueError(f"tile_n={tile_n}: expected a positive multiple of 8")
    nb = _cdiv(n, tile_n)
    out = []
    for a, per in ((wp, kt // 2), (ws, kt // 16)):
        a = _pad_axis(a, len(lead), nb * tile_n - n)
        a = a.reshape(*lead, nb, tile_n, k // kt, per)
        a = a.swapaxes(-3, -2)  # (tile, row, stage, byte) -> (tile, stage, row, byte)
        out.append(a.reshape(*lead, nb, k // kt, tile_n * per))
    return out[0], out[1]


def _pad_axis(x, axis: int, pad: int):
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    if isinstance(x, np.ndarray):
        return np.pad(x, widths)
    import jax.numpy as jnp

    return jnp.pad(x, widths)


# ----------------------------------------------------------------------------- build


def read_source() -> str:
    return SOURCE.read_text()


@functools.cache
def _build_cached(p: WgmmaPlan) -> WgmmaKernel:
    ptx = compile_ptx(read_source(), name=SOURCE.name, defines=p.defines(), arch=ARCH)
    entries = ptx_entries(ptx)
    if entries.get(ENTRY) != N_INPUTS + 1 or entries.get(FINISH_ENTRY) != FINISH_INPUTS + 1:
        raise KernelError(f"PTX entries {ENTRY} / {FINISH_ENTRY} missing or wrong: {entries}")
    return WgmmaKernel(plan=p, ptx=ptx)


LINEAR_TM = 128  # `build_linear`'s token tile by default (GemmOptions.wgmma_tm: "auto", `auto_tm`)
LINEAR_TMS = (128, 256)
# The stage copies of `build_linear`: BULK 3, x_hat pre-tiled (`to_stage_tiles`) and filled by
# one bulk copy, the weights in their plain layout by cp.async, all on the stage's mbarrier, no
# block barrier. Kernel alone on an H100 (experiments/results/wgmma_bulk_h100/, four Qwen3-8B
# shapes, geomean against the mma.sync GEMM, TM 128, one tile a warpgroup): 1.91x / 1.86x at
# M = 256 / 512 (1.37x / 1.13x jitted bf16), against 0.75x with every thread's cp.async and a
# block barrier a stage, and 1.97x / 1.88x with the weights pre-tiled too (BULK 1, which needs
# a second copy of every weight).
LINEAR_BULK = 3
# 64-row weight tiles per warpgroup of `build_linear` by token tile: one (with BULK 3 at
# TM = 128 one tile 1.91x / 1.86x the mma.sync GEMM at M = 256 / 512, two 1.71x / 1.80x; at
# TM = 256 two would need 256 accumulators a thread).
LINEAR_WR = {128: 1, 256: 1}
# `build_linear`'s tm="auto": a 256-token tile's time against two 128-token tiles' where both
# fill whole waves (H100, kernel alone, M = 512, 24576 x 4096: 165.9 against 179.0 us; 6144 x
# 4096, 96 tiles in one wave against 192 in two: 56.2 against 59.6;
# experiments/results/dot_x_h100/)
TM256_COST = 0.93


def auto_tm(m: int, n: int, k: int, num_sms: int = DEFAULT_SMS) -> int:
    """`build_linear`'s token tile for tm="auto": 256 where its plan splits no K and its waves
    (CTAs over `num_sms`, rounded up, times the tile, `TM256_COST` for 256) cost no more than
    128-token tiles' (whose K split counts: a split CTA does 1 / splitk of a tile), else 128.
    At M = 512 on 132 SMs that is 256 for Qwen3-8B's qkv (6144 x 4096), gate_up (24576 x 4096)
    and 128 for o (4096 x 4096) and down (4096 x 12288); at M <= 256 always 128."""
    costs = {}
    for tm in LINEAR_TMS:
        p = plan(m, n, k, num_sms, tm=tm, nwg=2, wr=LINEAR_WR[tm], bulk=LINEAR_BULK)
        ctas = _cdiv(m, tm) * _cdiv(n, p.tile_n) * p.splitk
        costs[tm] = (_cdiv(ctas, num_sms) * tm / p.splitk, p.splitk)
    (c128, _), (c256, split256) = costs[128], costs[256]
    return 256 if split256 == 1 and c256 * TM256_COST <= c128 else 128


def build_linear(
    m: int,
    n: int,
    k: int,
    *,
    tm: int = LINEAR_TM,
    gw_rows: bool = False,
    w_shift: int = DEFAULT_W_SHIFT,
    num_sms: int | None = None,
    split_m: int | None = None,
    raster: int = 0,
) -> WgmmaKernel:
    """The kernel `rejax.ops.linear` runs from `GemmOptions.wgmma_min_m` rows on: `tm`-token
    tiles (128 or 256: each weight decoded once per tile; "auto": `auto_tm`), two warpgroups
    sharing the x tile,
    each of `LINEAR_WR[tm]` 64-row weight tiles, the stage copies on mbarriers with x_hat
    pre-tiled (`LINEAR_BULK`: the caller passes `to_stage_tiles` of the wgmma-order x_hat), the
    deepest ring that fits, a K split only where the tiles do not fill one wave (`plan`);
    with `split_m` the split is planned as for that many rows, so
    every M adds each output's K in the same order (GemmOptions.split_m: a row's result then
    does not depend on the rows beside it; the order inside a split never depends on M).
    `raster` is the order the CTAs take their tiles (`raster_tiles`; GemmOptions.wgmma_raster).

    Raises KernelError off sm_90 (wgmma is Hopper's; the present GPU's arch, compute_90
    without one), for an unsupported plan (K not a multiple of 128) or without NVRTC.
    """
    from cuda_ops.build import device_arch, device_sms

    if tm not in (*LINEAR_TMS, "auto"):
        raise KernelError(f"tm={tm!r}, expected one of {LINEAR_TMS} or 'auto'")
    arch = device_arch()
    if arch != "compute_90":
        raise KernelError(f"the wgmma GEMM needs an sm_90 GPU (Hopper), this one is {arch}")
    sms = num_sms or device_sms()
    if tm == "auto":  # chosen for split_m rows where given, as the K split is
        tm = auto_tm(split_m or m, n, k, sms)
    tiles = {"tm": tm, "nwg": 2, "wr": LINEAR_WR[tm], "bulk": LINEAR_BULK}
    splitk = None if split_m is None else plan(split_m, n, k, sms, **tiles).splitk
    p = plan(m, n, k, sms, **tiles, splitk=splitk, w_shift=w_shift, gw_rows=gw_rows,
             raster=raster)  # fmt: skip
    return build_plan(p)


def build(m: int, n: int, k: int, **options) -> WgmmaKernel:
    """Plans (`plan` keyword options) and compiles (NVRTC, PTX for sm_90a, disk-cached) the
    kernel for one problem. Raises KernelError without NVRTC or for an unsupported plan."""
    return build_plan(plan(m, n, k, **options))


def build_plan(p: WgmmaPlan) -> WgmmaKernel:
    ok, why = check_plan(p)
    if not ok:
        raise KernelError(f"unsupported plan: {why}")
    return _build_cached(p)


def prebuild(plans: list[WgmmaPlan], workers: int | None = None) -> list[WgmmaKernel]:
    """Builds many plans at once (NVRTC in threads; it releases the GIL)."""
    import concurrent.futures
    import os

    for p in plans:
        ok, why = check_plan(p)
        if not ok:
            raise KernelError(f"unsupported plan {p}: {why}")
    workers = workers or min(16, os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        list(pool.map(_build_cached, dict.fromkeys(plans)))
    return [_build_cached(p) for p in plans]


_SERIALIZED = re.compile(r"[^\n]*wgmma[^\n]*serialized[^\n]*")


def ptxas_report(p: WgmmaPlan) -> dict:
    """ptxas -v of the main entry, offline (NVRTC to an sm_90a cubin, no GPU): registers, spill
    bytes, and ptxas's "wgmma ... serialized" performance warnings (C7515 and kin: the async
    pipeline broken into waits), which must be empty."""
    log = ptxas_log(read_source(), p.defines(), arch=CUBIN_ARCH, name=SOURCE.name)
    log = log.replace("\0", "")
    out = {"registers": None, "spill_stores": None, "spill_loads": None, "stack": None}
    part = log.split(f"Compiling entry function '{ENTRY}'", 1)
    if len(part) == 2:
        body = part[1].split("Compiling entry function", 1)[0]
        regs = re.search(r"Used (\d+) registers", body)
        spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", body)
        stack = re.search(r"(\d+) bytes stack frame", body)
        out["registers"] = int(regs.group(1)) if regs else None
        if spills:
            out["spill_stores"], out["spill_loads"] = int(spills.group(1)), int(spills.group(2))
        out["stack"] = int(stack.group(1)) if stack else None
    out["serialized"] = [m.group(0).strip() for m in _SERIALIZED.finditer(log)]
    return out


# ----------------------------------------------------------------------------- launch


@dataclasses.dataclass(frozen=True, eq=False)
class WgmmaKernel(GemmKernel):
    """A compiled specialisation and how to launch it: `cuda_ops.nvfp4_gemm.GemmKernel`'s
    launches, XLA custom-call configs and buffer callbacks (two entries, operands
    (x_hat, xg, wp, ws, wg, layer) then y; partials [SPLITK, M, N] and the finish with a K
    split), with this module's entries."""

    plan: WgmmaPlan
    ptx: str
    entry: str = ENTRY
    finish_entry: ClassVar[str] = FINISH_ENTRY

    def attributes(self) -> dict:
        """What the driver's JIT made of the PTX on this GPU: registers per thread, local
        (spill) bytes per thread, max threads per CTA."""
        from cuda.bindings import driver

        fn = gemm_function(self, self.entry)
        a = driver.CUfunction_attribute
        get = driver.cuFuncGetAttribute
        return {
            "registers": _drv_check(get(a.CU_FUNC_ATTRIBUTE_NUM_REGS, fn), "attr"),
            "local_bytes": _drv_check(get(a.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, fn), "attr"),
            "max_threads": _drv_check(get(a.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, fn), "attr"),
        }
