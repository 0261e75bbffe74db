"""safetensors and JSON files: a checked reader, the sharded tensor source `load` reads
through, and the writer `save` uses."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, TensorSpec, safe_open, serialize_file

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
FLOAT_TAGS = ("F64", "F32", "F16", "BF16")
DTYPE_NAMES = {  # HF config "dtype" strings
    np.dtype(np.float32): "float32",
    np.dtype(np.float16): "float16",
    np.dtype(ml_dtypes.bfloat16): "bfloat16",
    np.dtype(np.float64): "float64",
}


class CheckpointFileNotFoundError(FileNotFoundError, ValueError):
    """A required checkpoint file or directory is missing (both an OSError and a ValueError)."""


# ----------------------------------------------------------------------------- safetensors I/O


class _SafetensorsFile:
    """One safetensors file: header validated by the safetensors library, data memory-mapped.

    The safetensors numpy API cannot represent float8 tensors, so tensors are sliced from a
    memory map at the header's offsets and viewed with ml_dtypes types (bytes unchanged).
    """

    def __init__(self, path: Path):
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


class TensorSource:
    """Every tensor of a checkpoint, by HF name, across one file or the shards of an index."""

    def __init__(self, directory: Path):
        index = directory / "model.safetensors.index.json"
        single = directory / "model.safetensors"
        if index.exists():
            weight_map = read_json(index).get("weight_map")
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


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    # np.ascontiguousarray would turn 0-d scalars into shape [1]; keep [] as written.
    arrays = {k: v if v.flags.c_contiguous else v.copy(order="C") for k, v in tensors.items()}
    specs = {
        k: TensorSpec(dtype=a.dtype.name, shape=a.shape, data_ptr=a.ctypes.data, data_len=a.nbytes)
        for k, a in arrays.items()
    }
    serialize_file(specs, str(path), metadata={"format": "pt"})


def read_json(path: Path) -> dict:
    try:
        with open(path) as f:
            value = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from e
    if not isinstance(value, dict):
        found = type(value).__name__
        raise ValueError(f"{path}: expected a JSON object, found {found}")  # noqa: TRY004
    return value


def write_json(path: Path, value: dict) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=2, sort_keys=True)
        f.write("\n")
