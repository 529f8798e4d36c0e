"""End to end on real Ray + real NIXL (UCX over CPU memory) + the tiny model: one decode replica with
TP 2 and two prefill workers (direct host landing; staged host landing, whose NIXL peers are made
unreachable in the last test). Every generated token is checked against full-resident decode."""

from __future__ import annotations

import random
import threading
import time

import pytest
import ray

from hisparse_ray.actors import launch
from hisparse_ray.deploy import PrefillSpec, ReplicaSpec
from hisparse_ray.errors import TransferError
from hisparse_ray.testing.full_resident import full_resident_tokens

pytestmark = [pytest.mark.ray, pytest.mark.nixl, pytest.mark.slow]

SPEC = ReplicaSpec(tp_size=2, num_device_blocks=12, staging_blocks=4, page_size=8,
                   replica_id="e2e", landing_attempts=2, landing_timeout_s=5.0)
DIRECT, STAGED = 0, 1


@pytest.fixture(scope="module")
def replica(ray_cluster):
    from hisparse_ray.actors.prefill_worker import PrefillWorker

    workers = [launch._remote(PrefillWorker, **launch.prefill_options(s)).remote(s)
               for s in (PrefillSpec(name="direct"), PrefillSpec(name="staged"))]
    rep = launch.launch_replica(SPEC)
    ray.get([w.ready.remote() for w in workers])
    paths = [launch.connect(rep, w, mode) for w, mode in zip(workers, ("auto", "staged"))]
    assert paths == ["direct", "staged"]  # "auto" on CPU: the transport writes DRAM natively
    assert ray.get(rep.coordinator.metrics.remote())["staging_blocks"] == SPEC.staging_blocks
    yield rep
    rep.shutdown()


def _run(rep, requests, max_new, prefill=None):
    for rid, prompt in requests:
        ray.get(rep.coordinator.submit.remote(rid, prompt, max_new, None, prefill))
    return {r["request_id"]: r for r in ray.get(rep.coordinator.wait.remote(
        [rid for rid, _ in requests], 240))}


def _reference(requests, max_new):
    return full_resident_tokens(SPEC.model, [p for _, p in requests], max_new,
                                [rid for rid, _ in requests])


def _prompt(rng, n):
    return [rng.randrange(1, 96) for _ in range(n)]


def test_host_and_resident_landings_tp2_match_full_resident(replica):
    rng = random.Random(1)
    # 120-150 positions = 7-9x the 16-slot hot buffer -> host tier; 12 tokens fit the device pool
    requests = [("h0", _prompt(rng, 150)), ("s0", _prompt(rng, 12)), ("h1", _prompt(rng, 120)),
                ("s1", [4]), ("h2", _prompt(rng, 131))]
    rows = _run(replica, requests, 10, DIRECT)
    ref = _reference(requests, 10)
    for rid, _ in requests:
        assert rows[rid]["error"] is None
        assert rows[rid]["tokens"] == ref[rid], rid
    assert {rows[r]["target"] for r in ("h0", "h1", "h2")} == {"host"}
    assert {rows[r]["landing_path"] for r in ("h0", "h1", "h2")} == {"direct"}
    assert rows["s0"]["target"] == "resident"
    # KV rows into rank 0's host pool plus the indexer keys ([L, 149, index_head_dim] fp32)
    # into every rank's key staging, all by NIXL
    cfg = SPEC.model.dsa_config()
    key_bytes = cfg.num_hidden_layers * cfg.index_head_dim * 4
    assert rows["h0"]["landing_bytes"] == 149 * (SPEC.layout.bytes_per_token
                                                 + SPEC.tp_size * key_bytes)
    assert 0 <= rows["h0"]["hot_hit_rate"] < 1  # long contexts miss the 16-slot buffer
    m = ray.get(replica.coordinator.metrics.remote())
    assert m["counters"]["backups"] > 0 and m["hot_misses"] > 0
    _check_step_traces(replica)


