"""The KV cache: an explicit pytree passed into and returned from every forward call.

Keys and values of all layers are stacked, [L, B, S, K, H], so the decoder's scan over layers
updates one slot range of one layer in place. Slots are written in order for all rows at once
(one scalar write index) or, for the slot-refill driver (rejax/slots.py), from a per-row write
index [B] (each row its own next slot), and each slot records
the absolute position of the token it holds per row (-1 = empty or padding). Attention masks by
position (rejax.layers.attention_mask), so left-padded and right-padded prompts, and rows of
different lengths, share one cache layout.

With `Config(kv_dtype="fp8")` keys and values are stored as float8 E4M3 codes, each [H] vector
(one slot, one kv head) with its own float32 scale, amax / 448, in `k_scale` / `v_scale`
[L, B, S, K] beside the codes (`quantize_kv`). Per slot and head rather than one static scale per
layer and head: a static scale needs calibration data, clips any entry past the amax it saw
to 448, and pushes the entries of vectors far below that amax into E4M3's subnormals (under
2**-6 of the range), where relative precision drops; a per-vector scale is computed from the
entry being written, in the same step, and costs 4 bytes per 128 codes (Qwen3 H = 128: +3% of the fp8
bytes, 52% of the bf16 cache in all). Every read dequantizes (`dequantize_kv`, or inside the
decode kernel), so prompt and decode attention both see what the cache holds.
Dimension letters: see rejax/config.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from rejax.config import Config

# E4M3 without infinities: largest finite value 448, 3 mantissa bits (relative rounding <= 2**-4).
FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Stacked keys and values of every layer plus slot bookkeeping.

    Attributes:
        k: [L, B, S, K, H] keys (RoPE applied), the activation dtype or float8_e4m3fn codes.
        v: [L, B, S, K, H] values, likewise.
        positions: [B, S] int32 absolute position held by each slot, -1 if none.
        index: [] int32 next slot to write (shared by all rows), or [B] int32 per row.
        k_scale, v_scale: [L, B, S, K] float32 scale of each slot's fp8 vector, or None for an
            unquantized cache (entry = code * scale).
    """

    k: jax.Array
    v: jax.Array
    positions: jax.Array
    index: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def layers(self) -> tuple:
        """(k, v, k_scale, v_scale): the per-layer stacks the decoder carries over its layers."""
        return self.k, self.v, self.k_scale, self.v_scale

    @property
    def batch_size(self) -> int:
        return self.positions.shape[0]

    @property
    def length(self) -> int:  # S
        return self.positions.shape[1]


def init_cache(cfg: Config, batch_size: int, length: int, dtype=jnp.bfloat16) -> KVCache:
    """An empty cache.

    Args:
        cfg: model config (num_layers, num_kv_heads, head_dim; kv_dtype picks the storage).
        batch_size: B rows.
        length: S slots (prompt bucket + tokens to generate).
        dtype: key/value dtype of an unquantized cache (the activation dtype); with
            cfg.kv_dtype == "fp8" the codes are float8_e4m3fn whatever `dtype` is.

    Returns:
        KVCache with zero keys/values (and zero scales), every slot position -1, index 0.
    """
    if batch_size <= 0 or length <= 0:
        raise ValueError(f"cache needs batch_size > 0 and length > 0, got {batch_size=} {length=}")
    shape = (cfg.num_layers, batch_size, length, cfg.num_kv_heads, cfg.head_dim)
    fp8 = cfg.kv_dtype == "fp8"
    scale = (lambda: jnp.zeros(shape[:-1], jnp.float32)) if fp8 else (lambda: None)
    return KVCache(
        k=jnp.zeros(shape, FP8_DTYPE if fp8 else dtype),
        v=jnp.zeros(shape, FP8_DTYPE if fp8 else dtype),
        positions=jnp.full((batch_size, length), -1, jnp.int32),
        index=jnp.zeros((), jnp.int32),
        k_scale=scale(),
        v_scale=scale(),
    )


