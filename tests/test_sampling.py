"""Tests for rejax.sampling: ReSET semantics (the official implementation's reference semantics), top-p exactness, samplers, masks."""

from __future__ import annotations

import collections
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from rejax import sampling
from rejax.sampling import (
    Greedy,
    ReSET,
    SamplerState,
    Temperature,
    entropy,
    reset_init,
    reset_observe,
    reset_temperature,
    sample,
    sampler_init,
    top_p_mask,
)
from rejax.text import newline_masks

V8 = 8
NL, DNL, DOT_DNL, OTHER = 0, 1, 2, 5  # token ids of the scripted traces


def _masks(v: int) -> tuple[jax.Array, jax.Array]:
    nl = np.zeros(v, bool)
    dnl = np.zeros(v, bool)
    nl[NL] = True
    dnl[[DNL, DOT_DNL]] = True
    return jnp.asarray(nl), jnp.asarray(dnl)


def _logits_with_entropy(kind: str) -> np.ndarray:
    """[V8] logits: 'a' uniform (H = ln 8), '0' one-hot (H = 0), 'd' four-way tie (H = ln 4)."""
    ties = {"a": 8, "0": 1, "d": 4}[kind]
    z = np.full(V8, -1e4, np.float32)
    z[:ties] = 0.0
    return z


# ----------------------------------------------------------------------------- reference policy


def _ref_policy(entropies, tokens, *, w, tau_0, t_high, t_low, nl, dnl, include_current=False):
    """The official policy written out plainly (the official implementation's reference semantics), float64 and Python lists.

    Returns (temperatures, ambiguous) per position; `ambiguous` flags decisions whose margin
    (step vs running mean, or entropy vs threshold) is non-zero but < 1e-5, where float32 sums
    may round either way. Exact ties (the same sums) are decided and must agree.
    """
    ring = collections.deque(maxlen=w)
    s_sum = g_sum = 0.0
    s_n = g_n = 0
    y1 = y2 = None
    temps, ambiguous = [], []
    for h, y in zip(entropies, tokens):
        h = float(h)
        if y1 is not None and (y1 in dnl or (y1 in nl and y2 in nl)):
            s_sum, s_n = 0.0, 0
        if include_current:
            ring.append(h)
            s_sum, s_n, g_sum, g_n = s_sum + h, s_n + 1, g_sum + h, g_n + 1
            hs = s_sum / s_n if s_n > w else sum(ring) / len(ring)
            hbar = g_sum / g_n
        else:
            if s_n >= w:
                hs = s_sum / s_n
            else:
                hs = sum(ring) / len(ring) if ring else h
            hbar = g_sum / g_n if g_n > 0 else hs
        tau = hs if hs > hbar else tau_0
        temps.append(t_high if h >= tau else t_low)
        ambiguous.append(0 < abs(hs - hbar) < 1e-5 or 0 < abs(h - tau) < 1e-5)
        if not include_current:
            ring.append(h)
            s_sum, s_n, g_sum, g_n = s_sum + h, s_n + 1, g_sum + h, g_n + 1
        y2, y1 = y1, int(y)
    return temps, ambiguous


def _scan_policy(logits_seq, tokens_seq, cfg):
    """Runs reset_temperature + reset_observe over [T, B, V] logits and scripted [T, B] tokens."""

    def body(state, xs):
        z, y = xs
        t, h, state = reset_temperature(z, state, cfg)
        return reset_observe(state, y, cfg), (t, h)

    state = reset_init(logits_seq.shape[1], cfg.window)
    return jax.jit(lambda s, z, y: lax.scan(body, s, (z, y)))(state, logits_seq, tokens_seq)


# ----------------------------------------------------------------------------- hand traces

# w = 2, tau_0 = 2.5 > ln 8, so T_high only happens in an uncertain step (tau = H_step <= H).
# a = ln 8. Columns: entropy kind, token, expected temperature, why.
_TRACE = [
    ("a", OTHER, "L", "first token: H_step = H-bar = H, confident (a wrong H-bar=0 gives T_high)"),
    ("a", OTHER, "L", "window a vs H-bar a: equal, SAT is strict"),
    ("0", NL, "L", "step mean a vs a"),
    ("0", NL, "L", "2a/3 vs 2a/3; NL NL: a step starts after this token"),
    ("a", OTHER, "L", "window [0, 0] spans the boundary: 0 < a/2"),
    ("a", OTHER, "L", "window a/2 < H-bar 3a/5"),
    ("a", DNL, "H", "step mean a > 2a/3: tau = a and H = a >= tau (non-strict); DNL ends step"),
    ("0", OTHER, "L", "window a > 5a/7: tau = a > H = 0"),
    ("a", OTHER, "L", "window a/2 < 5a/8"),
    ("a", OTHER, "L", "step mean a/2 (= window) < 2a/3"),
    ("a", OTHER, "L", "4th token: step mean 2a/3 < 0.7a (the window a would give T_high)"),
    ("a", DOT_DNL, "H", "step mean 3a/4 > 8a/11, H >= tau; '.\\n\\n' ends the step"),
    ("0", NL, "L", "window a > 0.75a: tau = a > 0"),
    ("a", OTHER, "L", "window a/2 < 9a/13 (a single NL is no boundary)"),
    ("a", NL, "L", "step mean a/2 < 10a/14"),
    ("a", OTHER, "L", "step mean 2a/3 < 11a/15 (NL, x, NL is no boundary: a reset gives T_high)"),
]

