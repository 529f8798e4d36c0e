"""Token sampling (ring 2): a batch's next tokens from its logits, each row by its request's
:class:`~hisparse_ray.types.SamplingParams`, wherever the logits are (CPU or GPU).

Counter-based, so that it needs no state and runs where the logits are: row ``b`` draws with a
hash of ``(seed, counter, token id)`` (``counter``: the row's position, ``seq_len - 1``, unique
per request and step), by the Gumbel-max rule over the kept tokens: ``argmax(logits / T + g)``
with ``g = -log(-log(u))``, ``u`` the hash as a uniform in (0, 1), which draws a token with
exactly its softmax probability. The same logits and counters give the same tokens on every run
and on every rank, in every mode (HiSparse equals full-resident bit for bit, so its seeded
samples do too), and a step whose next row is launched before its tokens reach the host (the
step pipeline) samples on the device like any other. The hash uses only int64 products below
2**63 (no wrap-around), so CPU and CUDA compute the same bits; the float work (division, log)
may round differently across devices, as the logits themselves do. Greedy (temperature 0) is
``argmax`` of the row, as before sampling existed.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence

import torch
from torch import Tensor

from hisparse_ray.types import SamplingParams

GREEDY = SamplingParams()
_M32 = 0xFFFFFFFF


def _mul32(x: Tensor, c: int) -> Tensor:
    """``x * c mod 2**32`` for ``x`` in [0, 2**32) (int64), without an int64 overflow: the
    constant in two 16-bit halves."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _hash32(x: Tensor) -> Tensor:
    """A 32-bit integer mix (xorshift-multiply, "lowbias32" constants) of int64 values in
    [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


@lru_cache(maxsize=8)
def _id_hashes(vocab: int, device: torch.device) -> Tensor:
    """``[vocab]`` the token ids' half of the hash, the same every step: computed once per vocab
    size and device."""
    ids = torch.arange(vocab, dtype=torch.int64, device=device)
    return _hash32((ids + 0x9E3779B9) & _M32)


def uniforms(seed: Tensor, counter: Tensor, vocab: int) -> Tensor:
    """``[B, vocab]`` float32 uniforms in (0, 1): row ``b`` from ``(seed[b], counter[b])``."""
    s = seed.to(torch.int64)
    row = _hash32(s & _M32)
    row = _hash32(row ^ ((s >> 32) & _M32))
    row = _hash32(row ^ (counter.to(torch.int64) & _M32))  # [B]
    h = _hash32(row[:, None] ^ _id_hashes(vocab, seed.device)[None, :])
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def kept(x: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """``[B, V]`` bool: the tokens a row may draw. ``x``: logits / temperature ``[B, V]``;
    ``top_k`` (0 = all): the tokens scoring at least the k-th largest (ties with it kept: the
    cut depends on values only); then ``top_p`` (1 = all): the smallest prefix of the kept
    tokens sorted by score (descending, ties by id) whose softmax mass reaches ``top_p`` (the
    most likely token always stays)."""
    B, V = x.shape
    vals, order = torch.sort(x, dim=-1, descending=True, stable=True)
    k = torch.where((top_k <= 0) | (top_k >= V), V, top_k).to(torch.int64)
    kth = vals.gather(1, (k - 1)[:, None])
    keep_sorted = vals >= kth
    probs = torch.softmax(vals.masked_fill(~keep_sorted, float("-inf")), dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass of the tokens ranked above
    cut = (before >= top_p.to(probs.dtype)[:, None]) & (top_p < 1.0)[:, None]
    cut[:, 0] = False
    keep_sorted &= ~cut
    return torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)


def sample(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, seed: Tensor,
           counter: Tensor) -> Tensor:
    """Next tokens ``[B]`` int64 of ``logits [B, V]`` (any float dtype, computed in float32):
    argmax where ``temperature`` is 0, else the Gumbel-max draw over :func:`kept` tokens. The
    parameters are ``[B]`` tensors on the logits' device; no host sync."""
    x = logits.float()
    greedy = x.argmax(dim=-1)
    hot = temperature > 0
    t = torch.where(hot, temperature, 1.0).to(torch.float32)[:, None]
    x = x / t
    g = -torch.log(-torch.log(uniforms(seed, counter, x.shape[1])))
    score = torch.where(kept(x, top_k, top_p), x + g, float("-inf"))
    return torch.where(hot, score.argmax(dim=-1), greedy)


def sample_rows(logits: Tensor, params: Sequence[SamplingParams | None],
                counters: Sequence[int], into: Tensor | None = None) -> Tensor:
    """:func:`sample` with one ``SamplingParams`` (None: greedy) and counter per row: the greedy
    rows' argmax, the others drawn (only they are sorted and hashed). into: ``[B]`` tokens that
    already hold the greedy rows' argmax (the fast step's): only the drawn rows are written
    there, and it is returned."""
    ps = [p or GREEDY for p in params]
    hot = [b for b, p in enumerate(ps) if not p.greedy]
    out = logits.float().argmax(dim=-1) if into is None else into
    if not hot:
        return out
    dev = logits.device

    def col(vals, dtype):
        if dev.type != "cuda":
            return torch.tensor(vals, dtype=dtype, device=dev)
        # from pinned memory, asynchronously: a pageable copy would wait for the stream (the
        # step just launched), which the step pipeline must not
        return torch.tensor(vals, dtype=dtype, pin_memory=True).to(dev, non_blocking=True)

    ps, counters = [ps[b] for b in hot], [counters[b] for b in hot]
    rows = col(hot, torch.int64)
    drawn = sample(logits.index_select(0, rows), col([p.temperature for p in ps], torch.float32),
                   col([p.top_k for p in ps], torch.int64),
                   col([p.top_p for p in ps], torch.float32),
                   col([p.seed for p in ps], torch.int64), col(counters, torch.int64))
    return out.index_copy_(0, rows, drawn.to(out.dtype))


def probabilities(logits: Tensor, params: SamplingParams) -> Tensor:
    """The distribution a non-greedy ``params`` draws from (``logits``: ``[V]``): the softmax of
    ``logits / temperature`` over the :func:`kept` tokens, renormalized."""
    x = (logits.float() / params.temperature)[None]
    keep = kept(x, torch.tensor([params.top_k]), torch.tensor([params.top_p]))
    return torch.softmax(x.masked_fill(~keep, float("-inf")), dim=-1)[0]


class Sampler:
    """One request's sampler: ``sampler(logits [V]) -> token id``, drawing with counters 0, 1,
    2, ... (the executors pass each row's position instead: :func:`sample_rows`)."""

    __slots__ = ("params", "draws")

    def __init__(self, params: SamplingParams = GREEDY) -> None:
        self.params = params
        self.draws = 0

    def __call__(self, logits: Tensor, counter: int | None = None) -> int:
        if counter is None:
            counter, self.draws = self.draws, self.draws + 1
        return int(sample_rows(logits[None], [self.params], [counter])[0])
