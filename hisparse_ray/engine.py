"""In-process decode engine (TP 1, one process): the coordinator core, one HiSparseWorker, the model
and a private host pool, driven step by step with continuous batching (ring 2).

Per ``step()``: admit what fits (new and waiting requests), prefill and land each admitted prefix
locally (device pages for a resident landing, host blocks for the host tier), then take the step's
command, execute it and apply the report. ``full_resident=True`` sizes the device pool so that every
request lands on resident pages and never spills: the same code path with all KV on the device, the
baseline every comparison uses. The actor system runs the same pieces across processes.
"""

from __future__ import annotations

import itertools
import operator
import os
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from hisparse_ray.checks import (
    check_bool, check_choice, check_int, check_optional_number, check_type,
)
from hisparse_ray.config import (
    CoordinatorConfig, HiSparseConfig, KVLayout, hot_buffer_blocks, kv_rows_lossless,
)
from hisparse_ray.core.admission import validate_request
from hisparse_ray.core.coordinator import Coordinator
from hisparse_ray.errors import (
    CapacityError, ConfigError, DuplicateRequestError, InvalidRequestError, StateError,
)
from hisparse_ray.fastpath.config import INDEX_PAGE, FastPathConfig
from hisparse_ray.host.pool import HostPool
from hisparse_ray.kernels.kvfp8 import KV_DTYPES, row_codec
from hisparse_ray.rank.executor import HiSparseWorker
from hisparse_ray.types import RequestId, RequestState, SamplingParams