# include_current=True (figure semantics), w = 2: the in-step mean takes over at the step's
# (w+1)-th token and includes H_t. d = ln 4.
_TRACE_FIGURE = [
    ("0", OTHER, "L", "first token: everything equals H"),
    ("0", NL, "L", ""),
    ("0", NL, "L", "NL NL: a step starts after this token"),
    ("0", OTHER, "L", "window [0, 0]"),
    ("a", OTHER, "H", "window (a + 0)/2 > H-bar a/5; H = a >= a/2"),
    ("d", OTHER, "H", "3rd token: step mean (0+a+d)/3 = 1.155 <= d (window (a+d)/2 would be L)"),
]


def _run_trace(trace, include_current):
    cfg = ReSET(
        t_high=1.0, t_low=0.25, tau_0=2.5, window=2, include_current=include_current,
        nl_mask=_masks(V8)[0], dnl_mask=_masks(V8)[1],
    )  # fmt: skip
    logits = np.stack([_logits_with_entropy(k) for k, *_ in trace])[:, None, :]
    tokens = np.array([[tok] for _, tok, *_ in trace], np.int32)
    _, (temps, ents) = _scan_policy(jnp.asarray(logits), jnp.asarray(tokens), cfg)
    expected = [{"L": 0.25, "H": 1.0}[e] for _, _, e, _ in trace]
    return np.asarray(temps)[:, 0], np.asarray(ents)[:, 0], expected


def test_hand_trace_reference_semantics():
    temps, ents, expected = _run_trace(_TRACE, include_current=False)
    a = math.log(8)
    want_h = [{"a": a, "0": 0.0}[k] for k, *_ in _TRACE]
    np.testing.assert_allclose(ents, want_h, atol=1e-6)  # tolerance: f32 entropy
    for i, (got, want, row) in enumerate(zip(temps, expected, _TRACE)):
        assert got == want, f"position {i}: got T={got}, expected {want} ({row[3]})"


def test_hand_trace_figure_semantics():
    temps, _, expected = _run_trace(_TRACE_FIGURE, include_current=True)
    for i, (got, want, row) in enumerate(zip(temps, expected, _TRACE_FIGURE)):
        assert got == want, f"position {i}: got T={got}, expected {want} ({row[3]})"


def test_hand_traces_agree_with_reference_policy():
    for trace, fig in ((_TRACE, False), (_TRACE_FIGURE, True)):
        temps, ents, _ = _run_trace(trace, include_current=fig)
        want, _ = _ref_policy(
            ents, [t for _, t, *_ in trace], w=2, tau_0=2.5, t_high=1.0, t_low=0.25,
            nl={NL}, dnl={DNL, DOT_DNL}, include_current=fig,
        )  # fmt: skip
        assert list(temps) == want


def test_state_after_trace():
    cfg = ReSET(window=2, nl_mask=_masks(V8)[0], dnl_mask=_masks(V8)[1])
    state = reset_init(1, 2)
    for kind, tok in [("a", OTHER), ("0", NL), ("a", NL), ("0", OTHER)]:
        _, _, state = reset_temperature(jnp.asarray(_logits_with_entropy(kind))[None], state, cfg)
        state = reset_observe(state, jnp.array([tok], jnp.int32), cfg)
    a = np.float32(math.log(8))
    # ring slots: a, 0, a, 0 written round-robin into 2 slots
    np.testing.assert_allclose(np.asarray(state.ring), [[a, 0.0]], atol=1e-6)
    assert int(state.n_ring[0]) == 2 and int(state.ring_pos[0]) == 0
    assert int(state.s_n[0]) == 1 and float(state.s_sum[0]) == 0.0  # NL NL reset, then one 0
    assert int(state.g_n[0]) == 4
    np.testing.assert_allclose(float(state.g_sum[0]), 2 * a, rtol=1e-6)
    assert (int(state.y1[0]), int(state.y2[0])) == (OTHER, NL)


# ----------------------------------------------------------------------------- long streams


def _random_stream(rng, steps, batch, v):
    # entropies spread over [0, ln v] by a random per-token logit scale
    scale = rng.choice([0.05, 0.3, 1.0, 2.0, 4.0, 8.0], size=(steps, batch, 1))
    logits = (rng.normal(size=(steps, batch, v)) * scale).astype(np.float32)
    tokens = rng.integers(3, v, size=(steps, batch))
    u = rng.random(size=(steps, batch))
    tokens[u < 0.12] = NL
    tokens[(u >= 0.12) & (u < 0.14)] = DNL
    tokens[(u >= 0.14) & (u < 0.16)] = DOT_DNL
    return logits, tokens.astype(np.int32)


@pytest.mark.parametrize(("window", "include_current"), [(8, False), (32, False), (8, True)])
def test_long_random_streams_match_reference_policy(window, include_current):
    rng = np.random.default_rng(window + include_current)
    steps, batch, v = 2000, 4, 12
    logits, tokens = _random_stream(rng, steps, batch, v)
    cfg = ReSET(
        t_high=1.0, t_low=0.1, tau_0=1.25, window=window, include_current=include_current,
        nl_mask=_masks(v)[0], dnl_mask=_masks(v)[1],
    )  # fmt: skip
    _, (temps, ents) = _scan_policy(jnp.asarray(logits), jnp.asarray(tokens), cfg)
    temps, ents = np.asarray(temps), np.asarray(ents)

    z = logits.astype(np.float64)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(ents, -(p * np.log(p)).sum(-1), atol=2e-6)  # f32 vs f64 entropy

    n_amb = n_high = n_steps_long = 0
    for b in range(batch):
        want, amb = _ref_policy(
            ents[:, b], tokens[:, b], w=window, tau_0=1.25, t_high=1.0, t_low=0.1,
            nl={NL}, dnl={DNL, DOT_DNL}, include_current=include_current,
        )  # fmt: skip
        got = temps[:, b]
        ok = np.array(amb) | (got == np.array(want, np.float32))
        assert ok.all(), f"row {b}: first mismatch at position {int(np.argmin(ok))}"
        n_amb += sum(amb)
        n_high += int((got == 1.0).sum())
        # steps longer than w make the in-step mean matter
        lengths = np.diff(np.flatnonzero(np.isin(tokens[:, b], [DNL, DOT_DNL])))
        n_steps_long += int((lengths > window + 2).sum())
    assert n_amb <= 0.01 * steps * batch
    assert 0.1 * steps * batch < n_high < 0.9 * steps * batch  # both temperatures exercised
    assert n_steps_long > 5


