"""The OpenAI protocol of the front door (ring 3): request models (pydantic, strict, unknown
fields refused), their translation into HiSparse generation parameters, stop strings, response
and stream-chunk bodies, and OpenAI-style error bodies with their HTTP statuses.

Supported: ``/v1/completions`` (``prompt`` text or token ids, or a list of either: a batch,
one choice each) and ``/v1/chat/completions`` (the tokenizer's chat template), ``max_tokens``
(``max_completion_tokens``), ``temperature`` (OpenAI's default 1.0; 0 = greedy, bit-exact with
full-resident decode), ``top_p``, ``top_k`` (vLLM's extension; -1 / 0 = off), ``seed``, ``stop``
(strings), ``stop_token_ids`` and ``ignore_eos`` (vLLM's extensions), ``stream`` with
``stream_options.include_usage``, ``n`` (choices per prompt: independent requests; with a
``seed``, choice j samples with ``seed + j``), ``echo`` (completions: the prompt before the
answer), ``user``; at most ``MAX_CHOICES`` choices in all. Anything else that would change the
output (``logprobs``, ``best_of`` > 1, penalties, ``logit_bias``, tools, ``suffix``) is refused
with 400 naming the parameter rather than silently ignored.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hisparse_ray.errors import CapacityError, ConfigError, HiSparseError, InvalidRequestError
from hisparse_ray.errors import StateError, TransferError

MAX_STOPS = 16
MAX_CHOICES = 64  # prompts x n of one request (each is one request to the engine)


def model_id(options) -> str:
    """The model id clients name (``DeployOptions``): ``served_model_name``, else
    ``hisparse-<kind>`` (a model folder: its last path component, as vLLM names a folder)."""
    return options.served_model_name or f"hisparse-{Path(options.model.rstrip('/')).name}"


class ApiError(Exception):
    """An OpenAI-style error: HTTP ``status`` and the ``{"error": {...}}`` body fields."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(status, message, type, param, code)
        self.status, self.message, self.type, self.param, self.code = \
            status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def api_error(err: BaseException) -> ApiError | None:
    """The HTTP error a request's failure becomes (None: not a request error, a bug: 500)."""
    from ray.serve.exceptions import BackPressureError

    cause = getattr(err, "cause", None)
    err = cause if isinstance(cause, BaseException) else err
    if isinstance(err, ApiError):
        return err
    if isinstance(err, CapacityError):
        return ApiError(413, str(err), code="request_too_large")
    if isinstance(err, InvalidRequestError):
        return ApiError(400, err.reason)
    if isinstance(err, ConfigError):
        return ApiError(400, str(err), param=err.key)
    if isinstance(err, BackPressureError):
        return ApiError(429, "too many requests in flight; retry later", "rate_limit_error",
                        code="rate_limit_exceeded")
    if isinstance(err, (StateError, TransferError)):
        return ApiError(503, str(err), "service_unavailable", code="service_unavailable")
    if isinstance(err, TimeoutError):
        return ApiError(504, str(err), "timeout", code="timeout")
    if isinstance(err, HiSparseError):
        return ApiError(500, str(err), "server_error")
    return None


# -- requests ----------------------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampled(_Strict):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's sampling extras, which vLLM clients send at their neutral values whatever they use:
    # taken there, refused (400 naming them) at any other value
    repetition_penalty: float | None = 1.0
    min_p: float | None = 0.0
    min_tokens: int | None = 0

    def check_supported(self) -> None:
        for name, ok in (("presence_penalty", not self.presence_penalty),
                         ("frequency_penalty", not self.frequency_penalty),
                         ("repetition_penalty", self.repetition_penalty in (None, 1.0)),
                         ("min_p", not self.min_p), ("min_tokens", not self.min_tokens),
                         ("logit_bias", not self.logit_bias)):
            if not ok:
                raise ApiError(400, f"{name}={getattr(self, name)!r} is not supported "
                                    f"(HiSparse serves without penalties or biases)",
                               param=name)
        if self.n > MAX_CHOICES:
            raise ApiError(400, f"n={self.n} is more than {MAX_CHOICES} choices", param="n")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options needs stream=true", param="stream_options")
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            raise ApiError(400, "stream_options.continuous_usage_stats is not supported",
                           param="stream_options")

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS:
            raise ApiError(400, f"stop has {len(stops)} strings; at most {MAX_STOPS}", param="stop")
        return [s for s in stops if s]

    def new_tokens(self, limit: int) -> int | None:
        """The new tokens asked for (None: the server's default), at most ``limit``: 400 naming
        the parameter the client sent, not the engine's name for it."""
        name, n = self._max_tokens()
        if n is not None and n > limit:
            raise ApiError(400, f"{name}={n} is more than the {limit} new tokens this server "
                                f"generates per request", param=name)
        return n

    def _max_tokens(self) -> tuple[str, int | None]:
        return "max_tokens", self.max_tokens

    def engine_args(self, max_tokens: int | None, choice: int = 0) -> dict:
        """Keyword arguments of ``HiSparseServer.generate_stream`` for choice ``choice`` of a
        prompt (ids and stops added by the caller): with a seed, choice j samples with seed + j,
        so the n choices differ and each replays."""
        seed = None if self.seed is None else (self.seed + choice) % 2**63
        return {"max_new_tokens": max_tokens,
                "temperature": 1.0 if self.temperature is None else self.temperature,
                "top_p": self.top_p, "top_k": self.top_k, "seed": seed}


