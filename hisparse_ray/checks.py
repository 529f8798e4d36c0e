"""Field checks for the frozen configs, options and specs (pure ring: standard library only).

Each ``check_*`` returns the value when it obeys the rule and otherwise raises
:class:`~hisparse_ray.errors.ConfigError` naming the key, the value and the rule. ``bool`` is
never accepted where an integer or a number is asked for (``True`` is not 1 GPU or 1 rank), and
a number must be finite unless the rule says otherwise.

    check_int("page_size", v, lo=1)                      # an int >= 1
    check_number("gpus_per_rank", v, lo=0, hi=1)          # a finite number in [0, 1]
    check_number("landing_timeout_s", v, lo=0, lo_open=True)  # seconds > 0
"""

from __future__ import annotations

import math
from typing import Any, Iterable

from hisparse_ray.errors import ConfigError


def is_int(value: Any) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An ``int`` or ``float`` that is not a ``bool`` (finite or not)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _bounds(lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> str:
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {lo:g}"
    if hi is not None:
        return f"{'<' if hi_open else '<='} {hi:g}"
    return ""


def check_int(key: str, value: Any, *, lo: int | None = None, hi: int | None = None,
              why: str = "") -> int:
    """``value`` if it is an int (not a bool) in ``[lo, hi]`` (either bound optional)."""
    ok = is_int(value) and (lo is None or value >= lo) and (hi is None or value <= hi)
    if not ok:
        rule = " ".join(x for x in ("must be an integer", _bounds(lo, hi, False, False)) if x)
        raise ConfigError(key, value, rule + (f" ({why})" if why else ""))
    return value


def check_number(key: str, value: Any, *, lo: float | None = None, hi: float | None = None,
                 lo_open: bool = False, hi_open: bool = False, finite: bool = True,
                 why: str = "") -> float:
    """``value`` if it is a number (int or float, not a bool), finite unless ``finite=False``,
    within the bounds (``lo_open`` / ``hi_open``: the bound itself is excluded)."""
    ok = is_number(value) and not math.isnan(value) and (not finite or math.isfinite(value))
    if ok and lo is not None:
        ok = value > lo if lo_open else value >= lo
    if ok and hi is not None:
        ok = value < hi if hi_open else value <= hi
    if not ok:
        rule = " ".join(x for x in ("must be a", "finite" if finite else "", "number",
                                     _bounds(lo, hi, lo_open, hi_open)) if x)
        raise ConfigError(key, value, rule + (f" ({why})" if why else ""))
    return value


def check_optional_number(key: str, value: Any, **bounds: Any) -> float | None:
    """None, or a number obeying :func:`check_number`'s rule."""
    if value is None:
        return None
    try:
        return check_number(key, value, **bounds)
    except ConfigError as err:
        raise ConfigError(key, value, err.allowed + " or None") from None


def check_bool(key: str, value: Any) -> bool:
    """``value`` if it is ``True`` or ``False`` (not 0 / 1, not "true")."""
    if not isinstance(value, bool):
        raise ConfigError(key, value, "must be True or False")
    return value


def check_choice(key: str, value: Any, choices: Iterable[Any]) -> Any:
    """``value`` if it is one of ``choices`` (compared by type and value: ``True`` is not 1)."""
    choices = tuple(choices)
    if not any(type(value) is type(c) and value == c for c in choices):
        raise ConfigError(key, value, f"must be one of {', '.join(map(repr, choices))}")
    return value


def check_str(key: str, value: Any, *, forbid: str = "", why: str = "") -> str:
    """``value`` if it is a non-empty ``str`` containing none of the characters of ``forbid``."""
    if not isinstance(value, str) or not value or any(c in value for c in forbid):
        rule = "must be a non-empty string"
        if forbid:
            rule += " without " + " or ".join(repr(c) for c in forbid)
        raise ConfigError(key, value, rule + (f" ({why})" if why else ""))
    return value


def check_type(key: str, value: Any, cls: type, what: str = "") -> Any:
    """``value`` if it is an instance of ``cls``."""
    if not isinstance(value, cls):
        raise ConfigError(key, value, f"must be {what or 'a ' + cls.__name__}")
    return value
