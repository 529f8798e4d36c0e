"""Which experts every MoE layer chose for every decoded row of an engine run: a recorder around
``Router.forward``, read at each ``on_logits`` (the decode forward's router calls are the last
ones before it: one call of the whole batch per layer, a fast step's padded bucket included, or,
batch-invariant, one call per row and layer, row by row). Eager steps only: a CUDA graph's
replay runs no Python; unpipelined only: with ``lookahead`` step N + 1's calls come before step
N's logits."""

from __future__ import annotations

from hisparse_ray.model.layers import MoE, Router


class RoutingRecorder:
    """``by_row[(request_id, seq_len)]``: a tuple, one frozenset of expert ids per MoE layer.
    Use as a context manager around an engine run and pass :meth:`attach` as its ``between``."""

    def __init__(self, model) -> None:
        self.layers = sum(isinstance(layer.mlp, MoE) for layer in model.model.layers)
        self.calls: list = []
        self.by_row: dict = {}
        self._orig = None

    def __enter__(self) -> "RoutingRecorder":
        orig = self._orig = Router.forward
        calls = self.calls

        def forward(router, x, rm=None):
            weights, experts = orig(router, x, rm)
            calls.append(experts.detach().cpu())
            return weights, experts

        Router.forward = forward
        return self

    def __exit__(self, *exc) -> None:
        Router.forward = self._orig

    def attach(self, eng) -> None:
        """Wrap ``eng.worker.on_logits`` (set it first) to file each step's router calls."""
        if eng.config.pipelined:
            raise AssertionError("RoutingRecorder needs EngineConfig(lookahead=False): a pipelined "
                                 "step launches before the previous one's logits are read")
        inner = eng.worker.on_logits

        def on_logits(rows, out):
            self._file(rows)
            if inner is not None:
                inner(rows, out)

        eng.worker.on_logits = on_logits

    def _file(self, rows) -> None:
        B, L, calls = len(rows), self.layers, self.calls
        per_row = B > 1 and calls[-1].shape[0] == 1
        need = L * B if per_row else L
        if len(calls) < need:
            raise AssertionError(f"{len(calls)} router calls before a step of {B} rows, {L} MoE layers")
        last = calls[-need:]
        for b, row in enumerate(rows):
            picks = last[b * L:(b + 1) * L] if per_row else [c[b:b + 1] for c in last]
            self.by_row[(row.request_id, row.seq_len)] = tuple(frozenset(p[0].tolist()) for p in picks)
        calls.clear()
