"""`load`: an HF model directory (bf16 or ModelOpt NVFP4) -> `Params`; the files and
quantization modes are described in the package docstring."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from rejax import nvfp4
from rejax import params as rparams
from rejax.checkpoint.files import FLOAT_TAGS, CheckpointFileNotFoundError, TensorSource, read_json
from rejax.checkpoint.modelopt import QuantInfo, load_nvfp4_linears, quant_info
from rejax.checkpoint.names import (
    HARMLESS,
    KV_SCALES,
    fused_bias,
    fused_groups,
    linears,
    plain_tensors,
    tree_set,
)
from rejax.checkpoint.tokenizer import load_generation_config, load_tokenizer
from rejax.config import Config, from_hf_config
from rejax.nvfp4 import BLOCK
from rejax.params import Params

logger = logging.getLogger(__name__)


_PROGRESS_MIN_PARAMS = 50_000_000  # show a quantization progress bar above this many weights


# ----------------------------------------------------------------------------- load


def load(path: str | os.PathLike, quant: str | None = None, dtype: Any = jnp.bfloat16) -> Params:
    """Loads a Hugging Face Qwen3/Qwen2 directory (float or ModelOpt NVFP4) as `Params`.

    Args:
        path: the model directory (config.json, safetensors, optional tokenizer files).
        quant: None (the checkpoint's own format), "bf16" (float linears; refused for an NVFP4
            checkpoint), "nvfp4" (W4A4) or "nvfp4-w4a16". On a float
            checkpoint the NVFP4 modes quantize every decoder linear offline with
            `rejax.nvfp4.quantize_weight`; see the module docstring for NVFP4 checkpoints.
        dtype: float dtype of embeddings, norms, lm_head, biases and float linears.

    Returns:
        Params with the weights pytree (jax arrays; NVFP4 linears as `Nvfp4Tensor`), the static
        Config (with `quant` set to the effective mode), the tokenizer (or None) and the
        generation config as a sorted tuple of (key, value) pairs.

    Raises:
        CheckpointFileNotFoundError: the directory, config.json or the safetensors are missing.
        ValueError: corrupt files, unknown model_type, missing/unexpected tensors, wrong shapes
            or dtypes, unsupported quantization; messages name the file and the tensor.
    """
    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointFileNotFoundError(f"checkpoint directory {str(directory)!r} does not exist")
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise CheckpointFileNotFoundError(f"{config_path}: missing (every checkpoint needs one)")
    if quant not in (None, "bf16", "nvfp4", "nvfp4-w4a16"):
        raise ValueError(
            f"unknown quant {quant!r}; expected None, 'bf16', 'nvfp4' or 'nvfp4-w4a16'"
        )
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"dtype must be a float dtype, got {dtype}")

    hf = read_json(config_path)
    qinfo = quant_info(directory, hf)
    if quant == "bf16":
        # "bf16" = float linears, as the command line calls it; None keeps the file's format.
        if qinfo is not None:
            raise ValueError(
                f"quant='bf16' but {str(directory)!r} is an NVFP4 checkpoint ({qinfo.mode}): its "
                "float weights are not in it; load it with quant=None, 'nvfp4' or 'nvfp4-w4a16'"
            )
        quant = None
    mode = quant if qinfo is None else _checkpoint_mode(qinfo, quant)
    try:
        cfg = from_hf_config(hf, quant=mode)
    except ValueError as e:
        raise ValueError(f"{config_path}: {e}") from e
    except KeyError as e:
        raise ValueError(f"{config_path}: missing required field {e}") from e

    if cfg.arch == "qwen3" and cfg.attention_bias:
        # HF Qwen3 then also biases o_proj, which the rejax decoder does not implement.
        raise ValueError(f"{config_path}: qwen3 with attention_bias=true is not supported")
    source = TensorSource(directory)
    used: set[str] = set()
    weights: dict = {}
    stacks: dict = {}
    for name, tree_path, shape, layer in plain_tensors(cfg):
        value = source.get(name, shape, FLOAT_TAGS)
        if layer is None:
            tree_set(weights, tree_path, jnp.asarray(value).astype(dtype))
        else:
            stacks.setdefault(tree_path, []).append(value)
        used.add(name)
    for tree_path, values in stacks.items():
        tree_set(weights, tree_path, jnp.asarray(np.stack(values)).astype(dtype))
    if cfg.tie_word_embeddings and "lm_head.weight" in source:
        _check_tied_head(source, cfg)
        used.add("lm_head.weight")

    if qinfo is None:
        _load_float_linears(source, cfg, weights, used, dtype, quantize=mode is not None)
        if mode == "nvfp4":
            logger.warning(
                "rejax.load: quant='nvfp4' without calibration data: W4A4 activations use a "
                "per-row dynamic global scale (no input_scale); call "
                "rejax.calibrate_input_scales(params, texts) to set static scales"
            )
    else:
        load_nvfp4_linears(source, cfg, qinfo, weights, used, dtype)

    extra = sorted(source.names() - used)
    kv_scales = [n for n in extra if KV_SCALES.match(n)]
    if kv_scales:
        logger.warning(
            "rejax.load: dropping %d FP8 KV-cache scales (e.g. %s): the KV cache stays bf16",
            len(kv_scales),
            kv_scales[0],
        )
    unexpected = [n for n in extra if not HARMLESS.match(n) and not KV_SCALES.match(n)]
    if unexpected:
        listed = ", ".join(f"{n!r} in {source.file(n)}" for n in unexpected[:8])
        more = f" (+{len(unexpected) - 8} more)" if len(unexpected) > 8 else ""
        raise ValueError(f"unexpected tensors not used by a {cfg.arch} model: {listed}{more}")

    return Params(
        weights=weights,
        cfg=cfg,
        tokenizer=load_tokenizer(directory),
        generation_config=load_generation_config(directory),
    )


def _checkpoint_mode(qinfo: QuantInfo, quant: str | None) -> str:
    if quant is None or quant == qinfo.mode:
        return qinfo.mode
    if quant == "nvfp4-w4a16":
        logger.warning(
            "rejax.load: NVFP4 W4A4 checkpoint loaded as W4A16: weight bytes kept, "
            "input_scale dropped, activations stay bf16"
        )
    else:
        logger.warning(
            "rejax.load: W4A16 NVFP4 checkpoint loaded as W4A4: weight bytes kept, activations "
            "use a per-row dynamic global scale (no input_scale)"
        )
    return quant


def _check_tied_head(source: TensorSource, cfg: Config) -> None:
    shape = (cfg.vocab_size, cfg.hidden_size)
    head = source.get("lm_head.weight", shape, FLOAT_TAGS)
    embed = source.get("model.embed_tokens.weight", shape, FLOAT_TAGS)
    if not np.array_equal(head, embed):
        raise ValueError(
            f"{source.file('lm_head.weight')}: tie_word_embeddings is true but 'lm_head.weight' "
            "differs from 'model.embed_tokens.weight'"
        )


def _load_float_linears(source, cfg, weights, used, dtype, *, quantize: bool) -> None:
    groups = fused_groups(cfg)
    total = sum(lin.shape[0] * lin.shape[1] for lin in linears(cfg))
    if quantize:
        for lin in linears(cfg)[:7]:
            if lin.shape[1] % BLOCK:
                raise ValueError(
                    f"{lin.hf}.weight: in_features {lin.shape[1]} is not a multiple of {BLOCK}; "
                    "cannot quantize to NVFP4"
                )
    bar = tqdm(
        total=len(linears(cfg)),
        desc="rejax: quantizing to NVFP4",
        unit="linear",
        disable=not quantize or total < _PROGRESS_MIN_PARAMS,
    )
    for path, per_layer in groups.items():
        layers_w, layers_b = [], []
        for shard_lins in per_layer:
            parts = []
            for lin in shard_lins:
                # Copied to the device once, then cast and quantized there: no host round trip.
                w = jnp.asarray(source.get(f"{lin.hf}.weight", lin.shape, FLOAT_TAGS))
                w = w.astype(dtype)
                used.add(f"{lin.hf}.weight")
                parts.append(nvfp4.quantize_weight(w) if quantize else w)
                bar.update(1 if quantize else 0)
            layers_w.append(nvfp4.concat_rows(parts) if quantize else jnp.concatenate(parts))
            if shard_lins[0].bias:
                layers_b.append(fused_bias(source, shard_lins, used))
        weight = rparams.stack_layers(layers_w) if quantize else tuple(layers_w)
        entry = {"weight": weight}
        if layers_b:
            entry["bias"] = jnp.asarray(np.stack(layers_b)).astype(dtype)
        tree_set(weights, path, entry)
    bar.close()
