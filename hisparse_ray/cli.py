"""Command line ``hisparse-ray`` (ring 3): ``demo`` (the main job on the embedded default),
``generate`` (your prompts and config), ``serve`` (the OpenAI API through Ray Serve) and ``smoke`` (start
Ray, print the config).

``demo`` starts a local Ray cluster, one prefill worker and one decode replica with TP 2 on the
tiny built-in model (CPU without a GPU), runs a handful of long-context requests whose context is
many times the hot buffer, shows progress, prints per-request tokens/s, hot-buffer hit rate and
host pool use, and checks the tokens against full-resident decode (the in-process engine).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import MISSING, fields

from hisparse_ray.config import GIB, KVLayout, env_ray_address
from hisparse_ray.deploy import GROUPS, DeployOptions, ReplicaSpec, load_config, visible_gpus
from hisparse_ray.errors import ConfigError

CLI_GROUPS = {"demo": GROUPS[:4], "generate": GROUPS[:4], "serve": GROUPS}


def __getattr__(name: str):
    """``cli.ByteTokenizer``: lives in :mod:`hisparse_ray.model.tokenizer` (imported on use: that
    package loads torch, which ``hisparse-ray --help`` need not wait for)."""
    if name == "ByteTokenizer":
        from hisparse_ray.model.tokenizer import ByteTokenizer

        return ByteTokenizer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def options(args: argparse.Namespace) -> DeployOptions:
    """The deployment options the command's flags give (unset flags: the options' defaults);
    ConfigError naming a bad flag's option and value."""
    return DeployOptions.from_dict({f.name: getattr(args, f.name) for f in fields(DeployOptions)
                                    if hasattr(args, f.name)})


def pool_summary(spec: ReplicaSpec) -> str:
    """One line to print before anything starts: the host pool's size (the ``/dev/shm`` segment
    rank 0 will create), the device pool's and the hot buffer's."""
    from hisparse_ray.host.segment import pool_bytes

    lay, c = spec.layout, spec.hisparse
    host = pool_bytes(lay, spec.num_host_blocks)
    device = spec.num_device_blocks * lay.block_bytes
    return (f"host pool: {spec.num_host_blocks} blocks of {spec.page_size} tokens = "
            f"{_size(host)} in {spec.host_pool_dir} (host_pool_gib={c.host_pool_gib:g}); device "
            f"pool: {spec.num_device_blocks} blocks = {_size(device)} per rank; hot buffer "
            f"{c.device_buffer_size} slots per request, top-k {c.top_k}")


def check_host_fits(spec: ReplicaSpec, replicas: int = 1) -> int:
    """Before anything starts on THIS node (the CLI's local cluster): ConfigError unless
    ``replicas`` host pools of ``spec`` fit its ``host_pool_dir`` and memory, as
    ``HostPool.create`` will demand (``host.segment.fit_problem``). Returns their bytes."""
    from hisparse_ray.host.segment import fit_problem, pool_bytes

    need = replicas * pool_bytes(spec.layout, spec.num_host_blocks)
    try:
        why = fit_problem(need, spec.host_pool_dir)
    except OSError as e:
        raise ConfigError("host_pool_dir", spec.host_pool_dir,
                          f"must be a directory on this node ({e.strerror})") from None
    if why:
        raise ConfigError("host_pool_gib", spec.hisparse.host_pool_gib,
                          f"{replicas} host pool(s) of {_size(need // replicas)} on this node: "
                          f"{why}")
    return need


def _size(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.2f} MiB"


def deployment(args: argparse.Namespace, replicas: int = 1, out=None):
    """Options, specs and this node's checks of a command, all before Ray starts: ConfigError
    naming the option for a bad value, a config that does not fit the model, or pools that do
    not fit (the device pool one hot buffer; ``replicas`` host pools this node's
    ``host_pool_dir`` and memory). Prints the pools' sizes (to ``out``, default stdout).
    Returns (options, replica spec, prefill spec)."""
    opts = options(args)
    check_host_fits(opts.host_specs()[0], replicas)  # sizes before torch looks for GPUs
    replica_spec, prefill_spec = opts.specs()
    print(pool_summary(replica_spec) + (f", x{replicas} replicas" if replicas > 1 else ""),
          file=out or sys.stdout, flush=True)
    return opts, replica_spec, prefill_spec


