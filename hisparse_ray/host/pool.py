"""The pinned host pool (adapter ring): one named ``/dev/shm`` segment per decode replica, created by
TP rank 0 and mapped by its peers, registered with ``cudaHostRegister`` on GPU machines.

Segment layout: a 4 KiB header page, then for layer l in range(num_layers) a region of
``layer_stride`` bytes (``num_blocks * page_size * row_bytes`` rounded up to 4 KiB) whose first
``num_blocks * page_size`` rows of ``row_bytes`` form the layer view. Host block b holds rows
``[b * page_size, (b + 1) * page_size)`` of every layer.
"""

from __future__ import annotations

import mmap
import os
import secrets
import struct
import weakref
from typing import Any

import numpy as np
import torch

from hisparse_ray.config import GIB, KVLayout
from hisparse_ray.errors import HostPoolError
from hisparse_ray.host.segment import (  # noqa: F401  (re-exported: the pool's public surface)
    CREATING, DEFAULT_PREFIX, EVENT_OFFSET, EVENT_SLOT, HEADER_BYTES, HEADER_STRUCT, MAGIC,
    MAX_EVENT_RING, MAX_POOL_FRACTION, MAX_REGISTER_BYTES, MIN_EVENT_RING, READY, REC_OFFSET,
    REGISTER_FLAGS, SEQ_OFFSET, SHM_DIR, STATE_OFFSET, STEP_OFFSET, STEP_SLOTS, VERSION,
    HostSharing, cleanup_stale, fit_problem, layer_stride, list_segments,
    mapped_segments, mem_available_bytes, physical_pool_bytes, pool_bytes, prefault, proc_stat,
    read_header, register_chunks, unlink_quiet,
)
from hisparse_ray.host.sync import IpcEventRing, SharedCounter, StepRing, event_slot, spin_until


def _cudart() -> Any:
    return torch.cuda.cudart()


