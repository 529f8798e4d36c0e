"""Chained (lookahead) rows of host-tier requests at TP 2: two ranks' executors on one shared
host pool, each in its own thread, driven like the coordinator actor's step loop (command N + 1
leaves before step N's reports when every row of N chains). A peer running a command chained past
step N finds rank 0's step-N generation by step number (``HostPool.wait_step``), so it reads the
newest rows rank 0 backed up in step N, though ``host_seq`` cannot name them yet. Before the step
ring the coordinator refused to chain such requests at TP > 1 (no chained rows)."""

from __future__ import annotations

import queue
import random
import threading
import time

import pytest
import torch

from hisparse_ray.model.model import build_tiny_model
from tests.rank.test_executor_ranks import PATHS, TwoRanks

NEW = 10


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(0, "deepseek_v32")


def _prompts(model):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, model.cfg.vocab_size, (n,), generator=g).tolist() for n in (70, 60)]


class _Rank(threading.Thread):
    """One rank's step loop: execute each command as it arrives, report into ``reports``;
    ``delay()`` seconds of sleep before each command (rank 0: the peer runs ahead)."""

    def __init__(self, worker, reports: queue.Queue, delay=None) -> None:
        super().__init__(daemon=True)
        self.worker, self.reports, self.delay = worker, reports, delay
        self.cmds: queue.Queue = queue.Queue()

    def run(self) -> None:
        while (cmd := self.cmds.get()) is not None:
            try:
                if self.delay is not None:
                    time.sleep(self.delay())
                with torch.no_grad():
                    self.reports.put(self.worker.execute(cmd))
            except BaseException as err:  # surfaced by the driver
                self.reports.put(err)
                return


def run_pipelined(two: TwoRanks, delay0=None, timeout_s: float = 60.0) -> int:
    """The coordinator actor's loop over two rank threads: take and send command N + 1 before
    gathering step N's reports when every row of N chains. Returns the steps run."""
    reports: queue.Queue = queue.Queue()
    ranks = [_Rank(two.ranks[0], reports, delay0), _Rank(two.ranks[1], reports)]
    for r in ranks:
        r.start()
    got: dict[int, list] = {}

    def gather(step: int) -> list:
        while len(got.get(step, ())) < 2:
            rep = reports.get(timeout=timeout_s)
            if isinstance(rep, BaseException):
                raise rep
            got.setdefault(rep.step, []).append(rep)
        return got.pop(step)

    core, inflight, steps = two.core, None, 0
    try:
        while True:
            cmd = None
            if inflight is None or inflight[1]:
                cmd = core.take_command()
                if cmd is not None:
                    steps += 1
                    chains = bool(cmd.batch) and core.rows_chain(cmd)
                    for r in ranks:
                        r.cmds.put(cmd)
            gathered = inflight is not None
            if gathered:
                for rep in gather(inflight[0]):
                    core.apply_report(rep)
                core.check_invariants()
                inflight = None
            if cmd is not None:
                inflight = (cmd.step, chains)
            elif not gathered:
                return steps
    finally:
        for r in ranks:
            r.cmds.put(None)
        for r in ranks:
            r.join(timeout=timeout_s)


def _counting_waits(two: TwoRanks) -> list[int]:
    waits: list[int] = []
    real = two.peer_pool.wait_step

    def wait_step(step, **kw):
        waits.append(step)
        return real(step, **kw)

    two.peer_pool.wait_step = wait_step
    return waits


@pytest.mark.parametrize("path", list(PATHS))
def test_tp2_host_tier_requests_chain_and_equal_the_unpipelined_run_bitwise(model, path):
    """Host-tier requests (a 7-block device pool) at TP 2 with chaining produce chained rows, the
    peer waits by step number, rank 0 sleeps a random 0-30 ms before each command (the peer runs
    ahead of its backups): tokens and every logit of both ranks equal the run without chaining.
    Failed before the step ring: ``chained_rows`` stayed 0 (the coordinator refused)."""
    prompts = _prompts(model)
    base = TwoRanks(model, fast=PATHS[path])
    try:
        for i, p in enumerate(prompts):
            base.add(f"r{i}", p, NEW)
        while base.step() is not None:
            pass
        want = {rid: base.core.view(rid).tokens for rid in ("r0", "r1")}
        want_logits = base.logits[0]
    finally:
        base.close()
    two = TwoRanks(model, fast=PATHS[path])
    try:
        for i, p in enumerate(prompts):
            two.add(f"r{i}", p, NEW, chain=True)
        assert all(two.core.view(r).tier.name == "HOST" for r in ("r0", "r1"))
        waits = _counting_waits(two)
        rng = random.Random(5)
        run_pipelined(two, delay0=lambda: rng.uniform(0, 0.03))
        c = two.core.counters
        assert c.chained_rows > 0 and waits, (c, waits)
        assert {rid: two.core.view(rid).tokens for rid in ("r0", "r1")} == want
        assert two.logits[0].keys() == two.logits[1].keys() == want_logits.keys()
        for key, got in two.logits[1].items():
            assert torch.equal(got, two.logits[0][key]), key
            assert torch.equal(got, want_logits[key]), key
    finally:
        two.close()


def test_a_peer_that_skips_the_step_wait_reads_stale_rows(model):
    """The comparison above bites: with the peer's wait for the chained-past step turned off and
    rank 0 100 ms late to every command, the peer reads rows rank 0 has not backed up yet and its
    logits differ from rank 0's."""
    two = TwoRanks(model)
    try:
        for i, p in enumerate(_prompts(model)):
            two.add(f"r{i}", p, 6, chain=True)
        two.peer_pool.wait_step = lambda step, **kw: 0
        run_pipelined(two, delay0=lambda: 0.1)
        assert two.core.counters.chained_rows > 0
        differ = [k for k, got in two.logits[1].items() if not torch.equal(got, two.logits[0][k])]
        assert differ, "stale host rows went unnoticed"
    finally:
        two.close()
