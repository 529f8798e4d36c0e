"""Drive an ``Engine`` to completion in a test or sweep, checking the core's invariants after
every step."""

from __future__ import annotations

from typing import Callable


def drive(eng, between: Callable | None = None, pending: Callable[[], bool] = lambda: False,
          max_steps: int = 500) -> int:
    """Step ``eng`` until it is done and ``pending()`` (requests still to be added) is false,
    calling ``between(eng, k)`` before step ``k``, then drain the releases. Every step must make
    progress unless the engine is idle, and the run must end within ``max_steps``. Returns the
    number of steps before the drain."""
    k = 0
    while not eng.done or pending():
        if between is not None:
            between(eng, k)
        progressed = eng.step()
        if not (progressed or eng.done or pending()):
            raise AssertionError(f"no progress at step {k}")
        eng.core.check_invariants()
        k += 1
        if k >= max_steps:
            raise AssertionError(f"not done after {max_steps} steps")
    while eng.step():
        eng.core.check_invariants()
    return k
