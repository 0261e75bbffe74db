"""More than one device through `jax.sharding`: data-parallel rows, tensor-parallel layers.

`shard(params, mesh)` places a model on a mesh with axes "data" and "model" and returns Params
whose `sharding` field records the layout; the jitted functions of rejax/decode.py (so
`rejax.generate`, `rejax.logits`, `rejax eval`, `rejax bench`) then run the model under one
`jax.shard_map` over that mesh, with JAX's own collectives and nothing home-made:

* Rows of a batch are split over "data" (the tokens, positions and the KV cache's B axis).
* The decoder is split over "model" Megatron-style. The column-parallel linears (fused
  qkv_proj, gate_up_proj) keep on each device the rows of its query heads, its kv heads and its
  share of F, for every shard of the fused linear: their rows are reordered once, here, so that
  device d's contiguous slice is [q_d | k_d | v_d] ([gate_d | up_d]), which is the fused linear
  of a model with N / M heads, K / M kv heads and F / M width. The decoder runs unchanged on
  that slice with that smaller Config. The row-parallel linears (o_proj, down_proj) keep the
  matching input columns and end in one all-reduce (`psum`) each. NVFP4 codes, block scales and
  per-row global scales are split with their rows (column-parallel) or at 16-element block
  boundaries of K (row-parallel), so each device calls the same NVFP4 GEMV on its slice; a
  W4A4 dynamic activation scale of a row-parallel linear is the max over the devices of each
  row's amax (one `pmax`), so every device quantizes its slice exactly as the whole row is.
* The KV cache [L, B, S, K, H] is split over rows ("data") and kv heads ("model").
* Embeddings and lm_head: `vocab="split"` (default) splits both tables' V rows over "model";
  a token is looked up on the device holding its row (masked take, one psum of [B, T, D]) and
  the local logits [B, V / M] are all-gathered once per step, so the sampler sees whole rows.
  The head is read every step (V x D bf16: 1.2 GB for Qwen3-8B, more than a quarter of its
  NVFP4 weights), so replicating it would leave the largest single read undivided as M grows;
  the all-gather moves B x V float32 instead. `vocab="replicate"` keeps both tables whole on
  every device (no collective; for comparison on the GPU).

Numerics: float32 models match one device to rounding (the row-parallel partial sums are added
in float32). A row-parallel NVFP4 GEMV returns bfloat16, so with M > 1 each device's partial sum
is rounded before the all-reduce: logits then agree to bf16 rounding, not bit for bit. With
model=1 the program is the single-device one on each data shard.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from rejax import nvfp4
from rejax import params as rparams
from rejax.cache import KVCache
from rejax.cache import init_cache as _init_cache
from rejax.config import Config
from rejax.layers import linear
from rejax.nvfp4 import Nvfp4Tensor
from rejax.ops.linear import nvfp4_linear

AXES = ("data", "model")
VOCAB_MODES = ("split", "replicate")
COLUMN_PARALLEL = ("qkv_proj", "gate_up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")

_CACHE_KV = P(None, "data", None, "model", None)  # [L, B, S, K, H]
_CACHE_SCALE = P(None, "data", None, "model")  # [L, B, S, K] fp8 scales


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where `shard` put a model: the mesh and the vocabulary placement (static, hashable)."""

    mesh: Mesh
    vocab: str = "split"

    @property
    def data(self) -> int:
        return int(self.mesh.shape["data"])

    @property
    def model(self) -> int:
        return int(self.mesh.shape["model"])


# ----------------------------------------------------------------------------- meshes


def parse_mesh(text: str) -> dict[str, int]:
    """ "data=D,model=M" (either order, a missing axis is 1) -> {"data": D, "model": M}."""
    sizes = {"data": 1, "model": 1}
    seen = set()
    for part in str(text).split(","):
        name, eq, value = part.strip().partition("=")
        if not eq or name not in sizes or name in seen or not value.strip().isdigit():
            raise ValueError(
                f"mesh {text!r}: expected 'data=D,model=M' with positive integers, got {part!r}"
            )
        seen.add(name)
        sizes[name] = int(value)
        if sizes[name] <= 0:
            raise ValueError(f"mesh {text!r}: {name}={sizes[name]} must be positive")
    return sizes


