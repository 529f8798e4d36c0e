"""In-process ``TransferEngine`` for unit tests of code above the transport (adapter ring).

Engines sharing one ``LoopbackFabric`` see each other; a WRITE copies its bytes and delivers its
notification when it completes: at once, or after ``pending_polls`` polls (to drive the asynchronous
paths of code above). Same contract as the NIXL engine, including its failure modes: unknown peer, region not
in the peer's exported metadata or no longer registered, span out of range -> ``TransferError``.
"""

from __future__ import annotations

import itertools
import pickle
import threading
from typing import Any, Sequence

from hisparse_ray.errors import TransferError
from hisparse_ray.transfer.base import WriteSegment, XferState, registered
from hisparse_ray.types import MemKind, RegionDesc


class LoopbackFabric:
    """The set of loopback engines that can reach each other (one per test, injected)."""

    def __init__(self) -> None:
        self.engines: dict[str, LoopbackTransferEngine] = {}
        self.lock = threading.Lock()


class LoopbackTransferEngine:
    """``TransferEngine`` whose peers live in the same process (see module docstring).

    ``direct_host_write`` is what ``supports_direct_host_write`` answers for DEVICE sources, so
    tests can drive both landing paths. ``pending_polls``: how many ``poll`` calls answer PENDING
    before a WRITE lands (0 = lands inside ``post_write``; a huge value models a stuck peer).
    """

    def __init__(self, fabric: LoopbackFabric, name: str, *, direct_host_write: bool = True,
                 pending_polls: int = 0) -> None:
        if pending_polls < 0:
            raise ValueError(f"pending_polls must be >= 0, got {pending_polls}")
        self.name = name
        self._pending_polls = pending_polls
        self._fabric = fabric
        self._direct = direct_host_write
        self._regions: dict[str, tuple[RegionDesc, Any]] = {}  # name -> (desc, flat uint8 view)
        self._peers: dict[str, frozenset[str]] = {}  # peer -> region names in its metadata
        self._xfers: dict[int, list] = {}  # id -> [polls left, target, copies, notif]
        self._inbox: list[tuple[str, bytes]] = []
        self._ids = itertools.count(1)
        with fabric.lock:
            if name in fabric.engines:
                raise TransferError(f"loopback agent {name!r} already exists")
            fabric.engines[name] = self

    def register(self, name: str, tensor: Any) -> RegionDesc:
        if name in self._regions:
            raise TransferError(f"region {name!r} already registered on {self.name!r}")
        if not tensor.is_contiguous():
            raise TransferError(f"region {name!r}: tensor must be contiguous")
        import torch

        flat = tensor.reshape(-1).view(torch.uint8)
        kind = MemKind.DEVICE if tensor.is_cuda else MemKind.HOST
        desc = RegionDesc(self.name, name, int(tensor.data_ptr()), int(flat.numel()),
                          int(tensor.get_device()) if tensor.is_cuda else 0, kind)
        self._regions[name] = (desc, flat)
        return desc

    def deregister(self, name: str) -> None:
        registered(self._regions, name, self.name, pop=True)

    def region(self, name: str) -> RegionDesc:
        return registered(self._regions, name, self.name)[0]

    def agent_metadata(self) -> bytes:
        return pickle.dumps((self.name, tuple(self._regions)))

    def add_peer(self, metadata: bytes) -> str:
        peer, regions = pickle.loads(metadata)
        if peer not in self._fabric.engines:
            raise TransferError(f"loopback peer {peer!r} not on this fabric")
        self._peers[peer] = frozenset(regions)
        return peer

    def remove_peer(self, peer: str) -> None:
        if self._peers.pop(peer, None) is None:
            raise TransferError(f"unknown peer {peer!r}")

    def supports_direct_host_write(self, peer: str, source: MemKind = MemKind.DEVICE) -> bool:
        if peer not in self._peers:
            raise TransferError(f"unknown peer {peer!r}")
        return source is MemKind.HOST or self._direct

    def post_write(self, segments: Sequence[WriteSegment], notif: bytes = b"") -> int:
        if not segments:
            raise TransferError("a WRITE needs at least one segment")
        peer = segments[0].remote.agent
        if peer not in self._peers:
            raise TransferError(f"unknown peer {peer!r} (add_peer its metadata first)")
        target = self._fabric.engines.get(peer)
        if target is None:
            raise TransferError(f"peer {peer!r} is gone")
        copies = []
        for seg in segments:
            if seg.remote.agent != peer:
                raise TransferError(f"one WRITE targets one peer: {peer!r} and {seg.remote.agent!r}")
            local = self.region(seg.local)
            local.check_span(seg.local_offset, seg.nbytes)
            seg.remote.check_span(seg.remote_offset, seg.nbytes)
            entry = target._regions.get(seg.remote.name)
            if (seg.remote.name not in self._peers[peer] or entry is None
                    or entry[0].addr != seg.remote.addr):
                raise TransferError(f"region {seg.remote.name!r} not registered on {peer!r}")
            src = self._regions[seg.local][1]
            copies.append((entry[1], seg.remote_offset, src, seg.local_offset, seg.nbytes))
        xfer_id = next(self._ids)
        self._xfers[xfer_id] = [self._pending_polls, target, copies, bytes(notif)]
        if self._pending_polls == 0:
            self._complete(self._xfers[xfer_id])
        return xfer_id

    def _complete(self, entry: list) -> None:
        _, target, copies, notif = entry
        for dst, doff, src, soff, n in copies:
            dst[doff:doff + n].copy_(src[soff:soff + n])
        with self._fabric.lock:
            target._inbox.append((self.name, notif))
        entry[:] = [0, None, None, None]

    def poll(self, xfer_id: int) -> XferState:
        try:
            entry = self._xfers[xfer_id]
        except KeyError:
            raise TransferError(f"unknown transfer id {xfer_id} on {self.name!r}") from None
        if entry[1] is None:
            return XferState.DONE
        if entry[0] > 0:
            entry[0] -= 1
            return XferState.PENDING
        self._complete(entry)
        return XferState.DONE

    def release(self, xfer_id: int) -> None:
        if self._xfers.pop(xfer_id, None) is None:
            raise TransferError(f"unknown transfer id {xfer_id} on {self.name!r}")

    def take_notifications(self) -> list[tuple[str, bytes]]:
        with self._fabric.lock:
            out, self._inbox = self._inbox, []
        return out

    def close(self) -> None:
        self._regions.clear()
        self._peers.clear()
        self._xfers.clear()
        with self._fabric.lock:
            if self._fabric.engines.get(self.name) is self:
                del self._fabric.engines[self.name]
