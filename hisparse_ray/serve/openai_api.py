"""The OpenAI-compatible HTTP ingress (ring 3, front door): a FastAPI app on Ray Serve
(``@serve.ingress``) in front of the HiSparse deployment (:class:`HiSparseServer`).

Routes: ``GET /v1/models`` (and ``/v1/models/{id}``), ``POST /v1/completions``,
``POST /v1/chat/completions``, ``GET /health``, ``GET /metrics`` (Prometheus text), each also
with a trailing slash (clients whose base URL ends in ``/`` ask for ``/v1/models/``). Every
other path is 404 and a wrong method 405, both with OpenAI-style error bodies
(``{"error": {"message", "type", "param", "code"}}``).

Per request, in this order, each step before any work of the next: the API key (401), the body
size from ``Content-Length`` and while reading (413, the body is never read past the cap), JSON
and parameters (400 naming the parameter), the model id (404), the prompt's characters (413
before tokenizing) and text (a lone surrogate: 400), tokenizing (off the event loop), the token
ids (the vocabulary, ``max_prompt_tokens``: 400 / 413 naming the field), then the request goes
to the HiSparse deployment as token ids in ONE call for all its choices (a batch of prompts x
``n``: ``HiSparseServer.generate_choices``), so Serve's ``max_ongoing_requests``
/ ``max_queued_requests`` count it once and admit or refuse it whole (429 naming the limits);
an engine request per choice runs there. The status line goes out once every choice is
admitted (a stream's 200 and SSE headers do not wait for a token; an error before that is a
JSON error with its status). Each choice's text comes back per decode step (detokenized
there, stop strings ending a choice early, its blocks freed at once), and the answer goes out
whole or as server-sent events (each chunk naming its choice's ``index``; the first chat delta
of each carries ``"role": "assistant"``, then ``data: [DONE]``). A client that disconnects,
before or while the answer is sent, cancels the call, which aborts every choice on the
coordinator; a choice that is refused refuses the request.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hisparse_ray.deploy import DeployOptions
from hisparse_ray.serve import protocol as P
from hisparse_ray.serve.server import check_text

log = logging.getLogger(__name__)

app = FastAPI(title="hisparse-ray", docs_url=None, redoc_url=None, openapi_url=None)
TOKENIZE_INLINE_CHARS = 4096  # longer texts are tokenized in a worker thread


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """404 (no such path) and 405 (wrong method) as OpenAI-style bodies."""
    kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    msg = {404: f"no route {request.url.path!r}; routes: /v1/models, /v1/completions, "
                f"/v1/chat/completions, /health, /metrics",
           405: f"{request.method} is not allowed on {request.url.path!r}"}.get(
        exc.status_code, str(exc.detail))
    return JSONResponse(P.ApiError(exc.status_code, msg, code=kind).body(),
                        status_code=exc.status_code, headers=getattr(exc, "headers", None))


def _error(err: P.ApiError, rid: str | None = None) -> JSONResponse:
    headers = {"x-request-id": rid} if rid else None
    if err.status == 429:
        headers = {**(headers or {}), "retry-after": "1"}
    if err.status == 401:
        headers = {**(headers or {}), "www-authenticate": "Bearer"}
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


class OpenAIServer:
    """The ingress deployment class (``build_openai_app`` wraps it with ``serve.ingress``).
    ``engine``: the HiSparse deployment's handle; ``options``: the deployment's options (model
    id, API key, limits)."""

    def __init__(self, engine: Any, options: DeployOptions) -> None:
        replica_spec, prefill_spec = options.host_specs()
        self.engine = engine
        self.options = options
        self.model_id = P.model_id(options)
        self.tokenizer = replica_spec.model.tokenizer()
        self.max_prompt_tokens = prefill_spec.max_prompt_tokens
        self.vocab_size = int(replica_spec.model.dsa_config().vocab_size)
        self.created = P.now()

    # -- the door ----------------------------------------------------------------------------
    def _authorize(self, request: Request) -> None:
        key = self.options.api_key
        if not key:
            return
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                 key.encode()):
            raise P.ApiError(401, "missing or wrong API key (send 'Authorization: Bearer KEY')",
                             "authentication_error", code="invalid_api_key")

    async def _body(self, request: Request) -> bytes:
        """The request body, at most ``max_request_bytes`` (413 before reading more)."""
        cap = self.options.max_request_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > cap:
            raise P.ApiError(413, f"request body of {length} bytes exceeds {cap} bytes",
                             code="request_too_large")
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > cap:
                raise P.ApiError(413, f"request body exceeds {cap} bytes",
                                 code="request_too_large")
        return bytes(body)

    def _check_model(self, model: str) -> None:
        if model != self.model_id:
            raise P.ApiError(404, f"model {model!r} does not exist; this server serves "
                                  f"{self.model_id!r}", param="model", code="model_not_found")

    async def _encode(self, text: str, what: str, chat: list[dict] | None = None) -> list[int]:
        tok = self.tokenizer
        if tok is None:
            raise P.ApiError(400, "this model has no tokenizer: send token ids", param=what)
        check_text(what, text, self.max_prompt_tokens)
        if chat is not None:
            fn, arg = functools.partial(chat_ids, tok), chat
        else:
            fn, arg = tok.encode, text
        if len(text) <= TOKENIZE_INLINE_CHARS:
            return fn(arg)
        return await asyncio.to_thread(fn, arg)

    def _check_ids(self, prompts: list[list[int]], what: str, stops: list[int] | None) -> None:
        """Every prompt's length and token ids, and the stop ids: 413 / 400 naming the field
        (and which prompt of a batch) here, before the request takes a place in Serve's queue
        (the deployment checks them again, naming no field)."""
        def outside(ids) -> int | None:  # the first id outside the vocabulary
            return next((t for t in ids if not 0 <= t < self.vocab_size), None)

        for i, ids in enumerate(prompts):
            where = f"{what}[{i}]" if len(prompts) > 1 else what
            if len(ids) > self.max_prompt_tokens:
                raise P.ApiError(413, f"{where} has {len(ids)} tokens; at most "
                                      f"{self.max_prompt_tokens} prompt tokens", param=what,
                                 code="request_too_large")
            bad = outside(ids)
            if bad is not None:
                raise P.ApiError(400, f"{where} has token id {bad}, not in "
                                      f"[0, {self.vocab_size})", param=what)
        bad = outside(stops or ())
        if bad is not None:
            raise P.ApiError(400, f"stop_token_ids: stop token id {bad} is not in "
                                  f"[0, {self.vocab_size})", param="stop_token_ids")

    def _echo(self, prompt: str | list[int]) -> str:
        """A prompt as ``echo`` returns it: the text as sent, token ids decoded."""
        if isinstance(prompt, str):
            return prompt
        if self.tokenizer is None:
            raise P.ApiError(400, "echo of token ids needs a tokenizer; this model has none",
                             param="echo")
        return self.tokenizer.decode(prompt)

    # -- routes ------------------------------------------------------------------------------
    @app.get("/health")
    @app.get("/health/")
    async def health(self) -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    @app.get("/metrics/")
    async def metrics(self) -> PlainTextResponse:
        """HiSparse's Prometheus metrics on the API's own port, where vLLM-style servers serve
        them (open, like ``/health``): the ``ray_hisparse_*`` families of every node's Ray
        metrics export, which stays the place a cluster's Prometheus scrapes."""
        text = await asyncio.to_thread(prometheus_text)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(self, request: Request):
        try:
            self._authorize(request)
        except P.ApiError as err:
            return _error(err)
        return {"object": "list", "data": [self._model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(self, model: str, request: Request):
        """One model's card; ``/v1/models/`` (an empty id) is the list, a trailing slash
        after the id is no part of it."""
        model = model.rstrip("/")
        if not model:
            return await self.models(request)
        try:
            self._authorize(request)
            self._check_model(model)
        except P.ApiError as err:
            return _error(err)
        return self._model_card()

    def _model_card(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created,
                "owned_by": "hisparse-ray", "max_model_len": self.max_prompt_tokens
                + self.options.max_new_tokens_limit}

    @app.post("/v1/completions")
    @app.post("/v1/completions/")
    async def completions(self, request: Request):
        return await self._serve(request, chat=False)

    @app.post("/v1/chat/completions")
    @app.post("/v1/chat/completions/")
    async def chat_completions(self, request: Request):
        return await self._serve(request, chat=True)

    async def _serve(self, request: Request, chat: bool):
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        try:
            self._authorize(request)
            req = P.parse(P.ChatRequest if chat else P.CompletionRequest,
                          await self._body(request))
            self._check_model(req.model)
            max_new = req.new_tokens(self.options.max_new_tokens_limit)
            if chat:
                messages = [m.as_dict() for m in req.messages]
                text = "".join(m["content"] for m in messages)
                prompts = [await self._encode(text, "messages", messages)]
                echoes = [""]
            else:
                given = req.prompts()
                prompts = [await self._encode(p, "prompt") if isinstance(p, str) else list(p)
                           for p in given]
                echoes = [self._echo(p) if req.echo else "" for p in given]
            self._check_ids(prompts, "messages" if chat else "prompt", req.stop_token_ids)
            stops = list(req.stop_token_ids or ())
            if not req.ignore_eos and self.tokenizer is not None:
                stops += list(getattr(self.tokenizer, "eos_token_ids", ()))
            stop = req.stop_strings()
            choices = [{"ids": ids, **req.engine_args(max_new, j), "stop_token_ids": stops,
                        "stop": stop} for ids in prompts for j in range(req.n)]
            answer = _Answer(self, rid, chat, req, choices,
                             [e for e in echoes for _ in range(req.n)],
                             sum(len(ids) for ids in prompts))
            await answer.start()  # admitted whole, or refused here: before a status
        except BaseException as err:  # noqa: BLE001 - mapped to a status there
            return self._failed(err, rid)
        headers = {"x-request-id": rid}
        if req.stream:
            return _Stream(answer, headers=headers)
        try:
            body = await answer.whole()
        except BaseException as err:  # noqa: BLE001
            return self._failed(err, rid)
        return JSONResponse(body, headers=headers)

    def _failed(self, err: BaseException, rid: str) -> JSONResponse:
        """A failed request's JSON error: its status, or for an error no status maps (a bug) a
        500 with an OpenAI body, logged with its traceback (it was Starlette's plain-text 500,
        which OpenAI clients cannot read; a stream's error event already said 500). A
        cancellation (the client left) goes on up."""
        api = self._api_error(err)
        if api is None:
            if not isinstance(err, Exception):
                raise err
            log.error("request %s failed", rid, exc_info=err)
            api = P.ApiError(500, repr(err), "server_error")
        return _error(api, rid)

    def _api_error(self, err: BaseException) -> P.ApiError | None:
        """``P.api_error``, with a full queue's 429 naming the limits it hit."""
        api = P.api_error(err)
        if api is not None and api.status == 429:
            o = self.options
            queued = "no limit" if o.max_queued_requests < 0 else o.max_queued_requests
            api = P.ApiError(429, f"too many requests: each of the {o.num_replicas} replicas "
                                  f"runs {o.max_ongoing_requests} and queues {queued} more "
                                  f"(a request counts once, whatever its prompts x n); "
                                  f"retry later", "rate_limit_error",
                             code="rate_limit_exceeded")
        return api


class _Stream(StreamingResponse):
    """An answer's server-sent events that cancel the answer however the response ends:
    Starlette stops sending when the client leaves but leaves the body iterator unclosed while
    it waits at a ``yield`` (it would decode on until garbage-collected)."""

    def __init__(self, answer: "_Answer", headers: dict) -> None:
        super().__init__(answer.events(), media_type="text/event-stream", headers=headers)
        self.answer = answer

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.answer.gen.cancel()


class _Answer:
    """One HTTP request's choices (prompts x n, in OpenAI's index order) as one
    ``generate_choices`` call, merged as they come: ``events`` (SSE, each chunk naming its
    choice's index) or ``whole`` (one body); usage counts each prompt once and every choice's
    tokens. Leaving (an error, the client gone) cancels the call: every choice is aborted."""

    def __init__(self, server: OpenAIServer, rid: str, chat: bool, req, choices: list[dict],
                 echoes: list[str], prompt_tokens: int) -> None:
        self.server, self.rid, self.chat, self.req = server, rid, chat, req
        self.choices, self.echoes, self.prompt_tokens = choices, echoes, prompt_tokens
        self.tokens = [0] * len(choices)  # completion tokens per choice
        self.created = P.now()
        self.gen = None

    async def start(self) -> None:
        """Submit every choice and wait until all are admitted (Serve's queue took the call
        and the coordinator every choice); a refused request raises here, none of its choices
        left running."""
        handle = self.server.engine.options(stream=True)
        self.gen = handle.generate_choices.remote(self.choices)
        try:
            await self.gen.__anext__()  # {"admitted": k}
        except BaseException:
            self.gen.cancel()
            raise

    async def _merged(self):
        """(choice index, text piece, finish reason or None) of every choice as they come, each
        choice's echoed prompt first; leaving early cancels the call upstream."""
        try:
            for i, echo in enumerate(self.echoes):
                if echo:  # stop strings look at new text only
                    yield i, echo, None
            async for item in self.gen:
                i, fin = item["choice"], item.get("finish_reason")
                if fin is not None:
                    self.tokens[i] = item["completion_tokens"]
                yield i, item["text"], fin
        finally:
            self.gen.cancel()

    def _usage(self) -> dict:
        return P.usage(self.prompt_tokens, sum(self.tokens))

    async def whole(self) -> dict:
        parts: list[list[str]] = [[] for _ in self.choices]
        fins: list[str | None] = [None] * len(self.choices)
        async for i, piece, fin in self._merged():
            parts[i].append(piece)
            fins[i] = fin or fins[i]
        body = P.chat if self.chat else P.completion
        return body(self.rid, self.server.model_id, [("".join(p), f) for p, f in
                                                     zip(parts, fins)],
                    self._usage(), self.created)

    async def events(self):
        model, rid, created = self.server.model_id, self.rid, self.created
        include_usage = bool(self.req.stream_options and self.req.stream_options.include_usage)

        def sse(chunk: dict) -> str:  # with include_usage every chunk has "usage" (null until
            if include_usage:          # the last one), as OpenAI sends them
                chunk.setdefault("usage", None)
            return P.sse(chunk)

        try:
            if self.chat:
                for i in range(len(self.choices)):
                    yield sse(P.chat_chunk(rid, model, {"role": "assistant", "content": ""},
                                           None, None, created, i))
            async for i, piece, fin in self._merged():
                if self.chat:
                    if piece:
                        yield sse(P.chat_chunk(rid, model, {"content": piece}, None, None,
                                               created, i))
                    if fin is not None:
                        yield sse(P.chat_chunk(rid, model, {}, fin, None, created, i))
                else:
                    yield sse(P.completion_chunk(rid, model, piece, fin, None, created, i))
            if include_usage:
                chunk = P.chat_chunk if self.chat else P.completion_chunk
                yield P.sse(chunk(rid, model, None, None, self._usage(), created))
        except Exception as err:  # noqa: BLE001 - the status is sent: an error event instead
            api = P.api_error(err) or P.ApiError(500, repr(err), "server_error")
            yield P.sse(api.body())
        finally:  # the client left while a chunk was being sent (closed here, not in _merged)
            self.gen.cancel()
        yield P.sse("[DONE]")


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The chat template's ids for ``messages``. A template that refuses the conversation
    (its ``raise_exception``: roles out of order, a role it does not know, a missing field) is
    the client's error, 400 naming ``messages``; a template that does not compile stays a
    server error."""
    try:
        from jinja2.exceptions import TemplateError, TemplateSyntaxError
    except ImportError:  # no Jinja: no template to refuse anything
        return tokenizer.encode_chat(messages)
    try:
        return tokenizer.encode_chat(messages)
    except TemplateSyntaxError:
        raise
    except TemplateError as err:
        raise P.ApiError(400, f"the model's chat template refused these messages: {err}",
                         param="messages") from None


PROMETHEUS_PREFIX = "ray_hisparse_"
SCRAPE_TIMEOUT_S = 5.0


def prometheus_text(prefix: str = PROMETHEUS_PREFIX) -> str:
    """The metric families named ``prefix*`` of every alive node's Ray metrics export, merged
    (:func:`merge_prometheus`); a node that does not answer is left out."""
    import urllib.request

    import ray

    texts = []
    for node in ray.nodes():
        port = node.get("MetricsExportPort")
        if not node.get("Alive") or not port:
            continue
        try:
            with urllib.request.urlopen(f"http://{node['NodeManagerAddress']}:{port}/metrics",
                                        timeout=SCRAPE_TIMEOUT_S) as resp:
                texts.append(resp.read().decode())
        except OSError as err:
            log.warning("metrics of node %s left out: %r", node.get("NodeID"), err)
    return merge_prometheus(texts, prefix)


def merge_prometheus(texts: list[str], prefix: str) -> str:
    """The families named ``prefix*`` of several Prometheus expositions as one: one HELP and
    TYPE per family with every text's samples under it (a family twice is invalid text)."""
    families: dict[str, dict] = {}
    for text in texts:
        family = None
        for line in text.splitlines():
            parts = line.split(" ", 3)
            if line.startswith("# ") and len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                family = parts[2] if parts[2].startswith(prefix) else None
                if family is not None:
                    families.setdefault(family, {"samples": {}}).setdefault(parts[1], line)
            elif line.startswith(prefix):
                name = line.split("{", 1)[0].split(" ", 1)[0]
                key = family if family is not None and name.startswith(family) else name
                # an ordered set: a sample two exports both carry is written once
                families.setdefault(key, {"samples": {}})["samples"].setdefault(line)
    out = []
    for fam in families.values():
        out += [fam[k] for k in ("HELP", "TYPE") if k in fam] + list(fam["samples"])
    return "".join(line + "\n" for line in out)


def _ingress():
    from ray import serve

    return serve.ingress(app)(OpenAIServer)


OpenAIIngress = _ingress()  # the Serve-wrapped class (routes bound to its instances)
