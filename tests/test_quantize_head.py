"""The opt-in NVFP4 W4A16 lm_head (`rejax.params.quantize_head`)."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _lowering import decode_step_cuda_text

from cuda_ops import nvfp4_gemv
from rejax import nvfp4
from rejax import params as rparams
from rejax.config import Config
from rejax.decoder import forward
from rejax.nvfp4 import Nvfp4Tensor

CFG = Config(vocab_size=272, max_position_embeddings=256, num_layers=2)


@pytest.fixture(scope="module")
def params():
    return rparams.init_params(CFG, 3, jnp.bfloat16)


def _logits(p, tokens):
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return np.asarray(forward(p.weights, tokens, pos, None, p.cfg, None)[0], np.float64)


def test_head_logits_are_the_dequantized_table_times_bf16_activations(params):
    """The quantized head's logits equal the model whose head is the dequantized NVFP4 table
    (float32, exact) up to the bf16 rounding of the output: only the head changed, and it is
    `nvfp4.dequantize` of `quantize_weight`'s codes."""
    q = rparams.quantize_head(params)
    t = q.weights["lm_head"]["weight"]
    assert isinstance(t, Nvfp4Tensor) and t.shape == (CFG.vocab_size, CFG.hidden_size)
    want_t = nvfp4.quantize_weight(np.asarray(params.weights["lm_head"]["weight"], np.float32))
    np.testing.assert_array_equal(np.asarray(t.packed), np.asarray(want_t.packed))
    deq = dataclasses.replace(
        params,
        weights={
            **params.weights,
            "lm_head": {"weight": jnp.asarray(nvfp4.dequantize(t), jnp.float32)},
        },
    )
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 9)), jnp.int32)
    got, ref, bf16 = _logits(q, tokens), _logits(deq, tokens), _logits(params, tokens)
    scale = np.abs(ref).max()
    # deq casts the table to bf16 in the einsum; the kernel's reference sums exact products:
    # both within a few bf16 ulps of the logits' scale
    assert np.abs(got - ref).max() <= 2**-6 * scale, np.abs(got - ref).max() / scale
    # and the head changed the logits by NVFP4's weight rounding, far more than that
    assert np.abs(got - bf16).max() > 4 * np.abs(got - ref).max()
    assert rparams.quantize_head(q) is q


def test_random_head_and_refusals(params):
    r = rparams.quantize_head(params, random_key=1)
    t = r.weights["lm_head"]["weight"]
    assert t.packed.shape == (CFG.vocab_size, CFG.hidden_size // 2) and t.packed.dtype == jnp.uint8
    tied = rparams.init_params(dataclasses.replace(CFG, tie_word_embeddings=True), 0)
    with pytest.raises(ValueError, match="untied lm_head"):
        rparams.quantize_head(tied)
    from rejax import sharding

    mesh = jax.make_mesh((1, 1), ("data", "model"))
    with pytest.raises(ValueError, match="NVFP4 lm_head"):
        sharding.shard(r, mesh)
    with pytest.raises(ValueError, match="unsharded"):
        rparams.quantize_head(sharding.shard(params, mesh))


def test_decode_step_lowers_the_head_to_the_w4a16_gemv(monkeypatch):
    """On CUDA the quantized head of a bf16 model is one `nvfp4_gemv_w4a16` launch (M = batch
    rows) in the decode step; without it the step has no NVFP4 kernel at all."""
    seen = []

    def fake_compile(source, *, name, defines, arch, options=(), use_cache=True):
        seen.append(defines)
        params = ", ".join(f".param .u64 p{i}" for i in range(6))
        return (
            f".version 9.0\n.target sm_90\n.visible .entry nvfp4_gemv_w4a16({params})\n{{ ret; }}\n"
        )

    monkeypatch.setattr(nvfp4_gemv, "compile_ptx", fake_compile)
    nvfp4_gemv._build_cached.cache_clear()
    try:
        monkeypatch.setattr(rparams, "init_params", _with_head(rparams.init_params))
        cfg = dataclasses.replace(CFG, hidden_size=256, intermediate_size=512, head_dim=64)
        text = decode_step_cuda_text(cfg, batch=2)
    finally:
        nvfp4_gemv._build_cached.cache_clear()
    entries = re.findall(r"name = \\22(\w+)\\22", text)
    assert entries.count("nvfp4_gemv_w4a16") == 1, entries
    assert [(d["M_TOK"], d["N_OUT"], d["K_IN"]) for d in seen] == [(2, 272, 256)], seen


def _with_head(init):
    def make(cfg, key, dtype=jnp.float32):
        return rparams.quantize_head(init(cfg, key, dtype))

    return make


def test_torch_mirror_reads_the_quantized_head(params):
    """`rejax.torch_ref.forward` dequantizes the NVFP4 head: its logits track the JAX ones."""
    pytest.importorskip("torch")
    from rejax import torch_ref

    q = rparams.quantize_head(params)
    tokens = np.random.default_rng(1).integers(0, 256, (2, 7))
    want = _logits(q, jnp.asarray(tokens, jnp.int32))
    got = torch_ref.forward(q, tokens).numpy().astype(np.float64)
    assert np.abs(got - want).max() <= 2**-5 * np.abs(want).max()
