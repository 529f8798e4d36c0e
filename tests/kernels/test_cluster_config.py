"""Phase A over a thread-block cluster, the parts that need no GPU: the size switch (argument and
``HISPARSE_RESOLVER_CLUSTER``) names a bad value, the cluster layout needs no more shared memory
than one block a row (beyond toy shapes), and the kernel source compiles for sm90 (and, without
the cluster kernels, for sm80) wherever ``nvcc`` is installed. Parity with the reference is
``test_cuda_parity.py`` (gpu)."""

from __future__ import annotations

import shutil
import subprocess
import pytest

from hisparse_ray.config import env_choice
from hisparse_ray.errors import ConfigError, KernelPreconditionError
from hisparse_ray.kernels import cuda as kcuda

def test_env_switch_default_case_and_bad_value(monkeypatch):
    monkeypatch.delenv("HISPARSE_RESOLVER_CLUSTER", raising=False)
    assert env_choice("HISPARSE_RESOLVER_CLUSTER", ("1", "auto"), "1") == "1"
    monkeypatch.setenv("HISPARSE_RESOLVER_CLUSTER", " AUTO ")
    assert env_choice("HISPARSE_RESOLVER_CLUSTER", ("1", "auto"), "1") == "auto"
    monkeypatch.setenv("HISPARSE_RESOLVER_CLUSTER", "16")
    with pytest.raises(ConfigError, match="HISPARSE_RESOLVER_CLUSTER.*16"):
        kcuda.cluster_size(None, 1, 0)


def test_fused_phase_a_switch_is_checked(monkeypatch):
    """``phase_a`` / ``HISPARSE_RESOLVER_PHASE_A``: "default" unless asked; a bad value, a
    cluster and K past the packed counts' 16 bits are named before anything launches."""
    monkeypatch.delenv("HISPARSE_RESOLVER_PHASE_A", raising=False)
    assert not kcuda.fused_phase_a(None, 2048, 1)
    assert kcuda.fused_phase_a("fused", 2048, 1) and not kcuda.fused_phase_a("default", 2048, 8)
    monkeypatch.setenv("HISPARSE_RESOLVER_PHASE_A", "Fused")
    assert kcuda.fused_phase_a(None, 32767, 1)
    monkeypatch.setenv("HISPARSE_RESOLVER_PHASE_A", "fast")
    with pytest.raises(ConfigError, match="HISPARSE_RESOLVER_PHASE_A.*fast"):
        kcuda.fused_phase_a(None, 2048, 1)
    with pytest.raises(KernelPreconditionError, match="cluster=4"):
        kcuda.fused_phase_a("fused", 2048, 4)
    with pytest.raises(KernelPreconditionError, match="K=32768"):
        kcuda.fused_phase_a("fused", 32768, 1)
    with pytest.raises(KernelPreconditionError, match="phase_a='quick'"):
        kcuda.fused_phase_a("quick", 2048, 1)


@pytest.mark.parametrize("bad", [3, 0, 16, True, "many", 2.0])
def test_bad_cluster_size_is_named(bad):
    with pytest.raises(KernelPreconditionError, match=f"cluster={bad!r}"):
        kcuda.cluster_size(bad, 1, 0)


@pytest.mark.parametrize("k,h", [(2048, 4096), (2048, 6144), (2048, 8192), (100, 300), (512, 513)])
def test_cluster_layout_needs_no_more_shared_memory(k, h):
    for bits in {max(6, (2 * k - 1).bit_length()), max(6, (4 * k - 1).bit_length())}:
        one = kcuda._phase_a_smem(k, h, bits, 1)
        for size in (2, 4, 8):
            assert kcuda._phase_a_smem(k, h, bits, size) <= one


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit)")
@pytest.mark.parametrize("fused", [0, 1])
@pytest.mark.parametrize("arch,cluster", [("sm_90", True), ("sm_80", False)])
def test_source_compiles(tmp_path, arch, cluster, fused):
    src, cubin = tmp_path / "resolver.cu", tmp_path / "resolver.cubin"
    src.write_text(kcuda.source())
    run = subprocess.run(["nvcc", f"-arch={arch}", "-std=c++17", f"-DHS_FUSED={fused}", "-cubin",
                          "-o", str(cubin), str(src)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    names = cubin.read_bytes()
    assert b"hs_resolve" in names and (b"hs_resolve_c8" in names) == cluster
