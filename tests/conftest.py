"""Shared fixtures: strict markers (declared in pyproject.toml), GPU skipping, one Ray cluster."""

from __future__ import annotations

import os

import pytest


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the whole session (never `ray stop`: it kills every Ray process
    on the machine). Tests that need Ray take this fixture and carry the `ray` marker."""
    import ray

    if not ray.is_initialized():
        ray.init(
            address="local",
            num_cpus=int(os.environ.get("HISPARSE_TEST_CPUS", "4")),
            num_gpus=1 if _cuda_available() else 0,
            include_dashboard=False,
            log_to_driver=True,
        )
    yield ray
    ray.shutdown()
