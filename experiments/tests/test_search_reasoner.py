"""The Countdown experiment scripts' own logic: option handling, the ablation samplers, the
step-entropy summary, and (decoding a few tokens of the bundled tiny model) resuming a stopped
accuracy run."""

import json

import numpy as np
import pytest

from experiments import search_reasoner_accuracy, tiny_reasoner_accuracy, train_search_reasoner


def test_smoke_options_are_small_and_difficulty_flags_reach_the_generator(tmp_path):
    args = train_search_reasoner.parse_args(["--out", str(tmp_path), "--smoke"])
    assert (args.size, args.steps, args.time_budget) == ("smoke", 4, None)
    args = train_search_reasoner.parse_args(
        ["--out", str(tmp_path), "--max-number", "20", "--guide", "0.3", "--n-numbers", "3"]
    )
    d = train_search_reasoner._difficulty(args)
    assert (d.max_number, d.guide, d.n_numbers) == (20, 0.3, 3)
    with pytest.raises(ValueError, match="--batch must be positive"):
        train_search_reasoner.parse_args(["--out", str(tmp_path), "--batch", "0"])


def test_the_m_size_fits_the_bundle_and_the_kernel():
    m = train_search_reasoner.SIZES["m"]
    d, f, nh, kh = m["hidden_size"], m["intermediate_size"], m["num_heads"], m["num_kv_heads"]
    per_layer = (nh + 2 * kh) * m["head_dim"] * d + nh * m["head_dim"] * d + 3 * f * d
    n_params = m["num_layers"] * per_layer + 2 * 384 * d  # + embedding and head at V = 384
    assert 2 * n_params < 47e6  # bf16 bytes: with the 13 MB tiny model, under 60 MB
    assert d % 256 == 0 and f % 256 == 0 and (nh * m["head_dim"]) % 256 == 0


def test_ablation_samplers():
    s = {
        name: tiny_reasoner_accuracy._sampler(name, 0.5, 0.1, 0.95)
        for name in tiny_reasoner_accuracy.CONFIGS + tiny_reasoner_accuracy.ABLATIONS
    }
    assert type(s["bf16_t0.6"]).__name__ == "Temperature" and s["bf16_t0.6"].t == 0.6
    assert float(s["nvfp4_reset"].t_high) == 1.0 and not s["nvfp4_reset"].include_current
    assert float(s["nvfp4_reset_thigh0.6"].t_high) == 0.6
    assert float(s["nvfp4_reset_thigh0.8"].t_high) == 0.8
    assert s["nvfp4_reset_current"].include_current
    assert float(s["nvfp4_reset_current"].t_high) == 1.0
    assert all(float(s[n].tau_0) == 0.5 and float(s[n].t_low) == 0.1 for n in s if "reset" in n)


def test_step_summary_hand_computed():
    steps = {"bf16": [0.1, 1.0, 2.0, 3.0], "nvfp4": [0.1, 0.5, 2.5, 1.0], "responses": 2}
    st = tiny_reasoner_accuracy._step_summary(steps, tau0=1.0)
    assert (st["n_steps"], st["n_high_steps"], st["n_responses"]) == (4, 3, 2)
    assert st["median_bf16_high"] == 2.0 and st["median_nvfp4_high"] == 1.0
    assert st["frac_nvfp4_lower_high"] == pytest.approx(2 / 3)
    assert st["mean_diff_high"] == pytest.approx((-0.5 + 0.5 - 2.0) / 3)
    assert tiny_reasoner_accuracy._step_summary({"bf16": [], "nvfp4": []}, 1.0) is None


def test_search_accuracy_needs_a_trained_model():
    with pytest.raises(SystemExit, match="--model"):
        search_reasoner_accuracy.main([])
    with pytest.raises(SystemExit, match="--model"):
        search_reasoner_accuracy.main(["--model", "tiny"])


