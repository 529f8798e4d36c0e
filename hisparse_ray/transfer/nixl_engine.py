"""NIXL 1.5.1 transfer engine: one NIXL agent per process, WRITEs with notifications (adapter ring).

NIXL's "ERR" states and binding exceptions become ``TransferError`` here; nothing above this module
sees a NIXL type. Facts this adapter relies on (measured, NIXL 1.5.1 + UCX): CPU memory between
processes works with no settings; if ``UCX_TLS`` is set it must include ``tcp``; a peer's metadata
must be taken after it registered its regions; GPU -> another process's pinned host is emulated
over TCP (~0.5 GB/s on an H200 node) while GPU -> GPU uses CUDA IPC.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
import uuid
from typing import Any, Sequence

import numpy as np

from hisparse_ray.errors import TransferError
from hisparse_ray.transfer.base import PreparedWrite, WriteSegment, XferState, coalesce, registered
from hisparse_ray.types import MemKind, RegionDesc


def _default_name() -> str:
    return f"hsr-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _check_ucx_tls() -> None:
    tls = (os.environ.get("UCX_TLS") or "").strip()
    if not tls or tls == "all":
        return
    names = tls[1:].split(",") if tls.startswith("^") else tls.split(",")
    if tls.startswith("^") == ("tcp" in names):
        raise TransferError(f"UCX_TLS={tls!r} must include 'tcp' (NIXL needs it for its wire-up)")


class NixlTransferEngine:
    """``TransferEngine`` over one NIXL agent (UCX backend by default).

    Lifecycle: ``register`` regions -> ``agent_metadata()`` to peers -> ``add_peer`` theirs ->
    ``post_write`` / ``poll`` / ``release`` -> ``close()`` (releases handles, deregisters, drops
    peers; idempotent). Registered tensors are kept referenced until deregistered, so their memory
    cannot be freed under a peer's WRITE. All agent calls hold one lock (NIXL's agent runs in
    no-sync mode without a listener thread).

    ``device_to_remote_host_native``: whether a DEVICE source can WRITE a peer's HOST region at
    native speed. False by default: on one node UCX emulates it over TCP, so the landing path
    stages on the GPU and copies locally. HOST sources always write host directly.
    """

    def __init__(self, name: str | None = None, *, backends: Sequence[str] = ("UCX",),
                 device_to_remote_host_native: bool = False) -> None:
        _check_ucx_tls()
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as err:  # pragma: no cover - nixl is a hard dependency
            raise TransferError(f"NIXL is not importable: {err}") from err
        self.name = name or _default_name()
        self._device_to_remote_host_native = device_to_remote_host_native
        self._lock = threading.Lock()
        try:
            self._agent = nixl_agent(self.name, nixl_agent_config(backends=list(backends)))
        except Exception as err:
            raise TransferError(f"cannot create NIXL agent {self.name!r}: {err!r}") from err
        missing = [b for b in backends if b not in self._agent.backends]
        if missing:
            raise TransferError(f"NIXL backends {missing} unavailable on agent {self.name!r}")
        self._regions: dict[str, tuple[RegionDesc, Any, Any]] = {}  # name -> (desc, reg, tensor)
        self._peers: set[str] = set()
        self._xfers: dict[int, Any] = {}
        self._ids = itertools.count(1)
        self._closed = False

    # -- regions ---------------------------------------------------------------------------

    def register(self, name: str, tensor: Any) -> RegionDesc:
        """Register a contiguous torch tensor (CPU or CUDA) under ``name``; returns its descriptor."""
        if name in self._regions:
            raise TransferError(f"region {name!r} already registered on {self.name!r}")
        if not tensor.is_contiguous():
            raise TransferError(f"region {name!r}: tensor must be contiguous")
        kind = MemKind.DEVICE if tensor.is_cuda else MemKind.HOST
        desc = RegionDesc(self.name, name, int(tensor.data_ptr()),
                          int(tensor.numel() * tensor.element_size()),
                          int(tensor.get_device()) if tensor.is_cuda else 0, kind)
        if desc.nbytes == 0:
            raise TransferError(f"region {name!r} is empty")
        with self._lock:
            try:
                reg = self._agent.register_memory(
                    [(desc.addr, desc.nbytes, desc.device_id, "")], kind.value)
            except Exception as err:
                raise TransferError(f"register {name!r} failed: {err!r}") from err
            self._regions[name] = (desc, reg, tensor)
        return desc

    def deregister(self, name: str) -> None:
        with self._lock:
            entry = registered(self._regions, name, self.name, pop=True)
            try:
                self._agent.deregister_memory(entry[1])
            except Exception as err:
                raise TransferError(f"deregister {name!r} failed: {err!r}") from err

    def region(self, name: str) -> RegionDesc:
        return registered(self._regions, name, self.name)[0]

    # -- peers -----------------------------------------------------------------------------

    def agent_metadata(self) -> bytes:
        """This agent's metadata; take it after registering (it lists the registered regions)."""
        with self._lock:
            return bytes(self._agent.get_agent_metadata())

    def add_peer(self, metadata: bytes) -> str:
        """Load (or refresh) a peer's metadata; returns the peer's agent name.

        Loading metadata of a known peer again does not drop regions it has since deregistered,
        so a refresh invalidates the old entry and loads the new metadata from scratch.
        """
        with self._lock:
            try:
                peer = self._load_peer(metadata)
                if peer in self._peers:
                    self._agent.remove_remote_agent(peer)
                    peer = self._load_peer(metadata)
            except Exception as err:
                raise TransferError(f"cannot load peer metadata: {err!r}") from err
            self._peers.add(peer)
        return peer

    def _load_peer(self, metadata: bytes) -> str:
        peer = self._agent.add_remote_agent(metadata)
        return peer.decode() if isinstance(peer, bytes) else str(peer)

    def remove_peer(self, peer: str) -> None:
        with self._lock:
            if peer not in self._peers:
                raise TransferError(f"unknown peer {peer!r}")
            self._peers.discard(peer)
            try:
                self._agent.remove_remote_agent(peer)
            except Exception as err:
                raise TransferError(f"remove peer {peer!r} failed: {err!r}") from err

    def supports_direct_host_write(self, peer: str, source: MemKind = MemKind.DEVICE) -> bool:
        """Whether a ``source`` region here can WRITE ``peer``'s HOST regions at native speed
        (else: land in the peer's GPU staging and let it copy locally)."""
        if peer not in self._peers:
            raise TransferError(f"unknown peer {peer!r}")
        return source is MemKind.HOST or self._device_to_remote_host_native

    # -- transfers -------------------------------------------------------------------------

    def post_write(self, segments: Sequence[WriteSegment], notif: bytes = b"") -> int:
        """Post one WRITE of all ``segments`` (one peer, one local kind, one remote kind);
        ``notif`` reaches the peer once the whole WRITE has landed. Contiguous runs are merged
        into one descriptor (``coalesce``). Returns a transfer id."""
        return self.post_prepared(self.prepare_write(segments, notif))

    def prepare_write(self, segments: Sequence[WriteSegment], notif: bytes = b"") -> PreparedWrite:
        """Build the WRITE's descriptor lists and NIXL transfer handle without posting it (the
        bytes are read only when posted). ``post_prepared`` posts it, ``discard_prepared``
        releases it."""
        local_arr, remote_arr, peer, lkind, rkind = self._descs(segments)
        with self._lock:
            if self._closed:
                raise TransferError(f"engine {self.name!r} is closed")
            try:
                ldesc = self._agent.get_xfer_descs(local_arr, lkind.value)
                rdesc = self._agent.get_xfer_descs(remote_arr, rkind.value)
                handle = self._agent.initialize_xfer("WRITE", ldesc, rdesc, peer, notif)
            except Exception as err:
                raise TransferError(f"WRITE to {peer!r} rejected: {err!r}") from err
        return PreparedWrite(segments, notif, handle)

    def post_prepared(self, prepared: PreparedWrite) -> int:
        """Post a prepared WRITE (the handle is consumed: released here if the post fails)."""
        handle, prepared.handle = prepared.handle, None
        if handle is None:
            raise TransferError("prepared WRITE already posted or discarded")
        with self._lock:
            if self._closed:
                raise TransferError(f"engine {self.name!r} is closed")
            try:
                state = self._agent.transfer(handle, prepared.notif)
            except Exception as err:
                state = f"ERR ({err!r})"
            if state.startswith("ERR"):
                self._release_handle(handle)
                raise TransferError(f"WRITE to {prepared.segments[0].remote.agent!r} failed to "
                                    f"post: {state}")
            xfer_id = next(self._ids)
            self._xfers[xfer_id] = handle
        return xfer_id

    def discard_prepared(self, prepared: PreparedWrite) -> None:
        handle, prepared.handle = prepared.handle, None
        if handle is not None:
            with self._lock:
                if not self._closed:
                    self._release_handle(handle)

    def _descs(self, segments: Sequence[WriteSegment]):
        if not segments:
            raise TransferError("a WRITE needs at least one segment")
        for seg in segments:  # check before merging: errors name the caller's own segments
            self.region(seg.local).check_span(seg.local_offset, seg.nbytes)
            seg.remote.check_span(seg.remote_offset, seg.nbytes)
        segments = coalesce(segments)
        peer = segments[0].remote.agent
        if peer not in self._peers:
            raise TransferError(f"unknown peer {peer!r} (add_peer its metadata first)")
        n = len(segments)
        local_arr = np.empty((n, 3), dtype=np.uint64)
        remote_arr = np.empty((n, 3), dtype=np.uint64)
        lkinds, rkinds = set(), set()
        for i, seg in enumerate(segments):
            if seg.remote.agent != peer:
                raise TransferError(f"one WRITE targets one peer: {peer!r} and {seg.remote.agent!r}")
            local = self.region(seg.local)
            local.check_span(seg.local_offset, seg.nbytes)
            seg.remote.check_span(seg.remote_offset, seg.nbytes)
            local_arr[i] = (local.addr + seg.local_offset, seg.nbytes, local.device_id)
            remote_arr[i] = (seg.remote.addr + seg.remote_offset, seg.nbytes, seg.remote.device_id)
            lkinds.add(local.kind)
            rkinds.add(seg.remote.kind)
        if len(lkinds) != 1 or len(rkinds) != 1:
            raise TransferError("one WRITE moves one memory kind per side; split the segments")
        return local_arr, remote_arr, peer, lkinds.pop(), rkinds.pop()

    def poll(self, xfer_id: int) -> XferState:
        with self._lock:
            handle = self._handle(xfer_id)
            try:
                state = self._agent.check_xfer_state(handle)
            except Exception as err:
                state = f"ERR ({err!r})"
        if state == "DONE":
            return XferState.DONE
        if state == "PROC":
            return XferState.PENDING
        raise TransferError(f"transfer {xfer_id} failed: {state}")

    def release(self, xfer_id: int) -> None:
        """Free a transfer id; an active transfer is cancelled (``TransferError`` if it cannot be:
        the id then stays live, so a later ``release`` or ``close`` frees its handle)."""
        with self._lock:
            handle = self._handle(xfer_id)
            self._release_handle(handle, raise_=True)
            del self._xfers[xfer_id]

    def _handle(self, xfer_id: int) -> Any:
        try:
            return self._xfers[xfer_id]
        except KeyError:
            raise TransferError(f"unknown transfer id {xfer_id} on {self.name!r}") from None

    def _release_handle(self, handle: Any, raise_: bool = False) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as err:
            if raise_:
                raise TransferError(f"cannot release transfer: {err!r}") from err

    def take_notifications(self) -> list[tuple[str, bytes]]:
        """Drain notifications received since the last call, as ``(sender agent, message)``."""
        with self._lock:
            try:
                notifs = self._agent.get_new_notifs()
            except Exception as err:
                raise TransferError(f"reading notifications failed: {err!r}") from err
        out: list[tuple[str, bytes]] = []
        for sender, msgs in notifs.items():
            sender = sender.decode() if isinstance(sender, bytes) else str(sender)
            out.extend((sender, bytes(m)) for m in msgs)
        return out

    def close(self) -> None:
        """Release every transfer, deregister every region, drop every peer (best effort)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for handle in self._xfers.values():
                self._release_handle(handle)
            self._xfers.clear()
            for _, reg, _ in self._regions.values():
                try:
                    self._agent.deregister_memory(reg)
                except Exception:
                    pass
            self._regions.clear()
            for peer in self._peers:
                try:
                    self._agent.remove_remote_agent(peer)
                except Exception:
                    pass
            self._peers.clear()
