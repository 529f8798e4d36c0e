"""The HiSparse Serve deployment (ring 3, front door): one Serve replica owns one HiSparse
deployment (a prefill worker and a decode replica: coordinator + TP ranks) and generates for
token ids. The OpenAI ingress (:mod:`hisparse_ray.serve.openai_api`) sits in front of it; its
methods are also the handle API:

    out = handle.generate.remote(ids=[5, 17, 3], max_new_tokens=8).result()
    for chunk in handle.options(stream=True).generate_stream.remote(ids=[5, 17, 3]):
        ...                     # {"tokens": [...]} per decode step, last: the result ("done")
    # Ray Data's ServeDeploymentProcessorConfig: one dict in, the first item yielded out
    first = await handle.options(stream=True).batch.remote({"ids": [...], "max_tokens": 8})
    # one OpenAI request's choices (prompts x n) as one call: text per choice, stop strings
    async for item in handle.options(stream=True).generate_choices.remote([{"ids": [...]}]):
        ...                     # {"admitted": k}, then {"choice": i, "text": ...} per step

Requests from many callers share the decode steps. Each gets a fresh id (this replica's prefix +
a uuid4); a :class:`~hisparse_ray.serve.events.StreamHub` brings each decode step's tokens and
each finished request back. A caller that goes away (HTTP disconnect, ``cancel()``) or a request
that outlives its timeout is aborted, which frees its blocks. Serve's health check fails when
the decode replica failed, every prefill worker was retired, or a prefill worker died (Serve
then replaces the replica); a stopping Serve replica shuts its HiSparse deployment down.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from typing import TYPE_CHECKING, Any

from hisparse_ray.deploy import DeployOptions, PrefillSpec, ReplicaSpec
from hisparse_ray.errors import CapacityError, InvalidRequestError, StateError
from hisparse_ray.serve.events import StreamHub, unwrap
from hisparse_ray.types import SamplingParams

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from hisparse_ray.actors.coordinator import ReplicaCoordinator

log = logging.getLogger(__name__)

COORDINATOR_PREFIX = "hisparse-coordinator:"  # + app name + ":" + Serve replica id: drain targets
PREFILL_PING_S = 10.0


class HiSparseServer:
    """The Serve deployment class (plain; :func:`~hisparse_ray.serve.builder.build_openai_app`
    wraps it). ``replica_spec`` / ``prefill_spec``: the HiSparse deployment it launches;
    ``options``: request defaults and limits, timeouts, node pinning."""

    def __init__(self, replica_spec: ReplicaSpec, prefill_spec: PrefillSpec,
                 options: DeployOptions | None = None) -> None:
        from hisparse_ray.actors import launch

        self.options = options if options is not None else DeployOptions()
        self.vocab_size = int(replica_spec.model.dsa_config().vocab_size)
        self.max_prompt_tokens = prefill_spec.max_prompt_tokens
        self.tokenizer = replica_spec.model.tokenizer()
        t0 = time.monotonic()
        self.replica = launch.launch_deployment(
            replica_spec, prefill_spec, decode_resources=self.options.decode_resources,
            prefill_resources=self.options.prefill_resources, coordinator_name=_name())
        log.info("HiSparse deployment up in %.1f s (TP %d)", time.monotonic() - t0,
                 replica_spec.tp_size)
        self._coord = self.replica.coordinator
        self._prefix = f"serve-{uuid.uuid4().hex[:12]}-"  # this front end's request ids
        self.hub = StreamHub(self._coord, self._prefix)
        self._served = 0
        self._closed = False

    # -- requests ------------------------------------------------------------------------------
    def _params(self, prompt: Any, ids: Any, max_new_tokens: Any, eos_token_id: Any,
                temperature: Any, top_p: Any, top_k: Any, seed: Any, stop_token_ids: Any
                ) -> tuple[list[int], int, SamplingParams, tuple[int, ...]]:
        """Validated (prompt ids, max new tokens, sampling, stop ids); InvalidRequestError (400)
        or CapacityError (413) naming the bad value."""
        if (prompt is None) == (ids is None):
            raise InvalidRequestError("-", "give exactly one of 'prompt' (text) or 'ids' "
                                           "(token ids)")
        if prompt is not None:
            if not isinstance(prompt, str) or not prompt:
                raise InvalidRequestError("-", f"prompt={prompt!r:.80} must be a non-empty str")
            if self.tokenizer is None:
                raise InvalidRequestError("-", "this model has no built-in tokenizer: send 'ids'")
            ids = self.tokenizer.encode(check_text("prompt", prompt, self.max_prompt_tokens))
        if not isinstance(ids, (list, tuple)) or not ids:
            raise InvalidRequestError("-", f"ids={ids!r:.80} must be a non-empty list of "
                                           f"token ids")
        if len(ids) > self.max_prompt_tokens:
            raise CapacityError("prompt tokens", len(ids), self.max_prompt_tokens)
        for t in ids:
            self._check_token("token id", t)
        limit = self.options.max_new_tokens_limit
        if max_new_tokens is None:
            max_new_tokens = self.options.max_new_tokens
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
                or not 1 <= max_new_tokens <= limit:
            raise InvalidRequestError("-", f"max_new_tokens={max_new_tokens!r} must be an int in "
                                           f"[1, {limit}]")
        stops = list(stop_token_ids or ())
        if eos_token_id is not None:
            stops.append(eos_token_id)
        for t in stops:
            self._check_token("stop token id", t)
        if seed is None:
            seed = secrets.randbits(63)  # reported in the result: the request can be replayed
        try:
            sampling = SamplingParams(temperature=0.0 if temperature is None else temperature,
                                      top_p=1.0 if top_p is None else top_p,
                                      top_k=0 if top_k in (None, -1) else top_k, seed=seed)
        except Exception as err:  # ConfigError naming the key: a bad request here
            raise InvalidRequestError("-", str(err)) from None
        return list(ids), max_new_tokens, sampling, tuple(stops)

    def _check_token(self, what: str, t: Any) -> None:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
            raise InvalidRequestError("-", f"{what} {t!r:.40} is not an int in "
                                           f"[0, {self.vocab_size})")

    async def generate(self, prompt: str | None = None, ids: list[int] | None = None,
                       max_new_tokens: int | None = None, eos_token_id: int | None = None,
                       timeout_s: float | None = None, *, temperature: float | None = None,
                       top_p: float | None = None, top_k: int | None = None,
                       seed: int | None = None, stop_token_ids: list[int] | None = None) -> dict:
        """Generate for one prompt (``prompt`` text through the model's tokenizer, or token
        ``ids``); greedy unless ``temperature`` > 0. Returns the tokens (and text), finish
        reason ("length", "stop", "eos"), latency, time to first token, decode tokens/s,
        hot-buffer hit rate, landing target and the seed. Raises the request's typed error."""
        rid, w, extra = await self._start(prompt, ids, max_new_tokens, eos_token_id, False,
                                          temperature, top_p, top_k, seed, stop_token_ids)
        async for item in self._follow(rid, w, extra, timeout_s):
            if "done" in item:
                return item
        raise AssertionError("unreachable: _follow ends with the done item or raises")

    async def generate_stream(self, prompt: str | None = None, ids: list[int] | None = None,
                              max_new_tokens: int | None = None,
                              eos_token_id: int | None = None, timeout_s: float | None = None,
                              *, temperature: float | None = None, top_p: float | None = None,
                              top_k: int | None = None, seed: int | None = None,
                              stop_token_ids: list[int] | None = None):
        """``generate``, streamed (``handle.options(stream=True).generate_stream.remote(...)``):
        yields ``{"tokens": [...]}`` (plus ``"text"``) after each decode step that produced some,
        then ``generate``'s result with ``"done": True``. The chunks' tokens concatenate to the
        result's tokens. Bad requests raise before the first chunk."""
        rid, w, extra = await self._start(prompt, ids, max_new_tokens, eos_token_id, True,
                                          temperature, top_p, top_k, seed, stop_token_ids)
        async for item in self._follow(rid, w, extra, timeout_s):
            yield item

    async def batch(self, request: dict):
        """One request as one dict, its result as the one item yielded: Ray Data's
        ``ServeDeploymentProcessorConfig`` calls this (``method: "batch"``). Keys: ``prompt`` or
        ``ids``, ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``,
        ``stop_token_ids``; Ray Data's own ``request_id`` and ``idx_in_batch`` are ignored."""
        if not isinstance(request, dict):
            raise InvalidRequestError("-", f"batch takes one dict, got {type(request).__name__}")
        known = {"prompt", "ids", "max_tokens", "temperature", "top_p", "top_k", "seed",
                 "stop_token_ids", "request_id", "idx_in_batch"}
        unknown = sorted(set(request) - known)
        if unknown:
            raise InvalidRequestError("-", f"unknown keys {unknown}; allowed: {sorted(known)}")
        # Ray Data hands lists over as numpy arrays and numbers as numpy scalars
        request = {k: v.tolist() if hasattr(v, "tolist") else v for k, v in request.items()}
        out = await self.generate(
            request.get("prompt"), request.get("ids"), request.get("max_tokens"),
            temperature=request.get("temperature"), top_p=request.get("top_p"),
            top_k=request.get("top_k"), seed=request.get("seed"),
            stop_token_ids=request.get("stop_token_ids"))
        yield {k: v for k, v in out.items() if k != "done"}

    async def generate_choices(self, choices: list[dict], timeout_s: float | None = None):
        """One OpenAI request's choices (its prompts x ``n``) as one call, streamed: what the
        ingress sends, so Serve's ``max_ongoing_requests`` / ``max_queued_requests`` admit or
        refuse the request whole (it counts once, whatever its choices). Every choice is
        checked before any is submitted, and a refused submit aborts those already in: a
        request is never half-admitted. Yields ``{"admitted": k}`` once all k are in (the
        ingress sends its status line then, before any token), then, per choice and decode
        step, ``{"choice": i, "text": piece}`` and last ``{"choice": i, "text": tail,
        "finish_reason": r, "completion_tokens": m}``. A choice: ``ids``, ``stop`` (strings: the
        text ends before the first to complete, and the choice is aborted there, its blocks
        freed) and ``generate``'s keywords. A choice that fails fails the call; a caller that
        leaves aborts every choice."""
        if not isinstance(choices, list) or not choices:
            raise InvalidRequestError("-", "choices must be a non-empty list of dicts")
        known = {"ids", "stop", "max_new_tokens", "temperature", "top_p", "top_k", "seed",
                 "stop_token_ids"}
        for c in choices:
            if not isinstance(c, dict) or set(c) - known:
                raise InvalidRequestError("-", f"a choice is a dict of {sorted(known)}, got "
                                               f"{c!r:.80}")
        checked = [self._params(None, c.get("ids"), c.get("max_new_tokens"), None,
                                c.get("temperature"), c.get("top_p"), c.get("top_k"),
                                c.get("seed"), c.get("stop_token_ids")) for c in choices]
        started = await self._submit_all(checked, stream=True)
        out: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.ensure_future(self._choice(i, *s, c.get("stop") or [], timeout_s, out))
                 for i, (s, c) in enumerate(zip(started, choices))]
        try:
            yield {"admitted": len(tasks)}
            left = len(tasks)
            while left:
                item = await out.get()
                if isinstance(item, BaseException):
                    raise item
                left -= "finish_reason" in item
                yield item
        finally:  # an error, or the caller left: the other choices end upstream (aborted)
            for t in tasks:
                t.cancel()
            # A task cancelled before it first ran never runs its body (nor ``_follow``'s abort):
            # forget every choice here too. A finished one has no waiter left: a no-op.
            for rid, _, _ in started:
                self.hub.forget(rid, abort=True)

    async def _choice(self, i: int, rid: str, w, extra: dict, stop: list[str],
                      timeout_s: float | None, out: asyncio.Queue) -> None:
        """Choice ``i`` of ``generate_choices`` as text onto ``out`` (its error instead, if it
        fails); a stop string ends it here, which aborts it upstream."""
        text = ChoiceText(self.tokenizer, stop)
        follow = self._follow(rid, w, extra, timeout_s)
        try:
            async for item in follow:
                piece, fin = text.push(item)
                if fin is not None:
                    out.put_nowait({"choice": i, "text": piece, "finish_reason": fin,
                                    "completion_tokens": text.tokens})
                    return
                if piece:
                    out.put_nowait({"choice": i, "text": piece})
        except Exception as err:  # noqa: BLE001 - raised by generate_choices
            out.put_nowait(err)
        finally:
            await follow.aclose()  # before its end (a stop string): aborted, blocks freed

    async def _start(self, prompt, ids, max_new_tokens, eos_token_id, stream: bool, temperature,
                     top_p, top_k, seed, stop_token_ids):
        """Validate, register a waiter and submit. Raises the typed error of a refused
        request."""
        checked = self._params(prompt, ids, max_new_tokens, eos_token_id, temperature, top_p,
                               top_k, seed, stop_token_ids)
        (started,) = await self._submit_all([checked], stream, text=prompt is not None)
        return started

    async def _submit_all(self, checked: list[tuple], stream: bool, text: bool = False
                          ) -> list[tuple]:
        """Submit validated requests (``_params``' tuples) at once, each with a waiter
        registered first (it may finish at once); (request id, waiter, extra) each. If one is
        refused, or the caller leaves meanwhile, all are aborted (a submit that never arrived
        is unknown there: nothing to abort) and the typed error raised."""
        if self._closed:
            raise StateError("server is shutting down")
        started = []
        try:
            for tokens, max_new, sampling, stops in checked:
                rid = self._prefix + uuid.uuid4().hex
                started.append((rid, self.hub.register(rid, stream), {
                    "prompt_tokens": len(tokens), "text": text, "seed": sampling.seed}))
            got = await asyncio.gather(*(
                self._coord.submit.remote(rid, tokens, max_new, None, None, sampling=sampling,
                                          stop_token_ids=stops, stream=stream)
                for (rid, _, _), (tokens, max_new, sampling, stops) in zip(started, checked)),
                return_exceptions=True)
        except BaseException as err:  # the hub refused, or the caller left (a cancelled
            got = [err]               # submit may have run)
        errors = [unwrap(g) for g in got if isinstance(g, BaseException)]
        if errors:
            for rid, _, _ in started:
                self.hub.forget(rid, abort=True)
            raise next((e for e in errors if not isinstance(e, asyncio.CancelledError)),
                       errors[0]) from None
        return started

    async def _follow(self, rid: str, w, extra: dict, timeout_s: float | None):
        """Yield the request's token chunks (streams only) and its final result; a caller that
        leaves (cancellation, generator closed) or a timeout aborts the request, which frees
        its blocks and drops its record once done (a result that wins the race is dropped)."""
        timeout = self.options.request_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        finished = False
        try:
            while True:
                kind, payload = await self.hub.get(w, deadline - time.monotonic())
                if kind == "error":
                    finished = True
                    raise payload
                if kind == "tokens":
                    yield self._chunk(extra, payload)
                    continue
                summary, error = payload
                finished = True
                if error is not None:
                    raise error
                self._served += 1
                yield self._result(rid, extra, summary)
                return
        except asyncio.TimeoutError:
            raise TimeoutError(f"request {rid} not done after {timeout} s (aborted)") from None
        finally:
            if not finished:
                self.hub.forget(rid, abort=True)

    def _chunk(self, extra: dict, tokens: list[int]) -> dict:
        out: dict[str, Any] = {"tokens": tokens}
        if extra["text"]:
            out["text"] = self.tokenizer.decode(tokens)
        return out

    def _result(self, rid: str, extra: dict, summary: dict) -> dict:
        out = {
            "done": True, "request_id": rid, "tokens": summary["tokens"],
            "prompt_tokens": extra["prompt_tokens"], "finish_reason": summary["finish_reason"],
            "latency_s": summary["latency_s"], "ttft_s": summary["ttft_s"],
            "decode_tokens_per_s": summary["decode_tokens_per_s"],
            "hot_hit_rate": summary["hot_hit_rate"], "landing_target": summary["target"],
            "seed": extra["seed"],
        }
        if extra["text"]:
            out["text"] = self.tokenizer.decode(summary["tokens"])
        return out

    # -- operations ----------------------------------------------------------------------------
    def model_info(self) -> dict:
        """What the ingress needs to know of the model (vocabulary, limits)."""
        return {"vocab_size": self.vocab_size, "max_prompt_tokens": self.max_prompt_tokens,
                "max_new_tokens_limit": self.options.max_new_tokens_limit}

    async def metrics(self) -> dict:
        """The coordinator's metrics plus this front end's counts."""
        m = await self._coord.metrics.remote()
        m["serve"] = {"waiting": self.hub.waiting, "served": self._served,
                      "events_alive": self.hub.alive(),
                      "failed": repr(self.hub.failed) if self.hub.failed else None}
        return m

    def coordinator(self) -> ActorHandle[ReplicaCoordinator]:
        """The decode replica's coordinator actor handle (operations and tests)."""
        return self._coord

    def actors(self) -> dict[str, Any]:
        """Every actor handle of this replica's HiSparse deployment (operations and tests)."""
        return {"coordinator": self._coord, "ranks": list(self.replica.ranks),
                "prefill": list(self.replica.prefill)}

    async def check_health(self) -> None:
        """Serve's health check: unhealthy once the decode replica failed (a rank lost, fenced,
        every prefill worker retired) or a prefill worker does not answer; Serve then replaces
        this replica with a fresh HiSparse deployment."""
        if self.hub.failed is not None:
            raise RuntimeError(f"HiSparse replica failed: {self.hub.failed!r}")
        failed = await self._coord.failure.remote()
        if failed is not None:
            raise RuntimeError(f"HiSparse replica failed: {failed}")
        for i, p in enumerate(self.replica.prefill):
            try:
                await asyncio.wait_for(p.node_info.remote(), PREFILL_PING_S)
            except Exception as err:  # noqa: BLE001 - dead, or hung past the ping deadline
                raise RuntimeError(f"HiSparse prefill worker {i} is gone: {err!r}") from None

    def shutdown(self) -> None:
        """Stop the HiSparse deployment (idempotent); waiting requests get StateError."""
        if self._closed:
            return
        self._closed = True
        self.hub.close()
        self.replica.shutdown()

    def __del__(self) -> None:  # Serve calls it when the replica stops
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass


