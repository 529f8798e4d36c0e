"""The ingress's answer when the HiSparse deployment's call fails after admitting a request
with an error no status maps (a bug): an OpenAI 500 body (unary) or error event (stream), and
the call cancelled, with a fake deployment handle in place of Serve's (no Ray)."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("ray.serve")


class _Call:
    """A ``generate_choices`` call that admits its choices, then fails."""

    def __init__(self, choices: list[dict]) -> None:
        self.items = [{"admitted": len(choices)}, {"choice": 0, "text": "ab"}]
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> dict:
        if self.items:
            return self.items.pop(0)
        raise RuntimeError("boom")

    def cancel(self) -> None:
        self.cancelled = True


class _Engine:
    def __init__(self) -> None:
        self.calls: list[_Call] = []

    def options(self, stream: bool):
        return self

    @property
    def generate_choices(self):
        return self

    def remote(self, choices):
        self.calls.append(_Call(choices))
        return self.calls[-1]


def _request(body: dict):
    from starlette.requests import Request

    async def receive():
        return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}

    return Request({"type": "http", "method": "POST", "path": "/v1/completions",
                    "query_string": b"", "headers": [(b"content-type", b"application/json")]},
                   receive)


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_that_fails_after_admission_answers_an_openai_500(stream):
    from hisparse_ray.deploy import DeployOptions
    from hisparse_ray.serve import protocol as P
    from hisparse_ray.serve.openai_api import OpenAIServer

    engine = _Engine()
    door = OpenAIServer(engine, DeployOptions())
    body = {"model": door.model_id, "prompt": [1, 2, 3], "n": 2, "stream": stream}

    async def main():
        resp = await door._serve(_request(body), chat=False)
        if not stream:
            return resp.status_code, json.loads(resp.body)
        events = [e async for e in resp.answer.events()]
        return resp.status_code, json.loads(events[-2].removeprefix("data: "))

    status, out = asyncio.run(main())
    assert status == (200 if stream else 500), out
    assert out["error"]["type"] == "server_error" and "boom" in out["error"]["message"], out
    assert set(out["error"]) == {"message", "type", "param", "code"}
    assert engine.calls[0].cancelled, "the failed call's other choices were left running"
    assert P.api_error(RuntimeError("boom")) is None  # a bug, not a request error
