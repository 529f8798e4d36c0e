"""Reservations (issue #15 item 3): admission reserves what a request can grow to, so pools never
run dry mid-decode; literal cases, one rule each. Random workloads: test_properties.py (liveness in
the state machine's teardown) and tests/engine/test_pool_pressure.py (exact tokens)."""

import pytest

from hisparse_ray.errors import CapacityError
from hisparse_ray.types import LandingTarget as T, RequestState as S, StepReport
from tests.core._steps import ack, make, take


def step(c, sample=1):
    """Land waiting admissions, emit one step and ack it; False when there was nothing to send."""
    for adm in c.poll_waiting():
        c.apply_landed(adm.request_id)
    cmd = take(c)
    if cmd is not None:
        ack(c, cmd, sample=sample)
    c.check_invariants()
    return cmd is not None


def run_to_end(c, max_steps=200):
    """Step until every request is released; returns request ids in the order they finished."""
    done: list[str] = []
    for _ in range(max_steps):
        step(c)
        for rid in c.request_ids():
            if c.view(rid).state is S.RELEASED and rid not in done:
                done.append(rid)
        if len(done) == len(c.request_ids()):
            return done
    raise AssertionError(f"no end: {[(r, c.view(r).state) for r in c.request_ids()]}")


def test_host_requests_that_fit_alone_but_not_together_run_one_after_the_other():
    # The deadlock in miniature: each request's life (5 + 8 - 1 positions = 6 pages)
    # fits the 7 host blocks, both prompts (3 pages each) fit at once, both lives do not.
    c = make(dev=2, host=7)
    a = c.admit("a", [1] * 5, 8)
    assert a.target is T.HOST and len(a.pages) == 3
    assert c._room().host == 1  # 7 available - a's 6
    assert c.admit("b", [2] * 5, 8) is None  # would over-commit the host pool: waits
    assert (c.view("b").state, c.view("b").target) == (S.WAITING, T.HOST)
    c.apply_landed("a")
    assert run_to_end(c) == ["a", "b"]
    assert [c.view(r).num_generated for r in "ab"] == [8, 8]
    assert c.counters.stalls == 0 and c.counters.host_blocks_used == 0


def test_backed_resident_request_reserves_its_spill_on_the_host_tier():
    c = make(dev=4, host=8)
    a = c.admit("a", [1] * 5, 6)  # life 5 pages: > 4 device blocks, so backed by 5 host blocks
    assert a.target is T.RESIDENT and len(a.pages) == 3 and c._requests["a"].backed
    assert (c._room().host, c._room().device) == (3, 1)
    b = c.admit("b", [2] * 3, 4)  # life 3 pages: exactly the host room left
    assert b.target is T.HOST and len(b.pages) == 2
    assert c._room().host == 0
    c.apply_landed("a")
    c.apply_landed("b")
    assert run_to_end(c) == ["b", "a"]
    # a outgrew the device and spilled into the host blocks its backing kept free
    assert c.view("a").tier is T.HOST and c.counters.conversions_to_host == 1
    assert c.counters.stalls >= 1 and c.view("a").num_generated == 6


def test_unbacked_resident_request_keeps_its_device_reservation_and_never_spills():
    c = make(dev=8, host=4)
    a = c.admit("a", [1] * 5, 6)  # life 5 pages > 4 host blocks: its whole life on the device
    assert a.target is T.RESIDENT and not c._requests["a"].backed
    assert (c._room().host, c._room().device) == (4, 3)  # 8 - 3 leased - 2 more reserved
    b = c.admit("b", [2] * 5, 4)  # life 4: backed (3 device pages, 4 host blocks)
    assert b.target is T.RESIDENT and c._requests["b"].backed
    c.apply_landed("a")
    c.apply_landed("b")
    run_to_end(c)
    # b ran out of unreserved device blocks and spilled; a grew into its reservation
    assert c.view("a").tier is T.RESIDENT and c.view("b").tier is T.HOST
    assert c.counters.conversions_to_host == 1


