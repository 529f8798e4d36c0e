"""Driver-facing record of one request (pure ring), kept by the coordinator actor beside the core:
progress, outcome, landing and hot-buffer statistics, the summary dict ``ReplicaCoordinator.wait``
returns, and the ``RecordBook`` that holds a replica's records from submit until they are
taken."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from hisparse_ray.errors import DuplicateRequestError, StateError, UnknownRequestError


@dataclass
class RequestRecord:
    """Driver-facing progress of one request (times from ``time.monotonic`` in the actor)."""

    request_id: str
    prompt_len: int
    max_new_tokens: int
    submitted: float
    landed: float | None = None
    finished: float | None = None
    target: str | None = None
    tokens: tuple[int, ...] = ()  # generated tokens
    finish_reason: str | None = None
    error: BaseException | None = None
    hot_hits: int = 0
    hot_misses: int = 0
    landing_bytes: int = 0
    landing_s: float = 0.0  # after prefill: WRITEs, notifications, staging copies, key install
    landing_data_s: float = 0.0  # data movement only: NIXL WRITEs + staging copies
    landing_path: str = ""
    abort_requested: bool = False
    discard: bool = False  # aborted by a caller that will not collect it: drop when done
    stream: bool = False  # its new tokens are handed out after every step (``RecordBook.fresh``)
    stop_ids: frozenset = frozenset()  # sampling one of these finishes it ("stop")
    stopped: bool = False  # finished by a stop id
    generated: list = field(default_factory=list)  # tokens so far, as the steps report them
    pushed: int = 0  # of ``generated``: handed to the front end (streams)
    first_token: float | None = None
    last_token: float | None = None

    def add_token(self, token: int, now: float) -> float:
        """A decode step sampled ``token`` at ``now``; returns the time since the previous token
        (since submission for the first: the time to first token)."""
        self.generated.append(token)
        since = self.last_token if self.last_token is not None else self.submitted
        if self.first_token is None:
            self.first_token = now
        self.last_token = now
        return now - since

    @property
    def done(self) -> bool:
        return self.finished is not None

    def summary(self) -> dict:
        decode_s = (self.finished - self.landed) if self.finished and self.landed else None
        n = len(self.tokens)
        looked = self.hot_hits + self.hot_misses
        return {
            "request_id": self.request_id, "prompt_len": self.prompt_len, "target": self.target,
            "generated": n, "tokens": list(self.tokens), "finish_reason": self.finish_reason,
            "error": repr(self.error) if self.error else None,
            "error_type": type(self.error).__name__ if self.error else None,
            "latency_s": (self.finished - self.submitted) if self.finished else None,
            "decode_tokens_per_s": (n / decode_s) if decode_s else None,
            "hot_hit_rate": (self.hot_hits / looked) if looked else None,
            "landing_bytes": self.landing_bytes, "landing_s": self.landing_s,
            "landing_data_s": self.landing_data_s,
            "landing_path": self.landing_path,
            "ttft_s": (self.first_token - self.submitted) if self.first_token else None,
        }


TAKEN_MEMORY = 1 << 16  # ids of dropped records still refused as duplicates


class RecordBook(Mapping):
    """The request records of one coordinator (a read-only mapping id -> record) and their life:
    ``add`` (in flight) -> ``finished`` (done, kept) -> dropped by ``take`` / ``forget``, or at
    once when done if the request was ``discard``-ed. Dropped ids are remembered (the last
    ``memory`` of them) and refused by ``add``: a rank may still hold a pending release or a
    cancelled landing under an id, so an id must not come back. Not thread-safe: the
    coordinator calls it under its lock. ``check()`` asserts the invariants."""

    def __init__(self, memory: int = TAKEN_MEMORY) -> None:
        if memory < 0:
            raise ValueError(f"memory must be >= 0, got {memory}")
        self.memory = memory
        self._records: dict[str, RequestRecord] = {}
        self._done: dict[str, None] = {}  # done, not yet dropped, in finish order
        self._gone: dict[str, None] = {}  # dropped ids, oldest first
        self._fresh: dict[str, None] = {}  # streams with tokens not yet handed out

    # Mapping
    def __getitem__(self, rid: str) -> RequestRecord:
        return self._records[rid]

    def __iter__(self):
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    @property
    def in_flight(self) -> int:
        return len(self._records) - len(self._done)

    def is_done(self, rid: str) -> bool:
        """Done and still held (not taken or forgotten)."""
        return rid in self._done

    def is_new(self, rid: str) -> bool:
        """Neither held nor among the remembered dropped ids."""
        return rid not in self._records and rid not in self._gone

    def add(self, rec: RequestRecord) -> None:
        if not self.is_new(rec.request_id):
            raise DuplicateRequestError(rec.request_id)
        self._records[rec.request_id] = rec

    def finished(self, rid: str) -> None:
        """The record's ``finished`` was just set: it is done (dropped now if discarded)."""
        rec = self._records[rid]
        assert rec.done, f"{rid} finished() before its record was marked done"
        self._done[rid] = None
        if rec.discard:
            self._drop([rid])

    def discard(self, rid: str) -> None:
        """Nobody will collect ``rid``: drop it as soon as it is done (now if it is)."""
        self._records[rid].discard = True
        if rid in self._done:
            self._drop([rid])

    def token_added(self, rid: str) -> None:
        """A step added a token to ``rid``'s record; a stream's is handed out by ``take_fresh``."""
        if self._records[rid].stream:
            self._fresh[rid] = None

    def has_fresh(self, prefix: str) -> bool:
        return any(r.startswith(prefix) for r in self._fresh)

    def take_fresh(self, prefix: str) -> dict[str, list[int]]:
        """The new tokens of every stream whose id starts with ``prefix`` since its last take
        (done ones included: their summary then holds only what was not handed out yet)."""
        out = {}
        for rid in [r for r in self._fresh if r.startswith(prefix)]:
            del self._fresh[rid]
            rec = self._records.get(rid)
            if rec is not None and len(rec.generated) > rec.pushed:
                out[rid] = rec.generated[rec.pushed:]
                rec.pushed = len(rec.generated)
        return out

    def ready(self, request_ids: list[str] | None, prefix: str) -> bool:
        """Whether ``take`` would hand over anything."""
        if request_ids is None:
            return any(r.startswith(prefix) for r in self._done)
        return any(r in self._done for r in request_ids)

    def take(self, request_ids: list[str] | None, prefix: str = "",
             limit: int = 4096) -> list[RequestRecord]:
        """Drop and return the done records among ``request_ids`` (None: those whose id starts
        with ``prefix``), oldest first, at most ``limit``."""
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        picked = ([r for r in self._done if r.startswith(prefix)] if request_ids is None
                  else [r for r in request_ids if r in self._done])[:limit]
        out = [self._records[r] for r in picked]
        self._drop(picked)
        return out

    def forget(self, request_ids: list[str]) -> int:
        """Drop done records; UnknownRequestError / StateError (not done) and nothing dropped
        if any id is not a done record."""
        for rid in request_ids:
            rec = self._records.get(rid)
            if rec is None:
                raise UnknownRequestError(rid)
            if not rec.done:
                raise StateError(f"request {rid!r} is not done: abort it before forgetting it")
        self._drop(list(request_ids))
        return len(request_ids)

    def _drop(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if self._records.pop(rid, None) is not None:
                self._done.pop(rid, None)
                self._fresh.pop(rid, None)
                self._gone[rid] = None
        while len(self._gone) > self.memory:
            del self._gone[next(iter(self._gone))]

    def check(self) -> None:
        assert len(self._gone) <= self.memory
        assert all(r in self._records and self._records[r].done for r in self._done)
        assert all(r in self._done for r, rec in self._records.items() if rec.done)
        assert not any(r in self._records for r in self._gone)
        assert all(r in self._records and self._records[r].stream for r in self._fresh)
