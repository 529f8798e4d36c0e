"""The one frozen configuration root (pure ring: standard library only).

``HiSparseConfig`` carries the keys of SGLang's ``--hisparse-config`` JSON plus ``host_pool_gib``;
``KVLayout`` describes one MLA KV row and how rows group into host blocks; ``CoordinatorConfig``
is the pool sizing the coordinator core schedules against, derived from both. Every invalid value
raises :class:`~hisparse_ray.errors.ConfigError` naming the key, the value and what is allowed.
Environment variables are read here and nowhere else (:func:`env_flag`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from hisparse_ray.errors import ConfigError

GIB = 1 << 30

# Thread-block sizes the resolver kernel runs correctly with: whole warps, at least 2 warps (the
# ballot/scan LRU update needs >= 2 warps to hold the per-warp offsets), at most 1024 (CUDA limit).
# The original SGLang kernel silently corrupted its LRU below 512 threads; ours is written for any
# warp multiple in this range and tests sweep it.
MIN_BLOCK_THREADS = 64
MAX_BLOCK_THREADS = 1024

# Bytes of one token's KV in one layer.
#   bf16 MLA: (kv_lora_rank 512 + rope 64) dims * 2 B = 1152 B.
#   fp8 FlashMLA layout: 512 fp8 latent + 4 fp32 scales + 64 bf16 rope = 512 + 16 + 128 = 656 B.
KV_ROW_BYTES = {"bf16": 1152, "fp8": 656}
#: KV-cache dtypes of a row (``kv_cache_dtype``; "auto" = the model's dtype)
KV_CACHE_DTYPES = ("fp32", "bf16", "fp8")
FP8_TILE = 128  # latent values per fp8 scale (DeepSeek-V3.2's row layout)


def hot_buffer_blocks(device_buffer_size: int, page_size: int) -> int:
    """Device blocks of one request's hot buffer: ``device_buffer_size`` hot slots plus the slot
    reserved for the newest token, in pages of ``page_size`` rows."""
    return -(-(device_buffer_size + 1) // page_size)


def kv_row_bytes(kind: str, kv_lora_rank: int, rope_dim: int) -> int:
    """Bytes of one token's MLA row (``kv_lora_rank`` latent + ``rope_dim`` rope values) stored as
    ``kind``: fp32 / bf16 values, or fp8 (e4m3 latent, one fp32 scale per 128 latent values, bf16
    rope: 656 B at 512 + 64; :mod:`hisparse_ray.kernels.kvfp8` holds the codec). ConfigError
    names ``kv_cache_dtype`` for an unknown kind or a shape fp8 rows cannot hold."""
    if kind not in KV_CACHE_DTYPES:
        raise ConfigError("kv_cache_dtype", kind, f"must resolve to one of {KV_CACHE_DTYPES}")
    if kind == "fp8":
        if kv_lora_rank % 4 or rope_dim % 2:
            raise ConfigError("kv_cache_dtype", kind, f"fp8 rows need kv_lora_rank % 4 == 0 and an "
                              f"even rope dim, got {kv_lora_rank} + {rope_dim}")
        return kv_lora_rank + 4 * -(-kv_lora_rank // FP8_TILE) + 2 * rope_dim
    return (kv_lora_rank + rope_dim) * (4 if kind == "fp32" else 2)


def kv_rows_lossless(kv_cache_dtype: str, model_dtype: str) -> bool:
    """Whether KV rows stored as ``kv_cache_dtype`` ("auto", "fp32", "bf16", "fp8") read back as
    exactly the values a ``model_dtype`` ("float32", "bfloat16", torch's names) model computed:
    fp32 rows, or bf16 rows of a bf16 model. Only then does a decode step (attending over the
    stored rows) write bitwise the row a prefill of the same tokens (attending over its own
    unrounded rows) computes, so only then may a page a decode step wrote be reused as a prefix
    (``CoordinatorConfig.publish_decoded``)."""
    if kv_cache_dtype == "auto":
        return True
    return kv_cache_dtype == "fp32" or (kv_cache_dtype == "bf16" and model_dtype == "bfloat16")


def _int(key: str, value: Any, *, lo: int, allowed: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(key, value, f"must be an integer; {allowed}")
    if value < lo:
        raise ConfigError(key, value, allowed)
    return value


@dataclass(frozen=True, slots=True)
class HiSparseConfig:
    """Per-decode-replica HiSparse settings (the SGLang ``--hisparse-config`` keys + capacity).

    top_k: positions the indexer selects per layer and step (K).
    device_buffer_size: hot slots per request and layer (H); must be >= top_k.
    host_to_device_ratio: logical host pool size relative to the device pool (SGLang's sizing).
    swap_in_block_size: CUDA threads per resolver thread block.
    host_pool_gib: usable host-cache capacity per data-parallel replica (not a node budget),
        rounded down to whole host blocks by :meth:`KVLayout.host_blocks`.
    """

    top_k: int = 2048
    device_buffer_size: int = 4096
    host_to_device_ratio: int = 10
    swap_in_block_size: int = 960
    host_pool_gib: float = 4.0

    def __post_init__(self) -> None:
        _int("top_k", self.top_k, lo=1, allowed="must be >= 1")
        _int("device_buffer_size", self.device_buffer_size, lo=1, allowed="must be >= 1")
        if self.device_buffer_size < self.top_k:
            raise ConfigError(
                "device_buffer_size",
                self.device_buffer_size,
                f"must be >= top_k ({self.top_k}): every selected position needs a hot slot",
            )
        _int("host_to_device_ratio", self.host_to_device_ratio, lo=1, allowed="must be >= 1")
        block_rule = (
            f"must be a multiple of 32 in [{MIN_BLOCK_THREADS}, {MAX_BLOCK_THREADS}] "
            "(whole warps the resolver kernel can run correctly)"
        )
        b = _int("swap_in_block_size", self.swap_in_block_size, lo=MIN_BLOCK_THREADS, allowed=block_rule)
        if b > MAX_BLOCK_THREADS or b % 32:
            raise ConfigError("swap_in_block_size", b, block_rule)
        g = self.host_pool_gib
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not math.isfinite(g) or g <= 0:
            raise ConfigError("host_pool_gib", g, "must be a finite number > 0 (GiB per replica)")

    @classmethod
    def tiny(cls) -> "HiSparseConfig":
        """The embedded default for the tiny built-in model: top-k 8 of a 16-slot hot buffer and
        10 MiB of host cache, so that test prompts of a few hundred tokens are many times H."""
        return cls(top_k=8, device_buffer_size=16, host_to_device_ratio=4, swap_in_block_size=64,
                   host_pool_gib=0.01)

    @classmethod
    def from_dict(cls, data: dict[str, Any], base: "HiSparseConfig | None" = None
                  ) -> "HiSparseConfig":
        """The config ``data`` names; keys left out keep ``base``'s values (None: the class
        defaults, SGLang's production sizes). An unknown key raises ConfigError naming it."""
        if not isinstance(data, dict):
            raise ConfigError("hisparse-config", data, "must be a JSON object")
        known = {f.name for f in fields(cls)}
        for key in data:
            if key not in known:
                raise ConfigError(key, data[key], f"unknown key; allowed keys: {sorted(known)}")
        return cls(**{**(base.to_dict() if base is not None else {}), **data})

    @classmethod
    def from_json(cls, text: str, base: "HiSparseConfig | None" = None) -> "HiSparseConfig":
        """Parse SGLang's ``--hisparse-config`` JSON (``host_pool_gib`` may be added); keys left
        out keep ``base``'s values (None: the class defaults)."""
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, TypeError) as e:
            raise ConfigError("hisparse-config", text, f"must be valid JSON ({e})") from None
        return cls.from_dict(data, base)

    def check_model(self, index_topk: int, model: str = "the model") -> None:
        """ConfigError naming ``top_k`` unless this config fits a model whose indexer selects
        ``index_topk`` positions per layer and step: the resolver maps exactly that selection,
        so ``top_k`` must equal it (and ``device_buffer_size >= top_k`` then gives every
        selected position a hot slot). Checked wherever a config meets a model (``Engine``,
        ``HiSparseWorker``, ``ReplicaSpec``), so a mismatch never reaches a decode step."""
        if self.top_k != index_topk:
            hot = "" if self.device_buffer_size >= index_topk else (
                f"; device_buffer_size={self.device_buffer_size} must then be >= {index_topk}")
            raise ConfigError("top_k", self.top_k,
                              f"must equal {model}'s index_topk ({index_topk}): its indexer "
                              f"selects {index_topk} positions per layer and step, each needing "
                              f"a hot slot{hot}")

    @classmethod
    def load(cls, value: Any, base: "HiSparseConfig | None" = None) -> "HiSparseConfig":
        """A config from what a front door was given: a ``HiSparseConfig``, a dict, inline JSON or
        the path of a JSON file. Keys left out keep ``base``'s values (None: the class defaults);
        None or "" is ``base``. A path that is not there, a file that is not JSON and JSON that
        is not an object raise ConfigError (key ``config``) saying which."""
        base = cls() if base is None else base
        if isinstance(value, cls):
            return value
        if value is None or value == "":
            return base
        if isinstance(value, dict):
            return cls.from_dict(value, base)
        if not isinstance(value, str):
            raise ConfigError("config", value, "must be a HiSparseConfig, a dict, inline JSON or "
                                               "the path of a JSON file")
        text = value.strip()
        if text.startswith("{"):
            return cls.from_json(text, base)
        path = Path(text).expanduser()
        if path.is_file():
            try:
                data = json.loads(path.read_text())
            except (OSError, UnicodeDecodeError, ValueError) as e:
                raise ConfigError("config", value, f"the file is not readable JSON ({e})") from None
            return cls.from_dict(data, base)
        if path.exists():
            raise ConfigError("config", value, "is not a file: give a JSON file or inline JSON")
        try:
            data = json.loads(text)
        except ValueError:
            raise ConfigError("config", value, "no such file; give the path of a JSON file or "
                                               "inline JSON like '{\"top_k\": 8}'") from None
        return cls.from_dict(data, base)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @property
    def hot_slots(self) -> int:
        """Device rows per (request, layer): H hot slots + 1 reserved newest-token slot."""
        return self.device_buffer_size + 1


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of the MLA KV cache: one row per (token, layer), rows grouped into pages (host blocks).

    kv_dtype: "bf16" (1152 B rows) or "fp8" (656 B FlashMLA rows); ``row_bytes`` overrides it
        (for tiny test models whose latent is smaller).
    num_layers: sparse MLA layers whose KV HiSparse holds.
    page_size: tokens per page; one host block holds one page of every layer.
    """

    num_layers: int = 61
    kv_dtype: str = "bf16"
    page_size: int = 64
    row_bytes: int | None = None

    def __post_init__(self) -> None:
        _int("num_layers", self.num_layers, lo=1, allowed="must be >= 1")
        if not isinstance(self.kv_dtype, str) or self.kv_dtype not in KV_ROW_BYTES:
            raise ConfigError("kv_dtype", self.kv_dtype, f"must be one of {sorted(KV_ROW_BYTES)}")
        _int("page_size", self.page_size, lo=1, allowed="must be >= 1 (tokens per page)")
        if self.row_bytes is not None:
            _int("row_bytes", self.row_bytes, lo=1, allowed="must be >= 1 (bytes per token per layer)")

    @property
    def bytes_per_token_layer(self) -> int:
        return self.row_bytes if self.row_bytes is not None else KV_ROW_BYTES[self.kv_dtype]

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_token_layer * self.num_layers

    @property
    def page_bytes_per_layer(self) -> int:
        return self.bytes_per_token_layer * self.page_size

    @property
    def block_bytes(self) -> int:
        """Bytes of one host block: one page in every layer."""
        return self.page_bytes_per_layer * self.num_layers

    def host_blocks(self, host_pool_gib: float) -> int:
        """Whole host blocks that fit ``host_pool_gib`` (rounded down)."""
        return int(host_pool_gib * GIB) // self.block_bytes

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)


def _pos_int(key: str, value: object, lo: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ConfigError(key, value, f"must be an integer >= {lo}")
    return value


@dataclass(frozen=True, slots=True)
class CoordinatorConfig:
    """Pool sizes and shapes the coordinator schedules against.

    num_device_blocks: device pool blocks (``page_size`` rows per layer each); must hold at least
        one hot buffer.
    num_host_blocks: host pool blocks (``page_size`` rows per layer each).
    page_size: positions per page (host block and resident device block alike).
    device_buffer_size: H, hot slots per request; a host-tier request leases
        ``hot_blocks_per_request = ceil((H + 1) / page_size)`` device blocks.
    tp_size: TP ranks; every command is broadcast to them all and every transfer needs acks from
        every rank.
    max_batch: most requests in one decode step.
    page_bytes / row_bytes: bytes of one page / one position across all layers (for byte
        counters only; 0 disables byte counting).
    host_tier: False = full-resident under a device budget (the honest baseline): every request
        lands resident with device blocks for its whole life leased at admission (so a running
        request never stalls for a page), waits while they do not fit, and is never converted
        to the host tier.
    publish_decoded: whether a page holding a row a decode step wrote (positions from the
        prompt's last on) may be published for prefix reuse. Only where decode writes bitwise the
        row a prefill of the same tokens computes (the reference path with lossless KV rows,
        ``kv_rows_lossless``); the fast step does not (other kernels and batch shapes), nor does
        any path with fp8 rows (or bf16 rows of an fp32 model: decode attends over rounded rows,
        a prefill over its own), and a follow-up reusing such rows would decode from other KV
        than full-resident's fresh prefill. False: only prefill-written pages are reused.
    index_pages / index_page_tokens: a capped GPU index-key pool (the fast path's
        ``FastPathConfig.index_pages``; None: uncapped) of pages of ``index_page_tokens``
        positions. A request holds ``ceil((prompt + max_new) / index_page_tokens)`` of them from
        its landing to its release; admission waits while the requests holding pages leave too
        few for the next one (as it waits for blocks), so a landing never meets a full pool.
    """

    num_device_blocks: int
    num_host_blocks: int
    page_size: int
    device_buffer_size: int
    tp_size: int = 1
    max_batch: int = 256
    page_bytes: int = 0
    row_bytes: int = 0
    host_tier: bool = True
    publish_decoded: bool = True
    index_pages: int | None = None
    index_page_tokens: int = 64

    def __post_init__(self) -> None:
        for key in ("num_device_blocks", "num_host_blocks", "page_size", "device_buffer_size",
                    "tp_size", "max_batch"):
            _pos_int(key, getattr(self, key))
        _pos_int("page_bytes", self.page_bytes, lo=0)
        _pos_int("row_bytes", self.row_bytes, lo=0)
        _pos_int("index_page_tokens", self.index_page_tokens)
        if self.index_pages is not None:
            _pos_int("index_pages", self.index_pages)
        for key in ("host_tier", "publish_decoded"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(key, getattr(self, key), "must be True or False")
        if self.hot_blocks_per_request > self.num_device_blocks:
            raise ConfigError(
                "num_device_blocks", self.num_device_blocks,
                f"must hold one hot buffer ({self.hot_blocks_per_request} blocks for "
                f"device_buffer_size={self.device_buffer_size}, page_size={self.page_size})",
            )

    @property
    def hot_blocks_per_request(self) -> int:
        """Device blocks of one hot buffer: H hot slots + 1 reserved newest-token slot."""
        return hot_buffer_blocks(self.device_buffer_size, self.page_size)

    def pages_for(self, num_positions: int) -> int:
        return -(-num_positions // self.page_size)

    @classmethod
    def from_hisparse(cls, cfg: HiSparseConfig, layout: KVLayout, num_device_blocks: int,
                      tp_size: int = 1, max_batch: int = 256,
                      publish_decoded: bool = True) -> "CoordinatorConfig":
        """Host capacity is ``cfg.host_pool_gib`` rounded down to whole host blocks."""
        num_host = layout.host_blocks(cfg.host_pool_gib)
        if num_host < 1:
            raise ConfigError("host_pool_gib", cfg.host_pool_gib,
                              f"must hold at least one host block ({layout.block_bytes} B)")
        return cls(
            num_device_blocks=num_device_blocks, num_host_blocks=num_host,
            page_size=layout.page_size, device_buffer_size=cfg.device_buffer_size,
            tp_size=tp_size, max_batch=max_batch, page_bytes=layout.block_bytes,
            row_bytes=layout.bytes_per_token, publish_decoded=publish_decoded,
        )


def env_api_key() -> str:
    """The HTTP API key from ``HISPARSE_API_KEY`` ("" when unset): the serve front end's default."""
    return os.environ.get("HISPARSE_API_KEY", "")


def env_ray_address() -> str:
    """``RAY_ADDRESS`` ("" when unset): the cluster ``ray job submit`` runs an entrypoint on."""
    return os.environ.get("RAY_ADDRESS", "")


def env_flag(name: str, default: bool = False) -> bool:
    """Read a boolean environment switch (the only place the package reads the environment)."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    return raw.strip().lower() in ("1", "true", "yes", "on")


def env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """Read an environment switch that takes one of ``choices`` (``ConfigError`` names a bad
    value)."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    value = raw.strip().lower()
    if value not in choices:
        raise ConfigError(name, raw, f"must be one of {', '.join(choices)}")
    return value
