"""How much of the machine other processes used while we measured something.

On a shared machine, timings are only trustworthy when nothing else competed for the
cores (vLLM's CPU threads meet at a barrier every layer, so one competing process can slow
an engine step ~10x). :class:`ForeignLoad` reads ``/proc/stat`` (all CPU time) and
``/proc/self/stat`` (this process's CPU time) around a measurement; the difference is the
CPU time other processes used, as a fraction of the cores' wall time. Benchmarks record it
with every measurement and re-measure or flag what ran under load.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _machine_ticks() -> tuple[int, int] | None:
    """``(busy, steal)`` ticks of the whole machine so far, from one read of /proc/stat.

    Its ``cpu`` line holds user, nice, system, idle, iowait, irq, softirq, steal, ...; busy is
    all but idle and iowait, and includes steal (time the hypervisor gave our cores to others).
    """
    try:
        vals = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
    return sum(vals[:8]) - idle, (vals[7] if len(vals) > 7 else 0)


def _self_ticks() -> int | None:
    try:
        stat = Path("/proc/self/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime (all threads)


class ForeignLoad:
    """Context manager: ``fraction`` = other processes' CPU time / (cores x wall time).

    ``steal`` is the part of it that the hypervisor gave to other guests (steal time),
    on the same scale; both stay 0.0 where /proc/stat cannot be read.
    """

    def __init__(self) -> None:
        self.fraction = 0.0
        self.steal = 0.0

    def __enter__(self) -> ForeignLoad:
        self._t = time.perf_counter()
        self._machine = _machine_ticks()
        self._self = _self_ticks()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self._t
        machine, mine = _machine_ticks(), _self_ticks()
        if None in (machine, mine, self._machine, self._self) or wall <= 0:
            return
        (busy, steal), (busy0, steal0) = machine, self._machine
        machine_s = wall * (os.cpu_count() or 1)
        foreign = max(0, (busy - busy0) - (mine - self._self)) / _TICKS
        self.fraction = foreign / machine_s
        self.steal = max(0, steal - steal0) / _TICKS / machine_s


def wait_for_quiet(threshold: float = 0.05, timeout_s: float = 120.0, probe_s: float = 1.0) -> float:
    """Block until other processes use less than ``threshold`` of the machine over ``probe_s``.

    Returns the last probe's fraction (above ``threshold`` when ``timeout_s`` ran out).
    """
    deadline = time.perf_counter() + timeout_s
    while True:
        with ForeignLoad() as load:
            time.sleep(probe_s)
        if load.fraction < threshold or time.perf_counter() >= deadline:
            return load.fraction
