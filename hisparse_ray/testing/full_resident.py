"""Full-resident reference decode for exactness checks (the demo's, the examples' and the tests'):
the same prompts through the in-process :class:`~hisparse_ray.engine.Engine` in full-resident mode
(every KV row on resident device pages, never spilled), greedy or seeded sampling. HiSparse must
produce identical tokens."""

from __future__ import annotations

import torch


def full_resident_tokens(model_spec, prompts: list[list[int]], max_new_tokens: int,
                         request_ids: list[str] | None = None, device: str = "cpu",
                         sampling=None) -> dict[str, list[int]]:
    """request id -> generated tokens of ``prompts`` through the full-resident engine (greedy,
    or every request sampled by ``sampling``, a ``SamplingParams``)."""
    from hisparse_ray.engine import Engine, EngineConfig

    ids = request_ids or [str(i) for i in range(len(prompts))]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: extra threads only contend with the actors' processes
    try:
        model = model_spec.build(device)
        with Engine(model, EngineConfig(full_resident=True, device=device)) as eng:
            for rid, prompt in zip(ids, prompts):
                eng.add_request(rid, prompt, max_new_tokens, sampling=sampling)
            out = eng.run()
        return {rid: list(out[rid]) for rid in ids}
    finally:
        torch.set_num_threads(threads)
