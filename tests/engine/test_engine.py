"""The in-process engine: HiSparse decode equals full-resident decode bit-exactly on CPU (fp32),
with mixed lengths in one batch, spills forced by a small device pool, prefix reuse, seeded
sampling and GLM-style index sharing."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
import torch

from hisparse_ray.config import HiSparseConfig
from hisparse_ray.engine import Engine, EngineConfig
from hisparse_ray.errors import ConfigError
from hisparse_ray.model.model import build_tiny_model
from hisparse_ray.types import SamplingParams
from hisparse_ray.types import RequestState

H = 16  # EngineConfig's default device_buffer_size (top_k 8, page 8)


@pytest.fixture(scope="module")
def models():
    return {k: build_tiny_model(0, k) for k in ("deepseek_v32", "glm_moe_dsa")}


def prompts_of(lengths, vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def run(model, prompts, max_new, cfg, **kw):
    """Tokens per request and every step's logits per request (keyed by (request, seq_len))."""
    logits = {}
    with Engine(model, cfg) as eng:
        def grab(rows, out):
            for b, row in enumerate(rows):
                logits[(row.request_id, row.seq_len)] = out[b].detach().clone()
        eng.worker.on_logits = grab
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, max_new, **kw)
        tokens = eng.run()
        counters = eng.core.counters
        worker = dict(eng.worker.counters)
        for rid in tokens:
            assert eng.core.view(rid).state is RequestState.RELEASED
        eng.core.check_invariants()
    return tokens, logits, counters, worker


def assert_same(a, b):
    ta, la = a[0], a[1]
    tb, lb = b[0], b[1]
    assert ta == tb
    assert la.keys() == lb.keys()
    for k in la:
        assert torch.equal(la[k], lb[k]), k


@pytest.mark.parametrize("kind", ["deepseek_v32", "glm_moe_dsa"])
def test_long_context_batch_equals_full_resident(models, kind):
    """Contexts of 8x and more the hot buffer, several lengths in one batch, 64+ decode steps."""
    m = models[kind]
    prompts = prompts_of([8 * H + 5, 40, 3, 9 * H], m.cfg.vocab_size)
    base = run(m, prompts, 64, EngineConfig(full_resident=True))
    # A device pool too small for any of the long prefixes: they land on the host tier.
    hs = run(m, prompts, 64, EngineConfig(num_device_blocks=12))
    assert_same(hs, base)
    assert base[2].spills == 0 and base[2].conversions_to_host == 0
    assert base[3]["hot_hits"] == 0 and base[3]["hot_misses"] == 0  # all resident
    assert hs[3]["hot_misses"] > 0 and hs[3]["hot_hits"] > 0  # the hot buffer did real work
    assert hs[2].backups > 0
    assert all(len(t) == 64 for t in hs[0].values())


def test_spills_forced_by_small_pool_stay_exact(models):
    m = models["deepseek_v32"]
    prompts = prompts_of([40, 30, 60], m.cfg.vocab_size, seed=2)
    base = run(m, prompts, 30, EngineConfig(full_resident=True))
    hs = run(m, prompts, 30, EngineConfig(num_device_blocks=10))
    assert_same(hs, base)
    assert hs[2].conversions_to_host >= 1 and hs[2].spills >= 1
    assert hs[2].spill_bytes > 0
    assert hs[2].device_blocks_used == 0 and hs[2].host_blocks_used == 0  # everything released


def test_prefix_reuse_shares_host_blocks_and_stays_exact(models):
    m = models["deepseek_v32"]
    (shared,) = prompts_of([64], m.cfg.vocab_size, seed=3)
    tails = prompts_of([7, 12], m.cfg.vocab_size, seed=4)
    first, second = shared + tails[0], shared + tails[1]
    cfg = EngineConfig(num_device_blocks=4)  # host tier only (one hot buffer of 3 blocks fits)
    with Engine(m, cfg) as eng:
        eng.add_request("a", first, 5)
        out_a = eng.run()["a"]
        published = eng.core.counters.published_pages
        eng.add_request("b", second, 5)
        out_b = eng.run()["b"]
        c = eng.core.counters
    assert published >= 8
    assert c.prefix_hit_pages == 8  # 64 shared tokens = 8 full pages, reused, not copied again
    base = run(m, [first, second], 5, EngineConfig(full_resident=True))[0]
    assert [out_a, out_b] == [base["r0"], base["r1"]]


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, seed=7),
                                    SamplingParams(temperature=0.8, seed=3, top_k=20, top_p=0.9)])
