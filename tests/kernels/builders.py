"""Consistent resolver inputs for tests: every hot slot, resident row and newest row on the device
holds the bytes of the position it stands for (host row content), so a test can check that each
selected position's out row holds that position's bytes after a resolve."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import torch


@dataclass
class Case:
    top_k: torch.Tensor
    seq_lens: torch.Tensor
    state_idx: torch.Tensor
    slot_pos: torch.Tensor
    lru: torch.Tensor
    slot_rows: torch.Tensor
    resident_table: torch.Tensor
    host_table: torch.Tensor
    host_kv: torch.Tensor
    device_kv: torch.Tensor
    page_size: int

    def args(self, out_rows: torch.Tensor, plan: torch.Tensor | None = None) -> tuple:
        return (self.top_k, self.seq_lens, self.state_idx, self.slot_pos, self.lru, self.slot_rows,
                self.resident_table, self.host_table, self.host_kv, self.device_kv, out_rows, plan)

    def clone_state(self) -> "Case":
        """Independent slot_pos, lru and device_kv (inputs and host_kv shared)."""
        return replace(self, slot_pos=self.slot_pos.clone(), lru=self.lru.clone(),
                       device_kv=self.device_kv.clone())

    def to(self, device: str, pin: bool = False) -> "Case":
        host = self.host_kv.pin_memory() if pin else self.host_kv
        moved = {k: getattr(self, k).to(device) for k in
                 ("top_k", "seq_lens", "state_idx", "slot_pos", "lru", "slot_rows",
                  "resident_table", "host_table", "device_kv")}
        return replace(self, host_kv=host, **moved)

    def host_row(self, b: int, p: int) -> int:
        ps = self.page_size
        return int(self.host_table[b, p // ps]) * ps + p % ps

    def write_row(self, b: int, n: int) -> int:
        """Device row the forward writes position n-1 to (resident, else newest slot)."""
        ps, h = self.page_size, self.slot_pos.shape[1]
        p = n - 1
        blk = int(self.resident_table[b, p // ps])
        if blk >= 0:
            return blk * ps + p % ps
        return int(self.slot_rows[b, h if n > h else n - 1])

    def write_newest(self) -> None:
        """Emulate the forward: put the newest position's bytes in its write row."""
        for b, n in enumerate(self.seq_lens.tolist()):
            if n > 0:
                self.device_kv[self.write_row(b, n)] = self.host_kv[self.host_row(b, n - 1)].to(
                    self.device_kv.device)


def make_case(
    rng: random.Random, *, batch: int, k: int, h: int, seq_lens: list[int], page_size: int,
    row_bytes: int, hit_frac: float = 0.5, resident_frac: float = 0.1, pad_frac: float = 0.1,
    max_len: int | None = None, host_blocks: int = 64, extra_states: int = 1,
    lens_dtype: torch.dtype = torch.int32, fill_ratio: float = 0.9,
) -> Case:
    """A CPU case. seq_lens[b] == 0 makes a padded row. Long rows (n > h) get a hot buffer with
    about fill_ratio*h cached positions; their top-k mixes padding, the newest, hits (hit_frac)
    and misses. ``max_len`` sizes the page tables (defaults to max(seq_lens) + page_size)."""
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    max_len = max_len or max(seq_lens) + page_size
    pages = -(-max_len // page_size)
    s_total = batch + extra_states
    state_idx = rng.sample(range(s_total), batch)
    slot_pos = torch.full((s_total, h), -1, dtype=torch.int32)
    lru = torch.stack([torch.randperm(h, generator=gen) for _ in range(s_total)]).int()
    resident = torch.full((batch, pages), -1, dtype=torch.int32)
    n_res = 0
    for b in range(batch):
        for pg in range(pages):
            if rng.random() < resident_frac:
                resident[b, pg] = n_res
                n_res += 1
    host_table = torch.randint(0, host_blocks, (batch, pages), generator=gen, dtype=torch.int32)
    base = n_res * page_size
    slot_rows = (torch.randperm(batch * (h + 1), generator=gen).int() + base).view(batch, h + 1)
    host_kv = torch.randint(0, 256, (host_blocks * page_size, row_bytes), generator=gen,
                            dtype=torch.uint8)
    device_kv = torch.randint(0, 256, (base + batch * (h + 1), row_bytes), generator=gen,
                              dtype=torch.uint8)
    top_k = torch.full((batch, k), -1, dtype=torch.int32)
    case = Case(top_k, torch.tensor(seq_lens, dtype=lens_dtype), torch.tensor(state_idx, dtype=torch.int32),
                slot_pos, lru, slot_rows, resident, host_table, host_kv, device_kv, page_size)
    for b, n in enumerate(seq_lens):
        if n == 0:
            top_k[b] = torch.tensor([rng.randrange(-1, 5) for _ in range(k)], dtype=torch.int32)
            continue
        s = state_idx[b]
        if n <= h:
            slot_pos[s, : n - 1] = torch.arange(n - 1, dtype=torch.int32)
            cached = list(range(n - 1))
            chosen = rng.sample(range(n), min(k, n))
        else:
            cached = rng.sample(range(n - 1), min(n - 1, int(h * fill_ratio)))
            slots = rng.sample(range(h), len(cached))
            for q, sl in zip(cached, slots):
                slot_pos[s, sl] = q
            cold = list(set(range(n - 1)) - set(cached))
            want = k - int(pad_frac * k)
            chosen = [n - 1] if rng.random() < 0.5 else []
            n_hit = min(len(cached), int(hit_frac * (want - len(chosen))))
            chosen += rng.sample(cached, n_hit)
            chosen += rng.sample(cold, min(len(cold), want - len(chosen)))
        row = chosen + [-1] * (k - len(chosen))
        rng.shuffle(row)
        top_k[b] = torch.tensor(row, dtype=torch.int32)
        q = slot_pos[s].long()  # hot slots hold their positions' bytes
        held = q >= 0
        hrow = host_table[b, q[held] // page_size].long() * page_size + q[held] % page_size
        device_kv[slot_rows[b].long()[:h][held]] = host_kv[hrow]
        res_pages = (resident[b] >= 0).nonzero().flatten()  # resident pages hold theirs too
        if res_pages.numel():
            off = torch.arange(page_size)
            pos = (res_pages[:, None] * page_size + off).flatten()
            drow = (resident[b, res_pages].long()[:, None] * page_size + off).flatten()
            device_kv[drow] = host_kv[host_table[b, pos // page_size].long() * page_size + pos % page_size]
    case.write_newest()
    return case


def next_step(rng: random.Random, case: Case, overlap: float = 0.4) -> None:
    """Advance every active row by one token (n += 1) and draw a new top-k that keeps about
    ``overlap`` of the previous selection; writes the new newest token's bytes."""
    k = case.top_k.shape[1]
    pages = case.host_table.shape[1]
    lens = case.seq_lens.tolist()
    for b, n in enumerate(lens):
        if n == 0 or n + 1 > pages * case.page_size:
            continue
        n += 1
        lens[b] = n
        prev = [p for p in case.top_k[b].tolist() if 0 <= p < n]
        keep = rng.sample(prev, int(overlap * len(prev)))
        pool = rng.sample(range(n), min(n, 2 * k + 8))
        chosen = list(dict.fromkeys(keep + [n - 1] + pool))[: min(k, n)]
        row = chosen + [-1] * (k - len(chosen))
        rng.shuffle(row)
        case.top_k[b] = torch.tensor(row, dtype=torch.int32)
    case.seq_lens.copy_(torch.tensor(lens, dtype=case.seq_lens.dtype))
    case.write_newest()
