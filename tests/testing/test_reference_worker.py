"""The reference worker's content checks are not vacuous: a broken command is caught."""

import random

from hisparse_ray.core import Coordinator, CoordinatorConfig
from hisparse_ray.testing.reference_worker import ReferenceWorker
from hisparse_ray.types import StepCommand, TableDiff


def _setup():
    cfg = CoordinatorConfig(num_device_blocks=4, num_host_blocks=4, page_size=2, device_buffer_size=1)
    c = Coordinator(cfg)
    w = ReferenceWorker(cfg, random.Random(0))
    w.start("a", [1, 2, 0, 1, 2])
    adm = c.admit("a", [1, 2, 0, 1, 2], 2)
    w.land(adm)
    c.apply_landed("a")
    return c, w


def test_correct_commands_raise_no_violation():
    c, w = _setup()
    w.execute(c.take_commands())
    assert w.violations == [] and w.due[1][0][0] == "a"


def test_a_table_pointing_at_the_wrong_block_is_caught():
    c, w = _setup()
    (cmd,) = c.take_commands()
    bad = (TableDiff("a", 0, -1, 3),) + cmd.table_diffs[1:]
    w.execute((StepCommand(cmd.step, cmd.rank, cmd.batch, bad),))
    assert w.violations == ["step 1 a: position 0 (host -1, device 3) is wrong"]


def test_rank_commands_that_differ_are_caught():
    cfg = CoordinatorConfig(num_device_blocks=4, num_host_blocks=4, page_size=2,
                            device_buffer_size=1, tp_size=2)
    w = ReferenceWorker(cfg, random.Random(0))
    w.execute((StepCommand(1, 0, ()), StepCommand(1, 1, (), released=("x",))))
    assert w.violations == ["step 1: rank 1 command differs from rank 0"]
