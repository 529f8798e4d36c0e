"""Writer/reader routines shared by the process and Ray hammer tests of the host pool.

The production protocol: rank 0 is the only writer; every host row is written once while anyone
may read it (backups fill a request's rows one step at a time, spills and landings fill fresh
blocks), then published as a generation; a peer reads a row only after ``wait_published`` of a
generation at or after the one that wrote it (the step command tells it which). Row content is a
stamp: every int64 of row ``r`` of layer ``l`` written in generation g equals
``stamp(g, r, l)``; never-written rows are 0. Both sides derive the writer's schedule from the
same seed, so a reader knows exactly which rows are final at the generation it waited for and
what they hold: a zero row is stale, a mixed row torn.
"""

from __future__ import annotations

import random
import time

import torch

from hisparse_ray.config import KVLayout
from hisparse_ray.host.pool import HostPool

LAYOUT = KVLayout(num_layers=3, page_size=8, row_bytes=64)
NUM_BLOCKS = 48
ROWS = NUM_BLOCKS * LAYOUT.page_size


def stamp(gen: int, row: int, layer: int) -> int:
    return gen * 1_000_000 + row * 10 + layer + 1


def schedule(seed: int, gens: int) -> list[list[int]]:
    """Rows written in each generation 1..gens (index 0 is empty): 1-3 fresh rows each (a
    backup's newest row, or a few rows of a spilled page), every row at most once."""
    rng = random.Random(seed)
    fresh = list(range(ROWS))
    rng.shuffle(fresh)
    plan: list[list[int]] = [[]]
    for _ in range(gens):
        plan.append([fresh.pop() for _ in range(min(len(fresh), rng.randint(1, 3)))])
    return plan


def writer_of(plan: list[list[int]]) -> dict[int, int]:
    """row -> the generation that writes it."""
    return {r: g for g, rows in enumerate(plan) for r in rows}


def write_rows(pool: HostPool, rows: list[int], gen: int, rng: random.Random) -> None:
    """Stamp ``rows`` of every layer with ``gen``, in two stores per row with a random pause
    between now and then (a torn read is observable)."""
    for r in rows:
        for l in range(LAYOUT.num_layers):
            row = pool.layer(l)[r].view(torch.int64)
            half = row.shape[0] // 2
            row[:half].fill_(stamp(gen, r, l))
            if rng.random() < 0.05:
                time.sleep(rng.random() * 2e-4)
            row[half:].fill_(stamp(gen, r, l))


def check_rows(pool: HostPool, rows: list[int], written: dict[int, int], stats: dict) -> None:
    """Read every layer of ``rows``; count each torn (mixed stamps) or stale (not the stamp of
    the generation ``written[row]``) in ``stats``, and every row read."""
    for r in rows:
        for l in range(LAYOUT.num_layers):
            copy = pool.layer(l)[r].view(torch.int64).numpy().copy()
            if not (copy == copy[0]).all():
                stats["torn"] += 1
            elif int(copy[0]) != stamp(written[r], r, l):
                stats["stale"] += 1
            stats["rows"] += 1


def run_writer(pool: HostPool, seed: int, gens: int, duration_s: float = 1.0) -> int:
    """Owner side: write every generation of the schedule, with random pauses, spread over about
    ``duration_s`` so that readers overlap it, publishing each; returns gens."""
    rng = random.Random(seed ^ 0x5EED)
    plan = schedule(seed, gens)
    t0 = time.monotonic()
    for g in range(1, gens + 1):
        ahead = t0 + duration_s * g / gens - time.monotonic()
        if ahead > 0:
            time.sleep(ahead * rng.random() * 2)
        write_rows(pool, plan[g], g, rng)
        pool.publish()
        if rng.random() < 0.3:
            time.sleep(rng.random() * 5e-4)
    return gens


def run_reader(pool: HostPool, seed: int, gens: int, min_reads: int = 200,
               timeout_s: float = 60.0, honest: bool = True) -> dict:
    """Peer side: pick a generation (mostly the latest published, sometimes one ahead: the
    command may name a generation the writer is still finishing), ``wait_published`` it, read
    random rows final by then; counts torn and stale rows. ``honest=False`` skips the wait and
    reads rows of the picked generation at once (shows that the checks catch a reader breaking
    the protocol)."""
    rng = random.Random(seed ^ 0xBEEF)
    plan = schedule(seed, gens)
    written = writer_of(plan)
    stats: dict = {"reads": 0, "rows": 0, "torn": 0, "stale": 0}
    deadline = time.monotonic() + timeout_s
    while (stats["reads"] < min_reads or pool.published() < gens) and time.monotonic() < deadline:
        now = pool.published()
        target = now if rng.random() < 0.7 else rng.randint(now, min(gens, now + 5))
        if honest:
            pool.wait_published(target, timeout_s=timeout_s)
        final = [r for r, g in written.items() if g <= target]
        if not honest:  # the rows only the picked generation writes: the likeliest to be missing
            final = plan[target] or final
        check_rows(pool, rng.sample(final, min(len(final), rng.randint(1, 8))), written, stats)
        stats["reads"] += 1
        if rng.random() < 0.2:
            time.sleep(rng.random() * 3e-4)
    stats["final"] = pool.published()
    stats["honest"] = honest
    return stats


