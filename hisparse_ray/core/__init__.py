"""Pure core (ring 1): host/device block pools, prefix index, coordinator state machine.

Imports only the standard library (and the pure wire/config/error modules); a test enforces it.
"""

from hisparse_ray.config import CoordinatorConfig
from hisparse_ray.core.coordinator import Coordinator
from hisparse_ray.core.device_blocks import (
    HOT_GROUP, RESIDENT_GROUP, SOURCE_GROUP, CacheGroup, DeviceBlockPool, device_pool_id,
)
from hisparse_ray.core.host_blocks import HostBlockPool
from hisparse_ray.core.prefix_index import PrefixIndex, chain_keys, page_key

__all__ = [
    "CoordinatorConfig", "Coordinator", "CacheGroup", "DeviceBlockPool", "HostBlockPool",
    "PrefixIndex", "chain_keys", "page_key", "device_pool_id",
    "SOURCE_GROUP", "RESIDENT_GROUP", "HOT_GROUP",
]
