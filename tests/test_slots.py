"""Slot-refill generation (rejax/slots.py): the same tokens as static batches, any schedule."""

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rejax import slots as sl
from rejax.cache import write_kv
from rejax.config import Config
from rejax.params import init_params
from rejax.sampling import Greedy, ReSET, Temperature

gen = importlib.import_module("rejax.generate")

V = 272
M = 16  # one budget (and so one set of compiled shapes) for the whole file
# Stop ids the rows below sample at different steps (lengths 1 .. 16, stop and length ends).
STOP = [3, 9, 19, 27]
N = 2


@pytest.fixture(scope="module")
def params():
    """A tiny random Qwen3 with peaked logits (as in test_generate)."""
    cfg = Config(vocab_size=V, eos_token_ids=(STOP[0],), max_position_embeddings=256, num_layers=1)
    p = init_params(cfg, 7, jnp.float32)
    w = jax.tree_util.tree_map(lambda x: x * 10.0 if x.ndim == 2 else x, p.weights)
    return dataclasses.replace(p, weights=w)


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, 256, size=n)] for n in lengths]


# Two prompt buckets (32 and 64; the 40-token prompt last): slots hold rows at different
# cache indices.
PROMPTS = [_prompts([3, 40, 7, 12, 5, 20])[i] for i in (0, 2, 3, 4, 5, 1)]


def _reset(t_low=0.3, t_high=1.2, tau_0=0.5, nl=(10, 11, 12), dnl=(13, 14)):
    # Greedy rows are ReSET rows at temperature 0 (<= GREEDY_EPS samples the argmax): the
    # same compiled programs serve both, since hyperparameters are traced.
    nl, dnl = np.isin(np.arange(V), nl), np.isin(np.arange(V), dnl)
    return ReSET(t_low=t_low, tau_0=tau_0, t_high=t_high, window=4, nl_mask=nl, dnl_mask=dnl)


SAMPLERS = {"greedy": _reset(0.0, 0.0), "reset": _reset()}
# Step boundaries every few tokens and tau_0 at the rows' typical entropy (~4.4 nats): each
# step's temperature depends on the carried sampler state, so a row given another row's state
# samples other tokens.
BUSY = _reset(tau_0=4.45, nl=range(0, V, 3), dnl=range(1, V, 3))


@pytest.fixture(scope="module")
def static(params):
    """Static-batch generations of PROMPTS x N, per sampler: the reference."""
    return {
        name: gen.generate(
            params,
            PROMPTS,
            max_new_tokens=M,
            sampler=s,
            key=3,
            n=N,
            stop=STOP,
            progress=False,
        )
        for name, s in SAMPLERS.items()
    }


@pytest.fixture(scope="module")
def full(params):
    """PROMPTS x N to M tokens each (no stop token), BUSY, key 2: rows cut at their budgets
    are the reference of forced-length runs."""
    return gen.generate(
        params,
        PROMPTS,
        max_new_tokens=M,
        sampler=BUSY,
        key=2,
        n=N,
        stop=[],
        progress=False,
    )


def _same(a, b):
    assert a.tokens == b.tokens
    assert a.finish_reason == b.finish_reason
    for x, y in zip(a.entropy + a.temperature, b.entropy + b.temperature):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)  # same tokens, same math


