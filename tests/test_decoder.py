"""The stacked, fused decoder: equality with the previous layout, depth-independent programs,
the decode/full-sequence seam of NVFP4 models, one compile per checkpoint."""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rejax import compile_cache, sampling
from rejax import params as rparams
from rejax.cache import init_cache
from rejax.config import Config
from rejax.decode import TRACE_COUNTS, decode_step, prefill
from rejax.decoder import Model, layer_loop
from rejax.params import init_params

DATA = pathlib.Path(__file__).parent / "data"


def _logits(params, tokens):
    tokens = jnp.asarray(tokens, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    fn = jax.jit(
        lambda p, t, pos: Model(p.cfg, jnp.float32).apply({"params": p.weights}, t, pos)[0]
    )
    return np.asarray(fn(params, tokens, positions))


# max |new - old| / max |old| of fp32 logits against the unfused, unstacked decoder (112b486):
# fp32 reassociation only (fused projections add in another order). It depends on XLA CPU's
# code generation for the machine: below 1e-6 where the golden file was made, 1.07-1.10e-6 on
# a later development machine (jax 0.10.2). 4e-6 is about 34 float32 ulps of the largest logit;
# a wrong weight slice or norm moves the logits by orders of magnitude more.
GOLDEN_RTOL = 4e-6


@pytest.mark.parametrize(("arch", "tie"), [("qwen3", False), ("qwen3", True), ("qwen2", False)])
def test_fused_decoder_equals_the_unfused_one(hf_tiny, arch, tie):
    """fp32 logits of the HF test models equal those the previous decoder (separate q/k/v,
    gate/up, one module per layer; commit 112b486) computed on the same weights and tokens,
    stored in tests/data/golden_logits_112b486.npz."""
    golden = np.load(DATA / "golden_logits_112b486.npz")
    _, params = hf_tiny(arch, tie)
    got = _logits(params, golden["tokens"])
    want = golden[f"{arch}_tie{int(tie)}"]
    rel = float(np.abs(got - want).max() / np.abs(want).max())
    assert rel <= GOLDEN_RTOL, rel


def _hlo_instructions(cfg: Config, batch=2, slots=64) -> int:
    params = jax.eval_shape(lambda: rparams.random_params(cfg, 0))
    cache = jax.eval_shape(lambda: init_cache(cfg, batch, slots))
    greedy = sampling.Greedy()
    state = jax.eval_shape(lambda: sampling.sampler_init(greedy, batch))
    logits = jax.ShapeDtypeStruct((batch, cfg.vocab_size), jnp.float32)
    pos = jax.ShapeDtypeStruct((batch,), jnp.int32)
    keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), batch))
    step = jax.ShapeDtypeStruct((), jnp.int32)
    compiled = decode_step.lower(params, logits, cache, pos, greedy, state, keys, step).compile()
    return sum(" = " in line for line in compiled.as_text().splitlines())


def test_compiled_decode_step_does_not_grow_with_depth():
    """The NVFP4 decode step (layers scanned, scan_unroll layer bodies per iteration) of a
    36-layer config has at most 1.3x the HLO instructions of a config with as many layers as
    one iteration holds (abstract shapes, no weights): 2 layers at scan_unroll 1, 8 at the
    default 4 (36 = 9 x 4; 8 = 2 x 4)."""
    cfg = Config(quant="nvfp4", hidden_size=256, intermediate_size=512, head_dim=64)
    for unroll, shallow in ((1, 2), (cfg.scan_unroll, 2 * cfg.scan_unroll)):
        c = dataclasses.replace(cfg, scan_unroll=unroll)
        small = _hlo_instructions(dataclasses.replace(c, num_layers=shallow))
        deep = _hlo_instructions(dataclasses.replace(c, num_layers=36))
        assert deep <= 1.3 * small, (unroll, small, deep)
    assert layer_loop(rparams.random_params(cfg, 0).weights, cfg) == "scan"


def test_float_linears_take_the_unrolled_loop():
    params = init_params(Config(), 0)
    assert layer_loop(params.weights, params.cfg) == "unroll"
    cfg = dataclasses.replace(params.cfg, layer_loop="scan")
    with pytest.raises(ValueError, match="layer_loop='scan' needs every decoder linear NVFP4"):
        _logits(dataclasses.replace(params, cfg=cfg), [[1, 2, 3]])


def test_nvfp4_scan_equals_unrolled_loop():
    params = init_params(Config(quant="nvfp4"), 3, jnp.float32)
    tokens = np.random.default_rng(0).integers(0, 256, (2, 9))
    scanned = _logits(params, tokens)
    unrolled = dataclasses.replace(params, cfg=dataclasses.replace(params.cfg, layer_loop="unroll"))
    np.testing.assert_array_equal(scanned, _logits(unrolled, tokens))


def test_scan_unroll_equals_one_layer_per_iteration():
    # k layers per scan iteration (3 layers: k = 2 leaves a remainder, 3 and 8 unroll fully)
    params = init_params(Config(quant="nvfp4", num_layers=3), 3, jnp.float32)
    tokens = np.random.default_rng(1).integers(0, 256, (2, 5))
    base = _logits(params, tokens)
    for k in (2, 3, 8):
        cfg = dataclasses.replace(params.cfg, scan_unroll=k)
        np.testing.assert_array_equal(base, _logits(dataclasses.replace(params, cfg=cfg), tokens))
    with pytest.raises(ValueError, match="scan_unroll must be an int >= 1, got 0"):
        Config(scan_unroll=0)