def _check_step_traces(rep):
    """The per-stage step stamps the control-plane benchmark reads: every step the coordinator
    ran (one ``sent`` stamp: the command is written once for every rank) is in every rank's
    trace, and each process's stamps are in stage order."""
    coord = ray.get(rep.coordinator.get_step_trace.remote())
    ranks = [{t[0]: t for t in ray.get(r.get_step_trace.remote())} for r in rep.ranks]
    assert coord and len({t[0] for t in coord}) == len(coord)
    for step, start, sent, found, decoded in coord:  # one command broadcast to every rank
        assert len(found) == len(decoded) == SPEC.tp_size
        assert start <= sent and all(f <= d for f, d in zip(found, decoded))
        for r, trace in enumerate(ranks):
            _, r_found, r_decoded, r_executed, r_sent = trace[step]
            assert r_found <= r_decoded <= r_executed <= r_sent
            # one clock on one host; a peer may run before the other's send() returned, so only
            # causal pairs: found after the command was started, decoded after the report existed
            assert start <= r_found and r_executed <= decoded[r]


def test_staged_host_landing_in_chunks_matches_full_resident(replica):
    rng = random.Random(2)
    # 100 positions = 13 pages through a 4-block staging pool: 4 chunks
    requests = [("st0", _prompt(rng, 101)), ("st1", _prompt(rng, 110))]
    rows = _run(replica, requests, 8, STAGED)
    ref = _reference(requests, 8)
    for rid, _ in requests:
        assert rows[rid]["error"] is None and rows[rid]["target"] == "host"
        assert rows[rid]["landing_path"] == "staged"
        assert rows[rid]["tokens"] == ref[rid]


def test_prefix_reuse_shares_host_pages_and_stays_exact(replica):
    rng = random.Random(3)
    shared = _prompt(rng, 96)
    first = [("px0", shared + _prompt(rng, 9))]
    second = [("px1", shared + _prompt(rng, 17))]
    before = ray.get(replica.coordinator.metrics.remote())["counters"]["prefix_hit_pages"]
    rows = {**_run(replica, first, 6, DIRECT), **_run(replica, second, 6, DIRECT)}
    ref = _reference(first + second, 6)
    for rid in ("px0", "px1"):
        assert rows[rid]["tokens"] == ref[rid]
    after = ray.get(replica.coordinator.metrics.remote())["counters"]["prefix_hit_pages"]
    assert after - before == 96 // SPEC.page_size  # 12 full shared pages reused, not re-landed
    assert rows["px1"]["landing_bytes"] < rows["px0"]["landing_bytes"]


def test_concurrent_submitters_and_aborts_random_hammer(replica):
    """Three threads submit 10 requests (random lengths and routes); a fourth aborts 3 of them at
    random moments. Finished requests equal full-resident decode; aborted ones generated a prefix
    of it; afterwards no lease and no staging block is held."""
    rng = random.Random(5)
    requests = [(f"c{i}", _prompt(rng, rng.choice([rng.randint(2, 30), rng.randint(60, 160)])))
                for i in range(10)]
    routes = [rng.choice([None, DIRECT, STAGED]) for _ in requests]
    doomed = set(rng.sample([rid for rid, _ in requests], 3))
    submitted = {rid: threading.Event() for rid, _ in requests}
    errors: list[BaseException] = []

    def submit(chunk, seed):
        r = random.Random(seed)
        try:
            for (rid, prompt), route in chunk:
                ray.get(replica.coordinator.submit.remote(rid, prompt, 8, None, route))
                submitted[rid].set()
                time.sleep(r.random() * 0.05)
        except BaseException as e:
            errors.append(e)

    def abort():
        r = random.Random(55)
        try:
            for rid in sorted(doomed):
                submitted[rid].wait(120)
                time.sleep(r.random() * 0.3)
                ray.get(replica.coordinator.abort.remote(rid))
        except BaseException as e:
            errors.append(e)

    pairs = list(zip(requests, routes))
    threads = [threading.Thread(target=submit, args=(pairs[i::3], i)) for i in range(3)]
    threads.append(threading.Thread(target=abort))
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    rows = {r["request_id"]: r for r in ray.get(replica.coordinator.wait.remote(
        [rid for rid, _ in requests], 300))}
    ref = _reference(requests, 8)
    for rid, _ in requests:
        row = rows[rid]
        assert row["error"] is None, row
        if rid in doomed and row["finish_reason"] == "abort":
            assert row["tokens"] == ref[rid][:len(row["tokens"])], rid
        else:
            assert row["tokens"] == ref[rid], rid
    m = ray.get(replica.coordinator.metrics.remote())
    deadline = time.monotonic() + 30
    while m["counters"]["device_blocks_used"] or m["counters"]["host_blocks_used"]:
        assert time.monotonic() < deadline, m["counters"]  # last in-flight acks of aborted ones
        time.sleep(0.05)
        m = ray.get(replica.coordinator.metrics.remote())
    assert m["staging_free_blocks"] == SPEC.staging_blocks


