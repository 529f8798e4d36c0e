"""Polling helpers for scripts that drive a launched replica (tests, sweeps): wait until a
request has ``n`` tokens, wait until every block is back."""

from __future__ import annotations

import time

import ray


def wait_tokens(coordinator, rid: str, n: int, deadline: float) -> None:
    """Return once request ``rid`` has ``n`` tokens or finished; ``TimeoutError`` past
    ``deadline`` (a ``time.monotonic()`` value)."""
    while True:
        got, _, done = ray.get(coordinator.progress.remote(), timeout=30)[rid]
        if got >= n or done:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{rid} has {got} < {n} tokens")
        time.sleep(0.01)


def settled(coordinator, timeout: float = 60.0) -> dict:
    """The coordinator's metrics once no block is held and no request runs or waits;
    ``TimeoutError`` naming the counters after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        m = ray.get(coordinator.metrics.remote(), timeout=30)
        c = m["counters"]
        if (c["device_blocks_used"], c["host_blocks_used"], c["running"], c["waiting"]) == (0,) * 4:
            return m
        if time.monotonic() > deadline:
            raise TimeoutError(f"blocks not back after {timeout} s: {c}")
        time.sleep(0.1)
