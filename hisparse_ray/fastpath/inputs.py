"""The fast step's static inputs (ring 2: torch + numpy): every per-step integer the captured
graph reads, in one int32 device buffer, filled from one pinned host staging buffer before each
replay.

Fields (per batch row; a bucket of B rows uses rows ``[:B]`` of each field, which are contiguous
because the buffer is field-major):

============  ========  ==============================================================
field         width     meaning
============  ========  ==============================================================
ids           1         input token (the newest token of the request)
pos           1         its position n - 1
seq_lens      1         n; 0 marks a padded row (inert everywhere)
state         1         the request's state row in the resolver's slot tables
write         1         device row the newest KV row is written to (sink for padding)
index_write   1         index-key pool row the newest key is written to (sink for padding)
from_row      1         -1, or a chained row: the input is ``tokens[from_row]`` of the step
                        before (the step's own output buffer, read before it is overwritten)
slot_rows     H + 1     device row of each hot slot (-1 without a hot buffer)
resident      P         device block of each page (-1 = not resident)
host          P         host block of each page (-1 = none)
index_table   Pi        index-key page of each 64-token page
============  ========  ==============================================================

Per-request tables are copied into a row only when the request (or its table version) in that
row changed since the last step; scalars are written every step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

SCALARS = ("ids", "pos", "seq_lens", "state", "write", "index_write", "from_row")
TABLES = ("slot_rows", "resident", "host", "index_table")


@dataclass(slots=True)
class RowTables:
    """A request's tables as the step reads them (int32 numpy arrays, any length up to the
    field's width; the rest of the row is -1). ``key`` changes whenever any array changes."""

    key: tuple
    slot_rows: np.ndarray
    resident: np.ndarray
    host: np.ndarray
    index_table: np.ndarray


@dataclass(slots=True)
class RowInput:
    """One batch row of a step."""

    token: int
    seq_len: int
    state: int
    write: int
    index_write: int
    tables: RowTables
    from_row: int = -1


class StepInputs:
    """Static int32 inputs for up to ``max_batch`` rows on ``device`` (see the module table).

    ``view(name, B)`` is the device tensor ``[B, width]`` a graph captures; :meth:`fill` writes a
    step's rows (and inert padding up to the bucket) and enqueues the host -> device copy on the
    current stream. On CPU the staging buffer is the device buffer.
    """

    def __init__(self, max_batch: int, hot_slots: int, pages: int, index_pages: int,
                 write_sink: int, index_sink: int, device: torch.device) -> None:
        self.max_batch, self.device = max_batch, torch.device(device)
        self.widths = dict(ids=1, pos=1, seq_lens=1, state=1, write=1, index_write=1, from_row=1,
                           slot_rows=hot_slots, resident=pages, host=pages, index_table=index_pages)
        self.sinks = dict(write=write_sink, index_write=index_sink)
        self.offsets: dict[str, int] = {}
        total = 0
        for name, w in self.widths.items():
            self.offsets[name] = total
            total += max_batch * w
        cuda = self.device.type == "cuda"
        self.staging = torch.zeros(total, dtype=torch.int32, pin_memory=cuda)
        self.buffer = torch.zeros(total, dtype=torch.int32, device=self.device) if cuda else self.staging
        self._np = self.staging.numpy()
        self._keys: list[tuple | None] = [None] * max_batch
        self._copied: torch.cuda.Event | None = None
        for name in TABLES:
            self._host(name)[:] = -1
        for name, sink in self.sinks.items():
            self._host(name)[:, 0] = sink
        self._host("from_row")[:] = -1
        if cuda:
            self.buffer.copy_(self.staging)

    def set_sink(self, name: str, row: int) -> None:
        """Move a write sink (the index pool grew): padded rows write ``row`` from the next fill."""
        self.sinks[name] = row

    def _host(self, name: str) -> np.ndarray:
        o, w = self.offsets[name], self.widths[name]
        return self._np[o: o + self.max_batch * w].reshape(self.max_batch, w)

    def view(self, name: str, batch: int) -> Tensor:
        """Device tensor ``[batch, width]`` (contiguous) of a field; scalars: use ``[:, 0]``."""
        o, w = self.offsets[name], self.widths[name]
        return self.buffer[o: o + batch * w].view(batch, w)

    def fill(self, rows: Sequence[RowInput], bucket: int) -> None:
        """Write ``rows`` into rows ``[:len(rows)]`` and inert padding into ``[len(rows):bucket]``,
        then copy rows ``[:bucket]`` of every field to the device (current stream)."""
        if not len(rows) <= bucket <= self.max_batch:
            raise ValueError(f"{len(rows)} rows do not fit bucket {bucket} (max {self.max_batch})")
        if self._copied is not None:
            self._copied.synchronize()  # the previous copy has read the staging buffer
        sc = {name: self._host(name)[:, 0] for name in SCALARS}
        tab = {name: self._host(name) for name in TABLES}
        for b, r in enumerate(rows):
            sc["ids"][b], sc["pos"][b], sc["seq_lens"][b] = r.token, r.seq_len - 1, r.seq_len
            sc["state"][b], sc["write"][b], sc["index_write"][b] = r.state, r.write, r.index_write
            sc["from_row"][b] = r.from_row
            t = r.tables
            if self._keys[b] != t.key:
                for name in TABLES:
                    a = getattr(t, name)
                    if a.shape[0] > self.widths[name]:
                        raise ValueError(f"{name} of {t.key} has {a.shape[0]} entries, the step "
                                         f"covers {self.widths[name]} (raise max_context)")
                    tab[name][b, : a.shape[0]] = a
                    tab[name][b, a.shape[0]:] = -1
                self._keys[b] = t.key
        for b in range(len(rows), bucket):
            for name in ("ids", "pos", "seq_lens", "state"):
                sc[name][b] = 0
            sc["from_row"][b] = -1
            for name, sink in self.sinks.items():
                sc[name][b] = sink
        if self.device.type != "cuda":
            return
        for name in self.widths:
            o, w = self.offsets[name], self.widths[name]
            self.buffer[o: o + bucket * w].copy_(self.staging[o: o + bucket * w], non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
