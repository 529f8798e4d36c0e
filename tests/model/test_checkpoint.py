"""Model folders in the released format (fp8 block-quantized, sharded, per-expert keys, an MTP
layer, a real tokenizer): they load and decode; their weights and tokens equal the same weights
dequantized and saved as bf16; they equal HF transformers on the dequantized weights; TP 2 sharded
loading gives exactly the shards of whole loading + ``shard_heads``."""

from __future__ import annotations

import json

import pytest
import torch

from hisparse_ray.engine import EngineConfig, generate
from hisparse_ray.model.checkpoint import Checkpoint
from hisparse_ray.model.model import build_random_model
from hisparse_ray.model.sharded_load import load_checkpoint
from hisparse_ray.model.source import resolve

from ._checkpoint import checkpoint_config, roundtrip_fp8, write_released
from ._hf import Session, hf_twin

FP32_TOL = 1e-5


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(fp8 folder, bf16 folder of the same weights dequantized) for both kinds."""
    out = {}
    for kind in ("deepseek_v32", "glm_moe_dsa"):
        model = build_random_model(checkpoint_config(kind), seed=7)
        fp8 = write_released(model, tmp_path_factory.mktemp(f"{kind}_fp8"))
        bf16 = write_released(roundtrip_fp8(model), tmp_path_factory.mktemp(f"{kind}_bf16"), fp8=False)
        out[kind] = (fp8, bf16)
    return out


def test_the_folder_is_in_the_released_format(folders):
    fp8, _ = folders["deepseek_v32"]
    ckpt = Checkpoint(fp8)
    index = json.loads((fp8 / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3  # sharded
    assert ckpt.fp8.block == (128, 128) and ckpt.fp8.ue8m0 and ckpt.num_mtp_layers == 1
    L = ckpt.config.num_hidden_layers
    assert f"model.layers.{L}.eh_proj.weight" in ckpt  # the MTP layer is in the files
    assert ckpt.info("model.layers.1.mlp.experts.3.up_proj.weight").dtype == torch.float8_e4m3fn
    assert ckpt.info("model.layers.1.mlp.experts.3.up_proj.weight_scale_inv").shape == (1, 2)
    assert ckpt.info("model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv").shape == (2, 2)
    assert ckpt.info("model.embed_tokens.weight").dtype == torch.bfloat16


@pytest.mark.parametrize("kind", ["deepseek_v32", "glm_moe_dsa"])
def test_fp8_folder_equals_its_bf16_dequantization_bitwise(folders, kind):
    fp8, bf16 = folders[kind]
    a = load_checkpoint(fp8, dtype=torch.float32)
    b = load_checkpoint(bf16, dtype=torch.float32)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    prompts = [[(7 * i) % 300 for i in range(150)], list(range(3, 60))]
    cfg = EngineConfig(num_device_blocks=12)  # both prompts land on the host tier
    tokens = generate(a, prompts, 12, cfg)
    assert tokens == generate(b, prompts, 12, cfg)
    assert tokens == generate(a, prompts, 12, EngineConfig(full_resident=True))


@pytest.mark.parametrize("kind", ["deepseek_v32", "glm_moe_dsa"])
def test_folder_equals_hf_on_the_dequantized_weights(folders, kind):
    fp8, _ = folders[kind]
    model = resolve(fp8).load(dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 300, (n,), generator=gen) for n in (40, 23)]
    s = Session(model, hf_twin(model), prompts, capacity=64)
    ours, theirs = s.prefill()
    for o, t in zip(ours, theirs):
        torch.testing.assert_close(o, t, atol=FP32_TOL, rtol=0)
    tokens = torch.stack([o[-1].argmax() for o in ours])
    for _ in range(6):
        o, t = s.step(tokens)
        torch.testing.assert_close(o, t, atol=FP32_TOL, rtol=0)
        tokens = o.argmax(-1)
    # Both sides attend over HF's selection (Session replays it); our own top-k may differ from HF's
    # only where scores tie at the k-th place (relu zeroes), which HF breaks arbitrarily.
    assert s.selections > 0


@pytest.mark.parametrize("fp8", [True, False])
def test_tp2_sharded_loading_equals_whole_then_shard_heads(folders, fp8):
    folder = folders["deepseek_v32"][0 if fp8 else 1]
    for rank in range(2):
        whole = load_checkpoint(folder, dtype=torch.float32).shard_heads(rank, 2)
        part = load_checkpoint(folder, dtype=torch.float32, rank=rank, tp_size=2)
        assert part.model.layers[0].self_attn.heads == 2
        sw, sp = whole.state_dict(), part.state_dict()
        assert sw.keys() == sp.keys()
        for k in sw:
            assert sw[k].shape == sp[k].shape and torch.equal(sw[k], sp[k]), (rank, k)


def test_source_resolves_kinds_and_folders(folders):
    fp8, _ = folders["glm_moe_dsa"]
    src = resolve(fp8)
    assert src.is_folder and src.config == Checkpoint(fp8).config
    assert resolve("deepseek_v32").config.vocab_size == 96 and not resolve("deepseek_v32").is_folder
    tok = src.tokenizer()
    ids = tok.encode("hello 東京")
    assert ids[0] == tok.bos_token_id and tok.decode(ids) == "hello 東京"
    assert max(ids) < src.config.vocab_size


@pytest.mark.parametrize("tp", [1, 2])
def test_kept_fp8_weights_are_the_checkpoint_bytes_and_dequantize_to_the_loaded_ones(folders, tp):
    """fp8="torch" keeps weights fp8 as on the GPU (Fp8Linear, fp8 experts; the GEMM's torch twin
    multiplies): each rank's fp8 weights and scale slices dequantize bitwise to the weights the
    dequantizing loader gives that rank."""
    from hisparse_ray.model.fp8 import Fp8Linear, dequantize

    fp8, _ = folders["deepseek_v32"]
    for rank in range(tp):
        kept = load_checkpoint(fp8, dtype=torch.float32, rank=rank, tp_size=tp, fp8="torch")
        deq = dict(load_checkpoint(fp8, dtype=torch.float32, rank=rank, tp_size=tp).named_parameters())
        n_linear = n_experts = 0
        for name, mod in kept.named_modules():
            if isinstance(mod, Fp8Linear):
                assert mod.weight.dtype == torch.float8_e4m3fn and mod.fp8_backend == "torch"
                assert torch.equal(mod.dequantized(torch.float32), deq[f"{name}.weight"]), name
                n_linear += 1
            elif getattr(mod, "fp8_block", None):
                for w in ("gate_up_proj", "down_proj"):
                    got = dequantize(getattr(mod, w), getattr(mod, f"{w}_scale_inv"), dtype=torch.float32)
                    assert torch.equal(got, deq[f"{name}.{w}"]), (name, w)
                n_experts += 1
        L = kept.cfg.num_hidden_layers
        assert n_linear == 6 * L + 3 * L and n_experts == L - 1  # 4 attention + 2 indexer, 3 MLP
        assert not isinstance(kept.model.layers[0].self_attn.kv_b_proj, Fp8Linear)


def test_kept_fp8_model_decodes_exactly_and_each_gemm_is_within_fp8_rounding(folders):
    """The fp8 arithmetic (activations quantized per 128 values, e4m3: at most 2^-4 relative per
    value, ~2.5 % RMS) through HiSparse: HiSparse equals full-resident exactly, and every fp8
    linear's output is within 4 % (relative L2) of the dequantized weight's product. (End to end,
    this random model's sharp attention, top-8 selection and routing amplify that rounding.)"""
    from hisparse_ray.model.fp8 import Fp8Linear

    fp8, _ = folders["deepseek_v32"]
    kept = load_checkpoint(fp8, dtype=torch.float32, fp8="torch")
    errs = []

    def check(mod, inp, out):
        ref = torch.nn.functional.linear(inp[0], mod.dequantized(torch.float32))
        errs.append(float((out - ref).norm() / ref.norm()))

    for mod in kept.modules():
        if isinstance(mod, Fp8Linear):
            mod.register_forward_hook(check)
    prompts = [[(7 * i) % 300 for i in range(150)], list(range(3, 60))]
    tokens = generate(kept, prompts, 6, EngineConfig(num_device_blocks=12))
    assert tokens == generate(kept, prompts, 6, EngineConfig(full_resident=True))
    assert len(errs) > 100 and max(errs) < 0.04, max(errs)


@pytest.mark.parametrize("fp8", [False, True])
def test_one_shard_folder_with_an_mtp_layer_and_dims_off_the_128_grid(tmp_path, fp8):
    """The tiny model (hidden 64, MLA rows 48: every fp8 scale grid a ceil-div of partial blocks)
    written in ONE shard with its MTP layer: the MTP copy of layer L-1's fp32 islands
    (``weights_proj``, ``e_score_correction_bias``) aliased layer L-1's tensors, which safetensors
    refuses to save in one file (was a RuntimeError from write_checkpoint). Loaded, it is the
    model (fp8: the model's fp8 round trip) bitwise."""
    from hisparse_ray.model.config import tiny_config

    model = build_random_model(tiny_config("glm_moe_dsa"), seed=2)
    folder = write_released(model, tmp_path / "m", fp8=fp8, shard_bytes=1 << 30, tokenizer=False,
                            dtype=torch.float32)
    assert len(list(folder.glob("*.safetensors"))) == 1
    if fp8:
        assert Checkpoint(folder).info("model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv").shape == (1, 1)
        model = roundtrip_fp8(model)
    loaded = load_checkpoint(folder, dtype=torch.float32).state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(loaded[k], v), k


def test_auto_fp8_dequantizes_wherever_the_gemm_cannot_keep_the_weights():
    """``fp8="auto"`` (the default of every front door) on a GPU the fp8 GEMM supports, with an
    fp32 model or a checkpoint of non-128x128 blocks, dequantizes (was a ConfigError telling the
    user to pass 'dequantize'); an explicit "kernel" still refuses by name."""
    from hisparse_ray.errors import ConfigError
    from hisparse_ray.model.fp8 import Fp8Format
    from hisparse_ray.model.sharded_load import keeps_fp8

    std, odd = Fp8Format((128, 128), True), Fp8Format((64, 64))
    assert keeps_fp8(std, "auto", True, torch.bfloat16)
    for fmt, gemm, dtype in ((std, True, torch.float32), (odd, True, torch.bfloat16),
                             (std, False, torch.bfloat16), (None, True, torch.bfloat16)):
        assert not keeps_fp8(fmt, "auto", gemm, dtype)
        assert not keeps_fp8(fmt, "dequantize", gemm, dtype)
    assert keeps_fp8(std, "torch", False, torch.float32)
    for fmt, mode, gemm, dtype in ((std, "kernel", True, torch.float32), (std, "kernel", False, torch.bfloat16),
                                   (odd, "kernel", True, torch.bfloat16), (odd, "torch", False, torch.float32)):
        with pytest.raises(ConfigError) as ei:
            keeps_fp8(fmt, mode, gemm, dtype)
        assert ei.value.key == "fp8"


def test_kept_fp8_linears_with_attention_bias_run_in_bf16(tmp_path):
    """``attention_bias`` (q_a_proj, kv_a_proj_with_mqa, o_proj biases) on weights kept fp8: the
    biases were fp32 in a bf16 model, so q_a_proj's output became fp32 and the first decode step
    failed ('expected m1 and m2 to have the same dtype'). Now they keep the model dtype (and the
    checkpoint's values) and the bf16 model decodes."""
    cfg = checkpoint_config("deepseek_v32", layers=2).with_(attention_bias=True)
    folder = write_released(build_random_model(cfg, seed=9), tmp_path / "m", tokenizer=False)
    kept = load_checkpoint(folder, dtype=torch.bfloat16, fp8="torch")
    deq = load_checkpoint(folder, dtype=torch.bfloat16)
    biases = {n: p for n, p in kept.named_parameters() if n.endswith(("proj.bias", "mqa.bias"))}
    assert len(biases) == 3 * cfg.num_hidden_layers
    for n, p in biases.items():
        assert p.dtype == torch.bfloat16 and torch.equal(p, deq.get_parameter(n)), n
    prompt = [[(5 * i) % 300 for i in range(12)]]
    assert len(generate(kept, prompt, 3, EngineConfig(full_resident=True))[0]) == 3
