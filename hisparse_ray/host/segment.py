"""The host pool's shared-memory segment format and lifecycle helpers (adapter ring, standard
library + numpy): header layout, sizes, capacity checks, stale-segment cleanup, pre-faulting, and
the cudaHostRegister chunking plan. :mod:`hisparse_ray.host.pool` builds the pool on top of it.
"""

from __future__ import annotations

import enum
import mmap
import os
import struct
import time

import numpy as np

from hisparse_ray.config import GIB, KVLayout
from hisparse_ray.errors import HostPoolError

DEFAULT_PREFIX = "hisparse-pool"
SHM_DIR = "/dev/shm"
MAGIC = b"HSPRPOOL"
VERSION = 4  # 4: IPC event slots by step number (step % event_ring), recorded only by step
# publishes, and the recording mark at REC_OFFSET; 3: the step ring at STEP_OFFSET; 2: the
# counter at SEQ_OFFSET is the published generation (1 had a seqlock)
HEADER_BYTES = 4096
ALIGN = 4096
MAX_REGISTER_BYTES = 64 * GIB  # one cudaHostRegister call; a single 512 GiB call fails
MAX_POOL_FRACTION = 0.95  # of MemAvailable
STALE_GRACE_S = 60.0  # a segment without a readable header is stale only after this age

# magic, version, header_bytes, num_layers, page_size, row_bytes, row_bytes_given, num_blocks,
# layer_stride, total_bytes, owner_pid, owner_start, kv_dtype, state, event_ring
HEADER_STRUCT = struct.Struct("<8sIIIIIIQQQQQ8sII")
STATE_OFFSET = 80  # u32 state inside HEADER_STRUCT
SEQ_OFFSET = 128  # u64 published generation, on its own cache line
REC_OFFSET = 192  # u64 step + 1 whose IPC event rank 0 records last (stored before the record)
EVENT_OFFSET = 256  # event ring: slots of 128 bytes, [u32 length][handle bytes]
EVENT_SLOT = 128
STEP_OFFSET = 3584  # step ring: STEP_SLOTS slots of [u64 generation][u64 step + 1] (HostPool
STEP_SLOTS = 32  # .publish(step=...) / .wait_step), up to the end of the header
MAX_EVENT_RING = (STEP_OFFSET - EVENT_OFFSET) // EVENT_SLOT  # event slots that fit before it
# Event slots are indexed by step (HostPool.publish(stream, step=N) records slot N % event_ring)
# and a peer waits on step N's slot at its first command after N; rank 0 runs at most two steps
# ahead of any peer (step barrier, or lookahead's one step), so a ring of 3 is never re-recorded
# early and 4 keeps one step of margin (docs/architecture.md "How the ranks are ordered")
MIN_EVENT_RING = 4
CREATING, READY = 0, 1
REGISTER_FLAGS = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped (UVA device access)
_MADV_POPULATE_WRITE = 23
assert HEADER_STRUCT.size <= SEQ_OFFSET < REC_OFFSET < EVENT_OFFSET
assert STATE_OFFSET == HEADER_STRUCT.size - 8
assert STEP_OFFSET % 64 == 0 and STEP_OFFSET + 16 * STEP_SLOTS <= HEADER_BYTES


class HostSharing(enum.Enum):
    """How the TP ranks of one replica get host memory."""

    SHARED = "shared"  # rank 0 creates one segment, peers attach (MLA KV is replicated over TP)
    PRIVATE = "private"  # every rank creates its own pool (other executors / parallel layouts)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def layer_stride(layout: KVLayout, num_blocks: int) -> int:
    return _align(num_blocks * layout.page_bytes_per_layer)


def pool_bytes(layout: KVLayout, num_blocks: int) -> int:
    """Bytes of one segment: header page + every layer region (block stride alignment included)."""
    return HEADER_BYTES + layout.num_layers * layer_stride(layout, num_blocks)


def physical_pool_bytes(layout: KVLayout, num_blocks: int, tp_size: int, sharing: HostSharing) -> int:
    """Host bytes a replica of ``tp_size`` ranks uses: one segment shared, or one per rank."""
    return pool_bytes(layout, num_blocks) * (1 if sharing is HostSharing.SHARED else tp_size)


