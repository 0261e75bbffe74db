"""Decode attention over the live slots of the stacked KV cache, and chunked prefill attention.

One new query token per row attends over one layer of the stacked cache [L, B, S, K, H]. The
pure-JAX reference (`decode_attention_ref`) is today's `rejax.layers.attention` with slots at or
beyond `live` masked out; the fast path is a flash-decoding kernel written in Pallas (Triton
backend):

* grid (B, K, P): each program takes one row, one kv head with all G = N / K query heads that
  share it (GQA without repeating K/V), and one of P splits of the live range;
* the split plan comes from `live` on the device (P is static, the number of blocks per split
  is not), so the loop bounds follow the cache as it fills, slots >= live are never read, and
  a jitted `while_loop` compiles once;
* each split writes its partial max, sum and unnormalized weighted V (float32); a second small
  kernel, one program per (row, query head), reads the partials of all active splits at once,
  combines and normalizes them.

The partials kernel's launch choices are arguments of `decode_attention` (static params of the
primitive, never environment variables): `block_s`, `num_splits`, Triton's `num_warps` and
`num_stages`, and two loop shapes, `blocks_per_iter` (u blocks per iteration, all their loads
issued before the math, one softmax rescale per iteration) and `prefetch` (the next iteration's
K / V carried in registers). The defaults (BLOCK_S, NUM_WARPS, NUM_STAGES, 1, False) are the
kernel as first measured; `experiments/bench_attention.py --pallas-variants` times the others.

Why Pallas rather than a CUDA kernel through cuda_ops: decode attention is two small matmuls
per block ([G, H] x [H, Bs] and [G, Bs] x [Bs, H]) plus an online softmax, which Triton maps
onto tensor cores and pipelines (cp.async, num_stages) without hand-written layouts; the
kernel's speed is bound by reading K/V, which Triton's masked, coalesced 256-byte row loads
reach without the register-level decoding that made the NVFP4 GEMV worth hand-writing. Pallas
also runs the same kernel body on CPU in interpret mode, so the kernel (not just its
reference) is tested in CI. cuDNN through `jax.nn.dot_product_attention` takes per-row
sequence lengths, i.e. a prefix of valid slots, but our mask is by slot position (left padding,
-1 holes inside the live range), which would need a [B, 1, 1, S] mask tensor per call and
per-row lengths instead of one `live`. Not yet measured on the H200
(`experiments/bench_attention.py` does it); a CUDA version stays the option if the Triton
kernel falls short of the copy bandwidth.

That CUDA version is `impl="cuda"` (`cuda_ops/decode_attention.cu`, through the PTX custom
call): the same split plan idea and partials, but ONE launch per call, for bf16 caches. Its
CTAs (split, kv head, row) stream K/V rows with 16-byte loads, several rows in flight per warp,
and write float32 partials to a workspace that XLA allocates as two extra results; the last CTA
of each (row, kv head) to finish (an atomic ticket in a module-global counter that it resets)
combines the splits in split order, so the result is deterministic. The kernel's arithmetic is
written out in NumPy (`cuda_ops.decode_attention.emulate`) and tested against the reference on
CPU. `decode_attention(..., kernel="cuda")` makes `impl="auto"` prefer it on CUDA (the fp8
cache and shapes it does not take fall back to the Pallas kernel); `Config(attention="flash")`
is the decoder's switch for it, opt-in: on the H200 it measured slower than the Pallas kernel
(experiments/results/h200_e/).

Dispatch follows rejax.kernels: one primitive whose default lowering is the reference and whose
`platform="cuda"` lowering is the Pallas kernel, so CPU tracing never builds a Triton kernel.
`impl="auto"` takes the kernel when lowering for CUDA, the shape is supported and the kernel
compiles for it on this GPU (checked once per shape; else the reference, with a one-time
warning); `"ref"` forces the reference; `"pallas"` forces
the kernel and raises if it cannot run; `"interpret"` runs the kernel body through the Pallas
interpreter on any platform (tests); `"cuda"` forces the one-launch CUDA kernel (raises off CUDA
or for a problem it does not take). Off CUDA, `kernel="cuda"` changes nothing: the reference.

Numerics (both paths): scores q.k in float32 scaled by H**-0.5; a key is visible iff
0 <= k_positions[b, s] <= q_positions[b] and s < live; softmax in float32; probabilities cast to
the value dtype before the PV product. The kernel casts the unnormalized exp(s - m) (in (0, 1])
instead of the normalized probability (the same bf16 rounding, at most 2**-9 relative, per
weight) and normalizes the float32 sum at the end. A row with no visible key returns zeros on both paths.

An fp8 cache (rejax/cache.py: E4M3 codes, one float32 scale per slot and kv head) passes
`k_scale` / `v_scale` [L, B, S, K]. The reference dequantizes the layer to q's dtype
(code * scale, rounded to bf16) and runs the bf16 path. The kernel reads the codes (half the
bytes), converts them exactly to bf16 and applies the scales outside the dots: each key's scale
multiplies its float32 score, each value's scale its float32 weight before the bf16 cast, so it
differs from the reference by the bf16 rounding of the dequantized entries (<= 2**-9 relative).
`prefill_attention` is the prompt-side op (T new tokens): a chunked online softmax in pure JAX
that never holds [B, N, T, S] scores. `decode_attention_nvfp4` returns the decode output as
o_proj's NVFP4 W4A4 input (codes, block scales, global scale of a static input scale): the
CUDA kernel's QUANT_OUT build writes them in the same launch, elsewhere XLA's quantizer ops
follow the attention; the bytes are `quantize_activation`'s of the bf16 output either way.
Dimension letters: see rejax/config.py (Bs = slots per kernel block, P = splits).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.extend.core import Primitive
from jax.interpreters import mlir

from cuda_ops import decode_attention as flash_mod
from cuda_ops.build import KernelError
from rejax import nvfp4
from rejax.cache import FP8_DTYPE, dequantize_kv, read_layer
from rejax.layers import attention, attention_mask
from rejax.ops import _dispatch

IMPLS = ("auto", "ref", "pallas", "interpret", "cuda")
# Which kernel impl="auto" takes on CUDA: the Pallas kernel (two launches) or the one-launch CUDA
# kernel of cuda_ops/decode_attention.cu (bf16 caches; the Pallas kernel otherwise).
KERNELS = ("pallas", "cuda")
# Slots per kernel block: a [64, 128] bf16 K tile is 16 KiB, two stages of K and V fit in shared
# memory with room to spare, and Triton's dot needs every dimension >= 16.
BLOCK_S = 64
# Splits are sized so that about this many programs run per call (about 4 per SM on the H200's
# 132 SMs, enough to hide load latency); with K = 8 kv heads a batch-1 call gets 64 splits.
TARGET_PROGRAMS = 512
# The combine holds [next_pow2(P), H] float32 partials of one head in registers.
MAX_SPLITS = 128
# A split walks at least this many blocks, so short live ranges do not spread over programs
# that would each pay the fixed cost (q load, partial write) for one block of keys.
MIN_BLOCKS_PER_SPLIT = 2
# The partials kernel's Triton launch choices (the combine always runs with these defaults):
# warps per program, and pipeline stages of the block loop (Triton's shared-memory multi-buffering
# of the K / V loads; a [64, 128] bf16 tile is 16 KiB per stage and operand).
NUM_WARPS = 4
NUM_STAGES = 2
# Allowed values: warps a power of two (Triton), at most 1024 threads; stages and blocks per loop
# iteration small enough that the unrolled loads and tiles still fit a program.
MAX_WARPS = 32
MAX_STAGES = 8
MAX_BLOCKS_PER_ITER = 8
_KERNEL_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(np.float16))
# Score of a hidden key and the initial running max: finite, so exp(m_old - m_new) is never
# exp(-inf + inf) = NaN while a row has seen no visible key yet.
_NEG = -1e30


# ----------------------------------------------------------------------------- reference


def decode_attention_ref(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array,
    q_positions: jax.Array,
    k_positions: jax.Array,
    live: jax.Array,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> jax.Array:
    """Pure-JAX decode attention: `rejax.layers.attention` over one layer, slots >= live hidden.

    It computes scores over all S slots (static shapes) and masks the ones at or past `live`;
    for rows with a visible key it equals `attention(q[:, None], k_cache[layer],
    v_cache[layer], attention_mask(q_positions[:, None], k_positions))[:, 0]` whenever the
    slots past `live` hold no position (-1). Rows with no visible key return zeros.

    Args:
        q: [B, N, H] one query per row (RoPE applied).
        k_cache, v_cache: [L, B, S, K, H] stacked cache.
        layer: int32 [] layer to read.
        q_positions: [B] int32 absolute position of each row's query.
        k_positions: [B, S] int32 position held by each slot, -1 = empty / padding.
        live: int32 [] slots [0, live) may hold tokens, or [B] one live length per row.
        k_scale, v_scale: [L, B, S, K] float32 scales of an fp8 cache (codes float8_e4m3fn),
            or None.

    Returns:
        [B, N, H] in q's dtype.
    """
    k, v = read_layer((k_cache, v_cache, k_scale, v_scale), layer, q.dtype)  # [B, S, K, H]
    live = jnp.reshape(jnp.asarray(live), (-1, 1))  # [1 or B, 1]
    in_live = jnp.arange(k.shape[1])[None, :] < live  # [1 or B, S]
    k_pos = jnp.where(in_live, k_positions, -1)  # [B, S]
    # Hidden slots get probability 0, but 0 * NaN is NaN: stale slots past `live` may hold
    # anything, so their values are zeroed too (a no-op for finite values).
    v = jnp.where(in_live[:, :, None, None], v, jnp.zeros((), v.dtype))
    mask = attention_mask(q_positions[:, None], k_pos)  # [B, 1, S]
    out = attention(q[:, None], k, v, mask)[:, 0]  # [B, N, H]
    visible = jnp.any(mask, axis=(1, 2))  # [B]
    return jnp.where(visible[:, None, None], out, 0).astype(q.dtype)


# ----------------------------------------------------------------------------- Pallas kernel


def _split_plan(live: jax.Array, block_s: int, num_splits: int) -> tuple[jax.Array, jax.Array]:
    """(blocks per split, active splits) for `live` slots; both int32 device scalars."""
    blocks = pl.cdiv(live, block_s)
    per_split = jnp.maximum(pl.cdiv(blocks, num_splits), MIN_BLOCKS_PER_SPLIT)
    return per_split, pl.cdiv(blocks, per_split)


def _partials_kernel(
    live_ref,
    layer_ref,
    qpos_ref,
    q_ref,
    k_ref,
    v_ref,
    kpos_ref,
    *refs,
    g: int,
    gp: int,
    block_s: int,
    num_splits: int,
    seq: int,
    scaled: bool,
    blocks_per_iter: int = 1,
    prefetch: bool = False,
):
    # refs: (k_scale, v_scale,)? acc, m, l
    ks_ref, vs_ref = refs[:2] if scaled else (None, None)
    acc_ref, m_ref, l_ref = refs[2:] if scaled else refs
    b, kvh, p = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    live = jnp.clip(live_ref[b], 0, seq)  # this row's live length: its own split plan
    layer = layer_ref[0]
    per_split, active = _split_plan(live, block_s, num_splits)
    first = p * per_split
    last = jnp.minimum(first + per_split, pl.cdiv(live, block_s))
    h = q_ref.shape[-1]
    # The G query heads of this kv head, padded to gp >= 16 rows for the tensor-core dot; the
    # padding rows are masked on load and store, so q needs no re-layout in memory.
    rows = pl.ds(kvh * g, gp)
    row_ok = jnp.arange(gp) < g
    q = plgpu.load(q_ref.at[b, rows, :], mask=row_ok[:, None], other=0)  # [gp, H]
    q_pos = qpos_ref[b]
    u = blocks_per_iter

    # With one block per iteration and no prefetch (the default) V is loaded after the scores,
    # as the kernel always did; grouped and prefetching variants issue every load up front.
    late_v = u == 1 and not prefetch

    def load_k(blk):
        # A block at or past `last` belongs to the next split or lies past `live` (the tail of a
        # group of u blocks, or the prefetch after the last block): fully masked, it reads no
        # memory and every key in it is hidden.
        start = blk * block_s
        ok = start + jnp.arange(block_s) < live  # [Bs]
        if not late_v:  # the default loop never reaches `last`
            ok = ok & (blk < last)
        slots = pl.ds(start, block_s)
        t = {"start": start, "ok": ok}
        t["k_pos"] = plgpu.load(kpos_ref.at[b, slots], mask=ok, other=-1)  # [Bs]
        # the fill value is a float: Triton has no int -> fp8 cast
        t["k"] = plgpu.load(k_ref.at[layer, b, slots, kvh, :], mask=ok[:, None], other=0.0)
        if scaled:
            t["k_s"] = plgpu.load(ks_ref.at[layer, b, slots, kvh], mask=ok, other=0.0)  # [Bs]
        return t

    def load_v(t):
        t = dict(t)  # start and ok are dropped: what a prefetch carries is tiles only
        slots, ok = pl.ds(t.pop("start"), block_s), t.pop("ok")
        t["v"] = plgpu.load(v_ref.at[layer, b, slots, kvh, :], mask=ok[:, None], other=0.0)
        if scaled:
            t["v_s"] = plgpu.load(vs_ref.at[layer, b, slots, kvh], mask=ok, other=0.0)  # [Bs]
        return t

    def load_group(it):
        return [load_v(load_k(first + it * u + j)) for j in range(u)]

    def update(carry, group):
        # One online-softmax step over the u blocks of a group: one max, one rescale of acc.
        acc, m, l = carry
        scores, visible = [], []
        for t in group:
            k = t["k"]
            if scaled:  # E4M3 codes are exact in bf16; the scale goes on the float32 score
                k = k.astype(jnp.float32).astype(q.dtype)
            s = plgpu.dot(q, k, trans_b=True) * (h**-0.5)  # [gp, Bs] f32
            if scaled:
                s = s * t["k_s"][None, :]
            vis = ((t["k_pos"] >= 0) & (t["k_pos"] <= q_pos))[None, :]  # [1, Bs]
            scores.append(jnp.where(vis, s, _NEG))
            visible.append(vis)
        m_new = m
        for s in scores:
            m_new = jnp.maximum(m_new, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        acc, l = alpha[:, None] * acc, alpha * l
        for t, s, vis in zip(group, scores, visible):
            # Hidden keys get exactly 0, even while m_new is still _NEG (no visible key yet).
            w = jnp.where(vis, jnp.exp(s - m_new[:, None]), 0.0)  # [gp, Bs] f32
            t = load_v(t) if late_v else t
            v, wv = t["v"], w
            if scaled:  # sum_s w_s * (scale_s * code_s): the value scale goes on the weight
                v = v.astype(jnp.float32).astype(q.dtype)
                wv = w * t["v_s"][None, :]
            acc = acc + plgpu.dot(wv.astype(v.dtype), v)  # [gp, H] f32
            l = l + jnp.sum(w, axis=1)
        return acc, m_new, l

    init = (
        jnp.zeros((gp, h), jnp.float32),
        jnp.full((gp,), _NEG, jnp.float32),
        jnp.zeros((gp,), jnp.float32),
    )
    n_iter = pl.cdiv(jnp.maximum(last - first, 0), u)
    if late_v:
        acc, m, l = lax.fori_loop(first, last, lambda i, c: update(c, [load_k(i)]), init)
    elif prefetch:
        # Register double buffer: the loads of group it + 1 are issued before group it's math,
        # so they are in flight while it runs (Triton's num_stages pipelining does the same
        # through shared memory, when it applies to the loop).
        def body(it, carry):
            state, group = carry
            upcoming = load_group(it + 1)
            return update(state, group), upcoming

        (acc, m, l), _ = lax.fori_loop(0, n_iter, body, (init, load_group(0)))
    else:
        acc, m, l = lax.fori_loop(0, n_iter, lambda it, c: update(c, load_group(it)), init)

    # Splits past the active ones hold nothing and the combine never reads them.
    @pl.when(p < active)
    def _():
        plgpu.store(acc_ref.at[b, p, rows, :], acc, mask=row_ok[:, None])
        plgpu.store(m_ref.at[b, p, rows], m, mask=row_ok)
        plgpu.store(l_ref.at[b, p, rows], l, mask=row_ok)


def _combine_kernel(
    live_ref, acc_ref, m_ref, l_ref, o_ref, *, block_s: int, num_splits: int, seq: int, **_
):
    # One program per (row, query head) reads the partials of all active splits at once: a
    # serial loop over P splits would put P dependent global loads on the critical path.
    b, head = pl.program_id(0), pl.program_id(1)
    live = jnp.clip(live_ref[b], 0, seq)
    _, active = _split_plan(live, block_s, num_splits)
    pp = pl.next_power_of_2(num_splits)
    split_ok = jnp.arange(pp) < active  # splits past `active` were never written
    m = plgpu.load(m_ref.at[b, pl.ds(0, pp), head], mask=split_ok, other=_NEG)  # [pp]
    l = plgpu.load(l_ref.at[b, pl.ds(0, pp), head], mask=split_ok, other=0.0)  # [pp]
    acc = plgpu.load(acc_ref.at[b, pl.ds(0, pp), head, :], mask=split_ok[:, None], other=0.0)
    w = jnp.where(split_ok, jnp.exp(m - jnp.max(m)), 0.0)  # [pp]
    total = jnp.sum(w * l)
    out = jnp.sum(w[:, None] * acc, axis=0)  # [H]
    # total == 0 iff the row saw no visible key (each visible key adds exp(0) = 1 at its
    # split's max): zeros then, not 0 / 0.
    out = jnp.where(total > 0, out / jnp.where(total > 0, total, 1.0), 0.0)
    plgpu.store(o_ref.at[b, head, :], out.astype(o_ref.dtype))


def _poisoned(kernel, n_in: int, n_out: int):
    """The kernel called with NaN-filled outputs aliased in: drops the aliased input refs."""

    def run(*refs):
        return kernel(*refs[: n_in - n_out], *refs[n_in:])

    return run


def _call(
    kernel,
    args,
    out_shape,
    *,
    grid,
    interpret,
    poison,
    name,
    num_warps=NUM_WARPS,
    num_stages=NUM_STAGES,
):
    if poison:  # start every output as NaN (the interpreter does so for unaliased outputs too)
        outs = [jnp.full(o.shape, jnp.nan, o.dtype) for o in out_shape]
        aliases = {len(args) + i: i for i in range(len(outs))}
        kernel = _poisoned(kernel, len(args) + len(outs), len(outs))
        args = (*args, *outs)
    else:
        aliases = {}
    return pl.pallas_call(
        kernel,
        grid=grid,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=name,
    )(*args)


def decode_attention_kernel(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array,
    q_positions: jax.Array,
    k_positions: jax.Array,
    live: jax.Array,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    *,
    block_s: int = BLOCK_S,
    num_splits: int,
    num_warps: int = NUM_WARPS,
    num_stages: int = NUM_STAGES,
    blocks_per_iter: int = 1,
    prefetch: bool = False,
    interpret: bool = False,
    poison: bool = False,
) -> jax.Array:
    """The two Pallas calls themselves, without dispatch or input checks (use
    `decode_attention`; this entry point is for kernel tests and benchmarks). Only the launch
    choices are checked (`check_launch`).

    Args:
        q, k_cache, v_cache, layer, q_positions, k_positions, live, k_scale, v_scale: as
            `decode_attention`, already validated; positions int32.
        block_s: slots per block.
        num_splits: P.
        num_warps, num_stages, blocks_per_iter, prefetch: the partials kernel's launch
            choices, as `decode_attention`.
        interpret: run through the Pallas interpreter (any platform).
        poison: start the partial and final outputs as NaN, so a split that the combine reads
            without the partials kernel having written it, or an output row left unwritten,
            shows up as NaN (GPU checks; the interpreter always starts outputs as NaN).

    Returns:
        [B, N, H] in q's dtype.
    """
    check_launch(
        num_warps=num_warps,
        num_stages=num_stages,
        blocks_per_iter=blocks_per_iter,
        prefetch=prefetch,
        block_s=block_s,
        num_splits=num_splits,
    )
    b, n, h = q.shape
    _, _, s, kh, _ = k_cache.shape
    g = n // kh
    gp = max(16, pl.next_power_of_2(g))
    scaled = k_scale is not None
    statics = {"g": g, "gp": gp, "block_s": block_s, "num_splits": num_splits, "seq": s}
    loop = {"blocks_per_iter": blocks_per_iter, "prefetch": bool(prefetch)}
    scales = (k_scale, v_scale) if scaled else ()
    # [1] / [B] refs rather than 0-d ones, loaded as ref[0] / ref[b] in the kernels; one live
    # length for all rows is broadcast, so every row plans its splits from its own length
    live1 = jnp.broadcast_to(jnp.asarray(live, jnp.int32).reshape(-1), (b,))
    layer1 = jnp.asarray(layer, jnp.int32).reshape(1)
    common = {"interpret": interpret, "poison": poison}
    acc, m, l = _call(
        functools.partial(_partials_kernel, **statics, **loop, scaled=scaled),
        (live1, layer1, q_positions, q, k_cache, v_cache, k_positions, *scales),
        (
            jax.ShapeDtypeStruct((b, num_splits, n, h), jnp.float32),
            jax.ShapeDtypeStruct((b, num_splits, n), jnp.float32),
            jax.ShapeDtypeStruct((b, num_splits, n), jnp.float32),
        ),
        grid=(b, kh, num_splits),
        name="rejax_decode_attention_partials",
        num_warps=num_warps,
        num_stages=num_stages,
        **common,
    )
    (out,) = _call(
        functools.partial(_combine_kernel, **statics),
        (live1, acc, m, l),
        (jax.ShapeDtypeStruct((b, n, h), q.dtype),),
        grid=(b, n),
        name="rejax_decode_attention_combine",
        **common,
    )
    return out


def kernel_supported(q_shape, k_shape, dtype, block_s: int = BLOCK_S) -> tuple[bool, str]:
    """Whether the Pallas kernel handles this problem; (False, reason) otherwise.

    Args:
        q_shape: (B, N, H).
        k_shape: (L, B, S, K, H).
        dtype: the common dtype of q and the caches.
        block_s: slots per kernel block.

    Returns:
        (ok, reason); reason is "" when ok.
    """
    _, n, h = q_shape
    kh = k_shape[3]
    if np.dtype(dtype) not in _KERNEL_DTYPES:
        return False, f"kernel needs bfloat16 or float16 q/k/v, got {np.dtype(dtype).name}"
    if h < 16 or h > 256 or h & (h - 1):
        return False, f"kernel needs a power-of-two head dim in [16, 256], got H={h}"
    if n // kh > 64:
        return False, f"kernel handles up to 64 query heads per kv head, got G={n // kh}"
    if block_s < 16 or block_s & (block_s - 1):
        return False, f"block_s must be a power of two >= 16, got {block_s}"
    return True, ""


def cuda_problem(
    q, k_cache, v_cache, k_scale=None, options: flash_mod.FlashOptions | None = None
) -> tuple[flash_mod.FlashShape, str]:
    """The CUDA kernel's FlashShape for these operands, and "" or why it cannot take them."""
    b, n, h = q.shape
    n_layers, _, s, kh, _ = k_cache.shape
    shape = flash_mod.flash_shape(b, n_layers, s, kh, n // kh, h, options)
    if k_scale is not None:
        return shape, "the CUDA kernel reads bf16 caches (an fp8 cache takes the Pallas kernel)"
    bf16 = np.dtype(jnp.bfloat16)
    dtypes = tuple(np.dtype(x.dtype) for x in (q, k_cache, v_cache))
    if any(d != bf16 for d in dtypes):
        return shape, f"the CUDA kernel takes bfloat16 q, k, v, got {[d.name for d in dtypes]}"
    return shape, flash_mod.check_shape(shape)[1]


def default_num_splits(batch: int, kv_heads: int, slots: int, block_s: int = BLOCK_S) -> int:
    """P: enough splits for about TARGET_PROGRAMS programs, at most one per block of the cache."""
    splits = min(pl.cdiv(TARGET_PROGRAMS, batch * kv_heads), pl.cdiv(slots, block_s), MAX_SPLITS)
    return int(max(1, splits))


def _is_int(x, lo: int, hi: float) -> bool:
    ok = isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))
    return ok and lo <= x <= hi


