"""The fast decode step (ring 2): a whole decode step as one batch over static device buffers,
paged GPU index keys, FlashMLA / DeepGEMM where they run, CUDA graphs per batch-size bucket.
Turned on per engine with :class:`~hisparse_ray.fastpath.config.FastPathConfig`; see
docs/architecture.md, "The fast decode path"."""

from hisparse_ray.fastpath.config import FastPathConfig

__all__ = ["FastPathConfig"]
