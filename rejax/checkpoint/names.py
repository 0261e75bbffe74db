"""The Hugging Face name map: HF tensor names <-> the stacked, fused weights pytree of
rejax/params.py. Unfused names (q_proj, gate_proj, ...) live only here."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np

from rejax import params as rparams
from rejax.checkpoint.files import FLOAT_TAGS
from rejax.config import Config

# Buffers some exporters write that carry no weights (recomputed from the config).
HARMLESS = re.compile(r"^(model\.)?(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq$")
# FP8 KV-cache scales from ModelOpt exports with kv_cache_quant_algo=FP8.
KV_SCALES = re.compile(r"^model\.layers\.\d+\.self_attn\.[kv]_proj\.[kv]_scale$")


# ----------------------------------------------------------------------------- name mapping


@dataclasses.dataclass(frozen=True)
class Linear:
    """One HF linear: shard `shard` of layer `layer`'s fused linear `fused` in rejax."""

    hf: str  # HF module prefix, e.g. "model.layers.0.self_attn.q_proj"
    # path of the fused, stacked linear, e.g. ("layers", "self_attn", "qkv_proj")
    path: tuple[str, ...]
    layer: int
    shard: int
    shape: tuple[int, int]  # (N_out, K_in) of this shard, HF layout
    bias: bool


# rejax fused linear -> the HF linears it holds, in row order
FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


def linears(cfg: Config) -> list[Linear]:
    """All HF decoder linears of `cfg` (layer-major), with their place in the fused stacks."""
    out = []
    for i in range(cfg.num_layers):
        for block, fused in rparams.LINEARS:
            k_in = rparams.linear_shape(cfg, fused)[1]
            for s_idx, (name, rows) in enumerate(zip(FUSED[fused], rparams.shards(cfg, fused))):
                out.append(
                    Linear(
                        hf=f"model.layers.{i}.{block}.{name}",
                        path=("layers", block, fused),
                        layer=i,
                        shard=s_idx,
                        shape=(rows, k_in),
                        bias=rparams.has_bias(cfg, fused),
                    )
                )
    return out


def fused_groups(cfg: Config) -> dict[tuple[str, ...], list[list[Linear]]]:
    """Fused linear path -> [layer][shard] of its HF linears."""
    groups: dict = {}
    for lin in linears(cfg):
        per_layer = groups.setdefault(lin.path, [[] for _ in range(cfg.num_layers)])
        per_layer[lin.layer].append(lin)
    return groups


def plain_tensors(cfg: Config) -> list[tuple[str, tuple[str, ...], tuple[int, ...], int | None]]:
    """(HF name, pytree path, shape, layer or None) of every non-linear tensor (embedding, norms,
    lm_head); per-layer tensors are stacked over layers at their path."""
    d = cfg.hidden_size
    out = [("model.embed_tokens.weight", ("embed_tokens", "embedding"), (cfg.vocab_size, d), None)]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        for n in ("input_layernorm", "post_attention_layernorm"):
            out.append((f"{p}.{n}.weight", ("layers", n, "scale"), (d,), i))
        if cfg.arch == "qwen3":
            for n in ("q_norm", "k_norm"):
                out.append(
                    (
                        f"{p}.self_attn.{n}.weight",
                        ("layers", "self_attn", n, "scale"),
                        (cfg.head_dim,),
                        i,
                    )
                )
    out.append(("model.norm.weight", ("norm", "scale"), (d,), None))
    if not cfg.tie_word_embeddings:
        out.append(("lm_head.weight", ("lm_head", "weight"), (cfg.vocab_size, d), None))
    return out


def tree_set(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def tree_get(tree: dict, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            raise ValueError(f"params.weights has no entry {'/'.join(path)!r} (missing {key!r})")
        tree = tree[key]
    return tree


def fused_bias(source, shard_lins: list[Linear], used: set) -> np.ndarray:
    """One layer's fused bias: the shards' biases concatenated in row order."""
    used.update(f"{lin.hf}.bias" for lin in shard_lins)
    return np.concatenate(
        [source.get(f"{lin.hf}.bias", lin.shape[:1], FLOAT_TAGS) for lin in shard_lins]
    )
