"""Offline batch inference with Ray Data through the HiSparse Serve deployment, checked against
full-resident decode. Runs on CPU (tiny built-in model): ``python examples/batch_ray_data.py``;
on a running cluster: ``ray job submit --address http://HEAD:8265 -- python
examples/batch_ray_data.py`` (it attaches through ``RAY_ADDRESS``).

Prompts (token ids) are read from Parquet, each row goes through Ray Data's Serve processor
(``ServeDeploymentProcessorConfig``) to ``HiSparseServer.batch`` (one dict in, one result out),
and the tokens with per-request stats (latency, time to first token, hot-buffer hit rate, landing
target) are written back to Parquet.
"""

import os
import random
import tempfile

import pyarrow as pa
import pyarrow.parquet as pq
import ray
from ray import serve
from ray.data.llm import ServeDeploymentProcessorConfig, build_processor

from hisparse_ray.deploy import DeployOptions
from hisparse_ray.serve import build_engine_app
from hisparse_ray.testing.full_resident import full_resident_tokens

APP = "hisparse-batch"
OPTIONS = {"tp": 2, "device_blocks": 12, "device": "cpu"}  # long prompts land on the host tier


def main(max_new_tokens: int = 6, out_dir: str | None = None) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 96) for _ in range(rng.choice([12, 90, 160]))] for _ in range(6)]
    work = tempfile.mkdtemp(prefix="hisparse-batch-")
    out_dir = out_dir or os.path.join(work, "out")
    pq.write_table(pa.table({"prompt_id": list(range(len(prompts))), "ids": prompts}),
                   os.path.join(work, "prompts.parquet"))

    started = not ray.is_initialized()
    if started:  # attach to the cluster a job was submitted to, else start a local one
        ray.init(address=os.environ.get("RAY_ADDRESS") or "local", num_cpus=4,
                 include_dashboard=False, log_to_driver=False)
    try:
        serve.start(proxy_location="Disabled")  # handles only (a no-op where Serve runs already)
        serve.run(build_engine_app(OPTIONS), name=APP, route_prefix=None)
        processor = build_processor(
            ServeDeploymentProcessorConfig(deployment_name="HiSparseServer", app_name=APP,
                                           batch_size=3, concurrency=1),
            preprocess=lambda row: {"method": "batch", "request_kwargs": {
                "ids": [int(t) for t in row["ids"]], "max_tokens": max_new_tokens,
                "temperature": 0.0}},
            postprocess=lambda row: {
                "prompt_id": row["prompt_id"], "tokens": row["tokens"],
                "finish_reason": row["finish_reason"], "latency_s": row["latency_s"],
                "ttft_s": row["ttft_s"], "hot_hit_rate": row["hot_hit_rate"] or 0.0,
                "landing_target": row["landing_target"]})
        processor(ray.data.read_parquet(os.path.join(work, "prompts.parquet"))) \
            .write_parquet(out_dir)
    finally:
        serve.delete(APP)
        if started:
            ray.shutdown()

    rows = pq.read_table(out_dir).to_pylist()
    model = DeployOptions.from_dict(OPTIONS).host_specs()[0].model
    expected = full_resident_tokens(model, prompts, max_new_tokens)
    for r in sorted(rows, key=lambda r: r["prompt_id"]):
        print(f"prompt {r['prompt_id']}: {len(prompts[r['prompt_id']])} tokens -> "
              f"{r['landing_target']} landing, {list(r['tokens'])}, latency {r['latency_s']:.2f}s, "
              f"hit rate {r['hot_hit_rate']:.0%}")
        assert list(r["tokens"]) == expected[str(r["prompt_id"])], f"prompt {r['prompt_id']}"
    assert len(rows) == len(prompts)
    print(f"OK: {len(rows)} rows written to {out_dir}, identical to full-resident decode")


if __name__ == "__main__":
    main()