def test_sample_loop_matches_reference_policy():
    # ReSET drives its own tokens; the reference replays the same entropies and tokens.
    rng = np.random.default_rng(7)
    steps, batch, v = 400, 3, 12
    logits, _ = _random_stream(rng, steps, batch, v)
    logits[:, :, NL] += 1.5  # make newlines likely so steps end
    cfg = ReSET(t_high=1.0, t_low=0.3, tau_0=1.25, window=4, nl_mask=_masks(v)[0],
                dnl_mask=_masks(v)[1], top_p=0.9)  # fmt: skip

    def body(state, xs):
        i, z = xs
        tok, state, info = sample(jax.random.fold_in(jax.random.key(3), i), z, state, cfg)
        return state, (tok, info["temperature"], info["entropy"])

    run = jax.jit(lambda s, z: lax.scan(body, s, (jnp.arange(steps), z)))
    _, (toks, temps, ents) = run(sampler_init(cfg, batch), jnp.asarray(logits))
    toks, temps, ents = map(np.asarray, (toks, temps, ents))
    assert (toks == NL).sum() > 20
    for b in range(batch):
        want, amb = _ref_policy(
            ents[:, b], toks[:, b], w=4, tau_0=1.25, t_high=1.0, t_low=0.3,
            nl={NL}, dnl={DNL, DOT_DNL},
        )  # fmt: skip
        ok = np.array(amb) | (temps[:, b] == np.array(want, np.float32))
        assert ok.all(), f"row {b}: first mismatch at {int(np.argmin(ok))}"


def test_online_stats_loop_matches_reference_policy():
    # test_sample_loop_matches_reference_policy with the one-pass ("online") statistics
    rng = np.random.default_rng(8)
    steps, batch, v = 400, 3, 12
    logits, _ = _random_stream(rng, steps, batch, v)
    logits[:, :, NL] += 1.5
    cfg = ReSET(t_high=1.0, t_low=0.3, tau_0=1.25, window=4, nl_mask=_masks(v)[0],
                dnl_mask=_masks(v)[1], top_p=0.9)  # fmt: skip

    def body(state, xs):
        i, z = xs
        key = jax.random.fold_in(jax.random.key(3), i)
        tok, state, info = sample(key, z, state, cfg, stats_method="online")
        return state, (tok, info["temperature"], info["entropy"])

    run = jax.jit(lambda s, z: lax.scan(body, s, (jnp.arange(steps), z)))
    _, (toks, temps, ents) = run(sampler_init(cfg, batch), jnp.asarray(logits))
    toks, temps, ents = map(np.asarray, (toks, temps, ents))
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(ents, -(p * np.log(p)).sum(-1), atol=2e-6)  # f32 vs f64 entropy
    assert (toks == NL).sum() > 20
    for b in range(batch):
        want, amb = _ref_policy(
            ents[:, b], toks[:, b], w=4, tau_0=1.25, t_high=1.0, t_low=0.3,
            nl={NL}, dnl={DNL, DOT_DNL},
        )  # fmt: skip
        ok = np.array(amb) | (temps[:, b] == np.array(want, np.float32))
        assert ok.all(), f"row {b}: first mismatch at {int(np.argmin(ok))}"


def test_online_stats_equal_two_pass():
    z = jax.random.normal(jax.random.key(5), (6, 3000)) * jnp.array([[0.1, 1, 3, 10, 30, 1]]).T
    z = z.at[0, :100].set(-jnp.inf).at[5, 1:].set(-jnp.inf).at[2, 7].set(z[2].max())  # a tie
    inv = (jnp.full((6,), 1 / 0.7), jnp.linspace(0.5, 1e6, 6))  # 1e6: a near-greedy T_low
    m, top, h, (a, c) = jax.jit(sampling._online_stats)(z, inv)
    m2, h2, top2 = sampling._max_and_entropy(z)
    assert (np.asarray(m) == np.asarray(m2)).all() and (np.asarray(top) == np.asarray(top2)).all()
    np.testing.assert_allclose(h, h2, rtol=1e-5, atol=2e-6)  # tolerance: f32 rescaling
    for got, w in ((a, inv[0]), (c, inv[1])):
        want = jnp.sum(jnp.exp((z - m2) * w[:, None]), axis=-1)
        np.testing.assert_allclose(got, want, rtol=2e-5)  # tolerance: f32 rescaling
    with pytest.raises(ValueError, match="stats_method"):
        sample(jax.random.key(0), z, sampler_init(Greedy(), 6), Greedy(), stats_method="one")
    with pytest.raises(ValueError, match="top-p method"):
        sample(jax.random.key(0), z, sampler_init(Greedy(), 6), Greedy(), top_p_method="heap")


# ----------------------------------------------------------------------------- entropy


def test_entropy_values():
    z = jnp.asarray(np.stack([_logits_with_entropy(k) for k in "a0d"]))
    np.testing.assert_allclose(entropy(z), [math.log(8), 0.0, math.log(4)], atol=1e-6)
    # -inf logits contribute nothing (no 0 * inf NaN)
    z = jnp.array([[0.0, 0.0, -jnp.inf, -jnp.inf]])
    np.testing.assert_allclose(entropy(z), [math.log(2)], atol=1e-6)


