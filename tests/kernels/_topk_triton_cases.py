"""Run under ``TRITON_INTERPRET=1`` (``test_topk_triton.py`` starts it in a fresh process, since
the switch must be set before triton is first imported): the Triton top-k against ``select_topk``
on tie-heavy and edge-case rows, both histogram variants, one program per row and split rows
(forced 2, 3 and 7 chunks, and auto), every shape equal to the others bit for bit; exits 1 on a
mismatch. ``python -m tests.kernels._topk_triton_cases [cases] [device]``."""

from __future__ import annotations

import random
import sys

import torch

from hisparse_ray.fastpath.topk import in_position_order
from hisparse_ray.kernels import topk_triton
from hisparse_ray.model.indexer import select_topk

INF = float("inf")
SPLITS = [1, 2, 3, 7, None]  # None: auto (1 below 2 * MIN_CHUNK keys: see big_rows)
VALUES = [-INF, -2.0, -1.0, -0.0, 0.0, 0.0, 0.5, 1.0, 1.0, 3.0, INF, 1e-45, -1e-45, 3e38, -3e38]


def expected(scores: torch.Tensor, k: int, lengths: torch.Tensor | None) -> torch.Tensor:
    """``select_topk``'s set, in ascending position order, ``-1`` last (lengths applied)."""
    s = scores.float()
    if lengths is not None:
        pos = torch.arange(s.shape[1], device=s.device)
        s = s.masked_fill(pos[None] >= lengths.long()[:, None], -INF)
    return in_position_order(select_topk(s, k))


def row_batch(rng: random.Random, device: str) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    B, N = rng.randint(1, 4), rng.choice([1, 2, 7, 63, 64, 65, 300, 1023, 1024, 1025, 2500])
    k = rng.choice([1, 2, 5, 16, 64, 100, 256, 1024, 3000])
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    kind = rng.choice(["values", "mixed", "normal", "relu", "equal", "masked"])
    if kind == "normal":
        s = torch.randn(B, N, generator=g)
    elif kind == "relu":  # what the indexer makes: most keys tied at 0.0
        s = torch.relu(torch.randn(B, N, generator=g) - 1.5)
    elif kind == "equal":
        s = torch.full((B, N), rng.choice([0.0, -0.0, 1.0, -INF, INF]))
    elif kind == "masked":
        s = torch.randn(B, N, generator=g)
        s[:, rng.randint(0, N):] = -INF
    else:
        s = torch.tensor(VALUES)[torch.randint(0, len(VALUES), (B, N), generator=g)]
        if kind == "mixed":
            s = torch.where(torch.rand(B, N, generator=g) < 0.4, torch.randn(B, N, generator=g), s)
    lengths = None
    if rng.random() < 0.5:
        lengths = torch.tensor([rng.randint(0, N + 3) for _ in range(B)],
                               dtype=rng.choice([torch.int32, torch.int64]))
    return s.to(device), k, (lengths.to(device) if lengths is not None else None)


def signed_zero_walls(rng: random.Random, device: str):
    """Positives, then +0.0 and -0.0 shuffled: k-th place inside the zeros (both signs count as
    one value), and just past the positives, the +0.0 count, and all of them."""
    a, b, c = rng.randint(0, 40), rng.randint(0, 700), rng.randint(1, 700)
    s = torch.tensor([1.0 + i for i in range(a)] + [0.0] * b + [-0.0] * c)
    s = s[torch.randperm(len(s), generator=torch.Generator().manual_seed(rng.randrange(2**31)))]
    k = rng.choice([a + 1, a + b, a + b + 1, a + b + c, rng.randint(1, a + b + c)])
    return s[None].to(device), max(k, 1), None


