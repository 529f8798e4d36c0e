"""Prometheus metrics of one decode replica through ``ray.util.metrics`` (ring 3).

Names follow vLLM's (``num_requests_running``, ``time_to_first_token_seconds``, ...) with a
``hisparse_`` prefix; Ray's exporter adds ``ray_`` in front and ``_total`` to counters, so a
scrape of a node's metrics port (``ray.nodes()[i]["MetricsExportPort"]``) shows e.g.
``ray_hisparse_time_to_first_token_seconds_bucket`` and ``ray_hisparse_generation_tokens_total``.
Every series carries ``model_name`` and ``replica`` tags.

Cost on the decode path: the coordinator's step thread only appends numbers to lists (under its
lock, which it holds anyway); an exporter thread observes them and samples the counters every
``interval_s``. The GPU counters (hot-buffer hits and lookups, hence the resolver's host -> device
bytes) come from rank 0's step reports, which read them off the device every few steps
(``HiSparseWorker.hot_counts_every``), never every step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hisparse_ray.actors.coordinator import ReplicaCoordinator

#: histogram buckets (seconds), as vLLM's
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
               0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
E2E_BUCKETS = [0.01, 0.03, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
               40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]

#: counters sampled from the replica (``snapshot()`` keys): metric name -> description
COUNTERS = {
    "hot_buffer_hits": "selected positions served by a request's hot buffer",
    "hot_buffer_lookups": "selected positions looked up in hot buffers (hits + misses)",
    "host_to_device_bytes": "bytes copied host -> device: resolver misses and page restores",
    "spills": "device pages spilled to the host pool",
    "restores": "host pages restored to device pages",
    "backups": "newest-token rows backed up to the host pool",
    "landing_bytes": "prompt KV bytes landed by prefill workers",
}
#: gauges sampled from the replica: metric name -> description
GAUGES = {
    "num_requests_running": "requests decoding",
    "num_requests_waiting": "requests admitted but not decoding yet (waiting for room or landing)",
    "host_blocks_used": "host pool blocks in use (referenced or pinned)",
    "host_blocks_total": "host pool blocks",
    "device_blocks_used": "device pool blocks in use",
    "device_blocks_total": "device pool blocks",
}


class ReplicaMetrics:
    """The metrics of one replica. ``snapshot()`` returns the cumulative ``COUNTERS`` and the
    current ``GAUGES`` (the coordinator reads them under its lock); the request hooks
    (``submitted``, ``token``, ``finished``, ``landed``) only buffer numbers. ``start`` runs
    the exporter thread; ``flush`` exports once (tests, shutdown)."""

    def __init__(self, model_name: str, replica: str, snapshot: Callable[[], dict],
                 interval_s: float = 1.0) -> None:
        self.tags = {"model_name": model_name, "replica": replica}
        self._snapshot = snapshot
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._ttft: list[float] = []
        self._itl: list[float] = []
        self._done: list[tuple[float, str]] = []  # (e2e seconds, finish reason)
        self._landing_s: list[float] = []
        self._prompt_tokens = 0
        self._generated = 0
        self._sent: dict[str, float] = {}  # counters already exported
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._m: dict | None = None

    # -- hooks (cheap: buffered) --------------------------------------------------------------
    def submitted(self, prompt_tokens: int) -> None:
        with self._lock:
            self._prompt_tokens += prompt_tokens

    def token(self, first: bool, seconds: float) -> None:
        """A request got a token ``seconds`` after its previous one (after submission: first)."""
        with self._lock:
            (self._ttft if first else self._itl).append(seconds)
            self._generated += 1

    def finished(self, e2e_s: float, reason: str) -> None:
        with self._lock:
            self._done.append((e2e_s, reason or "unknown"))

    def landed(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._landing_s.append(seconds)

    # -- export ---------------------------------------------------------------------------------
    def _metrics(self) -> dict:
        from ray.util import metrics as m

        keys = tuple(self.tags)
        out = {
            "ttft": m.Histogram("hisparse_time_to_first_token_seconds", "time to first token",
                                boundaries=TTFT_BUCKETS, tag_keys=keys),
            "itl": m.Histogram("hisparse_inter_token_latency_seconds", "time between two tokens "
                               "of a request", boundaries=ITL_BUCKETS, tag_keys=keys),
            "e2e": m.Histogram("hisparse_e2e_request_latency_seconds", "submission to last token",
                               boundaries=E2E_BUCKETS, tag_keys=keys),
            "landing_seconds": m.Histogram("hisparse_landing_seconds", "a prompt's landing after "
                                           "its prefill", boundaries=E2E_BUCKETS, tag_keys=keys),
            "prompt_tokens": m.Counter("hisparse_prompt_tokens", "prompt tokens submitted",
                                       tag_keys=keys),
            "generation_tokens": m.Counter("hisparse_generation_tokens", "tokens generated",
                                           tag_keys=keys),
            "request_success": m.Counter("hisparse_request_success", "requests finished, by "
                                         "finish reason", tag_keys=keys + ("finished_reason",)),
        }
        for name, desc in COUNTERS.items():
            out[name] = m.Counter(f"hisparse_{name}", desc, tag_keys=keys)
        for name, desc in GAUGES.items():
            out[name] = m.Gauge(f"hisparse_{name}", desc, tag_keys=keys)
        return out

    def flush(self) -> None:
        """Export the buffered observations and the replica's counters and gauges now."""
        if self._m is None:
            self._m = self._metrics()
        m, tags = self._m, self.tags
        with self._lock:
            ttft, self._ttft = self._ttft, []
            itl, self._itl = self._itl, []
            done, self._done = self._done, []
            landing, self._landing_s = self._landing_s, []
            prompt, self._prompt_tokens = self._prompt_tokens, 0
            generated, self._generated = self._generated, 0
        for x in ttft:
            m["ttft"].observe(x, tags)
        for x in itl:
            m["itl"].observe(x, tags)
        for x in landing:
            m["landing_seconds"].observe(x, tags)
        for e2e, reason in done:
            m["e2e"].observe(e2e, tags)
            m["request_success"].inc(1, {**tags, "finished_reason": reason})
        if prompt:
            m["prompt_tokens"].inc(prompt, tags)
        if generated:
            m["generation_tokens"].inc(generated, tags)
        snap = self._snapshot()
        for name in COUNTERS:
            delta = snap[name] - self._sent.get(name, 0)
            if delta > 0:
                m[name].inc(delta, tags)
                self._sent[name] = snap[name]
        for name in GAUGES:
            m[name].set(snap[name], tags)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="replica-metrics", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - metrics never take the replica down
                pass

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def replica_snapshot(c: ReplicaCoordinator) -> dict:
    """The cumulative ``COUNTERS`` and current ``GAUGES`` of a coordinator (under its lock).
    Host -> device bytes: resolver misses (counted per anchor layer, each standing for the
    layers that share its top-k) times the row bytes, plus page restores."""
    with c.lock:
        k = c.core.counters
        landing = sum(1 for rec in c.records.values() if not rec.done and rec.landed is None)
        return {
            "hot_buffer_hits": c.hot_hits,
            "hot_buffer_lookups": c.hot_hits + c.hot_misses,
            "host_to_device_bytes": int(c.hot_misses * c.miss_bytes) + k.restore_bytes,
            "spills": k.spills, "restores": k.restores, "backups": k.backups,
            "landing_bytes": c.landing_bytes,
            "num_requests_running": k.running,
            "num_requests_waiting": landing,
            "host_blocks_used": k.host_blocks_used, "host_blocks_total": k.host_blocks_total,
            "device_blocks_used": k.device_blocks_used,
            "device_blocks_total": k.device_blocks_total,
        }


