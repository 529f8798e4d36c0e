"""StepCodec: the stateful flat binary codec of the step channel (adapter ring, standard library +
the wire module). The default codec of ``hisparse_ray.channel``.

Why: the per-step control budget at TP 2 is <= 100 us, and pickling ~100 small frozen dataclasses
(even flattened, ``WireCodec``) costs about that on its own. Here a ``StepCommand`` / ``StepReport``
becomes one small header, the request-id definitions, and one little-endian int64 column block
(``struct``), and is rebuilt column-wise with slot-setting constructors.

Stateful, one instance per channel *direction* (the SPSC ring is ordered and lossless):
  * Request ids are interned: a message *defines* ``index -> id`` for ids the encoder has not sent
    before (explicitly: the decoder never allocates, it only overwrites), later messages name the
    id by index. Ids in ``StepCommand.released`` are forgotten after their message (their index is
    reused); a table over ``max_ids`` entries is dropped wholesale before a message.
  * ``BatchRow.hot_blocks`` equal to the request's previous row is sent as "same" and decoded as
    the very tuple decoded last time (one flag when every row of the step is unchanged).
  * ``reset()`` forgets the encoder's state (the next message redefines every id it uses and sends
    every hot buffer in full). The channel calls it when a message was encoded but not delivered.
    A decoder that failed mid-message refuses further messages (``ChannelError``): never a silent
    misread.
Lossless: ``loads(dumps(m)) == m`` with the same types for every message the binary path accepts
(exact ``tuple``s of exact wire types, ``str`` request ids, ints within int64); anything else,
and any other object, falls back to plain pickle (tagged), so equality always holds.
"""

from __future__ import annotations

import dataclasses
import operator
import struct
from itertools import chain
from typing import Any

from hisparse_ray import types as wire
from hisparse_ray.errors import ChannelError
from hisparse_ray.transfer.codec import PickleCodec, _fast_constructor

TAG_FALLBACK, TAG_COMMAND, TAG_REPORT = 0, 1, 2
_ALL_HOT_SAME = 1  # flags bit: every batch row's hot_blocks equals its previous row's

# tag, flags, step, rank, rows, diffs, transfers, backups, released, defs, hot values
_CMD = struct.Struct("<BBqqIIIIIII")
# tag, flags, step, rank, enqueued, completed, sampled, hits_by_request, hot_hits, hot_misses, defs
_REP = struct.Struct("<BBqqIIIIqqI")

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
_make_row = _fast_constructor(wire.BatchRow, list(_LAYOUT[wire.BatchRow]))
_make_diff = _fast_constructor(wire.TableDiff, list(_LAYOUT[wire.TableDiff]))
_make_xfer = _fast_constructor(wire.PageTransfer, list(_LAYOUT[wire.PageTransfer]))
_make_backup = _fast_constructor(wire.Backup, list(_LAYOUT[wire.Backup]))
_make_cmd = _fast_constructor(wire.StepCommand, list(_LAYOUT[wire.StepCommand]))
_make_rep = _fast_constructor(wire.StepReport, list(_LAYOUT[wire.StepReport]))


class _Unencodable(Exception):
    """The message has a value the binary layout cannot carry exactly (use the fallback)."""


def _check(items: tuple, cls: type) -> tuple:
    """``items`` itself, if it is an exact tuple of exact ``cls`` instances."""
    if type(items) is not tuple or (items and set(map(type, items)) != {cls}):
        raise _Unencodable
    return items


def _pairs(items: tuple, width: int) -> tuple:
    """Transpose a tuple of exact ``width``-tuples (sampled, hits_by_request) into columns."""
    if type(items) is not tuple:
        raise _Unencodable
    if not items:
        return ((),) * width
    if set(map(type, items)) != {tuple} or set(map(len, items)) != {width}:
        raise _Unencodable
    return tuple(zip(*items))


def _ints(values: tuple) -> tuple:
    if type(values) is not tuple:
        raise _Unencodable
    return values


