"""Cross-framework comparison behind `rejax compare`: JAX against the Torch path, same weights.

1. JAX decodes a greedy trace (`rejax.generate`, no early stop).
2. Prompt + trace are teacher-forced through both frameworks: `rejax.logits` (JAX) and
   `rejax.torch_ref.forward` (PyTorch, NVFP4 by fake quantization); reported: max |diff| and
   relative error (Frobenius norm of the difference over that of the torch logits) of all
   logits, and at the positions that predicted the trace the top-1 agreement and the entropy
   difference.
3. ReSET decisions: `rejax.sampling.reset_temperature` / `reset_observe` and
   `rejax.torch_ref.TorchReSET` walk the same trace on the same (JAX) logits, and each on its
   own framework's logits; reported: the share of positions with the same temperature.
4. Timing (warm-up excluded, medians): the JAX greedy decode per token (`rejax.generate`,
   prefill included, cached), and one teacher-forced forward of the whole sequence in each
   framework. torch_ref has no KV cache, so its decode step would be that full forward.

torch is imported lazily (through rejax.torch_ref): importing this module does not import it.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from rejax import sampling, torch_ref
from rejax.generate import generate
from rejax.generate import logits as jax_logits
from rejax.torch_ref import TorchReSET


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up: compilation (JAX) or first-call allocation (torch)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _entropy(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    p = np.exp(z)
    s = p.sum(axis=-1, keepdims=True)
    p /= s
    return np.log(s[..., 0]) - (p * z).sum(axis=-1)


def _jax_decisions(logits: np.ndarray, trace: list[int], reset) -> np.ndarray:
    """ReSET temperatures along a fixed trace: logits [T, V] predicted trace[t]."""
    state = sampling.sampler_init(reset, 1)
    out = []
    for z, tok in zip(logits, trace):
        t, _, state = sampling.reset_temperature(jnp.asarray(z[None]), state, reset)
        state = sampling.reset_observe(state, jnp.asarray([tok], jnp.int32), reset)
        out.append(float(t[0]))
    return np.asarray(out, np.float32)


def _torch_decisions(logits: np.ndarray, trace: list[int], reset) -> np.ndarray:
    policy = TorchReSET.from_rejax(reset, 1)
    out = []
    for z, tok in zip(logits, trace):
        t, _ = policy.temperature(np.array(z[None], np.float32))  # writable, as torch wants
        policy.observe(np.asarray([tok]))
        out.append(float(t[0]))
    return np.asarray(out, np.float32)


def compare(
    params,
    prompt: list[int],
    *,
    steps: int,
    reset: sampling.ReSET,
    repeats: int = 3,
) -> dict:
    """Runs the comparison on one prompt.

    Args:
      params: the model (bf16 or NVFP4; the torch path mirrors cfg.quant).
      prompt: prompt token ids.
      steps: length of the greedy trace (> 0).
      reset: the ReSET sampler whose decisions are compared (newline masks set).
      repeats: timed calls per measurement (median).

    Returns:
      JSON-able dict: prompt_tokens, steps, logits_max_abs_diff, logits_rel_error,
      top1_agreement, top1_agreement_count, entropy_max_abs_diff, entropy_mean_abs_diff,
      trace_is_jax_argmax (the decode loop's tokens equal the argmax of the teacher-forced JAX
      logits), reset_agreement_same_logits, reset_agreement_own_logits, jax_ms_per_token,
      jax_forward_ms, torch_forward_ms, reset_settings.
    """
    if steps <= 0 or repeats <= 0:
        raise ValueError(f"steps and repeats must be positive, got {steps=} {repeats=}")
    if reset.nl_mask is None or reset.dnl_mask is None:
        raise ValueError("reset needs its newline masks (rejax.text.newline_masks)")
    limit = params.cfg.max_position_embeddings
    if len(prompt) + steps > limit:
        raise ValueError(
            f"the prompt has {len(prompt)} tokens; with {steps} steps that exceeds the model's "
            f"context of {limit}"
        )

    def decode():
        return generate(params, [prompt], max_new_tokens=steps, stop=[], progress=False)

    trace = decode().tokens[0]
    jax_step = _median_time(decode, repeats) / steps
    seq = np.asarray([prompt + trace], np.int32)  # [1, T]
    z_jax = np.asarray(jax.block_until_ready(jax_logits(params, seq)))[0]
    weights = torch_ref.torch_weights(params)
    z_torch = torch_ref.forward(params, seq, weights).numpy()[0]
    jax_forward = _median_time(lambda: jax.block_until_ready(jax_logits(params, seq)), repeats)
    torch_forward = _median_time(lambda: torch_ref.forward(params, seq, weights), repeats)

    diff = z_jax.astype(np.float64) - z_torch.astype(np.float64)
    # Logits at position j predict token j + 1: these rows predicted the trace.
    a, b = len(prompt) - 1, len(prompt) - 1 + steps
    gj, gt = z_jax[a:b], z_torch[a:b]
    top_j, top_t = gj.argmax(-1), gt.argmax(-1)
    dh = np.abs(_entropy(gj) - _entropy(gt))
    same = _jax_decisions(gj, trace, reset) == _torch_decisions(gj, trace, reset)
    own = _jax_decisions(gj, trace, reset) == _torch_decisions(gt, trace, reset)
    return {
        "prompt_tokens": len(prompt),
        "steps": steps,
        "quant": params.cfg.quant or "bf16",
        "logits_max_abs_diff": float(np.abs(diff).max()),
        "logits_rel_error": float(np.linalg.norm(diff) / np.linalg.norm(z_torch)),
        "top1_agreement": float(np.mean(top_j == top_t)),
        "top1_agreement_count": [int(np.sum(top_j == top_t)), steps],
        "entropy_max_abs_diff": float(dh.max()),
        "entropy_mean_abs_diff": float(dh.mean()),
        "trace_is_jax_argmax": bool(np.array_equal(top_j, np.asarray(trace))),
        "reset_agreement_same_logits": float(same.mean()),
        "reset_agreement_own_logits": float(own.mean()),
        "jax_ms_per_token": 1e3 * jax_step,
        "jax_forward_ms": 1e3 * jax_forward,
        "torch_forward_ms": 1e3 * torch_forward,
        "reset_settings": {
            "t_low": float(reset.t_low),
            "tau_0": float(reset.tau_0),
            "t_high": float(reset.t_high),
            "window": int(reset.window),
        },
    }


def format_table(result: dict) -> str:
    """A short table of `compare`'s result."""
    r = result
    rows = [
        ("logits max |diff|", f"{r['logits_max_abs_diff']:.3g}"),
        ("logits relative error", f"{r['logits_rel_error']:.3g}"),
        (
            "top-1 agreement on the trace",
            f"{100 * r['top1_agreement']:.1f}% ({r['top1_agreement_count'][0]}/{r['steps']})",
        ),
        (
            "entropy |diff| max / mean (nats)",
            f"{r['entropy_max_abs_diff']:.3g} / {r['entropy_mean_abs_diff']:.3g}",
        ),
        ("trace = argmax of JAX logits", "yes" if r["trace_is_jax_argmax"] else "no"),
        ("ReSET agreement, same logits", f"{100 * r['reset_agreement_same_logits']:.1f}%"),
        ("ReSET agreement, own logits", f"{100 * r['reset_agreement_own_logits']:.1f}%"),
        ("JAX decode ms/token (cached)", f"{r['jax_ms_per_token']:.2f}"),
        (
            f"forward over {r['prompt_tokens'] + r['steps']} tokens, JAX / torch ms",
            f"{r['jax_forward_ms']:.2f} / {r['torch_forward_ms']:.2f}",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
