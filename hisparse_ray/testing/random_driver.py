"""Random protocol driver: a Coordinator and a ReferenceWorker under random interleavings (pure
ring). Shared by the property tests (hypothesis picks the operations) and the soak script.

Each ``op_*`` takes explicit choices (ints), so hypothesis can shrink them; ``random_op`` draws
them from an RNG. After every operation ``check`` runs ``check_invariants`` and collects the
worker's content violations.
"""

from __future__ import annotations

import random

from hisparse_ray.config import CoordinatorConfig
from hisparse_ray.core.coordinator import Coordinator
from hisparse_ray.errors import (
    CapacityError, DoubleFreeError, DuplicateRequestError, StateError,
    UnknownRankError, UnknownRequestError, UnknownTransferError,
)
from hisparse_ray.testing.reference_worker import ReferenceWorker
from hisparse_ray.types import Rank, RequestState, StepReport, TransferId


class RandomDriver:
    """Drives one coordinator; ``prefixes`` shared prompt heads make prefix hits likely."""

    def __init__(self, config: CoordinatorConfig, seed: int = 0, vocab: int = 3) -> None:
        self.cfg = config
        self.rng = random.Random(seed)
        self.coord = Coordinator(config)
        self.worker = ReferenceWorker(config, random.Random(seed + 1), vocab)
        self.prefixes = [[self.rng.randrange(vocab) for _ in range(3 * config.page_size)]
                         for _ in range(3)]
        self.landing: list[str] = []
        self.next_id = 0
        self.ops = 0

    # -- operations --------------------------------------------------------------------------------
    def op_admit(self, prefix: int, extra: int, max_new: int, chain: bool = False) -> None:
        head = self.prefixes[prefix % len(self.prefixes)]
        prompt = head[: 1 + (extra * 7) % len(head)] + [self.rng.randrange(3) for _ in range(extra)]
        if len(self.coord._waiting) > 16:
            return  # a real caller stops accepting work at some queue length too
        rid = f"r{self.next_id}"
        self.next_id += 1
        try:
            adm = self.coord.admit(rid, prompt, max_new, 2 if extra % 4 == 3 else None,
                                   chain=chain)
        except CapacityError:
            return
        self.worker.start(rid, prompt)
        if adm is not None:
            self.worker.land(adm)
            self.landing.append(rid)

    def op_poll(self) -> None:
        for adm in self.coord.poll_waiting():
            self.worker.land(adm)
            self.landing.append(adm.request_id)

    def op_landed(self, pick: int, fail: bool = False) -> None:
        if not self.landing:
            return
        rid = self.landing.pop(pick % len(self.landing))
        if fail:
            self.coord.apply_landing_failed(rid)
        else:
            self.coord.apply_landed(rid)

    def op_take(self) -> None:
        self.op_poll()
        cmd = self.coord.take_command()
        if cmd is not None:
            self.worker.execute(cmd)

    def op_report(self, rank: int, flush: bool = False) -> None:
        rank %= self.cfg.tp_size
        rep = self.worker.flush(rank) if flush else self.worker.report(rank)
        if rep is not None:
            self.coord.apply_report(rep)

    def _ids(self, states: tuple[RequestState, ...]) -> list[str]:
        return [rid for rid, r in self.coord._requests.items() if r.state in states]

    def op_finish(self, pick: int) -> None:
        ids = self._ids((RequestState.WAITING, RequestState.RUNNING))
        if ids:
            self.coord.finish(ids[pick % len(ids)])

    def op_free(self, pick: int) -> None:
        ids = [r for r in self._ids((RequestState.FINISHED, RequestState.RELEASED))
               if not self.coord._requests[r].forget_when_released]
        if ids:
            self.coord.free(ids[pick % len(ids)])
        released = self._ids((RequestState.RELEASED,))
        for rid in released[:-8]:  # keep the record count bounded, like a real caller
            self.coord.free(rid)

    def op_restore(self, pick: int) -> None:
        ids = [r for r in self._ids((RequestState.RUNNING,))
               if self.coord.view(r).tier.value == "host"]
        if ids:
            try:
                self.coord.restore(ids[pick % len(ids)])
            except StateError:
                pass  # not stable right now (step or backup in flight): a legal refusal

    def op_bad(self, kind: int) -> None:
        """Bad input must raise its typed error and leave the state unchanged."""
        before = self.snapshot()
        c = self.coord
        kind %= 6
        expected: type[Exception] = {
            0: UnknownRequestError, 1: UnknownRankError,
            2: StateError if c.step == 0 else UnknownTransferError, 3: DuplicateRequestError,
            4: DoubleFreeError, 5: CapacityError}[kind]
        try:
            if kind == 0:
                c.finish("no-such-request")
            elif kind == 1:
                c.apply_report(StepReport(max(c.step, 1), Rank(self.cfg.tp_size)))
            elif kind == 2:
                c.apply_report(StepReport(max(c.step, 1), Rank(0), completed=(TransferId(10**9),)))
            elif kind == 3:
                ids = c.request_ids()
                if not ids:
                    return
                c.admit(ids[0], [1], 1)
            elif kind == 4:
                gone = next(iter(c._freed), None)
                if gone is None:
                    return
                c.free(gone)
            else:
                c.admit("huge", [0], (self.cfg.num_device_blocks + self.cfg.num_host_blocks + 1)
                        * self.cfg.page_size)
        except expected:
            pass
        else:
            raise AssertionError(f"bad input kind {kind} was accepted")
        assert self.snapshot() == before, f"bad input kind {kind} changed the state"

    def snapshot(self) -> tuple:
        c = self.coord
        return (c.counters, c.step, tuple(c.view(r) for r in c.request_ids()),
                len(c.book.pending), c.host.available(), c.device.num_free)

    # -- random mode -------------------------------------------------------------------------------
    def random_op(self) -> None:
        r = self.rng.random()
        g = self.rng.randrange(1 << 30)
        if r < 0.10:
            self.op_admit(g, g % 5, 1 + g % 6, chain=bool(g >> 7 & 1))  # about half chain
        elif r < 0.16:
            self.op_poll()
        elif r < 0.26:
            self.op_landed(g, fail=g % 17 == 0)
        elif r < 0.50:
            self.op_take()
        elif r < 0.85:
            self.op_report(g, flush=g % 9 == 0)
        elif r < 0.88:
            self.op_finish(g)
        elif r < 0.94:
            self.op_free(g)
        elif r < 0.97:
            self.op_restore(g)
        else:
            self.op_bad(g)
        self.ops += 1

    def drain(self, rounds: int = 1000) -> None:
        """Finish every request and deliver every outstanding ack and token; afterwards no lease
        may be left (the caller checks the pools)."""
        for rid in self._ids((RequestState.WAITING, RequestState.LANDING, RequestState.RUNNING)):
            self.coord.finish(rid)
        self.landing.clear()
        for _ in range(rounds):
            self.op_take()
            for rank in range(self.cfg.tp_size):
                self.op_report(rank, flush=True)
            if not self.coord.book.pending and not self.worker.due and not any(
                    self.coord.view(r).state is RequestState.FINISHED for r in self.coord.request_ids()):
                return
        raise AssertionError("drain did not converge")

    def settle(self, idle_rounds: int = 3, max_rounds: int = 100_000) -> list[str]:
        """Liveness: stop arrivals, then land every admission and deliver every ack and token
        (no aborts) until every request is released. Every request still unfinished at the
        start must finish on its own (``length`` or ``eos``). Returns the violations: a round
        repeated ``idle_rounds`` times with no step, transfer or request changing while requests
        remain is a deadlock, reported with the stuck requests' states; invariants are checked
        after every round."""
        c = self.coord
        open_ids = self._ids((RequestState.WAITING, RequestState.LANDING, RequestState.RUNNING))
        idle, last = 0, None
        out: list[str] = []
        for _ in range(max_rounds):
            self.op_poll()
            while self.landing:
                self.op_landed(0)
            self.op_take()
            for rank in range(self.cfg.tp_size):
                self.op_report(rank, flush=True)
            out += self.check()
            if out:
                return out
            live = [r for r in c.request_ids() if c.view(r).state is not RequestState.RELEASED]
            if not live and not c.book.pending and not self.worker.due:
                break
            now = (c.step, len(c.book.pending), tuple(c.view(r) for r in live))
            idle = idle + 1 if now == last else 0
            last = now
            if idle >= idle_rounds:
                return [f"deadlock: {[(r, c.view(r).state.value) for r in live]} made no "
                        f"progress; counters {c.counters}"]
        else:
            return [f"no end after {max_rounds} rounds; counters {c.counters}"]
        for rid in open_ids:
            reason = c.view(rid).finish_reason
            if reason not in ("length", "eos"):
                out.append(f"{rid} finished with {reason!r}, not on its own")
        return out

    def check(self) -> list[str]:
        """Run every invariant; returns the violations (empty when all hold)."""
        out = list(self.worker.violations)
        self.worker.violations.clear()
        try:
            self.coord.check_invariants()
        except AssertionError as e:
            out.append(f"invariant: {e}")
        return out

