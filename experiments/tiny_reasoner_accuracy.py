"""Accuracy of a bundled reasoner: BF16 vs NVFP4 W4A4 vs NVFP4 + ReSET, with 95% CIs, plus
the paper's observation statistics (claim (i): low-entropy tokens sampled off the BF16 argmax;
claim (ii), with --plots: NVFP4's entropy in high-uncertainty steps against BF16's).

`--task arithmetic` (default) runs the tiny model's task (rejax.data.tasks), `--task countdown`
the search task (rejax.data.countdown, graded exactly); `--ablations` adds NVFP4 + ReSET with
T_high 0.6 and 0.8 and with include_current=True. experiments/search_reasoner_accuracy.py runs
this script with the search reasoner's settings.

Protocol (the paper's recipe, §5, scaled to the tiny task):
  1. tau0: `rejax.eval.calibrate_tau0` on the NVFP4 model, the first `--calib-problems`
     validation problems, T = 0.6 (the raw full-vocabulary entropy ReSET thresholds); the BF16
     model on the same problems for the comparison plot.
  2. T_low: chosen on the next `--n-val-problems` validation problems only, from `--t-low-grid`,
     by avg@`--n-val-samples` of NVFP4 + ReSET (ties: the smaller T_low).
  3. Test: `--n-problems` test problems x `--n-samples` samples, top-p 0.95, for
        BF16 T=0.6 | NVFP4 W4A4 T=0.6 | NVFP4 W4A4 + ReSET (T_high 1.0, w 32, tau0, T_low),
     (plus the ablations), in chunks of problems; every configuration runs on every chunk with
     the same PRNG key
     (paired comparison), and a chunk's results are written as soon as it finishes. With
     `--time-budget` the test stops after the chunk that exhausts it, and the results say how
     many problems were evaluated; `--resume` (the same settings) continues such a run from
     OUT_PREFIX_state.json, written after every chunk, without calibrating again.
  4. Observation statistics: every test response teacher-forced through the BF16 model;
     off-argmax rates at low-entropy positions (BF16 entropy < tau0), overall and at symbolic
     (digit) positions, with bootstrap CIs over responses. With --plots, the BF16 samples of
     the first `--step-chunks` chunks are also teacher-forced through the NVFP4 model: per
     reasoning step (ReSET's boundary rule) the mean entropy under each model, and for steps
     whose BF16 mean entropy is >= tau0 (high-uncertainty steps) their distributions.

avg@n CIs: normal approximation over per-problem means (problems are the sampling unit);
differences between configurations: paired over problems.

Usage:
    PYTHONPATH=. python experiments/tiny_reasoner_accuracy.py               # full settings
    PYTHONPATH=. python experiments/tiny_reasoner_accuracy.py --n-problems 64 --n-samples 2 \\
        --n-val-problems 16 --out-prefix /tmp/acc                           # a quick look
Writes experiments/results/tiny_reasoner_accuracy.{json,md} and calibrate_tiny.* by default.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from rejax import cli, text
from rejax import eval as ev
from rejax.bench import versions
from rejax.data import tasks
from rejax.text import has_chat_template

RESULTS = Path(__file__).resolve().parent / "results"
CONFIGS = ("bf16_t0.6", "nvfp4_t0.6", "nvfp4_reset")
ABLATIONS = ("nvfp4_reset_thigh0.6", "nvfp4_reset_thigh0.8", "nvfp4_reset_current")
LABELS = {
    "bf16_t0.6": "BF16, T = 0.6",
    "nvfp4_t0.6": "NVFP4 W4A4, T = 0.6",
    "nvfp4_reset": "NVFP4 W4A4 + ReSET",
    "nvfp4_reset_thigh0.6": "NVFP4 + ReSET, T_high = 0.6",
    "nvfp4_reset_thigh0.8": "NVFP4 + ReSET, T_high = 0.8",
    "nvfp4_reset_current": "NVFP4 + ReSET, include_current",
}
TASKS = ("arithmetic", "countdown")  # rejax.data.tasks / rejax.data.countdown


def _training_text(task: str):
    """The task's training_text(problem, chat=...) (prompt, reference solution, end marker)."""
    if task == "countdown":
        from rejax.data import countdown

        return countdown.training_text
    return tasks.training_text


