"""StepCodec: the stateful binary codec of the step channel (adapter ring, standard library + the
wire module). The default codec of ``hisparse_ray.channel.ring``.

Why: the per-step control budget at TP 2 is <= 100 us, and pickling ~100 small frozen dataclasses
(even flattened to tuples) costs about that on its own. A ``StepCommand`` becomes one small
header, the request-id definitions and one little-endian int64 block (``struct``), rebuilt with
slot-setting constructors; a ``StepReport`` (plain ints, ids and tuples) is ``marshal``ed.

Command encoding is stateful, one state per channel *direction* (the SPSC ring is ordered and
lossless):
  * Request ids are interned: a message *defines* ``index -> id`` for ids the writer (``dumps``)
    has not sent before (explicitly: the reader (``loads``) never allocates, it only overwrites),
    later messages name the id by index. Ids in ``StepCommand.released`` are forgotten after their
    message (their index is reused); a table over ``max_ids`` entries is dropped wholesale before
    a message.
  * ``BatchRow.hot_blocks`` equal to the request's previous row is sent as "same" and loaded as
    the very tuple loaded last time (one flag when every row of the step is unchanged).
  * TP ranks receive equal commands (rank aside): encoders with equal states share one encoding
    through a small process-wide memo (``_dump_command``), so the coordinator encodes a step once.
  * ``reset()`` forgets the encoder's state (the next message redefines every id it uses and sends
    every hot buffer in full). The channel calls it when a message was encoded but not delivered.
    A reader that failed mid-message refuses further messages (``ChannelError``): never a silent
    misread.
Native hot path: when the optional C module ``hisparse_ray.channel._wire`` is built (``setup.py``;
any C compiler), commands that define no new id are encoded and every command is loaded in C, and a
report of exact builtin types travels as a compact binary layout (``TAG_REPORT_BIN``) instead of
marshal. The command bytes are identical either way; the Python reader reads both report
layouts, so ends with and without the module interoperate. ``HISPARSE_NATIVE_WIRE=0`` (or
``StepCodec(native=False)``) keeps everything in Python. Measured cause: on the H200 these
stages ran 3-5x slower than warm right after a model forward (BENCHMARKS.md, session 5).
Lossless: ``loads(dumps(m)) == m`` with the same types for every message the binary path accepts
(exact ``tuple``s of exact wire types, ``str`` request ids, ints within int64; marshal for reports
refuses anything but exact builtins); anything else, and any other object, falls back to plain
pickle (tagged), so equality always holds.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import marshal
import operator
import struct
from itertools import chain
from typing import Any

from hisparse_ray import types as wire
from hisparse_ray.channel.codec import PickleCodec, slot_constructor
from hisparse_ray.config import env_flag
from hisparse_ray.errors import ChannelError

TAG_FALLBACK, TAG_COMMAND, TAG_REPORT, TAG_REPORT_BIN = 0, 1, 2, 3
_ALL_HOT_SAME = 1  # flags bit: every batch row's hot_blocks equals its previous row's

# tag, flags, step, rank, rows, diffs, transfers, backups, released, defs, hot values
_CMD = struct.Struct("<BBqqIIIIIII")

# The binary layout below is written for exactly these fields; a wire type whose fields differ
# (someone added one) is carried by the fallback until this module learns it (a test says so).
_LAYOUT = {
    wire.StepCommand: ("step", "rank", "batch", "table_diffs", "transfers", "backups", "released"),
    wire.BatchRow: ("request_id", "seq_len", "input_token", "hot_blocks"),
    wire.TableDiff: ("request_id", "page", "host_block", "device_block"),
    wire.PageTransfer: ("transfer_id", "kind", "device_block", "host_block"),
    wire.Backup: ("transfer_id", "request_id", "position", "host_block", "offset"),
    wire.StepReport: ("step", "rank", "enqueued", "completed", "sampled", "hot_hits", "hot_misses",
                      "hits_by_request"),
}


def layout_matches(cls: type) -> bool:
    """Whether ``cls``'s dataclass fields are the ones the binary layout carries."""
    return tuple(f.name for f in dataclasses.fields(cls)) == _LAYOUT[cls]


_COMMAND_OK = all(layout_matches(c) for c in (wire.StepCommand, wire.BatchRow, wire.TableDiff,
                                               wire.PageTransfer, wire.Backup))
_REPORT_OK = layout_matches(wire.StepReport)

_KINDS = tuple(wire.TransferKind)
_KIND_CODE = {k: i for i, k in enumerate(_KINDS)}

