"""Coordinator rules, one test each, with literal expected values."""

import pickle

import pytest

from hisparse_ray.core import chain_keys
from hisparse_ray.errors import (
    CapacityError, DoubleFreeError, DuplicateRequestError, InvalidRequestError, StateError,
    UnknownRankError, UnknownRequestError, UnknownTransferError,
)
from hisparse_ray.types import (
    NO_BLOCK, LandingTarget as T, RequestHandle, RequestState as S, StepReport, TableDiff,
    TransferKind,
)
from tests.core._steps import ack, make, take, tids


def step(c, sample=7):
    cmd = take(c)
    ack(c, cmd, sample=sample)
    return cmd


def snapshot(c):
    return (c.counters, c.step, tuple(c.view(r) for r in c.request_ids()), len(c.book.pending),
            c.host.available(), c.device.num_free)


# -- admission -----------------------------------------------------------------------------------
def test_resident_target_when_prefix_fits_device_pool():
    c = make(dev=4)
    adm = c.admit("a", [1, 2, 3, 4, 5], 3)
    assert adm.target is T.RESIDENT and adm.num_positions == 4 and adm.hot_blocks == ()
    assert [(p.page, p.host_block, p.device_block, p.reused) for p in adm.pages] == [
        (0, NO_BLOCK, 0, False), (1, NO_BLOCK, 1, False), (2, NO_BLOCK, 2, False)]
    assert c.counters.device_blocks_used == 3
    c.check_invariants()


def test_host_target_when_device_is_short_but_hot_buffer_fits():
    c = make(dev=4)
    c.admit("a", [1, 2, 3, 4, 5], 3)  # 3 of 4 device blocks
    adm = c.admit("b", [9, 9, 9, 9, 9], 3)
    assert adm.target is T.HOST and adm.hot_blocks == (3,)
    assert [(p.host_block, p.device_block) for p in adm.pages] == [(0, -1), (1, -1), (2, -1)]
    assert (c.counters.device_blocks_used, c.counters.host_blocks_used) == (4, 3)
    c.check_invariants()


def test_waiting_request_keeps_its_target_across_retries():
    c = make(dev=4)
    c.admit("a", [1, 2, 3, 4, 5], 3)
    c.admit("b", [9, 9, 9, 9, 9], 3)
    assert c.admit("c", [5, 5, 5], 2) is None  # nothing free: waits, life fits the device pool
    v = c.view("c")
    assert (v.state, v.target) == (S.WAITING, T.RESIDENT)
    c.finish("b")  # frees 1 device block: the host tier would fit now, resident (2 pages) not
    assert c.poll_waiting() == ()
    assert c.view("c").target is T.RESIDENT and c.counters.waiting == 1
    c.finish("a")
    (adm,) = c.poll_waiting()
    assert (adm.request_id, adm.target, len(adm.pages)) == ("c", T.RESIDENT, 2)
    c.check_invariants()


def test_a_wait_the_conversions_cannot_serve_resident_waits_for_the_host_tier():
    """Device full with a's prompt; b's whole life fits the device pool, but converting a leaves
    its hot buffer: 7 blocks, one short of b's prompt. b waits with HOST and lands on the host
    tier once a converted, while a still decodes (a RESIDENT wait would idle the device until a
    finished)."""
    c = make(dev=8, host=32)
    c.admit("a", list(range(16)), 10)  # 8 pages: the whole device
    c.apply_landed("a")
    assert c.admit("b", list(range(100, 116)), 1) is None
    assert c.view("b").target is T.HOST and c.counters.conversions_to_host == 1
    landed = ()
    for _ in range(4):
        cmd = take(c)
        ack(c, cmd, sample=5)
        landed = landed or c.poll_waiting()
    (adm,) = landed
    assert (adm.request_id, adm.target) == ("b", T.HOST)
    assert c.view("a").state is S.RUNNING and c.view("a").tier is T.HOST
    c.check_invariants()