def _is_pow2(x, lo: int, hi: float) -> bool:
    return _is_int(x, lo, hi) and not x & (x - 1)


def check_launch(
    *,
    num_warps: int = NUM_WARPS,
    num_stages: int = NUM_STAGES,
    blocks_per_iter: int = 1,
    prefetch: bool = False,
    block_s: int | None = None,
    num_splits: int | None = None,
) -> None:
    """Raise ValueError, naming the value, for a Pallas launch choice the kernel cannot take.

    Args:
        num_warps, num_stages, blocks_per_iter, prefetch: as `decode_attention`.
        block_s, num_splits: also checked when given (not None).
    """
    if not _is_pow2(num_warps, 1, MAX_WARPS):
        raise ValueError(f"num_warps must be a power of two in [1, {MAX_WARPS}], got {num_warps!r}")
    if not _is_int(num_stages, 1, MAX_STAGES):
        raise ValueError(f"num_stages must be an integer in [1, {MAX_STAGES}], got {num_stages!r}")
    if not _is_int(blocks_per_iter, 1, MAX_BLOCKS_PER_ITER):
        raise ValueError(
            f"blocks_per_iter must be an integer in [1, {MAX_BLOCKS_PER_ITER}], got "
            f"{blocks_per_iter!r}"
        )
    if prefetch not in (False, True):  # 0 and 1 are taken as bools
        raise ValueError(f"prefetch must be a bool, got {prefetch!r}")
    if block_s is not None and not _is_pow2(block_s, 16, float("inf")):
        raise ValueError(f"block_s must be a power of two >= 16, got {block_s!r}")
    if num_splits is not None and not _is_int(num_splits, 1, MAX_SPLITS):
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits!r}")


# ----------------------------------------------------------------------------- primitive

_attn_p = Primitive("rejax_decode_attention")
_attn_p.def_abstract_eval(lambda q, *_, **__: jax.core.ShapedArray(q.shape, q.dtype))


@functools.cache
def _jitted_bind(**params):
    return jax.jit(functools.partial(_attn_p.bind, **params))


# eager calls run the primitive through jit (and so through the lowering rules below)
_attn_p.def_impl(lambda *args, **params: _jitted_bind(**params)(*args))


def _lower_ref(ctx, *args, **params):
    return mlir.lower_fun(decode_attention_ref, multiple_results=False)(ctx, *args)


# The primitive's params that are the Pallas kernel's launch choices.
_LAUNCH = ("block_s", "num_splits", "num_warps", "num_stages", "blocks_per_iter", "prefetch")


def _lower_kernel(ctx, *args, interpret: bool, **params: Any):
    launch = {k: params[k] for k in _LAUNCH}
    fn = functools.partial(decode_attention_kernel, **launch, interpret=interpret)
    return mlir.lower_fun(fn, multiple_results=False)(ctx, *args)


def _lower_default(ctx, *args, impl: str, **params):
    if impl == "interpret":
        return _lower_kernel(ctx, *args, interpret=True, **params)
    if impl in ("pallas", "cuda"):
        raise ValueError(
            f"decode_attention(impl={impl!r}) needs the CUDA platform, but this computation is "
            f"lowered for {ctx.module_context.platforms}; use impl='auto', 'ref' or 'interpret'"
        )
    return _lower_ref(ctx, *args)


def _on_cuda() -> bool:
    return _dispatch.on_cuda()


@functools.cache
def _compile_error(
    avals: tuple,
    block_s: int,
    num_splits: int,
    interpret: bool = False,
    num_warps: int = NUM_WARPS,
    num_stages: int = NUM_STAGES,
    blocks_per_iter: int = 1,
    prefetch: bool = False,
) -> str:
    """ "" if the kernel compiles (Triton to cubin) for these operands on this GPU, else why.

    `impl="auto"` asks once per shape before emitting the kernel, so a Triton failure on some
    GPU or JAX version falls back to the reference instead of failing the whole program.
    Lowering for CUDA on a machine without one (export, the dispatch test) cannot compile and
    skips the probe. `interpret=True` probes the interpreted kernel (any platform: the probe's
    own test).
    """
    if not interpret and not _on_cuda():
        return ""
    fn = functools.partial(
        decode_attention_kernel,
        block_s=block_s,
        num_splits=num_splits,
        num_warps=num_warps,
        num_stages=num_stages,
        blocks_per_iter=blocks_per_iter,
        prefetch=prefetch,
        interpret=interpret,
    )

    def probe():
        # Compile-only; no operand is allocated.
        jax.jit(fn).lower(*(jax.ShapeDtypeStruct(s, d) for s, d in avals)).compile()

    try:
        # The probe runs while an outer jit is being lowered. It must not join that trace, nor
        # evaluate eagerly (jax.ensure_compile_time_eval made Pallas evaluate program_id and
        # fail, so every jitted "live" step silently took the reference): a fresh thread starts
        # with JAX's thread-local trace state empty.
        _dispatch.outside_trace(probe)
    except Exception as err:  # noqa: BLE001 - any Triton / XLA failure -> reference
        return f"the Pallas kernel does not compile here ({type(err).__name__}: {err})"
    return ""


