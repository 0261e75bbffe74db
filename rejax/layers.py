"""Decoder building blocks as pure functions: RMSNorm, RoPE, GQA attention, SwiGLU, linear.

These are the references every fused or kernel op is checked against; `rejax.decoder` composes
them into a layer. A linear holds `weight` [N_out, K_in] (HF layout), stacked over layers
[L, N_out, K_in] in the decoder (see rejax/params.py). Dimension letters: see rejax/config.py.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cuda_ops import nvfp4_gemm
from rejax import nvfp4
from rejax.nvfp4 import Nvfp4Tensor
from rejax.ops import _dispatch
from rejax.ops.linear import nvfp4_linear

# Masked attention scores: the most negative finite float32, so a row with every key masked
# (a padded query) gives a uniform softmax rather than NaN.
_MASKED = float(np.finfo(np.float32).min)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm as Hugging Face computes it: normalize in float32, cast back, then scale.

    Args:
        x: [..., D] activations.
        scale: [D] weight.
        eps: added to the mean square.

    Returns:
        [..., D] in x's dtype.
    """
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (scale * xf.astype(x.dtype)).astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float) -> jax.Array:
    """RoPE's float32 frequencies [H/2]: theta ** -(2i / H), rounded once from float64.

    A trace-time constant (NumPy), not XLA ops: computed in the layer loop's body, the float32
    power was one more kernel launch per layer on the GPU (the profile's `loop_power_fusion`,
    experiments/results/h200_e/), which XLA does not hoist out of the while loop."""
    i = np.arange(0, head_dim, 2, dtype=np.float64)
    return jnp.asarray((1.0 / np.power(float(theta), i / head_dim)).astype(np.float32))


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding with the Hugging Face `rotate_half` convention.

    cos/sin are computed in float32 and cast to x's dtype before use, as transformers does.

    Args:
        x: [B, T, N, H] queries or keys.
        positions: [B, T] int32 absolute positions (padding may hold any value).
        theta: rope_theta.

    Returns:
        [B, T, N, H] in x's dtype.
    """
    h = x.shape[-1]
    freqs = positions.astype(jnp.float32)[..., None] * rope_inv_freq(h, theta)  # [B, T, H/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # [B, T, 1, H]
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    x1, x2 = x[..., : h // 2], x[..., h // 2 :]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x * cos + rotated * sin


def attention_mask(q_positions: jax.Array, k_positions: jax.Array) -> jax.Array:
    """Causal mask by absolute position, per row.

    A key is visible to a query iff the key slot holds a token (position >= 0) at or before the
    query's position. Because it compares positions rather than slot indices, left- and
    right-padded rows (and padding slots left behind in the cache) are handled alike.

    Args:
        q_positions: [B, T] int32 query positions (-1 = padding).
        k_positions: [B, S] int32 position held by each key slot (-1 = empty or padding).

    Returns:
        [B, T, S] bool.
    """
    k = k_positions[:, None, :]
    return (k >= 0) & (k <= q_positions[:, :, None])


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query attention with float32 scores and softmax.

    Args:
        q: [B, T, N, H] queries (RoPE applied).
        k: [B, S, K, H] keys (RoPE applied); N must be a multiple of K.
        v: [B, S, K, H] values.
        mask: [B, T, S] bool, True = attend.

    Returns:
        [B, T, N, H] in q's dtype.
    """
    b, t, n, h = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, t, kv, n // kv, h)  # [B, T, K, G, H]
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (h**-0.5)
    scores = jnp.where(mask[:, None, None, :, :], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v)
    return out.reshape(b, t, n, h).astype(q.dtype)  # [B, T, N, H]


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """SwiGLU activation: silu(gate) * up."""
    return jax.nn.silu(gate) * up


# cfg.quant -> the kernel's activation mode
_ACT = {"nvfp4": "w4a4", "nvfp4-w4a16": "w4a16"}


def take(a: Any, layer: Any) -> Any:
    """Entry `layer` of per-layer weights: a stacked array (int or traced int32 [] index) or a
    tuple of per-layer arrays (Python int index); `a` itself when layer is None."""
    if layer is None:
        return a
    if isinstance(a, (tuple, list)):
        if not isinstance(layer, (int, np.integer)):
            raise ValueError(  # noqa: TRY004 (bad input is a ValueError in rejax)
                "per-layer weights held as a tuple need a static layer index (an unrolled layer "
                f"loop), got {type(layer).__name__}"
            )
        return a[int(layer)]
    return jax.lax.dynamic_index_in_dim(a, layer, axis=0, keepdims=False)


