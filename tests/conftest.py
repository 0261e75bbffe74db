"""Test configuration and shared fixtures.

CPU by default; tests marked `gpu` skip unless JAX sees a CUDA GPU. `hf_tiny(arch, tie)` builds a
tiny random transformers model (seeded) and its rejax Params through a test-local name map.
"""

import jax
import jax.numpy as jnp
import pytest

from rejax.config import from_hf_config
from rejax.params import Params


def _has_cuda() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (gpu marker); none visible to JAX")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


TINY = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10_000.0,
    "initializer_range": 0.2,
}


def _hf_model(arch: str, tie: bool = False, seed: int = 0):
    import torch
    import transformers

    torch.manual_seed(seed)
    if arch == "qwen3":
        config = transformers.Qwen3Config(**TINY, tie_word_embeddings=tie)
        model = transformers.Qwen3ForCausalLM(config)
    else:
        kw = {k: v for k, v in TINY.items() if k != "head_dim"}
        config = transformers.Qwen2Config(**kw, tie_word_embeddings=tie)
        model = transformers.Qwen2ForCausalLM(config)
    model = model.float().eval()
    # Norm scales and biases start at 1 / 0; randomize them so the parity test sees them.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def _params_from_hf(model) -> Params:
    """Test-local HF -> rejax mapping (the library's lives in rejax/checkpoint.py): per-layer
    tensors stacked, q/k/v and gate/up rows concatenated, float linears one array per layer."""
    cfg = from_hf_config(model.config.to_dict())
    sd = {k: jnp.asarray(v.detach().numpy()) for k, v in model.state_dict().items()}
    L = cfg.num_layers

    def per_layer(name):
        return [sd[f"model.layers.{i}.{name}"] for i in range(L)]

    def fused(names, suffix="weight"):
        return [
            jnp.concatenate([sd[f"model.layers.{i}.{n}.{suffix}"] for n in names]) for i in range(L)
        ]

    qkv = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    attn = {
        "qkv_proj": {"weight": tuple(fused(qkv))},
        "o_proj": {"weight": tuple(per_layer("self_attn.o_proj.weight"))},
    }
    if cfg.attention_bias:
        attn["qkv_proj"]["bias"] = jnp.stack(fused(qkv, "bias"))
    if cfg.arch == "qwen3":
        for n in ("q_norm", "k_norm"):
            attn[n] = {"scale": jnp.stack(per_layer(f"self_attn.{n}.weight"))}
    w = {
        "embed_tokens": {"embedding": sd["model.embed_tokens.weight"]},
        "layers": {
            "input_layernorm": {"scale": jnp.stack(per_layer("input_layernorm.weight"))},
            "post_attention_layernorm": {
                "scale": jnp.stack(per_layer("post_attention_layernorm.weight"))
            },
            "self_attn": attn,
            "mlp": {
                "gate_up_proj": {"weight": tuple(fused(("mlp.gate_proj", "mlp.up_proj")))},
                "down_proj": {"weight": tuple(per_layer("mlp.down_proj.weight"))},
            },
        },
        "norm": {"scale": sd["model.norm.weight"]},
    }
    if not cfg.tie_word_embeddings:
        w["lm_head"] = {"weight": sd["lm_head.weight"]}
    return Params(weights=w, cfg=cfg)


@pytest.fixture
def hf_tiny():
    """factory(arch, tie=False, seed=0) -> (transformers model, rejax Params) in fp32."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")

    def make(arch, tie=False, seed=0):
        model = _hf_model(arch, tie, seed)
        return model, _params_from_hf(model)

    return make
