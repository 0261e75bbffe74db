"""Runs a script with the decode loops folding the step into the row keys in XLA again (this
process only), for A/B timings of the grid sampler kernels' in-launch fold
(`rejax.sampling.sample(..., step=)`) against the loops as they were before it: each step then
runs the fold as an XLA kernel before the sampler's launch.

    python3 experiments/loop_fold_off.py experiments/bench_decode.py ARGS...
"""

from __future__ import annotations

import os
import runpy
import sys

import jax

from rejax import decode, sampling, slots


def _fold_first(key, logits, state, sampler, *, step=None, **kw):
    if step is not None:
        axis = None if jax.numpy.ndim(step) == 0 else 0
        key = jax.vmap(jax.random.fold_in, in_axes=(0, axis))(key, step)
    return sampling.sample(key, logits, state, sampler, **kw)


def turn_off() -> None:
    """`decode_loop` and `decode_chunk` fold the step into the keys before `sample`."""
    decode.sample = slots.sample = _fold_first


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python3 experiments/loop_fold_off.py SCRIPT [ARGS...]")
    turn_off()
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
    runpy.run_path(sys.argv[0], run_name="__main__")
