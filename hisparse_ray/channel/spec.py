"""What names a step ring and how its ends wait (adapter ring, standard library): the spec an
attaching end needs, the wait policy, and the cleanup of segments whose creator died.
:mod:`hisparse_ray.channel.ring` builds the rings on them."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from hisparse_ray.checks import check_bool, check_number
from hisparse_ray.host.segment import pid_alive as _pid_alive

SHM_DIR = "/dev/shm"
DEFAULT_PREFIX = "hsr-ch-"

Role = Literal["writer", "reader"]


@dataclass(frozen=True, slots=True)
class ChannelSpec:
    """What an attaching side needs: the segment, its geometry, the role the creator took, and
    (attaching as a reader of a ring with several) which reader it is."""

    name: str
    capacity: int
    creator_role: Role
    readers: int = 1
    reader: int = 0


@dataclass(frozen=True, slots=True)
class WaitPolicy:
    """How a blocked ``send``/``recv`` waits: busy-spin for ``spin_s``, then ``sched_yield()``s
    until ``yield_s``, then blocks on a futex (``futex=True`` and supported: the other side's
    publish or read wakes it, a wait lasts at most ``futex_slice_s``) or else sleeps doubling from
    ``min_sleep_s`` to ``max_sleep_s``. The peer's liveness is checked at most every
    ``liveness_s`` once blocked. Ranks with a core of their own can raise ``yield_s``."""

    spin_s: float = 50e-6
    yield_s: float = 1e-3
    min_sleep_s: float = 10e-6
    max_sleep_s: float = 100e-6  # bounds the latency a sleeping waiter adds
    liveness_s: float = 0.02
    futex: bool = True
    futex_slice_s: float = 2e-3  # bounds a lost wake-up (see ShmRing) and the close check

    def __post_init__(self) -> None:  # ConfigError (a ValueError) naming the field
        check_number("yield_s", self.yield_s, lo=0, why="seconds")
        check_number("spin_s", self.spin_s, lo=0, hi=self.yield_s, why="seconds, <= yield_s")
        check_number("max_sleep_s", self.max_sleep_s, lo=0, lo_open=True, why="seconds")
        check_number("min_sleep_s", self.min_sleep_s, lo=0, lo_open=True, hi=self.max_sleep_s,
                     why="seconds, <= max_sleep_s")
        check_number("liveness_s", self.liveness_s, lo=0, lo_open=True, why="seconds")
        check_bool("futex", self.futex)
        check_number("futex_slice_s", self.futex_slice_s, lo=0, lo_open=True, why="seconds")


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host and is not a zombie."""
    return _pid_alive(pid, 0)


def cleanup_stale_segments(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Unlink ring segments whose creator process is gone (names carry the creator's pid);
    returns the names removed. Segments are normally unlinked once every end is mapped, so only
    a creator that died before its peers attached leaves one behind."""
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(prefix):
            continue
        try:
            pid = int(name[len(prefix):].split("-", 1)[0])
        except ValueError:
            continue
        if not pid_alive(pid):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
            except OSError:
                pass
    return removed
