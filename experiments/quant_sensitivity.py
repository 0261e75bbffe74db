"""How much NVFP4 W4A4 moves a reasoner's next-token distribution on its own reference traces:
a minute-long proxy for the accuracy gap, to pick a model before the long sampling experiment.

Every reference trace (prompt + the generator's solution) of `--n-problems` validation problems
is teacher-forced through the BF16 model and the NVFP4 W4A4 one (static input scales calibrated
on the traces of the next `--scale-problems` validation problems, the ModelOpt recipe, or
per-row dynamic ones). Over the solution positions it reports:
  - argmax flips: positions where the NVFP4 argmax differs from the BF16 argmax, overall, at
    low-entropy positions (BF16 entropy < tau, the forced tokens ReSET cools) and at symbolic
    ones (the BF16 argmax contains a digit);
  - the share of traces with at least one low-entropy flip (a greedy NVFP4 decode leaves the
    BF16 path there: an upper bound on what quantization noise can cost);
  - mean KL(BF16 || NVFP4) and the entropies of both models at low- and high-entropy positions;
  - at low-entropy positions, the BF16 argmax's lead over the runner-up (median, 1st percentile)
    and how much NVFP4 moves it (std, most negative): their ratio says how far a model is from
    the flips the paper's claim (i) is about, even where none happens.
tau: `--tau` nats, else the 80th percentile of the BF16 entropies over these positions.

    PYTHONPATH=. python experiments/quant_sensitivity.py --model rejax/data/tiny
    PYTHONPATH=. python experiments/quant_sensitivity.py --model CKPT --task countdown \\
        --out experiments/results/countdown_quant_sensitivity.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_reasoner_accuracy as acc  # the task's problems, difficulty and reference texts

from rejax import cli
from rejax import eval as ev
from rejax.bench import versions
from rejax.text import has_chat_template


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    m = z.max(axis=-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(axis=-1, keepdims=True))


def _mean(x: np.ndarray) -> float | None:
    return float(x.mean()) if x.size else None


def _margin(logp: np.ndarray, top: np.ndarray) -> np.ndarray:
    """logp[i, top[i]] minus the largest other entry of row i."""
    rows = np.arange(len(top))
    other = logp.copy()
    other[rows, top] = -np.inf
    return logp[rows, top] - other.max(-1)


def sensitivity(bf16_logits, nvfp4_logits, spans, digit_ids, tau=None) -> dict:
    """The statistics above from per-trace logits [T_i, V] and solution spans (a, b): rows
    a..b-1 predict the solution tokens."""
    h_b, h_q, kl, flip, sym, tr, mb, mq = [], [], [], [], [], [], [], []
    for zb, zq, (a, b) in zip(bf16_logits, nvfp4_logits, spans):
        lb, lq = _log_softmax(zb[a:b]), _log_softmax(zq[a:b])
        pb = np.exp(lb)
        h_b.append(-(pb * lb).sum(-1))
        h_q.append(-(np.exp(lq) * lq).sum(-1))
        kl.append((pb * (lb - lq)).sum(-1))
        ab, aq = lb.argmax(-1), lq.argmax(-1)
        flip.append(ab != aq)
        mb.append(_margin(lb, ab))
        mq.append(_margin(lq, ab))
        sym.append(np.isin(ab, digit_ids))
        tr.append(np.full(b - a, len(tr)))
    h_b, h_q, kl, flip, sym, tr, mb, mq = map(np.concatenate, (h_b, h_q, kl, flip, sym, tr, mb, mq))
    tau = float(np.percentile(h_b, 80)) if tau is None else float(tau)
    low = h_b < tau

    def rate(sel):
        n = int(sel.sum())
        return {
            "flips": int((flip & sel).sum()),
            "positions": n,
            "rate": float((flip & sel).sum() / max(n, 1)),
        }

    # How far the forced tokens are from a flip: the BF16 argmax's lead over the runner-up
    # (nats), and how much NVFP4 moves that lead.
    shift = mq[low] - mb[low]
    noise = float(shift.std()) if shift.size else None
    p1 = float(np.percentile(mb[low], 1)) if shift.size else None
    margins = {
        "bf16_median": float(np.median(mb[low])) if shift.size else None,
        "bf16_p1": p1,
        "nvfp4_shift_std": noise,
        "nvfp4_shift_min": float(shift.min()) if shift.size else None,
        "p1_over_shift_std": p1 / noise if noise else None,
    }
    n_traces = len(spans)
    low_flip_traces = len(np.unique(tr[flip & low]))
    return {
        "tau": tau,
        "positions": len(h_b),
        "traces": n_traces,
        "argmax_flips": {
            "all": rate(np.ones_like(low)),
            "low_entropy": rate(low),
            "low_entropy_symbolic": rate(low & sym),
            "high_entropy": rate(~low),
        },
        "traces_with_low_entropy_flip": low_flip_traces / max(n_traces, 1),
        "low_entropy_margin_nats": margins,
        "mean_kl_nats": {
            "all": _mean(kl),
            "low_entropy": _mean(kl[low]),
            "high_entropy": _mean(kl[~low]),
        },
        "mean_entropy_nats": {
            "bf16_low": _mean(h_b[low]),
            "nvfp4_low": _mean(h_q[low]),
            "bf16_high": _mean(h_b[~low]),
            "nvfp4_high": _mean(h_q[~low]),
        },
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="checkpoint directory or 'tiny'")
    p.add_argument("--task", choices=acc.TASKS, default="arithmetic")
    p.add_argument("--n-problems", type=int, default=200, help="validation reference traces")
    p.add_argument("--input-scales", choices=("dynamic", "calibrated"), default="calibrated")
    p.add_argument("--scale-problems", type=int, default=32)
    p.add_argument("--tau", type=float, default=None, help="low-entropy threshold (nats)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON file (default: print only)")
    args = p.parse_args(argv)
    for name in ("n_problems", "scale_problems"):
        if getattr(args, name) <= 0:
            raise SystemExit(
                f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}"
            )
    t0 = time.perf_counter()
    bf16 = cli.load_model(args.model, "bf16")
    nvfp4 = cli.load_model(args.model, "nvfp4")
    chat = has_chat_template(bf16)
    difficulty = acc._difficulty(args.task, args.model)
    n_scale = args.scale_problems if args.input_scales == "calibrated" else 0
    val = acc._problems(args.task, "validation", args.n_problems + n_scale, args.seed, difficulty)
    problems, scale = val[: args.n_problems], val[args.n_problems :]
    text = acc._training_text(args.task)
    tok = bf16.tokenizer.tokenizer
    if scale:
        from rejax.generate import calibrate_input_scales

        nvfp4 = calibrate_input_scales(nvfp4, [text(q, chat=chat) for q in scale])
    seqs, spans = [], []
    for q in problems:
        prompt = acc.tasks.chat_prompt(q["problem"]) if chat else acc.tasks.raw_prompt(q["problem"])
        ids = tok.encode(text(q, chat=chat)).ids
        n_prompt = len(tok.encode(prompt).ids)
        seqs.append(ids)
        spans.append((n_prompt - 1, len(ids) - 1))
    zb = list(ev.teacher_forced_logits(bf16, seqs))
    zq = list(ev.teacher_forced_logits(nvfp4, seqs))
    vocab = tok.get_vocab()
    digits = np.array([i for s, i in vocab.items() if any(c.isdigit() for c in s)])
    res = sensitivity(zb, zq, spans, digits, args.tau)
    res["settings"] = vars(args)
    res["versions"] = versions()
    res["seconds"] = time.perf_counter() - t0
    print(json.dumps({k: v for k, v in res.items() if k != "versions"}, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    main()
