"""Chained rows (``Coordinator.admit(chain=True)``): a request runs one step ahead of its reports,
never two, never past ``max_new_tokens``; its tokens arrive in step order; a finished request's
chained token is dropped. Literal expected values; invariants after every step."""

import random

import msgspec
import pytest

from hisparse_ray.errors import InvalidRequestError, StateError
from hisparse_ray.testing.reference_worker import ReferenceWorker
from hisparse_ray.types import LandingTarget as T, RequestState as S, StepReport
from tests.core._steps import make, take, tids


def running(c, *specs):
    """Admit and land each ``(rid, prompt, max_new, kwargs)``."""
    for rid, prompt, max_new, kw in specs:
        c.admit(rid, prompt, max_new, **kw)
        c.apply_landed(rid)
    c.check_invariants()


def rows(c, cmd):
    """``cmd``'s rows as ``(request id, seq_len, input_token, prev_row)``."""
    return [(c.test_names[r.handle], r.seq_len, r.input_token, r.prev_row) for r in cmd.batch]


def report(c, cmd, tokens, completed=False, published=0):
    """Rank 0's report of ``cmd`` sampling ``tokens`` (request id -> token), acking its transfers
    completed when asked."""
    c.apply_report(StepReport(cmd.step, 0, completed=tids(cmd) if completed else (),
                              sampled=tuple(tokens.items()), published=published))
    c.check_invariants()


def apply(c, rep):
    c.apply_report(rep)
    c.check_invariants()


def step_of(c):
    cmd = take(c)
    c.check_invariants()
    return cmd


def snapshot(c):
    return (c.counters, c.step, tuple(c.view(r) for r in c.request_ids()), len(c.book.pending))


def test_chained_row_names_its_row_in_the_previous_command():
    c = make()
    running(c, ("u", [1, 2, 3], 4, {}), ("a", [4, 5, 6], 4, {"chain": True}))
    one = step_of(c)
    assert rows(c, one) == [("u", 3, 3, -1), ("a", 3, 6, -1)]
    two = step_of(c)  # before report 1: u waits for its token, a runs one step ahead
    assert rows(c, two) == [("a", 4, 0, 1)] and c.counters.chained_rows == 1
    report(c, one, {"u": 7, "a": 8})
    three = step_of(c)  # a's only step in flight is 2: it chains again, to its row 0 there
    assert rows(c, three) == [("u", 4, 7, -1), ("a", 5, 0, 0)]
    report(c, two, {"a": 9})
    report(c, three, {"u": 1, "a": 2})
    assert c.view("a").tokens == (4, 5, 6, 8, 9, 2) and c.view("u").tokens == (1, 2, 3, 7, 1)
    assert c.counters.chained_rows == 2 and c.counters.dropped_rows == 0


def test_never_two_steps_ahead():
    c = make()
    running(c, ("x", [1, 2, 3], 5, {}), ("a", [4, 5, 6], 5, {"chain": True}))
    one = step_of(c)
    report(c, one, {"x": 1})  # x's token of step 1 only: a's is still due
    two = step_of(c)
    assert rows(c, two) == [("x", 4, 1, -1), ("a", 4, 0, 1)]
    report(c, two, {"x": 2})
    three = step_of(c)  # command N + 2 before report N: no row for a
    assert rows(c, three) == [("x", 5, 2, -1)]
    assert step_of(c) is None  # a still two steps in flight, x waits for its token
    report(c, one, {"a": 3})
    report(c, two, {"a": 4})  # a's tokens arrived in step order: nothing of it in flight
    four = step_of(c)
    assert rows(c, four) == [("a", 5, 4, -1)]  # an unchained row: its token is known again
    assert c.counters.chained_rows == 1


def pipeline(c, before_take=None):
    """Take command N + 1, then apply report N (every row samples 5), until nothing is left.
    Returns the rows of every command (with ``before_take()`` as it was before the take)."""
    out, prev = [], None
    while True:
        seen = before_take() if before_take else None
        cmd = step_of(c)
        if prev is not None:
            report(c, prev[0], {rid: 5 for rid, *_ in prev[1]})
        if cmd is None and prev is None:
            return out
        prev = None if cmd is None else (cmd, rows(c, cmd))
        if prev is not None:
            out.append(prev[1] if before_take is None else (prev[1], seen))


@pytest.mark.parametrize("max_new", [1, 2, 3, 4])
def test_never_past_max_new_tokens(max_new):
    """Taking always one command ahead: a request gets ``max_new`` rows, every one after the
    first chained (a row is chained only when its token can still be used: the step in flight
    samples token ``num_generated + 1``, the chained row the next one, so ``num_generated + 1 <
    max_new``; max_new = 2 chains once)."""
    c = make()
    running(c, ("a", [4, 5, 6], max_new, {"chain": True}))
    got = pipeline(c)
    assert [r for cmd in got for r in cmd] == [("a", 3, 6, -1)] + [
        ("a", 3 + k, 0, 0) for k in range(1, max_new)]
    assert c.counters.chained_rows == max_new - 1 and c.counters.dropped_rows == 0
    v = c.view("a")
    assert (v.state, v.finish_reason, v.tokens) == (S.RELEASED, "length", (4, 5, 6) + (5,) * max_new)


