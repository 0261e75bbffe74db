"""The copies inside an optimized HLO module's while loops: what a decode loop copies each
iteration.

A decode loop's profile shows a copy thunk and a device-to-device copy on the host after each
check of the loop's predicate, before the next iteration's graphs (experiments/DECODE_NOTES.md,
fifty-sixth session). This reads the text of an optimized module (`XLA_FLAGS=--xla_dump_to=DIR
--xla_dump_hlo_as_text`, the `*.after_optimizations.txt` file) and prints, for each while loop
from the outermost in, its trip count when XLA knows it and every `copy` / `copy-start` at the
top level of its body and condition (fused copies are kernels of their own, so not listed):
shape, bytes and the JAX op that made it.

    python3 experiments/hlo_loop_copies.py MODULE.after_optimizations.txt [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from experiments.count_kernels import computations

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
                "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}  # fmt: skip
_ENTRY = re.compile(r"^\s*ENTRY\s+%?([\w.\-]+)\s*\(")
_WHILE = re.compile(r"%([\w.\-]+)\s*=.*\swhile\(.*condition=%([\w.\-]+),\s*body=%([\w.\-]+)")
_COPY = re.compile(r"%([\w.\-]+)\s*=\s*([a-z0-9]+)\[([\d,]*)\]\S*\s+(copy|copy-start)\(")
_OPNAME = re.compile(r'op_name="([^"]*)"')
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _copies(lines: list[str]) -> list[dict]:
    out = []
    for line in lines:
        m = _COPY.search(line)
        if not m:
            continue
        name, dtype, dims, op = m.groups()
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        op_name = _OPNAME.search(line)
        out.append({
            "name": name, "op": op, "shape": f"{dtype}[{dims}]",
            "bytes": n * _DTYPE_BYTES.get(dtype, 0),
            "op_name": op_name.group(1) if op_name else "",
        })  # fmt: skip
    return out


def loop_copies(text: str) -> list[dict]:
    """One entry per while loop, outermost first (depth 0 = in the entry computation): its
    body and condition, known trip count (None if the host must read a predicate) and the
    copies at the top level of each."""
    entry = next((m.group(1) for m in map(_ENTRY.match, text.splitlines()) if m), None)
    if entry is None:
        raise ValueError("no ENTRY computation: not an HLO module's text")
    comps = computations(text)
    out, todo = [], [(entry, 0)]
    while todo:
        comp, depth = todo.pop(0)
        for line in comps.get(comp, []):
            m = _WHILE.search(line)
            if not m:
                continue
            name, cond, body = m.groups()
            trip = _TRIP.search(line)
            out.append({
                "while": name, "in": comp, "depth": depth, "body": body, "condition": cond,
                "known_trip_count": int(trip.group(1)) if trip else None,
                "body_copies": _copies(comps.get(body, [])),
                "condition_copies": _copies(comps.get(cond, [])),
            })  # fmt: skip
            todo.append((body, depth + 1))
    return out


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("hlo", help="an optimized HLO module's text (*.after_optimizations.txt)")
    ap.add_argument("--json", default=None, help="also write the loops and copies here")
    args = ap.parse_args(argv)
    with open(args.hlo) as f:
        loops = loop_copies(f.read())
    for lp in loops:
        trip = lp["known_trip_count"]
        print(f"{'  ' * lp['depth']}while {lp['while']} (in {lp['in']}; "
              f"{'trip count ' + str(trip) if trip else 'predicate read by the host'}): "
              f"{len(lp['body_copies'])} copies in its body, "
              f"{len(lp['condition_copies'])} in its condition")  # fmt: skip
        for c in lp["body_copies"] + lp["condition_copies"]:
            print(f"{'  ' * lp['depth']}  {c['op']} {c['name']} {c['shape']} "
                  f"{c['bytes']} B  {c['op_name'][-70:]}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(loops, f, indent=1)
    return loops


if __name__ == "__main__":
    main()