def _problems(task: str, split: str, n: int, seed: int, difficulty=None) -> list[dict]:
    """`n` problems of `split`; countdown ones of `difficulty` (None: the generator's default)."""
    if task == "countdown":
        from rejax.data import countdown

        return countdown.split(split, n, seed=seed, difficulty=difficulty or countdown.DEFAULT)
    return tasks.split(split, n, seed=seed)


def _difficulty(task: str, model: str):
    """The Countdown difficulty a checkpoint was trained on (its countdown_difficulty.json), or
    None (the default family; the bundled tiny model and the arithmetic task)."""
    if task != "countdown" or model == "tiny":
        return None
    from rejax.data import countdown

    return countdown.load_difficulty(model)


def _grading_task(task: str) -> str:
    return "countdown" if task == "countdown" else "math"


def _log(msg: str) -> None:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%H:%M:%S")
    print(f"[{stamp}] {msg}", flush=True)


def _environment() -> dict:
    import jax

    return dict(versions(), device_count=jax.device_count(), cpu_count=os.cpu_count())


def _weights_sha256(path: Path) -> dict:
    """sha256 of each safetensors file, so results can be matched to the shipped weights."""
    import hashlib

    return {
        f.name: hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(Path(path).glob("*.safetensors"))
    }


def _ci_text(c: dict) -> str:
    return f"{100 * c['avg']:.1f} [{100 * c['lo']:.1f}, {100 * c['hi']:.1f}]"


def _diff_text(d: dict) -> str:
    mark = "†" if d.get("method") == "newcombe" else ""  # footnoted under the table
    return f"{100 * d['diff']:+.1f} [{100 * d['lo']:+.1f}, {100 * d['hi']:+.1f}]{mark}"


def _rate_text(stats: dict, key: str) -> str:
    rate, ci = stats.get(f"rate_{key}"), stats.get(f"ci_{key}")
    if rate is None:
        return "n/a"
    if 0 < 100 * rate < 0.01 or 0 < 100 * ci[1] < 0.01:  # a few per million: keep the digits
        text = f"{100 * rate:.2g}% [{100 * ci[0]:.2g}, {100 * ci[1]:.2g}]"
    else:
        text = f"{100 * rate:.2f}% [{100 * ci[0]:.2f}, {100 * ci[1]:.2f}]"
    return f"{text} ({stats[f'off_{key}']}/{stats[f'n_{key}']})"


def _sampler(name: str, tau0: float, t_low: float, top_p: float):
    if name.startswith("nvfp4_reset"):
        t_high = {"nvfp4_reset_thigh0.6": 0.6, "nvfp4_reset_thigh0.8": 0.8}.get(name, 1.0)
        s = ev.parse_sampler("reset", t_low=t_low, tau0=tau0, t_high=t_high, top_p=top_p, window=32)
        return dataclasses.replace(s, include_current=name == "nvfp4_reset_current")
    return ev.parse_sampler("temp:0.6", top_p=top_p)


def _merge_observations(parts: list[dict], tau0: float) -> dict:
    """Pools per-chunk observation counts; CIs resample the problems of all chunks."""
    counts = np.concatenate([np.asarray(p["counts"]) for p in parts])
    nll = np.concatenate([np.asarray(p["nll_low"]) for p in parts])
    out = ev.summarize_observations(counts, nll)
    del out["counts"], out["nll_low"]  # per-problem arrays: too long for the results file
    out.update(tau0=tau0, n_responses=sum(p["n_responses"] for p in parts))
    return out


def _step_entropies(bf16, nvfp4, problems, tokens, args, chat):
    """Per-step mean raw entropy (nats) of the same responses under each model.

    The responses are teacher-forced through both models; steps follow ReSET's boundary rule
    (`rejax.text.step_spans`), so the two lists are aligned step by step.

    Returns:
        [("bf16", [step means]), ("nvfp4", [step means])].
    """
    tok = bf16.tokenizer.tokenizer
    nl, dnl = (np.asarray(m) for m in text.newline_masks(tok, bf16.cfg.vocab_size))
    seqs, spans = [], []
    for i, p in enumerate(problems):
        ids = text.encode_prompt(bf16, p["problem"], chat=chat)
        for r in range(i * args.n_samples, (i + 1) * args.n_samples):
            seqs.append(ids + list(tokens[r]))
            spans.append((len(ids) - 1, len(ids) - 1 + len(tokens[r])))
    out = []
    for name, model in (("bf16", bf16), ("nvfp4", nvfp4)):
        means = []
        for (a, b), seq, z in zip(spans, seqs, ev.teacher_forced_logits(model, seqs)):
            h = ev.processed_entropy(z[a:b], 1.0)  # T = 1, no top-p: the raw entropy
            for x, y in text.step_spans(seq[a + 1 : b + 1], nl, dnl):
                means.append(float(h[x:y].mean()))
        out.append((name, means))
    return out


