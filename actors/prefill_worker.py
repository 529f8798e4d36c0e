"""PrefillWorker (ring 3): runs a prompt through the same model code as decode and pushes the KV rows
with NIXL WRITEs into the landing target the coordinator picked. Plain class; made remote in
:mod:`hisparse_ray.actors.launch`.
"""

from __future__ import annotations

import collections
import threading
import time

import torch

from hisparse_ray.deploy import PrefillSpec
from hisparse_ray.errors import CapacityError, StateError
from hisparse_ray.kernels.kvfp8 import row_codec
from hisparse_ray.landing.plan import group_notif
from hisparse_ray.landing.segments import split_by_memory_kind, write_groups
from hisparse_ray.transfer import (
    MemKind, NixlTransferEngine, PreparedWrite, TransferEngine, WriteSegment, discard_prepared,
    prepare_writes, write_all_with_retry,
)
from hisparse_ray.types import LandingOrder, PrefillResult, unpack

SEND_REGION = "send"
KEYS_REGION = "send.keys"


class PrefillWorker:
    """One prefill process with one NIXL agent.

    Send buffers: ``[L, max_prompt_tokens, row_bytes]`` uint8 (KV rows encoded in the spec's
    ``kv_cache_dtype``, the bytes the replica's pools hold) and ``[L, max_prompt_tokens,
    key_row_bytes]`` uint8 (indexer keys, model dtype) on the worker's device, registered once.
    They hold one prefilled request at a time: ``prefill(rid, tokens)`` fills it, ``push(order)`` (one
    or more times, e.g. chunk by chunk through a staging pool) WRITEs pages of it, ``drop(rid)`` frees
    it. Lifecycle: construct -> ``endpoint()`` to decode ranks -> ``add_peer`` theirs -> prefills ->
    ``shutdown``.
    """

    def __init__(self, spec: PrefillSpec, engine: TransferEngine | None = None) -> None:
        if not spec.use_cuda:
            torch.set_num_threads(1)
        self.spec = spec
        self.model = spec.model.build(spec.device)
        cfg = self.model.cfg
        itemsize = torch.empty((), dtype=self.model.dtype).element_size()
        # KV rows leave in the replica's KV-cache dtype (kernels/kvfp8.py): fp8 656 B rows when asked
        self.codec = row_codec(spec.kv_cache_dtype, cfg, self.model.dtype)
        self.row_bytes = self.codec.row_bytes
        self.num_layers = cfg.num_hidden_layers
        self.key_row_bytes = cfg.index_head_dim * itemsize
        self.page_bytes_stride = spec.max_prompt_tokens * self.row_bytes
        self.key_bytes_stride = spec.max_prompt_tokens * self.key_row_bytes
        self.send = torch.zeros(self.num_layers, spec.max_prompt_tokens, self.row_bytes,
                                dtype=torch.uint8, device=spec.device)
        self.send_keys = torch.zeros(self.num_layers, spec.max_prompt_tokens, self.key_row_bytes,
                                     dtype=torch.uint8, device=spec.device)
        self.engine = engine if engine is not None else NixlTransferEngine(
            f"prefill-{spec.name}-{id(self):x}")
        self.engine.register(SEND_REGION, self.send)
        self.engine.register(KEYS_REGION, self.send_keys)
        self._lock = threading.Lock()
        self._held: tuple[str, int] | None = None  # (request id, positions) in the send buffer
        self.stats = {"prefills": 0, "pushes": 0, "pushed_bytes": 0, "push_s": 0.0, "prefill_s": 0.0,
                      "failed_pushes": 0, "pushes_started": 0, "pushes_with_prefill": 0}
        # (request id, call started, WRITEs planned, last DONE): perf_counter() per push
        self.landing_trace: collections.deque = collections.deque(maxlen=10_000)

    def ready(self) -> str:
        return self.engine.name

    def node_info(self) -> dict:
        import os

        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    def kv_row_bytes(self) -> int:
        """Bytes of one KV row this worker sends (its ``kv_cache_dtype``)."""
        return self.row_bytes

    def endpoint(self) -> tuple[str, bytes]:
        """(agent name, agent metadata), taken after the send buffer was registered."""
        return self.engine.name, self.engine.agent_metadata()

    def add_peer(self, metadata: bytes) -> str:
        return self.engine.add_peer(metadata)

    def remove_peer(self, peer: str) -> None:
        self.engine.remove_peer(peer)

    def direct_host_write(self, peer: str) -> bool:
        """Whether this worker's send buffer can WRITE ``peer``'s host memory at native speed."""
        source = MemKind.DEVICE if self.send.is_cuda else MemKind.HOST
        return self.engine.supports_direct_host_write(peer, source)

    def prefill(self, request_id: str, tokens: list[int], keys_inline: bool = True
                ) -> PrefillResult:
        """Run positions ``0..len(tokens)-1`` through the model; keep their KV rows and indexer
        keys in the send buffers (replacing any earlier request). ``keys_inline``: also return the
        keys (numpy, through Ray's object store; the fallback for replicas without key staging);
        False: the keys travel only by ``push`` (``LandingDest.key_rows``)."""
        T = len(tokens)
        if T > self.spec.max_prompt_tokens:
            raise CapacityError("prefill send buffer positions", T, self.spec.max_prompt_tokens)
        t0 = time.perf_counter()
        with self._lock:
            self._held = None
            keys = None
            if T:
                if self.spec.synthetic_kv:
                    keys = self._synthetic(T, tokens)
                else:
                    ids = torch.tensor(tokens, dtype=torch.int64, device=self.spec.device)
                    _, rows, keys = self.model.prefill(ids, batch_invariant=self.spec.batch_invariant)
                    for layer in range(self.num_layers):  # one layer's encoding temporaries at a time
                        self.send[layer, :T] = self.codec.encode(rows[layer])
                    self.send_keys[:, :T] = keys.contiguous().view(torch.uint8).reshape(
                        self.num_layers, T, self.key_row_bytes)
                if self.send.is_cuda:  # NIXL reads the buffers outside torch's stream order
                    torch.cuda.synchronize()
                keys = keys.float().cpu().numpy() if keys_inline else None
            self._held = (request_id, T)
        dt = time.perf_counter() - t0
        self.stats["prefills"] += 1
        self.stats["prefill_s"] += dt
        return PrefillResult(request_id, T, keys, dt)

    def prefill_and_push(self, request_id: str, tokens: list[int], order: LandingOrder | bytes,
                         page_size: int) -> tuple[int, float, float, float]:
        """``prefill`` (keys by NIXL only) and at once ``push(order)``, in one call
        (``ReplicaSpec.landing_push_with_prefill``): the WRITE starts as soon as the KV exists,
        without a round trip through the lander. Its segments and NIXL transfers are built
        BEFORE the prefill (a WRITE reads its bytes only once posted), so after the prefill only
        the posts remain. Returns (bytes moved, WRITE seconds, the ``perf_counter`` stamp when
        prefill ended, prefill seconds)."""
        self.stats["pushes_with_prefill"] += 1
        order = unpack(order)
        prepared: list[list[PreparedWrite]] = []
        planned = None
        try:
            if 0 < len(tokens) <= self.spec.max_prompt_tokens:  # else prefill raises, typed
                jobs, moved = self._plan(order, page_size, len(tokens))
                for phase in self._phases(jobs):
                    prepared.append(prepare_writes(self.engine, phase))
                planned = (prepared, moved)
            result = self.prefill(request_id, tokens, keys_inline=False)
            t_done = time.perf_counter()
            moved, seconds = self._push(order, page_size, planned)
        finally:
            for phase in prepared:  # the ones a failure left unposted
                discard_prepared(self.engine, phase)
        return moved, seconds, t_done, result.prefill_s

    def _synthetic(self, T: int, tokens: list[int]) -> torch.Tensor:
        """``PrefillSpec.synthetic_kv`` (benchmarks): fill rows and keys of positions ``0..T-1``
        layer by layer with normal values seeded by the prompt; returns the keys ``[L, T, d]``."""
        cfg, dtype, dev = self.model.cfg, self.model.dtype, self.spec.device
        gen = torch.Generator(device=dev).manual_seed(hash(tuple(tokens[:64])) & 0x7FFFFFFF)
        keys = torch.empty(self.num_layers, T, cfg.index_head_dim, dtype=dtype, device=dev)
        for layer in range(self.num_layers):
            rows = torch.randn(T, cfg.row_dim, generator=gen, device=dev).to(dtype)
            self.send[layer, :T] = self.codec.encode(rows)
            keys[layer] = torch.randn(T, cfg.index_head_dim, generator=gen, device=dev).to(dtype)
            self.send_keys[layer, :T] = keys[layer].view(torch.uint8).reshape(
                T, self.key_row_bytes)
        return keys

    def push(self, order: LandingOrder | bytes, page_size: int) -> tuple[int, float]:
        """WRITE ``order``'s pages of the held request (one WRITE + notification per dest, with
        retries; consecutive pages into consecutive blocks are one descriptor per layer);
        returns (bytes moved, seconds from the first post to the last DONE). Pushes of one
        request may run in any order; ``drop`` frees the send buffers.
        TransferError / TransferTimeoutError after the last attempt, tagged with the request id.
        ``order`` may come as :func:`~hisparse_ray.types.pack`'s bytes."""
        return self._push(unpack(order), page_size, None)

    def _plan(self, order: LandingOrder, page_size: int, T: int
              ) -> tuple[list[tuple[list[WriteSegment], bytes]], int]:
        """The order's WRITE jobs (segments, notification) for ``T`` held positions, and bytes."""
        jobs, moved = [], 0
        for dest in order.dests:
            groups = write_groups(dest, SEND_REGION, self.page_bytes_stride,
                                  self.row_bytes, page_size, T, key_local=KEYS_REGION,
                                  key_layer_stride=self.key_bytes_stride,
                                  key_row_bytes=self.key_row_bytes)
            if len(groups) > 1 and not all(groups):
                raise StateError(f"landing WRITE to rank {dest.rank} split in "
                                 f"{len(groups)} layer groups has an empty group")
            for g, segs in enumerate(groups):
                if segs:
                    jobs.append((segs, group_notif(dest.notif, g, len(groups))))
                    moved += sum(s.nbytes for s in segs)
        return jobs, moved

    def _phases(self, jobs: list[tuple[list[WriteSegment], bytes]]) -> list[list]:
        """Every job (one per destination rank; its notification tells the rank that ALL of
        the job's bytes arrived) in two phases: a job whose segments span memory kinds (KV rows
        into DRAM plus keys into VRAM) is split (``split_by_memory_kind``): its leading groups
        go in phase 1 without a notification, its last group in phase 2 with it."""
        kind = lambda name: self.engine.region(name).kind  # noqa: E731
        split = [(split_by_memory_kind(segs, kind), notif) for segs, notif in jobs]
        return [[(g, b"") for groups, _ in split for g in groups[:-1]],
                [(groups[-1], notif) for groups, notif in split]]

    def _push(self, order: LandingOrder, page_size: int,
              planned: tuple[list[list[PreparedWrite]], int] | None) -> tuple[int, float]:
        """``push`` of an unpacked order; ``planned``: its two phases' WRITEs, already built
        (``prefill_and_push``) for exactly the held positions, and their bytes."""
        t_enter = time.perf_counter()
        self.stats["pushes_started"] += 1
        with self._lock:
            if self._held is None or self._held[0] != order.request_id:
                raise StateError(f"request {order.request_id!r} is not held by prefill worker "
                                 f"{self.spec.name!r} (holds {self._held})")
            T = self._held[1]
            t0 = time.perf_counter()
            try:
                if planned is None:
                    jobs, moved = self._plan(order, page_size, T)
                    phases = self._phases(jobs)
                else:
                    phases, moved = planned
                t_planned = time.perf_counter()
                self._write_all(phases, order)
            except Exception:
                self.stats["failed_pushes"] += 1
                raise
            t_done = time.perf_counter()
            dt = t_done - t0
            self.landing_trace.append((order.request_id, t_enter, t_planned, t_done))
            self.stats["pushes"] += 1
            self.stats["pushed_bytes"] += moved
            self.stats["push_s"] += dt
            return moved, dt

    def _write_all(self, phases: list[list], order: LandingOrder) -> None:
        """WRITE both phases (``_phases``), the second after the first is DONE, so a
        notification always means all of a rank's bytes landed. In each phase every WRITE is
        posted before any is awaited, so the ranks' WRITEs overlap (``write_all_with_retry``:
        failed ones are re-posted up to ``order.attempts`` times)."""
        retry = dict(attempts=order.attempts, timeout_s=order.timeout_s,
                     request_id=order.request_id)
        for phase in phases:
            if phase:
                write_all_with_retry(self.engine, phase, **retry)

    def drop(self, request_id: str) -> None:
        with self._lock:
            if self._held is not None and self._held[0] == request_id:
                self._held = None

    def get_stats(self) -> dict:
        return dict(self.stats)

    def get_landing_trace(self) -> list[tuple[str, float, float, float]]:
        """(request id, push call started, WRITEs planned, last WRITE DONE) ``perf_counter``
        stamps of the recent pushes (benchmarks; comparable with the decode side's on one host)."""
        return list(self.landing_trace)

    def shutdown(self) -> None:
        self.engine.close()