def make_mesh(data: int = 1, model: int = 1, devices=None) -> Mesh:
    """A ("data", "model") mesh over the first data * model devices (default: jax.devices()).

    Devices are laid out model-fastest, so a model group sits on neighbouring devices (one
    NVLink island on a GPU host).
    """
    devices = list(jax.devices() if devices is None else devices)
    if data <= 0 or model <= 0:
        raise ValueError(f"mesh sizes must be positive, got data={data} model={model}")
    if data * model > len(devices):
        raise ValueError(
            f"mesh data={data} x model={model} needs {data * model} devices, "
            f"{len(devices)} visible ({devices[0].platform})"
        )
    grid = np.asarray(devices[: data * model], dtype=object).reshape(data, model)
    return Mesh(grid, AXES)


def check_mesh(cfg: Config, mesh: Mesh, vocab: str = "split") -> None:
    """Raises ValueError when this model cannot be split over this mesh (names the sizes)."""
    if vocab not in VOCAB_MODES:
        raise ValueError(f"vocab={vocab!r}, expected one of {VOCAB_MODES}")
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")  # noqa: TRY004
    if tuple(sorted(mesh.axis_names)) != tuple(sorted(AXES)):
        raise ValueError(f"mesh axes {mesh.axis_names}, expected exactly {AXES}")
    m = int(mesh.shape["model"])
    if cfg.num_kv_heads % m:
        raise ValueError(
            f"num_kv_heads={cfg.num_kv_heads} is not divisible by the mesh's model axis ({m}): "
            "each device holds whole kv heads"
        )
    if cfg.intermediate_size % m:
        raise ValueError(
            f"intermediate_size={cfg.intermediate_size} is not divisible by the model axis ({m})"
        )
    if vocab == "split" and cfg.vocab_size % m:
        raise ValueError(
            f"vocab_size={cfg.vocab_size} is not divisible by the model axis ({m}); "
            "use vocab='replicate'"
        )
    if cfg.quant is not None and m > 1:
        for name, k in (
            ("o_proj", cfg.num_heads * cfg.head_dim),
            ("down_proj", cfg.intermediate_size),
        ):
            if (k // m) % nvfp4.BLOCK:
                raise ValueError(
                    f"{name} has K={k}: K / model axis = {k / m:g} is not a multiple of the NVFP4 "
                    f"block of {nvfp4.BLOCK}, so its block scales cannot be split"
                )


def local_config(cfg: Config, model: int) -> Config:
    """The Config of one device's slice: N / M heads, K / M kv heads, F / M width."""
    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // model,
        num_kv_heads=cfg.num_kv_heads // model,
        intermediate_size=cfg.intermediate_size // model,
    )


# ----------------------------------------------------------------------------- placement