class CompletionRequest(_Sampled):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        for name, ok in (("logprobs", self.logprobs is None),
                         ("best_of", self.best_of in (None, 1)), ("suffix", not self.suffix)):
            if not ok:
                raise ApiError(400, f"{name}={getattr(self, name)!r} is not supported",
                               param=name)

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each text or token ids: one, or a batch (a list of texts or of token-id
        lists); each gets ``n`` choices, at most ``MAX_CHOICES`` in all."""
        p = self.prompt
        batch = p if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
        for i, one in enumerate(batch):
            if not one:
                where = f"prompt[{i}]" if len(batch) > 1 else "prompt"
                raise ApiError(400, f"{where} is empty", param="prompt")
        if len(batch) * self.n > MAX_CHOICES:
            raise ApiError(400, f"{len(batch)} prompts x n={self.n} is more than {MAX_CHOICES} "
                                f"choices", param="prompt" if self.n == 1 else "n")
        return batch


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None  # what a "tool" message answers (OpenAI requires it)

    def as_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        out: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name:
            out["name"] = self.name
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        return out


class ChatRequest(_Sampled):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    response_format: dict | None = None

    def _max_tokens(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens

    def check_supported(self) -> None:
        super().check_supported()
        fmt = (self.response_format or {}).get("type", "text")
        for name, ok in (("logprobs", not self.logprobs), ("top_logprobs", not self.top_logprobs),
                         ("tools", not self.tools),
                         ("tool_choice", self.tool_choice in (None, "none")),
                         ("response_format", fmt == "text")):
            if not ok:
                raise ApiError(400, f"{name}={getattr(self, name)!r} is not supported",
                               param=name)


def parse(model: type[BaseModel], body: bytes):
    """A request model from a JSON body; ApiError 400 naming the first bad parameter."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as err:
        raise ApiError(400, f"body is not JSON: {err}") from None
    except RecursionError:  # a body of nested brackets: the parser's recursion limit, not a bug
        raise ApiError(400, "body is not JSON a server takes: nested too deeply") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"body must be a JSON object, got {type(data).__name__}")
    # OpenAI's optional parameters are nullable ("n": null, "stream": null): null = not given
    data = {k: v for k, v in data.items() if v is not None}
    if isinstance(data.get("stream_options"), dict):
        data["stream_options"] = {k: v for k, v in data["stream_options"].items()
                                  if v is not None}
    try:
        req = model.model_validate(data, strict=True)
    except ValidationError as err:
        first = err.errors()[0]
        loc = ".".join(str(x) for x in first["loc"])
        name = str(first["loc"][0]) if first["loc"] else None
        if first["type"] == "extra_forbidden":
            raise ApiError(400, f"unknown parameter {loc!r}", param=name) from None
        raise ApiError(400, f"{loc}: {first['msg']} (got {first.get('input')!r:.80})",
                       param=name) from None
    req.check_supported()
    return req


# -- stop strings ------------------------------------------------------------------------------
class StopStrings:
    """Finds the first stop string to complete in streamed text (the earliest end; of two ending
    together, the longer), whatever the pieces the text comes in. ``push(text)`` returns (text
    safe to emit, hit): text that may still begin a stop string is held back until it cannot;
    on a hit the returned text ends right before the stop string (not part of the output)."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        buf = self._pending + text
        hits = [(i + len(s), i) for s, i in ((s, buf.find(s)) for s in self.stops) if i >= 0]
        if hits:
            self._pending = ""
            return buf[:min(hits)[1]], True
        keep = 0
        for s in self.stops:  # the longest tail of buf that begins some stop string
            for n in range(min(len(s) - 1, len(buf)), keep, -1):
                if s.startswith(buf[-n:]):
                    keep = n
                    break
        self._pending = buf[len(buf) - keep:]
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out


# -- responses ---------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion(rid: str, model: str, choices: list[tuple[str, str | None]], use: dict | None,
               created: int) -> dict:
    """A completion body; ``choices``: (text, finish reason) in index order."""
    out = {"id": rid, "object": "text_completion", "created": created, "model": model,
           "choices": [{"index": i, "text": text, "finish_reason": finish, "logprobs": None}
                       for i, (text, finish) in enumerate(choices)]}
    if use is not None:
        out["usage"] = use
    return out


def chat(rid: str, model: str, choices: list[tuple[str, str | None]], use: dict | None,
         created: int) -> dict:
    """A chat completion body; ``choices``: (content, finish reason) in index order."""
    out = {"id": rid, "object": "chat.completion", "created": created, "model": model,
           "choices": [{"index": i, "message": {"role": "assistant", "content": text},
                        "finish_reason": finish, "logprobs": None}
                       for i, (text, finish) in enumerate(choices)]}
    if use is not None:
        out["usage"] = use
    return out


def chat_chunk(rid: str, model: str, delta: dict | None, finish: str | None, use: dict | None,
               created: int, index: int = 0) -> dict:
    """A chat stream chunk of choice ``index`` (``delta`` None: no choice, the usage chunk)."""
    choices = [] if delta is None else [{"index": index, "delta": delta, "finish_reason": finish,
                                         "logprobs": None}]
    out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
           "choices": choices}
    if use is not None:
        out["usage"] = use
    return out


def completion_chunk(rid: str, model: str, text: str | None, finish: str | None,
                     use: dict | None, created: int, index: int = 0) -> dict:
    """A completion stream chunk of choice ``index`` (``text`` None: the usage chunk)."""
    out = completion(rid, model, [] if text is None else [(text, finish)], use, created)
    for choice in out["choices"]:
        choice["index"] = index
    return out


def sse(obj: dict | str) -> str:
    """One server-sent event (``data: ...`` and a blank line)."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def now() -> int:
    return int(time.time())