def test_smoke_training_writes_a_loadable_model(tmp_path):
    """--smoke end to end: a few steps, the metrics (with rejax's versions) and an HF model
    directory that rejax loads."""
    import json

    import rejax
    from rejax.data import countdown

    train_search_reasoner.main(
        ["--smoke", "--out", str(tmp_path / "out"), "--export", str(tmp_path / "model")]
        + ["--n-numbers", "3", "--max-number", "25", "--max-target", "199"]
    )
    metrics = json.loads((tmp_path / "out" / "countdown_train_metrics.json").read_text())
    assert metrics["steps"] == 4 and "source_digest" in metrics["versions"]
    params = rejax.load(tmp_path / "model")
    assert params.cfg.num_layers >= 1 and params.tokenizer is not None
    # the checkpoint records its task family, and the accuracy experiment draws from it
    want = countdown.Difficulty(n_numbers=3, max_number=25, max_target=199)
    assert countdown.load_difficulty(tmp_path / "model") == want
    d = tiny_reasoner_accuracy._difficulty("countdown", str(tmp_path / "model"))
    test = tiny_reasoner_accuracy._problems("countdown", "test", 20, seed=0, difficulty=d)
    assert test == countdown.split("test", 20, difficulty=want)
    assert all(len(p["numbers"]) == 3 for p in test)


def test_the_xs_size_suits_the_kernel():
    xs = train_search_reasoner.SIZES["xs"]
    for k in (xs["hidden_size"], xs["intermediate_size"], xs["num_heads"] * xs["head_dim"]):
        assert k % 256 == 0, xs  # the CUDA NVFP4 GEMV's K


def test_sensitivity_counts_flips_by_entropy_hand_computed():
    from experiments import quant_sensitivity as qs
    from rejax.eval.forcing import entropy_np

    big = 30.0
    # trace 0: 3 solution rows; row 0 confident on token 1, row 1 flat over 0 / 2, row 2
    # confident on token 3 (a digit). NVFP4 flips row 1 (high entropy) and row 2 (low entropy).
    zb0 = np.array([[0, 0, 0, 0], [0, big, 0, 0], [5, 0, 4.9, 0], [0, 0, 0, big]], float)
    zq0 = np.array([[0, 0, 0, 0], [0, big, 0, 0], [4.9, 0, 5, 0], [0, 0, big, big + 0.1]])
    zq0[3] = [0, 0, big + 0.1, big]  # the low-entropy flip: 3 -> 2
    # trace 1: one confident row, unchanged
    zb1 = np.array([[0, 0, 0, 0], [big, 0, 0, 0]], float)
    res = qs.sensitivity([zb0, zb1], [zq0, zb1.copy()], [(1, 4), (1, 2)], [3], tau=0.1)
    f = res["argmax_flips"]
    assert (res["positions"], res["traces"]) == (4, 2)
    assert f["all"] == {"flips": 2, "positions": 4, "rate": 0.5}
    assert f["low_entropy"]["flips"] == 1 and f["low_entropy"]["positions"] == 3
    assert f["low_entropy_symbolic"] == {"flips": 1, "positions": 1, "rate": 1.0}
    assert f["high_entropy"] == {"flips": 1, "positions": 1, "rate": 1.0}
    assert res["traces_with_low_entropy_flip"] == 0.5
    assert res["mean_kl_nats"]["low_entropy"] > 0.1  # the flipped confident row dominates
    # tau defaults to the 80th percentile of the BF16 entropies
    assert qs.sensitivity([zb1], [zb1], [(1, 2)], [3])["tau"] == pytest.approx(
        float(entropy_np(zb1[1:2])[0]), rel=1e-6
    )


def test_accuracy_input_scale_options():
    with pytest.raises(SystemExit):
        tiny_reasoner_accuracy.main(["--input-scales", "static"])
    with pytest.raises(SystemExit, match="--scale-problems must be positive"):
        tiny_reasoner_accuracy.main(["--input-scales", "calibrated", "--scale-problems", "0"])


def test_layers_override_is_checked(tmp_path):
    args = train_search_reasoner.parse_args(
        ["--out", str(tmp_path), "--size", "xs", "--layers", "4"]
    )
    assert (args.size, args.layers) == ("xs", 4)
    with pytest.raises(ValueError, match="--layers must be positive, got 0"):
        train_search_reasoner.parse_args(["--out", str(tmp_path), "--layers", "0"])


def test_quant_sensitivity_end_to_end_on_the_tiny_model(tmp_path):
    import json

    from experiments import quant_sensitivity as qs

    out = tmp_path / "sens.json"
    res = qs.main(["--n-problems", "4", "--input-scales", "dynamic", "--out", str(out)])
    assert json.loads(out.read_text())["argmax_flips"] == res["argmax_flips"]
    f = res["argmax_flips"]
    assert res["traces"] == 4 and res["positions"] == f["all"]["positions"] > 4 * 10
    assert f["low_entropy"]["positions"] + f["high_entropy"]["positions"] == res["positions"]
    assert f["all"]["flips"] == f["low_entropy"]["flips"] + f["high_entropy"]["flips"]
    assert 0 <= res["mean_kl_nats"]["all"] < 0.1  # NVFP4 is close to BF16 on this model
    with pytest.raises(SystemExit, match="--n-problems must be positive"):
        qs.main(["--n-problems", "0"])


