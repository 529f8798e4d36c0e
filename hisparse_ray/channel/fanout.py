"""The coordinator's end of the step channels (adapter ring, standard library): one
:class:`~hisparse_ray.channel.pair.ChannelPair` per TP rank; a step sends each rank its command
and gathers one report per rank in arrival order, with ``perf_counter`` stamps of every stage.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Sequence

from hisparse_ray.channel.pair import ChannelPair
from hisparse_ray.channel.ring import ChannelSpec, WaitPolicy
from hisparse_ray.errors import ChannelTimeoutError, StateError
from hisparse_ray.types import Rank, StepCommand, StepReport

REPORT_POLL_S = 0.005  # per-channel wait while collecting a step's reports


class RankChannels:
    """The coordinator's channel pairs to its ``n`` ranks (creator side: commands out, reports
    in). Lifecycle: construct -> hand ``specs[r]`` to rank r (``ChannelPair.attach``) ->
    ``round_trip`` per step -> ``close``. One round trip at a time (a lock); ``log`` and ``trace``
    keep the recent steps' timings."""

    def __init__(self, n: int, policy: WaitPolicy | None = None) -> None:
        self.pairs: list[ChannelPair] = []
        try:
            for _ in range(n):
                self.pairs.append(ChannelPair.create(policy=policy))
        except BaseException:
            self.close()
            raise
        self._lock = threading.Lock()
        self.log: collections.deque = collections.deque(maxlen=100_000)  # (step, round trip s)
        # (step, start, (sent per rank), (report found per rank), (loaded per rank)):
        # perf_counter() stamps, comparable with the ranks' traces (one clock per host)
        self.trace: collections.deque = collections.deque(maxlen=100_000)

    @property
    def specs(self) -> list[tuple[ChannelSpec, ChannelSpec]]:
        return [pair.spec for pair in self.pairs]

    def round_trip(self, cmds: Sequence[StepCommand], timeout: float) -> list[StepReport]:
        """Send ``cmds[r]`` to rank r, then take one report per rank, in whatever order they
        arrive (``_gather``). ``ChannelTimeoutError`` / ``ChannelPeerLostError`` when a rank does
        not answer within ``timeout`` s or died."""
        with self._lock:
            t0 = time.perf_counter()
            sent = []
            for pair, cmd in zip(self.pairs, cmds):
                pair.send(cmd, timeout)
                sent.append(time.perf_counter())
            reports, found, loaded = self._gather(timeout)
            dt = time.perf_counter() - t0
        self.log.append((cmds[0].step, dt))
        self.trace.append((cmds[0].step, t0, tuple(sent), tuple(found), tuple(loaded)))
        return reports

    def probe(self, n: int, timeout: float) -> list[float]:
        """Round-trip seconds of ``n`` empty StepCommands through every rank's channel and step
        executor (nothing to run: pure control-plane cost at this TP size). Reports are checked
        for the right step and rank; they are not for the coordinator core."""
        out = []
        with self._lock:
            for i in range(n):
                cmds = [StepCommand(-1 - i, Rank(r), ()) for r in range(len(self.pairs))]
                t0 = time.perf_counter()
                for pair, cmd in zip(self.pairs, cmds):
                    pair.send(cmd, timeout)
                reports, _, _ = self._gather(timeout)
                out.append(time.perf_counter() - t0)
                if [(r.step, r.rank) for r in reports] != [(c.step, c.rank) for c in cmds]:
                    raise StateError(f"probe reports out of order: {reports}")
        return out

    def _gather(self, timeout: float) -> tuple[list, list[float], list[float]]:
        """One report per rank, taken in whatever order they arrive, so that a dead rank is
        noticed at once (``ChannelPeerLostError``) even while a live one is blocked in a
        collective waiting for it; with each report's ``perf_counter`` stamps (found, loaded)
        for the step trace. ``ChannelTimeoutError`` after ``timeout`` s."""
        pairs = self.pairs
        reports: list = [None] * len(pairs)
        found = [0.0] * len(pairs)
        loaded = [0.0] * len(pairs)
        deadline = time.monotonic() + timeout
        turn = -1
        while True:
            missing = []
            for i, pair in enumerate(pairs):  # take every report already there
                if reports[i] is None:
                    if pair.inbox.pending():
                        reports[i] = pair.recv(0)
                        found[i], loaded[i] = pair.ready_t, time.perf_counter()
                    else:
                        missing.append(i)
            if not missing:
                return reports, found, loaded
            if time.monotonic() >= deadline:
                raise ChannelTimeoutError(f"no step report from ranks {missing} after {timeout} s")
            # wait on one missing channel (in turn: each peer's liveness gets checked), waking
            # for any other: a rank that reports first is loaded while the slower one still
            # works, off the step's critical path
            turn += 1
            k = missing[turn % len(missing)]
            pairs[k].inbox.wait_pending(
                REPORT_POLL_S, tuple(pairs[i].inbox for i in missing if i != k))

    def close(self) -> None:
        for pair in self.pairs:
            pair.close()
        self.pairs = []
