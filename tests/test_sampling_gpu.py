"""GPU tests of the fused sampler kernels (`cuda_ops/sampler.cu`; marker `gpu`).

The kernels compute their own probabilities (summation order differs from XLA's by float
rounding), so they are checked (1) against their NumPy mirror `rejax.ops.sampler.emulate` token
for token on the same keys (agreement except where rounding moves a boundary or a near-tie), (2)
for support: no token outside the float64 nucleus widened by 1e-5 of mass, (3) by chi-square
over >= 1e5 draws against the exact truncated softmax, on the full 151,936-token vocabulary
(`_assert_draws_match`: ids expected < 5 times pooled into one bin, pass at p > 1e-4, fixed
keys), and (4) for row independence, batch 1..64, ReSET decisions and no retrace. Every test
runs for each kernel variant (`rejax.ops.sampler.VARIANTS`: "split", three kernels; "cluster",
one launch, and "merge", split with top-k drawn from per-block candidates), each through
`op.sample_kernel`; `-k cluster` or `-k merge` selects one of those. The default, "auto", runs
"split" or "merge" by the batch rows and top-k (`op.choose_variant`, checked on the CPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_sampling import _assert_draws_match

from cuda_ops.build import device_sms
from rejax import sampling
from rejax.ops import sampler as op
from rejax.sampling import ReSET, Temperature, sample, sampler_init

pytestmark = pytest.mark.gpu

V = 151936
VARIANTS = pytest.mark.parametrize("variant", op.VARIANTS)
GRID = op.kernels.GRID_VARIANTS  # "grid" and "cdf": one launch over a grid of CTAs per row


def _logits(kind: str, b: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((b, V)).astype(np.float32)
    if kind == "peaked":  # a few dominant tokens over an N(0, 1) body
        z[:, :8] = np.arange(8, 0, -1) * 0.5 + 12.0
    elif kind == "ties":  # 24 tokens share the top logit, 24 more the next value
        z = z - 20.0
        z[:, 100:124] = 3.0
        z[:, 5000:5024] = 2.5
    elif kind == "equal":  # every token tied: the cut is by id (the large-bin path)
        z = np.zeros((b, V), np.float32)
    elif kind == "real":  # an LM-like spread: a long tail of small logits
        z = (rng.gumbel(size=(b, V)) * 2.0).astype(np.float32)
    return z


def _nucleus64(z: np.ndarray, t: float, top_p: float, slack: float = 1e-5) -> np.ndarray:
    """float64 probabilities and the tokens whose mass ranked above is < top_p + slack."""
    x = (z.astype(np.float64) - z.max()) / t
    p = np.exp(x) / np.exp(x).sum()
    order = np.lexsort((-np.arange(len(p)), -p))  # rank order: p, then id, descending
    above = np.cumsum(p[order]) - p[order]
    keep = np.zeros(len(p), bool)
    keep[order[above < top_p + slack]] = True
    return p, keep


def _sample_fn(variant: str | None):
    """`sample` (the default, "auto", or the sampler's method) or the op's path with `variant`."""
    if variant is None:
        return sample
    return lambda k, z, s, smp, **kw: op.sample_kernel(k, z, s, smp, variant=variant)


def _run(sampler, z, keys, state=None, method="kernel", variant=None):
    b = z.shape[0]
    state = sampler_init(sampler, b) if state is None else state
    if method == "kernel" and variant is not None:
        fn = jax.jit(op.sample_kernel, static_argnames="variant")
        tok, st, info = fn(keys, jnp.asarray(z), state, sampler, variant=variant)
    else:
        fn = jax.jit(sample, static_argnames="top_p_method")
        tok, st, info = fn(keys, jnp.asarray(z), state, sampler, top_p_method=method)
    return np.asarray(tok), st, info


@VARIANTS
def test_lowered_on_gpu_as_custom_calls(variant):
    smp = Temperature(top_p_method="kernel", t=0.6, top_p=0.95)
    z = jnp.zeros((4, V), jnp.float32)
    run = _sample_fn(variant)
    f = jax.jit(lambda k, z, s: run(k, z, s, smp)[0])
    hlo = f.lower(jax.random.key(0), z, sampler_init(smp, 4)).as_text()
    assert hlo.count("__gpu$xla.gpu.ptx") == len(op.kernels.entries(variant))


def draw_tokens(z: np.ndarray, smp, steps: int, variant: str | None = None) -> np.ndarray:
    """Tokens of `steps` sample calls on the rows of z (keys per row and step from key 11),
    flattened; also used by experiments/sampler_tail_bias.py."""
    b = z.shape[0]
    key = jax.random.key(11)
    run = _sample_fn(variant)

    @jax.jit
    def draws(z):
        def body(s, i):
            ks = jax.random.split(jax.random.fold_in(key, i), b)
            return s, run(ks, z, sampler_init(smp, b), smp)[0]

        return jax.lax.scan(body, 0, jnp.arange(steps))[1]

    return np.asarray(draws(jnp.asarray(z))).ravel()


@pytest.mark.parametrize(
    "kind,t,top_p,top_k",
    [("peaked", 0.6, 0.95, 0), ("real", 1.0, 0.95, 0), ("flat", 0.6, 0.95, 0),
     ("ties", 1.0, 0.5, 0), ("equal", 1.0, 0.3, 0), ("real", 1.0, 1.0, 0), ("real", 0.6, 1e-3, 0),
     ("peaked", 1e-7, 0.95, 0), ("real", 0.6, 0.95, 20), ("real", 1.0, 1.0, 20),
     ("equal", 1.0, 0.5, 20), ("flat", 1.0, 0.9, 3000), ("ties", 1.0, 0.9, 30)],
)  # fmt: skip
@VARIANTS
def test_kernel_matches_emulation_and_nucleus(kind, t, top_p, top_k, variant):
    b = 16
    z = _logits(kind, b, seed=1)
    keys = jax.random.split(jax.random.key(7), b)
    smp = Temperature(top_p_method="kernel", t=t, top_p=top_p, top_k=top_k)
    tok, _, info = _run(smp, z, keys, variant=variant)
    data = np.asarray(jax.random.key_data(keys))
    agree, paths = 0, set()
    plan = op.kernels.plan(b, V, top_k, variant=variant, sms=device_sms())  # the build's plan
    chunks = plan.chunks
    prune = "bound" if plan.variant in (*op.kernels.CLUSTER_VARIANTS, *GRID) else True
    for i in range(b):
        em = op.emulate(z[i], -np.inf, np.inf, t, t, top_p, data[i], top_k=top_k, chunks=chunks,
                        prune=prune, variant=variant)  # fmt: skip
        paths.add(em["path"])
        agree += int(em["tokens"][0] == tok[i])
        if t > 1e-6:  # smaller temperatures are greedy (Temperature's rule)
            _, keep = _nucleus64(_top_k64(z[i], top_k), t, top_p)
            assert keep[tok[i]], (kind, i, tok[i])
        else:
            assert tok[i] == np.argmax(z[i])
    assert agree >= b - 1, (kind, agree, paths)
    np.testing.assert_allclose(np.asarray(info["temperature"]), t)


def _top_k64(z: np.ndarray, k: int) -> np.ndarray:
    return z if not k else np.where(z >= np.sort(z)[::-1][k - 1], z, -np.inf)


@pytest.mark.parametrize(
    "kind,t,top_p,top_k",
    [("peaked", 1.0, 0.95, 0), ("ties", 1.0, 0.5, 0), ("real", 0.6, 0.9, 0),
     ("equal", 1.0, 1e-4, 0), ("peaked", 1.0, 1.0, 0), ("real", 0.6, 0.95, 20),
     ("ties", 1.0, 1.0, 30)],
)  # fmt: skip
@VARIANTS
def test_kernel_distribution_chi_square(kind, t, top_p, top_k, variant):
    b, steps = 64, 1600  # 102,400 draws
    z = np.repeat(_logits(kind, 1, seed=3), b, axis=0)
    smp = Temperature(top_p_method="kernel", t=t, top_p=top_p, top_k=top_k)
    tok = draw_tokens(z, smp, steps, variant)
    # the kernel's float32 probabilities may move the boundary token across the float64 cut:
    # tokens within 1e-6 of mass of it count as kept (drawn with their tiny expected share)
    p, keep = _nucleus64(_top_k64(z[0], top_k), t, top_p, slack=1e-6)
    assert keep[tok].all(), "a token outside the nucleus"
    q = np.where(keep, p, 0)
    # chi-square, rare ids pooled, p > 1e-4; [peaked-1.0-1.0-0] is the far-tail case: ~1.1% of
    # the mass on ~152K tokens each ~1e-7 of the top one, which 23-bit noise drew half as often
    _assert_draws_match(tok, q / q.sum(), f"{kind} t={t} top_p={top_p} top_k={top_k}")


@VARIANTS
def test_rows_independent_and_batch_sizes(variant):
    z = _logits("real", 64, seed=5)
    keys = jax.random.split(jax.random.key(3), 64)
    smp = Temperature(top_p_method="kernel", t=1.0, top_p=0.95)
    full, _, _ = _run(smp, z, keys, variant=variant)
    z2 = z.copy()
    z2[1:] = _logits("peaked", 63, seed=9)  # other rows change; row 0 must not
    other, _, _ = _run(smp, z2, keys, variant=variant)
    assert other[0] == full[0]
    for b in (1, 2, 7, 33):
        sub, _, _ = _run(smp, z[:b], keys[:b], variant=variant)
        # per-chunk rounding may move a boundary (the cluster kernel's chunks do not depend on B)
        exact = variant in op.kernels.CLUSTER_VARIANTS
        assert np.mean(sub == full[:b]) >= (1.0 if exact else 0.9), b


def test_cluster_variant_draws_the_split_tokens():
    # the same noise, bins, keep rule and draw: the same tokens up to the statistics' rounding
    # (8 chunks against the split plan's), on every path the kernels have
    b = 32
    keys = jax.random.split(jax.random.key(5), b)
    for kind, t, top_p, top_k in [("real", 0.6, 0.95, 0), ("flat", 0.6, 0.95, 0),
                                  ("ties", 1.0, 0.5, 0), ("real", 1.0, 1.0, 0),
                                  ("real", 0.6, 1.0, 20), ("flat", 1.0, 0.9, 3000)]:  # fmt: skip
        z = _logits(kind, b, seed=2)
        smp = Temperature(top_p_method="kernel", t=t, top_p=top_p, top_k=top_k)
        a, _, ia = _run(smp, z, keys, variant="split")
        c, _, ic = _run(smp, z, keys, variant="cluster")
        assert np.sum(a == c) >= b - 1, (kind, t, top_p, top_k, np.flatnonzero(a != c))
        np.testing.assert_allclose(np.asarray(ic["entropy"]), np.asarray(ia["entropy"]),
                                   rtol=2e-5, atol=2e-5)  # fmt: skip


def test_reject_variant_draws_the_cluster_tokens():
    # the same kernel with the shortcut: a first draw that passes the keep test is the cluster
    # kernel's token, a rejected one takes that kernel's path, so every token is the same
    masks = {"nl_mask": jnp.zeros(V, bool), "dnl_mask": jnp.zeros(V, bool)}
    for b in (1, 33, 64):
        keys = jax.random.split(jax.random.key(b), b)
        for kind, t, top_p in [
            ("real", 0.6, 0.95),
            ("flat", 0.6, 0.95),
            ("flat", 1.0, 0.5),
            ("ties", 1.0, 0.5),
            ("real", 0.05, 0.9),
            ("real", 1.0, 1.0),
        ]:
            z = _logits(kind, b, seed=3)
            for smp in (
                Temperature(top_p_method="kernel", t=t, top_p=top_p),
                ReSET(top_p_method="kernel", t_high=t, t_low=0.1, top_p=top_p, **masks),
            ):
                c, _, ic = _run(smp, z, keys, variant="cluster")
                r, _, ir = _run(smp, z, keys, variant="reject")
                np.testing.assert_array_equal(r, c, err_msg=f"{b} {kind} {smp}")
                np.testing.assert_array_equal(np.asarray(ir["entropy"]), np.asarray(ic["entropy"]))


def test_grid_variant_draws_the_reject_tokens():
    # the same noise, keep rule and kept-set draw (a rejected first draw climbs the rank order
    # to the best kept score, the token the histogram path finds), on statistics summed over
    # the grid's chunks instead of 8: the same tokens up to that rounding. "flat" at top-p 0.5
    # and "ties" reject often; "equal" at top-p 1e-4 climbs many rounds (the cut by id).
    masks = {"nl_mask": jnp.zeros(V, bool), "dnl_mask": jnp.zeros(V, bool)}
    differ = 0
    for b in (1, 8, 33, 64):
        keys = jax.random.split(jax.random.key(b), b)
        for kind, t, top_p in [
            ("real", 0.6, 0.95),
            ("flat", 0.6, 0.95),
            ("flat", 1.0, 0.5),
            ("ties", 1.0, 0.5),
            ("equal", 1.0, 1e-4),
            ("real", 0.05, 0.9),
            ("real", 1.0, 1.0),
        ]:
            z = _logits(kind, b, seed=3)
            for smp in (
                Temperature(top_p_method="kernel", t=t, top_p=top_p),
                ReSET(top_p_method="kernel", t_high=t, t_low=0.1, top_p=top_p, **masks),
            ):
                r, _, ir = _run(smp, z, keys, variant="reject")
                g, _, ig = _run(smp, z, keys, variant="grid")
                # at most one row per call (and one in all the one-row calls) moves
                differ += int(np.sum(g != r)) if b == 1 else 0
                assert np.sum(g == r) >= b - 1 and differ <= 1, (
                    b,
                    kind,
                    smp,
                    np.flatnonzero(g != r),
                )
                np.testing.assert_allclose(np.asarray(ig["entropy"]), np.asarray(ir["entropy"]),
                                           rtol=2e-5, atol=2e-5)  # fmt: skip
                np.testing.assert_array_equal(np.asarray(ig["temperature"]),
                                              np.asarray(ir["temperature"]))  # fmt: skip


@pytest.mark.parametrize(
    "variant,top_k",
    [("split", 0), ("merge", 20), ("cluster", 0), ("reject", 0), ("grid", 20), ("cdf", 0),
     ("grid-state", 0), ("cdf-state", 0)],
)  # fmt: skip
def test_bfloat16_logits_draw_as_their_float32_values(variant, top_k):
    # bfloat16 logits are read as their exact float32 values: tokens, entropies and
    # temperatures equal those of the same logits cast to float32, bit for bit, at 3 rows and
    # 64 (two launch plans), for Temperature and for ReSET (with its state in the launch on
    # the state variants); every kernel's loads (vector, scalar, each variant's paths)
    for b in (3, 64):
        z = jnp.asarray(_logits("real", b, seed=9)).astype(jnp.bfloat16)
        keys = jax.random.split(jax.random.key(3), b)
        smps = [Temperature(top_p_method="kernel", t=0.6, top_p=0.95, top_k=top_k)]
        if top_k == 0:
            smps.append(ReSET(top_p_method="kernel", top_p=0.95, nl_mask=jnp.zeros(V, bool),
                              dnl_mask=jnp.zeros(V, bool).at[7].set(True)))  # fmt: skip
        for smp in smps:
            state = sampler_init(smp, b)
            fn = jax.jit(op.sample_kernel, static_argnames="variant")
            t16, s16, i16 = fn(keys, z, state, smp, variant=variant)
            t32, s32, i32 = fn(keys, z.astype(jnp.float32), state, smp, variant=variant)
            hlo = fn.lower(keys, z, state, smp, variant=variant).as_text()
            # the kernels read the bf16 logits: no f32 copy of them
            assert "xla.gpu.ptx" in hlo and f"tensor<{b}x{V}xf32>" not in hlo
            np.testing.assert_array_equal(np.asarray(t16), np.asarray(t32), (b, smp))
            for k in ("entropy", "temperature"):
                np.testing.assert_array_equal(np.asarray(i16[k]), np.asarray(i32[k]), k)
            for a, c in zip(jax.tree.leaves(s16), jax.tree.leaves(s32), strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


@pytest.mark.parametrize("draw", GRID)
def test_grid_state_kernel_updates_reset_state_as_xla_does(draw):
    # "kernel-grid-state": the grid kernel also writes ReSET's new state (ring, counts, sums,
    # the step boundary from the newline masks, y1 / y2). Tokens, entropies and every state
    # array equal "kernel-grid"'s (the same draw, the update in XLA) bit for bit, step by step;
    # the newline tokens are near the top, so that some steps end and others go on
    import dataclasses

    from rejax.sampling import SamplerState

    nl = jnp.zeros(V, bool).at[:10].set(True)
    dnl = jnp.zeros(V, bool).at[10:15].set(True)
    for b in (1, 8, 64):
        z = _logits("real", b, seed=6)
        z[:, :15] = z.max(axis=1, keepdims=True) + np.linspace(0.0, -1.0, 15, dtype=np.float32)
        smp = ReSET(top_p_method=f"kernel-{draw}-state", t_high=1.0, t_low=0.3, tau_0=3.0,
                    window=8, top_p=0.9, nl_mask=nl, dnl_mask=dnl)  # fmt: skip
        ref = dataclasses.replace(smp, top_p_method=f"kernel-{draw}")
        step = jax.jit(sample)
        sa, sb, ends = sampler_init(smp, b), sampler_init(ref, b), 0
        steps = 24
        for i in range(steps):
            zi = jnp.asarray(np.roll(z, i, axis=0))
            ta, sa, ia = step(jax.random.key(i), zi, sa, smp)
            tb, sb, ib = step(jax.random.key(i), zi, sb, ref)
            np.testing.assert_array_equal(np.asarray(ta), np.asarray(tb), f"b={b} step {i}")
            np.testing.assert_array_equal(np.asarray(ia["entropy"]), np.asarray(ib["entropy"]))
            for f in dataclasses.fields(SamplerState):
                np.testing.assert_array_equal(np.asarray(getattr(sa, f.name)),
                                              np.asarray(getattr(sb, f.name)), f.name)  # fmt: skip
            ends += int((np.asarray(sa.s_n) == 0).sum())
        assert 0 < ends < steps * b, ends  # steps ended, and steps went on


@pytest.mark.parametrize("draw", GRID)
def test_grid_state_kernel_in_a_scan_matches_the_xla_update(draw):
    # inside a jitted scan the state is a loop carry, which the op updates in place (its state
    # operands alias its results): the tokens and the final state equal "kernel-grid"'s
    import dataclasses

    from rejax.sampling import SamplerState

    b, steps = 8, 32
    nl = jnp.zeros(V, bool).at[:10].set(True)
    dnl = jnp.zeros(V, bool).at[10:15].set(True)
    z = _logits("real", b, seed=7)
    z[:, :15] = z.max(axis=1, keepdims=True) + np.linspace(0.0, -1.0, 15, dtype=np.float32)
    z = jnp.asarray(z)
    smp = ReSET(top_p_method=f"kernel-{draw}-state", t_high=1.0, t_low=0.3, tau_0=3.0,
                window=8, top_p=0.9, nl_mask=nl, dnl_mask=dnl)  # fmt: skip

    def run(s):
        def body(state, i):
            tok, state, _ = sample(jax.random.fold_in(jax.random.key(0), i),
                                   jnp.roll(z, i, axis=0), state, s)  # fmt: skip
            return state, tok

        return jax.jit(lambda: jax.lax.scan(body, sampler_init(s, b), jnp.arange(steps)))()

    sa, ta = run(smp)
    sb, tb = run(dataclasses.replace(smp, top_p_method=f"kernel-{draw}"))
    np.testing.assert_array_equal(np.asarray(ta), np.asarray(tb))
    for f in dataclasses.fields(SamplerState):
        np.testing.assert_array_equal(np.asarray(getattr(sa, f.name)),
                                      np.asarray(getattr(sb, f.name)), f.name)  # fmt: skip
    assert int(np.asarray(sa.g_n).min()) == steps


@pytest.mark.parametrize("variant", GRID)
@pytest.mark.parametrize("top_k", [0, 20])
def test_grid_variant_repeats_its_bits_launch_after_launch(top_k, variant):
    # the barrier counters (and top-k's list length) are cleared by each row's last CTA: many
    # launches in one jitted loop (a stale counter would let a CTA pass a barrier early, or
    # hang, or list past the row's tokens) give the same tokens
    b = 8
    z = jnp.asarray(_logits("flat", b, seed=4))
    keys = jax.random.split(jax.random.key(9), b)
    smp = Temperature(top_p_method="kernel", t=1.0, top_p=0.5, top_k=top_k)
    state = sampler_init(smp, b)

    @jax.jit
    def many(z):
        def body(c, i):
            return c, op.sample_kernel(keys, z + 0.0 * i, state, smp, variant=variant)[0]

        return jax.lax.scan(body, 0, jnp.arange(64, dtype=jnp.float32))[1]

    toks = np.asarray(many(z))
    assert (toks == toks[0]).all()
    one, _, _ = _run(smp, np.asarray(z), keys, variant=variant)
    np.testing.assert_array_equal(toks[0], one)


def test_merge_variant_draws_the_split_tokens():
    # the same kept sets and draws, so the same tokens bit for bit ("grid" with top-k too: its
    # list of the tokens at or above the k-th largest published thread max, "front" putting
    # 25 of the top tokens in one CTA; the "equal" logits overflow the list). Top-k from the
    # chunks' candidates (k <= 32), and its fallbacks (a chunk with more than 64 candidates: "equal"
    # logits; k > 32). Top-p with a split boundary bin ranked by sub-bins ("flat", "real",
    # "ties"), the sort again when the boundary sub-bin holds more than 32 tokens ("tie40": 40
    # equal tokens), and the large-bin path ("equal"). At a batch of 1 (128 chunks a row) and
    # of 32.
    for b in (1, 32):
        keys = jax.random.split(jax.random.key(7), b)
        for kind, t, top_p, top_k in [("real", 0.6, 1.0, 20), ("flat", 0.6, 0.95, 20),
                                      ("ties", 1.0, 0.5, 20), ("ties", 1.0, 1.0, 30),
                                      ("equal", 1.0, 0.9, 20), ("real", 1.0, 0.9, 1),
                                      ("real", 0.6, 0.95, 40), ("real", 0.6, 0.95, 0),
                                      ("front", 1.0, 0.9, 20), ("flat", 0.6, 0.95, 0),
                                      ("ties", 1.0, 0.5, 0), ("tie40", 1.0, 0.5, 0),
                                      ("equal", 1.0, 0.9, 0), ("real", 1.0, 0.9, 0)]:  # fmt: skip
            z = _logits({"front": "real", "tie40": "ties"}.get(kind, kind), b, seed=3)
            if kind == "front":  # the top 25 in the first chunk: its k-th largest is the row's
                z[:, :25] = 30.0 + np.arange(25, dtype=np.float32) * 0.05
            if kind == "tie40":  # 40 tokens share the top logit (one key, one sub-bin)
                z[:, 100:140] = 3.0
            smp = Temperature(top_p_method="kernel", t=t, top_p=top_p, top_k=top_k)
            a, _, _ = _run(smp, z, keys, variant="split")
            m, _, _ = _run(smp, z, keys, variant="merge")
            assert np.array_equal(a, m), (b, kind, t, top_p, top_k, np.flatnonzero(a != m))
            if top_k:  # "grid" lists a superset of the top-k set and cuts it as "split" does
                g, _, _ = _run(smp, z, keys, variant="grid")
                assert np.array_equal(a, g), (b, kind, t, top_p, top_k, np.flatnonzero(a != g))


def test_default_auto_runs_the_variant_it_chooses():
    # `sample` with the default variant ("auto") lowers to the kernels of the variant
    # `choose_variant` names for the batch rows and top-k, and draws that variant's tokens:
    # cdf for top-p alone, grid for top-k up to GRID_TOPK_MAX_K; above it split below
    # MERGE_MIN_ROWS_TOPK rows, merge from there on (k <= MERGE_MAX_K), split for a larger k.
    assert op.VARIANT == "auto"
    for b in (1, 8, op.MERGE_MIN_ROWS_TOPK, 64):
        keys = jax.random.split(jax.random.key(5), b)
        z = _logits("real", b, seed=4)
        for smp in (Temperature(top_p_method="kernel", t=0.6, top_p=0.95),
                    Temperature(top_p_method="kernel", t=0.6, top_p=0.95, top_k=20),
                    Temperature(top_p_method="kernel", t=0.6, top_p=0.95, top_k=32),
                    Temperature(top_p_method="kernel", t=0.6, top_p=0.95, top_k=65),
                    ReSET(top_p_method="kernel", top_p=0.95, nl_mask=jnp.zeros(V, bool),
                          dnl_mask=jnp.zeros(V, bool).at[7].set(True))):  # fmt: skip
            chosen = op.choose_variant("auto", b, getattr(smp, "top_k", 0))
            f = jax.jit(lambda k, z, s, smp=smp: sample(k, z, s, smp)[0])
            hlo = f.lower(keys, jnp.asarray(z), sampler_init(smp, b)).as_text()
            assert hlo.count("__gpu$xla.gpu.ptx") == len(op.kernels.entries(chosen)), (b, smp)
            auto, _, _ = _run(smp, z, keys)
            ref, _, _ = _run(smp, z, keys, variant=chosen)
            assert np.array_equal(auto, ref), (b, smp, chosen, np.flatnonzero(auto != ref))


@pytest.mark.parametrize("variant", GRID)
@pytest.mark.parametrize("v", [10, 1001, 4099, 151937])
def test_grid_variant_small_and_odd_vocabularies_and_masked_rows(v, variant):
    # scalar loads (V % 4 != 0), one CTA a row (V <= 1024) or several; rows of -inf logits but
    # a few (a masked vocabulary); kept tokens only, and the emulation's tokens with the grid's
    # own chunks
    b = 5
    rng = np.random.default_rng(v)
    z = (rng.standard_normal((b, v)) * 2).astype(np.float32)
    z[1, : v - 3] = -np.inf  # three live tokens
    keys = jax.random.split(jax.random.key(v), b)
    data = np.asarray(jax.random.key_data(keys))
    plan = op.kernels.plan(b, v, 0, variant=variant, sms=device_sms())
    differ = []
    for t, top_p in [(1.0, 0.9), (0.6, 1.0), (1.0, 0.3)]:
        smp = Temperature(top_p_method="kernel", t=t, top_p=top_p)
        tok, _, _ = _run(smp, z, keys, variant=variant)
        for i in range(b):
            em = op.emulate(z[i], -np.inf, np.inf, t, t, top_p, data[i], chunks=plan.chunks,
                            prune="bound", variant=variant)  # fmt: skip
            _, keep = _nucleus64(z[i], t, top_p)
            assert keep[tok[i]], (v, t, top_p, i)
            if em["tokens"][0] != tok[i]:  # float rounding may move a boundary, rarely
                differ.append((t, top_p, i))
    assert len(differ) <= 1, differ


@pytest.mark.parametrize("v", [10, 1001, 4099])
def test_cluster_variant_small_and_odd_vocabularies(v):
    # scalar loads (V % 4 != 0), and empty chunks (V < 4 x 8): kept tokens only, and the
    # emulation's tokens
    b = 5
    rng = np.random.default_rng(v)
    z = (rng.standard_normal((b, v)) * 2).astype(np.float32)
    keys = jax.random.split(jax.random.key(v), b)
    data = np.asarray(jax.random.key_data(keys))
    differ = []
    for t, top_p, top_k in [(1.0, 0.9, 0), (0.6, 1.0, 0), (1.0, 0.8, 3)]:
        smp = Temperature(top_p_method="kernel", t=t, top_p=top_p, top_k=top_k)
        tok, _, _ = _run(smp, z, keys, variant="cluster")
        for i in range(b):
            em = op.emulate(z[i], -np.inf, np.inf, t, t, top_p, data[i], top_k=top_k,
                            prune="bound", variant="cluster")  # fmt: skip
            _, keep = _nucleus64(_top_k64(z[i], top_k), t, top_p)
            assert keep[tok[i]], (v, t, top_p, top_k, i)
            if em["tokens"][0] != tok[i]:  # float rounding may move a boundary, rarely
                differ.append((t, top_p, top_k, i))
    assert len(differ) <= 1, differ


@VARIANTS
def test_no_retrace_in_a_decode_loop(variant):
    traces = []
    smp = ReSET(top_p_method="kernel", t_high=1.0, t_low=0.1, top_p=0.95, nl_mask=jnp.zeros(V, bool),
                dnl_mask=jnp.zeros(V, bool))  # fmt: skip
    run = _sample_fn(variant)

    @jax.jit
    def step(key, z, state, i):
        traces.append(1)
        return run(jax.random.split(jax.random.fold_in(key, i), 4), z, state, smp)

    state = sampler_init(smp, 4)
    z = jnp.asarray(_logits("real", 4))
    for i in range(3):
        _, state, _ = step(jax.random.key(0), z, state, i)
    assert len(traces) == 1


@VARIANTS
def test_reset_decisions_match_reference_on_device(variant):
    b, n = 8, 40
    smp = ReSET(top_p_method="kernel", t_high=1.0, t_low=0.1, top_p=0.95, nl_mask=jnp.zeros(V, bool),
                dnl_mask=jnp.zeros(V, bool).at[7].set(True))  # fmt: skip
    rng = np.random.default_rng(0)
    sk = sampler_init(smp, b)
    fn = jax.jit(sample, static_argnames="top_p_method")
    fk = jax.jit(_sample_fn(variant))
    for i in range(n):
        scale = rng.uniform(0.5, 4.0, size=(b, 1)).astype(np.float32)
        z = jnp.asarray(_logits("real", b, seed=i) * scale)
        keys = jax.random.split(jax.random.key(i), b)
        _, sk_new, ik = fk(keys, z, sk, smp)
        _, _, ir = fn(keys, z, sk, smp, top_p_method="radix")  # the same state in
        hk, hr = np.asarray(ik["entropy"]), np.asarray(ir["entropy"])
        np.testing.assert_allclose(hk, hr, rtol=2e-5, atol=2e-5)
        thr, alt = (np.asarray(x) for x in sampling._policy_threshold(sk, smp))
        clear = (np.abs(hr - thr) > 1e-4) & (np.abs(hr - alt) > 1e-4)
        tk_t, tr_t = np.asarray(ik["temperature"]), np.asarray(ir["temperature"])
        np.testing.assert_array_equal(tk_t[clear], tr_t[clear])
        sk = sk_new


def _scan_draws(z, keys, state, smp, step, fold_before: bool):
    """4 steps of `sample` on rolled logits: with step=step + i, or on keys folded before."""
    axis = None if step.ndim == 0 else 0

    def body(st, i):
        zi = jnp.roll(z, i, axis=1)
        if fold_before:
            ki = jax.vmap(jax.random.fold_in, in_axes=(0, axis))(keys, step + i)
            tok, st, info = sample(ki, zi, st, smp)
        else:
            tok, st, info = sample(keys, zi, st, smp, step=step + i)
        return st, (tok, info["entropy"], info["temperature"])

    return jax.lax.scan(body, state, jnp.arange(4))


@pytest.mark.parametrize(
    ("method", "top_k"),
    [("kernel-cdf", 0), ("kernel-grid", 0), ("kernel-grid", 20), ("kernel-split", 0),
     ("kernel-cdf-state", 0), ("kernel-grid-state", 0)],
)  # fmt: skip
def test_the_kernels_fold_the_step_as_xla_does(method, top_k):
    # sample(..., step=s): "grid" / "cdf" (and their ReSET state builds) fold s into the row keys
    # in the launch (threefry_fold_in), "split" in XLA first: every token, entropy, temperature
    # and state word equals the call on keys folded before it (jax.random.fold_in), for a shared
    # step and a step a row, at 1 and 64 rows, over a scan's steps; and the compiled program
    # holds no threefry ops for "grid" / "cdf" (they are named in it when XLA folds)
    nl = jnp.zeros(V, bool).at[:10].set(True)
    dnl = jnp.zeros(V, bool).at[10:15].set(True)
    if method.endswith("-state"):
        smp = ReSET(top_p_method=method, t_high=1.0, t_low=0.3, tau_0=3.0, window=8, top_p=0.9,
                    nl_mask=nl, dnl_mask=dnl)  # fmt: skip
    else:
        smp = Temperature(top_p_method=method, t=1.0, top_p=0.9, top_k=top_k)
    scan = jax.jit(_scan_draws, static_argnames="fold_before")
    one = jax.jit(lambda z, k, s, step: sample(k, z, s, smp, step=step))
    for b in (1, 64):
        z = _logits("real", b, seed=8)
        z[:, :15] = z.max(axis=1, keepdims=True) + np.linspace(0.0, -1.0, 15, dtype=np.float32)
        z = jnp.asarray(z, jnp.bfloat16)
        keys = jax.random.split(jax.random.key(5), b)
        st0 = sampler_init(smp, b)
        for step in (jnp.int32(12345), jnp.arange(b, dtype=jnp.int32) * 7 + 1):
            got = scan(z, keys, st0, smp, step, False)
            want = scan(z, keys, st0, smp, step, True)
            for a, c in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(c), f"b={b} {step}")
            if b == 64:  # not a constant: another step moves some draws
                t0, t1 = one(z, keys, st0, step)[0], one(z, keys, st0, step + 1)[0]
                assert (np.asarray(t0) != np.asarray(t1)).any()
        inside = one.lower(z, keys, st0, jnp.int32(3)).compile().as_text().lower()
        before = jax.jit(lambda z, k, s: sample(k, z, s, smp)).lower(
            z, jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, 3), st0
        )  # the keys folded outside: no fold in this program either
        fold = jax.jit(lambda k: jax.vmap(jax.random.fold_in, in_axes=(0, None))(k, 3))
        assert "threefry" in fold.lower(keys).compile().as_text().lower()  # named when XLA folds
        assert ("threefry" in inside) == (method == "kernel-split"), (b, method)
        assert "threefry" not in before.compile().as_text().lower()
