"""The wheel installs actors/ and kernels/ only under hisparse_ray, with the CUDA sources."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


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
    assert any(n.startswith("hisparse_ray/kernels/csrc/") and n.endswith(".cu") for n in names)
    # pyproject lists the packages one by one: every package of the source tree is in the wheel
    for top, installed in (("hisparse_ray", "hisparse_ray"), ("actors", "hisparse_ray/actors"),
                           ("kernels", "hisparse_ray/kernels")):
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.relative_to(ROOT / top).as_posix()
            assert f"{installed}/{rel}" in names, f"{top}/{rel} is not in the wheel"

    # A normal (non-editable) install of that wheel imports both from another directory.
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--target", str(target), str(wheel)], check=True)
    out = subprocess.run(
        [sys.executable, "-c",
         "import hisparse_ray.actors as a, hisparse_ray.kernels as k, importlib.resources as r;"
         "print(a.__file__); print(k.__file__);"
         "print(any(f.name.endswith('.cu') for f in r.files('hisparse_ray.kernels.csrc').iterdir()))"],
        cwd=tmp_path, env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, check=True,
    )
    actors_file, kernels_file, has_cu = out.stdout.split()
    assert actors_file.startswith(str(target)) and kernels_file.startswith(str(target))
    assert has_cu == "True"


def test_subpackages_import_from_any_directory(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c",
         "import hisparse_ray.actors, hisparse_ray.kernels, importlib.util as u;"
         "print(u.find_spec('actors') is None, u.find_spec('kernels') is None)"],
        cwd=tmp_path, capture_output=True, text=True, check=True,
    )
    assert out.stdout.split() == ["True", "True"]
