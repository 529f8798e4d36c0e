"""A full-resident twin of a fast-path engine, stepped in lockstep with it (shared by the fast-path
state machine): the same rank executor (:class:`HiSparseWorker` on the fast step) with every page
of a request on its own resident device blocks, fed step commands built from the very rows the
engine ran. Each row then runs in the same bucket, with the same batch mates in the same order,
as in the engine, so the engine's logits and tokens must equal the twin's bit for bit whatever
the engine's schedule (several buckets, spills, restores, waiting requests): with an
``Engine(full_resident=True)`` the schedules, and so the buckets, would differ."""

from __future__ import annotations

import itertools
import os
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from hisparse_ray.engine import EngineConfig
from hisparse_ray.fastpath.config import FastPathConfig
from hisparse_ray.host.pool import HostPool
from hisparse_ray.rank.executor import HiSparseWorker
from hisparse_ray.types import (
    NO_BLOCK, Admission, BatchRow, LandingPage, LandingTarget, RequestHandle, RequestId,
    SamplingParams, StepCommand, TableDiff,
)

_ids = itertools.count()


def worker_rids(w: HiSparseWorker) -> set:
    """Every request some per-request state of a worker names."""
    out = set(w.runtime.requests) | set(w.index) | set(w.samplers)
    if w.fast is not None:
        out |= set(w.fast.keys.pages) | set(w.fast._tables)
    return out


class LockstepTwin:
    """Full-resident replay of an engine's fast-path steps. ``capacity``: requests landed at once
    (each gets ``ceil(max_context / page_size)`` device blocks for its whole life at landing).

    Lifecycle per request: landed (prefilled like ``Engine._land``: the exact prefill, its KV on
    the request's blocks, its index keys, its sampler) when it first appears in a step's rows ->
    one row per engine row -> released by the first step after the engine finished it."""

    def __init__(self, model: Any, cfg: EngineConfig, capacity: int = 32) -> None:
        fast = cfg.fast_path
        self.model, self.ps = model, cfg.page_size
        self.pages = -(-fast.max_context // self.ps)
        layout = cfg.layout(model.cfg, model.dtype)
        self.pool = HostPool.create(f"twin{os.getpid()}-{next(_ids)}", layout, 1)
        self.pool.unlink()
        try:
            self.worker = HiSparseWorker(
                model, cfg.hisparse, layout, capacity * self.pages, self.pool,
                max_requests=capacity + 1, kv_codec=cfg.codec(model.cfg, model.dtype),
                fast=FastPathConfig(max_context=fast.max_context, buckets=fast.buckets))
        except BaseException:
            self.pool.destroy()
            raise
        self.worker.on_logits = lambda rows, out: self._out.append(out.detach().clone())
        self._out: list[Tensor] = []
        self.handles: dict[str, int] = {}
        self._free_handles = list(range(capacity - 1, -1, -1))
        self._bases: dict[str, int] = {}
        self._free_bases = [i * self.pages for i in range(capacity - 1, -1, -1)]
        self._step = 0

    def _land(self, rid: str, prompt: Sequence[int], max_new: int,
              sampling: SamplingParams | None) -> int:
        assert self._free_bases, "twin capacity exceeded"
        h, base = self._free_handles.pop(), self._free_bases.pop()
        self.handles[rid], self._bases[rid] = h, base
        T = len(prompt) - 1
        keys = None
        if T:
            with torch.no_grad():
                _, kv_rows, keys = self.model.prefill(torch.tensor(prompt[:T]), batch_invariant=True)
            pages = tuple(LandingPage(i, NO_BLOCK, base + i, False) for i in range(-(-(T + 1) // self.ps)))
            self.worker.land_local(Admission(RequestId(rid), LandingTarget.RESIDENT, T, pages), kv_rows)
        self.worker.install_index_keys(RequestId(rid), keys, T + max_new + 1)
        self.worker.set_sampling(RequestId(rid), sampling or SamplingParams())
        return h

    def step(self, rows: Sequence[Any], request: Callable[[str], dict],
             finished: Callable[[str], bool]) -> tuple[list[int], Tensor | None]:
        """Run the engine's ``rows`` (its ``Row``s of one step, in order) -> (sampled tokens,
        logits ``[B, V]``). ``request(rid)``: what it was added with (prompt, max_new,
        sampling); ``finished(rid)``: the engine finished it (released here unless in ``rows``)."""
        batch_ids = {r.request_id for r in rows}
        released = []
        for rid in [r for r in self.handles if r not in batch_ids and finished(r)]:
            released.append(self.handles.pop(rid))
            self._free_bases.append(self._bases.pop(rid))
        defined, diffs, batch = [], [], []
        for r in rows:
            rid = r.request_id
            first = rid not in self.handles
            if first:
                q = request(rid)
                h = self._land(rid, q["prompt"], q["max_new"], q["sampling"])
                defined.append(RequestHandle(h, RequestId(rid)))
                diffs += [TableDiff(h, i, NO_BLOCK, self._bases[rid] + i) for i in range(self.pages)]
            batch.append(BatchRow(self.handles[rid], r.seq_len, r.input_token, () if first else None))
        self._step += 1
        self._out.clear()
        report = self.worker.execute(StepCommand(self._step, tuple(batch), tuple(diffs), (), (),
                                                 tuple(released), tuple(defined), 0))
        self._free_handles += released  # defined again from the next command on
        assert [rid for rid, _ in report.sampled] == [r.request_id for r in rows]
        return [t for _, t in report.sampled], (self._out[0] if rows else None)

    def release_finished(self, finished: Callable[[str], bool]) -> None:
        """One command without rows: the requests the engine finished are released."""
        self.step((), lambda rid: {}, finished)

    def close(self) -> None:
        try:
            self.worker.close()
        finally:
            self.pool.destroy()
