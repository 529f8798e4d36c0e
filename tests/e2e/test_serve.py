"""Ray Serve front end on real Ray, Ray Serve, NIXL and the tiny model: concurrent requests through
a deployment handle and over HTTP give full-resident decode's tokens; bad requests get 4xx naming
the bad value; a cancelled or timed-out request is aborted and every block comes back; a served
request leaves no record behind; deleting the app shuts the decode replica down."""

from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.error
import urllib.request

import pytest
import ray

from hisparse_ray.actors.tp import free_port

pytestmark = [pytest.mark.ray, pytest.mark.nixl, pytest.mark.slow]

serve = pytest.importorskip("ray.serve")

OPTIONS = {"tp": 2, "device_blocks": 12, "max_new_tokens": 6, "max_new_tokens_limit": 1000,
           "health_check_period_s": 2}


@pytest.fixture(scope="module")
def app(ray_cluster):
    from hisparse_ray.serve import build_app

    port = free_port("127.0.0.1")
    quiet = {"log_level": "WARNING"}  # not a line per request in the test log
    serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config=quiet)
    handle = serve.run(build_app(OPTIONS), name="hisparse-test", route_prefix="/",
                       logging_config=quiet)
    try:
        yield handle, f"http://127.0.0.1:{port}/"
    finally:
        serve.shutdown()


def _specs():
    from hisparse_ray.deploy import DeployOptions

    return DeployOptions.from_dict(OPTIONS).specs()


def _post(url: str, body) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=240) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _settled(handle, deadline_s: float = 120.0) -> dict:
    """Metrics once nothing is in flight and no block is leased (liveness bound, not a speed)."""
    end = time.monotonic() + deadline_s
    while True:
        m = handle.metrics.remote().result()
        c = m["counters"]
        if (m["in_flight"] == 0 and m["host_pool_used_blocks"] == 0
                and c["device_blocks_used"] == 0 and m["serve"]["waiting"] == 0):
            return m
        assert time.monotonic() < end, f"not settled after {deadline_s} s: {m}"
        time.sleep(0.2)


def test_concurrent_handle_requests_match_full_resident_decode(app):
    from hisparse_ray.deploy import ByteTokenizer
    from hisparse_ray.testing.full_resident import full_resident_tokens

    handle, _ = app
    rng = random.Random(7)
    prompts = [[rng.randrange(1, 96) for _ in range(n)] for n in (170, 12, 140, 9, 120)]
    responses = [handle.generate.remote(ids=p, max_new_tokens=6) for p in prompts]
    text = "The hot buffer holds sixteen slots; this prompt is many times longer than it is."
    text_resp = handle.generate.remote(prompt=text)  # default max_new_tokens (6)
    results = [r.result(timeout_s=300) for r in responses]
    text_out = text_resp.result(timeout_s=300)

    tok = ByteTokenizer()
    replica_spec, _ = _specs()
    all_prompts = [*prompts, tok.encode(text)]
    expected = full_resident_tokens(replica_spec.model, all_prompts, 6,
                                    [str(i) for i in range(len(all_prompts))])
    for i, out in enumerate([*results, text_out]):
        assert out["tokens"] == expected[str(i)], f"prompt {i} differs from full-resident"
        assert out["prompt_tokens"] == len(all_prompts[i])
        assert out["finish_reason"] == "length"
    assert text_out["text"] == tok.decode(text_out["tokens"])
    assert {r["landing_target"] for r in results} == {"host", "resident"}
    assert len({r["request_id"] for r in [*results, text_out]}) == 6
    m = _settled(handle)
    assert m["records"] == 0, "served requests must leave no record in the coordinator"
    assert m["serve"]["served"] >= 6


