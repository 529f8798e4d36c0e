"""A reference worker in pure Python: executes StepCommands against a content model (pure ring).

It plays every TP rank of the worker side of the protocol, for property tests and the soak run:
block tables from diffs alone, page transfers run in stream order (when the command is
processed), the forward reads every position ``< n-1`` from the row its table names and checks it
holds that position's KV, then writes the newest row; backups copy it to host. A row's "KV" is a
chained hash of the tokens up to it, so a stale, overwritten or wrongly shared row is detected.
Acks are released later, at random, per rank, out of order (``report``).
"""

from __future__ import annotations

import random

from hisparse_ray.config import CoordinatorConfig
from hisparse_ray.types import (
    NO_BLOCK, Admission, LandingTarget, Rank, StepCommand, StepReport, TransferKind,
)


class ReferenceWorker:
    """Worker-side model of all ranks. ``violations`` lists every broken contract it observed."""

    def __init__(self, config: CoordinatorConfig, rng: random.Random, vocab: int = 3) -> None:
        self.cfg, self.rng, self.vocab = config, rng, vocab
        self.ps = config.page_size
        self.device: dict[tuple[int, int], int] = {}
        self.host: dict[tuple[int, int], int] = {}
        self.tables: dict[str, dict[int, tuple[int, int]]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.vals: dict[str, list[int]] = {}
        self.acks: list[dict[int, str]] = [dict() for _ in range(config.tp_size)]
        self.due: dict[int, list[tuple[str, int]]] = {}
        self.steps: list[int] = []
        self.violations: list[str] = []

    def _value(self, rid: str, p: int) -> int:
        vals, toks = self.vals[rid], self.tokens[rid]
        while len(vals) <= p:
            vals.append(hash((vals[-1] if vals else 0, toks[len(vals)])))
        return vals[p]

    def _bad(self, msg: str) -> None:
        self.violations.append(msg)

    def start(self, rid: str, prompt: list[int]) -> None:
        self.tokens[rid] = list(prompt)
        self.vals[rid] = []

    def land(self, adm: Admission) -> None:
        """Write (or, for reused host pages, verify) positions ``0..num_positions-1``."""
        rid = adm.request_id
        for lp in adm.pages:
            for off in range(self.ps):
                p = lp.page * self.ps + off
                if p >= adm.num_positions:
                    break
                v = self._value(rid, p)
                if lp.reused:
                    if adm.target is LandingTarget.HOST and self.host.get((lp.host_block, off)) != v:
                        self._bad(f"{rid}: reused host block {lp.host_block} row {off} is stale")
                elif lp.device_block != NO_BLOCK:
                    self.device[(lp.device_block, off)] = v
                else:
                    self.host[(lp.host_block, off)] = v

    def execute(self, cmds: tuple[StepCommand, ...]) -> None:
        if len(cmds) != self.cfg.tp_size or [c.rank for c in cmds] != list(range(self.cfg.tp_size)):
            self._bad(f"expected one command per rank, got ranks {[c.rank for c in cmds]}")
            return
        c = cmds[0]
        for other in cmds[1:]:
            if (other.step, other.batch, other.table_diffs, other.transfers, other.backups,
                    other.released) != (c.step, c.batch, c.table_diffs, c.transfers, c.backups,
                                        c.released):
                self._bad(f"step {c.step}: rank {other.rank} command differs from rank 0")
        self.steps.append(c.step)
        for d in c.table_diffs:
            self.tables.setdefault(d.request_id, {})[d.page] = (d.host_block, d.device_block)
        for t in c.transfers:
            for off in range(self.ps):
                if t.kind is TransferKind.SPILL:
                    self.host[(t.host_block, off)] = self.device.get((t.device_block, off), -1)
                else:
                    self.device[(t.device_block, off)] = self.host.get((t.host_block, off), -1)
            for a in self.acks:
                a[t.transfer_id] = "issued"
        samples: list[tuple[str, int]] = []
        newest: dict[str, int] = {}
        for row in c.batch:
            rid, n = row.request_id, row.seq_len
            table = self.tables.get(rid)
            if table is None:
                self._bad(f"{rid} in a batch before any table diff")
                continue
            if row.input_token != self.tokens[rid][n - 1]:
                self._bad(f"{rid}: input token at {n - 1} is {row.input_token}")
            for p in range(n - 1):
                h, d = table.get(p // self.ps, (NO_BLOCK, NO_BLOCK))
                off = p % self.ps
                got = (self.device.get((d, off)) if d != NO_BLOCK
                       else self.host.get((h, off)) if h != NO_BLOCK else None)
                if got != self._value(rid, p):
                    self._bad(f"step {c.step} {rid}: position {p} (host {h}, device {d}) is wrong")
                    break
            h, d = table.get((n - 1) // self.ps, (NO_BLOCK, NO_BLOCK))
            v = self._value(rid, n - 1)
            if d != NO_BLOCK:
                self.device[(d, (n - 1) % self.ps)] = v
            elif h == NO_BLOCK or len(row.hot_blocks) != self.cfg.hot_blocks_per_request:
                self._bad(f"{rid}: newest position {n - 1} has no resident page and no host tier")
            newest[rid] = n - 1
            tok = self.rng.randrange(self.vocab)
            self.tokens[rid].append(tok)
            samples.append((rid, tok))
        for b in c.backups:
            if newest.get(b.request_id) != b.position:
                self._bad(f"backup of {b.request_id} position {b.position} is not its newest row")
            self.host[(b.host_block, b.offset)] = self._value(b.request_id, b.position)
            for a in self.acks:
                a[b.transfer_id] = "issued"
        for rid in c.released:
            self.tables.pop(rid, None)
        if samples:
            self.due[c.step] = samples

    def report(self, rank: int, p_ack: float = 0.5) -> StepReport | None:
        """One rank's report: a random subset of its acks and (rank 0) one due step's tokens."""
        if not self.steps:
            return None
        step = self.rng.choice(self.steps[-4:])
        sampled: tuple = ()
        if rank == 0 and self.due:
            step = self.rng.choice(sorted(self.due))
            sampled = tuple(self.due.pop(step))
        enq, comp = [], []
        acks = self.acks[rank]
        for tid in list(acks):
            r = self.rng.random()
            if r < p_ack / 2:
                comp.append(tid)
                del acks[tid]
            elif r < p_ack and acks[tid] == "issued":
                enq.append(tid)
                acks[tid] = "enqueued"
        return StepReport(step, Rank(rank), tuple(enq), tuple(comp), sampled)

    def flush(self, rank: int) -> StepReport | None:
        """Report every outstanding ack of ``rank`` completed (and rank 0's due tokens)."""
        if not self.steps:
            return None
        rep = self.report(rank, p_ack=0.0)
        comp = tuple(self.acks[rank])
        self.acks[rank].clear()
        return StepReport(rep.step, rep.rank, (), comp, rep.sampled)
