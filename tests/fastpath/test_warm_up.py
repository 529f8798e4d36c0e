"""``FastPathConfig.warm_up``: one step of inert padding rows per bucket before any request
(on CUDA it captures the graphs and compiles the kernels when the rank is built). On the CPU the
same steps run eagerly: afterwards every token and logit is bit-identical to a run without them,
through spills, restores and every bucket, fp32 and fp8 rows; the switch is validated."""

from __future__ import annotations

import pytest
import torch

from hisparse_ray.errors import ConfigError
from hisparse_ray.fastpath.config import FastPathConfig

from .test_engine_fast import MANY, H, assert_same, dense, fast_cfg, prompts_of, run  # noqa: F401


def _snapshot(eng):
    """What a padding row could reach: hot-buffer state (slot_pos / lru of every anchor layer),
    then every layer's device rows (the write sink is excluded by the caller)."""
    rt = eng.worker.runtime
    state = [t.clone() for a in sorted(rt.slot_pos) for t in (rt.slot_pos[a], rt.lru[a])]
    return state, [t.clone() for t in rt.device_kv]


@pytest.mark.parametrize("kv", ["fp32", "fp8"])
def test_results_after_warm_up_are_bit_identical(dense, kv):
    prompts = prompts_of([8 * H + 5, 40, 3, 9 * H, 21], dense.cfg.vocab_size, seed=5)
    cfg = fast_cfg(MANY, num_device_blocks=12, kv_cache_dtype=kv)
    cold = run(dense, prompts, [16, 9, 12, 5, 7], cfg)
    warmed = []

    def warm(eng):
        warmed.extend(eng.worker.fast.warm_up())

    hot = run(dense, prompts, [16, 9, 12, 5, 7], cfg, between=warm)
    assert [b for b, _ in warmed] == list(MANY.buckets) and all(t >= 0 for _, t in warmed)
    assert_same(hot, cold)
    assert hot[3]["spills"] > 0 and sorted(set(hot[4])) == sorted(set(cold[4]))


def test_warm_up_writes_only_the_sinks(dense):
    from hisparse_ray.engine import Engine

    with Engine(dense, fast_cfg(MANY, num_device_blocks=12)) as eng:
        for i, p in enumerate(prompts_of([8 * H + 5, 30], dense.cfg.vocab_size, seed=6)):
            eng.add_request(f"r{i}", p, 4)
        eng.step()  # requests with state on the device before the padding steps
        (state0, rows0), sink = _snapshot(eng), eng.worker.fast.step.inputs.sinks["write"]
        eng.worker.fast.warm_up()
        state1, rows1 = _snapshot(eng)
        assert all(torch.equal(a, b) for a, b in zip(state0, state1))
        for layer, (a, b) in enumerate(zip(rows0, rows1)):
            keep = torch.ones(a.shape[0], dtype=torch.bool)
            keep[sink] = False
            assert torch.equal(a[keep], b[keep]), layer
        eng.run()
        eng.core.check_invariants()


def test_switch_is_validated():
    assert FastPathConfig().warm_up == "auto"
    assert [FastPathConfig(warm_up=w).warms_up(d) for w in ("auto", True, False)
            for d in ("cuda", "cpu")] == [True, False, True, True, False, False]
    for bad in ("yes", "on", 1, None):
        with pytest.raises(ConfigError, match="warm_up"):
            FastPathConfig(warm_up=bad)
