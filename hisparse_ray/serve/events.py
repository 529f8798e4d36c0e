"""A Serve replica's side of its decode replica's request events (ring 3, front door).

:class:`StreamHub` keeps one long poll open on the coordinator
(``ReplicaCoordinator.take_events``), which returns right after a decode step gave one of this
front end's streams a token, or a request of it finished: each step's tokens reach their streams
without a poll period. It hands them to the waiting requests' event loops. A second thread sends
aborts (a caller that left, a timeout, a stop string), so an abort never waits for the long poll.

Both are threads, not asyncio tasks: Ray counts actor calls made from a request's task (and from
asyncio tasks it spawned) as that request's children and cancels them with it, so a cancelled
request would take the shared poll down. Either thread failing fails every waiter with a typed
error (a waiter never waits on a dead thread: ``Waiter.get`` checks the hub while it waits).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any

from hisparse_ray.errors import StateError, UnknownRequestError

log = logging.getLogger(__name__)

POLL_S = 1.0  # the longest wait of one take_events call (a shutdown is noticed within it)
WATCH_S = 5.0  # a waiter checks this often that the hub still runs


@dataclass
class Waiter:
    """One request in flight: the hub ``put``s ("tokens", new tokens) (streams only), then
    ("done", (summary, error)) or ("error", exception), onto the request's own loop."""

    loop: asyncio.AbstractEventLoop
    stream: bool
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    seen: int = 0  # tokens put so far (hub thread only)

    def put(self, item: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop closed: nobody waits any more
            pass


class StreamHub:
    """The poll and abort threads of one front end (request ids starting with ``prefix``) on the
    coordinator ``coord``. ``register`` before submitting (the request may finish at once),
    ``abort`` when the caller leaves, ``close`` at shutdown."""

    def __init__(self, coord: Any, prefix: str) -> None:
        self.coord, self.prefix = coord, prefix
        self._lock = threading.Lock()
        self._waiters: dict[str, Waiter] = {}
        self._aborts: queue.SimpleQueue = queue.SimpleQueue()
        self.failed: BaseException | None = None
        self._closed = threading.Event()
        self._threads = [threading.Thread(target=self._guard, args=(fn,), name=name, daemon=True)
                         for fn, name in ((self._poll, "hisparse-events"),
                                          (self._send_aborts, "hisparse-aborts"))]
        for t in self._threads:
            t.start()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def alive(self) -> bool:
        return self.failed is None and all(t.is_alive() for t in self._threads)

    def register(self, rid: str, stream: bool) -> Waiter:
        if self.failed is not None:
            raise _failed(self.failed)
        if self._closed.is_set():
            raise StateError("server is shutting down")
        w = Waiter(asyncio.get_running_loop(), stream)
        with self._lock:
            self._waiters[rid] = w
        return w

    def forget(self, rid: str, abort: bool) -> None:
        """The request's caller is gone (or its submit failed): drop its waiter; ``abort``: end
        the request on the coordinator too (its blocks are freed, its record dropped)."""
        with self._lock:
            had = self._waiters.pop(rid, None) is not None
        if abort and had:
            self._aborts.put(rid)

    async def get(self, w: Waiter, timeout: float) -> tuple:
        """The waiter's next item within ``timeout`` s (``asyncio.TimeoutError`` after);
        ``StateError`` if the hub stopped meanwhile."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            left = deadline - loop.time()
            if left <= 0:
                raise asyncio.TimeoutError
            try:
                return await asyncio.wait_for(w.queue.get(), min(left, WATCH_S))
            except asyncio.TimeoutError:
                if not self.alive() and w.queue.empty():
                    raise _failed(self.failed or StateError("the front end's event threads "
                                                            "stopped")) from None

    def close(self) -> None:
        self._closed.set()
        self._aborts.put(None)
        self.fail_all(StateError("server is shutting down"))
        for t in self._threads:
            t.join(timeout=POLL_S + 5)

    def fail_all(self, err: BaseException) -> None:
        with self._lock:
            if self.failed is None:
                self.failed = err
            waiters, self._waiters = self._waiters, {}
        for w in waiters.values():
            w.put(("error", _failed(err)))

    # -- threads ---------------------------------------------------------------------------------
    def _guard(self, fn) -> None:
        try:
            fn()
        except BaseException as err:  # noqa: BLE001 - never die silently: fail every waiter
            log.exception("front end event thread failed")
            self.fail_all(StateError(f"front end event thread failed: {err!r}"))

    def _poll(self) -> None:
        import ray

        while not self._closed.is_set():
            try:
                fresh, done = ray.get(self.coord.take_events.remote(self.prefix, POLL_S))
            except Exception as err:  # noqa: BLE001 - classified below
                err = unwrap(err)
                if isinstance(err, (StateError, ray.exceptions.RayActorError)):
                    self.fail_all(err)  # the replica failed or is gone: for good
                    return
                log.warning("take_events failed (retrying): %r", err)
                self._closed.wait(0.1)
                continue
            for rid, tokens in fresh.items():
                with self._lock:
                    w = self._waiters.get(rid)
                    if w is None or not w.stream:
                        continue
                    w.seen += len(tokens)
                w.put(("tokens", tokens))
            for summary, error in done:
                with self._lock:
                    w = self._waiters.pop(summary["request_id"], None)
                if w is None:
                    continue
                rest = summary["tokens"][w.seen:]
                if w.stream and error is None and rest:
                    w.put(("tokens", rest))
                w.put(("done", (summary, error)))

    def _send_aborts(self) -> None:
        import ray

        while True:
            rid = self._aborts.get()
            if rid is None:
                return
            batch = [rid]
            while not self._aborts.empty():
                more = self._aborts.get()
                if more is None:
                    return
                batch.append(more)
            refs = [self.coord.abort.remote(r, True) for r in batch]
            for ref in refs:
                try:
                    ray.get(ref, timeout=60)
                except Exception as err:  # noqa: BLE001 - done and taken already, or gone
                    if not isinstance(unwrap(err), UnknownRequestError):
                        log.debug("abort: %r", err)


def unwrap(err: BaseException) -> BaseException:
    """The typed error inside a Ray task error (Ray wraps what an actor method raised)."""
    cause = getattr(err, "cause", None)
    return cause if isinstance(cause, BaseException) else err


def _failed(err: BaseException) -> StateError:
    """A fresh StateError naming why the replica failed (the coordinator's, when it said)."""
    return StateError(str(err) if isinstance(err, StateError) else f"replica failed: {err!r}")