def test_abort_running_and_landing_requests_releases_their_leases(replica):
    rng = random.Random(7)
    coord = replica.coordinator
    ray.get(coord.submit.remote("ab-run", _prompt(rng, 90), 10_000, None, DIRECT))
    deadline = time.monotonic() + 60
    while ray.get(coord.progress.remote())["ab-run"][0] < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # queued behind a long landing on the same lander, then aborted before its own landing
    survivor = ("ab-a", _prompt(rng, 150))
    ray.get(coord.submit.remote(*survivor, 4, None, DIRECT))
    ray.get(coord.submit.remote("ab-b", _prompt(rng, 130), 4, None, DIRECT))
    ray.get(coord.abort.remote("ab-b"))
    got = ray.get(coord.abort.remote("ab-run"))
    assert len(got) >= 2
    rows = {r["request_id"]: r for r in ray.get(coord.wait.remote(["ab-run", "ab-a", "ab-b"], 120))}
    assert rows["ab-run"]["finish_reason"] == "abort" and rows["ab-run"]["error"] is None
    assert rows["ab-b"]["finish_reason"] == "abort" and rows["ab-b"]["tokens"] == []
    assert rows["ab-a"]["tokens"] == _reference([survivor], 4)["ab-a"]
    while True:  # the last in-flight backup of "ab-run" is acknowledged by the next step
        c = ray.get(coord.metrics.remote())["counters"]
        if c["device_blocks_used"] == 0 and c["host_blocks_used"] == 0:
            break
        assert time.monotonic() < deadline + 60, c
        time.sleep(0.05)


def test_generate_path_text_prompts_through_the_cli_helpers(replica, capsys):
    from hisparse_ray import cli

    tok = cli.ByteTokenizer()
    requests = [("p0", tok.encode("HiSparse keeps a small hot buffer on the GPU. " * 3)),
                ("p1", tok.encode("ok"))]
    rows = {r["request_id"]: r for r in cli.run_requests(replica, requests, 5)}
    assert "progress" in capsys.readouterr().out
    ref = _reference(requests, 5)
    for rid, _ in requests:
        assert rows[rid]["tokens"] == ref[rid]
        assert len(tok.decode(rows[rid]["tokens"])) == 5


def test_seeded_sampling_and_stop_ids_through_the_replica(replica):
    """Sampling parameters ride to rank 0 with the landing (direct, staged, resident): seeded
    samples equal the full-resident engine's with the same seed; a stop id ends a request right
    after the step that sampled it (finish reason "stop")."""
    from hisparse_ray.types import SamplingParams

    rng = random.Random(17)
    params = SamplingParams(temperature=0.9, top_k=30, top_p=0.95, seed=4242)
    requests = [("smp-h0", _prompt(rng, 150)), ("smp-h1", _prompt(rng, 130)),
                ("smp-s0", _prompt(rng, 14))]
    coord = replica.coordinator
    for i, (rid, prompt) in enumerate(requests):
        ray.get(coord.submit.remote(rid, prompt, 10, None, i % 2, sampling=params))
    got = {r["request_id"]: r for r in ray.get(coord.wait.remote([r for r, _ in requests], 240))}
    ref = full_resident_tokens(SPEC.model, [p for _, p in requests], 10,
                               [r for r, _ in requests], sampling=params)
    greedy = _reference(requests, 10)
    for rid, _ in requests:
        assert got[rid]["tokens"] == ref[rid], rid
    assert any(ref[r] != greedy[r] for r, _ in requests), "the parameters did not sample"
    # a stop id: the first greedy token that did not occur before it in the answer
    rid, prompt = requests[0]
    k = next(i for i, t in enumerate(greedy[rid]) if i >= 2 and t not in greedy[rid][:i])
    ray.get(coord.submit.remote("stop-0", prompt, 10, stop_token_ids=(greedy[rid][k],)))
    (out,) = ray.get(coord.wait.remote(["stop-0"], 240))
    assert out["tokens"] == greedy[rid][:k + 1] and out["finish_reason"] == "stop"
    ray.get(coord.forget.remote([r for r, _ in requests] + ["stop-0"]))


