"""τ0 calibration (the paper's recipe): sample at T = 0.6, take a percentile of all token
entropies; `write_calibration` writes the result, the entropies and a plot."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from rejax import sampling
from rejax.eval.forcing import entropy_np, processed_entropy, teacher_forced_logits
from rejax.eval.samplers import describe_sampler
from rejax.generate import generate
from rejax.text import encode_prompt, has_chat_template

# The calibration recipe (the paper's recipe): T = 0.6 sampling, 80th percentile of all entropies.
CALIBRATION_TEMPERATURE = 0.6
CALIBRATION_PERCENTILE = 80.0


# ----------------------------------------------------------------------------------------------
# τ0 calibration (the paper's recipe)


def _generation_setting(params, name, default):
    return dict(params.generation_config).get(name, default)


def calibrate_tau0(
    params,
    problems: Sequence[dict],
    *,
    n_problems: int = 5,
    max_new_tokens: int = 4096,
    temperature: float = CALIBRATION_TEMPERATURE,
    top_p: float | None = None,
    top_k: int | None = None,
    percentile: float = CALIBRATION_PERCENTILE,
    key: int = 0,
    chat: bool | None = None,
    processed: bool = True,
) -> dict:
    """τ0 = a percentile of all token entropies the model produces on calibration problems.

    Samples one response per problem at `temperature` (the paper: NVFP4 model, T = 0.6, the
    checkpoint's generation_config top-k / top-p), concatenates the raw full-vocabulary T=1
    entropy of every generated token (what ReSET thresholds: `Generation.entropy`) and takes
    its `percentile`-th percentile (numpy linear interpolation). With `processed=True` the
    responses are also teacher-forced through the same model to get the entropy of the
    processed distribution (T, top-k, top-p; what HF `output_scores` hold) and its percentile;
    the raw one is the τ0 this function returns.

    Args:
      params: the model to calibrate (the NVFP4 one for ReSET).
      problems: dicts with `problem`; the first `n_problems` are used.
      top_p, top_k: None = the generation_config's value (else 0.95 and 0).

    Returns:
      dict with `tau0` (= `tau0_raw`), `tau0_processed` (or None), `percentile`, `n_tokens`,
      `entropy_raw` (float32 array of all token entropies), `entropy_processed` (or None),
      `response_lengths`, `sampler`, `teacher_forced_max_abs_diff` (raw entropy recomputed from
      teacher-forced logits vs the decode loop's; a consistency check), `used` = "raw".
    """
    if not isinstance(n_problems, int) or n_problems <= 0:
        raise ValueError(f"n_problems must be a positive int, got {n_problems!r}")
    if len(problems) < n_problems:
        raise ValueError(f"calibration needs {n_problems} problems, the data holds {len(problems)}")
    if not 0 < percentile < 100:
        raise ValueError(f"percentile must be in (0, 100), got {percentile}")
    if chat is None:
        chat = has_chat_template(params)
    top_p = float(_generation_setting(params, "top_p", 0.95) if top_p is None else top_p)
    top_k = int(_generation_setting(params, "top_k", 0) if top_k is None else top_k)
    top_k = min(top_k, params.cfg.vocab_size)
    sampler = sampling.Temperature(t=temperature, top_p=top_p, top_k=top_k)
    texts = [p["problem"] for p in problems[:n_problems]]
    gen = generate(
        params,
        texts,
        max_new_tokens=max_new_tokens,
        sampler=sampler,
        key=key,
        n=1,
        chat=chat,
        progress=False,
    )
    raw = np.concatenate([np.asarray(e, np.float32) for e in gen.entropy])
    if raw.size == 0:
        raise ValueError("calibration generated no tokens")
    out = {
        "tau0": float(np.percentile(raw, percentile)),
        "tau0_raw": float(np.percentile(raw, percentile)),
        "tau0_processed": None,
        "used": "raw",
        "percentile": percentile,
        "n_problems": n_problems,
        "n_tokens": int(raw.size),
        "entropy_raw": raw,
        "entropy_processed": None,
        "response_lengths": [len(t) for t in gen.tokens],
        "sampler": describe_sampler(sampler),
        "max_new_tokens": max_new_tokens,
        "chat": chat,
        "seed": key,
        "teacher_forced_max_abs_diff": None,
    }
    if processed:
        seqs, spans = [], []
        for text, toks in zip(texts, gen.tokens):
            ids = encode_prompt(params, text, chat=chat)
            seqs.append(ids + list(toks))
            spans.append((len(ids) - 1, len(ids) - 1 + len(toks)))
        proc, diff = [], 0.0
        for (a, b), z, ent in zip(spans, teacher_forced_logits(params, seqs), gen.entropy):
            zr = z[a:b]  # logits that predicted each generated token
            proc.append(processed_entropy(zr, temperature, top_p, top_k))
            if b > a:
                diff = max(diff, float(np.max(np.abs(entropy_np(zr) - np.asarray(ent)))))
        proc = np.concatenate(proc)
        out["entropy_processed"] = proc
        out["tau0_processed"] = float(np.percentile(proc, percentile))
        out["teacher_forced_max_abs_diff"] = diff
    return out


def write_calibration(
    out_dir: str | Path,
    result: dict,
    reference: dict | None = None,
    *,
    quant: str = "nvfp4",
    meta: dict | None = None,
    prefix: str = "calibrate",
) -> list[Path]:
    """Writes a calibration (`calibrate_tau0` results) to `out_dir`.

    Files: `{prefix}.json` (τ0 values, settings, `meta`), `{prefix}_entropies.npz` (every token
    entropy: `<quant>_raw`, `<quant>_processed`, and `bf16_*` for the reference) and
    `{prefix}_entropy.png` (histograms of the reference vs the calibrated model with the
    percentile marked; skipped with a message on stderr when matplotlib is not installed).

    Returns:
      the paths written.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = {quant: result} if reference is None else {"bf16": reference, quant: result}
    arrays = {}
    for name, r in runs.items():
        arrays[f"{name}_raw"] = np.asarray(r["entropy_raw"], np.float32)
        if r.get("entropy_processed") is not None:
            arrays[f"{name}_processed"] = np.asarray(r["entropy_processed"], np.float32)
    npz = out_dir / f"{prefix}_entropies.npz"
    np.savez_compressed(npz, **arrays)

    def _public(r):
        return {k: v for k, v in r.items() if not k.startswith("entropy_")}

    summary = dict(meta or {})
    summary.update(
        tau0=result["tau0"],
        used=result["used"],
        quant=quant,
        calibration=_public(result),
        reference_bf16=None if reference is None else _public(reference),
        entropy_stats={k: _describe(v) for k, v in arrays.items()},
        files={"entropies": npz.name},
    )
    files = [npz]
    png = out_dir / f"{prefix}_entropy.png"
    try:
        _plot_entropies(png, runs, quant, result["percentile"])
        summary["files"]["plot"] = png.name
        files.append(png)
    except ImportError:
        print(
            "rejax calibrate: matplotlib is not installed, skipping the entropy plot "
            "(pip install matplotlib)",
            file=sys.stderr,
        )
    js = out_dir / f"{prefix}.json"
    js.write_text(json.dumps(summary, indent=2) + "\n")
    return [js, *files]


def _describe(x: np.ndarray) -> dict:
    q = np.percentile(x, [50, 80, 90, 99]) if x.size else [math.nan] * 4
    return {
        "n": int(x.size),
        "mean": float(x.mean()) if x.size else None,
        "p50": float(q[0]),
        "p80": float(q[1]),
        "p90": float(q[2]),
        "p99": float(q[3]),
        "frac_below_0.1": float(np.mean(x < 0.1)) if x.size else None,
    }


def _plot_entropies(path: Path, runs: dict, quant: str, percentile: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [k for k in ("raw", "processed") if all(k in _kinds(r) for r in runs.values())]
    fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        top = max(float(np.max(r[f"entropy_{kind}"])) for r in runs.values())
        bins = np.linspace(0.0, max(top, 1e-3), 60)
        for (name, r), color in zip(runs.items(), ("tab:blue", "tab:red")):
            h = np.asarray(r[f"entropy_{kind}"])
            q = float(np.percentile(h, percentile))
            ax.hist(
                h,
                bins=bins,
                density=True,
                histtype="step",
                lw=1.6,
                color=color,
                label=f"{name} (n={h.size}, p{percentile:g}={q:.3g})",
            )
            ax.axvline(q, color=color, ls="--", lw=1)
        ax.set_yscale("log")
        ax.set_xlabel("token entropy (nats)")
        ax.set_ylabel("density")
        title = "raw logits, T=1, full vocabulary" if kind == "raw" else "processed scores"
        ax.set_title(f"{title} (tau0 = {quant} p{percentile:g})" if kind == "raw" else title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _kinds(r: dict) -> set:
    return {k for k in ("raw", "processed") if r.get(f"entropy_{k}") is not None}
