"""Host side of the one-launch CUDA decode attention (`decode_attention.cu`): shapes, split plan,
build and launch configuration, and a NumPy emulation of the kernel's arithmetic.

`rejax.ops.decode_attention.decode_attention(..., impl="cuda")` binds it (bf16 caches only; the
fp8 cache keeps the Pallas kernel). The kernel runs a grid of (P splits, K kv heads, B rows) CTAs
and combines the splits in the same launch (the last CTA of each row and kv head; see the .cu
header). Its split plan and float32 operation order are written out once more here, in
`flash_split_plan` and `emulate`, so that a CPU test can check the kernel's logic (split
boundaries, masks, merges, empty rows) against the reference before it has run on a GPU; the
kernel's comments E1..E9 mark the same steps. Nothing here imports cuda-python at module import;
NVRTC is reached only by `build`.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from cuda_ops.build import (
    KernelError,
    compile_ptx,
    device_arch,
    escape_mlir,
    ptx_backend_config,
    ptx_entries,
    read_source,
)

__all__ = [
    "ENTRY",
    "FlashOptions",
    "FlashShape",
    "build",
    "check_shape",
    "default_splits",
    "emulate",
    "flash_split_plan",
]

SOURCE = "decode_attention.cu"
ENTRY = "rejax_flash_decode"
# operands: q, k_cache, v_cache, layer, q_positions, k_positions, live (+ out, ws_acc, ws_ml
# NaN-filled and aliased to the results when poisoned); results: out, ws_acc, ws_ml. With
# `FlashShape.quant_out` the static input scale xg follows live, and out is three results:
# codes, block scales and the global scale per row (`FlashShape.n_inputs` / `n_outputs`).
N_INPUTS = 7
N_OUTPUTS = 3
WARPS = 4
# About this many CTAs per call: about 3 per SM on the H200's 132 SMs, what fits at once with
# the ~150 registers per thread ptxas gives the Qwen3-8B build (so one wave, no tail wave).
# Unmeasured: `FlashOptions.splits` and experiments/bench_attention.py --flash-splits tune it.
TARGET_CTAS = 384
# The last CTA of a (row, kv head) reads all P partials: P stays small enough for that tail.
MAX_SPLITS = 64
# A split walks at least this many tiles, so a short live range does not spread over CTAs that
# would each pay the fixed cost (q load, partial write, ticket) for a few keys.
MIN_TILES = 2
MAX_GQA = 8
SMEM_LIMIT = 48 * 1024  # static shared memory per CTA
SM_SMEM_LIMIT = 227 * 1024  # static + dynamic shared memory per CTA (sm_90)
MMA_CHUNK = 16  # the MMA path's slots per warp step (the .cu's CH)
NEG = np.float32(-1e30)


@dataclasses.dataclass(frozen=True)
class FlashShape:
    """The static shapes and launch choices one kernel is compiled for."""

    batch: int
    layers: int
    slots: int
    kv_heads: int
    gqa: int
    head_dim: int
    splits: int
    warps: int = WARPS
    unroll: int = 0  # 0 -> default_unroll(head_dim)
    min_tiles: int = MIN_TILES
    min_ctas: int = 1
    prefetch: int = 0
    mma: int = 0
    stages: int = 3
    poison: bool = False
    quant_out: bool = False  # o_proj's NVFP4 input (codes, scales, global scale) instead of out
    xg_stack: bool = False  # quant_out: the static input scale is stacked [L]

    @property
    def n_inputs(self) -> int:
        """Operands before the poisoned outputs' (N_INPUTS, and xg with quant_out)."""
        return N_INPUTS + int(self.quant_out)

    @property
    def n_outputs(self) -> int:
        """Results: out (or codes, scales and global scale with quant_out), ws_acc, ws_ml."""
        return N_OUTPUTS + 2 * int(self.quant_out)

    @property
    def lanes_per_row(self) -> int:
        return self.head_dim // 8

    @property
    def rows_per_load(self) -> int:
        return 32 // self.lanes_per_row

    @property
    def unroll_(self) -> int:
        return self.unroll or default_unroll(self.head_dim)

    @property
    def tile(self) -> int:
        if self.mma:
            return self.warps * MMA_CHUNK
        return self.warps * self.unroll_ * self.rows_per_load

    @property
    def dynamic_smem_bytes(self) -> int:
        """The MMA path's cp.async rings: per warp STAGES x (K and V rows of a chunk, and its
        positions); 0 for the default path."""
        if not self.mma:
            return 0
        return self.warps * self.stages * (2 * MMA_CHUNK * self.head_dim * 2 + MMA_CHUNK * 4)

    @property
    def smem_bytes(self) -> int:
        g, h, w, p = self.gqa, self.head_dim, self.warps, self.splits
        c4 = g * h // 4
        j = max(1, 32 * w // c4)
        return 4 * (w * g * h + 3 * w * g + 3 * p * g + g) + 16 * j * c4 + 4


@dataclasses.dataclass(frozen=True)
class FlashOptions:
    """Launch choices of the CUDA decode attention (every field changes the compiled kernel).

    splits: P splits of the live range per (row, kv head); None -> `default_splits`.
    warps: warps per CTA. unroll: K/V loads per lane and step (0 -> `default_unroll`).
    min_tiles: tiles a split walks at least. min_ctas: CTAs per SM asked of ptxas (1 = no
    register cap; 4 caps the registers at 128, with spills). prefetch: 1 issues each warp's
    next step of K / V loads before its current step's math (a software pipeline: the same
    values in the same order, more registers); 0 (the default) loads a step, then computes it.
    mma: 1 runs the tensor-core main loop (bf16 mma.sync for Q K^T and P V over chunks of 16
    slots a warp streams through `stages` cp.async stages of shared memory; unroll and prefetch
    do not apply; within rounding of the default path, not bitwise); 0 (the default) the CUDA
    cores' loop. stages: the MMA path's stages per warp (2..8).
    """

    splits: int | None = None
    warps: int = WARPS
    unroll: int = 0
    min_tiles: int = MIN_TILES
    min_ctas: int = 1
    prefetch: int = 0
    mma: int = 0
    stages: int = 3


def flash_shape(
    batch: int,
    layers: int,
    slots: int,
    kv_heads: int,
    gqa: int,
    head_dim: int,
    options: FlashOptions | None = None,
    poison: bool = False,
) -> FlashShape:
    """The FlashShape of a problem ([L, B, S, K, H] cache, G query heads per kv head)."""
    o = options or FlashOptions()
    shape = FlashShape(
        batch=batch,
        layers=layers,
        slots=slots,
        kv_heads=kv_heads,
        gqa=gqa,
        head_dim=head_dim,
        splits=1,
        warps=o.warps,
        unroll=o.unroll,
        min_tiles=o.min_tiles,
        min_ctas=o.min_ctas,
        prefetch=o.prefetch,
        mma=o.mma,
        stages=o.stages,
        poison=poison,
    )
    splits = o.splits
    if splits is None and head_dim >= 8 and 32 % max(1, head_dim // 8) == 0 and o.warps >= 1:
        splits = default_splits(batch, kv_heads, slots, shape.tile, o.min_tiles)
    return dataclasses.replace(shape, splits=1 if splits is None else int(splits))


def default_unroll(head_dim: int) -> int:
    """Loads per lane and step: 8 K/V rows per warp step (16 at H = 16)."""
    return max(1, 8 // (32 // (head_dim // 8)))


def default_splits(batch: int, kv_heads: int, slots: int, tile: int, min_tiles=MIN_TILES) -> int:
    """P: about TARGET_CTAS CTAs, at most one split per MIN_TILES tiles of the cache."""
    cap = -(-slots // (tile * min_tiles))
    return int(max(1, min(-(-TARGET_CTAS // (batch * kv_heads)), cap, MAX_SPLITS)))


def check_shape(shape: FlashShape) -> tuple[bool, str]:
    """(True, "") if the kernel supports these shapes, else (False, why)."""
    h = shape.head_dim
    if h < 16 or h > 256 or h & (h - 1):
        return False, f"head_dim={h} (the CUDA kernel needs a power of two in [16, 256])"
    if not 1 <= shape.gqa <= MAX_GQA:
        return False, f"G={shape.gqa} query heads per kv head (the CUDA kernel takes 1..{MAX_GQA})"
    if min(shape.batch, shape.layers, shape.slots, shape.kv_heads) < 1:
        return False, f"{shape} has an empty dimension"
    if not 1 <= shape.splits <= MAX_SPLITS:
        return False, f"splits={shape.splits} (expected 1..{MAX_SPLITS})"
    if not (1 <= shape.warps <= 16 and 1 <= shape.unroll_ <= 16 and shape.min_tiles >= 1):
        return False, f"warps={shape.warps} unroll={shape.unroll_} min_tiles={shape.min_tiles}"
    if not 1 <= shape.min_ctas <= 8:
        return False, f"min_ctas={shape.min_ctas} (expected 1..8)"
    if shape.prefetch not in (0, 1):
        return False, f"prefetch={shape.prefetch} (expected 0 or 1)"
    if shape.mma not in (0, 1):
        return False, f"mma={shape.mma} (expected 0 or 1)"
    if shape.mma and not 2 <= shape.stages <= 8:
        return False, f"stages={shape.stages} (expected 2..8 with mma=1)"
    if shape.mma and shape.head_dim < 32:
        return False, f"head_dim={h} (mma=1 needs at least 32)"
    if shape.mma and shape.prefetch:
        return False, "prefetch=1 does not apply to mma=1 (its cp.async stages prefetch)"
    if shape.xg_stack and not shape.quant_out:
        return False, "xg_stack applies to quant_out only (the stacked input scale it reads)"
    if shape.smem_bytes + 256 > SMEM_LIMIT:  # the estimate, less alignment padding
        return False, f"{shape.smem_bytes} bytes of shared memory (limit {SMEM_LIMIT})"
    total = shape.smem_bytes + 256 + shape.dynamic_smem_bytes
    if total > SM_SMEM_LIMIT:
        return False, (
            f"{total} bytes of shared memory with warps={shape.warps} stages={shape.stages} "
            f"(limit {SM_SMEM_LIMIT} per CTA)"
        )
    return True, ""


def flash_split_plan(live: int, tile: int, splits: int, min_tiles: int) -> tuple[int, int]:
    """(tiles per split, active splits) for `live` slots, as the kernel computes them (E1).

    Split p covers slots [p * per * tile, min((p + 1) * per * tile, live)); split 0 is active
    even when live == 0 (it writes the empty partial, so its row's output is written).
    """
    tiles = -(-live // tile)
    per = max(-(-tiles // splits), min_tiles)
    return per, max(-(-tiles // per), 1)


def flash_score_scale(head_dim: int) -> np.float32:
    """H**-0.5 * log2(e) in float32 (E2): the kernel's softmax runs in base 2 (exp2)."""
    return np.float32(np.float32(head_dim**-0.5) * np.float32(np.log2(np.e)))


@dataclasses.dataclass(frozen=True, eq=False)
class FlashKernel:
    """A compiled specialisation."""

    shape: FlashShape
    ptx: str

    def backend_config(self) -> str:
        """MLIR dictionary text for XLA's `__gpu$xla.gpu.ptx` custom kernel call."""
        s = self.shape
        n_in = s.n_inputs + (s.n_outputs if s.poison else 0)
        return ptx_backend_config(
            ENTRY,
            escape_mlir(self.ptx),
            grid=(s.splits, s.kv_heads, s.batch),
            block=32 * s.warps,
            outputs=range(n_in, n_in + s.n_outputs),
            smem=s.dynamic_smem_bytes,
        )


def defines(shape: FlashShape) -> dict:
    """The -D constants of `shape` (the .cu header lists them)."""
    return {
        "B_ROWS": shape.batch,
        "N_LAYERS": shape.layers,
        "S_SLOTS": shape.slots,
        "KV_HEADS": shape.kv_heads,
        "GQA": shape.gqa,
        "HEAD_DIM": shape.head_dim,
        "SPLITS": shape.splits,
        "WARPS": shape.warps,
        "UNROLL": shape.unroll_,
        "MIN_TILES": shape.min_tiles,
        "MIN_CTAS": shape.min_ctas,
        "SCORE_SCALE": float(flash_score_scale(shape.head_dim)).hex() + "f",
        "POISON": int(shape.poison),
        # only when set: the default build keeps its cache key and its PTX
        **({"PREFETCH": 1} if shape.prefetch else {}),
        **({"MMA": 1, "STAGES": shape.stages} if shape.mma else {}),
        **({"QUANT_OUT": 1, "XG_STACK": int(shape.xg_stack)} if shape.quant_out else {}),
    }


@functools.cache
def _build_cached(shape: FlashShape, arch: str) -> FlashKernel:
    ptx = compile_ptx(read_source(SOURCE), name=SOURCE, defines=defines(shape), arch=arch)
    want = shape.n_inputs + shape.n_outputs * (2 if shape.poison else 1)
    entries = ptx_entries(ptx)
    if entries.get(ENTRY) != want:
        raise KernelError(f"PTX entry {ENTRY} missing or with wrong parameters: {entries}")
    return FlashKernel(shape=shape, ptx=ptx)


def build(shape: FlashShape, *, arch: str | None = None) -> FlashKernel:
    """Compiles (NVRTC, disk-cached) the kernel for `shape`.

    Raises KernelError when NVRTC is missing or the shape is unsupported.
    """
    ok, why = check_shape(shape)
    if not ok:
        raise KernelError(f"unsupported shape: {why}")
    return _build_cached(shape, arch or device_arch())


# ----------------------------------------------------------------------------- emulation


def _fma(a, b, c):
    """float32 fma: the product is exact in float64, then one rounding (twice, to 53 then 24
    bits: differs from a true fma only on rare ties, far below the tests' tolerance)."""
    return (a.astype(np.float64) * b + c).astype(np.float32)


def _bf16(x):
    """Round float32 to bf16 (nearest even), returned as float32."""
    u = np.asarray(x, np.float32).view(np.uint32)
    r = (u + np.uint32(0x7FFF) + ((u >> 16) & 1)) & np.uint32(0xFFFF0000)
    return r.view(np.float32)


def _butterfly_sum(x, axis: int):
    """The kernel's xor butterfly of adds over `axis` (offsets 1, 2, 4, ..): index 0's sum."""
    x = np.moveaxis(x, axis, -1)
    n = x.shape[-1]
    idx = np.arange(n)
    o = 1
    while o < n:
        x = (x + x[..., idx ^ o]).astype(np.float32)
        o *= 2
    return x[..., 0]


def emulate(q, k, v, q_positions, k_positions, live: int, shape: FlashShape) -> np.ndarray:
    """The kernel's arithmetic in NumPy float32, step for step (E1..E9 in the .cu).

    Args:
        q: [B, N, H] float32 (bf16 values).
        k, v: [B, S, K, H] float32 (bf16 values): the layer the kernel reads.
        q_positions: [B] int; k_positions: [B, S] int.
        live: slots [0, live) may hold tokens (clamped to [0, S]).
        shape: the kernel's shapes and launch choices (splits, warps, unroll, min_tiles).

    Returns:
        [B, N, H] float32 holding the bf16 values the kernel writes. Not bitwise the kernel's:
        exp2 is NumPy's, not CUDA's exp2f (a few ulps), and the fma emulation double-rounds.
        For an `mma=1` shape it follows that shape's split plan in the CUDA cores' order; the
        tensor-core kernel sums in another order (within rounding of this, not step for step).
    """
    q, k, v = (np.asarray(x, np.float32) for x in (q, k, v))
    qp, kp = np.asarray(q_positions), np.asarray(k_positions)
    b, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    g = n // kh
    lpr, kpw, w_, u_ = shape.lanes_per_row, shape.rows_per_load, shape.warps, shape.unroll_
    tile = shape.tile
    live = int(np.clip(live, 0, s))
    per, active = flash_split_plan(live, tile, shape.splits, shape.min_tiles)  # E1
    scale = flash_score_scale(h)  # E2
    a_ = active
    qg = q.reshape(b, kh, g, lpr, 8)
    # streams (split p, warp w, row group r): m, l [B, K, A, W, R, G], acc [B, K, A, W, R, G, H]
    m = np.full((b, kh, a_, w_, kpw, g), NEG, np.float32)
    lsum = np.zeros_like(m)
    acc = np.zeros((b, kh, a_, w_, kpw, g, h), np.float32)
    p_i = np.arange(a_)[:, None, None, None]
    w_i = np.arange(w_)[None, :, None, None]
    r_i = np.arange(kpw)[None, None, :, None]
    u_i = np.arange(u_)[None, None, None, :]
    start = p_i * per * tile
    end = np.minimum(start + per * tile, live)
    for t in range(per):  # E3: every stream's step t (steps past a split's end change nothing)
        slot = start + t * tile + w_i * u_ * kpw + u_i * kpw + r_i  # [A, W, R, U]
        inr = slot < end
        sc_ = np.minimum(slot, s - 1)
        kk = np.moveaxis(k[:, sc_], -2, 1)  # [B, K, A, W, R, U, H]
        vv = np.moveaxis(v[:, sc_], -2, 1)
        kpv = np.where(inr[None], kp[:, sc_], -1)  # [B, A, W, R, U]
        vis = (kpv >= 0) & (kpv <= qp[:, None, None, None, None])
        vis = vis[:, None, ..., None]  # [B, 1, A, W, R, U, 1]
        # E4: per-lane partial dots (product, then fmas in element order), butterfly over lanes
        kc = kk.reshape(*kk.shape[:-1], 1, lpr, 8)  # [B, K, A, W, R, U, 1, LPR, 8]
        qc = qg[:, :, None, None, None, None]  # [B, K, 1, 1, 1, 1, G, LPR, 8]
        d = (qc[..., 0] * kc[..., 0]).astype(np.float32)
        for e in range(1, 8):
            d = _fma(qc[..., e], kc[..., e], d)
        d = _butterfly_sum(d, -1)  # [B, K, A, W, R, U, G]
        # E5: the online-softmax update, keys in unroll order
        sc = np.where(vis, (d * scale).astype(np.float32), NEG)
        mn = np.maximum(m, sc.max(axis=5))
        alpha = np.exp2(m - mn).astype(np.float32)
        m = mn
        lsum = (alpha * lsum).astype(np.float32)
        acc = (alpha[..., None] * acc).astype(np.float32)
        for u in range(u_):
            vu = vis[:, :, :, :, :, u]  # [B, 1, A, W, R, 1]
            wgt = np.exp2(sc[:, :, :, :, :, u] - mn).astype(np.float32)
            lsum = np.where(vu, (lsum + wgt).astype(np.float32), lsum)
            upd = _fma(_bf16(wgt)[..., None], vv[:, :, :, :, :, u, None, :], acc)
            acc = np.where(vu[..., None], upd, acc)
    # E6: merge the warp's row groups: common max, rescale, butterfly of adds
    mx = m.max(axis=4, keepdims=True)
    cf = np.exp2(m - mx).astype(np.float32)
    lw = _butterfly_sum((cf * lsum).astype(np.float32), 4)  # [B, K, A, W, G]
    accw = _butterfly_sum((cf[..., None] * acc).astype(np.float32), 4)  # [B, K, A, W, G, H]
    mw = mx[:, :, :, :, 0]
    # E7: merge the warps in warp order
    mc = mw.max(axis=3)  # [B, K, A, G]
    lc = np.zeros_like(mc)
    accc = np.zeros((b, kh, a_, g, h), np.float32)
    for w in range(w_):
        cfw = np.exp2(mw[:, :, :, w] - mc).astype(np.float32)
        lc = _fma(cfw, lw[:, :, :, w], lc)
        accc = _fma(cfw[..., None], accw[:, :, :, w], accc)
    # E8: combine the splits in split order (groups j of p = j, j + J, ..)
    big = np.maximum(NEG, mc.max(axis=2))  # [B, K, G]
    tot = np.zeros_like(big)
    wp = np.exp2(mc - big[:, :, None]).astype(np.float32)  # [B, K, A, G]
    for p in range(a_):
        tot = _fma(wp[:, :, p], lc[:, :, p], tot)
    c4 = g * h // 4
    j_ = max(1, 32 * w_ // c4)
    out = None
    for j in range(j_):
        part = np.zeros((b, kh, g, h), np.float32)
        for p in range(j, a_, j_):
            part = _fma(wp[:, :, p, :, None], accc[:, :, p], part)
        out = part if out is None else (out + part).astype(np.float32)
    # E9: normalise; total == 0 -> zeros
    t_ = tot[..., None]
    out = np.where(t_ > 0, out / np.where(t_ > 0, t_, 1).astype(np.float32), 0).astype(np.float32)
    return _bf16(out.reshape(b, n, h))