def test_new_request_waits_behind_earlier_waiting_ones():
    c = make(dev=4)
    c.admit("a", [1, 2, 3, 4, 5, 6, 7], 3)  # 4 device blocks
    assert c.admit("b", [1] * 9, 1) is None
    assert c.admit("c", [2], 1) is None  # would fit the host tier? no: FIFO
    assert [c.view(r).state for r in ("b", "c")] == [S.WAITING, S.WAITING]


def test_request_larger_than_every_pool_is_refused_with_state_unchanged():
    c = make(dev=4, host=8)
    before = snapshot(c)
    with pytest.raises(CapacityError) as e:
        c.admit("big", [1], 40)  # 40 positions = 20 pages
    assert (e.value.needed, e.value.total) == (20, 8)
    assert snapshot(c) == before
    c.check_invariants()


def test_duplicate_and_invalid_requests_raise_typed_errors():
    c = make()
    c.admit("a", [1, 2], 1)
    before = snapshot(c)
    with pytest.raises(DuplicateRequestError):
        c.admit("a", [1], 1)
    for args in (([], 1), ([1], 0), ([1, -1], 1), ([True], 1), ([1], 1.5)):
        with pytest.raises(InvalidRequestError):
            c.admit("x", *args)
    assert snapshot(c) == before
    e = InvalidRequestError("x", "why")
    assert pickle.loads(pickle.dumps(e)).args == ("x", "why")


# -- prefix reuse and publishing -----------------------------------------------------------------
def test_second_request_with_same_prefix_gets_the_same_host_blocks():
    c = make(dev=2, host=8)  # resident never fits 4 pages: host tier, hot buffer = 1 block
    prompt = [4, 5, 6, 7, 8, 9, 1]
    a = c.admit("a", prompt, 2)
    assert a.target is T.HOST and [p.host_block for p in a.pages] == [0, 1, 2, 3]
    c.apply_landed("a")  # positions 0..5 landed: pages 0, 1, 2 full
    assert c.counters.published_pages == 3
    b = c.admit("b", prompt, 2)
    assert [(p.host_block, p.reused) for p in b.pages] == [(0, True), (1, True), (2, True), (4, False)]
    assert c.counters.prefix_hit_pages == 3
    assert [c.host.refs(i) for i in range(5)] == [2, 2, 2, 1, 1]
    c.check_invariants()


def test_landing_pages_are_published_only_on_apply_landed():
    c = make(dev=2, host=8)
    c.admit("a", [4, 5, 6], 1)
    b = c.admit("b", [4, 5, 6], 1)
    assert b is None or all(not p.reused for p in b.pages)
    assert c.counters.prefix_hit_pages == 0


def test_backup_page_is_published_only_after_every_rank_completed():
    c = make(dev=1, host=8, ps=2, H=1, tp=2)  # hot buffer: ceil(2/2) = 1 block
    adm = c.admit("a", [3, 4, 5], 3)
    assert adm.target is T.HOST
    c.apply_landed("a")  # positions 0, 1 landed: page 0 full and published
    assert c.counters.published_pages == 1
    step(c, sample=6)  # backs up position 2 into page 1
    cmd0 = take(c)
    (bk,) = cmd0.backups
    assert (bk.position, bk.host_block, bk.offset) == (3, 1, 1)
    key = chain_keys([3, 4, 5, 6], 2)[1]
    ack(c, cmd0, ranks=[0, 1], enqueued=True)
    ack(c, cmd0, ranks=[0])
    assert c.host.index.lookup(key) is None and c.counters.published_pages == 1
    ack(c, cmd0, ranks=[1])
    assert c.host.index.lookup(key) == 1 and c.counters.published_pages == 2
    assert c.counters.backups == 2


