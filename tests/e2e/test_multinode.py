"""Prefill and decode on different Ray nodes (ray.cluster_utils.Cluster), NIXL between them.

The Cluster needs its own ``ray.init``, which the session cluster of tests/conftest.py forbids in
this process, so the run happens in a subprocess (``python -m tests.e2e.multinode_main``) and this
test checks what it printed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.ray, pytest.mark.nixl, pytest.mark.slow]


def test_prefill_and_decode_on_different_nodes_match_full_resident():
    out = subprocess.run([sys.executable, "-m", "tests.e2e.multinode_main"], cwd=ROOT,
                         capture_output=True, text=True, timeout=420)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(result["decode_nodes"]) == 1
    assert result["prefill_node"] not in result["decode_nodes"]
    for row in result["rows"]:
        assert row["error"] is None
        assert row["tokens"] == result["reference"][row["request_id"]]
        assert len(row["tokens"]) == 6
    served = result["serve"]
    try:
        import ray.serve  # noqa: F401
        assert served is not None, "Ray Serve is installed but the Serve run did not happen"
    except ImportError:
        pass
    if served is not None:  # the Ray Serve front end, pinned the same way
        assert served["decode_nodes"] == result["decode_nodes"]
        assert served["prefill_node"] == result["prefill_node"]
        assert served["tokens"] == [result["reference"][f"mn{i}"] for i in range(2)]
