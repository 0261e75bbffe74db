"""avg@n with a confidence interval over problems, and the paired difference of two runs."""

from __future__ import annotations

import math
import statistics

import numpy as np

# ----------------------------------------------------------------------------------------------
# Metric


CI_METHODS = ("normal", "bootstrap", "wilson")


def _z(confidence: float) -> float:
    return statistics.NormalDist().inv_cdf(0.5 + confidence / 2)


def wilson_interval(p: float, n: int, *, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a proportion p observed over n units.

    Unlike the normal approximation it stays inside [0, 1], has non-zero width at p = 0 and
    p = 1 (10 of 10 gives [0.722, 1]) and is defined for n = 1.

    Args:
      p: the observed proportion in [0, 1].
      n: number of units (> 0).
      confidence: two-sided level in (0, 1).

    Returns:
      (lo, hi), fractions in [0, 1].
    """
    if n <= 0 or not 0.0 <= p <= 1.0:
        raise ValueError(f"wilson_interval needs 0 <= p <= 1 and n > 0, got p={p!r}, n={n!r}")
    z = _z(confidence)
    z2n = z * z / n
    center = (p + z2n / 2) / (1 + z2n)
    half = z / (1 + z2n) * math.sqrt(p * (1 - p) / n + z2n / (4 * n))
    return max(0.0, center - half), min(1.0, center + half)


def avg_at_n_ci(
    correct,
    *,
    confidence: float = 0.95,
    method: str = "normal",
    n_boot: int = 10_000,
    seed: int = 0,
) -> dict:
    """avg@n and its confidence interval, with problems as the sampling unit.

    avg@n = mean over problems of the per-problem fraction of correct samples (equal to
    correct / (problems * n) when every problem has n samples). The n samples of one problem
    are correlated, so the interval treats the per-problem means p_i as the i.i.d. draws:

      method "normal":    avg ± z * sd(p_i, ddof=1) / sqrt(P), z the normal quantile
                          (1.96 for 95%); clipped to [0, 1].
      method "bootstrap": percentile interval of the mean of p_i over `n_boot` resamples of
                          the problems with replacement (seeded).
      method "wilson":    Wilson score interval of avg over P units. Each p_i lies in [0, 1],
                          so var(p_i) <= avg * (1 - avg), the binomial variance this interval
                          assumes: it is conservative for n > 1.

    "normal" and "bootstrap" estimate the spread from the data; with one problem, or when
    every problem has the same mean (all right, all wrong), that estimate is zero or undefined
    and their interval would be empty or NaN. They then fall back to "wilson"; `method` in the
    result names the interval actually computed and `requested_method` the one asked for.

    Args:
      correct: bool/int array [P, n] (or a list of per-problem lists, ragged allowed).
      confidence: two-sided level in (0, 1).
      method: one of CI_METHODS.
      n_boot, seed: bootstrap resamples and their seed.

    Returns:
      {"avg", "lo", "hi", "se", "n_problems", "n_samples", "confidence", "method",
      "requested_method"}; avg/lo/hi are finite fractions in [0, 1]; se is the standard error
      of avg over problems (sd(p_i) / sqrt(P)), None for a single problem.
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if method not in CI_METHODS:
        raise ValueError(f"unknown CI method {method!r}; expected one of {CI_METHODS}")
    rows = [np.asarray(r, dtype=np.float64).reshape(-1) for r in correct]
    if not rows or any(r.size == 0 for r in rows):
        raise ValueError("avg_at_n_ci needs at least one problem with at least one sample")
    p = np.array([r.mean() for r in rows])
    n_problems = p.size
    avg = float(p.mean())
    se = float(p.std(ddof=1) / math.sqrt(n_problems)) if n_problems > 1 else None
    used = method
    if method != "wilson" and (n_problems < 2 or np.all(p == p[0])):
        used = "wilson"
    if used == "wilson":
        lo, hi = wilson_interval(min(max(avg, 0.0), 1.0), n_problems, confidence=confidence)
    elif used == "normal":
        z = _z(confidence)
        lo, hi = max(0.0, avg - z * se), min(1.0, avg + z * se)
    else:
        rng = np.random.default_rng(seed)
        idx = rng.integers(0, n_problems, size=(n_boot, n_problems))
        means = p[idx].mean(axis=1)
        alpha = (1 - confidence) / 2
        lo, hi = (float(q) for q in np.quantile(means, [alpha, 1 - alpha]))
    return {
        "avg": avg,
        "lo": float(lo),
        "hi": float(hi),
        "se": se,
        "n_problems": int(n_problems),
        "n_samples": int(sum(r.size for r in rows)),
        "confidence": confidence,
        "method": used,
        "requested_method": method,
    }


def paired_difference_ci(correct_a, correct_b, *, confidence: float = 0.95) -> dict:
    """avg@n(a) - avg@n(b) on the same problems, with a CI over problems.

    d_i = mean(a_i) - mean(b_i) per problem; the interval is mean(d) ± z * sd(d, ddof=1) /
    sqrt(P) ("normal"). Pairing removes the between-problem variance (difficulty) from the
    comparison. With one problem, or when every d_i is equal (both sides all right, say), that
    spread is zero or undefined; the interval is then Newcombe's hybrid score interval
    ("newcombe": the Wilson intervals of both sides over P problems combined), which ignores
    the pairing and so is conservative for positively correlated sides.

    Args:
      correct_a, correct_b: bool/int [P, n] (or per-problem lists) for the same P problems.
      confidence: two-sided level in (0, 1).

    Returns:
      {"diff", "lo", "hi", "se", "n_problems", "confidence", "method"} (finite fractions in
      [-1, 1]; se None for a single problem).
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    a = [np.asarray(r, np.float64).reshape(-1) for r in correct_a]
    b = [np.asarray(r, np.float64).reshape(-1) for r in correct_b]
    if len(a) != len(b) or not a:
        raise ValueError(f"need the same non-zero number of problems, got {len(a)} and {len(b)}")
    if any(x.size == 0 for x in a + b):
        raise ValueError("every problem needs at least one sample on both sides")
    pa = np.array([x.mean() for x in a])
    pb = np.array([y.mean() for y in b])
    d = pa - pb
    diff = float(d.mean())
    se = float(d.std(ddof=1) / math.sqrt(d.size)) if d.size > 1 else None
    if d.size > 1 and not np.all(d == d[0]):
        z = _z(confidence)
        lo, hi, method = diff - z * se, diff + z * se, "normal"
    else:
        ma, mb = float(pa.mean()), float(pb.mean())
        la, ua = wilson_interval(ma, d.size, confidence=confidence)
        lb, ub = wilson_interval(mb, d.size, confidence=confidence)
        lo = diff - math.sqrt((ma - la) ** 2 + (ub - mb) ** 2)
        hi = diff + math.sqrt((ua - ma) ** 2 + (mb - lb) ** 2)
        method = "newcombe"
    return {
        "diff": diff,
        "lo": max(-1.0, lo),
        "hi": min(1.0, hi),
        "se": se,
        "n_problems": int(d.size),
        "confidence": confidence,
        "method": method,
    }
