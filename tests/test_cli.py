"""The ``hisparse-ray`` command line without starting Ray: arguments, errors in one line, Serve
options checked before anything starts (the options themselves: tests/test_deploy.py)."""

from __future__ import annotations

import json

import pytest

from hisparse_ray import cli
from hisparse_ray.config import HiSparseConfig
from hisparse_ray.errors import ConfigError


def test_parser_demo_defaults_and_generate_arguments():
    p = cli.build_parser()
    a = p.parse_args(["demo"])
    assert (cli.options(a).tp, a.requests, a.func) == (2, 4, cli._cmd_demo)
    g = p.parse_args(["generate", "--prompt", "hello", "--ids", "1,2,3", "--tp", "1", "--json",
                      "--device", "cpu"])
    assert g.prompt == ["hello"] and g.ids == ["1,2,3"] and g.tp == "1" and g.json
    replica, prefill = cli.options(g).specs()
    assert replica.tp_size == 1 and replica.gpus_per_rank == 0 and prefill.gpus == 0


def test_main_reports_a_bad_config_in_one_line(capsys):
    bad = json.dumps({**HiSparseConfig.tiny().to_dict(), "top_k": 64})  # top_k > H
    assert cli.main(["generate", "--config", bad, "--ids", "1,2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hisparse-ray generate: invalid config") and "Traceback" not in err


def test_a_bad_flag_is_reported_in_one_line_naming_it(capsys):
    assert cli.main(["demo", "--tp", "two"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hisparse-ray demo: invalid config tp='two'") and "Traceback" not in err
    assert cli.main(["generate", "--gpus-per-rank", "2", "--ids", "1"]) == 2
    assert "gpus_per_rank=2.0" in capsys.readouterr().err


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
        build_app({"config": {**HiSparseConfig.tiny().to_dict(), "top_k": 64}})
    with pytest.raises(ConfigError, match="decode_resources"):
        build_app({"decode_resources": {"decode_node": 0}})
    app = build_app({"num_replicas": "2", "tp": 1, "device": "cpu"})  # `serve run k=v` strings
    assert app is not None
    bad = json.dumps({**HiSparseConfig.tiny().to_dict(), "top_k": 64})
    assert cli.main(["serve", "--config", bad]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hisparse-ray serve: invalid config") and "Traceback" not in err


def test_model_flag_takes_a_folder_and_a_bad_folder_is_one_line(tmp_path, capsys):
    from hisparse_ray.deploy import DeployOptions
    from hisparse_ray.model.model import build_random_model
    from tests.model._checkpoint import checkpoint_config, write_released

    folder = write_released(build_random_model(checkpoint_config(layers=2), seed=3), tmp_path / "m")
    opts = cli.options(cli.build_parser().parse_args(
        ["generate", "--model", str(folder), "--fp8", "dequantize", "--ids", "1,2", "--device", "cpu"]))
    replica, prefill = opts.specs()
    assert replica.model.kind == prefill.model.kind == str(folder.resolve())
    assert replica.model.fp8 == "dequantize" and replica.layout.num_layers == 2
    served = DeployOptions.from_dict({"model": str(folder), "fp8": "dequantize", "device": "cpu"})
    assert served.specs()[0].model == replica.model  # the Serve options take the same folder
    (folder / "model.safetensors.index.json").write_text('{"weight_map": {"lm_head.weight": "gone.safetensors"}}')
    assert cli.main(["generate", "--model", str(folder), "--ids", "1,2", "--device", "cpu"]) == 2
    err = capsys.readouterr().err  # (Ray's import may print a notice first)
    assert err.strip().splitlines()[-1].startswith(
        "hisparse-ray generate: checkpoint model.safetensors.index.json: lm_head.weight: its shard "
        "gone.safetensors is missing") and "Traceback" not in err