def flash_call(q, k_cache, v_cache, layer, q_positions, k_positions, live, *, kernel):
    """The CUDA kernel's custom call from traced code (inside `mlir.lower_fun` or a jitted
    function lowered for CUDA): operands as `decode_attention`'s, already validated (positions
    int32, layer and live int32 scalars), `kernel` a built `cuda_ops.decode_attention`
    FlashKernel. With `kernel.shape.poison` the output and the workspace start as NaN (aliased
    NaN-filled operands): a split the combine reads unwritten, or an output element never
    stored, shows up. Returns [B, N, H] bf16."""
    return _flash_results(q, k_cache, v_cache, layer, q_positions, k_positions, live,
                          kernel=kernel)[0]  # fmt: skip


def flash_quant_call(q, k_cache, v_cache, layer, q_positions, k_positions, live, xg, *, kernel):
    """`flash_call` for a kernel built with `quant_out` (o_proj's NVFP4 input): `xg` float32 [L]
    (with `kernel.shape.xg_stack`, read at `layer`) or [1], the static input scale. Returns
    (codes uint8 [B, N*H/2], E4M3 scales uint8 [B, N*H/16], global scale float32 [B])."""
    return _flash_results(q, k_cache, v_cache, layer, q_positions, k_positions, live, xg,
                          kernel=kernel)[:3]  # fmt: skip


