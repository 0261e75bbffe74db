"""Shared by the lowering and decoder tests: the CUDA lowering of one decode step of a random
model, its scanned layer's launches, static input scales per linear, decode-step logits, and a
stacked random W4A4 linear."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np

from rejax import nvfp4, sampling
from rejax import params as rparams
from rejax.cache import init_cache
from rejax.decode import decode_step
from rejax.decoder import Model

# static input scales, one value per linear, the second layer's 0.7 times the first's: no two
# a power of two apart (a block's codes are the same under a scale 2**j times another, so a
# mix-up of two linears' scales would not show)
SCALES = {"qkv_proj": 0.02, "o_proj": 0.013, "gate_up_proj": 0.03, "down_proj": 0.0047}


def decode_step_cuda_text(cfg, batch: int = 2) -> str:
    """StableHLO text of `decode_step` lowered for CUDA (no GPU needed), with static W4A4 input
    scales on every linear of an NVFP4 `cfg`."""
    params = rparams.init_params(cfg, 0, jnp.bfloat16)
    scale = jnp.full((cfg.num_layers,), 0.02, jnp.float32)
    weights = rparams.map_linears(params.weights, lambda _, p: {**p, "input_scale": scale})
    params = dataclasses.replace(params, weights=weights)
    smp = sampling.Greedy()
    args = (
        params,
        jnp.zeros((batch, cfg.vocab_size), jnp.float32),
        init_cache(cfg, batch, 8, jnp.bfloat16),
        jnp.zeros((batch,), jnp.int32),
        smp,
        sampling.sampler_init(smp, batch),
        jax.random.split(jax.random.key(0), batch),
        jnp.int32(0),
    )
    return decode_step.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def layer_launches(cfg, batch: int = 1) -> tuple[list[str], str]:
    """(the PTX entry names of the scanned layer's custom calls, in order; the layer body's
    StableHLO text) of `decode_step_cuda_text(cfg, batch)`."""
    text = decode_step_cuda_text(cfg, batch=batch)
    body = next(f for f in re.split(r"\n  func\.func ", text) if f.startswith("private @closed"))
    return re.findall(r"name = \\22(\w+)\\22", body), body


def per_linear_scales(params):
    """`params` with a static input scale [L] on every linear, from SCALES."""

    def put(path, p):
        value = SCALES[path[1]]
        scale = jnp.asarray([value * 0.7**i for i in range(params.cfg.num_layers)], jnp.float32)
        return {**p, "input_scale": scale}

    return dataclasses.replace(params, weights=rparams.map_linears(params.weights, put))


def decode_logits(cfg, params, steps: int, b: int, p: int = 4) -> np.ndarray:
    """float32 logits [B, steps, V] of `steps` decode steps after a `p`-token prompt (random
    tokens), the Linen model applied functionally with a bf16 cache."""
    tokens = np.random.default_rng(7).integers(0, cfg.vocab_size, (b, p + steps)).astype(np.int32)
    positions = np.broadcast_to(np.arange(p + steps, dtype=np.int32), tokens.shape)
    apply = jax.jit(
        lambda w, tok, pos, c: Model(cfg, jnp.bfloat16).apply({"params": w}, tok, pos, c)
    )
    cache = init_cache(cfg, b, p + steps + 2, jnp.bfloat16)
    _, cache = apply(params.weights, tokens[:, :p], positions[:, :p], cache)
    out = []
    for i in range(p, p + steps):
        logits, cache = apply(params.weights, tokens[:, i : i + 1], positions[:, i : i + 1], cache)
        out.append(np.asarray(logits, np.float32))
    return np.concatenate(out, axis=1)


def stacked_linear(n: int, k: int, input_scale, layers: int = 2, seed: int = 1) -> dict:
    """A W4A4 linear's params: `layers` random [n, k] matrices quantized and stacked, and the
    given static input scale."""
    w = jax.random.normal(jax.random.key(seed), (layers, n, k), jnp.float32) * 0.05
    stack = nvfp4.stack([nvfp4.quantize_weight(m) for m in w])
    return {"weight": stack, "input_scale": jnp.asarray(input_scale, jnp.float32)}
