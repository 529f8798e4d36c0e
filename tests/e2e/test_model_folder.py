"""The front door with a model folder: ``hisparse-ray generate --model FOLDER`` (a fresh process,
its own local Ray cluster, one prefill worker + TP 2 decode ranks, NIXL landing) on a folder in
the released format (fp8 block-quantized, sharded, per-expert keys, an MTP layer, a BPE
tokenizer): text prompts through the folder's tokenizer, tokens equal to full-resident decode of
the same folder in process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hisparse_ray.deploy import ModelSpec
from hisparse_ray.engine import EngineConfig, generate
from hisparse_ray.model.model import build_random_model
from tests.model._checkpoint import CORPUS, checkpoint_config, write_released

pytestmark = [pytest.mark.ray, pytest.mark.nixl, pytest.mark.slow]


def test_generate_with_a_model_folder_through_the_cli(tmp_path):
    folder = write_released(build_random_model(checkpoint_config(layers=2), seed=11), tmp_path / "m")
    prompts = [CORPUS[0], CORPUS[2]]  # long enough to land on the host tier (hot buffer: 16)
    cmd = [sys.executable, "-m", "hisparse_ray.cli", "generate", "--model", str(folder), "--tp", "2",
           "--device", "cpu", "--num-cpus", "4", "--max-new-tokens", "6", "--json"]
    for p in prompts:
        cmd += ["--prompt", p]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r["request_id"]: r for r in json.loads(out.stdout.strip().splitlines()[-1])["requests"]}
    spec = ModelSpec(kind=str(folder))
    tok = spec.tokenizer()
    ids = [tok.encode(p) for p in prompts]
    assert all(len(i) > 16 for i in ids)
    ref = generate(spec.build(), ids, 6, EngineConfig(full_resident=True))
    for i in range(len(prompts)):
        assert rows[f"p{i}"]["error"] is None and rows[f"p{i}"]["tokens"] == ref[i]
