"""A landing that times out for real: one decode replica (TP 1, real Ray + real NIXL over CPU
memory + the tiny model) whose rank 0, the receiving NIXL peer of every landing, is stopped with
SIGSTOP while a request lands. Every WRITE attempt of the prefill worker then times out
(``landing_attempts`` x ``landing_timeout_s``); the request must fail with TransferTimeoutError,
every lease must come back, and the replica must serve the next request exactly once resumed."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
import ray

from hisparse_ray.actors import launch
from hisparse_ray.actors.reference import full_resident_tokens
from hisparse_ray.actors.spec import PrefillSpec, ReplicaSpec
from hisparse_ray.errors import TransferTimeoutError

pytestmark = [pytest.mark.ray, pytest.mark.nixl, pytest.mark.slow]

# 2 attempts of 1.5 s: a stalled landing fails in about 3 s; an unstalled WRITE of a few KiB
# between two local processes takes milliseconds even on a loaded machine
SPEC = ReplicaSpec(tp_size=1, num_device_blocks=12, staging_blocks=4, page_size=8,
                   replica_id="lt", landing_attempts=2, landing_timeout_s=1.5)


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


@pytest.fixture(scope="module")
def replica(ray_cluster):
    from hisparse_ray.actors.prefill_worker import PrefillWorker

    pspec = PrefillSpec(name="lt-prefill")
    worker = launch._remote(PrefillWorker, **launch.prefill_options(pspec)).remote(pspec)
    rep = launch.launch_replica(SPEC)
    pid = None
    try:
        ray.get(worker.ready.remote(), timeout=120)
        assert launch.connect(rep, worker, "auto") == "direct"
        pid = ray.get(rep.ranks[0].__ray_call__.remote(lambda self: os.getpid()), timeout=60)
        yield rep, worker, pid
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
        rep.shutdown()
        ray.kill(worker)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 96) for _ in range(n)]


def _land_while_rank0_stopped(rep, worker, pid: int, rid: str, prompt: list[int]) -> dict:
    """Submit ``rid`` with rank 0 stopped; resume rank 0 once the prefill worker reports the
    failed push (its retries are spent); return the request's summary."""
    failed_before = ray.get(worker.get_stats.remote(), timeout=30).get("failed_pushes", 0)
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 10
        while not _stopped(pid):
            assert time.monotonic() < deadline, "SIGSTOP did not take effect"
            time.sleep(1e-3)
        ray.get(rep.coordinator.submit.remote(rid, prompt, 4, None, 0), timeout=30)
        deadline = time.monotonic() + 120
        while ray.get(worker.get_stats.remote(), timeout=30).get("failed_pushes", 0) \
                == failed_before:
            assert time.monotonic() < deadline, "the stalled push never gave up"
            time.sleep(0.05)
    finally:
        os.kill(pid, signal.SIGCONT)
    (row,) = ray.get(rep.coordinator.wait.remote([rid], 180), timeout=200)
    return row


def _no_lease_held(rep) -> dict:
    deadline = time.monotonic() + 60
    while True:
        m = ray.get(rep.coordinator.metrics.remote(), timeout=30)
        c = m["counters"]
        if c["device_blocks_used"] == 0 and c["host_blocks_used"] == 0:
            return m
        assert time.monotonic() < deadline, c
        time.sleep(0.05)


@pytest.mark.parametrize("target, length", [("host", 100), ("resident", 12)])
def test_stalled_landing_fails_typed_and_releases_every_lease(replica, target, length):
    rep, worker, pid = replica
    rng = random.Random(length)
    rid = f"stalled-{target}"
    row = _land_while_rank0_stopped(rep, worker, pid, rid, _prompt(rng, length))
    assert row["target"] == target
    assert row["error_type"] == "TransferTimeoutError", row
    assert row["tokens"] == []
    with pytest.raises(TransferTimeoutError) as err:
        ray.get(rep.coordinator.result.remote(rid), timeout=30)
    assert err.value.request_id == rid
    m = _no_lease_held(rep)
    assert m["counters"]["waiting"] == 0 and m["counters"]["running"] == 0
    assert m["staging_free_blocks"] == SPEC.staging_blocks


def test_resumed_replica_serves_the_next_requests_exactly(replica):
    rep, worker, pid = replica
    rng = random.Random(9)
    requests = [("after-host", _prompt(rng, 120)), ("after-res", _prompt(rng, 10))]
    for rid, prompt in requests:
        ray.get(rep.coordinator.submit.remote(rid, prompt, 4, None, 0), timeout=30)
    rows = {r["request_id"]: r for r in ray.get(
        rep.coordinator.wait.remote([rid for rid, _ in requests], 180), timeout=200)}
    ref = full_resident_tokens(SPEC.model, [p for _, p in requests], 4,
                               [rid for rid, _ in requests])
    for rid, _ in requests:
        assert rows[rid]["error"] is None, rows[rid]
        assert rows[rid]["tokens"] == ref[rid], rid
    assert {rows[r]["target"] for r in ("after-host", "after-res")} == {"host", "resident"}
    _no_lease_held(rep)


def test_a_landing_outliving_every_deadline_fences_the_replica(ray_cluster):
    """Rank 0 stays stopped past attempts x timeout + landing_call_timeout_s: its landing call
    cannot end, so a cancelled WRITE could still land in blocks the request held. The replica
    must stop (no reuse of that memory): waiters and new submits get a typed error naming it."""
    from hisparse_ray.actors.prefill_worker import PrefillWorker
    from hisparse_ray.errors import StateError

    spec = ReplicaSpec(tp_size=1, num_device_blocks=12, staging_blocks=4, page_size=8,
                       replica_id="fence", landing_attempts=1, landing_timeout_s=1.0,
                       landing_call_timeout_s=1.0)
    pspec = PrefillSpec(name="fence-prefill")
    worker = launch._remote(PrefillWorker, **launch.prefill_options(pspec)).remote(pspec)
    rep = launch.launch_replica(spec)
    pid = None
    try:
        ray.get(worker.ready.remote(), timeout=120)
        launch.connect(rep, worker, "auto")
        pid = ray.get(rep.ranks[0].__ray_call__.remote(lambda self: os.getpid()), timeout=60)
        os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not _stopped(pid):
            assert time.monotonic() < deadline, "SIGSTOP did not take effect"
            time.sleep(1e-3)
        ray.get(rep.coordinator.submit.remote("fenced", _prompt(random.Random(5), 100), 4),
                timeout=30)
        with pytest.raises(StateError, match="replica failed.*still running"):
            ray.get(rep.coordinator.wait.remote(["fenced"], 120), timeout=150)
        with pytest.raises(StateError, match="replica failed"):
            ray.get(rep.coordinator.submit.remote("late", [1, 2, 3], 2), timeout=30)
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
        rep.shutdown()
        ray.kill(worker)
