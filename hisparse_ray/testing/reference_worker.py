"""A reference worker in pure Python: executes StepCommands against a content model (pure ring).

It plays every TP rank of the worker side of the protocol, for property tests and the soak run:
request handles and hot buffers from the commands' diffs alone (a handle must be defined before
it is used and released before it is defined again; a request's first row carries its hot
buffer), block tables from diffs alone, page transfers run in stream order (when the command is
processed), the forward reads every position ``< n-1`` from the row its table names and checks it
holds that position's KV, then writes the newest row; backups copy it to host. A row's "KV" is a
chained hash of the tokens up to it, so a stale, overwritten or wrongly shared row is detected.
Host writes (spills, backups) are rank 0's: each command's writes form the next host-pool
generation (``host_seq`` must name a published one), and with peers (TP > 1) every host read of a
command (restores, the forward) of a row rank 0 wrote in step K is legal only when the peers
waited for a step >= K: a peer waits, at its first command after a step in which rank 0 wrote
the host, for that step by number (``HostPool.wait_step``: the step's IPC event, which covers
every earlier step's copies too), so a row written in an earlier command is legal and one
written in the same command is not (``peer_waits_by_step = False`` turns the wait off: the
checks must then bite). Landed rows are in host memory before the request decodes. Acks are
released later, at random, per rank, out of order (``report``; rank 0's carry the latest
generation). A chained row (``prev_row >= 0``) is fed the token this worker sampled for that
row of the command it executed just before, which must be the previous step and name the same
request; sampled tokens are reported in random step order, but in step order per request.
"""

from __future__ import annotations

import random

from hisparse_ray.config import CoordinatorConfig
from hisparse_ray.types import (
    NO_BLOCK, Admission, BatchRow, LandingTarget, Rank, StepCommand, StepReport, TransferKind,
)


