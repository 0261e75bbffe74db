"""ModelOpt NVFP4: the quantization config (hf_quant_config.json or config.json's
`quantization_config`) and loading its packed linears with their scales untouched."""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from rejax import nvfp4
from rejax import params as rparams
from rejax.checkpoint.files import FLOAT_TAGS, TensorSource, read_json
from rejax.checkpoint.names import FUSED, Linear, fused_bias, fused_groups, tree_set
from rejax.config import Config
from rejax.nvfp4 import BLOCK, Nvfp4Tensor

logger = logging.getLogger(__name__)


_QUANT_ALGOS = {"NVFP4": "nvfp4", "W4A16_NVFP4": "nvfp4-w4a16"}
MODES_TO_ALGO = {v: k for k, v in _QUANT_ALGOS.items()}


# ----------------------------------------------------------------------------- quantization config


@dataclasses.dataclass(frozen=True)
class QuantInfo:
    mode: str  # "nvfp4" | "nvfp4-w4a16"
    exclude: tuple[str, ...]
    dynamic_inputs: bool  # W4A4 saved without input_scale (rejax dynamic activations)


def quant_info(directory: Path, hf: dict) -> QuantInfo | None:
    """Reads the ModelOpt quantization description, or None for a float checkpoint."""
    qfile = directory / "hf_quant_config.json"
    from_file = read_json(qfile).get("quantization") if qfile.exists() else None
    if qfile.exists() and not isinstance(from_file, dict):
        raise ValueError(f"{qfile}: missing 'quantization' object")
    qcfg = hf.get("quantization_config")
    if from_file is None and not qcfg:
        return None
    algo_file = from_file.get("quant_algo") if from_file else None
    algo_cfg = None
    if qcfg:
        method = qcfg.get("quant_method")
        if method not in (None, "modelopt"):
            raise ValueError(
                f"{directory / 'config.json'}: quantization_config.quant_method {method!r} is not "
                "supported; rejax loads float checkpoints and ModelOpt NVFP4 (quant_method "
                "'modelopt')"
            )
        algo_cfg = qcfg.get("quant_algo")
    if algo_file and algo_cfg and algo_file != algo_cfg:
        raise ValueError(
            f"{qfile} says quant_algo {algo_file!r} but config.json quantization_config says "
            f"{algo_cfg!r}"
        )
    algo = algo_file or algo_cfg
    if algo not in _QUANT_ALGOS:
        src = qfile if algo_file else directory / "config.json"
        raise ValueError(
            f"{src}: quant_algo {algo!r} is not supported; expected one of {sorted(_QUANT_ALGOS)}"
        )
    group = (from_file or {}).get("group_size", BLOCK)
    if group != BLOCK:
        raise ValueError(f"{qfile}: group_size {group} is not supported; NVFP4 uses {BLOCK}")
    exclude = list((from_file or {}).get("exclude_modules") or [])
    exclude += list((qcfg or {}).get("ignore") or [])
    dynamic = False
    for group_cfg in ((qcfg or {}).get("config_groups") or {}).values():
        acts = group_cfg.get("input_activations") or {}
        dynamic = dynamic or bool(acts.get("dynamic", False))
    return QuantInfo(
        mode=_QUANT_ALGOS[algo],
        exclude=tuple(dict.fromkeys(exclude)),
        dynamic_inputs=dynamic,
    )


def _excluded(module: str, patterns: tuple[str, ...]) -> bool:
    """Whether the HF module name matches an exclude pattern (exact, prefix, or fnmatch)."""
    short = module.removeprefix("model.")
    for pat in patterns:
        for name in (module, short):
            if name == pat or name.startswith(pat + ".") or fnmatch.fnmatchcase(name, pat):
                return True
    return False


