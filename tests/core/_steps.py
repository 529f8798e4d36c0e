"""Driving a pure ``Coordinator`` by hand, as its ranks would (shared by the core's literal
tests): build one, take its next command with the handles applied, ack its transfers."""

from hisparse_ray.core import Coordinator, CoordinatorConfig
from hisparse_ray.types import StepReport


def make(dev=8, host=8, ps=2, H=1, tp=1, max_batch=8, **kw):
    return Coordinator(CoordinatorConfig(num_device_blocks=dev, num_host_blocks=host, page_size=ps,
                                         device_buffer_size=H, tp_size=tp, max_batch=max_batch, **kw))


def take(c):
    """The next command, with the handles it defines and releases applied to ``c.test_names``
    (handle -> request id, as a rank keeps them)."""
    cmd = c.take_command()
    names = c.__dict__.setdefault("test_names", {})
    if cmd is not None:
        for h in cmd.released:
            del names[h]
        for d in cmd.handles:
            assert d.handle not in names
            names[d.handle] = d.request_id
    return cmd


def tids(cmd):
    return tuple(t.transfer_id for t in cmd.transfers) + tuple(b.transfer_id for b in cmd.backups)


def ack(c, cmd, ranks=None, *, enqueued=False, sample=None, ids=None):
    """Every rank in ``ranks`` acks ``ids`` (default: all of cmd's transfers) completed (or
    enqueued); rank 0 also returns ``sample`` as every batch row's token."""
    ids = tids(cmd) if ids is None else ids
    for r in range(c.config.tp_size) if ranks is None else ranks:
        sampled = (tuple((c.test_names[row.handle], sample) for row in cmd.batch)
                   if r == 0 and sample is not None else ())
        c.apply_report(StepReport(cmd.step, r, enqueued=ids if enqueued else (),
                                  completed=() if enqueued else ids, sampled=sampled))
    c.check_invariants()