def chunk_ties(rng: random.Random, device: str):
    """One tied value over every chunk (signed zeros when it is 0.0), a few keys above it, more
    below, some ``-inf``: row 0's k-th place inside the tie, so ``rem`` cuts the tie inside a
    later chunk for most splits and the ties of earlier chunks shift every later chunk's slots."""
    B, N = rng.randint(1, 3), rng.randint(1200, 3000)
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    tie = rng.choice([0.0, 1.0, -0.5])
    u = torch.rand(B, N, generator=g)
    s = torch.full((B, N), tie)
    if tie == 0.0:
        s = torch.where(torch.rand(B, N, generator=g) < 0.5, -0.0, s)
    s = torch.where(u < 0.03, tie + 1.0 + torch.rand(B, N, generator=g), s)
    s = torch.where((u >= 0.03) & (u < 0.3), tie - 1.0 - torch.rand(B, N, generator=g), s)
    s = torch.where((u >= 0.3) & (u < 0.35), -INF, s)
    above, tied = int((u[0] < 0.03).sum()), int((u[0] >= 0.35).sum())
    k = above + rng.randint(1, tied)
    return s.to(device), k, None


def short_rows(rng: random.Random, device: str):
    """Rows whose length ends inside the first chunk (later chunks empty), or at 0, beside an all
    ``-inf`` row; k at, above and below the valid count."""
    B, N = rng.randint(2, 4), rng.randint(1500, 3000)
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    s = torch.relu(torch.randn(B, N, generator=g) - 1.0)
    s[rng.randrange(B)] = -INF
    lengths = torch.tensor([rng.choice([0, 1, rng.randint(2, N // 8)]) for _ in range(B)],
                           dtype=rng.choice([torch.int32, torch.int64]))
    k = rng.choice([1, 7, int(lengths.max()), int(lengths.max()) + 5, 300])
    return s.to(device), max(k, 1), lengths.to(device)


def big_rows(rng: random.Random, device: str):
    """Rows long enough for auto splits to split them (above ``2 * MIN_CHUNK`` keys)."""
    B, N = 2, 2 * topk_triton.MIN_CHUNK + rng.randint(1, 3000)
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    s = torch.relu(torch.randn(B, N, generator=g) - 2.0)  # ~2 % positive: the cut in the zeros
    lengths = torch.tensor([N, rng.randint(N // 2, N)], dtype=torch.int32)
    return s.to(device), 2048, lengths.to(device)


def check(case, s, k, lengths, variants, rng, device) -> int:
    """0 when every run (histogram variant, splits) returns ``expected``, the same buffer bit
    for bit, and writes nothing past its row's k slots."""
    if rng.random() < 0.3:  # strided rows: a wider buffer's leading columns
        wide = torch.full((s.shape[0], s.shape[1] + 5), 7.0, device=device)
        wide[:, :s.shape[1]] = s
        s = wide[:, :s.shape[1]]
    want = expected(s, k, lengths)
    first, bad = None, 0
    # one program per row in every histogram variant; each split in one, turn about (lean)
    runs = [(m, 1) for m in variants] + [(variants[(case + i) % len(variants)], splits)
                                         for i, splits in enumerate(SPLITS[1:])]
    for masked, splits in runs:
        dtype = rng.choice([torch.int32, torch.int64])
        buf = torch.full((s.shape[0], k + 3), 99, dtype=dtype, device=device)
        out = buf[:, :k]  # the sentinel columns after each row must stay 99
        got = topk_triton.select_positions(s, k, lengths=lengths, out=out,
                                           masked_hist=masked, splits=splits)
        first = buf.long() if first is None else first
        if (got.data_ptr() != out.data_ptr() or not torch.equal(got.long(), want)
                or not bool((buf[:, k:] == 99).all()) or not torch.equal(buf.long(), first)):
            bad += 1
            print(f"case {case} (masked_hist={masked}, splits={splits}): shape "
                  f"{tuple(s.shape)} k {k} lengths {lengths}\n got  {buf.tolist()}\n"
                  f" want {want.tolist()}")
    return bad


def main(cases: int = 150, device: str = "cpu") -> int:
    rng = random.Random(20261201)
    variants = [True, False] if topk_triton._masked_hist() else [False]
    bad = 0
    makers = [row_batch, chunk_ties, row_batch, signed_zero_walls, row_batch, short_rows,
              row_batch, signed_zero_walls]
    for case in range(cases):
        s, k, lengths = (big_rows if case == cases - 1 else makers[case % 8])(rng, device)
        bad += check(case, s, k, lengths, variants, rng, device)
    print(f"{cases} cases x {len(variants)} histogram variants x splits {SPLITS}: "
          f"{bad} mismatches")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(*(int(a) if i == 0 else a for i, a in enumerate(sys.argv[1:]))))
