"""A local Hugging Face model folder, read lazily (ring 2): ``config.json``, safetensors shards with
their ``model.safetensors.index.json`` (or one ``model.safetensors``, or shards without an index),
tokenizer files beside them.

Nothing is loaded on open: the config is parsed and validated, the index read, every shard's
header (a JSON table of dtype, shape and offsets at the file's start) parsed, and every listed key
checked against its file. Tensors are then read one at a time from memory-mapped files
(:meth:`Checkpoint.reader`, ``safetensors.safe_open`` + ``get_slice``), a slice at a time, so a
tensor-parallel rank touches only its rows. Every problem raises
:class:`~hisparse_ray.errors.CheckpointError` naming the file and the key.
"""

from __future__ import annotations

import json
import struct
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from hisparse_ray.errors import CheckpointError, ConfigError
from hisparse_ray.model.config import KINDS, DSAConfig, config_from_hf
from hisparse_ray.model.fp8 import Fp8Format, parse_quantization

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

# safetensors dtype names -> torch dtypes (the ones a DSA checkpoint may hold)
DTYPES = {
    "F8_E4M3": torch.float8_e4m3fn, "BF16": torch.bfloat16, "F16": torch.float16,
    "F32": torch.float32, "F64": torch.float64, "I64": torch.int64, "I32": torch.int32,
    "U8": torch.uint8, "I8": torch.int8, "BOOL": torch.bool,
}
if hasattr(torch, "float8_e8m0fnu"):  # power-of-two block scales (ue8m0) stored as such; torch >= 2.7
    DTYPES["F8_E8M0"] = torch.float8_e8m0fnu


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Where a tensor lives and what it is: ``file`` (name inside the folder), ``dtype``, ``shape``."""

    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


def read_header(path: Path) -> dict[str, TensorInfo]:
    """The tensor table of one safetensors file (its first 8 + N bytes only)."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(path.name, "header", "file shorter than a safetensors header")
            (n,) = struct.unpack("<Q", head)
            size = path.stat().st_size
            if n > size - 8:
                raise CheckpointError(path.name, "header", f"header length {n} exceeds the file's {size} bytes")
            raw = f.read(n)
        table = json.loads(raw)
    except CheckpointError:
        raise
    except (OSError, ValueError) as err:
        raise CheckpointError(path.name, "header", f"not a readable safetensors file ({err})") from None
    out = {}
    for key, meta in table.items():
        if key == "__metadata__":
            continue
        dtype = DTYPES.get(meta.get("dtype"))
        if dtype is None:
            raise CheckpointError(path.name, key, f"dtype {meta.get('dtype')!r} is not supported")
        out[key] = TensorInfo(path.name, dtype, tuple(int(s) for s in meta["shape"]))
    return out


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(str(path), "-", "missing") from None
    except (OSError, ValueError) as err:
        raise CheckpointError(str(path), "-", f"not valid JSON ({err})") from None


class Checkpoint:
    """One model folder. ``config`` (:class:`DSAConfig`), ``hf_config`` (the raw dict), ``fp8``
    (:class:`Fp8Format` or None), ``num_mtp_layers`` (``num_nextn_predict_layers``: their weights,
    keys ``model.layers.{num_hidden_layers + i}.*``, are in the files and never read here), and
    :meth:`info` / :meth:`reader` for tensors."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        if not self.path.is_dir():
            raise CheckpointError(str(self.path), "-", "not a directory")
        self.hf_config: dict[str, Any] = _json(self.path / "config.json")
        kind = self.hf_config.get("model_type")
        if kind not in KINDS:
            raise CheckpointError("config.json", "model_type",
                                  f"{kind!r} is not a DSA model: one of {', '.join(KINDS)}")
        try:
            self.config: DSAConfig = config_from_hf(self.hf_config)
            self.fp8: Fp8Format | None = parse_quantization(self.hf_config.get("quantization_config"))
        except ConfigError as err:  # config_from_hf / parse_quantization name the key
            if err.value is None:  # a required key the folder's config.json does not have
                raise CheckpointError("config.json", err.key, "required key missing") from None
            raise CheckpointError("config.json", err.key, f"{err.value!r}: {err.allowed}") from None
        self.num_mtp_layers = int(self.hf_config.get("num_nextn_predict_layers") or 0)
        self._tensors = self._read_tables()

    # -- the tensor table ------------------------------------------------------------------------
    def _read_tables(self) -> dict[str, TensorInfo]:
        index_path = self.path / INDEX
        if index_path.exists():
            index = _json(index_path)
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict):
                raise CheckpointError(INDEX, "weight_map", "missing or not an object")
            files = sorted(set(weight_map.values()))
            for f in files:
                if not (self.path / f).is_file():
                    key = next(k for k, v in weight_map.items() if v == f)
                    raise CheckpointError(INDEX, key, f"its shard {f} is missing from {self.path}")
            tables = {f: read_header(self.path / f) for f in files}
            out = {}
            for key, f in weight_map.items():
                info = tables[f].get(key)
                if info is None:
                    raise CheckpointError(f, key, f"listed in {INDEX} but not in the file")
                out[key] = info
            return out
        files = [self.path / SINGLE] if (self.path / SINGLE).is_file() else sorted(self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(str(self.path), "-", f"no {INDEX}, {SINGLE} or *.safetensors files")
        out = {}
        for p in files:
            for key, info in read_header(p).items():
                if key in out:
                    raise CheckpointError(p.name, key, f"also in {out[key].file}")
                out[key] = info
        return out

    def keys(self) -> list[str]:
        return list(self._tensors)

    def __contains__(self, key: str) -> bool:
        return key in self._tensors

    def info(self, key: str) -> TensorInfo:
        try:
            return self._tensors[key]
        except KeyError:
            raise CheckpointError(INDEX if (self.path / INDEX).exists() else str(self.path), key,
                                  "missing from the checkpoint") from None

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor in the files (the checkpoint size, MTP layers included)."""
        return sum(i.nbytes for i in self._tensors.values())

    # -- reading ---------------------------------------------------------------------------------
    @contextmanager
    def reader(self, file: str) -> Iterator["FileReader"]:
        """Memory-map one shard while the block runs; unmapped after (its pages leave the RSS)."""
        from safetensors import safe_open

        with safe_open(str(self.path / file), framework="pt", device="cpu") as handle:
            yield FileReader(file, handle)


class FileReader:
    """Reads whole tensors or ``[rows, cols]`` slices of one open shard (copies out of the map)."""

    def __init__(self, file: str, handle: Any) -> None:
        self.file, self._h = file, handle

    def read(self, key: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        if rows is None and cols is None:
            return self._h.get_tensor(key)
        sl = self._h.get_slice(key)
        rows = rows or slice(None)
        return sl[rows] if cols is None else sl[rows, cols or slice(None)]
