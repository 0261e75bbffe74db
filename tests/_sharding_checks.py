"""Multi-device checks of rejax.sharding, run by tests/test_sharding.py in a subprocess.

XLA_FLAGS must be set before JAX initialises, so these run in a fresh interpreter with eight
host CPU devices. Prints one JSON object: {check name: result}; the test file asserts on it.
"""

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import dataclasses
import json
import re
import sys
import time

_T0 = time.perf_counter()

import jax
import jax.numpy as jnp
import numpy as np

import rejax
from rejax import nvfp4, sharding
from rejax.config import Config
from rejax.decode import TRACE_COUNTS, decode_step, prefill
from rejax.ops.linear import nvfp4_linear
from rejax.params import init_params
from rejax.sampling import sampler_init

# 4 kv heads, so model=4 leaves one per device
CFG = Config(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=8,
    num_kv_heads=4,
    head_dim=16,
    max_position_embeddings=256,
    eos_token_ids=(),
)
MESHES = {"data=8": (8, 1), "model=2 x data=4": (4, 2), "model=4 x data=2": (2, 4)}
PROMPTS = [[1 + i, 7, 3 + 2 * i, 9, 4][: 2 + i % 4] for i in range(8)]
NEW = 6
# near the median entropy of this model's greedy tokens, so ReSET takes both temperatures
TAU_0 = 0.4


def _log(what: str) -> None:
    print(f"{time.perf_counter() - _T0:6.1f} s {what}", file=sys.stderr, flush=True)