class ChoiceText:
    """One choice's tokens as text (``push`` each ``_follow`` item): incremental
    detokenization, then the stop strings (:class:`~hisparse_ray.serve.protocol.StopStrings`:
    the first to complete ends the choice, the text ends before it). A model without a
    tokenizer gives empty text."""

    def __init__(self, tokenizer, stop: list[str]) -> None:
        from hisparse_ray.serve.protocol import StopStrings

        self.text = tokenizer.stream() if tokenizer is not None else None
        self.stops = StopStrings(stop)
        self.tokens = 0  # completion tokens so far

    def push(self, item: dict) -> tuple[str, str | None]:
        """(text piece, finish reason or None: "stop" at a stop string, stop id or EOS,
        "length" at max_new_tokens). A choice aborted on the coordinator by someone else (this
        front end's own aborts never come back as items) raises ``StateError``: its text is
        cut short, and reporting "length" would pass it off as complete."""
        if "done" in item:
            if item["finish_reason"] == "abort":
                raise StateError(f"request {item.get('request_id', '?')} was aborted on the "
                                 f"replica after {len(item['tokens'])} tokens")
            piece, hit = self.stops.push(self.text.flush() if self.text is not None else "")
            if not hit:
                piece += self.stops.flush()
            self.tokens = len(item["tokens"])
            return piece, "stop" if hit or item["finish_reason"] in ("stop", "eos") else "length"
        # token by token with stop strings: the count ends at the token that completes one,
        # whatever number of decode steps a chunk holds (it varies with the event poll's timing)
        tokens, out = item["tokens"], ""
        step = 1 if self.stops.stops and self.text is not None else max(1, len(tokens))
        for k in range(0, len(tokens), step):
            part = tokens[k:k + step]
            self.tokens += len(part)
            piece, hit = self.stops.push(self.text.push(part) if self.text is not None else "")
            out += piece
            if hit:
                return out, "stop"
        return out, None


def check_text(what: str, text: str, max_tokens: int, chars_per_token: int = 64) -> str:
    """``text`` if it can be tokenized: ``InvalidRequestError`` (400) for a lone surrogate
    (not UTF-8), ``CapacityError`` (413) before tokenizing when it is longer than
    ``chars_per_token`` characters per allowed token (no tokenizer's token is that long)."""
    if len(text) > max_tokens * chars_per_token:
        raise CapacityError(f"{what} characters", len(text), max_tokens * chars_per_token)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InvalidRequestError("-", f"{what} is not valid Unicode text: "
                                       f"{err.reason} at index {err.start}") from None
    return text


def _name() -> str | None:
    """The coordinator's actor name inside a Serve replica (``hisparse-ray serve`` drains the
    coordinators of its app by name before it stops); None outside Serve."""
    try:
        from ray import serve

        ctx = serve.get_replica_context()
    except Exception:  # noqa: BLE001 - not in a Serve replica
        return None
    return f"{COORDINATOR_PREFIX}{ctx.app_name}:{ctx.replica_id.unique_id}"
