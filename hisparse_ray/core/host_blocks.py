"""Host block pool: logical host block ids with ref counts, transfer pins and LRU eviction of
unreferenced published blocks (pure ring; the bytes live in the worker's pinned pool).

Lifecycle of a block::

    free --allocate--> owned (refs>=1, private) --publish--> published (indexed for reuse)
    published, refs==0 and pins==0 --> cached (in the LRU, evictable) --evict--> free
    private, refs==0 and pins==0 --> free

``refs`` count request pages that own the block; ``pins`` count in-flight transfers that read or
write it (spill destination, restore source, backup destination). A pinned block is never freed or
evicted, so no lease is released before its ack.

Allocation order: ``allocate(n)`` hands out the first contiguous run of ``n`` free blocks, else the
``n`` lowest free blocks, always ascending (see :class:`FreeBlocks`), so a request's pages form few
contiguous host runs and the landing path needs few descriptors and copies.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import cast

from hisparse_ray.core.free_blocks import FreeBlocks
from hisparse_ray.core.prefix_index import PrefixIndex, PrefixKey
from hisparse_ray.errors import DoubleFreeError, StateError
from hisparse_ray.types import HostBlockId


class HostBlockPool:
    """``num_blocks`` host blocks. Invariants (``check_invariants``): every block is exactly one of
    free / owned-or-pinned / cached; free + used + cached == total; refs, pins >= 0; cached blocks
    are published with refs == pins == 0; every prefix entry points at a live published block."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = FreeBlocks(num_blocks)
        self._refs = [0] * num_blocks
        self._pins = [0] * num_blocks
        self._cached: OrderedDict[HostBlockId, None] = OrderedDict()  # LRU: oldest first
        self.index = PrefixIndex()
        self.evictions = 0

    # -- queries ---------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free) - len(self._cached)

    def available(self) -> int:
        """Blocks ``allocate`` can hand out now (free + evictable)."""
        return len(self._free) + len(self._cached)

    def refs(self, block: HostBlockId) -> int:
        return self._refs[block]

    def pins(self, block: HostBlockId) -> int:
        return self._pins[block]

    def is_published(self, block: HostBlockId) -> bool:
        return self.index.key_of(block) is not None

    def is_cached(self, block: HostBlockId) -> bool:
        return block in self._cached

    # -- transitions -----------------------------------------------------------------------------
    def allocate(self, n: int) -> list[HostBlockId] | None:
        """``n`` private blocks with refs=1, strictly ascending (first contiguous free run, else
        the lowest free), evicting exactly ``n - num_free`` least recently used cached blocks when
        the free blocks do not suffice; None (nothing changed) if fewer than ``n`` are available."""
        if n > self.available():
            return None
        for _ in range(n - len(self._free)):
            victim, _ = self._cached.popitem(last=False)
            self.index.remove_block(victim)
            self.evictions += 1
            self._free.add(victim)
        out = cast("list[HostBlockId]", self._free.take(n))
        assert out is not None
        refs = self._refs
        for b in out:
            refs[b] = 1
        return out

    def acquire(self, block: HostBlockId) -> None:
        """Add a reference to a published block (prefix reuse); takes it out of the LRU."""
        if not self.is_published(block):
            raise StateError(f"host block {block} is not published; only published blocks are shared")
        self._cached.pop(block, None)
        self._refs[block] += 1

    def release(self, block: HostBlockId) -> None:
        """Drop one reference; an unpinned block at refs 0 becomes cached (published) or free."""
        if self._refs[block] <= 0:
            raise DoubleFreeError("host block", block)
        self._refs[block] -= 1
        self._settle(block)

    def pin(self, block: HostBlockId) -> None:
        if self._refs[block] <= 0 and self._pins[block] <= 0:
            raise StateError(f"host block {block} is free; cannot pin it")
        self._pins[block] += 1

    def unpin(self, block: HostBlockId) -> None:
        if self._pins[block] <= 0:
            raise DoubleFreeError("host block pin", block)
        self._pins[block] -= 1
        self._settle(block)

    def publish(self, block: HostBlockId, key: PrefixKey) -> bool:
        """Index an owned block whose page copy completed; False if the key is already served by
        another block (this block then stays private and is freed at refs 0)."""
        if self._refs[block] <= 0:
            raise StateError(f"host block {block} is not owned; cannot publish it")
        return self.index.insert(key, block)

    def _settle(self, block: HostBlockId) -> None:
        if self._refs[block] or self._pins[block]:
            return
        if self.is_published(block):
            self._cached[block] = None  # most recently used end
        else:
            self._free.add(block)

    # -- checks ----------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        self.index.check_invariants()
        self._free.check_invariants()
        free = set(self._free)
        cached = set(self._cached)
        assert not free & cached, "host block both free and cached"
        for b in range(self.num_blocks):
            r, p = self._refs[b], self._pins[b]
            assert r >= 0 and p >= 0, f"host block {b}: refs={r} pins={p}"
            if b in free:
                assert r == 0 and p == 0, f"free host block {b} has refs={r} pins={p}"
                assert not self.is_published(HostBlockId(b)), f"free host block {b} is indexed"
            elif b in cached:
                assert r == 0 and p == 0, f"cached host block {b} has refs={r} pins={p}"
                assert self.is_published(HostBlockId(b)), f"cached host block {b} not published"
            else:
                assert r > 0 or p > 0, f"host block {b} is lost (neither free, cached nor used)"
        assert len(free) + len(cached) + self.num_used == self.num_blocks
        for b in self.index.blocks():
            assert b not in free, f"prefix entry points at free host block {b}"
