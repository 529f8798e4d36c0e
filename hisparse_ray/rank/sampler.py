"""Rank 0's token sampler (ring 2): a request's next token from its logits row, by its
:class:`~hisparse_ray.types.SamplingParams`.

Runs on the CPU on the float32 copy of the step's logits that rank 0 reads back anyway, with one
``torch.Generator`` per request seeded from ``SamplingParams.seed`` and advanced by exactly one
draw per sampled token. Equal logits therefore give equal tokens on every run, on every device
the model ran on, and in every mode (HiSparse decode equals full-resident decode bit for bit, so
their seeded samples are equal too). Greedy is ``argmax`` of the row, as before sampling existed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hisparse_ray.types import SamplingParams

GREEDY = SamplingParams()


class Sampler:
    """One request's sampler: ``sampler(logits [V] float32 CPU) -> token id``."""

    __slots__ = ("params", "gen")

    def __init__(self, params: SamplingParams = GREEDY) -> None:
        self.params = params
        self.gen: torch.Generator | None = None
        if not params.greedy:
            self.gen = torch.Generator(device="cpu")
            self.gen.manual_seed(params.seed)

    def __call__(self, logits: Tensor) -> int:
        if self.gen is None:
            return int(logits.argmax())
        return int(torch.multinomial(probabilities(logits, self.params), 1, generator=self.gen))


def probabilities(logits: Tensor, params: SamplingParams) -> Tensor:
    """The distribution a non-greedy ``params`` draws from: softmax(logits / temperature) over
    the ``top_k`` largest logits (ties with the k-th kept: the cut depends on values only, never
    on their order), then the smallest prefix of the tokens sorted by probability (descending,
    ties by id) whose mass reaches ``top_p``, renormalized. ``logits``: [V] float32."""
    x = logits.float() / params.temperature
    k = params.top_k
    if 0 < k < x.numel():
        kth = torch.topk(x, k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True, stable=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass of the tokens ranked above
        cut = before >= params.top_p
        cut[0] = False  # the most likely token always stays
        probs = probs.scatter(0, order[cut], 0.0)
        probs = probs / probs.sum()
    return probs
