"""hisparse-ray: HiSparse hierarchical KV offload for sparse-attention LLMs, as a Ray actor system."""

from hisparse_ray.config import HiSparseConfig, KVLayout
from hisparse_ray.errors import HiSparseError

__all__ = ["HiSparseConfig", "KVLayout", "HiSparseError"]
__version__ = "0.1.0"