def _request_ids(args: argparse.Namespace, vocab: int, tok=None) -> list[tuple[str, list[int]]]:
    """``--prompt`` texts (through ``tok``, the model's tokenizer) and ``--ids`` lists as (request
    id, token ids); ConfigError naming ``ids`` for a value that is not a list of ids in
    ``[0, vocab)``."""
    requests = [(f"p{i}", tok.encode(text)) for i, text in enumerate(args.prompt or [])]
    for i, ids in enumerate(args.ids or []):
        try:
            toks = [int(x) for x in ids.replace(",", " ").split()]
        except ValueError:
            toks = []
        if not toks or not all(0 <= t < vocab for t in toks):
            raise ConfigError("ids", ids, f"must be token ids in [0, {vocab}) separated by commas "
                                          f"or spaces")
        requests.append((f"ids{i}", toks))
    return requests


def _start_ray(num_cpus: int | None, address: str | None = None) -> bool:
    """Attach to the Ray cluster at ``address`` (``--address``, else ``$RAY_ADDRESS``: what
    ``ray job submit`` sets), else start a private local one. Returns whether it attached."""
    import ray

    address = address or env_ray_address()
    if address:
        ray.init(address=address, log_to_driver=False, configure_logging=False)
        return True
    ray.init(address="local", num_cpus=num_cpus or max(4, os.cpu_count() or 1),
             num_gpus=visible_gpus(), include_dashboard=False,
             log_to_driver=False, configure_logging=False)
    return False


def run_requests(replica, requests: list[tuple[str, list[int]]], max_new_tokens: int,
                 *, show_progress: bool = True, timeout_s: float = 600.0) -> list[dict]:
    """Submit every request to the replica, print progress until all are done, return summaries."""
    import ray

    coord = replica.coordinator
    for rid, prompt in requests:
        ray.get(coord.submit.remote(rid, prompt, max_new_tokens))
    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        prog = ray.get(coord.progress.remote())
        line = "  ".join(f"{rid}:{n}/{m}{'*' if done else ''}" for rid, (n, m, done) in prog.items())
        if show_progress and line != last:
            print(f"  progress  {line}", flush=True)
            last = line
        if all(done for _, _, done in prog.values()):
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"requests not done after {timeout_s} s")
        time.sleep(0.5)
    return ray.get(coord.wait.remote([rid for rid, _ in requests]))


def reference_tokens(replica_spec, requests: list[tuple[str, list[int]]], max_new_tokens: int
                     ) -> dict[str, list[int]]:
    """The same prompts through the in-process engine in full-resident mode (greedy), on the
    device, KV-cache dtype and decode path (fast step or reference) the decode ranks used."""
    from hisparse_ray.testing.full_resident import replica_baseline

    return replica_baseline(replica_spec, [p for _, p in requests], max_new_tokens,
                            [rid for rid, _ in requests])


def print_table(rows: list[dict], metrics: dict) -> None:
    print(f"\n{'request':>8} {'prompt':>6} {'target':>8} {'path':>8} {'tokens':>6} "
          f"{'tok/s':>7} {'hit rate':>8} {'landed KiB':>10}")
    for r in rows:
        hit = f"{r['hot_hit_rate']:.1%}" if r["hot_hit_rate"] is not None else "-"
        tps = f"{r['decode_tokens_per_s']:.1f}" if r["decode_tokens_per_s"] else "-"
        print(f"{r['request_id']:>8} {r['prompt_len']:>6} {r['target'] or '-':>8} "
              f"{r['landing_path'] or '-':>8} {r['generated']:>6} {tps:>7} {hit:>8} "
              f"{r['landing_bytes'] / 1024:>10.1f}")
    c = metrics["counters"]
    rate = metrics["hot_hit_rate"]
    if rate is not None:
        print(f"\nhot-buffer hit rate (all requests): {rate:.1%} (selected positions served from "
              f"the hot buffer; a random-weight model's consecutive top-k overlap about k/n, the "
              f"worst case; DeepSeek-V3.2 shares 35-50 % in most layers)")
    print(f"host pool: {c['host_blocks_used']} of {c['host_blocks_total']} blocks in use, "
          f"{c['host_blocks_cached']} cached ({metrics['host_pool_bytes'] / 2**20:.2f} MiB pool); "
          f"device pool: {c['device_blocks_used']} of {c['device_blocks_total']} blocks; "
          f"backups {c['backups']}, spills {c['spills']}, restores {c['restores']}")
    if metrics["step_ms_median"] is not None:
        print(f"decode steps: {metrics['steps']}, median {metrics['step_ms_median']:.2f} ms per step")


