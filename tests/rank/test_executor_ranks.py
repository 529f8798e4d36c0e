"""Two ranks' step executors on one shared host pool (CPU, one process): rank 0 writes the pool
(landings, backups) and publishes one generation per step, the command carries it to the peer
(``host_seq``), and the peer, reading the host rows rank 0 wrote in the steps before, computes
bitwise what rank 0 computes (the model is replicated here, not sharded), on the reference path
and on the fast step (which enqueues rank 0's backups while its launched step runs). The
executor's checks of the protocol: unknown or reused handles, a generation never published."""

from __future__ import annotations

import os

import pytest
import torch

from hisparse_ray.config import CoordinatorConfig
from hisparse_ray.core.coordinator import Coordinator
from hisparse_ray.engine import EngineConfig
from hisparse_ray.errors import HostPoolError, StateError
from hisparse_ray.fastpath.config import FastPathConfig
from hisparse_ray.host.pool import HostPool
from hisparse_ray.model.model import build_tiny_model
from hisparse_ray.rank.executor import HiSparseWorker
from hisparse_ray.types import BatchRow, RequestHandle, StepCommand, TransferKind
from tests.host._step_hammer import LANDING, EventLog

PREFIX = f"hs-test-ranks-{os.getpid()}"
PATHS = {"reference": None, "fast": FastPathConfig(max_context=128, buckets=(2, 4))}


class TwoRanks:
    """A coordinator core at TP 2 and two executors sharing one host pool."""

    def __init__(self, model, num_device_blocks: int = 7, fast: FastPathConfig | None = None) -> None:
        cfg = EngineConfig(num_device_blocks=num_device_blocks)
        self.model, self.layout = model, cfg.layout(model.cfg, model.dtype)
        num_host = self.layout.host_blocks(cfg.hisparse.host_pool_gib)
        self.core = Coordinator(CoordinatorConfig(
            num_device_blocks=num_device_blocks, num_host_blocks=num_host,
            page_size=cfg.page_size, device_buffer_size=cfg.hisparse.device_buffer_size,
            max_batch=cfg.max_batch, tp_size=2))
        self.pool = HostPool.create("ranks", self.layout, num_host, register_cuda=False,
                                    prefix=PREFIX)
        self.peer_pool = HostPool.attach(self.pool.name, register_cuda=False)
        self.ranks = [HiSparseWorker(model, cfg.hisparse, self.layout, num_device_blocks, pool,
                                     rank=r, max_requests=num_device_blocks + 1, host_wait_s=1.0,
                                     fast=fast)
                      for r, pool in enumerate((self.pool, self.peer_pool))]
        self.logits: list[dict] = [{}, {}]
        for r, w in enumerate(self.ranks):
            w.on_logits = (lambda rows, out, r=r: self.logits[r].update(
                {(row.request_id, row.seq_len): out[b].clone() for b, row in enumerate(rows)}))
        self.published: list[int] = []

    def add(self, rid: str, prompt: list[int], new: int, chain: bool = False) -> None:
        adm = self.core.admit(rid, prompt, new, chain=chain)
        assert adm is not None
        tokens = torch.tensor(prompt[:adm.num_positions], dtype=torch.int64)
        with torch.no_grad():
            _, kv_rows, keys = self.model.prefill(tokens, batch_invariant=True)
        for w in self.ranks:  # device pages on every rank, host pages by rank 0 alone
            w.land_local(adm, kv_rows)
            w.install_index_keys(adm.request_id, keys, len(prompt) + new + 1)
        self.core.apply_landed(rid)

    def step(self, before_peer=None) -> StepCommand | None:
        cmd = self.core.take_command()
        if cmd is None:
            return None
        assert cmd.host_seq == (self.published[-1] if self.published else 0)
        with torch.no_grad():
            rep0 = self.ranks[0].execute(cmd)
            if before_peer is not None:
                before_peer(cmd)
            rep1 = self.ranks[1].execute(cmd)
        self.published.append(rep0.published)
        assert rep1.published == 0  # before_peer may publish too (landings)
        assert rep0.published == self.pool.published() or before_peer is not None
        for rep in (rep1, rep0):
            self.core.apply_report(rep)
        return cmd

    def close(self) -> None:
        for w in self.ranks:
            w.close()
        self.peer_pool.close()
        self.pool.destroy()


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(0, "deepseek_v32")


@pytest.mark.parametrize("path", list(PATHS))
def test_the_peer_reads_rank_0s_host_rows_of_the_steps_before_bitwise(model, path):
    """Host-tier requests (a 7-block device pool, prompts of 9 and 8 pages): every step rank 0 backs the newest row up and
    publishes a generation; the peer's resolver misses read those rows a step later."""
    g = torch.Generator().manual_seed(1)
    two = TwoRanks(model, fast=PATHS[path])
    try:
        for i, n in enumerate((70, 60)):
            two.add(f"r{i}", torch.randint(0, model.cfg.vocab_size, (n,), generator=g).tolist(),
                    12)
        while two.step() is not None:
            pass
        assert two.published == sorted(two.published) and two.published[-1] >= 12
        assert two.ranks[0].counters["backups"] > 0 and two.ranks[0].counters["hot_misses"] > 0
        assert two.logits[0].keys() == two.logits[1].keys() and len(two.logits[0]) == 24
        for key, got in two.logits[1].items():
            assert torch.equal(got, two.logits[0][key]), key
    finally:
        two.close()


