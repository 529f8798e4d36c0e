"""The wire benchmark the lead runs on the H200 still runs end to end (a few steps, CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_wire_smoke(tmp_path):
    out = tmp_path / "wire.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_wire.py"), "--steps", "20",
         "--tp", "2", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "msgspec+py / pickle+py, cold" in proc.stdout
    got = json.loads(out.read_text())
    rows = got["median_us"]
    impls = ["msgspec+py", "pickle+py"]
    assert set(rows) == {f"{i} {c}" for i in impls for c in ("warm", "cold")}
    assert all(v > 0 for stages in rows.values() for v in stages.values())