# --- commands -------------------------------------------------------------------------------------
def _cmd_demo(args: argparse.Namespace) -> int:
    import ray

    from hisparse_ray.actors import launch

    t_start = time.perf_counter()
    opts, replica_spec, prefill_spec = deployment(args)
    cfg = opts.config
    rng = random.Random(opts.seed)
    lengths = [rng.randint(args.min_context, args.max_context) for _ in range(args.requests)]
    requests = [(f"req{i}", [rng.randrange(1, 96) for _ in range(n)]) for i, n in enumerate(lengths)]
    print(f"hisparse-ray demo: {len(requests)} requests, contexts {lengths} tokens = "
          f"{min(lengths) / cfg.device_buffer_size:.0f}-{max(lengths) / cfg.device_buffer_size:.0f}x "
          f"the hot buffer ({cfg.device_buffer_size} slots), top-k {cfg.top_k}, "
          f"{opts.max_new_tokens} new tokens each, TP {opts.tp}, device {replica_spec.device}"
          + (f" ({replica_spec.gpus_per_rank:g} GPU per rank)" if replica_spec.use_cuda else "")
          + f", {'fast step' if replica_spec.fast_path else 'reference'} decode path, KV rows "
          f"{replica_spec.kv_cache_dtype} ({replica_spec.layout.bytes_per_token_layer} B)")
    _start_ray(args.num_cpus, args.address)
    try:
        t0 = time.perf_counter()
        replica = launch.launch_deployment(replica_spec, prefill_spec)
        print(f"deployment up in {time.perf_counter() - t0:.1f}s: 1 prefill worker, 1 decode "
              f"replica (coordinator + {opts.tp} ranks, STRICT_PACK), landing path "
              f"{ray.get(replica.coordinator.metrics.remote())['landing_paths']}")
        try:
            rows = run_requests(replica, requests, opts.max_new_tokens)
            metrics = ray.get(replica.coordinator.metrics.remote())
        finally:
            replica.shutdown()
    finally:
        ray.shutdown()
    print_table(rows, metrics)
    failed = [r for r in rows if r["error"]]
    if failed:
        print(f"FAILED requests: {[(r['request_id'], r['error']) for r in failed]}")
        return 1
    print("\nexactness check: the same prompts through full-resident decode (in-process engine)")
    ref = reference_tokens(replica_spec, requests, opts.max_new_tokens)
    ok = True
    for r in rows:
        same = r["tokens"] == ref[r["request_id"]]
        ok &= same
        print(f"  {r['request_id']}: {'identical' if same else 'DIFFERENT'} "
              f"({len(r['tokens'])} tokens)")
    print(f"\n{'PASS' if ok else 'FAIL'}: HiSparse tokens {'equal' if ok else 'differ from'} "
          f"full-resident decode; demo took {time.perf_counter() - t_start:.1f}s")
    return 0 if ok else 1