def test_unchained_request_never_gets_a_row_while_its_step_is_in_flight():
    c = make()
    running(c, ("u", [1, 2, 3], 6, {}), ("a", [4, 5, 6], 6, {"chain": True}))
    u = c._requests["u"]
    got = pipeline(c, before_take=lambda: u.awaiting == [])
    urows = [(r, idle) for cmd, idle in got for r in cmd if r[0] == "u"]
    assert len(urows) == 6 and all(r[3] == -1 and idle for r, idle in urows)
    assert sum(r[3] >= 0 for cmd, _ in got for r in cmd) == 5  # a chains all but its first
    assert c.view("u").tokens == (1, 2, 3) + (5,) * 6 and c.view("a").tokens == (4, 5, 6) + (5,) * 6


def test_tokens_must_arrive_in_step_order():
    c = make()
    running(c, ("a", [4, 5, 6], 4, {"chain": True}))
    one, two = step_of(c), step_of(c)
    assert rows(c, two) == [("a", 4, 0, 0)]
    before = snapshot(c)
    with pytest.raises(StateError):
        c.apply_report(StepReport(two.step, 0, sampled=(("a", 1),)))
    assert snapshot(c) == before
    c.check_invariants()
    report(c, one, {"a": 2})
    report(c, two, {"a": 1})
    assert c.view("a").tokens == (4, 5, 6, 2, 1)


def test_eos_before_a_chained_step_drops_its_token():
    c = make()
    running(c, ("a", [4, 5, 6], 5, {"chain": True, "eos_token_id": 9}))
    one, two = step_of(c), step_of(c)
    used = c.counters.device_blocks_used
    report(c, one, {"a": 9})
    v = c.view("a")
    assert (v.state, v.finish_reason, v.tokens) == (S.FINISHED, "eos", (4, 5, 6, 9))
    assert c.counters.device_blocks_used == used and c.counters.finished == 0  # step 2 in flight
    assert step_of(c) is None
    report(c, two, {"a": 3})
    v = c.view("a")
    assert (v.state, v.tokens) == (S.RELEASED, (4, 5, 6, 9))
    assert c.counters.dropped_rows == 1 and c.counters.device_blocks_used == 0
    assert step_of(c).released == (0,)


def test_abort_with_two_steps_in_flight_releases_after_both_reports():
    c = make()
    running(c, ("a", [4, 5, 6], 5, {"chain": True}))
    one, two = step_of(c), step_of(c)
    c.finish("a")
    c.check_invariants()
    report(c, one, {"a": 1})
    assert c.view("a").state is S.FINISHED
    report(c, two, {"a": 2})
    v = c.view("a")
    assert (v.state, v.finish_reason, v.tokens) == (S.RELEASED, "abort", (4, 5, 6))
    assert c.counters.dropped_rows == 2 and c.counters.device_blocks_used == 0


def test_chain_must_be_a_bool():
    c = make()
    before = snapshot(c)
    for bad in ("yes", 1, None):
        with pytest.raises(InvalidRequestError):
            c.admit("a", [1, 2], 3, chain=bad)
    assert snapshot(c) == before and c.request_ids() == ()
    c.check_invariants()


@pytest.mark.parametrize("tp", [1, 2])
def test_a_host_tier_request_chains_with_its_backup_in_flight(tp):
    """A host-tier row reads its previous row from the host copy its backup wrote. With one rank
    the reader is the writer (its compute stream waits for its own copies); at TP > 1 a peer finds
    the generation of the previous step's writes by step number (``HostPool.wait_step``), so the
    request chains at once at any TP size. Failed before at TP 2: the request waited for its
    backup to complete on every rank (no chained row while it was in flight)."""
    c = make(dev=1, host=8, ps=2, H=1, tp=tp)
    assert c.admit("a", [3, 4, 5], 6, chain=True).target is T.HOST
    c.apply_landed("a")
    one = step_of(c)
    assert len(one.backups) == 1
    two = step_of(c)
    assert rows(c, two) == [("a", 4, 0, 0)] and len(two.backups) == 1 and two.host_seq == 0
    for rank in range(1, tp):
        apply(c, StepReport(1, rank, completed=tids(one)))
        apply(c, StepReport(2, rank, completed=tids(two)))
    report(c, one, {"a": 7}, completed=True, published=1)
    report(c, two, {"a": 8}, completed=True, published=2)
    assert c.view("a").tokens == (3, 4, 5, 7, 8)


