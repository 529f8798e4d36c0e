"""What a decode replica and a prefill worker are built from (ring 3): frozen, picklable specs that
the launcher hands to every actor, so that all of them derive the same model, layout and pool sizes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hisparse_ray.config import HiSparseConfig, KVLayout
from hisparse_ray.errors import ConfigError

#: ``ReplicaSpec.landing_push_with_prefill`` values
PUSH_WITH_PREFILL = ("auto", "always", "never")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The model every actor of a deployment builds. ``kind``: a built-in DSA kind with random
    weights from ``seed`` (identical on every actor), or the path of a local HF model folder
    (config.json, safetensors shards, tokenizer: :func:`hisparse_ray.model.source.resolve`; every
    rank reads only its slices). ``dtype``: "float32" (CPU, tests) or "bfloat16" (GPU). ``shape``
    (built-in kinds): "tiny" (the embedded default, 4 layers of 48-value rows) or "landing"
    (DeepSeek-V3.2's KV bytes per token around a tiny network, ``num_layers`` layers of 576-value
    rows: for landing and capacity benchmarks). ``fp8`` (fp8 folders): "auto" (fp8 GEMM on sm90,
    else dequantized at load), "kernel", "dequantize"."""

    kind: str = "deepseek_v32"
    seed: int = 0
    dtype: str = "float32"
    shape: str = "tiny"
    num_layers: int = 61  # "landing" shape only
    fp8: str = "auto"

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError("dtype", self.dtype, "one of 'float32', 'bfloat16'")
        if self.fp8 not in ("auto", "kernel", "dequantize"):
            raise ConfigError("fp8", self.fp8, "one of 'auto', 'kernel', 'dequantize'")
        src = self.source()  # a bad kind, shape or folder fails here, before anything starts
        object.__setattr__(self, "kind", src.name)  # a folder as an absolute path: same on every node

    def source(self):
        from hisparse_ray.model.source import resolve

        return resolve(self.kind, seed=self.seed, shape=self.shape, num_layers=self.num_layers)

    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    def dsa_config(self):
        return self.source().config

    def build(self, device: str = "cpu", *, rank: int = 0, tp_size: int = 1):
        """Rank ``rank`` of ``tp_size``'s model on ``device`` (the whole model at TP 1; the TP group
        is the default process group); same weights wherever it is built."""
        return self.source().load(dtype=self.torch_dtype(), device=device, rank=rank, tp_size=tp_size,
                                  fp8=self.fp8)

    def tokenizer(self):
        """The folder's HF tokenizer, or the built-in kinds' byte tokenizer."""
        return self.source().tokenizer()

    def kv_layout(self, page_size: int) -> KVLayout:
        """The KV row layout of this model: ``row_dim`` values of ``dtype`` per (token, layer)."""
        cfg = self.dsa_config()
        itemsize = 4 if self.dtype == "float32" else 2
        return KVLayout(num_layers=cfg.num_hidden_layers, page_size=page_size,
                        row_bytes=cfg.row_dim * itemsize)


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """One decode replica: a coordinator and ``tp_size`` DecodeWorker ranks on one node.

    num_device_blocks: device pool blocks per rank (MLA KV is replicated, so every rank has the
        same pool). staging_blocks: bounded GPU staging pool for host landing (blocks of one page
        in every layer) used when the prefill peer cannot write host memory natively.
    gpus_per_rank: 0 on CPU; 0.5 puts both TP ranks on one GPU (gloo TP group); more than 0.5
        puts every rank on its own GPU (NCCL TP group; the ranks still share one host pool).
    max_batch: most requests per decode step. step_timeout_s: how long the coordinator waits for a
        rank's report before it declares the rank lost.
    landing_attempts / landing_timeout_s: NIXL WRITE retries and per-attempt deadline.
    landing_call_timeout_s: how much longer than ``landing_attempts x landing_timeout_s`` a
        landing's Ray calls may run; past it the replica is fenced (stopped with a typed error),
        since a stalled peer may still write into blocks that would otherwise be reused.
    step_yield_s: how long a step-channel waiter (coordinator, ranks) keeps its core with
        ``sched_yield`` before it blocks on a futex; None = 20 ms on hosts with >= 8 cores (a
        woken waiter costs ~60-140 us of the step's round trip; on the H200 host the yield
        phase measured 0.65-0.72x the blocking round trip at TP 2), else 1 ms.
    landing_layer_groups: a staged landing chunk is WRITTEN as this many layer groups, each with
        its own notification, and rank 0 copies group g to host while later groups are still in
        flight (overlaps the NIXL WRITE with the D2H copy). 1 = one WRITE (what was measured on
        the H200); capped at the layer count.
    landing_push_with_prefill: a one-chunk landing leases its staging run and plans its WRITEs
        before prefill, and the prefill worker pushes in the same call as its prefill (no Ray
        round trip through the lander between KV ready and WRITE; the worker builds the WRITEs
        before prefilling and only posts them after: a 16K-token landing on the H200 went from
        38.2 to 43.9-44.4 GB/s). The staging run is then held through the prefill.
        "auto" (default): only when the pool keeps room for another landing of the same size
        after this lease and nobody waits for it, so holding the run never delays another
        prefill worker's landing; "always": every one-chunk landing (waits for its run before
        prefill); "never": the usual path. True / False mean "always" / "never". So give
        ``staging_blocks`` room for two prompts to get it under "auto".
    """

    model: ModelSpec = field(default_factory=ModelSpec)
    hisparse: HiSparseConfig = field(default_factory=HiSparseConfig.tiny)
    page_size: int = 8
    num_device_blocks: int = 64
    staging_blocks: int = 16
    tp_size: int = 2
    max_batch: int = 16
    gpus_per_rank: float = 0.0
    cpus_per_rank: float = 0.5
    step_timeout_s: float = 60.0
    landing_attempts: int = 3
    landing_timeout_s: float = 20.0
    replica_id: str = "r0"
    step_yield_s: float | None = None
    landing_layer_groups: int = 1
    landing_call_timeout_s: float = 120.0
    landing_push_with_prefill: str = "auto"

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ConfigError("tp_size", self.tp_size, "must be >= 1")
        if self.page_size < 1:
            raise ConfigError("page_size", self.page_size, "must be >= 1")
        if self.num_device_blocks < 1:
            raise ConfigError("num_device_blocks", self.num_device_blocks, "must be >= 1")
        if self.staging_blocks < 0:
            raise ConfigError("staging_blocks", self.staging_blocks, "must be >= 0")
        if self.gpus_per_rank < 0 or self.cpus_per_rank < 0:
            raise ConfigError("gpus_per_rank", self.gpus_per_rank, "resources must be >= 0")
        if self.landing_attempts < 1:
            raise ConfigError("landing_attempts", self.landing_attempts, "must be >= 1")
        if self.landing_call_timeout_s <= 0:
            raise ConfigError("landing_call_timeout_s", self.landing_call_timeout_s, "must be > 0")
        if self.landing_layer_groups < 1:
            raise ConfigError("landing_layer_groups", self.landing_layer_groups, "must be >= 1")
        pwp = self.landing_push_with_prefill
        if isinstance(pwp, bool):
            object.__setattr__(self, "landing_push_with_prefill", "always" if pwp else "never")
        elif pwp not in PUSH_WITH_PREFILL:
            raise ConfigError("landing_push_with_prefill", pwp,
                              f"must be one of {', '.join(PUSH_WITH_PREFILL)} (or a bool)")
        if self.step_yield_s is not None and self.step_yield_s < 50e-6:
            raise ConfigError("step_yield_s", self.step_yield_s, "must be >= 50e-6 s or None")

    @property
    def use_cuda(self) -> bool:
        return self.gpus_per_rank > 0

    def wait_policy(self):
        """The step channels' :class:`~hisparse_ray.channel.WaitPolicy` on this host."""
        import os

        from hisparse_ray.channel import WaitPolicy

        yield_s = self.step_yield_s
        if yield_s is None:
            yield_s = 20e-3 if (os.cpu_count() or 1) >= 8 else WaitPolicy().yield_s
        return WaitPolicy(yield_s=yield_s)

    @property
    def device(self) -> str:
        return "cuda" if self.use_cuda else "cpu"

    @property
    def layout(self) -> KVLayout:
        return self.model.kv_layout(self.page_size)

    @property
    def num_host_blocks(self) -> int:
        n = self.layout.host_blocks(self.hisparse.host_pool_gib)
        if n < 1:
            raise ConfigError("host_pool_gib", self.hisparse.host_pool_gib,
                              f"must hold at least one host block ({self.layout.block_bytes} B)")
        return n


@dataclass(frozen=True, slots=True)
class PrefillSpec:
    """One prefill worker: the same model, on any node. ``max_prompt_tokens`` sizes its registered
    send buffer (one prompt's KV, all layers).

    synthetic_kv: BENCHMARKS ONLY. ``prefill`` skips the model and fills the send buffers with
    seeded normal values of the model dtype (KV rows and indexer keys of the right shapes), so
    landings of 64K-128K tokens can be timed without minutes of dense prefill per prompt. The
    landing path is the real one; the tokens decoded afterwards are meaningless."""

    model: ModelSpec = field(default_factory=ModelSpec)
    max_prompt_tokens: int = 4096
    gpus: float = 0.0
    cpus: float = 0.5
    name: str = "prefill0"
    synthetic_kv: bool = False

    @property
    def use_cuda(self) -> bool:
        return self.gpus > 0

    @property
    def device(self) -> str:
        return "cuda" if self.use_cuda else "cpu"
