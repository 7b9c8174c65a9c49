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

from scheduler_runtime.hardware import parse_cores

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _machine_ticks(cores: tuple[int, ...] | None = None) -> tuple[int, int] | None:
    """``(busy, steal)`` ticks so far of the whole machine, or of ``cores``, from one read of /proc/stat.

    Its ``cpu`` (``cpuN``) lines hold user, nice, system, idle, iowait, irq, softirq, steal, ...;
    busy is all but idle and iowait, and includes steal (time the hypervisor gave our cores to others).
    """
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    wanted = ("cpu",) if cores is None else tuple(f"cpu{c}" for c in cores)
    busy = steal = 0
    found = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if name not in wanted:
            continue
        try:
            vals = [int(x) for x in rest.split()]
        except ValueError:
            return None
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
        busy += sum(vals[:8]) - idle
        steal += vals[7] if len(vals) > 7 else 0
        found += 1
    return (busy, steal) if found == len(wanted) else None


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

    ``cores``: measure on these cores only (an engine pinned to them, with this process's work
    running there too): other processes elsewhere do not slow it, so they do not count.
    """

    def __init__(self, cores: tuple[int, ...] | None = None) -> None:
        self.cores = cores
        self.fraction = 0.0
        self.steal = 0.0

    def __enter__(self) -> ForeignLoad:
        self._t = time.perf_counter()
        self._machine = _machine_ticks(self.cores)
        self._self = _self_ticks()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self._t
        machine, mine = _machine_ticks(self.cores), _self_ticks()
        if None in (machine, mine, self._machine, self._self) or wall <= 0:
            return
        (busy, steal), (busy0, steal0) = machine, self._machine
        machine_s = wall * (len(self.cores) if self.cores is not None else (os.cpu_count() or 1))
        foreign = max(0, (busy - busy0) - (mine - self._self)) / _TICKS
        self.fraction = foreign / machine_s
        self.steal = max(0, steal - steal0) / _TICKS / machine_s


def wait_for_quiet(threshold: float = 0.05, timeout_s: float = 120.0, probe_s: float = 1.0,
                   cores: tuple[int, ...] | None = None) -> float:
    """Block until other processes use less than ``threshold`` of the machine over ``probe_s``.

    ``cores``: of these cores only (see :class:`ForeignLoad`). Returns the last probe's fraction
    (above ``threshold`` when ``timeout_s`` ran out).
    """
    deadline = time.perf_counter() + timeout_s
    while True:
        with ForeignLoad(cores) as load:
            time.sleep(probe_s)
        if load.fraction < threshold or time.perf_counter() >= deadline:
            return load.fraction


def pinned_cores(spec: str | None) -> tuple[int, ...] | None:
    """The cores of an engine's ``cpu_cores`` spec (``"1"``, ``"0-1"``, ``"0,2"``); None: unpinned.

    Raises:
        ValueError: a spec that names no core this way (``"a"``, ``"1-0"``, ``"-1"``, ``"0,"``).
    """
    if not spec:
        return None
    try:
        return tuple(parse_cores(spec))
    except ValueError:
        raise ValueError(f"cpu_cores must be cores like '1', '0-1' or '0,2', got {spec!r}") from None
