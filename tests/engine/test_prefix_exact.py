"""Issue #15 items 1-2: a request that reuses another request's KV pages decodes bit-exactly what
full-resident decode (which never reuses: every prompt gets its own fresh prefill) decodes: tokens
and every step's logits (``torch.equal``), on models with 1-2 index heads (exact ties of indexer
scores everywhere) and MoE layers, for the DeepSeek-V3.2 and the GLM kind. Pages reused through
the host tier, restored onto resident pages at a resident landing, reused while their donor still
decodes (including pages the donor's decode steps wrote, a multi-turn follow-up) and reused after
their donor was spilled to the host tier.

Each scenario is one script of ``add`` / ``step`` actions run through a HiSparse engine and a
full-resident engine; a follow-up prompt may be built from the donor's tokens at that moment (the
same in both, which the test checks too). Counters prove the reuse really happened. Before the
deterministic top-k (4210052^) and the batch-invariant prefill these scripts decoded different
tokens or logits (the MoE layers' expert batching alone changed logits by ~3e-6).
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from hisparse_ray.engine import Engine, EngineConfig
from hisparse_ray.model.config import tiny_config
from hisparse_ray.model.model import build_random_model
from hisparse_ray.types import LandingTarget, RequestState

PAGE = 8  # EngineConfig's default page size; hot buffer 16 slots (3 device blocks)
HEADS = {"deepseek_v32": 1, "glm_moe_dsa": 2}  # index heads: ties at the k-th place in most rows


@pytest.fixture(scope="module")
def models():
    return {k: build_random_model(tiny_config(k).with_(index_n_heads=h), seed=0) for k, h in HEADS.items()}


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


Prompt = list[int] | Callable[[Engine], list[int]]


def drive(model, cfg: EngineConfig, script: list[tuple]) -> dict:
    """Run ``script`` (``("add", rid, prompt, max_new)`` with ``prompt`` a list or a function of the
    engine, ``("step", n)``, ``("run",)``) -> tokens, logits per ``(rid, seq_len)``, prompts,
    landing targets and coordinator counters."""
    logits: dict = {}
    prompts: dict = {}
    with Engine(model, cfg) as eng:
        def grab(rows, out):
            for b, row in enumerate(rows):
                logits[(str(row.request_id), row.seq_len)] = out[b].detach().clone()
        eng.worker.on_logits = grab
        for action in script:
            if action[0] == "add":
                _, rid, prompt, max_new = action
                prompts[rid] = prompt(eng) if callable(prompt) else prompt
                eng.add_request(rid, prompts[rid], max_new)
            elif action[0] == "step":
                for _ in range(action[1]):
                    assert eng.step()
            else:
                eng.run()
        out = {r: eng.result(r) for r in prompts}
        for rid in prompts:
            assert eng.core.view(rid).state is RequestState.RELEASED
        targets = {r: eng.core.view(r).target for r in prompts}
        eng.core.check_invariants()
        return {"tokens": out, "logits": logits, "prompts": prompts, "targets": targets,
                "counters": eng.core.counters}


def assert_exact(hs: dict, base: dict) -> None:
    assert hs["prompts"] == base["prompts"]
    assert hs["tokens"] == base["tokens"]
    assert hs["logits"].keys() == base["logits"].keys()
    for key, got in hs["logits"].items():
        assert torch.equal(got, base["logits"][key]), f"logits differ at {key}"


def generated(rid: str, n: int) -> Callable[[Engine], list[int]]:
    """The tokens ``rid`` generated so far (at least ``n``), cut to ``n``."""
    def get(eng: Engine) -> list[int]:
        out = eng.result(rid)
        assert len(out) >= n, (rid, len(out), n)
        return out[:n]
    return get


def follow_up(rid: str, prompt: list[int], n_generated: int, tail: list[int]) -> Callable[[Engine], list[int]]:
    """A multi-turn follow-up: ``rid``'s prompt, its first ``n_generated`` tokens, then ``tail``."""
    return lambda eng: prompt + generated(rid, n_generated)(eng) + tail


def both(model, cfg: EngineConfig, script: list[tuple]) -> tuple[dict, dict]:
    return drive(model, cfg, script), drive(model, EngineConfig(full_resident=True), script)


@pytest.mark.parametrize("kind", list(HEADS))
def test_long_shared_prefix_through_the_host_tier(models, kind):
    """The issue's repro: 16 shared pages, the donor finished, both on the host tier."""
    a = tokens(160, 0)
    b = a[:128] + tokens(9, 1)
    hs, base = both(models[kind], EngineConfig(num_device_blocks=12),
                    [("add", "a", a, 6), ("run",), ("add", "b", b, 6), ("run",)])
    assert_exact(hs, base)
    assert hs["counters"].prefix_hit_pages == 128 // PAGE
    assert hs["targets"] == {"a": LandingTarget.HOST, "b": LandingTarget.HOST}
    assert base["counters"].prefix_hit_pages == 0  # the baseline prefilled b on its own


