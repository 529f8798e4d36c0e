"""Resolver kernels (ring 2, installed as ``hisparse_ray.kernels``): CUDA via CuPy plus a
bit-exact pure-torch twin in ``reference``; this module is the one dispatch point.

``backend="auto"`` runs the CUDA launcher when cupy imports and ``device_kv`` is on a CUDA device,
else the torch reference; ``"cuda"`` / ``"torch"`` force one. Signatures: the backends' own plus
the keyword ``backend``. Contract: docs/architecture.md, "The resolver contract".
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch

from hisparse_ray.config import env_flag
from hisparse_ray.errors import KernelPreconditionError
from hisparse_ray.kernels import cuda, reference
from hisparse_ray.kernels._contract import DEFAULT_BLOCK_THREADS

__all__ = ["DEFAULT_BLOCK_THREADS", "backend_for", "backup", "replay", "resolve", "triton_module"]

BACKENDS = ("auto", "cuda", "torch")


@functools.cache
def triton_module(name: str, switch: str) -> ModuleType | None:
    """``hisparse_ray.kernels.<name>``, one of the fast step's Triton kernel modules, where triton
    imports and the environment switch ``switch`` is not 0; else None (the caller runs torch)."""
    if not env_flag(switch, True):
        return None
    try:
        return importlib.import_module(f"hisparse_ray.kernels.{name}")
    except ImportError:
        return None


def backend_for(device_kv: torch.Tensor, backend: str = "auto") -> ModuleType:
    """The module (``cuda`` or ``reference``) that a call with this ``device_kv`` runs."""
    if backend not in BACKENDS:
        raise KernelPreconditionError(f"backend={backend!r} must be one of {BACKENDS}")
    if backend == "torch":
        return reference
    if backend == "cuda":
        if not cuda.available():
            raise KernelPreconditionError("backend='cuda' needs cupy and a CUDA device")
        return cuda
    return cuda if device_kv.is_cuda and cuda.available() else reference


def resolve(top_k, seq_lens, state_idx, slot_pos, lru, slot_rows, resident_table, host_table,
            host_kv, device_kv, out_rows, plan=None, *, page_size: int,
            block_threads: int = DEFAULT_BLOCK_THREADS, debug: bool | None = None,
            cluster: int | str | None = None, phase_a: str | None = None,
            backend: str = "auto") -> None:
    """Resolve one layer's top-k positions to device rows (see ``reference.resolve``;
    ``cluster``: phase A's blocks per row on CUDA, ``cuda.cluster_size``; ``phase_a``: its long
    path's variant on CUDA, ``cuda.fused_phase_a``)."""
    backend_for(device_kv, backend).resolve(
        top_k, seq_lens, state_idx, slot_pos, lru, slot_rows, resident_table, host_table,
        host_kv, device_kv, out_rows, plan, page_size=page_size, block_threads=block_threads,
        debug=debug, cluster=cluster, phase_a=phase_a,
    )


def replay(plan, host_kv, device_kv, *, debug: bool | None = None, backend: str = "auto") -> None:
    """Apply a recorded miss plan to another layer's views (see ``reference.replay``)."""
    backend_for(device_kv, backend).replay(plan, host_kv, device_kv, debug=debug)


def backup(src_rows, dst_rows, device_kv, host_kv, *, debug: bool | None = None,
           backend: str = "auto") -> None:
    """Copy the newest tokens' rows of every layer device -> host (see ``reference.backup``)."""
    backend_for(device_kv, backend).backup(src_rows, dst_rows, device_kv, host_kv, debug=debug)
