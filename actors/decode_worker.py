"""DecodeWorker (ring 3): one TP rank of a decode replica. Owns its model shard, step executor
(:mod:`hisparse_ray.rank.executor`) and NIXL agent; rank 0 also creates the shared host pool and
the landing staging pool. Executes the coordinator's StepCommands received over a shared-memory
channel on a step thread; its side of a landing is :class:`~hisparse_ray.rank.landing.RankLanding`.
Plain class; made remote in :mod:`hisparse_ray.actors.launch`.
"""

from __future__ import annotations

import collections
import os
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

import ray
import torch

from hisparse_ray.actors import tp
from hisparse_ray.channel.pair import ChannelPair
from hisparse_ray.channel.ring import ChannelSpec
from hisparse_ray.deploy import ReplicaSpec
from hisparse_ray.errors import (
    ChannelClosedError, ChannelPeerLostError, ChannelTimeoutError, StateError,
)
from hisparse_ray.host.pool import HostPool
from hisparse_ray.rank.landing import RankLanding
from hisparse_ray.transfer import NixlTransferEngine, TransferEngine
from hisparse_ray.types import RankEndpoint, RankLandingStep, unpack

if TYPE_CHECKING:
    from hisparse_ray.rank.executor import HiSparseWorker

POLL_S = 0.2  # the step thread re-checks its stop flag this often while idle
HOT_COUNTS_EVERY = 16  # on a GPU rank 0 reads its hot-buffer counters every 16 steps (no per-step sync)


