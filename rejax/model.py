"""The decoder (Qwen3 / Qwen2) as Flax Linen modules applied functionally.

`Params` (weights pytree + static config + host tokenizer) is the contract between
checkpoint.py, model.py and generate.py. `Model` is the Linen decoder; the KV cache
(rejax/cache.py) is an explicit argument and result. Dimension letters: see rejax/config.py.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from rejax.cache import KVCache, write_positions
from rejax.config import Config
from rejax.layers import DecoderLayer, Embed, Linear, RMSNorm


class HostTokenizer:
    """Host-side tokenizer handle carried as static pytree metadata.

    Hashes and compares by identity, so carrying it in `Params` never retraces a jitted
    function and never compares vocabularies.
    """

    def __init__(
        self, tokenizer: Any, chat_template: str | None = None, special_tokens: dict | None = None
    ):
        self.tokenizer = tokenizer  # a `tokenizers.Tokenizer`
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})

    def __hash__(self):
        return id(self)

    def __eq__(self, other):
        return self is other


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Params:
    """A loaded model: the weights pytree plus its static config and host-side tokenizer.

    `weights` is the Flax params dict taken by `Model(cfg).apply({"params": weights}, ...)`.
    """

    weights: dict
    cfg: Config = dataclasses.field(metadata={"static": True})
    tokenizer: HostTokenizer | None = dataclasses.field(default=None, metadata={"static": True})
    generation_config: tuple = dataclasses.field(default=(), metadata={"static": True})


class Model(nn.Module):
    """The Qwen2 / Qwen3 decoder, applied functionally.

    `Model(cfg).apply({"params": weights}, tokens, positions, cache)` returns
    `(logits, cache)`; nothing is mutated. Parameter names mirror the HF checkpoint
    (CONTRACTS.md): embed_tokens, layers_{i}, norm, lm_head (absent when tied).

    Attributes:
        cfg: static model config; cfg.quant selects bf16 or NVFP4 linears.
        param_dtype: dtype of float parameters created by `init` (tests use float32).
    """

    cfg: Config
    param_dtype: Any = jnp.bfloat16

    @nn.compact
    def __call__(self, tokens, positions, cache=None, logits_at=None):
        """Forward over T new tokens per row.

        Args:
            tokens: [B, T] int32 token ids (padding ids are ignored through positions).
            positions: [B, T] int32 absolute positions; -1 marks padding.
            cache: a KVCache with room for T more slots, or None for cache-free attention
                over these T tokens only.
            logits_at: optional [B] int32 index into T; when given only those rows' logits are
                computed (prefill), shape [B, V].

        Returns:
            (logits float32 [B, T, V] or [B, V], updated cache or None).
        """
        cfg = self.cfg
        embed = Embed(cfg.vocab_size, cfg.hidden_size, self.param_dtype, name="embed_tokens")
        x = embed(tokens)  # [B, T, D]
        if cache is None:
            index, k_positions = None, positions
        else:
            if tokens.shape[1] > cache.length:
                raise ValueError(
                    f"{tokens.shape=} has more tokens than the cache's {cache.length} slots"
                )
            index, k_positions = cache.index, write_positions(cache, positions)
        new_k, new_v = [], []
        for i in range(cfg.num_layers):
            kv = None if cache is None else (cache.k[i], cache.v[i])
            x, kv = DecoderLayer(cfg, self.param_dtype, name=f"layers_{i}")(
                x, positions, kv, index, k_positions
            )
            if kv is not None:
                new_k.append(kv[0])
                new_v.append(kv[1])
        if logits_at is not None:
            x = jnp.take_along_axis(x, logits_at[:, None, None].astype(jnp.int32), axis=1)[:, 0]
        x = RMSNorm(cfg.rms_norm_eps, self.param_dtype, name="norm")(x)
        # The head runs in the activation dtype and is cast to float32 afterwards, as
        # transformers and vLLM do, so entropies see the same logits.
        if cfg.tie_word_embeddings:
            logits = embed.attend(x)
        else:
            logits = Linear(cfg.vocab_size, param_dtype=self.param_dtype, name="lm_head")(x)
        if cache is not None:
            cache = KVCache(
                k=tuple(new_k),
                v=tuple(new_v),
                positions=k_positions,
                index=cache.index + tokens.shape[1],
            )
        return logits.astype(jnp.float32), cache


def init_params(
    cfg: Config,
    key: jax.Array | int = 0,
    dtype=jnp.bfloat16,
    tokenizer: HostTokenizer | None = None,
) -> Params:
    """Random weights for tests and benchmarks.

    Float weights are normal(0.02) in `dtype`, norm scales one, biases zero. With cfg.quant set,
    each decoder linear's weight is quantized offline with `rejax.nvfp4.quantize_weight` (host
    side; meant for tiny configs).

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
    tokens = jnp.zeros((1, 1), jnp.int32)
    weights = _jitted_init(float_cfg, jnp.dtype(dtype))(key, tokens, tokens)["params"]
    weights = _copy_dicts(weights)  # plain dicts
    if cfg.quant is not None:
        weights = quantize_linears(weights)
    return Params(weights=weights, cfg=cfg, tokenizer=tokenizer)


@functools.lru_cache(maxsize=16)
def _jitted_init(cfg: Config, dtype):
    # One compiled init per (config, dtype) rather than hundreds of eager ops per call.
    return jax.jit(Model(cfg, dtype).init)


_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def linear_paths(weights: dict) -> list[tuple[str, str, str]]:
    """(layer, block, linear) names of every decoder linear, e.g. ("layers_0", "mlp", "up_proj")."""
    out = []
    for layer in sorted(
        (k for k in weights if k.startswith("layers_")), key=lambda s: int(s.split("_")[1])
    ):
        for block in ("self_attn", "mlp"):
            for name in _LINEARS:
                if name in weights[layer][block]:
                    out.append((layer, block, name))
    return out


def map_linears(weights: dict, fn) -> dict:
    """A copy of `weights` with fn(path, linear_params) -> linear_params applied to each linear."""
    out = _copy_dicts(weights)
    for path in linear_paths(weights):
        layer, block, name = path
        out[layer][block][name] = fn(path, weights[layer][block][name])
    return out


def _copy_dicts(tree):
    if isinstance(tree, dict):
        return {k: _copy_dicts(v) for k, v in tree.items()}
    return tree


def quantize_linears(weights: dict) -> dict:
    """Quantizes every decoder linear's float weight to an Nvfp4Tensor (ModelOpt recipe).

    Embeddings, norms, lm_head and biases stay as they are.
    """
    from rejax.nvfp4 import quantize_weight

    def quant(_, p):
        q = dict(p)
        q["weight"] = quantize_weight(p["weight"])
        return q

    return map_linears(weights, quant)
