"""NIXL test peers: one engine per process (a Ray actor class body and a spawned-process body)."""

from __future__ import annotations

import random
import time

import torch

from hisparse_ray.transfer import NixlTransferEngine, WriteSegment, wait


def pattern(nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def random_pages(seed: int, n: int, region_bytes: int, page: int) -> list[tuple[int, int, int]]:
    """``n`` (local_offset, remote_offset, nbytes) with distinct remote pages, random lengths."""
    rng = random.Random(seed)
    remote_pages = rng.sample(range(region_bytes // page), n)
    out = []
    for rp in remote_pages:
        nbytes = rng.randint(1, page)
        out.append((rng.randrange(region_bytes - nbytes + 1), rp * page, nbytes))
    return out


def expected_after(writes, src: torch.Tensor, dst_nbytes: int) -> torch.Tensor:
    dst = torch.zeros(dst_nbytes, dtype=torch.uint8)
    for lo, ro, n in writes:
        dst[ro:ro + n] = src[lo:lo + n]
    return dst


class NixlPeer:
    """Owns one engine and one CPU region; every method is a plain call (made remote by tests)."""

    def __init__(self, name: str):
        self.engine = NixlTransferEngine(name)
        self.tensor = None

    def setup(self, nbytes: int, seed: int | None, names: tuple[str, ...] = ("kv",),
              device: str = "cpu"):
        """Register one region per name (the first holds ``pattern(seed)`` or zeros, the rest
        zeros) on ``device`` ("cpu": pinned when CUDA exists); returns (metadata taken after
        registering, descriptors)."""
        def alloc(t: torch.Tensor) -> torch.Tensor:
            if device == "cuda":
                return t.cuda()
            return t.pin_memory() if torch.cuda.is_available() else t

        self.tensor = alloc(pattern(nbytes, seed) if seed is not None else torch.zeros(
            nbytes, dtype=torch.uint8))
        self.extra = [alloc(torch.zeros(nbytes, dtype=torch.uint8)) for _ in names[1:]]
        descs = [self.engine.register(n, t) for n, t in zip(names, [self.tensor, *self.extra])]
        return self.engine.agent_metadata(), descs

    def ping(self) -> bool:
        return True

    def pid(self) -> int:
        import os

        return os.getpid()

    def write_until_error(self, remote, attempts: int, timeout_s: float) -> tuple[int, str]:
        """Write one MiB repeatedly until it raises; returns (writes that succeeded, error type).
        A peer's death reaches NIXL asynchronously, so the first write after it may land."""
        from hisparse_ray.errors import TransferError

        for i in range(attempts):
            try:
                self.write_one(remote, 0, 0, 1 << 20, timeout_s)
            except TransferError as err:
                return i, type(err).__name__
            time.sleep(0.05)
        return attempts, ""

    def add_peer(self, metadata: bytes) -> str:
        return self.engine.add_peer(metadata)

    def write(self, remote, writes, notif_prefix: bytes, per_post: int, timeout_s: float = 10.0):
        """Post ``writes`` in groups of ``per_post`` segments, each group with one notification;
        waits for all; returns the notifications sent."""
        notifs, live = [], []
        for g in range(0, len(writes), per_post):
            segs = [WriteSegment("kv", lo, n, remote, ro) for lo, ro, n in writes[g:g + per_post]]
            msg = notif_prefix + str(g).encode()
            live.append(self.engine.post_write(segs, msg))
            notifs.append(msg)
        for xfer_id in live:
            wait(self.engine, xfer_id, timeout_s)
            self.engine.release(xfer_id)
        return notifs

    def write_one(self, remote, lo: int, ro: int, n: int, timeout_s: float = 5.0) -> None:
        xfer_id = self.engine.post_write([WriteSegment("kv", lo, n, remote, ro)], b"one")
        try:
            wait(self.engine, xfer_id, timeout_s)
        finally:
            self.engine.release(xfer_id)

    def collect(self, count: int, timeout_s: float = 10.0):
        got: list[tuple[str, bytes]] = []
        deadline = time.monotonic() + timeout_s
        while len(got) < count and time.monotonic() < deadline:
            got.extend(self.engine.take_notifications())
            time.sleep(1e-3)
        return got, self.tensor.cpu().numpy().tobytes()

    def deregister_and_metadata(self, name: str = "kv") -> bytes:
        self.engine.deregister(name)
        return self.engine.agent_metadata()

    def supports_direct_host_write(self, peer: str) -> tuple[bool, bool]:
        from hisparse_ray.transfer import MemKind

        return (self.engine.supports_direct_host_write(peer, MemKind.HOST),
                self.engine.supports_direct_host_write(peer, MemKind.DEVICE))

    def close(self) -> None:
        self.engine.close()


def spawned_target(md_queue, result_queue, nbytes: int, count: int) -> None:
    """Spawned-process body: register a zeroed region, publish metadata, wait for ``count``
    notifications, send the region's bytes back."""
    peer = NixlPeer("spawned-target")
    md, (desc,) = peer.setup(nbytes, None)
    md_queue.put((md, desc))
    result_queue.put(peer.collect(count, timeout_s=30))
    peer.close()
