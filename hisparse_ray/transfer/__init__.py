"""Transport for the actor system (adapter ring): KV WRITEs between processes over NIXL, plus an
in-process loopback for unit tests. See ``base`` for the contract."""

from hisparse_ray.transfer.base import (
    PreparedWrite,
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
from hisparse_ray.types import MemKind, RegionDesc  # the regions a peer names (wire values)

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
