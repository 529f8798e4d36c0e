"""Rank 0's staging -> host copies of a landing run outside the rank's executor lock (a long
prompt's landing must not hold decode steps out); only the host pool's publish takes it (the
generation counter is bumped by the steps' publishes too, one load + store: two publishers at once
would lose a generation). Literal case, a thread hammer on a real shared-memory ``HostPool`` with
a step thread publishing by step, and the CUDA variant (``gpu``: the copies on a landing stream
while another stream is busy)."""

from __future__ import annotations

import os
import random
import threading
import time

import pytest
import torch

from hisparse_ray.config import KVLayout
from hisparse_ray.host.pool import HostPool
from hisparse_ray.landing.plan import unstage_runs
from hisparse_ray.rank.landing import RankLanding

PREFIX = f"hs-test-landlock-{os.getpid()}"
PAGE = 4


class _Pool:
    """A host writer that records whether the executor lock was held at each publish."""

    def __init__(self, layers: list[torch.Tensor], lock: threading.Lock) -> None:
        self.layers, self.lock, self.published = layers, lock, []

    def layer(self, l: int) -> torch.Tensor:
        return self.layers[l]

    def publish(self) -> int:
        self.published.append(self.lock.locked())
        return len(self.published)


def _landing(pool, lock, staging) -> RankLanding:
    return RankLanding(0, PAGE, lambda: [], keys=None, lock=lock, pool=pool, staging=staging)


def _wait(cond, timeout_s: float = 30.0) -> bool:
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(1e-3)
    return True


def test_a_landing_copies_while_a_step_holds_the_lock_and_publishes_after_it():
    lock = threading.Lock()
    L, row = 3, 16
    staging = [torch.randint(0, 255, (8 * PAGE, row), dtype=torch.uint8) for _ in range(L)]
    host = [torch.zeros(10 * PAGE, row, dtype=torch.uint8) for _ in range(L)]
    pool = _Pool(host, lock)
    landing = _landing(pool, lock, staging)
    lock.acquire()  # a decode step in flight
    try:
        t = threading.Thread(target=landing.unstage_run, args=(2, [7, 3], [0, 1], 2 * PAGE - 1))
        t.start()
        copied = _wait(lambda: all(torch.equal(host[l][3 * PAGE:4 * PAGE - 1],
                                               staging[l][3 * PAGE:4 * PAGE - 1])
                                   for l in range(L)))
        assert copied, "the copy waited for the executor lock"
        assert all(torch.equal(host[l][7 * PAGE:8 * PAGE], staging[l][2 * PAGE:3 * PAGE])
                   for l in range(L))
        time.sleep(0.02)
        assert pool.published == [] and t.is_alive(), "published while a step held the lock"
    finally:
        lock.release()
    t.join(30)
    assert not t.is_alive()
    assert pool.published == [True]  # under the lock, once
    assert all(not host[l][4 * PAGE - 1].any() for l in range(L))  # the partial page's tail


