"""A landing that times out for real: one decode replica (TP 1, real Ray + real NIXL over CPU
memory + the tiny model) whose rank 0, the receiving NIXL peer of every landing, is stopped with
SIGSTOP while a request lands. Every WRITE attempt of the prefill worker then times out
(``landing_attempts`` x ``landing_timeout_s``); the request must fail with TransferTimeoutError,
every lease must come back, and the replica must serve the next request exactly once resumed.
Past every deadline: a stalled rank fences the replica; a stalled prefill worker is retired
(killed, disconnected) and the replica goes on serving through the other one."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time

import pytest
import ray

from hisparse_ray.actors import launch
from hisparse_ray.deploy import PrefillSpec, ReplicaSpec
from hisparse_ray.errors import TransferTimeoutError
from hisparse_ray.testing.full_resident import full_resident_tokens

pytestmark = [pytest.mark.ray, pytest.mark.nixl, pytest.mark.slow]

# 2 attempts of 1.5 s: a stalled landing fails in about 3 s; an unstalled WRITE of a few KiB
# between two local processes takes milliseconds even on a loaded machine
SPEC = ReplicaSpec(tp_size=1, num_device_blocks=12, staging_blocks=4, page_size=8,
                   replica_id="lt", landing_attempts=2, landing_timeout_s=1.5)


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


@contextlib.contextmanager
def _deployment(spec: ReplicaSpec, workers: int = 1):
    """A replica of ``spec`` with ``workers`` prefill workers connected ("auto": direct on CPU);
    yields (replica, workers, rank 0's pid). Rank 0 is resumed on the way out whatever
    happened, then everything is shut down."""
    from hisparse_ray.actors.prefill_worker import PrefillWorker

    pspecs = [PrefillSpec(name=f"{spec.replica_id}-prefill{i}") for i in range(workers)]
    handles = [launch._remote(PrefillWorker, **launch.prefill_options(p)).remote(p)
               for p in pspecs]
    rep = launch.launch_replica(spec)
    pid = None
    try:
        ray.get([w.ready.remote() for w in handles], timeout=120)
        for w in handles:
            assert launch.connect(rep, w, "auto") == "direct"
        pid = ray.get(rep.ranks[0].__ray_call__.remote(lambda self: os.getpid()), timeout=60)
        yield rep, handles, pid
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
        rep.shutdown()
        for w in handles:
            ray.kill(w)


def _stop(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while not _stopped(pid):
        assert time.monotonic() < deadline, "SIGSTOP did not take effect"
        time.sleep(1e-3)


@pytest.fixture(scope="module")
def replica(ray_cluster):
    with _deployment(SPEC) as (rep, (worker,), pid):
        yield rep, worker, pid


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 96) for _ in range(n)]


def _land_while_rank0_stopped(rep, worker, pid: int, rid: str, prompt: list[int]) -> dict:
    """Submit ``rid`` with rank 0 stopped; resume rank 0 once the prefill worker reports the
    failed push (its retries are spent); return the request's summary."""
    failed_before = ray.get(worker.get_stats.remote(), timeout=30).get("failed_pushes", 0)
    _stop(pid)
    try:
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


def _served_exactly(rep, spec: ReplicaSpec, requests: list[tuple[str, list[int]]]) -> dict:
    """Wait for ``requests`` (4 new tokens each); every one must equal full-resident decode.
    Returns their summaries by id."""
    rows = {r["request_id"]: r for r in ray.get(
        rep.coordinator.wait.remote([rid for rid, _ in requests], 180), timeout=200)}
    ref = full_resident_tokens(spec.model, [p for _, p in requests], 4,
                               [rid for rid, _ in requests])
    for rid, _ in requests:
        assert rows[rid]["error"] is None, rows[rid]
        assert rows[rid]["tokens"] == ref[rid], rid
    return rows


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
    rows = _served_exactly(rep, SPEC, requests)
    assert {rows[r]["target"] for r in ("after-host", "after-res")} == {"host", "resident"}
    _no_lease_held(rep)


def test_a_landing_outliving_every_deadline_fences_the_replica(ray_cluster):
    """Rank 0 stays stopped past attempts x timeout + landing_call_timeout_s: its landing call
    cannot end, so a cancelled WRITE could still land in blocks the request held. The replica
    must stop (no reuse of that memory): waiters and new submits get a typed error naming it."""
    from hisparse_ray.errors import StateError

    spec = ReplicaSpec(tp_size=1, num_device_blocks=12, staging_blocks=4, page_size=8,
                       replica_id="fence", landing_attempts=1, landing_timeout_s=1.0,
                       landing_call_timeout_s=1.0)
    with _deployment(spec) as (rep, _, pid):
        _stop(pid)
        ray.get(rep.coordinator.submit.remote("fenced", _prompt(random.Random(5), 100), 4),
                timeout=30)
        with pytest.raises(StateError, match="replica failed.*still running"):
            ray.get(rep.coordinator.wait.remote(["fenced"], 120), timeout=150)
        with pytest.raises(StateError, match="replica failed"):
            ray.get(rep.coordinator.submit.remote("late", [1, 2, 3], 2), timeout=30)


def test_a_prefill_worker_stalled_past_every_deadline_is_retired_not_the_replica(ray_cluster):
    """Prefill worker 0 is stopped inside its push (rank 0 is stopped first, so the WRITE cannot
    finish before it; then resumed, so the rank's calls end). The push outlives attempts x
    timeout + landing_call_timeout_s: the lander kills worker 0, waits for its death, drops it
    as a NIXL peer, fails the request with TransferTimeoutError and releases every lease. The
    replica is not fenced: the request queued behind it on worker 0, requests submitted from
    three threads on random schedules and routes meanwhile, and every later one go to worker 1
    and decode exactly; a request routed to worker 0 after its retirement is refused. Then
    worker 1 is killed: its landing fails typed, it is retired as dead, and with no worker left
    the replica refuses new requests."""
    from hisparse_ray.errors import StateError

    spec = ReplicaSpec(tp_size=1, num_device_blocks=12, staging_blocks=4, page_size=8,
                       replica_id="retire", landing_attempts=1, landing_timeout_s=2.0,
                       landing_call_timeout_s=2.0)
    rng = random.Random(11)
    with _deployment(spec, workers=2) as (rep, workers, pid):
        w0_pid = ray.get(workers[0].__ray_call__.remote(lambda self: os.getpid()), timeout=60)
        _stop(pid)
        try:
            ray.get(rep.coordinator.submit.remote("stalled", _prompt(rng, 100), 4, None, 0),
                    timeout=30)
            # queued behind it on worker 0's lander: handed to worker 1 once 0 is retired
            queued = ("queued", _prompt(rng, 90))
            ray.get(rep.coordinator.submit.remote(*queued, 4, None, 0), timeout=30)
            deadline = time.monotonic() + 60
            while ray.get(workers[0].get_stats.remote(), timeout=30)["pushes_started"] == 0:
                assert time.monotonic() < deadline, "the push never started"
                time.sleep(0.01)
            _stop(w0_pid)  # inside its push, whose WRITE waits on the stopped rank 0
        finally:
            os.kill(pid, signal.SIGCONT)
        # while the lander waits out the deadline and retires worker 0: submitters on random
        # schedules and routes (worker 0, worker 1, round robin). Accepted before the retirement
        # means queued on a lander and served; refused only when routed to the retired worker
        accepted, refused, errors = [], [], []

        def submitter(seed: int) -> None:
            r = random.Random(seed)
            for i in range(3):
                time.sleep(r.uniform(0, 3.0))
                rid, route = f"h{seed}-{i}", r.choice([None, 0, 1])
                prompt = _prompt(r, r.choice([10, 60, 110]))
                try:
                    ray.get(rep.coordinator.submit.remote(rid, prompt, 4, None, route), timeout=30)
                    accepted.append((rid, prompt))
                except Exception as err:  # noqa: BLE001 - checked below
                    (refused if route == 0 and "was retired" in str(err) else errors).append(
                        (rid, route, repr(err)))

        def after_retirement() -> None:  # the other branch, for certain: right after it
            deadline = time.monotonic() + 120
            while not ray.get(rep.coordinator.metrics.remote(), timeout=30)["retired_prefill"]:
                assert time.monotonic() < deadline, "worker 0 was never retired"
                time.sleep(0.02)
            r = random.Random(99)
            for i, route in enumerate((0, None, 0)):
                rid, prompt = f"late-{i}", _prompt(r, 40)
                try:
                    ray.get(rep.coordinator.submit.remote(rid, prompt, 4, None, route), timeout=30)
                    (accepted if route is None else errors).append((rid, prompt))
                except Exception as err:  # noqa: BLE001 - checked below
                    (refused if route == 0 and "was retired" in str(err) else errors).append(
                        (rid, route, repr(err)))

        threads = [threading.Thread(target=submitter, args=(s,)) for s in range(3)]
        threads.append(threading.Thread(target=after_retirement))
        for t in threads:
            t.start()
        (row,) = ray.get(rep.coordinator.wait.remote(["stalled"], 120), timeout=150)
        for t in threads:
            t.join(timeout=60)
        assert row["error_type"] == "TransferTimeoutError" and "retired" in row["error"], row
        assert not errors, errors
        assert list(ray.get(rep.coordinator.metrics.remote(), timeout=30)["retired_prefill"]) \
            == [0]
        assert not _alive(w0_pid)  # killed, not left stopped
        with pytest.raises(StateError, match="prefill worker 0 .* was retired"):
            ray.get(rep.coordinator.submit.remote("to-w0", [1, 2, 3], 2, None, 0), timeout=30)
        later = [("after-host", _prompt(rng, 120)), ("after-res", _prompt(rng, 10))]
        for rid, prompt in later:  # round robin over the live worker only
            ray.get(rep.coordinator.submit.remote(rid, prompt, 4), timeout=30)
        _served_exactly(rep, spec, [queued, *later, *accepted])
        m = _no_lease_held(rep)
        assert m["staging_free_blocks"] == spec.staging_blocks
        assert len(accepted) + len(refused) == 12 and len(refused) >= 2
        print(f"\nretire hammer: {len(accepted)} accepted, {len(refused)} refused (routed to the "
              f"retired worker)")
        # worker 1 crashes: its next landing fails typed and it is retired too; with no prefill
        # worker left, submits are refused (nothing is admitted that could never land)
        ray.kill(workers[1], no_restart=True)
        ray.get(rep.coordinator.submit.remote("on-dead", _prompt(rng, 30), 4), timeout=30)
        (dead,) = ray.get(rep.coordinator.wait.remote(["on-dead"], 120), timeout=150)
        assert dead["error_type"] == "TransferError" and "ActorDied" in dead["error"], dead
        assert list(ray.get(rep.coordinator.metrics.remote(), timeout=30)["retired_prefill"]) \
            == [0, 1]
        with pytest.raises(StateError, match="every prefill worker of this replica was retired"):
            ray.get(rep.coordinator.submit.remote("none-left", [1, 2, 3], 2), timeout=30)
        _no_lease_held(rep)


def _alive(pid: int) -> bool:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return False
        except FileNotFoundError:
            return False
        time.sleep(0.05)
    return True