_rid_get = operator.attrgetter("request_id")
_row_ints = operator.attrgetter("seq_len", "input_token")
_hot_get = operator.attrgetter("hot_blocks")
_diff_ints = operator.attrgetter("page", "host_block", "device_block")
_xfer_ints = operator.attrgetter("transfer_id", "device_block", "host_block")
_kind_get = operator.attrgetter("kind")
_backup_ints = operator.attrgetter("transfer_id", "position", "host_block", "offset")


def _builder(cls: type):
    """``build(n, *columns) -> tuple`` of ``n`` new ``cls`` objects, field i from column i. For a
    ``slots=True`` class without ``__post_init__``: allocate all, then set one field across all
    objects per pass (C-level loops; ~20 % cheaper than a constructor call per object)."""
    names = _LAYOUT[cls]
    make = slot_constructor(cls, list(names))
    if make is cls:
        return lambda n, *cols: tuple(map(cls, *cols))
    setters = [getattr(cls, f).__set__ for f in names]
    new, repeat, drain = object.__new__, itertools.repeat, collections.deque

    def build(n: int, *cols) -> tuple:
        if not n:
            return ()
        objs = tuple(map(new, repeat(cls, n)))
        for put, col in zip(setters, cols):
            drain(map(put, objs, col), 0)
        return objs
    return build


_rows = _builder(wire.BatchRow)
_diffs = _builder(wire.TableDiff)
_xfers = _builder(wire.PageTransfer)
_backups = _builder(wire.Backup)
_make_cmd = slot_constructor(wire.StepCommand, list(_LAYOUT[wire.StepCommand]))
_make_rep = slot_constructor(wire.StepReport, list(_LAYOUT[wire.StepReport]))
_rep_get = operator.attrgetter(*_LAYOUT[wire.StepReport])
_REPORT_TAG = bytes((TAG_REPORT,))
# TAG_REPORT_BIN: tag, step, rank, hot_hits, hot_misses (int64), then the lengths of enqueued,
# completed, sampled, hits_by_request (uint32); int64 enqueued and completed; per sampled entry
# (uint32 id length, utf-8 id, int64 token); per hits entry (length, id, int64 hits, misses)
_REP_BIN = struct.Struct("<B4q4I")
_U32 = struct.Struct("<I")


def _load_native():
    """The configured C module, or None (not built, switched off, or the wire types changed)."""
    if not env_flag("HISPARSE_NATIVE_WIRE", True) or not (_COMMAND_OK and _REPORT_OK):
        return None
    try:
        from hisparse_ray.channel import _wire
    except ImportError:
        return None
    classes = (wire.BatchRow, wire.TableDiff, wire.PageTransfer, wire.Backup, wire.StepCommand,
               wire.StepReport)
    if any(slot_constructor(c, list(_LAYOUT[c])) is c for c in classes):
        return None  # a class with __post_init__ or without slots: only Python builds it
    try:
        _wire.configure(tuple((c, tuple(getattr(c, f) for f in _LAYOUT[c])) for c in classes),
                        _KINDS)
    except TypeError:
        return None
    return _wire


NATIVE = _load_native()


def _load_report_bin(data) -> wire.StepReport:
    """The Python reader of ``TAG_REPORT_BIN`` (what ``_wire.load_report`` does in C)."""
    _, step, rank, hits, misses, ne, nc, ns, nh = _REP_BIN.unpack_from(data, 0)
    off = _REP_BIN.size
    ints = struct.unpack_from(f"<{ne + nc}q", data, off)
    off += 8 * (ne + nc)
    keyed = []
    for n, width in ((ns, 1), (nh, 2)):
        entries = []
        for _ in range(n):
            (ln,) = _U32.unpack_from(data, off)
            off += 4
            rid = str(data[off:off + ln], "utf-8")
            off += ln
            entries.append((rid, *struct.unpack_from(f"<{width}q", data, off)))
            off += 8 * width
        keyed.append(tuple(entries))
    if off != len(data):
        raise ValueError(f"report of {len(data)} bytes, layout ends at {off}")
    return _make_rep(step, rank, ints[:ne], ints[ne:], keyed[0], hits, misses, keyed[1])


# (max_ids, state token) -> (command, header fields, bytes after the header, state delta, token
# after): lets the encoders of a TP group encode a step once (see StepCodec._dump_command).
_MEMO: dict[tuple[int, int], tuple] = {}
_MEMO_MAX = 64  # a TP group needs one live entry; more only absorbs several groups
_TOKENS = itertools.count(1)


class _Unencodable(Exception):
    """The message has a value the binary layout cannot carry exactly (use the fallback)."""


