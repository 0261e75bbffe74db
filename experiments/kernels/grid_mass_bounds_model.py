"""The grid kernel's keep tests from mass ranges (`sampler_grid_mass_bounds.patch`), modelled in
NumPy: how often a row still needs the exact sweep, and that the ranges never give a verdict the
exact sums would not.

The patch builds, in the scoring sweep, a histogram of estimated integer masses (2**y by
ex2.approx, y = zt log2 e + 30 - log2 den) over NB bins of the tempered logit on [-21.5, 0].
For candidate x (tempered logit zx, probability key kx) the bins above mass_bin(zx + 1e-4) hold
only tokens ranked above x, and every token ranked above x sits in the bins from
mass_bin(zx - 1e-4) up; with each sum s of estimates within MASS_ERR(s) = s // 2**15 + V + 2 of
the exact sum, the mass above x and the total lie in known ranges. x is kept when even the
most mass above it is below top_p x the least total, rejected when even the least is not below
top_p x the most total, and otherwise "open": the kernel then sweeps the row again for x's exact
sums. The draw is the first candidate (best Gumbel score first) kept.

This replays that on rows of the kinds `bench_sampler.py` times (float32 as the kernel computes
it; the Gumbel scores from NumPy's generator, the candidates the row's NC best): per row the
exact path's token, the ranges' token (the same, or the check fails), and whether the row
opened a candidate. The kernel runs the open rows' extra sweep while the other rows of the
launch are done, so the cost is about one sweep of a row whenever any row of a launch opens.

    python experiments/kernels/grid_mass_bounds_model.py --rows 200
"""

from __future__ import annotations

import argparse

import numpy as np

F32 = np.float32
NB, NC = 2048, 4
KEY_LO = F32(2.0**-31)
BAND = F32(1e-4)
BIN_SCALE = F32((F32(NB) - F32(0.5)) / F32(21.5))
LOG2E = F32(1.44269504)


def mass_bin(zt: np.ndarray) -> np.ndarray:
    """The kernel's mass_bin: fma(zt, BIN_SCALE, NB - 1/2) rounded once to float32, truncated
    with saturation at 0, at most NB - 1."""
    y = (zt.astype(np.float64) * np.float64(BIN_SCALE) + (NB - 0.5)).astype(F32)
    b = np.trunc(np.maximum(y, F32(0.0)))
    return np.minimum(b, NB - 1).astype(np.int64)


def mass_err(s: np.ndarray | int, vocab: int) -> np.ndarray:
    """MASS_ERR(s): the most a sum of n <= vocab estimates may differ from the exact sum."""
    s = np.asarray(s, dtype=np.int64)
    return (s >> 15) + vocab + 2


def limits(t_est: int, top_p: float, vocab: int) -> tuple[np.float32, np.float32]:
    """top_p x the least and the most total (float32, as the kernel's limit_lo / limit_hi)."""
    e = int(mass_err(t_est, vocab))
    return (F32(F32(top_p) * F32(max(t_est - e, 0))), F32(F32(top_p) * F32(t_est + e)))


def range_verdict(s_above: int, s_band: int, w_x: int, t_est: int, top_p: float, vocab: int) -> str:
    """ "kept", "rejected" or "open" for a candidate of exact mass w_x whose estimated sums are
    s_above (the bins above its band) and s_band (its band and up), with t_est the estimated
    total: the kernel's test, in float32."""
    limit_lo, limit_hi = limits(t_est, top_p, vocab)
    least = max(s_above - int(mass_err(s_above, vocab)), 0)
    most = s_band + int(mass_err(s_band, vocab)) - w_x
    if F32(most) < limit_lo:
        return "kept"
    if not F32(least) < limit_hi:
        return "rejected"
    return "open"


def row_masses(z: np.ndarray, t: float):
    """(zt, keys, exact masses, estimated masses) of logits z at temperature t, float32 as the
    kernel computes them (den from a float64 sum)."""
    z = z.astype(F32)
    m = z.max()
    it = F32(F32(1.0) / F32(t))
    zt = ((z - m) * it).astype(F32)
    den = F32(np.exp(zt.astype(np.float64)).sum())
    iden = F32(F32(1.0) / den)
    zt_cut = F32(F32(np.log(den)) - F32(21.487563) - F32(0.01))
    key = (np.exp(zt).astype(F32) * iden).astype(F32)
    live = (zt >= zt_cut) & (key > KEY_LO)
    w = np.where(live, np.rint(key.astype(np.float64) * 2.0**30), 0).astype(np.int64)
    mass_log2 = F32(F32(30.0) - F32(np.log2(den)))
    y = (zt.astype(np.float64) * np.float64(LOG2E) + np.float64(mass_log2)).astype(F32)
    est = np.rint(np.exp2(y.astype(np.float64)).astype(F32)).astype(np.int64)
    est[~(zt >= zt_cut)] = 0  # below zt_cut the estimate is < 0.5 (the kernel adds 0)
    return zt, key, w, est


