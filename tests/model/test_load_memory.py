"""Loading a folder holds at most one shard's pages and one tensor's buffers beyond the model: a
TP rank's peak host memory (RSS, in a fresh process) exceeds its own weights by well under the
checkpoint size. (Loading every shard into a state dict first, the old way, costs the whole
checkpoint on top.) A loose bound, not a speed or tightness claim; the H200 numbers of the
real-size layer are in BENCHMARKS.md (benchmarks/bench_checkpoint.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from hisparse_ray.model.export import random_items, released_config, write_checkpoint

from ._checkpoint import checkpoint_config

CHILD = textwrap.dedent("""
    import json, sys, torch
    from hisparse_ray.model.sharded_load import load_checkpoint
    from hisparse_ray.model.checkpoint import Checkpoint
    folder, warm, rank, tp = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    load_checkpoint(warm, dtype=torch.bfloat16)  # lazy imports and allocator warm-up
    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS: the peak of the load alone
    before = status("VmRSS:")
    model = load_checkpoint(folder, dtype=torch.bfloat16, rank=rank, tp_size=tp)
    peak = status("VmHWM:")
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    print(json.dumps({"before": before, "peak": peak, "weights": weights,
                      "checkpoint": Checkpoint(folder).nbytes}))
""")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    big = checkpoint_config(layers=2).with_(hidden_size=512, moe_intermediate_size=512,
                                             n_routed_experts=32, n_group=4, topk_group=2)
    out = {}  # bf16 (the fp8 path's extra buffers are per tensor too; its H200 numbers: BENCHMARKS.md)
    for name, cfg in (("big", big), ("warm", checkpoint_config(layers=2))):
        path = tmp_path_factory.mktemp(name)
        write_checkpoint(path, released_config(cfg), random_items(cfg, 0), shard_bytes=8 << 20)
        out[name] = path
    return out


@pytest.mark.slow
def test_peak_rss_beyond_the_rank_weights_is_under_the_checkpoint_size(folders):
    rank, tp = 1, 2
    out = subprocess.run([sys.executable, "-c", CHILD, str(folders["big"]), str(folders["warm"]),
                          str(rank), str(tp)], capture_output=True, text=True, check=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    extra = r["peak"] - r["before"] - r["weights"]
    print(f"\nrank {rank}/{tp}: checkpoint {r['checkpoint'] / 2**20:.1f} MiB, rank weights "
          f"{r['weights'] / 2**20:.1f} MiB, peak RSS - before - weights = {extra / 2**20:.1f} MiB")
    assert r["checkpoint"] > 40 << 20  # large enough that the bound means something
    assert extra < 0.5 * r["checkpoint"]
