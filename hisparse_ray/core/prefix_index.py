"""Prefix index: chained hashes of full token pages -> published host blocks (pure ring).

A prefix key identifies the KV of one full page *and everything before it*: the KV of position p
depends on tokens 0..p, so page i's key is ``H(key[i-1], tokens[i*P:(i+1)*P])`` (blake2b, 128 bit,
stable across processes, unlike ``hash()`` of strings).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from hisparse_ray.types import HostBlockId

PrefixKey = bytes
ROOT_KEY: PrefixKey = b""


def page_key(parent: PrefixKey, page_tokens: Sequence[int]) -> PrefixKey:
    """Key of one full page given its parent's key (``ROOT_KEY`` for page 0)."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", page_tokens).tobytes())
    return h.digest()


def chain_keys(tokens: Sequence[int], page_size: int) -> list[PrefixKey]:
    """Keys of every *full* page of ``tokens`` (a trailing partial page has no key)."""
    keys: list[PrefixKey] = []
    parent = ROOT_KEY
    for i in range(len(tokens) // page_size):
        parent = page_key(parent, tokens[i * page_size:(i + 1) * page_size])
        keys.append(parent)
    return keys


class PrefixIndex:
    """Bijection between prefix keys and published host blocks.

    Invariant: ``key -> block`` and ``block -> key`` are inverse maps. The host pool owns the
    index and is the only writer (publish on completed copy, drop on eviction).
    """

    def __init__(self) -> None:
        self._by_key: dict[PrefixKey, HostBlockId] = {}
        self._by_block: dict[HostBlockId, PrefixKey] = {}

    def __len__(self) -> int:
        return len(self._by_key)

    def lookup(self, key: PrefixKey) -> HostBlockId | None:
        return self._by_key.get(key)

    def key_of(self, block: HostBlockId) -> PrefixKey | None:
        return self._by_block.get(block)

    def match(self, keys: Sequence[PrefixKey]) -> list[HostBlockId]:
        """Blocks of the longest published run ``keys[0..m-1]`` (stops at the first miss)."""
        out: list[HostBlockId] = []
        for k in keys:
            b = self._by_key.get(k)
            if b is None:
                break
            out.append(b)
        return out

    def insert(self, key: PrefixKey, block: HostBlockId) -> bool:
        """Add ``key -> block``; False (nothing changed) if the key or the block is indexed."""
        if key in self._by_key or block in self._by_block:
            return False
        self._by_key[key] = block
        self._by_block[block] = key
        return True

    def remove_block(self, block: HostBlockId) -> None:
        key = self._by_block.pop(block)
        del self._by_key[key]

    def blocks(self) -> set[HostBlockId]:
        return set(self._by_block)

    def check_invariants(self) -> None:
        assert len(self._by_key) == len(self._by_block), "prefix maps differ in size"
        for k, b in self._by_key.items():
            assert self._by_block.get(b) == k, f"prefix entry {k.hex()} -> {b} not inverse"
