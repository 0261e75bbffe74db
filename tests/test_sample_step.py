"""`rejax.sampling.sample(..., step=s)`: row r draws with fold_in(key[r], s[r]).

The decode loops pass their step this way instead of folding it into the keys themselves, so
that the grid sampler kernels ("grid", "cdf" and their ReSET state builds) fold it in their
launch (sampler.cu's `threefry_fold_in`) and the loop runs no XLA kernel for the fold. Here,
without a GPU: the fold's NumPy mirror equals jax.random.fold_in; every method draws the same
tokens, entropies, temperatures and ReSET state as on keys folded before the call (the ops'
references fold in XLA), under jit and vmap; a bad step is refused by name; the decode loops
hand the step to the sampler op and fold nothing themselves; the kernel plans count the step
operand and their builds do not spill. The GPU test (`test_sampling_gpu.py`,
`test_the_kernels_fold_the_step_as_xla_does`) checks the kernels' fold bit for bit."""

from __future__ import annotations

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
import pytest

from cuda_ops import sampler as kernels
from rejax import params as rparams
from rejax import sampling
from rejax.cache import init_cache
from rejax.config import Config
from rejax.decode import decode_loop
from rejax.ops import sampler as op
from rejax.slots import decode_chunk, init_slots

B, V = 4, 300


def _samplers(v=V):
    nl = jnp.zeros((v,), bool).at[:3].set(True)
    dnl = jnp.zeros((v,), bool).at[3:5].set(True)
    return [
        sampling.Temperature(t=0.6, top_p=0.95),
        sampling.Temperature(t=0.8, top_k=20),
        sampling.ReSET(t_high=1.0, t_low=0.3, tau_0=0.5, nl_mask=nl, dnl_mask=dnl),
        sampling.Greedy(),
    ]


def test_the_kernels_fold_mirror_is_jax_fold_in():
    keys = jax.random.split(jax.random.key(3), 64)
    data = np.asarray(jax.random.key_data(keys))
    for step in (0, 1, 5, 2**31 - 1, -1, -123456):
        want = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, jnp.int32(step))
        got = op.threefry_fold_in(data[:, 0], data[:, 1], step)
        np.testing.assert_array_equal(np.stack(got, 1), jax.random.key_data(want), str(step))
    per_row = np.arange(64, dtype=np.int32) * 1000003
    want = jax.vmap(jax.random.fold_in)(keys, jnp.asarray(per_row))
    got = op.threefry_fold_in(data[:, 0], data[:, 1], per_row)
    np.testing.assert_array_equal(np.stack(got, 1), jax.random.key_data(want))


