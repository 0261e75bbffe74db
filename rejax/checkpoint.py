"""Hugging Face checkpoints (bf16 safetensors, ModelOpt NVFP4) <-> rejax `Params`.

The HF-name <-> weights-pytree mapping lives only here. `load` reads an HF model directory:

    config.json                      required; `model_type` qwen3 | qwen2
    model.safetensors                or model.safetensors.index.json + the shards it names
    tokenizer.json                   optional (+ tokenizer_config.json / chat_template.jinja)
    generation_config.json           optional
    hf_quant_config.json             optional; ModelOpt NVFP4 (also `quantization_config` in
                                     config.json)

Quantization modes (`quant`):
    bf16 checkpoint, quant=None            float linears in `dtype`
    bf16 checkpoint, quant="nvfp4"         every decoder linear quantized offline with
                                           `nvfp4.quantize_weight` (ModelOpt-exact); W4A4 with
                                           no `input_scale` (per-row dynamic activation global
                                           scale) until `rejax.calibrate_input_scales` sets one
    bf16 checkpoint, quant="nvfp4-w4a16"   same weights, bf16 activations
    NVFP4 checkpoint, quant=None           the checkpoint's own mode (NVFP4 -> W4A4 with its
                                           static input_scales; W4A16_NVFP4 -> W4A16)
    NVFP4 checkpoint, quant=<other NVFP4>  same weight bytes, only the activation mode changes:
                                           W4A4 -> W4A16 drops input_scale; W4A16 -> W4A4 runs
                                           with dynamic activation scales (both logged)
NVFP4 weights are never dequantized and re-quantized: a ModelOpt tensor's bytes are kept.

ModelOpt NVFP4 tensors per quantized linear `p` (checked on load, written by `save`):
    p.weight          uint8 [N, K/2]   element 2j in the low nibble of byte j, 2j+1 in the high
                                       nibble (ModelOpt's `NVFP4QTensor` packing, the same as
                                       `Nvfp4Tensor.packed`, so bytes are copied untouched)
    p.weight_scale    float8_e4m3fn [N, K/16] (uint8 accepted and reinterpreted bit for bit)
    p.weight_scale_2  float32 [] or [1] -> Nvfp4Tensor.global_scale f32 []; written as []
    p.input_scale     float32 [] or [1] -> f32 [] (W4A4 static); written as []
    p.bias            optional, float
Excluded modules (`exclude_modules` / `ignore`, fnmatch patterns) stay float; lm_head and the
embedding are always float. FP8 KV-cache scales (`k_proj.k_scale`, `v_proj.v_scale`) are
dropped with a warning: rejax keeps the KV cache in bf16.

Layout: every layer's tensors of one kind are stacked ([L, ...], rejax/params.py), and q/k/v and
gate/up are fused into one linear each (rows concatenated, bytes unchanged). Each NVFP4 shard
keeps its own `weight_scale_2` exactly (one global scale per row when they differ) and its own
`input_scale` (one per layer when the shards agree, as ModelOpt exports them; else one per
shard, and activations are quantized once per shard scale); nothing is re-quantized, and `save`
splits every stack and fused linear back into the HF tensors with the same bytes. A
ModelOpt `exclude_modules` pattern must keep a fused linear float in every layer or in none
(a mix cannot be stacked and is refused with a message naming the modules).

W4A4 with dynamic activation scales has no `input_scale` tensors; `save` marks it with
`input_activations.dynamic = true` in config.json's `quantization_config` (the
compressed-tensors field), which `load` reads back. Without that flag a missing `input_scale`
on an NVFP4 checkpoint is an error.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from rejax import nvfp4
from rejax import params as rparams
from rejax.config import Config, from_hf_config
from rejax.nvfp4 import Nvfp4Tensor
from rejax.params import HostTokenizer, Params

logger = logging.getLogger(__name__)

__all__ = ["CheckpointFileNotFoundError", "load", "save"]

# safetensors dtype tag <-> numpy dtype (bf16 / fp8 through ml_dtypes).
_ST_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_FLOAT_TAGS = ("F64", "F32", "F16", "BF16")
_DTYPE_NAMES = {  # HF config "dtype" strings
    np.dtype(np.float32): "float32",
    np.dtype(np.float16): "float16",
    np.dtype(ml_dtypes.bfloat16): "bfloat16",
    np.dtype(np.float64): "float64",
}

_LINEARS = (
    ("self_attn", "q_proj"),
    ("self_attn", "k_proj"),
    ("self_attn", "v_proj"),
    ("self_attn", "o_proj"),
    ("mlp", "gate_proj"),
    ("mlp", "up_proj"),
    ("mlp", "down_proj"),
)
# Buffers some exporters write that carry no weights (recomputed from the config).
_HARMLESS = re.compile(r"^(model\.)?(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq$")
# FP8 KV-cache scales from ModelOpt exports with kv_cache_quant_algo=FP8.
_KV_SCALES = re.compile(r"^model\.layers\.\d+\.self_attn\.[kv]_proj\.[kv]_scale$")
_QUANT_ALGOS = {"NVFP4": "nvfp4", "W4A16_NVFP4": "nvfp4-w4a16"}
_MODES_TO_ALGO = {v: k for k, v in _QUANT_ALGOS.items()}
_BLOCK = 16  # NVFP4 elements per E4M3 block scale
_PROGRESS_MIN_PARAMS = 50_000_000  # show a quantization progress bar above this many weights


class CheckpointFileNotFoundError(FileNotFoundError, ValueError):
    """A required checkpoint file or directory is missing (both an OSError and a ValueError)."""


# ----------------------------------------------------------------------------- name mapping


@dataclasses.dataclass(frozen=True)
class _Linear:
    """One HF linear: shard `shard` of layer `layer`'s fused linear `fused` in rejax."""

    hf: str  # HF module prefix, e.g. "model.layers.0.self_attn.q_proj"
    path: tuple[
        str, ...
    ]  # path of the fused, stacked linear, e.g. ("layers", "self_attn", "qkv_proj")
    layer: int
    shard: int
    shape: tuple[int, int]  # (N_out, K_in) of this shard, HF layout
    bias: bool


