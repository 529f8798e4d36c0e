"""Linux futex wait/wake on a shared-memory word through libc ``syscall`` (adapter ring, standard
library: ctypes). Used by the step channel's blocked waits; ``futex_available()`` is False where
the platform has none (the channel then sleeps)."""

from __future__ import annotations

import ctypes
import os
import platform

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not PRIVATE): the words live in a shared mapping


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load_syscall():
    if _SYS_FUTEX is None or not hasattr(os, "sched_yield"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).syscall  # CDLL calls release the GIL
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    return fn


_syscall = _load_syscall()
_WAKE_ALL = ctypes.c_int(2**31 - 1)


def futex_available() -> bool:
    """Whether blocked waits use a futex here (Linux x86-64 / aarch64 through libc ``syscall``)."""
    return _syscall is not None


def futex_wait(addr: int, expected: int, seconds: float) -> None:
    """Block while the u32 at ``addr`` equals ``expected``, at most ``seconds`` (returns early on
    a wake-up, a changed word, a signal or a spurious wake: the caller re-checks)."""
    ts = _Timespec(int(seconds), int((seconds % 1.0) * 1e9))
    _syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_int(_FUTEX_WAIT),
             ctypes.c_int(expected), ctypes.byref(ts), None, ctypes.c_int(0))


def futex_wake(addr: int) -> None:
    """Wake every waiter blocked on the u32 at ``addr`` (none: a cheap no-op syscall)."""
    _syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_int(_FUTEX_WAKE),
             _WAKE_ALL, None, None, ctypes.c_int(0))
