"""CoordinatorConfig: the frozen sizing of one coordinator (pure ring: standard library only).

Derived from the user-facing :class:`~hisparse_ray.config.HiSparseConfig` and
:class:`~hisparse_ray.config.KVLayout` by :meth:`CoordinatorConfig.from_hisparse`.
"""

from __future__ import annotations

from dataclasses import dataclass

from hisparse_ray.config import HiSparseConfig, KVLayout
from hisparse_ray.errors import ConfigError


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
    tp_size: TP ranks; every command is emitted once per rank and every transfer needs acks from
        every rank.
    max_batch: most requests in one decode step.
    page_bytes / row_bytes: bytes of one page / one position across all layers (for byte
        counters only; 0 disables byte counting).
    host_tier: False = full-resident under a device budget (the honest baseline): every request
        lands resident with device blocks for its whole life leased at admission (so a running
        request never stalls for a page), waits while they do not fit, and is never converted
        to the host tier.
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

    def __post_init__(self) -> None:
        for key in ("num_device_blocks", "num_host_blocks", "page_size", "device_buffer_size",
                    "tp_size", "max_batch"):
            _pos_int(key, getattr(self, key))
        _pos_int("page_bytes", self.page_bytes, lo=0)
        _pos_int("row_bytes", self.row_bytes, lo=0)
        if self.hot_blocks_per_request > self.num_device_blocks:
            raise ConfigError(
                "num_device_blocks", self.num_device_blocks,
                f"must hold one hot buffer ({self.hot_blocks_per_request} blocks for "
                f"device_buffer_size={self.device_buffer_size}, page_size={self.page_size})",
            )

    @property
    def hot_blocks_per_request(self) -> int:
        """Device blocks of one hot buffer: H hot slots + 1 reserved newest-token slot."""
        return -(-(self.device_buffer_size + 1) // self.page_size)

    def pages_for(self, num_positions: int) -> int:
        return -(-num_positions // self.page_size)

    @classmethod
    def from_hisparse(cls, cfg: HiSparseConfig, layout: KVLayout, num_device_blocks: int,
                      tp_size: int = 1, max_batch: int = 256) -> "CoordinatorConfig":
        """Host capacity is ``cfg.host_pool_gib`` rounded down to whole host blocks."""
        num_host = layout.host_blocks(cfg.host_pool_gib)
        if num_host < 1:
            raise ConfigError("host_pool_gib", cfg.host_pool_gib,
                              f"must hold at least one host block ({layout.block_bytes} B)")
        return cls(
            num_device_blocks=num_device_blocks, num_host_blocks=num_host,
            page_size=layout.page_size, device_buffer_size=cfg.device_buffer_size,
            tp_size=tp_size, max_batch=max_batch, page_bytes=layout.block_bytes,
            row_bytes=layout.bytes_per_token,
        )
