"""Rank 0 and a peer on the pool's step ring (``HostPool.publish(step=N)`` / ``wait_step(N)``),
shared by the process hammer of tests/host/test_step_ring.py.

The production protocol it models: rank 0 runs steps 1, 2, ...; in some of them it writes host rows
(a step's backups or spills: fresh rows, each written once) and publishes them as that step's
generation, tagged with the step number; between steps it may publish other writes (landings)
without a step. The peer runs the same steps in order; a step N + 1 that chains past step N (taken
before rank 0's report of N) waits for step N by number before it reads, and then reads rows of
step N and before. Rank 0 never runs more than two steps ahead of the peer (the step pipeline:
command N + 2 leaves after every report of N). Both sides derive the schedule from one seed, so the
peer knows each step's generation and which rows are final: a zero row is stale, a mixed one torn.
"""

from __future__ import annotations

import random
import time

from hisparse_ray.host.pool import HostPool
from tests.host._hammer import ROWS, check_rows, write_rows

AHEAD = 2  # rank 0 runs at most this many steps past the peer's last finished one


def plan(seed: int, steps: int) -> list[dict]:
    """Per step 1..steps (index 0 empty): ``rows`` rank 0 writes in it (empty: no publish),
    ``extra`` generations published before it without a step (landings), ``gen`` the generation
    of its writes (None without), ``chained`` whether the peer's next step chains past it."""
    rng = random.Random(seed)
    fresh = list(range(ROWS))
    rng.shuffle(fresh)
    out: list[dict] = [{}]
    gen = 0
    for _ in range(steps):
        extra = 1 if rng.random() < 0.1 else 0
        gen += extra
        rows = [fresh.pop() for _ in range(rng.randint(1, 2))] if rng.random() < 0.7 else []
        if rows:
            gen += 1
        out.append({"rows": rows, "extra": extra, "gen": gen if rows else None,
                    "chained": rng.random() < 0.8})
    return out


def run_rank0(pool: HostPool, seed: int, steps: int, peer_done, duration_s: float = 1.0) -> None:
    """Rank 0: every step of the plan with random pauses (spread over about ``duration_s``),
    never more than ``AHEAD`` steps past ``peer_done.value`` (the peer's last finished step)."""
    rng = random.Random(seed ^ 0x5EED)
    p = plan(seed, steps)
    t0 = time.monotonic()
    for n in range(1, steps + 1):
        while n - peer_done.value > AHEAD:
            time.sleep(1e-4)
        ahead = t0 + duration_s * n / steps - time.monotonic()
        if ahead > 0:
            time.sleep(ahead * rng.random() * 2)
        for _ in range(p[n]["extra"]):
            pool.publish()  # a landing's writes: a generation no step names
        if p[n]["rows"]:
            write_rows(pool, p[n]["rows"], p[n]["gen"], rng)
            assert pool.publish(step=n) == p[n]["gen"]
        if rng.random() < 0.3:
            time.sleep(rng.random() * 5e-4)


def run_peer(pool: HostPool, seed: int, steps: int, peer_done, honest: bool = True,
             timeout_s: float = 60.0) -> dict:
    """The peer: steps 1..steps in order; step n chains past n - 1 when the plan says so and
    waits for it by number (``honest=False`` skips the wait: the checks bite) if rank 0 wrote in
    it; then reads every row of step n - 1 and a few earlier ones and checks them. Counts torn
    and stale rows, waits, and generations that differ from the plan's."""
    rng = random.Random(seed ^ 0xBEEF)
    p = plan(seed, steps)
    written = {r: p[n]["gen"] for n in range(1, steps + 1) for r in p[n]["rows"]}
    final: list[int] = []  # rows of steps before the previous one: in host_seq by now
    stats = {"waits": 0, "rows": 0, "torn": 0, "stale": 0, "wrong_gen": 0, "honest": honest}
    for n in range(1, steps + 1):
        prev = p[n - 1] if n > 1 else {"rows": [], "chained": False}
        if prev["rows"] and prev["chained"]:
            if honest:
                g = pool.wait_step(n - 1, timeout_s=timeout_s)
                stats["waits"] += 1
                stats["wrong_gen"] += g != prev["gen"]
            check_rows(pool, prev["rows"] + rng.sample(final, min(len(final), 3)), written, stats)
        elif prev["rows"]:  # not chained: the report of n - 1 came first (the step barrier)
            pool.wait_published(prev["gen"], timeout_s=timeout_s)
        final += prev["rows"]
        if rng.random() < 0.2:
            time.sleep(rng.random() * 5e-4)
        peer_done.value = n
    return stats


def peer_process(name: str, seed: int, steps: int, peer_done, ready, queue,
                 honest: bool = True) -> None:
    """multiprocessing target: attach, signal ``ready``, run the peer, report its stats."""
    try:
        with HostPool.attach(name, register_cuda=False) as pool:
            ready.set()
            queue.put(run_peer(pool, seed, steps, peer_done, honest=honest))
    except BaseException as e:  # report instead of dying silently
        queue.put({"error": repr(e)})
