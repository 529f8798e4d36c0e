"""General-case sweep 3 (CPU): random engine configurations and request scripts, each run in four
modes (full-resident / HiSparse x lookahead off / on) and compared token for token and logit for
logit. Usage: python benchmarks/sweep3.py [first_seed] [count] [--only-fast|--only-ref]

A case: a tiny DSA model (either kind, 1-4 layers, dense / MoE, 1-16 index heads, fp32 or bf16
weights), top-k 1-8 with a hot buffer at its minimum or a little above, page sizes 1-16, KV rows
auto / fp32 / bf16 / fp8, the reference path or the fast path (one bucket or several), device
pools from one hot buffer to roomy, host pools tight or roomy, and 1-7 requests: prompt lengths
around page and hot-buffer boundaries, shared prefixes with earlier requests, follow-ups built
from a finished request's answer, arrivals at different steps, max_new_tokens 1, eos picked from
a first run's tokens, seeded sampling (temperature, top-k, top-p).
"""

from __future__ import annotations

import random
import sys
import time
import traceback

import torch

from hisparse_ray.config import GIB, HiSparseConfig, hot_buffer_blocks
from hisparse_ray.engine import Engine, EngineConfig
from hisparse_ray.errors import CapacityError
from hisparse_ray.fastpath.config import FastPathConfig
from hisparse_ray.model.config import tiny_config
from hisparse_ray.model.model import build_random_model
from hisparse_ray.types import RequestState, SamplingParams

FAST = False
DONE = (RequestState.FINISHED, RequestState.RELEASED)


def make_case(seed, only=None):
    r = random.Random(seed)
    kind = r.choice(["deepseek_v32", "glm_moe_dsa"])
    L = r.choice([1, 2, 3, 4])
    topk = r.choice([1, 2, 3, 4, 8])
    indexers = (("full",) + tuple(r.choice(["full", "shared"]) for _ in range(L - 1))
                if kind == "glm_moe_dsa" else ("full",) * L)
    mcfg = tiny_config(kind, yarn=r.random() < 0.5).with_(
        index_topk=topk, index_n_heads=r.choice([1, 2, 16]), num_hidden_layers=L,
        num_attention_heads=r.choice([1, 2, 4]),
        mlp_layer_types=tuple(r.choice(["dense", "sparse"]) for _ in range(L)),
        indexer_types=indexers)
    dtype = r.choice([torch.float32, torch.float32, torch.bfloat16])
    page = r.choice([1, 2, 3, 4, 5, 8, 16])
    hot = topk + r.choice([0, 0, 0, 1, 2, 7])
    kv = r.choice(["auto", "fp32", "bf16", "fp8"])
    path = only or r.choice(["ref", "fast"])
    max_batch = r.choice([1, 2, 3, 4])
    lookahead_modes = (False, True)
    # requests
    n_req = r.randint(1, 7)
    P, H = page, hot
    lens = [1, 2, P - 1, P, P + 1, 2 * P, 2 * P + 1, H - 1, H, H + 1, H + 2, 3 * P - 1,
            r.randint(1, 60), r.randint(30, 120)]
    reqs = []
    for i in range(n_req):
        spec = {"rid": f"r{i}", "max_new": r.choice([1, 1, 2, 3, 5, 8, 12]),
                "at": r.choice([0, 0, 0, 1, 2, 3, 5, 8]), "eos_at": None, "sampling": None,
                "after": None}
        kindr = r.random()
        if reqs and kindr < 0.25:  # shares a prefix with an earlier request (its prompt)
            j = r.randrange(len(reqs))
            spec["prefix_of"] = (j, r.choice([P, 2 * P, P - 1, P + 1, r.randint(1, 50)]))
            spec["len"] = r.randint(0, 2 * P + 2)
        elif reqs and kindr < 0.4:  # follow-up of a finished request: prompt + answer + extra
            j = r.randrange(len(reqs))
            spec["after"] = j
            spec["len"] = r.randint(1, P + 2)
        else:
            spec["len"] = max(1, r.choice(lens))
        if r.random() < 0.25:
            spec["eos_at"] = r.randint(0, spec["max_new"] - 1)
        if r.random() < 0.3:
            spec["sampling"] = SamplingParams(
                temperature=r.choice([0.5, 1.0, 1.5]), seed=r.randrange(1 << 20),
                top_k=r.choice([0, 0, 5]), top_p=r.choice([1.0, 1.0, 0.8]))
        reqs.append(spec)
    pool = r.choice(["min", "min+1", "few", "roomy"])
    host = r.choice(["tight", "roomy", "roomy"])
    fast = None
    bi = True
    if path == "fast":
        buckets = r.choice(["one", "one", "powers", "every"])
        buckets = {"one": (max_batch,), "powers": tuple(b for b in (1, 2, 4) if b < max_batch)
                   + (max_batch,), "every": tuple(range(1, max_batch + 1))}[buckets]
        fast = dict(max_context=256, buckets=buckets,
                    index_key_dtype=r.choice(["auto", "auto", "fp32"]))
        bi = r.random() < 0.7
    return dict(seed=seed, mcfg=mcfg, dtype=dtype, page=page, hot=hot, topk=topk, kv=kv,
                path=path, max_batch=max_batch, reqs=reqs, pool=pool, host=host, fast=fast,
                bi=bi, lookahead_modes=lookahead_modes)


