"""benchmarks/bench_prefill.py still runs end to end at toy dims on CPU (the H200 run uses the same
code at DeepSeek-V3.2 shapes), with a chunk budget small enough to split every stage."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_prefill_tiny_smoke(tmp_path):
    out = tmp_path / "prefill.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_prefill.py"), "--tiny", "--lengths", "40",
         "300", "--layers", "2", "--chunk-gib", str(64 / 2**20), "--out", str(out)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "tok/s" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["tiny"] and doc["chunk_bytes"] == 64 << 10 and doc["layers"] == 2
    assert [r["tokens"] for r in doc["results"]] == [40, 300]
    assert all(r["seconds"] > 0 and r["peak_gib"] is None for r in doc["results"])