def test_take_events_pushes_each_step_and_hands_over_the_done(replica):
    """A stream's tokens come out of ``take_events`` right after the steps that made them (a
    request of 12 tokens arrives in several takes), concatenate to the answer, and the done
    request is handed over once; another prefix sees nothing of it."""
    coord = replica.coordinator
    rng = random.Random(23)
    prompt = _prompt(rng, 140)
    ray.get(coord.submit.remote("evt-a", prompt, 12, stream=True))
    ray.get(coord.submit.remote("evt-b", _prompt(rng, 20), 3))  # not a stream: done only
    seen: list[int] = []
    takes, done = 0, {}
    deadline = time.monotonic() + 240  # liveness bound
    while len(done) < 2:
        fresh, finished = ray.get(coord.take_events.remote("evt-", 30))
        if fresh:
            takes += 1
        assert set(fresh) <= {"evt-a"}
        seen += fresh.get("evt-a", [])
        for summary, err in finished:
            assert err is None and summary["request_id"] not in done
            done[summary["request_id"]] = summary
        assert time.monotonic() < deadline
    assert seen == done["evt-a"]["tokens"] == _reference([("a", prompt)], 12)["a"]
    assert takes >= 2, "12 tokens over 12 decode steps came in one take"
    assert ray.get(coord.take_events.remote("evt-", 0.05)) == ({}, [])
    assert ray.get(coord.take_events.remote("other-", 0.05)) == ({}, [])


def test_landing_callbacks_are_not_on_the_handle(replica):
    """#15 item 12: no holder of the coordinator's handle can end a landing."""
    for name in ("landed", "landing_failed", "reroute", "fence", "abort_requested"):
        assert not hasattr(replica.coordinator, name), name


def test_failed_transfer_fails_request_and_leaves_no_lease(replica):
    """Runs last: it breaks the staged prefill worker for good."""
    eps = ray.get(replica.coordinator.endpoints_view.remote())
    broken = replica.prefill[STAGED]
    for ep in eps:  # the peer's metadata is gone: every WRITE attempt fails
        ray.get(broken.remove_peer.remote(ep["agent"]))
    rng = random.Random(4)
    requests = [("bad-host", _prompt(rng, 140)), ("bad-res", _prompt(rng, 20))]
    rows = _run(replica, requests, 4, STAGED)
    for rid, _ in requests:
        assert rows[rid]["error_type"] == "TransferError", rows[rid]
        assert rows[rid]["tokens"] == []
    assert rows["bad-host"]["target"] == "host" and rows["bad-res"]["target"] == "resident"
    with pytest.raises(TransferError):
        ray.get(replica.coordinator.result.remote("bad-host"))
    c = ray.get(replica.coordinator.metrics.remote())["counters"]
    assert c["device_blocks_used"] == 0 and c["host_blocks_used"] == 0
    # one failed push per request at least (a chunked landing has two chunks in flight)
    assert ray.get(broken.get_stats.remote())["failed_pushes"] >= 2
    # a dead prefill worker: its landings fail with TransferError too, leases released
    ray.kill(broken, no_restart=True)
    dead = _run(replica, [("dead-prefill", _prompt(rng, 100))], 4, STAGED)["dead-prefill"]
    assert dead["error_type"] == "TransferError" and "landing failed" in dead["error"]
    c = ray.get(replica.coordinator.metrics.remote())["counters"]
    assert c["device_blocks_used"] == 0 and c["host_blocks_used"] == 0
    # the replica keeps serving through the healthy peers
    ok = [("after-fail", _prompt(rng, 60))]
    assert _run(replica, ok, 4, DIRECT)["after-fail"]["tokens"] == _reference(ok, 4)["after-fail"]


def test_a_dead_rank_fails_the_replica_promptly_with_a_typed_error(replica):
    """Runs after every other test of the module: it kills rank 1. Rank 0 is then stuck in the
    TP all-reduce; the coordinator still notices the dead peer through its channel at once."""
    from hisparse_ray.errors import StateError

    rng = random.Random(6)
    ray.get(replica.coordinator.submit.remote("doomed", _prompt(rng, 40), 10_000, None, DIRECT))
    deadline = time.monotonic() + 60
    while ray.get(replica.coordinator.progress.remote())["doomed"][0] < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    ray.kill(replica.ranks[1], no_restart=True)
    t0 = time.monotonic()
    with pytest.raises(StateError, match="ChannelPeerLostError"):
        ray.get(replica.coordinator.wait.remote(["doomed"], 60))
    assert time.monotonic() - t0 < 30  # not the 60 s step timeout
    with pytest.raises(StateError, match="replica failed"):
        ray.get(replica.coordinator.submit.remote("late", [1, 2, 3], 2))
