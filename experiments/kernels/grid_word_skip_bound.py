"""The noise-word bound of `sampler_grid_word_skip.patch`, checked in float32 with worst-case
intrinsic errors (NumPy, no GPU).

The patch lets the grid kernel's scoring sweep skip a group of four tokens when every noise word
hi is above `hi_max(floor)`. That is exact only if no such word passes scores4's own test,
`zt + gumbel_bound(hi) >= floor` with zt <= 0, where for 0 < hi < 2**31

    gumbel_bound(hi) = (22.18071f + 1e-4f) - __logf((float)hi)      (float32)
    hi_max(floor)    = (u32)__expf((22.18081f + 1e-3f) - floor) + 1  (floor > 0.36652f)

(a word >= 2**31 has the bound 0.36652f, below any such floor; hi = 0 passes both). Here
`__logf` is taken 3 ulp low of the rounded logarithm (CUDA's stated bound, the direction that
raises the noise bound) and `__expf` `rel` low (2**-21 by default, above ex2.approx's error),
and the test is run at zt = 0, where it passes most easily: for every floor of a float32 grid,
the first word above hi_max(floor) must fail it. The bound is monotone in hi (so the first word
decides for all above it). `margin` is the 1e-3 of the patch; 0 shows what it is for.

    python experiments/kernels/grid_word_skip_bound.py
"""

from __future__ import annotations

import argparse

import numpy as np

F32 = np.float32
C_BOUND = F32(F32(22.18071) + F32(1e-4))  # gumbel_bound's constant, folded in float32
FLOOR_ALL = F32(0.36652)  # at or below it every word may reach the floor: no bound


def _down(x: np.ndarray, ulps: int) -> np.ndarray:
    for _ in range(ulps):
        x = np.nextafter(x, F32(-np.inf))
    return x


def hi_max(floor: np.ndarray, margin: float = 1e-3, rel: float = 2.0**-21) -> np.ndarray:
    """hi_max(floor) (uint64) with __expf `rel` low of the exact exponential of its float32
    argument; floor > FLOOR_ALL."""
    arg = (F32(F32(22.18081) + F32(margin)) - floor.astype(F32)).astype(F32)
    x = (arg * F32(1.4426950408889634)).astype(F32)  # __expf: ex2.approx(x log2 e)
    e = np.exp2(x.astype(np.float64)) * (1.0 - rel)
    return np.floor(e).astype(np.uint64) + 1


def passes(hi: np.ndarray, floor: np.ndarray, ulps: int = 3) -> np.ndarray:
    """Whether scores4's test can pass for word hi (0 < hi < 2**31) at zt = 0 with __logf
    `ulps` low."""
    hf = hi.astype(F32)
    log = _down(np.log(hf.astype(np.float64)).astype(F32), ulps)
    bound = (C_BOUND - log).astype(F32)
    return bound >= floor.astype(F32)


def check(floors: np.ndarray, margin: float = 1e-3, rel: float = 2.0**-21) -> dict:
    """Worst case over `floors` (float32, > FLOOR_ALL): how many floors let the first word
    above hi_max pass, the largest hi_max, and the smallest relative slack (hi_max over the
    exact largest passing word, minus 1, where that word is >= 1000)."""
    floors = floors.astype(F32)
    if np.any(floors <= FLOOR_ALL):
        raise ValueError(f"floors must exceed {FLOOR_ALL} (below it hi_max is 0xFFFFFFFF)")
    h = hi_max(floors, margin, rel)
    nxt = h + 1  # the first word the sweep skips is h + 1 (h itself is tested)
    small = nxt < 2**31
    bad = np.zeros(floors.shape, bool)
    bad[small] = passes(nxt[small], floors[small])
    # the largest passing word from the exact logarithm, for the slack figure (where it is
    # large enough for a relative figure to mean something)
    exact = np.exp(np.float64(C_BOUND) - floors.astype(np.float64))
    big = exact >= 1e3
    return {
        "floors": int(floors.size),
        "violations": int(bad.sum()),
        "max_hi_max": int(h.max()),
        "min_relative_slack": float(np.min(h[big] / exact[big] - 1.0)) if big.any() else None,
    }


def floor_grid(n: int = 200_000) -> np.ndarray:
    """Floors from just above FLOOR_ALL to 45 (the sweep's floor is a score: tempered logit
    <= 0 plus noise <= 38.82), evenly spaced plus the float32 neighbours of FLOOR_ALL."""
    lo = np.nextafter(FLOOR_ALL, F32(np.inf))
    near = [lo]
    for _ in range(64):
        near.append(np.nextafter(near[-1], F32(np.inf)))
    return np.concatenate([np.array(near, F32), np.linspace(lo, 45.0, n, dtype=F32)])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--floors", type=int, default=200_000, help="evenly spaced floors")
    ap.add_argument("--margin", type=float, default=1e-3, help="hi_max's exponent margin")
    args = ap.parse_args(argv)
    if args.floors < 1:
        ap.error(f"--floors={args.floors}: expected at least 1")
    print(check(floor_grid(args.floors), args.margin))


if __name__ == "__main__":
    main()