@pytest.mark.parametrize(("name", "compact"), [("greedy", True), ("reset", True), ("reset", False)])
def test_refilled_run_equals_static_batches(params, static, name, compact):
    before = dict(gen.TRACE_COUNTS)
    out = gen.generate(
        params,
        PROMPTS,
        max_new_tokens=M,
        sampler=SAMPLERS[name],
        key=3,
        n=N,
        stop=STOP,
        slots=3,
        progress=False,
        compact=compact,
    )
    _same(out, static[name])
    ref = static[name]
    lengths = [len(t) for t in ref.tokens]
    assert "stop" in ref.finish_reason and "length" in ref.finish_reason
    assert len(set(lengths)) >= 3, lengths  # slots free at different steps
    if name == "greedy":
        assert ref.tokens[0::2] == ref.tokens[1::2]  # argmax rows: the key plays no part
    else:
        assert ref.tokens[0::2] != ref.tokens[1::2]
    stats = out.slot_stats
    assert stats["rows"] == 12 and stats["tokens"] == sum(lengths) == stats["live_row_steps"]
    assert stats["prefills"] == 12  # one row per refill (B // 16 -> 1), a slot refilled 4x
    assert stats["row_occupancy"] == sum(lengths) / sum(
        c * k for c, k in stats["steps_by_size"].items()
    )
    if compact:
        # Sizes 3, 2, 1 fit every live count: each drained row shrinks the program at once.
        assert stats["compactions"] == 2 and list(stats["steps_by_size"]) == [3, 2, 1]
        assert stats["occupancy"] == stats["row_occupancy"] == 1.0
    else:
        assert stats["compactions"] == 0 and list(stats["steps_by_size"]) == [3]
        # the mean of per-step fractions vs one division: equal up to float rounding
        assert stats["occupancy"] == pytest.approx(sum(lengths) / (3 * stats["steps"]), rel=1e-12)
        assert stats["occupancy"] > 0.7
        assert stats["occupancy_while_pending"] > stats["occupancy"]  # the drain has idle slots
    # 12 refills over two buckets: one decode program per size, one prefill per bucket at most.
    sizes = len(stats["steps_by_size"])
    assert gen.TRACE_COUNTS["decode_chunk"] - before.get("decode_chunk", 0) <= sizes
    assert gen.TRACE_COUNTS["compact_slots"] - before.get("compact_slots", 0) <= sizes - 1
    assert gen.TRACE_COUNTS["slot_prefill"] - before.get("slot_prefill", 0) <= 2


def test_one_slot_refilled_for_every_row(params, static):
    # One slot serves rows 0..9 (the bucket-32 prompts): a refill follows longer prompts and
    # rows (stale keys past the new prompt must be masked), and a row must not inherit the
    # previous occupant's key, sampler state or step.
    out = gen.generate(
        params,
        PROMPTS[:5],
        max_new_tokens=M,
        sampler=SAMPLERS["reset"],
        key=3,
        n=N,
        stop=STOP,
        slots=1,
        progress=False,
    )
    ref = static["reset"]
    assert out.tokens == ref.tokens[:10] and out.finish_reason == ref.finish_reason[:10]
    assert len({len(t) for t in out.tokens}) >= 3
    assert out.slot_stats["prefills"] == 10 and out.slot_stats["occupancy"] == 1.0


def test_fewer_rows_than_slots(params, static):
    # The bucket-64 prompt alone (greedy, so its rows do not depend on the row index): 2 rows
    # in 3 slots, prefilled together with a dummy row (refill_rows=3) that must be dropped.
    stop_mask = jnp.asarray(np.isin(np.arange(V), STOP))
    for compact in (False, True):
        rows, s = sl.generate_rows(
            params,
            [PROMPTS[5]],
            slots=3,
            max_new_tokens=M,
            sampler=SAMPLERS["greedy"],
            key=jax.random.key(0),
            stop_mask=stop_mask,
            n=N,
            refill_rows=3,
            compact=compact,
        )
        assert [r[0].tolist() for r in rows] == static["greedy"].tokens[10:12]
        assert s.prefills == 1 and s.occupancy_while_pending is None
        assert s.live_row_steps == s.tokens == sum(len(r[0]) for r in rows)  # no dummy went live
        if compact:  # 2 live rows fit a program of 2 before the first step
            assert 3 not in s.steps_by_size and s.compactions >= 1
        else:
            assert s.chunks == 1 and s.occupancy <= 2 / 3