def linear(
    x: jax.Array,
    params: dict,
    quant: str | None = None,
    *,
    layer: Any = None,
    shards: tuple[int, ...] | None = None,
    gemm_min_m: int | None = None,
    gemm_occupancy: str | None = None,
    gemm_max_m: int | None | str = "default",
    gemm_reduce: str | None = None,
    invariant_rows: int | None = None,
    residual: jax.Array | None = None,
    gemm_copies: str | None = None,
    gemm_wgmma_min_m: int | None | str = "default",
    gemm_dot_dequant: str | None = None,
    gemm_wgmma_max_m: int | None | str = "default",
    gemm_dot_x: str | None = None,
    gemm_wgmma_tm: int | str | None = None,
    gemm_dot_stream: str | None = None,
    gemm_wgmma_raster: int | None = None,
) -> jax.Array:
    """y = x @ W.T (+ b) for a float weight, or an NVFP4 linear through `nvfp4_linear`; with
    `residual`, residual + y.

    NVFP4 linears (quant "nvfp4" = W4A4, "nvfp4-w4a16" = W4A16) take bf16 activations; W4A4 uses
    the static `input_scale` when the params hold one, else a per-row dynamic global scale, and
    quantizes the activations once however many shards the linear fuses. A fused linear whose
    shards have different static input scales (`input_scale` [..., shards]) quantizes x once per
    shard with that shard's scale, so each shard's rows equal the unfused linear exactly.

    Args:
        x: [..., K_in] activations.
        params: {"weight": [N_out, K_in] array, a tuple of them (one per layer), or an
            Nvfp4Tensor (stacked [L, ...] with `layer`), optional "bias" [(L,) N_out], optional
            "input_scale" f32 [(L,)] or [(L,) shards]}.
        quant: None (float weights), "nvfp4" or "nvfp4-w4a16" (cfg.quant): the activation mode
            of NVFP4 weights.
        layer: index into per-layer params (int or traced int32 []), or None for one matrix.
            The NVFP4 kernel reads its stack in place; float weights are separate per-layer
            arrays (XLA would copy a slice of a stack before its cuBLAS call).
        shards: output rows of each fused shard (needed only for per-shard input scales).
        gemm_min_m: NVFP4 W4A4 on CUDA: the fewest rows that take the tensor-core GEMM instead
            of the GEMV (None: the kernel's default, `Config.gemm_min_m`'s default).
        gemm_occupancy: the GEMM plan's `GemmOptions.occupancy` (None: the default, "fill16"; see
            `Config.gemm_occupancy`).
        gemm_max_m: NVFP4 W4A4 on CUDA: the most rows the "auto" dispatch gives the GEMM; more
            take the dot reference ("default": `Config.gemm_max_m`'s default; None: no bound).
        gemm_reduce: how a K-split GEMM adds its partials (`GemmOptions.reduce`; None: the
            default, "finish"; see `Config.gemm_reduce`).
        gemm_copies: how the GEMM writes its stage copies (`GemmOptions.copies`; None: the
            default, "auto"; see `Config.gemm_copies`).
        gemm_wgmma_min_m, gemm_wgmma_max_m: NVFP4 W4A4 on CUDA: the rows that take the wgmma
            GEMM (`GemmOptions.wgmma_min_m` / `wgmma_max_m`; "default": 128 .. 2048; min None:
            never, max None: no bound; see `Config.gemm_wgmma_min_m`).
        gemm_dot_dequant: how the dot path above `gemm_max_m` rows decodes the weight
            (`GemmOptions.dot_dequant`; None: the default, "kernel"; see `Config.gemm_dot_dequant`).
        gemm_dot_x: how that dot takes the activations' values (`GemmOptions.dot_x`; None: the
            default, "kernel"; see `Config.gemm_dot_x`).
        gemm_dot_stream: where that dot's dequantizer kernel runs (`GemmOptions.dot_stream`;
            None: the default, "main"; see `Config.gemm_dot_stream`).
        gemm_wgmma_tm: the wgmma GEMM's token tile (`GemmOptions.wgmma_tm`; None: the default;
            see `Config.gemm_wgmma_tm`).
        gemm_wgmma_raster: the order of that GEMM's tiles (`GemmOptions.wgmma_raster`; None:
            the default; see `Config.gemm_wgmma_raster`).
        invariant_rows: compute as a matmul of this many rows would (`Config.invariant_rows`;
            None: off): the NVFP4 GEMM plans its K split for it (`GemmOptions.split_m`); a
            float weight's matmul runs on rows zero-padded to it (when fewer), and so does
            the residual add.
        residual: [..., N_out] added to the result (a decoder's residual stream), or None.

    Returns:
        [..., N_out] in x's dtype (residual + y with a residual).
    """
    w = params["weight"]
    if not isinstance(w, Nvfp4Tensor):

        def matmul(a):
            y = jnp.einsum("...k,nk->...n", a, take(w, layer).astype(x.dtype))
            if "bias" in params:
                y = y + take(params["bias"], layer).astype(x.dtype)
            return y

        # The residual add is inside the padded rows: XLA may fuse it into the matmul's
        # epilogue (one rounding of x @ W.T + residual), and a padded program must fuse it
        # as the unpadded one does.
        return padded_rows(matmul, x, invariant_rows, residual)
    else:
        if quant not in _ACT:
            raise ValueError(f"NVFP4 weight needs quant 'nvfp4' or 'nvfp4-w4a16', got {quant!r}")
        act = _ACT[quant]
        # A calibrated input_scale only matters for W4A4; W4A16 never quantizes activations.
        scale = params.get("input_scale") if act == "w4a4" else None
        scale = None if scale is None else take(scale, layer)
        xb = x.astype(jnp.bfloat16)
        opts = gemm_options(
            gemm_min_m,
            gemm_occupancy,
            gemm_max_m,
            gemm_reduce,
            invariant_rows,
            copies=gemm_copies,
            wgmma_min_m=gemm_wgmma_min_m,
            dot_dequant=gemm_dot_dequant,
            wgmma_max_m=gemm_wgmma_max_m,
            dot_x=gemm_dot_x,
            wgmma_tm=gemm_wgmma_tm,
            wgmma_raster=gemm_wgmma_raster,
            dot_stream=gemm_dot_stream,
        )
        if scale is not None and scale.ndim == 1:
            y = _per_shard_linear(xb, w, scale, layer, shards, opts)
        else:
            y = nvfp4_linear(xb, w, input_scale=scale, act=act, layer=layer, gemm_options=opts)
        y = y.astype(x.dtype)
    if "bias" in params:
        y = y + take(params["bias"], layer).astype(x.dtype)
    return y if residual is None else residual + y


