"""The wire module: every value that crosses a process boundary (pure ring: standard library and
``msgspec``, the step messages' codec).

Small frozen records of ints and tuples, with ``NewType`` ids so that a host block id cannot be
passed where a device block id is expected. Commands carry diffs, not snapshots. Three groups:
the decode step (``StepCommand`` / ``StepReport``: ``msgspec.Struct``s, one typed codec in
:mod:`hisparse_ray.channel.codec`, over the shared-memory channel), the coordinator's
answers (``Admission``, ``RequestView``, counters), and a landing (the ``RegionDesc``s a peer
WRITEs into, ``RankEndpoint``, ``LandingOrder`` / ``LandingDest`` to the prefill worker,
``RankLandingStep`` to each rank; they ride Ray calls as :func:`pack`'s bytes).

Device memory model (shared by coordinator, worker runtime and kernels):
  * The device pool is ``num_device_blocks`` blocks of ``page_size`` rows per layer. A block is
    leased either as a *resident page* of one request, or as part of a request's *hot buffer*
    (``ceil((H + 1) / page_size)`` blocks giving H hot slots + 1 reserved newest-token slot).
  * The host pool is ``num_host_blocks`` blocks of ``page_size`` rows per layer (layer-major).
  * Row of position p of a request: page ``p // page_size``, offset ``p % page_size``; physical row
    ``block * page_size + offset`` in that pool's per-layer view.
"""

from __future__ import annotations

import enum
import functools
import pickle
from dataclasses import dataclass
from typing import Any, NewType

import msgspec

from hisparse_ray.checks import check_int, check_number
from hisparse_ray.errors import TransferError

RequestId = NewType("RequestId", str)
HostBlockId = NewType("HostBlockId", int)
DeviceBlockId = NewType("DeviceBlockId", int)
TransferId = NewType("TransferId", int)
Rank = NewType("Rank", int)

NO_BLOCK = -1  # "no block" in block tables sent to workers and kernels


class LandingTarget(enum.Enum):
    """Where a request's prefix KV lands at admission; chosen once per request."""

    RESIDENT = "resident"  # whole prefix in device pages
    HOST = "host"  # host blocks + a fixed hot buffer on the device


class TransferKind(enum.Enum):
    SPILL = "spill"  # resident device page -> host block (all layers)
    RESTORE = "restore"  # host block -> resident device page (all layers)


class _Wire(msgspec.Struct, frozen=True, array_like=True, gc=False, forbid_unknown_fields=True):
    """Base of the per-step messages: frozen, encoded as a MessagePack array of the fields in
    order (no field names on the wire; a decoder refuses extra elements), never tracked by the
    garbage collector (ints, strings and tuples of them only: no reference cycles)."""


class PageTransfer(_Wire):
    """Copy one page (all layers) between the device pool and the host pool."""

    transfer_id: TransferId
    kind: TransferKind
    device_block: DeviceBlockId
    host_block: HostBlockId


class RequestHandle(_Wire):
    """Defines ``handle`` as the name of ``request_id`` from this command on (until a command
    lists it in ``released``; a released handle may be defined again for another request)."""

    handle: int
    request_id: RequestId


class Backup(_Wire):
    """Eager backup: after this step's forward, copy the newest token's rows (all layers) from the
    request's reserved slot to ``host_block``/``offset``. The next forward waits on it."""

    transfer_id: TransferId
    handle: int
    position: int
    host_block: HostBlockId
    offset: int


class TableDiff(_Wire):
    """Set one page of a request's block tables (``NO_BLOCK`` clears an entry)."""

    handle: int
    page: int
    host_block: int  # HostBlockId or NO_BLOCK
    device_block: int  # DeviceBlockId (resident page) or NO_BLOCK