def build_prompts(case, vocab):
    r = random.Random(case["seed"] * 31 + 7)
    prompts = {}
    for i, s in enumerate(case["reqs"]):
        if s["after"] is not None:
            prompts[i] = None  # built when the donor is done
            continue
        if "prefix_of" in s:
            j, n = s["prefix_of"]
            base = prompts[j] if prompts[j] is not None else [r.randrange(vocab) for _ in range(40)]
            p = base[:n] + [r.randrange(vocab) for _ in range(s["len"])]
            prompts[i] = p or [r.randrange(vocab)]
        else:
            prompts[i] = [r.randrange(vocab) for _ in range(s["len"])]
    return prompts


def engine_config(case, full, lookahead, hs):
    fast = None if case["fast"] is None else FastPathConfig(**case["fast"])
    page, hot = case["page"], case["hot"]
    hb = hot_buffer_blocks(hot, page)
    blocks = {"min": hb, "min+1": hb + 1, "few": 2 * hb + 3, "roomy": 200}[case["pool"]]
    return EngineConfig(hisparse=hs, page_size=page, num_device_blocks=blocks,
                        max_batch=case["max_batch"], full_resident=full,
                        batch_invariant=case["bi"], kv_cache_dtype=case["kv"], fast_path=fast,
                        lookahead=lookahead)


