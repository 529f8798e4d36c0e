"""Our lightning indexer vs HF's indexer module (same weights, fp32): same top-k sets.

A set may differ only where HF's and our order break a tie of equal scores at the k-th place; the
check accepts exactly that (every differing position has the k-th score) and nothing else.
"""

from __future__ import annotations

import pytest
import torch

from hisparse_ray.model import build_tiny_model
from hisparse_ray.model.config import tiny_config
from hisparse_ray.model.indexer import select_topk
from hisparse_ray.model.model import build_random_model
from hisparse_ray.model.rowmath import RowMath

from ._hf import as_sets, hf_to_ours, hf_twin

KINDS = ["deepseek_v32", "glm_moe_dsa"]


def _assert_same_sets(ours: torch.Tensor, ref: torch.Tensor, scores: torch.Tensor, k: int) -> None:
    for s, (a, b) in enumerate(zip(as_sets(ours), as_sets(ref))):
        if a == b:
            continue
        valid = scores[s][scores[s] > float("-inf")]
        kth = valid.sort(descending=True).values[k - 1]
        assert all(scores[s, p] == kth for p in a ^ b), f"query {s}: {sorted(a ^ b)} are not ties at {kth}"


def _inputs(model, T: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(T, model.cfg.hidden_size, generator=gen)


@pytest.mark.parametrize("heads,chunk,exact", [(16, None, False), (2, 7, True), (1, 10, False)])
@pytest.mark.parametrize("kind", KINDS)
def test_prefill_topk_matches_hf_indexer(kind, heads, chunk, exact):
    """With 1-2 index heads most rows tie at the k-th place (relu zeros): HF's torch.topk and our
    rule may then pick different tied positions, which the check accepts and nothing else."""
    model = build_random_model(tiny_config(kind).with_(index_n_heads=heads), seed=1)
    hf = hf_twin(model)
    cfg, T = model.cfg, 96
    x = _inputs(model, T, seed=4)
    pos = torch.arange(T)
    for layer in cfg.indexer_layers:
        attn = model.model.layers[layer].self_attn
        hf_attn = hf.model.layers[layer].self_attn
        with torch.no_grad():
            q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
            cos_sin = hf.model.rotary_emb(x[None], pos[None])
            causal = torch.ones(1, T, T, dtype=torch.bool).tril()
            ref = hf_attn.indexer(x[None], q_resid[None], cos_sin, causal, pos[None])[0]
            cos, sin = model.rope.cos_sin(pos, model.dtype)
            ours, keys = attn.indexer.prefill_topk(x, q_resid, cos, sin, query_chunk=chunk, rm=RowMath(exact))
            qi, w = attn.indexer.queries(x, q_resid, cos, sin)
            scores = attn.indexer.scores(qi[None], w[None], keys[None])[0].masked_fill(~causal[0], float("-inf"))
        assert ours.shape == (T, cfg.index_topk)
        # Causality: never a future position; rows with < k visible keys select all of them.
        assert bool((ours <= pos[:, None]).all())
        assert all(len(s) == min(t + 1, cfg.index_topk) for t, s in enumerate(as_sets(ours)))
        _assert_same_sets(ours, hf_to_ours(ref, cfg.index_topk, query_pos=pos), scores, cfg.index_topk)


@pytest.mark.parametrize("kind", KINDS)
def test_batched_decode_topk_equals_last_row_of_prefill(kind):
    """Decode query at n-1 selects over all of [0, n) incl. itself, as HF's last prompt row does;
    batching rows of different n (keys padded) changes nothing."""
    model = build_tiny_model(seed=2, kind=kind)
    attn = model.model.layers[0].self_attn
    lengths = [5, 40, 73]
    xs = [_inputs(model, n, seed=n) for n in lengths]
    with torch.no_grad():
        rows, keys, q_rows = [], [], []
        for x in xs:
            pos = torch.arange(len(x))
            cos, sin = model.rope.cos_sin(pos, model.dtype)
            q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
            topk, k = attn.indexer.prefill_topk(x, q_resid, cos, sin)
            rows.append(topk[-1])
            keys.append(torch.nn.functional.pad(k, (0, 0, 0, max(lengths) - len(x))))
            q_rows.append((x[-1], q_resid[-1]))
        n = torch.tensor(lengths)
        cos, sin = model.rope.cos_sin(n - 1, model.dtype)
        x_last = torch.stack([q[0] for q in q_rows])
        qr_last = torch.stack([q[1] for q in q_rows])
        got = attn.indexer.decode_topk(x_last, qr_last, cos, sin, torch.stack(keys), n)
    assert as_sets(got) == as_sets(torch.stack(rows))
    assert as_sets(got)[0] == set(range(5))  # n <= k: everything, the current position included


def test_select_topk_pads_with_minus_one():
    s = torch.tensor([[3.0, float("-inf"), 1.0], [0.5, 2.0, 1.0]])
    got = select_topk(s, 4)
    assert got.tolist() == [[0, 2, -1, -1], [1, 2, 0, -1]]


def test_select_topk_breaks_ties_by_lower_position():
    z = -0.0
    s = torch.tensor([[0.0, 1.0, z, 0.0, 2.0, float("-inf"), 0.0]])
    assert select_topk(s, 5).tolist() == [[4, 1, 0, 2, 3]]
    assert select_topk(s, 8).tolist() == [[4, 1, 0, 2, 3, 6, -1, -1]]  # -inf never selected


@pytest.mark.parametrize("seed", range(4))
def test_select_topk_does_not_depend_on_padding_or_batch(seed):
    """Many exact ties (few distinct values): a row's selection is the same whatever its padded
    length and whatever other rows share the batch (the rule prefix reuse relies on)."""
    g = torch.Generator().manual_seed(seed)
    n, k = 300, 16
    row = torch.randint(0, 4, (n,), generator=g).float() * torch.rand(1, generator=g)
    alone = select_topk(row[None], k)
    for pad in (0, 1, 77, 1000):
        padded = torch.cat([row, torch.full((pad,), float("-inf"))])
        other = torch.randint(0, 4, (3, n + pad), generator=g).float()
        batch = torch.cat([other[:1], padded[None], other[1:]])
        assert torch.equal(select_topk(batch, k)[1], alone[0])
        assert torch.equal(select_topk(padded[None], k)[0], alone[0])
    # the selection equals a stable descending sort's first k
    ref = torch.sort(row, descending=True, stable=True).indices[:k]
    assert alone[0].tolist() == ref.tolist()



def _stable_reference(s: torch.Tensor, k: int) -> torch.Tensor:
    """The rule spelled out: a stable descending sort (-0.0 sorts equal to 0.0), -inf dropped."""
    vals, idx = torch.sort(s, descending=True, stable=True)
    idx = idx.masked_fill(vals == float("-inf"), -1)[:, :k]
    return torch.nn.functional.pad(idx, (0, k - idx.shape[1]), value=-1)


def _tie_heavy(g: torch.Generator, rows: int, n: int) -> torch.Tensor:
    s = torch.randint(0, 4, (rows, n), generator=g).float() * torch.rand(1, generator=g)
    s[torch.rand(rows, n, generator=g) < 0.2] = -0.0
    s[torch.rand(rows, n, generator=g) < 0.1] = float("-inf")
    return s


SHAPES = ((5, 7, 16), (8, 300, 16), (4, 5000, 2048), (2, 131072, 2048))  # rows, keys, k


def test_select_topk_is_a_stable_descending_sort():
    g = torch.Generator().manual_seed(0)
    for rows, n, k in SHAPES:
        s = _tie_heavy(g, rows, n)
        assert torch.equal(select_topk(s, k), _stable_reference(s, k)), (rows, n, k)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(3))
def test_select_topk_on_cuda_equals_cpu_on_ties(seed):
    """Tie-heavy rows (a few distinct values, -0.0 among the zeros, -inf masked keys), from short
    rows to 128K keys with DeepSeek-V3.2's k = 2048: the CUDA selection is the CPU's, position for
    position (the one rule: higher score first, equal scores by lower position)."""
    g = torch.Generator().manual_seed(seed)
    for rows, n, k in SHAPES:
        s = _tie_heavy(g, rows, n)
        assert torch.equal(select_topk(s.cuda(), k).cpu(), select_topk(s, k)), (rows, n, k)
