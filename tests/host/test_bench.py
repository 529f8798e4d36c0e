"""The copy benchmark still runs end to end (tiny sizes; on CPU it measures memcpy only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_bench_copies_smoke(tmp_path):
    out = tmp_path / "copies.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_copies.py"), "--smoke", "--iters",
         "1", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "plain H2D (limit)" in proc.stdout
    results = json.loads(out.read_text())["results"]
    assert {"plain H2D (limit)", "plain D2H (limit)"} <= set(results)
    assert all(r["gbps"] > 0 for r in results.values())