def _step_summary(steps: dict, tau0: float) -> dict | None:
    b, q = np.asarray(steps["bf16"]), np.asarray(steps["nvfp4"])
    if not b.size:
        return None
    high = b >= tau0
    d = q[high] - b[high]
    return {
        "n_steps": int(b.size),
        "n_high_steps": int(high.sum()),
        "n_responses": steps.get("responses"),
        "median_bf16_high": float(np.median(b[high])) if high.any() else float("nan"),
        "median_nvfp4_high": float(np.median(q[high])) if high.any() else float("nan"),
        "frac_nvfp4_lower_high": float(np.mean(d < 0)) if high.any() else float("nan"),
        "mean_diff_high": float(d.mean()) if high.any() else float("nan"),
        "rule": "high-uncertainty step: BF16 step-mean raw entropy >= tau0",
    }


def _plot_observations(prefix: Path, res: dict, steps: dict, tau0: float) -> list[str]:
    """Claim (i): off-argmax rates at low-entropy positions per configuration; claim (ii):
    step-mean entropy of BF16 vs NVFP4 in high-uncertainty steps. Returns the file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    obs = res["test"]["observation"]
    names = list(obs)
    fig, ax = plt.subplots(figsize=(1.6 * len(names) + 2, 4))
    width = 0.38
    for j, (key, label) in enumerate((("low", "low-entropy"), ("low_symbolic", "low, symbolic"))):
        rates = [100 * (obs[c][f"rate_{key}"] or 0.0) for c in names]
        cis = [obs[c][f"ci_{key}"] or [0.0, 0.0] for c in names]
        err = [
            [r - 100 * lo for r, (lo, _) in zip(rates, cis)],
            [100 * hi - r for r, (_, hi) in zip(rates, cis)],
        ]
        x = np.arange(len(names)) + (j - 0.5) * width
        ax.bar(x, rates, width, yerr=err, capsize=3, label=label)
    ax.set_xticks(np.arange(len(names)), [LABELS[c] for c in names], rotation=20, ha="right")
    ax.set_ylabel("sampled token != BF16 argmax (%)")
    ax.set_title(f"low-entropy positions (BF16 entropy < tau0 = {tau0:.3g} nats)")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    off = Path(f"{prefix}_offargmax.png")
    fig.savefig(off, dpi=120)
    plt.close(fig)

    files = [off.name]
    b, q = np.asarray(steps["bf16"]), np.asarray(steps["nvfp4"])
    high = b >= tau0
    if high.any():
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        top = max(float(b[high].max()), float(q[high].max()), 1e-3)
        bins = np.linspace(0.0, top, 50)
        ax1.hist(b[high], bins=bins, histtype="step", lw=1.6, label=f"BF16 (n={high.sum()})")
        ax1.hist(q[high], bins=bins, histtype="step", lw=1.6, label="NVFP4 W4A4")
        ax1.set_xlabel("step-mean token entropy (nats)")
        ax1.set_ylabel("steps")
        ax1.set_title("high-uncertainty steps (BF16 step mean >= tau0)")
        ax1.legend()
        ax2.scatter(b[high], q[high], s=3, alpha=0.3)
        ax2.plot([0, top], [0, top], "k--", lw=1)
        ax2.set_xlabel("BF16 step-mean entropy (nats)")
        ax2.set_ylabel("NVFP4 step-mean entropy (nats)")
        ax2.set_title("same steps, teacher-forced through both models")
        fig.tight_layout()
        st = Path(f"{prefix}_step_entropy.png")
        fig.savefig(st, dpi=120)
        plt.close(fig)
        files.append(st.name)
    return files


def _markdown(res: dict) -> str:
    t = res["test"]
    s = res["settings"]
    configs = s["configs"]
    title = {"countdown": "Countdown search reasoner"}.get(s.get("task"), "Tiny reasoner")
    lines = [
        f"## {title}: BF16 vs NVFP4 W4A4 vs NVFP4 + ReSET",
        "",
        (
            f"{t['n_problems']} test problems x {s['n_samples']} samples (avg@{s['n_samples']}, %), "
            f"top-p {s['top_p']}, max {s['max_new_tokens']} new tokens; NVFP4 activation "
            f"scales {s.get('input_scales', 'dynamic')}; "
            f"tau0 = {res['calibration']['tau0']:.3g} nats (calibrated), "
            f"T_low = {res['t_low_selection']['chosen']} (validation), T_high 1.0, w 32. "
            "95% CIs: normal approximation over per-problem means; differences paired over "
            f"problems. Device: {res['environment']['device']} ({res['environment']['backend']}, "
            f"{res['environment']['cpu_count']} CPU cores)."
        ),
    ]
    if t["stopped_early"]:
        lines += [
            "",
            (
                f"**Partial run:** {t['n_problems']} of the {s['n_problems']} requested test "
                "problems were evaluated "
                + (
                    f"within the time budget ({s['time_budget']:.0f} s)."
                    if res.get("finished")
                    else "(the run was still going when this was written)."
                )
            ),
        ]
    lines += [
        "",
        (
            "| configuration | avg@n [95% CI] | vs NVFP4 T=0.6 (paired) | tokens/response | "
            "no answer |"
        ),
        "|---|---|---|---|---|",
    ]
    for name in configs:
        c = t["configs"][name]
        vs = "—" if name == "nvfp4_t0.6" else _diff_text(t["paired"][f"{name}_vs_nvfp4_t0.6"])
        lines.append(
            f"| {LABELS[name]} | {_ci_text(c['avg_at_n'])} | {vs} | "
            f"{c['mean_response_tokens']:.0f} | {100 * c['frac_no_answer']:.1f}% |"
        )
    newcombe = {
        LABELS[n]: t["paired"][f"{n}_vs_nvfp4_t0.6"]
        for n in configs
        if n != "nvfp4_t0.6" and t["paired"][f"{n}_vs_nvfp4_t0.6"].get("method") == "newcombe"
    }
    if newcombe:
        which = "; ".join(f"{k}: {100 * d['diff']:+.1f}" for k, d in newcombe.items())
        lines += [
            "",
            (
                f"† Every problem has the same paired difference against NVFP4 T = 0.6 ({which} "
                "points on every problem; +0.0 means the same number of correct samples on "
                "every problem), so the paired spread is zero; the interval shown is Newcombe's "
                "unpaired one, which is conservative."
            ),
        ]
    lines += [
        "",
        (
            "Observation (claim (i)): share of sampled tokens that differ from the BF16 argmax, "
            "by BF16 entropy at that position (teacher forcing through the BF16 model); low = "
            "BF16 entropy < tau0, symbolic = the BF16 argmax contains a digit. 95% bootstrap "
            "CIs over problems."
        ),
        "",
        "| samples from | low-entropy | low-entropy symbolic | high-entropy |",
        "|---|---|---|---|",
    ]
    for name in configs:
        o = t["observation"][name]
        lines.append(
            f"| {LABELS[name]} | {_rate_text(o, 'low')} | "
            f"{_rate_text(o, 'low_symbolic')} | {_rate_text(o, 'high')} |"
        )
    if res.get("step_entropy") and not res["step_entropy"]["n_high_steps"]:
        lines += ["", "Observation (claim (ii)): no step had a BF16 step-mean entropy >= tau0."]
    elif res.get("step_entropy"):
        st = res["step_entropy"]
        lines += [
            "",
            (
                f"Observation (claim (ii)): {st['n_high_steps']} high-uncertainty steps (BF16 "
                f"step-mean entropy >= tau0) of {st['n_steps']} steps of {st['n_responses']} BF16 "
                f"responses, teacher-forced through both models: median step-mean entropy BF16 "
                f"{st['median_bf16_high']:.3g} vs NVFP4 {st['median_nvfp4_high']:.3g} nats; "
                f"NVFP4 lower in {100 * st['frac_nvfp4_lower_high']:.1f}% of them "
                f"(paired mean difference NVFP4 - BF16 {st['mean_diff_high']:+.3g} nats). "
                f"Plots: {', '.join(res.get('plots', []))}."
            ),
        ]
    sel = res["t_low_selection"]
    grid = ", ".join(f"T_low {g['t_low']}: {_ci_text(g['avg_at_n'])}" for g in sel["grid"])
    lines += [
        "",
        (
            f"T_low selection (NVFP4 + ReSET, {sel['n_problems']} validation problems x "
            f"{sel['n_samples']}): {grid}."
        ),
        (
            f"Calibration: raw-entropy p80 {res['calibration']['tau0_raw']:.3g} nats "
            f"(processed-score p80 {res['calibration']['tau0_processed']:.3g}; BF16 raw p80 "
            f"{res['calibration']['bf16_tau0_raw']:.3g}) over {res['calibration']['n_tokens']} "
            "tokens."
        ),
        (
            f"Produced by `experiments/tiny_reasoner_accuracy.py --task {s.get('task', 'arithmetic')}`"
            f" in {res['wall_s'] / 60:.0f} min "
            f"(weights sha256 {next(iter(res['model_sha256'].values()), '?')[:12]})."
        ),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="checkpoint directory or 'tiny'")
    p.add_argument("--task", choices=TASKS, default="arithmetic", help="the problems' generator")
    p.add_argument(
        "--ablations",
        action="store_true",
        help="also NVFP4 + ReSET with T_high 0.6, 0.8 and with include_current=True",
    )
    p.add_argument(
        "--plots",
        action="store_true",
        help="write OUT_PREFIX_offargmax.png and OUT_PREFIX_step_entropy.png",
    )
    p.add_argument(
        "--step-chunks",
        type=int,
        default=2,
        help="test chunks whose BF16 samples feed the step-entropy comparison (--plots)",
    )
    p.add_argument(
        "--reset-json",
        default=None,
        help="write the calibrated tau_0 and the chosen T_low there (a model's reset.json)",
    )
    p.add_argument("--n-problems", type=int, default=1000, help="test problems")
    p.add_argument("--n-samples", type=int, default=8, help="samples per test problem")
    p.add_argument("--calib-problems", type=int, default=5, help="validation problems for tau0")
    p.add_argument("--n-val-problems", type=int, default=200, help="validation problems for T_low")
    p.add_argument("--n-val-samples", type=int, default=4, help="samples per validation problem")
    p.add_argument("--t-low-grid", type=float, nargs="+", default=[0.1, 0.3, 0.5])
    p.add_argument(
        "--input-scales",
        choices=("dynamic", "calibrated"),
        default="dynamic",
        help="NVFP4 activation global scales: per-row dynamic, or static ones calibrated "
        "(rejax.calibrate_input_scales, the ModelOpt recipe) on --scale-problems reference traces",
    )
    p.add_argument(
        "--scale-problems",
        type=int,
        default=32,
        help="validation problems (after the tau0 and T_low ones) whose reference traces "
        "calibrate the input scales",
    )
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument(
        "--batch-rows", type=int, default=256, help="rows (problems x samples) decoded together"
    )
    p.add_argument(
        "--chunk-problems",
        type=int,
        default=None,
        help="test problems per chunk (default: batch-rows // n-samples)",
    )
    p.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds; stop the test after the chunk that exceeds it",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue an earlier run of the same settings that stopped at its --time-budget: "
        "its tau0, T_low and finished test chunks come from OUT_PREFIX_state.json (written "
        "after every chunk), the test goes on from the next chunk",
    )
    p.add_argument(
        "--out-prefix",
        default=None,
        help="default: results/tiny_reasoner_accuracy (arithmetic), results/countdown_accuracy",
    )
    p.add_argument(
        "--calib-prefix",
        default=None,
        help="default: calibrate_tiny (arithmetic), calibrate_countdown (countdown)",
    )
    p.add_argument(
        "--render-only",
        action="store_true",
        help="rewrite OUT_PREFIX.md from an existing OUT_PREFIX.json and exit",
    )
    args = p.parse_args(argv)
    countdown = args.task == "countdown"
    if args.out_prefix is None:
        args.out_prefix = str(
            RESULTS / ("countdown_accuracy" if countdown else "tiny_reasoner_accuracy")
        )
    if args.calib_prefix is None:
        args.calib_prefix = "calibrate_countdown" if countdown else "calibrate_tiny"
    configs = CONFIGS + (ABLATIONS if args.ablations else ())
    if args.render_only:
        prefix = Path(args.out_prefix)
        Path(f"{prefix}.md").write_text(_markdown(json.loads(Path(f"{prefix}.json").read_text())))
        return 0
    for name in (
        "n_problems",
        "n_samples",
        "calib_problems",
        "n_val_problems",
        "n_val_samples",
        "max_new_tokens",
        "batch_rows",
        "scale_problems",
    ):
        if getattr(args, name) <= 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be positive")

    t_start = time.perf_counter()
    out_prefix = Path(args.out_prefix)
    out_prefix.parent.mkdir(parents=True, exist_ok=True)
    _log(f"loading {args.model} as bf16 and nvfp4 (W4A4, {args.input_scales} activation scales)")
    bf16 = cli.load_model(args.model, "bf16")
    nvfp4 = cli.load_model(args.model, "nvfp4")
    chat = has_chat_template(nvfp4)
    params = {name: bf16 if name.startswith("bf16") else nvfp4 for name in configs}
    grading_task = _grading_task(args.task)
    difficulty = _difficulty(args.task, args.model)
    if difficulty is not None:
        _log(f"problems of the checkpoint's training difficulty: {difficulty}")
    n_val = args.calib_problems + args.n_val_problems
    n_scale = args.scale_problems if args.input_scales == "calibrated" else 0
    val = _problems(args.task, "validation", n_val + n_scale, seed=args.seed, difficulty=difficulty)
    val, scale_problems = val[:n_val], val[n_val:]
    if scale_problems:
        # Static activation scales from reference traces no tau0 / T_low / test problem uses.
        from rejax.generate import calibrate_input_scales

        gen = _training_text(args.task)
        nvfp4 = calibrate_input_scales(nvfp4, [gen(p, chat=chat) for p in scale_problems])
        params = {name: bf16 if name.startswith("bf16") else nvfp4 for name in configs}
        _log(f"input scales calibrated on {len(scale_problems)} validation reference traces")
    test = _problems(args.task, "test", args.n_problems, seed=args.seed, difficulty=difficulty)
    res = {
        "settings": dict(
            vars(args),
            chat=chat,
            configs=list(configs),
            difficulty=None if difficulty is None else dataclasses.asdict(difficulty),
        ),
        "model_sha256": _weights_sha256(cli.resolve_model(args.model)),
        "environment": _environment(),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }

    chunk = args.chunk_problems or max(1, args.batch_rows // args.n_samples)
    state_path = Path(f"{out_prefix}_state.json")
    state = _load_state(state_path, res, args, chunk) if args.resume else None
    if state is not None:
        res.update(state["res"])
        tau0, t_low = res["calibration"]["tau0"], res["t_low_selection"]["chosen"]
        _log(
            f"resuming {state_path}: tau0 {tau0:.4g}, T_low {t_low}, "
            f"{state['done']} test problems done"
        )
    else:
        tau0, t_low = _calibrate_and_choose(
            args, res, bf16, nvfp4, val, chat, grading_task, out_prefix
        )
    steps = {"bf16": [], "nvfp4": [], "responses": 0}
    correct = {c: [] for c in configs}
    summaries = {c: [] for c in configs}
    observations = {c: [] for c in configs}
    done = 0
    if state is not None:
        correct, summaries, observations = (
            state["correct"],
            state["summaries"],
            state["observations"],
        )
        steps, done = state["steps"], state["done"]
    _test(args, res, configs, params, bf16, nvfp4, test, chunk, chat, grading_task, tau0, t_low,
          t_start, out_prefix, state_path, correct, summaries, observations, steps, done)  # fmt: skip
    return 0


def _calibrate_and_choose(args, res, bf16, nvfp4, val, chat, grading_task, out_prefix):
    """Steps 1 and 2: tau0 on the first validation problems, T_low on the next ones; fills
    res["calibration"] and res["t_low_selection"], writes --reset-json. Returns (tau0, t_low)."""
    countdown = args.task == "countdown"
    # 1. tau0 -----------------------------------------------------------------------------
    _log(f"calibrating tau0 on {args.calib_problems} validation problems (NVFP4, T=0.6)")
    cal = ev.calibrate_tau0(
        nvfp4,
        val,
        n_problems=args.calib_problems,
        max_new_tokens=args.max_new_tokens,
        key=args.seed,
        chat=chat,
    )
    cal_ref = ev.calibrate_tau0(
        bf16,
        val,
        n_problems=args.calib_problems,
        max_new_tokens=args.max_new_tokens,
        key=args.seed,
        chat=chat,
    )
    ev.write_calibration(
        out_prefix.parent,
        cal,
        cal_ref,
        quant="nvfp4",
        meta={
            "model": args.model,
            "data": f"rejax.data.{'countdown' if countdown else 'tasks'} validation split",
            "environment": res["environment"],
        },
        prefix=args.calib_prefix,
    )
    tau0 = cal["tau0"]
    res["calibration"] = {
        "tau0": tau0,
        "tau0_raw": cal["tau0_raw"],
        "tau0_processed": cal["tau0_processed"],
        "bf16_tau0_raw": cal_ref["tau0_raw"],
        "n_tokens": cal["n_tokens"],
        "files": f"{args.calib_prefix}.json / _entropies.npz / _entropy.png",
    }
    _log(
        f"tau0 = {tau0:.4f} nats (processed {cal['tau0_processed']:.4f}, "
        f"bf16 {cal_ref['tau0_raw']:.4f}) over {cal['n_tokens']} tokens"
    )

    # 2. T_low on validation -------------------------------------------------------------
    val_problems = val[args.calib_problems :]
    grid = []
    val_batch = max(1, args.batch_rows // args.n_val_samples)
    for t_low in args.t_low_grid:
        r = ev.evaluate(
            nvfp4,
            val_problems,
            _sampler("nvfp4_reset", tau0, t_low, args.top_p),
            n=args.n_val_samples,
            max_new_tokens=args.max_new_tokens,
            batch_size=val_batch,
            key=args.seed + 1,
            chat=chat,
            progress=False,
            task=grading_task,
        )
        grid.append(
            {
                "t_low": t_low,
                "avg_at_n": r.summary["avg_at_n"],
                "mean_response_tokens": r.summary["mean_response_tokens"],
                "wall_s": r.summary["wall_s"],
            }
        )
        _log(
            f"validation T_low={t_low}: avg@{args.n_val_samples} "
            f"{_ci_text(r.summary['avg_at_n'])} ({r.summary['wall_s']:.0f} s)"
        )
    best = max(grid, key=lambda g: (g["avg_at_n"]["avg"], -g["t_low"]))
    t_low = best["t_low"]
    res["t_low_selection"] = {
        "grid": grid,
        "chosen": t_low,
        "n_problems": len(val_problems),
        "n_samples": args.n_val_samples,
        "rule": "max avg@n; ties: smaller",
    }
    _log(f"chosen T_low = {t_low}")
    if args.reset_json:
        Path(args.reset_json).write_text(
            json.dumps(
                {
                    "tau_0": float(f"{tau0:.4g}"),
                    "t_low": t_low,
                    "source": (
                        f"tau_0: 80th percentile of the NVFP4 model's raw token entropy on "
                        f"{args.calib_problems} validation problems ({args.calib_prefix}.json); "
                        f"t_low chosen on {len(val_problems)} validation problems from "
                        f"{list(args.t_low_grid)} (experiments/tiny_reasoner_accuracy.py "
                        f"--task {args.task})"
                    ),
                },
                indent=2,
            )
            + "\n"
        )
        _log(f"wrote {args.reset_json}")
    return tau0, t_low


# settings a resumed run must share with the run it continues
_RESUME_KEYS = (
    "task", "n_problems", "n_samples", "calib_problems", "n_val_problems", "n_val_samples",
    "t_low_grid", "input_scales", "scale_problems", "top_p", "max_new_tokens", "seed",
    "ablations", "plots", "step_chunks",
)  # fmt: skip


def _load_state(path: Path, res: dict, args, chunk: int) -> dict:
    """The saved state of an earlier run with these settings (SystemExit with the reason when
    there is none or it does not match)."""
    if not path.is_file():
        raise SystemExit(f"--resume: no {path} (it is written after each test chunk)")
    state = json.loads(path.read_text())
    old = state["res"]["settings"]
    diff = [k for k in _RESUME_KEYS if old.get(k) != res["settings"].get(k)]
    if state["chunk"] != chunk:
        diff.append(f"chunk ({state['chunk']} problems, now {chunk})")
    if state["res"].get("model_sha256") != res["model_sha256"]:
        diff.append("model weights")
    if diff:
        raise SystemExit(f"--resume: {path} was written with other settings: {diff}")
    keep = ("settings", "calibration", "t_low_selection", "started")
    state["res"] = {k: state["res"][k] for k in keep if k in state["res"]}
    state["res"]["resumed"] = state["res"].pop("started", None)
    return state


def _test(args, res, configs, params, bf16, nvfp4, test, chunk, chat, grading_task, tau0, t_low,
          t_start, out_prefix, state_path, correct, summaries, observations, steps, done):  # fmt: skip
    """Steps 3 and 4: the test in chunks from problem `done` on (a multiple of `chunk`)."""
    t_test = time.perf_counter()
    first, stopped_early = done, False
    for k, start in enumerate(range(0, len(test), chunk)):
        if start < first:
            continue
        problems = test[start : start + chunk]
        key = args.seed * 1_000_003 + 17 + k  # same key for every configuration of a chunk
        for name in configs:
            r = ev.evaluate(
                params[name],
                problems,
                _sampler(name, tau0, t_low, args.top_p),
                n=args.n_samples,
                max_new_tokens=args.max_new_tokens,
                batch_size=chunk,
                key=key,
                chat=chat,
                progress=False,
                task=grading_task,
            )
            correct[name].extend(r.correct.tolist())
            summaries[name].append(r.summary)
            observations[name].append(
                ev.observation_stats(
                    bf16, problems, r.tokens, n=args.n_samples, tau0=tau0, chat=chat, seed=k
                )
            )
            if args.plots and name == "bf16_t0.6" and k < args.step_chunks:
                for model, out in _step_entropies(bf16, nvfp4, problems, r.tokens, args, chat):
                    steps[model].extend(out)
                steps["responses"] += len(r.tokens)
        done += len(problems)
        elapsed = time.perf_counter() - t_test
        accs = ", ".join(f"{c} {100 * np.mean(correct[c]):.1f}%" for c in configs)
        _log(f"test {done}/{len(test)} problems ({elapsed:.0f} s): {accs}")
        res["test"] = _test_summary(
            correct, summaries, observations, tau0, done, stopped_early=done < len(test)
        )
        if args.plots:
            res["step_entropy"] = _step_summary(steps, tau0)
        res["wall_s"] = time.perf_counter() - t_start
        _write(out_prefix, res)
        state = {"res": res, "chunk": chunk, "done": done, "correct": correct,
                 "summaries": summaries, "observations": observations, "steps": steps}  # fmt: skip
        state_path.write_text(json.dumps(state, default=_json_default) + "\n")
        if args.time_budget is not None and time.perf_counter() - t_start > args.time_budget:
            stopped_early = done < len(test)
            break
    res["test"] = _test_summary(
        correct, summaries, observations, tau0, done, stopped_early=stopped_early
    )
    res["wall_s"] = time.perf_counter() - t_start
    res["finished"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    if args.plots:
        res["step_entropy"] = _step_summary(steps, tau0)
        res["plots"] = _plot_observations(out_prefix, res, steps, tau0)
    _write(out_prefix, res)
    _log(f"wrote {out_prefix}.json and {out_prefix}.md")
    print(_markdown(res))


def _test_summary(correct, summaries, observations, tau0, done, *, stopped_early) -> dict:
    names = list(correct)
    configs = {}
    for name in names:
        s = summaries[name]
        tokens = sum(x["tokens_generated"] for x in s)
        rows = sum(x["n_problems"] * x["n"] for x in s)
        configs[name] = {
            "label": LABELS[name],
            "sampler": s[0]["sampler"],
            "avg_at_n": ev.avg_at_n_ci(correct[name]),
            "mean_response_tokens": tokens / rows,
            "frac_length_capped": sum(x["frac_length_capped"] * x["n_problems"] * x["n"] for x in s)
            / rows,
            "frac_no_answer": sum(x["frac_no_answer"] * x["n_problems"] * x["n"] for x in s) / rows,
            "tokens_generated": tokens,
            "decode_wall_s": sum(x["wall_s"] for x in s),
        }
    pairs = [(a, "nvfp4_t0.6") for a in names if a != "nvfp4_t0.6"] + [("nvfp4_reset", "bf16_t0.6")]
    paired = {f"{a}_vs_{b}": ev.paired_difference_ci(correct[a], correct[b]) for a, b in pairs}
    return {
        "n_problems": done,
        "stopped_early": stopped_early,
        "configs": configs,
        "paired": paired,
        "observation": {c: _merge_observations(observations[c], tau0) for c in names},
    }


def _write(prefix: Path, res: dict) -> None:
    Path(f"{prefix}.json").write_text(json.dumps(res, indent=2, default=_json_default) + "\n")
    Path(f"{prefix}.md").write_text(_markdown(res))


def _json_default(x):
    if isinstance(x, (np.floating, np.integer, np.bool_)):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    if dataclasses.is_dataclass(x):
        return dataclasses.asdict(x)
    raise TypeError(f"not JSON serializable: {type(x).__name__}")


if __name__ == "__main__":
    sys.exit(main())