def replica_view(c: ReplicaCoordinator) -> dict:
    """``ReplicaCoordinator.metrics()``: core counters (invariants checked), hot-buffer hits and
    misses, host pool use, step timings, landing paths, retired prefill workers, staging, records
    and the Prometheus snapshot."""
    with c.lock:
        k = c.core.counters
        c.core.check_invariants()
    looked = c.hot_hits + c.hot_misses
    # list(deque) copies in C, atomically under the GIL; iterating it here in Python while the
    # step thread appends raised "deque mutated during iteration" (the serve tests' flake)
    steps = sorted(dt for _, dt in list(c.channels.log)) if c.channels is not None else []
    return {
        "counters": {n: getattr(k, n) for n in k.__slots__},
        "hot_hits": c.hot_hits, "hot_misses": c.hot_misses,
        "hot_hit_rate": (c.hot_hits / looked) if looked else None,
        "host_pool_blocks": k.host_blocks_total,
        "host_pool_used_blocks": k.host_blocks_used,
        "host_pool_cached_blocks": k.host_blocks_cached,
        "host_pool_bytes": k.host_blocks_total * c.spec.layout.block_bytes,
        "steps": len(steps),
        "step_ms_median": steps[len(steps) // 2] * 1e3 if steps else None,
        "landing_paths": [lander.path for lander in c._landers],
        "pushes_with_prefill": [lander.pushes_with_prefill for lander in c._landers],
        # prefill workers retired after a push outlived every deadline (index -> why)
        "retired_prefill": {i: repr(lander.retired) for i, lander in enumerate(c._landers)
                            if lander.retired is not None},
        "staging_blocks": c.staging.capacity if c.staging else 0,
        "staging_free_blocks": c.staging.num_free if c.staging else 0,
        "records": len(c.records),  # requests known: in flight, or done and not taken
        "in_flight": c.records.in_flight,
        "prometheus": replica_snapshot(c),  # what ReplicaMetrics exports
    }