def test_scan_unroll_runs_fewer_loop_iterations():
    # the layer scan's while loop runs L / k iterations of k layer bodies: its known trip
    # count in the compiled program (a 4-layer stack: 4 at k = 1, 2 at k = 2)
    import re

    params = init_params(Config(quant="nvfp4", num_layers=4), 3, jnp.float32)
    tokens = jnp.zeros((1, 3), jnp.int32)
    pos = jnp.arange(3, dtype=jnp.int32)[None]

    def trips(k):
        p = dataclasses.replace(params, cfg=dataclasses.replace(params.cfg, scan_unroll=k))
        fn = jax.jit(lambda t: Model(p.cfg, jnp.float32).apply({"params": p.weights}, t, pos)[0])
        return re.findall(r'known_trip_count":\{"n":"(\d+)"', fn.lower(tokens).compile().as_text())

    assert trips(1) == ["4"] and trips(2) == ["2"]


# NVFP4 W4A4 logits, decode steps through the cache vs one full-sequence pass: the two add the
# same exact block dots in different float32 orders (on a GPU: the kernel vs the reference), so
# rare bf16 flips move activation codes downstream. Measured 0 (bit-equal) on this tiny model.
SEAM_RTOL = 2e-2


@pytest.mark.parametrize("quant", ["nvfp4", "nvfp4-w4a16"])
def test_nvfp4_decode_steps_equal_full_sequence_logits(quant):
    """The seam: logits of T decode steps (M = B rows per linear: the GEMV's domain on a GPU)
    equal the full-sequence logits (M = B * T: the GEMM path), within SEAM_RTOL."""
    params = init_params(Config(quant=quant), 4, jnp.float32)
    b, t, p = 2, 12, 5
    tokens = np.random.default_rng(5).integers(0, 256, (b, t)).astype(np.int32)
    full = _logits(params, tokens)
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    apply = jax.jit(
        lambda w, tok, pos, c: Model(params.cfg, jnp.float32).apply({"params": w}, tok, pos, c)
    )
    cache = init_cache(params.cfg, b, t, jnp.float32)
    first, cache = apply(params.weights, tokens[:, :p], positions[:, :p], cache)
    steps = [np.asarray(first)]
    for i in range(p, t):
        out, cache = apply(params.weights, tokens[:, i : i + 1], positions[:, i : i + 1], cache)
        steps.append(np.asarray(out))
    stepped = np.concatenate(steps, axis=1)
    rel = np.linalg.norm(stepped - full) / np.linalg.norm(full)
    assert rel <= SEAM_RTOL, rel


def test_loading_a_checkpoint_twice_compiles_once():
    """Two loads of the same checkpoint share one compiled prefill: the tokenizer in Params is
    static metadata compared by content, not by identity."""
    import rejax
    from rejax.data import TINY_MODEL

    a, b = rejax.load(TINY_MODEL), rejax.load(TINY_MODEL)
    assert a.tokenizer is not b.tokenizer and a.tokenizer == b.tokenizer
    assert hash(a.tokenizer) == hash(b.tokenizer)
    tokens = jnp.asarray([[1, 5, 9]], jnp.int32)
    positions = jnp.asarray([[0, 1, 2]], jnp.int32)
    prefill(a, tokens, positions, None)
    before = TRACE_COUNTS["prefill"]
    prefill(b, tokens, positions, None)
    assert TRACE_COUNTS["prefill"] == before


def test_compilation_cache_on_by_default_and_switches(monkeypatch, tmp_path):
    """rejax turns JAX's persistent cache on under the user's cache directory unless a cache
    directory is already configured or JAX_ENABLE_COMPILATION_CACHE turns it off."""
    saved = (jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache)
    try:
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
        monkeypatch.delenv("JAX_ENABLE_COMPILATION_CACHE", raising=False)
        jax.config.update("jax_compilation_cache_dir", None)
        compile_cache.enable_default()
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "rejax" / "jax")
        assert jax.config.jax_enable_compilation_cache
        jax.config.update("jax_compilation_cache_dir", "/elsewhere")
        compile_cache.enable_default()  # the user's choice stays
        assert jax.config.jax_compilation_cache_dir == "/elsewhere"
        jax.config.update("jax_compilation_cache_dir", None)
        monkeypatch.setenv("JAX_ENABLE_COMPILATION_CACHE", "false")
        compile_cache.enable_default()
        assert jax.config.jax_compilation_cache_dir is None
        compile_cache.set_compilation_cache(None)
        assert not jax.config.jax_enable_compilation_cache
    finally:
        jax.config.update("jax_compilation_cache_dir", saved[0])
        jax.config.update("jax_enable_compilation_cache", saved[1])


@pytest.mark.parametrize("quant", [None, "nvfp4"])
def test_live_slot_attention_equals_masked_attention(quant):
    """Config.attention='live' (decode steps read only the written slots through
    rejax.ops.decode_attention; its reference on CPU) gives the logits of the masked attention
    over every slot, step by step, in a cache with empty slots left over."""
    params = init_params(Config(quant=quant), 6, jnp.float32)
    live = dataclasses.replace(params, cfg=dataclasses.replace(params.cfg, attention="live"))
    b, t, p = 2, 9, 4
    tokens = np.random.default_rng(7).integers(0, 256, (b, t)).astype(np.int32)
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))

    def steps(pr):
        apply = jax.jit(
            lambda w, tok, pos, c: Model(pr.cfg, jnp.float32).apply({"params": w}, tok, pos, c)
        )
        cache = init_cache(pr.cfg, b, t + 5, jnp.float32)
        out, cache = apply(pr.weights, tokens[:, :p], positions[:, :p], cache)
        logits = [np.asarray(out)]
        for i in range(p, t):
            out, cache = apply(pr.weights, tokens[:, i : i + 1], positions[:, i : i + 1], cache)
            logits.append(np.asarray(out))
        return np.concatenate(logits, axis=1)

    a, c = steps(params), steps(live)
    np.testing.assert_allclose(c, a, rtol=1e-5, atol=1e-5)