def test_per_row_budgets_and_progress(params, full):
    budgets = [4, 11, 1, 7, 16, 2, 9, 3, 12, 5, 6, 8]  # one per row
    sampler, key = BUSY, jax.random.key(2)
    calls = []
    rows, stats = sl.generate_rows(
        params,
        PROMPTS,
        slots=3,
        max_new_tokens=budgets,
        sampler=sampler,
        key=key,
        stop_mask=jnp.zeros((V,), bool),
        n=N,
        progress=lambda *c: calls.append(c),
    )
    assert [len(r[0]) for r in rows] == budgets
    for r, (row, ref) in enumerate(zip(rows, full.tokens)):
        assert row[0].tolist() == ref[: budgets[r]], r
        assert not row[3]  # no stop token: every row ends at its budget
    assert sum(c[0] for c in calls) == 12 and sum(c[1] for c in calls) == len(PROMPTS)
    assert sum(c[2] for c in calls) == sum(budgets) == stats.tokens
    assert stats.chunks == len(calls) or stats.chunks > len(calls)


def test_no_retrace_for_new_prompts_keys_and_hyperparameters(params, static):
    seen = dict(gen.TRACE_COUNTS)
    assert seen.get("decode_chunk", 0) >= 1  # compiled by the runs above
    # New prompts in the same buckets, a new key, new traced hyperparameters.
    out = gen.generate(
        params,
        _prompts([30, 50, 1], seed=4),
        max_new_tokens=M,
        key=1,
        n=3,
        stop=STOP,
        sampler=_reset(0.5, 0.9, 0.2),
        slots=3,
        progress=False,
    )
    assert dict(gen.TRACE_COUNTS) == seen
    assert len(out.tokens) == 9 and out.slot_stats["prefills"] == 9


def _forced(params, budgets, slots, compact, prompts=PROMPTS, key=2, **kw):
    # Rows of forced lengths (no stop token): the schedule is known step by step. M and the
    # 64 bucket (PROMPTS[5]) fix the cache length of the runs above, so programs are shared.
    return sl.generate_rows(
        params,
        prompts,
        slots=slots,
        max_new_tokens=budgets,
        sampler=BUSY,
        key=jax.random.key(key),
        stop_mask=jnp.zeros((V,), bool),
        n=N,
        compact=compact,
        buffer_tokens=M,
        **kw,
    )


def test_occupancy_counted_per_program_size(params):
    # Rows of 1, 2, 3 and 8 tokens in 3 slots, sizes 3 and 1. Step 1 (3 live): row 0 ends,
    # row 3 takes its slot; steps 2-3 (3, then 2 live) run until one row is left; row 3's
    # last 6 steps run alone at size 1. Without compaction, row 3 runs to step 9 at size 3.
    budgets = [1, 2, 3, 8]
    _, s = _forced(params, budgets, 3, [1], [PROMPTS[5], PROMPTS[0]])
    assert s.steps_by_size == {3: 3, 1: 6} and s.compactions == 1, s
    assert s.steps == 9 and s.live_row_steps == s.tokens == 14
    assert s.occupancy == pytest.approx(((3 + 3 + 2) / 3 + 6 / 1) / 9)  # live / rows, per step
    assert s.row_occupancy == pytest.approx(14 / (3 * 3 + 1 * 6))
    assert set(s.decode_s_by_size) == {3, 1} and 0 < s.time_weighted_occupancy <= 1
    assert s.occupancy_while_pending == 1.0  # step 1
    _, s = _forced(params, budgets, 3, False, [PROMPTS[5], PROMPTS[0]])
    assert s.steps_by_size == {3: 9} and s.compactions == 0
    for occ in (s.occupancy, s.row_occupancy, s.time_weighted_occupancy):
        assert occ == pytest.approx(14 / 27)


