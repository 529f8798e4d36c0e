"""Transport for the actor system (adapter ring): KV WRITEs between processes over NIXL, plus an
in-process loopback for unit tests. See ``base`` for the contract."""

from hisparse_ray.transfer.base import (
    MemKind,
    PreparedWrite,
    RegionDesc,
    TransferEngine,
    WriteSegment,
    XferState,
    coalesce,
    discard_prepared,
    prepare_writes,
    wait,
    write_all_with_retry,
    write_with_retry,
)
from hisparse_ray.transfer.loopback import LoopbackFabric, LoopbackTransferEngine
from hisparse_ray.transfer.nixl_engine import NixlTransferEngine

__all__ = [
    "LoopbackFabric",
    "LoopbackTransferEngine",
    "MemKind",
    "NixlTransferEngine",
    "PreparedWrite",
    "RegionDesc",
    "TransferEngine",
    "WriteSegment",
    "XferState",
    "coalesce",
    "discard_prepared",
    "prepare_writes",
    "wait",
    "write_all_with_retry",
    "write_with_retry",
]
