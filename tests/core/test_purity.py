"""The pure core and the landing plan import only the standard library (and the pure
wire/config/error modules)."""

import json
import subprocess
import sys

FORBIDDEN = ("torch", "ray", "cupy", "nixl", "numpy")


def test_core_imports_no_heavy_packages():
    code = (
        "import sys, json\n"
        "import hisparse_ray.core, hisparse_ray.core.records, hisparse_ray.testing.random_driver\n"
        "import hisparse_ray.types, hisparse_ray.landing.plan, hisparse_ray.landing.staging\n"
        f"print(json.dumps(sorted(m for m in {FORBIDDEN!r} if m in sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []
