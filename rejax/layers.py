"""Decoder building blocks: RMSNorm, RoPE, GQA attention, SwiGLU MLP and the linear layer.

The math lives in small pure functions (`rms_norm`, `rope`, `attention`, `linear`, `swiglu`);
the Flax Linen modules below only declare parameters and call them. Parameter names follow the
Hugging Face checkpoint layout (CONTRACTS.md), e.g. a linear holds `weight` [N_out, K_in].
Dimension letters: see rejax/config.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from rejax.config import Config

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
    inv_freq = 1.0 / (theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))  # [H/2]
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
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


def linear(x: jax.Array, params: dict, quant: str | None = None) -> jax.Array:
    """y = x @ W.T (+ b) for a bf16 weight in HF layout, or an NVFP4 linear through the kernel.

    NVFP4 linears (quant "nvfp4" = W4A4, "nvfp4-w4a16" = W4A16) call
    `rejax.kernels.nvfp4_linear` on bf16 activations; W4A4 uses the static `input_scale` when
    the params hold one, else a per-row dynamic global scale.

    Args:
        x: [..., K_in] activations.
        params: {"weight": [N_out, K_in] array or Nvfp4Tensor, optional "bias" [N_out],
            optional "input_scale" f32 []}.
        quant: None (bf16 / float weight), "nvfp4" or "nvfp4-w4a16" (cfg.quant).

    Returns:
        [..., N_out] in x's dtype.
    """
    w = params["weight"]
    if quant is None:
        y = jnp.einsum("...k,nk->...n", x, w.astype(x.dtype))
    else:
        from rejax.kernels import nvfp4_linear

        act = _ACT[quant]
        # A calibrated input_scale only matters for W4A4; W4A16 never quantizes activations.
        input_scale = params.get("input_scale") if act == "w4a4" else None
        y = nvfp4_linear(x.astype(jnp.bfloat16), w, input_scale=input_scale, act=act)
        y = y.astype(x.dtype)
    if "bias" in params:
        y = y + params["bias"].astype(x.dtype)
    return y


def _zeros_nvfp4(n_out: int, k_in: int):
    """An all-zero Nvfp4Tensor: the Linen init for quantized weights (shape checking only)."""
    from rejax.nvfp4 import Nvfp4Tensor

    return Nvfp4Tensor(
        packed=jnp.zeros((n_out, k_in // 2), jnp.uint8),
        scales=jnp.zeros((n_out, k_in // 16), jnp.float8_e4m3fn),
        global_scale=jnp.ones((), jnp.float32),
        shape=(n_out, k_in),
    )


class Linear(nn.Module):
    """A linear layer holding `weight` [N_out, K_in] (HF layout), optional `bias`.

    With `quant` set ("nvfp4" / "nvfp4-w4a16") the weight is an Nvfp4Tensor and an optional
    static `input_scale` may be present in the params (W4A4 calibrated). Sows the input amax
    into the `amax` collection when that collection is mutable (calibration only).
    """

    features: int
    use_bias: bool = False
    quant: str | None = None
    param_dtype: jnp.dtype = jnp.bfloat16

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        k_in = x.shape[-1]
        if self.quant is not None:
            w = self.param("weight", lambda _: _zeros_nvfp4(self.features, k_in))
        else:
            init = nn.initializers.normal(0.02)
            w = self.param("weight", init, (self.features, k_in), self.param_dtype)
        p = {"weight": w}
        if self.use_bias:
            p["bias"] = self.param(
                "bias", nn.initializers.zeros, (self.features,), self.param_dtype
            )
        if self.quant is not None and self.has_variable("params", "input_scale"):
            p["input_scale"] = self.param("input_scale", nn.initializers.ones, (), jnp.float32)
        if self.is_mutable_collection("amax"):
            amax = jnp.max(jnp.abs(x.astype(jnp.float32)))
            self.sow("amax", "input", amax, reduce_fn=jnp.maximum, init_fn=lambda: jnp.float32(0))
        return linear(x, p, self.quant)


class RMSNorm(nn.Module):
    """RMSNorm with parameter `scale` [D]."""

    eps: float
    param_dtype: jnp.dtype = jnp.bfloat16

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        return rms_norm(x, scale, self.eps)


class Embed(nn.Module):
    """Token embedding with parameter `embedding` [V, D]; also the tied lm_head."""

    num_embeddings: int
    features: int
    param_dtype: jnp.dtype = jnp.bfloat16

    def setup(self):
        self.embedding = self.param(
            "embedding",
            nn.initializers.normal(0.02),
            (self.num_embeddings, self.features),
            self.param_dtype,
        )

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.embedding, tokens, axis=0)

    def attend(self, x: jax.Array) -> jax.Array:
        """Tied head: [..., D] -> [..., V] in x's dtype."""
        return jnp.einsum("...d,vd->...v", x, self.embedding.astype(x.dtype))