def reader_process(name: str, seed: int, gens: int, ready, queue, honest: bool = True) -> None:
    """multiprocessing target: attach, signal ``ready``, read, report stats through ``queue``."""
    try:
        with HostPool.attach(name, register_cuda=False) as pool:
            ready.set()
            queue.put(run_reader(pool, seed, gens, honest=honest))
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

    def write(self, seed: int, gens: int) -> int:
        return run_writer(self.pool, seed, gens)

    def read(self, seed: int, gens: int) -> dict:
        return run_reader(self.pool, seed, gens)

    def landings(self, k: int) -> int:
        """``k`` publishes without a step (landings: CPU-complete, no event); the generation."""
        for _ in range(k):
            gen = self.pool.publish()
        return gen

    # --- GPU path: device pages spilled by rank 0, restored by a peer after the IPC event
    def _device_layers(self, seed: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        shape = (NUM_BLOCKS * LAYOUT.page_size, LAYOUT.row_bytes)
        return [torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).cuda()
                for _ in range(LAYOUT.num_layers)]

    def spill_and_publish(self, seed: int, pairs: list[tuple[int, int]], step: int):
        from hisparse_ray.host import copies

        # kept on self: the source must outlive the enqueued copies (the caching allocator could
        # hand its memory to the next allocation on the current stream)
        self.layers, self.side = self._device_layers(seed), torch.cuda.Stream()
        torch.cuda._sleep(20_000_000)  # the copies (and the event) complete well after publish
        for d, h in pairs:
            copies.spill_page(self.layers, self.pool, d, h, self.side)
        return self.pool.publish(self.side, step=step)  # a stream's copies: published by step

    def restore_and_check(self, seed: int, pairs: list[tuple[int, int]], step: int) -> int:
        from hisparse_ray.host import copies

        want = self._device_layers(seed)
        got = [torch.zeros_like(t) for t in want]
        side = torch.cuda.Stream()
        self.pool.wait_step(step, stream=side, timeout_s=60)
        for d, h in pairs:
            copies.restore_page(got, self.pool, d, h, side)
        side.synchronize()
        bad = 0
        for d, _ in pairs:
            rows = slice(d * LAYOUT.page_size, (d + 1) * LAYOUT.page_size)
            bad += sum(not torch.equal(g[rows], w[rows]) for g, w in zip(got, want))
        return bad

    # --- a decode step's ordering: rank 0 backs rows up on its copy stream and publishes step N
    # without waiting; the peer's next step waits for step N by number (its IPC event slot), then
    # reads the rows on the GPU
    def backup_step(self, seed: int, rows: list[int], step: int) -> int:
        from hisparse_ray.host import copies

        self.layers = self._device_layers(seed)  # kept: the copies read it after we return
        self.copy_stream = getattr(self, "copy_stream", None) or torch.cuda.Stream()
        torch.cuda._sleep(20_000_000)  # the forward, still running when the step reports
        copies.backup_rows(self.layers, self.pool, rows, rows, self.copy_stream)
        return self.pool.publish(self.copy_stream, step=step)  # no host sync: the report leaves

    def read_step(self, seed: int, rows: list[int], step: int) -> int:
        """Rows of mismatching bytes after reading ``rows`` through UVA (as the resolver reads
        misses) on the current stream, once it waited for rank 0's ``step``."""
        from hisparse_ray.host import copies

        want = self._device_layers(seed)
        got = [torch.zeros_like(t) for t in want]
        self.pool.wait_step(step, timeout_s=60)
        copies.fill_rows(got, self.pool, rows, rows, use_uva=True).order_before()
        torch.cuda.current_stream().synchronize()
        return sum(not torch.equal(g[r], w[r]) for g, w in zip(got, want) for r in rows)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.destroy() if self.pool.is_owner else self.pool.close()
            self.pool = None
