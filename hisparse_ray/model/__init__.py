"""DeepSeek-V3.2-style sparse-attention (DSA) model in torch (ring 2).

Public API: :class:`DSAModel` (``prefill``, ``decode``, ``shard_heads``), :func:`build_tiny_model`,
:func:`tiny_config`, the cache interface :class:`AttentionKVCache` with :class:`DenseKVCache` and
:class:`IndexerKeyCache`, and loaders from HF weights (:mod:`hisparse_ray.model.loading`).

The names load on first use (PEP 562), so that importing :mod:`hisparse_ray.model.config` (pure:
the front doors validate a deployment against the model's shapes with it) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "AttentionKVCache": "cache", "DenseKVCache": "cache", "IndexerKeyCache": "cache",
    "DSAConfig": "config", "config_from_hf": "config", "hf_config_dict": "config",
    "tiny_config": "config",
    "from_hf_model": "loading", "from_pretrained_dir": "loading", "from_state_dict": "loading",
    "save_pretrained_dir": "loading",
    "DSAModel": "model", "build_tiny_model": "model",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