class BatchRow(_Wire):
    """One request in this step's decode batch.

    seq_len: n, the number of positions after this step's token is written (newest = n - 1).
    hot_blocks: a diff: the device blocks of the request's hot buffer (``()`` for a fully resident
        request) when they changed since the request's previous row (always in its first row),
        ``None`` when unchanged.
    prev_row: -1, or a chained row (``Coordinator.admit(chain=True)``): its input is the token
        that row ``prev_row`` of the previous command samples (``input_token`` is then 0; the
        worker reads it where it was sampled, on the device on the fast path).
    """

    handle: int
    seq_len: int
    input_token: int
    hot_blocks: tuple[DeviceBlockId, ...] | None = None
    prev_row: int = -1


class StepCommand(_Wire, tag=1):
    """What every TP rank executes for one decode step: ONE message, broadcast to all ranks.

    A diff against the previous commands, never a snapshot; a rank applies it in this order:
    ``released`` handles are forgotten (with their request's state), ``handles`` defined, the
    peers wait on the host until generation ``host_seq`` is published and, when rank 0 wrote the
    host in the previous step, for that step by number (its IPC event: the streams; see
    docs/architecture.md "How the ranks are ordered"), ``table_diffs``
    applied, ``transfers`` enqueued, ``batch`` run (a row's ``hot_blocks`` bind a new hot
    buffer), ``backups`` enqueued. Requests are named by the integer handles of ``handles``
    (this or an earlier command); the codec holds no state."""

    step: int
    batch: tuple[BatchRow, ...] = ()
    table_diffs: tuple[TableDiff, ...] = ()
    transfers: tuple[PageTransfer, ...] = ()
    backups: tuple[Backup, ...] = ()
    released: tuple[int, ...] = ()  # handles whose request's rank-side state may be dropped
    handles: tuple[RequestHandle, ...] = ()  # handles named from this command on
    # host-pool generation (rank 0's latest reported) the peers wait for on the host before
    # reading host rows; their GPU streams are ordered by step number, not by this field
    host_seq: int = 0