def test_compaction_many_times_same_tokens(params, full):
    # 12 rows of very different budgets through 4 slots: refills, then a drain through sizes
    # 4 -> 2 -> 1 (and 4 -> 3 -> 1 given as a list); every row equals the full-length static
    # row cut at its budget, whatever the program sizes it ran in.
    budgets = [16, 1, 2, 12, 1, 3, 8, 2, 1, 5, 14, 16]
    temps = np.concatenate(full.temperature)
    assert 0.2 < np.mean(np.isclose(temps, 0.3)) < 0.8  # both drawn: the state matters
    before = dict(gen.TRACE_COUNTS)
    for compact, sizes in ((True, [4, 2, 1]), ([3, 1], [4, 3, 1])):
        rows, s = _forced(params, budgets, 4, compact)
        for r, row in enumerate(rows):
            assert row[0].tolist() == full.tokens[r][: budgets[r]], (compact, r)
            for got, want in zip(row[1:3], (full.entropy[r], full.temperature[r])):
                np.testing.assert_allclose(got, want[: budgets[r]], rtol=1e-5, atol=1e-6)
        assert list(s.steps_by_size) == sizes and s.compactions == len(sizes) - 1, s
        assert s.tokens == sum(budgets) and s.prefills == 12
    # one decode program per size (4, 2, 1, 3 at most) and one gather per step down
    seen = dict(gen.TRACE_COUNTS)
    assert seen["decode_chunk"] - before.get("decode_chunk", 0) <= 4
    assert seen["compact_slots"] - before.get("compact_slots", 0) <= 4
    # another compacting run (other budgets, prompt order and key): nothing retraces
    rows, s = _forced(params, budgets[::-1], 4, True, PROMPTS[::-1], key=9)
    assert dict(gen.TRACE_COUNTS) == seen and s.compactions == 2


def test_per_row_cache_write_matches_dynamic_update_slice():
    rng = np.random.default_rng(0)
    cache = rng.normal(size=(2, 3, 6, 1, 2)).astype(np.float32)  # [L, B, S, K, H]
    new = rng.normal(size=(3, 2, 1, 2)).astype(np.float32)  # [B, T, K, H]
    index = np.array([0, 4, 6], np.int32)  # row 2 is past the end: its write is dropped
    got = jax.jit(lambda c, x, i: write_kv(c, c, x, x, i, layer=1)[0])(cache, new, index)
    want = cache.copy()
    want[1, 0, 0:2] = new[0]
    want[1, 1, 4:6] = new[1]
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize(("name", "p", "batch_size"), [("greedy", 1, None), ("reset", 5, 4)])
def test_chunked_static_prefill_keeps_the_tokens(params, static, name, p, batch_size):
    """Static batches prefilled in chunks of P prompts of one bucket (prefill_rows=P, the slot
    refill's prefill) give the one-prefill tokens; batches of 4 prompts x 2 leave the last chunk
    of a bucket short (dummy rows dropped)."""
    before = dict(gen.TRACE_COUNTS)
    out = gen.generate(
        params,
        PROMPTS,
        max_new_tokens=M,
        sampler=SAMPLERS[name],
        key=3,
        n=N,
        stop=STOP,
        progress=False,
        batch_size=batch_size,
        prefill_rows=p,
    )
    _same(out, static[name])
    # one compiled chunk prefill per (bucket, batch rows): two buckets, batches of 12 or 8 and 4
    assert gen.TRACE_COUNTS["prefill_rows"] - before.get("prefill_rows", 0) <= 4
    assert gen.TRACE_COUNTS["prefill"] == before.get("prefill", 0)  # no one-shot prefill


