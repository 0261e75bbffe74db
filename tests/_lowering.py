"""Shared by the lowering tests: the CUDA lowering of one decode step of a random model."""

import dataclasses

import jax
import jax.numpy as jnp

from rejax import params as rparams
from rejax import sampling
from rejax.cache import init_cache
from rejax.decode import decode_step


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