def _check(items: tuple, cls: type) -> tuple:
    """``items`` itself, if it is an exact tuple of exact ``cls`` instances."""
    if type(items) is not tuple or (items and set(map(type, items)) != {cls}):
        raise _Unencodable
    return items


def _ints(values: tuple) -> tuple:
    if type(values) is not tuple:
        raise _Unencodable
    return values


class StepCodec:
    """Binary codec for ``StepCommand`` / ``StepReport`` (anything else: tagged pickle).

    One instance serves one channel end: its encoder state belongs to the direction it sends on,
    its reader state to the one it receives on (a ``ChannelPair`` end may share one instance for
    both). Never share an instance between two channels sending: use ``fresh()``.
    """

    def __init__(self, max_ids: int = 8192, native: bool | None = None) -> None:
        if max_ids < 1:
            raise ValueError(f"max_ids must be >= 1, got {max_ids}")
        self.max_ids = max_ids
        # the C hot path (None: use it where built); the bytes it writes are Python's own
        self._native = NATIVE if native is None or native else None
        if native and NATIVE is None:
            raise ValueError("native=True, but hisparse_ray.channel._wire is not built or is "
                             "switched off")
        self._fallback = PickleCodec()
        self.reset()
        self._names: list[str | None] = []  # reader: index -> request id
        self._hot_in: list[tuple | None] = []  # reader: index -> last hot_blocks
        self._broken: str | None = None

    def fresh(self) -> StepCodec:
        """A new codec with the same settings and no state (one per channel)."""
        return StepCodec(self.max_ids, self._native is not None)

    @property
    def native(self) -> bool:
        """Whether this codec runs the C hot path."""
        return self._native is not None

    def reset(self) -> None:
        """Forget the encoder state: the next message redefines every id it names."""
        self._ids: dict[str, int] = {}
        self._free: list[int] = []
        self._hot_out: dict[int, tuple] = {}
        self._token = 0  # names the encoder state; every empty state is token 0

    # -- encoding ---------------------------------------------------------------------------------
    def dumps(self, obj: Any) -> bytes:
        cls = type(obj)
        try:
            if cls is wire.StepCommand and _COMMAND_OK:
                return self._dump_command(obj)
            if cls is wire.StepReport and _REPORT_OK:
                if self._native is not None:
                    out = self._native.dump_report(obj)
                    if out is not None:
                        return out
                return self._dump_report(obj)
        except Exception:  # noqa: BLE001 - any value the layout cannot carry: the fallback
            self.reset()  # the failed attempt may have defined ids nobody will receive
        return bytes((TAG_FALLBACK,)) + self._fallback.dumps(obj)

    def _intern(self, groups: tuple) -> tuple[list[int], bool, dict[str, int]]:
        """Plan (no state change): indices of the ids of ``groups`` (each: a tuple of wire
        objects, or of ids), whether the table is dropped first, and the ids to define (id ->
        index: free indices first, most recently freed first)."""
        ids, free = self._ids, self._free
        drop = len(ids) > self.max_ids
        if drop:
            ids, free = {}, []
        get = ids.get
        idx = [*map(get, map(_rid_get, groups[0])), *map(get, map(_rid_get, groups[1])),
               *map(get, map(_rid_get, groups[2])), *map(get, groups[3])]
        new: dict[str, int] = {}
        if None in idx:
            rids = [*map(_rid_get, groups[0]), *map(_rid_get, groups[1]),
                    *map(_rid_get, groups[2]), *groups[3]]
            nfree, base = len(free), len(ids)
            for i, got in enumerate(idx):
                if got is None:
                    rid = rids[i]
                    got = new.get(rid)
                    if got is None:
                        if type(rid) is not str:
                            raise _Unencodable
                        k = len(new)
                        got = free[nfree - 1 - k] if k < nfree else base + k
                        new[rid] = got
                    idx[i] = got
        return idx, drop, new

    def _apply(self, delta: tuple) -> None:
        """Advance the encoder state by a planned message (``drop, new, hot updates,
        released``); the same delta takes an equal state to an equal state."""
        drop, new, hot_updates, released = delta
        if drop:
            self._ids, self._free, self._hot_out = {}, [], {}
        ids, free, hot_out = self._ids, self._free, self._hot_out
        if new:
            ids.update(new)
            del free[max(0, len(free) - len(new)):]
            for i in new.values():
                hot_out.pop(i, None)
        for i, h in hot_updates:
            hot_out[i] = h
        for rid in released:  # forget released ids once their message is sent
            i = ids.pop(rid, None)
            if i is not None:
                free.append(i)
                hot_out.pop(i, None)

    @staticmethod
    def _defs(new: dict[str, int]) -> bytes:
        if not new:
            return b""
        blobs = [s.encode("utf-8", "surrogatepass") for s in new]
        n = len(blobs)
        return struct.pack(f"<{2 * n}I", *new.values(), *map(len, blobs)) + b"".join(blobs)

    def _dump_command(self, cmd: wire.StepCommand) -> bytes:
        """Layout after the header and defs, int64: row ids, (seq_len, input_token) per row,
        [hot lengths, -1 = same], diff ids, (page, host, device) per diff, (id, device, host) per
        transfer, transfer kinds, backup ids, (id, position, host, offset) per backup, released
        ids, hot values.

        TP ranks get equal commands (rank aside) and their encoders, fed the same stream, hold
        equal states: the first encodes, the others find (their state token, an equal command)
        in ``_MEMO`` and only re-pack the header with their rank and replay the state delta."""
        if (cmd.batch == () and cmd.table_diffs == () and cmd.transfers == ()
                and cmd.backups == () and cmd.released == ()):  # an empty step: header only
            return _CMD.pack(TAG_COMMAND, _ALL_HOT_SAME, cmd.step, cmd.rank, 0, 0, 0, 0, 0, 0, 0)
        key = (self.max_ids, self._token)
        hit = _MEMO.get(key)
        if hit is not None:
            prev, head, rest, delta, after = hit
            if (prev.step == cmd.step and prev.batch == cmd.batch
                    and prev.table_diffs == cmd.table_diffs and prev.transfers == cmd.transfers
                    and prev.backups == cmd.backups and prev.released == cmd.released):
                out = _CMD.pack(TAG_COMMAND, head[0], cmd.step, cmd.rank, *head[1:]) + rest
                self._apply(delta)
                self._token = after
                return out
        if self._native is not None and len(self._ids) <= self.max_ids:
            fast = self._native.encode_command(cmd, self._ids, self._hot_out)
            if fast is not None:  # every id known: the same bytes as below, in C
                head, rest, out, hot_updates = fast
                return self._remember(key, cmd, head, rest, (False, {}, hot_updates,
                                                              cmd.released), out)
        batch = _check(cmd.batch, wire.BatchRow)
        diffs = _check(cmd.table_diffs, wire.TableDiff)
        xfers = _check(cmd.transfers, wire.PageTransfer)
        backups = _check(cmd.backups, wire.Backup)
        released = _ints(cmd.released)
        nb, nd, nk = len(batch), len(diffs), len(backups)
        idx, drop, new = self._intern((batch, diffs, backups, released))
        ridx = idx[:nb]
        # hot buffers: "same as this request's previous row" unless changed
        hot_out = {} if drop else self._hot_out
        hots = list(map(_hot_get, batch))
        flags, hot_len, hot_vals, hot_updates = 0, (), [], []
        cached = list(map(hot_out.get, ridx))
        if not new and (all(map(operator.is_, hots, cached))
                        or all(map(operator.eq, hots, cached))):
            flags = _ALL_HOT_SAME
        else:
            hot_len = []
            seen = dict.fromkeys(new.values())  # index -> hot as of this row (new ids: none)
            for i, h in zip(ridx, hots):
                c = seen[i] if i in seen else hot_out.get(i)
                if h is c or h == c:
                    hot_len.append(-1)
                else:
                    if type(h) is not tuple:
                        raise _Unencodable
                    hot_len.append(len(h))
                    hot_vals += h
                    hot_updates.append((i, h))
                    seen[i] = h
        n = 3 * nb + len(hot_len) + 4 * nd + 4 * len(xfers) + 5 * nk + len(released) + len(hot_vals)
        rest = self._defs(new) + struct.pack(
            f"<{n}q", *ridx, *chain.from_iterable(map(_row_ints, batch)), *hot_len,
            *idx[nb:nb + nd], *chain.from_iterable(map(_diff_ints, diffs)),
            *chain.from_iterable(map(_xfer_ints, xfers)),
            *map(_KIND_CODE.__getitem__, map(_kind_get, xfers)),
            *idx[nb + nd:nb + nd + nk], *chain.from_iterable(map(_backup_ints, backups)),
            *idx[nb + nd + nk:], *hot_vals)
        head = (flags, nb, nd, len(xfers), nk, len(released), len(new), len(hot_vals))
        out = _CMD.pack(TAG_COMMAND, flags, cmd.step, cmd.rank, *head[1:]) + rest
        return self._remember(key, cmd, head, rest, (drop, new, hot_updates, released), out)

    def _remember(self, key: tuple, cmd: wire.StepCommand, head: tuple, rest: bytes,
                  delta: tuple, out: bytes) -> bytes:
        """Advance the encoder state by ``delta`` and leave the encoding for the TP group."""
        self._apply(delta)
        after = next(_TOKENS)
        if len(_MEMO) >= _MEMO_MAX:
            _MEMO.clear()
        _MEMO[key] = (cmd, head, rest, delta, after)
        self._token = after
        return out

    @staticmethod
    def _dump_report(rep: wire.StepReport) -> bytes:
        """A report is plain values (ints, str ids, tuples): ``marshal`` (C, exact types or an
        error) beats any Python-level layout; no state."""
        return _REPORT_TAG + marshal.dumps(_rep_get(rep))

    # -- decoding ---------------------------------------------------------------------------------
    def loads(self, data: bytes) -> Any:
        tag = data[0]
        if tag == TAG_FALLBACK:
            return self._fallback.loads(data[1:])
        if self._broken is not None:
            raise ChannelError(f"step codec is out of step after a failed load ({self._broken})")
        try:
            if tag == TAG_COMMAND:
                if self._native is not None:
                    return self._native.load_command(data, self._names, self._hot_in)
                return self._load_command(data)
            if tag == TAG_REPORT_BIN:
                if self._native is not None:
                    return self._native.load_report(data)
                return _load_report_bin(data)
            if tag == TAG_REPORT:
                return self._load_report(data)
            raise ValueError(f"unknown message tag {tag}")
        except Exception as err:
            self._broken = repr(err)
            raise ChannelError(f"unreadable step message: {err!r}") from err

    def _load_defs(self, data: bytes, off: int, n: int) -> int:
        if not n:
            return off
        meta = struct.unpack_from(f"<{2 * n}I", data, off)
        off += 8 * n
        names, hot = self._names, self._hot_in
        need = max(meta[:n]) + 1
        if need > len(names) + n:  # a valid encoder extends its table by one per definition
            raise ValueError(f"request id index {need - 1} defined past the table "
                             f"({len(names)} ids, {n} defined)")
        if need > len(names):
            names.extend([None] * (need - len(names)))
            hot.extend([None] * (need - len(hot)))
        for i, length in zip(meta[:n], meta[n:]):
            names[i] = str(data[off:off + length], "utf-8", "surrogatepass")
            hot[i] = None
            off += length
        return off

    def _load_command(self, data: bytes) -> wire.StepCommand:
        _, flags, step, rank, nb, nd, nt, nk, nr, ndef, nhot = _CMD.unpack_from(data, 0)
        if not (nb or nd or nt or nk or nr or ndef):
            return _make_cmd(step, rank, (), (), (), (), ())
        off = self._load_defs(data, _CMD.size, ndef)
        has_len = not flags & _ALL_HOT_SAME
        n = 3 * nb + (nb if has_len else 0) + 4 * nd + 4 * nt + 5 * nk + nr + nhot
        v = struct.unpack_from(f"<{n}q", data, off) if n else ()
        name = self._names.__getitem__
        hot_in = self._hot_in
        ridx = v[:nb]
        p = 3 * nb
        if has_len:
            hots = []
            q = n - nhot  # hot values sit at the end
            for i, ln in zip(ridx, v[p:p + nb]):
                if ln >= 0:
                    if ln > n - q:
                        raise ValueError("command message shorter than its header says")
                    hot_in[i] = v[q:q + ln]
                    q += ln
                hots.append(hot_in[i])
            p += nb
        else:
            hots = map(hot_in.__getitem__, ridx)
        batch = _rows(nb, map(name, ridx), v[nb:p:2], v[nb + 1:p:2], hots)
        e = p + 4 * nd
        diffs = _diffs(nd, map(name, v[p:p + nd]), v[p + nd:e:3], v[p + nd + 1:e:3],
                       v[p + nd + 2:e:3])
        p, e = e, e + 3 * nt
        xfers = _xfers(nt, v[p:e:3], map(_KINDS.__getitem__, v[e:e + nt]), v[p + 1:e:3],
                       v[p + 2:e:3])
        p = e + nt
        e = p + 5 * nk
        backups = _backups(nk, v[p + nk:e:4], map(name, v[p:p + nk]), v[p + nk + 1:e:4],
                           v[p + nk + 2:e:4], v[p + nk + 3:e:4])
        released = tuple(map(name, v[e:e + nr]))
        return _make_cmd(step, rank, batch, diffs, xfers, backups, released)

    @staticmethod
    def _load_report(data: bytes) -> wire.StepReport:
        return _make_rep(*marshal.loads(memoryview(data)[1:]))
