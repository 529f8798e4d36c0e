"""General-case sweep 4 (``benchmarks/sweep4.py``): the actor system (real Ray + NIXL on CPU,
prefill workers landing prompts while other requests decode) equals the full-resident engine on
random replicas and request scripts, and every block comes back. 130 random cases
(2026-12-05; 20 on the fast step) found no difference, hang or leak; bf16 weights at TP 2 are
not compared (their tokens differ from TP 1's: the all-reduce order, docs/architecture.md "TP
layouts").

Three of its configurations, each a script of submits (some while earlier requests decode, so
landings overlap steps), waits for a number of tokens, aborts (while landing and mid-decode),
follow-ups built from a finished or aborted answer, ``max_new_tokens`` 1 and eos:

* TP 2, lookahead, fp8 KV rows (decoded pages not published), a device pool of one hot buffer
  plus one block (spills, restores, backups), two prefill workers, staging of 4 blocks (landings
  of many chunks);
* TP 2 without lookahead, bf16 KV rows of an fp32 model (lossy: a follow-up of a decoded answer
  prefills it), a burst of short landings while a host-tier request decodes;
* TP 1, lookahead, fp32 rows (decoded pages published and reused by a follow-up), pages of 4.
"""

from __future__ import annotations

import random
import time

import pytest
import ray

from hisparse_ray.actors import launch
from hisparse_ray.config import HiSparseConfig, hot_buffer_blocks
from hisparse_ray.deploy import ModelSpec, PrefillSpec, ReplicaSpec
from hisparse_ray.testing.full_resident import replica_baseline
from hisparse_ray.testing.replica_waits import settled, wait_tokens

pytestmark = [pytest.mark.ray, pytest.mark.nixl, pytest.mark.slow]

TIMEOUT = 120.0


def _spec(name, *, tp, lookahead, kv, page, hot, extra_blocks, staging, max_batch, kind):
    hs = HiSparseConfig(top_k=8, device_buffer_size=hot, host_to_device_ratio=4,
                        swap_in_block_size=64, host_pool_gib=0.005)
    return ReplicaSpec(model=ModelSpec(kind=kind, seed=ord(name[-1])), hisparse=hs, tp_size=tp,
                       page_size=page, lookahead=lookahead, kv_cache_dtype=kv,
                       num_device_blocks=hot_buffer_blocks(hot, page) + extra_blocks,
                       staging_blocks=staging, max_batch=max_batch, replica_id=name)


def _p(rng, n):
    return [rng.randrange(1, 96) for _ in range(n)]


def _cases():
    rng = random.Random(44)
    a = _spec("sw4-a", tp=2, lookahead=True, kv="fp8", page=8, hot=8, extra_blocks=1, staging=4,
              max_batch=3, kind="glm_moe_dsa")
    base = _p(rng, 120)
    script_a = [  # (op, rid, ...): see _run
        ("submit", "long", base, 14, None, 0), ("tokens", "long", 2),
        ("submit", "shared", base[:70] + _p(rng, 5), 10, None, 1),
        ("submit", "gone", _p(rng, 90), 12, None, 0), ("abort", "gone"),  # while it lands
        ("submit", "mid", _p(rng, 40), 16, None, 1), ("tokens", "mid", 3), ("abort", "mid"),
        ("submit", "one", _p(rng, 9), 1, None, 0), ("done", "long"),
        ("submit", "follow", ("long", _p(rng, 3)), 8, None, 1),
        ("submit", "after-abort", ("mid", [7]), 6, 3, 0),  # eos: the baseline's 4th token
    ]
    b = _spec("sw4-b", tp=2, lookahead=False, kv="bf16", page=4, hot=11, extra_blocks=2,
              staging=32, max_batch=4, kind="deepseek_v32")
    script_b = [("submit", "host", _p(rng, 150), 12, None, 0), ("tokens", "host", 1)]
    script_b += [("submit", f"b{i}", _p(rng, 1 + 3 * i), 3 + i, None, 0) for i in range(6)]
    script_b += [("abort", "b2"), ("done", "host"),
                 ("submit", "follow", ("host", _p(rng, 2)), 6, None, 0)]
    c = _spec("sw4-c", tp=1, lookahead=True, kv="fp32", page=4, hot=8, extra_blocks=0, staging=8,
              max_batch=2, kind="deepseek_v32")
    first = _p(rng, 60)
    script_c = [("submit", "solo", _p(rng, 70), 20, None, 0), ("tokens", "solo", 3),
                ("abort", "solo"), ("settled", "solo"),  # alone: every block back at once
                ("submit", "first", first, 12, 5, 0), ("tokens", "first", 2),
                ("submit", "second", first[:33] + _p(rng, 4), 9, None, 0),
                ("submit", "one", [5], 1, None, 0), ("done", "first"),
                ("submit", "follow", ("first", _p(rng, 6)), 10, None, 0),
                ("tokens", "follow", 2), ("abort", "second")]
    return {"tp2-lookahead-fp8": (a, 2, script_a), "tp2-bf16rows-burst": (b, 1, script_b),
            "tp1-lookahead-fp32-reuse": (c, 1, script_c)}


