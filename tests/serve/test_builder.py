"""Building the OpenAI app: options are checked before anything starts, Serve's
``deployment_config`` reaches the HiSparse deployment, the API key defaults to
``$HISPARSE_API_KEY``, and ``examples/serve_config.yaml`` is a valid ``serve deploy`` config
whose args build."""

from __future__ import annotations

from pathlib import Path

import pytest

from hisparse_ray.config import HiSparseConfig
from hisparse_ray.errors import ConfigError

serve = pytest.importorskip("ray.serve")

CONFIG = Path(__file__).resolve().parents[2] / "examples" / "serve_config.yaml"


def _engine(app):
    return app._bound_deployment.init_args[0]._bound_deployment


def test_bad_options_are_refused_before_anything_starts():
    from hisparse_ray.serve import build_openai_app

    for options, key in [({"bogus": 1}, "bogus"), ({"num_replicas": 0}, "num_replicas=0"),
                         ({"max_new_tokens": 50, "max_new_tokens_limit": 10}, "max_new_tokens"),
                         ({"request_timeout_s": -1}, "request_timeout_s"),
                         ({"config": {**HiSparseConfig.tiny().to_dict(), "top_k": 64}}, "top_k"),
                         ({"max_queued_requests": 0}, "max_queued_requests"),
                         ({"deployment_config": {"route_prefix": "/x"}}, "route_prefix"),
                         ({"deployment_config": "{nope"}, "deployment_config")]:
        with pytest.raises(ConfigError, match=key):
            build_openai_app(options)


def test_deployment_config_reaches_the_hisparse_deployment(monkeypatch):
    from hisparse_ray.serve import build_openai_app

    monkeypatch.setenv("HISPARSE_API_KEY", "from-env")
    app = build_openai_app({"tp": 1, "device": "cpu", "max_queued_requests": "5",
                            "deployment_config": '{"autoscaling_config": {"min_replicas": 1, '
                            '"max_replicas": 3}, "graceful_shutdown_timeout_s": 7}'})
    engine = _engine(app)
    cfg = engine._deployment_config
    assert engine.name == "HiSparseServer" and app._bound_deployment.name == "OpenAIIngress"
    assert (cfg.autoscaling_config.max_replicas, cfg.graceful_shutdown_timeout_s,
            cfg.max_queued_requests) == (3, 7.0, 5)
    options = app._bound_deployment.init_args[1]
    assert options.api_key == "from-env" and "from-env" not in repr(options)


def test_the_serve_deploy_config_is_valid_and_builds():
    import yaml
    from ray.serve.schema import ServeDeploySchema

    from hisparse_ray.serve import build_openai_app

    cfg = yaml.safe_load(CONFIG.read_text())
    ServeDeploySchema(**cfg)
    (spec,) = cfg["applications"]
    assert spec["import_path"] == "hisparse_ray.serve:build_openai_app"
    assert _engine(build_openai_app(spec["args"]))._deployment_config.autoscaling_config


def test_the_ingress_of_a_gpu_deployment_starts_where_no_gpu_is_visible():
    """The ingress runs no rank: a ``device="gpu"`` deployment's ingress (placed on any node,
    num_cpus 0) reads the model, tokenizer and limits without looking for a GPU (it raised
    "needs a visible CUDA device" and the app never deployed)."""
    from hisparse_ray.deploy import DeployOptions
    from hisparse_ray.serve.openai_api import OpenAIServer

    opts = DeployOptions(device="gpu", max_prompt_tokens=300)
    with pytest.raises(ConfigError, match="needs a visible CUDA device"):
        opts.specs(gpus=0)  # placing ranks still needs one
    replica, prefill = opts.host_specs()
    assert replica.gpus_per_rank == 0.0 and prefill.max_prompt_tokens == 300
    door = OpenAIServer(None, opts)
    assert door.max_prompt_tokens == 300 and door.model_id
