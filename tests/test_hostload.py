"""feather_env.hostload: the foreign-CPU figure every benchmark records with its timings.

No assertion here depends on how busy the machine is: the accounting is checked on scripted
/proc readings, and on the real /proc only as a lower bound (other processes can only add).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import feather_env.hostload as hostload
from feather_env.engines.vllm_engine import EngineConfig
from feather_env.hostload import ForeignLoad
from scheduler_runtime.config import ConfigError


class _Clock:
    def __init__(self, *readings: float) -> None:
        self.readings = list(readings)

    def perf_counter(self) -> float:
        return self.readings.pop(0)


def test_foreign_load_is_the_machine_time_less_our_own_over_the_cores_wall_time(monkeypatch) -> None:
    ticks = hostload._TICKS
    machine = iter([(1000, 50), (1000 + 3 * ticks, 50 + ticks // 2)])  # 3 s busy, 0.5 s of it steal
    mine = iter([400, 400 + ticks])  # 1 s of it ours
    monkeypatch.setattr(hostload, "_machine_ticks", lambda cores=None: next(machine))
    monkeypatch.setattr(hostload, "_self_ticks", lambda: next(mine))
    monkeypatch.setattr(hostload, "time", _Clock(10.0, 12.0))  # 2 s of wall time
    monkeypatch.setattr(hostload.os, "cpu_count", lambda: 2)
    with ForeignLoad() as load:
        pass
    assert load.fraction == (3 - 1) / (2 * 2.0)  # others' 2 s of the cores' 4 s
    assert load.steal == 0.5 / (2 * 2.0)


def test_unreadable_proc_leaves_zero(monkeypatch) -> None:
    monkeypatch.setattr(hostload, "_machine_ticks", lambda cores=None: None)
    with ForeignLoad() as load:
        pass
    assert load.fraction == 0.0 and load.steal == 0.0


def test_a_spinning_child_is_counted_as_foreign_load() -> None:
    """The child's own CPU time (from the kernel's rusage) is a lower bound of what is counted."""
    spin = "import time\nwhile time.process_time() < 0.5: pass\n"
    outer = hostload.time.perf_counter()
    with ForeignLoad() as load:
        child = subprocess.Popen([sys.executable, "-c", spin])
        _, status, usage = os.wait4(child.pid, 0)
    wall = hostload.time.perf_counter() - outer  # at least the load's own wall time
    assert os.waitstatus_to_exitcode(status) == 0
    child_cpu = usage.ru_utime + usage.ru_stime
    counted = load.fraction * (os.cpu_count() or 1) * wall
    assert child_cpu >= 0.5 and counted >= child_cpu - 3 / hostload._TICKS
    assert 0.0 <= load.steal <= load.fraction + 1e-9


def test_foreign_load_on_pinned_cores_reads_only_their_lines(monkeypatch) -> None:
    stat = iter(["cpu  10 0 10 100 0 0 0 0\ncpu0 5 0 5 50 0 0 0 0\ncpu1 5 0 5 50 0 0 0 0\n",
                 "cpu  10 0 10 100 0 0 0 0\ncpu0 905 0 5 50 0 0 0 0\ncpu1 105 0 5 50 0 0 0 0\n"])

    class _Stat:
        def __init__(self, path: str) -> None:
            self.path = path

        def read_text(self) -> str:
            return next(stat)

    ticks = hostload._TICKS
    monkeypatch.setattr(hostload, "Path", _Stat)
    mine = iter([0, 0])
    monkeypatch.setattr(hostload, "_self_ticks", lambda: next(mine))
    monkeypatch.setattr(hostload, "time", _Clock(0.0, 100 / ticks))  # core 1 was busy all along
    with ForeignLoad(cores=(1,)) as load:
        pass
    assert load.fraction == 1.0  # core 0's 900 ticks do not count
    assert hostload.pinned_cores("1") == (1,) and hostload.pinned_cores("0-2,5") == (0, 1, 2, 5)
    assert hostload.pinned_cores(None) is None


@pytest.mark.parametrize("spec", ["a", "1-0", "0,", "-1", "0-", "1,,2", "0-1-2"])
def test_a_cpu_cores_spec_that_names_no_core_is_refused_with_the_engine_config(spec: str) -> None:
    with pytest.raises(ValueError, match="cpu_cores must be cores like"):
        hostload.pinned_cores(spec)
    with pytest.raises(ConfigError, match="cpu_cores must be cores like"):
        EngineConfig(cpu_cores=spec)
    assert EngineConfig(cpu_cores="0-1,3").cores == (0, 1, 3)