def test_chunked_static_prefill_has_the_slot_refills_shapes(params, monkeypatch):
    """With the same P, every prefill of the static path has a shape [P, T] that the slot run's
    refills have too: on a GPU, where a linear's rounding may depend on its row count, that
    is what makes a row's prefill the same in both. (M = 13: shapes traced fresh here.)"""
    seen = {"static": set(), "slots": set()}
    path = ["static"]
    real = sl.prefill_rows

    def spy(params_, cache, tokens, positions, ids):
        seen[path[0]].add(tuple(tokens.shape))
        return real(params_, cache, tokens, positions, ids)

    monkeypatch.setattr(sl, "prefill_rows", spy)
    kw = {"max_new_tokens": 13, "sampler": Greedy(), "n": N, "stop": STOP, "progress": False}
    static_out = gen.generate(params, PROMPTS, prefill_rows=2, **kw)
    path[0] = "slots"
    slot_out = gen.generate(params, PROMPTS, prefill_rows=2, slots=4, **kw)
    assert static_out.tokens == slot_out.tokens
    assert seen["static"] == {(2, 32), (2, 64)} and seen["static"] <= seen["slots"], seen


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"prefill_rows": 0}, "prefill_rows must be a positive int or None"),
        ({"prefill_rows": 2.0}, "prefill_rows must be a positive int or None"),
        ({"slots": 2, "prefill_rows": 3}, "prefill_rows=3 exceeds slots=2"),
        ({"slots": 0}, "slots must be a positive int"),
        ({"slots": 2, "batch_size": 2}, "excludes batch_size"),
        ({"slots": 2, "sampler": Temperature(jnp.ones((2,)))}, "scalar sampler"),
    ],
)
def test_bad_input_raises(params, kw, match):
    with pytest.raises(ValueError, match=match):
        gen.generate(params, [[1, 2]], max_new_tokens=2, progress=False, **kw)


def test_bad_driver_input_raises(params):
    common = {"sampler": Greedy(), "key": jax.random.key(0), "stop_mask": jnp.zeros((V,), bool)}
    with pytest.raises(ValueError, match="refill_rows"):
        sl.generate_rows(params, [[1]], slots=2, max_new_tokens=2, refill_rows=3, **common)
    with pytest.raises(ValueError, match="one per row"):
        sl.generate_rows(params, [[1]], slots=2, max_new_tokens=[2, 3], n=1, **common)
    for bad in ([0], [2], [4, 1], "1", 1, "all"):
        with pytest.raises(
            ValueError, match=r"compact must be 'auto', True, False or sizes in \[1, slots=2\)"
        ):
            sl.generate_rows(params, [[1]], slots=2, max_new_tokens=2, compact=bad, **common)
    # "auto" (the default) stops at 16 rows, where a GPU's decode step still rounds as at B
    assert sl.compact_sizes(64) == (64, 32, 16) and sl.compact_sizes(16) == (16,)
    assert sl.compact_sizes(48) == (48, 32, 16) and sl.compact_sizes(8) == (8,)
    assert sl.compact_sizes(64, True) == (64, 32, 16, 8, 4, 2, 1)
    assert sl.compact_sizes(48, True) == (48, 32, 16, 8, 4, 2, 1)
    assert sl.compact_sizes(8, False) == (8,) and sl.compact_sizes(8, (2, 6, 2)) == (8, 6, 2)


def test_compacting_runs_decode_with_invariant_rows(params, monkeypatch):
    """With compaction the decode programs of every size run with Config.invariant_rows = B
    (their matmuls planned as B rows, so a GPU rounds each row as the B-row program does); the
    slot prefills keep the plain config (the static path's prefill shapes); without
    compaction, or with invariant_rows already set, the config is left alone."""
    seen = {"decode": set(), "prefill": set()}
    decode, prefill = sl.decode_chunk, sl._prefill

    def spy_decode(p, *a, **k):
        seen["decode"].add(p.cfg.invariant_rows)
        return decode(p, *a, **k)

    def spy_prefill(p, *a, **k):
        seen["prefill"].add(p.cfg.invariant_rows)
        return prefill(p, *a, **k)

    monkeypatch.setattr(sl, "decode_chunk", spy_decode)
    monkeypatch.setattr(sl, "_prefill", spy_prefill)
    budgets = [9, 2, 2, 2, 2, 2] * N
    _forced(params, budgets[: len(PROMPTS) * N], 4, [2])
    assert seen == {"decode": {4}, "prefill": {None}}, seen
    for compact, cfg_rows, want in ((False, None, {None}), ([2], 8, {8})):
        seen = {"decode": set(), "prefill": set()}
        p = dataclasses.replace(
            params, cfg=dataclasses.replace(params.cfg, invariant_rows=cfg_rows)
        )
        _forced(p, budgets[: len(PROMPTS) * N], 4, compact)
        assert seen["decode"] == want, (compact, seen)


