"""decode_attention(impl="auto") inside a jitted program: the compile probe must not fail.

The probe runs from the CUDA lowering rule, i.e. while an outer jit is being lowered. It once ran
under `jax.ensure_compile_time_eval`, which made Pallas evaluate `program_id` eagerly and fail,
so every jitted decode step with attention="live" quietly took the reference on the GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rejax.ops import _dispatch
from rejax.ops import decode_attention as da

B, N, KV, S, H = 1, 4, 2, 128, 32
AVALS = (
    ((B, N, H), jnp.bfloat16),
    ((2, B, S, KV, H), jnp.bfloat16),
    ((2, B, S, KV, H), jnp.bfloat16),
    ((), jnp.int32),
    ((B,), jnp.int32),
    ((B, S), jnp.int32),
    ((), jnp.int32),
)


def test_probe_from_inside_a_trace_compiles():
    # The interpreted kernel compiles on any platform: probing it from inside an outer jit's
    # trace must give "" (no reason to fall back).
    reasons = []

    def outer(x):
        da._compile_error.cache_clear()
        reasons.append(da._compile_error(AVALS, 64, 2, interpret=True))
        return x

    try:
        jax.jit(outer).lower(1.0)
    finally:
        da._compile_error.cache_clear()
    assert reasons == [""]


def test_outside_trace_returns_and_raises():
    assert _dispatch.outside_trace(lambda: 41 + 1) == 42

    def boom():
        raise KeyError("probe failed")

    with pytest.raises(KeyError, match="probe failed"):
        _dispatch.outside_trace(boom)


@pytest.mark.gpu
def test_jitted_auto_emits_the_kernel_gpu():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, N, H)), jnp.bfloat16)
    kc = jnp.asarray(rng.standard_normal((2, B, S, KV, H)), jnp.bfloat16)
    vc = jnp.asarray(rng.standard_normal((2, B, S, KV, H)), jnp.bfloat16)
    qp = jnp.asarray([S // 2], jnp.int32)
    kp = jnp.asarray(np.where(np.arange(S) <= S // 2, np.arange(S), -1)[None], jnp.int32)
    da._compile_error.cache_clear()

    @jax.jit
    def step(q, kc, vc, qp, kp, live):
        return da.decode_attention(q, kc, vc, jnp.int32(1), qp, kp, live, impl="auto")

    live = jnp.int32(S // 2 + 1)
    text = step.lower(q, kc, vc, qp, kp, live).compile().as_text()
    assert "rejax_decode_attention_partials" in text, "impl='auto' fell back to the reference"
    ref = da.decode_attention(q, kc, vc, jnp.int32(1), qp, kp, live, impl="ref")
    out = step(q, kc, vc, qp, kp, live)
    err = np.linalg.norm(np.asarray(out, np.float32) - np.asarray(ref, np.float32))
    assert err <= 1e-2 * np.linalg.norm(np.asarray(ref, np.float32))
