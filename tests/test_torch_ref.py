"""rejax.torch_ref: the PyTorch forward and ReSET policy agree with rejax on the same inputs."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from rejax import torch_ref
from rejax.config import Config
from rejax.nvfp4 import dequantize, quantize_activation, quantize_weight

TINY = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 16,
}


def _random_params(arch: str, tied: bool, dtype=jnp.float32, seed=0):
    """init_params with every leaf (norm scales and biases too) replaced by random values."""
    from rejax.params import init_params

    cfg = Config(arch=arch, tie_word_embeddings=tied, attention_bias=arch == "qwen2", **TINY)
    params = init_params(cfg, 0, dtype=dtype)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params.weights)
    rng = np.random.default_rng(seed)
    new = []
    for path, leaf in leaves:
        name = jax.tree_util.keystr(path)
        base = 1.0 if "scale" in name else 0.0
        value = base + rng.normal(0.0, 0.1 if "scale" in name else 0.05, leaf.shape)
        new.append(jnp.asarray(value, dtype))
    weights = jax.tree_util.tree_unflatten(treedef, new)
    return dataclasses.replace(params, weights=weights)


def _quantized(params, quant: str, input_scale=None):
    from rejax.params import map_linears, quantize_stack, shards

    def q(path, p):
        w16 = [a.astype(jnp.bfloat16) for a in p["weight"]]
        out = dict(p, weight=quantize_stack(w16, shards(params.cfg, path[1])))
        if input_scale is not None:
            out["input_scale"] = jnp.full((params.cfg.num_layers,), input_scale, jnp.float32)
        return out

    cfg = dataclasses.replace(params.cfg, quant=quant)
    return dataclasses.replace(params, weights=map_linears(params.weights, q), cfg=cfg)


TOKENS = np.random.default_rng(1).integers(0, 256, size=(2, 11))


@pytest.mark.parametrize("arch,tied", [("qwen3", False), ("qwen3", True), ("qwen2", True)])
def test_forward_matches_rejax_fp32(arch, tied):
    from rejax.generate import logits

    params = _random_params(arch, tied)
    ours = np.asarray(logits(params, jnp.asarray(TOKENS, jnp.int32)))
    ref = torch_ref.forward(params, TOKENS).numpy()
    assert ref.shape == ours.shape == (2, 11, 256)
    np.testing.assert_allclose(ref, ours, rtol=1e-4, atol=1e-5)  # STYLE.md: fp32 layer tolerance


def test_forward_matches_rejax_bf16():
    from rejax.generate import logits

    params = _random_params("qwen3", False, dtype=jnp.bfloat16)
    ours = np.asarray(logits(params, jnp.asarray(TOKENS, jnp.int32)))
    ref = torch_ref.forward(params, TOKENS).numpy()
    np.testing.assert_allclose(ref, ours, rtol=1e-2, atol=1e-2)  # STYLE.md: bf16 tolerance


def test_nvfp4_weight_dequantize_bit_exact():
    w = jnp.asarray(np.random.default_rng(2).normal(size=(48, 64)), jnp.bfloat16)
    qw = quantize_weight(w)
    tw = {
        "packed": torch_ref.to_torch(qw.packed),
        "scales": torch_ref.to_torch(qw.scales),
        "global_scale": torch_ref.to_torch(qw.global_scale),
        "shape": qw.shape,
    }
    np.testing.assert_array_equal(
        torch_ref.dequantize_weight(tw).numpy(), np.asarray(dequantize(qw))
    )


@pytest.mark.parametrize(
    "input_scale",
    [
        pytest.param(None, id="dynamic"),
        pytest.param(0.7 / (6 * 448), id="saturating"),
        pytest.param(4.0 / (6 * 448), id="roomy"),
    ],
)
def test_nvfp4_activation_fake_quant_bit_exact(input_scale):
    x = jnp.asarray(np.random.default_rng(0).normal(size=(64, 256)) * 3, jnp.bfloat16)
    ours = np.asarray(dequantize(quantize_activation(x, input_scale)))
    ref = torch_ref.fake_quantize_activation(torch_ref.to_torch(x), input_scale).numpy()
    np.testing.assert_array_equal(ref, ours)


@pytest.mark.parametrize(
    "quant,input_scale,bound",
    [
        # measured max |diff| / max |logit|: 1.1e-6 (W4A16), 1.6e-4 (W4A4 static), 0.13 (dynamic)
        pytest.param("nvfp4-w4a16", None, 1e-5, id="w4a16"),
        pytest.param("nvfp4", 2.0 / (6 * 448), 1e-3, id="w4a4-static"),
        pytest.param("nvfp4", None, 1e-3, id="w4a4-dynamic"),
    ],
)
def test_forward_quantized_close_to_rejax(quant, input_scale, bound):
    """Full model logits vs torch_ref, quantized: top-1 agreement and max abs logit diff.

    NVFP4 linears round to bf16 after a float32 sum whose order differs between the two paths
    (block-ordered reference vs one float32 matmul), so single bf16-ulp flips can propagate.
    """
    from rejax.generate import logits

    params = _quantized(_random_params("qwen3", False), quant, input_scale)
    ours = np.asarray(logits(params, jnp.asarray(TOKENS, jnp.int32)))
    ref = torch_ref.forward(params, TOKENS).numpy()
    top1 = np.mean(ours.argmax(-1) == ref.argmax(-1))
    diff = np.max(np.abs(ours - ref))
    scale = np.max(np.abs(ref))
    assert top1 >= 0.95, top1
    assert diff <= bound * scale, (diff, scale)
    # The quantization itself is visible: the float model differs by much more.
    float_params = dataclasses.replace(
        _random_params("qwen3", False), cfg=dataclasses.replace(params.cfg, quant=None)
    )
    float_logits = torch_ref.forward(float_params, TOKENS).numpy()
    assert np.max(np.abs(float_logits - ref)) > 10 * bound * scale


def _reset_stream(include_current: bool):
    from rejax import sampling

    v, b, steps = 64, 3, 90
    nl = np.zeros(v, bool)
    dnl = np.zeros(v, bool)
    nl[[1, 2]] = True
    dnl[[3]] = True
    cfg = sampling.ReSET(
        t_high=1.0,
        t_low=0.3,
        tau_0=2.5,
        window=4,
        nl_mask=jnp.asarray(nl),
        dnl_mask=jnp.asarray(dnl),
        include_current=include_current,
    )
    rng = np.random.default_rng(3)
    # Rows drift between peaked and flat distributions so both temperatures occur.
    sharp = 0.5 + 4.0 * np.abs(np.sin(np.arange(steps)[:, None] / 7.0 + np.arange(b)))
    logits = rng.normal(size=(steps, b, v)).astype(np.float32) * sharp[..., None].astype(np.float32)
    script = rng.choice(
        [1, 2, 3, 10, 11, 12, 13], p=[0.15, 0.1, 0.05, 0.2, 0.2, 0.2, 0.1], size=(steps, b)
    )
    state = sampling.reset_init(b, cfg.window)
    ref = torch_ref.TorchReSET.from_rejax(cfg, b)
    ours_t, ref_t, ours_h, ref_h = [], [], [], []
    for s in range(steps):
        t, h, state = sampling.reset_temperature(jnp.asarray(logits[s]), state, cfg)
        state = sampling.reset_observe(state, jnp.asarray(script[s], jnp.int32), cfg)
        rt, rh = ref.temperature(torch.from_numpy(logits[s]))
        ref.observe(script[s])
        ours_t.append(np.asarray(t))
        ours_h.append(np.asarray(h))
        ref_t.append(rt.numpy())
        ref_h.append(rh.numpy())
    return map(np.array, (ours_t, ref_t, ours_h, ref_h))


@pytest.mark.parametrize("include_current", [False, True])
def test_reset_decisions_match_rejax(include_current):
    ours_t, ref_t, ours_h, ref_h = _reset_stream(include_current)
    np.testing.assert_allclose(ref_h, ours_h, rtol=1e-5, atol=1e-5)
    assert set(np.unique(ours_t)) == {np.float32(0.3), np.float32(1.0)}  # both branches taken
    np.testing.assert_array_equal(ref_t, ours_t)


def test_top_p_keep_vllm_semantics():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    assert torch_ref.top_p_keep(probs, 0.8).tolist() == [[True, True, False, False]]
    assert torch_ref.top_p_keep(probs, 0.81).tolist() == [[True, True, True, False]]
    assert torch_ref.top_p_keep(probs, 1e-3).tolist() == [[True, False, False, False]]
    # The top token survives even when rounding leaves the total mass below 1 - p.
    short = torch.tensor([[0.3, 0.25, 0.2499, 0.2]])
    assert torch_ref.top_p_keep(short, 1e-5).tolist() == [[True, False, False, False]]
    with pytest.raises(ValueError, match="top_p"):
        torch_ref.top_p_keep(probs, 0.0)


def test_import_is_lazy():
    import subprocess
    import sys

    code = "import sys, rejax.torch_ref; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
