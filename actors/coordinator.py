"""The coordinator actor of one decode replica (ring 3): :class:`ReplicaCoordinator` wraps the
pure coordinator core (:class:`hisparse_ray.core.coordinator.Coordinator`), drives the decode step
loop over shared-memory channels to its co-located TP ranks
(:class:`~hisparse_ray.channel.fanout.RankChannels`), and lands admitted requests through prefill
workers (NIXL; :class:`~hisparse_ray.actors.lander.Lander`, to which it is the
:class:`~hisparse_ray.landing.context.LandingSink`). Plain class; made remote in
:mod:`hisparse_ray.actors.launch`.

Threads: Ray method calls (``submit``, ``wait``, ``metrics``...) run on the actor's thread pool;
one *step thread* emits StepCommands and applies StepReports; one *lander thread* per prefill worker
runs admissions through prefill and NIXL in FIFO order; one *metrics thread* exports
(:mod:`~hisparse_ray.actors.metrics`). The core is only touched under one lock and never while
waiting on a channel, a NIXL transfer or a Ray call.

Front ends: ``take_events`` is the long poll a serving front end keeps open: it returns as soon as
a step gave one of its streams a token (or one of its requests finished), so tokens are pushed per
decode step, not polled on a timer. A lander ends its landings through a
:class:`~hisparse_ray.actors.replica_sink.ReplicaSink`, which the actor's handle does not expose.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

import ray

from hisparse_ray.actors.lander import Lander
from hisparse_ray.actors.metrics import ReplicaMetrics, replica_snapshot, replica_view
from hisparse_ray.actors.replica_sink import ReplicaSink
from hisparse_ray.channel.fanout import RankChannels
from hisparse_ray.core.coordinator import Coordinator
from hisparse_ray.core.records import RecordBook, RequestRecord
from hisparse_ray.deploy import ReplicaSpec
from hisparse_ray.errors import (
    CapacityError, ChannelError, ConfigError, DuplicateRequestError, HiSparseError,
    InvalidRequestError, StateError, UnknownRequestError,
)
from hisparse_ray.landing.context import LandingContext
from hisparse_ray.landing.staging import StagingPool
from hisparse_ray.types import Admission, RequestId, RequestState, SamplingParams

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from hisparse_ray.actors.decode_worker import DecodeWorker
    from hisparse_ray.actors.prefill_worker import PrefillWorker

IDLE_WAIT_S = 0.02


class ReplicaCoordinator:
    """One decode replica's coordinator actor. Lifecycle: construct (spec, rank handles) -> ``start``
    (channels + step thread) -> ``add_prefill`` (NIXL metadata exchange; lander thread) ->
    ``submit`` / ``wait`` / ``result`` -> ``shutdown``.

    Invariant: a request is in exactly one of: waiting in the core, queued for landing, landing,
    decoding, done (record finished; core state freed). A failed landing releases every lease
    (``apply_landing_failed``) before the request is reported done with its typed error.

    Its landers see the replica through ``self.landing`` (a ``LandingContext``) and report through
    ``self.sink`` (a ``ReplicaSink``: ``landed``, ``landing_failed``, ``reroute``, ``fence``,
    ``abort_requested``), a plain object in this process: no handle holder can end a landing.
    """

    def __init__(self, spec: ReplicaSpec, ranks: list[ActorHandle[DecodeWorker]]) -> None:
        self.spec = spec
        self.ranks = ranks
        self.endpoints = tuple(ray.get([r.endpoint.remote() for r in ranks]))
        self.core = Coordinator(spec.core_config)
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.records = RecordBook()  # submit -> done -> taken / forgotten (see RecordBook)
        self._prompts: dict[str, list[int]] = {}
        self._sampling: dict[str, SamplingParams] = {}
        self._route: dict[str, int] = {}
        self.channels: RankChannels | None = None  # after start()
        self._landers: list[Lander] = []
        blocks = self.endpoints[0].staging_blocks
        self.staging = StagingPool(blocks) if blocks else None  # rank 0's, FIFO over all landers
        self.landing = LandingContext(spec, self.endpoints, tuple(ranks), self.staging)
        self._next_lander = 0
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._fatal: BaseException | None = None
        self._closing: str | None = None  # drain(): why new requests are refused
        self.hot_hits = self.hot_misses = 0
        self.landing_bytes = 0
        self.sink = ReplicaSink(self)
        mcfg = spec.model.dsa_config()
        anchors = len({mcfg.anchor_of(l) for l in range(mcfg.num_hidden_layers)})
        # resolver misses are counted per anchor layer; a shared layer replays its anchor's copies
        self.miss_bytes = spec.layout.bytes_per_token_layer * mcfg.num_hidden_layers / anchors
        model_name = spec.model.kind.rstrip("/").rsplit("/", 1)[-1]  # a folder: its name
        self.exporter = ReplicaMetrics(model_name, spec.replica_id, lambda: replica_snapshot(self))

    # -- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> None:
        """Open one channel pair per rank, hand the ranks their ends, start the step thread."""
        if self._thread is not None:
            raise StateError("coordinator already started")
        self.channels = RankChannels(len(self.ranks), self.spec.wait_policy())
        ray.get([r.attach_channel.remote(spec) for r, spec in zip(self.ranks, self.channels.specs)])
        self.channels.unlink()  # every rank mapped its rings
        self._thread = threading.Thread(target=self._step_loop, name="coordinator-steps", daemon=True)
        self._thread.start()
        self.exporter.start()

    def add_prefill(self, prefill: ActorHandle[PrefillWorker], host_landing: str = "auto") -> str:
        """Exchange NIXL agent metadata between ``prefill`` and every rank (both directions) and
        start a lander thread for it. ``host_landing``: "auto" (direct when the transport writes
        host memory natively from the prefill's send buffer, else staged), "direct" or "staged".
        Returns the path chosen for this peer's host landings."""
        if host_landing not in ("auto", "direct", "staged"):
            raise ValueError(f"host_landing must be auto, direct or staged, got {host_landing!r}")
        agent, md = ray.get(prefill.endpoint.remote())
        rows = ray.get(prefill.kv_row_bytes.remote())
        if rows != self.spec.layout.bytes_per_token_layer:
            raise ConfigError("kv_cache_dtype", self.spec.kv_cache_dtype,
                              f"the prefill worker sends {rows} B KV rows, this replica holds "
                              f"{self.spec.layout.bytes_per_token_layer} B rows: give both specs "
                              f"the same kv_cache_dtype")
        for ep in self.endpoints:
            ray.get(prefill.add_peer.remote(ep.metadata))
        ray.get([r.add_peer.remote(md) for r in self.ranks])
        direct = ray.get(prefill.direct_host_write.remote(self.endpoints[0].agent))
        if host_landing != "auto":
            direct = host_landing == "direct"
        if not direct and not self.endpoints[0].staging_layers:
            raise StateError("the prefill peer cannot write host memory natively and the replica "
                             "has no staging pool (staging_blocks=0)")
        lander = Lander(self.landing, self.sink, prefill, agent, direct=direct)
        self._landers.append(lander)
        lander.start()
        return lander.path

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        for lander in self._landers:
            lander.stop()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.exporter.stop()
        if self.channels is not None:
            self.channels.close()

    # -- requests ------------------------------------------------------------------------------------
    def submit(self, request_id: str, prompt: list[int], max_new_tokens: int,
               eos_token_id: int | None = None, prefill: int | None = None, *,
               sampling: SamplingParams | None = None, stop_token_ids: tuple[int, ...] = (),
               stream: bool = False) -> str:
        """Admit a request (typed error for bad input); returns "landing" or "waiting".
        ``prefill``: index of the prefill worker (in ``add_prefill`` order) that lands it; None =
        round robin. ``sampling``: how the ranks sample it (None: greedy). ``stop_token_ids``:
        sampling one of them finishes it (finish reason "stop"; the token is kept, as an
        ``eos_token_id`` is). ``stream``: hand its tokens to ``take_events`` after every step."""
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise InvalidRequestError(request_id, f"sampling={sampling!r} must be a "
                                                  f"SamplingParams")
        stops = frozenset(stop_token_ids)
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in stops):
            raise InvalidRequestError(request_id, f"stop_token_ids={stop_token_ids!r} must be "
                                                  f"ints >= 0")
        with self.lock:
            if self._fatal is not None:
                raise StateError(f"replica failed: {self._fatal!r}")
            if self._closing is not None:
                raise StateError(self._closing)
            if not self._landers:
                raise StateError("no prefill worker connected (add_prefill first)")
            if prefill is not None and not 0 <= prefill < len(self._landers):
                raise ValueError(f"prefill index {prefill} not in 0..{len(self._landers) - 1}")
            if prefill is not None and self._landers[prefill].retired is not None:
                raise StateError(f"prefill worker {prefill} ({self._landers[prefill].agent}) was "
                                 f"retired: {self._landers[prefill].retired!r}")
            if all(lander.retired is not None for lander in self._landers):
                raise StateError("every prefill worker of this replica was retired")
            rec = RequestRecord(request_id, len(prompt), max_new_tokens, time.monotonic(),
                                stream=bool(stream), stop_ids=stops)
            if not self.records.is_new(request_id):  # held, or dropped not long ago
                raise DuplicateRequestError(request_id)
            fast = self.spec.fast_path  # the ranks' static tables hold max_context positions
            if fast is not None and len(prompt) + max_new_tokens > fast.max_context:
                raise CapacityError(f"positions of request {request_id!r} (fast_path.max_context)",
                                    len(prompt) + max_new_tokens, fast.max_context)
            adm = self.core.admit(RequestId(request_id), list(prompt), max_new_tokens, eos_token_id,
                                  chain=self.spec.lookahead)
            self.records.add(rec)
            self.exporter.submitted(len(prompt))
            self._prompts[request_id] = list(prompt)
            if sampling is not None and not sampling.greedy:
                self._sampling[request_id] = sampling
            if prefill is not None:
                self._route[request_id] = prefill
            if adm is not None:
                self._dispatch(adm)
        self._wake.set()
        return "landing" if adm is not None else "waiting"

    def _dispatch(self, adm: Admission) -> None:
        """(lock held) Queue an admitted request on its routed lander or the next live one, round
        robin; with none left (every prefill worker retired) the request fails at once."""
        rec = self.records[adm.request_id]
        rec.target = adm.target.value
        index = self._route.pop(adm.request_id, None)
        if index is None or self._landers[index].retired is not None:
            live = [i for i, lander in enumerate(self._landers) if lander.retired is None]
            if not live:
                self._landing_failed_locked(adm.request_id, StateError(
                    "every prefill worker of this replica was retired"))
                return
            index = live[self._next_lander % len(live)]
            self._next_lander += 1
        self._landers[index].enqueue(adm, self._prompts[adm.request_id], rec.max_new_tokens,
                                     self._sampling.get(adm.request_id))

    def _landing_failed_locked(self, request_id: str, error: BaseException | None) -> None:
        rec = self.records[request_id]
        self.core.apply_landing_failed(RequestId(request_id))
        if not rec.abort_requested:  # aborted: no error (drained: the drain's error stays)
            rec.error = error
        self._collect(request_id)
        self.cond.notify_all()

    def abort(self, request_id: str, discard: bool = False) -> list[int]:
        """Finish a request now (any state before done); its leases are released as soon as
        nothing of it is in flight. Returns the tokens generated so far. ``discard``: nobody
        will collect it, drop its record once it is done (as ``forget`` would)."""
        with self.cond:
            rec = self.records.get(request_id)
            if rec is None:
                raise UnknownRequestError(request_id)
            if discard:
                self.records.discard(request_id)
            if not rec.done:
                rec.abort_requested = True
                if self.core.state(RequestId(request_id)) is not RequestState.LANDING:
                    self.core.finish(RequestId(request_id))
                    self._collect(request_id)
                # LANDING: the lander may be writing into its blocks; it finishes the request
                # (landed or failed) so no block is released under a WRITE
                self.cond.notify_all()
        self._wake.set()
        return list(rec.tokens)

    def endpoints_view(self) -> list[dict]:
        """The ranks' NIXL endpoints (agent, node, region counts) for tools and tests."""
        return [{"rank": ep.rank, "agent": ep.agent, "node_id": ep.node_id,
                 "host_regions": len(ep.host_layers), "device_regions": len(ep.device_layers),
                 "staging_regions": len(ep.staging_layers), "staging_blocks": ep.staging_blocks}
                for ep in self.endpoints]

    def wait(self, request_ids: list[str] | None = None, timeout: float | None = None) -> list[dict]:
        """Block until the requests are done (all known ones if None); returns their summaries.
        TimeoutError if not done within ``timeout`` s."""
        with self.cond:
            ids = list(self.records) if request_ids is None else list(request_ids)
            for rid in ids:
                if rid not in self.records:
                    raise UnknownRequestError(rid)
            ok = self.cond.wait_for(  # a record taken meanwhile (take_done) counts as done
                lambda: all(self.records[r].done for r in ids if r in self.records)
                or self._fatal is not None, timeout)
            for rid in ids:
                if rid not in self.records:
                    raise UnknownRequestError(rid)  # taken by take_done or forget while waiting
            if self._fatal is not None:
                raise StateError(f"replica failed: {self._fatal!r}")
            if not ok:
                raise TimeoutError(f"requests not done after {timeout} s: "
                                   f"{[r for r in ids if not self.records[r].done]}")
            return [self.records[r].summary() for r in ids]

    def result(self, request_id: str) -> list[int]:
        """Generated tokens of a done request; re-raises its typed error if it failed."""
        (summary,) = self.wait([request_id])
        rec = self.records[request_id]
        if rec.error is not None:
            raise rec.error
        return list(rec.tokens)

    def take_done(self, request_ids: list[str] | None = None, timeout: float | None = None,
                  limit: int = 4096, prefix: str = "") -> list[tuple[dict, BaseException | None]]:
        """Wait until one of ``request_ids`` (when None: of the requests whose id starts with
        ``prefix``, so several front ends can share a replica) is done, then hand over
        the done ones, oldest first and at most ``limit``, as (summary, typed error or None), and
        forget them (``forget``). ``[]`` after ``timeout`` s. This is a long-running front end's
        call (the Ray Serve deployment polls it); ``wait`` / ``result`` keep every record until
        ``forget``. Each done request is handed to exactly one caller."""
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        with self.cond:
            ids = None if request_ids is None else list(request_ids)
            for rid in ids or ():
                if rid not in self.records:
                    raise UnknownRequestError(rid)
            self.cond.wait_for(lambda: self.records.ready(ids, prefix) or self._fatal is not None,
                               timeout)
            if self._fatal is not None:
                raise StateError(f"replica failed: {self._fatal!r}")
            return [(rec.summary(), rec.error) for rec in self.records.take(ids, prefix, limit)]

    def forget(self, request_ids: list[str]) -> int:
        """Drop the records of done requests; returns how many. ``StateError`` for a request not
        done yet (abort it first), ``UnknownRequestError`` for an unknown id; on either error
        nothing is dropped. A request id stays unique for the replica's life: the ranks may still
        hold a release or a cancelled landing under it, so submitting it again is refused
        (``DuplicateRequestError``) for the last ``records.TAKEN_MEMORY`` ids dropped and unsafe after
        that (front ends use fresh ids: the Serve deployment takes uuid4s)."""
        with self.cond:
            return self.records.forget(list(request_ids))

    def take_events(self, prefix: str, timeout: float | None = None, limit: int = 4096
                    ) -> tuple[dict[str, list[int]], list[tuple[dict, BaseException | None]]]:
        """A front end's long poll: wait until a stream whose id starts with ``prefix`` has new
        tokens or a request of it is done (or ``timeout`` s), then return (the new tokens of each
        such stream since its last take, the done requests as ``take_done`` hands them over: at
        most ``limit``, records dropped). It returns right after the step that produced them: the
        step thread wakes it, so a stream's tokens arrive per decode step, not per poll period.
        ``StateError`` once the replica failed."""
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        with self.cond:
            self.cond.wait_for(lambda: self.records.has_fresh(prefix)
                               or self.records.ready(None, prefix) or self._fatal is not None,
                               timeout)
            if self._fatal is not None:
                raise StateError(f"replica failed: {self._fatal!r}")
            fresh = self.records.take_fresh(prefix)
            return fresh, [(rec.summary(), rec.error)
                           for rec in self.records.take(None, prefix, limit)]

    def drain(self, reason: str = "server is shutting down") -> int:
        """Refuse new requests with ``StateError(reason)`` and end every request in flight with
        that error (its blocks are released as ``abort`` releases them), so a front end that is
        stopping answers its clients (HTTP 503) instead of cutting them off. Returns how many
        were in flight. Idempotent."""
        with self.cond:
            self._closing = reason
            live = [rid for rid, rec in self.records.items() if not rec.done]
            for rid in live:
                self.records[rid].error = StateError(reason)
        for rid in live:
            try:
                self.abort(rid)
            except UnknownRequestError:  # taken meanwhile
                pass
        return len(live)

    def failure(self) -> str | None:
        """Why the replica cannot serve (fenced, a rank lost, every prefill worker retired), or
        None while it serves. Serve's health check asks it (a failed replica is replaced)."""
        with self.lock:
            if self._fatal is not None:
                return repr(self._fatal)
            if self._landers and all(lander.retired is not None for lander in self._landers):
                return (f"every prefill worker of this replica was retired: "
                        f"{[repr(lander.retired) for lander in self._landers]}")
            return None

    def progress(self) -> dict[str, tuple[int, int, bool]]:
        """request id -> (generated so far, max_new_tokens, done)."""
        with self.lock:
            out = {}
            for rid, rec in self.records.items():
                n = len(rec.tokens)
                if not rec.done and rec.landed is not None:
                    try:
                        n = len(self.core.generated(RequestId(rid)))
                    except UnknownRequestError:
                        pass
                out[rid] = (n, rec.max_new_tokens, rec.done)
            return out

    def metrics(self) -> dict:
        """Core counters, hot-buffer hits/misses, host pool use, step timings, landings
        (``actors.metrics.replica_view``)."""
        return replica_view(self)

    def get_step_log(self) -> list[tuple[int, float]]:
        """(step, command-to-last-report seconds) of the recent steps (benchmarks)."""
        return list(self.channels.log) if self.channels is not None else []

    def get_landing_trace(self) -> list[tuple[str, float, float, float]]:
        """(request id, prefill done, first chunk issued, every call ended) ``perf_counter``
        stamps of the recent landings of every lander (benchmarks; see ``DecodeWorker`` and
        ``PrefillWorker.get_landing_trace``)."""
        return [t for lander in self._landers for t in list(lander.trace)]  # copy: see metrics

    def get_step_trace(self) -> list[tuple]:
        """(step, start, command sent, report found per rank, loaded per rank)
        ``perf_counter`` stamps of the recent steps (benchmarks; see ``DecodeWorker``)."""
        return list(self.channels.trace) if self.channels is not None else []

    def probe_control_plane(self, n: int) -> list[float]:
        """Round-trip seconds of ``n`` empty StepCommands through every rank's channel and step
        executor (pure control-plane cost at this TP size; ``RankChannels.probe``)."""
        if self.channels is None:
            raise StateError("probe_control_plane() before start()")
        return self.channels.probe(n, self.spec.step_timeout_s)

    # -- the step loop -----------------------------------------------------------------------------
    def _step_loop(self) -> None:
        """Take, send and gather steps until stopped or fenced. With ``ReplicaSpec.lookahead``
        command N + 1 is taken and sent before step N's reports are gathered, so the
        coordinator's work and the ranks' input fill run while the GPUs compute step N; a
        command holding a row that does not chain, or none, is gathered before the next is
        taken (without lookahead: every command). Nothing is left in flight when it returns."""
        timeout = self.spec.step_timeout_s
        inflight = None  # (step, whether the next command may be taken before its reports)
        try:
            while True:
                cmd = None
                live = not self._stop.is_set() and self._fatal is None  # a fence stops steps
                if live and (inflight is None or inflight[1]):
                    with self.lock:
                        for adm in self.core.poll_waiting():
                            self._dispatch(adm)
                        cmd = self.core.take_command()
                        chains = (self.spec.lookahead and cmd is not None and bool(cmd.batch)
                                  and self.core.rows_chain(cmd))
                    if cmd is not None:
                        self.channels.send(cmd, timeout)
                gathered = inflight is not None
                if gathered:
                    reports = self.channels.gather(inflight[0], timeout)
                    inflight = None
                    with self.cond:
                        for rep in reports:
                            self.core.apply_report(rep)
                        self._account(reports[0])
                        self.cond.notify_all()
                if cmd is not None:
                    inflight = (cmd.step, chains)
                elif not live:
                    return
                elif not gathered:  # nothing to send, nothing in flight
                    self._wake.wait(IDLE_WAIT_S)
                    self._wake.clear()
        except (ChannelError, HiSparseError) as err:
            with self.cond:
                self._fatal = err
                self.cond.notify_all()
        except BaseException as err:  # pragma: no cover - surfaced to every waiter
            with self.cond:
                self._fatal = err
                self.cond.notify_all()
            raise

    def _account(self, report) -> None:
        """(lock held) After a step, from rank 0's report (a token per batch row): each request's
        new token (streams, latencies, stop ids), hot-buffer counters, finished requests."""
        now = time.monotonic()
        for rid, tok in report.sampled:
            rec = self.records.get(rid)
            if rec is None or rec.done:
                continue
            first = rec.first_token is None
            self.exporter.token(first, rec.add_token(tok, now))
            self.records.token_added(rid)
            if tok in rec.stop_ids and not rec.abort_requested and \
                    self.core.state(RequestId(rid)) is RequestState.RUNNING:
                rec.stopped = True
                self.core.finish(RequestId(rid))
        self.hot_hits += report.hot_hits
        self.hot_misses += report.hot_misses
        per_request = getattr(report, "hits_by_request", ())
        for rid, hits, misses in per_request:
            rec = self.records.get(rid)
            if rec is not None:
                rec.hot_hits += hits
                rec.hot_misses += misses
        for rid, _ in report.sampled:
            rec = self.records.get(rid)
            if rec is None or rec.done:
                continue
            if self.core.state(rid) in (RequestState.FINISHED, RequestState.RELEASED):
                self._collect(rid)

    def _collect(self, rid: str) -> None:
        """(lock held) Record a finished request's outcome and let the core forget it."""
        rec = self.records[rid]
        if rec.done:
            return
        view = self.core.view(RequestId(rid))
        rec.tokens = view.tokens[view.prompt_len:]
        rec.finish_reason = "abort" if rec.abort_requested else \
            "stop" if rec.stopped else view.finish_reason
        rec.finished = time.monotonic()
        self.exporter.finished(rec.finished - rec.submitted, rec.finish_reason)
        self._sampling.pop(rid, None)
        self.core.free(RequestId(rid))
        self._prompts.pop(rid, None)
        self.records.finished(rid)