class _CudaArray:
    """Minimal ``__cuda_array_interface__`` so torch can alias registered host memory via UVA."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3, "strides": None,
        }


class HostPool:
    """A mapped host pool segment; build it with :meth:`create` (rank 0) or :meth:`attach` (peers).

    Lifecycle: created (owner: header CREATING -> READY, pre-faulted, registered) -> mapped by peers
    -> owner ``unlink()`` (the name leaves the directory; the mappings keep the memory) -> peers
    ``close()`` -> owner ``destroy()`` (unregister + unlink if not done). Unlinking as soon as
    every peer attached is what a replica does (``actors/launch.py``): from then on no exit path,
    SIGKILL of every rank included, can leave the segment behind, since the kernel frees an
    unlinked tmpfs file with its last mapping. Until then a crash leaves a segment that the next
    ``create`` of the same prefix removes (its owner pid is dead). Views handed out by
    :meth:`layer` keep the mapping alive after close (plain, unpinned memory then); CUDA aliases
    from :meth:`device_layer` / :meth:`device_stacked` are valid only until close.

    Write/publish protocol (rank 0 is the only writer): every batch of writes is published as
    the pool's next generation g (the header counter, release). Two kinds:

    - ``publish(stream, step=N)``: rank 0's writes of step N enqueued on its copy stream (spills,
      backups). On CUDA pools it first records the IPC event of slot ``N % event_ring``
      (:func:`~hisparse_ray.host.sync.event_slot`) on ``stream``, then bumps the counter, then
      names g as step N's in the header's step ring (``STEP_SLOTS`` slots). A peer orders its
      GPU reads after them with ``wait_step(N)``: a host spin until the step ring names step N,
      then its stream waits on step N's event. Every step publish comes from rank 0's one copy
      stream, so step N's event also covers every earlier step's copies.
    - ``publish()``: writes already complete in host memory when it is called (CPU stores,
      landings' synchronous staging copies): the counter only, no event (none is needed: no GPU
      work of rank 0 is pending on those bytes). A peer's ``wait_published(g)`` orders its host
      side after them (acquire).

    A GPU stream never waits on a slot chosen by generation: landing publishes between two steps
    would move the slot a peer needs to a later step's record (a deadlock at TP > 1, see
    docs/architecture.md "How the ranks are ordered").
    """

    def __init__(self, *, name: str, path: str, mm: mmap.mmap, header: tuple, owner: bool,
                 register_cuda: bool, event_ring: int) -> None:
        (_, _, _, num_layers, page_size, row_bytes, row_given, num_blocks, stride, total, _, _,
         kv_dtype, _, _) = header
        self.name, self.path, self.is_owner = name, path, owner
        self.unlinked = False  # the owner removed the name (``unlink``); the memory lives on
        self.layout = KVLayout(num_layers=num_layers, kv_dtype=kv_dtype.rstrip(b"\0").decode(),
                               page_size=page_size, row_bytes=row_bytes if row_given else None)
        self.num_blocks, self.layer_stride, self.nbytes = num_blocks, stride, total
        self.rows = num_blocks * page_size
        self._mm: mmap.mmap | None = mm
        self._arr = np.frombuffer(mm, dtype=np.uint8)  # holds the buffer export (mm stays mapped)
        self._base = self._arr.ctypes.data
        self._counter: SharedCounter | None = SharedCounter(self._base + SEQ_OFFSET)
        self._steps: StepRing | None = StepRing(self._base + STEP_OFFSET, STEP_SLOTS)
        self._recording: SharedCounter | None = SharedCounter(self._base + REC_OFFSET)
        self._stacked = self._stack(torch.from_numpy(self._arr))
        self._views = list(self._stacked.unbind(0))
        self._registered: list[int] = []
        self._device_stacked: Any = None  # None: not built yet, False: torch refused the alias
        self._ring: IpcEventRing | None = None
        self._finalizer = weakref.finalize(self, unlink_quiet, path) if owner else None
        if register_cuda:
            self._register()
            try:
                if event_ring:
                    self._ring = IpcEventRing(event_ring, owner=owner)
                    if owner:
                        for slot in range(event_ring):
                            h = self._ring.handle(slot)
                            off = EVENT_OFFSET + slot * EVENT_SLOT
                            struct.pack_into(f"<I{len(h)}s", mm, off, len(h), h)
            except BaseException:
                self._unregister()
                raise

    # ---------------------------------------------------------------- construction
    @classmethod
    def create(cls, replica_id: str, layout: KVLayout, num_blocks: int,
               register_cuda: bool | None = None, *, prefix: str = DEFAULT_PREFIX,
               shm_dir: str = SHM_DIR, event_ring: int = 8) -> "HostPool":
        """Rank 0: create, pre-fault and (on GPU machines) register a new segment named
        ``{prefix}.{replica_id}.{random}``. Stale segments of ``prefix`` are removed first.
        register_cuda: None = register iff CUDA is available. Raises HostPoolError if the pool
        exceeds 95 % of MemAvailable or the free space of ``shm_dir``."""
        if not replica_id or "/" in replica_id or "\0" in replica_id:
            raise HostPoolError(f"replica id {replica_id!r} cannot be part of a segment name")
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise HostPoolError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        if event_ring and not MIN_EVENT_RING <= event_ring <= MAX_EVENT_RING:
            raise HostPoolError(
                f"event_ring {event_ring} out of range: 0 (no events) or {MIN_EVENT_RING}.."
                f"{MAX_EVENT_RING} (event slots are indexed by step and rank 0 runs up to two "
                f"steps ahead of a peer: a smaller ring could be re-recorded before a peer "
                f"waited on it)")
        register = torch.cuda.is_available() if register_cuda is None else bool(register_cuda)
        cleanup_stale(prefix, shm_dir)
        stride, total = layer_stride(layout, num_blocks), pool_bytes(layout, num_blocks)
        try:
            why = fit_problem(total, shm_dir)
        except OSError as e:
            raise HostPoolError(f"cannot use {shm_dir} for a host pool: {e}") from None
        if why:
            raise HostPoolError(f"host pool of {total} bytes ({total / GIB:.2f} GiB) {why}")
        name = f"{prefix}.{replica_id}.{secrets.token_hex(4)}"
        path = os.path.join(shm_dir, name)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError as e:
            raise HostPoolError(f"cannot create host pool segment {path}: {e}") from None
        mm = None
        try:
            stat = proc_stat(os.getpid())
            header = (MAGIC, VERSION, HEADER_BYTES, layout.num_layers, layout.page_size,
                      layout.bytes_per_token_layer, int(layout.row_bytes is not None), num_blocks,
                      stride, total, os.getpid(), stat[1] if stat else 0,
                      layout.kv_dtype.encode(), CREATING, event_ring if register else 0)
            os.pwrite(fd, HEADER_STRUCT.pack(*header), 0)  # owner pid first: a crash from here is stale
            os.ftruncate(fd, total)
            try:
                os.posix_fallocate(fd, 0, total)
            except OSError as e:
                raise HostPoolError(f"cannot allocate {total} bytes for {path}: {e}") from None
            mm = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            prefault(mm)
            pool = cls(name=name, path=path, mm=mm, header=header, owner=True,
                       register_cuda=register, event_ring=event_ring)
            struct.pack_into("<I", mm, STATE_OFFSET, READY)
            return pool
        except BaseException:
            if mm is not None:
                try:
                    mm.close()
                except BufferError:
                    pass
            unlink_quiet(path)
            raise
        finally:
            os.close(fd)

    @classmethod
    def create_for_capacity(cls, replica_id: str, layout: KVLayout, host_pool_gib: float,
                            register_cuda: bool | None = None, **kwargs: Any) -> "HostPool":
        """Rank 0: a pool of ``host_pool_gib`` usable capacity rounded down to whole host blocks
        (:meth:`KVLayout.host_blocks`; ``HiSparseConfig.host_pool_gib``)."""
        num_blocks = layout.host_blocks(host_pool_gib)
        if num_blocks < 1:
            raise HostPoolError(f"host_pool_gib={host_pool_gib} holds no whole host block "
                                f"({layout.block_bytes} bytes each)")
        return cls.create(replica_id, layout, num_blocks, register_cuda, **kwargs)

    @classmethod
    def attach(cls, name: str, register_cuda: bool | None = None, *, shm_dir: str = SHM_DIR,
               timeout_s: float = 30.0) -> "HostPool":
        """A peer rank: map an existing segment (waits for the owner to mark it READY)."""
        if "/" in name:
            raise HostPoolError(f"segment name {name!r} must not contain '/'")
        register = torch.cuda.is_available() if register_cuda is None else bool(register_cuda)
        path = os.path.join(shm_dir, name)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as e:
            raise HostPoolError(f"cannot open host pool segment {path}: {e}") from None
        try:
            header = read_header(fd)
            if header is None or header[1] != VERSION:
                raise HostPoolError(f"{path} is not a version {VERSION} host pool segment")
            total = header[9]
            mm = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        try:
            spin_until(lambda: struct.unpack_from("<I", mm, STATE_OFFSET)[0] == READY,
                       timeout_s, f"host pool {name} to become ready")
            header = HEADER_STRUCT.unpack_from(mm, 0)
            return cls(name=name, path=path, mm=mm, header=header, owner=False,
                       register_cuda=register, event_ring=header[14])
        except BaseException:
            try:
                mm.close()
            except BufferError:
                pass
            raise

    # ---------------------------------------------------------------- views
    def layer(self, l: int) -> torch.Tensor:
        """Layer ``l``'s host view: [num_blocks * page_size, row_bytes] uint8 on the shared mapping
        (pinned where registered)."""
        self._check_open()
        return self._views[l]

    def block_rows(self, block: int) -> slice:
        """Rows of host block ``block`` in every layer view."""
        if not 0 <= block < self.num_blocks:
            raise HostPoolError(f"host block {block} out of range 0..{self.num_blocks - 1}")
        p = self.layout.page_size
        return slice(block * p, (block + 1) * p)

    def block(self, l: int, block: int) -> torch.Tensor:
        """One page: [page_size, row_bytes] uint8 view of host block ``block`` in layer ``l``."""
        return self.layer(l)[self.block_rows(block)]

    @property
    def registered(self) -> bool:
        return bool(self._registered)

    @property
    def closed(self) -> bool:
        return self._mm is None

    def stacked(self) -> torch.Tensor:
        """All layers as one strided view [num_layers, rows, row_bytes] uint8 (layer stride
        ``layer_stride`` bytes): lets one gather/scatter cover every layer."""
        self._check_open()
        return self._stacked

    def device_layer(self, l: int) -> torch.Tensor | None:
        """A CUDA tensor aliasing layer ``l`` through UVA (GPU kernels read/write host memory over
        PCIe), or None when the pool is not registered or torch refuses the alias."""
        stacked = self.device_stacked()
        return None if stacked is None else stacked[l]

    def device_stacked(self) -> torch.Tensor | None:
        """The CUDA (UVA) alias of :meth:`stacked`, or None (see :meth:`device_layer`)."""
        self._check_open()
        if not self._registered:
            return None
        if self._device_stacked is None:
            try:
                whole = torch.as_tensor(_CudaArray(self._base, self.nbytes), device="cuda")
                self._device_stacked = self._stack(whole)
            except (RuntimeError, TypeError, ValueError):
                self._device_stacked = False
        return self._device_stacked if self._device_stacked is not False else None

    def _stack(self, whole: torch.Tensor) -> torch.Tensor:
        rb = self.layout.bytes_per_token_layer
        return whole.as_strided((self.layout.num_layers, self.rows, rb), (self.layer_stride, rb, 1),
                                HEADER_BYTES)

    # ---------------------------------------------------------------- publish protocol
    def publish(self, stream: Any = None, *, step: int | None = None) -> int:
        """Owner, after a batch of writes; returns the new generation (1, 2, ...).

        With ``step`` (rank 0's writes of that step, enqueued on ``stream``, default the current
        one): on CUDA pools record step ``step``'s IPC event (:meth:`event_slot`) on ``stream``,
        then bump the generation counter (release), then name the generation as the step's in
        the step ring (:meth:`wait_step`). Without: bump the counter only, no event: for writes
        already in host memory (CPU stores, landings' synchronous copies); ``stream`` is then
        refused (``HostPoolError``): GPU writes are published by step."""
        self._check_owner("publish")
        if step is None and stream is not None:
            raise HostPoolError("publish(stream) needs step=: copies enqueued on a stream are "
                                "published as a step's (their IPC event slot is the step's)")
        seq = self._counter.load() + 1
        if step is not None and self._ring is not None:
            self._recording.store(step + 1)  # before the record: a peer can tell it was reused
            self._ring.record(event_slot(step, self._ring.size), stream)
        self._counter.store(seq)
        if step is not None:
            self._steps.store(step, seq)
        return seq

    def event_slot(self, step: int) -> int | None:
        """The IPC event slot step ``step``'s publish records and :meth:`wait_step` waits on, None
        on a pool without events (CPU)."""
        return None if self._ring is None else event_slot(step, self._ring.size)

    def step_generation(self, step: int) -> int | None:
        """The generation the owner published for ``step`` (``publish(step=...)``), None while it
        has not; ``HostPoolError`` when the owner already ran ``STEP_SLOTS`` steps past it."""
        self._check_open()
        return self._steps.load(step)

    def wait_step(self, step: int, *, stream: Any = None, timeout_s: float | None = None) -> int:
        """Peer: block until the owner published ``step``'s host writes (``HostPoolError``
        naming the step after ``timeout_s``); on CUDA pools then make ``stream`` (default:
        current) wait on step ``step``'s IPC event, so the GPU work enqueued on it afterwards
        sees every write rank 0 enqueued in that step and before. Returns the step's generation.

        Call it at the first command after ``step``: rank 0 re-records the slot at step
        ``step + event_ring`` at the earliest, which it cannot reach before this peer reported
        ``step + event_ring - 2``. A slot found re-recorded already (rank 0 too far ahead) is a
        ``HostPoolError`` naming both steps, not a wait on the later step."""
        self._check_open()
        steps = self._steps
        found: list[int] = []

        def stored() -> bool:
            g = steps.load(step)
            if g is not None:
                found.append(g)
            return g is not None

        if not stored():
            spin_until(stored, timeout_s, f"rank 0 to publish the host writes of step {step} "
                                          f"({self.name})")
        if self._ring is not None:
            slot = event_slot(step, self._ring.size)
            self._ring.wait(slot, self._event_handle(slot), stream)
            last = self._recording.load() - 1
            if last >= step + self._ring.size:
                raise HostPoolError(
                    f"event slot {slot} of step {step} may hold step {last}'s record: rank 0 ran "
                    f"{last - step} steps ahead of this peer (event_ring {self._ring.size}) in "
                    f"host pool {self.name}")
        return found[0]

    def published(self) -> int:
        """The latest published generation (0 before the first publish)."""
        self._check_open()
        return self._counter.load()

    def wait_published(self, seq: int, *, timeout_s: float | None = None) -> None:
        """Block until generation ``seq`` is published (``HostPoolError`` after ``timeout_s``):
        host-side ordering only (acquire: the CPU stores before that publish are visible to this
        thread, and to the GPU work it enqueues later). It waits on no event: GPU writes of a
        step are ordered by :meth:`wait_step`."""
        self._check_open()
        counter = self._counter
        if counter.load() < seq:
            spin_until(lambda: counter.load() >= seq, timeout_s, f"{self.name} generation {seq}")

    def _event_handle(self, slot: int) -> bytes:
        off = EVENT_OFFSET + slot * EVENT_SLOT
        (n,) = struct.unpack_from("<I", self._mm, off)
        return bytes(self._mm[off + 4: off + 4 + n])

    # ---------------------------------------------------------------- teardown
    def close(self) -> None:
        """Unmap this process's view (unregistering it first). Idempotent. No GPU work may still
        use the pool's memory. Views held elsewhere keep the mapping alive until they die."""
        if self._mm is None:
            return
        if self._ring is not None:
            self._ring.close()
            self._ring = None
        self._device_stacked = None
        self._unregister()
        self._counter = self._steps = self._recording = None
        self._views = []
        self._stacked = None
        self._arr = None
        mm, self._mm = self._mm, None
        try:
            mm.close()
        except BufferError:
            pass  # caller-held views still export the buffer; unmapped when they are freed

    def unlink(self) -> None:
        """Owner: remove the segment's name from its directory, once every peer that will ever
        ``attach`` has (attaching needs the name). The memory stays mapped and shared by every
        process that mapped it and goes back to the kernel with the last mapping, however the
        processes end. Idempotent; the pool keeps working; ``destroy`` still closes it."""
        self._check_owner("unlink")
        unlink_quiet(self.path)
        self.unlinked = True

    def destroy(self) -> None:
        """Owner: close and unlink the segment (peers' mappings stay valid until they close)."""
        self._check_owner("destroy")
        self.close()
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> "HostPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.destroy() if self.is_owner else self.close()

    def __repr__(self) -> str:
        role = "owner" if self.is_owner else "peer"
        return (f"HostPool({self.name!r}, {role}, blocks={self.num_blocks}, "
                f"layers={self.layout.num_layers}, bytes={self.nbytes}, registered={self.registered})")

    # ---------------------------------------------------------------- internals
    def _check_open(self) -> None:
        if self._mm is None:
            raise HostPoolError(f"host pool {self.name} is closed")

    def _check_owner(self, what: str) -> None:
        if what != "destroy":
            self._check_open()
        if not self.is_owner:
            raise HostPoolError(f"{what} is for the owner (rank 0) of host pool {self.name}")

    def _register(self) -> None:
        """cudaHostRegister in chunks of <= 64 GiB, cut at layer boundaries where possible."""
        cudart = _cudart()
        for ptr, size in register_chunks(self._base, HEADER_BYTES, self.layer_stride,
                                          self.layout.num_layers):
            rc = cudart.cudaHostRegister(ptr, size, REGISTER_FLAGS)
            if rc != cudart.cudaError.success:
                self._unregister()
                why = cudart.cudaGetErrorString(rc)
                raise HostPoolError(f"cudaHostRegister({ptr:#x}, {size} bytes) of host pool "
                                    f"{self.name} failed: {why}")
            self._registered.append(ptr)

    def _unregister(self) -> None:
        if not self._registered:
            return
        cudart = _cudart()
        torch.cuda.synchronize()
        for ptr in self._registered:
            cudart.cudaHostUnregister(ptr)
        self._registered = []