def test_the_reference_worker_lets_a_row_read_the_previous_steps_backup_after_the_step_wait(
        monkeypatch):
    """The reference worker's rule at TP 2: command 2's host reads may see step 1's backup (not
    yet in ``host_seq``) because the peers wait for step 1 by number (``HostPool.wait_step``) at
    their first command after it; with that wait off the same reads are flagged."""
    for waits in (True, False):
        monkeypatch.setattr(ReferenceWorker, "peer_waits_by_step", waits)
        c = make(dev=1, host=8, ps=2, H=1, tp=2)
        w = ReferenceWorker(c.config, random.Random(0))
        w.start("a", [3, 4, 5])
        w.land(c.admit("a", [3, 4, 5], 6, chain=True))
        c.apply_landed("a")
        w.execute(c.take_command())
        two = c.take_command()
        assert two.host_seq == 0 and two.batch[0].prev_row == 0
        w.execute(two)
        assert w.chained_host_rows == 1
        if waits:
            assert w.violations == []
        else:
            assert w.violations and all("written in step 1 read with the peers waited only for "
                                        "step -1" in v for v in w.violations), w.violations


def test_no_chained_row_after_a_command_without_the_request():
    """Its only step in flight must be exactly the previous command (one row a step: the earlier
    request x takes step 3, so a's step 2 is not the previous command of step 4)."""
    c = make(dev=4, host=16, ps=2, H=1, tp=2, max_batch=1)
    assert c.admit("x", [6], 6).target is T.RESIDENT
    c.apply_landed("x")
    assert c.admit("a", [3, 4, 5, 6, 7, 8, 9, 1, 2], 6, chain=True).target is T.HOST  # backups
    c.apply_landed("a")
    one = step_of(c)
    assert rows(c, one) == [("x", 1, 6, -1)]
    two = step_of(c)  # x waits for its token: a's first row
    assert rows(c, two) == [("a", 9, 2, -1)] and len(two.backups) == 1
    report(c, one, {"x": 1})
    three = step_of(c)  # x again, first in line: the batch is full
    assert rows(c, three) == [("x", 2, 1, -1)]
    assert step_of(c) is None  # a's step 2 is not the previous command: no chained row
    report(c, two, {"a": 4})
    assert rows(c, step_of(c))[0] == ("a", 10, 4, -1)


def _page_filled_by_a_chained_row():
    """Host tier, page size 2: step 1 writes position 2 (page 1 row 0), chained step 2 writes
    position 3 (page 1 row 1), both backups completed, no token reported yet."""
    c = make(dev=1, host=8, ps=2, H=1, tp=1)
    c.admit("a", [3, 4, 5], 6, chain=True)  # positions 0, 1 landed: page 0 published
    c.apply_landed("a")
    assert c.counters.published_pages == 1
    one = step_of(c)  # position 2: page 1 row 0
    apply(c, StepReport(1, 0, completed=tids(one), published=1))
    two = step_of(c)  # chained, position 3: page 1 row 1, fed the token of step 1
    assert rows(c, two) == [("a", 4, 0, 0)]
    apply(c, StepReport(2, 0, completed=tids(two), published=2))
    return c, one, two


def test_an_aborted_chained_page_is_not_published():
    """A chained row wrote the last position of a page, fed a token that never arrives (abort):
    the page is never published, though its backup completed."""
    c, one, two = _page_filled_by_a_chained_row()
    assert c.counters.published_pages == 1  # page 1 is backed up, its last token unknown
    c.finish("a")
    c.check_invariants()
    report(c, one, {"a": 1})
    report(c, two, {"a": 1})
    assert c.view("a").state is S.RELEASED and c.view("a").tokens == (3, 4, 5)
    assert c.counters.published_pages == 1 and c.counters.dropped_rows == 2


@pytest.mark.parametrize("prev_row, why", [(None, None), (0, "which is x"), (5, "which is no row")])
def test_the_reference_worker_flags_a_wrong_chain(prev_row, why):
    """The content-checking worker feeds a chained row the token it sampled for ``prev_row`` of
    the command before, and flags one naming another request's row or no row."""
    c = make()
    w = ReferenceWorker(c.config, random.Random(0))
    for rid, prompt in (("x", [1, 2, 3]), ("a", [4, 5, 6])):
        w.start(rid, prompt)
        w.land(c.admit(rid, prompt, 5, chain=True))
        c.apply_landed(rid)
    w.execute(c.take_command())
    cmd = c.take_command()
    assert [(r.handle, r.prev_row) for r in cmd.batch] == [(0, 0), (1, 1)]
    if prev_row is not None:
        forged = msgspec.structs.replace(cmd.batch[1], prev_row=prev_row)
        cmd = msgspec.structs.replace(cmd, batch=(cmd.batch[0], forged))
    w.execute(cmd)
    if why is None:
        assert w.violations == []
    else:
        assert len(w.violations) == 1 and why in w.violations[0], w.violations


def test_a_page_a_chained_row_completed_is_published_once_its_tokens_are_known():
    """The backup of a chained row that fills a page may complete before the token it was fed
    arrives: the page is published when that token arrives."""
    c, one, two = _page_filled_by_a_chained_row()
    assert c.counters.published_pages == 1  # page 1's last token is not known yet
    report(c, one, {"a": 7})
    assert c.counters.published_pages == 2
    report(c, two, {"a": 8})
    c.finish("a")
    follow = c.admit("b", [3, 4, 5, 7, 1], 1)  # a's prompt and first token: two pages reused
    assert [p.reused for p in follow.pages][:2] == [True, True]
    c.check_invariants()