CASES = _cases()


def _run(spec, n_prefill, script):
    """Play ``script`` on a fresh replica: (prompts, max_new_tokens, eos by id, aborted answers,
    summaries, settled metrics, rank stats). "settled" waits until no block is in use; a
    follow-up's prompt is ("follow", donor, extra): the donor's prompt + its answer (waited
    for) + extra; an eos pick is the index of the baseline token used as the request's eos."""
    prompts, news, eos_of, aborted = {}, {}, {}, {}
    rep = launch.launch_replica(spec)
    try:
        for i in range(n_prefill):
            launch.connect(rep, launch.launch_prefill(PrefillSpec(
                model=spec.model, name=f"{spec.replica_id}-p{i}",
                kv_cache_dtype=spec.kv_cache_dtype)))
        co = rep.coordinator
        for item in script:
            op, rid = item[0], item[1]
            if op == "submit":
                _, _, prompt, max_new, eos_pick, pf = item
                if isinstance(prompt, tuple):
                    (donor,) = ray.get(co.wait.remote([prompt[0]], TIMEOUT), timeout=TIMEOUT + 5)
                    prompt = prompts[prompt[0]] + list(donor["tokens"]) + prompt[1]
                prompts[rid], news[rid] = prompt, max_new
                eos_of[rid] = None if eos_pick is None else \
                    replica_baseline(spec, [prompt], max_new, [rid])[rid][eos_pick]
                ray.get(co.submit.remote(rid, prompt, max_new, eos_of[rid], pf), timeout=30)
            elif op == "tokens":
                wait_tokens(co, rid, item[2], time.monotonic() + TIMEOUT)
            elif op == "abort":
                aborted[rid] = ray.get(co.abort.remote(rid), timeout=30)
            elif op == "settled":
                settled(co)
            else:
                ray.get(co.wait.remote([rid], TIMEOUT), timeout=TIMEOUT + 5)
        rows = {s["request_id"]: s
                for s in ray.get(co.wait.remote(list(prompts), TIMEOUT), timeout=TIMEOUT + 5)}
        metrics = settled(co)
        stats = ray.get([r.stats.remote() for r in rep.ranks], timeout=30)
    finally:
        rep.shutdown()
    return prompts, news, eos_of, aborted, rows, metrics, stats


@pytest.mark.parametrize("name", list(CASES))
def test_sweep4_configuration(ray_cluster, name):
    spec, n_prefill, script = CASES[name]
    prompts, news, eos_of, aborted, rows, m, stats = _run(spec, n_prefill, script)
    for rid, prompt in prompts.items():
        want = replica_baseline(spec, [prompt], news[rid], [rid])[rid]
        if eos_of[rid] is not None:
            want = want[:want.index(eos_of[rid]) + 1]
        got = list(rows[rid]["tokens"])
        assert rows[rid]["error"] is None, rows[rid]
        if rid in aborted:
            assert got == want[:len(got)], (rid, got, want)
        else:
            assert got == want, (rid, got, want)
    c = m["counters"]  # every block back, aborted requests' included; the staging pool whole
    assert m["staging_free_blocks"] == spec.staging_blocks, m
    assert all(s["error"] is None for s in stats), stats
    assert c["spills"] + c["backups"] > 0, c  # the host tier on the way