class DecodeWorker:
    """One TP rank. Lifecycle (driven by the launcher, in order): ``rendezvous`` (rank 0) ->
    ``join_tp`` (all ranks at once) -> ``create_host_pool`` (rank 0) / ``attach_host_pool`` (peers)
    -> ``build`` -> ``endpoint`` -> ``attach_channel`` (starts the step thread) -> landings and steps
    -> ``shutdown``.

    Threading: the step thread and Ray method calls (landing, stats) share the executor under one
    lock, so a landing is installed between two steps, never inside one.

    NIXL regions: every rank registers its device pool layers (VRAM on GPU, DRAM on CPU): resident
    landings WRITE all of them (MLA KV is replicated). The shared host pool and the staging pool
    are registered by rank 0 only: one physical copy serves every rank, and rank 0 is its writer.
    """

    def __init__(self, spec: ReplicaSpec, rank: int, engine: TransferEngine | None = None) -> None:
        if not spec.use_cuda:
            torch.set_num_threads(1)
        self.spec, self.rank = spec, rank
        self._engine = engine
        self.engine: TransferEngine | None = None  # this rank's NIXL agent, after build()
        self.pool: HostPool | None = None
        self.executor: HiSparseWorker | None = None  # this rank's step executor, after build()
        self.staging: list[torch.Tensor] = []
        self.key_staging: torch.Tensor | None = None  # [L, staging rows, key_row_bytes] uint8
        self.landing: RankLanding | None = None  # this rank's side of landings, after build()
        self._lock = threading.Lock()
        self._endpoint: RankEndpoint | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._channel: ChannelPair | None = None
        self._error: BaseException | None = None
        self._jitter: tuple[float, Any] | None = None  # set_finish_jitter (tests)
        self.steps = 0
        self.step_s = 0.0
        self.step_log: collections.deque = collections.deque(maxlen=100_000)  # (step, execute s)
        # (step, found, loaded, executed, report sent): perf_counter() stamps, one clock per host
        self.step_trace: collections.deque = collections.deque(maxlen=100_000)

    # -- lifecycle -----------------------------------------------------------------------------------
    def node_info(self) -> dict:
        ctx = ray.get_runtime_context()
        import torch.distributed as dist

        gpu = torch.cuda.get_device_properties(0).uuid if self.spec.use_cuda else None
        return {"rank": self.rank, "node_id": ctx.get_node_id(), "pid": os.getpid(),
                "ip": tp.node_ip(), "gpu": str(gpu) if gpu is not None else None,
                "tp_backend": dist.get_backend() if dist.is_initialized() else None}

    def rendezvous(self) -> tp.Rendezvous:
        if self.rank != 0:
            raise StateError("only rank 0 picks the TP rendezvous")
        return tp.rendezvous_address(self.spec.tp_size, self.spec.gpus_per_rank)

    def join_tp(self, rdv: tp.Rendezvous) -> None:
        if self.spec.use_cuda:
            torch.cuda.set_device(0)  # Ray exposes only this rank's GPU(s)
        tp.init_tp_group(rdv, self.rank)

    def check_tp(self) -> float:
        """All-reduce (sum) of ``rank + 1`` over the group: a health check of the TP group."""
        import torch.distributed as dist

        t = torch.tensor([float(self.rank + 1)], device=self.spec.device)
        if dist.is_initialized():
            dist.all_reduce(t)
        return float(t.item())

    def create_host_pool(self) -> str:
        if self.rank != 0:
            raise StateError("only rank 0 creates the host pool")
        self.pool = HostPool.create(self.spec.replica_id, self.spec.layout, self.spec.num_host_blocks,
                                    register_cuda=self.spec.use_cuda,
                                    shm_dir=self.spec.host_pool_dir)
        return self.pool.name

    def attach_host_pool(self, name: str) -> None:
        self.pool = HostPool.attach(name, register_cuda=self.spec.use_cuda,
                                    shm_dir=self.spec.host_pool_dir)

    def unlink_host_pool(self) -> None:
        """Rank 0, once every peer attached: the segment's name goes, the mappings stay, so no
        way this replica ends (SIGKILL of any rank included) leaves it in ``host_pool_dir``."""
        if self.rank != 0 or self.pool is None:
            raise StateError("only rank 0 unlinks the host pool, after creating it")
        self.pool.unlink()

    def build(self) -> RankEndpoint:
        """Model shard, runtime + step executor, NIXL regions; returns this rank's endpoint."""
        from hisparse_ray.kernels.kvfp8 import row_codec
        from hisparse_ray.rank.executor import HiSparseWorker

        if self.pool is None:
            raise StateError("build() before the host pool was created/attached")
        spec = self.spec
        # this rank's heads only (a folder: read slice by slice); all-reduce over the default group
        model = spec.model.build(spec.device, rank=self.rank, tp_size=spec.tp_size)
        self.executor = HiSparseWorker(
            model, spec.hisparse, spec.layout, spec.num_device_blocks, self.pool, rank=self.rank,
            device=spec.device, max_requests=max(spec.num_device_blocks, spec.max_batch) + 1,
            host_wait_s=spec.step_timeout_s,
            kv_codec=row_codec(spec.kv_cache_dtype, model.cfg, model.dtype), fast=spec.fast_path,
            hot_counts_every=HOT_COUNTS_EVERY if spec.use_cuda else 1)
        self.engine = self._engine or NixlTransferEngine(
            f"decode-{spec.replica_id}-r{self.rank}-{os.getpid()}")
        dev = [self.engine.register(f"dev.{l}", t)
               for l, t in enumerate(self.executor.runtime.device_kv)]
        host: list = []
        staging: list = []
        if self.rank == 0:
            host = [self.engine.register(f"host.{l}", self.pool.layer(l))
                    for l in range(self.spec.layout.num_layers)]
            if self.spec.staging_blocks:
                rows = self.spec.staging_blocks * self.spec.page_size
                self.staging = [torch.zeros(rows, self.spec.layout.bytes_per_token_layer,
                                            dtype=torch.uint8, device=self.spec.device)
                                for _ in range(self.spec.layout.num_layers)]
                staging = [self.engine.register(f"stage.{l}", t) for l, t in enumerate(self.staging)]
        keys: list = []
        if self.spec.staging_blocks:  # every rank: the indexer keys are replicated
            mcfg = model.cfg
            key_row_bytes = mcfg.index_head_dim * torch.empty((), dtype=model.dtype).element_size()
            self.key_staging = torch.zeros(mcfg.num_hidden_layers,
                                           self.spec.staging_blocks * self.spec.page_size,
                                           key_row_bytes, dtype=torch.uint8,
                                           device=self.spec.device)
            keys = [self.engine.register(f"keys.{l}", self.key_staging[l])
                    for l in range(mcfg.num_hidden_layers)]
        self.landing = RankLanding(
            self.rank, spec.page_size, self.engine.take_notifications, self.executor, self._lock,
            pool=self.pool if self.rank == 0 else None, staging=self.staging,
            key_staging=self.key_staging)
        self._endpoint = RankEndpoint(
            self.rank, self.engine.name, self.engine.agent_metadata(),
            ray.get_runtime_context().get_node_id(), tuple(host), tuple(dev), tuple(staging),
            self.spec.staging_blocks if self.rank == 0 else 0, tuple(keys))
        return self._endpoint

    def endpoint(self) -> RankEndpoint:
        """This rank's endpoint (after ``build``); metadata taken after every region registered."""
        if self._endpoint is None:
            raise StateError("endpoint() before build()")
        return self._endpoint

    def add_peer(self, metadata: bytes) -> str:
        return self.engine.add_peer(metadata)

    def remove_peer(self, agent: str) -> bool:
        """Drop a (retired) prefill worker as a NIXL peer: its connection closes, so bytes of its
        WRITEs still in flight are discarded. False if it was not a peer of this rank."""
        try:
            self.engine.remove_peer(agent)
        except Exception:
            return False
        return True

    # -- landing ------------------------------------------------------------------------------------
    def complete_landing(self, step: RankLandingStep | bytes, index_keys: Any = None) -> float:
        """This rank's part of one landing chunk in ONE Ray call (``RankLanding.complete``):
        notification wait, staging -> host copy, key copy, and on the last chunk the key cache's
        length. ``index_keys``: the whole prompt's keys as numpy ``[L, T, d]`` (the fallback for a
        replica without key staging; they travel through Ray's object store). Returns the seconds
        of the staging -> host copy. ``step`` may come as :func:`~hisparse_ray.types.pack`'s
        bytes."""
        if self.landing is None:
            raise StateError("complete_landing() before build()")
        return self.landing.complete(unpack(step), index_keys)

    def get_landing_trace(self) -> list[tuple[str, float, float, float, float]]:
        """(request id, call started, first notification, staging copied, call done)
        ``perf_counter`` stamps of the recent ``complete_landing`` calls (benchmarks)."""
        return list(self.landing.trace) if self.landing is not None else []

    def drop_landing(self, request_id: str) -> None:
        """Forget a landing that failed (its keys may have reached some ranks): running and later
        ``complete_landing`` calls of it fail fast instead of waiting for their notifications."""
        if self.landing is not None:
            self.landing.drop(request_id)

    # -- step loop ----------------------------------------------------------------------------------
    def attach_channel(self, spec: tuple[ChannelSpec, ChannelSpec]) -> None:
        """Attach the coordinator's channel pair and start the step thread."""
        if self._thread is not None:
            raise StateError(f"rank {self.rank} already runs a step thread")
        self._channel = ChannelPair.attach(spec, policy=self.spec.wait_policy())
        self._thread = threading.Thread(target=self._loop, name=f"step-r{self.rank}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        """Receive commands and run them. Without lookahead each command is launched and
        finished under the lock, its report sent before the next is received. With
        ``ReplicaSpec.lookahead`` each command is launched as it arrives (the fast step returns
        once its GPU work is enqueued) while a finisher thread waits for the launched steps in
        order, outside the lock, finishes each under it and sends its report: command N + 1
        (sent by the coordinator before it read report N) is launched while the GPU still
        computes step N."""
        ch = self._channel
        launched: queue.Queue = queue.Queue()
        finisher = None
        if self.spec.lookahead:
            finisher = threading.Thread(target=self._finish_steps, args=(launched,),
                                        name=f"finish-r{self.rank}", daemon=True)
            finisher.start()
        try:
            while not self._stop.is_set() and self._error is None:
                try:
                    cmd = ch.recv(timeout=POLL_S)
                except ChannelTimeoutError:
                    continue
                t0 = time.perf_counter()
                with self._lock:
                    # rank 0 returns with its host writes enqueued and published as the step's
                    # (the report carries the generation); a peer waits on the host for
                    # cmd.host_seq and, after a step in which rank 0 wrote the host, for that
                    # step by number (the step ring, then its stream on the step's IPC event;
                    # rank 0 need not have reported)
                    step = self.executor.launch(cmd)
                    report = None if finisher else self.executor.finish(step)
                if finisher:
                    launched.put((step, ch.ready_t, t0))
                else:
                    self._send_report(cmd.step, report, ch.ready_t, t0)
        except (ChannelClosedError, ChannelPeerLostError):
            pass
        except BaseException as err:  # surfaced through stats(); the coordinator times out
            self._error = err
        finally:
            if finisher is not None:
                launched.put(None)
                finisher.join(timeout=self.spec.step_timeout_s)

    def _finish_steps(self, launched: queue.Queue) -> None:
        try:
            while True:
                item = launched.get()
                if item is None:
                    return
                step, ready_t, t0 = item
                if self._jitter is not None:  # tests: random schedules of the two threads
                    time.sleep(self._jitter[1].uniform(0, self._jitter[0]))
                self.executor.wait(step)  # the GPU finishing the step: the lock stays free
                with self._lock:
                    report = self.executor.finish(step)
                self._send_report(step.cmd.step, report, ready_t, t0)
        except (ChannelClosedError, ChannelPeerLostError):
            pass
        except BaseException as err:  # surfaced through stats(); the coordinator times out
            self._error = err

    def _send_report(self, step: int, report: Any, ready_t: float, t0: float) -> None:
        """Count a finished step (seconds from its launch: with lookahead they overlap the next
        launch) and send its report."""
        t1 = time.perf_counter()
        self.step_s += t1 - t0
        self.steps += 1
        self.step_log.append((step, t1 - t0))
        self._channel.send(report, timeout=self.spec.step_timeout_s)
        self.step_trace.append((step, ready_t, t0, t1, time.perf_counter()))

    def set_finish_jitter(self, seconds: float, seed: int = 0) -> None:
        """Tests: with ``lookahead``, sleep a random 0..``seconds`` before finishing each step
        (the next command is then launched first, or not: random schedules); 0 turns it off."""
        import random

        self._jitter = (seconds, random.Random(seed)) if seconds > 0 else None

    def get_step_log(self) -> list[tuple[int, float]]:
        """(step, seconds spent executing it) of the recent steps (benchmarks)."""
        return list(self.step_log)

    def get_step_trace(self) -> list[tuple[int, float, float, float, float]]:
        """(step, command found, loaded, executed, report sent) ``perf_counter`` stamps of the
        recent steps: the same clock as the coordinator's trace on this host (benchmarks)."""
        return list(self.step_trace)

    def ping(self, payload: Any = None) -> int:
        """A plain Ray call (the baseline the shared-memory control plane is measured against)."""
        return self.rank

    def stats(self) -> dict:
        out = {"rank": self.rank, "steps": self.steps, "step_s": self.step_s,
               "error": repr(self._error) if self._error else None}
        if self.executor is not None:
            out.update(self.executor.counters)
        return out

    def shutdown(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self.executor is not None:
            self.executor.close()
        if getattr(self, "engine", None) is not None:
            self.engine.close()
        if self.pool is not None:
            if self.pool.is_owner:
                self.pool.destroy()
            else:
                self.pool.close()
            self.pool = None
        tp.destroy_tp_group()
