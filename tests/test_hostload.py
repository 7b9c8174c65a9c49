"""feather_env.hostload: the foreign-CPU figure every benchmark records with its timings."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from feather_env.hostload import ForeignLoad


def test_a_spinning_process_shows_as_foreign_load_and_our_own_work_does_not() -> None:
    with ForeignLoad() as own:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.5:  # our own busy loop is not foreign
            pass
    spin = "import time\nt = time.perf_counter()\nwhile time.perf_counter() - t < 1.5: pass\n"
    child = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(0.2)  # let the child start
        with ForeignLoad() as other:
            time.sleep(1.0)
    finally:
        child.wait()
    # one core of the machine's cores busy: 1 / cores of its time (0.5 on 2 cores)
    assert other.fraction - own.fraction > 0.4 / (os.cpu_count() or 1)
    assert 0.0 <= other.steal <= other.fraction + 1e-9