def _cmd_generate(args: argparse.Namespace) -> int:
    import ray

    from hisparse_ray.actors import launch

    opts, replica_spec, prefill_spec = deployment(args, out=sys.stderr if args.json else None)
    tok = replica_spec.model.tokenizer()  # a folder's HF tokenizer, or the built-ins' byte one
    if tok is None and args.prompt:
        raise SystemExit(f"--prompt: the model {opts.model} has no tokenizer; give --ids")
    requests = _request_ids(args, replica_spec.model.dsa_config().vocab_size, tok)
    if not requests:
        raise SystemExit("give at least one --prompt TEXT or --ids '1,2,3'")
    _start_ray(args.num_cpus, args.address)
    try:
        replica = launch.launch_deployment(replica_spec, prefill_spec)
        try:
            rows = run_requests(replica, requests, opts.max_new_tokens,
                                show_progress=not args.json)
            metrics = ray.get(replica.coordinator.metrics.remote())
        finally:
            replica.shutdown()
    finally:
        ray.shutdown()
    if args.json:
        print(json.dumps({"requests": rows, "metrics": metrics}, default=str))
    else:
        for r in rows:
            text = f" {tok.decode(r['tokens'])!r}" if tok is not None else ""  # --ids too
            print(f"{r['request_id']}: {r['tokens']}{text}" if not r["error"]
                  else f"{r['request_id']}: ERROR {r['error']}")
        print_table(rows, metrics)
    return 1 if any(r["error"] for r in rows) else 0


def _cmd_serve(args: argparse.Namespace) -> int:
    """Serve the OpenAI API with Ray Serve until interrupted (Ctrl-C or SIGTERM): then every
    request in flight is answered 503 (its decode replica drains) and the app stops."""
    import signal
    import threading

    import ray

    try:
        from ray import serve

        from hisparse_ray.serve import build_openai_app
        from hisparse_ray.serve.builder import options_of
        from hisparse_ray.serve.protocol import model_id
    except ImportError as err:
        raise SystemExit(f"hisparse-ray serve needs Ray Serve and openai: pip install "
                         f"'hisparse-ray[serve]' ({err})") from None

    opts = options_of(options(args))  # the API key defaults to $HISPARSE_API_KEY
    deployment(args, opts.num_replicas)  # option errors and this node's sizes before Ray starts
    app = build_openai_app(opts)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    attached = _start_ray(args.num_cpus, args.address)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        print(f"starting {opts.num_replicas} HiSparse replica(s) (TP {opts.tp})...", flush=True)
        t0 = time.perf_counter()
        serve.run(app, name=args.app_name, route_prefix="/", blocking=False)
        key = " (API key required)" if opts.api_key else ""
        print(f"serving the OpenAI API on http://{args.host}:{args.port}/v1{key} (up in "
              f"{time.perf_counter() - t0:.1f}s); model "
              f"{model_id(opts)!r}; Ctrl-C stops",
              flush=True)
        stop.wait()
        print("stopping: answering requests in flight with 503...", flush=True)
        print(f"drained {drain_app(args.app_name)} request(s)", flush=True)
    finally:
        try:
            serve.delete(args.app_name)
            if not attached:
                serve.shutdown()
        finally:
            ray.shutdown()
    return 0


def drain_app(app_name: str, timeout_s: float = 10.0) -> int:
    """Drain the decode replicas of a Serve app (their coordinators are named actors): every
    request in flight ends with ``StateError`` -> HTTP 503, new ones are refused. Returns how
    many requests were in flight."""
    import ray

    from hisparse_ray.serve.server import COORDINATOR_PREFIX

    prefix = f"{COORDINATOR_PREFIX}{app_name}:"
    refs = []
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].startswith(prefix):
            try:
                coord = ray.get_actor(actor["name"], namespace=actor["namespace"])
                refs.append(coord.drain.remote("server is shutting down"))
            except Exception:  # noqa: BLE001 - gone meanwhile
                pass
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    total = 0
    for ref in done:
        try:
            total += ray.get(ref)
        except Exception:  # noqa: BLE001 - a replica that died meanwhile has nothing to drain
            pass
    return total


def _cmd_smoke(args: argparse.Namespace) -> int:
    import ray

    cfg = load_config(args.config)
    layout = KVLayout()
    t0 = time.perf_counter()
    _start_ray(args.num_cpus, args.address)
    try:
        res = ray.cluster_resources()
        print(f"local Ray cluster up in {time.perf_counter() - t0:.1f}s: "
              f"{json.dumps(res, sort_keys=True)}")
        print("config:", cfg.to_json())
        print(f"layout: {layout.bytes_per_token_layer} B/token/layer, {layout.num_layers} layers, "
              f"page {layout.page_size}, host blocks in {cfg.host_pool_gib} GiB: "
              f"{layout.host_blocks(cfg.host_pool_gib)}")
    finally:
        ray.shutdown()
    return 0


