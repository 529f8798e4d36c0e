"""Shared fixtures: strict markers (declared in pyproject.toml), GPU skipping, one Ray cluster."""

from __future__ import annotations

import os

# One intra-op thread per process: on 2 cores shared with Ray workers, torch's OpenMP pool spins
# against the other processes (measured: an engine test took 26.8 s with 2 threads, 1.1 s with 1).
# Set before torch is imported; Ray workers inherit it from the driver's environment.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402


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
