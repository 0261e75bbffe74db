"""Each sampler entry's us per token over greedy, from bench_decode.py JSON files whose
--samplers alternate with greedy: the greedy baseline of an entry is the mean of the nearest
greedy entry before and after it (the same process).

    python3 experiments/results/s51/over_greedy.py FILE.json...
"""

import json
import sys


def deltas(path):
    with open(path) as f:
        runs = [r for r in json.load(f)["runs"] if "error" not in r]
    for b in sorted({r["batch"] for r in runs}):
        rs = [r for r in runs if r["batch"] == b]
        g = [i for i, r in enumerate(rs) if r["sampler"] == "greedy"]
        for i, r in enumerate(rs):
            if r["sampler"] == "greedy":
                continue
            before = [rs[j]["ms_per_token"] for j in g if j < i][-1:]
            after = [rs[j]["ms_per_token"] for j in g if j > i][:1]
            base = sum(before + after) / len(before + after)
            yield b, r["sampler"], 1e3 * (r["ms_per_token"] - base)


for path in sys.argv[1:]:
    out = {}
    for b, s, d in deltas(path):
        out.setdefault((b, s), []).append(d)
    print(
        path,
        "  ".join(f"b{b} {s}: " + " ".join(f"{x:+.0f}" for x in v) for (b, s), v in out.items()),
    )
