"""Writer/reader routines shared by the process and Ray hammer tests of the host pool.

Page content is a stamp: every int64 of page (layer, block) written in generation g equals
``stamp(g, block, layer)``; generation 0 is the zero-filled initial state. Both sides derive the
writer's schedule from the same seed, so a reader knows exactly which generation's stamp each page
must carry at the generation it observed: anything else is stale, a mixed page is torn.
"""

from __future__ import annotations

import random
import time

import numpy as np
import torch

from hisparse_ray.config import KVLayout
from hisparse_ray.host.pool import HostPool

LAYOUT = KVLayout(num_layers=3, page_size=8, row_bytes=64)
NUM_BLOCKS = 48


def stamp(gen: int, block: int, layer: int) -> int:
    return 0 if gen == 0 else gen * 1_000_000 + block * 100 + layer + 1


def schedule(seed: int, gens: int, write_once: bool) -> list[list[int]]:
    """Blocks written in each generation 1..gens (index 0 is empty). write_once: every block is
    written at most once (like spills into fresh host blocks), else blocks are rewritten."""
    rng = random.Random(seed)
    plan: list[list[int]] = [[]]
    fresh = list(range(NUM_BLOCKS))
    rng.shuffle(fresh)
    for _ in range(gens):
        if write_once:
            k = min(len(fresh), rng.randint(1, 3))
            plan.append([fresh.pop() for _ in range(k)])
        else:
            plan.append(rng.sample(range(NUM_BLOCKS), rng.randint(1, 6)))
    return plan


def last_writer(plan: list[list[int]]) -> list[list[int]]:
    """lw[g][b]: the generation whose stamp block b carries once generation g is published."""
    cur = [0] * NUM_BLOCKS
    out = [list(cur)]
    for g in range(1, len(plan)):
        for b in plan[g]:
            cur[b] = g
        out.append(list(cur))
    return out


def run_writer(pool: HostPool, seed: int, gens: int, write_once: bool,
               duration_s: float = 1.0) -> int:
    """Owner side: write every generation of the schedule, with random pauses, spread over about
    ``duration_s`` so that readers overlap it; returns gens."""
    rng = random.Random(seed ^ 0x5EED)
    plan = schedule(seed, gens, write_once)
    t0 = time.monotonic()
    for g in range(1, gens + 1):
        ahead = t0 + duration_s * g / gens - time.monotonic()
        if ahead > 0:
            time.sleep(ahead * rng.random() * 2)
        if not write_once:
            pool.begin_write()
        for b in plan[g]:
            for l in range(LAYOUT.num_layers):
                page = pool.block(l, b).view(torch.int64)
                half = page.shape[0] // 2  # two stores per page: a torn read is observable
                page[:half].fill_(stamp(g, b, l))
                if rng.random() < 0.05:
                    time.sleep(rng.random() * 2e-4)
                page[half:].fill_(stamp(g, b, l))
        pool.publish()
        if rng.random() < 0.3:
            time.sleep(rng.random() * 5e-4)
    return gens


def _check_page(copy: np.ndarray, b: int, l: int, gen: int, lw, stats) -> None:
    want = stamp(lw[gen][b], b, l)
    if not (copy == copy[0]).all():
        stats["torn"] += 1
    elif int(copy[0]) != want:
        stats["stale"] += 1


def run_reader(pool: HostPool, seed: int, gens: int, write_once: bool, min_reads: int = 200,
               timeout_s: float = 60.0, honest: bool = True) -> dict:
    """Peer side: wait for random generations and read random pages; counts torn and stale pages.

    write_once: read after wait_published(g) only (no seqlock): blocks written up to g are final.
    Otherwise: seqlock reads (read_begin / copy / read_valid), checked against the observed gen.
    honest=False skips wait_published (shows that the checks catch a reader breaking protocol).
    """
    rng = random.Random(seed ^ 0xBEEF)
    plan = schedule(seed, gens, write_once)
    lw = last_writer(plan)
    stats: dict = {"reads": 0, "pages": 0, "retries": 0, "torn": 0, "stale": 0}
    deadline = time.monotonic() + timeout_s
    while (stats["reads"] < min_reads or pool.published() < gens) and time.monotonic() < deadline:
        now = pool.published()  # mostly read at once (overlapping the writer), else wait ahead
        target = now if rng.random() < 0.7 else rng.randint(now, min(gens, now + 5))
        if honest:
            pool.wait_published(target, timeout_s=timeout_s)
        if write_once:  # only blocks already final at target (later writes may be in flight)
            gen = target
            written = [b for b in range(NUM_BLOCKS) if lw[gen][b] > 0]
            blocks = rng.sample(written, min(len(written), rng.randint(1, 8)))
            for b in blocks:
                for l in range(LAYOUT.num_layers):
                    copy = pool.block(l, b).reshape(-1).view(torch.int64).numpy().copy()
                    _check_page(copy, b, l, gen, lw, stats)
                    stats["pages"] += 1
        else:
            blocks = rng.sample(range(NUM_BLOCKS), rng.randint(1, 8))
            while True:
                token = pool.read_begin(timeout_s=timeout_s)
                copies = {(b, l): pool.block(l, b).reshape(-1).view(torch.int64).numpy().copy()
                          for b in blocks for l in range(LAYOUT.num_layers)}
                if pool.read_valid(token):
                    break
                stats["retries"] += 1
            gen = token // 2
            if gen < target:
                stats["stale"] += 1
            for (b, l), copy in copies.items():
                _check_page(copy, b, l, gen, lw, stats)
                stats["pages"] += 1
        stats["reads"] += 1
        if rng.random() < 0.2:
            time.sleep(rng.random() * 3e-4)
    stats["final"] = pool.published()
    stats["honest"] = honest
    return stats