@pytest.mark.parametrize("kind", list(HEADS))
def test_multi_turn_follow_up_reuses_pages_the_donor_decode_wrote(models, kind):
    """While the donor decodes, a follow-up of its prompt + its first 12 tokens + 5 new arrives. The
    donor's 13 steps wrote positions 99..111, so the follow-up's 14 full prefix pages hold prefill
    rows (pages 0-11), both (page 12: 96..98 prefill, 99..103 decode) and decode rows only (page
    13); later a third request reuses 9 pages of the donor's prompt once more."""
    a = tokens(100, 2)
    script = [("add", "a", a, 24), ("step", 13),
              ("add", "b", follow_up("a", a, 12, tokens(5, 3)), 10), ("step", 4),
              ("add", "c", a[:72] + tokens(3, 4), 5), ("run",)]
    # synchronous steps (no lookahead): the page counts below follow their schedule
    hs, base = both(models[kind], EngineConfig(num_device_blocks=12, lookahead=False), script)
    assert_exact(hs, base)
    assert hs["counters"].prefix_hit_pages == 14 + 72 // PAGE
    assert all(t is LandingTarget.HOST for t in hs["targets"].values())


@pytest.mark.parametrize("kind", list(HEADS))
def test_reused_pages_restored_onto_a_resident_landing(models, kind):
    """The donor (20 pages) lands on the host tier; a 9-page request sharing 8 pages fits the device
    pool and lands resident: its 8 matched pages are restored from the donor's host blocks."""
    a = tokens(160, 5)
    b = a[:64] + tokens(7, 6)
    script = [("add", "a", a, 16), ("step", 3), ("add", "b", b, 12), ("run",)]
    hs, base = both(models[kind], EngineConfig(num_device_blocks=12), script)
    assert_exact(hs, base)
    assert hs["targets"] == {"a": LandingTarget.HOST, "b": LandingTarget.RESIDENT}
    c = hs["counters"]
    assert c.prefix_hit_pages == 8 and c.restores == 8


@pytest.mark.parametrize("kind", list(HEADS))
def test_pages_of_a_spilled_request_are_reused_exactly(models, kind):
    """Resident requests outgrow a 10-block pool and one is spilled to the host tier (its full pages
    published by the spill); follow-ups of every prompt then reuse what was published."""
    prompts = {f"r{i}": tokens(n, 10 + i) for i, n in enumerate((40, 30, 60))}
    script = [("add", rid, p, 24) for rid, p in prompts.items()] + [("run",)]
    script += [("add", f"f{rid}", p[:32] + tokens(4, 20), 4) for rid, p in prompts.items()] + [("run",)]
    hs, base = both(models[kind], EngineConfig(num_device_blocks=10), script)
    assert_exact(hs, base)
    c = hs["counters"]
    assert c.conversions_to_host >= 1 and c.spills >= 1
    assert c.prefix_hit_pages >= 32 // PAGE


@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(HEADS))
def test_cuda_prefix_reuse_equals_full_resident_bf16_gpu(kind):
    """bf16 on CUDA with the CUDA resolver: a multi-turn follow-up (20 pages, the last ones written
    by the donor's decode) and a resident landing restoring 8 of the donor's pages stay bit-exact."""
    from hisparse_ray.config import HiSparseConfig

    model = build_random_model(tiny_config(kind).with_(index_n_heads=HEADS[kind]), seed=0,
                               dtype=torch.bfloat16, device="cuda")
    hs = HiSparseConfig(top_k=8, device_buffer_size=16, host_to_device_ratio=4, swap_in_block_size=64,
                        host_pool_gib=0.01)
    common = dict(hisparse=hs, device="cuda", backend="cuda")
    a = tokens(150, 2)
    script = [("add", "a", a, 24), ("step", 13),
              ("add", "b", follow_up("a", a, 12, tokens(5, 3)), 10), ("step", 2),
              ("add", "c", a[:64] + tokens(7, 6), 8), ("run",)]
    got = drive(model, EngineConfig(num_device_blocks=16, **common), script)
    base = drive(model, EngineConfig(full_resident=True, **common), script)
    assert_exact(got, base)
    assert got["targets"]["c"] is LandingTarget.RESIDENT and got["counters"].restores == 8
    assert got["counters"].prefix_hit_pages == 20 + 8
