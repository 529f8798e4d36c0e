"""Rank 0 and a peer on the pool's step ring (``HostPool.publish(step=N)`` / ``wait_step(N)``),
shared by the process hammer of tests/host/test_step_ring.py.

The production protocol it models: rank 0 runs steps 1, 2, ...; in some of them it writes host rows
(a step's backups or spills: fresh rows, each written once) and publishes them as that step's
generation, tagged with the step number (and, on a GPU, its IPC event slot ``N % event_ring``);
between steps it may publish other writes (landings) without a step, sometimes in bursts longer
than the event ring. The peer runs the same steps in order; at step N + 1, when rank 0 wrote in
step N, it waits for step N by number (after the report of N, through ``host_seq``, unless N + 1
chains past N), and then reads rows of step N and before. Rank 0 never runs more than two steps
ahead of the peer (the step pipeline: command N + 2 leaves after every report of N). Both sides
derive the schedule from one seed, so the peer knows each step's generation and which rows are
final: a zero row is stale, a mixed one torn.

On CPU there are no events: :class:`EventLog` stands in for the pool's IPC event ring and keeps,
in shared memory, which step each slot was last recorded for, so the peer can check that every
wait caught the record of the step it waited for (on a GPU a later step's record would make the
peer's stream wait for that step's forward: a deadlock at TP > 1).
"""

from __future__ import annotations

import random
import time

from hisparse_ray.host.pool import HostPool
from tests.host._hammer import ROWS, check_rows, write_rows

AHEAD = 2  # rank 0 runs at most this many steps past the peer's last finished one
LANDING = -1  # EventLog's label of a record made by a publish without a step (never legal)


class EventLog:
    """A CPU stand-in of ``HostPool``'s IPC event ring (install it as ``pool._ring``): ``labels``
    (shared, e.g. a ``multiprocessing.Array``, one per slot) holds the label of each slot's last
    record: the owner's ``label`` when it recorded (the step it publishes, ``LANDING`` for a
    publish without a step). A wait appends ``(slot, label found)`` to ``waits``."""

    def __init__(self, labels, owner: bool) -> None:
        self.size, self.owner, self.labels = len(labels), owner, labels
        self.label, self.records = LANDING, 0
        self.waits: list[tuple[int, int]] = []
        for i in range(self.size if owner else 0):
            labels[i] = -2  # never recorded

    def handle(self, slot: int) -> bytes:
        return b""

    def record(self, slot: int, stream=None) -> None:
        self.labels[slot] = self.label
        self.records += 1

    def wait(self, slot: int, handle: bytes, stream=None) -> None:
        self.waits.append((slot, self.labels[slot]))

    def close(self) -> None:
        pass


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
        r = rng.random()  # a burst of landings: more generations than the event ring has slots
        extra = rng.randint(9, 12) if r < 0.08 else 1 if r < 0.18 else 0
        gen += extra
        rows = [fresh.pop() for _ in range(rng.randint(1, 2))] if rng.random() < 0.7 else []
        if rows:
            gen += 1
        out.append({"rows": rows, "extra": extra, "gen": gen if rows else None,
                    "chained": rng.random() < 0.8})
    return out


def run_rank0(pool: HostPool, seed: int, steps: int, peer_done, duration_s: float = 1.0,
              events: EventLog | None = None) -> None:
    """Rank 0: every step of the plan with random pauses (spread over about ``duration_s``),
    never more than ``AHEAD`` steps past ``peer_done.value`` (the peer's last finished step);
    ``events``: the pool's stand-in event ring, labelled with each publish's step."""
    rng = random.Random(seed ^ 0x5EED)
    p = plan(seed, steps)
    t0 = time.monotonic()
    for n in range(1, steps + 1):
        while n - peer_done.value > AHEAD:
            time.sleep(1e-4)
        ahead = t0 + duration_s * n / steps - time.monotonic()
        if ahead > 0:
            time.sleep(ahead * rng.random() * 2)
        if events is not None:
            events.label = LANDING
        for _ in range(p[n]["extra"]):
            pool.publish()  # a landing's writes: a generation no step names
        if p[n]["rows"]:
            write_rows(pool, p[n]["rows"], p[n]["gen"], rng)
            if events is not None:
                events.label = n
            assert pool.publish(step=n) == p[n]["gen"]
        if rng.random() < 0.3:
            time.sleep(rng.random() * 5e-4)


def run_peer(pool: HostPool, seed: int, steps: int, peer_done, honest: bool = True,
             timeout_s: float = 60.0) -> dict:
    """The peer: steps 1..steps in order; at step n, when rank 0 wrote in step n - 1, it waits
    for the report of n - 1 (its generation, as ``host_seq`` carries it) unless n chains past
    n - 1, then for step n - 1 by number (``honest=False`` skips both: the checks bite); then
    reads every row of step n - 1 and a few earlier ones and checks them. Counts torn and stale
    rows, waits, generations that differ from the plan's and, with an :class:`EventLog` as the
    pool's event ring, waits that caught another record than step n - 1's (``wrong_event``)."""
    rng = random.Random(seed ^ 0xBEEF)
    p = plan(seed, steps)
    written = {r: p[n]["gen"] for n in range(1, steps + 1) for r in p[n]["rows"]}
    final: list[int] = []  # rows of steps before the previous one: in host_seq by now
    events = pool._ring if isinstance(pool._ring, EventLog) else None
    stats = {"waits": 0, "rows": 0, "torn": 0, "stale": 0, "wrong_gen": 0, "wrong_event": 0,
             "event_waits": 0, "honest": honest}
    for n in range(1, steps + 1):
        prev = p[n - 1] if n > 1 else {"rows": [], "chained": False}
        if prev["rows"]:
            if honest:
                if not prev["chained"]:  # the report of n - 1 came first (the step barrier)
                    pool.wait_published(prev["gen"], timeout_s=timeout_s)
                g = pool.wait_step(n - 1, timeout_s=timeout_s)
                stats["waits"] += 1
                stats["wrong_gen"] += g != prev["gen"]
                if events is not None and events.waits:
                    slot, label = events.waits[-1]  # the wait for step n - 1's writes
                    events.waits.clear()
                    stats["event_waits"] += 1
                    stats["wrong_event"] += label != n - 1
            check_rows(pool, prev["rows"] + rng.sample(final, min(len(final), 3)), written, stats)
        final += prev["rows"]
        if rng.random() < 0.2:
            time.sleep(rng.random() * 5e-4)
        peer_done.value = n
    return stats


def peer_process(name: str, seed: int, steps: int, peer_done, ready, queue,
                 honest: bool = True, labels=None) -> None:
    """multiprocessing target: attach (with ``labels``: an :class:`EventLog` on them as its
    event ring), signal ``ready``, run the peer, report its stats."""
    try:
        with HostPool.attach(name, register_cuda=False) as pool:
            if labels is not None:
                pool._ring = EventLog(labels, owner=False)
            ready.set()
            queue.put(run_peer(pool, seed, steps, peer_done, honest=honest))
    except BaseException as e:  # report instead of dying silently
        queue.put({"error": repr(e)})