class Attention(nn.Module):
    """Self-attention (Qwen2 / Qwen3) over an explicit per-layer KV cache.

    Called with x [B, T, D], positions [B, T], the layer's cache arrays k, v [B, S, K, H] (or
    None for cache-free full-sequence attention), the cache write slot and the cache's
    per-slot positions after this write [B, S]. Returns (out [B, T, D], (k, v)).
    """

    cfg: Config
    param_dtype: jnp.dtype = jnp.bfloat16

    @nn.compact
    def __call__(self, x, positions, kv, index, k_positions):
        cfg = self.cfg
        b, t, _ = x.shape
        n, kh, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

        def lin(name, features, bias):
            return Linear(
                features, use_bias=bias, quant=cfg.quant, param_dtype=self.param_dtype, name=name
            )

        q = lin("q_proj", n * h, cfg.attention_bias)(x).reshape(b, t, n, h)  # [B, T, N, H]
        k = lin("k_proj", kh * h, cfg.attention_bias)(x).reshape(b, t, kh, h)  # [B, T, K, H]
        v = lin("v_proj", kh * h, cfg.attention_bias)(x).reshape(b, t, kh, h)  # [B, T, K, H]
        if cfg.arch == "qwen3":
            q = RMSNorm(cfg.rms_norm_eps, self.param_dtype, name="q_norm")(q)
            k = RMSNorm(cfg.rms_norm_eps, self.param_dtype, name="k_norm")(k)
        q = rope(q, positions, cfg.rope_theta)
        k = rope(k, positions, cfg.rope_theta)
        if kv is None:
            keys, values = k, v
        else:
            from rejax.cache import write_kv

            keys, values = write_kv(kv[0], kv[1], k, v, index)
        mask = attention_mask(positions, k_positions)
        out = attention(q, keys, values, mask).reshape(b, t, n * h)  # [B, T, N*H]
        out = lin("o_proj", cfg.hidden_size, False)(out)
        return out, (None if kv is None else (keys, values))


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    cfg: Config
    param_dtype: jnp.dtype = jnp.bfloat16

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg

        def lin(name, features):
            return Linear(features, quant=cfg.quant, param_dtype=self.param_dtype, name=name)

        hidden = swiglu(
            lin("gate_proj", cfg.intermediate_size)(x), lin("up_proj", cfg.intermediate_size)(x)
        )
        return lin("down_proj", cfg.hidden_size)(hidden)


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)); x + mlp(norm(x))."""

    cfg: Config
    param_dtype: jnp.dtype = jnp.bfloat16

    @nn.compact
    def __call__(self, x, positions, kv, index, k_positions):
        cfg, pd = self.cfg, self.param_dtype
        h = RMSNorm(cfg.rms_norm_eps, pd, name="input_layernorm")(x)
        h, kv = Attention(cfg, pd, name="self_attn")(h, positions, kv, index, k_positions)
        x = x + h
        h = RMSNorm(cfg.rms_norm_eps, pd, name="post_attention_layernorm")(x)
        x = x + MLP(cfg, pd, name="mlp")(h)
        return x, kv
