"""Params: the weights pytree (decoder layers stacked [L, ...], fused projections), its static
config and the host tokenizer; random and test initialisers.

The weights pytree, taken by `rejax.decoder.Model(cfg).apply({"params": weights}, ...)`:

    embed_tokens/embedding                [V, D]
    layers/input_layernorm/scale          [L, D]
    layers/post_attention_layernorm/scale [L, D]
    layers/self_attn/qkv_proj/weight      L x [N*H + 2*K*H, D]  (q, k, v rows, in that order)
    layers/self_attn/qkv_proj/bias        [L, N*H + 2*K*H]      (Qwen2)
    layers/self_attn/q_norm/scale         [L, H]                (Qwen3; k_norm likewise)
    layers/self_attn/o_proj/weight        L x [D, N*H]
    layers/mlp/gate_up_proj/weight        L x [2*F, D]          (gate rows, then up rows)
    layers/mlp/down_proj/weight           L x [D, F]
    norm/scale                            [D]
    lm_head/weight                        [V, D]                (absent when tied)

A linear's weight ("L x [N, K]") is either a stacked `Nvfp4Tensor` (packed [L, N, K/2], scales
[L, N, K/16], global scale [L], or [L, N] when the shards of a fused linear keep their own
scales), which the NVFP4 kernel reads in place given the layer index, or, for float weights, a
tuple of L separate [N, K] arrays: XLA copies a layer's slice out of a stacked float weight
before its cuBLAS call (measured on the H200: bf16 decode 2.1-2.5x slower, scanned or
unrolled), so float linears keep one buffer per layer and the decoder unrolls its layer loop for
them (rejax/decoder.py). A W4A4 linear may hold `input_scale` f32 [L] (static activation scale;
[L, shards] when the shards' scales differ). The Hugging Face names
(`model.layers.{i}.self_attn.q_proj`, ...) live only in rejax/checkpoint/names.py. Dimension
letters: see rejax/config.py.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rejax import nvfp4
from rejax.config import Config
from rejax.nvfp4 import Nvfp4Tensor
from rejax.text import HostTokenizer

# Fused decoder linears: (block, name) in layer order.
LINEARS = (
    ("self_attn", "qkv_proj"),
    ("self_attn", "o_proj"),
    ("mlp", "gate_up_proj"),
    ("mlp", "down_proj"),
)


def shards(cfg: Config, name: str) -> tuple[int, ...]:
    """Output rows of each shard of a fused linear, in row order (one shard if not fused)."""
    qh, kvh = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {
        "qkv_proj": (qh, kvh, kvh),
        "o_proj": (cfg.hidden_size,),
        "gate_up_proj": (cfg.intermediate_size, cfg.intermediate_size),
        "down_proj": (cfg.hidden_size,),
    }[name]


def linear_shape(cfg: Config, name: str) -> tuple[int, int]:
    """(N_out, K_in) of one layer's fused linear."""
    k_in = {
        "qkv_proj": cfg.hidden_size,
        "o_proj": cfg.num_heads * cfg.head_dim,
        "gate_up_proj": cfg.hidden_size,
        "down_proj": cfg.intermediate_size,
    }[name]
    return sum(shards(cfg, name)), k_in


def has_bias(cfg: Config, name: str) -> bool:
    return cfg.attention_bias and name == "qkv_proj"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Params:
    """A loaded model: the weights pytree plus its static config and host-side tokenizer.

    `weights` is the params dict taken by `Model(cfg).apply({"params": weights}, ...)` (layout in
    this module's docstring). `sharding` is None for one device, or the `rejax.sharding.Layout`
    (mesh and vocabulary placement) that `rejax.shard` placed the weights in: the jitted decode
    functions then run the model under `shard_map` over that mesh.
    """

    weights: dict
    cfg: Config = dataclasses.field(metadata={"static": True})
    tokenizer: HostTokenizer | None = dataclasses.field(default=None, metadata={"static": True})
    generation_config: tuple = dataclasses.field(default=(), metadata={"static": True})
    sharding: Any = dataclasses.field(default=None, metadata={"static": True})


# ----------------------------------------------------------------------------- init