def _flash_results(q, k_cache, v_cache, layer, q_positions, k_positions, live, *xg, kernel):
    sh = kernel.shape
    b, n, h = q.shape
    if sh.quant_out:
        outs = (
            jax.ShapeDtypeStruct((b, n * h // 2), jnp.uint8),  # codes
            jax.ShapeDtypeStruct((b, n * h // 16), jnp.uint8),  # E4M3 block scales
            jax.ShapeDtypeStruct((b,), jnp.float32),  # global scale per row
        )
    else:
        outs = (jax.ShapeDtypeStruct((b, n, h), q.dtype),)
    out = (
        *outs,
        jax.ShapeDtypeStruct((b, sh.kv_heads, sh.splits, sh.gqa, h), jnp.float32),  # ws_acc
        jax.ShapeDtypeStruct((b, sh.kv_heads, sh.splits, 2, sh.gqa), jnp.float32),  # ws_ml
    )
    # the CUDA kernel plans its splits from one live length: the furthest row's (the positions
    # mask the rest of a shorter row's range)
    live = jnp.max(live) if jnp.ndim(live) else live
    ops = (q, k_cache, v_cache, layer, q_positions, k_positions, live, *xg)
    aliases = None
    if sh.poison:
        # NaN for floats; 0xFF (a NaN E4M3 scale, code -6 pairs) for the byte outputs
        ops += tuple(
            jnp.full(o.shape, jnp.nan if jnp.issubdtype(o.dtype, jnp.floating) else 0xFF, o.dtype)
            for o in out
        )  # fmt: skip
        aliases = {sh.n_inputs + i: i for i in range(sh.n_outputs)}
    return _dispatch.ptx_call(kernel.backend_config(), out, *ops, aliases=aliases)


def decode_attention_cuda(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array,
    q_positions: jax.Array,
    k_positions: jax.Array,
    live: jax.Array,
    *,
    options: flash_mod.FlashOptions | None = None,
    poison: bool = False,
    input_scale: Any = None,
) -> Any:
    """The CUDA kernel's call itself, without dispatch (use `decode_attention(impl="cuda")`;
    this entry point is for GPU tests and benchmarks, and lowers for CUDA only).

    Args:
        q, k_cache, v_cache, layer, q_positions, k_positions, live: as `decode_attention`.
        options: the kernel's launch choices (None -> the defaults).
        poison: the output and the workspace start as NaN (the byte outputs as 0xFF).
        input_scale: None, or o_proj's static input scale (as `decode_attention_nvfp4`): the
            kernel built with `quant_out` writes the NVFP4 codes of its output instead.

    Returns:
        [B, N, H] bf16; with `input_scale` (codes, scales, global scale) as
        `decode_attention_nvfp4`.
    """
    _check_inputs(q, k_cache, v_cache, layer, q_positions, k_positions, live, None, None)
    shape, why = cuda_problem(q, k_cache, v_cache, None, options)
    if why:
        raise ValueError(f"decode_attention_cuda cannot run: {why}")
    ops = (
        q,
        k_cache,
        v_cache,
        jnp.asarray(layer, jnp.int32),
        q_positions.astype(jnp.int32),
        k_positions.astype(jnp.int32),
        jnp.asarray(live, jnp.int32),
    )
    if input_scale is None:
        return flash_call(*ops, kernel=flash_mod.build(dataclasses.replace(shape, poison=poison)))
    xg, stacked = _check_input_scale(input_scale, k_cache.shape[0])
    shape = dataclasses.replace(shape, poison=poison, quant_out=True, xg_stack=stacked)
    return flash_quant_call(*ops, xg, kernel=flash_mod.build(shape))


def _lower_flash(ctx, *args, kernel):
    fn = functools.partial(flash_call, kernel=kernel)
    return mlir.lower_fun(fn, multiple_results=False)(ctx, *args)


def _lower_cuda(
    ctx, *args, impl: str, reason: str, kernel: str, flash, flash_reason: str, **params
):
    if impl == "interpret":
        return _lower_kernel(ctx, *args, interpret=True, **params)
    if impl == "ref":
        return _lower_ref(ctx, *args)
    if impl == "cuda" or (impl == "auto" and kernel == "cuda"):
        built = None
        if not flash_reason:
            try:
                built = flash_mod.build(flash)
            except KernelError as err:
                flash_reason = f"the CUDA kernel does not build ({err})"
        if built is not None:
            return _lower_flash(ctx, *args, kernel=built)
        if impl == "cuda":
            raise ValueError(f"decode_attention(impl='cuda') cannot run: {flash_reason}")
        # kernel="cuda" under impl="auto": the Pallas kernel (or the reference) instead
        _dispatch.note_once(
            "decode_attention", f"kernel='cuda' takes the Pallas kernel instead: {flash_reason}"
        )
    if impl == "auto" and not reason:
        avals = tuple((a.shape, a.dtype) for a in ctx.avals_in)
        reason = _compile_error(avals, **{k: params[k] for k in _LAUNCH})
    if reason:  # impl == "auto": "pallas" with a reason was refused in decode_attention
        _dispatch.note_once("decode_attention", reason)
        return _lower_ref(ctx, *args)
    return _lower_kernel(ctx, *args, interpret=False, **params)


def _lower_default_all(ctx, *args, kernel, flash, flash_reason, **params):
    del kernel, flash, flash_reason  # off CUDA every kernel choice is the reference
    return _lower_default(ctx, *args, **params)


mlir.register_lowering(_attn_p, _lower_default_all)
mlir.register_lowering(_attn_p, _lower_cuda, platform="cuda")


# ----------------------------------------------------------------------------- public op


def _check_inputs(q, k_cache, v_cache, layer, q_positions, k_positions, live, k_scale, v_scale):
    if q.ndim != 3:
        raise ValueError(f"q must be [B, N, H], got {q.shape=}")
    if k_cache.ndim != 5 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be [L, B, S, K, H], got {k_cache.shape=} "
            f"{v_cache.shape=}"
        )
    n_layers, b, s, kh, h = k_cache.shape
    if q.shape[0] != b or q.shape[2] != h:
        raise ValueError(
            f"q [B, N, H] does not match the cache [L, B, S, K, H]: {q.shape=} {k_cache.shape=}"
        )
    if q.shape[1] % kh:
        raise ValueError(f"query heads N={q.shape[1]} must be a multiple of kv heads K={kh}")
    if q_positions.shape != (b,):
        raise ValueError(f"q_positions must be [B]=({b},), got {q_positions.shape=}")
    if k_positions.shape != (b, s):
        raise ValueError(f"k_positions must be [B, S]=({b}, {s}), got {k_positions.shape=}")
    for name, x in (("q_positions", q_positions), ("k_positions", k_positions)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be integer, got {x.dtype}")
    if (k_scale is None) != (v_scale is None):
        raise ValueError(
            "an fp8 cache needs both k_scale and v_scale, got "
            f"k_scale={None if k_scale is None else k_scale.shape} "
            f"v_scale={None if v_scale is None else v_scale.shape}"
        )
    if k_scale is not None:
        fp8 = np.dtype(FP8_DTYPE)
        if np.dtype(k_cache.dtype) != fp8 or np.dtype(v_cache.dtype) != fp8:
            raise ValueError(
                f"with scales the cache must hold {fp8.name} codes, got {k_cache.dtype=} "
                f"{v_cache.dtype=}"
            )
        for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
            if x.shape != k_cache.shape[:-1] or np.dtype(x.dtype) != np.float32:
                raise ValueError(
                    f"{name} must be float32 [L, B, S, K]={k_cache.shape[:-1]}, got "
                    f"{x.shape} {x.dtype}"
                )
    elif np.dtype(k_cache.dtype) == np.dtype(FP8_DTYPE):
        raise ValueError("an fp8 cache (float8_e4m3fn codes) needs k_scale and v_scale")
    for name, x, hi in (("layer", layer, n_layers - 1), ("live", live, s)):
        shapes = [()] if name == "layer" else [(), (b,)]
        if jnp.shape(x) not in shapes or not jnp.issubdtype(jnp.result_type(x), jnp.integer):
            what = "an integer scalar" if name == "layer" else f"an integer scalar or [B]=({b},)"
            raise ValueError(f"{name} must be {what}, got {jnp.shape(x)} {jnp.result_type(x)}")
        if not isinstance(x, jax.core.Tracer):
            bad = np.asarray(x)[(np.asarray(x) < 0) | (np.asarray(x) > hi)]
            if bad.size:
                raise ValueError(f"{name}={int(bad.flat[0])} out of range [0, {hi}]")


def decode_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array,
    q_positions: jax.Array,
    k_positions: jax.Array,
    live: jax.Array,
    *,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    impl: str = "auto",
    block_s: int = BLOCK_S,
    num_splits: int | None = None,
    num_warps: int = NUM_WARPS,
    num_stages: int = NUM_STAGES,
    blocks_per_iter: int = 1,
    prefetch: bool = False,
    kernel: str = "pallas",
    cuda_options: flash_mod.FlashOptions | None = None,
) -> jax.Array:
    """Attention of one new token per row over the live slots of one layer of the stacked cache.

    Works inside jit, `lax.scan` over layers and `lax.while_loop`: `layer` and `live` are device
    values and the compiled program does not depend on them. Traced values are clamped on the
    device (layer to [0, L), live to [0, S]); concrete ones out of range raise.

    Args:
        q: [B, N, H] bf16 queries, one new token per row (RoPE applied).
        k_cache, v_cache: [L, B, S, K, H] all layers stacked, this token's k/v already written.
        layer: int32 [] which layer to read.
        q_positions: [B] int32 absolute position of each row's query.
        k_positions: [B, S] int32 position held by each slot, -1 = empty / padding.
        live: int32 [] slots [0, live) may hold tokens; slots >= live are never read. Or [B],
            one live length per row: the Pallas kernel and the reference then read row b's
            slots [0, live[b]) and plan its splits from that length alone, so a row's result
            does not depend on the other rows (the CUDA kernel reads up to the longest).
        k_scale, v_scale: [L, B, S, K] float32 scales of an fp8 cache (k_cache / v_cache then
            hold float8_e4m3fn codes, rejax/cache.py), or None for a bf16 cache.
        impl: "auto", "ref", "pallas", "interpret" or "cuda" (see the module docstring).
        block_s: slots per Pallas kernel block (a power of two >= 16).
        num_splits: P splits of the live range per row and kv head (Pallas kernel only); None
            -> `default_num_splits`.
        num_warps: warps per program of the Pallas partials kernel (a power of two).
        num_stages: Triton pipeline stages of its block loop (shared-memory buffers of K / V).
        blocks_per_iter: blocks of `block_s` slots per loop iteration of the partials kernel:
            all their K / V loads are issued before the math, with one softmax rescale per
            iteration (1: the default loop, V loaded after the scores).
        prefetch: carry the next iteration's K / V tiles in registers, loaded before this
            iteration's math (a register double buffer next to Triton's num_stages).
        kernel: which kernel impl="auto" takes when lowering for CUDA: "pallas" or "cuda"
            (the one-launch CUDA kernel; for an fp8 cache or a shape it does not take, the
            Pallas kernel, with a one-time warning).
        cuda_options: the CUDA kernel's launch choices (`cuda_ops.decode_attention.
            FlashOptions`: splits, warps, unroll, ...); None -> the defaults.

    Returns:
        [B, N, H] in q's dtype; zeros for a row with no visible key.
    """
    ops, params = _prepare(
        q, k_cache, v_cache, layer, q_positions, k_positions, live, k_scale, v_scale,
        impl=impl, block_s=block_s, num_splits=num_splits, num_warps=num_warps,
        num_stages=num_stages, blocks_per_iter=blocks_per_iter, prefetch=prefetch, kernel=kernel,
        cuda_options=cuda_options,
    )  # fmt: skip
    return _attn_p.bind(*ops, **params)


def _prepare(
    q, k_cache, v_cache, layer, q_positions, k_positions, live, k_scale, v_scale, *, impl,
    block_s, num_splits, num_warps, num_stages, blocks_per_iter, prefetch, kernel, cuda_options,
):  # fmt: skip
    """Validates `decode_attention`'s arguments: (the primitive's operands, its params)."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}, expected one of {IMPLS}")
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}, expected one of {KERNELS}")
    if cuda_options is not None and not isinstance(cuda_options, flash_mod.FlashOptions):
        raise ValueError(f"cuda_options={cuda_options!r}, expected a FlashOptions or None")
    _check_inputs(q, k_cache, v_cache, layer, q_positions, k_positions, live, k_scale, v_scale)
    flash, flash_reason = cuda_problem(q, k_cache, v_cache, k_scale, cuda_options)
    if impl == "cuda" and flash_reason:
        raise ValueError(f"decode_attention(impl='cuda') cannot run: {flash_reason}")
    dtypes = {np.dtype(q.dtype), np.dtype(k_cache.dtype), np.dtype(v_cache.dtype)}
    ok, reason = kernel_supported(q.shape, k_cache.shape, q.dtype, block_s)
    if ok and k_scale is None and len(dtypes) != 1:
        ok, reason = False, f"kernel needs one dtype for q, k, v, got {sorted(map(str, dtypes))}"
    if num_splits is None:
        num_splits = default_num_splits(q.shape[0], k_cache.shape[3], k_cache.shape[2], block_s)
    # block_s is not checked here: a bad one takes the reference under impl="auto" (as always)
    check_launch(
        num_warps=num_warps,
        num_stages=num_stages,
        blocks_per_iter=blocks_per_iter,
        prefetch=prefetch,
        num_splits=num_splits,
    )
    if impl in ("pallas", "interpret") and not ok:
        raise ValueError(f"decode_attention(impl={impl!r}) cannot run: {reason}")
    ops = (
        q,
        k_cache,
        v_cache,
        jnp.asarray(layer, jnp.int32),
        q_positions.astype(jnp.int32),
        k_positions.astype(jnp.int32),
        jnp.asarray(live, jnp.int32),
        *(() if k_scale is None else (k_scale, v_scale)),
    )
    params = {
        "impl": impl,
        "reason": reason,
        "block_s": int(block_s),
        "num_splits": int(num_splits),
        "num_warps": int(num_warps),
        "num_stages": int(num_stages),
        "blocks_per_iter": int(blocks_per_iter),
        "prefetch": bool(prefetch),
        "kernel": kernel,
        "flash": flash,
        "flash_reason": flash_reason,
    }
    return ops, params


# ----------------------------------------------------------------------------- NVFP4 output
#
# decode_attention_nvfp4: the attention output as o_proj's W4A4 input. On CUDA with the
# one-launch kernel ("cuda") its QUANT_OUT build writes the codes, block scales and global scale
# itself (one launch, no quantizer launch after it); everywhere else (off CUDA, the Pallas
# kernel, an fp8 cache, a shape the CUDA kernel does not take) the bf16 attention output, then
# `rejax.nvfp4.quantize_activation`'s XLA ops. The bytes are quantize_activation of the bf16
# output in both cases.


def _check_input_scale(input_scale: Any, layers: int) -> tuple[jax.Array, bool]:
    """(xg float32 [L] or [1], stacked): a static input scale [] or stacked [L], > 0."""
    shape = tuple(np.shape(input_scale))
    if shape not in ((), (layers,)):
        raise ValueError(
            f"input_scale must be a float32 scalar or one per layer [L]=({layers},), got {shape}"
        )
    if not jnp.issubdtype(jnp.result_type(input_scale), jnp.floating):
        raise ValueError(f"input_scale must be floating, got {jnp.result_type(input_scale)}")
    if not isinstance(input_scale, jax.core.Tracer):
        v = np.asarray(input_scale, np.float32)
        bad = v[~(np.isfinite(v) & (v > 0))]
        if bad.size:
            raise ValueError(f"input_scale={float(bad.flat[0])}: expected finite and > 0")
    xg = jnp.reshape(jnp.asarray(input_scale, jnp.float32), (-1,))
    return xg, len(shape) == 1


def _quantize_out(out, xg, layer, *, stacked):
    """(codes, scales, global scale [B]) of the attention output out [B, N, H]:
    `quantize_activation` of its bf16 values with the static scale xg[layer] (stacked) or xg[0]."""
    b = out.shape[0]
    g = xg[jnp.clip(layer, 0, xg.shape[0] - 1)] if stacked else xg[0]
    q = nvfp4.quantize_activation(out.astype(jnp.bfloat16).reshape(b, -1), g)
    scales = jax.lax.bitcast_convert_type(q.scales, jnp.uint8)
    return q.packed, scales, jnp.broadcast_to(q.global_scale, (b,))


_attn_q_p = Primitive("rejax_decode_attention_nvfp4")
_attn_q_p.multiple_results = True
_attn_q_p.def_abstract_eval(
    lambda q, *_, **__: (
        jax.core.ShapedArray((q.shape[0], q.shape[1] * q.shape[2] // 2), jnp.uint8),
        jax.core.ShapedArray((q.shape[0], q.shape[1] * q.shape[2] // nvfp4.BLOCK), jnp.uint8),
        jax.core.ShapedArray((q.shape[0],), jnp.float32),
    )
)


@functools.cache
def _jitted_bind_q(**params):
    return jax.jit(functools.partial(_attn_q_p.bind, **params))


_attn_q_p.def_impl(lambda *args, **params: _jitted_bind_q(**params)(*args))


def _composed(*args, stacked, **params):
    """The attention primitive (whatever it lowers to here), then quantize_activation's ops."""
    q, k_cache, v_cache, layer, q_positions, k_positions, live, xg, *scales = args
    ops = (q, k_cache, v_cache, layer, q_positions, k_positions, live, *scales)
    return _quantize_out(_attn_p.bind(*ops, **params), xg, layer, stacked=stacked)


def _lower_q_default(ctx, *args, **params):
    return mlir.lower_fun(functools.partial(_composed, **params), multiple_results=True)(ctx, *args)


def _lower_q_cuda(ctx, *args, stacked, **params):
    impl, flash_reason = params["impl"], params["flash_reason"]
    if impl == "cuda" or (impl == "auto" and params["kernel"] == "cuda"):
        built = None
        if not flash_reason:
            shape = dataclasses.replace(params["flash"], quant_out=True, xg_stack=stacked)
            try:
                built = flash_mod.build(shape)
            except KernelError as err:
                flash_reason = f"the CUDA kernel does not build ({err})"
        if built is not None:
            fn = functools.partial(flash_quant_call, kernel=built)
            return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)
        if impl == "cuda":
            raise ValueError(f"decode_attention_nvfp4(impl='cuda') cannot run: {flash_reason}")
        _dispatch.note_once(
            "decode_attention_nvfp4",
            f"the attention output is quantized by XLA ops after the attention: {flash_reason}",
        )
    return _lower_q_default(ctx, *args, stacked=stacked, **params)


mlir.register_lowering(_attn_q_p, _lower_q_default)
mlir.register_lowering(_attn_q_p, _lower_q_cuda, platform="cuda")


def decode_attention_nvfp4(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array,
    q_positions: jax.Array,
    k_positions: jax.Array,
    live: jax.Array,
    input_scale: Any,
    *,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    impl: str = "auto",
    block_s: int = BLOCK_S,
    num_splits: int | None = None,
    num_warps: int = NUM_WARPS,
    num_stages: int = NUM_STAGES,
    blocks_per_iter: int = 1,
    prefetch: bool = False,
    kernel: str = "cuda",
    cuda_options: flash_mod.FlashOptions | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`decode_attention`'s output as o_proj's NVFP4 W4A4 input, with a static input scale.

    The bytes are `rejax.nvfp4.quantize_activation(out.reshape(B, N*H), g)` of the bf16 output
    `out` that `decode_attention` gives with the same arguments, g = input_scale[layer] (or the
    scalar input_scale): the operands `rejax.ops.fused_linear.linear_from_codes` takes. On CUDA
    with `kernel="cuda"` (the default here) and a bf16 cache the one-launch CUDA kernel writes
    them itself (`cuda_ops/decode_attention.cu`, QUANT_OUT); otherwise the attention (as
    `decode_attention` runs it), then quantize_activation's XLA ops.

    Args:
        q, k_cache, v_cache, layer, q_positions, k_positions, live, k_scale, v_scale: as
            `decode_attention`.
        input_scale: float32 [] or [L] (one per layer, read at `layer`), > 0: o_proj's static
            activation global scale (calibrated amax / (6 * 448)).
        impl, block_s, num_splits, num_warps, num_stages, blocks_per_iter, prefetch, kernel,
            cuda_options: as `decode_attention` ("cuda" with impl="cuda" forces the kernel).

    Returns:
        (codes uint8 [B, N*H/2], E4M3 block scales uint8 [B, N*H/16], global scale float32 [B]).
    """
    ops, params = _prepare(
        q, k_cache, v_cache, layer, q_positions, k_positions, live, k_scale, v_scale,
        impl=impl, block_s=block_s, num_splits=num_splits, num_warps=num_warps,
        num_stages=num_stages, blocks_per_iter=blocks_per_iter, prefetch=prefetch, kernel=kernel,
        cuda_options=cuda_options,
    )  # fmt: skip
    if (q.shape[1] * q.shape[2]) % nvfp4.BLOCK:
        raise ValueError(
            f"N*H={q.shape[1] * q.shape[2]} must be a multiple of {nvfp4.BLOCK} (NVFP4 blocks)"
        )
    xg, stacked = _check_input_scale(input_scale, k_cache.shape[0])
    ops = (*ops[:7], xg, *ops[7:])
    return tuple(_attn_q_p.bind(*ops, stacked=stacked, **params))


# ----------------------------------------------------------------------------- prefill


def prefill_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_positions: jax.Array,
    k_positions: jax.Array,
    *,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    q_chunk: int = 256,
    k_chunk: int = 512,
) -> jax.Array:
    """Attention of T new tokens over S keys that never materializes [B, N, T, S] scores.

    Pure JAX, flash style: a `lax.map` over chunks of `q_chunk` queries, each running an online
    softmax (running max, sum and weighted V in float32) over chunks of `k_chunk` keys read in
    place from k / v (no padded or transposed copy of the cache). The largest intermediate is
    [B, N, q_chunk, k_chunk] float32. Masking is `rejax.layers.attention_mask`: a key is
    visible iff 0 <= k_positions[b, s] <= q_positions[b, t] (causal over the prompt plus what
    the cache holds, left padding and holes alike). Weights exp(s - m) are cast to v's dtype
    before the PV product, as in `decode_attention`; for rows with a visible key the result
    matches `rejax.layers.attention` to the rounding of that cast. Rows with no visible key
    (padded queries) return zeros. Every (query chunk, key chunk) pair is computed, masked or
    not (positions are data, so causal skipping would need a device-side branch): the FLOPs of
    the unchunked op, in bounded memory.

    Args:
        q: [B, T, N, H] queries (RoPE applied).
        k, v: [B, S, K, H] keys (RoPE applied) and values, e.g. one layer of the cache after
            the prompt's keys were written; N must be a multiple of K.
        q_positions: [B, T] int32 query positions (-1 = padding).
        k_positions: [B, S] int32 position held by each key slot (-1 = empty or padding).
        k_scale, v_scale: [B, S, K] float32 scales when k / v are fp8 codes (one layer of an
            fp8 cache): each key chunk is dequantized to q's dtype as it is read, or None.
        q_chunk: queries per chunk (T is padded up to a multiple; only q is copied).
        k_chunk: keys per chunk.

    Returns:
        [B, T, N, H] in q's dtype.
    """
    b, t, n, h = q.shape
    if k.ndim != 4 or v.shape != k.shape or k.shape[0] != b or k.shape[3] != h:
        raise ValueError(
            f"k, v must be [B, S, K, H] matching q [B, T, N, H]: {q.shape=} {k.shape=} {v.shape=}"
        )
    s, kh = k.shape[1], k.shape[2]
    if n % kh:
        raise ValueError(f"query heads N={n} must be a multiple of kv heads K={kh}")
    if q_positions.shape != (b, t) or k_positions.shape != (b, s):
        raise ValueError(
            f"positions must be q [B, T]=({b}, {t}) and k [B, S]=({b}, {s}), got "
            f"{q_positions.shape=} {k_positions.shape=}"
        )
    if (k_scale is None) != (v_scale is None) or (
        k_scale is not None and (k_scale.shape != k.shape[:-1] or v_scale.shape != k.shape[:-1])
    ):
        raise ValueError(
            f"k_scale and v_scale must both be [B, S, K]={k.shape[:-1]} or both None, got "
            f"{None if k_scale is None else k_scale.shape} "
            f"{None if v_scale is None else v_scale.shape}"
        )
    if q_chunk < 1 or k_chunk < 1:
        raise ValueError(f"chunks must be >= 1, got {q_chunk=} {k_chunk=}")
    g = n // kh
    tq, sk = min(q_chunk, t), min(k_chunk, s)
    nq, nk = pl.cdiv(t, tq), pl.cdiv(s, sk)
    pad = nq * tq - t
    qg = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, nq, tq, kh, g, h)
    qg = qg.transpose(1, 0, 3, 4, 2, 5)  # [nq, B, K, G, tq, H]
    qp = jnp.pad(q_positions.astype(jnp.int32), ((0, 0), (0, pad)), constant_values=-1)
    qp = qp.reshape(b, nq, tq).transpose(1, 0, 2)  # [nq, B, tq]
    k_pos = k_positions.astype(jnp.int32)

    def one_q_chunk(args):
        qi, qpi = args  # [B, K, G, tq, H], [B, tq]

        def body(j, carry):
            acc, m, l = carry
            # The last chunk is shifted back to fit inside S (dynamic_slice clamps); slots it
            # shares with the previous chunk are masked so none is counted twice.
            start = jnp.minimum(j * sk, s - sk)
            kj = lax.dynamic_slice_in_dim(k, start, sk, axis=1)  # [B, sk, K, H]
            vj = lax.dynamic_slice_in_dim(v, start, sk, axis=1)  # [B, sk, K, H]
            if k_scale is not None:
                ksj = lax.dynamic_slice_in_dim(k_scale, start, sk, axis=1)  # [B, sk, K]
                vsj = lax.dynamic_slice_in_dim(v_scale, start, sk, axis=1)
                kj, vj = dequantize_kv(kj, ksj, q.dtype), dequantize_kv(vj, vsj, q.dtype)
            kpj = lax.dynamic_slice_in_dim(k_pos, start, sk, axis=1)  # [B, sk]
            kpj = jnp.where(start + jnp.arange(sk) >= j * sk, kpj, -1)
            scores = jnp.einsum("BKGTH,BSKH->BKGTS", qi, kj, preferred_element_type=jnp.float32)
            scores = scores * (h**-0.5)
            vis = ((kpj[:, None, :] >= 0) & (kpj[:, None, :] <= qpi[:, :, None]))[:, None, None]
            scores = jnp.where(vis, scores, _NEG)  # [B, K, G, tq, sk]
            m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
            alpha = jnp.exp(m - m_new)
            w = jnp.where(vis, jnp.exp(scores - m_new[..., None]), 0.0)
            pv = jnp.einsum(
                "BKGTS,BSKH->BKGTH", w.astype(vj.dtype), vj, preferred_element_type=jnp.float32
            )
            return alpha[..., None] * acc + pv, m_new, alpha * l + jnp.sum(w, axis=-1)

        init = (
            jnp.zeros((b, kh, g, tq, h), jnp.float32),
            jnp.full((b, kh, g, tq), _NEG, jnp.float32),
            jnp.zeros((b, kh, g, tq), jnp.float32),
        )
        acc, _, l = lax.fori_loop(0, nk, body, init)
        return jnp.where((l > 0)[..., None], acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)

    out = lax.map(one_q_chunk, (qg, qp))  # [nq, B, K, G, tq, H]
    out = out.transpose(1, 0, 4, 2, 3, 5).reshape(b, nq * tq, n, h)[:, :t]  # [B, T, N, H]
    return out.astype(q.dtype)