def mem_available_bytes() -> int:
    """``MemAvailable`` from /proc/meminfo (bytes)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise HostPoolError("MemAvailable not found in /proc/meminfo")


def fit_problem(nbytes: int, shm_dir: str = SHM_DIR) -> str | None:
    """Why ``nbytes`` of host pool cannot be made in ``shm_dir`` on this node now (more than 95 %
    of MemAvailable, or more than the directory's free space), or None when it fits: the rule
    ``HostPool.create`` enforces, for front doors to check before anything starts. OSError when
    ``shm_dir`` is not there."""
    st = os.statvfs(shm_dir)
    avail, free = mem_available_bytes(), st.f_bavail * st.f_frsize
    if nbytes > MAX_POOL_FRACTION * avail:
        return (f"exceeds {MAX_POOL_FRACTION:.0%} of available memory ({avail} bytes, "
                f"{avail / GIB:.2f} GiB)")
    if nbytes > free:
        return f"does not fit {shm_dir} ({free} bytes, {free / GIB:.2f} GiB free)"
    return None


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) of a live pid, None if it does not exist."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
        return rest[0], int(rest[19])
    except (OSError, IndexError, ValueError):
        return None


def pid_alive(pid: int, start: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    stat = proc_stat(pid)
    if stat is None:
        return True  # exists per kill(); /proc not readable: assume alive
    state, started = stat
    return state not in ("Z", "X") and (start == 0 or started == start)


def read_header(fd: int) -> tuple | None:
    raw = os.pread(fd, HEADER_STRUCT.size, 0)
    if len(raw) < HEADER_STRUCT.size or raw[:8] != MAGIC:
        return None
    return HEADER_STRUCT.unpack(raw)


def list_segments(prefix: str = DEFAULT_PREFIX, shm_dir: str = SHM_DIR) -> list[str]:
    """Names of the segments in ``shm_dir`` whose name starts with ``prefix + "."``."""
    try:
        return sorted(n for n in os.listdir(shm_dir) if n.startswith(prefix + "."))
    except FileNotFoundError:
        return []


def mapped_segments(pid: int | str = "self", prefix: str = DEFAULT_PREFIX,
                    shm_dir: str = SHM_DIR) -> dict[str, int]:
    """Segments of ``prefix`` in ``shm_dir`` that process ``pid`` maps, unlinked ones included
    (a replica's pool is unlinked once its ranks attached, so it is no longer listed in the
    directory): name -> bytes mapped, from ``/proc/<pid>/maps``. Empty if the process is gone."""
    head = os.path.join(shm_dir, prefix + ".")
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/maps") as f:
            lines = f.readlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) < 6 or not parts[5].startswith(head):
            continue
        path = parts[5].rstrip("\n").removesuffix(" (deleted)")
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        name = os.path.basename(path)
        out[name] = out.get(name, 0) + hi - lo
    return out


def cleanup_stale(prefix: str = DEFAULT_PREFIX, shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink segments of ``prefix`` whose owner process is dead (or, without a readable header,
    that are older than ``STALE_GRACE_S``). Returns the names removed. Live pools are untouched."""
    removed = []
    for name in list_segments(prefix, shm_dir):
        path = os.path.join(shm_dir, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            header = read_header(fd)
            age = time.time() - os.fstat(fd).st_mtime
        finally:
            os.close(fd)
        if header is None:
            stale = age > STALE_GRACE_S
        else:
            stale = not pid_alive(header[10], header[11])
        if stale:
            try:
                os.unlink(path)
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed


def unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def register_chunks(base: int, header: int, stride: int, layers: int) -> list[tuple[int, int]]:
    """(ptr, size) ranges covering the segment, each <= MAX_REGISTER_BYTES; a layer region is never
    split unless it alone exceeds the limit."""
    chunks: list[tuple[int, int]] = []
    start, end = base, base + header
    for _ in range(layers):
        if end - start + stride <= MAX_REGISTER_BYTES:
            end += stride
            continue
        if end > start:
            chunks.append((start, end - start))
        start, remaining = end, stride
        while remaining > MAX_REGISTER_BYTES:
            chunks.append((start, MAX_REGISTER_BYTES))
            start += MAX_REGISTER_BYTES
            remaining -= MAX_REGISTER_BYTES
        end = start + remaining
    if end > start:
        chunks.append((start, end - start))
    return chunks


def prefault(mm: mmap.mmap) -> None:
    """Fault every page in now (MADV_POPULATE_WRITE, else one write per page)."""
    try:
        mm.madvise(_MADV_POPULATE_WRITE)
    except (OSError, ValueError):
        arr = np.frombuffer(mm, dtype=np.uint8)
        arr[:: mmap.PAGESIZE] = 0
        del arr