class StepCodec:
    """Binary codec for ``StepCommand`` / ``StepReport`` (anything else: tagged pickle).

    One instance serves one channel end: its encoder state belongs to the direction it sends on,
    its decoder state to the one it receives on (a ``ChannelPair`` end may share one instance for
    both). Never share an instance between two channels sending: use ``fresh()``.
    """

    def __init__(self, max_ids: int = 8192) -> None:
        if max_ids < 1:
            raise ValueError(f"max_ids must be >= 1, got {max_ids}")
        self.max_ids = max_ids
        self._fallback = PickleCodec()
        self.reset()
        self._names: list[str | None] = []  # decoder: index -> request id
        self._hot_in: list[tuple | None] = []  # decoder: index -> last hot_blocks
        self._broken: str | None = None

    def fresh(self) -> StepCodec:
        """A new codec with the same settings and no state (one per channel)."""
        return StepCodec(self.max_ids)

    def reset(self) -> None:
        """Forget the encoder state: the next message redefines every id it names."""
        self._ids: dict[str, int] = {}
        self._free: list[int] = []
        self._hot_out: dict[int, tuple] = {}

    # -- encoding ---------------------------------------------------------------------------------
    def dumps(self, obj: Any) -> bytes:
        cls = type(obj)
        try:
            if cls is wire.StepCommand and _COMMAND_OK:
                return self._dump_command(obj)
            if cls is wire.StepReport and _REPORT_OK:
                return self._dump_report(obj)
        except Exception:  # noqa: BLE001 - any value the layout cannot carry: the fallback
            self.reset()  # the failed attempt may have defined ids nobody will receive
        return bytes((TAG_FALLBACK,)) + self._fallback.dumps(obj)

    def _intern(self, rids: list) -> tuple[list[int], list[int], list[str]]:
        """Indices of ``rids``; defines unknown ones (returned: their indices and ids)."""
        ids = self._ids
        if len(ids) > self.max_ids:
            self.reset()
            ids = self._ids
        idx = list(map(ids.get, rids))
        def_idx: list[int] = []
        def_ids: list[str] = []
        if None in idx:
            for i, got in enumerate(idx):
                if got is not None:
                    continue
                rid = rids[i]
                got = ids.get(rid)
                if got is None:
                    if type(rid) is not str:
                        raise _Unencodable
                    got = self._free.pop() if self._free else len(ids)
                    ids[rid] = got
                    self._hot_out.pop(got, None)
                    def_idx.append(got)
                    def_ids.append(rid)
                idx[i] = got
        return idx, def_idx, def_ids

    @staticmethod
    def _defs(def_idx: list[int], def_ids: list[str]) -> bytes:
        if not def_idx:
            return b""
        blobs = [s.encode("utf-8", "surrogatepass") for s in def_ids]
        n = len(blobs)
        return struct.pack(f"<{2 * n}I", *def_idx, *map(len, blobs)) + b"".join(blobs)

    def _dump_command(self, cmd: wire.StepCommand) -> bytes:
        """Layout after the header and defs, int64: row ids, (seq_len, input_token) per row,
        [hot lengths, -1 = same], diff ids, (page, host, device) per diff, (id, device, host) per
        transfer, transfer kinds, backup ids, (id, position, host, offset) per backup, released
        ids, hot values."""
        batch = _check(cmd.batch, wire.BatchRow)
        diffs = _check(cmd.table_diffs, wire.TableDiff)
        xfers = _check(cmd.transfers, wire.PageTransfer)
        backups = _check(cmd.backups, wire.Backup)
        released = _ints(cmd.released)
        nb, nd, nk = len(batch), len(diffs), len(backups)
        idx, def_idx, def_ids = self._intern([*map(_rid_get, batch), *map(_rid_get, diffs),
                                              *map(_rid_get, backups), *released])
        ridx = idx[:nb]
        # hot buffers: "same as this request's previous row" unless changed
        hot_out = self._hot_out
        hots = list(map(_hot_get, batch))
        flags, hot_len, hot_vals = 0, (), []
        cached = list(map(hot_out.get, ridx))
        if all(map(operator.is_, hots, cached)) or all(map(operator.eq, hots, cached)):
            flags = _ALL_HOT_SAME
        else:
            hot_len = []
            for i, h in zip(ridx, hots):
                c = hot_out.get(i)
                if h is c or h == c:
                    hot_len.append(-1)
                else:
                    if type(h) is not tuple:
                        raise _Unencodable
                    hot_len.append(len(h))
                    hot_vals += h
                    hot_out[i] = h
        n = 3 * nb + len(hot_len) + 4 * nd + 4 * len(xfers) + 5 * nk + len(released) + len(hot_vals)
        body = struct.pack(f"<{n}q", *ridx, *chain.from_iterable(map(_row_ints, batch)), *hot_len,
                           *idx[nb:nb + nd], *chain.from_iterable(map(_diff_ints, diffs)),
                           *chain.from_iterable(map(_xfer_ints, xfers)),
                           *map(_KIND_CODE.__getitem__, map(_kind_get, xfers)),
                           *idx[nb + nd:nb + nd + nk], *chain.from_iterable(map(_backup_ints, backups)),
                           *idx[nb + nd + nk:], *hot_vals)
        head = _CMD.pack(TAG_COMMAND, flags, cmd.step, cmd.rank, nb, nd, len(xfers), nk,
                         len(released), len(def_idx), len(hot_vals))
        out = b"".join((head, self._defs(def_idx, def_ids), body))
        if released:  # forget released ids once their message is encoded
            ids, free = self._ids, self._free
            for rid in released:
                i = ids.pop(rid, None)
                if i is not None:
                    free.append(i)
                    hot_out.pop(i, None)
        return out

    def _dump_report(self, rep: wire.StepReport) -> bytes:
        enq, comp = _ints(rep.enqueued), _ints(rep.completed)
        s_rid, s_tok = _pairs(rep.sampled, 2)
        h_rid, h_hit, h_miss = _pairs(rep.hits_by_request, 3)
        ns, nh = len(s_rid), len(h_rid)
        idx, def_idx, def_ids = self._intern([*s_rid, *h_rid])
        n = len(enq) + len(comp) + 2 * ns + 3 * nh
        body = struct.pack(f"<{n}q", *enq, *comp, *idx[:ns], *s_tok, *idx[ns:], *h_hit, *h_miss)
        head = _REP.pack(TAG_REPORT, 0, rep.step, rep.rank, len(enq), len(comp), ns, nh,
                         rep.hot_hits, rep.hot_misses, len(def_idx))
        return b"".join((head, self._defs(def_idx, def_ids), body))

    # -- decoding ---------------------------------------------------------------------------------
    def loads(self, data: bytes) -> Any:
        tag = data[0]
        if tag == TAG_FALLBACK:
            return self._fallback.loads(data[1:])
        if self._broken is not None:
            raise ChannelError(f"step codec is out of step after a failed decode ({self._broken})")
        try:
            if tag == TAG_COMMAND:
                return self._load_command(data)
            if tag == TAG_REPORT:
                return self._load_report(data)
            raise ValueError(f"unknown message tag {tag}")
        except Exception as err:
            self._broken = repr(err)
            raise ChannelError(f"undecodable step message: {err!r}") from err

    def _load_defs(self, data: bytes, off: int, n: int) -> int:
        if not n:
            return off
        meta = struct.unpack_from(f"<{2 * n}I", data, off)
        off += 8 * n
        names, hot = self._names, self._hot_in
        need = max(meta[:n]) + 1
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
        off = self._load_defs(data, _CMD.size, ndef)
        has_len = not flags & _ALL_HOT_SAME
        n = 3 * nb + (nb if has_len else 0) + 4 * nd + 4 * nt + 5 * nk + nr + nhot
        v = struct.unpack_from(f"<{n}q", data, off)
        name = self._names.__getitem__
        hot_in = self._hot_in
        ridx = v[:nb]
        p = 3 * nb
        if has_len:
            hots = []
            q = n - nhot  # hot values sit at the end
            for i, ln in zip(ridx, v[p:p + nb]):
                if ln >= 0:
                    hot_in[i] = v[q:q + ln]
                    q += ln
                hots.append(hot_in[i])
            p += nb
        else:
            hots = map(hot_in.__getitem__, ridx)
        batch = tuple(map(_make_row, map(name, ridx), v[nb:p:2], v[nb + 1:p:2], hots))
        e = p + 4 * nd
        diffs = tuple(map(_make_diff, map(name, v[p:p + nd]), v[p + nd:e:3], v[p + nd + 1:e:3],
                          v[p + nd + 2:e:3]))
        p, e = e, e + 3 * nt
        xfers = tuple(map(_make_xfer, v[p:e:3], map(_KINDS.__getitem__, v[e:e + nt]),
                          v[p + 1:e:3], v[p + 2:e:3]))
        p = e + nt
        e = p + 5 * nk
        backups = tuple(map(_make_backup, v[p + nk:e:4], map(name, v[p:p + nk]),
                            v[p + nk + 1:e:4], v[p + nk + 2:e:4], v[p + nk + 3:e:4]))
        released = tuple(map(name, v[e:e + nr]))
        return _make_cmd(step, rank, batch, diffs, xfers, backups, released)

    def _load_report(self, data: bytes) -> wire.StepReport:
        _, _, step, rank, ne, nc, ns, nh, hits, misses, ndef = _REP.unpack_from(data, 0)
        off = self._load_defs(data, _REP.size, ndef)
        v = struct.unpack_from(f"<{ne + nc + 2 * ns + 3 * nh}q", data, off)
        name = self._names.__getitem__
        p = ne + nc
        sampled = tuple(zip(map(name, v[p:p + ns]), v[p + ns:p + 2 * ns]))
        p += 2 * ns
        per_req = tuple(zip(map(name, v[p:p + nh]), v[p + nh:p + 2 * nh], v[p + 2 * nh:p + 3 * nh]))
        return _make_rep(step, rank, v[:ne], v[ne:ne + nc], sampled, hits, misses, per_req)