def padded_rows(fn, x: jax.Array, rows: int | None, residual: jax.Array | None = None) -> jax.Array:
    """fn(x) (residual + fn(x) with a `residual` [..., N]) for a row-wise fn ([..., K] ->
    [..., N]), computed on x's (and the residual's) rows zero-padded to `rows` when it has fewer
    (None: unpadded): a float matmul then runs with the algorithm of a `rows`-row batch, and
    whatever XLA fuses into it (the residual add) is fused alike, so each row's result does not
    depend on how many rows came with it."""
    lead = x.shape[:-1]
    m = math.prod(lead)
    if rows is None or m >= rows or m == 0:
        return fn(x) if residual is None else residual + fn(x)

    # No optimization barriers around the matmul: the B-row program must stay the one that
    # static batches run (no padding there). With barriers only the smaller programs would
    # change; with them at B rows too, 214 of 512 bf16 rows differed from static batches on the
    # H200 (experiments/results/h200_i/), and one decode step measured the same bits with
    # and without them (experiments/row_invariance_check.py).
    def pad(a):
        return jnp.pad(jnp.reshape(a, (m, a.shape[-1])), ((0, rows - m), (0, 0)))

    y = fn(pad(x))
    if residual is not None:
        y = pad(residual) + y
    y = y[:m]
    return jnp.reshape(y, (*lead, y.shape[-1]))


