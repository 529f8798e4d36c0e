"""Prefix reuse against HF transformers 5.23.0 on tie-heavy models (1-2 index heads, MoE): the
HiSparse engine's logits at every step of requests that reuse other requests' pages (a multi-turn
follow-up reusing pages the donor's decode wrote, a resident landing restoring a donor's pages)
equal HF's within 1e-5, HF running each request from scratch (its own prefill, no reuse).

Ties: HF's indexer ends in ``torch.topk``, which breaks exact score ties (most rows here) its own
way; both choices are valid top-k sets but attend over different rows. So HF's indexer is forced to
our selection (our prefill's and each decode step's, through :class:`IndexerTap`); that our
selection is a valid top-k of HF's scores is checked where scores are visible:
``tests/model/test_indexer.py::test_prefill_topk_matches_hf_indexer`` (sets equal HF's up to
positions tied at the k-th score, with 1, 2 and 16 index heads). Everything else (MLA, rope,
norms, MoE, the KV rows the reused pages hold) is compared here.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from hisparse_ray.engine import Engine, EngineConfig
from hisparse_ray.model.config import tiny_config
from hisparse_ray.model.model import build_random_model
from hisparse_ray.types import LandingTarget
from tests.model._hf import IndexerTap, hf_twin

from .test_prefix_exact import HEADS, follow_up, tokens

FP32_TOL = 1e-5


def _to_hf(topk: torch.Tensor, query_pos: torch.Tensor) -> torch.Tensor:
    """Ours ``[S, K]`` (-1 padded) -> HF's indexer output ``[1, S, K]`` int32: a pad becomes the
    query's own position (always selected when pads exist), harmless in HF's scatter."""
    return torch.where(topk < 0, query_pos[:, None], topk).to(torch.int32)[None]


class ForcedHF:
    """HF twins that attend over our selections. Engine hooks: ``prefill_hook`` records each
    request's prefill selection, the worker's ``trace`` (``begin_step`` / ``hook``) each step's, and
    ``on_logits`` runs HF for every row of the step (its prefill first, when new) and keeps both
    logits."""

    def __init__(self, model, prompts: dict[str, list[int]]) -> None:
        self.model, self.prompts = model, prompts
        self.hf = hf_twin(model)
        self.tap = IndexerTap().install(self.hf)
        self.prefill_sel: dict[str, dict[int, torch.Tensor]] = {}
        self.step_sel: dict[tuple[str, int], dict[int, torch.Tensor]] = {}
        self.caches: dict[str, object] = {}
        self.pairs: list[tuple[str, int, torch.Tensor, torch.Tensor]] = []  # rid, seq_len, ours, HF
        self._row: tuple[str, int] | None = None

    def prefill_hook(self, rid: str, layer: int, topk: torch.Tensor) -> None:
        self.prefill_sel.setdefault(rid, {})[layer] = topk.clone()

    def begin_step(self, step: int, rows) -> None:
        assert len(rows) == 1  # batch-invariant: one row per forward
        self._row = (str(rows[0].request_id), rows[0].seq_len)

    def hook(self, layer: int, topk: torch.Tensor) -> None:
        self.step_sel.setdefault(self._row, {})[layer] = topk[0].clone()

    def _forward(self, ids: list[int], cache, selection: dict[int, torch.Tensor], first: int) -> torch.Tensor:
        pos = torch.arange(first, first + len(ids))
        for layer, topk in selection.items():
            self.tap.replace[layer] = _to_hf(topk.view(len(ids), -1), pos)
        with torch.no_grad():
            out = self.hf(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
        assert not self.tap.replace  # every forced selection was consumed
        return out.logits[0, -1].float()

    def on_logits(self, rows, logits: torch.Tensor) -> None:
        for b, row in enumerate(rows):
            rid = str(row.request_id)
            if rid not in self.caches:
                self.caches[rid] = transformers.DynamicCache(config=self.hf.config)
                prompt = self.prompts[rid]
                self._forward(prompt[: len(prompt) - 1], self.caches[rid], self.prefill_sel[rid], 0)
            ref = self._forward([row.input_token], self.caches[rid], self.step_sel[(rid, row.seq_len)],
                                row.seq_len - 1)
            self.pairs.append((rid, row.seq_len, logits[b].detach().float().clone(), ref))


@pytest.mark.parametrize("kind", list(HEADS))
def test_prefix_reuse_matches_hf_with_forced_ties(kind):
    model = build_random_model(tiny_config(kind).with_(index_n_heads=HEADS[kind]), seed=0)
    a = tokens(150, 2)
    prompts: dict[str, list[int]] = {"a": a, "c": a[:64] + tokens(7, 6)}
    twins = ForcedHF(model, prompts)
    b_prompt = follow_up("a", a, 12, tokens(5, 3))
    with Engine(model, EngineConfig(num_device_blocks=16)) as eng:
        eng.prefill_hook = twins.prefill_hook
        eng.worker.trace = twins
        eng.worker.on_logits = twins.on_logits
        eng.add_request("a", a, 20)
        for _ in range(13):
            eng.step()
        prompts["b"] = b_prompt(eng)
        eng.add_request("b", prompts["b"], 8)
        eng.step()
        eng.add_request("c", prompts["c"], 8)
        out = eng.run()
        counters = eng.core.counters
        targets = {r: eng.core.view(r).target for r in prompts}
    assert targets == {"a": LandingTarget.HOST, "b": LandingTarget.HOST, "c": LandingTarget.RESIDENT}
    assert counters.prefix_hit_pages == 20 + 8 and counters.restores == 8
    assert len(twins.pairs) == 20 + 8 + 8
    worst = 0.0
    for rid, seq_len, ours, ref in twins.pairs:
        torch.testing.assert_close(ours, ref, atol=FP32_TOL, rtol=0, msg=lambda m: f"{rid} @ {seq_len}: {m}")
        worst = max(worst, float((ours - ref).abs().max()))
        assert int(ref.argmax()) == out[rid][seq_len - len(prompts[rid])], (rid, seq_len)
    print(f"\n{kind}: reuse vs HF from scratch, {len(twins.pairs)} steps: max |logit diff| {worst:.2e}")