# ----------------------------------------------------------------------------- top-p


def _top_p_numpy(probs, top_p):
    """Independent statement of the definition: stable ascending sort, exact integer masses."""
    q = np.round(probs.astype(np.float32) * np.float32(2**30)).astype(np.int64)
    keep = np.zeros(probs.shape, bool)
    for b in range(probs.shape[0]):
        order = np.argsort(probs[b], kind="stable")
        incl = np.cumsum(q[b, order])
        above = (incl[-1] - incl).astype(np.float32)
        limit = np.float32(top_p[b]) * np.float32(q[b].sum())
        keep[b, order] = (above < limit) | (top_p[b] >= 1.0)
    return keep


def _cases(rng, n):
    for i in range(n):
        v = (2, 5, 17, 60)[i % 4]  # few shapes: one compile each
        kind = i % 5
        if kind == 0:
            z = rng.normal(size=(3, v)) * rng.uniform(0.1, 6)
        elif kind == 1:
            z = rng.integers(0, 3, size=(3, v)).astype(np.float64)  # large tie groups
        elif kind == 2:
            z = np.zeros((3, v))  # one tie group
        elif kind == 3:
            z = rng.integers(-3, 2, size=(3, v)) * 4.0
        else:
            z = rng.normal(size=(3, v)) * 30  # tiny and zero probabilities
        probs = np.asarray(jax.nn.softmax(jnp.asarray(z, jnp.float32), axis=-1))
        top_p = rng.choice([0.05, 0.25, 0.5, 0.75, 0.9, 0.95, 0.999, 1.0, 1 / 3], size=3)
        yield probs, top_p.astype(np.float32)


def _covered(probs, top_p):
    """Which rows the "topk" method decides from its 16 candidates (the rest take "radix")."""
    return np.asarray(_covered_jit(jnp.asarray(probs), jnp.asarray(top_p)))


_covered_jit = jax.jit(lambda probs, top_p: sampling._top_p_candidates(probs, top_p)[3])


def test_top_p_methods_equal_definition_including_ties():
    # 120 cases of 3 rows; rows are independent, so the cases of one width run as one batch
    rng = np.random.default_rng(0)
    fn = jax.jit(top_p_mask, static_argnames="method")
    groups = collections.defaultdict(list)
    for probs, top_p in _cases(rng, 120):
        groups[probs.shape[1]].append((probs, top_p))
    for v, cases in groups.items():
        probs = np.concatenate([c[0] for c in cases])
        top_p = np.concatenate([c[1] for c in cases])
        want = _top_p_numpy(probs, top_p)
        for method in sampling.TOP_P_METHODS:
            got = np.asarray(fn(jnp.asarray(probs), jnp.asarray(top_p), method=method))
            bad = np.flatnonzero((got != want).any(-1))
            assert bad.size == 0, (method, v, probs[bad[:1]], top_p[bad[:1]])
        if v > sampling._TOPK_FAST:  # both "topk" paths ran on rows wider than its candidates
            n_covered = int(_covered(probs, top_p).sum())
            assert 0.2 * len(probs) < n_covered < 0.8 * len(probs), (v, n_covered, len(probs))
    # a tie group cut in the middle: 4 x 0.25 at top_p 0.5 keeps the two highest ids (vLLM
    # stable ascending sort drops the lower ids first)
    for method in sampling.TOP_P_METHODS:
        got = top_p_mask(jnp.full((1, 4), 0.25), 0.5, method)
        assert np.asarray(got).tolist() == [[False, False, True, True]]
        got = top_p_mask(jnp.array([[0.1, 0.6, 0.3]]), 0.5, method)  # only the top token
        assert np.asarray(got).tolist() == [[False, True, False]]


def test_top_p_matches_float64_vllm_definition():
    # Away from exact mass ties, the integer-mass definition equals vLLM's cumulative sum.
    rng = np.random.default_rng(1)
    fn = jax.jit(top_p_mask)
    for _ in range(50):
        probs = rng.dirichlet(np.full(40, 0.3), size=2)
        top_p = rng.uniform(0.2, 0.99, size=2)
        order = np.argsort(probs, axis=-1, kind="stable")
        want = np.zeros_like(probs, bool)
        for b in range(2):
            c = np.cumsum(probs[b, order[b]])
            if np.min(np.abs(c - (1 - top_p[b]))) < 1e-5:
                continue
            want[b, order[b]] = c > 1 - top_p[b]
            want[b, order[b][-1]] = True
            got = fn(jnp.asarray(probs[b : b + 1], jnp.float32), jnp.float32(top_p[b]))
            assert (np.asarray(got)[0] == want[b]).all()


def test_top_p_methods_equal_sort_at_full_vocab():
    v = 151936
    z = jax.random.normal(jax.random.key(0), (3, v)) * jnp.array([[3.0], [0.5], [1.0]])
    z = z.at[2, :5].set(jnp.array([14.0, 13.8, 13.8, 13.5, 13.0]))  # a peaked row
    probs = jax.nn.softmax(z / 0.6, axis=-1)
    fn = jax.jit(top_p_mask, static_argnames="method")
    for tp in (0.95, 0.5):
        want = fn(probs, tp, method="sort")
        for method in ("radix", "topk"):
            assert bool(jnp.all(fn(probs, tp, method=method) == want)), (method, tp)
        assert 1 < int(want[0].sum()) < v
        assert 1 < int(want[2].sum()) <= sampling._TOPK_FAST
        # the flat row's nucleus passes the 16 candidates, the peaked row's does not
        assert _covered(probs, jnp.full((3,), tp))[1:].tolist() == [False, True]


