"""Deployment options and the specs built from them (front door, ring 3): one frozen
:class:`DeployOptions` with every option of a deployment and its one default, built once from CLI
flags (``hisparse-ray``), Serve options (``build_app``) or Python, and validated before Ray starts;
then the frozen, picklable specs the launcher hands to every actor (:class:`ModelSpec`,
:class:`ReplicaSpec`, :class:`PrefillSpec`), so that all of them derive the same model, layout and
pool sizes. The specs' defaults are the options' defaults.

    opts = DeployOptions(tp=2, device_blocks=12)            # or DeployOptions.from_dict({...})
    replica_spec, prefill_spec = opts.specs()                 # resolves "auto" device / GPUs
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from hisparse_ray.checks import (
    check_bool, check_choice, check_int, check_number, check_optional_number, check_str, check_type,
)
from hisparse_ray.config import CoordinatorConfig, HiSparseConfig, KVLayout, kv_row_bytes
from hisparse_ray.config import kv_rows_lossless
from hisparse_ray.errors import ConfigError
from hisparse_ray.option_values import (  # noqa: F401 - load_config, visible_gpus: public here
    check_kind, load_config, parse_value, resolve_gpus_per_rank, visible_gpus,
)
from hisparse_ray.fastpath.config import deployment_fast_path

#: ``landing_push_with_prefill`` values
PUSH_WITH_PREFILL = ("auto", "always", "never")
#: option groups: the CLI's ``demo`` and ``generate`` take the first four, ``serve`` all
GROUPS = ("model", "replica", "prefill", "request", "serve")
#: ``deployment_config`` keys: Serve deployment options passed through to the HiSparse deployment
SERVE_DEPLOYMENT_KEYS = ("autoscaling_config", "num_replicas", "max_ongoing_requests",
                         "max_queued_requests", "health_check_period_s", "health_check_timeout_s",
                         "graceful_shutdown_timeout_s", "graceful_shutdown_wait_loop_s",
                         "ray_actor_options", "user_config", "placement_group_bundles",
                         "placement_group_strategy", "max_replicas_per_node")
#: the built-in model kinds (``hisparse_ray.model.config.KINDS``; spelled out here so that the
#: front door refuses a bad kind without importing torch)
MODEL_KINDS = ("deepseek_v32", "glm_moe_dsa")
#: a replica id names the host pool's segment file and placement group
_NAME_FORBIDS = "/\0"
FAST_PATH, KV_CACHE_DTYPES = ("auto", "on", "off"), ("auto", "fp32", "bf16", "fp8")
ON_OFF = ("off", "on")


def _opt(default: Any, help: str, group: str, *, kind: str = "", choices: tuple = (),
         factory: Any = None, secret: bool = False) -> Any:
    """A ``DeployOptions`` field: its default, help text (the CLI's), group and value kind
    ("int", "float", "str", "float?" (or None), "dict?" (resource dict or None), "json?" (a JSON
    object or None), "config")."""
    kind = kind or {int: "int", float: "float", str: "str"}[type(default)]
    meta = {"help": help, "group": group, "kind": kind, "choices": choices}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta, repr=not secret)  # a secret stays out of logs


@dataclass(frozen=True, slots=True)
class DeployOptions:
    """Every option of a deployment (one decode replica + one prefill worker, per Serve replica
    when served), with the one set of defaults. Invalid values raise :class:`ConfigError` naming
    the option, the value and the rule, at construction: a replica whose pools cannot hold one
    hot buffer or one host block is refused here, before anything starts. ``specs()`` resolves
    the device ("auto": a GPU when one is visible) into the specs the launcher takes."""

    # -- the model every actor builds
    model: str = _opt("deepseek_v32", "a built-in kind (deepseek_v32, glm_moe_dsa: tiny, random "
                      "weights) or a local HF model folder (config.json, safetensors shards, "
                      "tokenizer; DeepSeek-V3.2 / GLM-5, fp8 block-quantized included)", "model")
    seed: int = _opt(0, "model weights seed (identical on every actor)", "model")
    dtype: str = _opt("float32", "model dtype, and the KV rows' unless kv_cache_dtype says "
                      "(float32 keeps greedy choices robust to batching differences in the "
                      "exactness checks)", "model",
                      choices=("float32", "bfloat16"))
    model_shape: str = _opt("tiny", "tiny: 4 layers of 48-value rows; landing: DeepSeek-V3.2's KV "
                            "bytes per token around a tiny network (benchmarks)", "model",
                            choices=("tiny", "landing"))
    model_layers: int = _opt(61, "layers of the 'landing' shape", "model")
    fp8: str = _opt("auto", "fp8 checkpoints: fp8 GEMMs on sm90 GPUs (auto, kernel) or "
                    "dequantized at load (dequantize; always on CPUs)", "model",
                    choices=("auto", "kernel", "dequantize"))
    # -- one decode replica
    config: HiSparseConfig = _opt(None, "HiSparse config: a JSON file or inline JSON (SGLang "
                                  "--hisparse-config keys + host_pool_gib); keys left out take "
                                  "the built-in model's defaults: top-k 8 of a 16-slot hot "
                                  "buffer, 10 MiB host pool", "replica", kind="config",
                                  factory=HiSparseConfig.tiny)
    tp: int = _opt(2, "decode tensor-parallel ranks", "replica")
    page_size: int = _opt(8, "positions per page / host block", "replica")
    device_blocks: int = _opt(16, "device pool blocks per rank (small: long contexts land on the "
                              "host tier)", "replica")
    staging_blocks: int = _opt(16, "rank 0's GPU staging pool for host landings, in blocks (0: "
                               "none); room for two prompts lets a landing WRITE in its "
                               "prefill's call", "replica")
    max_batch: int = _opt(16, "most requests per decode step", "replica")
    device: str = _opt("auto", "auto: a GPU when one is visible", "replica",
                       choices=("auto", "cpu", "gpu"))
    gpus_per_rank: float | None = _opt(None, "GPU share of each decode rank: 1 = a GPU per rank "
                                       "(NCCL TP group), 0.5 = two ranks on one GPU (gloo); "
                                       "default: 1 if the node has tp GPUs, else 1/tp", "replica",
                                       kind="float?")
    cpus_per_rank: float = _opt(0.5, "CPUs Ray reserves per decode rank", "replica")
    step_timeout_s: float = _opt(60.0, "how long the coordinator waits for a rank's step report "
                                 "before it declares the rank lost", "replica")
    step_yield_s: float | None = _opt(None, "how long a step-channel waiter yields its core "
                                      "before it blocks on a futex; default: 20 ms on hosts with "
                                      ">= 8 cores, else 1 ms", "replica", kind="float?")
    landing_attempts: int = _opt(3, "NIXL WRITE attempts per landing chunk", "replica")
    landing_timeout_s: float = _opt(20.0, "deadline of one landing WRITE attempt", "replica")
    landing_call_timeout_s: float = _opt(120.0, "how much longer than attempts x timeout a "
                                         "landing's calls may run before the replica is fenced "
                                         "(a stalled peer may still write)", "replica")
    landing_layer_groups: int = _opt(1, "a staged landing chunk is written as this many layer "
                                     "groups, rank 0 copying group g while later ones are in "
                                     "flight", "replica")
    landing_push_with_prefill: str = _opt("auto", "a one-chunk landing WRITEs in its prefill's "
                                          "call: auto = while the staging pool keeps room for "
                                          "another landing, always, never", "replica",
                                          choices=PUSH_WITH_PREFILL)
    replica_id: str = _opt("r0", "names the replica's host pool and placement group", "replica")
    host_pool_dir: str = _opt("/dev/shm", "directory (a tmpfs) of the host pool's shared-memory "
                              "segment; its name is removed as soon as every rank mapped it, so "
                              "no exit path leaves it behind", "replica")
    fast_path: str = _opt("auto", "decode with the fast step (batched, paged GPU index keys, "
                          "FlashMLA / DeepGEMM, CUDA graphs): on, off (the reference path), auto = "
                          "on with CUDA and FlashMLA on an sm90 GPU", "replica", choices=FAST_PATH)
    compile_glue: str = _opt("off", "the fast step's per-layer torch work compiled by "
                             "torch.compile (fused kernels; compiles in a bucket's first step, "
                             "once per rank process): on, off", "replica", choices=ON_OFF)
    lookahead: str = _opt("off", "pipeline the decode steps one deep: step N + 1 goes to "
                          "the ranks before step N's tokens are read, each row fed the token "
                          "its previous row sampled on the device (the same tokens): on, off, "
                          "auto = on with the fast path", "replica", choices=FAST_PATH)
    kv_cache_dtype: str = _opt("auto", "KV rows in every pool and landing: auto = the model dtype, "
                               "fp32, bf16, fp8 (656 B rows)", "replica", choices=KV_CACHE_DTYPES)
    index_key_dtype: str = _opt("auto", "the fast path's GPU index keys: auto = the model dtype, "
                                "fp32, bf16, fp8", "replica", choices=KV_CACHE_DTYPES)
    # -- one prefill worker
    max_prompt_tokens: int = _opt(4096, "prefill send buffer: the longest prompt", "prefill")
    prefill_gpus: float = _opt(0.0, "GPU share of the prefill worker", "prefill")
    prefill_cpus: float = _opt(0.5, "CPUs Ray reserves for the prefill worker", "prefill")
    # -- requests and Ray Serve
    max_new_tokens: int = _opt(16, "new tokens per request unless it asks", "request")
    max_new_tokens_limit: int = _opt(4096, "the most new tokens a request may ask for", "serve")
    request_timeout_s: float = _opt(600.0, "a request still running after this is aborted "
                                    "(HTTP 504)", "serve")
    num_replicas: int = _opt(1, "Serve replicas, each with its own prefill worker and decode "
                             "replica", "serve")
    max_ongoing_requests: int = _opt(64, "requests one Serve replica takes at once (an OpenAI "
                                     "request counts once, all its prompts x n choices)",
                                     "serve")
    health_check_period_s: float = _opt(10.0, "how soon Serve notices a failed replica and "
                                        "replaces it", "serve")
    decode_resources: dict | None = _opt(None, "pin the decode replica to nodes offering these "
                                         "custom resources (JSON, e.g. {\"decode_node\": 0.01})",
                                         "serve", kind="dict?")
    prefill_resources: dict | None = _opt(None, "pin the prefill worker likewise", "serve",
                                          kind="dict?")
    served_model_name: str = _opt("", "the model id clients name in OpenAI requests "
                                  "(default: hisparse-<model>)", "serve")
    api_key: str = _opt("", "require 'Authorization: Bearer KEY' on /v1 (default: "
                        "$HISPARSE_API_KEY; empty: no key)", "serve", secret=True)
    max_request_bytes: int = _opt(8 << 20, "the largest HTTP request body (413 before it is "
                                  "read or tokenized)", "serve")
    max_queued_requests: int = _opt(-1, "requests queued per Serve replica beyond "
                                    "max_ongoing_requests before HTTP 429 (-1: no limit); a "
                                    "request with several choices is queued or refused whole",
                                    "serve")
    deployment_config: dict | None = _opt(None, "Serve options of the HiSparse deployment, passed "
                                          "through (JSON: autoscaling_config, "
                                          "graceful_shutdown_timeout_s, ...)", "serve", kind="json?")

    def __post_init__(self) -> None:
        for f in fields(self):
            check_kind(f.name, getattr(self, f.name), f.metadata)
        for key in ("tp", "page_size", "device_blocks", "max_batch", "model_layers",
                    "landing_attempts", "landing_layer_groups", "max_prompt_tokens",
                    "max_new_tokens", "max_new_tokens_limit", "num_replicas",
                    "max_ongoing_requests", "max_request_bytes"):
            check_int(key, getattr(self, key), lo=1)
        check_int("seed", self.seed, lo=0, hi=2**64 - 1)
        check_int("staging_blocks", self.staging_blocks, lo=0)
        for key in ("step_timeout_s", "landing_timeout_s", "landing_call_timeout_s",
                    "request_timeout_s", "health_check_period_s"):
            check_number(key, getattr(self, key), lo=0, lo_open=True, why="seconds")
        check_number("cpus_per_rank", self.cpus_per_rank, lo=0, why="CPUs")
        check_number("prefill_cpus", self.prefill_cpus, lo=0, why="CPUs")
        check_number("prefill_gpus", self.prefill_gpus, lo=0, hi=1, why="a share of one GPU")
        check_optional_number("gpus_per_rank", self.gpus_per_rank, lo=0, lo_open=True, hi=1)
        check_str("replica_id", self.replica_id, forbid=_NAME_FORBIDS)
        check_str("host_pool_dir", self.host_pool_dir, forbid="\0")
        if self.max_queued_requests < -1 or self.max_queued_requests == 0:
            raise ConfigError("max_queued_requests", self.max_queued_requests, "-1 or an int >= 1")
        bad = sorted(set(self.deployment_config or {}) - set(SERVE_DEPLOYMENT_KEYS))
        if bad:
            raise ConfigError("deployment_config", bad[0], f"one of {', '.join(SERVE_DEPLOYMENT_KEYS)}")
        if self.max_new_tokens > self.max_new_tokens_limit:
            raise ConfigError("max_new_tokens", self.max_new_tokens,
                              f"<= max_new_tokens_limit ({self.max_new_tokens_limit})")
        self.host_specs()  # every spec rule and the pool sizing, device aside

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "DeployOptions":
        """Options from a mapping of option names (Serve's ``build_app`` options, the CLI's flags):
        strings are parsed by each option's kind (``serve run module:app tp=2`` passes strings),
        ``config`` may be a dict, inline JSON or a JSON file path; None means the default. An
        unknown name raises ConfigError naming it."""
        known = {f.name: f for f in fields(cls)}
        out = {}
        for key, value in values.items():
            if key not in known:
                raise ConfigError(key, value, f"a deployment option: one of {sorted(known)}")
            if value is not None:
                out[key] = parse_value(key, value, known[key].metadata["kind"])
        return cls(**out)

    def specs(self, gpus: int | None = None) -> tuple["ReplicaSpec", "PrefillSpec"]:
        """The decode replica and prefill worker these options deploy, on a node with ``gpus``
        visible GPUs (None: as many as torch sees here; device "cpu" uses none)."""
        if self.device == "cpu":
            gpus = 0
        elif gpus is None:
            gpus = visible_gpus()
        if self.device == "gpu" and gpus == 0:
            raise ConfigError("device", self.device, "needs a visible CUDA device; none is visible")
        return self._specs(resolve_gpus_per_rank(self.gpus_per_rank, self.tp, gpus))

    def host_specs(self) -> tuple["ReplicaSpec", "PrefillSpec"]:
        """The specs with no GPU resolved (``gpus_per_rank`` 0), whatever ``device`` says: what
        code that places no rank reads (the model, its tokenizer, the limits, the host pool's
        size) in a process that may see no GPU: the OpenAI ingress, the CLI before it looks for
        GPUs. ``specs`` of ``device="gpu"`` with no GPU visible raises instead."""
        return self._specs(0.0)

    def _specs(self, gpus_per_rank: float) -> tuple["ReplicaSpec", "PrefillSpec"]:
        """The specs; a spec's ConfigError is re-raised under the option's name (``tp`` for
        ``tp_size``...), the name the user gave it."""
        try:
            return self._build_specs(gpus_per_rank)
        except ConfigError as err:
            if err.key not in _OPTION_OF:
                raise
            raise ConfigError(_OPTION_OF[err.key], err.value, err.allowed) from None

    def _build_specs(self, gpus_per_rank: float) -> tuple["ReplicaSpec", "PrefillSpec"]:
        model = ModelSpec(kind=self.model, seed=self.seed, dtype=self.dtype,
                          shape=self.model_shape, num_layers=self.model_layers, fp8=self.fp8)
        fast = deployment_fast_path(
            self.fast_path, gpus_per_rank, self.max_prompt_tokens + self.max_new_tokens_limit,
            self.max_batch, self.index_key_dtype, self.compile_glue == "on")
        replica = ReplicaSpec(
            model=model, hisparse=self.config, page_size=self.page_size,
            num_device_blocks=self.device_blocks, staging_blocks=self.staging_blocks,
            tp_size=self.tp, max_batch=self.max_batch, gpus_per_rank=gpus_per_rank,
            cpus_per_rank=self.cpus_per_rank, step_timeout_s=self.step_timeout_s,
            landing_attempts=self.landing_attempts, landing_timeout_s=self.landing_timeout_s,
            replica_id=self.replica_id, step_yield_s=self.step_yield_s, fast_path=fast,
            landing_layer_groups=self.landing_layer_groups, host_pool_dir=self.host_pool_dir,
            landing_call_timeout_s=self.landing_call_timeout_s, kv_cache_dtype=self.kv_cache_dtype,
            landing_push_with_prefill=self.landing_push_with_prefill,
            lookahead=self.lookahead == "on" or (self.lookahead == "auto" and fast is not None))
        prefill = PrefillSpec(model=model, max_prompt_tokens=self.max_prompt_tokens,
                              gpus=self.prefill_gpus, cpus=self.prefill_cpus,
                              kv_cache_dtype=self.kv_cache_dtype)
        return replica, prefill


#: spec field -> the DeployOptions option it comes from, where the names differ
_OPTION_OF = {"num_device_blocks": "device_blocks", "tp_size": "tp", "kind": "model",
              "shape": "model_shape", "num_layers": "model_layers", "gpus": "prefill_gpus",
              "cpus": "prefill_cpus"}


_D = {f.name: f.default for f in fields(DeployOptions)}  # the one set of defaults


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The model every actor of a deployment builds. ``kind``: a built-in DSA kind with random
    weights from ``seed`` (identical on every actor), or the path of a local HF model folder
    (config.json, safetensors shards, tokenizer: :func:`hisparse_ray.model.source.resolve`; each
    rank reads only its slices; stored absolute). ``dtype``: "float32" (CPU, tests) or
    "bfloat16" (GPU). ``shape`` (built-in kinds): "tiny" (the embedded default, 4 layers of
    48-value rows) or "landing" (DeepSeek-V3.2's KV bytes per token around a tiny network,
    ``num_layers`` layers of 576-value rows: for landing and capacity benchmarks). ``fp8`` (fp8
    folders): "auto" (fp8 GEMMs on sm90, else dequantized at load), "kernel", "dequantize"."""

    kind: str = _D["model"]
    seed: int = _D["seed"]
    dtype: str = _D["dtype"]
    shape: str = _D["model_shape"]
    num_layers: int = _D["model_layers"]  # "landing" shape only
    fp8: str = _D["fp8"]

    def __post_init__(self) -> None:
        check_int("seed", self.seed, lo=0, hi=2**64 - 1)
        check_choice("dtype", self.dtype, ("float32", "bfloat16"))
        check_choice("shape", self.shape, ("tiny", "landing"))
        check_int("num_layers", self.num_layers, lo=1)
        check_choice("fp8", self.fp8, ("auto", "kernel", "dequantize"))
        check_type("kind", self.kind, str, "a built-in kind or a local HF model folder")
        if self.kind not in MODEL_KINDS and not os.path.isdir(self.kind):  # no torch import yet
            raise ConfigError("kind", self.kind, f"must be one of {', '.join(MODEL_KINDS)} or a "
                                                 "local HF model folder")
        src = self.source()  # a bad kind, shape or folder fails here, before anything starts
        object.__setattr__(self, "kind", src.name)  # a folder as an absolute path

    def source(self):
        """The resolved :class:`~hisparse_ray.model.source.ModelSource`."""
        from hisparse_ray.model.source import resolve

        return resolve(self.kind, seed=self.seed, shape=self.shape, num_layers=self.num_layers)

    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    def dsa_config(self):
        return self.source().config

    def build(self, device: str = "cpu", *, rank: int = 0, tp_size: int = 1):
        """Rank ``rank`` of ``tp_size``'s model on ``device`` (the whole model at TP 1; the TP
        group is the default process group); same weights wherever it is built."""
        return self.source().load(dtype=self.torch_dtype(), device=device, rank=rank,
                                  tp_size=tp_size, fp8=self.fp8)

    def kv_layout(self, page_size: int, kv_cache_dtype: str = "auto") -> KVLayout:
        """The KV row layout of this model: one row per (token, layer) in ``kv_cache_dtype``
        ("auto": ``row_dim`` values of ``dtype``; fp8: DeepSeek-V3.2's row layout)."""
        cfg = self.dsa_config()
        kind = kv_cache_dtype
        if kind == "auto":
            kind = "fp32" if self.dtype == "float32" else "bf16"
        return KVLayout(num_layers=cfg.num_hidden_layers, page_size=page_size,
                        row_bytes=kv_row_bytes(kind, cfg.kv_lora_rank, cfg.qk_rope_head_dim))

    def tokenizer(self):
        """A folder's HF tokenizer (None when it has no tokenizer.json), or the built-in kinds'
        byte tokenizer when the vocabulary is its (96 ids), else None."""
        src = self.source()
        if src.is_folder:
            return src.tokenizer() if (Path(src.name) / "tokenizer.json").is_file() else None
        tok = src.tokenizer()
        return tok if int(src.config.vocab_size) == tok.vocab_size else None


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """One decode replica: a coordinator and ``tp_size`` DecodeWorker ranks on one node. The
    fields are :class:`DeployOptions`' replica options (``tp_size`` = ``tp``,
    ``num_device_blocks`` = ``device_blocks``, ``hisparse`` = ``config``; same defaults, meaning
    in their help), with ``gpus_per_rank`` resolved: 0 on CPU, <= 0.5 ranks may share a GPU (gloo
    TP group), above 0.5 each rank has its own (NCCL; the ranks still share one host pool).
    Construction checks the pool sizing the coordinator core will schedule against
    (``core_config``). ``landing_push_with_prefill`` also takes True / False ("always" /
    "never"). ``kv_cache_dtype`` sizes every pool's rows (``layout``); ``fast_path``: the ranks'
    ``FastPathConfig`` (None: the reference path); ``lookahead``: DeployOptions' ``"on"``."""

    model: ModelSpec = field(default_factory=ModelSpec)
    hisparse: HiSparseConfig = field(default_factory=HiSparseConfig.tiny)
    page_size: int = _D["page_size"]
    num_device_blocks: int = _D["device_blocks"]
    staging_blocks: int = _D["staging_blocks"]
    tp_size: int = _D["tp"]
    max_batch: int = _D["max_batch"]
    gpus_per_rank: float = 0.0
    cpus_per_rank: float = _D["cpus_per_rank"]
    step_timeout_s: float = _D["step_timeout_s"]
    landing_attempts: int = _D["landing_attempts"]
    landing_timeout_s: float = _D["landing_timeout_s"]
    replica_id: str = _D["replica_id"]
    step_yield_s: float | None = _D["step_yield_s"]
    landing_layer_groups: int = _D["landing_layer_groups"]
    landing_call_timeout_s: float = _D["landing_call_timeout_s"]
    landing_push_with_prefill: str = _D["landing_push_with_prefill"]
    host_pool_dir: str = _D["host_pool_dir"]
    kv_cache_dtype: str = _D["kv_cache_dtype"]
    fast_path: Any = None  # FastPathConfig | None (hisparse_ray.fastpath.config)
    lookahead: bool = False

    def __post_init__(self) -> None:
        check_type("model", self.model, ModelSpec)
        check_bool("lookahead", self.lookahead)
        check_type("hisparse", self.hisparse, HiSparseConfig)
        for key in ("page_size", "num_device_blocks", "tp_size", "max_batch", "landing_attempts",
                    "landing_layer_groups"):
            check_int(key, getattr(self, key), lo=1)
        check_int("staging_blocks", self.staging_blocks, lo=0)
        check_number("gpus_per_rank", self.gpus_per_rank, lo=0, hi=1, why="a share of one GPU")
        check_number("cpus_per_rank", self.cpus_per_rank, lo=0, why="CPUs")
        for key in ("step_timeout_s", "landing_timeout_s", "landing_call_timeout_s"):
            check_number(key, getattr(self, key), lo=0, lo_open=True, why="seconds")
        check_str("replica_id", self.replica_id, forbid=_NAME_FORBIDS)
        check_str("host_pool_dir", self.host_pool_dir, forbid="\0")
        check_optional_number("step_yield_s", self.step_yield_s, lo=50e-6, why="seconds")
        pwp = self.landing_push_with_prefill
        if isinstance(pwp, bool):
            object.__setattr__(self, "landing_push_with_prefill", "always" if pwp else "never")
        elif not isinstance(pwp, str) or pwp not in PUSH_WITH_PREFILL:
            raise ConfigError("landing_push_with_prefill", pwp,
                              f"must be one of {', '.join(PUSH_WITH_PREFILL)} (or a bool)")
        if self.fast_path is not None:
            from hisparse_ray.fastpath.config import check_fast_path

            check_fast_path(self.fast_path, self.max_batch)
        self.check_model()
        self.core_config  # noqa: B018 - pools holding a hot buffer and a host block; kv_cache_dtype

    def check_model(self) -> None:
        """The HiSparse config and TP size against the model every rank builds (ConfigError
        naming the key): ``top_k`` equals the model's ``index_topk`` (so the hot buffer holds
        every selected position) and ``tp_size`` divides its attention heads."""
        cfg = self.model.dsa_config()
        self.hisparse.check_model(cfg.index_topk, model=f"the {self.model.kind} model")
        if cfg.num_attention_heads % self.tp_size:
            raise ConfigError("tp_size", self.tp_size, f"must divide the {self.model.kind} "
                              f"model's {cfg.num_attention_heads} attention heads")

    @property
    def use_cuda(self) -> bool:
        return self.gpus_per_rank > 0

    def wait_policy(self):
        """The step channels' :class:`~hisparse_ray.channel.ring.WaitPolicy` on this host."""
        from hisparse_ray.channel.ring import WaitPolicy

        yield_s = self.step_yield_s
        if yield_s is None:
            yield_s = 20e-3 if (os.cpu_count() or 1) >= 8 else WaitPolicy().yield_s
        return WaitPolicy(yield_s=yield_s)

    @property
    def device(self) -> str:
        return "cuda" if self.use_cuda else "cpu"

    @property
    def layout(self) -> KVLayout:
        return self.model.kv_layout(self.page_size, self.kv_cache_dtype)

    @property
    def num_host_blocks(self) -> int:
        return self.core_config.num_host_blocks

    @property
    def core_config(self) -> CoordinatorConfig:
        """The pool sizing of this replica's coordinator core (ConfigError if the device pool
        cannot hold one hot buffer or the host pool one host block)."""
        lossless = kv_rows_lossless(self.kv_cache_dtype, self.model.dtype)
        return CoordinatorConfig.from_hisparse(self.hisparse, self.layout, self.num_device_blocks,
                                               tp_size=self.tp_size, max_batch=self.max_batch,
                                               publish_decoded=self.fast_path is None and lossless)


@dataclass(frozen=True, slots=True)
class PrefillSpec:
    """One prefill worker: the same model, on any node. ``max_prompt_tokens`` sizes its registered
    send buffer (one prompt's KV, all layers).

    synthetic_kv: BENCHMARKS ONLY. ``prefill`` skips the model and fills the send buffers with
    seeded normal values of the model dtype (KV rows and indexer keys of the right shapes), so
    landings of 64K-128K tokens can be timed without minutes of dense prefill per prompt. The
    landing path is the real one; the tokens decoded afterwards are meaningless.

    batch_invariant: the exact prefill (``DSAModel.prefill``: every position's KV bitwise what
    decode computes, so reused prefixes stay exact; see docs/architecture.md "Exactness
    contract"). It computes per token row (on a GPU one position at a time): False batches the
    prefill's matmuls, for benchmarks and real-size models (rows then differ in the last bits).
    ``kv_cache_dtype``: the KV rows it sends; the replica's (``add_prefill`` checks)."""

    model: ModelSpec = field(default_factory=ModelSpec)
    max_prompt_tokens: int = _D["max_prompt_tokens"]
    gpus: float = _D["prefill_gpus"]
    cpus: float = _D["prefill_cpus"]
    name: str = "prefill0"
    synthetic_kv: bool = False
    batch_invariant: bool = True
    kv_cache_dtype: str = _D["kv_cache_dtype"]

    def __post_init__(self) -> None:
        check_type("model", self.model, ModelSpec)
        check_int("max_prompt_tokens", self.max_prompt_tokens, lo=1)
        check_number("gpus", self.gpus, lo=0, hi=1, why="a share of one GPU")
        check_number("cpus", self.cpus, lo=0, why="CPUs")
        check_str("name", self.name, forbid=_NAME_FORBIDS)
        check_bool("synthetic_kv", self.synthetic_kv)
        check_bool("batch_invariant", self.batch_invariant)
        self.model.kv_layout(1, self.kv_cache_dtype)  # ConfigError naming kv_cache_dtype

    @property
    def use_cuda(self) -> bool:
        return self.gpus > 0

    @property
    def device(self) -> str:
        return "cuda" if self.use_cuda else "cpu"
