"""Pure-torch twin of every resolver kernel (ring 2): the oracle, on CPU or GPU.

Same signatures and semantics as ``kernels/cuda.py``; clarity over speed (Python loops per row,
fine for tests up to H ~ 512 on a CPU). The contract is docs/architecture.md, "The resolver
contract". Unlike the CUDA launcher it always checks the data preconditions.
"""

from __future__ import annotations

import torch

from hisparse_ray.kernels._contract import (
    DEFAULT_BLOCK_THREADS,
    _fail,
    check_copy_index,
    check_kv_pair,
    check_resolve_args,
    check_resolve_preconditions,
    check_rows_in_range,
    check_views,
)


def _resolve_row(
    positions: list[int], n: int, slot_pos: list[int], lru: list[int], slot_rows: list[int],
    resident: list[int], host: list[int], page_size: int,
) -> tuple[list[int], list[tuple[int, int]]]:
    """One batch row (n > 0); mutates slot_pos and lru (lists). Returns out rows and the plan."""
    h = len(slot_pos)
    out = [-1] * len(positions)
    plan = [(-1, -1)] * len(positions)
    pending: list[int] = []  # top-k indices that need the hot buffer
    for j, p in enumerate(positions):
        if p < 0:
            continue
        blk = resident[p // page_size]
        if blk >= 0:  # 1. resident page
            out[j] = blk * page_size + p % page_size
        elif p == n - 1:  # 2. newest token
            out[j] = slot_rows[h] if n > h else slot_rows[n - 1]
        elif n <= h:  # 3. short sequence: slot p holds position p
            out[j] = slot_rows[p]
        else:
            pending.append(j)
    if n <= h:
        slot_pos[:n] = range(n)
        return out, plan
    where = {q: s for s, q in enumerate(slot_pos) if q >= 0}
    hits = [j for j in pending if positions[j] in where]  # 4. all hits first
    misses = [j for j in pending if positions[j] not in where]
    hit_slots = {where[positions[j]] for j in hits}
    evictable = [s for s in lru if s not in hit_slots]  # oldest first
    victims, untouched = evictable[: len(misses)], evictable[len(misses):]
    for j in hits:
        out[j] = slot_rows[where[positions[j]]]
    for j, v in zip(misses, victims):  # 5. misses take the LRU non-hit slots
        p = positions[j]
        slot_pos[v] = p
        out[j] = slot_rows[v]
        plan[j] = (host[p // page_size] * page_size + p % page_size, slot_rows[v])
    lru[:] = untouched + victims + [where[positions[j]] for j in hits]
    return out, plan


def _copy_rows(src_rows: torch.Tensor, dst_rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """dst[..., dst_rows[i], :] = src[..., src_rows[i], :] for src_rows[i] >= 0 (1-D index tensors)."""
    keep = src_rows >= 0
    s = src_rows[keep].long()
    d = dst_rows[keep].long()
    if s.numel() == 0:
        return
    rows = src.index_select(-2, s.to(src.device))
    dst.index_copy_(-2, d.to(dst.device), rows.to(dst.device))


def resolve(
    top_k: torch.Tensor,
    seq_lens: torch.Tensor,
    state_idx: torch.Tensor,
    slot_pos: torch.Tensor,
    lru: torch.Tensor,
    slot_rows: torch.Tensor,
    resident_table: torch.Tensor,
    host_table: torch.Tensor,
    host_kv: torch.Tensor,
    device_kv: torch.Tensor,
    out_rows: torch.Tensor,
    plan: torch.Tensor | None = None,
    *,
    page_size: int,
    block_threads: int = DEFAULT_BLOCK_THREADS,
    debug: bool | None = None,
    cluster: int | str | None = None,
    phase_a: str | None = None,
) -> None:
    """Map each selected position to a device row, copying misses host -> device.

    Shapes and dtypes (all int32 unless said; every tensor but host_kv on device_kv's device):
    top_k [B, K] (-1 = padding); seq_lens [B] int32/int64 (0 = padded row); state_idx [B];
    slot_pos, lru [S, H] (in place); slot_rows [B, H+1]; resident_table, host_table [B, P];
    host_kv [host_rows, R] uint8; device_kv [device_rows, R] uint8 (in place); out_rows [B, K]
    (out); plan [B, K, 2] (out, optional): (host_row, device_row) per miss copy, else (-1, -1).
    Requires K <= H. ``block_threads`` (CUDA threads per block) and ``debug`` are validated and
    otherwise ignored here: the reference always checks the data preconditions; ``cluster``
    (the CUDA twin's blocks per row) and ``phase_a`` (its long path's variant) are ignored.
    """
    b, k, h = check_resolve_args(
        top_k, seq_lens, state_idx, slot_pos, lru, slot_rows, resident_table, host_table,
        host_kv, device_kv, out_rows, plan, page_size, block_threads,
    )
    check_resolve_preconditions(
        top_k, seq_lens, state_idx, slot_pos, lru, resident_table, host_table, page_size
    )
    check_views(slot_rows, resident_table, host_table, page_size, host_kv.shape[0], device_kv.shape[0])
    if b == 0:
        return
    tk, lens, sidx = top_k.tolist(), seq_lens.tolist(), state_idx.tolist()
    srows, rtab, htab = slot_rows.tolist(), resident_table.tolist(), host_table.tolist()
    out_all = [[-1] * k for _ in range(b)]
    plan_all = [[(-1, -1)] * k for _ in range(b)]
    for r in range(b):
        n = lens[r]
        if n == 0:
            continue
        s = sidx[r]
        sp, order = slot_pos[s].tolist(), lru[s].tolist()
        out_all[r], plan_all[r] = _resolve_row(tk[r], n, sp, order, srows[r], rtab[r], htab[r], page_size)
        slot_pos[s] = torch.tensor(sp, dtype=torch.int32)
        lru[s] = torch.tensor(order, dtype=torch.int32)
    out_rows.copy_(torch.tensor(out_all, dtype=torch.int32).view(b, k))
    plan_t = torch.tensor(plan_all, dtype=torch.int32).view(b, k, 2)
    check_rows_in_range("plan (host rows)", plan_t[..., 0], host_kv.shape[0])
    check_rows_in_range("plan (device rows)", plan_t[..., 1], device_kv.shape[0])
    _copy_rows(plan_t[..., 0].reshape(-1), plan_t[..., 1].reshape(-1), host_kv, device_kv)
    if plan is not None:
        plan.copy_(plan_t)


def replay(
    plan: torch.Tensor, host_kv: torch.Tensor, device_kv: torch.Tensor, *, debug: bool | None = None
) -> None:
    """Apply a recorded plan [B, K, 2] int32 (on device_kv's device) to another layer's views:
    device_kv[plan[..., 1]] = host_kv[plan[..., 0]] wherever plan[..., 0] >= 0.
    host_kv [host_rows, R] uint8, device_kv [device_rows, R] uint8 (in place)."""
    check_copy_index("plan", plan, 3)
    if plan.shape[-1] != 2:
        _fail(f"plan must be [B, K, 2], got {tuple(plan.shape)}")
    check_kv_pair("host_kv", host_kv, "device_kv", device_kv, 2)
    src, dst = plan[..., 0].reshape(-1), plan[..., 1].reshape(-1)
    _check_pairs(src, dst, host_kv.shape[0], device_kv.shape[0], "plan")
    _copy_rows(src, dst, host_kv, device_kv)


def backup(
    src_rows: torch.Tensor,
    dst_rows: torch.Tensor,
    device_kv: torch.Tensor,
    host_kv: torch.Tensor,
    *,
    debug: bool | None = None,
) -> None:
    """Eager backup of the newest tokens, every layer: host_kv[l, dst_rows[i]] =
    device_kv[l, src_rows[i]] for all l and every i with src_rows[i] >= 0.
    src_rows, dst_rows [N] int32 (on device_kv's device); device_kv [L, device_rows, R] uint8;
    host_kv [L, host_rows, R] uint8 (pinned for the CUDA backend; in place)."""
    check_copy_index("src_rows", src_rows, 1)
    check_copy_index("dst_rows", dst_rows, 1)
    if src_rows.shape != dst_rows.shape:
        _fail(f"src_rows {tuple(src_rows.shape)} and dst_rows {tuple(dst_rows.shape)} differ")
    check_kv_pair("device_kv", device_kv, "host_kv", host_kv, 3)
    _check_pairs(src_rows, dst_rows, device_kv.shape[1], host_kv.shape[1], "backup")
    _copy_rows(src_rows, dst_rows, device_kv, host_kv)


def _check_pairs(src: torch.Tensor, dst: torch.Tensor, src_limit: int, dst_limit: int, what: str) -> None:
    keep = src >= 0
    if bool((dst[keep] < 0).any()):
        _fail(f"{what}: an entry has a source row but no destination row")
    check_rows_in_range(f"{what} (source rows)", src, src_limit)
    check_rows_in_range(f"{what} (destination rows)", dst[keep], dst_limit)
    d = dst[keep]
    if d.unique().numel() != d.numel():
        _fail(f"{what}: two entries write the same destination row")