def test_kth_largest_rounds_of_16():
    rng = np.random.default_rng(5)
    fn = jax.jit(sampling._kth_largest, static_argnums=1)
    for v in (40, 300):
        z = rng.integers(-4, 4, size=(6, v)).astype(np.float32)  # large tie groups
        z[1] = rng.normal(size=v)
        z[2, : v // 2] = -np.inf
        z[3] = 0.0
        z[4, :-17] = -np.inf  # exactly 17 finite entries
        for k in (16, 17, 20, 33, v):
            want = -np.sort(-z, axis=-1)[:, k - 1]
            np.testing.assert_array_equal(np.asarray(fn(jnp.asarray(z), k)), want, err_msg=f"{k}")


def _chi2_pvalue(stat: float, df: int) -> float:
    """P(chi2_df >= stat): 1 - the regularised lower incomplete gamma P(df/2, stat/2) (series)."""
    a, x = df / 2.0, stat / 2.0
    term = total = 1.0 / a
    n = 0
    while term > 1e-17 * total:
        n += 1
        term *= x / (a + n)
        total += term
    return max(0.0, 1.0 - math.exp(a * math.log(x) - x - math.lgamma(a)) * total) if x > 0 else 1.0


def _assert_draws_match(tokens, want, label):
    """Chi-square goodness of fit of the drawn ids to the exact distribution `want` [V]."""
    n = tokens.size
    counts = np.bincount(tokens, minlength=want.size)
    assert counts[want == 0].sum() == 0, f"{label}: drew ids outside the nucleus"
    expected = want * n
    big = expected >= 5  # pool the rare ids into one bin so that every bin expects >= 5
    obs = np.append(counts[big], counts[~big & (want > 0)].sum())
    exp = np.append(expected[big], expected[~big & (want > 0)].sum())
    obs, exp = obs[exp > 0], exp[exp > 0]
    if exp.size < 2:
        assert counts[want > 0].sum() == n
        return
    stat = float(((obs - exp) ** 2 / exp).sum())
    p = _chi2_pvalue(stat, exp.size - 1)
    assert p > 1e-4, f"{label}: chi2 {stat:.1f} on {exp.size - 1} dof, p = {p:.2e}"


def test_chi2_pvalue_helper():
    # known quantiles: chi2_1 >= 3.841 has p 0.05; chi2_10 >= 29.59 has p 0.001
    assert abs(_chi2_pvalue(3.841, 1) - 0.05) < 1e-3
    assert abs(_chi2_pvalue(29.59, 10) - 0.001) < 1e-4
    assert abs(_chi2_pvalue(10.0, 10) - 0.4405) < 1e-3


V40 = 40


def _dist_logits(case):
    rng = np.random.default_rng(11)
    if case == "peaked":  # nucleus inside the 16 candidates ("topk" fast path)
        return np.concatenate([[6.0, 5.0, 4.5, 4.0, 3.0], rng.normal(size=V40 - 5)]), 0.95
    if case == "flat":  # 40 equal logits, top_p 0.5: 20 tied tokens kept (radix fallback)
        return np.zeros(V40), 0.5
    if case == "ties":  # tie groups with the boundary inside one group, nucleus > 16
        return np.repeat([2.0, 1.0, 0.0, -1.0], 10), 0.8
    if case == "top_p_1":
        return rng.normal(size=V40) * 1.5, 1.0
    if case == "tiny_top_p":  # only the top token (the higher id of a tie at the top)
        return np.concatenate([[3.0, 3.0], rng.normal(size=V40 - 2)]), 1e-3
    raise AssertionError(case)


def _exact_truncated(z, t, top_p, top_k=0):
    zt = np.asarray(z, np.float32) / np.float32(t)
    if top_k:
        zt = np.where(zt >= np.sort(zt)[::-1][top_k - 1], zt, -np.inf)
    p = np.exp(zt.astype(np.float64) - zt.max())
    p /= p.sum()
    keep = _top_p_numpy(p[None].astype(np.float32), np.array([top_p], np.float32))[0]
    want = np.where(keep & (p > 0), p, 0.0)
    return want / want.sum()


_N_DRAWS = 100_000


@pytest.mark.parametrize(
    ("case", "method"),
    [(c, "topk") for c in ("peaked", "flat", "ties", "top_p_1", "tiny_top_p")]
    + [("ties", "radix")],
)
def test_draws_follow_truncated_softmax(case, method):
    # 10^5 rows of the same logits, one key each; chi-square against the exact truncated
    # softmax at p > 1e-4 (a fixed key, so the outcome is deterministic), no id outside it.
    z, top_p = _dist_logits(case)
    t = 0.8
    keys = jax.random.split(jax.random.key(2024), _N_DRAWS)
    zb = jnp.broadcast_to(jnp.asarray(z, jnp.float32), (_N_DRAWS, V40))
    run = jax.jit(sample, static_argnames="top_p_method")
    smp = Temperature(t, top_p=top_p)
    tok, _, _ = run(keys, zb, sampler_init(smp, _N_DRAWS), smp, top_p_method=method)
    want = _exact_truncated(z, t, top_p)
    _assert_draws_match(np.asarray(tok), want, f"{case}/{method}")
    if method == "topk":  # the case exercises the path its comment names
        cov = _covered(jax.nn.softmax(zb[:1] / t), jnp.full((1,), top_p, jnp.float32))[0]
        assert cov == (case in ("peaked", "tiny_top_p")), case


def test_draws_top_k_20_and_reset():
    n, v = _N_DRAWS, 32
    rng = np.random.default_rng(3)
    z = (rng.normal(size=v) * 1.2).astype(np.float32)
    z[[3, 9, 30]] = z.max() + 0.5  # ties among the top
    keys = jax.random.split(jax.random.key(7), n)
    zb = jnp.broadcast_to(jnp.asarray(z), (n, v))
    run = jax.jit(sample)
    # top_p = 1: the support is exactly the 20 largest (found in two rounds of 16)
    smp = Temperature(0.7, top_k=20)
    tok, _, _ = run(keys, zb, sampler_init(smp, n), smp)
    want = _exact_truncated(z, 0.7, 1.0, top_k=20)
    assert (want > 0).sum() == 20
    _assert_draws_match(np.asarray(tok), want, "top_k 20")
    # ReSET at a response's first token: H >= tau_0 = 0.5 takes T_high
    cfg = _reset_cfg(v, t_high=1.3, t_low=0.2, tau_0=0.5, top_p=0.95)
    tok, _, info = run(keys, zb, sampler_init(cfg, n), cfg)
    assert (np.asarray(info["temperature"]) == np.float32(1.3)).all()
    _assert_draws_match(np.asarray(tok), _exact_truncated(z, 1.3, 0.95), "reset")


# ----------------------------------------------------------------------------- samplers


def _reset_cfg(v, **kw):
    nl, dnl = _masks(v)
    return ReSET(nl_mask=nl, dnl_mask=dnl, window=4, **kw)


@pytest.mark.parametrize(
    "sampler",
    [Greedy(), Temperature(0.7, top_p=0.9), Temperature(1.3, top_p=0.8, top_k=5), None],
)
def test_jit_equals_eager(sampler):
    v, b = 32, 4
    sampler = sampler or _reset_cfg(v)
    z = jax.random.normal(jax.random.key(1), (b, v)) * 2
    state = sampler_init(sampler, b)
    for step in range(2):
        key = jax.random.fold_in(jax.random.key(0), step)
        t1, s1, i1 = sample(key, z, state, sampler)
        t2, s2, i2 = jax.jit(sample)(key, z, state, sampler)
        assert (np.asarray(t1) == np.asarray(t2)).all()
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6),
                     (s1, i1), (s2, i2))  # fmt: skip
        state = s1


