"""``ray job submit`` of an example runs it on THAT cluster: a private head started by the test
(its own temp dir and ports, ``ray start --head --block`` in its own process group, stopped by
ending that group: never a bare ``ray stop``, which kills every Ray process on the machine)."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from hisparse_ray.actors.tp import free_port

pytestmark = [pytest.mark.ray, pytest.mark.nixl, pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "prefill_decode_offload.py"
RAY = str(Path(sys.executable).with_name("ray"))


WORKER_PORTS = 200  # the head's worker port range: [wmin, wmin + WORKER_PORTS]


def _ports(n: int) -> list[int]:
    """``n`` distinct free ports; the last one starts the worker port range, and no other port
    lies inside that range (Ray refuses to start when a component's port is in it: a CI run
    failed on a dashboard port drawn inside the workers' range)."""
    while True:
        out: list[int] = []
        while len(out) < n:
            p = free_port("127.0.0.1")
            if p not in out:
                out.append(p)
        wmin = out[-1]
        if wmin + WORKER_PORTS < 65536 and not any(wmin <= p <= wmin + WORKER_PORTS
                                                   for p in out[:-1]):
            return out


def test_an_example_submitted_as_a_job_runs_on_the_given_cluster():
    gcs, dash, client, nm, om, agent, agent_grpc, metrics, renv, wmin = _ports(10)
    tmp = tempfile.mkdtemp(prefix="rj", dir="/tmp")  # short: Ray's socket paths have a limit
    # the private cluster's own auth token (Ray 2.60 turns token auth on for `ray start`)
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    head = subprocess.Popen(
        [RAY, "start", "--head", "--block", f"--port={gcs}", "--num-cpus=4",
         "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
         f"--ray-client-server-port={client}", f"--node-manager-port={nm}",
         f"--object-manager-port={om}", f"--dashboard-agent-listen-port={agent}",
         f"--dashboard-agent-grpc-port={agent_grpc}", f"--metrics-export-port={metrics}",
         f"--runtime-env-agent-port={renv}", f"--min-worker-port={wmin}",
         f"--max-worker-port={wmin + WORKER_PORTS}", f"--temp-dir={tmp}", "--disable-usage-stats"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)  # its own process group: ended below by that group's id
    try:
        job = None
        deadline = time.monotonic() + 180  # liveness bound: the dashboard's job server is up
        while True:
            job = subprocess.run(
                [RAY, "job", "submit", f"--address=http://127.0.0.1:{dash}", "--",
                 sys.executable, str(EXAMPLE)],
                env=env, capture_output=True, text=True, timeout=600)
            starting = any(x in job.stdout + job.stderr for x in (
                "Connection refused", "Failed to connect", "Cannot connect", "not available"))
            if not starting or time.monotonic() > deadline:
                break
            assert head.poll() is None, f"the head exited: {head.stdout.read()[-4000:]}"
            time.sleep(2)
        out = job.stdout + job.stderr
        assert job.returncode == 0, (out[-4000:], head.poll())
        assert "OK: identical to full-resident decode" in out, out[-4000:]
        # the example attached to the head it was submitted to, not a cluster of its own
        assert f"Ray cluster 127.0.0.1:{gcs}" in out or f":{gcs}" in out.split(
            "Ray cluster", 1)[1].split("\n", 1)[0], out[-4000:]
        assert "succeeded" in out
    finally:
        _stop(head)


def _stop(head: subprocess.Popen) -> None:
    """End the head this test started: SIGINT to its process group (``ray start --block`` then
    stops the processes it started), SIGKILL to the group if it lingers."""
    for sig, wait_s in ((signal.SIGINT, 60), (signal.SIGKILL, 30)):
        try:
            os.killpg(head.pid, sig)
        except ProcessLookupError:  # the group is gone already
            break
        try:
            head.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