@pytest.mark.parametrize("publish_decoded", [True, False])
@pytest.mark.parametrize("spill", [False, True])
def test_publish_decoded_off_publishes_only_pages_the_prefill_wrote(publish_decoded, spill):
    """``publish_decoded=False`` (the fast step: its decode rows are not bitwise a prefill's): a
    page holding a decode-written row is never published, whether backups (host tier) or a spill
    filled its host copy, so a follow-up reuses only the prompt's prefill pages."""
    c = make(dev=3 if spill else 1, host=16, ps=2, H=1, publish_decoded=publish_decoded)
    c.admit("a", [3, 4, 5, 6], 5)  # positions 0..2 landed: page 0 by the prefill, page 1 half
    c.apply_landed("a")
    for _ in range(3):
        step(c, sample=9)  # positions 3..5 decoded: pages 1 and 2 full
    if spill:  # resident so far: a waiting admission converts it
        assert c.view("a").tier is T.RESIDENT
        assert c.admit("b", [7] * 5, 1) is None and c.counters.conversions_to_host == 1
        step(c)
        assert c.view("a").tier is T.HOST and c.counters.spills == 3
    assert c.counters.published_pages == (3 if publish_decoded else 1)
    for rid in c.request_ids():
        if c.view(rid).state not in (S.FINISHED, S.RELEASED):
            c.finish(rid)
    step(c)
    follow = c.admit("c", [3, 4, 5, 6, 9, 9, 9, 1], 1)  # a's prompt, its answer, a new turn
    assert [p.reused for p in follow.pages][:3] == [True, publish_decoded, publish_decoded]
    c.check_invariants()


# -- steps and commands --------------------------------------------------------------------------
def test_one_command_for_every_rank_with_full_tables_first_then_diffs():
    c = make(dev=8, tp=3)
    c.admit("a", [1, 2, 3, 4], 3)
    c.apply_landed("a")
    cmd = take(c)
    assert cmd.step == 1 and cmd.handles == (RequestHandle(0, "a"),)
    row = cmd.batch[0]
    assert (row.handle, row.seq_len, row.input_token, row.hot_blocks) == (0, 4, 4, ())
    assert cmd.table_diffs == (TableDiff(0, 0, -1, 0), TableDiff(0, 1, -1, 1))
    ack(c, cmd, sample=9)
    cmd = take(c)  # position 4 needs page 2: one new diff only; handle and hot buffer known
    assert cmd.table_diffs == (TableDiff(0, 2, -1, 2),) and cmd.handles == ()
    assert (cmd.batch[0].seq_len, cmd.batch[0].input_token, cmd.batch[0].hot_blocks) == (5, 9, None)
    assert c.view("a").tokens == (1, 2, 3, 4, 9)


def test_a_step_scans_only_the_page_tables_that_changed_and_a_missed_change_is_caught():
    c = make(dev=8)
    c.admit("a", [1, 2, 3, 4], 9)
    c.apply_landed("a")
    ack(c, take(c), sample=9)  # position 3 in page 1: no new page
    req = c._requests["a"]
    cmd = take(c)  # position 4 needs page 2: the table is scanned once, then clean
    assert cmd.table_diffs == (TableDiff(0, 2, -1, 2),) and req.table_from == 3
    ack(c, cmd, sample=9)
    cmd = take(c)  # position 5 in page 2: no page changed, nothing scanned
    assert cmd.table_diffs == () and req.table_from == 3
    req.pages[0].device = 7  # a change that forgot to mark the table: the invariants name it
    with pytest.raises(AssertionError, match="mark_table"):
        c.check_invariants()


def test_handles_are_defined_once_released_once_and_reused_after_their_release():
    c = make(dev=8)
    for r in "ab":
        c.admit(r, [1, 2], 1 if r == "a" else 3)
        c.apply_landed(r)
    cmd = step(c)
    assert cmd.handles == (RequestHandle(0, "a"), RequestHandle(1, "b")) and cmd.released == ()
    cmd = step(c)  # a finished after one token: released here, b still runs
    assert cmd.released == (0,) and cmd.handles == () and c.test_names == {1: "b"}
    c.admit("c", [4, 5], 1)
    c.apply_landed("c")
    cmd = step(c)  # handle 0 is free again: c takes it
    assert cmd.handles == (RequestHandle(0, "c"),)
    assert [c.test_names[row.handle] for row in cmd.batch] == ["b", "c"]