def test_rows_independent_batch_and_vmap():
    v, b, steps = 40, 5, 3
    cfg = _reset_cfg(v, top_p=0.9)
    z = jax.random.normal(jax.random.key(2), (steps, b, v)) * 3
    keys = jax.random.split(jax.random.key(9), b)
    run = jax.jit(sample)
    batch_state = sampler_init(cfg, b)
    row_states = [sampler_init(cfg, 1) for _ in range(b)]
    for s in range(steps):
        ks = jax.vmap(lambda k, s=s: jax.random.fold_in(k, s))(keys)
        tok, batch_state, info = run(ks, z[s], batch_state, cfg)
        for r in range(b):
            t_r, row_states[r], i_r = run(ks[r : r + 1], z[s, r : r + 1], row_states[r], cfg)
            assert int(t_r[0]) == int(tok[r])
            assert float(i_r["temperature"][0]) == float(info["temperature"][r])
            np.testing.assert_allclose(i_r["entropy"][0], info["entropy"][r], rtol=1e-6)

    # vmap of a one-row call over rows gives the batched result
    def one(k, zr, st):
        st1 = jax.tree.map(lambda x: x[None], st)
        t, st1, _ = sample(k[None], zr[None], st1, cfg)
        return t[0], jax.tree.map(lambda x: x[0], st1)

    state0 = sampler_init(cfg, b)
    tv, sv = jax.jit(jax.vmap(one))(keys, z[0], state0)
    tb, sb, _ = sample(keys, z[0], state0, cfg)
    assert (np.asarray(tv) == np.asarray(tb)).all()
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6), sv, sb)


def test_greedy_at_tiny_temperature():
    v, b = 50, 6
    z = jax.random.normal(jax.random.key(4), (b, v))
    want = np.asarray(jnp.argmax(z, -1))
    state = sampler_init(Greedy(), b)
    run = jax.jit(sample)
    for sampler in (Greedy(), Temperature(1e-6), Temperature(1e-7, top_p=0.5)):
        for k in range(3):
            tok, _, _ = run(jax.random.key(k), z, state, sampler)
            assert (np.asarray(tok) == want).all()
    # ReSET with T_low = 0: rows that take T_low are greedy; flat rows (high entropy) sample
    cfg = _reset_cfg(v, t_low=0.0, tau_0=100.0)
    tok, _, info = run(jax.random.key(0), z, sampler_init(cfg, b), cfg)
    assert (np.asarray(info["temperature"]) == 0.0).all()
    assert (np.asarray(tok) == want).all()
    # a temperature just above the threshold samples (flat logits: not always token 0)
    flat = jnp.zeros((64, v))
    tok, _, _ = run(jax.random.key(0), flat, sampler_init(Greedy(), 64), Temperature(2e-6))
    assert len(set(np.asarray(tok).tolist())) > 10


