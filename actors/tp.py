"""Tensor-parallel process-group bootstrap between Ray actors (ring 3).

The launcher asks rank 0 for a rendezvous address (its node IP and a free TCP port, see
:func:`rendezvous_address`), then every rank calls :func:`init_tp_group` with the same address at
the same time: ``torch.distributed`` over gloo on CPU, NCCL on GPU. One group per process (the
default group), which is what the model's head-sharded all-reduce uses. NCCL needs a GPU of its own
per rank (``num_gpus > 0.5``); ranks that may share one GPU (``num_gpus <= 0.5``) use gloo.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

from hisparse_ray.errors import StateError


@dataclass(frozen=True, slots=True)
class Rendezvous:
    """Where the ranks of one TP group meet: ``tcp://host:port``, ``world_size`` ranks, ``backend``
    ``"gloo"`` or ``"nccl"``."""

    host: str
    port: int
    world_size: int
    backend: str

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {self.backend!r}")

    @property
    def init_method(self) -> str:
        return f"tcp://{self.host}:{self.port}"


def node_ip() -> str:
    """This process's node IP as Ray sees it (127.0.0.1 style fallback outside Ray)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # pragma: no cover - ray is a hard dependency; be robust outside workers
        pass
    return socket.gethostbyname(socket.gethostname())


def free_port(host: str = "") -> int:
    """A TCP port that was free on this node a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        return int(s.getsockname()[1])


def default_backend(gpus_per_rank: float) -> str:
    """NCCL when no two ranks of the group can share a GPU; gloo on CPU and when they may (NCCL
    refuses two ranks on one device; gloo all-reduces CUDA tensors through host memory).

    Ranks asking for more than half a GPU each never share one (Ray would need more than a whole
    GPU), so 0.8 per rank puts every rank on its own GPU and leaves 0.2 of each for prefill."""
    return "nccl" if gpus_per_rank > 0.5 else "gloo"


def rendezvous_address(world_size: int, gpus_per_rank: float) -> Rendezvous:
    """Rank 0 calls this (inside its actor) to pick the group's meeting point on its own node."""
    host = node_ip()
    return Rendezvous(host, free_port(), world_size, default_backend(gpus_per_rank))


def init_tp_group(rdv: Rendezvous, rank: int, timeout_s: float = 120.0) -> None:
    """Join the default ``torch.distributed`` group as ``rank`` (blocks until every rank joined).

    Idempotence is refused: a process joins one TP group in its life (``StateError`` otherwise).
    With ``world_size == 1`` nothing is created (the model runs without collectives).
    """
    import torch.distributed as dist

    if not 0 <= rank < rdv.world_size:
        raise ValueError(f"rank {rank} not in 0..{rdv.world_size - 1}")
    if rdv.world_size == 1:
        return
    if dist.is_initialized():
        raise StateError("this process already joined a torch.distributed group")
    dist.init_process_group(
        backend=rdv.backend, init_method=rdv.init_method, rank=rank,
        world_size=rdv.world_size, timeout=timedelta(seconds=timeout_s),
    )


def destroy_tp_group() -> None:
    """Leave the group (idempotent)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