def _zeros_nvfp4(stack: tuple[int, ...], n: int, k: int) -> Nvfp4Tensor:
    return Nvfp4Tensor(
        packed=jnp.zeros((*stack, n, k // 2), jnp.uint8),
        scales=jnp.ones((*stack, n, k // nvfp4.BLOCK), jnp.float8_e4m3fn),
        global_scale=jnp.ones(stack, jnp.float32),
        shape=(n, k),
    )


def init_weights(cfg: Config, key: jax.Array, dtype=jnp.bfloat16) -> dict:
    """Random float weights (normal(0.02), norm scales one, biases zero) in `dtype`.

    With cfg.quant set the linears are all-zero Nvfp4Tensors (shapes only); `init_params`
    quantizes real random weights instead.
    """
    L, d, v = cfg.num_layers, cfg.hidden_size, cfg.vocab_size
    keys = iter(jax.random.split(key, 4 + 4 * L))

    def normal(shape):
        return (0.02 * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

    def lin(name):
        n, k = linear_shape(cfg, name)
        if cfg.quant:
            p = {"weight": _zeros_nvfp4((L,), n, k)}
        else:
            p = {"weight": tuple(normal((n, k)) for _ in range(L))}
        if has_bias(cfg, name):
            p["bias"] = jnp.zeros((L, n), dtype)
        return p

    attn = {"qkv_proj": lin("qkv_proj"), "o_proj": lin("o_proj")}
    if cfg.arch == "qwen3":
        attn["q_norm"] = {"scale": jnp.ones((L, cfg.head_dim), dtype)}
        attn["k_norm"] = {"scale": jnp.ones((L, cfg.head_dim), dtype)}
    weights = {
        "embed_tokens": {"embedding": normal((v, d))},
        "layers": {
            "input_layernorm": {"scale": jnp.ones((L, d), dtype)},
            "post_attention_layernorm": {"scale": jnp.ones((L, d), dtype)},
            "self_attn": attn,
            "mlp": {"gate_up_proj": lin("gate_up_proj"), "down_proj": lin("down_proj")},
        },
        "norm": {"scale": jnp.ones((d,), dtype)},
    }
    if not cfg.tie_word_embeddings:
        weights["lm_head"] = {"weight": normal((v, d))}
    return weights


@functools.lru_cache(maxsize=16)
def _jitted_init(cfg: Config, dtype):
    # One compiled init per (config, dtype) rather than many eager ops per call.
    return jax.jit(functools.partial(init_weights, cfg, dtype=dtype))


def init_params(
    cfg: Config,
    key: jax.Array | int = 0,
    dtype=jnp.bfloat16,
    tokenizer: HostTokenizer | None = None,
) -> Params:
    """Random weights for tests and small models.

    Float weights are normal(0.02) in `dtype`, norm scales one, biases zero. With cfg.quant set,
    each shard of each layer's linear is quantized offline with `rejax.nvfp4.quantize_weight`
    (host side, ModelOpt-exact per shard; meant for small configs).

    Args:
        cfg: model config.
        key: PRNG key or int seed.
        dtype: float parameter dtype.
        tokenizer: optional host tokenizer to carry.

    Returns:
        Params.
    """
    if isinstance(key, int):
        key = jax.random.key(key)
    float_cfg = dataclasses.replace(cfg, quant=None)
    weights = _jitted_init(float_cfg, jnp.dtype(dtype))(key)
    weights = copy_dicts(weights)
    if cfg.quant is not None:
        weights = quantize_linears(weights, cfg)
    return Params(weights=weights, cfg=cfg, tokenizer=tokenizer)


def random_params(cfg: Config, key: jax.Array | int = 0, dtype=jnp.bfloat16) -> Params:
    """Random weights built on the device, for benchmarks of full-size presets.

    Float arrays are normal(0.02) (norm scales one); NVFP4 linears (cfg.quant set) get uniform
    random codes and E4M3 block scales in [64, 448) with a global scale of 0.02 / 800 (weights
    of std ~0.02), never going through the host quantizer.
    """
    if isinstance(key, int):
        key = jax.random.key(key)
    shapes = jax.eval_shape(functools.partial(init_weights, cfg, dtype=dtype), key)
    leaves, treedef = jax.tree_util.tree_flatten(
        shapes, is_leaf=lambda x: isinstance(x, Nvfp4Tensor)
    )
    keys = jax.random.split(key, len(leaves))
    out = []
    for k, leaf in zip(keys, leaves):
        if isinstance(leaf, Nvfp4Tensor):
            out.append(_random_nvfp4(leaf.packed.shape, leaf.scales.shape, leaf.shape)(k))
        else:
            out.append(_random_array(leaf.shape, leaf.dtype)(k))
    weights = jax.tree_util.tree_unflatten(treedef, out)
    return Params(weights=_norm_scales_one(weights), cfg=cfg)


def _norm_scales_one(tree):
    if isinstance(tree, dict):
        return {
            k: jnp.ones_like(v) if k == "scale" else _norm_scales_one(v) for k, v in tree.items()
        }
    return tree


@functools.cache
def _random_array(shape, dtype):
    return jax.jit(lambda k: (0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dtype))


@functools.cache
def _random_nvfp4(packed_shape, scales_shape, shape):
    def make(key):
        kc, ks = jax.random.split(key)
        scales = jax.random.uniform(ks, scales_shape, jnp.float32, 64.0, 448.0)
        return Nvfp4Tensor(
            packed=jax.random.bits(kc, packed_shape, jnp.uint8),
            scales=scales.astype(jnp.float8_e4m3fn),
            global_scale=jnp.full(packed_shape[:-2], 0.02 / 800.0, jnp.float32),
            shape=shape,
        )

    return jax.jit(make)


def quantize_head(params: Params, *, random_key: jax.Array | int | None = None) -> Params:
    """The same model with its lm_head as an NVFP4 matrix, read as a W4A16 linear (opt-in).

    The paper's recipe and ModelOpt keep the lm_head bf16, so this changes the logits: each
    weight is rounded to NVFP4 (`nvfp4.quantize_weight`, the ModelOpt weight recipe) and the
    head runs as `layers.linear(..., "nvfp4-w4a16")`, the bf16 activations unquantized. On
    CUDA the GEMV reads a quarter of the bf16 bytes at up to 8 rows; more rows (a larger
    batch, prefill with every position's logits) take the dot reference, which dequantizes
    the table first.

    Args:
        params: a model with an untied lm_head (returned as is when already NVFP4).
        random_key: build random NVFP4 codes on the device instead of quantizing (benchmarks
            on random weights, as `random_params`).

    Raises:
        ValueError: tied embeddings (the head is the embedding table) or sharded params.
    """
    if params.cfg.tie_word_embeddings or "lm_head" not in params.weights:
        raise ValueError(
            "quantize_head needs an untied lm_head; this model ties it to the embeddings"
        )
    if params.sharding is not None:
        raise ValueError("quantize_head takes unsharded params (quantize before sharding)")
    w = params.weights["lm_head"]["weight"]
    if isinstance(w, Nvfp4Tensor):
        return params
    v, d = w.shape
    if random_key is not None:
        key = jax.random.key(random_key) if isinstance(random_key, int) else random_key
        t = _random_nvfp4((v, d // 2), (v, d // 16), (v, d))(key)
    else:
        t = nvfp4.quantize_weight(np.asarray(jnp.asarray(w, jnp.float32)))
    weights = copy_dicts(params.weights)
    weights["lm_head"] = {**weights["lm_head"], "weight": t}
    return dataclasses.replace(params, weights=weights)


# ----------------------------------------------------------------------------- linears


def linear_paths(weights: dict) -> list[tuple[str, str]]:
    """(block, name) of every decoder linear present, e.g. ("mlp", "gate_up_proj")."""
    layers = weights["layers"]
    return [(b, n) for b, n in LINEARS if n in layers.get(b, {})]


def map_linears(weights: dict, fn) -> dict:
    """A copy of `weights` with fn((block, name), linear_params) -> linear_params per linear."""
    out = copy_dicts(weights)
    for path in linear_paths(weights):
        block, name = path
        out["layers"][block][name] = fn(path, weights["layers"][block][name])
    return out


def copy_dicts(tree):
    if isinstance(tree, dict):
        return {k: copy_dicts(v) for k, v in tree.items()}
    return tree


def quantize_stack(w: Any, sizes: tuple[int, ...]) -> Nvfp4Tensor:
    """Quantizes a float linear (L x [N, K], a tuple or a stacked array) to a stacked
    Nvfp4Tensor, shard by shard.

    Each (layer, shard) matrix goes through `nvfp4.quantize_weight` on its own, exactly as
    ModelOpt quantizes the unfused linears, and the shards are joined with `concat_rows`.
    """
    per_layer = []
    for layer in w:
        layer = np.asarray(layer)
        parts, start = [], 0
        for n in sizes:
            parts.append(nvfp4.quantize_weight(layer[start : start + n]))
            start += n
        per_layer.append(nvfp4.concat_rows(parts))
    if any(t.per_row for t in per_layer) and not all(t.per_row for t in per_layer):
        per_layer = [_per_row(t) for t in per_layer]
    return nvfp4.stack(per_layer)


def _per_row(t: Nvfp4Tensor) -> Nvfp4Tensor:
    if t.per_row:
        return t
    g = jnp.broadcast_to(jnp.asarray(t.global_scale, jnp.float32), (t.rows,))
    return dataclasses.replace(t, global_scale=g)


def stack_layers(tensors: list[Nvfp4Tensor]) -> Nvfp4Tensor:
    """`nvfp4.stack` of per-layer matrices, per-row scales everywhere if any layer has them."""
    if any(t.per_row for t in tensors):
        tensors = [_per_row(t) for t in tensors]
    return nvfp4.stack(tensors)


def quantize_linears(weights: dict, cfg: Config) -> dict:
    """Quantizes every float decoder linear to a stacked Nvfp4Tensor (ModelOpt recipe, per shard).

    Embeddings, norms, lm_head and biases stay as they are.
    """

    def quant(path, p):
        if isinstance(p["weight"], Nvfp4Tensor):
            return p
        return {**p, "weight": quantize_stack(p["weight"], shards(cfg, path[1]))}

    return map_linears(weights, quant)
