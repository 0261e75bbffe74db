"""`save`: `Params` -> an HF model directory (bf16 safetensors or ModelOpt NVFP4), every
stack and fused linear split back into the HF tensors with the same bytes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from rejax import __version__, nvfp4
from rejax import params as rparams
from rejax.checkpoint.files import DTYPE_NAMES, write_json, write_safetensors
from rejax.checkpoint.modelopt import MODES_TO_ALGO
from rejax.checkpoint.names import fused_groups, plain_tensors, tree_get
from rejax.checkpoint.tokenizer import save_tokenizer, unhashable
from rejax.config import Config
from rejax.nvfp4 import BLOCK, Nvfp4Tensor
from rejax.params import Params

# ----------------------------------------------------------------------------- save


def save(params: Params, path: str | os.PathLike, *, max_shard_bytes: int | None = None) -> None:
    """Writes `params` as a Hugging Face directory that `load` (and transformers) reads back.

    Float models are written in their current dtype; NVFP4 models in ModelOpt format
    (`hf_quant_config.json`, config.json `quantization_config`, uint8 / float8_e4m3fn / f32
    tensors; scalar scales as shape []). The tokenizer (tokenizer.json, tokenizer_config.json)
    and generation_config.json are written when present.

    Args:
        params: a loaded or constructed `Params`.
        path: output directory (created if needed; existing model files are overwritten).
        max_shard_bytes: if set, split the tensors into shards of at most this many bytes with a
            model.safetensors.index.json (a tensor larger than the limit gets its own shard).
    """
    if params.sharding is not None:
        raise ValueError("params are sharded (rejax.shard); save rejax.sharding.unshard(params)")
    cfg = params.cfg
    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"save path {str(directory)!r} exists and is not a directory")
    directory.mkdir(parents=True, exist_ok=True)
    tensors, exclude = _to_hf_tensors(params)
    float_dtype = np.asarray(tree_get(params.weights, ("embed_tokens", "embedding"))).dtype

    for stale in list(directory.glob("*.safetensors")) + [
        directory / "model.safetensors.index.json",
        directory / "hf_quant_config.json",
    ]:
        if stale.exists():
            stale.unlink()
    _write_shards(directory, tensors, max_shard_bytes)

    hf = _hf_config(cfg, float_dtype)
    if cfg.quant is not None:
        dynamic = cfg.quant == "nvfp4" and not any(n.endswith(".input_scale") for n in tensors)
        quant_file = {
            "producer": {"name": "rejax", "version": __version__},
            "quantization": {
                "quant_algo": MODES_TO_ALGO[cfg.quant],
                "kv_cache_quant_algo": None,
                "group_size": BLOCK,
                "exclude_modules": exclude,
            },
        }
        write_json(directory / "hf_quant_config.json", quant_file)
        weights_cfg = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": BLOCK}
        group = {"weights": weights_cfg, "targets": ["Linear"]}
        if cfg.quant == "nvfp4":
            group["input_activations"] = dict(weights_cfg, dynamic=dynamic)
        hf["quantization_config"] = {
            "config_groups": {"group_0": group},
            "ignore": exclude,
            "quant_algo": MODES_TO_ALGO[cfg.quant],
            "producer": quant_file["producer"],
            "quant_method": "modelopt",
        }
    write_json(directory / "config.json", hf)
    if params.generation_config:
        write_json(directory / "generation_config.json", unhashable(params.generation_config))
    if params.tokenizer is not None:
        save_tokenizer(params.tokenizer, directory)


def _to_hf_tensors(params: Params) -> tuple[dict[str, np.ndarray], list[str]]:
    """Flattens the weights pytree into HF-named numpy arrays (stacks split per layer, fused
    linears split per shard, bytes unchanged); returns the float-linear list too."""
    cfg = params.cfg
    tensors: dict[str, np.ndarray] = {}
    for name, tree_path, shape, layer in plain_tensors(cfg):
        if layer is None:
            tensors[name] = _checked(tree_get(params.weights, tree_path), name, shape)
        else:
            stacked = _checked(
                tree_get(params.weights, tree_path), "/".join(tree_path), (cfg.num_layers, *shape)
            )
            tensors[name] = stacked[layer]
    exclude = ["lm_head"] if cfg.quant is not None else []
    missing_input = []
    for path, per_layer in fused_groups(cfg).items():
        entry = tree_get(params.weights, path)
        w = entry.get("weight") if isinstance(entry, dict) else None
        where = "/".join(path)
        if w is None:
            raise ValueError(f"params.weights[{where}] has no 'weight'")
        n, k = rparams.linear_shape(cfg, path[-1])
        sizes = rparams.shards(cfg, path[-1])
        quantized = isinstance(w, Nvfp4Tensor)
        if quantized:
            if cfg.quant is None:
                raise ValueError(f"{where}: Nvfp4Tensor weight but cfg.quant is None")
            if tuple(w.shape) != (n, k) or w.stack != (cfg.num_layers,):
                raise ValueError(
                    f"{where}: Nvfp4Tensor shape {w.shape} stack {w.stack}, expected {(n, k)} "
                    f"stacked over {cfg.num_layers} layers"
                )
        else:
            if not isinstance(w, (tuple, list)) or len(w) != cfg.num_layers:
                raise ValueError(
                    f"{where}/weight: expected a tuple of {cfg.num_layers} per-layer float "
                    f"arrays [{n}, {k}], got {type(w).__name__}"
                )
            w = [_checked(a, f"{where}/weight[{i}]", (n, k)) for i, a in enumerate(w)]
        scales_in = entry.get("input_scale") if cfg.quant == "nvfp4" else None
        bias = entry.get("bias")
        if per_layer[0][0].bias:
            bias = _checked(bias, f"{where}/bias", (cfg.num_layers, n))
        for i, shard_lins in enumerate(per_layer):
            if quantized:
                layer_w = nvfp4.take(w, i)
                parts = nvfp4.split_rows(
                    Nvfp4Tensor(
                        packed=np.asarray(layer_w.packed),
                        scales=np.asarray(layer_w.scales),
                        global_scale=np.asarray(layer_w.global_scale),
                        shape=layer_w.shape,
                    ),
                    sizes,
                )
            start = 0
            for s_idx, lin in enumerate(shard_lins):
                rows = slice(start, start + lin.shape[0])
                start += lin.shape[0]
                if not quantized:
                    tensors[f"{lin.hf}.weight"] = w[i][rows]
                    if cfg.quant is not None:
                        exclude.append(lin.hf)
                else:
                    part = parts[s_idx]
                    g = np.asarray(part.global_scale, np.float32)
                    if g.ndim:
                        raise ValueError(
                            f"{lin.hf}: rows of this shard carry different global scales; a "
                            "ModelOpt checkpoint stores one weight_scale_2 per linear"
                        )
                    tensors[f"{lin.hf}.weight"] = np.asarray(part.packed)
                    tensors[f"{lin.hf}.weight_scale"] = np.asarray(part.scales).view(
                        ml_dtypes.float8_e4m3fn
                    )
                    tensors[f"{lin.hf}.weight_scale_2"] = g
                    if scales_in is not None:
                        si = np.asarray(scales_in, np.float32)
                        if si.shape not in ((cfg.num_layers,), (cfg.num_layers, len(sizes))):
                            raise ValueError(
                                f"{where}/input_scale has shape {list(si.shape)}, expected "
                                f"[{cfg.num_layers}] or [{cfg.num_layers}, {len(sizes)}]"
                            )
                        tensors[f"{lin.hf}.input_scale"] = np.asarray(
                            si[i] if si.ndim == 1 else si[i, s_idx], np.float32
                        )
                    elif cfg.quant == "nvfp4":
                        missing_input.append(lin.hf)
                if lin.bias:
                    tensors[f"{lin.hf}.bias"] = bias[i, rows]
    n_quant = sum(1 for n in tensors if n.endswith(".weight_scale"))
    if missing_input and len(missing_input) != n_quant:
        raise ValueError(
            f"W4A4 params mix static and dynamic activation scales: {missing_input[:4]} have no "
            "input_scale while other linears do; calibrate all or none"
        )
    return tensors, exclude


def _checked(value: Any, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if value is None:
        raise ValueError(f"params has no tensor for {name!r}")
    array = np.asarray(value)
    if array.shape != tuple(shape):
        raise ValueError(
            f"{name}: params array has shape {list(array.shape)}, expected {list(shape)}"
        )
    return array


def _write_shards(directory: Path, tensors: dict[str, np.ndarray], max_bytes: int | None) -> None:
    if max_bytes is None:
        write_safetensors(directory / "model.safetensors", tensors)
        return
    if max_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_bytes}")
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(directory / fname, shard)
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(a.nbytes for a in tensors.values())
    write_json(
        directory / "model.safetensors.index.json",
        {"metadata": {"total_size": total}, "weight_map": weight_map},
    )


def _hf_config(cfg: Config, float_dtype: np.dtype) -> dict:
    model_type = {"qwen3": "qwen3", "qwen2": "qwen2"}[cfg.arch]
    arch = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM"}[cfg.arch]
    eos = list(cfg.eos_token_ids)
    return {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_scaling": None,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias,
        "max_position_embeddings": cfg.max_position_embeddings,
        "use_sliding_window": False,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "pad_token_id": cfg.pad_token_id,
        "dtype": DTYPE_NAMES.get(np.dtype(float_dtype), "bfloat16"),
        "use_cache": True,
    }
