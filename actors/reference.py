"""Full-resident reference decode for exactness checks (ring 3 helper): the same prompts, the same
model code, every KV row kept on the device (``DenseKVCache``), greedy sampling, one request at a
time. HiSparse must produce identical tokens."""

from __future__ import annotations

import torch

from hisparse_ray.model.cache import DenseKVCache, IndexerKeyCache


def full_resident_tokens(model_spec, prompts: list[list[int]], max_new_tokens: int,
                         request_ids: list[str] | None = None, device: str = "cpu"
                         ) -> dict[str, list[int]]:
    """request id -> generated tokens. Sequence bookkeeping as the coordinator's: the prompt's
    positions ``0..P-2`` are prefilled; decode step 1 feeds ``prompt[P-1]`` at position ``P-1``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: extra threads only contend with the actors' processes
    try:
        return _run(model_spec.build(device), prompts, max_new_tokens,
                    request_ids or [str(i) for i in range(len(prompts))], device)
    finally:
        torch.set_num_threads(threads)


def _run(model, prompts, max_new_tokens, ids, device) -> dict[str, list[int]]:
    cfg = model.cfg
    out: dict[str, list[int]] = {}
    for rid, prompt in zip(ids, prompts):
        T = len(prompt) - 1
        cap = len(prompt) + max_new_tokens
        dense = DenseKVCache(cfg.num_hidden_layers, cfg.row_dim, 1, cap, dtype=model.dtype,
                             device=device)
        index = IndexerKeyCache(cfg.num_hidden_layers, cfg.index_head_dim, cap, dtype=model.dtype,
                                device=device)
        if T:
            _, rows, keys = model.prefill(torch.tensor(prompt[:T], dtype=torch.int64, device=device))
            dense.load(0, rows)
            index.keys[:, :T] = keys
            index.length = T
        tok, gen = prompt[-1], []
        for step in range(max_new_tokens):
            pos = torch.tensor([T + step], dtype=torch.int64, device=device)
            dense.begin_step(torch.zeros(1, dtype=torch.int64, device=device), pos)
            logits = model.decode(torch.tensor([tok], dtype=torch.int64, device=device), pos,
                                  dense, [index])
            tok = int(logits.argmax(dim=-1)[0])
            gen.append(tok)
        out[rid] = gen
    return out
