"""The far-tail check of experiments/results/sampler_tail_bias_cpu.md, on any device.

Runs `tests/test_sampling_gpu.py::test_kernel_distribution_chi_square[peaked-1.0-1.0-0]`'s body
with another top-p method (default "radix"): peaked logits, V = 151,936, Temperature 1.0,
top_p 1.0, 64 rows x 1,600 steps = 102,400 draws, and prints the share drawn from the tokens
expected < 5 times each next to its exact share, and the test's chi-square. 7 to 18 minutes
on 2 CPU cores ("radix"):

    PYTHONPATH=.:tests python experiments/sampler_tail_bias.py --method radix
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from test_sampling import _chi2_pvalue
from test_sampling_gpu import _logits, _nucleus64, draw_tokens

from rejax.sampling import SAMPLE_METHODS, Temperature


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--method", default="radix", choices=SAMPLE_METHODS)
    ap.add_argument("--steps", type=int, default=1600, help="draws per row (64 rows)")
    args = ap.parse_args()
    b = 64
    z = np.repeat(_logits("peaked", 1, seed=3), b, axis=0)
    smp = Temperature(t=1.0, top_p=1.0, top_p_method=args.method)
    t0 = time.perf_counter()
    tok = draw_tokens(z, smp, args.steps)
    p, _ = _nucleus64(z[0], 1.0, 1.0)
    n = tok.size
    counts = np.bincount(tok, minlength=p.size)
    big = p * n >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(p[big] * n, p[~big].sum() * n)
    stat = float(((obs - exp) ** 2 / exp).sum())
    print(f"method {args.method}, {n} draws, {time.perf_counter() - t0:.0f} s")
    print(f"share from tokens expected < 5 times: {obs[-1] / n:.3%} (exact {exp[-1] / n:.3%})")
    print(
        f"chi-square {stat:.1f} on {exp.size - 1} dof, p = {_chi2_pvalue(stat, exp.size - 1):.2e}"
    )


if __name__ == "__main__":
    main()
