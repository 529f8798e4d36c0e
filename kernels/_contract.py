"""Argument checks shared by both resolver backends (ring 2: torch only).

``check_*_args`` validate shape, dtype, device and contiguity (no device sync, safe inside a CUDA
graph capture); ``check_resolve_preconditions`` validates the data (distinct positions in range,
state, page tables) and reads tensors back to the host: the reference always runs it, the CUDA
launcher only in debug mode. Every failure raises ``KernelPreconditionError``.
"""

from __future__ import annotations

import torch

from hisparse_ray.config import MAX_BLOCK_THREADS, MIN_BLOCK_THREADS
from hisparse_ray.errors import KernelPreconditionError

DEFAULT_BLOCK_THREADS = 1024  # fastest phase A on the H200 (BENCHMARKS.md)


def _fail(msg: str) -> None:
    raise KernelPreconditionError(msg)


def _tensor(name: str, t: object, ndim: int, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        _fail(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        _fail(f"{name} must have dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if not t.is_contiguous():
        _fail(f"{name} must be contiguous")
    return t


def _same_device(device: torch.device, **named: torch.Tensor) -> None:
    for name, t in named.items():
        if t.device != device:
            _fail(f"{name} is on {t.device}, expected {device} (the device of device_kv)")


def check_block_threads(block_threads: int) -> None:
    if (
        isinstance(block_threads, bool)
        or not isinstance(block_threads, int)
        or not MIN_BLOCK_THREADS <= block_threads <= MAX_BLOCK_THREADS
        or block_threads % 32
    ):
        _fail(
            f"block_threads={block_threads!r} must be a multiple of 32 in "
            f"[{MIN_BLOCK_THREADS}, {MAX_BLOCK_THREADS}]"
        )


def check_kv_pair(src_name: str, src: object, dst_name: str, dst: object, ndim: int) -> int:
    """Both KV views uint8, ``ndim`` dims, contiguous, the same row size; returns row_bytes."""
    _tensor(src_name, src, ndim, (torch.uint8,))
    _tensor(dst_name, dst, ndim, (torch.uint8,))
    if src.shape[-1] != dst.shape[-1]:
        _fail(f"{src_name} rows ({src.shape[-1]} B) and {dst_name} rows ({dst.shape[-1]} B) differ")
    if ndim == 3 and src.shape[0] != dst.shape[0]:
        _fail(f"{src_name} has {src.shape[0]} layers, {dst_name} {dst.shape[0]}")
    return int(src.shape[-1])


def check_resolve_args(
    top_k, seq_lens, state_idx, slot_pos, lru, slot_rows, resident_table, host_table,
    host_kv, device_kv, out_rows, plan, page_size, block_threads,
) -> tuple[int, int, int]:
    """Shapes, dtypes, devices, contiguity, K <= H, page_size, block size. Returns (B, K, H)."""
    _tensor("top_k", top_k, 2, (torch.int32,))
    b, k = top_k.shape
    _tensor("seq_lens", seq_lens, 1, (torch.int32, torch.int64))
    _tensor("state_idx", state_idx, 1, (torch.int32,))
    _tensor("slot_pos", slot_pos, 2, (torch.int32,))
    _tensor("lru", lru, 2, (torch.int32,))
    _tensor("slot_rows", slot_rows, 2, (torch.int32,))
    _tensor("resident_table", resident_table, 2, (torch.int32,))
    _tensor("host_table", host_table, 2, (torch.int32,))
    _tensor("out_rows", out_rows, 2, (torch.int32,))
    check_kv_pair("host_kv", host_kv, "device_kv", device_kv, 2)
    h = slot_pos.shape[1]
    if seq_lens.shape[0] != b or state_idx.shape[0] != b:
        _fail(f"seq_lens {tuple(seq_lens.shape)} and state_idx {tuple(state_idx.shape)} must be [{b}]")
    if lru.shape != slot_pos.shape:
        _fail(f"lru {tuple(lru.shape)} must match slot_pos {tuple(slot_pos.shape)}")
    if tuple(slot_rows.shape) != (b, h + 1):
        _fail(f"slot_rows must be [{b}, {h + 1}], got {tuple(slot_rows.shape)}")
    if resident_table.shape[0] != b or host_table.shape != resident_table.shape:
        _fail(
            f"resident_table {tuple(resident_table.shape)} and host_table "
            f"{tuple(host_table.shape)} must both be [{b}, P]"
        )
    if tuple(out_rows.shape) != (b, k):
        _fail(f"out_rows must be [{b}, {k}], got {tuple(out_rows.shape)}")
    if plan is not None:
        _tensor("plan", plan, 3, (torch.int32,))
        if tuple(plan.shape) != (b, k, 2):
            _fail(f"plan must be [{b}, {k}, 2], got {tuple(plan.shape)}")
    if k > h:
        _fail(f"top-k width K={k} exceeds the hot slots H={h}")
    if h < 1 or k < 1:
        _fail(f"K={k} and H={h} must be >= 1")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        _fail(f"page_size={page_size!r} must be an int >= 1")
    check_block_threads(block_threads)
    _same_device(
        device_kv.device, top_k=top_k, seq_lens=seq_lens, state_idx=state_idx, slot_pos=slot_pos,
        lru=lru, slot_rows=slot_rows, resident_table=resident_table, host_table=host_table,
        out_rows=out_rows, **({} if plan is None else {"plan": plan}),
    )
    return b, k, h


def check_resolve_preconditions(
    top_k, seq_lens, state_idx, slot_pos, lru, resident_table, host_table, page_size,
) -> None:
    """Data preconditions (reads back to the host). For each row with seq_len n > 0: positions
    (-1 = padding) distinct and in [0, n); state rows distinct and in range; when n > H, the
    state's lru is a permutation of 0..H-1, its slot_pos entries distinct and in [-1, n), and
    every selected position except the newest is resident or has a host block."""
    tk, lens = top_k.cpu().tolist(), seq_lens.cpu().tolist()
    sidx = state_idx.cpu().tolist()
    rtab, htab = resident_table.cpu(), host_table.cpu()
    s_count, h = slot_pos.shape
    p_count = rtab.shape[1]
    seen_states: set[int] = set()
    for b, n in enumerate(lens):
        if n < 0:
            _fail(f"row {b}: seq_len {n} < 0")
        if n == 0:
            continue
        pos = [p for p in tk[b] if p != -1]
        if len(set(pos)) != len(pos):
            _fail(f"row {b}: top-k positions are not distinct")
        bad = [p for p in pos if not 0 <= p < n]
        if bad:
            _fail(f"row {b}: position {bad[0]} outside [0, {n}) (use -1 for padding)")
        if (n - 1) // page_size >= p_count:
            _fail(f"row {b}: seq_len {n} needs {(n - 1) // page_size + 1} pages, tables hold {p_count}")
        s = sidx[b]
        if not 0 <= s < s_count:
            _fail(f"row {b}: state_idx {s} outside [0, {s_count})")
        if s in seen_states:
            _fail(f"row {b}: state_idx {s} used by two batch rows")
        seen_states.add(s)
        if n <= h:
            continue
        lru_row = lru[s].cpu().tolist()
        if sorted(lru_row) != list(range(h)):
            _fail(f"row {b}: lru of state {s} is not a permutation of 0..{h - 1}")
        sp = [q for q in slot_pos[s].cpu().tolist() if q != -1]
        if len(set(sp)) != len(sp) or any(not 0 <= q < n for q in sp):
            _fail(f"row {b}: slot_pos of state {s} has duplicates or values outside [-1, {n})")
        for p in pos:
            pg = p // page_size
            if p != n - 1 and rtab[b, pg] < 0 and htab[b, pg] < 0:
                _fail(f"row {b}: position {p} (page {pg}) is neither resident nor on host")


def check_views(slot_rows, resident_table, host_table, page_size: int, host_rows: int,
                device_rows: int) -> None:
    """Every row the tables can name lies inside the views (reads back to the host): slot rows
    < device_rows, whole resident pages inside device_kv, whole host pages inside host_kv."""
    check_rows_in_range("slot_rows", slot_rows, device_rows)
    for name, table, limit in (("resident_table", resident_table, device_rows),
                               ("host_table", host_table, host_rows)):
        valid = table[table >= 0]
        if valid.numel() and (int(valid.max()) + 1) * page_size > limit:
            _fail(f"{name} names block {int(valid.max())}: its page ends past the view's {limit} rows")


def check_copy_index(name: str, t: object, ndim: int) -> torch.Tensor:
    return _tensor(name, t, ndim, (torch.int32,))


def check_rows_in_range(name: str, rows: torch.Tensor, limit: int) -> None:
    """Debug/reference check: every index >= 0 is < ``limit`` (reads back to the host)."""
    valid = rows[rows >= 0]
    if valid.numel() and int(valid.max()) >= limit:
        _fail(f"{name} holds row {int(valid.max())}, the view has {limit} rows")
