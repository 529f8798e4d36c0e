"""CUDA launchers of the resolver kernels (ring 2: torch + cupy), twins of ``kernels/reference.py``.

``kernels/csrc/resolver.cu`` is compiled once per process with ``cupy.RawModule`` and launched on
torch's current stream: no host sync, no allocation but the optional plan scratch, so a call can be
captured in a CUDA graph (warm it up once first: compiling is not capturable). Host views are read
or written zero-copy through UVA, so they must be pinned (or device) memory. ``debug=True`` (or the
environment switch ``HISPARSE_KERNEL_DEBUG``) adds the data-precondition checks (host readback).
"""

from __future__ import annotations

import functools
import importlib.resources
import warnings

import torch

from hisparse_ray.config import env_choice, env_flag
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

COPY_THREADS = 256


def available() -> bool:
    """True when cupy imports and torch sees a CUDA device."""
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


_DEFINES: tuple[str, ...] = ()  # extra compiler options; benchmarks set these for profiling


def _module(device_index: int):
    return _build(device_index, _DEFINES)


SOURCES = ("resolver.cu", "resolver_copy.cu", "resolver_cluster.cu")  # one module: the later
# files use resolver.cu's helpers


def source() -> str:
    """The resolver module's CUDA source (:data:`SOURCES` in order)."""
    d = importlib.resources.files("hisparse_ray.kernels.csrc")
    return "\n".join(d.joinpath(name).read_text() for name in SOURCES)


@functools.cache
def _raw_module(device_index: int, defines: tuple[str, ...]):
    import cupy

    src = source()
    with cupy.cuda.Device(device_index):
        return cupy.RawModule(code=src, options=("-std=c++17", *defines))


def _get(device_index: int, defines: tuple[str, ...], name: str):
    import cupy

    with cupy.cuda.Device(device_index):
        kern = _raw_module(device_index, defines).get_function(name)
        try:  # one shared-memory carveout for all: no SM reconfiguration between them
            kern.preferred_shared_memory_carveout = 100
        except (AttributeError, ValueError):
            pass
        return kern


@functools.cache
def _build(device_index: int, defines: tuple[str, ...]):
    return tuple(_get(device_index, defines, n)
                 for n in ("hs_resolve", "hs_copy_rows", "hs_copy_compact"))


@functools.cache
def _cluster_kernel(device_index: int, defines: tuple[str, ...], size: int):
    return _get(device_index, defines, f"hs_resolve_c{size}")


CLUSTER_SIZES = (1, 2, 4, 8)


def cluster_size(requested: int | str | None, batch: int, device_index: int) -> int:
    """Blocks per batch row in phase A: ``requested`` 1 / 2 / 4 / 8, or "auto" (the largest that
    keeps the batch in one wave of the SMs; 1 below sm90); None reads
    ``HISPARSE_RESOLVER_CLUSTER`` (default 1: one block a row, the measured kernel)."""
    if requested is None:
        requested = env_choice("HISPARSE_RESOLVER_CLUSTER", ("1", "2", "4", "8", "auto"), "1")
    if requested != "auto":
        if isinstance(requested, str) and requested.isdigit():
            requested = int(requested)
        if type(requested) is not int or requested not in CLUSTER_SIZES:
            _fail(f"cluster={requested!r} must be one of {CLUSTER_SIZES} or 'auto'")
    if requested == "auto":
        if not _sm90(device_index):
            return 1
        return next((c for c in (8, 4, 2) if batch * c <= _sm_count(device_index)), 1)
    if requested > 1 and not _sm90(device_index):
        _fail(f"cluster={requested} needs thread-block clusters (sm90), device {device_index} is "
              f"sm{''.join(map(str, torch.cuda.get_device_capability(device_index)))}")
    return requested


PHASE_A = ("default", "fused")


