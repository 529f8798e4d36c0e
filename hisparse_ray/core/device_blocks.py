"""Resident (device) block pool: GPU blocks handed out as leases (pure ring).

Like vLLM's HMA block pool it knows no KV meaning: a lease is (block -> owner). The owner decides
whether a block is a resident page or part of a hot buffer. Lifecycle of a block::

    free --lease--> leased --pin (a transfer reads/writes it)--> pinned --unpin--> leased
    leased --release--> free          (releasing a pinned block is refused: ack first)

Cache groups: the *source* group (host blocks) has no device pool id; code that indexes a device
pool must narrow the group first (:func:`device_pool_id`), so host ownership can never masquerade
as a device pool.

Allocation order: ``lease(n)`` hands out the first contiguous run of ``n`` free blocks, else the
``n`` lowest, always ascending (:class:`FreeBlocks`): resident landings write into these blocks,
and a contiguous run is one descriptor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from hisparse_ray.core.free_blocks import FreeBlocks
from hisparse_ray.errors import DoubleFreeError, StateError
from hisparse_ray.types import DeviceBlockId, RequestId


@dataclass(frozen=True, slots=True)
class CacheGroup:
    """A KV cache group; ``device_pool_id`` is None for the host-backed source group."""

    name: str
    device_pool_id: int | None


SOURCE_GROUP = CacheGroup("source", None)
RESIDENT_GROUP = CacheGroup("resident", 0)
HOT_GROUP = CacheGroup("hot", 0)


def device_pool_id(group: CacheGroup) -> int:
    """Narrow a group to its device pool id; the source group has none (StateError)."""
    if group.device_pool_id is None:
        raise StateError(f"cache group {group.name!r} is host-backed and has no device pool id")
    return group.device_pool_id


class DeviceBlockPool:
    """``num_blocks`` device blocks. Invariants: free + leased == total; no block both free and
    leased; pinned blocks are leased; pin counts >= 0."""

    def __init__(self, num_blocks: int, pool_id: int = 0) -> None:
        self.num_blocks = num_blocks
        self.pool_id = pool_id
        self._free = FreeBlocks(num_blocks)
        self._owner: dict[DeviceBlockId, RequestId] = {}
        self._pins: dict[DeviceBlockId, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._owner)

    def owner(self, block: DeviceBlockId) -> RequestId | None:
        return self._owner.get(block)

    def pins(self, block: DeviceBlockId) -> int:
        return self._pins.get(block, 0)

    def lease(self, n: int, owner: RequestId, group: CacheGroup = RESIDENT_GROUP
              ) -> list[DeviceBlockId] | None:
        """``n`` blocks leased to ``owner``, strictly ascending (first contiguous free run, else the
        lowest free); all or nothing: None if fewer are free."""
        if device_pool_id(group) != self.pool_id:
            raise StateError(f"cache group {group.name!r} belongs to device pool "
                             f"{group.device_pool_id}, not {self.pool_id}")
        out = cast("list[DeviceBlockId] | None", self._free.take(n))
        if out is None:
            return None
        for b in out:
            self._owner[b] = owner
        return out

    def release(self, block: DeviceBlockId) -> None:
        if block not in self._owner:
            raise DoubleFreeError("device block", block)
        if self._pins.get(block):
            raise StateError(f"device block {block} is pinned by an unacknowledged transfer")
        del self._owner[block]
        self._free.add(block)

    def pin(self, block: DeviceBlockId) -> None:
        if block not in self._owner:
            raise StateError(f"device block {block} is not leased; cannot pin it")
        self._pins[block] = self._pins.get(block, 0) + 1

    def unpin(self, block: DeviceBlockId) -> None:
        n = self._pins.get(block, 0)
        if n <= 0:
            raise DoubleFreeError("device block pin", block)
        if n == 1:
            del self._pins[block]
        else:
            self._pins[block] = n - 1

    def check_invariants(self) -> None:
        self._free.check_invariants()
        free = set(self._free)
        assert not free & self._owner.keys(), "device block both free and leased"
        assert len(free) + len(self._owner) == self.num_blocks, "device blocks lost or duplicated"
        assert all(0 <= b < self.num_blocks for b in free | self._owner.keys())
        for b, n in self._pins.items():
            assert n > 0, f"device block {b} pin count {n}"
            assert b in self._owner, f"pinned device block {b} is not leased"
