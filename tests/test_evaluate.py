"""Tests for rejax.eval: problem files, sampler specs, avg@n CIs, step spans, processed
entropy, and eval / calibration / observation statistics on a tiny random checkpoint."""

import json
import math

import numpy as np
import pytest

from rejax import eval as ev
from rejax import sampling
from rejax.checkpoint import load
from rejax.eval.forcing import entropy_np
from rejax.eval.grading import extract_answer, grade
from rejax.generate import generate
from rejax.text import step_spans


@pytest.fixture(scope="module")
def params(chat_checkpoint):
    import jax.numpy as jnp

    # float32 keeps the cached decode and the full-sequence forward within 1e-4 of each other.
    return load(chat_checkpoint, dtype=jnp.float32)


# ----------------------------------------------------------------------------- load_jsonl


def test_load_jsonl_reads_fields_and_skips_blank_lines(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"problem": "a", "answer": 3, "id": 7}\n\n{"problem": "b", "answer": "x"}\n')
    rows = ev.load_jsonl(f)
    assert rows == [{"problem": "a", "answer": "3", "id": 7}, {"problem": "b", "answer": "x"}]
    assert ev.load_jsonl(f, limit=1) == rows[:1]


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('{"problem": "a", "answer": 1}\n{"problem": "b", "answer": \n', r"p\.jsonl:2: malformed"),
        ('{"problem": "a", "answer": 1}\n\n{"answer": 1}\n', r":3: missing field 'problem'"),
        ('{"problem": "a"}\n', r":1: missing field 'answer'"),
        ("[1, 2]\n", r":1: expected a JSON object"),
        ('{"problem": "", "answer": 1}\n', r":1: 'problem' must be a non-empty string"),
        ('{"problem": "a", "answer": null}\n', r":1: 'answer' must be a string or a number"),
        ('{"problem": "a", "answer": " "}\n', r":1: 'answer' is empty"),
        ("\n\n", r"holds no problems"),
    ],
)
def test_load_jsonl_errors_name_the_line(tmp_path, text, match):
    f = tmp_path / "p.jsonl"
    f.write_text(text)
    with pytest.raises(ValueError, match=match):
        ev.load_jsonl(f)


def test_load_jsonl_missing_file_and_bad_limit(tmp_path):
    with pytest.raises(ValueError, match=r"nope\.jsonl' does not exist"):
        ev.load_jsonl(tmp_path / "nope.jsonl")
    f = tmp_path / "p.jsonl"
    f.write_text('{"problem": "a", "answer": 1}\n')
    with pytest.raises(ValueError, match="limit must be a positive"):
        ev.load_jsonl(f, limit=0)


# ----------------------------------------------------------------------------- samplers


def test_parse_sampler_specs():
    assert isinstance(ev.parse_sampler("greedy"), sampling.Greedy)
    t = ev.parse_sampler("temp:0.6", top_p=0.9)
    assert isinstance(t, sampling.Temperature)
    assert (float(t.t), float(t.top_p)) == (0.6, 0.9)
    r = ev.parse_sampler("reset", t_low=0.1, tau0=0.55, t_high=0.9, top_p=0.95, window=16)
    assert isinstance(r, sampling.ReSET)
    assert (r.t_low, r.tau_0, r.t_high, r.top_p, r.window) == (0.1, 0.55, 0.9, 0.95, 16)
    assert r.nl_mask is None  # generate fills the masks from the tokenizer


