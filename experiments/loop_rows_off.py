"""Runs a script with the decode loops' per-row sampler broadcast turned off (this process only),
for A/B timings of `rejax.sampling.broadcast_rows` against the loops as they were before it:
each step then broadcasts the sampler's scalar hyperparameters again.

    python3 experiments/loop_rows_off.py experiments/bench_decode.py ARGS...
"""

from __future__ import annotations

import os
import runpy
import sys

from rejax import decode, slots


def turn_off() -> None:
    """`decode_loop` and `decode_chunk` pass the sampler into the loop unchanged."""
    decode.broadcast_rows = slots.broadcast_rows = lambda sampler, batch: sampler


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python3 experiments/loop_rows_off.py SCRIPT [ARGS...]")
    turn_off()
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
    runpy.run_path(sys.argv[0], run_name="__main__")