def test_the_command_carries_rank_0s_latest_host_generation_to_the_peers():
    c = make(dev=1, host=8, ps=2, H=1, tp=2)
    c.admit("a", [3, 4, 5], 4)
    c.apply_landed("a")
    cmd = take(c)
    assert cmd.host_seq == 0
    c.apply_report(StepReport(cmd.step, 1, completed=tids(cmd)))
    c.apply_report(StepReport(cmd.step, 0, completed=tids(cmd), sampled=(("a", 1),),
                              published=3))
    nxt = take(c)
    assert nxt.host_seq == 3
    c.apply_report(StepReport(nxt.step, 0, published=2))  # an older report never lowers it
    c.apply_report(StepReport(nxt.step, 0, completed=tids(nxt), sampled=(("a", 1),)))
    c.apply_report(StepReport(nxt.step, 1, completed=tids(nxt)))
    assert take(c).host_seq == 3


def test_nothing_to_send_gives_no_command_and_no_step():
    c = make()
    assert c.take_command() is None and c.step == 0


def test_request_finishes_at_max_new_tokens_or_eos_and_is_released_once():
    c = make()
    c.admit("a", [1, 2], 3)
    c.admit("b", [1, 2], 5, eos_token_id=0)
    c.apply_landed("a")
    c.apply_landed("b")
    step(c, sample=5)
    step(c, sample=0)  # b hits eos
    assert (c.view("b").state, c.view("b").finish_reason, c.view("b").num_generated) == (S.RELEASED, "eos", 2)
    cmd = step(c, sample=6)
    assert cmd.released == (1,)  # b's handle
    assert (c.view("a").state, c.view("a").finish_reason, c.view("a").tokens) == (
        S.RELEASED, "length", (1, 2, 5, 0, 6))
    assert c.counters.device_blocks_used == 0 and c.counters.finished == 2


def test_max_batch_limits_rows_in_admission_order():
    c = make(dev=8, max_batch=2)
    for r in "abc":
        c.admit(r, [1], 1)
        c.apply_landed(r)
    cmd = take(c)
    assert [c.test_names[row.handle] for row in cmd.batch] == ["a", "b"]


# -- spill, restore ------------------------------------------------------------------------------
def _resident_full(tp=2):
    c = make(dev=4, host=8, ps=2, H=1, tp=tp)
    c.admit("a", [1, 2, 3, 4, 5, 6, 7, 8], 4)  # 4 pages = the whole device pool
    c.apply_landed("a")
    step(c, sample=9)  # writes position 7 (page 3)
    return c


def test_spill_before_free_releases_device_blocks_only_after_every_rank_enqueued():
    c = _resident_full()
    cmd = take(c)  # position 8 needs a 5th page: convert a to the host tier
    assert cmd.batch == () and c.counters.stalls == 1
    assert [(t.kind, t.device_block, t.host_block) for t in cmd.transfers] == [
        (TransferKind.SPILL, d, d) for d in range(4)]
    ack(c, cmd, ranks=[0], enqueued=True)
    assert c.device.num_free == 0 and all(c.device.pins(d) == 1 for d in range(4))
    ack(c, cmd, ranks=[1], enqueued=True)
    assert c.device.num_free == 3  # block 0 became a's hot buffer, 1..3 were released
    assert c.counters.published_pages == 0 and c.counters.spills == 0  # not completed yet
    assert c._requests["a"].hot == [0]
    nxt = take(c)
    assert nxt.batch == ()  # spills not completed yet: a stays out of the batch
    assert nxt.table_diffs == tuple(TableDiff(0, i, i, -1) for i in range(4))
    ack(c, cmd)
    assert (c.counters.spills, c.counters.published_pages, c.view("a").tier) == (4, 4, T.HOST)
    s3 = take(c)
    assert (s3.batch[0].seq_len, s3.batch[0].hot_blocks) == (9, (0,))
    (bk,) = s3.backups
    assert (bk.position, bk.host_block, bk.offset) == (8, 4, 0)