def test_auto_compaction_needs_xla_autotune_off_on_gpu(params, full, monkeypatch):
    """compact="auto" compacts only where every program rounds a row alike: on a GPU only
    with Config.xla_autotune=False (XLA's timed algorithm picks may differ between a padded
    small program and the B-row one), on the CPU only with float32 weights. Otherwise it
    warns once and keeps all B slots; the tokens are the static rows either way."""
    off = dataclasses.replace(params, cfg=dataclasses.replace(params.cfg, xla_autotune=False))
    assert sl.auto_compacts(params, "cpu") and sl.auto_compacts(off, "gpu")
    assert not sl.auto_compacts(params, "gpu") and not sl.auto_compacts(params, "tpu")
    bf16 = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params.weights)
    assert not sl.auto_compacts(dataclasses.replace(params, weights=bf16), "cpu")
    # 12 rows through 32 slots: "auto" moves them into 16 rows at once where it compacts
    budgets = [16, 1, 2, 12, 1, 3, 8, 2, 1, 5, 14, 16]
    rows, s = _forced(params, budgets, 32, "auto")
    assert list(s.steps_by_size) == [16] and s.compactions == 1, s
    monkeypatch.setattr(sl, "_AUTO_OFF_NOTED", [])
    monkeypatch.setattr(sl, "auto_compacts", lambda p: False)  # as on a GPU, autotuning
    with pytest.warns(UserWarning, match="xla_autotune=False"):
        kept, s = _forced(params, budgets, 32, "auto")
    assert list(s.steps_by_size) == [32] and s.compactions == 0, s
    for r, (a, b) in enumerate(zip(rows, kept)):
        assert a[0].tolist() == b[0].tolist() == full.tokens[r][: budgets[r]], r
    # an explicit compaction request is honoured whatever the backend
    _, s = _forced(params, budgets, 32, [16])
    assert list(s.steps_by_size) == [16] and s.compactions == 1, s


@pytest.mark.gpu
def test_auto_compaction_equals_static_batches_gpu():
    """On a GPU with Config.xla_autotune=False, "auto" compaction (32 slots, then 16 rows)
    gives the tokens of static batches of 32 rows with the same chunked prefill, for a bf16
    model (its matmuls are what XLA would autotune per program); with autotuning on, "auto"
    warns and keeps all 32 slots, with the same tokens as well."""
    v, n, m = 4096, 8, 96
    cfg = Config(
        vocab_size=v, hidden_size=512, intermediate_size=1536, num_layers=2, num_heads=8,
        num_kv_heads=4, head_dim=64, max_position_embeddings=1024, xla_autotune=False,
    )  # fmt: skip
    off = init_params(cfg, 11, jnp.bfloat16)
    prompts = _prompts([5, 9, 17, 30, 12, 7, 22, 3], seed=4)
    rng = np.random.default_rng(1)
    budgets = np.minimum(m, 1 + rng.pareto(1.2, len(prompts) * n) * 12).astype(int)
    none = np.zeros((v,), bool)
    greedy = ReSET(t_low=0.0, t_high=0.0, tau_0=0.5, window=4, nl_mask=none, dnl_mask=none)
    for params in (off, dataclasses.replace(off, cfg=dataclasses.replace(cfg, xla_autotune=True))):
        static = gen.generate(
            params, prompts, max_new_tokens=m, sampler=greedy, key=5, n=n, stop=[],
            progress=False, batch_size=32 // n, prefill_rows=2,
        )  # fmt: skip
        rows, s = sl.generate_rows(
            params, prompts, slots=32, max_new_tokens=budgets, sampler=greedy,
            key=jax.random.key(5), stop_mask=jnp.zeros((v,), bool), n=n, refill_rows=2,
            buffer_tokens=m,
        )  # fmt: skip
        assert (16 in s.steps_by_size) == (not params.cfg.xla_autotune), s
        same = [rows[r][0].tolist() == static.tokens[r][: budgets[r]] for r in range(len(rows))]
        assert all(same), (params.cfg.xla_autotune, same.count(False))
