"""Prefill -> decode with HiSparse offload on a local Ray cluster, checked against full-resident
decode. Runs on CPU (tiny built-in model) in about a minute: ``python examples/prefill_decode_offload.py``;
on a running cluster: ``ray job submit --address http://HEAD:8265 -- python
examples/prefill_decode_offload.py`` (it attaches through ``RAY_ADDRESS``, which the job sets).

One prefill worker pushes each prompt's KV with NIXL into a decode replica (coordinator + 2 TP
ranks); long prompts land in the host pool and decode through a 16-slot hot buffer, short ones land
on resident device pages. The example ends in an equality check.
"""

import os
import random

import ray

from hisparse_ray.actors import launch
from hisparse_ray.deploy import PrefillSpec, ReplicaSpec
from hisparse_ray.testing.full_resident import full_resident_tokens


def main(max_new_tokens: int = 8) -> None:
    spec = ReplicaSpec(tp_size=2, num_device_blocks=12)  # 12 blocks of 8 rows: long prompts go to host
    rng = random.Random(0)
    prompts = {"long-a": [rng.randrange(1, 96) for _ in range(180)],
               "long-b": [rng.randrange(1, 96) for _ in range(140)],
               "short": [rng.randrange(1, 96) for _ in range(10)]}

    started = not ray.is_initialized()
    if started:  # attach to the cluster a job was submitted to, else start a local one
        ray.init(address=os.environ.get("RAY_ADDRESS") or "local", num_cpus=None if
                 os.environ.get("RAY_ADDRESS") else 4, include_dashboard=False, log_to_driver=False)
    print(f"Ray cluster {ray.get_runtime_context().gcs_address}")
    replica = launch.launch_deployment(spec, PrefillSpec())
    try:
        for rid, prompt in prompts.items():
            ray.get(replica.coordinator.submit.remote(rid, prompt, max_new_tokens))
        results = ray.get(replica.coordinator.wait.remote(list(prompts), 300))
    finally:
        replica.shutdown()
        if started:
            ray.shutdown()

    expected = full_resident_tokens(spec.model, list(prompts.values()), max_new_tokens, list(prompts))
    for r in results:
        print(f"{r['request_id']:>7}: {r['prompt_len']} prompt tokens -> {r['target']} landing, "
              f"tokens {r['tokens']}")
        assert r["tokens"] == expected[r["request_id"]], f"{r['request_id']} differs"
    print("OK: identical to full-resident decode")


if __name__ == "__main__":
    main()
