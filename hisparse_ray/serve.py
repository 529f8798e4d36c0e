"""Ray Serve front end (ring 3): one Serve replica owns one HiSparse deployment (a prefill worker
and a decode replica: coordinator + TP ranks) and serves ``generate`` over HTTP and handles.

    from ray import serve
    from hisparse_ray.serve import build_app
    handle = serve.run(build_app({"tp": 2, "max_new_tokens": 16}))
    out = handle.generate.remote(prompt="hello", max_new_tokens=8).result()

    for chunk in handle.options(stream=True).generate_stream.remote(prompt="hello"):
        print(chunk["text"])                     # new tokens as they decode; last: the result

    # or: hisparse-ray serve --port 8000
    # curl -d '{"prompt": "hello", "max_new_tokens": 8}' localhost:8000/
    # curl -N -d '{"prompt": "hello", "stream": true}' localhost:8000/      (JSON lines)

Requests from many clients run concurrently and share the decode steps (the coordinator batches
them). Each request gets a fresh id (this front end's prefix + a uuid4); one poller thread per
Serve replica collects its finished requests with ``Coordinator.take_done``, which also drops
their records, so a long-running server keeps no per-request state after answering. A request
whose caller goes away (HTTP client disconnect, ``DeploymentResponse.cancel()``) or that outlives
``request_timeout_s`` is aborted on the coordinator, which releases its device and host blocks.
Serve's health check asks the coordinator: a replica that failed (fenced, rank lost) reports
unhealthy and Serve replaces it, and a Serve replica that stops shuts its HiSparse deployment
down.

``num_replicas`` > 1 gives each Serve replica its own prefill worker and decode replica (each
decode replica is one placement group: its ranks share ``/dev/shm`` and CUDA IPC); Serve spreads
requests over them (tests/e2e/test_serve_replicas.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hisparse_ray.deploy import DeployOptions, PrefillSpec, ReplicaSpec
from hisparse_ray.errors import (
    CapacityError, ConfigError, HiSparseError, InvalidRequestError, StateError, TransferError,
)

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from hisparse_ray.actors.coordinator import ReplicaCoordinator

log = logging.getLogger(__name__)

POLL_S = 1.0  # the poller's longest wait on the coordinator (a shutdown is noticed within it)
_REQUEST_KEYS = ("prompt", "ids", "max_new_tokens", "eos_token_id", "stream")
STREAM_POLL_S = 0.05  # while a stream is open: how often its new tokens are fetched


class HiSparseServer:
    """The Serve deployment class (plain; ``build_app`` wraps it). ``replica_spec`` /
    ``prefill_spec``: the HiSparse deployment it launches (``options.specs()``); ``options``: the
    deployment's options (request defaults and limits, timeouts, node pinning)."""

    def __init__(self, replica_spec: ReplicaSpec, prefill_spec: PrefillSpec,
                 options: DeployOptions | None = None) -> None:
        from hisparse_ray.actors import launch

        self.options = options if options is not None else DeployOptions()
        self.vocab_size = int(replica_spec.model.dsa_config().vocab_size)
        self.tokenizer = replica_spec.model.tokenizer()
        t0 = time.monotonic()
        self.replica = launch.launch_deployment(
            replica_spec, prefill_spec, decode_resources=self.options.decode_resources,
            prefill_resources=self.options.prefill_resources)
        log.info("HiSparse deployment up in %.1f s (TP %d)", time.monotonic() - t0,
                 replica_spec.tp_size)
        self._coord = self.replica.coordinator
        self._lock = threading.Lock()
        self._waiters: dict[str, _Waiter] = {}
        self._aborts: list[str] = []
        self._failed: BaseException | None = None
        self._closed = threading.Event()
        self._served = 0
        self._prefix = f"serve-{uuid.uuid4().hex[:12]}-"  # this front end's request ids
        # A thread, not an asyncio task: Ray counts calls made from a request's task (and from
        # asyncio tasks it spawned) as that request's children and cancels them with it, so a
        # cancelled request would take the shared poll (and its own abort) down with it.
        self._poller = threading.Thread(target=self._poll, name="hisparse-serve-poller",
                                        daemon=True)
        self._poller.start()

    # -- requests ------------------------------------------------------------------------------
    def _prompt_ids(self, prompt: Any, ids: Any) -> list[int]:
        if (prompt is None) == (ids is None):
            raise InvalidRequestError("-", "give exactly one of 'prompt' (text) or 'ids' "
                                           "(token ids)")
        if prompt is not None:
            if not isinstance(prompt, str) or not prompt:
                raise InvalidRequestError("-", f"prompt={prompt!r} must be a non-empty str")
            if self.tokenizer is None:
                raise InvalidRequestError("-", "this model has no built-in tokenizer: send 'ids'")
            return self.tokenizer.encode(prompt)
        if not isinstance(ids, (list, tuple)) or not ids:
            raise InvalidRequestError("-", f"ids={ids!r:.80} must be a non-empty list of "
                                           f"token ids")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise InvalidRequestError("-", f"token id {t!r} is not an int in "
                                               f"[0, {self.vocab_size})")
        return list(ids)

    def _max_new(self, value: Any) -> int:
        if value is None:
            return self.options.max_new_tokens
        limit = self.options.max_new_tokens_limit
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
            raise InvalidRequestError("-", f"max_new_tokens={value!r} must be an int in "
                                           f"[1, {limit}]")
        return value

    async def generate(self, prompt: str | None = None, ids: list[int] | None = None,
                       max_new_tokens: int | None = None, eos_token_id: int | None = None,
                       timeout_s: float | None = None) -> dict:
        """Generate for one prompt (``prompt`` text through the tiny model's byte tokenizer, or
        token ``ids``). Returns the tokens (and text), finish reason, latency, decode tokens/s,
        hot-buffer hit rate and landing target. Raises the request's typed error."""
        rid, w = await self._start(prompt, ids, max_new_tokens, eos_token_id, stream=False)
        async for item in self._follow(rid, w, timeout_s):
            if "done" in item:
                return item
        raise AssertionError("unreachable: _follow ends with the done item or raises")

    async def generate_stream(self, prompt: str | None = None, ids: list[int] | None = None,
                              max_new_tokens: int | None = None,
                              eos_token_id: int | None = None, timeout_s: float | None = None):
        """``generate``, streamed (``handle.options(stream=True).generate_stream.remote(...)``):
        yields ``{"tokens": [...]}`` (plus ``"text"``) as the decode steps produce them, at most
        every ``STREAM_POLL_S``, then ``generate``'s result with ``"done": True``. The chunks'
        tokens concatenate to the result's tokens."""
        rid, w = await self._start(prompt, ids, max_new_tokens, eos_token_id, stream=True)
        async for item in self._follow(rid, w, timeout_s):
            yield item

    async def _start(self, prompt, ids, max_new_tokens, eos_token_id, stream: bool):
        """Validate, register a waiter (before submitting: the poller may see the request
        finish at once) and submit. Raises the typed error of a refused request."""
        tokens = self._prompt_ids(prompt, ids)
        max_new = self._max_new(max_new_tokens)
        if self._failed is not None:
            raise _replica_failed(self._failed)
        if self._closed.is_set():
            raise StateError("server is shutting down")
        rid = self._prefix + uuid.uuid4().hex
        w = _Waiter(asyncio.get_running_loop(), asyncio.Queue(), stream, len(tokens),
                    prompt is not None)
        with self._lock:
            self._waiters[rid] = w
        try:
            await self._coord.submit.remote(rid, tokens, max_new, eos_token_id)
        except BaseException as err:
            with self._lock:
                self._waiters.pop(rid, None)
                if isinstance(err, asyncio.CancelledError):  # the submit may have run
                    self._aborts.append(rid)
            raise _unwrap(err) from None
        return rid, w

    async def _follow(self, rid: str, w: "_Waiter", timeout_s: float | None):
        """Yield the request's token chunks (streams only) and its final result; a caller that
        leaves (cancellation, generator closed) or a timeout aborts the request, which frees
        its blocks and drops its record once done (a result that wins the race is dropped)."""
        timeout = self.options.request_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        finished = False
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise asyncio.TimeoutError
                kind, payload = await asyncio.wait_for(w.queue.get(), left)
                if kind == "error":
                    finished = True
                    raise payload
                if kind == "tokens":
                    yield self._chunk(w, payload)
                    continue
                summary, error = payload
                finished = True
                if error is not None:
                    raise error
                self._served += 1
                yield self._result(rid, w, summary)
                return
        except asyncio.TimeoutError:
            raise TimeoutError(f"request {rid} not done after {timeout} s (aborted)") from None
        finally:
            if not finished:
                with self._lock:
                    if self._waiters.pop(rid, None) is not None:
                        self._aborts.append(rid)

    def _chunk(self, w: "_Waiter", tokens: list[int]) -> dict:
        out: dict[str, Any] = {"tokens": tokens}
        if w.text:
            out["text"] = self.tokenizer.decode(tokens)
        return out

    def _result(self, rid: str, w: "_Waiter", summary: dict) -> dict:
        out = {
            "done": True, "request_id": rid, "tokens": summary["tokens"],
            "prompt_tokens": w.prompt_len, "finish_reason": summary["finish_reason"],
            "latency_s": summary["latency_s"],
            "decode_tokens_per_s": summary["decode_tokens_per_s"],
            "hot_hit_rate": summary["hot_hit_rate"], "landing_target": summary["target"],
        }
        if w.text:
            out["text"] = self.tokenizer.decode(summary["tokens"])
        return out

    def _poll(self) -> None:
        """Poller thread: send the aborts, take finished requests (``take_done`` long poll;
        short while a stream is open, then the streams' new tokens in one call) and hand
        everything to the waiters' event loops, until shutdown or the replica fails."""
        import ray

        pending: list = []  # abort calls in flight (their errors are read, not left unhandled)
        while not self._closed.is_set():
            with self._lock:
                aborts, self._aborts = self._aborts, []
                streams = {rid: w.seen for rid, w in self._waiters.items() if w.stream}
            pending += [self._coord.abort.remote(rid, True) for rid in aborts]
            if pending:
                done, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
                for ref in done:
                    try:
                        ray.get(ref)
                    except Exception as err:  # noqa: BLE001 - done and taken already
                        log.debug("abort: %r", err)
            try:
                got = ray.get(self._coord.take_done.remote(
                    None, STREAM_POLL_S if streams else POLL_S, 4096, self._prefix))
                partial = ray.get(self._coord.partial_tokens.remote(streams)) if streams else {}
            except Exception as err:  # noqa: BLE001 - classified below
                err = _unwrap(err)
                if isinstance(err, (StateError, ray.exceptions.RayActorError)):
                    self._fail_all(err)  # the replica failed or is gone: for good
                    return
                log.warning("take_done failed (retrying): %r", err)
                self._closed.wait(0.1)
                continue
            for rid, tokens in partial.items():
                with self._lock:
                    w = self._waiters.get(rid)
                    if w is None or w.seen != streams[rid]:
                        continue
                    w.seen += len(tokens)
                w.put(("tokens", tokens))
            for summary, error in got:
                with self._lock:
                    w = self._waiters.pop(summary["request_id"], None)
                if w is None:
                    continue
                rest = summary["tokens"][w.seen:]
                if w.stream and error is None and rest:
                    w.put(("tokens", rest))
                w.put(("done", (summary, error)))

    def _fail_all(self, err: BaseException) -> None:
        with self._lock:
            self._failed = err
            waiters, self._waiters = self._waiters, {}
        for w in waiters.values():
            w.put(("error", _replica_failed(err)))

    # -- HTTP ----------------------------------------------------------------------------------
    async def __call__(self, request) -> Any:
        """POST a JSON object: ``prompt`` or ``ids``, optional ``max_new_tokens``,
        ``eos_token_id`` and ``stream``. 200 with ``generate``'s result (``stream``: JSON lines,
        ``generate_stream``'s chunks); 400 for a bad request (the message names the value), 413
        when the request can never fit the pools, 503 when the replica failed or the landing
        failed, 504 on timeout."""
        from starlette.responses import JSONResponse, StreamingResponse

        try:
            try:
                body = await request.json()
            except Exception as err:  # noqa: BLE001 - any parse failure is the client's
                raise InvalidRequestError("-", f"body is not JSON: {err}") from None
            if not isinstance(body, dict):
                raise InvalidRequestError("-", f"body must be a JSON object, got {body!r:.80}")
            unknown = sorted(set(body) - set(_REQUEST_KEYS))
            if unknown:
                raise InvalidRequestError("-", f"unknown keys {unknown}; allowed: "
                                               f"{list(_REQUEST_KEYS)}")
            stream = body.pop("stream", False)
            if not isinstance(stream, bool):
                raise InvalidRequestError("-", f"stream={stream!r} must be true or false")
            if not stream:
                return await self.generate(**body)
            rid, w = await self._start(body.get("prompt"), body.get("ids"),
                                       body.get("max_new_tokens"), body.get("eos_token_id"),
                                       stream=True)
            return StreamingResponse(self._ndjson(rid, w), media_type="application/x-ndjson")
        except BaseException as err:  # noqa: BLE001 - mapped to a status below
            status = _status(err)
            if status is None:
                raise
            return JSONResponse({"error": str(err), "error_type": type(err).__name__},
                                status_code=status)

    async def _ndjson(self, rid: str, w: "_Waiter"):
        """A stream's chunks as JSON lines; an error after the stream started (the status is
        sent) becomes a last line ``{"error": ..., "error_type": ...}``."""
        try:
            async for item in self._follow(rid, w, None):
                yield json.dumps(item) + "\n"
        except (HiSparseError, TimeoutError) as err:
            yield json.dumps({"error": str(err), "error_type": type(err).__name__}) + "\n"

    # -- operations ----------------------------------------------------------------------------
    async def metrics(self) -> dict:
        """The coordinator's metrics plus this front end's counts."""
        m = await self._coord.metrics.remote()
        m["serve"] = {"waiting": len(self._waiters), "served": self._served,
                      "poller_alive": self._poller.is_alive(),
                      "failed": repr(self._failed) if self._failed else None}
        return m

    def coordinator(self) -> ActorHandle[ReplicaCoordinator]:
        """The decode replica's coordinator actor handle (operations and tests)."""
        return self._coord

    def actors(self) -> dict[str, Any]:
        """Every actor handle of this replica's HiSparse deployment (operations and tests)."""
        return {"coordinator": self._coord, "ranks": list(self.replica.ranks),
                "prefill": list(self.replica.prefill)}

    async def check_health(self) -> None:
        """Serve's health check: unhealthy once the replica failed (Serve replaces it)."""
        if self._failed is not None:
            raise RuntimeError(f"HiSparse {_replica_failed(self._failed)}")
        failed = await self._coord.failure.remote()
        if failed is not None:
            raise RuntimeError(f"HiSparse replica failed: {failed}")

    def shutdown(self) -> None:
        """Stop the HiSparse deployment (idempotent); waiting requests get StateError."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._fail_all(StateError("server is shutting down"))
        self._poller.join(timeout=2 * POLL_S + 5)
        self.replica.shutdown()

    def __del__(self) -> None:  # Serve calls it when the replica stops
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass


@dataclass
class _Waiter:
    """One request in flight through this front end. The poller thread ``put``s ("tokens",
    new tokens) (streams only), then ("done", (summary, error)), or ("error", exception)."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    stream: bool
    prompt_len: int
    text: bool  # the prompt came as text: answer with text too
    seen: int = 0  # tokens already put (poller thread, under the front end's lock)

    def put(self, item: tuple) -> None:
        """From any thread, onto the waiter's own loop (a closed loop: nobody waits)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            pass


def _replica_failed(err: BaseException) -> StateError:
    """A fresh StateError naming why the replica failed (the coordinator's, when it said)."""
    return StateError(str(err) if isinstance(err, StateError) else f"replica failed: {err!r}")


def _unwrap(err: BaseException) -> BaseException:
    """The typed error inside a Ray task error (Ray wraps what an actor method raised)."""
    cause = getattr(err, "cause", None)
    return cause if isinstance(cause, BaseException) else err


def _status(err: BaseException) -> int | None:
    err = _unwrap(err)
    if isinstance(err, CapacityError):
        return 413
    if isinstance(err, (InvalidRequestError, ConfigError)):
        return 400
    if isinstance(err, (StateError, TransferError)):
        return 503
    if isinstance(err, TimeoutError):
        return 504
    if isinstance(err, HiSparseError):
        return 500
    return None


def build_app(options: DeployOptions | Mapping[str, Any] | None = None):
    """A Serve application of ``HiSparseServer`` (``serve.run(build_app({...}))``, or
    ``serve run hisparse_ray.serve:build_app tp=2 ...``). ``options``: a ``DeployOptions`` or a
    mapping of its option names (strings are parsed); an unknown name or a bad value raises
    ConfigError naming it, before anything starts."""
    from ray import serve

    opts = options if isinstance(options, DeployOptions) else \
        DeployOptions.from_dict(options or {})
    replica_spec, prefill_spec = opts.specs()
    dep = serve.deployment(
        HiSparseServer, name="hisparse", num_replicas=opts.num_replicas,
        max_ongoing_requests=opts.max_ongoing_requests,
        ray_actor_options={"num_cpus": 0},  # a router: the decode replica holds the resources
        graceful_shutdown_timeout_s=60, health_check_period_s=opts.health_check_period_s,
    )
    return dep.bind(replica_spec, prefill_spec, opts)