def row_verdicts(
    z: np.ndarray,
    t: float,
    top_p: float,
    rng: np.random.Generator,
    *,
    est_skew: float = 0.0,
    above_from_band: bool = False,
) -> dict:
    """The exact path's and the ranges' draw for one row. `est_skew` scales every estimate by
    (1 + est_skew) and moves it 1 (the error MASS_ERR allows for a token, either sign);
    `above_from_band` is a planted bug (the least mass above x counted from x's band)."""
    v = len(z)
    zt, key, w, est = row_masses(z, t)
    if est_skew:
        est = np.maximum(np.rint(est * (1.0 + est_skew)) + np.sign(est_skew) * (est > 0), 0)
        est = est.astype(np.int64)
    ids = np.arange(v)
    score = zt.astype(np.float64) + rng.gumbel(size=v)
    cand = np.argsort(-score, kind="stable")[:NC]
    # the exact keep rule: mass ranked above x (larger key, or equal key and higher id)
    order = np.lexsort((ids, key))  # ascending rank
    above_of = np.empty(v, dtype=np.int64)
    cum = np.cumsum(w[order][::-1])  # mass of the token and everything ranked above it
    above_of[order[::-1]] = cum - w[order][::-1]
    total = int(w.sum())
    limit = F32(F32(top_p) * F32(total))
    exact_kept = [bool(key[x] > KEY_LO and F32(above_of[x]) < limit) for x in cand]
    # the ranges
    bins = mass_bin(zt)
    hist = np.bincount(bins, weights=est, minlength=NB).astype(np.int64)
    suffix = np.concatenate([np.cumsum(hist[::-1])[::-1], [0]])  # suffix[b] = sum of bins >= b
    t_est = int(hist.sum())
    verdicts = []
    for x in cand:
        if not key[x] > KEY_LO:
            verdicts.append("rejected")
            continue
        lb = int(mass_bin(np.array([zt[x] - BAND], F32))[0])
        hb = int(mass_bin(np.array([zt[x] + BAND], F32))[0])
        # the band's claims: above it only larger keys; every token ranked above x from lb up
        assert (key[bins > hb] > key[x]).all()
        ranked_above = (key > key[x]) | ((key == key[x]) & (ids > x))
        assert (bins[ranked_above] >= lb).all()
        s_above = int(suffix[lb if above_from_band else hb + 1])
        verdicts.append(range_verdict(s_above, int(suffix[lb]), int(w[x]), t_est, top_p, v))
    # the draws: the first kept candidate; an open one takes the exact verdict
    exact_draw = next((int(x) for x, k in zip(cand, exact_kept) if k), None)
    range_draw, opened = None, 0
    for x, vd, k in zip(cand, verdicts, exact_kept):
        if vd == "open":
            opened += 1
            vd = "kept" if k else "rejected"
        if vd == "kept":
            range_draw = int(x)
            break
    wrong = sum((vd == "kept" and not k) or (vd == "rejected" and k)
                for vd, k in zip(verdicts, exact_kept))  # fmt: skip
    return {"exact": exact_draw, "ranges": range_draw, "opened": opened, "wrong": wrong}


def rows(kind: str, count: int, vocab: int, seed: int = 0, npz: str | None = None):
    """Rows of `kind`: "flat" N(0, 1), "lm" 2 x Gumbel (bench_sampler.py's), "ties" (every
    logit equal but a few), or "npz": the rows of the first array in file `npz` ([R, vocab]),
    in turn (each call of row_verdicts draws new candidates)."""
    rng = np.random.default_rng(seed)
    if kind == "npz":
        with np.load(npz) as f:
            saved = np.asarray(f[f.files[0]], F32).reshape(-1, vocab)
        for i in range(count):
            yield saved[i % len(saved)]
        return
    for _ in range(count):
        if kind == "flat":
            yield rng.standard_normal(vocab).astype(F32)
        elif kind == "lm":
            yield (2.0 * rng.gumbel(size=vocab)).astype(F32)
        elif kind == "ties":
            z = np.zeros(vocab, F32)
            z[rng.choice(vocab, 8, replace=False)] = 3.0
            yield z
        else:
            raise ValueError(f"kind={kind!r}: expected flat, lm or ties")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=200, help="random rows per kind and temperature")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.6, 1.0, 0.1])
    ap.add_argument("--kinds", nargs="+", default=["flat", "lm", "ties"],
                    choices=["flat", "lm", "ties", "npz"])  # fmt: skip
    ap.add_argument("--npz", default=None,
                    help="kind npz: saved logits rows, e.g. experiments/results/h200_r/"
                    "call2_model_logits.npz (the 36-layer random model's decode-loop rows)")  # fmt: skip
    args = ap.parse_args(argv)
    if "npz" in args.kinds and not args.npz:
        ap.error("--kinds npz needs --npz PATH")
    if args.rows < 1:
        ap.error(f"--rows={args.rows}: expected >= 1")
    if not 0.0 < args.top_p < 1.0:
        ap.error(f"--top-p={args.top_p}: expected in (0, 1) (1 draws without a keep test)")
    if args.vocab < 8 * NC:
        ap.error(f"--vocab={args.vocab}: expected >= {8 * NC}")
    for kind in args.kinds:
        for t in args.temperatures:
            if not t > 0:
                ap.error(f"--temperatures: {t} is not > 0")
            rng = np.random.default_rng(1)
            zs = rows(kind, args.rows, args.vocab, npz=args.npz)
            res = [row_verdicts(z, t, args.top_p, rng) for z in zs]
            assert all(r["exact"] == r["ranges"] for r in res), "the ranges changed a draw"
            assert not any(r["wrong"] for r in res), "a range verdict differs from the exact one"
            p = sum(r["opened"] > 0 for r in res) / len(res)
            print(f"{kind:5s} T={t:<4g} rows opening a candidate {p:7.2%}   "
                  f"launches of 64 rows with one: {1 - (1 - p) ** 64:6.1%}")  # fmt: skip


if __name__ == "__main__":
    main()
