"""The ``hisparse-ray`` command line without starting Ray: tokenizer, config loading, arguments."""

from __future__ import annotations

import json

import pytest

from hisparse_ray import cli
from hisparse_ray.config import HiSparseConfig
from hisparse_ray.errors import ConfigError


def test_byte_tokenizer_round_trips_printable_ascii_and_marks_the_rest():
    tok = cli.ByteTokenizer()
    assert tok.encode("Hi ~") == [ord("H") - 31, ord("i") - 31, 1, 95]
    assert tok.decode(tok.encode("sparse attention!")) == "sparse attention!"
    assert tok.encode("é\n") == [0, 0, 0]  # two UTF-8 bytes + newline: outside the vocabulary
    assert max(tok.encode("".join(map(chr, range(32, 127))))) < tok.vocab_size


def test_config_inline_file_and_default(tmp_path):
    inline = '{"top_k": 8, "device_buffer_size": 32, "host_to_device_ratio": 2, ' \
             '"swap_in_block_size": 64, "host_pool_gib": 0.5}'
    assert cli.load_config(inline).device_buffer_size == 32
    path = tmp_path / "hs.json"
    path.write_text(inline)
    assert cli.load_config(str(path)) == cli.load_config(inline)
    assert cli.load_config(None) == HiSparseConfig.from_dict(cli.DEMO_CONFIG)


def test_invalid_config_names_the_key():
    bad = json.dumps({**cli.DEMO_CONFIG, "swap_in_block_size": 48})
    with pytest.raises(ConfigError, match="swap_in_block_size"):
        cli.load_config(bad)
    with pytest.raises(ConfigError, match="hisparse-config"):
        cli.load_config("{not json")


def test_parser_demo_defaults_and_generate_arguments():
    p = cli.build_parser()
    a = p.parse_args(["demo"])
    assert (a.tp, a.requests, a.func) == (2, 4, cli._cmd_demo)
    g = p.parse_args(["generate", "--prompt", "hello", "--ids", "1,2,3", "--tp", "1", "--json",
                      "--device", "cpu"])
    assert g.prompt == ["hello"] and g.ids == ["1,2,3"] and g.tp == 1 and g.json
    replica, prefill = cli._specs(g, cli.load_config(None))
    assert replica.tp_size == 1 and replica.gpus_per_rank == 0 and prefill.gpus == 0


def test_main_reports_a_bad_config_in_one_line(capsys):
    bad = json.dumps({**cli.DEMO_CONFIG, "top_k": 64})  # top_k > device_buffer_size
    assert cli.main(["generate", "--config", bad, "--ids", "1,2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hisparse-ray generate: invalid config") and "Traceback" not in err


def test_gpus_per_rank_default_follows_the_gpu_count_and_bad_values_name_the_flag():
    assert cli.gpus_per_rank(None, 2, 0) == 0.0  # CPU
    assert cli.gpus_per_rank(None, 2, 1) == 0.5  # both ranks on the one GPU
    assert cli.gpus_per_rank(None, 2, 2) == 1.0  # a GPU per rank
    assert cli.gpus_per_rank(None, 2, 8) == 1.0
    assert cli.gpus_per_rank(0.5, 2, 2) == 0.5  # asked: share one GPU anyway
    assert cli.gpus_per_rank(0.8, 2, 2) == 0.8
    with pytest.raises(SystemExit, match="--gpus-per-rank 1.0 with --tp 2 needs 2 GPUs, 1 visible"):
        cli.gpus_per_rank(1.0, 2, 1)
    with pytest.raises(SystemExit, match="must be in"):
        cli.gpus_per_rank(0.0, 2, 2)
    assert cli.build_parser().parse_args(["demo", "--gpus-per-rank", "1"]).gpus_per_rank == 1.0


def test_tp_backend_is_nccl_only_when_no_two_ranks_can_share_a_gpu():
    from hisparse_ray.actors import tp

    assert [tp.default_backend(g) for g in (0.0, 0.25, 0.5, 0.51, 0.8, 1.0, 2.0)] == \
        ["gloo", "gloo", "gloo", "nccl", "nccl", "nccl", "nccl"]


def test_serve_options_are_checked_before_anything_starts(capsys):
    serve = pytest.importorskip("ray.serve")  # noqa: F841
    from hisparse_ray.serve import build_app

    with pytest.raises(ConfigError, match="bogus"):
        build_app({"bogus": 1})
    with pytest.raises(ConfigError, match="num_replicas=0"):
        build_app({"num_replicas": 0})
    with pytest.raises(ConfigError, match="max_new_tokens=50"):
        build_app({"max_new_tokens": 50, "max_new_tokens_limit": 10})
    with pytest.raises(ConfigError, match="request_timeout_s"):
        build_app({"request_timeout_s": -1})
    with pytest.raises(ConfigError, match="top_k"):
        build_app({"config": {**cli.DEMO_CONFIG, "top_k": 64}})
    with pytest.raises(ConfigError, match="decode_resources"):
        build_app({"decode_resources": {"decode_node": 0}})
    app = build_app({"num_replicas": "2", "tp": 1, "device": "cpu"})  # `serve run k=v` strings
    assert app is not None
    bad = json.dumps({**cli.DEMO_CONFIG, "top_k": 64})
    assert cli.main(["serve", "--config", bad]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hisparse-ray serve: invalid config") and "Traceback" not in err


def test_model_flag_takes_a_folder_and_a_bad_folder_is_one_line(tmp_path, capsys):
    from hisparse_ray.model.model import build_random_model
    from tests.model._checkpoint import checkpoint_config, write_released

    folder = write_released(build_random_model(checkpoint_config(layers=2), seed=3), tmp_path / "m")
    g = cli.build_parser().parse_args(["generate", "--model", str(folder), "--fp8", "dequantize",
                                       "--ids", "1,2", "--device", "cpu"])
    replica, prefill = cli._specs(g, cli.load_config(None))
    assert replica.model.kind == prefill.model.kind == str(folder.resolve())
    assert replica.model.fp8 == "dequantize" and replica.layout.num_layers == 2
    from hisparse_ray import serve  # the Serve options take the same folder

    replica, _ = serve._specs({**serve.DEFAULTS, "model": str(folder), "fp8": "dequantize", "device": "cpu"})
    assert replica.model.kind == str(folder.resolve()) and replica.model.fp8 == "dequantize"
    (folder / "model.safetensors.index.json").write_text('{"weight_map": {"lm_head.weight": "gone.safetensors"}}')
    assert cli.main(["generate", "--model", str(folder), "--ids", "1,2", "--device", "cpu"]) == 2
    err = capsys.readouterr().err  # (Ray's import may print a notice first)
    assert err.strip().splitlines()[-1].startswith(
        "hisparse-ray generate: checkpoint model.safetensors.index.json: lm_head.weight: its shard "
        "gone.safetensors is missing") and "Traceback" not in err
