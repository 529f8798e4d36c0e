"""RecordBook, the coordinator's request records from submit until a front end takes them: a
hypothesis state machine drives random submits, finishes, discards, takes (by id and by prefix,
with limits) and forgets, against a plain model, checking the invariants after every step."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hisparse_ray.core.records import RecordBook, RequestRecord
from hisparse_ray.errors import DuplicateRequestError, StateError, UnknownRequestError

IDS = [f"{p}{i}" for p in ("a-", "b-") for i in range(6)]


def _rec(rid: str) -> RequestRecord:
    return RequestRecord(rid, 3, 2, 0.0)


class Book(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.memory = 3
        self.book = RecordBook(memory=self.memory)
        self.flight: set[str] = set()
        self.done: list[str] = []  # finish order
        self.discarded: set[str] = set()
        self.gone: list[str] = []  # dropped, oldest first (model of the bounded memory)
        self.handed: set[str] = set()

    def _dropped(self, rid: str) -> None:
        self.gone.append(rid)
        self.gone = self.gone[-self.memory:]

    @rule(rid=st.sampled_from(IDS))
    def add(self, rid):
        known = rid in self.flight or rid in self.done or rid in self.gone
        if known:
            with pytest.raises(DuplicateRequestError):
                self.book.add(_rec(rid))
        else:
            self.book.add(_rec(rid))  # an id forgotten by the bounded memory comes back new:
            self.flight.add(rid)
            self.discarded.discard(rid)  # nothing of its earlier life applies
            self.handed.discard(rid)

    @precondition(lambda self: self.flight)
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from(sorted(self.flight)))
        self.book[rid].finished = 1.0
        self.book.finished(rid)
        self.flight.discard(rid)
        if rid in self.discarded:
            self._dropped(rid)
        else:
            self.done.append(rid)

    @precondition(lambda self: self.flight or self.done)
    @rule(data=st.data())
    def discard(self, data):
        rid = data.draw(st.sampled_from(sorted(self.flight | set(self.done))))
        self.book.discard(rid)
        if rid in self.done:
            self.done.remove(rid)
            self._dropped(rid)
        else:
            self.discarded.add(rid)

    @rule(prefix=st.sampled_from(["", "a-", "b-", "zz"]), limit=st.integers(1, 4))
    def take_prefix(self, prefix, limit):
        want = [r for r in self.done if r.startswith(prefix)][:limit]
        assert self.book.ready(None, prefix) == bool(want)
        got = [rec.request_id for rec in self.book.take(None, prefix, limit)]
        assert got == want
        self._handed(got)

    @rule(ids=st.lists(st.sampled_from(IDS), max_size=4, unique=True), limit=st.integers(1, 4))
    def take_ids(self, ids, limit):
        want = [r for r in ids if r in self.done][:limit]
        assert self.book.ready(ids, "") == bool(want)
        got = [rec.request_id for rec in self.book.take(ids, "", limit)]
        assert got == want
        self._handed(got)

    def _handed(self, got):
        assert not set(got) & self.handed, "a done request was handed over twice"
        self.handed |= set(got)
        for rid in got:
            self.done.remove(rid)
            self._dropped(rid)

    @rule(ids=st.lists(st.sampled_from(IDS), max_size=3, unique=True))
    def forget(self, ids):
        bad = next((r for r in ids if r not in self.done), None)  # the first id it refuses
        if bad is not None and bad not in self.flight:
            with pytest.raises(UnknownRequestError):
                self.book.forget(ids)
        elif bad is not None:
            with pytest.raises(StateError, match="not done"):
                self.book.forget(ids)
        else:
            assert self.book.forget(ids) == len(ids)
            for rid in ids:
                self.done.remove(rid)
                self._dropped(rid)

    @invariant()
    def matches_the_model(self):
        self.book.check()
        assert set(self.book) == self.flight | set(self.done)
        assert self.book.in_flight == len(self.flight)
        assert all(self.book.is_done(r) for r in self.done)
        assert all(not self.book.is_new(r) for r in self.gone)


Book.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_record_book = Book.TestCase


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="memory"):
        RecordBook(memory=-1)
    with pytest.raises(ValueError, match="limit"):
        RecordBook().take(None, "", 0)
