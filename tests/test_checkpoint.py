"""rejax.checkpoint: HF safetensors and ModelOpt NVFP4 loading, saving, and bad input.

Every checkpoint here is written by the test: tiny random Qwen3 / Qwen2 models from
transformers, and ModelOpt-format NVFP4 checkpoints built from the format description with
ModelOpt's own `NVFP4QTensor.quantize` (CPU) and written with safetensors' torch writer, so the
reader under test never reads files written by its own writer except in the round-trip tests.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

try:  # torch is optional: the tests whose checkpoints transformers writes skip in `hf_model`
    import torch
    import transformers
    from safetensors.torch import load_file, save_file
except ImportError:
    torch = transformers = load_file = save_file = None

import rejax
import rejax.checkpoint.reader as ckpt
from rejax import nvfp4
from rejax.checkpoint import CheckpointFileNotFoundError, load, save
from rejax.config import Config
from rejax.generate import logits
from rejax.nvfp4 import Nvfp4Tensor, dequantize
from rejax.params import init_params

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"


# ----------------------------------------------------------------------------- fixtures


def _write_tokenizer(directory):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "\n", "\n\n", "hello", "world", "a", "b", "=", "1", "2"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
    tok.save(str(directory / "tokenizer.json"))
    tcfg = {
        "chat_template": CHAT_TEMPLATE,
        "eos_token": "<|im_end|>",
        "pad_token": {"content": "<|endoftext|>", "special": True},
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tcfg))
    return tok


def _write_hf(hf_model, directory, arch="qwen3", tied=False, shard=None, tokenizer=True, seed=0):
    """Writes `hf_model(arch, tied, seed)` with transformers; returns its state dict."""
    model = hf_model(arch, tied, seed)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    if tokenizer:
        _write_tokenizer(directory)
    gen = {"eos_token_id": [2, 3], "temperature": 0.6, "top_p": 0.95, "do_sample": True}
    (directory / "generation_config.json").write_text(json.dumps(gen))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory, hf_model):
    d = tmp_path_factory.mktemp("qwen3")
    return d, _write_hf(hf_model, d, "qwen3", tied=False)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory, hf_model):
    d = tmp_path_factory.mktemp("qwen2")
    return d, _write_hf(hf_model, d, "qwen2", tied=True, seed=1)


def _copy(src, tmp_path, name="copy"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def _rewrite_tensors(directory, fn):
    """Loads model.safetensors with torch, applies fn(dict) in place, writes it back."""
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _edit_json(path, fn):
    value = json.loads(path.read_text())
    fn(value)
    path.write_text(json.dumps(value))


_FUSED = {  # HF linear -> (rejax fused linear, shard index); an independent restatement
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}


def _rows(cfg, fused: str, shard: int) -> slice:
    """Rows of shard `shard` in the fused linear (q, k, v rows; gate, up rows)."""
    qh, kvh, f = (
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
        cfg.intermediate_size,
    )
    sizes = {"qkv_proj": (qh, kvh, kvh), "gate_up_proj": (f, f)}.get(fused, (None,))
    start = sum(sizes[:shard]) if shard else 0
    return slice(start, None if sizes[shard] is None else start + sizes[shard])


def _entry(params, prefix: str) -> dict:
    """The rejax view of one HF linear `prefix` (e.g. "model.layers.1.mlp.down_proj"): its
    weight (float array, or an Nvfp4Tensor of just its rows), bias and input_scale."""
    parts = prefix.split(".")
    layer, block, name = int(parts[2]), parts[3], parts[4]
    fused, shard = _FUSED[name]
    stacked = params.weights["layers"][block][fused]
    rows = _rows(params.cfg, fused, shard)
    out = {}
    w = stacked["weight"]
    if isinstance(w, Nvfp4Tensor):
        g = _np(w.global_scale)[layer]
        g = g[rows] if g.ndim else g
        if g.ndim and np.all(g == g[0]):
            g = g[0]
        packed = _np(w.packed)[layer][rows]
        out["weight"] = Nvfp4Tensor(
            packed=packed,
            scales=_np(w.scales)[layer][rows],
            global_scale=np.asarray(g, np.float32),
            shape=(packed.shape[0], w.shape[1]),
        )
    else:
        out["weight"] = _np(w[layer])[rows]
    if "bias" in stacked:
        out["bias"] = _np(stacked["bias"])[layer][rows]
    if "input_scale" in stacked:
        s = _np(stacked["input_scale"])[layer]
        out["input_scale"] = s[shard] if s.ndim else s
    return out


def _hf_view(params, hf_name: str):
    """The rejax array holding HF tensor `hf_name` (test oracle of the name map and layout)."""
    w = params.weights
    if hf_name == "model.embed_tokens.weight":
        return w["embed_tokens"]["embedding"]
    if hf_name == "model.norm.weight":
        return w["norm"]["scale"]
    if hf_name == "lm_head.weight":
        return w["lm_head"]["weight"]
    parts = hf_name.split(".")
    layer, rest = int(parts[2]), parts[3:]
    if rest[0] in ("input_layernorm", "post_attention_layernorm"):
        return _np(w["layers"][rest[0]]["scale"])[layer]
    if rest[1] in ("q_norm", "k_norm"):
        return _np(w["layers"]["self_attn"][rest[1]]["scale"])[layer]
    return _entry(params, ".".join(parts[:5]))[rest[2]]


def _leaf(weights, path):
    for key in path:
        weights = weights[key]
    return weights


def _np(x):
    return np.asarray(x)


# ----------------------------------------------------------------------------- float loading


@pytest.mark.parametrize(
    "arch,tied,shard",
    [
        ("qwen3", False, None),
        ("qwen3", True, None),
        ("qwen2", True, None),
        ("qwen2", False, "40KB"),
        ("qwen3", False, "40KB"),
    ],
)
def test_load_matches_torch_state_dict(tmp_path, hf_model, arch, tied, shard):
    state = _write_hf(hf_model, tmp_path, arch, tied=tied, shard=shard)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").exists()
        assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    params = load(tmp_path, dtype=jnp.float32)
    cfg = params.cfg
    assert (cfg.arch, cfg.tie_word_embeddings, cfg.quant) == (arch, tied, None)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (256, 64, 128)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 4, 2, 16)
    assert cfg.attention_bias == (arch == "qwen2")
    expected = {k: v for k, v in state.items() if not (tied and k == "lm_head.weight")}
    for name, tensor in expected.items():
        leaf = _hf_view(params, name)
        assert leaf.dtype == jnp.float32, name
        np.testing.assert_array_equal(_np(leaf), tensor.numpy(), err_msg=name)
    # Nothing more than the checkpoint's tensors: every element is one of theirs.
    import jax

    total = sum(int(np.size(a)) for a in jax.tree_util.tree_leaves(params.weights))
    assert total == sum(int(t.numel()) for t in expected.values())
    assert ("lm_head" in params.weights) == (not tied)


def test_load_default_dtype_is_bf16(qwen3_dir):
    directory, state = qwen3_dir
    params = load(directory)
    leaf = _entry(params, "model.layers.1.mlp.down_proj")["weight"]
    assert leaf.dtype == ml_dtypes.bfloat16
    ref = state["model.layers.1.mlp.down_proj.weight"].to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(_np(leaf).astype(np.float32), ref)


def test_bf16_checkpoint_loads_bit_exact(tmp_path, hf_model):
    model = hf_model("qwen3", False).to(torch.bfloat16)
    model.save_pretrained(tmp_path, safe_serialization=True)
    params = load(tmp_path)  # bf16 -> bf16: no rounding at all
    for name, tensor in model.state_dict().items():
        leaf = _np(_hf_view(params, name))
        assert leaf.dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(
            leaf.view(np.uint16), tensor.view(torch.int16).numpy().view(np.uint16)
        )


def test_tokenizer_and_generation_config(qwen3_dir, tmp_path):
    directory, _ = qwen3_dir
    params = load(directory)
    host = params.tokenizer
    assert host is not None
    assert host.tokenizer.encode("hello world a").ids == [3, 4, 5]
    assert host.chat_template == CHAT_TEMPLATE
    assert host.special_tokens["eos_token"] == "<|im_end|>"
    assert host.special_tokens["pad_token"] == "<|endoftext|>"
    assert host.special_tokens["additional_special_tokens"] == ("<|im_start|>", "<|im_end|>")
    gen = dict(params.generation_config)
    assert gen["eos_token_id"] == (2, 3)
    assert gen["temperature"] == 0.6 and gen["top_p"] == 0.95
    assert list(params.generation_config) == sorted(params.generation_config)
    hash(params.generation_config)  # static pytree metadata must be hashable
    # chat_template.jinja overrides tokenizer_config.json's template.
    d = _copy(directory, tmp_path)
    (d / "chat_template.jinja").write_text("{{ messages }}")
    assert load(d).tokenizer.chat_template == "{{ messages }}"
    # No tokenizer files -> tokenizer None; no generation config -> ().
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (d / f).unlink()
    params = load(d)
    assert params.tokenizer is None and params.generation_config == ()


# ----------------------------------------------------------------------------- quantize on load


def test_quant_nvfp4_quantizes_every_linear(qwen3_dir, caplog):
    directory, state = qwen3_dir
    with caplog.at_level(logging.WARNING, logger="rejax.checkpoint"):
        params = load(directory, quant="nvfp4")
    notices = [r.getMessage() for r in caplog.records if "dynamic" in r.getMessage()]
    assert len(notices) == 1 and "calibrate_input_scales" in notices[0]
    assert params.cfg.quant == "nvfp4"
    for i in range(2):
        for block, name in [("self_attn", n) for n in LINEARS[:4]] + [
            ("mlp", n) for n in LINEARS[4:]
        ]:
            entry = _entry(params, f"model.layers.{i}.{block}.{name}")
            assert set(entry) == {"weight"}, (i, name)  # W4A4 dynamic: no input_scale
            w = entry["weight"]
            assert isinstance(w, Nvfp4Tensor)
            hf = state[f"model.layers.{i}.{block}.{name}.weight"]
            # the numpy twin of quantize_weight: the bytes the loader gave before it went jitted
            ref = nvfp4._quantize_weight_numpy(jnp.asarray(hf.numpy()).astype(jnp.bfloat16))
            assert w.shape == tuple(hf.shape)
            np.testing.assert_array_equal(_np(w.packed), _np(ref.packed))
            np.testing.assert_array_equal(
                _np(w.scales).view(np.uint8), _np(ref.scales).view(np.uint8)
            )
            assert _np(w.global_scale).shape == () and _np(w.global_scale) == _np(ref.global_scale)
    # Embedding, norms and lm_head stay float (bf16).
    assert params.weights["embed_tokens"]["embedding"].dtype == jnp.bfloat16
    assert params.weights["lm_head"]["weight"].dtype == jnp.bfloat16
    assert params.weights["layers"]["self_attn"]["q_norm"]["scale"].dtype == jnp.bfloat16


def test_quant_w4a16_same_weights_no_notice(qwen2_dir, caplog):
    directory, state = qwen2_dir
    with caplog.at_level(logging.WARNING, logger="rejax.checkpoint"):
        params = load(directory, quant="nvfp4-w4a16")
    assert not caplog.records
    assert params.cfg.quant == "nvfp4-w4a16"
    entry = _entry(params, "model.layers.0.self_attn.k_proj")
    assert set(entry) == {"weight", "bias"}  # qwen2 bias stays float
    ref = nvfp4._quantize_weight_numpy(
        jnp.asarray(state["model.layers.0.self_attn.k_proj.weight"].numpy()).astype(jnp.bfloat16)
    )
    np.testing.assert_array_equal(_np(entry["weight"].packed), _np(ref.packed))
    np.testing.assert_array_equal(
        _np(entry["bias"]).astype(np.float32),
        state["model.layers.0.self_attn.k_proj.bias"].to(torch.bfloat16).float().numpy(),
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_quant_nvfp4_quantizes_the_weight_cast_to_dtype(qwen3_dir, dtype):
    """Each float32 linear is cast to `dtype` (on the device) and quantized from that."""
    directory, state = qwen3_dir
    params = load(directory, quant="nvfp4", dtype=dtype)
    for name in ("model.layers.0.self_attn.v_proj", "model.layers.1.mlp.up_proj"):
        w = _entry(params, name)["weight"]
        ref = nvfp4._quantize_weight_numpy(state[f"{name}.weight"].numpy().astype(dtype))
        np.testing.assert_array_equal(_np(w.packed), _np(ref.packed), err_msg=name)
        np.testing.assert_array_equal(
            _np(w.scales).view(np.uint8), _np(ref.scales).view(np.uint8), err_msg=name
        )
        assert _np(w.global_scale).tobytes() == _np(ref.global_scale).tobytes(), name


# ----------------------------------------------------------------------------- ModelOpt NVFP4


def _modelopt_quantize(w: torch.Tensor):
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    qt, scale, scale_2 = NVFP4QTensor.quantize(w, 16)
    return qt, scale, scale_2


def _write_modelopt(
    directory, src_dir, *, exclude=("lm_head",), scalar_shape=(), algo="NVFP4", seed=0
):
    """Writes a ModelOpt NVFP4 checkpoint of the float model in `src_dir` (the format that
    rejax.checkpoint's docstring describes).

    Returns {hf tensor name: torch tensor} as written, and {linear prefix: ModelOpt QTensor}.
    """
    shutil.copytree(src_dir, directory, dirs_exist_ok=True)
    source = load_file(str(src_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    out, qtensors = {}, {}
    for name, t in source.items():
        prefix = name.rsplit(".", 1)[0]
        is_linear = name.endswith(".weight") and prefix.split(".")[-1] in LINEARS
        skip = any(prefix == e or prefix.startswith(e.rstrip("*")) for e in exclude)
        if not is_linear or skip:
            out[name] = t.to(torch.bfloat16)
            continue
        qt, scale, scale_2 = _modelopt_quantize(t.to(torch.bfloat16))
        qtensors[prefix] = (qt, scale, scale_2)
        out[name] = qt._quantized_data
        out[f"{prefix}.weight_scale"] = scale
        out[f"{prefix}.weight_scale_2"] = scale_2.float().reshape(scalar_shape)
        if algo == "NVFP4":
            amax = 1.0 + torch.rand((), generator=gen)
            out[f"{prefix}.input_scale"] = (amax / (6 * 448)).reshape(scalar_shape)
    (directory / "model.safetensors").unlink()
    save_file(out, str(directory / "model.safetensors"), metadata={"format": "pt"})
    quant = {
        "quant_algo": algo,
        "kv_cache_quant_algo": None,
        "group_size": 16,
        "exclude_modules": list(exclude),
    }
    (directory / "hf_quant_config.json").write_text(
        json.dumps({"producer": {"name": "modelopt", "version": "0.47.0"}, "quantization": quant})
    )
    _edit_json(
        directory / "config.json",
        lambda c: c.update(
            quantization_config={
                "quant_algo": algo,
                "quant_method": "modelopt",
                "ignore": list(exclude),
            }
        ),
    )
    return out, qtensors


@pytest.fixture(scope="module")
def modelopt_dir(qwen3_dir, tmp_path_factory):
    src, _ = qwen3_dir
    d = tmp_path_factory.mktemp("modelopt")
    written, qtensors = _write_modelopt(d, src)
    return d, written, qtensors


def test_modelopt_checkpoint_bytes_untouched(modelopt_dir):
    directory, written, qtensors = modelopt_dir
    params = load(directory)
    assert params.cfg.quant == "nvfp4"
    assert len(qtensors) == 14
    for prefix, (qt, scale, scale_2) in qtensors.items():
        entry = _entry(params, prefix)
        assert set(entry) == {"weight", "input_scale"}
        w = entry["weight"]
        np.testing.assert_array_equal(_np(w.packed), written[prefix + ".weight"].numpy())
        np.testing.assert_array_equal(
            _np(w.scales).view(np.uint8),
            written[prefix + ".weight_scale"].view(torch.uint8).numpy(),
        )
        assert _np(w.global_scale).shape == ()
        assert _np(w.global_scale) == scale_2.float().item()
        assert _np(entry["input_scale"]).dtype == np.float32
        assert _np(entry["input_scale"]) == written[prefix + ".input_scale"].item()
        # Nibble order: our dequantization equals ModelOpt's of the same bytes.
        ref = qt.dequantize(
            dtype=torch.float32, scale=scale, double_scale=scale_2, block_sizes={-1: 16}
        )
        np.testing.assert_array_equal(_np(dequantize(w)), ref.numpy())
    # The excluded lm_head, embeddings and norms stay float.
    assert params.weights["lm_head"]["weight"].dtype == jnp.bfloat16


def test_modelopt_matches_quantize_on_load(modelopt_dir, qwen3_dir):
    directory, _, _ = modelopt_dir
    a = load(directory)
    b = load(qwen3_dir[0], quant="nvfp4")
    wa = _entry(a, "model.layers.1.mlp.gate_proj")["weight"]
    wb = _entry(b, "model.layers.1.mlp.gate_proj")["weight"]
    np.testing.assert_array_equal(_np(wa.packed), _np(wb.packed))
    np.testing.assert_array_equal(_np(wa.scales).view(np.uint8), _np(wb.scales).view(np.uint8))


def test_modelopt_scalar_shape_1_and_exclude_patterns(qwen3_dir, tmp_path):
    """Scalars stored as [1]; an exclude pattern that keeps one linear kind float in every layer
    (here every layer's MLP) loads those stacks float; a pattern that splits a stack (one
    layer's MLP float, the other's NVFP4) is refused with the modules named."""
    src, state = qwen3_dir
    written, _ = _write_modelopt(
        tmp_path / "m",
        src,
        exclude=("lm_head", "model.layers.0.mlp", "model.layers.1.mlp"),
        scalar_shape=(1,),
    )
    assert written["model.layers.0.self_attn.o_proj.weight_scale_2"].shape == (1,)
    params = load(tmp_path / "m")
    o = _entry(params, "model.layers.0.self_attn.o_proj")
    assert _np(o["weight"].global_scale).shape == () and _np(o["input_scale"]).shape == ()
    for i in range(2):
        for name in ("gate_proj", "up_proj", "down_proj"):
            entry = _entry(params, f"model.layers.{i}.mlp.{name}")
            assert set(entry) == {"weight"} and not isinstance(entry["weight"], Nvfp4Tensor)
            ref = state[f"model.layers.{i}.mlp.{name}.weight"].to(torch.bfloat16).float().numpy()
            np.testing.assert_array_equal(_np(entry["weight"]).astype(np.float32), ref)
    assert isinstance(params.weights["layers"]["self_attn"]["o_proj"]["weight"], Nvfp4Tensor)
    _write_modelopt(tmp_path / "split", src, exclude=("lm_head", "model.layers.1.mlp*"))
    with pytest.raises(ValueError, match=r"keep \['model\.layers\.1\.mlp\.gate_proj', .*float but"):
        load(tmp_path / "split")


def test_modelopt_w4a16_and_mode_conflicts(modelopt_dir, qwen3_dir, tmp_path, caplog):
    directory, written, _ = modelopt_dir
    # quant="nvfp4" on an NVFP4 (W4A4) checkpoint is the checkpoint's own mode.
    same = load(directory, quant="nvfp4")
    assert "input_scale" in _entry(same, "model.layers.0.mlp.down_proj")
    # quant="nvfp4-w4a16" keeps the bytes, drops the activation scales, and says so.
    with caplog.at_level(logging.WARNING, logger="rejax.checkpoint"):
        w4a16 = load(directory, quant="nvfp4-w4a16")
    assert any("W4A16" in r.getMessage() for r in caplog.records)
    assert w4a16.cfg.quant == "nvfp4-w4a16"
    entry = _entry(w4a16, "model.layers.0.mlp.down_proj")
    assert set(entry) == {"weight"}
    np.testing.assert_array_equal(
        _np(entry["weight"].packed), written["model.layers.0.mlp.down_proj.weight"].numpy()
    )
    # A W4A16_NVFP4 checkpoint (no input_scale) loads as W4A16, or as dynamic W4A4 on request.
    _write_modelopt(tmp_path / "w", qwen3_dir[0], algo="W4A16_NVFP4")
    assert load(tmp_path / "w").cfg.quant == "nvfp4-w4a16"
    dyn = load(tmp_path / "w", quant="nvfp4")
    assert dyn.cfg.quant == "nvfp4" and "input_scale" not in _entry(
        dyn, "model.layers.0.mlp.up_proj"
    )


def test_fp8_kv_scales_dropped_with_warning(modelopt_dir, tmp_path, caplog):
    d = _copy(modelopt_dir[0], tmp_path)
    _rewrite_tensors(
        d,
        lambda t: t.update(
            {
                "model.layers.0.self_attn.k_proj.k_scale": torch.tensor(1.0),
                "model.layers.0.self_attn.v_proj.v_scale": torch.tensor(1.0),
            }
        ),
    )
    with caplog.at_level(logging.WARNING, logger="rejax.checkpoint"):
        load(d)
    assert any("KV-cache" in r.getMessage() for r in caplog.records)


# ----------------------------------------------------------------------------- round trips


def _assert_params_equal(a, b):
    import jax

    assert a.cfg == b.cfg
    la, ta = jax.tree_util.tree_flatten(a.weights)
    lb, tb = jax.tree_util.tree_flatten(b.weights)
    assert ta == tb
    for x, y in zip(la, lb):
        x, y = _np(x), _np(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()
    assert a.generation_config == b.generation_config


def test_round_trip_bf16(qwen3_dir, tmp_path):
    directory, state = qwen3_dir
    first = load(directory)
    save(first, tmp_path / "a")
    second = load(tmp_path / "a")
    _assert_params_equal(first, second)
    assert second.tokenizer.chat_template == CHAT_TEMPLATE
    assert second.tokenizer.special_tokens == first.tokenizer.special_tokens
    assert (
        second.tokenizer.tokenizer.encode("a = 1\n\nb").ids
        == first.tokenizer.tokenizer.encode("a = 1\n\nb").ids
    )
    # transformers reads what we wrote (config.json is regenerated from Config).
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "a", dtype=torch.float32)
    for name, tensor in hf.state_dict().items():
        ref = state[name].to(torch.bfloat16).float()
        torch.testing.assert_close(tensor, ref, rtol=0, atol=0, msg=name)
    # Sharded save, then saving the sharded load unsharded again: same arrays.
    save(second, tmp_path / "s", max_shard_bytes=20_000)
    assert len(list((tmp_path / "s").glob("model-*.safetensors"))) > 2
    third = load(tmp_path / "s")
    _assert_params_equal(first, third)
    save(third, tmp_path / "a")  # overwrite an existing directory
    _assert_params_equal(first, load(tmp_path / "a"))


def test_round_trip_qwen2_tied_float32(qwen2_dir, tmp_path):
    first = load(qwen2_dir[0], dtype=jnp.float32)
    save(first, tmp_path / "a")
    assert json.loads((tmp_path / "a" / "config.json").read_text())["dtype"] == "float32"
    _assert_params_equal(first, load(tmp_path / "a", dtype=jnp.float32))


def test_round_trip_modelopt_nvfp4(modelopt_dir, tmp_path):
    directory, written, _ = modelopt_dir
    first = load(directory)
    save(first, tmp_path / "a")
    # Files: the same tensor names, dtypes and bytes as the ModelOpt checkpoint.
    again = load_file(str(tmp_path / "a" / "model.safetensors"))
    assert sorted(again) == sorted(written)
    for name, t in written.items():
        assert again[name].dtype == t.dtype, name
        assert again[name].shape == t.shape, name
        assert torch.equal(
            again[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)
        ), name
    qcfg = json.loads((tmp_path / "a" / "hf_quant_config.json").read_text())["quantization"]
    assert qcfg["quant_algo"] == "NVFP4" and qcfg["exclude_modules"] == ["lm_head"]
    hf_cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    assert hf_cfg["quantization_config"]["quant_method"] == "modelopt"
    _assert_params_equal(first, load(tmp_path / "a"))


def test_round_trip_dynamic_w4a4_and_w4a16(qwen2_dir, tmp_path):
    for quant in ("nvfp4", "nvfp4-w4a16"):
        first = load(qwen2_dir[0], quant=quant)
        save(first, tmp_path / quant, max_shard_bytes=30_000)
        tensors = {}
        for f in (tmp_path / quant).glob("*.safetensors"):
            tensors.update(load_file(str(f)))
        assert not any(n.endswith("input_scale") for n in tensors)
        assert tensors["model.layers.0.mlp.up_proj.weight"].dtype == torch.uint8
        assert tensors["model.layers.0.mlp.up_proj.weight_scale"].dtype == torch.float8_e4m3fn
        assert tensors["model.layers.0.mlp.up_proj.weight_scale_2"].shape == ()
        second = load(tmp_path / quant)
        _assert_params_equal(first, second)


def test_round_trip_static_scales_set_after_quantizing(qwen3_dir, tmp_path):
    """A W4A4 model whose input_scales were set (as calibrate_input_scales does) saves them."""
    params = load(qwen3_dir[0], quant="nvfp4")
    weights = params.weights
    for block in ("self_attn", "mlp"):
        for entry in weights["layers"][block].values():
            if "weight" in entry:
                entry["input_scale"] = jnp.asarray([0.01, 0.02], jnp.float32)  # [L]
    params = dataclasses.replace(params, weights=weights)
    save(params, tmp_path / "a")
    back = load(tmp_path / "a")
    _assert_params_equal(params, back)
    # Partly calibrated params are refused instead of being written inconsistently.
    del weights["layers"]["mlp"]["down_proj"]["input_scale"]
    with pytest.raises(ValueError, match="layers.0.mlp.down_proj"):
        save(params, tmp_path / "b")


# ----------------------------------------------------------------------------- bad input


def test_missing_files(qwen3_dir, tmp_path):
    with pytest.raises(CheckpointFileNotFoundError, match="nope"):
        load(tmp_path / "nope")
    with pytest.raises(ValueError, match="nope"):  # also a ValueError
        load(tmp_path / "nope")
    d = _copy(qwen3_dir[0], tmp_path, "noconfig")
    (d / "config.json").unlink()
    with pytest.raises(CheckpointFileNotFoundError, match="config.json"):
        load(d)
    d = _copy(qwen3_dir[0], tmp_path, "noweights")
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointFileNotFoundError, match="model.safetensors"):
        load(d)
    (d / "model-00001-of-00002.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointFileNotFoundError, match="without an index"):
        load(d)


def test_missing_shard(tmp_path, hf_model):
    _write_hf(hf_model, tmp_path, shard="40KB", tokenizer=False)
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointFileNotFoundError, match=shard.name):
        load(tmp_path)


@pytest.mark.parametrize("damage", ["truncated", "garbage_header", "empty"])
def test_corrupt_safetensors(qwen3_dir, tmp_path, damage):
    d = _copy(qwen3_dir[0], tmp_path)
    path = d / "model.safetensors"
    data = path.read_bytes()
    if damage == "truncated":
        data = data[: len(data) - 100]
    elif damage == "garbage_header":
        data = data[:8] + b"{not json" + data[17:]
    else:
        data = b""
    path.write_bytes(data)
    with pytest.raises(ValueError, match=r"model\.safetensors.*not a valid safetensors"):
        load(d)


def test_bad_config(qwen3_dir, tmp_path):
    d = _copy(qwen3_dir[0], tmp_path)
    _edit_json(d / "config.json", lambda c: c.update(model_type="llama"))
    with pytest.raises(ValueError, match=r"config\.json.*'llama'"):
        load(d)
    (d / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json: invalid JSON"):
        load(d)
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    with pytest.raises(ValueError, match="missing required field"):
        load(d)


def test_bad_arguments(qwen3_dir):
    with pytest.raises(ValueError, match="'int8'"):
        load(qwen3_dir[0], quant="int8")
    with pytest.raises(ValueError, match="float dtype"):
        load(qwen3_dir[0], dtype=jnp.int32)


def test_missing_tensor(qwen3_dir, tmp_path):
    d = _copy(qwen3_dir[0], tmp_path)
    _rewrite_tensors(d, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.self_attn\.k_norm"):
        load(d)


def test_unexpected_tensor(qwen3_dir, tmp_path):
    d = _copy(qwen3_dir[0], tmp_path)
    _rewrite_tensors(d, lambda t: t.update({"model.layers.0.inv_freq": torch.ones(8)}))
    with pytest.raises(
        ValueError, match=r"unexpected tensors.*'model\.layers\.0\.inv_freq'.*model\.safetensors"
    ):
        load(d)
    # Rotary inv_freq buffers are known to be harmless.
    _rewrite_tensors(
        d,
        lambda t: (
            t.pop("model.layers.0.inv_freq"),
            t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}),
        ),
    )
    load(d)


def test_shape_mismatch(qwen3_dir, tmp_path):
    d = _copy(qwen3_dir[0], tmp_path)
    _edit_json(d / "config.json", lambda c: c.update(intermediate_size=96))
    with pytest.raises(
        ValueError,
        match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.\w+_proj\.weight' "
        r"has shape \[\d+, \d+\], expected \[\d+, \d+\]",
    ):
        load(d)


def test_wrong_dtype_and_untied_head_mismatch(qwen2_dir, tmp_path):
    d = _copy(qwen2_dir[0], tmp_path)
    _rewrite_tensors(
        d, lambda t: t.update({"model.norm.weight": torch.ones(64, dtype=torch.int32)})
    )
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' has dtype I32"):
        load(d)
    d = _copy(qwen2_dir[0], tmp_path, "tied")
    _rewrite_tensors(d, lambda t: t.update({"lm_head.weight": torch.zeros(256, 64)}))
    with pytest.raises(
        ValueError, match="tie_word_embeddings is true but 'lm_head.weight' differs"
    ):
        load(d)
    # An identical lm_head copy in a tied checkpoint is accepted.
    _rewrite_tensors(
        d, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()})
    )
    load(d)


@pytest.mark.parametrize(
    "drop,match",
    [
        ("weight_scale", r"missing 'model\.layers\.0\.mlp\.up_proj\.weight_scale'"),
        ("weight_scale_2", r"missing 'model\.layers\.0\.mlp\.up_proj\.weight_scale_2'"),
        ("input_scale", r"missing 'model\.layers\.0\.mlp\.up_proj\.input_scale'"),
    ],
)
def test_modelopt_missing_scale(modelopt_dir, tmp_path, drop, match):
    d = _copy(modelopt_dir[0], tmp_path)
    _rewrite_tensors(d, lambda t: t.pop(f"model.layers.0.mlp.up_proj.{drop}"))
    with pytest.raises(ValueError, match=match):
        load(d)


def test_modelopt_bad_tensors(modelopt_dir, qwen3_dir, tmp_path):
    src = modelopt_dir[0]
    # A float weight where the config says NVFP4.
    d = _copy(src, tmp_path, "float_weight")
    _rewrite_tensors(
        d,
        lambda t: (
            t.update({"model.layers.0.self_attn.o_proj.weight": torch.zeros(64, 64)}),
            t.pop("model.layers.0.self_attn.o_proj.weight_scale"),
        ),
    )
    with pytest.raises(ValueError, match=r"self_attn\.o_proj is not in exclude_modules.*F32"):
        load(d)
    # Block scales of the wrong shape.
    d = _copy(src, tmp_path, "scale_shape")
    _rewrite_tensors(
        d,
        lambda t: t.update(
            {
                "model.layers.0.self_attn.o_proj.weight_scale": torch.ones(64, 2).to(
                    torch.float8_e4m3fn
                )
            }
        ),
    )
    with pytest.raises(
        ValueError, match=r"o_proj\.weight_scale' has shape \[64, 2\], expected \[64, 4\]"
    ):
        load(d)
    # A non-scalar global scale.
    d = _copy(src, tmp_path, "scale2_shape")
    _rewrite_tensors(
        d, lambda t: t.update({"model.layers.0.self_attn.o_proj.weight_scale_2": torch.ones(2)})
    )
    with pytest.raises(
        ValueError, match=r"weight_scale_2' has shape \[2\], expected \[\] or \[1\]"
    ):
        load(d)
    # A quantized lm_head (rejax keeps it bf16).
    d = _copy(src, tmp_path, "qhead")
    _rewrite_tensors(
        d, lambda t: t.update({"lm_head.weight_scale": torch.ones(256, 4).to(torch.float8_e4m3fn)})
    )
    with pytest.raises(ValueError, match="lm_head is NVFP4-quantized"):
        load(d)
    # Excluded by pattern but stored quantized.
    d = _copy(src, tmp_path, "excl")
    _edit_json(
        d / "hf_quant_config.json",
        lambda c: c["quantization"].update(exclude_modules=["lm_head", "model.layers.0.mlp.*"]),
    )
    with pytest.raises(
        ValueError, match=r"model\.layers\.0\.mlp\.\w+_proj matches exclude_modules"
    ):
        load(d)


def test_modelopt_bad_quant_config(modelopt_dir, tmp_path):
    src = modelopt_dir[0]
    d = _copy(src, tmp_path, "fp8")
    _edit_json(d / "hf_quant_config.json", lambda c: c["quantization"].update(quant_algo="FP8"))
    with pytest.raises(ValueError, match="hf_quant_config.json says quant_algo 'FP8'"):
        load(d)
    _edit_json(d / "config.json", lambda c: c["quantization_config"].update(quant_algo="FP8"))
    with pytest.raises(
        ValueError, match=r"hf_quant_config\.json: quant_algo 'FP8' is not supported"
    ):
        load(d)
    d = _copy(src, tmp_path, "gptq")
    (d / "hf_quant_config.json").unlink()
    _edit_json(d / "config.json", lambda c: c.update(quantization_config={"quant_method": "gptq"}))
    with pytest.raises(ValueError, match="quant_method 'gptq' is not supported"):
        load(d)
    # Without the hf_quant_config.json file, config.json's quantization_config suffices.
    d = _copy(src, tmp_path, "cfg_only")
    (d / "hf_quant_config.json").unlink()
    assert load(d).cfg.quant == "nvfp4"


def test_save_rejects_inconsistent_params(qwen3_dir, tmp_path):
    params = load(qwen3_dir[0])
    bad = dataclasses.replace(params, cfg=dataclasses.replace(params.cfg, hidden_size=32))
    with pytest.raises(ValueError, match=r"model\.embed_tokens\.weight: params array has shape"):
        save(bad, tmp_path / "a")
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="not a directory"):
        save(params, tmp_path / "file")


def test_qwen3_attention_bias_refused(qwen3_dir, tmp_path):
    d = _copy(qwen3_dir[0], tmp_path)
    _edit_json(d / "config.json", lambda c: c.update(attention_bias=True))
    with pytest.raises(ValueError, match=r"config\.json: qwen3 with attention_bias=true"):
        load(d)


# ----------------------------------------------------------------------------- HF parity


@pytest.mark.parametrize("which", ["qwen3_dir", "qwen2_dir"])
def test_loaded_logits_match_hf(which, request):
    """Logits of a loaded checkpoint equal transformers' (fp32, max rel diff <= 1e-4)."""
    directory, _ = request.getfixturevalue(which)
    params = load(directory, dtype=jnp.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    tokens = np.random.default_rng(0).integers(0, 256, size=(2, 9))
    with torch.no_grad():
        ref = hf(torch.as_tensor(tokens)).logits.numpy()
    ours = np.asarray(logits(params, jnp.asarray(tokens, jnp.int32)))
    assert ours.shape == ref.shape == (2, 9, 256)
    rel = np.max(np.abs(ours - ref)) / np.max(np.abs(ref))
    assert rel <= 1e-4, rel


def test_quantization_progress_bar(qwen3_dir, monkeypatch, capsys):
    load(qwen3_dir[0], quant="nvfp4-w4a16")  # tiny model: no bar
    assert "quantizing" not in capsys.readouterr().err
    monkeypatch.setattr(ckpt, "_PROGRESS_MIN_PARAMS", 0)
    load(qwen3_dir[0], quant="nvfp4-w4a16")
    err = capsys.readouterr().err
    assert "rejax: quantizing to NVFP4" in err and "14/14" in err


@pytest.mark.parametrize("quant", [None, "nvfp4"])
def test_save_init_params_round_trip(tmp_path, quant):
    """Params built by the decoder (`init_params`) save and load back unchanged."""
    cfg = Config(arch="qwen2", attention_bias=True, eos_token_ids=(5, 6), bos_token_id=1)
    cfg = dataclasses.replace(cfg, quant=quant)
    params = init_params(cfg, 0)
    save(params, tmp_path)
    back = load(tmp_path)
    _assert_params_equal(params, back)


@pytest.mark.parametrize("kind", ["bf16", "quantized_on_load", "modelopt"])
def test_generate_on_loaded_checkpoints(kind, qwen3_dir, modelopt_dir):
    """rejax.load + rejax.generate on each kind of checkpoint the tests write: every row gets
    its tokens, in the vocabulary, with finite entropies; sampled rows are the same for the same
    key and differ for another key; the greedy first token is the argmax of `logits` on the
    prompt."""
    if kind == "bf16":
        params = load(qwen3_dir[0])
    elif kind == "quantized_on_load":
        params = load(qwen3_dir[0], quant="nvfp4")
    else:
        params = load(modelopt_dir[0])
    assert (params.cfg.quant is None) == (kind == "bf16")
    prompts = [[1, 2, 3, 4], [5, 6]]
    hot = rejax.Temperature(1.0)
    out = rejax.generate(params, prompts, max_new_tokens=6, stop=[], key=3, sampler=hot)
    again = rejax.generate(params, prompts, max_new_tokens=6, stop=[], key=3, sampler=hot)
    other = rejax.generate(params, prompts, max_new_tokens=6, stop=[], key=4, sampler=hot)
    assert out.tokens == again.tokens and out.tokens != other.tokens
    v = params.cfg.vocab_size
    for row, ent in zip(out.tokens, out.entropy):
        assert len(row) == 6 and all(0 <= t < v for t in row)
        assert np.all(np.isfinite(ent))
    assert out.finish_reason == ["length", "length"]
    greedy = rejax.generate(params, prompts, max_new_tokens=1, stop=[])
    first = np.asarray(logits(params, jnp.asarray([prompts[0]], jnp.int32)))[0, -1]
    assert greedy.tokens[0][0] == int(np.argmax(first))
