"""Load a :class:`DSAModel` (or one TP rank's shard of it) from a :class:`Checkpoint` folder, tensor
by tensor (ring 2).

The model is built on the meta device, cast, sharded (:meth:`DSAModel.shard_heads`: rank ``r`` of
``tp`` keeps heads ``[r*H/tp, (r+1)*H/tp)`` of ``q_b_proj`` / ``kv_b_proj`` rows and ``o_proj``
columns; everything else replicated) and, for fp8 checkpoints run as fp8, its linears swapped for
:class:`Fp8Linear` and its experts made fp8; only then is memory allocated (on ``device``). Each
parameter is then filled from its checkpoint keys, one shard file at a time, reading only the rows
and columns this rank keeps (``get_slice`` of a memory-mapped file; the file is unmapped before
the next one). Peak host memory is therefore the model's own (when ``device`` is the CPU) plus one
file's touched pages plus one tensor's conversion buffers, never the checkpoint.

Key layout: parameter names equal HF's; routed experts come packed
(``mlp.experts.gate_up_proj [E, 2I, D]`` / ``down_proj [E, D, I]``, transformers 5.x) or per expert
(``mlp.experts.{e}.{gate,up,down}_proj.weight``, the released files), packed here gate rows first.
Keys of layers ``>= num_hidden_layers`` (the MTP layers), indexer weights of layers the config
makes ``"shared"`` (GLM index sharing over a checkpoint that has them) and rotary buffers are
skipped; any other key the model has no place for is an error, as is a missing key, a shape that
does not match the config, a non-float dtype, or an fp8 weight without its ``weight_scale_inv``.

fp8 weights are dequantized (fp32 products, one rounding to the model dtype) unless ``fp8`` is
``"kernel"`` (or ``"auto"`` on a device the fp8 GEMM supports, with dtype bf16 and 128x128 blocks;
:func:`keeps_fp8`): then every linear that is called as a module (all but ``kv_b_proj``, whose
weight the absorbed attention reads directly) and the routed
experts keep their fp8 bytes and scales, provided this rank's slice starts and ends on 128-row
block edges (else that one weight is dequantized).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hisparse_ray.errors import CheckpointError, ConfigError
from hisparse_ray.model.checkpoint import Checkpoint
from hisparse_ray.model.fp8 import FP8, Fp8Format, Fp8Linear, dequantize, set_fp8_backend
from hisparse_ray.model.layers import Experts
from hisparse_ray.model.model import DSAModel

FP8_MODES = ("auto", "kernel", "dequantize", "torch")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
# linears run through their module's forward (fp8-capable); kv_b_proj is read as a weight
_FP8_LINEARS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj", "indexer.wq_b", "indexer.wk",
                "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class Piece:
    """Fill ``param[dst]`` from checkpoint ``key`` rows/cols (``None`` = all). ``raw``: copy the
    stored values as they are (fp8 bytes or fp32 scales of a kept-fp8 weight); else values
    (fp8 dequantized, floats cast)."""

    key: str
    dst: tuple = ()
    rows: slice | None = None
    cols: slice | None = None
    raw: bool = False


def _head_cut(cfg, name: str, rank: int, tp: int) -> tuple[slice | None, slice | None]:
    """Rows / columns of the full checkpoint tensor that rank ``rank`` of ``tp`` keeps."""
    if tp == 1 or ".self_attn." not in name or ".indexer." in name:
        return None, None
    h = cfg.num_attention_heads // tp
    lo, hi = rank * h, (rank + 1) * h
    if name.endswith("q_b_proj.weight"):
        return slice(lo * cfg.qk_head_dim, hi * cfg.qk_head_dim), None
    if name.endswith("kv_b_proj.weight"):
        per = cfg.qk_nope_head_dim + cfg.v_head_dim
        return slice(lo * per, hi * per), None
    if name.endswith("o_proj.weight"):
        return None, slice(lo * cfg.v_head_dim, hi * cfg.v_head_dim)
    return None, None


def _aligned(s: slice | None, block: int) -> bool:
    return s is None or (s.start % block == 0 and s.stop % block == 0)


def _blocks(s: slice | None, block: int) -> slice | None:
    return None if s is None else slice(s.start // block, -(-s.stop // block))


class _Plan:
    """Every parameter's pieces, the expected full shape of every key, the keys consumed."""

    def __init__(self, ckpt: Checkpoint, full: dict[str, tuple[int, ...]], rank: int, tp: int) -> None:
        self.ckpt, self.full, self.rank, self.tp = ckpt, full, rank, tp
        self.pieces: dict[str, list[Piece]] = {}
        self.expected: dict[str, tuple[int, ...]] = {}  # checkpoint key -> full shape per config
        cfg = ckpt.config
        for name, shape in full.items():
            if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
                self._experts(name, shape)
                continue
            key = name
            if name == "lm_head.weight" and key not in ckpt and cfg.tie_word_embeddings:
                key = "model.embed_tokens.weight"
            rows, cols = _head_cut(cfg, name, rank, tp)
            self.pieces[name] = [Piece(key, (), rows, cols)]
            self.expected[key] = shape

    def _experts(self, name: str, shape: tuple[int, ...]) -> None:
        prefix, which = name.rsplit(".", 1)
        if name in self.ckpt:  # packed (transformers 5.x)
            self.pieces[name] = [Piece(name)]
            self.expected[name] = shape
            return
        E, n, k = shape
        if which == "gate_up_proj":
            i = n // 2
            parts = [(f"{prefix}.{e}.{p}_proj.weight", (e, slice(j * i, (j + 1) * i)))
                     for e in range(E) for j, p in enumerate(("gate", "up"))]
            per_key = (i, k)
        else:
            parts = [(f"{prefix}.{e}.down_proj.weight", (e,)) for e in range(E)]
            per_key = (n, k)
        self.pieces[name] = [Piece(key, dst) for key, dst in parts]
        self.expected.update({key: per_key for key, _ in parts})

    def check_keys(self) -> None:
        """Every key consumed or skippable; every expected key present with the expected shape."""
        L = self.ckpt.config.num_hidden_layers
        for key in self.ckpt.keys():
            if key in self.expected or "rotary_emb" in key:
                continue
            m = _LAYER.match(key)
            if m and int(m.group(1)) >= L:
                continue  # MTP layers
            if m and ".self_attn.indexer." in key and \
                    self.ckpt.config.indexer_types[int(m.group(1))] == "shared":
                continue  # a shared layer reuses its anchor's top-k: its indexer is unused (as in HF)
            if key.endswith("weight_scale_inv") and key[: -len("_scale_inv")] in self.expected:
                continue
            raise CheckpointError(self.ckpt.info(key).file, key, "unexpected: this model has no such parameter")
        for key, shape in self.expected.items():
            info = self.ckpt.info(key)
            if info.shape != shape:
                raise CheckpointError(info.file, key, f"shape {list(info.shape)} does not match the "
                                      f"config's {list(shape)}")
            if not info.dtype.is_floating_point:
                raise CheckpointError(info.file, key, f"dtype {info.dtype} is not a floating-point type")
            if info.dtype == FP8:
                skey = key[: -len("weight")] + "weight_scale_inv"
                fmt = self.ckpt.fp8
                if fmt is None:
                    raise CheckpointError(info.file, key, "fp8 weight but config.json has no quantization_config")
                if skey not in self.ckpt:
                    raise CheckpointError(info.file, skey, f"missing: the scales of fp8 weight {key}")
                want = tuple(-(-s // b) for s, b in zip(shape, fmt.block))
                sinfo = self.ckpt.info(skey)
                if sinfo.shape != want or not sinfo.dtype.is_floating_point:
                    raise CheckpointError(sinfo.file, skey, f"{sinfo.dtype} {list(sinfo.shape)}, expected "
                                          f"float {list(want)} (one scale per {fmt.block} block)")

    def is_fp8(self, key: str) -> bool:
        return self.ckpt.info(key).dtype == FP8


def _fp8_linears(model: DSAModel, plan: _Plan) -> list[str]:
    """Names of the linear modules that can keep fp8 weights on this rank."""
    block = plan.ckpt.fp8.block
    out = []
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear) or not name.endswith(_FP8_LINEARS):
            continue
        (piece,) = plan.pieces[f"{name}.weight"]
        if plan.is_fp8(piece.key) and _aligned(piece.rows, block[0]) and _aligned(piece.cols, block[1]) \
                and mod.in_features % block[1] == 0:
            out.append(name)
    return out


def _swap_to_fp8(model: DSAModel, plan: _Plan) -> None:
    """On meta: kept-fp8 linears become :class:`Fp8Linear`, fp8 experts :meth:`Experts.to_fp8_`;
    their pieces are rewritten to raw byte and scale copies."""
    block = plan.ckpt.fp8.block
    for name in _fp8_linears(model, plan):
        parent_name, attr = name.rsplit(".", 1)
        parent = model.get_submodule(parent_name)
        old = getattr(parent, attr)
        out_f, in_f = old.weight.shape  # after shard_heads (out|in)_features still name the full layer
        new = Fp8Linear(in_f, out_f, old.bias is not None, block)
        if old.bias is not None:  # the bias stays in the model dtype (Fp8Linear makes it fp32)
            new.bias = nn.Parameter(torch.empty_like(old.bias), requires_grad=False)
        setattr(parent, attr, new)
        (p,) = plan.pieces[f"{name}.weight"]
        plan.pieces[f"{name}.weight"] = [Piece(p.key, (), p.rows, p.cols, raw=True)]
        plan.pieces[f"{name}.weight_scale_inv"] = [
            Piece(p.key + "_scale_inv", (), _blocks(p.rows, block[0]), _blocks(p.cols, block[1]), raw=True)]
    for name, mod in model.named_modules():
        if not isinstance(mod, Experts):
            continue
        pieces = plan.pieces[f"{name}.gate_up_proj"] + plan.pieces[f"{name}.down_proj"]
        if not all(plan.is_fp8(p.key) for p in pieces) or mod.gate_up_proj.shape[1] % (2 * block[0]) \
                or mod.gate_up_proj.shape[2] % block[1] or mod.down_proj.shape[2] % block[1]:
            continue
        mod.to_fp8_(block)
        for w in ("gate_up_proj", "down_proj"):
            old = plan.pieces[f"{name}.{w}"]
            plan.pieces[f"{name}.{w}"] = [Piece(p.key, p.dst, raw=True) for p in old]
            plan.pieces[f"{name}.{w}_scale_inv"] = [
                Piece(p.key + "_scale_inv", tuple(_blocks(d, block[0]) if isinstance(d, slice) else d
                                                  for d in p.dst), raw=True) for p in old]


def _fill(param: Tensor, piece: Piece, reader, scales: dict[str, Tensor], plan: _Plan) -> None:
    ckpt = plan.ckpt
    info = ckpt.info(piece.key)
    dst = param[piece.dst] if piece.dst else param
    t = reader.read(piece.key, piece.rows, piece.cols).to(dst.device)  # convert where the weight lives
    if piece.raw:
        value = t
    elif info.dtype == FP8:
        r0 = piece.rows.start if piece.rows else 0
        c0 = piece.cols.start if piece.cols else 0
        bm, bn = ckpt.fp8.block
        s = scales[piece.key[: -len("weight")] + "weight_scale_inv"]
        s = s[r0 // bm: -(-(r0 + t.shape[0]) // bm), c0 // bn: -(-(c0 + t.shape[1]) // bn)].to(dst.device)
        value = dequantize(t, s, ckpt.fp8.block, dtype=dst.dtype, row0=r0, col0=c0)
    else:
        value = t
    if tuple(value.shape) != tuple(dst.shape):
        raise CheckpointError(info.file, piece.key, f"slice {list(value.shape)} does not fit "
                              f"{list(dst.shape)} (sharding bug or inconsistent config)")
    dst.copy_(value)


def keeps_fp8(fmt: Fp8Format | None, fp8: str, gemm_supported: bool, dtype: torch.dtype) -> bool:
    """Whether an ``fmt`` checkpoint's weights stay fp8 under mode ``fp8`` on a device where the fp8
    GEMM is (``gemm_supported``) or is not available, for model ``dtype``. ``"auto"`` keeps them only
    where the GEMM runs them (CUDA sm90, bf16, 128x128 blocks) and dequantizes everywhere else;
    ``"kernel"`` / ``"torch"`` that cannot keep them raise a ConfigError naming ``fp8``."""
    if fmt is None or fp8 == "dequantize":
        return False
    if fp8 == "auto":
        return gemm_supported and dtype == torch.bfloat16 and fmt.block == (128, 128)
    if fmt.block != (128, 128):
        raise ConfigError("fp8", fp8, f"weights kept fp8 need 128x128 blocks, the checkpoint has "
                          f"{fmt.block}; use 'dequantize'")
    if fp8 == "kernel" and (not gemm_supported or dtype != torch.bfloat16):
        raise ConfigError("fp8", fp8, "'kernel' needs a CUDA device of compute capability 9.x with "
                          "sgl-deep-gemm and dtype bfloat16; use 'dequantize'")
    return True


def load_checkpoint(
    ckpt: Checkpoint | str,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    rank: int = 0,
    tp_size: int = 1,
    group: dist.ProcessGroup | None = None,
    fp8: str = "auto",
) -> DSAModel:
    """Rank ``rank`` of ``tp_size``'s model from a checkpoint folder (see the module docstring).
    ``fp8``: ``"auto"`` (fp8 GEMM where supported, else dequantize), ``"kernel"`` (fp8 GEMM or a
    :class:`ConfigError`), ``"dequantize"``, ``"torch"`` (weights kept fp8, multiplied by the
    GEMM's torch twin: any device and dtype, slow; tests); ignored for unquantized checkpoints. ``group``: the TP
    process group (default group when None) for the per-layer all-reduce."""
    from hisparse_ray.kernels import fp8_gemm

    if not isinstance(ckpt, Checkpoint):
        ckpt = Checkpoint(ckpt)
    if fp8 not in FP8_MODES:
        raise ConfigError("fp8", fp8, f"one of {FP8_MODES}")
    cfg = ckpt.config
    if tp_size < 1 or not 0 <= rank < tp_size or cfg.num_attention_heads % tp_size:
        raise ConfigError("tp_size", tp_size, f"must divide num_attention_heads {cfg.num_attention_heads} "
                          f"(rank {rank})")
    keep_fp8 = keeps_fp8(ckpt.fp8, fp8, fp8_gemm.supported(device), dtype)
    with torch.device("meta"):
        model = DSAModel(cfg)
    model.cast_(dtype)
    full = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    plan = _Plan(ckpt, full, rank, tp_size)
    plan.check_keys()
    if tp_size > 1:
        model.shard_heads(rank, tp_size, group)
    if keep_fp8:
        _swap_to_fp8(model, plan)
    model.to_empty(device=device)
    model.rope = type(model.rope)(cfg)  # meta construction left its fp32 tables on meta
    params = model.state_dict(keep_vars=True)
    if set(params) != set(plan.pieces):
        raise AssertionError(f"plan/model mismatch: {sorted(set(params) ^ set(plan.pieces))[:5]}")
    by_file: dict[str, list[tuple[str, Piece]]] = defaultdict(list)
    scale_keys: dict[str, list[str]] = defaultdict(list)
    for name, pieces in plan.pieces.items():
        for p in pieces:
            info = ckpt.info(p.key)
            by_file[info.file].append((name, p))
            if info.dtype == FP8 and not p.raw:
                skey = p.key[: -len("weight")] + "weight_scale_inv"
                scale_keys[ckpt.info(skey).file].append(skey)
    scales: dict[str, Tensor] = {}  # small: one fp32 value per 128x128 block
    for file, keys in scale_keys.items():
        with ckpt.reader(file) as r:
            scales.update({k: r.read(k) for k in keys})
    with torch.no_grad():
        for file in sorted(by_file):
            with ckpt.reader(file) as r:
                for name, piece in by_file[file]:
                    _fill(params[name].data, piece, r, scales, plan)
    if keep_fp8 and fp8 == "torch":
        set_fp8_backend(model, "torch")
    return model.requires_grad_(False).eval()
