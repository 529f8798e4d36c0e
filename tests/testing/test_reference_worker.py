"""The reference worker's checks are not vacuous: a broken command is caught (content, request
handles, hot-buffer diffs, host-pool generations)."""

import random

from msgspec.structs import replace

from hisparse_ray.core import Coordinator, CoordinatorConfig
from hisparse_ray.testing.reference_worker import ReferenceWorker
from hisparse_ray.types import RequestHandle, StepCommand, StepReport, TableDiff


def _setup(prompt=(1, 2, 0, 1, 2), dev=4, **kw):
    cfg = CoordinatorConfig(num_device_blocks=dev, num_host_blocks=4, page_size=2,
                            device_buffer_size=1, **kw)
    c = Coordinator(cfg)
    w = ReferenceWorker(cfg, random.Random(0))
    w.start("a", list(prompt))
    adm = c.admit("a", list(prompt), 3)
    w.land(adm)
    c.apply_landed("a")
    return c, w


def test_correct_commands_raise_no_violation():
    c, w = _setup()
    w.execute(c.take_command())
    assert w.violations == [] and w.due[1][0][0] == "a"


def test_a_table_pointing_at_the_wrong_block_is_caught():
    c, w = _setup()
    cmd = c.take_command()
    bad = (TableDiff(0, 0, -1, 3),) + cmd.table_diffs[1:]
    w.execute(replace(cmd, table_diffs=bad))
    assert w.violations == ["step 1 a: position 0 (host -1, device 3) is wrong"]


def test_a_handle_used_before_its_definition_or_defined_twice_is_caught():
    c, w = _setup()
    cmd = c.take_command()
    w.execute(replace(cmd, handles=()))
    assert "step 1: handle 0 used before any command defined it" in w.violations
    c, w = _setup()
    cmd = c.take_command()
    w.execute(cmd)
    w.execute(StepCommand(2, handles=(RequestHandle(0, "b"),)))
    assert w.violations == ["step 2: handle 0 defined while it names a"]


def test_a_first_row_without_its_hot_buffer_is_caught():
    c, w = _setup()
    cmd = c.take_command()
    w.execute(replace(cmd, batch=(replace(cmd.batch[0], hot_blocks=None),)))
    assert w.violations == ["step 1: a's first row carries no hot buffer"]


def test_a_host_row_read_before_the_peers_waited_for_its_step_is_caught(monkeypatch):
    """With peers (TP 2) a host row rank 0 wrote in step K is read only after the peers waited
    for a step >= K (``HostPool.wait_step`` at their first command after K); ``host_seq`` orders
    the host side only, so a command carrying an old one reads step 1's backup legally. With the
    peers' step wait off the read is flagged; with one rank, rank 0 reads its own writes in
    stream order (no peer to wait for)."""
    for waits in (True, False):
        monkeypatch.setattr(ReferenceWorker, "peer_waits_by_step", waits)
        for tp in (2, 1):
            c, w = _setup(prompt=(1, 2, 0), dev=1, tp_size=tp)  # host tier: backups every step
            cmd = c.take_command()
            w.execute(cmd)
            assert w.gen == 1 and w.violations == [] and set(w.host_step.values()) == {1}
            for r in range(c.config.tp_size):  # rank 0 reports generation 1: the next has it
                rep = w.flush(r)
                assert rep.published == (1 if r == 0 else 0)
                c.apply_report(rep)
            nxt = c.take_command()
            assert nxt.host_seq == 1
            w.execute(replace(nxt, host_seq=0))
            caught = [v for v in w.violations
                      if "written in step 1 read with the peers waited only for step -1" in v]
            assert bool(caught) == (tp > 1 and not waits), w.violations
            assert len(caught) == len(w.violations)


def test_a_host_seq_never_published_is_caught():
    c, w = _setup()
    w.execute(replace(c.take_command(), host_seq=5))
    assert w.violations == ["step 1: host_seq 5 was never published (0)"]


def test_anything_but_one_command_is_caught():
    _, w = _setup()
    w.execute((StepCommand(1),))
    w.execute(StepReport(1, 0))
    assert len(w.violations) == 2 and all("expected one StepCommand" in v for v in w.violations)