def test_http_round_trip_and_errors_name_the_bad_value(app):
    handle, url = app
    status, body = _post(url, {"prompt": "hello, hisparse", "max_new_tokens": 3})
    assert status == 200, body
    assert len(body["tokens"]) == 3 and isinstance(body["text"], str)
    # same prompt through the handle: same tokens (greedy)
    again = handle.generate.remote(prompt="hello, hisparse", max_new_tokens=3).result()
    assert again["tokens"] == body["tokens"]

    cases = [
        (b"{not json", 400, "not JSON"),
        ([1, 2], 400, "JSON object"),
        ({"prompt": "x", "temperature": 0.5}, 400, "temperature"),
        ({"ids": [1, 500]}, 400, "token id 500"),
        ({"ids": []}, 400, "ids=[]"),
        ({"prompt": "x", "ids": [1]}, 400, "exactly one"),
        ({"prompt": "x", "max_new_tokens": 0}, 400, "max_new_tokens=0"),
        ({"prompt": "x", "max_new_tokens": 5000}, 400, "max_new_tokens=5000"),
        ({"ids": [1] * 20000, "max_new_tokens": 1}, 413, "pages"),  # never fits either pool
    ]
    for body_in, want, needle in cases:
        status, body = _post(url, body_in)
        assert status == want, (body_in if not isinstance(body_in, dict) else list(body_in), body)
        assert needle in body["error"], body
    m = _settled(handle)
    assert m["records"] == 0


def test_streams_concatenate_to_the_full_answer_over_handle_and_http(app):
    """Streamed chunks (handle generator and HTTP JSON lines) concatenate to the tokens the
    unstreamed call returns, which equal full-resident decode; a long answer arrives in more
    than one chunk; a stream abandoned half way is aborted and frees its blocks."""
    from hisparse_ray.testing.full_resident import full_resident_tokens

    handle, url = app
    rng = random.Random(13)
    prompt = [rng.randrange(1, 96) for _ in range(160)]
    chunks = list(handle.options(stream=True).generate_stream.remote(ids=prompt,
                                                                      max_new_tokens=24))
    final = chunks[-1]
    assert final["done"] and all("done" not in c for c in chunks[:-1])
    streamed = [t for c in chunks[:-1] for t in c["tokens"]]
    assert streamed == final["tokens"]
    assert len(chunks) > 2, "24 tokens over several decode steps came in one chunk"
    expected = full_resident_tokens(_specs()[0].model, [prompt], 24, ["s"])["s"]
    assert final["tokens"] == expected

    req = urllib.request.Request(url, data=json.dumps(
        {"prompt": "stream me a few tokens", "max_new_tokens": 10, "stream": True}).encode())
    with urllib.request.urlopen(req, timeout=240) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in resp.read().decode().splitlines() if line]
    assert lines[-1]["done"] and len(lines[-1]["tokens"]) == 10
    assert "".join(c["text"] for c in lines[:-1]) == lines[-1]["text"]
    plain = handle.generate.remote(prompt="stream me a few tokens", max_new_tokens=10).result()
    assert plain["tokens"] == lines[-1]["tokens"]
    status, body = _post(url, {"ids": [1, 500], "stream": True})  # refused before streaming
    assert status == 400 and "token id 500" in body["error"]
    status, body = _post(url, {"ids": [1], "stream": "yes"})
    assert status == 400 and "stream='yes'" in body["error"]

    gen = handle.options(stream=True).generate_stream.remote(ids=prompt, max_new_tokens=900)
    first = next(iter(gen))
    assert first["tokens"] and "done" not in first
    gen.cancel()
    assert _settled(handle)["records"] == 0


def test_cancelled_and_timed_out_requests_release_every_block(app):
    handle, _ = app
    coord = handle.coordinator.remote().result()
    rng = random.Random(3)
    long_prompt = [rng.randrange(1, 96) for _ in range(150)]  # host landing
    resp = handle.generate.remote(ids=long_prompt, max_new_tokens=900)
    end = time.monotonic() + 120
    while not any(n > 0 for n, _, _ in ray.get(coord.progress.remote()).values()):
        assert time.monotonic() < end, "the request never started decoding"
        time.sleep(0.1)
    assert ray.get(coord.metrics.remote())["host_pool_used_blocks"] > 0
    resp.cancel()
    with pytest.raises((asyncio.CancelledError, ray.exceptions.TaskCancelledError,
                        serve.exceptions.RequestCancelledError)):
        resp.result(timeout_s=60)
    assert _settled(handle)["records"] == 0

    with pytest.raises(TimeoutError, match="aborted"):
        handle.generate.remote(ids=long_prompt, max_new_tokens=900, timeout_s=2.0).result()
    m = _settled(handle)
    assert m["records"] == 0

    # the server still serves, and exactly
    out = handle.generate.remote(ids=long_prompt, max_new_tokens=4).result(timeout_s=300)
    assert len(out["tokens"]) == 4


def test_coordinator_take_done_and_forget_semantics(app):
    """take_done hands a done request to one caller and drops its record; its id stays refused;
    forget refuses a request still running."""
    from hisparse_ray.errors import DuplicateRequestError, StateError, UnknownRequestError

    handle, _ = app
    coord = handle.coordinator.remote().result()
    ray.get(coord.submit.remote("mine-1", [5, 6, 7], 2))
    ray.get(coord.submit.remote("mine-2", list(range(1, 90)), 400))
    with pytest.raises(StateError, match="not done"):
        ray.get(coord.forget.remote(["mine-2"]))
    got = ray.get(coord.take_done.remote(["mine-1"], 120))
    assert [s["request_id"] for s, _ in got] == ["mine-1"] and got[0][1] is None
    assert len(got[0][0]["tokens"]) == 2
    with pytest.raises(UnknownRequestError):
        ray.get(coord.wait.remote(["mine-1"], 1))
    with pytest.raises(DuplicateRequestError):
        ray.get(coord.submit.remote("mine-1", [5, 6, 7], 2))
    ray.get(coord.abort.remote("mine-2"))
    ray.get(coord.wait.remote(["mine-2"], 120))
    assert ray.get(coord.forget.remote(["mine-2"])) == 1
    assert ray.get(coord.take_done.remote(None, 0.1)) == []
    with pytest.raises(ValueError, match="limit"):
        ray.get(coord.take_done.remote(None, 0.1, 0))
    _settled(handle)


def test_many_concurrent_http_clients(app):
    """16 clients at once over HTTP (the decode steps batch them): every answer equals what the
    same prompt gives alone through the handle, nothing stays behind."""
    handle, url = app
    rng = random.Random(11)
    prompts = [[rng.randrange(1, 96) for _ in range(rng.randrange(5, 120))] for _ in range(16)]

    async def main():
        loop = asyncio.get_running_loop()
        return await asyncio.gather(*[
            loop.run_in_executor(None, _post, url, {"ids": p, "max_new_tokens": 3})
            for p in prompts])

    answers = asyncio.run(main())
    assert all(status == 200 for status, _ in answers), answers
    alone = [handle.generate.remote(ids=p, max_new_tokens=3) for p in prompts[:4]]
    for (status, body), r in zip(answers, alone):
        assert body["tokens"] == r.result(timeout_s=300)["tokens"]
    assert _settled(handle)["records"] == 0


def test_random_mix_of_served_cancelled_and_timed_out_requests(app):
    """Hammer: 24 requests at once, random prompt lengths (host and resident landings) and
    lengths, a third cancelled after a random delay, some with a timeout that may or may not
    fire. Every request that answers gives full-resident decode's tokens; afterwards nothing is
    in flight, no block is leased, no record is left."""
    from hisparse_ray.testing.full_resident import full_resident_tokens

    handle, _ = app
    rng = random.Random(2026)
    jobs = []
    for i in range(24):
        prompt = [rng.randrange(1, 96) for _ in range(rng.choice([6, 30, 90, 160]))]
        max_new = rng.randrange(1, 9)
        timeout = rng.choice([None, None, 0.05, 30.0])
        resp = handle.generate.remote(ids=prompt, max_new_tokens=max_new, timeout_s=timeout)
        cancel_after = rng.uniform(0, 1.5) if i % 3 == 0 else None
        jobs.append((prompt, max_new, resp, cancel_after))
    t0 = time.monotonic()
    for _, _, resp, cancel_after in sorted(jobs, key=lambda j: j[3] or 1e9):
        if cancel_after is None:
            break
        time.sleep(max(0.0, t0 + cancel_after - time.monotonic()))
        resp.cancel()
    answered = []
    for prompt, max_new, resp, _ in jobs:
        try:
            answered.append((prompt, max_new, resp.result(timeout_s=300)))
        except (TimeoutError, asyncio.CancelledError, ray.exceptions.TaskCancelledError,
                serve.exceptions.RequestCancelledError):
            pass
    assert answered, "every request was cancelled or timed out"
    for max_new in {m for _, m, _ in answered}:
        group = [(p, out) for p, m, out in answered if m == max_new]
        ref = full_resident_tokens(_specs()[0].model, [p for p, _ in group], max_new,
                                   [str(i) for i in range(len(group))])
        for i, (_, out) in enumerate(group):
            assert out["tokens"] == ref[str(i)]
    assert _settled(handle)["records"] == 0