class StepReport(_Wire, tag=2):
    """What one TP rank reports back after a step: transfer acks and (rank 0) sampled tokens."""

    step: int
    rank: Rank
    enqueued: tuple[TransferId, ...] = ()
    completed: tuple[TransferId, ...] = ()
    sampled: tuple[tuple[RequestId, int], ...] = ()
    hot_hits: int = 0
    hot_misses: int = 0
    # (request, hits, misses) per batch row, summed over anchor layers (added by actors; additive)
    hits_by_request: tuple[tuple[RequestId, int, int], ...] = ()
    # rank 0: the host pool's published generation after this step (its writes so far); the
    # next command carries it to the peers as ``host_seq``
    published: int = 0


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How rank 0 picks a request's next token from its logits (``hisparse_ray.rank.sampler``).

    ``temperature`` 0 is greedy (argmax; ``top_k`` / ``top_p`` ignored, bit-exact like before
    sampling existed); otherwise softmax(logits / temperature) restricted to the ``top_k`` most
    likely tokens (0 = all) and then to the smallest set whose probability reaches ``top_p``
    (1.0 = all), drawn with a counter-based hash of ``seed`` and the row's position
    (``rank/sampler.py``): a request samples the same tokens on every run, on every rank and in
    every mode (HiSparse and full-resident give the same logits), where the logits are.
    Rides to every rank with the last chunk of the request's landing
    (``RankLandingStep.sampling``)."""

    temperature: float = 0.0
    seed: int = 0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        check_number("temperature", self.temperature, lo=0, why="0 = greedy")
        check_number("top_p", self.top_p, lo=0, lo_open=True, hi=1, why="1 = no nucleus cut")
        check_int("top_k", self.top_k, lo=0, hi=(1 << 31) - 1, why="0 = every token")
        check_int("seed", self.seed, lo=0, hi=(1 << 63) - 1)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


# --- Coordinator-facing values (added by the core; additive) ------------------------------------


class RequestState(enum.Enum):
    """Lifecycle of a request in the coordinator: WAITING -> LANDING -> RUNNING -> FINISHED ->
    RELEASED. FINISHED still holds leases while transfers (or an in-flight step) of the request are
    outstanding; RELEASED holds nothing."""

    WAITING = "waiting"  # admission did not fit yet; the landing target is already chosen
    LANDING = "landing"  # leases handed out, the prefill path is writing the landing plan
    RUNNING = "running"  # landed; takes part in decode batches
    FINISHED = "finished"  # done or aborted; draining in-flight transfers
    RELEASED = "released"  # every lease returned


@dataclass(frozen=True, slots=True)
class LandingPage:
    """Destination of one page of an admitted prefix.

    host_block / device_block: HostBlockId / DeviceBlockId or NO_BLOCK (exactly one is set).
    reused: True when the page needs no landing (a published host page matched the prefix; for a
        resident target the coordinator restores it into ``device_block`` itself).
    """

    page: int
    host_block: int
    device_block: int
    reused: bool


@dataclass(frozen=True, slots=True)
class Admission:
    """Landing plan of an admitted request: write KV of positions ``0..num_positions-1`` into the
    non-reused pages, then call ``Coordinator.apply_landed``.

    pages: one entry per page ``0..ceil((num_positions + 1) / page_size) - 1`` (the last may hold
        only the position the first decode step writes).
    hot_blocks: device blocks of the hot buffer (host target), () for a resident target.
    """

    request_id: RequestId
    target: LandingTarget
    num_positions: int
    pages: tuple[LandingPage, ...]
    hot_blocks: tuple[DeviceBlockId, ...] = ()


@dataclass(frozen=True, slots=True)
class RequestView:
    """Read-only snapshot of one request for callers (``Coordinator.view``)."""

    request_id: RequestId
    state: RequestState
    target: LandingTarget
    tier: LandingTarget  # current tier (a resident request may have been converted to host)
    tokens: tuple[int, ...]  # prompt + sampled tokens
    prompt_len: int
    num_generated: int
    finish_reason: str | None = None  # "length", "eos", "abort", "landing_failed"


@dataclass(frozen=True, slots=True)
class CoordinatorCounters:
    """Metrics snapshot of the coordinator (hot hits/misses are the worker's, not counted here)."""

    steps: int = 0
    admitted: int = 0
    waiting: int = 0
    running: int = 0
    finished: int = 0
    spills: int = 0  # completed SPILL page transfers
    restores: int = 0  # completed RESTORE page transfers
    backups: int = 0  # completed newest-row backups
    spill_bytes: int = 0
    restore_bytes: int = 0
    backup_bytes: int = 0
    conversions_to_host: int = 0
    prefix_hit_pages: int = 0
    published_pages: int = 0
    evictions: int = 0
    stalls: int = 0  # batch slots skipped because a pool had no block for the next page
    chained_rows: int = 0  # rows emitted before their input token was known (admit(chain=True))
    dropped_rows: int = 0  # rows whose token was dropped: their request finished (eos of the
    # step before a chained row, or an abort) while their step was in flight
    device_blocks_total: int = 0
    device_blocks_used: int = 0
    host_blocks_total: int = 0
    host_blocks_used: int = 0  # referenced or pinned host blocks
    host_blocks_cached: int = 0  # published, unreferenced (evictable) host blocks


# --- Landing: the regions a peer writes and the messages of a prefill -> decode landing ---------


class MemKind(enum.Enum):
    """Where a registered region lives; the values are NIXL's memory-segment names."""

    HOST = "DRAM"
    DEVICE = "VRAM"


@dataclass(frozen=True, slots=True)
class RegionDesc:
    """A registered memory region, as its owner describes it to peers (picklable, plain ints).

    agent: owning engine's agent name. name: the owner's label, unique per engine.
    addr/nbytes: virtual address and byte length in the owner's process. device_id: CUDA device
    ordinal for DEVICE, 0 for HOST. Offsets into a region are byte offsets in ``[0, nbytes)``.
    """

    agent: str
    name: str
    addr: int
    nbytes: int
    device_id: int
    kind: MemKind

    def __reduce__(self):
        # plain values, rebuilt through a cache: a landing order names the same few hundred
        # regions every time, and the dataclass's own pickling (per-field setstate + the enum)
        # cost ~3 us per region, ~1 ms per 16K-token order on its critical path
        return _region, (self.agent, self.name, self.addr, self.nbytes, self.device_id,
                         self.kind.value)

    def check_span(self, offset: int, nbytes: int) -> None:
        """Raise ``TransferError`` unless ``[offset, offset + nbytes)`` lies inside the region."""
        if nbytes <= 0 or offset < 0 or offset + nbytes > self.nbytes:
            raise TransferError(
                f"span [{offset}, {offset + nbytes}) outside region {self.agent}/{self.name} "
                f"of {self.nbytes} bytes"
            )


@functools.lru_cache(maxsize=16384)
def _region(agent: str, name: str, addr: int, nbytes: int, device_id: int, kind: str) -> RegionDesc:
    """Unpickling of a :class:`RegionDesc` (frozen, so one shared instance per value is safe)."""
    return RegionDesc(agent, name, addr, nbytes, device_id, MemKind(kind))


_COLUMNS: dict[int, tuple[tuple, tuple]] = {}  # id(regions) -> (regions, columns)


def region_columns(regions: tuple[RegionDesc, ...]) -> tuple:
    """A tuple of regions as plain columns for pickling, ``(agent, kind, device, names, addrs,
    sizes)`` when they share agent, kind and device (an endpoint's per-layer regions), else the
    tuple itself. Memoized per tuple object: a landing order names the same endpoint tuples every
    time (pickling 61 regions one by one took ~250 us per order on the dev VM)."""
    hit = _COLUMNS.get(id(regions))
    if hit is not None and hit[0] is regions:
        return hit[1]
    if not regions or type(regions) is not tuple:
        return regions
    r0 = regions[0]
    if any(type(r) is not RegionDesc or r.agent != r0.agent or r.kind is not r0.kind
           or r.device_id != r0.device_id for r in regions):
        return regions
    cols = (r0.agent, r0.kind.value, r0.device_id, tuple(r.name for r in regions),
            tuple(r.addr for r in regions), tuple(r.nbytes for r in regions))
    if len(_COLUMNS) > 1024:
        _COLUMNS.clear()
    _COLUMNS[id(regions)] = (regions, cols)  # holds ``regions``: its id stays unique
    return cols


def regions_from_columns(cols: tuple) -> tuple[RegionDesc, ...]:
    """The inverse of :func:`region_columns`; equal columns give the very same tuple."""
    if not cols or isinstance(cols[0], RegionDesc):
        return cols
    return _regions(cols)


@functools.lru_cache(maxsize=1024)
def _regions(cols: tuple) -> tuple[RegionDesc, ...]:
    agent, kind, device, names, addrs, sizes = cols
    n = len(names)
    return tuple(map(_region, (agent,) * n, names, addrs, sizes, (device,) * n, (kind,) * n))


@dataclass(frozen=True, slots=True)
class RankEndpoint:
    """How a prefill worker reaches one decode rank (published after the rank registered its
    regions). host_layers / staging_layers: rank 0 only, () on peers. device_layers: every rank.
    direct_host: whether this rank accepts direct host writes from a peer of the same memory kind
    as the prefill worker's send buffer (decided by the prefill side's engine; see module doc)."""

    rank: int
    agent: str
    metadata: bytes
    node_id: str
    host_layers: tuple[RegionDesc, ...]
    device_layers: tuple[RegionDesc, ...]
    staging_layers: tuple[RegionDesc, ...]
    staging_blocks: int
    # every rank (when the replica has a staging pool): indexer-key landing rows, one region per
    # layer of ``staging_blocks * page_size`` rows of ``key_row_bytes``, indexed like the staging
    # pool's blocks (the lander's staging lease covers them on every rank)
    key_layers: tuple[RegionDesc, ...] = ()


@dataclass(frozen=True, slots=True)
class LandingDest:
    """One WRITE into one rank: ``pages`` are (page of the request, block of ``layers``) pairs;
    page p holds positions ``[p * page_size, (p + 1) * page_size)`` clipped to the prompt."""

    rank: int
    layers: tuple[RegionDesc, ...]
    pages: tuple[tuple[int, int], ...]
    notif: bytes
    # indexer keys of positions ``[lo, lo + n)`` into rows ``[row, row + n)`` of every layer's
    # ``key_layers`` region: ``key_rows = (lo, row, n)``; None: no keys in this WRITE
    key_layers: tuple[RegionDesc, ...] = ()
    key_rows: tuple[int, int, int] | None = None
    # > 1: the KV rows go as this many WRITEs by layer group (layer l in group l * G // L), each
    # with notification ``group_notif(notif, g)`` (the keys ride with the last group), so the
    # rank can copy group g to host while later groups are still being written
    layer_groups: int = 1

    def __reduce__(self):
        # the layer regions as columns (one endpoint's: same agent, kind, device): an order of a
        # 16K-token prompt names 183 of them, pickled one by one they were most of pack()
        return _landing_dest, (self.rank, region_columns(self.layers), self.pages, self.notif,
                               region_columns(self.key_layers), self.key_rows, self.layer_groups)


def _landing_dest(rank, layers, pages, notif, key_layers, key_rows, layer_groups) -> LandingDest:
    return LandingDest(rank, regions_from_columns(layers), pages, notif,
                       regions_from_columns(key_layers), key_rows, layer_groups)


@dataclass(frozen=True, slots=True)
class RankLandingStep:
    """What one decode rank does for one landing chunk, in one Ray call
    (``DecodeWorker.complete_landing``), in this order:

    1. wait for the WRITE notification ``notif`` (None: nothing was written to this rank);
    2. rank 0, staged path: ``unstage = (first staging block, host blocks, pages)``: copy the
       chunk's pages from the staging run into host blocks; ``host_written``: a direct WRITE
       went into host blocks (publish them to the peers);
    3. ``keys = (lo, row, n)``: copy indexer keys of positions ``[lo, lo + n)`` from key
       staging rows ``[row, row + n)`` into the request's key cache (created on first use with
       room for ``capacity`` positions);
    4. ``last``: the request's key cache holds ``num_positions`` keys (it may decode once every
       rank finished its steps); the rank takes the request's ``sampling`` then."""

    request_id: str
    num_positions: int
    capacity: int
    timeout_s: float
    notif: bytes | None = None
    unstage: tuple[int, tuple[int, ...], tuple[int, ...]] | None = None
    host_written: bool = False
    keys: tuple[int, int, int] | None = None
    last: bool = False
    layer_groups: int = 1  # > 1: wait and unstage group by group (``LandingDest.layer_groups``)
    # rank 0, last chunk: how it samples the request (None: greedy)
    sampling: SamplingParams | None = None


@dataclass(frozen=True, slots=True)
class LandingOrder:
    """Push ``request_id``'s prefilled KV (already computed by ``PrefillWorker.prefill``) to
    ``dests``; each dest is one WRITE with its notification, retried ``attempts`` times with a
    ``timeout_s`` deadline per attempt."""

    request_id: str
    dests: tuple[LandingDest, ...]
    attempts: int = 3
    timeout_s: float = 20.0


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """What prefill returns besides the pushed KV: timings and, only when asked (``keys_inline``:
    replicas without key staging), the indexer keys (model-owned, dense, replicated over ranks)
    as numpy ``[L, T, index_head_dim]`` (float32 on the wire for bf16 models); otherwise None
    and the keys travel by NIXL with the KV (``LandingDest.key_rows``)."""

    request_id: str
    num_positions: int
    index_keys: object
    prefill_s: float


def pack(obj: Any) -> bytes:
    """A landing order or rank step as the bytes its Ray call carries. Ray serializes a nested
    dataclass argument several times slower than the same bytes (measured on the dev VM: 560 vs
    160 us per ``.remote()`` for a 16K-token order of 61 layer regions and 256 pages), and the
    lander makes three such calls on a landing's critical path. ``RegionDesc`` pickles by value
    through a cache (``transfer.base``), which cut a 16K-token order's loads from 370 to 70 us."""
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def unpack(arg: Any) -> Any:
    """The object behind :func:`pack`'s bytes; anything else as it is (direct callers, tests)."""
    return pickle.loads(arg) if isinstance(arg, (bytes, bytearray)) else arg
