"""The KV cache: an explicit pytree passed into and returned from every forward call.

Keys and values of all layers are stacked, [L, B, S, K, H], so the decoder's scan over layers
updates one slot range of one layer in place. Slots are written in order for all rows at once
(one scalar write index) or, for the slot-refill driver (rejax/slots.py), from a per-row write
index [B] (each row its own next slot), and each slot records
the absolute position of the token it holds per row (-1 = empty or padding). Attention masks by
position (rejax.layers.attention_mask), so left-padded and right-padded prompts, and rows of
different lengths, share one cache layout. Dimension letters: see rejax/config.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from rejax.config import Config


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Stacked keys and values of every layer plus slot bookkeeping.

    Attributes:
        k: [L, B, S, K, H] keys (RoPE applied).
        v: [L, B, S, K, H] values.
        positions: [B, S] int32 absolute position held by each slot, -1 if none.
        index: [] int32 next slot to write (shared by all rows), or [B] int32 per row.
    """

    k: jax.Array
    v: jax.Array
    positions: jax.Array
    index: jax.Array

    @property
    def batch_size(self) -> int:
        return self.positions.shape[0]

    @property
    def length(self) -> int:  # S
        return self.positions.shape[1]


def init_cache(cfg: Config, batch_size: int, length: int, dtype=jnp.bfloat16) -> KVCache:
    """An empty cache.

    Args:
        cfg: model config (num_layers, num_kv_heads, head_dim).
        batch_size: B rows.
        length: S slots (prompt bucket + tokens to generate).
        dtype: key/value dtype (the activation dtype).

    Returns:
        KVCache with zero keys/values, every slot position -1, index 0.
    """
    if batch_size <= 0 or length <= 0:
        raise ValueError(f"cache needs batch_size > 0 and length > 0, got {batch_size=} {length=}")
    shape = (cfg.num_layers, batch_size, length, cfg.num_kv_heads, cfg.head_dim)
    return KVCache(
        k=jnp.zeros(shape, dtype),
        v=jnp.zeros(shape, dtype),
        positions=jnp.full((batch_size, length), -1, jnp.int32),
        index=jnp.zeros((), jnp.int32),
    )


def write_kv(
    k_cache: jax.Array,
    v_cache: jax.Array,
    k: jax.Array,
    v: jax.Array,
    index: jax.Array,
    layer: jax.Array | int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Writes T new keys/values at slots [index, index + T) of one layer's cache.

    Args:
        k_cache, v_cache: [L, B, S, K, H] stacked (with `layer`) or [B, S, K, H] one layer.
        k, v: [B, T, K, H] new entries.
        index: [] int32 first slot, or [B] int32 first slot per row.
        layer: int32 [] layer to write in a stacked cache (in place), or None.

    Returns:
        The updated (k_cache, v_cache).
    """
    if jnp.ndim(index) == 1:
        return _write_rows(k_cache, k, index, layer), _write_rows(v_cache, v, index, layer)
    if layer is None:
        start = (0, index, 0, 0)
    else:
        start = (layer, 0, index, 0, 0)
        k, v = k[None], v[None]
    return (
        jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), start),
        jax.lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), start),
    )


def _row_slots(index: jax.Array, t: int) -> tuple[jax.Array, jax.Array]:
    # (row ids [B, 1], slot ids [B, T]) of T entries per row written from a per-row index
    b = index.shape[0]
    return jnp.arange(b)[:, None], index[:, None] + jnp.arange(t, dtype=index.dtype)[None]


def _write_rows(cache: jax.Array, x: jax.Array, index: jax.Array, layer) -> jax.Array:
    # One scatter of B x T entries; a slot past the cache's end is dropped (the slot driver's
    # finished rows never reach it, but the write must not clamp onto a live slot).
    rows, slots = _row_slots(index, x.shape[1])
    x = x.astype(cache.dtype)
    if layer is None:
        return cache.at[rows, slots].set(x, mode="drop")
    return cache.at[layer, rows, slots].set(x, mode="drop")


def write_positions(cache: KVCache, positions: jax.Array) -> jax.Array:
    """The cache's slot positions after writing T tokens at positions [B, T]: [B, S] int32."""
    if cache.index.ndim == 1:
        rows, slots = _row_slots(cache.index, positions.shape[1])
        return cache.positions.at[rows, slots].set(positions.astype(jnp.int32), mode="drop")
    return jax.lax.dynamic_update_slice(
        cache.positions, positions.astype(jnp.int32), (0, cache.index)
    )