@pytest.mark.parametrize(
    ("spec", "kwargs", "match"),
    [
        ("temp:abc", {}, r"'temp:abc': temperature 'abc' is not a number"),
        ("temp:", {}, r"temperature '' is not a number"),
        ("temp:0", {}, r"'temp:0': temperature must be a finite number > 0"),
        ("temp:-1", {}, r"must be a finite number > 0"),
        ("temp:nan", {}, r"must be a finite number > 0"),
        ("beam", {}, r"unknown sampler spec 'beam'"),
        ("reset:2", {}, r"unknown sampler spec 'reset:2'"),
        ("reset", {"top_p": 0.0}, r"top_p must be in \(0.0, 1.0\], got 0.0"),
        ("temp:0.6", {"top_p": 1.5}, r"top_p must be in"),
        ("reset", {"t_high": 0.0}, r"t_high must be in"),
        ("reset", {"t_low": -0.1}, r"t_low must be in"),
        ("reset", {"tau0": math.inf}, r"tau0 must be in"),
        ("reset", {"window": 0}, r"window must be >= 1"),
    ],
)
def test_parse_sampler_errors(spec, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ev.parse_sampler(spec, **kwargs)


# ----------------------------------------------------------------------------- avg@n CI


def test_avg_at_n_ci_normal_hand_computed():
    correct = [[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
    out = ev.avg_at_n_ci(correct)
    # per-problem means 0.5, 0.25, 1.0 -> avg 7/12; sd(ddof=1) = sqrt(0.0729167 * 2) = 0.381881
    assert out["avg"] == pytest.approx(7 / 12)
    assert out["se"] == pytest.approx(0.381881 / math.sqrt(3), rel=1e-5)
    assert out["lo"] == pytest.approx(7 / 12 - 1.959964 * 0.220479, rel=1e-5)  # 0.151200
    assert out["hi"] == 1.0  # 1.015466 clipped
    assert (out["n_problems"], out["n_samples"], out["method"]) == (3, 12, "normal")


def test_avg_at_n_ci_pools_ragged_rows_by_problem():
    # Problem-level means: (1 + 0) / 2 problems, not 3 of 4 samples.
    out = ev.avg_at_n_ci([[1, 1, 1], [0]])
    assert out["avg"] == pytest.approx(0.5)
    assert out["n_samples"] == 4


def test_avg_at_n_ci_bootstrap_and_degenerate_cases():
    rng = np.random.default_rng(0)
    correct = rng.random((200, 8)) < 0.4
    normal = ev.avg_at_n_ci(correct)
    boot = ev.avg_at_n_ci(correct, method="bootstrap", n_boot=4000, seed=1)
    assert boot["avg"] == normal["avg"]
    assert boot["lo"] < boot["avg"] < boot["hi"]
    # The bootstrap percentile interval of a mean of 200 i.i.d. values is close to normal.
    assert boot["lo"] == pytest.approx(normal["lo"], abs=0.01)
    assert boot["hi"] == pytest.approx(normal["hi"], abs=0.01)
    one = ev.avg_at_n_ci([[1, 0, 1, 1]])
    assert one["avg"] == 0.75 and one["method"] == "wilson" and one["se"] is None
    with pytest.raises(ValueError, match="at least one problem"):
        ev.avg_at_n_ci([])
    with pytest.raises(ValueError, match="unknown CI method 'wald'; expected one of"):
        ev.avg_at_n_ci(correct, method="wald")


def test_paired_difference_ci_hand_computed():
    a = [[1, 1], [1, 0], [0, 0], [1, 1]]
    b = [[1, 0], [0, 0], [0, 0], [1, 1]]
    out = ev.paired_difference_ci(a, b)
    # d = 0.5, 0.5, 0, 0 -> mean 0.25, sd(ddof=1) = sqrt(1/12) = 0.288675, se = 0.144338
    assert out["diff"] == pytest.approx(0.25)
    assert out["se"] == pytest.approx(0.144338, rel=1e-5)
    assert out["lo"] == pytest.approx(-0.032896, abs=2e-6)  # 0.25 - 1.959964 * 0.144338
    assert out["hi"] == pytest.approx(0.532896, abs=2e-6)
    with pytest.raises(ValueError, match="same non-zero number of problems, got 4 and 3"):
        ev.paired_difference_ci(a, b[:3])


def test_wilson_interval_hand_computed():
    # 10 of 10: center (1 + z^2/20) / (1 + z^2/10) = 0.861236, half-width 0.138764.
    assert ev.wilson_interval(1.0, 10) == pytest.approx((0.722467, 1.0), abs=1e-6)
    assert ev.wilson_interval(0.0, 10) == pytest.approx((0.0, 0.277533), abs=1e-6)
    # 1 of 2: symmetric about 0.5, half-width z / (1 + z^2/2) * sqrt(1/8 + z^2/16) = 0.405469.
    assert ev.wilson_interval(0.5, 2) == pytest.approx((0.094531, 0.905469), abs=1e-6)
    with pytest.raises(ValueError, match=r"n > 0, got p=0.5, n=0"):
        ev.wilson_interval(0.5, 0)


@pytest.mark.parametrize("method", ["normal", "bootstrap", "wilson"])
@pytest.mark.parametrize(
    ("correct", "lo", "hi"),
    [
        ([[1, 1]] * 10, 0.722467, 1.0),  # every problem right: not 100-100%
        ([[0]] * 10, 0.0, 0.277533),  # every problem wrong
        # one problem (n = 1 unit): half-width z / (2 * sqrt(1 + z^2)) = 0.445379, not NaN
        ([[1, 0]], 0.054621, 0.945379),
    ],
)
def test_avg_at_n_ci_degenerate_sets_fall_back_to_wilson(method, correct, lo, hi):
    out = ev.avg_at_n_ci(correct, method=method)
    assert (out["lo"], out["hi"]) == pytest.approx((lo, hi), abs=1e-6)
    assert out["method"] == "wilson" and out["requested_method"] == method
    json.dumps(out, allow_nan=False)  # strict JSON: no NaN anywhere


def test_paired_difference_ci_degenerate_sets_use_newcombe():
    same = ev.paired_difference_ci([[1]] * 10, [[1]] * 10)
    # Both sides 10 of 10: diff 0 +- (1 - 0.722467).
    assert (same["diff"], same["method"]) == (0.0, "newcombe")
    assert (same["lo"], same["hi"]) == pytest.approx((-0.277533, 0.277533), abs=1e-6)
    one = ev.paired_difference_ci([[1, 1]], [[0, 0]])
    # P = 1: Wilson(1, 1) = [0.206549, 1], Wilson(0, 1) = [0, 0.793451].
    assert one["diff"] == 1.0 and one["se"] is None
    expected = (1 - math.hypot(0.793451, 0.793451), 1.0)
    assert (one["lo"], one["hi"]) == pytest.approx(expected, abs=1e-6)
    json.dumps(one, allow_nan=False)


# ----------------------------------------------------------------------------- helpers


def test_step_spans_follow_the_reset_boundary_rule():
    nl = np.zeros(8, bool)
    dnl = np.zeros(8, bool)
    nl[1], dnl[2] = True, True
    # tokens: a b \n\n c \n \n d \n e   (ids 3 4 2 5 1 1 6 1 7)
    tokens = [3, 4, 2, 5, 1, 1, 6, 1, 7]
    assert step_spans(tokens, nl, dnl) == [(0, 3), (3, 6), (6, 9)]
    assert step_spans([], nl, dnl) == []
    assert step_spans([2, 2], nl, dnl) == [(0, 1), (1, 2)]


def test_processed_entropy_hand_cases():
    z = np.log(np.array([[0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1]]))
    raw = entropy_np(z)
    assert raw[0] == pytest.approx(math.log(4), rel=1e-6)
    np.testing.assert_allclose(ev.processed_entropy(z, 1.0), raw, rtol=1e-6)
    # Uniform over 4, top-p 0.5: ascending cumsum 0.25, 0.5 <= 0.5 are dropped -> 2 tokens left.
    assert ev.processed_entropy(z[:1], 1.0, top_p=0.5)[0] == pytest.approx(math.log(2), rel=1e-6)
    # top-k keeps every token tied with the k-th (HF and vLLM): the uniform row keeps all 4.
    assert ev.processed_entropy(z, 0.6, top_k=1) == pytest.approx([math.log(4), 0.0], abs=1e-6)
    # T < 1 sharpens: lower entropy than the raw distribution.
    assert ev.processed_entropy(z[1:], 0.6)[0] < raw[1]


# ----------------------------------------------------------------------------- on a checkpoint


def test_evaluate_end_to_end_grades_and_is_deterministic(params, math_problems):
    sampler = ev.parse_sampler("temp:0.8")
    res = ev.evaluate(
        params, math_problems, sampler, n=2, max_new_tokens=8, batch_size=2, key=3, progress=False
    )
    assert res.correct.shape == (3, 2)
    assert len(res.records) == 3 and len(res.tokens) == 6
    for rec, ok in zip(res.records, res.correct):
        assert rec["correct"] == list(ok)
        assert rec["extracted"] == [extract_answer(t) for t in rec["responses"]]
        assert rec["correct"] == [grade(t, rec["answer"]) for t in rec["responses"]]
        assert all(1 <= k <= 8 for k in rec["num_tokens"])
    s = res.summary
    assert s["avg_at_n"]["avg"] == pytest.approx(res.correct.mean())
    assert s["tokens_generated"] == sum(len(t) for t in res.tokens)
    assert s["chat"] is True  # the checkpoint has a chat template

    # Rewrite each answer to what the first sample extracted (or a number the random model
    # cannot produce): with the same key the first sample must now be graded correct, and the
    # batch size must not change any response.
    relabeled = [
        dict(p, answer=r["extracted"][0] or "123456789") for p, r in zip(math_problems, res.records)
    ]
    again = ev.evaluate(
        params, relabeled, sampler, n=2, max_new_tokens=8, batch_size=3, key=3, progress=False
    )
    assert [r["responses"] for r in again.records] == [r["responses"] for r in res.records]
    assert [bool(c) for c in again.correct[:, 0]] == [
        r["extracted"][0] is not None for r in res.records
    ]


def test_evaluate_rejects_bad_arguments(params, math_problems):
    with pytest.raises(ValueError, match="n must be a positive"):
        ev.evaluate(params, math_problems, ev.parse_sampler("greedy"), n=0)
    with pytest.raises(ValueError, match="at least one problem"):
        ev.evaluate(params, [], ev.parse_sampler("greedy"), n=1)


def test_calibrate_tau0_and_write_calibration(params, tmp_path, math_problems):
    res = ev.calibrate_tau0(params, math_problems, n_problems=2, max_new_tokens=12, key=0)
    raw = res["entropy_raw"]
    assert raw.size == res["n_tokens"] == sum(res["response_lengths"])
    assert res["tau0"] == res["tau0_raw"] == pytest.approx(np.percentile(raw, 80))
    assert res["used"] == "raw"
    assert res["entropy_processed"].shape == raw.shape
    # Teacher forcing reproduces the decode loop's entropies: the prompt tokens and the
    # position offsets match generate's.
    assert res["teacher_forced_max_abs_diff"] < 1e-3
    assert res["sampler"] == {
        "kind": "Temperature",
        "t": 0.6,
        "top_p": 0.95,
        "top_k": 0,
        "top_p_method": "kernel",  # the default (off a GPU it computes "radix")
    }

    files = ev.write_calibration(tmp_path, res, res, quant="nvfp4", meta={"model": "x"})
    names = sorted(f.name for f in files)
    summary = json.loads((tmp_path / "calibrate.json").read_text())
    assert summary["tau0"] == pytest.approx(res["tau0"]) and summary["model"] == "x"
    dump = np.load(tmp_path / "calibrate_entropies.npz")
    np.testing.assert_array_equal(dump["nvfp4_raw"], raw)
    assert set(dump.files) == {"nvfp4_raw", "nvfp4_processed", "bf16_raw", "bf16_processed"}
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "calibrate_entropy.png" not in names
    else:
        assert (tmp_path / "calibrate_entropy.png").stat().st_size > 1000

    with pytest.raises(ValueError, match="calibration needs 5 problems, the data holds 3"):
        ev.calibrate_tau0(params, math_problems, n_problems=5)


def test_observation_stats_greedy_samples_never_leave_their_own_argmax(params, math_problems):
    gen = generate(
        params,
        [p["problem"] for p in math_problems[:2]],
        n=1,
        max_new_tokens=10,
        sampler=sampling.Greedy(),
        stop=[],
        chat=True,
    )
    stats = ev.observation_stats(params, math_problems[:2], gen.tokens, n=1, tau0=100.0)
    assert stats["n_all"] == stats["n_low"] == 20
    assert stats["off_all"] == 0 and stats["rate_low"] == 0.0
    assert stats["n_high"] == 0 and stats["rate_high"] is None

    # Shifting every response by one token makes most tokens disagree with the argmax.
    shifted = [[t[0], *t[:-1]] for t in gen.tokens]
    off = ev.observation_stats(params, math_problems[:2], shifted, n=1, tau0=0.0)
    assert off["n_low"] == 0 and off["n_high"] == 20
    assert off["rate_high"] > 0.3
    with pytest.raises(ValueError, match=r"2 problems x n=2 = 4 responses, got 2"):
        ev.observation_stats(params, math_problems[:2], gen.tokens, n=2, tau0=1.0)


def test_evaluate_progress_counts_problems_with_a_rate(params, capsys, math_problems):
    # Same shapes as the end-to-end test above (2 problems x n=2 per batch, 8 tokens).
    ev.evaluate(
        params, math_problems, ev.parse_sampler("temp:0.8"), n=2, max_new_tokens=8, batch_size=2,
        key=3, progress=True,
    )  # fmt: skip
    err = capsys.readouterr().err
    assert "3/3" in err and "problem/s" in err and "tok/s" in err, err
    assert "batch" not in err


def test_evaluate_with_slots_matches_batches_and_reports_occupancy(params, capsys, math_problems):
    # The end-to-end test's run (2 problems x n=2 per batch, 8 tokens) through 3 refilled
    # slots: the same responses, a bar over rows with tok/s, occupancy in the summary.
    sampler = ev.parse_sampler("temp:0.8")
    kw = {"n": 2, "max_new_tokens": 8, "key": 3}
    batched = ev.evaluate(params, math_problems, sampler, batch_size=2, progress=False, **kw)
    slotted = ev.evaluate(params, math_problems, sampler, slots=3, progress=True, **kw)
    assert [r["responses"] for r in slotted.records] == [r["responses"] for r in batched.records]
    s = slotted.summary
    assert s["slots"] == 3 and 0 < s["slot_occupancy"] <= 1 and s["batch_size"] is None
    assert "slot_occupancy" not in batched.summary
    err = capsys.readouterr().err
    assert "6/6" in err and "row" in err and "tok/s" in err, err
    with pytest.raises(ValueError, match="excludes batch_size"):
        ev.evaluate(params, math_problems, sampler, slots=3, batch_size=2, **kw)
