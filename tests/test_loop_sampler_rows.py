"""The decode loops broadcast the sampler's per-row hyperparameters once, before the loop
(`rejax.sampling.broadcast_rows`): inside the loop the sampler op takes its temperatures and
top-p as loop inputs, not as broadcasts of a scalar made every step (on a GPU, a kernel each
at more than one row; a broadcast of a literal constant is folded and costs nothing)."""

from __future__ import annotations

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
import pytest

from rejax import params as rparams
from rejax import sampling
from rejax.cache import init_cache
from rejax.config import Config
from rejax.decode import decode_loop
from rejax.slots import decode_chunk, init_slots

B = 3
CFG = Config(num_layers=1, head_dim=32)


def _samplers():
    none = jnp.zeros((CFG.vocab_size,), bool)
    return [sampling.Temperature(t=0.6, top_p=0.95), sampling.ReSET(nl_mask=none, dnl_mask=none)]


def test_broadcast_rows_gives_float32_rows_of_the_same_values():
    smp = sampling.broadcast_rows(sampling.Temperature(t=0.6, top_p=0.95, top_k=20), B)
    assert smp.t.shape == smp.top_p.shape == (B,) and smp.t.dtype == jnp.float32
    np.testing.assert_array_equal(smp.t, np.float32(0.6))
    assert smp.top_k == 20
    reset = sampling.ReSET(t_high=1.0, t_low=np.array([0.1, 0.2, 0.3]), tau_0=0.5, top_p=0.9)
    rows = sampling.broadcast_rows(reset, B)
    for name, want in [("t_high", 1.0), ("t_low", [0.1, 0.2, 0.3]), ("tau_0", 0.5), ("top_p", 0.9)]:
        np.testing.assert_array_equal(getattr(rows, name), np.float32(want), err_msg=name)
    assert rows.window == reset.window and rows.nl_mask is None
    greedy = sampling.Greedy()
    assert sampling.broadcast_rows(greedy, B) is greedy


def test_broadcast_rows_names_a_wrong_row_count():
    with pytest.raises(
        ValueError, match=r"Temperature\.t has shape \(2,\), expected a scalar or \[3\]"
    ):
        sampling.broadcast_rows(sampling.Temperature(t=np.array([0.5, 0.7])), B)
    with pytest.raises(ValueError, match="sampler must be Greedy"):
        sampling.broadcast_rows("greedy", B)


def _sampler_operands(jaxpr, found, in_loop=False):
    # (primitive, [how each of thr, alt, t_a, t_b, top_p is made]) for every sampler op inside
    # a while loop: "in" (a loop input), "const" (a broadcast of a literal) or the primitive
    made = {}
    for e in jaxpr.eqns:
        for v in e.outvars:
            made[v] = e
        if in_loop and e.primitive.name.startswith("rejax_sample"):
            how = []
            for v in e.invars[1:6]:
                src = made.get(v)
                if src is None:
                    how.append("in")
                elif src.primitive.name == "broadcast_in_dim" and isinstance(
                    src.invars[0], jcore.Literal
                ):
                    how.append("const")
                else:
                    how.append(src.primitive.name)
            found.append((e.primitive.name, how))
        for p in e.params.values():
            for s in p if isinstance(p, (list, tuple)) else [p]:
                j = s.jaxpr if isinstance(s, jcore.ClosedJaxpr) else s
                if isinstance(j, jcore.Jaxpr):
                    _sampler_operands(j, found, in_loop or e.primitive.name == "while")
    return found


def _check(found, smp):
    assert found, "no sampler op inside the loop"
    for name, how in found:
        assert "broadcast_in_dim" not in how, (type(smp).__name__, name, how)
        assert how[2:] == ["in", "in", "in"], (type(smp).__name__, name, how)


@pytest.mark.parametrize("smp", _samplers(), ids=["temperature", "reset"])
def test_decode_loop_takes_the_rows_as_loop_inputs(smp):
    params = rparams.init_params(CFG, 0, jnp.bfloat16)
    args = (
        params,
        jnp.zeros((B, CFG.vocab_size), jnp.bfloat16),
        init_cache(CFG, B, 8, jnp.bfloat16),
        jnp.zeros((B,), jnp.int32),
        smp,
        sampling.sampler_init(smp, B),
        jax.random.split(jax.random.key(0), B),
        jnp.zeros((CFG.vocab_size,), bool),
        jnp.zeros((B,), bool),
    )
    _check(_sampler_operands(decode_loop.trace(*args, max_new_tokens=4).jaxpr.jaxpr, []), smp)


@pytest.mark.parametrize("smp", _samplers(), ids=["temperature", "reset"])
def test_slot_decode_chunk_takes_the_rows_as_loop_inputs(smp):
    params = rparams.init_params(CFG, 0, jnp.bfloat16)
    state = init_slots(params, B, 16, 4, smp)
    stop = jnp.zeros((CFG.vocab_size,), bool)
    traced = decode_chunk.trace(params, state, smp, stop, jnp.int32(B), jnp.int32(4))
    _check(_sampler_operands(traced.jaxpr.jaxpr, []), smp)


def test_the_experiments_switch_brings_the_per_step_broadcasts_back(monkeypatch):
    # experiments/loop_rows_off.py (the A/B baseline) must restore the old loop, or its timing
    # compares the change with itself
    import importlib
    import pathlib
    import sys

    from rejax import decode, slots

    monkeypatch.setattr(decode, "broadcast_rows", decode.broadcast_rows)
    monkeypatch.setattr(slots, "broadcast_rows", slots.broadcast_rows)
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[1] / "experiments"))
    off = importlib.import_module("loop_rows_off")
    off.turn_off()
    jax.clear_caches()  # the traces above were made with the switch on
    smp = _samplers()[0]
    params = rparams.init_params(CFG, 0, jnp.bfloat16)
    state = init_slots(params, B, 16, 4, smp)
    stop = jnp.zeros((CFG.vocab_size,), bool)
    traced = decode_chunk.trace(params, state, smp, stop, jnp.int32(B), jnp.int32(4))
    found = _sampler_operands(traced.jaxpr.jaxpr, [])
    sys.modules.pop("loop_rows_off")
    jax.clear_caches()
    assert any("broadcast_in_dim" in how for _, how in found), found
