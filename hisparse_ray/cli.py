"""Command line ``hisparse-ray`` (ring 3)."""

from __future__ import annotations

import argparse
import json
import sys
import time

from hisparse_ray.config import HiSparseConfig, KVLayout


def _cmd_smoke(args: argparse.Namespace) -> int:
    import ray

    cfg = HiSparseConfig.from_json(args.config) if args.config else HiSparseConfig()
    layout = KVLayout()
    t0 = time.perf_counter()
    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        res = ray.cluster_resources()
        print(f"local Ray cluster up in {time.perf_counter() - t0:.1f}s: {json.dumps(res, sort_keys=True)}")
        print("config:", cfg.to_json())
        print(
            f"layout: {layout.bytes_per_token_layer} B/token/layer, {layout.num_layers} layers, "
            f"page {layout.page_size}, host blocks in {cfg.host_pool_gib} GiB: "
            f"{layout.host_blocks(cfg.host_pool_gib)}"
        )
    finally:
        ray.shutdown()
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hisparse-ray", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("smoke", help="start a local Ray cluster and print the config")
    s.add_argument("--config", help="HiSparse config JSON (SGLang --hisparse-config keys)")
    s.add_argument("--num-cpus", type=int, default=2)
    s.set_defaults(func=_cmd_smoke)
    d = sub.add_parser("demo", help="the main job on the embedded default (for now: the smoke run)")
    d.add_argument("--config", help="HiSparse config JSON (SGLang --hisparse-config keys)")
    d.add_argument("--num-cpus", type=int, default=2)
    d.set_defaults(func=_cmd_smoke)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