def test_a_lost_rank_fails_its_requests_and_serve_replaces_the_replica(app):
    """Kill a decode rank mid-request: the request fails with StateError (HTTP 503), the health
    check reports the replica failed, Serve starts a new one (a new HiSparse deployment) and
    serves exactly again; the old coordinator is shut down with its Serve replica."""
    from hisparse_ray.errors import StateError

    handle, url = app
    old = handle.actors.remote().result()
    rng = random.Random(5)
    prompt = [rng.randrange(1, 96) for _ in range(150)]
    resp = handle.generate.remote(ids=prompt, max_new_tokens=900)
    end = time.monotonic() + 120
    while not any(n > 0 for n, _, _ in ray.get(old["coordinator"].progress.remote()).values()):
        assert time.monotonic() < end, "the request never started decoding"
        time.sleep(0.1)
    ray.kill(old["ranks"][1], no_restart=True)
    with pytest.raises(StateError, match="replica failed"):
        resp.result(timeout_s=120)
    status, body = _post(url, {"ids": [1, 2, 3], "max_new_tokens": 2})
    assert status in (503, 200), body  # 200 only if Serve replaced it already

    end = time.monotonic() + 300
    while True:  # until the replacement serves (liveness bound, not a speed)
        try:
            out = handle.generate.remote(ids=prompt, max_new_tokens=3).result(timeout_s=120)
            break
        except (StateError, ray.exceptions.RayActorError, serve.exceptions.BackPressureError):
            assert time.monotonic() < end, "Serve did not replace the failed replica"
            time.sleep(1)
    new = handle.actors.remote().result()
    assert new["coordinator"] != old["coordinator"]
    from hisparse_ray.testing.full_resident import full_resident_tokens

    assert out["tokens"] == full_resident_tokens(_specs()[0].model, [prompt], 3, ["x"])["x"]
    end = time.monotonic() + 120
    while True:  # the failed replica's coordinator went down with its Serve replica
        try:
            ray.get(old["coordinator"].failure.remote(), timeout=10)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            break
        assert time.monotonic() < end, "the failed replica's coordinator is still alive"
        time.sleep(0.5)


def test_deleting_the_app_shuts_the_replica_down(app):
    handle, _ = app
    coord = handle.coordinator.remote().result()
    assert ray.get(coord.failure.remote()) is None
    serve.delete("hisparse-test")
    end = time.monotonic() + 120
    while True:
        try:
            ray.get(coord.metrics.remote(), timeout=10)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            break
        assert time.monotonic() < end, "the coordinator outlived its Serve replica"
        time.sleep(0.5)


def test_the_serve_command_answers_http_and_stops_on_ctrl_c(tmp_path):
    """`hisparse-ray serve` as a user runs it: its own local Ray cluster, HTTP on --port, a
    clean exit (0) on SIGINT."""
    import os
    import signal
    import subprocess
    import sys

    port = free_port("127.0.0.1")
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hisparse_ray.cli", "serve", "--port", str(port),
             "--num-cpus", "4", "--max-new-tokens", "3"],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        end = time.monotonic() + 240
        while "serving on" not in log.read_text():
            assert proc.poll() is None, f"serve exited early:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < end, f"not serving after 240 s:\n{log.read_text()[-4000:]}"
            time.sleep(0.5)
        status, body = _post(f"http://127.0.0.1:{port}/", {"prompt": "hello"})
        assert status == 200 and len(body["tokens"]) == 3, body
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "stopping" in log.read_text()
