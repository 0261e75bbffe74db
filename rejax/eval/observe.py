"""The paper's observation statistics (claim (i)): how often low-entropy tokens of a quantized
model leave the BF16 model's argmax, with bootstrap CIs over problems."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rejax.eval.forcing import entropy_np, teacher_forced_logits
from rejax.text import encode_prompt, has_chat_template

# ----------------------------------------------------------------------------------------------
# Observation statistics (the paper's claim (i))


OBSERVATION_SETS = ("all", "low", "high", "low_symbolic")


def observation_stats(
    ref_params,
    problems: Sequence[dict],
    tokens: Sequence[Sequence[int]],
    *,
    n: int,
    tau0: float,
    chat: bool | None = None,
    n_boot: int = 2000,
    seed: int = 0,
) -> dict:
    """How often sampled tokens leave the reference (BF16) model's argmax, by reference entropy.

    Each response is teacher-forced through `ref_params`; at every generated position the
    reference entropy H_ref (raw, T=1, full vocabulary) and argmax are recorded. A position is
    *low-entropy* when H_ref < tau0 and *symbolic* when the reference argmax decodes to text
    containing a digit. For samples from the reference model itself the off-argmax rate is the
    sampler's own; for NVFP4 samples it adds the quantization's argmax flips (claim (i)).

    Args:
      ref_params: the BF16 model.
      problems: the problems the responses answer (`problem` field), in order.
      tokens: generated ids, problem-major: responses i*n .. i*n+n-1 answer problems[i].
      n: samples per problem.
      tau0: the low-entropy threshold (nats).

    Returns:
      `summarize_observations` of the per-problem counts: for all / low / high / low-symbolic
      positions the counts `n_*`, off-argmax counts `off_*`, rates `rate_*` and bootstrap 95%
      CIs over problems `ci_*`, the mean reference NLL of the sampled tokens at low-entropy
      positions, and `counts` (int [P, 4, 2]: positions and off-argmax per set) and
      `nll_low` (float [P, 2]: NLL sum and count) for merging runs.
    """
    if len(tokens) != len(problems) * n:
        raise ValueError(
            f"expected {len(problems)} problems x n={n} = {len(problems) * n} "
            f"responses, got {len(tokens)}"
        )
    if chat is None:
        chat = has_chat_template(ref_params)
    tok = ref_params.tokenizer.tokenizer
    v = ref_params.cfg.vocab_size
    digit = np.zeros((v,), bool)
    n_tok = tok.get_vocab_size(with_added_tokens=True)
    pieces = tok.decode_batch([[i] for i in range(min(v, n_tok))], skip_special_tokens=False)
    digit[: len(pieces)] = [any(c.isdigit() for c in s) for s in pieces]

    seqs, spans = [], []
    for i, p in enumerate(problems):
        ids = encode_prompt(ref_params, p["problem"], chat=chat)
        for r in range(i * n, (i + 1) * n):
            seqs.append(ids + list(tokens[r]))
            # logits at position j predict token j + 1: the generated tokens are predicted
            # from positions len(ids) - 1 .. len(ids) + len - 2
            spans.append((len(ids) - 1, len(ids) - 1 + len(tokens[r])))
    counts = np.zeros((len(problems), len(OBSERVATION_SETS), 2), np.int64)
    nll_low = np.zeros((len(problems), 2), np.float64)
    for s, ((a, b), z) in enumerate(zip(spans, teacher_forced_logits(ref_params, seqs))):
        if b == a:
            continue
        i = s // n
        z = z[a:b].astype(np.float64)
        y = np.asarray(seqs[s][a + 1 : b + 1])
        h = entropy_np(z)
        am = z.argmax(axis=-1)
        off = am != y
        low = h < tau0
        masks = (np.ones_like(low), low, ~low, low & digit[am])
        for k, m in enumerate(masks):
            counts[i, k] += (m.sum(), (off & m).sum())
        m = z.max(-1)
        nll = np.log(np.exp(z - m[:, None]).sum(-1)) + m - z[np.arange(len(y)), y]
        nll_low[i] += (nll[low].sum(), low.sum())
    out = summarize_observations(counts, nll_low, n_boot=n_boot, seed=seed)
    out.update(tau0=tau0, n_responses=len(seqs))
    return out


def summarize_observations(counts, nll_low, *, n_boot: int = 2000, seed: int = 0) -> dict:
    """Rates and bootstrap CIs (resampling problems) from `observation_stats` counts.

    Args:
      counts: int [P, 4, 2] per problem and set (`OBSERVATION_SETS`): (positions, off-argmax).
      nll_low: float [P, 2] per problem: (sum of reference NLL at low-entropy positions, count).

    Returns:
      dict with `n_<set>`, `off_<set>`, `rate_<set>` (None without positions) and `ci_<set>`
      (95% percentile interval of the pooled rate over `n_boot` resamples of the problems),
      `mean_ref_nll_low`, and the inputs as lists under `counts` / `nll_low`.
    """
    counts = np.asarray(counts, np.int64)
    nll_low = np.asarray(nll_low, np.float64)
    rng = np.random.default_rng(seed)
    boot = rng.integers(0, len(counts), size=(n_boot, len(counts)))
    out = {}
    for k, name in enumerate(OBSERVATION_SETS):
        c = counts[:, k]
        total, off = int(c[:, 0].sum()), int(c[:, 1].sum())
        out[f"n_{name}"] = total
        out[f"off_{name}"] = off
        out[f"rate_{name}"] = off / total if total else None
        out[f"ci_{name}"] = None
        if total:
            bt = c[boot].sum(axis=1)  # [n_boot, 2]
            with np.errstate(invalid="ignore", divide="ignore"):
                r = bt[:, 1] / bt[:, 0]
            lo, hi = np.nanquantile(r, [0.025, 0.975])
            out[f"ci_{name}"] = [float(lo), float(hi)]
    n_low = nll_low[:, 1].sum()
    out["mean_ref_nll_low"] = float(nll_low[:, 0].sum() / n_low) if n_low else None
    out["counts"] = counts.tolist()
    out["nll_low"] = nll_low.tolist()
    return out