def hs_config(case, model):
    page, hot = case["page"], case["hot"]
    roomy = HiSparseConfig(top_k=case["topk"], device_buffer_size=hot, host_to_device_ratio=4,
                           swap_in_block_size=64, host_pool_gib=0.01)
    if case["host"] == "roomy":
        return roomy
    layout = EngineConfig(hisparse=roomy, page_size=page, kv_cache_dtype=case["kv"],
                          num_device_blocks=hot_buffer_blocks(hot, page)).layout(model.cfg,
                                                                                 model.dtype)
    # the longest single life + a bit
    longest = 200
    blocks = -(-longest // page) + 2
    return HiSparseConfig(top_k=case["topk"], device_buffer_size=hot, host_to_device_ratio=4,
                          swap_in_block_size=64,
                          host_pool_gib=(blocks + 0.5) * layout.block_bytes / GIB)


def drive(model, ecfg, case, prompts0, eos):
    """-> tokens, logits {(rid, seq_len): (input, logits)}, buckets, errors, counters"""
    prompts = dict(prompts0)
    logits, buckets, errors = {}, {}, {}
    reqs = case["reqs"]
    with Engine(model, ecfg) as eng:
        def grab(rows, out):
            b = ecfg.fast_path.bucket(len(rows)) if ecfg.fast_path is not None else len(rows)
            batch = (b,) + tuple((str(row.request_id), row.seq_len) for row in rows)
            for k, row in enumerate(rows):
                key = (str(row.request_id), row.seq_len)
                assert key not in logits, f"{key} ran twice"
                logits[key] = (row.input_token, out[k].detach().clone())
                buckets[key] = batch
        eng.worker.on_logits = grab
        added = set()
        step = 0

        def try_add():
            for i, s in enumerate(reqs):
                if i in added:
                    continue
                if s["after"] is not None:
                    d = reqs[s["after"]]["rid"]
                    if s["after"] not in added:
                        continue
                    if d in errors:
                        added.add(i)
                        errors[s["rid"]] = "donor refused"
                        continue
                    if eng.core.state(d) not in DONE or eng._inflight is not None:
                        continue
                    rr = random.Random(case["seed"] * 101 + i)
                    prompts[i] = (prompts[s["after"]] + eng.result(d)
                                  + [rr.randrange(model.cfg.vocab_size) for _ in range(s["len"])])
                elif s["at"] > step:
                    continue
                added.add(i)
                try:
                    eng.add_request(s["rid"], prompts[i], s["max_new"], sampling=s["sampling"],
                                    eos_token_id=eos.get(s["rid"]))
                except CapacityError as e:
                    errors[s["rid"]] = f"capacity: {e}"
        idle = 0
        while len(added) < len(reqs) or not eng.done:
            try_add()
            progressed = eng.step()
            eng.core.check_invariants()
            step += 1
            idle = 0 if progressed else idle + 1
            if idle > 12:
                raise RuntimeError(f"no progress at step {step}, added {sorted(added)}")
            if step > 3000:
                raise RuntimeError("too many steps")
        while eng.step():
            pass
        out = {s["rid"]: eng.result(s["rid"]) for i, s in enumerate(reqs)
               if s["rid"] not in errors}
        reasons = {r: eng.core.view(r).finish_reason for r in out}
        c = eng.core.counters
        assert (c.device_blocks_used, c.host_blocks_used) == (0, 0), c
        w = eng.worker
        assert not w.runtime.requests and not w.index and not w.samplers, "worker state left"
        if w.fast is not None:
            assert w.fast.keys.free_pages == w.fast.keys.num_pages, "index pages left"
    return dict(tokens=out, logits=logits, buckets=buckets, errors=errors, counters=c,
                reasons=reasons, prompts=prompts)


def compare(a, b, name, lookahead_pair=False):
    """-> list of problems (strings)."""
    probs = []
    if a["tokens"] != b["tokens"]:
        diff = {r: (a["tokens"].get(r), b["tokens"].get(r)) for r in
                set(a["tokens"]) | set(b["tokens"]) if a["tokens"].get(r) != b["tokens"].get(r)}
        probs.append(f"{name}: tokens differ {diff}")
    if set(a["errors"]) != set(b["errors"]):
        probs.append(f"{name}: errors differ {a['errors']} vs {b['errors']}")
    if a["reasons"] != b["reasons"]:
        probs.append(f"{name}: finish reasons differ {a['reasons']} vs {b['reasons']}")
    def needed(run):  # rows whose token is kept (a lookahead run may have one more per request)
        out = set()
        for (rid, sl) in run["logits"]:
            i = int(rid[1:])
            plen = len(run["prompts"][i])
            if rid in run["tokens"] and sl <= plen + len(run["tokens"][rid]) - 2:
                out.add((rid, sl))
        return out
    ka, kb = set(a["logits"]), set(b["logits"])
    if needed(a) != needed(b) or (not lookahead_pair and ka != kb and not name.endswith("la=True")):
        probs.append(f"{name}: logit rows differ {sorted(ka ^ kb)[:6]}")

    def history(run, k):
        rid, sl = k
        return tuple(v for (r, s2), v in sorted(run["buckets"].items()) if r == rid and s2 <= sl)
    worst, worst_bucket_same = 0.0, 0.0
    for k in ka & kb:
        ta, xa = a["logits"][k]
        tb, xb = b["logits"][k]
        if ta != tb:
            probs.append(f"{name}: input token differs at {k}")
            continue
        if not torch.equal(xa, xb):
            d = (xa.float() - xb.float()).abs().max().item()
            same_bucket = not FAST or history(a, k) == history(b, k)
            if same_bucket:
                worst_bucket_same = max(worst_bucket_same, d)
            else:
                worst = max(worst, d)
    if worst_bucket_same:
        probs.append(f"{name}: logits differ in the same batch, max {worst_bucket_same:.3g}")
    return probs, worst


def run_case(seed, only=None, verbose=False, **over):
    case = make_case(seed, only)
    case.update(over)
    model = build_random_model(case["mcfg"].with_(index_topk=case["topk"]), seed=seed % 97,
                               dtype=case["dtype"])
    prompts = build_prompts(case, model.cfg.vocab_size)
    hs = hs_config(case, model)
    # eos from a first full-resident run without eos
    eos = {}
    if any(s["eos_at"] is not None for s in case["reqs"]):
        first = drive(model, engine_config(case, True, False, hs), case, prompts, {})
        for s in case["reqs"]:
            t = first["tokens"].get(s["rid"])
            if s["eos_at"] is not None and t and s["eos_at"] < len(t):
                eos[s["rid"]] = t[s["eos_at"]]
    res = {}
    for full in (True, False):
        for la in case["lookahead_modes"]:
            res[(full, la)] = drive(model, engine_config(case, full, la, hs), case, prompts, eos)
    global FAST
    FAST = case["fast"] is not None
    probs = []
    if case["path"] == "ref":  # the honest baseline: a device budget, no host tier
        hc = engine_config(case, True, False, hs)
        layout = hc.layout(model.cfg, model.dtype)
        need = max(len(p or []) for p in res[(True, False)]["prompts"].values()) + 13
        gib = (-(-need // case["page"]) + hot_buffer_blocks(case["hot"], case["page"])) * 2 \
            * layout.block_bytes / GIB
        import dataclasses
        hon = drive(model, dataclasses.replace(hc, device_pool_gib=gib), case, prompts, eos)
        probs += compare(res[(True, False)], hon, "honest-vs-full")[0]
    multi = case["fast"] is not None and len(case["fast"]["buckets"]) > 1
    worst = 0.0
    for la in case["lookahead_modes"]:
        p, w = compare(res[(True, la)], res[(False, la)], f"hs-vs-full la={la}")
        probs += p
        worst = max(worst, w)
    for full in (True, False):
        p, w = compare(res[(full, False)], res[(full, True)], f"la-vs-not full={full}",
                       lookahead_pair=True)
        probs += p
        worst = max(worst, w)
        # every non-lookahead row ran with lookahead too
        missing = set(res[(full, False)]["logits"]) - set(res[(full, True)]["logits"])
        if missing:
            probs.append(f"full={full}: rows missing with lookahead {sorted(missing)[:5]}")
    hits = res[(False, False)]["counters"].prefix_hit_pages + \
        res[(False, True)]["counters"].prefix_hit_pages
    if not case["bi"] and hits and all("logits differ in the same batch" in p and "e-0" in p
                                       for p in probs):
        probs = [f"known (throughput prefill + prefix hit): {p}" for p in probs]
    if worst > 1e-4:
        probs.append(f"cross-schedule logits differ by {worst:.3g}")
    summary = dict(kind=case["mcfg"].kind, L=case["mcfg"].num_hidden_layers,
                   dtype=str(case["dtype"]),
                   page=case["page"], topk=case["topk"], hot=case["hot"], kv=case["kv"],
                   path=case["path"], fast=case["fast"], bi=case["bi"], mb=case["max_batch"],
                   pool=case["pool"], host=case["host"], n=len(case["reqs"]),
                   eos=len(eos), sampled=sum(s["sampling"] is not None for s in case["reqs"]),
                   spills=res[(False, False)]["counters"].spills,
                   prefix_hit=res[(False, False)]["counters"].prefix_hit_pages,
                   errors=len(res[(False, False)]["errors"]), xbucket=worst)
    return probs, summary


def main():
    first = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    only = "fast" if "--only-fast" in sys.argv else "ref" if "--only-ref" in sys.argv else None
    torch.set_num_threads(1)
    bad = 0
    for seed in range(first, first + count):
        t = time.time()
        try:
            probs, summary = run_case(seed, only)
        except Exception:
            probs = ["CRASH " + traceback.format_exc(limit=8)]
            summary = make_case(seed, only)["path"]
        dt = time.time() - t
        status = "OK " if not probs else "KNOWN" if probs[0].startswith("known") else "BAD"
        bad += bool(probs) and status == "BAD"
        print(f"{status} seed={seed} {dt:.1f}s {summary}", flush=True)
        for p in probs:
            print("    ", p[:3000], flush=True)
    print(f"done: {bad} bad of {count}")


if __name__ == "__main__":
    main()
