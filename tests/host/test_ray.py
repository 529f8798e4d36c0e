"""Two Ray actors (TP ranks) share one host pool: hammer on CPU, IPC events and copies on GPU."""

from __future__ import annotations

import os
import random
import time
from contextlib import contextmanager

import pytest

from hisparse_ray.host.pool import cleanup_stale, list_segments
from hisparse_ray.host.segment import pid_alive
from tests.host import _hammer

PREFIX = f"hs-test-ray-{os.getpid()}"


def _actors(ray, n, **opts):
    Actor = ray.remote(**opts)(_hammer.PoolActor)
    return [Actor.remote() for _ in range(n)]


@contextmanager
def _shared_pool(ray, label, cuda=False, **opts):
    """Two rank actors on one host pool segment (the owner creates it, the peer maps it):
    yields (owner, peer, segment name); on a clean exit both close it and no segment remains;
    the actors are killed either way."""
    owner, peer = _actors(ray, 2, num_cpus=0, **opts)
    try:
        name = ray.get(owner.create.remote(label, PREFIX, cuda))
        ray.get(peer.attach.remote(name, cuda))
        yield owner, peer, name
        ray.get(peer.close.remote())
        ray.get(owner.close.remote())
        assert list_segments(PREFIX) == []
    finally:
        for a in (owner, peer):
            ray.kill(a)


@pytest.mark.ray
def test_ray_actors_hammer_shared_pool(ray_cluster):
    ray = ray_cluster
    with _shared_pool(ray, "ray") as (owner, peer, name):
        seed, gens = 11, 300
        stats = peer.read.remote(seed, gens)
        assert ray.get(owner.write.remote(seed, gens), timeout=120) == gens
        r = ray.get(stats, timeout=120)
        assert r["reads"] >= 200 and r["final"] == gens
        assert r["torn"] == 0 and r["stale"] == 0, r
        assert list_segments(PREFIX) == [name]  # one segment for both ranks


@pytest.mark.ray
def test_killed_owner_actor_leaves_a_segment_that_cleanup_removes(ray_cluster):
    ray = ray_cluster
    (owner,) = _actors(ray, 1, num_cpus=0)
    name = ray.get(owner.create.remote("killed", PREFIX))
    pid = ray.get(owner.pid.remote())
    ray.kill(owner)
    deadline = time.monotonic() + 30
    while pid_alive(pid, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert name in list_segments(PREFIX)
    assert cleanup_stale(PREFIX) == [name]
    assert list_segments(PREFIX) == []


@pytest.mark.gpu
@pytest.mark.ray
@pytest.mark.parametrize("num_gpus", [0.5, pytest.param(1, marks=pytest.mark.two_gpus)],
                         ids=["one-gpu", "gpu-each"])
def test_gpu_actors_spill_publish_restore_through_ipc_events(ray_cluster, num_gpus):
    """Rank 0 spills device pages on a side stream behind a long sleep kernel and publishes at
    once; the peer's stream waits on the IPC event, restores the pages and compares bytes.
    ``gpu-each``: the peer's stream is on another GPU than the event (Ray shows each actor only
    its own GPU) and both GPUs map the one pinned pool."""
    ray = ray_cluster
    rng = random.Random(5)
    with _shared_pool(ray, "gpu", True, num_gpus=num_gpus) as (owner, peer, name):
        gpus = ray.get([owner.gpu.remote(), peer.gpu.remote()])
        assert (gpus[0] != gpus[1]) == (num_gpus == 1), gpus
        for round_ in range(6):
            devs = rng.sample(range(_hammer.NUM_BLOCKS), 8)
            hosts = rng.sample(range(_hammer.NUM_BLOCKS), 8)
            pairs = list(zip(devs, hosts))
            pub = ray.get(owner.spill_and_publish.remote(100 + round_, pairs, round_))
            assert pub == round_ + 1
            assert ray.get(peer.restore_and_check.remote(100 + round_, pairs, round_)) == 0
        assert list_segments(PREFIX) == [name]


@pytest.mark.gpu
@pytest.mark.ray
@pytest.mark.parametrize("num_gpus", [0.5, pytest.param(1, marks=pytest.mark.two_gpus)],
                         ids=["one-gpu", "gpu-each"])
def test_gpu_peer_reads_the_rows_rank_0_wrote_in_the_previous_step(ray_cluster, num_gpus):
    """The step ordering of issue #16 B2: each round (step) rank 0 rewrites the SAME host rows with
    new bytes, on its copy stream behind a 20 ms kernel, and returns the generation without
    waiting (as its step report does), then publishes 7 or 9 landing generations (no event);
    the peer's stream waits on that step's IPC event (slot by step number) and reads the rows
    through UVA. Every round it must see the new bytes, never the last round's. (With slots by
    generation, as before 2026-12-05, the landings moved the slot the peer waited on.)"""
    ray = ray_cluster
    with _shared_pool(ray, "step", True, num_gpus=num_gpus) as (owner, peer, _):
        rows = random.Random(3).sample(range(_hammer.NUM_BLOCKS * _hammer.LAYOUT.page_size), 24)
        gen = 0
        for round_ in range(8):
            assert ray.get(owner.backup_step.remote(200 + round_, rows, round_)) == gen + 1
            gen = ray.get(owner.landings.remote(7 if round_ % 2 else 9))
            assert ray.get(peer.read_step.remote(200 + round_, rows, round_)) == 0, round_