def load_nvfp4_linears(source, cfg, qinfo: QuantInfo, weights, used, dtype) -> None:
    for special in ("lm_head", "model.embed_tokens"):
        if f"{special}.weight_scale" in source:
            raise ValueError(
                f"{source.file(special + '.weight_scale')}: {special} is NVFP4-quantized; rejax "
                "keeps the embedding and lm_head in bf16 (ModelOpt default)"
            )
    for path, per_layer in fused_groups(cfg).items():
        kinds = {}
        for lin in (lin for shard_lins in per_layer for lin in shard_lins):
            if f"{lin.hf}.weight" not in source:
                raise ValueError(f"checkpoint is missing tensor {lin.hf + '.weight'!r}")
            kinds[lin.hf] = _excluded(lin.hf, qinfo.exclude)
            quant_names = [
                f"{lin.hf}.{k}" for k in ("weight_scale", "weight_scale_2", "input_scale")
            ]
            present = [n for n in quant_names if n in source]
            if kinds[lin.hf] and present:
                raise ValueError(
                    f"{source.file(present[0])}: {lin.hf} matches exclude_modules "
                    f"{list(qinfo.exclude)} but has quantization tensor {present[0]!r}"
                )
        if len(set(kinds.values())) > 1:
            floats = sorted(k for k, v in kinds.items() if v)
            quant = sorted(k for k, v in kinds.items() if not v)
            raise ValueError(
                f"exclude_modules {list(qinfo.exclude)} keep {floats[:3]} float but {quant[:3]} "
                f"are NVFP4: rejax stacks every layer's {'/'.join(FUSED[path[-1]])} into one "
                "fused linear, which must be all float or all NVFP4 (exclude a linear in every "
                "layer, or none)"
            )
        excluded = next(iter(kinds.values()))
        layers_w, layers_b, layers_in = [], [], []
        for shard_lins in per_layer:
            parts, inputs = [], []
            for lin in shard_lins:
                w_name = f"{lin.hf}.weight"
                names = {
                    k: f"{lin.hf}.{k}" for k in ("weight_scale", "weight_scale_2", "input_scale")
                }
                if excluded:
                    parts.append(
                        np.asarray(
                            jnp.asarray(source.get(w_name, lin.shape, FLOAT_TAGS)).astype(dtype)
                        )
                    )
                    used.add(w_name)
                else:
                    entry = _nvfp4_entry(source, lin, names, qinfo, cfg)
                    used.add(w_name)
                    used.update(n for n in names.values() if n in source)
                    parts.append(entry["weight"])
                    if "input_scale" in entry:
                        inputs.append(entry["input_scale"])
            layers_w.append(np.concatenate(parts) if excluded else nvfp4.concat_rows(parts))
            if inputs:
                layers_in.append(np.asarray(inputs, np.float32))
            if shard_lins[0].bias:
                layers_b.append(fused_bias(source, shard_lins, used))
        weight = (
            tuple(jnp.asarray(w) for w in layers_w) if excluded else rparams.stack_layers(layers_w)
        )
        entry = {"weight": weight}
        if layers_in:
            scales = np.stack(layers_in)  # [L, shards]
            shared = bool(np.all(scales == scales[:, :1]))
            if not shared:
                logger.info(
                    "rejax.load: %s has per-shard input scales (e.g. layer 0: %s); activations "
                    "are quantized once per shard scale (exact)",
                    "/".join(path),
                    scales[0].tolist(),
                )
            entry["input_scale"] = jnp.asarray(scales[:, 0] if shared else scales)
        if layers_b:
            entry["bias"] = jnp.asarray(np.stack(layers_b)).astype(dtype)
        tree_set(weights, path, entry)


def _nvfp4_entry(source, lin: Linear, names, qinfo: QuantInfo, cfg: Config) -> dict:
    """One ModelOpt NVFP4 linear -> {"weight": Nvfp4Tensor[, "input_scale": f32 []]}."""
    w_name = f"{lin.hf}.weight"
    where = source.file(w_name)
    tag = source.dtype_tag(w_name)
    if tag != "U8":
        why = "has no 'weight_scale'" if names["weight_scale"] not in source else "is not packed"
        raise ValueError(
            f"{where}: {lin.hf} is not in exclude_modules {list(qinfo.exclude)} so it must be "
            f"NVFP4 (uint8 packed weight), but {w_name!r} is {tag} and {why}"
        )
    for key in ("weight_scale", "weight_scale_2"):
        if names[key] not in source:
            raise ValueError(f"{where}: quantized linear {lin.hf} is missing {names[key]!r}")
    n, k = lin.shape
    packed = source.get(w_name, (n, k // 2), ("U8",))
    scales = source.get(names["weight_scale"], (n, k // BLOCK), ("F8_E4M3", "U8"))
    entry = {
        "weight": Nvfp4Tensor(
            packed=jnp.asarray(packed),
            scales=jnp.asarray(scales.view(ml_dtypes.float8_e4m3fn)),
            global_scale=jnp.asarray(_scalar(source, names["weight_scale_2"])),
            shape=(n, k),
        )
    }
    has_input = names["input_scale"] in source
    if qinfo.mode == "nvfp4-w4a16" and has_input:
        raise ValueError(
            f"{source.file(names['input_scale'])}: W4A16_NVFP4 checkpoint has an activation "
            f"scale {names['input_scale']!r}"
        )
    if qinfo.mode == "nvfp4" and qinfo.dynamic_inputs and has_input:
        raise ValueError(
            f"{source.file(names['input_scale'])}: checkpoint marks activations dynamic "
            f"(input_activations.dynamic) but has {names['input_scale']!r}"
        )
    if qinfo.mode == "nvfp4" and not qinfo.dynamic_inputs and not has_input:
        raise ValueError(
            f"{where}: W4A4 NVFP4 linear {lin.hf} is missing {names['input_scale']!r} "
            "(static activation scale)"
        )
    if has_input and cfg.quant == "nvfp4":
        entry["input_scale"] = jnp.asarray(_scalar(source, names["input_scale"]))
    return entry


def _scalar(source: TensorSource, name: str) -> np.ndarray:
    """An f32 scalar stored as shape [] or [1] -> f32 [] (value bits unchanged)."""
    value = source.get(name, None, ("F32",))
    if value.shape not in ((), (1,)):
        raise ValueError(
            f"{source.file(name)}: tensor {name!r} has shape {list(value.shape)}, "
            "expected [] or [1]"
        )
    value = np.array(value.reshape(()), dtype=np.float32)
    if not (np.isfinite(value) and value > 0):
        raise ValueError(f"{source.file(name)}: tensor {name!r} = {value} must be finite and > 0")
    return value