@pytest.mark.parametrize("path", list(PATHS))
def test_stale_host_rows_would_show_in_the_peers_logits(model, path):
    """The comparison above bites: zeroing the rows rank 0 just backed up, before the peer
    runs its next step, makes the peer's logits differ from rank 0's."""
    g = torch.Generator().manual_seed(1)
    two = TwoRanks(model, fast=PATHS[path])
    last: list = []

    def clobber(cmd: StepCommand) -> None:  # the previous step's backups, gone stale
        ps = two.layout.page_size
        for b in last:
            for l in range(two.layout.num_layers):
                two.pool.layer(l)[b.host_block * ps + b.offset].zero_()
        last[:] = cmd.backups

    try:
        two.add("r0", torch.randint(0, model.cfg.vocab_size, (70,), generator=g).tolist(), 10)
        while two.step(clobber) is not None:
            pass
        differ = [k for k, got in two.logits[1].items() if not torch.equal(got, two.logits[0][k])]
        assert differ, "stale host rows went unnoticed"
    finally:
        two.close()


@pytest.mark.parametrize("path", list(PATHS))
def test_landing_publishes_between_steps_never_move_the_event_a_peer_waits_on(model, path):
    """The TP > 1 deadlock's schedule on CPU, the event ring an ``EventLog`` (which publish
    recorded each slot last): rank 0 runs command N, then publishes 7 or 9 landings, and only
    then the peer runs N (so rank 0's N + 1 also comes before the peer's N + 1). Every event the
    peer's stream waits on must be the record of the step before its command (rank 0 wrote the
    host in it: backups); the logits still equal rank 0's. Failed before events were indexed by
    step: the peer waited on generation ``host_seq``'s slot, re-recorded by a landing or (7
    landings) by rank 0's step N + 1, whose event on a GPU follows that step's all-reduce, which
    needs the peer's own step N + 1 forward, queued after the wait."""
    g = torch.Generator().manual_seed(1)
    two = TwoRanks(model, fast=PATHS[path])
    labels = [0] * 8
    two.pool._ring = events = EventLog(labels, owner=True)
    two.peer_pool._ring = waits = EventLog(labels, owner=False)
    rank0, peer = two.ranks[0].execute, two.ranks[1].execute
    caught: list[tuple[int, int]] = []  # (command, label of the record its wait caught)

    wrote: list[int] = []  # steps in which rank 0 wrote the host (backups, spills)
    commands: list[int] = []

    def rank0_execute(cmd: StepCommand):
        events.label = cmd.step
        commands.append(cmd.step)
        if cmd.backups or any(t.kind is TransferKind.SPILL for t in cmd.transfers):
            wrote.append(cmd.step)
        return rank0(cmd)

    def peer_execute(cmd: StepCommand):
        waits.waits.clear()
        rep = peer(cmd)
        caught.extend((cmd.step, label) for _, label in waits.waits)
        return rep

    def landings(cmd: StepCommand) -> None:
        events.label = LANDING
        for _ in range(7 if cmd.step % 2 else 9):
            two.pool.publish()

    two.ranks[0].execute, two.ranks[1].execute = rank0_execute, peer_execute
    try:
        for i, n in enumerate((70, 60)):
            two.add(f"r{i}", torch.randint(0, model.cfg.vocab_size, (n,), generator=g).tolist(),
                    8)
        while two.step(landings) is not None:
            pass
        assert len(caught) >= 8 and all(label == step - 1 for step, label in caught), caught
        assert events.records == len(wrote)  # none for the landings
        assert {step for step, _ in caught} == {n + 1 for n in wrote} & set(commands)
        for key, got in two.logits[1].items():
            assert torch.equal(got, two.logits[0][key]), key
    finally:
        two.close()


def test_the_executor_refuses_a_broken_protocol(model):
    two = TwoRanks(model)
    peer = two.ranks[1]
    try:
        with pytest.raises(HostPoolError, match="generation 1"):
            peer.execute(StepCommand(1, host_seq=1))  # rank 0 never published it
        with pytest.raises(StateError, match="handle 3"):
            peer.execute(StepCommand(2, (BatchRow(3, 5, 1, ()),)))
        peer.execute(StepCommand(3, handles=(RequestHandle(0, "a"),)))
        with pytest.raises(StateError, match="still names 'a'"):
            peer.execute(StepCommand(4, handles=(RequestHandle(0, "b"),)))
        peer.execute(StepCommand(5, released=(0,)))
        with pytest.raises(StateError, match="releases handle 0"):
            peer.execute(StepCommand(6, released=(0,)))
        peer.execute(StepCommand(7, handles=(RequestHandle(0, "b"),)))  # free again: reusable
        assert peer.handles == {0: "b"}
    finally:
        two.close()
