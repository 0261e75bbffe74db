"""GPU tests of the attention-prologue kernel `qk_norm_rope_cache` (marker `gpu`).

The kernel (impl="cuda") against the reference composition (impl="ref") jitted on the same GPU:
* every cache entry except the written slots is unchanged, bit for bit, and the written values
  equal the reference's bitwise (v) or within the norm's rounding (q, k): the kernel sums the
  mean square of a head in its own order, so rsqrt's input may differ in its last bit and a
  bf16 rounding may then go the other way. Bound: >= ROPE_EQUAL of the q / k elements bitwise
  equal and |kernel - reference| <= ROPE_ATOL_REL * max |reference| of the head. Without the
  norm (Qwen2) the arithmetic is the reference's operation for operation (unless XLA contracts
  the rotation's multiply and add into an fma), under the same bound;
* per-row slots (the slot driver), with slots outside the cache dropped, padding positions (-1)
  and long positions (up to 40,000);
* inside a jitted loop that fills the cache slot by slot, the kernel's cache equals the
  reference's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rejax.ops.rope_cache import rope_cache

pytestmark = pytest.mark.gpu

ROPE_EQUAL = 0.98
ROPE_ATOL_REL = 2.0**-6
L, S = 3, 64


def _operands(b, n, kv, h, seed):
    ks = jax.random.split(jax.random.key(seed), 6)
    qkv = (3 * jax.random.normal(ks[0], (b, (n + 2 * kv) * h))).astype(jnp.bfloat16)
    qn = (1 + 0.3 * jax.random.normal(ks[1], (L, h))).astype(jnp.bfloat16)
    kn = (1 + 0.3 * jax.random.normal(ks[2], (L, h))).astype(jnp.bfloat16)
    kc = jax.random.normal(ks[3], (L, b, S, kv, h)).astype(jnp.bfloat16)
    vc = jax.random.normal(ks[4], (L, b, S, kv, h)).astype(jnp.bfloat16)
    pos = jax.random.randint(ks[5], (b,), -1, 40_000).at[0].set(-1)
    return qkv, qn, kn, kc, vc, pos


def _run(impl, qk_norm, *, n, kv, h):
    def fn(qkv, qn, kn, layer, pos, index, kc, vc):
        norms = (qn, kn) if qk_norm else (None, None)
        return rope_cache(qkv, *norms, layer, pos, index, kc, vc, heads=n, kv_heads=kv,
                          head_dim=h, eps=1e-6, theta=1e6, impl=impl)  # fmt: skip

    return jax.jit(fn)


def _close(got, want):
    g = np.asarray(got, np.float32).reshape(-1, np.shape(got)[-1])
    w = np.asarray(want, np.float32).reshape(-1, np.shape(want)[-1])
    assert np.mean(g == w) >= ROPE_EQUAL, np.mean(g == w)
    bound = ROPE_ATOL_REL * np.max(np.abs(w), axis=-1, keepdims=True)
    assert np.all(np.abs(g - w) <= bound), np.max(np.abs(g - w) / bound)


@pytest.mark.parametrize("b", [1, 8, 64])
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("index", ["first", "last", "rows"])
def test_kernel_matches_the_reference(b, qk_norm, index):
    n, kv, h = 32, 8, 128  # Qwen3-8B
    qkv, qn, kn, kc, vc, pos = _operands(b, n, kv, h, seed=b)
    if index == "rows":
        idx = jnp.asarray(np.random.default_rng(b).integers(0, S, b), jnp.int32)
        if b > 2:
            idx = idx.at[1].set(S).at[2].set(-1)  # dropped; counted from the end
    else:
        idx = jnp.int32(0 if index == "first" else S - 1)
    args = (qkv, qn, kn, jnp.int32(2), pos, idx, kc, vc)
    q, kc1, vc1 = _run("cuda", qk_norm, n=n, kv=kv, h=h)(*args)
    rq, rkc, rvc = _run("ref", qk_norm, n=n, kv=kv, h=h)(*args)
    np.testing.assert_array_equal(np.asarray(vc1, np.float32), np.asarray(rvc, np.float32))
    _close(q, rq)
    # the written keys against the reference's; every other entry untouched, bit for bit
    raw = np.broadcast_to(np.asarray(idx), (b,))
    wrapped = np.where(raw < 0, raw + S, raw)  # a negative slot counts from the end once
    rows = np.nonzero((wrapped >= 0) & (wrapped < S))[0]  # the others are dropped
    slots = wrapped[rows]
    got, want = np.asarray(kc1, np.float32), np.asarray(rkc, np.float32)
    _close(got[2, rows, slots], want[2, rows, slots])
    keep = np.ones(got.shape[:3], bool)
    keep[2, rows, slots] = False
    np.testing.assert_array_equal(got[keep], np.asarray(kc, np.float32)[keep])
    np.testing.assert_array_equal(want[keep], np.asarray(kc, np.float32)[keep])


def test_a_loop_fills_the_cache_like_the_reference():
    n, kv, h, b = 32, 8, 128, 4
    qkv, qn, kn, kc, vc, _ = _operands(b, n, kv, h, seed=7)

    def loop(impl):
        step = _run(impl, True, n=n, kv=kv, h=h)

        @jax.jit
        def run(kc, vc):
            def body(t, carry):
                kc, vc = carry
                x = (qkv * (1 + t)).astype(jnp.bfloat16)
                pos = jnp.full((b,), t, jnp.int32)
                _, kc, vc = step(x, qn, kn, t % L, pos, t, kc, vc)
                return kc, vc

            return jax.lax.fori_loop(0, S, body, (kc, vc))

        return run(kc, vc)

    (k1, v1), (k2, v2) = loop("cuda"), loop("ref")
    np.testing.assert_array_equal(np.asarray(v1, np.float32), np.asarray(v2, np.float32))
    _close(k1, k2)
