"""Samplers from a command-line spec ("greedy", "temp:T", "reset") and their JSON description,
with the official ReSET defaults."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from rejax import sampling

# The official ReSET defaults: T_low 0.3, τ0 0.6349, T_high 1.0, w 32, top-p 0.95.
DEFAULT_T_LOW = 0.3
DEFAULT_TAU0 = 0.6349
DEFAULT_T_HIGH = 1.0
DEFAULT_TOP_P = 0.95
DEFAULT_WINDOW = 32


# ----------------------------------------------------------------------------------------------
# Samplers from a command-line spec


def parse_sampler(
    spec: str,
    *,
    t_low: float = DEFAULT_T_LOW,
    tau0: float = DEFAULT_TAU0,
    t_high: float = DEFAULT_T_HIGH,
    top_p: float = DEFAULT_TOP_P,
    window: int = DEFAULT_WINDOW,
):
    """Builds a sampler from `greedy`, `temp:T` or `reset`.

    `top_p` applies to `temp:T` and `reset`; `t_low`, `tau0`, `t_high`, `window` to `reset`
    only. ReSET's newline masks are left None: `generate` fills them from the tokenizer.

    Raises:
      ValueError: an unknown spec, a non-numeric or non-positive temperature, top_p outside
        (0, 1], or out-of-range ReSET hyperparameters.
    """
    _check_range("top_p", top_p, 0.0, 1.0, lo_open=True)
    name, _, arg = spec.strip().partition(":")
    name = name.lower()
    if name == "greedy" and not arg:
        return sampling.Greedy()
    if name in ("temp", "temperature"):
        try:
            t = float(arg)
        except ValueError:
            raise ValueError(
                f"sampler spec {spec!r}: temperature {arg!r} is not a number "
                "(expected e.g. 'temp:0.6')"
            ) from None
        if not math.isfinite(t) or t <= 0:
            raise ValueError(
                f"sampler spec {spec!r}: temperature must be a finite number > 0 "
                "(use 'greedy' for argmax decoding)"
            )
        return sampling.Temperature(t=t, top_p=top_p)
    if name == "reset" and not arg:
        _check_range("t_low", t_low, 0.0, math.inf)
        _check_range("t_high", t_high, 0.0, math.inf, lo_open=True)
        _check_range("tau0", tau0, 0.0, math.inf)
        if window < 1:
            raise ValueError(f"ReSET window must be >= 1, got {window}")
        return sampling.ReSET(t_high=t_high, t_low=t_low, tau_0=tau0, window=window, top_p=top_p)
    raise ValueError(
        f"unknown sampler spec {spec!r}; expected 'greedy', 'temp:T' (T > 0, e.g. 'temp:0.6') "
        "or 'reset'"
    )


def _check_range(name, value, lo, hi, *, lo_open=False):
    ok = isinstance(value, (int, float)) and math.isfinite(value) and value <= hi
    ok = ok and (value > lo if lo_open else value >= lo)
    if not ok:
        bracket = "(" if lo_open else "["
        raise ValueError(f"{name} must be in {bracket}{lo}, {hi}], got {value!r}")


def describe_sampler(sampler) -> dict:
    """A JSON-able description of a sampler (its class and float hyperparameters)."""
    out = {"kind": type(sampler).__name__}
    for f in dataclasses.fields(sampler):
        v = getattr(sampler, f.name)
        if v is None or isinstance(v, (bool, int, float, str)):
            out[f.name] = v
        elif np.ndim(v) == 0:
            out[f.name] = float(v)
    return out
