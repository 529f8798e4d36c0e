"""The lander talks to its replica only through a LandingContext and a LandingSink: an admission
aborted while queued ends in ``landing_failed(rid, None)`` and one queued on a retired lander is
handed back with ``reroute``, in queue order, without a Ray call (no cluster is started)."""

from __future__ import annotations

import time

from hisparse_ray.actors.lander import Lander
from hisparse_ray.deploy import ReplicaSpec
from hisparse_ray.landing.context import LandingContext
from hisparse_ray.types import Admission, LandingTarget, RequestId


class _Sink:
    """Records every call a lander makes (a ``landing.context.LandingSink``)."""

    def __init__(self, aborted: set[str]) -> None:
        self.aborted = aborted
        self.calls: list[tuple] = []

    def abort_requested(self, request_id: str) -> bool:
        return request_id in self.aborted

    def landed(self, request_id, nbytes, seconds, data_s, path) -> None:
        self.calls.append(("landed", request_id))

    def landing_failed(self, request_id, error) -> None:
        self.calls.append(("landing_failed", request_id, error))

    def reroute(self, adm: Admission) -> None:
        self.calls.append(("reroute", adm.request_id))

    def fence(self, error: BaseException) -> None:
        self.calls.append(("fence", error))


def _adm(rid: str) -> Admission:
    return Admission(RequestId(rid), LandingTarget.HOST, 0, ())


def _run(lander: Lander, sink: _Sink, rids: list[str]) -> list[tuple]:
    lander.start()
    try:
        for rid in rids:
            lander.enqueue(_adm(rid), [1, 2, 3], 4)
        deadline = time.monotonic() + 30  # liveness bound
        while len(sink.calls) < len(rids) and time.monotonic() < deadline:
            time.sleep(0.001)
    finally:
        lander.stop()
    return sink.calls


def test_aborted_and_rerouted_admissions_end_through_the_sink_in_queue_order():
    ctx = LandingContext(ReplicaSpec(tp_size=1), (), (), None)
    sink = _Sink(aborted={"a0", "a2"})
    lander = Lander(ctx, sink, None, "prefill-x", direct=True)  # no handle: never called
    assert _run(lander, sink, ["a0", "a2"]) == [("landing_failed", "a0", None),
                                                 ("landing_failed", "a2", None)]

    sink = _Sink(aborted=set())
    retired = Lander(ctx, sink, None, "prefill-y", direct=False)
    retired.retired = RuntimeError("killed")
    assert _run(retired, sink, ["r0", "r1"]) == [("reroute", "r0"), ("reroute", "r1")]