def _assert_same(a, b, what):
    """Tokens, decisions and integer state bit for bit; float leaves (entropies, temperatures,
    the ReSET ring) within a few float32 ulps: XLA may order an entropy's reduction differently in
    two programs (on the GPU it did, by one ulp), which the step's fold cannot cause."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, (what, x.dtype, y.dtype)
        if np.issubdtype(x.dtype, np.floating):
            np.testing.assert_allclose(x, y, rtol=2.5e-7, atol=0, err_msg=what)
        else:
            np.testing.assert_array_equal(x, y, what)


@pytest.mark.parametrize("method", [None, "radix", "topk", "sort", "kernel"])
@pytest.mark.parametrize("smp", _samplers(), ids=["temp", "topk20", "reset", "greedy"])
def test_step_draws_as_keys_folded_before(smp, method):
    if method == "kernel" and isinstance(smp, sampling.ReSET):
        method = "kernel-cdf-state"  # the op with ReSET's state update (its reference here)
    logits = jax.random.normal(jax.random.key(1), (B, V)) * 3.0
    keys = jax.random.split(jax.random.key(0), B)
    state = sampling.sampler_init(smp, B)
    run = jax.jit(lambda k, s, step: sampling.sample(k, logits, s, smp, top_p_method=method,
                                                     step=step))  # fmt: skip
    seen = set()
    for step in (jnp.int32(7), jnp.uint32(8), jnp.arange(B, dtype=jnp.int32) * 5 + 3, 9):
        step_arr = jnp.asarray(step)
        axis = None if step_arr.ndim == 0 else 0
        folded = jax.vmap(jax.random.fold_in, in_axes=(0, axis))(keys, step_arr)
        want = jax.jit(lambda k, s: sampling.sample(k, logits, s, smp, top_p_method=method))(
            folded, state
        )
        got = run(keys, state, step_arr)
        _assert_same(got, want, f"step {step}")
        seen.add(tuple(np.asarray(got[0])))
    if not isinstance(smp, sampling.Greedy):
        assert len(seen) > 1  # the step moves the draws


def test_a_single_key_split_per_row_then_folded():
    smp = sampling.Temperature(t=1.0)
    logits = jnp.zeros((B, V))
    key = jax.random.key(4)
    got = sampling.sample(key, logits, sampling.sampler_init(smp, B), smp, step=3)
    rows = jax.vmap(jax.random.fold_in, in_axes=(0, None))(jax.random.split(key, B), 3)
    want = sampling.sample(rows, logits, sampling.sampler_init(smp, B), smp)
    _assert_same(got, want, "split then fold")


def test_the_ops_under_vmap_fold_a_shared_or_batched_step():
    n = 3
    logits = jax.random.normal(jax.random.key(2), (n, B, V)) * 2.0
    keys = jax.random.split(jax.random.key(6), (n, B))
    ones = jnp.ones((n, B), jnp.float32)
    inf = jnp.full((n, B), jnp.inf)

    def draw(z, k, step):
        return op.sample_top_p(z, -inf[0], inf[0], ones[0] * 0.7, ones[0] * 0.7, ones[0] * 0.9,
                               k, kind="temperature", step=step)  # fmt: skip

    def draw_folded(z, k, step):
        k = jax.vmap(jax.random.fold_in, in_axes=(0, None if step.ndim == 0 else 0))(k, step)
        return op.sample_top_p(z, -inf[0], inf[0], ones[0] * 0.7, ones[0] * 0.7, ones[0] * 0.9,
                               k, kind="temperature")  # fmt: skip

    shared = jnp.int32(11)
    _assert_same(jax.vmap(draw, in_axes=(0, 0, None))(logits, keys, shared),
                 jax.vmap(draw_folded, in_axes=(0, 0, None))(logits, keys, shared), "shared")  # fmt: skip
    per = jnp.arange(n * B, dtype=jnp.int32).reshape(n, B)
    _assert_same(
        jax.vmap(draw)(logits, keys, per), jax.vmap(draw_folded)(logits, keys, per), "rows"
    )
    one_key = keys[0]
    _assert_same(jax.vmap(draw, in_axes=(0, None, 0))(logits, one_key, per),
                 jax.vmap(draw_folded, in_axes=(0, None, 0))(logits, one_key, per), "keys shared")  # fmt: skip


def test_the_reset_op_under_vmap_folds_the_step():
    n = 2
    smp = _samplers()[2]
    logits = jax.random.normal(jax.random.key(2), (n, B, V)) * 2.0
    keys = jax.random.split(jax.random.key(6), (n, B))
    state = jax.tree.map(lambda x: jnp.stack([x] * n), sampling.sampler_init(smp, B))
    per = jnp.arange(n * B, dtype=jnp.int32).reshape(n, B) + 1

    def draw(z, k, s, step):
        return sampling.sample(k, z, s, smp, top_p_method="kernel-cdf-state", step=step)

    def draw_folded(z, k, s, step):
        k = jax.vmap(jax.random.fold_in)(k, step)
        return sampling.sample(k, z, s, smp, top_p_method="kernel-cdf-state")

    _assert_same(jax.vmap(draw)(logits, keys, state, per),
                 jax.vmap(draw_folded)(logits, keys, state, per), "reset rows")  # fmt: skip


@pytest.mark.parametrize(
    ("step", "match"),
    [(jnp.float32(1.0), r"step must be an int .* got float32\[\]"),
     (jnp.arange(B + 1), rf"step must be an int .*shape \[B={B}\], got int32\[{B + 1}\]"),
     (jnp.zeros((B, 1), jnp.int32), r"got int32\[4, 1\]"),
     (jnp.array(True), r"got bool\[\]")],
)  # fmt: skip
def test_a_bad_step_is_refused_by_name(step, match):
    smp = sampling.Temperature(t=0.6)
    with pytest.raises(ValueError, match=match):
        sampling.sample(jax.random.key(0), jnp.zeros((B, V)), sampling.sampler_init(smp, B),
                        smp, step=step)  # fmt: skip


# ---------------------------------------------------------------- the decode loops

CFG = Config(num_layers=1, head_dim=32)
FOLDS = ("random_fold_in", "threefry2x32", "random_bits")


def _loop_ops(jaxpr, found, in_loop=False):
    # (sampler op params and operand count, fold primitives) inside while loops
    for e in jaxpr.eqns:
        name = e.primitive.name
        if in_loop and name.startswith("rejax_sample"):
            found["ops"].append((name, e.params.get("fold_step"), len(e.invars)))
        if in_loop and name in FOLDS:
            found["folds"].append(name)
        for p in e.params.values():
            for s in p if isinstance(p, (list, tuple)) else [p]:
                j = s.jaxpr if isinstance(s, jcore.ClosedJaxpr) else s
                if isinstance(j, jcore.Jaxpr):
                    _loop_ops(j, found, in_loop or name == "while")
    return found


def _check_loop(found):
    assert found["ops"], "no sampler op inside the loop"
    for name, fold_step, n in found["ops"]:
        assert fold_step, (name, fold_step)
        assert n == (8 if name == "rejax_sample_top_p" else 19), (name, n)
    assert not found["folds"], found["folds"]


@pytest.mark.parametrize("smp", _samplers(CFG.vocab_size)[:3], ids=["temp", "topk20", "reset"])
def test_decode_loop_hands_its_step_to_the_sampler_op(smp):
    b = 3
    params = rparams.init_params(CFG, 0, jnp.bfloat16)
    args = (
        params,
        jnp.zeros((b, CFG.vocab_size), jnp.bfloat16),
        init_cache(CFG, b, 8, jnp.bfloat16),
        jnp.zeros((b,), jnp.int32),
        smp,
        sampling.sampler_init(smp, b),
        jax.random.split(jax.random.key(0), b),
        jnp.zeros((CFG.vocab_size,), bool),
        jnp.zeros((b,), bool),
    )
    traced = decode_loop.trace(*args, max_new_tokens=4)
    _check_loop(_loop_ops(traced.jaxpr.jaxpr, {"ops": [], "folds": []}))


@pytest.mark.parametrize("smp", _samplers(CFG.vocab_size)[:3], ids=["temp", "topk20", "reset"])
def test_slot_decode_chunk_hands_its_steps_to_the_sampler_op(smp):
    b = 3
    params = rparams.init_params(CFG, 0, jnp.bfloat16)
    state = init_slots(params, b, 16, 4, smp)
    stop = jnp.zeros((CFG.vocab_size,), bool)
    traced = decode_chunk.trace(params, state, smp, stop, jnp.int32(b), jnp.int32(4))
    _check_loop(_loop_ops(traced.jaxpr.jaxpr, {"ops": [], "folds": []}))


# ---------------------------------------------------------------- the kernels' plans


def test_plans_count_the_step_operand_and_refuse_other_variants():
    p = kernels.plan(64, 151936, 0, variant="cdf", window=16, step_rows=64)
    assert p.defines()["FOLD_STEP"] == 1 and p.defines()["STEP_ROWS"] == 64
    assert kernels.entries("cdf", 0, 16, 64) == {"rejax_sample_grid": (19, 12)}
    assert kernels.entries("grid", 20, 0, 1) == {"rejax_sample_grid": (8, 3)}
    assert kernels.entries("grid") == {"rejax_sample_grid": (7, 3)}
    assert "FOLD_STEP" not in kernels.plan(64, 151936, 0, variant="cdf").defines()
    with pytest.raises(ValueError, match=r"step_rows=1 .* needs variant 'grid' or 'cdf'"):
        kernels.plan(8, 1000, 0, variant="split", step_rows=1)
    with pytest.raises(ValueError, match=r"step_rows=3 .* 1 or batch=8 rows"):
        kernels.plan(8, 1000, 0, variant="grid", step_rows=3)
    with pytest.raises(ValueError, match=r"step_rows=-1, expected an int >= 0"):
        kernels.build(8, 1000, 0, variant="grid", step_rows=-1, sms=132, arch="compute_90")


@pytest.mark.parametrize(
    ("variant", "b", "top_k", "window", "rows"),
    [("cdf", 1, 0, 0, 1), ("cdf", 64, 0, 16, 1), ("cdf", 64, 0, 16, 64), ("grid", 8, 0, 0, 8),
     ("grid", 64, 20, 0, 1)],
)  # fmt: skip
def test_the_folding_builds_keep_their_registers(variant, b, top_k, window, rows):
    pytest.importorskip("cuda.bindings.nvrtc")
    import re

    from cuda_ops.build import ptxas_log, read_source

    def regs(step_rows):
        p = kernels.plan(b, 151936, top_k, variant=variant, window=window, bf16=True,
                         step_rows=step_rows)  # fmt: skip
        log = ptxas_log(read_source(kernels.SOURCE), p.defines(), name=kernels.SOURCE)
        if "ptxas info" not in log:  # the GPU machine's NVRTC logged only its warnings
            pytest.skip("this NVRTC's log carries no ptxas -v report")
        assert re.search(r"\b0 bytes spill stores, 0 bytes spill loads", log), log
        return int(re.search(r"Used (\d+) registers", log).group(1))

    ctas = kernels.GRID_TOPK_CTAS_PER_SM if top_k else kernels.GRID_CTAS_PER_SM
    assert regs(rows) * kernels.GRID_THREADS * ctas <= 65536
    assert regs(rows) <= regs(0)


def test_the_experiments_switch_folds_in_the_loop_again(monkeypatch):
    # experiments/loop_fold_off.py (the A/B baseline) must restore the fold before the op, or
    # its timing compares the change with itself
    import importlib
    import pathlib
    import sys

    from rejax import decode, slots

    monkeypatch.setattr(decode, "sample", decode.sample)
    monkeypatch.setattr(slots, "sample", slots.sample)
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[1] / "experiments"))
    off = importlib.import_module("loop_fold_off")
    off.turn_off()
    jax.clear_caches()  # traces made with the switch on
    smp = _samplers(CFG.vocab_size)[0]
    params = rparams.init_params(CFG, 0, jnp.bfloat16)
    state = init_slots(params, 3, 16, 4, smp)
    stop = jnp.zeros((CFG.vocab_size,), bool)
    traced = decode_chunk.trace(params, state, smp, stop, jnp.int32(3), jnp.int32(4))
    found = _loop_ops(traced.jaxpr.jaxpr, {"ops": [], "folds": []})
    sys.modules.pop("loop_fold_off")
    jax.clear_caches()
    assert found["folds"] and all(not f for _, f, _ in found["ops"]), found


def test_a_build_checks_its_entry_takes_every_operand(monkeypatch):
    pytest.importorskip("cuda.bindings.nvrtc")
    kern = kernels.build(8, 1000, 0, variant="cdf", step_rows=8, sms=132, arch="compute_90")
    assert kern.plan.step_rows == 8 and "FOLD_STEP" in kern.plan.defines()
    kernels._build_cached.cache_clear()
    monkeypatch.setattr(kernels, "entries", lambda *a: {"rejax_sample_grid": (7, 3)})
    with pytest.raises(kernels.KernelError, match=r"PTX entries \{'rejax_sample_grid': 11\}"):
        kernels.build(8, 1000, 0, variant="cdf", step_rows=8, sms=132, arch="compute_90")
    kernels._build_cached.cache_clear()