_ids = itertools.count()


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Sizing of one in-process engine.

    num_device_blocks: device pool blocks (``page_size`` rows per layer each) for resident pages and
        hot buffers; ignored (grown) in full-resident mode unless ``device_pool_gib`` is set.
    full_resident: every request lands on resident device pages (the exactness baseline).
    device_pool_gib: the GPU memory budget of the KV device pool, the same for both modes (it
        replaces ``num_device_blocks``). Full-resident mode then has no host tier: a request
        reserves device blocks for its whole life at admission and waits while they do not fit,
        the honest capacity baseline. None: full-resident grows its pool to what the host pool
        would hold (every request fits: the exactness baseline).
    kv_cache_dtype: how KV rows are stored (host pool, device pool, landing bytes): "auto" (the
        model's dtype), "fp32", "bf16" or "fp8" (DeepSeek-V3.2's 656 B layout; attention reads
        dequantized rows), independent of the weights' dtype.
    fast_path: decode through the fast step (:mod:`hisparse_ray.fastpath`: batched, paged GPU
        index keys, FlashMLA / DeepGEMM where they run, CUDA graphs per bucket); None = the
        reference path. Its largest bucket must hold ``max_batch``.
    lookahead: pipeline the steps one deep: the host takes and launches step N + 1 before it
        reads step N's tokens, so its work (applying report N, building command N + 1, filling
        the inputs) runs while the GPU computes. Every request chains (``Coordinator.admit
        (chain=True)``: a row's input is read on the device from the step before, where it was
        sampled, greedy or not). The tokens are those of ``lookahead=False``; a step that finds
        eos was already followed by one more row of its request, whose output is dropped. Pays
        on the GPU's fast path only (elsewhere a step runs to the end when launched): "auto"
        (default) = on with ``fast_path`` on a CUDA device (0.96-0.99x the ms/step on the H100,
        61 layers, batch 1-16), True, False.
    device: "cpu", "cuda" or "cuda:N". backend: the resolver's ("auto", "cuda", "torch").
    Every field is checked at construction (ConfigError naming it); ``Engine`` then checks the
    HiSparse config against the model (``HiSparseConfig.check_model``).
    """

    hisparse: HiSparseConfig = field(default_factory=HiSparseConfig.tiny)
    page_size: int = 8
    num_device_blocks: int = 8
    max_batch: int = 16
    full_resident: bool = False
    device: str = "cpu"
    backend: str = "auto"
    batch_invariant: bool = True  # see HiSparseWorker and DSAModel.prefill: exact; False = throughput
    kv_cache_dtype: str = "auto"
    device_pool_gib: float | None = None
    fast_path: FastPathConfig | None = None
    lookahead: bool | str = "auto"

    def __post_init__(self) -> None:
        check_type("hisparse", self.hisparse, HiSparseConfig)
        for key in ("page_size", "num_device_blocks", "max_batch"):
            check_int(key, getattr(self, key), lo=1)
        check_bool("full_resident", self.full_resident)
        if not isinstance(self.device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ConfigError("device", self.device, "must be 'cpu', 'cuda' or 'cuda:N'")
        check_choice("backend", self.backend, ("auto", "cuda", "torch"))
        check_bool("batch_invariant", self.batch_invariant)
        if self.lookahead != "auto" and type(self.lookahead) is not bool:
            raise ConfigError("lookahead", self.lookahead, "True, False or 'auto'")
        check_choice("kv_cache_dtype", self.kv_cache_dtype, ("auto", *KV_DTYPES))
        check_optional_number("device_pool_gib", self.device_pool_gib, lo=0, lo_open=True,
                              why="GiB")
        hot = self.hot_blocks
        if not self.full_resident and self.device_pool_gib is None and \
                self.num_device_blocks < hot:
            raise ConfigError("num_device_blocks", self.num_device_blocks,
                              f"must hold one hot buffer ({hot} blocks for device_buffer_size="
                              f"{self.hisparse.device_buffer_size}, page_size={self.page_size})")
        if self.fast_path is not None:
            check_type("fast_path", self.fast_path, FastPathConfig, "a FastPathConfig or None")
            if self.fast_path.max_batch < self.max_batch:
                raise ConfigError("fast_path.buckets", self.fast_path.buckets,
                                  f"the largest bucket must hold max_batch={self.max_batch}")

    def codec(self, model_cfg: Any, dtype: torch.dtype):
        """The KV row codec of ``kv_cache_dtype`` for this model."""
        return row_codec(self.kv_cache_dtype, model_cfg, dtype)

    @property
    def pipelined(self) -> bool:
        """Whether steps pipeline one deep (``lookahead``; "auto": the fast path on CUDA)."""
        if self.lookahead == "auto":
            return self.fast_path is not None and self.device.startswith("cuda")
        return self.lookahead

    @property
    def hot_blocks(self) -> int:
        """Device blocks of one request's hot buffer (``config.hot_buffer_blocks``)."""
        return hot_buffer_blocks(self.hisparse.device_buffer_size, self.page_size)

    def layout(self, model_cfg: Any, dtype: torch.dtype) -> KVLayout:
        return KVLayout(num_layers=model_cfg.num_hidden_layers, page_size=self.page_size,
                        row_bytes=self.codec(model_cfg, dtype).row_bytes)


def _check_devices(c: EngineConfig) -> None:
    """ConfigError naming ``device`` / ``backend`` when this machine cannot run them (checked when
    an engine starts, not in the config: a config may be written on one machine for another)."""
    if c.device != "cpu":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(c.device.partition(":")[2] or 0)
        if index >= n:
            raise ConfigError("device", c.device, f"this machine has {n} CUDA device(s)"
                              + ("" if n else "; use 'cpu'"))
    if c.backend == "cuda":
        from hisparse_ray.kernels import cuda
        if c.device == "cpu" or not cuda.available():
            raise ConfigError("backend", c.backend, "the CUDA resolver needs device='cuda' and "
                              "cupy with a CUDA device; 'auto' picks what runs here")


@dataclass
class _Pending:
    prompt: list[int]
    max_new_tokens: int
    eos_token_id: int | None


