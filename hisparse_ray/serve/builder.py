"""Building the Serve application (ring 3, front door), as Ray Serve LLM does: a builder that
takes the options and returns the bound app, usable from Python, ``serve run`` and a
``serve deploy`` config (``examples/serve_config.yaml``).

    from ray import serve
    from hisparse_ray.serve import build_openai_app
    serve.run(build_openai_app({"tp": 2, "device_blocks": 12}))     # http://localhost:8000/v1

    # serve run hisparse_ray.serve:build_openai_app tp=2 device_blocks=12
    # hisparse-ray serve --tp 2 --device-blocks 12 [--address ray://...] [--api-key KEY]

Two deployments: ``OpenAIIngress`` (FastAPI, the HTTP door: cheap, no resources) and
``HiSparseServer`` (one HiSparse deployment per Serve replica: its prefill worker and decode
replica hold the CPUs / GPUs). ``deployment_config`` passes Serve options (autoscaling, ...)
through to ``HiSparseServer``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hisparse_ray.config import env_api_key
from hisparse_ray.deploy import DeployOptions

ENGINE = "HiSparseServer"  # the HiSparse deployment's name (Ray Data's processor names it)
INGRESS = "OpenAIIngress"
INGRESS_ONGOING = 4096  # requests one ingress replica holds at once (it only relays)


def options_of(options: DeployOptions | Mapping[str, Any] | None) -> DeployOptions:
    """``DeployOptions`` from options or a mapping of option names (strings parsed: ``serve run
    k=v``); the API key defaults to ``$HISPARSE_API_KEY``. ConfigError naming a bad option."""
    opts = options if isinstance(options, DeployOptions) else \
        DeployOptions.from_dict(options or {})
    if not opts.api_key and env_api_key():
        from dataclasses import replace

        opts = replace(opts, api_key=env_api_key())
    return opts


def build_engine_app(options: DeployOptions | Mapping[str, Any] | None = None):
    """The ``HiSparseServer`` deployment alone (no HTTP ingress): a handle-only application
    (``handle.generate`` / ``generate_stream`` / ``batch``; Ray Data's processor)."""
    from ray import serve

    from hisparse_ray.serve.server import HiSparseServer

    opts = options_of(options)
    replica_spec, prefill_spec = opts.specs()
    config: dict[str, Any] = {
        "num_replicas": opts.num_replicas, "max_ongoing_requests": opts.max_ongoing_requests,
        "max_queued_requests": opts.max_queued_requests,
        "ray_actor_options": {"num_cpus": 0},  # a router: the HiSparse actors hold resources
        "graceful_shutdown_timeout_s": 60, "graceful_shutdown_wait_loop_s": 0.5,
        "health_check_period_s": opts.health_check_period_s,
    }
    config.update(opts.deployment_config or {})
    if "autoscaling_config" in config:
        config.pop("num_replicas", None)
    dep = serve.deployment(HiSparseServer, name=ENGINE, **config)
    return dep.bind(replica_spec, prefill_spec, opts)


def build_openai_app(options: DeployOptions | Mapping[str, Any] | None = None):
    """The OpenAI-compatible Serve application: ``OpenAIIngress`` -> ``HiSparseServer``.
    ``options``: a ``DeployOptions`` or a mapping of its option names; an unknown name or a bad
    value raises ConfigError naming it, before anything starts."""
    from ray import serve

    from hisparse_ray.serve.openai_api import OpenAIIngress

    opts = options_of(options)
    engine = build_engine_app(opts)
    # the door never limits first: the HiSparse deployment's queue answers 429 (a stream holds
    # an ingress slot for its whole answer)
    ongoing = INGRESS_ONGOING
    ingress = serve.deployment(OpenAIIngress, name=INGRESS, max_ongoing_requests=ongoing,
                               ray_actor_options={"num_cpus": 0},
                               graceful_shutdown_wait_loop_s=0.5)
    return ingress.bind(engine, opts)