def test_seeded_sampling_is_reproducible_across_modes(models, params):
    m = models["deepseek_v32"]
    prompts = prompts_of([8 * H, 20], m.cfg.vocab_size, seed=5)
    kw = dict(sampling=params)
    base = run(m, prompts, 20, EngineConfig(full_resident=True), **kw)
    hs = run(m, prompts, 20, EngineConfig(num_device_blocks=8), **kw)
    assert_same(hs, base)
    greedy = run(m, prompts, 20, EngineConfig(full_resident=True))[0]
    assert greedy != base[0]  # temperature 1 really sampled


def test_engine_rejects_bad_input(models):
    from hisparse_ray.errors import DuplicateRequestError, InvalidRequestError

    m = models["deepseek_v32"]
    with Engine(m, EngineConfig()) as eng:
        eng.add_request("x", [1, 2, 3], 2)
        with pytest.raises(DuplicateRequestError):
            eng.add_request("x", [1, 2, 3], 2)
        with pytest.raises(InvalidRequestError, match="max_new_tokens"):
            eng.add_request("y", [1], 0)
        with pytest.raises(InvalidRequestError, match=r"token 96 is not an id in \[0, 96\)"):
            eng.add_request("z", [1, 96], 2)
        for eos, msg in [(96, r"eos_token_id=96 is not an id in \[0, 96\)"), (-1, "eos_token_id=-1"),
                         (True, "eos_token_id=True must be an int"), (2.0, "eos_token_id=2.0")]:
            with pytest.raises(InvalidRequestError, match=msg):
                eng.add_request("e", [1, 2], 2, eos_token_id=eos)
        eng.add_request("n", [1, 2], 2, eos_token_id=np.int64(95))  # numpy ids are ids
        out = eng.run()
        assert out["x"] and len(out["x"]) == 2 and "e" not in out and len(out["n"]) <= 2


@pytest.mark.parametrize("top_k, hot", [(4, 6), (16, 16), (4, 16)])
def test_a_config_that_does_not_fit_the_model_is_refused_up_front(models, top_k, hot,
                                                                   private_shm):
    """Issue 15 item 4: top_k 4 with a 6-slot hot buffer on the tiny model (its indexer selects
    8 positions) was accepted by Engine and add_request and failed at the first decode step with
    KernelPreconditionError. Any top_k other than the model's index_topk is refused, by the
    engine and by the step executor alone."""
    from hisparse_ray.host.pool import HostPool
    from hisparse_ray.rank.executor import HiSparseWorker

    m = models["deepseek_v32"]
    hs = HiSparseConfig(top_k=top_k, device_buffer_size=hot, host_to_device_ratio=4,
                        swap_in_block_size=64, host_pool_gib=0.01)
    with pytest.raises(ConfigError) as ei:
        Engine(m, EngineConfig(hisparse=hs))
    assert ei.value.key == "top_k" and ei.value.value == top_k
    assert "index_topk (8)" in str(ei.value)
    assert ("device_buffer_size=6 must then be >= 8" in str(ei.value)) == (hot < 8)
    layout = EngineConfig().layout(m.cfg, m.dtype)
    with HostPool.create("fit", layout, 4, register_cuda=False, shm_dir=private_shm) as pool:
        with pytest.raises(ConfigError, match="top_k"):
            HiSparseWorker(m, hs, layout, 8, pool)
    assert os.listdir(private_shm) == []


def test_sampling_params_are_checked(models):
    with pytest.raises(ConfigError, match="temperature='0.7'"):
        SamplingParams(temperature="0.7")
    with Engine(models["deepseek_v32"], EngineConfig()) as eng:
        with pytest.raises(ConfigError, match="sampling"):
            eng.add_request("s", [1, 2], 2, sampling={"temperature": 1.0})


def test_the_engine_host_pool_has_no_name_in_dev_shm(models):
    """Issue 15 item 8, in process: the engine's private pool is unlinked at once (nothing
    attaches to it), so however the process ends, nothing stays in /dev/shm."""
    from hisparse_ray.host.segment import list_segments, mapped_segments

    def mine(names):
        return [n for n in names if n.startswith(f"hisparse-pool.engine{os.getpid()}-")]

    with Engine(models["deepseek_v32"], EngineConfig()) as eng:
        assert mine(mapped_segments()) == [eng.pool.name]  # mapped here ...
        assert mine(list_segments()) == []  # ... but without a name to leave behind
        eng.add_request("a", list(range(1, 41)), 3)
        assert len(eng.run()["a"]) == 3
    del eng  # its views keep the mapping until they go
    gc.collect()
    assert mine(mapped_segments()) == []


