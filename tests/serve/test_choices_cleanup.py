"""``HiSparseServer.generate_choices`` when its caller leaves at the very first item: the
per-choice tasks are cancelled before they ever ran, so their own cleanup (``_follow``'s abort)
never runs; every choice must still be forgotten and aborted (else it decodes to its
max_tokens for nobody). Ray-free: a stand-in hub and coordinator record what the server does."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from hisparse_ray.deploy import DeployOptions
from hisparse_ray.serve.server import HiSparseServer


class _Hub:
    def __init__(self) -> None:
        self.waiters: set[str] = set()
        self.aborted: list[str] = []

    def register(self, rid, stream):
        self.waiters.add(rid)
        return SimpleNamespace(rid=rid)

    def forget(self, rid, abort):
        if rid in self.waiters:  # as StreamHub: only a request still waited for is aborted
            self.waiters.discard(rid)
            if abort:
                self.aborted.append(rid)

    async def get(self, w, timeout):
        await asyncio.sleep(3600)  # no events: the choices would run for a long time


def _server() -> HiSparseServer:
    srv = HiSparseServer.__new__(HiSparseServer)

    async def submit(*args, **kwargs):
        return None

    srv.__dict__.update(_closed=False, _prefix="t-", hub=_Hub(), tokenizer=None, vocab_size=64,
                        max_prompt_tokens=100, options=DeployOptions(),
                        _coord=SimpleNamespace(submit=SimpleNamespace(remote=submit)))
    return srv


def test_a_caller_leaving_at_admission_aborts_every_choice():
    srv = _server()

    async def leave_at_once() -> None:
        gen = srv.generate_choices([{"ids": [1, 2, 3], "max_new_tokens": 5}] * 3)
        assert await gen.__anext__() == {"admitted": 3}
        await gen.aclose()  # in the same loop step: no choice task has run yet
        await asyncio.sleep(0)

    asyncio.run(leave_at_once())
    assert len(srv.hub.aborted) == 3 and not srv.hub.waiters
