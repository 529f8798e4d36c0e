"""``hisparse-ray serve`` as a user runs it: its own local Ray cluster, the OpenAI API on
``--port`` behind an API key from the environment, and on SIGINT with requests in flight every
client gets an answer (503 with an OpenAI body, or an error event ending the stream) and the
process exits 0 promptly (#15 item 9: clients were cut off and the exit took 32-33 s)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from hisparse_ray.actors.tp import free_port

pytestmark = [pytest.mark.ray, pytest.mark.nixl, pytest.mark.slow]
pytest.importorskip("ray.serve")


def _post(url: str, body: dict, key: str, on_token=None) -> tuple[int, bytes]:
    """(status, body); ``on_token()`` is called at a streamed answer's first token chunk."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            if on_token is None:
                return resp.status, resp.read()
            lines = []
            for line in resp:
                lines.append(line)
                if line.startswith(b"data: {") and b'"text"' in line:
                    on_token()
            return resp.status, b"".join(lines)
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def test_serve_answers_the_openai_api_and_sigint_answers_every_client_then_exits(tmp_path):
    port = free_port("127.0.0.1")
    log = tmp_path / "serve.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HISPARSE_API_KEY": "k1"}
    env.pop("RAY_ADDRESS", None)
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hisparse_ray.cli", "serve", "--port", str(port),
             "--num-cpus", "4", "--tp", "1", "--max-new-tokens", "3"],
            stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}/v1/completions"
    try:
        end = time.monotonic() + 240
        while "serving the OpenAI API" not in log.read_text():
            assert proc.poll() is None, f"serve exited early:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < end, f"not serving after 240 s:\n{log.read_text()[-4000:]}"
            time.sleep(0.5)
        assert "API key required" in log.read_text()
        status, body = _post(url, {"model": "hisparse-deepseek_v32", "prompt": "hello"}, "k1")
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 3, body
        assert _post(url, {"model": "hisparse-deepseek_v32", "prompt": "hello"}, "no")[0] == 401

        answers: dict[str, tuple[int, bytes]] = {}
        decoding = threading.Event()  # the stream's first token arrived

        def ask(name: str, stream: bool) -> None:
            body = {"model": "hisparse-deepseek_v32", "prompt": [5] * 150, "max_tokens": 1000,
                    "stream": stream}
            answers[name] = _post(url, body, "k1", on_token=decoding.set if stream else None)

        clients = [threading.Thread(target=ask, args=(n, s)) for n, s in (("plain", False),
                                                                          ("stream", True))]
        clients[0].start()
        time.sleep(0.5)  # the plain request is admitted first: decoding when the stream is
        clients[1].start()
        # no fixed sleep: a fresh GPU process lands its first long prompts slower than a CPU one
        assert decoding.wait(180), f"no streamed token after 180 s:\n{log.read_text()[-4000:]}"
        time.sleep(0.5)  # (1000 tokens take far longer than this on any device)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        for c in clients:
            c.join(timeout=120)
        assert proc.wait(timeout=120) == 0, log.read_text()[-4000:]
        exit_s = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    status, body = answers["plain"]
    assert status == 503 and json.loads(body)["error"]["message"] == "server is shutting down"
    status, body = answers["stream"]
    events = [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["type"] == "service_unavailable", events[-3:]
    text = log.read_text()
    assert "stopping" in text and "drained 2 request(s)" in text, text[-3000:]
    print(f"SIGINT to exit: {exit_s:.1f} s")
