"""What a channel codec is (adapter ring, standard library): the ``Codec`` protocol, plain pickle
(any object; the fallback and the benchmarks' baseline), and slot-setting constructors for the
wire dataclasses. The step channels' default codec is
:class:`~hisparse_ray.channel.stepcodec.StepCodec`.

Pickling a ``slots=True`` dataclass goes through Python-level ``__getstate__``/``__setstate__``
per object: a 32-request ``StepCommand`` (~100 small objects) costs hundreds of microseconds each
way, more than the whole per-step budget; ``StepCodec`` rebuilds them with
:func:`slot_constructor` instead.
"""

from __future__ import annotations

import pickle
from typing import Any, Callable, Protocol

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


def slot_constructor(cls: type, names: list[str]) -> Callable[..., Any]:
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
