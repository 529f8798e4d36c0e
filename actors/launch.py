"""The one place that makes actor classes remote (ring 3): every resource, placement and concurrency
option of the actor system lives here, and the start-up order of a deployment.

A decode replica (one ReplicaCoordinator + ``tp_size`` DecodeWorker ranks) is placed with a
STRICT_PACK placement group so its processes share ``/dev/shm`` (host pool, step channels) and
CUDA IPC; prefill workers may sit on any node. Start-up of a replica, in order:

1. placement group ready; ranks created (bundle i+1 = rank i; bundle 0 = the coordinator);
2. rank 0 picks the TP rendezvous (its node IP + a free port), every rank joins the group;
3. rank 0 creates the shared host pool, peers attach it, rank 0 unlinks its name (the mappings
   keep it; no exit path can leave it behind in ``host_pool_dir``);
4. every rank builds its model shard, runtime and NIXL agent (regions registered, then metadata);
5. the coordinator is created with the ranks' endpoints and opens one channel pair per rank;
6. prefill workers are connected: agent metadata exchanged through the coordinator.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray
from ray.actor import ActorHandle
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from hisparse_ray.deploy import PrefillSpec, ReplicaSpec

if TYPE_CHECKING:
    from hisparse_ray.actors.coordinator import ReplicaCoordinator
    from hisparse_ray.actors.decode_worker import DecodeWorker
    from hisparse_ray.actors.prefill_worker import PrefillWorker

# ReplicaCoordinator: method calls (submit, wait, metrics) run on a thread pool beside its step thread.
COORDINATOR_CPUS = 0.25
COORDINATOR_CONCURRENCY = 8
# DecodeWorker: lifecycle and landing calls beside the rank's step thread (each lander keeps up to
# two complete_landing calls waiting per rank, so room for a few landers plus stats calls).
DECODE_WORKER_CONCURRENCY = 8
# PrefillWorker: one prefill at a time, two pushes of a pipelined landing, metadata / stats calls.
PREFILL_CONCURRENCY = 4
PLACEMENT_TIMEOUT_S = 120.0



def _remote(cls: type, **options: Any):
    return ray.remote(**options)(cls)


def coordinator_options(spec: ReplicaSpec, pg: PlacementGroup | None,
                        name: str | None = None) -> dict[str, Any]:
    opts: dict[str, Any] = dict(num_cpus=COORDINATOR_CPUS, num_gpus=0,
                                max_concurrency=COORDINATOR_CONCURRENCY, max_restarts=0)
    if name is not None:  # a named actor (Serve: the CLI drains it by name before stopping)
        opts["name"] = name
    if pg is not None:
        opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=0)
    return opts


def decode_worker_options(spec: ReplicaSpec, rank: int, pg: PlacementGroup | None) -> dict[str, Any]:
    opts: dict[str, Any] = dict(num_cpus=spec.cpus_per_rank, num_gpus=spec.gpus_per_rank,
                                max_concurrency=DECODE_WORKER_CONCURRENCY, max_restarts=0)
    if pg is not None:
        opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=rank + 1)
    return opts


def prefill_options(spec: PrefillSpec, node_id: str | None = None,
                    resources: dict[str, float] | None = None) -> dict[str, Any]:
    opts: dict[str, Any] = dict(num_cpus=spec.cpus, num_gpus=spec.gpus,
                                max_concurrency=PREFILL_CONCURRENCY, max_restarts=0)
    if resources:
        opts["resources"] = dict(resources)
    if node_id is not None:
        opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    return opts


def replica_bundles(spec: ReplicaSpec, resources: dict[str, float] | None = None
                    ) -> list[dict[str, float]]:
    """Bundle 0: the coordinator; bundle 1 + r: rank r. ``resources`` (e.g. a custom node label
    resource) is added to bundle 0, which pins the whole STRICT_PACK group to a matching node."""
    coord = {"CPU": COORDINATOR_CPUS, **(resources or {})}
    ranks = []
    for _ in range(spec.tp_size):
        b = {"CPU": spec.cpus_per_rank}
        if spec.gpus_per_rank:
            b["GPU"] = spec.gpus_per_rank
        ranks.append({k: v for k, v in b.items() if v})
    return [coord] + [r or {"CPU": 0.01} for r in ranks]


def replica_placement_group(spec: ReplicaSpec, resources: dict[str, float] | None = None,
                            timeout_s: float = PLACEMENT_TIMEOUT_S) -> PlacementGroup:
    """A ready STRICT_PACK placement group for one decode replica (TimeoutError if it cannot be
    placed, e.g. no node has the GPUs, and then nothing is left reserved)."""
    # Placement group names are cluster-wide: several launching processes, on any node (Serve
    # replicas, jobs), may start replicas of one spec, so the name carries a random token.
    pg = placement_group(replica_bundles(spec, resources), strategy="STRICT_PACK",
                         name=f"hisparse-{spec.replica_id}-{secrets.token_hex(4)}")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise TimeoutError(f"placement group for replica {spec.replica_id!r} not ready after "
                           f"{timeout_s} s (bundles {replica_bundles(spec, resources)})")
    return pg


@dataclass
class Replica:
    """Handles of one running decode replica. ``coordinator`` is the entry point for requests."""

    spec: ReplicaSpec
    pg: PlacementGroup
    coordinator: ActorHandle[ReplicaCoordinator]
    ranks: list[ActorHandle[DecodeWorker]]
    prefill: list[ActorHandle[PrefillWorker]] = field(default_factory=list)

    def shutdown(self) -> None:
        """Stop the step loop, release pools and agents, kill the actors, free the placement."""
        try:
            ray.get(self.coordinator.shutdown.remote(), timeout=30)
        except Exception:
            pass
        try:
            ray.get([r.shutdown.remote() for r in self.ranks], timeout=30)
        except Exception:
            pass
        try:
            ray.get([p.shutdown.remote() for p in self.prefill], timeout=30)
        except Exception:
            pass
        for a in [self.coordinator, *self.ranks, *self.prefill]:
            ray.kill(a, no_restart=True)
        remove_placement_group(self.pg)


def start_ranks(spec: ReplicaSpec, pg: PlacementGroup | None, *, build: bool = True
                ) -> list[ActorHandle[DecodeWorker]]:
    """Steps 1-4: create the ranks, form the TP group, share the host pool, build every rank
    (``build=False`` stops after the host pool). Returns the rank handles (each rank's
    ``endpoint()`` describes it once built)."""
    from hisparse_ray.actors.decode_worker import DecodeWorker

    cls = DecodeWorker
    ranks = [_remote(cls, **decode_worker_options(spec, r, pg)).remote(spec, r)
             for r in range(spec.tp_size)]
    try:
        rdv = ray.get(ranks[0].rendezvous.remote())
        ray.get([r.join_tp.remote(rdv) for r in ranks])
        pool_name = ray.get(ranks[0].create_host_pool.remote())
        ray.get([r.attach_host_pool.remote(pool_name) for r in ranks[1:]])
        ray.get(ranks[0].unlink_host_pool.remote())  # every rank mapped it: the name may go
        if build:
            ray.get([r.build.remote() for r in ranks])
    except BaseException:
        _kill(ranks)
        raise
    return ranks


def _kill(actors: list[ActorHandle]) -> None:
    """Best-effort teardown of half-started actors (shutdown releases pools and segments)."""
    try:
        ray.get([a.shutdown.remote() for a in actors], timeout=30)
    except Exception:
        pass
    for a in actors:
        ray.kill(a, no_restart=True)


def launch_replica(spec: ReplicaSpec, resources: dict[str, float] | None = None,
                   coordinator_name: str | None = None) -> Replica:
    """Start one decode replica (steps 1-5). ``resources`` pins it to nodes offering them;
    ``coordinator_name`` names its coordinator actor."""
    from hisparse_ray.actors.coordinator import ReplicaCoordinator

    pg = replica_placement_group(spec, resources)
    try:
        ranks = start_ranks(spec, pg)
    except BaseException:
        remove_placement_group(pg)
        raise
    try:
        coord = _remote(ReplicaCoordinator, **coordinator_options(
            spec, pg, coordinator_name)).remote(spec, ranks)
        ray.get(coord.start.remote())
    except BaseException:
        _kill(ranks)
        remove_placement_group(pg)
        raise
    return Replica(spec, pg, coord, ranks)


def launch_prefill(spec: PrefillSpec, node_id: str | None = None,
                   resources: dict[str, float] | None = None) -> ActorHandle[PrefillWorker]:
    """Start one prefill worker (anywhere, or on ``node_id`` / nodes offering ``resources``)."""
    from hisparse_ray.actors.prefill_worker import PrefillWorker

    handle = _remote(PrefillWorker, **prefill_options(spec, node_id, resources)).remote(spec)
    ray.get(handle.ready.remote())
    return handle


def connect(replica: Replica, prefill: ActorHandle[PrefillWorker], host_landing: str = "auto"
            ) -> str:
    """Step 6: exchange NIXL agent metadata between a prefill worker and the replica's ranks
    (through the coordinator) and let the coordinator route admissions to it. Returns the host
    landing path for this peer ("direct" or "staged"; ``host_landing`` "auto" asks the transport)."""
    path = ray.get(replica.coordinator.add_prefill.remote(prefill, host_landing))
    replica.prefill.append(prefill)
    return path


def launch_deployment(replica: ReplicaSpec, prefill: PrefillSpec, *,
                      decode_resources: dict[str, float] | None = None,
                      prefill_resources: dict[str, float] | None = None,
                      coordinator_name: str | None = None) -> Replica:
    """One prefill worker + one decode replica, connected: the demo's deployment. The resource
    dicts pin either side to nodes offering them (multi-node tests use custom node resources)."""
    from hisparse_ray.actors.prefill_worker import PrefillWorker

    # the prefill worker starts while the replica forms (actor start-up costs seconds each)
    pf = _remote(PrefillWorker, **prefill_options(prefill, None, prefill_resources)).remote(prefill)
    try:
        rep = launch_replica(replica, resources=decode_resources,
                             coordinator_name=coordinator_name)
    except BaseException:
        ray.kill(pf, no_restart=True)
        raise
    try:
        ray.get(pf.ready.remote())
        connect(rep, pf)
    except BaseException:
        rep.shutdown()
        ray.kill(pf, no_restart=True)
        raise
    return rep