def test_sampler_distribution():
    # 40000 draws of one row with per-row keys; empirical frequencies must lie within
    # 5 standard errors sqrt(p (1 - p) / n) of softmax(z / t) renormalised over the top-p set,
    # and tokens outside the set never appear.
    z = np.array([2.0, 1.5, 1.0, 0.2, -0.5, -1.0, -3.0], np.float32)
    t, top_p, n = 0.8, 0.85, 40000
    p = np.exp(z / t - np.max(z / t))
    p /= p.sum()
    keep = _top_p_numpy(p[None].astype(np.float32), np.array([top_p], np.float32))[0]
    assert 2 < keep.sum() < len(z)
    want = np.where(keep, p, 0.0) / p[keep].sum()
    keys = jax.random.split(jax.random.key(123), n)
    tok, _, _ = jax.jit(sample)(keys, jnp.broadcast_to(z, (n, len(z))),
                                sampler_init(Greedy(), n), Temperature(t, top_p=top_p))  # fmt: skip
    freq = np.bincount(np.asarray(tok), minlength=len(z)) / n
    bound = 5 * np.sqrt(want * (1 - want) / n)
    assert (np.abs(freq - want) <= bound).all(), (freq, want)
    assert (freq[~keep] == 0).all()


def test_top_k_then_top_p():
    z = jnp.array([[5.0, 4.0, 4.0, 3.0, 0.0, -1.0]])
    # top_k=2 keeps the tokens >= the 2nd value (4.0): ids 0, 1, 2 (ties kept, as vLLM)
    n = 300
    keys = jax.random.split(jax.random.key(0), n)
    tok, _, _ = jax.jit(sample)(keys, jnp.broadcast_to(z, (n, 6)), sampler_init(Greedy(), n),
                                Temperature(3.0, top_k=2))  # fmt: skip
    assert set(np.asarray(tok).tolist()) == {0, 1, 2}


def test_sweeps_do_not_retrace():
    traces = []

    @jax.jit
    def step(key, z, state, sampler):
        traces.append(1)
        return sample(key, z, state, sampler)

    v, b = 16, 2
    z = jnp.zeros((b, v))
    for t_low in (0.1, 0.2, 0.3):
        cfg = _reset_cfg(v, t_low=t_low, tau_0=t_low + 0.5, top_p=0.9 - t_low)
        step(jax.random.key(0), z, sampler_init(cfg, b), cfg)
    assert len(traces) == 1
    for t in (0.5, 0.7):
        step(jax.random.key(0), z, sampler_init(Greedy(), b), Temperature(t, top_p=t))
    assert len(traces) == 2


@pytest.mark.parametrize("method", ["topk", "radix"])  # "sort" has no data-dependent path
def test_methods_do_not_retrace_when_paths_change(method):
    # V = 40 > 16: the logits below switch rows between the "topk" candidate path and its
    # fallback; neither that nor new sampler values may retrace, and decode steps reuse the trace
    traces = []

    @jax.jit
    def step(key, z, state, sampler):
        traces.append(1)
        return sample(key, z, state, sampler, top_p_method=method)

    v, b = 40, 2
    peaked = jnp.zeros((b, v)).at[:, 3].set(20.0)
    flat = jnp.zeros((b, v))
    cfg = _reset_cfg(v)
    state = sampler_init(cfg, b)
    for i, z in enumerate([peaked, flat, peaked.at[1].set(0.0)]):
        cfg = dataclasses.replace(cfg, t_low=0.1 * (i + 1), top_p=0.9 - 0.1 * i)
        _, state, _ = step(jax.random.fold_in(jax.random.key(0), i), z, state, cfg)
    assert len(traces) == 1
    for t in (0.5, 0.7):
        smp = Temperature(t, top_p=t, top_k=20)
        step(jax.random.key(0), flat if t == 0.5 else peaked, sampler_init(smp, b), smp)
    assert len(traces) == 2


def test_topk_rows_independent_across_paths():
    # one row on the 16-candidate path, one on the fallback: each row's token equals the token
    # it draws alone, whatever the other row needs
    v = 40
    # row 0 keeps 4 tied tokens, drawn from its candidates; rows 1 and 2 keep more than 16
    z = jnp.stack([jnp.zeros(v).at[5:9].set(6.0), jnp.zeros(v), jnp.linspace(0.0, 3.0, v)])
    probs = jax.nn.softmax(z / 0.8, axis=-1)
    assert _covered(probs, jnp.full((3,), 0.9, jnp.float32)).tolist() == [True, False, False]
    run = jax.jit(sample, static_argnames="top_p_method")
    smp = Temperature(0.8, top_p=0.9)
    for i in range(6):
        keys = jax.random.split(jax.random.key(i), 3)
        tok, _, _ = run(keys, z, sampler_init(smp, 3), smp, top_p_method="topk")
        for r in range(3):
            alone, _, _ = run(keys[r : r + 1], z[r : r + 1], sampler_init(smp, 1), smp,
                              top_p_method="topk")  # fmt: skip
            assert int(alone[0]) == int(tok[r]), (i, r)


# ----------------------------------------------------------------------------- newline masks


