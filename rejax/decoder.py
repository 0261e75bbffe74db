"""The decoder (Qwen3 / Qwen2): one layer as a pure function, the stack under one `lax.scan`.

`forward` embeds the tokens, runs `decoder_layer` for layer i = 0 .. L-1 under a `lax.scan`
over the stacked layer weights (rejax/params.py), so the compiled program does not grow with
depth, then the final norm and head. The stacked weights are closed over, not scanned: every op
receives the whole stack and the layer index (the NVFP4 kernel offsets its pointers by it), and
the stacked KV cache [L, B, S, K, H] is carried and updated in place. `Model` is the Flax Linen
module over it: `Model(cfg).apply({"params": weights}, tokens, positions, cache)` returns
`(logits, cache)`, nothing mutated. Dimension letters: see rejax/config.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from cuda_ops import nvfp4_gemm
from cuda_ops.build import device_sms
from cuda_ops.decode_attention import FlashOptions
from cuda_ops.nvfp4_gemv import Prefetch
from cuda_ops.rope_cache import Shape as RopeShape
from rejax import params as rparams
from rejax import sharding
from rejax.cache import KVCache, read_layer, write_layer, write_positions
from rejax.config import FLASH_ATTENTIONS, Config, weight_prefetch_policy
from rejax.layers import (
    attention,
    attention_mask,
    gemm_options,
    linear,
    padded_rows,
    rms_norm,
    rope,
    swiglu,
    take,
)
from rejax.nvfp4 import Nvfp4Tensor
from rejax.ops.decode_attention import (
    cuda_problem,
    decode_attention,
    decode_attention_nvfp4,
    default_num_splits,
    prefill_attention,
)
from rejax.ops.dot_block import dot_block_supported, mlp_dot, post_attention_dot
from rejax.ops.fused_block import (
    block_supported,
    post_attention_block,
    pre_attention_block,
    pre_supported,
    xhat_input,
)
from rejax.ops.fused_linear import (
    fusable,
    fused_linear,
    fused_linear_swiglu,
    linear_from_codes,
    linear_norm_out,
    linear_swiglu_from_codes,
    norm_out_supported,
    swiglu_kernel_supported,
    takes_codes,
)
from rejax.ops.rope_cache import rope_cache


def decoder_layer(
    x: jax.Array,
    lw: dict,
    i: jax.Array,
    positions: jax.Array,
    kv: tuple[jax.Array, jax.Array] | None,
    index: jax.Array | None,
    k_positions: jax.Array,
    cfg: Config,
    with_amax: bool = False,
    tp_axis: str | None = None,
    live: jax.Array | None = None,
    qkv_in: tuple[jax.Array, jax.Array] | None = None,
) -> tuple[jax.Array, tuple | None, dict, tuple | None]:
    """Pre-norm block x + attn(norm(x)); x + mlp(norm(x)) for layer i of the stack.

    Args:
        x: [B, T, D] activations.
        lw: the stacked layer weights (params["layers"]).
        i: int32 [] layer index.
        positions: [B, T] int32 positions (-1 = padding).
        kv: the stacked cache `KVCache.layers` (k, v [L, B, S, K, H], fp8 scales [L, B, S, K] or
            None) to write this layer's T entries into, or None for cache-free attention over
            these T tokens.
        index: [] int32 first cache slot written (with kv), or [B] int32 per row.
        k_positions: [B, S] (or [B, T] without a cache) positions held by each key slot.
        cfg: model config.
        with_amax: record each linear's input amax (calibration).
        tp_axis: inside `shard_map` (rejax/sharding.py), the mesh axis the heads and the
            feed-forward width are split over: lw and cfg are this device's slice, and o_proj
            and down_proj are row-parallel (`sharding.row_parallel_linear`, one all-reduce each).
        live: with kv and one new token per row, the cache slots attention reads, [0, live)
            (`live_slots(index)`; computed here when None). `forward` computes it once for all
            layers, so the scanned body does not recompute it.
        qkv_in: this layer's qkv input already quantized (x_hat, global scale), which the
            previous layer wrote (`cross_layer_chain`); then the layer also writes the next
            one's.

    Returns:
        (x [B, T, D], updated kv or None, {linear name: input amax f32 []} or {}, the next
        layer's qkv input with `qkv_in`, else None).
    """
    b, t, _ = x.shape
    n, kh, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q_ = cfg.quant
    att, mlp = lw["self_attn"], lw["mlp"]
    amax = {}

    def lin(inp, block, name, residual=None):
        if with_amax:
            amax[name] = jnp.max(jnp.abs(inp.astype(jnp.float32)))
        if tp_axis is not None and name in sharding.ROW_PARALLEL:
            shards = rparams.shards(cfg, name)
            y = sharding.row_parallel_linear(inp, block[name], q_, i, shards, tp_axis)
            return y if residual is None else residual + y
        return linear(inp, block[name], q_, layer=i, shards=rparams.shards(cfg, name),
                      gemm_min_m=cfg.gemm_min_m, gemm_occupancy=cfg.gemm_occupancy,
                      gemm_max_m=cfg.gemm_max_m, gemm_reduce=cfg.gemm_reduce,
                      invariant_rows=cfg.invariant_rows, residual=residual,
                      gemm_copies=cfg.gemm_copies,
                      gemm_wgmma_min_m=cfg.gemm_wgmma_min_m,
                      gemm_dot_dequant=cfg.gemm_dot_dequant,
                      gemm_wgmma_max_m=cfg.gemm_wgmma_max_m,
                      gemm_dot_x=cfg.gemm_dot_x, gemm_wgmma_tm=cfg.gemm_wgmma_tm,
                      gemm_dot_stream=cfg.gemm_dot_stream,
                      gemm_wgmma_raster=cfg.gemm_wgmma_raster)  # fmt: skip

    # W4A4 linears with bf16 activations take the fused ops (one kernel each on CUDA): the
    # norms / SwiGLU in front, the residual adds behind (a composition of the same functions)
    fuse = (
        cfg.linear_fusion in ("fused", "split", "mixed")
        and tp_axis is None  # row-parallel linears need their all-reduce before the residual
        and not with_amax
        and x.dtype == jnp.bfloat16
        and all(fusable(lw[blk][name], q_) for blk, name in rparams.LINEARS)
    )
    eps = cfg.rms_norm_eps
    kernels = "two" if cfg.linear_fusion in ("split", "mixed") else "one"
    # "mixed": o_proj, whose input needs no row statistic (no norm in front), quantizes it in
    # its own GEMV launch; the others keep the quantizer kernel in front
    o_kernels = "one" if cfg.linear_fusion == "mixed" else kernels
    gemm = {
        "gemm_options": gemm_options(
            cfg.gemm_min_m,
            cfg.gemm_occupancy,
            cfg.gemm_max_m,
            cfg.gemm_reduce,
            cfg.invariant_rows,
            cfg.gemm_x_quant,
            copies=cfg.gemm_copies,
            wgmma_min_m=cfg.gemm_wgmma_min_m,
            dot_dequant=cfg.gemm_dot_dequant,
            wgmma_max_m=cfg.gemm_wgmma_max_m,
            wgmma_x_quant=cfg.gemm_wgmma_x_quant,
            dot_x=cfg.gemm_dot_x,
            wgmma_tm=cfg.gemm_wgmma_tm,
            dot_stream=cfg.gemm_dot_stream,
            wgmma_raster=cfg.gemm_wgmma_raster,
        ),
        "residual_epilogue": cfg.residual_fusion == "fused",
    }
    pf = weight_prefetch_policy(cfg.weight_prefetch) if fuse and kernels == "two" else None

    def prefetch(*targets):
        # L2 prefetch hints for a linear's GEMV: (block, linear, layer delta, policy key)
        if pf is None:
            return {}
        picked = tuple(
            (block[name]["weight"], delta, pf[key])
            for block, name, delta, key in targets
            if pf[key] > 0
        )
        options = Prefetch(at=pf["at"], mode=pf["mode"], evict_first=bool(pf["ef"]))
        return {"prefetch": picked, "prefetch_options": options}

    # one new token per row into a bf16 cache: q/k norms, RoPE and the cache write as one op
    # (one kernel on CUDA, the cache updated in place; the same composition elsewhere)
    rope_fused = kv is not None and t == 1 and kv[2] is None and cfg.rope_fusion == "fused"
    if qkv_in is not None:
        if not (fuse and rope_fused):
            raise ValueError(
                "qkv_in needs the fused linears and the rope kernel (cross_layer_chain)"
            )
        q, kv = _pre_attention_xq(qkv_in, lw, i, cfg, positions, index, kv, gemm)
    elif fuse and rope_fused:
        q, kv = _pre_attention(x, lw, i, cfg, positions, index, kv, kernels, gemm, prefetch)
    elif fuse:
        qkv = _fused_qkv(x, lw, i, cfg, kernels, gemm, prefetch)
    else:
        hs = rms_norm(x, take(lw["input_layernorm"]["scale"], i), cfg.rms_norm_eps)
        qkv = lin(hs, att, "qkv_proj")
    if rope_fused and not fuse:  # (fused: _pre_attention did both)
        q, kv = _rope_cache(qkv, lw, i, cfg, positions, index, kv)
    elif not rope_fused:
        q = qkv[..., : n * h].reshape(b, t, n, h)  # [B, T, N, H]
        k = qkv[..., n * h : (n + kh) * h].reshape(b, t, kh, h)  # [B, T, K, H]
        v = qkv[..., (n + kh) * h :].reshape(b, t, kh, h)  # [B, T, K, H]
        if cfg.arch == "qwen3":
            q = rms_norm(q, take(att["q_norm"]["scale"], i), cfg.rms_norm_eps)
            k = rms_norm(k, take(att["k_norm"]["scale"], i), cfg.rms_norm_eps)
        q = rope(q, positions, cfg.rope_theta)
        k = rope(k, positions, cfg.rope_theta)
        if kv is not None:
            kv = write_layer(kv, k, v, index, i)
    if kv is not None and t == 1 and cfg.attention != "einsum":
        # one new token per row: read only the slots written so far, [0, index + 1) (with a
        # per-row index, each row its own range and split plan). "flash" / "flash-mma" take
        # the one-launch CUDA kernel (FLASH_ATTENTIONS' options) for a bf16 cache on CUDA;
        # otherwise what "live" runs.
        li = jnp.asarray(i, jnp.int32)
        live = live_slots(index) if live is None else live
        flash = cfg.attention in FLASH_ATTENTIONS and kv[2] is None
        kernel = "cuda" if flash else "pallas"
        options = FlashOptions(**FLASH_ATTENTIONS[cfg.attention]) if flash else None
        # invariant_rows: the split count of a program of that many rows, so a row's splits
        # (and its rounding) are the same in a compacted program as in the B-row one
        splits = None
        if cfg.invariant_rows is not None:
            splits = default_num_splits(max(b, cfg.invariant_rows), kh, kv[0].shape[2])
        args = (q[:, 0], kv[0], kv[1], li, positions[:, 0], k_positions, live)
        launch = {"kernel": kernel, "num_splits": splits, "cuda_options": options}
        if (
            flash
            and not cuda_problem(*args[:3], None, options)[1]
            and codes_out(cfg, att["o_proj"], b, fuse, o_kernels, gemm["gemm_options"])
        ):
            # the CUDA kernel takes this problem: it writes o_proj's NVFP4 input (no quantizer
            # launch), the GEMV reads it
            xq = decode_attention_nvfp4(*args, att["o_proj"]["input_scale"], **launch)
            if norm_codes_out(cfg, att["o_proj"], mlp, b, gemm, pf is not None):
                # o_proj's GEMV also writes gate_up's NVFP4 input (its last CTA: no quantizer
                # launch for gate_up)
                y, gq = linear_norm_out(*xq, att["o_proj"], residual=x[:, 0],
                                        norm=lw["post_attention_layernorm"]["scale"],
                                        next_scale=mlp["gate_up_proj"]["input_scale"], layer=i,
                                        eps=eps, gemm_options=gemm["gemm_options"])  # fmt: skip
                return _mlp_from_codes(y, gq, mlp, i, cfg, kernels, gemm)[:, None], kv, amax, None
            x = linear_from_codes(*xq, att["o_proj"], layer=i, residual=x[:, 0],
                                  gemm_options=gemm["gemm_options"],
                                  residual_epilogue=gemm["residual_epilogue"],
                                  **prefetch((mlp, "gate_up_proj", 0, "gu")))[:, None]  # fmt: skip
            return _mlp(x, lw, mlp, i, cfg, kernels, gemm, prefetch), kv, amax, None
        out = decode_attention(*args, k_scale=kv[2], v_scale=kv[3], **launch)
        out = out.reshape(b, t, n * h)  # [B, 1, N*H]
    elif kv is not None and cfg.attention != "einsum":
        # a prompt: flash-style over chunks, never holding [B, N, T, S] scores (fp8 chunks
        # dequantized as they are read)
        ks, vs = (None, None) if kv[2] is None else (take(kv[2], i), take(kv[3], i))
        out = prefill_attention(
            q, take(kv[0], i), take(kv[1], i), positions, k_positions, k_scale=ks, v_scale=vs
        ).reshape(b, t, n * h)
    else:
        keys, values = (k, v) if kv is None else read_layer(kv, i, q.dtype)  # [B, S, K, H]
        mask = attention_mask(positions, k_positions)
        out = attention(q, keys, values, mask).reshape(b, t, n * h)  # [B, T, N*H]
    if fuse:
        if qkv_in is not None:  # cross_layer_chain: this layer also writes the next one's
            y, qkv_next = _post_attention_next(x, out, lw, i, cfg, gemm)
            return y, kv, amax, qkv_next
        return (
            _post_attention(x, out, lw, i, cfg, o_kernels, kernels, gemm, prefetch),
            kv,
            amax,
            None,
        )
    x = lin(out, att, "o_proj", residual=x)
    hs = rms_norm(x, take(lw["post_attention_layernorm"]["scale"], i), cfg.rms_norm_eps)
    gate_up = lin(hs, mlp, "gate_up_proj")
    f = cfg.intermediate_size
    x = lin(swiglu(gate_up[..., :f], gate_up[..., f:]), mlp, "down_proj", residual=x)
    return x, kv, amax, None


def _fused_qkv(x, lw, i, cfg: Config, kernels: str, gemm: dict, prefetch) -> jax.Array:
    """The fused path's qkv projection: rms_norm(x) in front, [B, T, (N + 2 KV) H]."""
    att, mlp = lw["self_attn"], lw["mlp"]
    norm = lw["input_layernorm"]["scale"]
    return fused_linear(x, att["qkv_proj"], layer=i, prologue="rmsnorm", norm=norm,
                        eps=cfg.rms_norm_eps, kernels=kernels, **gemm,
                        **prefetch((att, "o_proj", 0, "o"), (mlp, "gate_up_proj", 0, "qkv_gu")))  # fmt: skip


def _rope_cache(qkv, lw, i, cfg: Config, positions, index, kv) -> tuple:
    """q [B, 1, N, H] and the cache with this token's k, v written, from qkv [B, 1, ...]."""
    att = lw["self_attn"]
    norms = (None, None)
    if cfg.arch == "qwen3":
        norms = (att["q_norm"]["scale"], att["k_norm"]["scale"])
    q, kc, vc = rope_cache(
        qkv[:, 0], *norms, i, positions[:, 0], index, kv[0], kv[1], heads=cfg.num_heads,
        kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, eps=cfg.rms_norm_eps,
        theta=cfg.rope_theta,
    )  # fmt: skip
    return q[:, None], (kc, vc, None, None)


def _pre_attention(x, lw, i, cfg: Config, positions, index, kv, kernels: str, gemm: dict,
                   prefetch) -> tuple:  # fmt: skip
    """The fused path before the attention for one new token a row into a bf16 cache: the qkv
    projection, then q/k norms, RoPE and the cache write (with Config.gemm_chain "fused" or
    "swiglu_rope" on the GEMM's rows as one op, `pre_attention_block`: the qkv GEMM's finish inside the rope
    kernel). One function, so an experiment can swap it
    (experiments/kernels/nvfp4_block_tma.py's `install_qkv`)."""
    rows = x.shape[0] * x.shape[1]
    if cfg.gemm_chain != "split" and kernels == "two" and rows >= gemm["gemm_options"].min_m:
        # the qkv GEMM's split-K finish inside the rope kernel (one launch fewer)
        att = lw["self_attn"]
        norms = (None, None)
        if cfg.arch == "qwen3":
            norms = (att["q_norm"]["scale"], att["k_norm"]["scale"])
        q, kc, vc = pre_attention_block(
            x[:, 0], att["qkv_proj"], *norms, positions[:, 0], index, kv[0], kv[1],
            norm=lw["input_layernorm"]["scale"], layer=i, heads=cfg.num_heads,
            kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, eps=cfg.rms_norm_eps,
            theta=cfg.rope_theta, gemm_options=gemm["gemm_options"],
        )  # fmt: skip
        return q[:, None], (kc, vc, None, None)
    qkv = _fused_qkv(x, lw, i, cfg, kernels, gemm, prefetch)
    return _rope_cache(qkv, lw, i, cfg, positions, index, kv)


def _rope_norms(att: dict, cfg: Config) -> tuple:
    """(q_norm, k_norm) stacks for the rope kernel (Qwen3), or (None, None) (Qwen2)."""
    if cfg.arch == "qwen3":
        return att["q_norm"]["scale"], att["k_norm"]["scale"]
    return None, None


def _pre_attention_xq(xq, lw, i, cfg: Config, positions, index, kv, gemm: dict) -> tuple:
    """`_pre_attention` on this layer's qkv input as the previous layer quantized it
    (`cross_layer_chain`): the qkv GEMM reads it, its finish inside the rope kernel."""
    att = lw["self_attn"]
    q, kc, vc = pre_attention_block(
        None, att["qkv_proj"], *_rope_norms(att, cfg), positions[:, 0], index, kv[0], kv[1],
        norm=lw["input_layernorm"]["scale"], layer=i, heads=cfg.num_heads,
        kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, eps=cfg.rms_norm_eps,
        theta=cfg.rope_theta, gemm_options=gemm["gemm_options"], xq=xq,
    )  # fmt: skip
    return q[:, None], (kc, vc, None, None)


def _post_attention_next(x, out, lw, i, cfg: Config, gemm: dict) -> tuple:
    """`post_attention_block` that also writes the next layer's qkv input (x_hat, global
    scale): down's finish and that quantizer in one launch (`cross_layer_chain`)."""
    att, mlp = lw["self_attn"], lw["mlp"]
    y, xq = post_attention_block(
        out[:, 0].astype(x.dtype), x[:, 0], att["o_proj"], mlp["gate_up_proj"],
        mlp["down_proj"], norm=lw["post_attention_layernorm"]["scale"], layer=i,
        eps=cfg.rms_norm_eps, gemm_options=gemm["gemm_options"],
        residual_epilogue=gemm["residual_epilogue"], next_qkv=att["qkv_proj"],
        next_norm=lw["input_layernorm"]["scale"], norm_cluster=cfg.gemm_chain == "cluster",
    )  # fmt: skip
    return y[:, None], xq


def cross_layer_chain(cfg: Config, lw: dict, shape: tuple, kv, dtype) -> bool:
    """Whether the decode step's layers hand each other the next qkv input already quantized
    (Config.gemm_chain "fused" or "cluster" on the GEMM's rows: down_proj's split-K finish and the next
    layer's qkv quantizer in one launch; `forward` quantizes layer 0's input before the loop):
    one new token a row into a bf16 cache with the rope kernel, every linear a W4A4 fused
    linear with static or dynamic scales, and every chain of the layer served (the qkv GEMM and
    down_proj's splitting K, `pre_supported` / `block_supported`)."""
    b, t, d = shape
    if not (
        cfg.gemm_chain in ("fused", "cluster")
        and cfg.linear_fusion in ("split", "mixed")
        and cfg.rope_fusion == "fused"
        and t == 1
        and kv is not None
        and kv[2] is None
        and dtype == jnp.bfloat16
        and all(fusable(lw[blk][name], cfg.quant) for blk, name in rparams.LINEARS)
    ):
        return False
    att, mlp = lw["self_attn"], lw["mlp"]
    go = gemm_options(cfg.gemm_min_m, cfg.gemm_occupancy, cfg.gemm_max_m, cfg.gemm_reduce,
                      cfg.invariant_rows, cfg.gemm_x_quant, copies=cfg.gemm_copies,
                      wgmma_min_m=cfg.gemm_wgmma_min_m,
                      dot_dequant=cfg.gemm_dot_dequant,
                      wgmma_max_m=cfg.gemm_wgmma_max_m,
                      wgmma_x_quant=cfg.gemm_wgmma_x_quant, dot_x=cfg.gemm_dot_x,
                      wgmma_tm=cfg.gemm_wgmma_tm, dot_stream=cfg.gemm_dot_stream,
                      wgmma_raster=cfg.gemm_wgmma_raster)  # fmt: skip
    shapes = tuple(mlp_or_att[name]["weight"].shape for mlp_or_att, name in
                   ((att, "o_proj"), (mlp, "gate_up_proj"), (mlp, "down_proj")))  # fmt: skip
    qkv = att["qkv_proj"]["weight"].shape
    norms = _rope_norms(att, cfg)
    rope = rope_kernel_shape(b, cfg, kv, norms[0] is not None)
    down = nvfp4_gemm.plan(b, *shapes[2], device_sms(), go)
    return (
        block_supported(b, shapes, go)[0]
        and pre_supported(b, qkv, rope, go)[0]
        and down.partials
        and qkv[1] == d
    )


def rope_kernel_shape(b: int, cfg: Config, kv, qk_norm: bool):
    """The rope kernel's shape for B rows of `cfg` into the cache `kv` (one slot for all rows:
    a per-row index is checked by the op itself)."""
    return RopeShape(batch=b, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
                     head_dim=cfg.head_dim, slots=kv[0].shape[2], qk_norm=qk_norm,
                     eps=float(cfg.rms_norm_eps), index_rows=False)  # fmt: skip


def _post_attention(x, out, lw, i, cfg: Config, o_kernels: str, kernels: str, gemm: dict,
                    prefetch) -> jax.Array:  # fmt: skip
    """The fused path after the attention: x + o_proj(out), then the feed-forward half (`_mlp`);
    with Config.gemm_chain "fused" on the GEMM's rows, the whole of it as one op
    (`post_attention_block`: each K-split GEMM's finish and the next quantizer in one launch;
    "swiglu_rope": only gate_up's finish and down's quantizer; "cluster": as "fused", the
    RMSNorm finish-quantizers as thread-block clusters). On the dot path's rows with
    Config.gemm_dot_finish "block" `post_attention_dot` (each dot's float32 sum read by the next
    quantizer), with "swiglu" o_proj then `mlp_dot` (in `_mlp`).
    One function, so an experiment can swap the whole post-attention block of the decode step
    (experiments/kernels/nvfp4_block_tma.py's `install`)."""
    att, mlp = lw["self_attn"], lw["mlp"]
    rows = x.shape[0] * x.shape[1]
    go = gemm["gemm_options"]
    if cfg.gemm_dot_finish == "block" and o_kernels == kernels and dot_finish(cfg, lw, rows, go):
        y = post_attention_dot(
            out.astype(x.dtype).reshape(rows, -1), x.reshape(rows, x.shape[-1]), att["o_proj"],
            mlp["gate_up_proj"], mlp["down_proj"], layer=i,
            norm=lw["post_attention_layernorm"]["scale"], eps=cfg.rms_norm_eps, kernels=kernels,
            **gemm,
        )  # fmt: skip
        return y.reshape(x.shape)
    # (on the dot path's rows post_attention_block is its three linears: with a dot finish the
    # last two go as one op, in `_mlp`)
    if (
        cfg.gemm_chain != "split"
        and kernels == "two"
        and rows >= go.min_m
        and not dot_finish(cfg, lw, rows, go, with_o=False)
    ):
        return post_attention_block(
            out.astype(x.dtype), x, att["o_proj"], mlp["gate_up_proj"], mlp["down_proj"],
            norm=lw["post_attention_layernorm"]["scale"], layer=i, eps=cfg.rms_norm_eps,
            gemm_options=gemm["gemm_options"], residual_epilogue=gemm["residual_epilogue"],
            chain_norm=cfg.gemm_chain != "swiglu_rope",
            norm_cluster=cfg.gemm_chain == "cluster",
        )  # fmt: skip
    x = fused_linear(out.astype(x.dtype), att["o_proj"], layer=i, residual=x,
                     kernels=o_kernels, **gemm,
                     **prefetch((mlp, "gate_up_proj", 0, "gu")))  # fmt: skip
    return _mlp(x, lw, mlp, i, cfg, kernels, gemm, prefetch)


def _mlp(x, lw, mlp, i, cfg: Config, kernels: str, gemm: dict, prefetch) -> jax.Array:
    """The fused path's feed-forward half: x + down(swiglu(gate_up(rms_norm(x)))); with
    Config.gate_up_output "nvfp4" where it applies, gate_up writes down's NVFP4 input."""
    norm = lw["post_attention_layernorm"]["scale"]
    rows = x.shape[0] * x.shape[1]
    if dot_finish(cfg, lw, rows, gemm["gemm_options"], with_o=False):
        y = mlp_dot(x.reshape(rows, x.shape[-1]), mlp["gate_up_proj"], mlp["down_proj"], layer=i,
                    norm=norm, eps=cfg.rms_norm_eps, kernels=kernels, **gemm)  # fmt: skip
        return y.reshape(x.shape)
    if swiglu_codes_out(cfg, mlp, rows, kernels, gemm["gemm_options"]):
        x2 = x.reshape(rows, x.shape[-1])
        xq = fused_linear_swiglu(x2, mlp["gate_up_proj"], mlp["down_proj"]["input_scale"],
                                 layer=i, norm=norm, eps=cfg.rms_norm_eps,
                                 gemm_options=gemm["gemm_options"],
                                 **prefetch((mlp, "down_proj", 0, "down")))  # fmt: skip
        y = linear_from_codes(*xq, mlp["down_proj"], layer=i, residual=x2,
                              gemm_options=gemm["gemm_options"],
                              residual_epilogue=gemm["residual_epilogue"],
                              **prefetch((lw["self_attn"], "qkv_proj", 1, "qkv")))  # fmt: skip
        return y.reshape(x.shape)
    gate_up = fused_linear(x, mlp["gate_up_proj"], layer=i, prologue="rmsnorm", norm=norm,
                           eps=cfg.rms_norm_eps, kernels=kernels, **gemm,
                           **prefetch((mlp, "down_proj", 0, "down")))  # fmt: skip
    return fused_linear(gate_up, mlp["down_proj"], layer=i, prologue="swiglu", residual=x,
                        kernels=kernels, **gemm, **prefetch((lw["self_attn"], "qkv_proj", 1, "qkv")))  # fmt: skip


def _mlp_from_codes(y, gq, mlp, i, cfg: Config, kernels: str, gemm: dict) -> jax.Array:
    """`_mlp` on [rows, D] y whose gate_up input `gq` (codes, scales, global scale) o_proj
    wrote: gate_up on the codes, then down with the residual y (gate_up writing down's input
    too where Config.gate_up_output "nvfp4" applies)."""
    go = gemm["gemm_options"]
    if swiglu_codes_out(cfg, mlp, y.shape[0], kernels, go):
        xq = linear_swiglu_from_codes(*gq, mlp["gate_up_proj"], mlp["down_proj"]["input_scale"],
                                      layer=i, gemm_options=go)  # fmt: skip
        return linear_from_codes(*xq, mlp["down_proj"], layer=i, residual=y, gemm_options=go,
                                 residual_epilogue=gemm["residual_epilogue"])  # fmt: skip
    gate_up = linear_from_codes(*gq, mlp["gate_up_proj"], layer=i, gemm_options=go)
    return fused_linear(gate_up, mlp["down_proj"], layer=i, prologue="swiglu", residual=y,
                        kernels=kernels, **gemm)  # fmt: skip


def norm_codes_out(
    cfg: Config, o_proj: dict, mlp: dict, rows: int, gemm: dict, prefetching: bool
) -> bool:
    """Whether o_proj's GEMV also writes gate_up's NVFP4 input (Config.o_proj_output "nvfp4"
    where it applies: after the attention wrote o_proj's codes (`codes_out`), with the residual
    in the GEMV's epilogue, a static gate_up input scale, no weight prefetch, `rows` in the
    NORM_OUT GEMV's range; `linear_norm_out`)."""
    n, k = o_proj["weight"].shape
    return (
        cfg.o_proj_output == "nvfp4"
        and gemm["residual_epilogue"]
        and not prefetching
        and mlp["gate_up_proj"].get("input_scale") is not None
        and norm_out_supported(rows, n, k, gemm["gemm_options"])[0]
    )


def dot_finish(cfg: Config, lw: dict, rows: int, gemm_options, with_o: bool = True) -> bool:
    """Whether the next quantizer reads a dot's float32 sum (Config.gemm_dot_finish "swiglu" or
    "block" where `rejax.ops.dot_block.dot_block_supported` holds: the dot path's rows), for
    the post-attention half (`with_o`) or the feed-forward half alone."""
    mlp = lw["mlp"]
    shapes = (mlp["gate_up_proj"]["weight"].shape, mlp["down_proj"]["weight"].shape)
    if with_o:
        shapes = (lw["self_attn"]["o_proj"]["weight"].shape, *shapes)
    return cfg.gemm_dot_finish != "split" and dot_block_supported(rows, shapes, gemm_options)[0]


def swiglu_codes_out(cfg: Config, mlp: dict, rows: int, kernels: str, gemm_options) -> bool:
    """Whether gate_up writes down's NVFP4 input (Config.gate_up_output "nvfp4" where it
    applies: the "split" path, a static down_proj input scale, `rows` at the GEMV's, N = 2F
    in whole blocks; `fused_linear_swiglu`)."""
    n, k = mlp["gate_up_proj"]["weight"].shape
    return (
        cfg.gate_up_output == "nvfp4"
        and kernels == "two"
        and mlp["down_proj"].get("input_scale") is not None
        and swiglu_kernel_supported(rows, n, k, gemm_options)[0]
    )


def codes_out(
    cfg: Config, o_proj: dict, rows: int, fuse: bool, o_kernels: str, gemm_options
) -> bool:
    """Whether a decode step's attention writes o_proj's NVFP4 input (Config.attention_output
    "nvfp4" where it applies: the fused "split" path, a static o_proj input scale, `rows` in the
    plain W4A4 GEMV's range); the caller has checked the one-launch CUDA attention applies."""
    return (
        cfg.attention_output == "nvfp4"
        and fuse
        and o_kernels == "two"
        and o_proj.get("input_scale") is not None
        and takes_codes(rows, o_proj, gemm_options)
    )


def live_slots(index: jax.Array) -> jax.Array:
    """Slots a decode step's attention reads after writing one token per row at `index` ([] or
    [B] int32): [0, index + 1), per row with a per-row index (each row's attention then reads,
    and splits, only its own range, whatever the other rows hold)."""
    return index + 1


def layer_loop(weights: dict, cfg: Config) -> str:
    """ "scan" or "unroll" for these weights (cfg.layer_loop, "auto" resolved).

    "auto" scans when every decoder linear is NVFP4: its kernel reads the layer stack in place.
    Float linears hold one buffer per layer (a tuple; XLA would copy a slice of a stacked float
    weight before its cuBLAS call, rejax/params.py), which only a Python loop can index, so
    they take the unrolled loop: one layer body per layer in the program, as before stacking.
    """
    quantized = all(
        isinstance(weights["layers"][b][n]["weight"], Nvfp4Tensor) for b, n in rparams.LINEARS
    )
    if cfg.layer_loop == "scan" and not quantized:
        raise ValueError(
            "layer_loop='scan' needs every decoder linear NVFP4 (stacked); float linears hold "
            "one array per layer and need layer_loop='unroll' or 'auto'"
        )
    if cfg.layer_loop != "auto":
        return cfg.layer_loop
    return "scan" if quantized else "unroll"


def logits_out_dtype(head_dtype: Any, logits_dtype: Any) -> Any:
    """The dtype `forward` returns its logits in: `logits_dtype`, None for the head's own; a
    ValueError where it would round the head's logits."""
    if logits_dtype is None:
        return jnp.dtype(head_dtype)
    out = jnp.dtype(logits_dtype)
    if jnp.promote_types(head_dtype, out) != out:
        raise ValueError(
            f"logits_dtype={out.name} would round the head's {jnp.dtype(head_dtype).name} "
            f"logits; expected {jnp.dtype(head_dtype).name}, a wider float or None"
        )
    return out


def forward(
    weights: dict,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache | None,
    cfg: Config,
    logits_at: jax.Array | None = None,
    *,
    with_amax: bool = False,
    tp_axis: str | None = None,
    logits_dtype: Any = jnp.float32,
):
    """Forward over T new tokens per row.

    Args:
        weights: the weights pytree (rejax/params.py).
        tokens: [B, T] int32 token ids (padding ids are ignored through positions).
        positions: [B, T] int32 absolute positions; -1 marks padding.
        cache: a KVCache with room for T more slots, or None for cache-free attention over
            these T tokens only.
        cfg: model config.
        logits_at: optional [B] int32 index into T; when given only those rows' logits are
            computed (prefill), shape [B, V].
        with_amax: also return each linear's input amax per layer ({name: f32 [L]}), for
            activation-scale calibration.
        tp_axis: run as one device's shard of a tensor-parallel model inside `shard_map`
            (rejax/sharding.py): weights and cfg are this device's slice, row-parallel linears
            all-reduce over this mesh axis, and an embedding table with fewer rows than
            cfg.vocab_size is this device's vocabulary slice (logits are then [..., V / M]).
        logits_dtype: the logits' dtype: float32 (the default), or None for the head's own
            (the activation dtype: bfloat16 logits of a bfloat16 model hold the same values in
            half the bytes, which the decode loop carries and the sampler kernels read). A
            dtype narrower than the head's is an error (it would round the logits).

    Returns:
        (logits [B, T, V] or [B, V] of `logits_dtype`, updated cache or None[, amax]).
    """
    embedding = weights["embed_tokens"]["embedding"]
    if tp_axis is not None and embedding.shape[0] != cfg.vocab_size:
        x = sharding.embed_vocab_split(embedding, tokens, tp_axis)  # [B, T, D]
    else:
        x = jnp.take(embedding, tokens, axis=0)  # [B, T, D]
    if cache is None:
        index, k_positions, kv = None, positions, None
    else:
        if tokens.shape[1] > cache.length:
            raise ValueError(
                f"{tokens.shape=} has more tokens than the cache's {cache.length} slots"
            )
        index, k_positions = cache.index, write_positions(cache, positions)
        kv = cache.layers
    lw = weights["layers"]
    live = live_slots(index) if index is not None and tokens.shape[1] == 1 else None

    xq = None
    if not with_amax and tp_axis is None and cross_layer_chain(cfg, lw, x.shape, kv, x.dtype):
        # layer 0's qkv input quantized here; each layer then writes the next one's
        att = lw["self_attn"]
        xq = xhat_input(x[:, 0], att["qkv_proj"], lw["input_layernorm"]["scale"],
                        layer=jnp.int32(0), eps=cfg.rms_norm_eps)  # fmt: skip

    def body(carry, i):
        x, kv, xq = carry
        x, kv, amax, xq = decoder_layer(
            x, lw, i, positions, kv, index, k_positions, cfg, with_amax, tp_axis, live, xq
        )
        return (x, kv, xq), amax

    if layer_loop(weights, cfg) == "scan":
        layers = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        unroll = min(cfg.scan_unroll, cfg.num_layers)
        (x, kv, xq), amax = jax.lax.scan(body, (x, kv, xq), layers, unroll=unroll)
    else:
        per_layer = []
        for i in range(cfg.num_layers):
            (x, kv, xq), a = body((x, kv, xq), i)
            per_layer.append(a)
        amax = jax.tree.map(lambda *v: jnp.stack(v), *per_layer) if with_amax else {}
    if logits_at is not None:
        x = jnp.take_along_axis(x, logits_at[:, None, None].astype(jnp.int32), axis=1)[:, 0]
    x = rms_norm(x, weights["norm"]["scale"], cfg.rms_norm_eps)
    # The head runs in the activation dtype and is cast to float32 afterwards (by default), as
    # transformers and vLLM do, so entropies see the same logits.
    head = embedding if cfg.tie_word_embeddings else weights["lm_head"]["weight"]
    if isinstance(head, Nvfp4Tensor):  # rejax.params.quantize_head: NVFP4 W4A16 (opt-in)
        logits = linear(x, {"weight": head}, "nvfp4-w4a16")
    else:
        logits = padded_rows(
            lambda a: jnp.einsum("...d,vd->...v", a, head.astype(x.dtype)), x, cfg.invariant_rows
        )
    logits = logits.astype(logits_out_dtype(logits.dtype, logits_dtype))
    if cache is not None:
        cache = dataclasses.replace(
            cache, k=kv[0], v=kv[1], k_scale=kv[2], v_scale=kv[3], positions=k_positions,
            index=cache.index + tokens.shape[1],
        )  # fmt: skip
    if with_amax:
        return logits, cache, amax
    return logits, cache


class Model(nn.Module):
    """The Qwen2 / Qwen3 decoder as a Flax Linen module, applied functionally.

    `Model(cfg).apply({"params": weights}, tokens, positions, cache)` returns `(logits, cache)`;
    `Model(cfg).init(key, tokens, positions)` returns random weights in the layout of
    rejax/params.py (all-zero NVFP4 linears when cfg.quant is set: shapes only). The math is
    `forward`; the module only declares the parameter groups.

    Attributes:
        cfg: static model config; cfg.quant selects the NVFP4 activation mode.
        param_dtype: dtype of float parameters created by `init` (tests use float32).
    """

    cfg: Config
    param_dtype: Any = jnp.bfloat16

    @nn.compact
    def __call__(self, tokens, positions, cache=None, logits_at=None):
        init = {}

        def group(name):
            if self.has_variable("params", name):
                # applied to given weights: taken as they are (per-row NVFP4 scales, per-shard
                # input scales and calibration state vary from the init's shapes)
                return self.get_variable("params", name)

            def make(key):
                if name not in init:
                    init.update(rparams.init_weights(self.cfg, key, self.param_dtype))
                return init[name]

            return self.param(name, make)

        names = ["embed_tokens", "layers", "norm"]
        if not self.cfg.tie_word_embeddings:
            names.append("lm_head")
        weights = {name: group(name) for name in names}
        return forward(weights, tokens, positions, cache, self.cfg, logits_at)
