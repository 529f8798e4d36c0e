"""Where a model comes from (ring 2): the one resolution of a ``--model`` value.

``resolve(name)`` takes a built-in kind (``deepseek_v32``, ``glm_moe_dsa``: seeded random weights,
no download) or the path of a local HF model folder (config.json, safetensors shards with their
index, tokenizer files) and returns a :class:`ModelSource` with the model's ``config``, a
``load(...)`` that builds the model (one TP rank's shard, read tensor by tensor for folders) and its
``tokenizer()``. Every front door (CLI ``--model``, ``ModelSpec``, the Serve options) and the
in-process engine go through it, so a folder works wherever a kind does.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from hisparse_ray.errors import ConfigError
from hisparse_ray.model.config import KINDS, DSAConfig, landing_config, tiny_config
from hisparse_ray.model.model import DSAModel, build_random_model
from hisparse_ray.model.tokenizer import BaseTokenizer, ByteTokenizer, HFTokenizer

SHAPES = ("tiny", "landing")


@functools.lru_cache(maxsize=8)
def _checkpoint(path: str, stamps: tuple):
    from hisparse_ray.model.checkpoint import Checkpoint

    return Checkpoint(path)


INDEX = "model.safetensors.index.json"


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A resolved model. ``name``: the kind or the folder (absolute). Built-in kinds take ``seed``
    and ``shape`` ("tiny", or "landing": DeepSeek-V3.2's KV bytes around a tiny network with
    ``num_layers`` layers); a folder ignores them."""

    name: str
    seed: int = 0
    shape: str = "tiny"
    num_layers: int = 61

    @property
    def is_folder(self) -> bool:
        return self.name not in KINDS

    def checkpoint(self):
        """The folder's :class:`~hisparse_ray.model.checkpoint.Checkpoint` (cached; re-read when
        config.json, the index or any safetensors file changes: the cached tensor tables are
        those files' headers)."""
        if not self.is_folder:
            raise ConfigError("model", self.name, "a built-in kind has no checkpoint")
        folder = Path(self.name)
        files = (folder / "config.json", folder / INDEX, *sorted(folder.glob("*.safetensors")))
        stamps = tuple((str(p), p.stat().st_mtime_ns, p.stat().st_size) if p.exists() else (str(p), 0, 0)
                       for p in files)
        return _checkpoint(self.name, stamps)

    @property
    def config(self) -> DSAConfig:
        if self.is_folder:
            return self.checkpoint().config
        if self.shape == "landing":
            return landing_config(self.name, self.num_layers)
        return tiny_config(self.name)

    def load(self, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
             rank: int = 0, tp_size: int = 1, group: dist.ProcessGroup | None = None,
             fp8: str = "auto") -> DSAModel:
        """Rank ``rank`` of ``tp_size``'s model on ``device``. A folder is read tensor by tensor,
        only this rank's slices (:func:`~hisparse_ray.model.sharded_load.load_checkpoint`; ``fp8``
        as there); a built-in kind is built whole from its seed, then sharded."""
        if self.is_folder:
            from hisparse_ray.model.sharded_load import load_checkpoint

            return load_checkpoint(self.checkpoint(), dtype=dtype, device=device, rank=rank,
                                   tp_size=tp_size, group=group, fp8=fp8)
        model = build_random_model(self.config, self.seed, dtype=dtype, device=str(device))
        return model.shard_heads(rank, tp_size, group) if tp_size > 1 else model

    def tokenizer(self) -> BaseTokenizer:
        """The folder's HF tokenizer, or the byte tokenizer of the built-in kinds (vocab 96)."""
        if self.is_folder:
            return HFTokenizer(self.name)
        return ByteTokenizer()


def resolve(name: str | Path, *, seed: int = 0, shape: str = "tiny", num_layers: int = 61) -> ModelSource:
    """A kind name or a model folder -> :class:`ModelSource`; anything else is a :class:`ConfigError`
    naming ``model``. A folder's config is parsed (and its files checked) here, so a bad folder
    fails before anything starts."""
    if shape not in SHAPES:
        raise ConfigError("shape", shape, f"one of {SHAPES}")
    if num_layers < 1:
        raise ConfigError("num_layers", num_layers, "must be >= 1")
    text = str(name)
    if text in KINDS:
        return ModelSource(text, seed, shape, num_layers)
    path = Path(text).expanduser()
    if not path.is_dir():
        raise ConfigError("model", text, f"a built-in kind ({', '.join(KINDS)}) or a local HF model "
                          "folder (config.json + *.safetensors)")
    src = ModelSource(str(path.resolve()), seed, shape, num_layers)
    src.checkpoint()
    return src