# rejax fused linear -> the HF linears it holds, in row order
_FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


def _linears(cfg: Config) -> list[_Linear]:
    """All HF decoder linears of `cfg` (layer-major), with their place in the fused stacks."""
    out = []
    for i in range(cfg.num_layers):
        for block, fused in rparams.LINEARS:
            k_in = rparams.linear_shape(cfg, fused)[1]
            for s_idx, (name, rows) in enumerate(zip(_FUSED[fused], rparams.shards(cfg, fused))):
                out.append(
                    _Linear(
                        hf=f"model.layers.{i}.{block}.{name}",
                        path=("layers", block, fused),
                        layer=i,
                        shard=s_idx,
                        shape=(rows, k_in),
                        bias=rparams.has_bias(cfg, fused),
                    )
                )
    return out


def _fused_groups(cfg: Config) -> dict[tuple[str, ...], list[list[_Linear]]]:
    """Fused linear path -> [layer][shard] of its HF linears."""
    groups: dict = {}
    for lin in _linears(cfg):
        per_layer = groups.setdefault(lin.path, [[] for _ in range(cfg.num_layers)])
        per_layer[lin.layer].append(lin)
    return groups


def _plain_tensors(cfg: Config) -> list[tuple[str, tuple[str, ...], tuple[int, ...], int | None]]:
    """(HF name, pytree path, shape, layer or None) of every non-linear tensor (embedding, norms,
    lm_head); per-layer tensors are stacked over layers at their path."""
    d = cfg.hidden_size
    out = [("model.embed_tokens.weight", ("embed_tokens", "embedding"), (cfg.vocab_size, d), None)]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        for n in ("input_layernorm", "post_attention_layernorm"):
            out.append((f"{p}.{n}.weight", ("layers", n, "scale"), (d,), i))
        if cfg.arch == "qwen3":
            for n in ("q_norm", "k_norm"):
                out.append(
                    (
                        f"{p}.self_attn.{n}.weight",
                        ("layers", "self_attn", n, "scale"),
                        (cfg.head_dim,),
                        i,
                    )
                )
    out.append(("model.norm.weight", ("norm", "scale"), (d,), None))
    if not cfg.tie_word_embeddings:
        out.append(("lm_head.weight", ("lm_head", "weight"), (cfg.vocab_size, d), None))
    return out


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _get(tree: dict, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            raise ValueError(f"params.weights has no entry {'/'.join(path)!r} (missing {key!r})")
        tree = tree[key]
    return tree


# ----------------------------------------------------------------------------- safetensors I/O


class _SafetensorsFile:
    """One safetensors file: header validated by the safetensors library, data memory-mapped.

    The safetensors numpy API cannot represent float8 tensors, so tensors are sliced from a
    memory map at the header's offsets and viewed with ml_dtypes types (bytes unchanged).
    """

    def __init__(self, path: Path):
        from safetensors import SafetensorError, safe_open

        self.path = path
        try:
            with safe_open(str(path), framework="np") as f:  # validates header and file size
                names = list(f.keys())
        except (SafetensorError, OSError, ValueError) as e:
            raise ValueError(f"{path}: not a valid safetensors file ({e})") from e
        with open(path, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        self.metadata = header.pop("__metadata__", None) or {}
        self._start = 8 + n
        self._header = header
        self._mmap = None
        assert sorted(names) == sorted(header), (path, names)

    def names(self) -> list[str]:
        return list(self._header)

    def dtype_tag(self, name: str) -> str:
        return self._header[name]["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._header[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        entry = self._header[name]
        dtype = _ST_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(
                f"{self.path}: tensor {name!r} has unsupported dtype {entry['dtype']!r}; "
                f"expected one of {sorted(_ST_DTYPES)}"
            )
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        begin, end = entry["data_offsets"]
        raw = self._mmap[self._start + begin : self._start + end]
        return np.asarray(raw).view(dtype).reshape(entry["shape"])


class _TensorSource:
    """Every tensor of a checkpoint, by HF name, across one file or the shards of an index."""

    def __init__(self, directory: Path):
        index = directory / "model.safetensors.index.json"
        single = directory / "model.safetensors"
        if index.exists():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(f"{index}: missing or empty 'weight_map'")
            files = sorted(set(weight_map.values()))
        elif single.exists():
            weight_map, files = None, [single.name]
        else:
            others = sorted(p.name for p in directory.glob("*.safetensors"))
            hint = f" (found {others} without an index)" if others else ""
            raise CheckpointFileNotFoundError(
                f"{directory}: no model.safetensors or model.safetensors.index.json{hint}"
            )
        self._where: dict[str, _SafetensorsFile] = {}
        for fname in files:
            fpath = directory / fname
            if not fpath.is_file():
                raise CheckpointFileNotFoundError(f"{fpath}: shard named in {index} is missing")
            shard = _SafetensorsFile(fpath)
            for name in shard.names():
                if name in self._where:
                    raise ValueError(
                        f"tensor {name!r} appears in both {self._where[name].path} and {fpath}"
                    )
                if weight_map is not None and weight_map.get(name) != fname:
                    raise ValueError(
                        f"{fpath}: tensor {name!r} is not mapped to this shard in {index} "
                        f"(index says {weight_map.get(name)!r})"
                    )
                self._where[name] = shard
        if weight_map is not None:
            missing = sorted(set(weight_map) - set(self._where))
            if missing:
                raise ValueError(
                    f"{index}: tensors listed but absent from their shards: {missing[:8]}"
                )

    def names(self) -> set[str]:
        return set(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def file(self, name: str) -> Path:
        return self._where[name].path

    def dtype_tag(self, name: str) -> str:
        return self._where[name].dtype_tag(name)

    def get(self, name: str, shape: tuple[int, ...] | None = None, tags=None) -> np.ndarray:
        """The tensor `name`, checked against an expected shape and dtype tags."""
        shard = self._where.get(name)
        if shard is None:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        found = shard.shape(name)
        if shape is not None and found != tuple(shape):
            raise ValueError(
                f"{shard.path}: tensor {name!r} has shape {list(found)}, expected {list(shape)}"
            )
        tag = shard.dtype_tag(name)
        if tags is not None and tag not in tags:
            raise ValueError(
                f"{shard.path}: tensor {name!r} has dtype {tag}, expected one of {list(tags)}"
            )
        return shard.get(name)


def _write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    from safetensors import TensorSpec, serialize_file

    # np.ascontiguousarray would turn 0-d scalars into shape [1]; keep [] as written.
    arrays = {k: v if v.flags.c_contiguous else v.copy(order="C") for k, v in tensors.items()}
    specs = {
        k: TensorSpec(dtype=a.dtype.name, shape=a.shape, data_ptr=a.ctypes.data, data_len=a.nbytes)
        for k, a in arrays.items()
    }
    serialize_file(specs, str(path), metadata={"format": "pt"})


def _read_json(path: Path) -> dict:
    try:
        with open(path) as f:
            value = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from e
    if not isinstance(value, dict):
        found = type(value).__name__
        raise ValueError(f"{path}: expected a JSON object, found {found}")  # noqa: TRY004
    return value


def _write_json(path: Path, value: dict) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=2, sort_keys=True)
        f.write("\n")


# ----------------------------------------------------------------------------- quantization config


@dataclasses.dataclass(frozen=True)
class _QuantInfo:
    mode: str  # "nvfp4" | "nvfp4-w4a16"
    exclude: tuple[str, ...]
    dynamic_inputs: bool  # W4A4 saved without input_scale (rejax dynamic activations)


def _quant_info(directory: Path, hf: dict) -> _QuantInfo | None:
    """Reads the ModelOpt quantization description, or None for a float checkpoint."""
    qfile = directory / "hf_quant_config.json"
    from_file = _read_json(qfile).get("quantization") if qfile.exists() else None
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
    group = (from_file or {}).get("group_size", _BLOCK)
    if group != _BLOCK:
        raise ValueError(f"{qfile}: group_size {group} is not supported; NVFP4 uses {_BLOCK}")
    exclude = list((from_file or {}).get("exclude_modules") or [])
    exclude += list((qcfg or {}).get("ignore") or [])
    dynamic = False
    for group_cfg in ((qcfg or {}).get("config_groups") or {}).values():
        acts = group_cfg.get("input_activations") or {}
        dynamic = dynamic or bool(acts.get("dynamic", False))
    return _QuantInfo(
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

    hf = _read_json(config_path)
    qinfo = _quant_info(directory, hf)
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
    source = _TensorSource(directory)
    used: set[str] = set()
    weights: dict = {}
    stacks: dict = {}
    for name, tree_path, shape, layer in _plain_tensors(cfg):
        value = source.get(name, shape, _FLOAT_TAGS)
        if layer is None:
            _set(weights, tree_path, jnp.asarray(value).astype(dtype))
        else:
            stacks.setdefault(tree_path, []).append(value)
        used.add(name)
    for tree_path, values in stacks.items():
        _set(weights, tree_path, jnp.asarray(np.stack(values)).astype(dtype))
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
        _load_nvfp4_linears(source, cfg, qinfo, weights, used, dtype)

    extra = sorted(source.names() - used)
    kv_scales = [n for n in extra if _KV_SCALES.match(n)]
    if kv_scales:
        logger.warning(
            "rejax.load: dropping %d FP8 KV-cache scales (e.g. %s): the KV cache stays bf16",
            len(kv_scales),
            kv_scales[0],
        )
    unexpected = [n for n in extra if not _HARMLESS.match(n) and not _KV_SCALES.match(n)]
    if unexpected:
        listed = ", ".join(f"{n!r} in {source.file(n)}" for n in unexpected[:8])
        more = f" (+{len(unexpected) - 8} more)" if len(unexpected) > 8 else ""
        raise ValueError(f"unexpected tensors not used by a {cfg.arch} model: {listed}{more}")

    return Params(
        weights=weights,
        cfg=cfg,
        tokenizer=_load_tokenizer(directory),
        generation_config=_load_generation_config(directory),
    )


def _checkpoint_mode(qinfo: _QuantInfo, quant: str | None) -> str:
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


def _check_tied_head(source: _TensorSource, cfg: Config) -> None:
    shape = (cfg.vocab_size, cfg.hidden_size)
    head = source.get("lm_head.weight", shape, _FLOAT_TAGS)
    embed = source.get("model.embed_tokens.weight", shape, _FLOAT_TAGS)
    if not np.array_equal(head, embed):
        raise ValueError(
            f"{source.file('lm_head.weight')}: tie_word_embeddings is true but 'lm_head.weight' "
            "differs from 'model.embed_tokens.weight'"
        )


def _load_float_linears(source, cfg, weights, used, dtype, *, quantize: bool) -> None:
    from tqdm.auto import tqdm

    groups = _fused_groups(cfg)
    total = sum(lin.shape[0] * lin.shape[1] for lin in _linears(cfg))
    if quantize:
        for lin in _linears(cfg)[:7]:
            if lin.shape[1] % _BLOCK:
                raise ValueError(
                    f"{lin.hf}.weight: in_features {lin.shape[1]} is not a multiple of {_BLOCK}; "
                    "cannot quantize to NVFP4"
                )
    bar = tqdm(
        total=len(_linears(cfg)),
        desc="rejax: quantizing to NVFP4",
        unit="linear",
        disable=not quantize or total < _PROGRESS_MIN_PARAMS,
    )
    for path, per_layer in groups.items():
        layers_w, layers_b = [], []
        for shard_lins in per_layer:
            parts = []
            for lin in shard_lins:
                w = np.asarray(
                    jnp.asarray(source.get(f"{lin.hf}.weight", lin.shape, _FLOAT_TAGS)).astype(
                        dtype
                    )
                )
                used.add(f"{lin.hf}.weight")
                parts.append(nvfp4.quantize_weight(w) if quantize else w)
                bar.update(1 if quantize else 0)
            layers_w.append(nvfp4.concat_rows(parts) if quantize else np.concatenate(parts))
            if shard_lins[0].bias:
                layers_b.append(_fused_bias(source, shard_lins, used))
        weight = (
            rparams.stack_layers(layers_w) if quantize else tuple(jnp.asarray(w) for w in layers_w)
        )
        entry = {"weight": weight}
        if layers_b:
            entry["bias"] = jnp.asarray(np.stack(layers_b)).astype(dtype)
        _set(weights, path, entry)
    bar.close()


def _fused_bias(source, shard_lins: list[_Linear], used: set) -> np.ndarray:
    """One layer's fused bias: the shards' biases concatenated in row order."""
    used.update(f"{lin.hf}.bias" for lin in shard_lins)
    return np.concatenate(
        [source.get(f"{lin.hf}.bias", lin.shape[:1], _FLOAT_TAGS) for lin in shard_lins]
    )


def _load_nvfp4_linears(source, cfg, qinfo: _QuantInfo, weights, used, dtype) -> None:
    for special in ("lm_head", "model.embed_tokens"):
        if f"{special}.weight_scale" in source:
            raise ValueError(
                f"{source.file(special + '.weight_scale')}: {special} is NVFP4-quantized; rejax "
                "keeps the embedding and lm_head in bf16 (ModelOpt default)"
            )
    for path, per_layer in _fused_groups(cfg).items():
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
                f"are NVFP4: rejax stacks every layer's {'/'.join(_FUSED[path[-1]])} into one "
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
                            jnp.asarray(source.get(w_name, lin.shape, _FLOAT_TAGS)).astype(dtype)
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
                layers_b.append(_fused_bias(source, shard_lins, used))
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
        _set(weights, path, entry)


def _nvfp4_entry(source, lin: _Linear, names, qinfo: _QuantInfo, cfg: Config) -> dict:
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
    scales = source.get(names["weight_scale"], (n, k // _BLOCK), ("F8_E4M3", "U8"))
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


def _scalar(source: _TensorSource, name: str) -> np.ndarray:
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


# ----------------------------------------------------------------------------- tokenizer, gen cfg


def _special_token(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _load_tokenizer(directory: Path) -> HostTokenizer | None:
    tok_path = directory / "tokenizer.json"
    if not tok_path.exists():
        return None
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(tok_path))
    except Exception as e:  # the tokenizers library raises a bare Exception on bad files
        raise ValueError(f"{tok_path}: cannot be loaded by tokenizers ({e})") from e
    tcfg_path = directory / "tokenizer_config.json"
    tcfg = _read_json(tcfg_path) if tcfg_path.exists() else {}
    chat_template = tcfg.get("chat_template")
    if isinstance(chat_template, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in chat_template if isinstance(t, dict)}
        chat_template = named.get("default") or next(iter(named.values()), None)
    jinja = directory / "chat_template.jinja"
    if jinja.exists():
        chat_template = jinja.read_text()
    special = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        token = _special_token(tcfg.get(key))
        if token is not None:
            special[key] = token
    extra = [_special_token(t) for t in tcfg.get("additional_special_tokens") or []]
    if extra:
        special["additional_special_tokens"] = tuple(t for t in extra if t is not None)
    return HostTokenizer(tokenizer, chat_template=chat_template, special_tokens=special)


def _hashable(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    return value


def _load_generation_config(directory: Path) -> tuple:
    gpath = directory / "generation_config.json"
    if not gpath.exists():
        return ()
    return _hashable(_read_json(gpath))


def _unhashable(value: Any) -> Any:
    if isinstance(value, tuple):
        if value and all(
            isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], str) for v in value
        ):
            return {k: _unhashable(v) for k, v in value}
        return [_unhashable(v) for v in value]
    return value


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
    float_dtype = np.asarray(_get(params.weights, ("embed_tokens", "embedding"))).dtype

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
            "producer": {"name": "rejax", "version": _version()},
            "quantization": {
                "quant_algo": _MODES_TO_ALGO[cfg.quant],
                "kv_cache_quant_algo": None,
                "group_size": _BLOCK,
                "exclude_modules": exclude,
            },
        }
        _write_json(directory / "hf_quant_config.json", quant_file)
        weights_cfg = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": _BLOCK}
        group = {"weights": weights_cfg, "targets": ["Linear"]}
        if cfg.quant == "nvfp4":
            group["input_activations"] = dict(weights_cfg, dynamic=dynamic)
        hf["quantization_config"] = {
            "config_groups": {"group_0": group},
            "ignore": exclude,
            "quant_algo": _MODES_TO_ALGO[cfg.quant],
            "producer": quant_file["producer"],
            "quant_method": "modelopt",
        }
    _write_json(directory / "config.json", hf)
    if params.generation_config:
        _write_json(directory / "generation_config.json", _unhashable(params.generation_config))
    if params.tokenizer is not None:
        _save_tokenizer(params.tokenizer, directory)


def _version() -> str:
    from rejax import __version__

    return __version__


def _to_hf_tensors(params: Params) -> tuple[dict[str, np.ndarray], list[str]]:
    """Flattens the weights pytree into HF-named numpy arrays (stacks split per layer, fused
    linears split per shard, bytes unchanged); returns the float-linear list too."""
    cfg = params.cfg
    tensors: dict[str, np.ndarray] = {}
    for name, tree_path, shape, layer in _plain_tensors(cfg):
        if layer is None:
            tensors[name] = _checked(_get(params.weights, tree_path), name, shape)
        else:
            stacked = _checked(
                _get(params.weights, tree_path), "/".join(tree_path), (cfg.num_layers, *shape)
            )
            tensors[name] = stacked[layer]
    exclude = ["lm_head"] if cfg.quant is not None else []
    missing_input = []
    for path, per_layer in _fused_groups(cfg).items():
        entry = _get(params.weights, path)
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
        _write_safetensors(directory / "model.safetensors", tensors)
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
        _write_safetensors(directory / fname, shard)
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(a.nbytes for a in tensors.values())
    _write_json(
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
        "dtype": _DTYPE_NAMES.get(np.dtype(float_dtype), "bfloat16"),
        "use_cache": True,
    }


def _save_tokenizer(host: HostTokenizer, directory: Path) -> None:
    host.tokenizer.save(str(directory / "tokenizer.json"))
    tcfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for key, value in host.special_tokens.items():
        tcfg[key] = list(value) if isinstance(value, tuple) else value
    if host.chat_template is not None:
        tcfg["chat_template"] = host.chat_template
    _write_json(directory / "tokenizer_config.json", tcfg)
    jinja = directory / "chat_template.jinja"
    if jinja.exists():  # a stale template would override the one just written
        jinja.unlink()
