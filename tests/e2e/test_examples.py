"""Every example that needs no GPU runs (on the session cluster) and checks itself."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.py"))

pytestmark = [pytest.mark.ray, pytest.mark.nixl, pytest.mark.slow]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_runs_and_checks_itself(ray_cluster, path, capsys):
    runpy.run_path(str(path), run_name="example")["main"]()
    assert "OK:" in capsys.readouterr().out
