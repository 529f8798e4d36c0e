"""Deployment option values by kind (``DeployOptions``' field metadata ``kind``): checking a
value's type, parsing one that came as a string (CLI flags, ``serve run module:app tp=2``), the
``config`` option's loader, and this node's GPUs for ``gpus_per_rank``. Kinds: "int", "float",
"float?" (or None), "str", "dict?" (resource name -> amount > 0, or None), "json?" (a JSON object
or None), "config" (a :class:`~hisparse_ray.config.HiSparseConfig`)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from hisparse_ray.checks import is_int, is_number
from hisparse_ray.config import HiSparseConfig
from hisparse_ray.errors import ConfigError


def check_kind(key: str, value: Any, meta: Mapping[str, Any]) -> None:
    """ConfigError naming ``key`` unless ``value`` has the type of option kind ``meta["kind"]``
    and is one of ``meta["choices"]`` (when there are choices)."""
    kind, choices = meta["kind"], meta["choices"]
    if kind == "config":
        ok = isinstance(value, HiSparseConfig)
    elif kind == "dict?":
        ok = value is None or (isinstance(value, dict) and all(
            isinstance(k, str) and is_number(x) and math.isfinite(x) and x > 0
            for k, x in value.items()))
    elif kind == "json?":
        ok = value is None or (isinstance(value, dict) and all(isinstance(k, str) for k in value))
    elif kind == "float?":
        ok = value is None or is_number(value)
    elif kind == "float":
        ok = is_number(value)
    elif kind == "int":
        ok = is_int(value)
    else:
        ok = isinstance(value, str)
    if not ok:
        raise ConfigError(key, value, {"config": "a HiSparseConfig", "int": "an int",
                                       "float": "a number", "float?": "a number or None",
                                       "str": "a str", "json?": "None or a JSON object",
                                       "dict?": "None or a dict of resource "
                                       "name -> amount > 0"}[kind])
    if choices and value not in choices:
        raise ConfigError(key, value, f"one of {', '.join(choices)}")


def parse_value(key: str, value: Any, kind: str) -> Any:
    """``value`` as the option kind wants it when it came as a string (CLI, ``serve run``)."""
    if kind == "config":
        return load_config(value)
    if not isinstance(value, str):
        return value
    text = value.strip()
    try:
        if kind == "int":
            return int(text)
        if kind in ("float", "float?"):
            return None if kind == "float?" and text.lower() in ("", "none") else float(text)
        if kind in ("dict?", "json?"):
            return None if text.lower() in ("", "none") else json.loads(text)
    except ValueError:
        raise ConfigError(key, value, {"int": "an int", "json?": "a JSON object",
                                       "dict?": "JSON of resource name -> "
                                       "amount"}.get(kind, "a number")) from None
    return value


def load_config(value: Any, base: HiSparseConfig | None = None) -> HiSparseConfig:
    """A HiSparse config from a ``HiSparseConfig``, a dict, inline JSON or a JSON file path
    (SGLang ``--hisparse-config`` keys + ``host_pool_gib``). Keys left out take ``base``'s values
    (default: ``HiSparseConfig.tiny()``, the built-in models' defaults; SGLang's production
    defaults would silently make a 4 GiB host pool for a tiny model); None or "" is ``base``.
    A path that does not exist, a file that is not JSON and JSON that is not an object are
    ConfigErrors saying which (``HiSparseConfig.load``)."""
    return HiSparseConfig.load(value, HiSparseConfig.tiny() if base is None else base)


def visible_gpus() -> int:
    """CUDA devices torch sees in this process (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_gpus_per_rank(asked: float | None, tp: int, gpus: int) -> float:
    """A decode rank's GPU share: ``asked`` when given, else one GPU per rank when ``gpus`` >=
    ``tp``, else all ranks on one GPU (1 / tp each); 0 without GPUs. ConfigError when ``asked``
    needs more GPUs than are visible (above 0.5 no two ranks share a GPU)."""
    if gpus == 0:
        return 0.0
    if asked is None:
        return 1.0 if gpus >= tp else 1.0 / tp
    needed = tp if asked > 0.5 else asked * tp
    if needed > gpus + 1e-9:
        raise ConfigError("gpus_per_rank", asked, f"with tp={tp} needs {needed:g} GPUs, {gpus} "
                                                  f"visible")
    return asked