def reader_process(name: str, seed: int, gens: int, write_once: bool, ready, queue,
                   honest: bool = True) -> None:
    """multiprocessing target: attach, signal ``ready``, read, report stats through ``queue``."""
    try:
        with HostPool.attach(name, register_cuda=False) as pool:
            ready.set()
            queue.put(run_reader(pool, seed, gens, write_once, honest=honest))
    except BaseException as e:  # report instead of dying silently
        queue.put({"error": repr(e)})


def hold_pool_process(replica_id: str, prefix: str, queue) -> None:
    """multiprocessing target: create a pool, report its name, then sleep until killed."""
    pool = HostPool.create(replica_id, LAYOUT, NUM_BLOCKS, register_cuda=False, prefix=prefix)
    queue.put(pool.name)
    time.sleep(600)


def unlinking_owner_process(shm_dir: str, prefix: str, attached, queue) -> None:
    """multiprocessing target: rank 0 of a replica. Create a pool in ``shm_dir``, stamp block 1 of
    every layer, report its name, wait until the peer attached (``attached`` set), unlink the
    name, report, then sleep until killed."""
    pool = HostPool.create("unlinked", LAYOUT, NUM_BLOCKS, register_cuda=False, prefix=prefix,
                           shm_dir=shm_dir)
    for l in range(LAYOUT.num_layers):
        pool.block(l, 1).view(torch.int64).fill_(stamp(1, 1, l))
    pool.publish()
    queue.put(pool.name)
    attached.wait(120)
    pool.unlink()
    queue.put("unlinked")
    time.sleep(600)


def attach_and_hold_process(name: str, queue) -> None:
    """multiprocessing target: attach as a peer, report, then sleep until killed."""
    pool = HostPool.attach(name, register_cuda=False)
    queue.put(int(pool.layer(0).sum()))
    time.sleep(600)


class PoolActor:
    """A TP rank in a Ray actor: rank 0 creates the pool, peers attach (made remote by the tests)."""

    def __init__(self) -> None:
        self.pool: HostPool | None = None

    def pid(self) -> int:
        import os

        return os.getpid()

    def gpu(self) -> str:
        """This actor's GPU (its UUID: Ray shows each actor only the GPUs it was given)."""
        return str(torch.cuda.get_device_properties(0).uuid)

    def create(self, replica_id: str, prefix: str, register_cuda: bool = False) -> str:
        self.pool = HostPool.create(replica_id, LAYOUT, NUM_BLOCKS, register_cuda=register_cuda,
                                    prefix=prefix)
        return self.pool.name

    def attach(self, name: str, register_cuda: bool = False) -> bool:
        self.pool = HostPool.attach(name, register_cuda=register_cuda)
        return True

    def write(self, seed: int, gens: int, write_once: bool) -> int:
        return run_writer(self.pool, seed, gens, write_once)

    def read(self, seed: int, gens: int, write_once: bool) -> dict:
        return run_reader(self.pool, seed, gens, write_once)

    # --- GPU path: device pages spilled by rank 0, restored by a peer after the IPC event
    def _device_layers(self, seed: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        shape = (NUM_BLOCKS * LAYOUT.page_size, LAYOUT.row_bytes)
        return [torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).cuda()
                for _ in range(LAYOUT.num_layers)]

    def spill_and_publish(self, seed: int, pairs: list[tuple[int, int]]):
        from hisparse_ray.host import copies

        # kept on self: the source must outlive the enqueued copies (the caching allocator could
        # hand its memory to the next allocation on the current stream)
        self.layers, self.side = self._device_layers(seed), torch.cuda.Stream()
        torch.cuda._sleep(20_000_000)  # the copies (and the event) complete well after publish
        for d, h in pairs:
            copies.spill_page(self.layers, self.pool, d, h, self.side)
        return self.pool.publish(self.side)

    def restore_and_check(self, seed: int, pairs: list[tuple[int, int]], publication) -> int:
        from hisparse_ray.host import copies

        want = self._device_layers(seed)
        got = [torch.zeros_like(t) for t in want]
        side = torch.cuda.Stream()
        self.pool.wait_published(publication.seq, stream=side, publication=publication)
        for d, h in pairs:
            copies.restore_page(got, self.pool, d, h, side)
        side.synchronize()
        bad = 0
        for d, _ in pairs:
            rows = slice(d * LAYOUT.page_size, (d + 1) * LAYOUT.page_size)
            bad += sum(not torch.equal(g[rows], w[rows]) for g, w in zip(got, want))
        return bad

    def close(self) -> None:
        if self.pool is not None:
            self.pool.destroy() if self.pool.is_owner else self.pool.close()
            self.pool = None