class ReferenceWorker:
    """Worker-side model of all ranks. ``violations`` lists every broken contract it observed."""

    peer_waits_by_step = True  # False: the peers skip HostPool.wait_step (the checks must bite)

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
        self.names: dict[int, str] = {}  # handle -> request id
        self.hot: dict[str, tuple[int, ...]] = {}  # the hot buffer each request was last sent
        self.gen = 0  # host-pool generations published so far (rank 0 writes)
        self.host_step: dict[tuple[int, int], int] = {}  # host row -> rank 0's step that wrote it
        self.wrote_step = -1  # the last executed command's step if rank 0 wrote the host in it
        self.waited = -1  # the latest step the peers waited for (HostPool.wait_step)
        self.chained_host_rows = 0  # chained rows of host-tier requests (their backup in flight)
        # the last executed command's step and, per batch row, (request id, sampled token)
        self.last: tuple[int, list[tuple[str | None, int | None]]] | None = None

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

    def _name(self, c: StepCommand, handle: int) -> str | None:
        rid = self.names.get(handle)
        if rid is None:
            self._bad(f"step {c.step}: handle {handle} used before any command defined it")
        return rid

    def _read_host(self, c: StepCommand, key: tuple[int, int]) -> int | None:
        """A peer's read of host row ``key``: only after the peers waited for the step that wrote
        it, or a later one. With one rank there are no peers: rank 0 reads what it wrote, ordered
        after its own copies (``HiSparseWorker``: the compute stream waits for every copy in
        flight)."""
        if self.cfg.tp_size > 1 and self.host_step.get(key, -1) > self.waited:
            self._bad(f"step {c.step}: host row {key} written in step {self.host_step[key]} read "
                      f"with the peers waited only for step {self.waited}")
        return self.host.get(key)

    def execute(self, c: StepCommand | None) -> None:
        if type(c) is not StepCommand:
            self._bad(f"expected one StepCommand for every rank, got {c!r}")
            return
        if self.steps and c.step != self.steps[-1] + 1:
            self._bad(f"step {c.step} after step {self.steps[-1]}")
        if c.host_seq > self.gen:
            self._bad(f"step {c.step}: host_seq {c.host_seq} was never published ({self.gen})")
        self.steps.append(c.step)
        if self.wrote_step >= 0 and self.peer_waits_by_step:  # a peer's wait_step
            self.waited = max(self.waited, self.wrote_step)
        for h in c.released:
            rid = self.names.pop(h, None)
            if rid is None:
                self._bad(f"step {c.step}: released handle {h} names no request")
            else:
                self.tables.pop(rid, None)
                self.hot.pop(rid, None)
        for d in c.handles:
            if d.handle in self.names:
                self._bad(f"step {c.step}: handle {d.handle} defined while it names "
                          f"{self.names[d.handle]}")
            if d.request_id in self.names.values():
                self._bad(f"step {c.step}: {d.request_id} got a second handle")
            self.names[d.handle] = d.request_id
        wrote = False
        for d in c.table_diffs:
            rid = self._name(c, d.handle)
            if rid is not None:
                self.tables.setdefault(rid, {})[d.page] = (d.host_block, d.device_block)
        for t in c.transfers:
            for off in range(self.ps):
                if t.kind is TransferKind.SPILL:
                    self.host[(t.host_block, off)] = self.device.get((t.device_block, off), -1)
                    self.host_step[(t.host_block, off)] = c.step
                    wrote = True
                else:
                    self.device[(t.device_block, off)] = self._read_host(c, (t.host_block, off))
                    if self.device[(t.device_block, off)] is None:
                        self.device[(t.device_block, off)] = -1
            for a in self.acks:
                a[t.transfer_id] = "issued"
        samples: list[tuple[str, int]] = []
        rows: list[tuple[str | None, int | None]] = []  # per batch row: (request id, token)
        newest: dict[str, int] = {}
        for row in c.batch:
            rid, n = self._name(c, row.handle), row.seq_len
            rows.append((rid, None))
            if rid is None:
                continue
            if row.hot_blocks is not None:
                self.hot[rid] = row.hot_blocks
            elif rid not in self.hot:
                self._bad(f"step {c.step}: {rid}'s first row carries no hot buffer")
            table = self.tables.get(rid)
            if table is None:
                self._bad(f"{rid} in a batch before any table diff")
                continue
            toks = self.tokens[rid]
            if n != len(toks):
                self._bad(f"step {c.step} {rid}: row at seq_len {n}, but it has {len(toks)} "
                          f"tokens (the row must feed its newest one)")
                continue
            inp = self._input(c, row, rid)
            if inp is not None and inp != toks[n - 1]:
                self._bad(f"{rid}: input token at {n - 1} is {inp}, expected {toks[n - 1]}")
            for p in range(n - 1):
                h, d = table.get(p // self.ps, (NO_BLOCK, NO_BLOCK))
                off = p % self.ps
                got = (self.device.get((d, off)) if d != NO_BLOCK
                       else self._read_host(c, (h, off)) if h != NO_BLOCK else None)
                if got != self._value(rid, p):
                    self._bad(f"step {c.step} {rid}: position {p} (host {h}, device {d}) is wrong")
                    break
            h, d = table.get((n - 1) // self.ps, (NO_BLOCK, NO_BLOCK))
            v = self._value(rid, n - 1)
            if d != NO_BLOCK:
                self.device[(d, (n - 1) % self.ps)] = v
            elif h == NO_BLOCK or len(self.hot.get(rid, ())) != self.cfg.hot_blocks_per_request:
                self._bad(f"{rid}: newest position {n - 1} has no resident page and no host tier")
            newest[rid] = n - 1
            tok = self.rng.randrange(self.vocab)
            self.tokens[rid].append(tok)
            samples.append((rid, tok))
            rows[-1] = (rid, tok)
        for b in c.backups:
            rid = self._name(c, b.handle)
            if rid is None:
                continue
            if newest.get(rid) != b.position:
                self._bad(f"backup of {rid} position {b.position} is not its newest row")
            self.host[(b.host_block, b.offset)] = self._value(rid, b.position)
            self.host_step[(b.host_block, b.offset)] = c.step
            wrote = True
            for a in self.acks:
                a[b.transfer_id] = "issued"
        if wrote:
            self.gen += 1
        self.wrote_step = c.step if wrote else -1
        backed = {b.handle for b in c.backups}
        self.chained_host_rows += sum(r.prev_row >= 0 and r.handle in backed for r in c.batch)
        if samples:
            self.due[c.step] = samples
        self.last = (c.step, rows)

    def _input(self, c: StepCommand, row: BatchRow, rid: str) -> int | None:
        """The token a row feeds: its ``input_token``, or for a chained row the token this worker
        sampled for row ``prev_row`` of the command it executed just before (None, with the
        violation recorded, when that row is not the same request's row of step ``c.step - 1``).
        ``tokens[rid]`` runs ahead of the coordinator by the tokens still in ``due``: an unchained
        row must have none due (its input is a reported token), a chained one exactly step
        ``c.step - 1``'s (one step ahead, never two)."""
        due = [s for s in sorted(self.due) if any(r == rid for r, _ in self.due[s])]
        if row.prev_row < 0:
            if due:  # its newest token is one the coordinator has not received yet
                self._bad(f"step {c.step} {rid}: unchained row with the tokens of steps {due} "
                          f"not reported")
            return row.input_token
        if due != [c.step - 1]:  # one step ahead, never two (nor a known token's row chained)
            self._bad(f"step {c.step} {rid}: chained row with the tokens of steps {due} due")
        if row.input_token != 0:
            self._bad(f"step {c.step} {rid}: chained row carries input token {row.input_token}")
        if self.last is None or self.last[0] != c.step - 1:
            self._bad(f"step {c.step} {rid}: chained row, but the previous command executed was "
                      f"{None if self.last is None else self.last[0]}")
            return None
        prev = self.last[1]
        if not 0 <= row.prev_row < len(prev) or prev[row.prev_row][0] != rid:
            who = prev[row.prev_row][0] if 0 <= row.prev_row < len(prev) else "no row"
            self._bad(f"step {c.step} {rid}: chained to row {row.prev_row} of step {c.step - 1}, "
                      f"which is {who}")
            return None
        return prev[row.prev_row][1]

    def report(self, rank: int, p_ack: float = 0.5) -> StepReport | None:
        """One rank's report: a random subset of its acks and (rank 0) one due step's tokens."""
        if not self.steps:
            return None
        step = self.rng.choice(self.steps[-4:])
        sampled: tuple = ()
        if rank == 0 and self.due:
            step = self.rng.choice(self._reportable())
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
        return StepReport(step, Rank(rank), tuple(enq), tuple(comp), sampled,
                          published=self.gen if rank == 0 else 0)

    def _reportable(self) -> list[int]:
        """Due steps with no request that has an earlier step due (a request's tokens arrive in
        step order; the oldest due step always qualifies)."""
        out: list[int] = []
        earlier: set[str] = set()
        for step in sorted(self.due):
            rids = {rid for rid, _ in self.due[step]}
            if not rids & earlier:
                out.append(step)
            earlier |= rids
        return out

    def flush(self, rank: int) -> StepReport | None:
        """Report every outstanding ack of ``rank`` completed (and rank 0's due tokens)."""
        if not self.steps:
            return None
        rep = self.report(rank, p_ack=0.0)
        comp = tuple(self.acks[rank])
        self.acks[rank].clear()
        return StepReport(rep.step, rep.rank, (), comp, rep.sampled, published=rep.published)
