"""The error hierarchy survives pickling and Ray: the caller catches the exact subclass."""

import pickle

import pytest

from hisparse_ray import errors as E

SAMPLES = [
    E.ConfigError("top_k", 0, "must be >= 1"),
    E.UnknownRequestError("r1"),
    E.DuplicateRequestError("r1"),
    E.UnknownTransferError(7),
    E.UnknownRankError(3, 2),
    E.DoubleFreeError("host block", 5),
    E.CapacityError("host blocks", 100, 10),
    E.HostPoolError("segment gone"),
    E.KernelPreconditionError("positions not distinct"),
    E.TransferError("NIXL_ERR_BACKEND", "r9"),
    E.TransferTimeoutError("no notification after 3 tries", "r9"),
    E.CheckpointError("model-00002.safetensors", "model.norm.weight", "missing"),
]


@pytest.mark.parametrize("err", SAMPLES, ids=lambda e: type(e).__name__)
def test_pickle_round_trip(err):
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err)
    assert back.args == err.args
    assert str(back) == str(err)
    assert isinstance(back, E.HiSparseError)


class _Raiser:
    def raise_(self, err):
        raise err


@pytest.mark.ray
def test_errors_survive_a_ray_actor(ray_cluster):
    ray = ray_cluster
    actor = ray.remote(num_cpus=0)(_Raiser).remote()
    for err in SAMPLES:
        with pytest.raises(type(err)) as ei:
            ray.get(actor.raise_.remote(err))
        assert str(err) in str(ei.value)
    ray.kill(actor)