def test_a_failed_landing_releases_the_request_and_the_others_go_on(models):
    """A prefill that raises (here the prefill hook) fails that landing alone: the error reaches
    the caller, the request is released with every block it leased, the requests queued behind it
    still land, and all of them decode what they decode without it (was: it stayed LANDING with
    its leases, the waiting requests behind it were never landed)."""
    m = models["deepseek_v32"]
    prompts = prompts_of([60, 30, 45, 20], m.cfg.vocab_size, seed=8)

    def hook(rid, layer, topk):
        if rid == "r2":
            raise RuntimeError("prefill of r2 failed")

    with Engine(m, EngineConfig(num_device_blocks=4, max_batch=2)) as eng:
        eng.prefill_hook = hook
        eng.add_request("r0", prompts[0], 6)  # the others wait for its blocks
        for i in (1, 2, 3):
            eng.add_request(f"r{i}", prompts[i], 6)
        with pytest.raises(RuntimeError, match="prefill of r2"):
            eng.run()
        assert eng.core.view("r2").state is RequestState.RELEASED
        out = eng.run()
        eng.core.check_invariants()
        c = eng.core.counters
        assert (c.device_blocks_used, c.host_blocks_used, c.waiting, c.running) == (0, 0, 0, 0)
        assert "r2" not in eng.worker.samplers and "r2" not in eng.worker.index
    base = run(m, [prompts[i] for i in (0, 1, 3)], 6, EngineConfig(full_resident=True))[0]
    assert out == {"r0": base["r0"], "r1": base["r1"], "r2": [], "r3": base["r2"]}


def test_prompts_of_any_integer_type_are_taken_and_the_rest_refused_by_name(models):
    """numpy / 0-d torch integers are token ids like Python ints (tokenizers return arrays); None,
    floats and bools are refused with InvalidRequestError naming the value (was: TypeError for
    None, and 'np.int64(5) is not an id in [0, 96)' for a valid id)."""
    import numpy as np

    from hisparse_ray.errors import InvalidRequestError

    m = models["deepseek_v32"]
    ids = [5, 17, 3, 40]
    with Engine(m, EngineConfig()) as eng:
        eng.add_request("py", ids, 3)
        eng.add_request("np", np.array(ids), 3)
        eng.add_request("pt", torch.tensor(ids), 3)
        for rid, bad, match in (("a", None, "prompt must be a sequence of token ids, got NoneType"),
                                ("b", [1, 2.0], "token 2.0 is not an integer token id"),
                                ("c", [1, True], "token True is not an integer token id"),
                                ("d", np.array([1, 96]), r"token 96 is not an id in \[0, 96\)")):
            with pytest.raises(InvalidRequestError, match=match):
                eng.add_request(rid, bad, 3)
        out = eng.run()
    assert out["np"] == out["pt"] == out["py"] and len(out["py"]) == 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize("kw, key", [(dict(device="cuda"), "device"), (dict(device="cuda:3"), "device"),
                                     (dict(backend="cuda"), "backend")])
def test_cuda_options_on_a_machine_without_cuda_are_refused_by_name(models, kw, key):
    """Was: AssertionError 'Torch not compiled with CUDA enabled' deep in the worker (device), or
    KernelPreconditionError at the first decode step, after requests were admitted (backend)."""
    with pytest.raises(ConfigError) as ei:
        Engine(models["deepseek_v32"], EngineConfig(**kw))
    assert ei.value.key == key and ei.value.value == kw[key]


def test_a_text_prompt_is_refused_with_how_to_tokenize_it(models, tmp_path):
    """Was: "token 'h' is not an integer token id" (a str iterates to characters). A folder
    without tokenizer.json says it takes token ids when its tokenizer is asked for."""
    from hisparse_ray.errors import CheckpointError, InvalidRequestError
    from hisparse_ray.model.model import build_random_model
    from hisparse_ray.model.source import resolve
    from tests.model._checkpoint import write_released

    with Engine(models["deepseek_v32"], EngineConfig()) as eng:
        for text in ("hello world", b"hello"):
            with pytest.raises(InvalidRequestError, match="prompt is text .*tokenizer"):
                eng.add_request("t", text, 3)
    folder = write_released(build_random_model(models["deepseek_v32"].cfg, seed=1), tmp_path / "m",
                            tokenizer=False)
    with pytest.raises(CheckpointError, match="tokenizer.json: missing .*give token ids"):
        resolve(folder).tokenizer()