class Engine:
    """Prefill + continuous-batching decode through the coordinator core and the worker runtime.

    Lifecycle: ``add_request`` (any time) -> ``step`` until ``done`` (or ``run``) -> ``result`` ->
    ``close`` (destroys the host pool segment). Also a context manager.
    """

    def __init__(self, model: Any, config: EngineConfig | None = None) -> None:
        self.model, self.config = model, config or EngineConfig()
        c = check_type("config", self.config, EngineConfig)
        _check_devices(c)
        c.hisparse.check_model(model.cfg.index_topk, model=f"the {model.cfg.kind} model")
        self.layout = c.layout(model.cfg, model.dtype)
        num_host = self.layout.host_blocks(c.hisparse.host_pool_gib)
        if num_host < 1:
            raise ConfigError("host_pool_gib", c.hisparse.host_pool_gib,
                              f"must hold at least one host block ({self.layout.block_bytes} B)")
        hot_blocks = c.hot_blocks
        num_device = c.num_device_blocks
        if c.device_pool_gib is not None:
            num_device = int(c.device_pool_gib * (1 << 30)) // self.layout.block_bytes
            if num_device < hot_blocks:
                raise ConfigError("device_pool_gib", c.device_pool_gib,
                                  f"must hold one hot buffer ({hot_blocks} blocks of "
                                  f"{self.layout.block_bytes} B)")
        elif c.full_resident:
            num_device = max(num_device, num_host + hot_blocks)
        self.core = Coordinator(CoordinatorConfig(
            num_device_blocks=num_device, num_host_blocks=num_host, page_size=c.page_size,
            device_buffer_size=c.hisparse.device_buffer_size, max_batch=c.max_batch,
            page_bytes=self.layout.block_bytes, row_bytes=self.layout.bytes_per_token,
            host_tier=not (c.full_resident and c.device_pool_gib is not None),
            publish_decoded=c.fast_path is None and kv_rows_lossless(
                c.kv_cache_dtype, str(model.dtype).removeprefix("torch.")),
            index_pages=None if c.fast_path is None else c.fast_path.index_pages,
            index_page_tokens=INDEX_PAGE))
        self.pool = HostPool.create(f"engine{os.getpid()}-{next(_ids)}", self.layout, num_host)
        self.pool.unlink()  # private: nothing attaches, so no exit path leaves the segment behind
        try:
            self.worker = HiSparseWorker(
                model, c.hisparse, self.layout, num_device, self.pool, device=c.device,
                max_requests=max(c.max_batch, num_device) + 1, backend=c.backend,
                batch_invariant=c.batch_invariant, kv_codec=c.codec(model.cfg, model.dtype),
                fast=c.fast_path)
        except BaseException:
            self.pool.destroy()
            raise
        self._pending: dict[RequestId, _Pending] = {}
        self._known: dict[RequestId, _Pending] = {}
        self._inflight = None  # the launched step not finished yet (lookahead)
        self.steps = 0
        # prefill_hook(request_id, layer, topk) may record or replace a prefill's top-k (tests, tools)
        self.prefill_hook: Any = None

    # -- requests --------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: Sequence[int], max_new_tokens: int, *,
                    sampling: SamplingParams | None = None, eos_token_id: int | None = None) -> None:
        rid = RequestId(request_id)
        if rid in self._known:
            raise DuplicateRequestError(rid)
        if sampling is not None:
            check_type("sampling", sampling, SamplingParams)
        vocab = self.model.cfg.vocab_size
        eos_token_id = _eos_id(rid, eos_token_id, vocab)
        p = _Pending(_token_ids(rid, prompt), max_new_tokens, eos_token_id)
        bad = [t for t in p.prompt if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(rid, f"token {bad[0]!r} is not an id in [0, {vocab}) of this model")
        validate_request(rid, p.prompt, max_new_tokens, eos_token_id)  # before the sum below
        fast = self.config.fast_path
        if fast is not None and len(p.prompt) + max_new_tokens > fast.max_context:
            raise CapacityError(f"positions of request {rid!r} (fast_path.max_context)",
                                len(p.prompt) + max_new_tokens, fast.max_context)
        adm = self.core.admit(rid, p.prompt, max_new_tokens, eos_token_id,
                              chain=self.config.pipelined)  # validates first
        self._known[rid] = p
        self.worker.set_sampling(rid, sampling or SamplingParams())
        if adm is not None:
            self._land(adm)
        else:
            self._pending[rid] = p

    def _land(self, adm) -> None:
        """Prefill and land one admission. If that fails (e.g. the fast path's index-key pool is
        full), the request finishes as a failed landing, frees every lease and worker state it
        held, and the error is raised: nothing stays half-landed."""
        rid = adm.request_id
        p = self._known[rid]
        self._pending.pop(rid, None)
        T = adm.num_positions
        keys = None
        try:
            if T:
                tokens = torch.tensor(p.prompt[:T], dtype=torch.int64, device=self.model.device)
                hook = None
                if self.prefill_hook is not None:
                    hook = lambda layer, topk: self.prefill_hook(rid, layer, topk)  # noqa: E731
                with torch.no_grad():
                    _, kv_rows, keys = self.model.prefill(
                        tokens, topk_hook=hook, batch_invariant=self.config.batch_invariant)
                self.worker.land_local(adm, kv_rows)
            self._free_released_keys()
            self.worker.install_index_keys(rid, keys, T + p.max_new_tokens + 1)
        except BaseException:
            self.core.apply_landing_failed(rid)
            self._forget_unnamed(rid)
            raise
        self.core.apply_landed(rid)

    def _land_all(self, admissions) -> None:
        """Land every admission; a failed one does not keep the others from landing (its error
        is raised after them)."""
        error = None
        for adm in admissions:
            try:
                self._land(adm)
            except Exception as e:  # noqa: BLE001 - re-raised below
                error = error or e
        if error is not None:
            raise error

    def _free_released_keys(self) -> None:
        """Give back the fast path's index-key pages of requests the coordinator has released.
        The worker learns of a release from the next step's command; a request landing before
        that step (added right after another finished) would otherwise find a capped pool
        (``FastPathConfig.index_pages``) still full of pages nothing will read again."""
        fast = self.worker.fast
        if fast is None:
            return
        for rid in [r for r in fast.keys.pages if r in self._known]:
            if self.core.state(rid) is RequestState.RELEASED:
                fast.release(rid)

    def _forget_unnamed(self, rid: RequestId) -> None:
        """Drop the worker's state of a released request no step ever named (a step that names
        a request releases its state itself)."""
        if (self.core.state(rid) is RequestState.RELEASED
                and rid not in self.worker.runtime.requests):
            self.worker.index.pop(rid, None)
            self.worker.samplers.pop(rid, None)
            if self.worker.fast is not None:  # its paged index keys
                self.worker.fast.release(rid)

    def abort(self, request_id: str) -> list[int]:
        """Finish a request now (waiting or running); its blocks are released once nothing of it
        is in flight. Returns the tokens it generated so far (a prefix of its full answer)."""
        rid = RequestId(request_id)
        self.core.finish(rid)  # UnknownRequestError / StateError before anything changes
        self._pending.pop(rid, None)
        self._forget_unnamed(rid)
        return self.result(request_id)

    # -- stepping --------------------------------------------------------------------------------
    def step(self) -> bool:
        """Admit what fits, run one decode step. False when nothing could be done.

        With ``lookahead`` the step is launched and left in flight; the previous one is finished
        (its tokens applied) after that launch, so ``result`` may lag one step behind until
        ``run`` returns or ``done`` holds."""
        if self._inflight is not None and not self.core.rows_chain(self._inflight.cmd):
            self._finish_inflight()  # an unchained row's token feeds the next step
        self._land_all(self.core.poll_waiting())
        cmd = self.core.take_command()
        if cmd is None:
            return self._finish_inflight()
        with torch.no_grad():
            launched = self.worker.launch(cmd)
        self.steps += 1
        self._finish_inflight()
        if self.config.pipelined:
            self._inflight = launched
        else:
            self.core.apply_report(self.worker.finish(launched))
        return True

    def _finish_inflight(self) -> bool:
        """Finish the step in flight, if any (True then)."""
        launched, self._inflight = self._inflight, None
        if launched is None:
            return False
        self.core.apply_report(self.worker.finish(launched))
        return True

    @property
    def done(self) -> bool:
        if self._inflight is not None:
            return False
        return all(self.core.state(r) in (RequestState.FINISHED, RequestState.RELEASED)
                   for r in self._known)

    def run(self, max_steps: int = 1_000_000) -> dict[str, list[int]]:
        """Step until every request finished; returns generated tokens per request."""
        idle = 0
        for _ in range(max_steps):
            if self.done:
                break
            idle = 0 if self.step() else idle + 1
            if idle > 3:
                raise StateError("engine made no progress: a request can never be scheduled")
        while self.step():  # drain in-flight transfers of finished requests
            pass
        return {r: self.result(r) for r in self._known}

    def result(self, request_id: str) -> list[int]:
        return list(self.core.generated(RequestId(request_id)))

    def close(self) -> None:
        try:
            if self._inflight is not None:
                launched, self._inflight = self._inflight, None
                self.worker.finish(launched)  # its outputs are dropped; its copies drain
            self.worker.close()
        finally:
            self.pool.destroy()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _token_ids(rid: RequestId, prompt: Any) -> list[int]:
    """``prompt`` as a list of Python ints: any iterable of integers (numpy's, 0-d torch tensors
    too); InvalidRequestError for anything else (None, floats, bools, strings)."""
    if isinstance(prompt, (str, bytes)):
        raise InvalidRequestError(rid, f"prompt is text ({prompt[:40]!r}): the engine takes token "
                                       "ids; encode it with the model's tokenizer first "
                                       "(hisparse_ray.model.source.resolve(folder).tokenizer(); "
                                       "a folder without tokenizer.json takes token ids only)")
    try:
        items = list(prompt)
    except TypeError:
        raise InvalidRequestError(rid, f"prompt must be a sequence of token ids, got "
                                       f"{type(prompt).__name__} {prompt!r}"[:200]) from None
    out = []
    for t in items:
        try:
            if isinstance(t, bool) or getattr(t, "dtype", None) == torch.bool:
                raise TypeError
            out.append(operator.index(t))
        except TypeError:
            raise InvalidRequestError(rid, f"token {t!r} is not an integer token id") from None
    return out


def _eos_id(rid: RequestId, eos: Any, vocab: int) -> int | None:
    """``eos_token_id`` as an int id of this model (numpy integers too) or None;
    InvalidRequestError naming the value otherwise (one outside the vocabulary could never be
    sampled, so the request would silently run to its ``max_new_tokens``)."""
    if eos is None:
        return None
    try:
        if isinstance(eos, bool):
            raise TypeError
        eos = operator.index(eos)
    except TypeError:
        raise InvalidRequestError(rid, f"eos_token_id={eos!r} must be an int or None") from None
    if not 0 <= eos < vocab:
        raise InvalidRequestError(rid, f"eos_token_id={eos} is not an id in [0, {vocab}) of this model")
    return eos


def generate(model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             config: EngineConfig | None = None, **kw: Any) -> list[list[int]]:
    """Convenience: run ``prompts`` through a fresh engine; tokens per prompt, in order."""
    with Engine(model, config) as eng:
        for i, p in enumerate(prompts):
            eng.add_request(f"req{i}", p, max_new_tokens, **kw)
        out = eng.run()
    return [out[f"req{i}"] for i in range(len(prompts))]
