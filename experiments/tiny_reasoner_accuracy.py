"""Accuracy of the bundled tiny reasoner: BF16 vs NVFP4 W4A4 vs NVFP4 + ReSET, with 95% CIs,
plus the paper's observation statistics (claim (i): low-entropy tokens sampled off the BF16
argmax).

Protocol (the paper's recipe, §5, scaled to the tiny task):
  1. tau0: `rejax.eval.calibrate_tau0` on the NVFP4 model, the first `--calib-problems`
     validation problems, T = 0.6 (the raw full-vocabulary entropy ReSET thresholds); the BF16
     model on the same problems for the comparison plot.
  2. T_low: chosen on the next `--n-val-problems` validation problems only, from `--t-low-grid`,
     by avg@`--n-val-samples` of NVFP4 + ReSET (ties: the smaller T_low).
  3. Test: `--n-problems` test problems x `--n-samples` samples, top-p 0.95, for
        BF16 T=0.6 | NVFP4 W4A4 T=0.6 | NVFP4 W4A4 + ReSET (T_high 1.0, w 32, tau0, T_low),
     in chunks of problems; every configuration runs on every chunk with the same PRNG key
     (paired comparison), and a chunk's results are written as soon as it finishes. With
     `--time-budget` the test stops after the chunk that exhausts it, and the results say how
     many problems were evaluated.
  4. Observation statistics: every test response teacher-forced through the BF16 model;
     off-argmax rates at low-entropy positions (BF16 entropy < tau0), overall and at symbolic
     (digit) positions, with bootstrap CIs over responses.

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

from rejax import cli
from rejax import eval as ev
from rejax.bench import versions
from rejax.data import tasks
from rejax.text import has_chat_template

RESULTS = Path(__file__).resolve().parent / "results"
CONFIGS = ("bf16_t0.6", "nvfp4_t0.6", "nvfp4_reset")
LABELS = {
    "bf16_t0.6": "BF16, T = 0.6",
    "nvfp4_t0.6": "NVFP4 W4A4, T = 0.6",
    "nvfp4_reset": "NVFP4 W4A4 + ReSET",
}


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
    return f"{100 * d['diff']:+.1f} [{100 * d['lo']:+.1f}, {100 * d['hi']:+.1f}]"


def _rate_text(stats: dict, key: str) -> str:
    rate, ci = stats.get(f"rate_{key}"), stats.get(f"ci_{key}")
    if rate is None:
        return "n/a"
    return (
        f"{100 * rate:.2f}% [{100 * ci[0]:.2f}, {100 * ci[1]:.2f}] "
        f"({stats[f'off_{key}']}/{stats[f'n_{key}']})"
    )


def _sampler(name: str, tau0: float, t_low: float, top_p: float):
    if name == "nvfp4_reset":
        return ev.parse_sampler("reset", t_low=t_low, tau0=tau0, t_high=1.0, top_p=top_p, window=32)
    return ev.parse_sampler("temp:0.6", top_p=top_p)


def _merge_observations(parts: list[dict], tau0: float) -> dict:
    """Pools per-chunk observation counts; CIs resample the problems of all chunks."""
    counts = np.concatenate([np.asarray(p["counts"]) for p in parts])
    nll = np.concatenate([np.asarray(p["nll_low"]) for p in parts])
    out = ev.summarize_observations(counts, nll)
    del out["counts"], out["nll_low"]  # per-problem arrays: too long for the results file
    out.update(tau0=tau0, n_responses=sum(p["n_responses"] for p in parts))
    return out


def _markdown(res: dict) -> str:
    t = res["test"]
    s = res["settings"]
    lines = [
        "## Tiny reasoner: BF16 vs NVFP4 W4A4 vs NVFP4 + ReSET",
        "",
        (
            f"{t['n_problems']} test problems x {s['n_samples']} samples (avg@{s['n_samples']}, %), "
            f"top-p {s['top_p']}, max {s['max_new_tokens']} new tokens; "
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
    for name in CONFIGS:
        c = t["configs"][name]
        vs = "—" if name == "nvfp4_t0.6" else _diff_text(t["paired"][f"{name}_vs_nvfp4_t0.6"])
        lines.append(
            f"| {LABELS[name]} | {_ci_text(c['avg_at_n'])} | {vs} | "
            f"{c['mean_response_tokens']:.0f} | {100 * c['frac_no_answer']:.1f}% |"
        )
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
    for name in CONFIGS:
        o = t["observation"][name]
        lines.append(
            f"| {LABELS[name]} | {_rate_text(o, 'low')} | "
            f"{_rate_text(o, 'low_symbolic')} | {_rate_text(o, 'high')} |"
        )
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
            f"Produced by `experiments/tiny_reasoner_accuracy.py` in {res['wall_s'] / 60:.0f} min "
            f"(weights sha256 {next(iter(res['model_sha256'].values()), '?')[:12]})."
        ),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="checkpoint directory or 'tiny'")
    p.add_argument("--n-problems", type=int, default=1000, help="test problems")
    p.add_argument("--n-samples", type=int, default=8, help="samples per test problem")
    p.add_argument("--calib-problems", type=int, default=5, help="validation problems for tau0")
    p.add_argument("--n-val-problems", type=int, default=200, help="validation problems for T_low")
    p.add_argument("--n-val-samples", type=int, default=4, help="samples per validation problem")
    p.add_argument("--t-low-grid", type=float, nargs="+", default=[0.1, 0.3, 0.5])
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
    p.add_argument("--out-prefix", default=str(RESULTS / "tiny_reasoner_accuracy"))
    p.add_argument("--calib-prefix", default="calibrate_tiny")
    p.add_argument(
        "--render-only",
        action="store_true",
        help="rewrite OUT_PREFIX.md from an existing OUT_PREFIX.json and exit",
    )
    args = p.parse_args(argv)
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
    ):
        if getattr(args, name) <= 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be positive")

    t_start = time.perf_counter()
    out_prefix = Path(args.out_prefix)
    out_prefix.parent.mkdir(parents=True, exist_ok=True)
    _log(f"loading {args.model} as bf16 and nvfp4 (W4A4, dynamic activation scales)")
    bf16 = cli.load_model(args.model, "bf16")
    nvfp4 = cli.load_model(args.model, "nvfp4")
    chat = has_chat_template(nvfp4)
    params = {"bf16_t0.6": bf16, "nvfp4_t0.6": nvfp4, "nvfp4_reset": nvfp4}
    val = tasks.split("validation", args.calib_problems + args.n_val_problems, seed=args.seed)
    test = tasks.split("test", args.n_problems, seed=args.seed)
    res = {
        "settings": dict(vars(args), chat=chat, configs=list(CONFIGS)),
        "model_sha256": _weights_sha256(cli.resolve_model(args.model)),
        "environment": _environment(),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }

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
            "data": "rejax.data.tasks validation split",
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

    # 3 + 4. test, in chunks -------------------------------------------------------------
    chunk = args.chunk_problems or max(1, args.batch_rows // args.n_samples)
    correct = {c: [] for c in CONFIGS}
    summaries = {c: [] for c in CONFIGS}
    observations = {c: [] for c in CONFIGS}
    t_test = time.perf_counter()
    done, stopped_early = 0, False
    for k, start in enumerate(range(0, len(test), chunk)):
        problems = test[start : start + chunk]
        key = args.seed * 1_000_003 + 17 + k  # same key for every configuration of a chunk
        for name in CONFIGS:
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
            )
            correct[name].extend(r.correct.tolist())
            summaries[name].append(r.summary)
            observations[name].append(
                ev.observation_stats(
                    bf16, problems, r.tokens, n=args.n_samples, tau0=tau0, chat=chat, seed=k
                )
            )
        done += len(problems)
        elapsed = time.perf_counter() - t_test
        accs = ", ".join(f"{c} {100 * np.mean(correct[c]):.1f}%" for c in CONFIGS)
        _log(f"test {done}/{len(test)} problems ({elapsed:.0f} s): {accs}")
        res["test"] = _test_summary(
            correct, summaries, observations, tau0, done, stopped_early=done < len(test)
        )
        res["wall_s"] = time.perf_counter() - t_start
        _write(out_prefix, res)
        if args.time_budget is not None and time.perf_counter() - t_start > args.time_budget:
            stopped_early = done < len(test)
            break
    res["test"] = _test_summary(
        correct, summaries, observations, tau0, done, stopped_early=stopped_early
    )
    res["wall_s"] = time.perf_counter() - t_start
    res["finished"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    _write(out_prefix, res)
    _log(f"wrote {out_prefix}.json and {out_prefix}.md")
    print(_markdown(res))
    return 0


def _test_summary(correct, summaries, observations, tau0, done, *, stopped_early) -> dict:
    configs = {}
    for name in CONFIGS:
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
    paired = {
        f"{a}_vs_{b}": ev.paired_difference_ci(correct[a], correct[b])
        for a, b in (
            ("nvfp4_reset", "nvfp4_t0.6"),
            ("bf16_t0.6", "nvfp4_t0.6"),
            ("nvfp4_reset", "bf16_t0.6"),
        )
    }
    return {
        "n_problems": done,
        "stopped_early": stopped_early,
        "configs": configs,
        "paired": paired,
        "observation": {c: _merge_observations(observations[c], tau0) for c in CONFIGS},
    }


def _write(prefix: Path, res: dict) -> None:
    Path(f"{prefix}.json").write_text(json.dumps(res, indent=2, default=_json_default) + "\n")
    Path(f"{prefix}.md").write_text(_markdown(res))


def _json_default(x):
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if dataclasses.is_dataclass(x):
        return dataclasses.asdict(x)
    raise TypeError(f"not JSON serializable: {type(x).__name__}")


if __name__ == "__main__":
    sys.exit(main())