def test_sensitivity_margins_hand_computed():
    from experiments import quant_sensitivity as qs

    # two confident rows: leads 10 and 6 nats in BF16, 9 and 6.5 under NVFP4 (shifts -1, +0.5)
    zb = np.array([[0.0, 0, 0], [10, 0, 0], [0, 6, 0]])
    zq = np.array([[0.0, 0, 0], [9, 0, 0], [0, 6.5, 0]])
    m = qs.sensitivity([zb], [zq], [(1, 3)], [], tau=1.0)["low_entropy_margin_nats"]
    lead = qs._margin(qs._log_softmax(zb[1:]), np.array([0, 1]))
    np.testing.assert_allclose(lead, [10, 6])
    assert m["bf16_median"] == pytest.approx(8.0)
    assert m["bf16_p1"] == pytest.approx(6.04)
    assert m["nvfp4_shift_std"] == pytest.approx(0.75)
    assert m["nvfp4_shift_min"] == pytest.approx(-1.0)
    assert m["p1_over_shift_std"] == pytest.approx(6.04 / 0.75)


def test_init_continues_from_an_exported_checkpoint_of_the_same_run(tmp_path):
    """--init: an exported checkpoint's weights come back as float32 (the bf16 values it holds);
    another model size, another tokenizer or a folder without a checkpoint is refused."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    from train_tiny_reasoner import build_tokenizer, export

    from rejax.config import Config
    from rejax.params import init_params

    texts = [f"{a}+{b}={a + b}\n\n{a}*{b}={a * b}" for a in range(30) for b in range(7)]
    tok = build_tokenizer(texts)
    cfg = Config(
        arch="qwen3", vocab_size=-(-tok.get_vocab_size() // 128) * 128, rope_theta=10_000.0,
        max_position_embeddings=256, eos_token_ids=(2, 0), pad_token_id=0, bos_token_id=0,
        **train_search_reasoner.SIZES["smoke"],
    )  # fmt: skip
    weights = init_params(cfg, jax.random.key(3), dtype=jnp.float32).weights
    export(weights, cfg, tok, tmp_path / "ck")
    got = train_search_reasoner.init_weights(tmp_path / "ck", cfg, tok)
    want = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), weights)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == jnp.float32 and np.array_equal(np.asarray(a), np.asarray(b))
    deeper = dataclasses.replace(cfg, num_layers=3)
    with pytest.raises(ValueError, match="num_layers=2 there, 3 in this run"):
        train_search_reasoner.init_weights(tmp_path / "ck", deeper, tok)
    other = build_tokenizer([f"to {w} or not to {w}, that is the question" for w in texts])
    with pytest.raises(ValueError, match="tokenizer's vocabulary differs"):
        train_search_reasoner.init_weights(tmp_path / "ck", cfg, other)
    with pytest.raises(ValueError, match="config.json missing"):
        train_search_reasoner.init_weights(tmp_path / "none", cfg, tok)
    args = train_search_reasoner.parse_args(["--out", str(tmp_path), "--init", "x"])
    assert args.init == "x"


def test_the_time_budget_is_a_hard_cap():
    # steps that slow down after the first timed ones (as on the H200, where the first fit
    # undercounted by a fifth) must stop at the budget, not run on to the first fit: no step
    # starts once the budget is spent (compile and the last step may end past it)
    import argparse
    import time

    import jax

    from experiments import train_tiny_reasoner as tiny
    from rejax.config import Config
    from rejax.params import init_params

    cfg = Config(arch="qwen3", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
                 num_heads=2, num_kv_heads=1, head_dim=8, max_position_embeddings=64)  # fmt: skip
    w = init_params(cfg, jax.random.key(0), dtype=np.float32).weights
    ids = np.random.default_rng(0).integers(1, 32, size=(64, 16)).astype(np.int32)
    mask = np.ones((64, 15), np.float32)  # the loss mask of the 15 next-token targets
    args = argparse.Namespace(seed=0, steps=100_000, time_budget=3.0, batch=4, lr=1e-3,
                              warmup=2, weight_decay=0.0, eval_every=10_000)  # fmt: skip
    real = tiny.lr_at
    starts = []  # (step, time) of each step's start: lr_at runs once per step, before it

    def slower(step, *a, **k):  # each step slower than the last, past the first fit
        starts.append((step, time.perf_counter()))
        if step > 60:
            time.sleep(0.002 * (step - 60))
        return real(step, *a, **k)

    tiny.lr_at = slower
    try:
        t0 = time.perf_counter()
        _, hist, total, _, _ = tiny.train_loop(w, cfg, ids, mask, ids[:4], mask[:4], args)
    finally:
        tiny.lr_at = real
    assert total == len(starts) < 100_000
    late = [(i, round(t - t0, 2)) for i, t in starts[1:] if t - t0 > args.time_budget + 1.0]
    assert late == [], late
    assert hist["val_step"][-1] == total


def test_a_stopped_run_resumes_from_its_state(tmp_path, monkeypatch):
    """A run cut by --time-budget after its first test chunk goes on with --resume: tau0 and
    T_low are not computed again, the second chunk runs with its own key, and the results
    cover every problem; other settings are refused."""
    prefix = str(tmp_path / "acc")
    args = ["--model", "tiny", "--n-problems", "2", "--n-samples", "1", "--chunk-problems", "1",
            "--calib-problems", "1", "--n-val-problems", "1", "--n-val-samples", "1",
            "--t-low-grid", "0.3", "--scale-problems", "1", "--max-new-tokens", "8",
            "--input-scales", "calibrated", "--out-prefix", prefix]  # fmt: skip
    assert tiny_reasoner_accuracy.main([*args, "--time-budget", "0"]) == 0
    first = json.loads((tmp_path / "acc.json").read_text())
    assert first["test"]["n_problems"] == 1 and first["test"]["stopped_early"]
    state = json.loads((tmp_path / "acc_state.json").read_text())
    assert state["done"] == 1 and all(len(c) == 1 for c in state["correct"].values())

    def again(*_a, **_k):
        raise AssertionError("a resumed run calibrated again")

    monkeypatch.setattr(tiny_reasoner_accuracy, "_calibrate_and_choose", again)
    with pytest.raises(SystemExit, match="n_samples"):
        tiny_reasoner_accuracy.main([*args, "--n-samples", "2", "--resume"])
    assert tiny_reasoner_accuracy.main([*args, "--resume"]) == 0
    res = json.loads((tmp_path / "acc.json").read_text())
    assert res["test"]["n_problems"] == 2 and not res["test"]["stopped_early"]
    assert res["calibration"] == first["calibration"]
    assert res["t_low_selection"] == first["t_low_selection"]
    for name, c in res["test"]["configs"].items():
        assert c["tokens_generated"] > first["test"]["configs"][name]["tokens_generated"], name
    with pytest.raises(SystemExit, match="no .*acc2_state.json"):
        tiny_reasoner_accuracy.main([*args[:-1], prefix + "2", "--resume"])


def test_the_shipped_countdown_results_render_and_mark_the_unpaired_interval(tmp_path):
    # The H200 run's JSON renders to its markdown; the T_high = 0.6 ablation sampled exactly
    # NVFP4's tokens (every paired difference 0), so its interval is the footnoted Newcombe one.
    src = tiny_reasoner_accuracy.RESULTS / "countdown_accuracy.json"
    res = json.loads(src.read_text())
    (tmp_path / "r.json").write_text(json.dumps(res))
    argv = ["--task", "countdown", "--ablations", "--render-only"]
    assert tiny_reasoner_accuracy.main([*argv, "--out-prefix", str(tmp_path / "r")]) == 0
    md = (tmp_path / "r.md").read_text()
    assert md == (tiny_reasoner_accuracy.RESULTS / "countdown_accuracy.md").read_text()
    paired = res["test"]["paired"]
    marked = [k for k, d in paired.items() if d["method"] == "newcombe"]
    assert marked == ["nvfp4_reset_thigh0.6_vs_nvfp4_t0.6"]
    row = next(x for x in md.splitlines() if x.startswith("| NVFP4 + ReSET, T_high = 0.6"))
    assert "†" in row and md.count("†") == 2  # the mark and its footnote
    assert res["test"]["n_problems"] >= 1000 and res["settings"]["n_samples"] >= 8
