"""Free block set that hands out the lowest block ids first, as contiguous runs when it can (pure
ring; shared by the host and device block pools).

Why: the landing path spends one NIXL descriptor and one copy per contiguous run of a request's
blocks, so a LIFO free list (blocks come back in release order) degrades it to per-page transfers
after churn. Ascending, first-fit allocation keeps a request's blocks in runs.
"""

from __future__ import annotations

from collections.abc import Iterator

FREE, TAKEN = 1, 0


class FreeBlocks:
    """The free subset of block ids ``0..num_blocks-1``, as a byte map (1 = free).

    ``take(n)`` returns, all or nothing, the first (lowest-starting) run of ``n`` consecutive free
    ids if one exists, else the ``n`` lowest free ids; either way the list is strictly ascending.
    Cost: ``add`` O(1); ``take`` one C-level scan of the byte map from the lowest free id (at most
    ``num_blocks`` bytes, about 0.1-1 ms at 10^6 blocks) plus O(n) Python work for a scattered
    result.

    Invariants (``check_invariants``): ``len`` equals the number of free ids; no free id lies below
    ``_lo``; ``_run_bound`` is at least the longest run of consecutive free ids (a failed run search
    for ``n`` sets it to ``n - 1``, so repeated large requests under fragmentation do not rescan).
    """

    def __init__(self, num_blocks: int) -> None:
        """All ``num_blocks`` ids start free."""
        self.num_blocks = num_blocks
        self._bits = bytearray([FREE]) * num_blocks
        self._count = num_blocks
        self._lo = 0
        self._run_bound = num_blocks

    def __len__(self) -> int:
        return self._count

    def __contains__(self, block: int) -> bool:
        return 0 <= block < self.num_blocks and self._bits[block] == FREE

    def __iter__(self) -> Iterator[int]:
        """Free ids in ascending order."""
        bits, i = self._bits, self._bits.find(FREE, self._lo)
        while i >= 0:
            yield i
            i = bits.find(FREE, i + 1)

    def add(self, block: int) -> None:
        """Return ``block`` to the set (the caller has checked that it was taken)."""
        bits = self._bits
        assert bits[block] == TAKEN, f"block {block} is already free"
        bits[block] = FREE
        count = self._count = self._count + 1
        if block < self._lo:
            self._lo = block
        # the run through ``block`` joins at most two runs of <= bound each
        bound = 2 * self._run_bound + 1
        self._run_bound = bound if bound < count else count

    def take(self, n: int) -> list[int] | None:
        """``n`` free ids, strictly ascending, removed from the set; None (nothing changed) if
        fewer than ``n`` are free. First fit contiguous run, else the ``n`` lowest."""
        if n > self._count:
            return None
        if n <= 0:
            return []
        bits = self._bits
        lo = bits.find(FREE, self._lo)
        start = lo if n == 1 else -1
        if start < 0 and n <= self._run_bound:
            start = bits.find(bytes([FREE]) * n, lo)
            if start < 0:
                self._run_bound = n - 1
        if start >= 0:
            out = list(range(start, start + n))
            bits[start:start + n] = bytes(n)
            self._lo = start + n if start == lo else lo
        else:
            out, i = [], lo
            for _ in range(n):
                i = bits.find(FREE, i)
                bits[i] = TAKEN
                out.append(i)
                i += 1
            self._lo = i  # the n lowest were taken: nothing free below the last one
        self._count -= n
        return out

    def check_invariants(self) -> None:
        bits = self._bits
        assert len(bits) == self.num_blocks, "free map has the wrong size"
        assert bits.count(FREE) == self._count, "free count disagrees with the free map"
        assert bits.count(TAKEN) == self.num_blocks - self._count, "free map holds a stray value"
        assert bits.find(FREE, 0, self._lo) < 0, f"a free block lies below the low mark {self._lo}"
        longest = max(map(len, bytes(bits).split(bytes([TAKEN]))), default=0)
        assert longest <= self._run_bound, f"free run {longest} exceeds bound {self._run_bound}"
