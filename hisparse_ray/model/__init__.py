"""DeepSeek-V3.2-style sparse-attention (DSA) model in torch (ring 2).

Public API: :class:`DSAModel` (``prefill``, ``decode``, ``shard_heads``), :func:`build_tiny_model`,
:func:`tiny_config`, the cache interface :class:`AttentionKVCache` with :class:`DenseKVCache` and
:class:`IndexerKeyCache`, and loaders from HF weights (:mod:`hisparse_ray.model.loading`).
"""

from hisparse_ray.model.cache import AttentionKVCache, DenseKVCache, IndexerKeyCache
from hisparse_ray.model.config import DSAConfig, config_from_hf, hf_config_dict, tiny_config
from hisparse_ray.model.loading import from_hf_model, from_pretrained_dir, from_state_dict, save_pretrained_dir
from hisparse_ray.model.model import DSAModel, build_tiny_model

__all__ = [
    "AttentionKVCache",
    "DSAConfig",
    "DSAModel",
    "DenseKVCache",
    "IndexerKeyCache",
    "build_tiny_model",
    "config_from_hf",
    "from_hf_model",
    "from_pretrained_dir",
    "from_state_dict",
    "hf_config_dict",
    "save_pretrained_dir",
    "tiny_config",
]
