"""The wheel installs actors/ and kernels/ only under hisparse_ray, with the CUDA sources."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_wheel_layout(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(ROOT)],
        check=True,
    )
    (wheel,) = tmp_path.glob("hisparse_ray-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("hisparse_ray/actors/") for n in names)
    assert any(n.startswith("hisparse_ray/kernels/") for n in names)
    assert not any(n.startswith(("actors/", "kernels/")) for n in names), names
    assert "hisparse_ray/kernels/csrc/__init__.py" in names


def test_subpackages_import_from_any_directory(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c",
         "import hisparse_ray.actors, hisparse_ray.kernels, importlib.util as u;"
         "print(u.find_spec('actors') is None, u.find_spec('kernels') is None)"],
        cwd=tmp_path, capture_output=True, text=True, check=True,
    )
    assert out.stdout.split() == ["True", "True"]