def _column_order(cfg: Config, name: str, model: int) -> np.ndarray:
    """Row order of a column-parallel fused linear: device d's contiguous block holds its
    slice of every shard ([q_d | k_d | v_d] or [gate_d | up_d])."""
    sizes = rparams.shards(cfg, name)
    starts = np.cumsum((0, *sizes))[:-1]
    return np.concatenate(
        [
            np.arange(s + d * (n // model), s + (d + 1) * (n // model))
            for d in range(model)
            for s, n in zip(starts, sizes)
        ]
    )


def _reorder_rows(p: dict, order: np.ndarray) -> dict:
    """A column-parallel linear's params with their output rows taken in `order`."""
    w = p["weight"]
    if isinstance(w, Nvfp4Tensor):
        g = w.global_scale
        w = dataclasses.replace(
            w,
            packed=jnp.asarray(w.packed)[..., order, :],
            scales=jnp.asarray(w.scales)[..., order, :],
            global_scale=jnp.asarray(g)[..., order] if w.per_row else g,
        )
    else:
        w = tuple(jnp.asarray(a)[order] for a in w)
    out = {**p, "weight": w}
    if "bias" in p:
        out["bias"] = jnp.asarray(p["bias"])[..., order]
    return out


def _names(path) -> list:
    return [getattr(k, "key", getattr(k, "name", getattr(k, "idx", None))) for k in path]


def _leaf_spec(path, leaf, vocab: str) -> P:
    names = _names(path)
    if names[0] in ("embed_tokens", "lm_head"):
        return P("model", None) if vocab == "split" else P()
    if names[0] != "layers" or len(names) < 4 or names[2] not in (*COLUMN_PARALLEL, *ROW_PARALLEL):
        return P()
    column = names[2] in COLUMN_PARALLEL
    field, part = names[3], (names[4] if len(names) > 4 else None)
    if field == "bias":  # [L, N_out]
        return P(None, "model") if column else P()
    if field != "weight":  # input_scale: per layer (and shard), the same on every device
        return P()
    if part in ("packed", "scales"):  # [L, N, K/2], [L, N, K/16]
        return P(None, "model", None) if column else P(None, None, "model")
    if part == "global_scale":  # [L] or [L, N]: with the rows
        return P(None, "model") if column and np.ndim(leaf) == 2 else P()
    return P("model", None) if column else P(None, "model")  # a float layer's [N, K]


def weight_specs(weights: dict, vocab: str = "split"):
    """The PartitionSpec of every leaf of a weights pytree (same tree structure)."""
    return jax.tree_util.tree_map_with_path(lambda p, x: _leaf_spec(p, x, vocab), weights)


def shard(params: rparams.Params, mesh: Mesh, *, vocab: str = "split") -> rparams.Params:
    """Places a model on a ("data", "model") mesh for data- and tensor-parallel decoding.

    Args:
        params: a model on one device (any quant mode; not already sharded).
        mesh: a `jax.sharding.Mesh` with axes "data" and "model" (`make_mesh(data, model)`).
        vocab: "split" (embeddings and lm_head split over "model" by vocabulary rows) or
            "replicate" (whole tables on every device).

    Returns:
        Params with the weights placed (column-parallel rows reordered, see the module
        docstring) and `sharding` set, taken by `rejax.generate` and the decode functions.
        `unshard` gives back the one-device layout.
    """
    if not isinstance(params, rparams.Params):
        raise ValueError(f"params must be rejax Params, got {type(params).__name__}")  # noqa: TRY004
    if params.sharding is not None:
        raise ValueError("params are already sharded; pass rejax.sharding.unshard(params)")
    check_mesh(params.cfg, mesh, vocab)
    m = int(mesh.shape["model"])

    def reorder(path, p):
        if path[1] not in COLUMN_PARALLEL or m == 1:
            return p
        return _reorder_rows(p, _column_order(params.cfg, path[1], m))

    if isinstance(params.weights.get("lm_head", {}).get("weight"), rparams.Nvfp4Tensor):
        raise ValueError(  # noqa: TRY004 (bad input is a ValueError in rejax)
            "an NVFP4 lm_head (rejax.params.quantize_head) is not sharded; shard the bf16 model"
        )
    weights = rparams.map_linears(params.weights, reorder)
    specs = weight_specs(weights, vocab)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    weights = jax.device_put(weights, shardings)
    return dataclasses.replace(params, weights=weights, sharding=Layout(mesh, vocab))


def unshard(params: rparams.Params, device=None) -> rparams.Params:
    """The one-device Params of sharded ones (plain row order, every array on `device`)."""
    layout = params.sharding
    if layout is None:
        return params
    device = jax.devices()[0] if device is None else device
    m = layout.model

    def restore(path, p):
        if path[1] not in COLUMN_PARALLEL or m == 1:
            return p
        return _reorder_rows(p, np.argsort(_column_order(params.cfg, path[1], m)))

    weights = jax.device_put(params.weights, device)
    weights = rparams.map_linears(weights, restore)
    return dataclasses.replace(params, weights=weights, sharding=None)


def init_cache(params: rparams.Params, batch_size: int, length: int, dtype=jnp.bfloat16):
    """An empty KV cache for these params: `rejax.cache.init_cache`, built already split over
    the mesh (rows over "data", kv heads over "model") when the params are sharded."""
    layout = params.sharding
    if layout is None:
        return _init_cache(params.cfg, batch_size, length, dtype)
    _check_rows(batch_size, layout)
    specs = cache_specs(params.cfg.kv_dtype == "fp8")
    out = jax.tree.map(lambda s: NamedSharding(layout.mesh, s), specs)
    # a one-off placement: zeros created where they live, never a full cache on one device
    make = jax.jit(_init_cache, static_argnums=(0, 1, 2, 3), out_shardings=out)
    return make(params.cfg, batch_size, length, dtype)


def cache_specs(quantized: bool = False) -> KVCache:
    """PartitionSpecs of a KVCache: k, v [L, B, S, K, H] (and an fp8 cache's scales
    [L, B, S, K]) over rows and kv heads."""
    scale = _CACHE_SCALE if quantized else None
    return KVCache(
        k=_CACHE_KV, v=_CACHE_KV, positions=P("data", None), index=P(), k_scale=scale,
        v_scale=scale,
    )  # fmt: skip


def _check_rows(rows: int, layout: Layout) -> None:
    if rows % layout.data:
        raise ValueError(
            f"a batch of {rows} rows is not divisible by the mesh's data axis ({layout.data}); "
            "use a batch size (times n samples) that is a multiple of it"
        )


# ----------------------------------------------------------------------------- the model


def row_parallel_linear(
    x: jax.Array, p: dict, quant: str | None, layer: Any, shards: tuple[int, ...], axis: str
) -> jax.Array:
    """A row-parallel linear inside `shard_map`: x holds this device's input features, the
    result is the sum over `axis` (one all-reduce, in float32).

    A W4A4 linear without a static input scale quantizes its activations with the dynamic
    global scale of the whole row: the max of each row's amax over the devices.
    """
    if "bias" in p:
        raise ValueError("a row-parallel linear with a bias is not supported")
    w = p["weight"]
    if isinstance(w, Nvfp4Tensor) and quant == "nvfp4" and p.get("input_scale") is None:
        xb = x.astype(jnp.bfloat16)
        x2 = xb.reshape(-1, xb.shape[-1])  # [M, K / model]
        g = nvfp4.global_scale_from_amax(jax.lax.pmax(nvfp4.activation_amax(x2), axis))  # [M]
        y = nvfp4_linear(xb, w, input_scale=g, act="w4a4", layer=layer)
    else:
        y = linear(x, p, quant, layer=layer, shards=shards)
    return jax.lax.psum(y.astype(jnp.float32), axis).astype(x.dtype)


def embed_vocab_split(embedding: jax.Array, tokens: jax.Array, axis: str) -> jax.Array:
    """Embedding lookup in a table split by vocabulary rows over `axis` (inside `shard_map`):
    each device fills the tokens it holds, zeros elsewhere, and one psum joins them (exact: one
    nonzero term per entry)."""
    rows = embedding.shape[0]
    local = tokens - jax.lax.axis_index(axis) * rows
    mine = (local >= 0) & (local < rows)
    x = jnp.take(embedding, jnp.where(mine, local, 0), axis=0)  # [B, T, D]
    x = jnp.where(mine[..., None], x, jnp.zeros((), x.dtype))
    return jax.lax.psum(x, axis)


def _localize(weights: dict) -> dict:
    """Inside shard_map an Nvfp4Tensor's static logical shape is still the whole matrix's; set
    it to the slice this device holds."""

    def fix(_, p):
        w = p["weight"]
        if isinstance(w, Nvfp4Tensor):
            w = dataclasses.replace(w, shape=(w.packed.shape[-2], 2 * w.packed.shape[-1]))
        return {**p, "weight": w}

    return rparams.map_linears(weights, fix)


def forward(
    params: rparams.Params,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache | None,
    logits_at: jax.Array | None = None,
):
    """`rejax.decoder.forward` of sharded params, under one `shard_map` over their mesh.

    Same arguments and results as the one-device forward (logits float32 [B, T, V] or [B, V],
    split over "data" by rows and whole along V; the cache split as `cache_specs`).
    """
    from rejax.decoder import forward as decoder_forward

    layout = params.sharding
    _check_rows(tokens.shape[0], layout)
    cfg = local_config(params.cfg, layout.model)
    # with one device per model group there is nothing to reduce: each data shard runs the
    # one-device program, without collectives of one participant
    tp_axis = "model" if layout.model > 1 else None
    gather = tp_axis is not None and layout.vocab == "split"

    def body(weights, tokens, positions, cache, logits_at):
        logits, cache = decoder_forward(
            _localize(weights), tokens, positions, cache, cfg, logits_at, tp_axis=tp_axis
        )
        if gather:
            # [B / data, (T,) V / model] -> whole rows for the sampler
            logits = jax.lax.all_gather(logits, "model", axis=logits.ndim - 1, tiled=True)
        return logits, cache

    rows = P("data")
    cache_spec = None if cache is None else cache_specs(cache.quantized)
    at_spec = None if logits_at is None else rows
    fn = jax.shard_map(
        body,
        mesh=layout.mesh,
        in_specs=(weight_specs(params.weights, layout.vocab), rows, rows, cache_spec, at_spec),
        out_specs=(rows, cache_spec),
        # the logits are whole along "model" after the all-gather (which the replication
        # check does not infer), and nothing here is differentiated
        check_vma=False,
    )
    return fn(params.weights, tokens, positions, cache, logits_at)
