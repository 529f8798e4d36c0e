"""Shared fixtures: strict markers (declared in pyproject.toml), GPU skipping, one Ray cluster."""

from __future__ import annotations

import os

# One intra-op thread per process: on 2 cores shared with Ray workers, torch's OpenMP pool spins
# against the other processes (measured: an engine test took 26.8 s with 2 threads, 1.1 s with 1).
# Set before torch is imported; Ray workers inherit it from the driver's environment.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402


def _cuda_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _cuda_available() -> bool:
    return _cuda_count() > 0


def pytest_collection_modifyitems(config, items):
    n = _cuda_count()
    no_gpu = pytest.mark.skip(reason="needs a CUDA device")
    one_gpu = pytest.mark.skip(reason=f"needs two CUDA devices ({n} visible)")
    for item in items:
        if n == 0 and ("gpu" in item.keywords or "two_gpus" in item.keywords):
            item.add_marker(no_gpu)
        elif n == 1 and "two_gpus" in item.keywords:
            item.add_marker(one_gpu)


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the whole session (never `ray stop`: it kills every Ray process
    on the machine). Tests that need Ray take this fixture and carry the `ray` marker."""
    import ray

    if not ray.is_initialized():
        ray.init(
            address="local",
            num_cpus=int(os.environ.get("HISPARSE_TEST_CPUS", "4")),
            num_gpus=_cuda_count(),  # every GPU: two-GPU tests place one rank on each
            include_dashboard=False,
            log_to_driver=True,
            # ray.util.metrics reach the node's Prometheus port within a second (default 10 s):
            # the serve metrics test scrapes them
            _system_config={"metrics_report_interval_ms": 1000},
        )
    yield ray
    ray.shutdown()


@pytest.fixture
def private_shm():
    """A private directory on /dev/shm's tmpfs for host pool segments (``shm_dir`` /
    ``ReplicaSpec.host_pool_dir``): what a test finds in it is its own, whatever else runs."""
    import shutil
    import tempfile

    path = tempfile.mkdtemp(prefix="hs-test-shm-", dir="/dev/shm")
    yield path
    shutil.rmtree(path, ignore_errors=True)