def gemm_options(
    min_m: int | None,
    occupancy: str | None = None,
    max_m: int | None | str = "default",
    reduce: str | None = None,
    split_m: int | None = None,
    x_quant: str | None = None,
    copies: str | None = None,
    wgmma_min_m: int | None | str = "default",
    dot_dequant: str | None = None,
    wgmma_max_m: int | None | str = "default",
    wgmma_x_quant: str | None = None,
    dot_x: str | None = None,
    wgmma_tm: int | str | None = None,
    dot_stream: str | None = None,
    wgmma_raster: int | None = None,
) -> nvfp4_gemm.GemmOptions:
    """The NVFP4 GEMM choices with `min_m`, `occupancy`, `max_m`, `reduce`, `split_m`, `x_quant`,
    `copies`, `wgmma_min_m`, `dot_dequant` and `wgmma_max_m` (None / "default": the defaults;
    max_m and wgmma_max_m None are no bound, wgmma_min_m None is never; with `split_m` a
    "default" wgmma_min_m is None: the wgmma GEMM would change the summation order at its
    first row count), e.g. `Config.gemm_min_m`, `gemm_occupancy`, `gemm_max_m`, `gemm_reduce`,
    `invariant_rows`, `gemm_x_quant`, `gemm_copies`, `gemm_wgmma_min_m`, `gemm_dot_dequant`,
    `gemm_wgmma_max_m`, `gemm_wgmma_x_quant`, `gemm_dot_x`, `gemm_wgmma_tm`,
    `gemm_dot_stream` and `gemm_wgmma_raster` (None: the default; `wgmma_tm` "128" / "256" as
    ints)."""
    opts = nvfp4_gemm.DEFAULT_OPTIONS
    if isinstance(wgmma_tm, str) and wgmma_tm.isdigit():
        wgmma_tm = int(wgmma_tm)
    if wgmma_tm is not None and wgmma_tm != opts.wgmma_tm:
        opts = dataclasses.replace(opts, wgmma_tm=wgmma_tm)
    if wgmma_raster is not None and wgmma_raster != opts.wgmma_raster:
        opts = dataclasses.replace(opts, wgmma_raster=wgmma_raster)
    if dot_x is not None and dot_x != opts.dot_x:
        opts = dataclasses.replace(opts, dot_x=dot_x)
    if dot_stream is not None and dot_stream != opts.dot_stream:
        opts = dataclasses.replace(opts, dot_stream=dot_stream)
    if dot_dequant is not None and dot_dequant != opts.dot_dequant:
        opts = dataclasses.replace(opts, dot_dequant=dot_dequant)
    if wgmma_min_m == "default" and split_m is not None:
        wgmma_min_m = None
    if wgmma_min_m != "default" and wgmma_min_m != opts.wgmma_min_m:
        opts = dataclasses.replace(opts, wgmma_min_m=wgmma_min_m)
    if wgmma_max_m != "default" and wgmma_max_m != opts.wgmma_max_m:
        opts = dataclasses.replace(opts, wgmma_max_m=wgmma_max_m)
    if wgmma_x_quant is not None and wgmma_x_quant != opts.wgmma_x_quant:
        opts = dataclasses.replace(opts, wgmma_x_quant=wgmma_x_quant)
    if copies is not None and copies != opts.copies:
        opts = dataclasses.replace(opts, copies=copies)
    if x_quant is not None and x_quant != opts.x_quant:
        opts = dataclasses.replace(opts, x_quant=x_quant)
    if split_m is not None:
        opts = dataclasses.replace(opts, split_m=split_m)
    if min_m is not None and min_m != opts.min_m:
        opts = dataclasses.replace(opts, min_m=min_m)
    if occupancy is not None and occupancy != opts.occupancy:
        opts = dataclasses.replace(opts, occupancy=occupancy)
    if max_m != "default" and max_m != opts.max_m:
        opts = dataclasses.replace(opts, max_m=max_m)
    if reduce is not None and reduce != opts.reduce:
        opts = dataclasses.replace(opts, reduce=reduce)
    return opts


def _per_shard_linear(x, w, scales, layer, shards, gemm_options):
    if shards is None or len(shards) != scales.shape[0]:
        raise ValueError(f"per-shard input scales {scales.shape} need shards=, got {shards}")
    _dispatch.note_once(
        "nvfp4_linear", f"fused linear {w.shape} with per-shard input scales: one GEMV per shard"
    )
    wl = w if layer is None else nvfp4.take(w, layer)
    outs, start = [], 0
    for i, n in enumerate(shards):
        part = Nvfp4Tensor(
            packed=wl.packed[start : start + n],
            scales=wl.scales[start : start + n],
            global_scale=wl.global_scale if not wl.per_row else wl.global_scale[start : start + n],
            shape=(n, wl.k),
        )
        outs.append(
            nvfp4_linear(x, part, input_scale=scales[i], act="w4a4", gemm_options=gemm_options)
        )
        start += n
    return jnp.concatenate(outs, axis=-1)
