"""The coordinator's end of the step channels (adapter ring, standard library): ONE ring that
broadcasts each step's command to every TP rank, and one report ring per rank; a step sends the
command once and gathers one report per rank in arrival order, with ``perf_counter`` stamps of
every stage.
"""

from __future__ import annotations

import collections
import threading
import time

from hisparse_ray.channel.ring import ChannelSpec, ShmRing, WaitPolicy
from hisparse_ray.errors import ChannelTimeoutError, StateError
from hisparse_ray.types import StepCommand, StepReport

REPORT_POLL_S = 0.005  # per-ring wait while collecting a step's reports


class RankChannels:
    """The coordinator's rings to its ``n`` ranks: ``commands`` (it writes, rank r is reader r)
    and ``reports[r]`` (rank r writes, it reads). Lifecycle: construct -> hand ``specs[r]`` to
    rank r (``ChannelPair.attach``) -> ``round_trip`` per step -> ``close``. One round trip at
    a time (a lock); ``log`` and ``trace`` keep the recent steps' timings. A pipelined caller
    (``ReplicaSpec.lookahead``) uses ``send`` and ``gather`` instead: command N + 1 may be sent
    before step N's reports are gathered; reports are gathered in step order."""

    def __init__(self, n: int, policy: WaitPolicy | None = None) -> None:
        self.reports: list[ShmRing] = []
        self.commands = ShmRing.create("writer", readers=n, policy=policy)
        try:
            for _ in range(n):
                self.reports.append(ShmRing.create("reader", policy=policy))
        except BaseException:
            self.close()
            raise
        self._lock = threading.Lock()
        self._sent: dict[int, tuple[float, float]] = {}  # step -> (start, sent): not gathered
        self.log: collections.deque = collections.deque(maxlen=100_000)  # (step, round trip s)
        # (step, start, command sent, (report found per rank), (loaded per rank)):
        # perf_counter() stamps, comparable with the ranks' traces (one clock per host)
        self.trace: collections.deque = collections.deque(maxlen=100_000)

    @property
    def specs(self) -> list[tuple[ChannelSpec, ChannelSpec]]:
        """Rank r's ``ChannelPair.attach`` spec: (its reader of the broadcast, its report ring)."""
        return [(self.commands.spec_for(r), ring.spec) for r, ring in enumerate(self.reports)]

    def round_trip(self, cmd: StepCommand, timeout: float) -> list[StepReport]:
        """Broadcast ``cmd`` to every rank, then take one report per rank, in whatever order
        they arrive (``_gather``). ``ChannelTimeoutError`` / ``ChannelPeerLostError`` when a rank
        does not answer within ``timeout`` s or died."""
        self.send(cmd, timeout)
        return self.gather(cmd.step, timeout)

    def send(self, cmd: StepCommand, timeout: float) -> None:
        """Broadcast ``cmd``; its reports are taken by :meth:`gather` (in step order)."""
        with self._lock:
            t0 = time.perf_counter()
            self.commands.send(cmd, timeout)
            self._sent[cmd.step] = (t0, time.perf_counter())

    def gather(self, step: int, timeout: float) -> list[StepReport]:
        """One report per rank of the oldest step sent and not gathered yet, which must be
        ``step`` (StateError otherwise, as for a report of another step)."""
        with self._lock:
            if not self._sent or min(self._sent) != step:
                raise StateError(f"gather of step {step}; steps sent and not gathered: "
                                 f"{sorted(self._sent)}")
            reports, found, loaded = self._gather(timeout)
            t0, sent = self._sent.pop(step)
            dt = time.perf_counter() - t0
        got = [(r.step, r.rank) for r in reports]
        if got != [(step, r) for r in range(len(reports))]:
            raise StateError(f"step {step}: reports (step, rank) {got}")
        self.log.append((step, dt))
        self.trace.append((step, t0, sent, tuple(found), tuple(loaded)))
        return reports

    def unlink(self) -> None:
        """Remove the rings' names once every rank attached (their mappings stay)."""
        self.commands.unlink()
        for ring in self.reports:
            ring.unlink()

    def probe(self, n: int, timeout: float) -> list[float]:
        """Round-trip seconds of ``n`` empty StepCommands through every rank's channel and step
        executor (nothing to run: pure control-plane cost at this TP size). Reports are checked
        for the right step and rank; they are not for the coordinator core."""
        out = []
        with self._lock:
            if self._sent:
                raise StateError(f"probe while steps {sorted(self._sent)} are in flight")
            for i in range(n):
                cmd = StepCommand(-1 - i)
                t0 = time.perf_counter()
                self.commands.send(cmd, timeout)
                reports, _, _ = self._gather(timeout)
                out.append(time.perf_counter() - t0)
                if [(r.step, r.rank) for r in reports] != [(cmd.step, r) for r in
                                                           range(len(self.reports))]:
                    raise StateError(f"probe reports out of order: {reports}")
        return out

    def _gather(self, timeout: float) -> tuple[list, list[float], list[float]]:
        """One report per rank, taken in whatever order they arrive, so that a dead rank is
        noticed at once (``ChannelPeerLostError``) even while a live one is blocked in a
        collective waiting for it; with each report's ``perf_counter`` stamps (found, loaded)
        for the step trace. ``ChannelTimeoutError`` after ``timeout`` s."""
        rings = self.reports
        reports: list = [None] * len(rings)
        found = [0.0] * len(rings)
        loaded = [0.0] * len(rings)
        deadline = time.monotonic() + timeout
        turn = -1
        while True:
            missing = []
            for i, ring in enumerate(rings):  # take every report already there
                if reports[i] is None:
                    if ring.pending():
                        reports[i] = ring.recv(0)
                        found[i], loaded[i] = ring.ready_t, time.perf_counter()
                    else:
                        missing.append(i)
            if not missing:
                return reports, found, loaded
            if time.monotonic() >= deadline:
                raise ChannelTimeoutError(f"no step report from ranks {missing} after {timeout} s")
            # wait on one missing ring (in turn: each peer's liveness gets checked), waking for
            # any other: a rank that reports first is loaded while the slower one still works,
            # off the step's critical path
            turn += 1
            k = missing[turn % len(missing)]
            rings[k].wait_pending(REPORT_POLL_S, tuple(rings[i] for i in missing if i != k))

    def close(self) -> None:
        self.commands.close()
        for ring in self.reports:
            ring.close()
        self.reports = []