def _byte_level_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())  # byte -> printable char; "\n" is "Ċ"
    vocab = {c: i for i, c in enumerate(alphabet)}
    merges = [("Ċ", "Ċ"), (".", "ĊĊ"), ("ĊĊ", "Ċ"), ("h", "i"), ("Ġ", "Ċ")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|im_end|>"])
    return tok, vocab


def test_newline_masks_byte_level_bpe():
    tok, vocab = _byte_level_tokenizer()
    v = len(vocab) + 20  # padded logits rows beyond the tokenizer
    nl, dnl = newline_masks(tok, v)
    assert nl.shape == dnl.shape == (v,) and nl.dtype == dnl.dtype == jnp.bool_
    assert np.flatnonzero(np.asarray(nl)).tolist() == [vocab["Ċ"]]
    want_dnl = sorted(vocab[t] for t in ("ĊĊ", ".ĊĊ", "ĊĊĊ"))
    assert np.flatnonzero(np.asarray(dnl)).tolist() == want_dnl  # not " \n", not "<|im_end|>"
    ids = tok.encode("hi.\n\nhi\n\n\nx\n").ids
    assert [bool(dnl[i]) for i in ids] == [False, True, False, True, False, False]
    assert bool(nl[ids[-1]])


def test_newline_masks_drive_boundaries():
    tok, vocab = _byte_level_tokenizer()
    nl, dnl = newline_masks(tok, len(vocab) + 1)
    cfg = ReSET(window=2, nl_mask=nl, dnl_mask=dnl)
    state = reset_init(3, 2)
    state = dataclasses.replace(state, s_n=jnp.full((3,), 5), s_sum=jnp.full((3,), 1.0))
    for y in ([vocab["Ċ"], vocab[".ĊĊ"], vocab["Ċ"]], [vocab["Ċ"], vocab["h"], vocab["hi"]]):
        state = reset_observe(state, jnp.array(y, jnp.int32), cfg)
    # row 0: NL NL, row 1: DNL (then "h" starts the new step), row 2: NL then "hi"
    assert np.asarray(state.s_n).tolist() == [0, 0, 5]
    state = reset_init(3, 2)
    state = dataclasses.replace(state, s_n=jnp.full((3,), 5))
    state = reset_observe(state, jnp.array([vocab["ĊĊ"], -1, len(vocab)], jnp.int32), cfg)
    assert np.asarray(state.s_n).tolist() == [0, 5, 5]  # ids outside the masks count as text


# ----------------------------------------------------------------------------- bad input


def test_bad_inputs():
    v, b = 16, 2
    z = jnp.zeros((b, v))
    cfg = _reset_cfg(v)
    st = sampler_init(cfg, b)
    key = jax.random.key(0)
    with pytest.raises(ValueError, match="Temperature.t"):
        Temperature(0.0)
    with pytest.raises(ValueError, match="Temperature.t"):
        Temperature(-1.0)
    with pytest.raises(ValueError, match="Temperature.t"):
        Temperature(float("nan"))
    with pytest.raises(ValueError, match="top_p"):
        Temperature(1.0, top_p=0.0)
    with pytest.raises(ValueError, match="top_p"):
        Temperature(1.0, top_p=1.5)
    with pytest.raises(ValueError, match="top_p"):
        ReSET(top_p=-0.1)
    with pytest.raises(ValueError, match="top_k"):
        Temperature(1.0, top_k=-1)
    with pytest.raises(ValueError, match="top_k=17"):
        sample(key, z, st, Temperature(1.0, top_k=17))
    with pytest.raises(ValueError, match="t_low"):
        ReSET(t_low=-0.5)
    with pytest.raises(ValueError, match="window"):
        ReSET(window=0)
    with pytest.raises(ValueError, match="tau_0"):
        ReSET(tau_0=float("inf"))
    with pytest.raises(ValueError, match="nl_mask"):
        ReSET(nl_mask=np.zeros(v, np.int32))
    with pytest.raises(ValueError, match="nl_mask is None"):
        sample(key, z, st, ReSET(window=4))
    with pytest.raises(ValueError, match="nl_mask is None"):
        reset_observe(st, jnp.zeros(b, jnp.int32), ReSET(window=4))
    with pytest.raises(ValueError, match=r"dnl_mask must be bool \[16\]"):
        sample(key, z, st, dataclasses.replace(cfg, dnl_mask=jnp.zeros(v + 1, bool)))
    with pytest.raises(ValueError, match="logits"):
        sample(key, z[0], st, cfg)
    with pytest.raises(ValueError, match="logits"):
        sample(key, z[None], st, cfg)
    with pytest.raises(ValueError, match="logits"):
        sample(key, jnp.zeros((b, v), jnp.int32), st, cfg)
    with pytest.raises(ValueError, match="state.ring"):
        sample(key, z, sampler_init(cfg, b + 1), cfg)
    with pytest.raises(ValueError, match="state.ring"):
        sample(key, z, reset_init(b, 5), cfg)
    with pytest.raises(ValueError, match="SamplerState"):
        sample(key, z, None, cfg)
    with pytest.raises(ValueError, match="key"):
        sample(jax.random.split(key, b + 1), z, st, cfg)
    with pytest.raises(ValueError, match="key"):
        sample(jnp.zeros(3, jnp.float32), z, st, cfg)
    with pytest.raises(ValueError, match="sampler"):
        sample(key, z, st, "greedy")
    with pytest.raises(ValueError, match=r"Temperature.t has shape \(3,\)"):
        sample(key, z, st, Temperature(jnp.ones(3)))
    with pytest.raises(ValueError, match="tokens"):
        reset_observe(st, jnp.zeros(b + 1, jnp.int32), cfg)
    with pytest.raises(ValueError, match="batch_size"):
        reset_init(0, 4)
    with pytest.raises(ValueError, match="method"):
        top_p_mask(jnp.ones((1, 2)) / 2, 0.5, "bisect")
    tok, _ = _byte_level_tokenizer()
    with pytest.raises(ValueError, match="vocab_size=10"):
        newline_masks(tok, 10)
    with pytest.raises(ValueError, match="tokenizer"):
        newline_masks(object(), 10)


def test_state_pytree_and_dummy_state():
    st = sampler_init(Temperature(0.6), 3)
    assert isinstance(st, SamplerState) and st.ring.shape == (3, 1)
    assert sampler_init(_reset_cfg(8), 3).ring.shape == (3, 4)
    leaves = jax.tree.leaves(_reset_cfg(8))
    assert len(leaves) == 6  # t_high, t_low, tau_0, masks, top_p: all traced
    _, st2, _ = sample(jax.random.key(0), jnp.zeros((3, 8)), st, Temperature(0.6))
    assert st2 is st
    assert sampling.GREEDY_EPS == 1e-6
