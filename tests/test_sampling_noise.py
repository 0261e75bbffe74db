"""The samplers' Gumbel noise in its far tail (CPU).

A Gumbel-max draw gives a token ~1e-7 of the top one its share only if the noise's tail
P(g > t) is right out to t ~ 20. float32 noise from 23-bit uniforms stops at 15.9 (16.6 in the
earlier kernels) and drew the ~150K such tokens of a peaked row about half as often as they
should be (experiments/results/sampler_tail_bias_cpu.md). Checked here, for the JAX methods'
noise (`rejax.sampling._gumbel`, 40 bits a token) and the CUDA kernels' (their NumPy mirror
`rejax.ops.sampler.gumbel`, 55 bits): the bits -> noise maps against the exact Gumbel tail over
their whole range, the keyed noise's counts over 2**26 draws (the old noise never exceeds 16),
and the bit layout the draw uses.

A draw-level test of the defect needs ~1e9 token noises to see it at 6 sigma (e.g. a body of
~4M tokens each ~3e-8 of the row, ~300 draws), minutes on 2 cores, so the draw-level check is
experiments/sampler_tail_bias.py (the GPU test's far-tail row through "radix", 1.5e10 token
noises), and its result is in experiments/results/sampler_tail_bias_cpu.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_sampling import _chi2_pvalue

from rejax import sampling
from rejax.ops import sampler as op


def _jax_map(h: np.ndarray) -> np.ndarray:
    # 40-bit integers -> the JAX methods' noise: hi word = h >> 8, byte = h & 255
    hi = jnp.asarray((h >> np.uint64(8)).astype(np.uint32))
    lo8 = jnp.asarray((h & np.uint64(255)).astype(np.uint32))
    return np.asarray(sampling._gumbel_of_bits(hi, lo8), np.float64)


def _kernel_map(h: np.ndarray) -> np.ndarray:
    # 55-bit integers -> the kernels' noise: hi word = h >> 23, lo word's top 23 bits = the rest
    hi = (h >> np.uint64(23)).astype(np.uint32)
    lo = ((h & np.uint64((1 << 23) - 1)) << np.uint64(9)).astype(np.uint32)
    return op.gumbel_of_bits(hi, lo).astype(np.float64)


MAPS = {"jax": (_jax_map, 40), "kernel": (_kernel_map, 55)}


def _tail_counts(g_of, bits: int, t: np.ndarray) -> np.ndarray:
    # #{h in [0, 2**bits): g(h) > t} for each t, by bisection (g is non-increasing in h)
    lo = np.zeros(t.shape, np.uint64)
    hi = np.full(t.shape, 1 << bits, np.uint64)
    for _ in range(bits + 1):
        mid = (lo + hi) >> np.uint64(1)
        above = g_of(np.minimum(mid, np.uint64((1 << bits) - 1))) > t
        lo, hi = np.where(above, mid + np.uint64(1), lo), np.where(above, hi, mid)
    return lo


@pytest.mark.parametrize("name", list(MAPS))
def test_noise_map_has_the_exact_gumbel_tail(name):
    g_of, bits = MAPS[name]
    h = np.random.default_rng(0).integers(0, 1 << bits, 4000, dtype=np.uint64)
    h = np.sort(np.concatenate([np.array([0, (1 << bits) - 1], np.uint64), h]))
    g = g_of(h)
    assert np.all(np.diff(g) <= 0), "noise must fall as the bits grow (an inverse CDF)"
    # the largest noise is -log(-log1p(-2**-(bits + 1))) = (bits + 1) log 2; then P(g > t) is
    # right to float32 rounding of g (ulp / 1 relative) or one step of the 2**-bits grid
    np.testing.assert_allclose(g[0], (bits + 1) * np.log(2), rtol=1e-6)
    np.testing.assert_allclose(g[-1], -np.log((bits + 1) * np.log(2)), rtol=1e-6)
    ts = np.array([-3.0, -1.0, 0.3, 2.0, 5.0, 10.0, 14.0, 16.0, 18.0, 20.0, 24.0, 27.0])
    if bits > 40:
        ts = np.append(ts, [30.0, 34.0, 38.0])
    got = _tail_counts(g_of, bits, ts).astype(np.float64) * 2.0**-bits
    want = -np.expm1(-np.exp(-ts))
    err = np.abs(got - want)
    bad = err > 1e-5 * want + 2.0**-bits
    assert not bad.any(), f"P(g > t) wrong at t = {ts[bad]}: {got[bad]} vs exact {want[bad]}"


def _keyed_counts(n_keys: int, per_key: int, edges: np.ndarray) -> np.ndarray:
    # counts of the keyed noise g > t for each edge, over n_keys keys x per_key tokens
    @jax.jit
    def counts(key):
        g = jax.vmap(lambda k: sampling._gumbel(k, per_key))(jax.random.split(key, n_keys))
        return jnp.sum(g[..., None] > jnp.asarray(edges, jnp.float32), axis=(0, 1))

    return np.asarray(counts(jax.random.key(2026)))


def test_keyed_noise_follows_the_gumbel_law_past_16():
    # 2**26 draws: the bulk against the exact CDF (chi-square, p > 1e-4, fixed key) and the far
    # tail: P(g > 16) = 1.1e-7, 7.5 expected (Poisson), where 23-bit noise gives none at all
    edges = np.array([-1.0, 0.0, 1.0, 2.0, 4.0, 7.0, 10.0, 13.0, 16.0])
    n = 1 << 26
    above = _keyed_counts(64, n // 64, edges)
    tail = -np.expm1(-np.exp(-edges))
    obs = -np.diff(np.concatenate([[n], above, [0]]))
    exp = -np.diff(np.concatenate([[1.0], tail, [0.0]])) * n
    stat = float(((obs - exp) ** 2 / exp).sum())
    p = _chi2_pvalue(stat, exp.size - 1)
    assert p > 1e-4, f"chi2 {stat:.1f} on {exp.size - 1} dof, p = {p:.2e}: {obs} vs {exp}"
    assert 1 <= above[-1] <= 25, f"{above[-1]} draws above 16, expected {n * tail[-1]:.1f}"


def test_noise_bit_layout():
    # token j: word j of jax.random.bits(key, (n + ceil(n / 4),)) and byte j % 4 of word
    # n + j // 4; every token its own bits (distinct noise) and `_draw` adds exactly this noise
    key = jax.random.key(5)
    n = 10
    w = np.asarray(jax.random.bits(key, (n + 3,), jnp.uint32))
    j = np.arange(n)
    lo8 = (w[n + j // 4] >> (8 * (j % 4)).astype(np.uint32)) & np.uint32(255)
    want = np.asarray(sampling._gumbel_of_bits(jnp.asarray(w[:n]), jnp.asarray(lo8)))
    got = np.asarray(sampling._gumbel(key, n))
    np.testing.assert_array_equal(got, want)
    assert np.unique(got).size == n
    keys = jax.random.split(jax.random.key(8), 3)
    zt = jnp.asarray(np.random.default_rng(1).normal(size=(3, n)), jnp.float32)
    keep = jnp.ones((3, n), bool).at[1, 2:].set(False)
    g = jax.vmap(lambda k: sampling._gumbel(k, n))(keys)
    want_tok = jnp.argmax(jnp.where(keep, zt + g, -jnp.inf), axis=-1)
    np.testing.assert_array_equal(sampling._draw(keys, zt, keep), want_tok)
    # the kernels' mirror: hi = Philox word id % 4 at (id / 4, 0, 0, 0), lo at (id / 4, 1, 0, 0);
    # the low word is read only where it can matter, which changes no value
    ids = np.arange(100_000, dtype=np.uint32)
    r = (ids & np.uint32(3)).astype(np.intp)
    hi = np.choose(r, op.philox(ids >> np.uint32(2), 5, 9))
    lo = np.choose(r, op.philox(ids >> np.uint32(2), 5, 9, 1))
    assert (np.minimum(hi, ~hi) < (1 << 24)).sum() > 200  # both kinds of token occur
    np.testing.assert_array_equal(op.gumbel(5, 9, ids), op.gumbel_of_bits(hi, lo))
