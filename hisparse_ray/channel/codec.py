"""Message codecs for the step channel (adapter ring, standard library + the wire module).

Pickling a ``slots=True`` dataclass goes through Python-level ``__getstate__``/``__setstate__``
per object: a 32-request ``StepCommand`` (~100 small objects) costs hundreds of microseconds each
way, more than the whole per-step budget. ``WireCodec`` flattens the wire dataclasses to nested
tuples (pickled by C code) and rebuilds them slot by slot: equal objects, ~5-10x cheaper. The
channel's default is now the stateful binary ``stepcodec.StepCodec`` (faster again); these stay
for other channels and as its comparison baseline (``benchmarks/bench_channel.py``).
"""

from __future__ import annotations

import dataclasses
import enum
import operator
import pickle
import typing
from itertools import starmap
from typing import Any, Callable, Protocol

from hisparse_ray import types as wire

_PROTO = pickle.HIGHEST_PROTOCOL


class Codec(Protocol):
    """Turns one message into bytes and back; ``loads(dumps(x)) == x``."""

    def dumps(self, obj: Any) -> bytes: ...

    def loads(self, data: bytes) -> Any: ...


class PickleCodec:
    """Plain pickle (highest protocol): any picklable object."""

    def dumps(self, obj: Any) -> bytes:
        return pickle.dumps(obj, protocol=_PROTO)

    def loads(self, data: bytes) -> Any:
        return pickle.loads(data)


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _fast_constructor(cls: type, names: list[str]) -> Callable[..., Any]:
    """A positional constructor for a frozen ``slots=True`` dataclass that sets the slots through
    their descriptors: the generated ``__init__`` of a frozen class pays an ``object.__setattr__``
    lookup per field (~1.6x slower). Classes with ``__post_init__`` or without slots keep theirs."""
    if hasattr(cls, "__post_init__") or not all(
            type(getattr(cls, n, None)).__name__ == "member_descriptor" for n in names):
        return cls
    env: dict[str, Any] = {"_new": object.__new__, "_cls": cls}
    env.update({f"_set_{n}": getattr(cls, n).__set__ for n in names})
    args = ", ".join(names)
    body = "".join(f"    _set_{n}(obj, {n})\n" for n in names)
    exec(f"def make({args}):\n    obj = _new(_cls)\n{body}    return obj\n", env)  # noqa: S102
    return env["make"]


class _Schema:
    """How one wire dataclass is flattened: per field, plain, enum, nested dataclass, or a tuple of
    nested dataclasses (from its resolved type hints)."""

    def __init__(self, cls: type, schemas: dict[type, _Schema]) -> None:
        self.cls = cls
        hints = typing.get_type_hints(cls, vars(wire))
        self.names = [f.name for f in dataclasses.fields(cls)]
        self.enc: list[Callable[[Any], Any] | None] = []
        self.dec: list[Callable[[Any], Any] | None] = []
        for name in self.names:
            tp = hints[name]
            args = typing.get_args(tp)
            if isinstance(tp, type) and issubclass(tp, enum.Enum):
                self.enc.append(operator.attrgetter("value"))
                self.dec.append(tp)
            elif _is_dataclass_type(tp):
                sub = schemas.setdefault(tp, _Schema(tp, schemas))
                self.enc.append(sub.encode)
                self.dec.append(sub.decode)
            elif typing.get_origin(tp) is tuple and len(args) == 2 and args[1] is Ellipsis \
                    and _is_dataclass_type(args[0]):
                sub = schemas.setdefault(args[0], _Schema(args[0], schemas))
                self.enc.append(sub.encode_many)
                self.dec.append(sub.decode_many)
            else:
                self.enc.append(None)
                self.dec.append(None)
        self.plain = all(e is None for e in self.enc)
        self.make = _fast_constructor(cls, self.names)
        self.get = operator.attrgetter(*self.names)
        if len(self.names) == 1:
            only = self.get
            self.get = lambda o: (only(o),)

    def encode(self, obj: Any) -> tuple:
        values = self.get(obj)
        if self.plain:
            return values
        return tuple(v if e is None else e(v) for v, e in zip(values, self.enc))

    def decode(self, values: tuple) -> Any:
        if self.plain:
            return self.make(*values)
        return self.make(*(v if d is None else d(v) for v, d in zip(values, self.dec)))

    def encode_many(self, objs: tuple) -> tuple:
        if self.plain:
            return tuple(map(self.get, objs))
        return tuple(map(self.encode, objs))

    def decode_many(self, rows: tuple) -> tuple:
        if self.plain:
            return tuple(starmap(self.make, rows))
        return tuple(map(self.decode, rows))


class WireCodec:
    """Fast codec for the top-level wire messages (``StepCommand``, ``StepReport`` by default);
    anything else is pickled as is. The flattening follows each dataclass's fields and type hints,
    so fields added to ``hisparse_ray.types`` are carried without touching this module."""

    def __init__(self, messages: tuple[type, ...] = (wire.StepCommand, wire.StepReport)) -> None:
        schemas: dict[type, _Schema] = {}
        self._by_type = {cls: (i, schemas.setdefault(cls, _Schema(cls, schemas)))
                         for i, cls in enumerate(messages)}
        self._by_tag = [schema for _, schema in self._by_type.values()]

    def dumps(self, obj: Any) -> bytes:
        hit = self._by_type.get(type(obj))
        if hit is None:
            return pickle.dumps((-1, obj), protocol=_PROTO)
        tag, schema = hit
        return pickle.dumps((tag, schema.encode(obj)), protocol=_PROTO)

    def loads(self, data: bytes) -> Any:
        tag, body = pickle.loads(data)
        return body if tag < 0 else self._by_tag[tag].decode(body)