def test_waiting_admission_converts_a_resident_request_and_lands_after_enqueued():
    c = _resident_full()
    assert c.admit("b", [5, 5, 5], 1) is None  # device full: waits (resident), relieves pressure
    assert c.counters.conversions_to_host == 1
    cmd = take(c)
    assert [t.kind for t in cmd.transfers] == [TransferKind.SPILL] * 4 and cmd.batch == ()
    assert c.poll_waiting() == ()  # nothing is freed before every rank enqueued the spills
    ack(c, cmd, enqueued=True)
    (adm,) = c.poll_waiting()
    assert (adm.request_id, adm.target, [p.device_block for p in adm.pages]) == (
        "b", T.RESIDENT, [1, 2])  # blocks 1..3 were released, 0 is a's hot buffer: lowest first
    c.check_invariants()


def test_restore_moves_a_host_tier_request_back_to_resident_pages():
    c = make(dev=8, host=8, ps=2, H=1, tp=2)
    c.admit("f", [1] * 11, 1)  # 6 resident pages
    adm = c.admit("a", [2, 3, 4], 3)  # resident needs 2, 2 left: resident
    c.finish("a")
    c.finish("f")
    c.admit("f2", [1] * 13, 1)  # 7 pages
    adm = c.admit("a2", [2, 3, 4, 5], 3)
    assert adm.target is T.HOST
    c.apply_landed("a2")
    step(c)
    assert c.restore("a2") is False  # 2 device pages needed, 0 free
    c.finish("f2")
    assert c.restore("a2") is True
    cmd = take(c)
    assert [(t.kind, t.host_block) for t in cmd.transfers] == [(TransferKind.RESTORE, 0), (TransferKind.RESTORE, 1)]
    with pytest.raises(StateError):
        c.restore("a2")  # already converting
    ack(c, cmd)
    v = c.view("a2")
    assert (v.tier, c.counters.restores, c._requests["a2"].hot) == (T.RESIDENT, 2, [])
    assert c.counters.host_blocks_used == 0 and c.counters.host_blocks_cached == 2
    nxt = take(c)
    assert nxt.batch[0].hot_blocks == () and nxt.backups == ()


def test_resident_target_restores_a_matched_host_prefix():
    c = make(dev=2, host=8)
    c.admit("a", [4, 5, 6, 7, 8], 1)  # host tier: pages 0, 1 published on landing
    c.apply_landed("a")
    c.finish("a")
    adm = c.admit("b", [4, 5, 6, 7, 8], 1)  # device now empty: 3 pages do not fit 2 -> host
    assert adm.target is T.HOST and [p.reused for p in adm.pages] == [True, True, False]
    c.finish("b")
    c2 = make(dev=8, host=8)
    c2.admit("h", [1] * 15, 1)  # 8 pages: fills device
    c2.admit("a", [4, 5, 6, 7, 8], 1)  # waits (no hot buffer room) with target resident
    c2.finish("h")
    (adm,) = c2.poll_waiting()
    assert adm.target is T.RESIDENT and [p.reused for p in adm.pages] == [False, False, False]


# -- finishing, freeing, bad input -----------------------------------------------------------------
def test_finish_with_transfers_in_flight_frees_leases_only_when_they_complete():
    c = make(dev=2, host=8, tp=2)
    assert c.admit("a", [1, 2, 3, 4, 5], 4).target is T.HOST
    c.apply_landed("a")
    cmd = take(c)
    c.finish("a")
    c.free("a")  # forgotten once released
    assert c.view("a").state is S.FINISHED and c.counters.device_blocks_used == 1
    ack(c, cmd, ranks=[0], sample=3)  # token of the aborted step is dropped
    assert c.view("a").tokens == (1, 2, 3, 4, 5) and c.counters.host_blocks_used == 3
    ack(c, cmd, ranks=[1])
    assert c.request_ids() == () and c.counters.device_blocks_used == 0
    assert (c.counters.host_blocks_used, c.counters.host_blocks_cached) == (0, 2)
    assert take(c).released == (0,)
    with pytest.raises(DoubleFreeError):
        c.free("a")


