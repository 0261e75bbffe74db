"""Test configuration and shared fixtures.

CPU by default; tests marked `gpu` skip unless JAX sees a CUDA GPU. Fixtures:
- `hf_model(arch, tie=False, seed=0)`: a tiny random transformers Qwen3 / Qwen2 (fp32, seeded,
  random norm scales and biases); skips without torch and transformers.
- `hf_tiny(arch, tie=False, seed=0)`: that model and its rejax Params through a test-local
  name map.
- `chat_checkpoint`: a directory holding a tiny random Qwen3 with a byte-level tokenizer,
  ChatML chat template and <|im_end|> as EOS, written once per session by transformers.
- `math_problems`: three arithmetic problems with answers, the rows of a problems file.
"""

import json
import string
import sys

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


def pytest_addoption(parser):
    parser.addoption(
        "--failures-now",
        action="store_true",
        help="write each failure's traceback to stderr as soon as the test fails (for device "
        "runs that a time limit may stop before pytest's summary)",
    )


_FAILURES_NOW = {"on": False}


def pytest_configure(config):
    _FAILURES_NOW["on"] = bool(config.getoption("--failures-now", default=False))


def pytest_runtest_logreport(report):
    if _FAILURES_NOW["on"] and report.failed:
        sys.stderr.write(f"\n=== FAILED {report.nodeid} ({report.when})\n{report.longreprtext}\n")
        sys.stderr.flush()


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
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

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
    """Test-local HF -> rejax mapping (the library's lives in rejax/checkpoint/names.py): per-layer
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


@pytest.fixture(scope="session")
def hf_model():
    """factory(arch, tie=False, seed=0) -> a tiny random transformers model in fp32."""
    return _hf_model


@pytest.fixture
def hf_tiny():
    """factory(arch, tie=False, seed=0) -> (transformers model, rejax Params) in fp32."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")

    def make(arch, tie=False, seed=0):
        model = _hf_model(arch, tie, seed)
        return model, _params_from_hf(model)

    return make


# ----------------------------------------------------------------------------- chat checkpoint


def _byte_symbols() -> dict[int, str]:
    # GPT-2 byte -> printable-unicode table, as the ByteLevel pre-tokenizer uses.
    bs = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    cs, extra = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return dict(zip(bs, map(chr, cs)))


CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _write_chat_checkpoint(directory, *, seed: int = 0, vocab_size: int = 128):
    """A random 2-layer Qwen3 (D=64) with a character-level byte BPE tokenizer ("\\n\\n" is one
    token), ChatML chat template and <|im_end|> as EOS, written by transformers."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    directory.mkdir(parents=True, exist_ok=True)
    sym = _byte_symbols()
    vocab = {}
    for c in [*string.printable[:95], "\n"]:
        vocab[sym[ord(c)]] = len(vocab)
    nl = sym[ord("\n")]
    vocab[nl + nl] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(nl, nl)]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.save(str(directory / "tokenizer.json"))
    eos = tok.token_to_id("<|im_end|>")
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>"})
    )
    torch.manual_seed(seed)
    # A large init range gives peaked logits, so argmax decisions are not near-ties.
    cfg = transformers.Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        eos_token_id=eos,
        tie_word_embeddings=False,
        initializer_range=0.3,
    )
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def chat_checkpoint(tmp_path_factory):
    """A tiny random chat checkpoint (see `_write_chat_checkpoint`); tests must not modify it."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    return _write_chat_checkpoint(tmp_path_factory.mktemp("chat_checkpoint"))


_MATH_PROBLEMS = [
    {"problem": "Evaluate 1 + 2.", "answer": "3"},
    {"problem": "Evaluate 4 * 5.", "answer": "20"},
    {"problem": "Evaluate 9 - 12.", "answer": "-3"},
]


@pytest.fixture
def math_problems():
    """Three {"problem", "answer"} rows (a fresh copy per test)."""
    return [dict(p) for p in _MATH_PROBLEMS]


@pytest.fixture
def quant_defines(tmp_path, monkeypatch):
    """The defines of every quantizer kernel compiled while the test runs (NVRTC still runs,
    into a fresh kernel cache)."""
    from cuda_ops import nvfp4_quant

    monkeypatch.setenv("REJAX_KERNEL_CACHE", str(tmp_path))
    nvfp4_quant._build_cached.cache_clear()
    seen = []
    compile_ptx = nvfp4_quant.compile_ptx

    def recording(source, *, defines, **kw):
        seen.append(dict(defines))
        return compile_ptx(source, defines=defines, **kw)

    monkeypatch.setattr(nvfp4_quant, "compile_ptx", recording)
    yield seen
    nvfp4_quant._build_cached.cache_clear()