def fused_phase_a(requested: str | None, k: int, size: int) -> bool:
    """Whether phase A runs its long path in fewer passes (``-DHS_FUSED=1``: one sweep stages
    the row, reads the page tables and hashes; one block scan counts hits, misses and the LRU's
    evictable slots). ``requested``: "default" / "fused", None reads
    ``HISPARSE_RESOLVER_PHASE_A`` (default "default"). One block a row only; K < 32768."""
    if requested is None:
        requested = env_choice("HISPARSE_RESOLVER_PHASE_A", PHASE_A, "default")
    if requested not in PHASE_A:
        _fail(f"phase_a={requested!r} must be one of {PHASE_A}")
    if requested == "fused" and size > 1:
        _fail(f"phase_a='fused' runs one block a row; cluster={size} asks for {size}")
    if requested == "fused" and k >= 1 << 15:
        _fail(f"phase_a='fused' packs two counts of K in one int: K={k} must be < 32768")
    return requested == "fused"


@functools.cache
def _sm90(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def _phase_a_smem(k: int, h: int, hash_bits: int, size: int) -> int:
    """Dynamic shared memory of phase A in bytes (layouts in resolver.cu)."""
    cap = 1 << hash_bits
    if size == 1:
        return 4 * (2 * cap + 5 * k + 3 * h + 65) + h
    ks, hs = -(-k // size), -(-h // size)
    return 4 * (2 * cap + 4 * k + ks + 3 * hs + 3 * size + 64) + 2 * hs


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _smem_limit(device_index: int) -> int:
    props = torch.cuda.get_device_properties(device_index)
    return int(getattr(props, "shared_memory_per_block_optin", 48 * 1024))


_smem_set: dict[int, int] = {}
_counters: dict[int, torch.Tensor] = {}


def _miss_counters(idx: int) -> torch.Tensor:
    """Per-device [2] int32 (miss count, blocks done): zero between calls, reset by the copy
    kernel itself. Resolves on one device therefore must not run concurrently on two streams."""
    c = _counters.get(idx)
    if c is None:
        if torch.cuda.is_current_stream_capturing():
            _fail("call resolve once before capturing it in a CUDA graph (module and scratch setup)")
        c = _counters[idx] = torch.zeros(2, dtype=torch.int32, device=f"cuda:{idx}")
    return c
_streams: dict[tuple[int, int], object] = {}


def _stream(idx: int, device: torch.device):
    """cupy view of torch's current stream (cached: ExternalStream is not free to build)."""
    import cupy

    ptr = torch.cuda.current_stream(device).cuda_stream
    key = (idx, ptr)
    st = _streams.get(key)
    if st is None:
        if len(_streams) > 256:
            _streams.clear()
        with warnings.catch_warnings():  # cupy 14 deprecates it; Stream.from_external needs
            warnings.simplefilter("ignore", DeprecationWarning)  # the stream protocol on torch's side
            st = _streams[key] = cupy.cuda.ExternalStream(ptr, idx)
    return st


def _launch(kernel, grid, block, args, shared_mem: int, device: torch.device) -> None:
    import cupy

    idx = device.index if device.index is not None else torch.cuda.current_device()
    with cupy.cuda.Device(idx):
        if shared_mem > 48 * 1024 and _smem_set.get(id(kernel), 0) < shared_mem:
            kernel.max_dynamic_shared_size_bytes = shared_mem
            _smem_set[id(kernel)] = shared_mem
        with _stream(idx, device):
            kernel(grid, block, args, shared_mem=shared_mem)


def _ptr(t: torch.Tensor):
    import numpy as np

    return np.uint64(t.data_ptr())


def _check_reachable(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.is_cuda:
        if t.device != device:
            _fail(f"{name} is on {t.device}, the kernel runs on {device}")
    elif not t.is_pinned():
        _fail(f"{name} must be pinned host memory (read through UVA) or on {device}")


def _vec_width(row_bytes: int, *tensors: torch.Tensor) -> int:
    for v in (16, 8, 4):
        if row_bytes % v == 0 and all(t.data_ptr() % v == 0 for t in tensors):
            return v
    return 1


def _copy(src_idx, dst_idx, stride: int, n_entries: int, src, src_layer_stride: int, dst,
          dst_layer_stride: int, layers: int, row_bytes: int, device: torch.device) -> None:
    import numpy as np

    if n_entries == 0 or layers == 0:
        return
    idx = device.index if device.index is not None else torch.cuda.current_device()
    target_warps = _sm_count(idx) * 32
    group = 1
    while group < 32 and group * target_warps < n_entries:
        group *= 2
    warps = -(-n_entries // group)
    blocks = min(-(-warps // (COPY_THREADS // 32)), _sm_count(idx) * 16)
    kernel = _module(idx)[1]
    args = (
        _ptr(src_idx) if src_idx is not None else np.uint64(0), _ptr(dst_idx), np.int32(stride),
        np.int64(n_entries), _ptr(src), np.int64(src_layer_stride), _ptr(dst),
        np.int64(dst_layer_stride), np.int64(row_bytes), np.int32(_vec_width(row_bytes, src, dst)),
        np.int32(group),
    )
    _launch(kernel, (blocks, layers), (COPY_THREADS,), args, 0, device)


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
    """CUDA twin of :func:`hisparse_ray.kernels.reference.resolve` (same shapes and semantics).

    Two launches on torch's current stream: phase A (one block of ``block_threads`` per batch
    row, or a cluster of ``cluster`` such blocks: :func:`cluster_size`) classifies, updates
    slot_pos/lru and writes out_rows, the plan and a compact miss list; phase B (one block per
    SM, 4 rows per warp) copies the listed rows from host_kv (pinned, UVA) into device_kv and
    resets the per-device miss counter. When ``plan`` is None a scratch plan is allocated on the
    current stream. Calls on one device must not overlap on two streams. ``phase_a``: the long
    path's variant (:func:`fused_phase_a`; same results)."""
    import numpy as np

    b, k, h = check_resolve_args(
        top_k, seq_lens, state_idx, slot_pos, lru, slot_rows, resident_table, host_table,
        host_kv, device_kv, out_rows, plan, page_size, block_threads,
    )
    device = device_kv.device
    if not device_kv.is_cuda:
        _fail(f"device_kv must be on a CUDA device, got {device}")
    _check_reachable("host_kv", host_kv, device)
    if debug is None:
        debug = env_flag("HISPARSE_KERNEL_DEBUG")
    if debug:
        check_resolve_preconditions(
            top_k, seq_lens, state_idx, slot_pos, lru, resident_table, host_table, page_size
        )
        check_views(slot_rows, resident_table, host_table, page_size, host_kv.shape[0],
                    device_kv.shape[0])
    if b == 0:
        return
    if plan is None:
        plan = torch.empty((b, k, 2), dtype=torch.int32, device=device)
    elif plan.data_ptr() % 8:
        _fail("plan must start at an 8-byte aligned address (one int2 store per entry)")
    idx = device.index if device.index is not None else torch.cuda.current_device()
    size = cluster_size(cluster, b, idx)
    limit = _smem_limit(idx) - 64
    hash_bits = max(6, (4 * k - 1).bit_length())  # load <= 1/4 when it fits, else <= 1/2
    smem = _phase_a_smem(k, h, hash_bits, size)
    if smem > limit:
        hash_bits = max(6, (2 * k - 1).bit_length())
        smem = _phase_a_smem(k, h, hash_bits, size)
    if smem > limit:
        _fail(f"K={k}, H={h} need {smem} B of shared memory per block, the device allows {limit}")
    fused = fused_phase_a(phase_a, k, size)
    kernel_a, _, kernel_b = _build(idx, _DEFINES + ("-DHS_FUSED=1",)) if fused else _module(idx)
    if size > 1:
        kernel_a = _cluster_kernel(idx, _DEFINES, size)
    counters = _miss_counters(idx)
    miss_list = torch.empty((b * k, 2), dtype=torch.int32, device=device)
    args = (
        _ptr(top_k), np.int32(k), _ptr(seq_lens), np.int32(seq_lens.dtype == torch.int64),
        _ptr(state_idx), _ptr(slot_pos), _ptr(lru), np.int32(h), _ptr(slot_rows),
        _ptr(resident_table), _ptr(host_table), np.int32(resident_table.shape[1]),
        np.int32(page_size), _ptr(out_rows), _ptr(plan), np.int32(hash_bits), _ptr(miss_list),
        _ptr(counters),
    )
    # nothing that can raise between the two launches: phase B resets the miss counter
    _launch(kernel_a, (b * size,), (block_threads,), args, smem, device)
    rb = int(device_kv.shape[1])
    args_b = (_ptr(miss_list), _ptr(counters), _ptr(host_kv), _ptr(device_kv), np.int64(rb),
              np.int32(_vec_width(rb, host_kv, device_kv)))
    blocks = min(_sm_count(idx), -(-b * k // (4 * COPY_THREADS // 32)))
    _launch(kernel_b, (blocks,), (COPY_THREADS,), args_b, 0, device)


def replay(
    plan: torch.Tensor, host_kv: torch.Tensor, device_kv: torch.Tensor, *, debug: bool | None = None
) -> None:
    """CUDA twin of :func:`hisparse_ray.kernels.reference.replay`: the copy-only phase B on the
    current stream (run it on a side stream that waited for the anchor layer's resolve)."""
    check_copy_index("plan", plan, 3)
    if plan.shape[-1] != 2:
        _fail(f"plan must be [B, K, 2], got {tuple(plan.shape)}")
    rb = check_kv_pair("host_kv", host_kv, "device_kv", device_kv, 2)
    device = device_kv.device
    if not device_kv.is_cuda or plan.device != device:
        _fail(f"device_kv and plan must be on one CUDA device, got {device} and {plan.device}")
    _check_reachable("host_kv", host_kv, device)
    if debug if debug is not None else env_flag("HISPARSE_KERNEL_DEBUG"):
        check_rows_in_range("plan (host rows)", plan[..., 0], host_kv.shape[0])
        check_rows_in_range("plan (device rows)", plan[..., 1][plan[..., 0] >= 0], device_kv.shape[0])
    flat = plan.view(-1)
    _copy(flat[0:], flat[1:], 2, plan.numel() // 2, host_kv, 0, device_kv, 0, 1, rb, device)


def backup(
    src_rows: torch.Tensor,
    dst_rows: torch.Tensor,
    device_kv: torch.Tensor,
    host_kv: torch.Tensor,
    *,
    debug: bool | None = None,
) -> None:
    """CUDA twin of :func:`hisparse_ray.kernels.reference.backup`: device -> pinned host rows of
    every layer in one launch (grid.y = layers), zero-copy writes through UVA."""
    check_copy_index("src_rows", src_rows, 1)
    check_copy_index("dst_rows", dst_rows, 1)
    if src_rows.shape != dst_rows.shape:
        _fail(f"src_rows {tuple(src_rows.shape)} and dst_rows {tuple(dst_rows.shape)} differ")
    rb = check_kv_pair("device_kv", device_kv, "host_kv", host_kv, 3)
    device = device_kv.device
    if not device_kv.is_cuda or src_rows.device != device or dst_rows.device != device:
        _fail(f"device_kv, src_rows, dst_rows must be on one CUDA device, got {device}")
    _check_reachable("host_kv", host_kv, device)
    if debug if debug is not None else env_flag("HISPARSE_KERNEL_DEBUG"):
        check_rows_in_range("src_rows", src_rows, device_kv.shape[1])
        check_rows_in_range("dst_rows", dst_rows[src_rows >= 0], host_kv.shape[1])
    layers = int(device_kv.shape[0])
    _copy(src_rows, dst_rows, 1, src_rows.numel(), device_kv, device_kv.stride(0), host_kv,
          host_kv.stride(0), layers, rb, device)