def _hammer(seed: int, staging_device: str) -> None:
    """A step thread publishes steps 1..S under the lock (writing its own rows first); landing
    threads land random chunks into their own host blocks at once, on one RankLanding. Every
    generation is published exactly once (none lost to a concurrent publish), each step's is
    named in the step ring, and every landed row holds its staging bytes."""
    rng = random.Random(seed)
    layout = KVLayout(num_layers=2, page_size=PAGE, row_bytes=32)
    n_blocks, n_threads, chunks_each, steps = 96, 3, 6, 40
    lock = threading.Lock()
    with HostPool.create(f"h{seed}", layout, n_blocks, register_cuda=False,
                         prefix=PREFIX) as pool:
        stage_blocks = 8 * n_threads
        staging = [torch.randint(0, 255, (stage_blocks * PAGE, layout.row_bytes),
                                 dtype=torch.uint8, device=staging_device)
                   for _ in range(layout.num_layers)]
        landing = _landing(pool, lock, staging)
        blocks = list(range(8, n_blocks))  # 0..7: the step thread's
        rng.shuffle(blocks)
        plans = []
        for t in range(n_threads):
            mine = [blocks.pop() for _ in range(chunks_each * 4)]
            plans.append([(t * 8 + rng.randint(0, 3), mine[c * 4:c * 4 + rng.randint(1, 4)])
                          for c in range(chunks_each)])
        step_gens: dict[int, int] = {}
        errors: list[BaseException] = []

        def stepper() -> None:
            r = random.Random(seed ^ 1)
            try:
                for n in range(1, steps + 1):
                    with lock:
                        for l in range(layout.num_layers):
                            pool.layer(l)[(n % 8) * PAGE].fill_(n % 251)
                        if r.random() < 0.3:
                            time.sleep(r.random() * 1e-3)  # a step's launch
                        step_gens[n] = pool.publish(step=n)
                    time.sleep(r.random() * 5e-4)
            except BaseException as e:  # noqa: BLE001  (reported by the main thread)
                errors.append(e)

        def lander(t: int) -> None:
            r = random.Random(seed ^ (t + 2))
            try:
                for first, hbs in plans[t]:
                    n_pos = len(hbs) * PAGE - r.randint(0, PAGE - 1)
                    landing.unstage_run(first, hbs, list(range(len(hbs))), n_pos)
                    time.sleep(r.random() * 5e-4)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=stepper)]
        threads += [threading.Thread(target=lander, args=(t,)) for t in range(n_threads)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert not any(th.is_alive() for th in threads) and not errors, errors
        assert pool.published() == steps + n_threads * chunks_each  # no generation lost
        assert sorted(step_gens.values()) == sorted(set(step_gens.values()))
        assert all(pool.step_generation(n) == g for n, g in step_gens.items()
                   if n > steps - 32)
        host_blocks = {}
        for t in range(n_threads):
            for first, hbs in plans[t]:
                for i, hb in enumerate(hbs):
                    host_blocks[hb] = first + i
        for l in range(layout.num_layers):
            src = staging[l].cpu()
            for hb, sb in host_blocks.items():
                got = pool.layer(l)[hb * PAGE:hb * PAGE + 1]  # the first row of every page
                assert torch.equal(got, src[sb * PAGE:sb * PAGE + 1]), (l, hb, sb)


@pytest.mark.parametrize("seed", range(4))
def test_landings_and_steps_publish_at_once_without_losing_a_generation(seed):
    _hammer(seed, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_landing_copies_on_their_own_stream_while_a_step_runs():
    """GPU staging: a landing's copies finish while another stream is busy (a decode step
    spinning on the GPU) and the executor lock is held; then the hammer with GPU staging."""
    lock = threading.Lock()
    staging = [torch.randint(0, 255, (8 * PAGE, 64), dtype=torch.uint8, device="cuda")]
    host = [torch.zeros(10 * PAGE, 64, dtype=torch.uint8).pin_memory()]
    pool = _Pool(host, lock)
    landing = _landing(pool, lock, staging)
    busy = torch.cuda.Stream()
    with torch.cuda.stream(busy):
        torch.cuda._sleep(2_000_000_000)  # about a second of a busy SM on `busy`
    with lock:
        t = threading.Thread(target=landing.unstage_run, args=(0, [5], [0], PAGE))
        t.start()
        assert _wait(lambda: torch.equal(host[0][5 * PAGE:6 * PAGE], staging[0][:PAGE].cpu()))
        busy_done = busy.query()
    t.join(30)
    assert pool.published == [True]
    assert not busy_done, "the landing's copies waited for another stream's work"
    _hammer(0, "cuda")
    torch.cuda.synchronize()


def test_unstage_run_reads_nothing_past_its_runs():
    """Runs from ``unstage_runs`` with a partial last page copy only its positions (the rest of
    the host block keeps its bytes)."""
    lock = threading.Lock()
    staging = [torch.full((4 * PAGE, 8), 9, dtype=torch.uint8)]
    host = [torch.full((4 * PAGE, 8), 1, dtype=torch.uint8)]
    landing = _landing(_Pool(host, lock), lock, staging)
    landing.unstage_run(0, [2, 0], [0, 1], PAGE + 2)
    runs = unstage_runs(0, [2, 0], [0, 1], PAGE, PAGE + 2)
    assert runs == [(0, 2 * PAGE, PAGE), (PAGE, 0, 2)]
    assert host[0][2 * PAGE:3 * PAGE].eq(9).all() and host[0][:2].eq(9).all()
    assert host[0][2:PAGE].eq(1).all() and host[0][PAGE:2 * PAGE].eq(1).all()
