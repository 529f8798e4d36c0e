"""Full-resident reference decode for exactness checks (the demo's, the examples' and the tests'):
the same prompts through the in-process :class:`~hisparse_ray.engine.Engine` in full-resident mode
(every KV row on resident device pages, never spilled), greedy or seeded
sampling. HiSparse must produce identical tokens.

:func:`replica_baseline` runs the baseline a decode replica (:class:`~hisparse_ray.deploy.ReplicaSpec`)
is compared with: the same model, KV-cache dtype, page size and decode path (the fast step with
the replica's buckets, or the reference path); ``honest=True`` gives it the replica's device pool
bytes and no host tier (the capacity baseline: requests wait while their lives do not fit),
otherwise its pool grows to hold every request (the exactness baseline)."""

from __future__ import annotations

from typing import Any

import torch


def full_resident_tokens(model_spec, prompts: list[list[int]], max_new_tokens: int,
                         request_ids: list[str] | None = None, device: str = "cpu", *,
                         kv_cache_dtype: str = "auto", fast_path: Any = None,
                         device_pool_gib: float | None = None, page_size: int = 8,
                         hisparse: Any = None, batch_invariant: bool = True, sampling: Any = None
                         ) -> dict[str, list[int]]:
    """request id -> generated tokens of ``prompts`` through the full-resident engine (greedy,
    or every request sampled by ``sampling``, a ``SamplingParams``).
    ``fast_path``: a ``FastPathConfig`` (its buckets batch the requests; exact against a replica
    running the same buckets) or None (the reference path, each row its own forward);
    ``device_pool_gib``: the device budget (None: grown to fit everything); ``hisparse``: the
    ``HiSparseConfig`` (default: the engine's); ``batch_invariant``: the exact prefill (the
    prefill workers' default, ``PrefillSpec.batch_invariant``) and, on the reference path, each
    decode row its own forward."""
    from hisparse_ray.engine import Engine, EngineConfig

    ids = request_ids or [str(i) for i in range(len(prompts))]
    kw: dict[str, Any] = dict(full_resident=True, device=device, kv_cache_dtype=kv_cache_dtype,
                              device_pool_gib=device_pool_gib, page_size=page_size,
                              batch_invariant=batch_invariant)
    if hisparse is not None:
        kw["hisparse"] = hisparse
    if fast_path is not None:
        kw.update(fast_path=fast_path, max_batch=fast_path.max_batch)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: extra threads only contend with the actors' processes
    try:
        model = model_spec.build(device)
        with Engine(model, EngineConfig(**kw)) as eng:
            for rid, prompt in zip(ids, prompts):
                eng.add_request(rid, prompt, max_new_tokens, sampling=sampling)
            out = eng.run()
        return {rid: list(out[rid]) for rid in ids}
    finally:
        torch.set_num_threads(threads)


def replica_baseline(spec, prompts: list[list[int]], max_new_tokens: int,
                     request_ids: list[str] | None = None, *, honest: bool = False,
                     prefill: Any = None) -> dict[str, list[int]]:
    """:func:`full_resident_tokens` configured like the decode replica ``spec`` (TP 1: a TP
    replica is compared within the tolerance of its all-reduce order) and prefilling like
    ``prefill`` (a ``PrefillSpec``; None: the default, exact prefill). ``honest``: the same
    device pool bytes as the replica's ranks (``num_device_blocks`` blocks of its layout)."""
    budget = None
    if honest:
        budget = spec.num_device_blocks * spec.layout.block_bytes / (1 << 30)
    return full_resident_tokens(spec.model, prompts, max_new_tokens, request_ids, spec.device,
                                kv_cache_dtype=spec.kv_cache_dtype, fast_path=spec.fast_path,
                                device_pool_gib=budget, page_size=spec.page_size,
                                hisparse=spec.hisparse,
                                batch_invariant=True if prefill is None else prefill.batch_invariant)