def test_stalled_request_claims_a_device_block_ahead_of_admissions():
    c = make(dev=8, host=32)
    for rid in "pq":
        assert c.admit(rid, [ord(rid)] * 7, 6).target is T.RESIDENT  # backed, 4 pages each
        c.apply_landed(rid)
    while True:  # until both reach page 4 (the same step)
        cmd = take(c)
        assert cmd is not None
        if c.counters.stalls:
            break
        ack(c, cmd, sample=1)
    # p stalled first and spills itself; q stalled while that conversion is in flight
    assert cmd.batch == () and len(cmd.transfers) == 4 and c.counters.stalls == 2
    assert c._requests["q"].stalled and c._room().claims == 1
    ids = tuple(t.transfer_id for t in cmd.transfers)
    c.apply_report(StepReport(cmd.step, 0, enqueued=ids))
    # p's spills are enqueued: 3 device blocks come free (the 4th became p's hot buffer)
    assert c.device.num_free == 3 and c._room().admit_device == 2
    # x's prompt (3 pages) would fit the 3 free blocks, but one of them is q's claim: x lands on
    # the host tier instead, and q gets its page at the next step
    assert c.admit("x", [9] * 5, 1).target is T.HOST
    c.apply_landed("x")
    c.apply_report(StepReport(cmd.step, 0, completed=ids))
    step(c)
    assert not c._requests["q"].stalled and len(c._requests["q"].pages) == 5
    run_to_end(c)
    assert c.view("q").num_generated == 6


def test_restore_keeps_other_requests_reservations():
    c = make(dev=6, host=4)
    c.admit("f", [1] * 3, 8)  # life 5 > host 4: unbacked, 2 pages leased + 3 reserved
    assert c.admit("a", [2] * 3, 4).target is T.HOST  # 1 hot block
    c.apply_landed("f")
    c.apply_landed("a")
    step(c)
    assert c.device.num_free == 3 and c._room().device == 0
    assert c.restore("a") is False  # 2 pages would fit the 3 free blocks, all reserved by f
    c.finish("f")
    step(c)
    assert c.restore("a") is True


def test_resident_admission_reuses_only_the_cached_prefix_blocks_the_host_room_allows():
    c = make(dev=5, host=12)
    prefix = [4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 5]
    assert c.admit("a", prefix, 1).target is T.HOST  # 6 prompt pages > 5 device blocks
    c.apply_landed("a")  # positions 0..9: pages 0..4 published
    c.finish("a")
    assert c.counters.host_blocks_cached == 5
    assert c.admit("x", [9] * 11, 11).target is T.HOST  # life 11: 6 blocks now, 5 reserved
    assert c._room().host == 1  # 12 - 6 used - 5 reserved
    b = c.admit("b", prefix[:5], 1)  # 2 matched pages, both cached, only 1 affordable
    assert b.target is T.RESIDENT and [p.reused for p in b.pages] == [True, False, False]
    assert c._room().host == 0
    c.check_invariants()


def test_a_request_that_fits_no_empty_pool_is_refused_naming_its_size_and_the_pools():
    c = make(dev=4, host=8)
    with pytest.raises(CapacityError) as e:
        c.admit("big", [1] * 3, 38)
    assert (e.value.needed, e.value.total) == (20, 8)
    assert str(e.value) == (
        "request 'big' (3 prompt + 38 new tokens = 20 pages of 2 positions) fits neither the "
        "device pool (4 blocks) nor the host pool (8 blocks); pages: needs 20, the whole pool "
        "holds 8")
    assert c.request_ids() == ()
    ok = c.admit("ok", [1] * 3, 14)  # 16 positions = 8 pages: its life fits the host pool
    assert ok.target is T.RESIDENT and c._requests["ok"].backed


def test_without_a_host_tier_the_refusal_names_the_device_pool_alone():
    """A full-resident budget (``host_tier=False``) never uses the host pool: the error must not
    say that the whole pool holds the host pool's blocks (was: "needs 20, the whole pool holds 30"
    for a request the 30 host blocks would hold, on a tier it may not use)."""
    c = make(dev=4, host=30, host_tier=False)
    with pytest.raises(CapacityError) as e:
        c.admit("big", [1] * 3, 38)
    assert (e.value.needed, e.value.total) == (20, 4)
    assert "does not fit the device pool (4 blocks, no host tier)" in str(e.value)
    assert c.request_ids() == ()