def _err(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return ""


def _float_model():
    p = init_params(CFG, 0, dtype=jnp.float32)
    w = p.weights
    # a peakier head than normal(0.02), so the entropies straddle tau_0 and ReSET switches
    w["lm_head"]["weight"] = w["lm_head"]["weight"] * 60.0
    return p


def _reset(tau_0: float, greedy: bool = False):
    nl = np.zeros(CFG.vocab_size, bool)
    nl[[10, 11]] = True
    dnl = np.zeros(CFG.vocab_size, bool)
    dnl[12] = True
    # temperatures <= 1e-6 are greedy: the same compiled loop (hyperparameters are traced)
    t_low, t_high = (0.0, 0.0) if greedy else (0.1, 1.0)
    return rejax.ReSET(t_low=t_low, t_high=t_high, tau_0=tau_0, nl_mask=nl, dnl_mask=dnl)


def _prefill_logits(params) -> np.ndarray:
    """Last-token prefill logits [B, V] of PROMPTS, with the shapes `generate` compiles (left
    padding to the 32 bucket, cache of 32 + NEW slots), so its compiled prefill is reused."""
    tokens = np.zeros((len(PROMPTS), 32), np.int32)
    positions = np.full(tokens.shape, -1, np.int32)
    for r, p in enumerate(PROMPTS):
        tokens[r, 32 - len(p) :] = p
        positions[r, 32 - len(p) :] = np.arange(len(p))
    cache = sharding.init_cache(params, len(PROMPTS), 32 + NEW, jnp.float32)
    return np.asarray(prefill(params, jnp.asarray(tokens), jnp.asarray(positions), cache)[0])


def _run(params, tau_0):
    greedy = rejax.generate(params, PROMPTS, max_new_tokens=NEW, sampler=_reset(tau_0, True))
    logits = _prefill_logits(params)
    before = dict(TRACE_COUNTS)
    reset = rejax.generate(params, PROMPTS, max_new_tokens=NEW, sampler=_reset(tau_0), key=3)
    retraced = {k: v - before.get(k, 0) for k, v in TRACE_COUNTS.items()}
    return logits, greedy, reset, retraced


def _close(a, b) -> bool:
    # float32 reassociation (sums split over devices) errs in proportion to the largest terms,
    # not to each output's own size: the absolute tolerance scales with max |b| (1.7e-5 seen on
    # logits of up to 42, against 1e-5 + 1e-5 |b| for a small |b|)
    b = np.asarray(b)
    scale = max(1.0, float(np.max(np.abs(b)))) if b.size else 1.0
    return bool(np.allclose(a, b, rtol=1e-5, atol=1e-5 * scale))


def _collectives(params, mesh) -> dict:
    """Collectives in the compiled decode step: all-reduce count and all-gather shapes."""
    sp = sharding.shard(params, mesh)
    rows = 8
    cache = sharding.init_cache(sp, rows, 16, jnp.float32)
    logits = jnp.zeros((rows, CFG.vocab_size), jnp.float32)
    greedy = rejax.Greedy()
    keys = jax.random.split(jax.random.key(0), rows)
    args = (sp, logits, cache, jnp.zeros(rows, jnp.int32), greedy, sampler_init(greedy, rows))
    text = decode_step.lower(*args, keys, jnp.int32(0)).compile().as_text()
    gathers = re.findall(r"= ([a-z0-9]+\[[0-9,]*\])[^ ]* all-gather(?:-start)?\(", text)
    reduces = re.findall(r" all-reduce(?:-start)?\(", text)
    return {"all_reduce": len(reduces), "all_gather_shapes": gathers}


def _row_parallel_op() -> float:
    """norm(sharded - one device) / norm(one device) of a W4A4 dynamic-scale row-parallel
    linear split over 2 devices (stacked weight, layer 1)."""
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(0)
    mats = [rng.normal(size=(64, 256)) * 0.02 for _ in range(2)]
    w = nvfp4.stack([nvfp4.quantize_weight(jnp.asarray(m, jnp.bfloat16)) for m in mats])
    x = rng.normal(size=(5, 256))
    x[:, 200] *= 40.0  # one large feature on device 1: each half's own amax differs
    x = jnp.asarray(x, jnp.bfloat16)
    ref = np.asarray(nvfp4_linear(x, w, layer=1), np.float32)
    mesh = sharding.make_mesh(1, 2)

    def body(x, packed, scales):
        local = nvfp4.Nvfp4Tensor(packed, scales, w.global_scale, shape=(64, 128))
        return sharding.row_parallel_linear(x, {"weight": local}, "nvfp4", 1, (64,), "model")

    spec = P(None, None, "model")
    f = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P(None, "model"), spec, spec),
            out_specs=P(),
            check_vma=False,
        )
    )
    out = np.asarray(f(x, w.packed, w.scales), np.float32)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def main() -> None:
    out = {}
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (8, 10)), jnp.int32)

    # float32: every mesh against one device
    p = _float_model()
    ref_logits, ref_greedy, ref_reset, _ = _run(p, TAU_0)
    out["reset_temperatures"] = sorted({t for r in ref_reset.temperature for t in r})
    _log("one device")
    for name, (d, m) in MESHES.items():
        sp = sharding.shard(p, sharding.make_mesh(d, m))
        logits, greedy, reset, retraced = _run(sp, TAU_0)
        _log(name)
        out[name] = {
            "logits_max_diff": float(np.max(np.abs(logits - ref_logits))),
            "logits_close": _close(logits, ref_logits),
            "greedy_equal": greedy.tokens == ref_greedy.tokens,
            "reset_tokens_equal": reset.tokens == ref_reset.tokens,
            "reset_temperatures_equal": reset.temperature == ref_reset.temperature,
            "retraced": retraced,
            "kv_cache_local_shape": list(
                sharding.init_cache(sp, 8, 4, jnp.float32).k.addressable_shards[0].data.shape
            ),
        }
        if name == "model=2 x data=4":
            back = sharding.unshard(sp)
            same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), back.weights, p.weights)
            out["unshard_roundtrip"] = all(jax.tree.leaves(same))
            replicated = sharding.shard(p, sharding.make_mesh(d, m), vocab="replicate")
            full = np.asarray(rejax.logits(p, tokens))  # the cache-free path
            out["vocab_replicate_close"] = _close(rejax.logits(replicated, tokens), full)
    out["collectives"] = _collectives(p, sharding.make_mesh(4, 2))
    _log("collectives")

    # an fp8 KV cache split over rows and kv heads: the scales travel with their heads
    p8 = dataclasses.replace(p, cfg=dataclasses.replace(p.cfg, kv_dtype="fp8"))
    sp8 = sharding.shard(p8, sharding.make_mesh(4, 2))
    greedy = _reset(TAU_0, True)
    one = rejax.generate(p8, PROMPTS, max_new_tokens=NEW, sampler=greedy)
    two = rejax.generate(sp8, PROMPTS, max_new_tokens=NEW, sampler=greedy)
    c8 = sharding.init_cache(sp8, 8, 4, jnp.float32)
    out["fp8"] = {
        "greedy_equal": one.tokens == two.tokens,
        "differs_from_bf16": one.tokens != ref_greedy.tokens
        or not np.allclose(one.entropy, ref_greedy.entropy, rtol=1e-6, atol=1e-7),
        "k_local_shape": list(c8.k.addressable_shards[0].data.shape),
        "k_scale_local_shape": list(c8.k_scale.addressable_shards[0].data.shape),
    }
    _log("fp8")

    # NVFP4 (CPU reference path)
    q = init_params(dataclasses.replace(CFG, quant="nvfp4-w4a16"), 0)
    q_ref = np.asarray(rejax.logits(q, tokens))
    q_tp = np.asarray(rejax.logits(sharding.shard(q, sharding.make_mesh(4, 2)), tokens))
    out["w4a16_tp_rel_diff"] = float(np.max(np.abs(q_tp - q_ref)) / np.max(np.abs(q_ref)))
    _log("w4a16")
    out["row_parallel_rel"] = _row_parallel_op()

    # bad meshes and batches
    out["err_kv_heads"] = _err(lambda: sharding.shard(p, sharding.make_mesh(1, 8)))
    dp = sharding.shard(p, sharding.make_mesh(8, 1))
    out["err_rows"] = _err(lambda: rejax.generate(dp, PROMPTS[:3], max_new_tokens=2))
    out["err_devices"] = _err(lambda: sharding.make_mesh(4, 4))
    out["err_twice"] = _err(lambda: sharding.shard(dp, sharding.make_mesh(8, 1)))
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