_TITLES = {"model": "model", "replica": "decode replica", "prefill": "prefill worker",
           "request": "requests", "serve": "Ray Serve"}
_METAVARS = {"int": "N", "float": "X", "float?": "X", "str": "NAME", "dict?": "JSON", "json?": "JSON",
             "config": "JSON"}


# SGLang's spelling of the same option (its HiSparse guide's launch lines), taken as well
_SGLANG_FLAGS = {"config": ("--hisparse-config",), "model": ("--model-path",), "tp": ("--tp-size",)}


def _deployment_args(p: argparse.ArgumentParser, command: str) -> None:
    """One flag per deployment option of the command's groups (``DeployOptions``: its help, its
    default; values are parsed and checked by ``DeployOptions.from_dict``), and SGLang's name
    for it where it has one (``--hisparse-config``, ``--model-path``, ``--tp-size``)."""
    groups = {g: p.add_argument_group(_TITLES[g] + " options") for g in CLI_GROUPS[command]}
    for f in fields(DeployOptions):
        meta = f.metadata
        if meta["group"] not in groups:
            continue
        shown = "" if f.default is MISSING or f.default is None else f" (default {f.default})"
        groups[meta["group"]].add_argument(
            "--" + f.name.replace("_", "-"), *_SGLANG_FLAGS.get(f.name, ()), dest=f.name, default=None,
            choices=meta["choices"] or None, metavar=None if meta["choices"] else
            _METAVARS[meta["kind"]], help=meta["help"] + shown)
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray cluster")
    p.add_argument("--address", default=None, help="attach to this Ray cluster (default: "
                   "$RAY_ADDRESS, e.g. set by `ray job submit`; else start a local one)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hisparse-ray", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="the main job: long-context requests through prefill -> "
                       "NIXL -> TP 2 HiSparse decode, checked against full-resident decode")
    _deployment_args(d, "demo")
    d.add_argument("--requests", type=int, default=4)
    d.add_argument("--min-context", type=int, default=160)
    d.add_argument("--max-context", type=int, default=240)
    d.set_defaults(func=_cmd_demo)
    g = sub.add_parser("generate", help="generate for your prompts (text via a byte-level "
                       "tokenizer, or token ids)")
    _deployment_args(g, "generate")
    g.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    g.add_argument("--ids", action="append", help="prompt token ids, e.g. '5,17,3' (repeatable)")
    g.add_argument("--json", action="store_true", help="print results as JSON")
    g.set_defaults(func=_cmd_generate)
    v = sub.add_parser("serve", help="serve the OpenAI API (/v1/completions, "
                       "/v1/chat/completions, /v1/models) with Ray Serve")
    _deployment_args(v, "serve")
    v.add_argument("--host", default="127.0.0.1", help="HTTP address (0.0.0.0: every interface)")
    v.add_argument("--port", type=int, default=8000)
    v.add_argument("--app-name", default="hisparse", help="the Serve application's name")
    v.set_defaults(func=_cmd_serve)
    s = sub.add_parser("smoke", help="start a local Ray cluster and print the config")
    s.add_argument("--config", "--hisparse-config", dest="config",
                   help="HiSparse config JSON (SGLang --hisparse-config keys)")
    s.add_argument("--num-cpus", type=int, default=2)
    s.add_argument("--address", default=None, help="attach to this Ray cluster")
    s.set_defaults(func=_cmd_smoke)
    return p


def main(argv: list[str] | None = None) -> int:
    from hisparse_ray.errors import HiSparseError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except HiSparseError as err:  # bad config, pool too large...: one line, not a traceback
        cause = getattr(err, "cause", None)  # raised inside an actor: Ray wraps it
        print(f"hisparse-ray {args.cmd}: {cause if isinstance(cause, HiSparseError) else err}",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
