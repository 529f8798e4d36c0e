"""Options of the fast decode step (pure: standard library only) and its batch-size buckets.

The fast step runs a whole decode step as one batch over static device buffers (CUDA graphs per
batch-size bucket on a GPU); see :mod:`hisparse_ray.fastpath.step`. These options are frozen and
validated here; every bad value is a :class:`~hisparse_ray.errors.ConfigError` naming key, value
and rule.
"""

from __future__ import annotations

from dataclasses import dataclass

from hisparse_ray.errors import ConfigError

INDEX_PAGE = 64  # tokens per index-key page (the page DeepGEMM's paged logits read)
INDEX_KEY_DTYPES = ("auto", "fp32", "bf16", "fp8")
ATTENTION = ("auto", "flashmla", "reference")
LOGITS = ("auto", "deepgemm", "reference")


def _pos_int(key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(key, value, "must be an integer >= 1")
    return value


@dataclass(frozen=True, slots=True)
class FastPathConfig:
    """The fast decode step of one rank.

    max_context: positions a request may reach (prompt + new tokens); the static block tables and
        the indexer's logits row are this wide, so it bounds per-step work and memory.
    buckets: batch sizes a graph is captured for (ascending); a step of B rows runs in the
        smallest bucket >= B, padded rows are inert. The largest bucket is the most rows a step
        can hold.
    index_key_dtype: indexer keys in the GPU's paged pool: "auto" (the model's dtype), "fp32",
        "bf16" or "fp8" (DeepSeek's e4m3 keys + one fp32 scale per token, 132 B at 128 dims).
    attention: "flashmla" (FlashMLA's sm90 sparse kernels: bf16 activations, 512 + 64 rows, needs
        ``sglang-kernel``), "reference" (gather + torch attention, any shape and device), or
        "auto" (FlashMLA where it runs, else the reference).
    logits: indexer logits by "deepgemm" (``fp8_paged_mqa_logits``: fp8 keys, 64 x 128 index
        heads, needs ``sgl-deep-gemm``), "reference" (torch), or "auto".
    cuda_graphs: capture one CUDA graph per bucket (CUDA only; TP needs NCCL to be captured).
    index_pages: pages of the GPU index-key pool, a fixed cap (None: room for ``max_batch``
        requests of ``max_context`` positions, grown on demand). At least one request of
        ``max_context`` positions. The engine's admission counts these pages
        (``CoordinatorConfig.index_pages``): a request waits while the landed ones hold too many.
    compile_glue: ``torch.compile`` the per-layer torch work between the library kernels (norms,
        projections, rope, casts, the dense MLP; :mod:`hisparse_ray.fastpath.glue`): fused
        kernels instead of ~150 small launches a layer. Compiles during a bucket's first step
        (one graph per function for every layer; seconds to minutes once per process).
    overlap_resolve: on CUDA, run each layer's resolver (or its replay) on a side stream while
        the main stream computes the absorbed query (``q_b_proj`` + ``W_uk``), joining before
        attention: the miss copies hide behind the layer's largest GEMM. The same kernels on
        the same inputs: results are bit-identical either way. No effect on CPU.
    warm_up: run one step of inert padding rows per bucket when the rank is built
        (:meth:`~hisparse_ray.fastpath.executor.FastExecutor.warm_up`): every bucket's graph is
        captured and every library kernel compiled before the first request, so no step pays a
        capture or a JIT compile (on a cold machine that can take a first step near the
        replica's 60 s step timeout). No request's state is read or written. "auto" (default):
        on CUDA only; True: on every device (tests: TP ranks warming together on the CPU);
        False: never.
    """

    max_context: int = 4096
    buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    index_key_dtype: str = "auto"
    attention: str = "auto"
    logits: str = "auto"
    cuda_graphs: bool = True
    index_pages: int | None = None
    compile_glue: bool = False
    overlap_resolve: bool = True
    warm_up: bool | str = "auto"

    def __post_init__(self) -> None:
        _pos_int("max_context", self.max_context)
        b = self.buckets
        if not isinstance(b, tuple) or not b:
            raise ConfigError("buckets", b, "must be a non-empty tuple of batch sizes")
        for v in b:
            _pos_int("buckets", v)
        if list(b) != sorted(set(b)):
            raise ConfigError("buckets", b, "must be strictly ascending")
        if self.index_key_dtype not in INDEX_KEY_DTYPES:
            raise ConfigError("index_key_dtype", self.index_key_dtype, f"must be one of {INDEX_KEY_DTYPES}")
        if self.attention not in ATTENTION:
            raise ConfigError("attention", self.attention, f"must be one of {ATTENTION}")
        if self.logits not in LOGITS:
            raise ConfigError("logits", self.logits, f"must be one of {LOGITS}")
        if not isinstance(self.cuda_graphs, bool):
            raise ConfigError("cuda_graphs", self.cuda_graphs, "must be a bool")
        if self.index_pages is not None:
            _pos_int("index_pages", self.index_pages)
            if self.index_pages < self.index_pages_per_request:
                raise ConfigError("index_pages", self.index_pages,
                                  f"must hold one request of max_context={self.max_context} "
                                  f"positions ({self.index_pages_per_request} pages of {INDEX_PAGE})")
        if not isinstance(self.compile_glue, bool):
            raise ConfigError("compile_glue", self.compile_glue, "must be a bool")
        if not isinstance(self.overlap_resolve, bool):
            raise ConfigError("overlap_resolve", self.overlap_resolve, "must be a bool")
        if not (isinstance(self.warm_up, bool) or self.warm_up == "auto"):
            raise ConfigError("warm_up", self.warm_up, 'must be True, False or "auto"')

    def warms_up(self, device_type: str) -> bool:
        """Whether a rank on a ``device_type`` device runs :attr:`warm_up`'s padding steps."""
        return self.warm_up is True or (self.warm_up == "auto" and device_type == "cuda")

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    @property
    def index_pages_per_request(self) -> int:
        return -(-self.max_context // INDEX_PAGE)

    def bucket(self, batch: int) -> int:
        """The smallest bucket holding ``batch`` rows (ConfigError past the largest)."""
        for b in self.buckets:
            if b >= batch:
                return b
        raise ConfigError("buckets", self.buckets, f"the largest bucket must hold a batch of {batch}")


def default_buckets(max_batch: int) -> tuple[int, ...]:
    """The powers of two below ``max_batch``, then ``max_batch``: (1, 2, 4, 8, 12) for 12."""
    _pos_int("max_batch", max_batch)
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return tuple(out) + (max_batch,)


def check_fast_path(fast: object, max_batch: int) -> None:
    """A deployment's ``fast_path``: a :class:`FastPathConfig` whose largest bucket holds
    ``max_batch`` (ConfigError naming the key otherwise)."""
    if not isinstance(fast, FastPathConfig):
        raise ConfigError("fast_path", fast, "must be a FastPathConfig or None")
    if fast.max_batch < max_batch:
        raise ConfigError("fast_path.buckets", fast.buckets,
                          f"the largest bucket must hold max_batch={max_batch}")


def deployment_fast_path(mode: str, gpus_per_rank: float, max_context: int, max_batch: int,
                         index_key_dtype: str = "auto",
                         compile_glue: bool = False) -> FastPathConfig | None:
    """``DeployOptions.fast_path`` ("on" | "off" | "auto") -> the ranks' config (None: the
    reference path). "auto" is on when the ranks get a GPU and this process can run FlashMLA
    (sm90, ``sglang-kernel`` importable; checked only then, it imports torch). Buckets:
    :func:`default_buckets` of ``max_batch``; ``compile_glue``: ``DeployOptions.compile_glue``."""
    if mode not in ("auto", "on", "off"):
        raise ConfigError("fast_path", mode, "must be one of auto, on, off")
    if mode == "off" or (mode == "auto" and not (gpus_per_rank > 0 and _kernels_available())):
        return None
    return FastPathConfig(max_context=max_context, buckets=default_buckets(max_batch),
                          index_key_dtype=index_key_dtype, compile_glue=compile_glue)


def _kernels_available() -> bool:
    from hisparse_ray.kernels import flashmla

    return flashmla.available()
