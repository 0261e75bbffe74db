"""Effect of the fp8 KV cache (Config.kv_dtype="fp8") on the bundled tiny model, on CPU.

1. Logits: greedy responses of the bf16-cache model to test-split problems (at least
   `--min-tokens` generated tokens in all) are teacher-forced through the model once with a bf16
   cache and once with an fp8 cache (`rejax.generate.prefill(..., all_logits=True)`: every
   query attends over what the cache holds, as in decoding). Per generated token: relative
   logit error norm(l_fp8 - l_bf16) / norm(l_bf16), top-1 agreement, |entropy difference|
   (the quantity ReSET thresholds) and the max |logit difference|.
2. Free-running: the same prompts decoded greedily with each cache; identical responses.
3. Scale choice: the bf16 cache's keys and values quantized with the shipped scale (one per
   slot and kv head) and with one static scale per layer and kv head (amax over this very
   cache: an oracle calibration, the best a static scale can do); relative RMS error of each.
4. Accuracy: `rejax eval` (greedy, n = 1) on `--eval-problems` test problems, once per cache
   dtype; paired per-problem differences.

    PYTHONPATH=. python experiments/fp8_kv_cache.py          # a few minutes on one CPU core

Writes experiments/results/fp8_kv_cache.json and .md (with rejax.bench.versions()).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

import rejax
from rejax import bench, cli
from rejax.cache import dequantize_kv, init_cache, quantize_kv
from rejax.data import TINY_MODEL, tasks
from rejax.generate import prefill
from rejax.sampling import Greedy
from rejax.text import encode_prompt

RESULTS = Path(__file__).resolve().parent / "results"


def _with_kv(params, kv: str):
    return dataclasses.replace(params, cfg=dataclasses.replace(params.cfg, kv_dtype=kv))


def _entropy(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(-1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(-1, keepdims=True)
    return -(p * np.log(np.maximum(p, 1e-30))).sum(-1)


def _teacher_forced(params, seqs: list[list[int]]):
    """All-position logits [B, T, V] and the cache of right-padded sequences."""
    t = max(len(s) for s in seqs)
    tokens = np.zeros((len(seqs), t), np.int32)
    positions = np.full((len(seqs), t), -1, np.int32)
    for r, s in enumerate(seqs):
        tokens[r, : len(s)] = s
        positions[r, : len(s)] = np.arange(len(s))
    cache = init_cache(params.cfg, len(seqs), t, jnp.bfloat16)
    logits, cache = prefill(
        params, jnp.asarray(tokens), jnp.asarray(positions), cache, all_logits=True
    )
    return np.asarray(logits, np.float32), cache


def logit_effect(params, prompts: list[list[int]], responses: list[list[int]]) -> dict:
    seqs = [p + r for p, r in zip(prompts, responses)]
    ref, cache16 = _teacher_forced(params, seqs)
    got, _ = _teacher_forced(_with_kv(params, "fp8"), seqs)
    rel, agree, dent, dmax, tf_greedy = [], [], [], [], []
    for row, (p, r) in enumerate(zip(prompts, responses)):
        idx = np.arange(len(p) - 1, len(p) + len(r) - 1)  # logits predicting each response token
        a, b = ref[row, idx], got[row, idx]
        rel += list(np.linalg.norm(b - a, axis=-1) / np.linalg.norm(a, axis=-1))
        agree += list(a.argmax(-1) == b.argmax(-1))
        dent += list(np.abs(_entropy(a) - _entropy(b)))
        dmax += list(np.abs(b - a).max(-1))
        tf_greedy += list(a.argmax(-1) == np.asarray(r))
    rel, dent = np.asarray(rel), np.asarray(dent)
    return {
        "tokens": len(rel),
        "rel_err_mean": float(rel.mean()),
        "rel_err_median": float(np.median(rel)),
        "rel_err_p99": float(np.quantile(rel, 0.99)),
        "rel_err_max": float(rel.max()),
        "top1_agreement": float(np.mean(agree)),
        "top1_disagreements": int(len(agree) - np.sum(agree)),
        "entropy_abs_diff_mean": float(dent.mean()),
        "entropy_abs_diff_max": float(dent.max()),
        "logit_abs_diff_max": float(np.max(dmax)),
        "bf16_teacher_forced_argmax_equals_response": float(np.mean(tf_greedy)),
    }, cache16


def scale_choice(cache) -> dict:
    """Relative RMS error of per-slot-and-head vs static per-layer-and-head E4M3 scales."""
    out = {}
    live = np.asarray(cache.positions) >= 0  # [B, S]
    for name, x in (("k", cache.k), ("v", cache.v)):
        x = jnp.asarray(x, jnp.float32)  # [L, B, S, K, H]
        mask = live[None, :, :, None, None]
        per_slot = dequantize_kv(*quantize_kv(x), jnp.float32)
        amax = jnp.max(jnp.abs(jnp.where(mask, x, 0)), axis=(1, 2, 4))  # [L, K]
        scale = (amax / 448.0)[:, None, None, :, None]
        static = (x / scale).astype(jnp.float8_e4m3fn).astype(jnp.float32) * scale
        xm = np.asarray(x)[np.broadcast_to(mask, x.shape)]

        def rms_rel(y, xm=xm, mask=mask, x=x):
            d = np.asarray(y)[np.broadcast_to(mask, x.shape)] - xm
            return float(np.sqrt(np.mean(d**2) / np.mean(xm**2)))

        out[name] = {
            "per_slot_and_head": rms_rel(per_slot),
            "static_per_layer_and_head_oracle": rms_rel(static),
        }
    return out


def free_running(params, prompts, max_new: int, bf16_tokens) -> dict:
    out = rejax.generate(_with_kv(params, "fp8"), prompts, max_new_tokens=max_new, sampler=Greedy())
    same = [a == b for a, b in zip(out.tokens, bf16_tokens)]
    first = []
    for a, b in zip(out.tokens, bf16_tokens):
        n = min(len(a), len(b))
        diff = [i for i in range(n) if a[i] != b[i]]
        first.append(diff[0] if diff else (None if len(a) == len(b) else n))
    return {
        "rows": len(same),
        "identical_rows": int(sum(same)),
        "first_divergence_of_differing_rows": [f for f, s in zip(first, same) if not s],
    }


def run_eval(quant: str, kv: str, data: Path, max_new: int, workdir: Path) -> dict:
    summary = workdir / f"summary_{kv}.json"
    per = workdir / f"eval_{kv}.jsonl"
    argv = [
        "eval", "--task", "math", "--data", str(data), "--model", "tiny", "--quant", quant,
        "--kv-dtype", kv, "--sampler", "greedy", "--n", "1", "--max-new-tokens", str(max_new),
        "--no-progress", "--summary", str(summary), "--out", str(per),
    ]  # fmt: skip
    t0 = time.perf_counter()
    rc = cli.main(argv)
    if rc != 0:
        raise SystemExit(f"rejax {' '.join(argv)} exited {rc}")
    s = json.loads(summary.read_text())
    rows = [json.loads(line) for line in per.read_text().splitlines()]
    return {
        "command": "rejax " + " ".join(a if "/" not in a else Path(a).name for a in argv),
        "avg": s["avg_at_n"]["avg"],
        "ci": [s["avg_at_n"]["lo"], s["avg_at_n"]["hi"]],
        "wall_s": time.perf_counter() - t0,
        "correct": [r["n_correct"] for r in rows],
        "responses": [r["responses"][0] for r in rows],
    }


def verdict(result: dict) -> str:
    """One paragraph from the numbers: does fp8 change logits or accuracy measurably?"""
    worst = min(r["top1_agreement"] for r in result["logits"].values())
    rel = {q: r["rel_err_mean"] for q, r in result["logits"].items()}
    parts = [
        "mean relative logit error "
        + ", ".join(f"{v:.4f} ({q} weights)" for q, v in rel.items())
        + f", top-1 agreement >= {100 * worst:.2f}%"
    ]
    # a relative error above 0.1% is far above float32 rounding: a measurable change
    changed = worst < 1.0 or max(rel.values()) > 1e-3
    if "eval" in result:
        e = result["eval"]
        diff = 100 * (e["fp8"]["avg"] - e["bf16"]["avg"])
        parts.append(
            f"accuracy {100 * e['bf16']['avg']:.1f}% (bf16 cache) vs {100 * e['fp8']['avg']:.1f}% "
            f"(fp8), {diff:+.1f} points, {e['only_bf16'] + e['only_fp8']} problems graded "
            "differently"
        )
        changed = changed or e["only_bf16"] + e["only_fp8"] > 0
    parts.append(
        "the fp8 cache changes the logits (or accuracy) measurably, so it stays opt-in "
        '(Config.kv_dtype="fp8", `--kv-dtype fp8`)'
        if changed
        else "no measurable change on this model"
    )
    return "; ".join(parts) + "."


def _md(result: dict) -> str:
    lines = [
        "# FP8 KV cache on the bundled tiny model (CPU)",
        "",
        (
            '`Config(kv_dtype="fp8")`: E4M3 codes, one float32 scale (amax / 448) per slot and '
            "kv head. Produced by `experiments/fp8_kv_cache.py` (numbers in `fp8_kv_cache.json`)."
        ),
        "",
        "## Logits (teacher-forced bf16-cache greedy responses)",
        "",
        (
            "| weights | tokens | rel. error mean / p99 / max | top-1 agreement "
            "| mean / max abs. entropy diff (nats) | max abs. logit diff |"
        ),
        "|---|---|---|---|---|---|",
    ]
    for q, r in result["logits"].items():
        lines.append(
            f"| {q} | {r['tokens']} | {r['rel_err_mean']:.4f} / {r['rel_err_p99']:.4f} / "
            f"{r['rel_err_max']:.4f} | {100 * r['top1_agreement']:.2f}% "
            f"({r['top1_disagreements']} differ) | {r['entropy_abs_diff_mean']:.2e} / "
            f"{r['entropy_abs_diff_max']:.2e} | {r['logit_abs_diff_max']:.3f} |"
        )
    lines += ["", "## Free-running greedy decoding", ""]
    for q, r in result["free_running"].items():
        lines.append(
            f"- {q}: {r['identical_rows']} of {r['rows']} responses identical to the bf16 "
            f"cache's; first differing token of the others: "
            f"{r['first_divergence_of_differing_rows']}"
        )
    lines += ["", "## Scale choice (relative RMS error of the dequantized cache)", ""]
    lines += ["| tensor | per slot and head (shipped) | static per layer and head (oracle) |"]
    lines += ["|---|---|---|"]
    for name, r in result["scale_choice"].items():
        lines.append(
            f"| {name} | {r['per_slot_and_head']:.4f} | {r['static_per_layer_and_head_oracle']:.4f} |"
        )
    if "eval" in result:
        e = result["eval"]
        lines += ["", f"## Accuracy (`rejax eval`, {e['problems']} test problems, greedy)", ""]
        lines += ["| KV cache | accuracy [95% CI] | wall s |", "|---|---|---|"]
        for kv in ("bf16", "fp8"):
            r = e[kv]
            lines.append(
                f"| {kv} | {100 * r['avg']:.1f}% [{100 * r['ci'][0]:.1f}, {100 * r['ci'][1]:.1f}] "
                f"| {r['wall_s']:.0f} |"
            )
        lines += [
            "",
            (
                f"Paired: {e['both_right']} both right, {e['only_bf16']} only bf16, "
                f"{e['only_fp8']} only fp8, {e['identical_responses']} identical responses. "
                f"Command: `{e['bf16']['command']}` (and `--kv-dtype fp8`)."
            ),
        ]
    lines += ["", "## Verdict", "", result["verdict"], ""]
    return "\n".join(lines)


def _write(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quants", nargs="+", default=["bf16", "nvfp4"])
    ap.add_argument("--problems", type=int, default=24, help="prompts for the logit comparison")
    ap.add_argument("--min-tokens", type=int, default=1024)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--eval-problems", type=int, default=300, help="0 skips the eval")
    ap.add_argument("--eval-quant", default="nvfp4")
    ap.add_argument("--out", default=str(RESULTS / "fp8_kv_cache.json"))
    ap.add_argument(
        "--resume",
        action="store_true",
        help="keep the logit results already in --out; run the rest",
    )
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    problems = tasks.split("test", args.problems)
    out = Path(args.out)
    result = {"versions": bench.versions(), "args": vars(args), "logits": {}, "free_running": {}}
    if args.resume and out.exists():
        old = json.loads(out.read_text())
        for k in ("logits", "free_running", "scale_choice"):
            result[k] = old.get(k, result.get(k))
        result["resumed_from"] = old.get("versions", "an earlier run of this script")
    if "scale_choice" not in result or result["scale_choice"] is None:
        params = rejax.load(TINY_MODEL, quant=args.quants[0])
        prompts = [encode_prompt(params, p["problem"], chat=True) for p in problems]
        gen = rejax.generate(params, prompts, max_new_tokens=args.max_new_tokens, sampler=Greedy())
        seqs = [p + r for p, r in zip(prompts, gen.tokens)]
        result["scale_choice"] = scale_choice(_teacher_forced(params, seqs)[1])
        print("scale choice", result["scale_choice"], flush=True)
    for quant in args.quants:
        if quant in result["logits"]:
            continue
        params = rejax.load(TINY_MODEL, quant=quant)
        prompts = [encode_prompt(params, p["problem"], chat=True) for p in problems]
        gen = rejax.generate(params, prompts, max_new_tokens=args.max_new_tokens, sampler=Greedy())
        total = sum(len(t) for t in gen.tokens)
        if total < args.min_tokens:
            raise SystemExit(f"{total} generated tokens < --min-tokens {args.min_tokens}")
        result["logits"][quant], _ = logit_effect(params, prompts, gen.tokens)
        result["free_running"][quant] = free_running(
            params, prompts, args.max_new_tokens, gen.tokens
        )
        print(quant, result["logits"][quant], result["free_running"][quant], flush=True)
        _write(out, result)  # a partial result survives a timeout (--resume)
    if args.eval_problems:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            data = tmp / "test_problems.jsonl"
            tasks.write_jsonl(tasks.split("test", args.eval_problems, seed=1), data)
            runs = {
                kv: run_eval(args.eval_quant, kv, data, args.max_new_tokens, tmp)
                for kv in ("bf16", "fp8")
            }
        a, b = np.asarray(runs["bf16"]["correct"]), np.asarray(runs["fp8"]["correct"])
        result["eval"] = {
            "problems": args.eval_problems,
            "quant": args.eval_quant,
            "both_right": int(((a > 0) & (b > 0)).sum()),
            "only_bf16": int(((a > 0) & (b == 0)).sum()),
            "only_fp8": int(((a == 0) & (b > 0)).sum()),
            "identical_responses": int(
                sum(x == y for x, y in zip(runs["bf16"]["responses"], runs["fp8"]["responses"]))
            ),
            **{
                kv: {k: v for k, v in r.items() if k not in ("correct", "responses")}
                for kv, r in runs.items()
            },
        }
    result["verdict"] = verdict(result)
    result["wall_s"] = time.perf_counter() - t0
    _write(out, result)
    out.with_suffix(".md").write_text(_md(result))
    print(f"wrote {out} and {out.with_suffix('.md')} ({result['wall_s']:.0f} s)")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
