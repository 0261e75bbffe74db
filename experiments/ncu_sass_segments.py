"""Where a kernel's instructions go, from Nsight Compute's per-SASS source page.

Reads the CSV of `ncu --section SourceCounters --page source --csv --print-source sass` (one row
per SASS instruction with its executed count and warp-stall samples) and groups consecutive
instructions that ran the same number of times (a basic block, or a run of them) into segments.
Prints the total warp instructions and every segment holding at least `--min-share` of them or
of the stall samples, with its most frequent opcodes. A loop body's segments show as one count
(its iterations, in warps); comparing two builds' totals and segments shows what a change cut.

    ncu --kernel-name rejax_sample_grid --launch-skip 4 --launch-count 1 \\
        --section SourceCounters --section InstructionStats --page source --csv \\
        --print-source sass python3 experiments/bench_sampler.py ... > grid_sass.csv
    python experiments/ncu_sass_segments.py grid_sass.csv [more.csv ...]
"""

from __future__ import annotations

import argparse
import collections
import csv
import dataclasses
import io


@dataclasses.dataclass(frozen=True)
class Segment:
    start: int  # first SASS row
    stop: int  # one past the last
    count: int  # warp executions of each instruction
    share: float  # of all warp instructions executed
    stall_share: float  # of all warp-stall samples
    opcodes: tuple[tuple[str, int], ...]  # the most frequent, (name, instructions)


def read_rows(text: str) -> list[dict]:
    """The per-instruction rows of an ncu source-page CSV (lines before its header skipped)."""
    lines = text.splitlines()
    try:
        k = next(i for i, line in enumerate(lines) if line.startswith('"Address"'))
    except StopIteration:
        raise ValueError('no per-SASS table (a header row starting with "Address")') from None
    reader = csv.DictReader(io.StringIO("\n".join(lines[k:])))
    need = ("Source", "Instructions Executed", "Warp Stall Sampling (All Samples)")
    missing = [c for c in need if c not in (reader.fieldnames or [])]
    if missing:
        raise ValueError(f"columns {missing} missing: collect with --section SourceCounters")
    return [r for r in reader if r.get("Address")]


def _opcode(source: str) -> str:
    parts = source.split()
    if not parts:
        return "?"
    return parts[1] if parts[0].startswith("@") and len(parts) > 1 else parts[0]


def _int(x: str | None) -> int:
    return int(float(x.replace(",", ""))) if x else 0


def segments(rows: list[dict], min_share: float = 0.008) -> tuple[int, list[Segment]]:
    """(total warp instructions, the segments at or above `min_share` of the instructions or of
    the stall samples)."""
    executed = [_int(r["Instructions Executed"]) for r in rows]
    stalls = [_int(r["Warp Stall Sampling (All Samples)"]) for r in rows]
    total, total_stalls = sum(executed), max(1, sum(stalls))
    out, start = [], 0
    for k in range(1, len(rows) + 1):
        if k < len(rows) and executed[k] == executed[start]:
            continue
        n = executed[start] * (k - start)
        share, stall_share = n / max(1, total), sum(stalls[start:k]) / total_stalls
        if n and (share >= min_share or stall_share >= 2 * min_share):
            ops = collections.Counter(_opcode(rows[j]["Source"]) for j in range(start, k))
            out.append(Segment(start, k, executed[start], share, stall_share,
                               tuple(ops.most_common(4))))  # fmt: skip
        start = k
    return total, out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", nargs="+", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--min-share", type=float, default=0.008, help="smallest share printed")
    args = ap.parse_args(argv)
    if not 0 <= args.min_share < 1:
        ap.error(f"--min-share={args.min_share}: expected a fraction in [0, 1)")
    for path in args.csv:
        with open(path) as f:
            total, segs = segments(read_rows(f.read()), args.min_share)
        print(f"{path}: {total} warp instructions")
        for s in segs:
            ops = ", ".join(f"{name} {n}" for name, n in s.opcodes)
            print(f"  [{s.start:5d}, {s.stop:5d}) {s.stop - s.start:4d} instructions x{s.count:8d}"
                  f"  {100 * s.share:5.1f}% of executed, {100 * s.stall_share:5.1f}% of stalls"
                  f"  ({ops})")  # fmt: skip


if __name__ == "__main__":
    main()