def quantize_kv(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """E4M3 codes and one scale per [H] vector: x ~= codes * scale[..., None].

    Args:
        x: [..., H] keys or values (any float dtype).

    Returns:
        (codes float8_e4m3fn [..., H], scale float32 [...] = amax / 448; 0 for an all-zero
        vector, whose codes are 0).
    """
    xf = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(xf), axis=-1) / FP8_MAX
    safe = jnp.where(scale > 0, scale, 1.0)
    # |x / scale| <= 448 by construction: the cast rounds to nearest, never saturates
    return (xf / safe[..., None]).astype(FP8_DTYPE), scale


def dequantize_kv(codes: jax.Array, scale: jax.Array | None, dtype) -> jax.Array:
    """codes * scale in float32, cast to `dtype`; an unquantized array (scale None) is only cast.

    Args:
        codes: [..., H] float8_e4m3fn (or float, with scale None).
        scale: [...] float32, or None.
        dtype: the result dtype.
    """
    if scale is None:
        return codes.astype(dtype)
    return (codes.astype(jnp.float32) * scale[..., None]).astype(dtype)


def write_layer(kv: tuple, k: jax.Array, v: jax.Array, index: jax.Array, layer) -> tuple:
    """Writes T new keys/values into one layer of the stacks `KVCache.layers`, quantizing
    them when the cache is fp8.

    Args:
        kv: (k, v, k_scale, v_scale) stacks [L, B, S, K, H] / [L, B, S, K] (scales None when
            unquantized).
        k, v: [B, T, K, H] new entries.
        index: [] int32 first slot, or [B] int32 per row.
        layer: int32 [] layer.

    Returns:
        The updated (k, v, k_scale, v_scale).
    """
    kc, vc, ks, vs = kv
    if ks is None:
        return (*write_kv(kc, vc, k, v, index, layer), None, None)
    (k, k_s), (v, v_s) = quantize_kv(k), quantize_kv(v)
    kc, vc = write_kv(kc, vc, k, v, index, layer)
    ks, vs = write_kv(ks, vs, k_s, v_s, index, layer)
    return kc, vc, ks, vs


def read_layer(kv: tuple, layer, dtype) -> tuple[jax.Array, jax.Array]:
    """One layer's keys and values [B, S, K, H] of the stacks `KVCache.layers`: fp8 codes
    dequantized to `dtype`, an unquantized cache as stored."""
    kc, vc, ks, vs = kv

    def take(x):
        return None if x is None else jax.lax.dynamic_index_in_dim(x, layer, 0, keepdims=False)

    if ks is None:
        return take(kc), take(vc)
    return dequantize_kv(take(kc), take(ks), dtype), dequantize_kv(take(vc), take(vs), dtype)


def write_kv(
    k_cache: jax.Array,
    v_cache: jax.Array,
    k: jax.Array,
    v: jax.Array,
    index: jax.Array,
    layer: jax.Array | int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Writes T new keys/values at slots [index, index + T) of one layer's cache.

    Any trailing shape works alike (the fp8 scales [L, B, S, K] take [B, T, K] entries).

    Args:
        k_cache, v_cache: [L, B, S, K, H] stacked (with `layer`) or [B, S, K, H] one layer.
        k, v: [B, T, K, H] new entries (cast to the cache's dtype).
        index: [] int32 first slot, or [B] int32 first slot per row.
        layer: int32 [] layer to write in a stacked cache (in place), or None.

    Returns:
        The updated (k_cache, v_cache).
    """
    if jnp.ndim(index) == 1:
        return _write_rows(k_cache, k, index, layer), _write_rows(v_cache, v, index, layer)
    tail = (0,) * (k.ndim - 2)
    if layer is None:
        start = (0, index, *tail)
    else:
        start = (layer, 0, index, *tail)
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
