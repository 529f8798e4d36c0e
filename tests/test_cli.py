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


def test_sglang_spellings_of_the_config_model_and_tp_flags_are_taken(tmp_path):
    """A launch line written from SGLang's HiSparse guide (``--hisparse-config``, ``--model-path``,
    ``--tp-size``) means what ours does, on every command that has the option."""
    p = cli.build_parser()
    cfg = '{"top_k": 8, "device_buffer_size": 24, "host_to_device_ratio": 10}'
    for cmd in ("generate", "serve", "demo"):
        a = p.parse_args([cmd, "--hisparse-config", cfg, "--model-path", "glm_moe_dsa",
                          "--tp-size", "1"])
        ours = p.parse_args([cmd, "--config", cfg, "--model", "glm_moe_dsa", "--tp", "1"])
        assert vars(a) == vars(ours)
        replica, _ = cli.options(a).specs()
        assert replica.tp_size == 1 and replica.hisparse.device_buffer_size == 24
    assert p.parse_args(["smoke", "--hisparse-config", cfg]).config == cfg


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
    """(build_openai_app's own checks: tests/serve/test_builder.py) The command prints one line,
    no traceback, before starting anything."""
    pytest.importorskip("ray.serve")
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


@pytest.mark.parametrize("config, option", [
    ('{"device_buffer_size": 100000}', "device_blocks=16: must hold one hot buffer"),
    ('{"top_k": 4, "device_buffer_size": 6}', "top_k=4: must equal the deepseek_v32 model's "
                                               "index_topk (8)"),
    ('{"top_k": 16, "device_buffer_size": 16}', "top_k=16"),
    ('{"host_pool_gib": 100000}', "host_pool_gib=100000: 1 host pool(s) of"),
])
def test_sizes_and_the_model_are_checked_before_ray_starts(capsys, config, option):
    """Issue 15 item 4: ``generate --config '{"device_buffer_size": 100000}'`` printed a 39-line
    traceback after 11 s, and a hot buffer smaller than the model's top-k failed mid-step. Each
    is one line naming the key, exit code 2, and Ray never started."""
    import ray

    started = ray.is_initialized()  # the session cluster of earlier tests, or none
    assert cli.main(["generate", "--config", config, "--ids", "1,2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hisparse-ray generate: invalid config ") and option in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert ray.is_initialized() == started  # refused before ``ray.init``


def test_bad_ids_and_a_tp_that_does_not_divide_the_heads_are_one_line(capsys):
    for argv, option in ((["--ids", "1,x"], "ids='1,x'"), (["--ids", "5,96"], "ids='5,96'"),
                         (["--tp", "3", "--ids", "1"], "tp=3: must divide")):
        assert cli.main(["generate", *argv]) == 2
        err = capsys.readouterr().err
        assert option in err and len(err.strip().splitlines()) == 1, err


def test_left_out_keys_take_the_built_in_defaults_and_the_pool_size_is_printed(capsys):
    """Issue 15 item 6: the README's ``--config '{"top_k": 8, "device_buffer_size": 16}'`` made a
    4 GiB /dev/shm pool (SGLang's production host_pool_gib for the keys left out). Now they
    take the built-in model's defaults (a 10 MiB pool), and the sizes are printed first."""
    args = cli.build_parser().parse_args(
        ["generate", "--config", '{"top_k": 8, "device_buffer_size": 16}', "--ids", "1"])
    opts, replica, _ = cli.deployment(args)
    assert opts.config == HiSparseConfig.tiny() and opts.config.host_pool_gib == 0.01
    out = capsys.readouterr().out
    assert out.startswith(f"host pool: {replica.num_host_blocks} blocks of 8 tokens = 10.")
    assert "MiB in /dev/shm (host_pool_gib=0.01); device pool: 16 blocks" in out
    assert cli.check_host_fits(replica) <= 0.011 * 2**30


def test_pool_summary_and_host_fit(tmp_path):
    from hisparse_ray.deploy import ReplicaSpec
    from hisparse_ray.host.segment import pool_bytes

    spec = ReplicaSpec(host_pool_dir=str(tmp_path))
    line = cli.pool_summary(spec)
    assert line.startswith(f"host pool: {spec.num_host_blocks} blocks of 8 tokens")
    assert str(tmp_path) in line and "top-k 8" in line
    one = pool_bytes(spec.layout, spec.num_host_blocks)
    assert cli.check_host_fits(spec) == one and cli.check_host_fits(spec, 3) == 3 * one
    with pytest.raises(ConfigError, match=r"host_pool_gib=0.01: 10000000 host pool\(s\) of"):
        cli.check_host_fits(spec, 10_000_000)


def test_a_missing_or_broken_config_file_says_which(capsys, tmp_path):
    assert cli.main(["generate", "--config", "nope.json", "--ids", "1"]) == 2
    err = capsys.readouterr().err
    assert "config='nope.json': no such file" in err and "JSON" in err
    bad = tmp_path / "bad.json"
    bad.write_text('{"top_k": 8,')
    assert cli.main(["demo", "--config", str(bad)]) == 2
    assert "the file is not readable JSON" in capsys.readouterr().err
    assert cli.main(["demo", "--config", str(tmp_path)]) == 2
    assert "is not a file" in capsys.readouterr().err
    good = tmp_path / "good.json"
    good.write_text('{"device_buffer_size": 32}')
    assert cli.options(cli.build_parser().parse_args(["demo", "--config", str(good)])).config \
        == HiSparseConfig(top_k=8, device_buffer_size=32, host_to_device_ratio=4,
                          swap_in_block_size=64, host_pool_gib=0.01)


def test_the_host_pool_directory_must_exist_on_this_node(capsys, tmp_path):
    missing = str(tmp_path / "nowhere")
    assert cli.main(["generate", "--host-pool-dir", missing, "--ids", "1"]) == 2
    assert f"host_pool_dir='{missing}': must be a directory" in capsys.readouterr().err