def test_free_rules():
    c = make()
    c.admit("a", [1, 2], 1)
    with pytest.raises(StateError):
        c.free("a")  # still landing
    with pytest.raises(UnknownRequestError):
        c.free("zz")
    with pytest.raises(StateError):
        c.restore("a")  # not running
    c.apply_landing_failed("a")
    assert (c.view("a").state, c.view("a").finish_reason) == (S.RELEASED, "landing_failed")
    assert c.counters.device_blocks_used == 0
    c.free("a")
    with pytest.raises(DoubleFreeError):
        c.free("a")
    with pytest.raises(UnknownRequestError):
        c.finish("a")  # forgotten
    c.check_invariants()


@pytest.mark.parametrize("bad", ["rank", "tid", "dup", "sampled_rank", "not_due", "future", "twice",
                                 "peer_published", "negative_published"])
def test_bad_reports_raise_and_leave_state_unchanged(bad):
    c = make(dev=2, host=8, tp=2)
    c.admit("a", [1, 2, 3, 4, 5], 4)
    c.apply_landed("a")
    cmd = take(c)
    (tid,) = tids(cmd)
    c.apply_report(StepReport(1, 0, enqueued=(tid,)))
    before = snapshot(c)
    report, err = {
        "rank": (StepReport(1, 2), UnknownRankError),
        "tid": (StepReport(1, 0, completed=(999,)), UnknownTransferError),
        "dup": (StepReport(1, 0, enqueued=(tid,)), StateError),
        "sampled_rank": (StepReport(1, 1, sampled=(("a", 1),)), StateError),
        "not_due": (StepReport(1, 0, sampled=(("zz", 1),)), UnknownRequestError),
        "future": (StepReport(2, 0), StateError),
        "twice": (StepReport(1, 1, completed=(tid, tid)), StateError),
        "peer_published": (StepReport(1, 1, published=1), StateError),
        "negative_published": (StepReport(1, 0, published=-1), StateError),
    }[bad]
    with pytest.raises(err):
        c.apply_report(report)
    assert snapshot(c) == before
    c.check_invariants()


def test_unknown_request_ids_raise():
    c = make()
    for f in (c.finish, c.apply_landed, c.apply_landing_failed, c.restore, c.view, c.state,
              c.generated):
        with pytest.raises(UnknownRequestError):
            f("nope")
    c.admit("a", [1, 2, 3], 2)
    assert c.state("a") is c.view("a").state is S.LANDING


def test_everything_that_crosses_a_process_boundary_pickles():
    c = make(dev=2, host=8, tp=2)
    adm = c.admit("a", [1, 2, 3, 4, 5], 2)
    c.apply_landed("a")
    cmd = take(c)
    for obj in (adm, c.view("a"), c.counters, cmd, StepReport(1, 0, sampled=(("a", 2),))):
        assert pickle.loads(pickle.dumps(obj)) == obj


def test_a_capped_index_key_pool_makes_admission_wait_not_convert():
    """index_pages=5 of 4 positions: "a" (10 + 6 positions = 4 pages) lands; "b" (2 pages) waits
    although blocks are plenty, and no resident request is converted for it (pages come back on
    a release, not from a spill); it lands once "a" is released. A request needing more pages
    than the whole pool is refused at admission, naming the pool."""
    c = make(dev=32, host=32, ps=2, H=1, index_pages=5, index_page_tokens=4)
    assert c.admit("a", list(range(10)), 6) is not None
    c.apply_landed("a")
    assert c.admit("b", [1, 2, 3], 4) is None
    assert c.view("b").state is S.WAITING and c.poll_waiting() == ()
    c.check_invariants()
    step(c)
    assert c.counters.conversions_to_host == 0 and c.view("a").tier is T.RESIDENT
    c.finish("a")
    step(c)
    assert c.view("a").state is S.RELEASED
    (adm,) = c.poll_waiting()
    assert adm.request_id == "b"
    c.check_invariants()
    with pytest.raises(CapacityError, match="index-key pages of 4 positions"):
        c.admit("huge", list(range(20)), 5)  # 25 positions = 7 pages > 5
    with pytest.raises(UnknownRequestError):
        c.view("huge")
