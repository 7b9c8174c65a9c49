"""Arrival processes: when the requests of a workload reach the scheduler.

Four processes, named by a short spec string (:func:`parse_arrival`):

- ``"burst"``: every request at t = 0, the setting of SVF's latency bound;
- ``"poisson:RATE"``: a Poisson process of RATE requests per second (exponential gaps with
  mean 1/RATE, the first arrival one gap after t = 0), seeded;
- ``"trace"``: keep the timestamps the workload was loaded with (e.g. the Splitwise trace's
  ``arrived_at``); an error for a workload without timestamps;
- ``"trace:FILE[:RATE]"``: the inter-arrival pattern of a real trace, for any workload. FILE is
  a CSV with an ``arrived_at`` column (seconds; the vidur traces) or JSON lines with a
  ``timestamp`` field; each seed takes the gaps of a window of consecutive arrivals starting at
  a random point of the trace (the first request at t = 0), so an episode keeps the trace's
  bursts and lulls. With RATE, every gap is scaled by the trace's mean rate / RATE, so the
  trace's mean rate becomes RATE requests/s while each window keeps its own relative load.
  A relative FILE is looked up beside the file that names it (a scenario), then in the
  data root's ``traces/`` folder (:mod:`feather_env.workloads.datadir`).
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Protocol

import numpy as np

from feather_env.workloads.datadir import resolve_data_dir
from feather_env.workloads.errors import WorkloadError
from feather_env.workloads.request import Request
from scheduler_runtime.config import ConfigError

ARRIVAL_FORMS = ('"burst", "poisson:RATE" (requests/s, > 0), "trace" or "trace:FILE[:RATE]" (a CSV with '
                 'arrived_at or JSON lines with timestamp)')


class Queue(Protocol):
    """What an arrival process reads of a workload (:class:`~feather_env.workloads.workload.Workload`):
    its name, its requests in queue order, and where their own timestamps came from."""

    @property
    def name(self) -> str: ...

    @property
    def arrivals(self) -> str | None: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Request]: ...


class ArrivalProcess(Protocol):
    """Draws one arrival time (seconds) per request of a workload, in its queue order."""

    @property
    def spec(self) -> str: ...

    def arrival_times(self, workload: Queue, seed: int) -> np.ndarray: ...


@dataclass(frozen=True)
class BurstArrivals:
    """All requests arrive at t = 0."""

    @property
    def spec(self) -> str:
        return "burst"

    def arrival_times(self, workload: Queue, seed: int) -> np.ndarray:
        return np.zeros(len(workload))


@dataclass(frozen=True)
class PoissonArrivals:
    """Poisson arrivals at ``rate`` requests per second, deterministic for a seed."""

    rate: float

    def __post_init__(self) -> None:
        if not (self.rate > 0 and np.isfinite(self.rate)):
            raise ConfigError(
                f"poisson arrival rate must be a finite number > 0, got {self.rate}; "
                f"valid forms: {ARRIVAL_FORMS}"
            )

    @property
    def spec(self) -> str:
        return f"poisson:{self.rate:g}"

    def arrival_times(self, workload: Queue, seed: int) -> np.ndarray:
        gaps = np.random.default_rng(seed).exponential(1.0 / self.rate, size=len(workload))
        return np.cumsum(gaps)


@dataclass(frozen=True)
class TraceArrivals:
    """The workload's own timestamps, as loaded (requests without them are an error)."""

    @property
    def spec(self) -> str:
        return "trace"

    def arrival_times(self, workload: Queue, seed: int) -> np.ndarray:
        if workload.arrivals is None:
            raise WorkloadError(
                f'arrival "trace": workload {workload.name!r} has no timestamps of its own '
                f'(only trace files with an arrived_at column do); use "burst" or '
                f'"poisson:RATE"'
            )
        return np.array([r.arrival_time for r in workload])


@lru_cache(maxsize=8)
def _trace_times(path: str, mtime_ns: int) -> np.ndarray:
    """The sorted timestamps of a trace file (cached per path and modification time)."""
    times: list[float] = []
    where = path
    try:
        with open(path, encoding="utf-8", newline="") as f:
            if path.endswith((".jsonl", ".json")):
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    where = f"{path}:{lineno}"
                    row = json.loads(line)
                    if not isinstance(row, dict) or "timestamp" not in row:
                        raise ConfigError(f"{where}: a trace line needs a 'timestamp' (seconds)")
                    times.append(float(row["timestamp"]))
            else:
                reader = csv.DictReader(f)
                if reader.fieldnames is None or "arrived_at" not in reader.fieldnames:
                    raise ConfigError(f"{path}: a trace CSV needs an 'arrived_at' column (seconds), "
                                      f"has {reader.fieldnames}")
                for lineno, row in enumerate(reader, 2):
                    where = f"{path}:{lineno}"
                    times.append(float(row["arrived_at"]))
    except (ValueError, TypeError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"{where}: not a timestamp ({exc})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    arr = np.asarray(times, dtype=np.float64)
    if len(arr) < 2:
        raise ConfigError(f"{path}: a trace needs at least 2 timestamps, has {len(arr)}")
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise ConfigError(f"{path}: timestamps must be finite seconds >= 0")
    arr.sort()
    if arr[-1] <= arr[0]:
        raise ConfigError(f"{path}: every timestamp is the same; a trace needs a time span")
    return arr


def resolve_trace_path(name: str, base_dir: str | os.PathLike[str] | None = None) -> Path:
    """A trace file named in an arrival spec: as given when absolute, else beside ``base_dir``
    (the file that names it), else in the data root's ``traces/`` folder."""
    path = Path(name).expanduser()
    if path.is_absolute():
        candidates = [path]
    else:
        candidates = [Path(base_dir) / path] if base_dir is not None else []
        try:
            candidates.append(resolve_data_dir(None, "traces") / path)
        except FileNotFoundError:
            pass
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise ConfigError(f"arrival trace file {name!r} not found (looked at {[str(c) for c in candidates]})")


@dataclass(frozen=True)
class TraceFileArrivals:
    """The inter-arrival gaps of a window of a trace file, optionally rescaled to ``rate``."""

    path: Path
    rate: float | None = None
    times: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.rate is not None and not (self.rate > 0 and math.isfinite(self.rate)):
            raise ConfigError(f"trace arrival rate must be a finite number > 0, got {self.rate}")
        path = str(self.path)
        object.__setattr__(self, "times", _trace_times(path, os.stat(path).st_mtime_ns))

    @property
    def spec(self) -> str:
        return f"trace:{self.path}" + ("" if self.rate is None else f":{self.rate:g}")

    @property
    def trace_rate(self) -> float:
        """The trace's own mean rate (requests/s)."""
        t = self.times
        return (len(t) - 1) / float(t[-1] - t[0])

    def arrival_times(self, workload: Queue, seed: int) -> np.ndarray:
        n, t = len(workload), self.times
        if n == 0:
            return np.zeros(0)
        rng = np.random.default_rng(seed)
        if n <= len(t):
            start = int(rng.integers(0, len(t) - n + 1))
            window = t[start:start + n] - t[start]
        else:  # a workload longer than the trace: its gaps again, drawn at random
            gaps = rng.choice(np.diff(t), size=n - 1)
            window = np.concatenate([[0.0], np.cumsum(gaps)])
        scale = 1.0 if self.rate is None else self.trace_rate / self.rate
        return window * scale


def parse_arrival(spec: str, base_dir: str | os.PathLike[str] | None = None) -> ArrivalProcess:
    """``"burst"`` | ``"poisson:RATE"`` | ``"trace"`` | ``"trace:FILE[:RATE]"`` -> an arrival process.

    ``base_dir``: where a relative trace FILE is looked up first (the scenario's folder).
    Raises :class:`ConfigError` naming the spec and the valid forms.
    """
    if not isinstance(spec, str):
        raise ConfigError(f"arrival must be a string ({ARRIVAL_FORMS}), got {spec!r}")
    kind, _, arg = spec.strip().partition(":")
    kind = kind.strip().lower()
    if kind == "burst" and not arg:
        return BurstArrivals()
    if kind == "trace" and not arg:
        return TraceArrivals()
    if kind == "trace":
        name, rate = arg, None
        head, sep, tail = arg.rpartition(":")
        if sep:
            try:
                rate = float(tail)
            except ValueError:
                rate = None
            else:
                name = head
        if not name:
            raise ConfigError(f"arrival {spec!r}: no trace file; valid forms: {ARRIVAL_FORMS}")
        return TraceFileArrivals(resolve_trace_path(name, base_dir), rate)
    if kind == "poisson" and arg:
        try:
            rate = float(arg)
        except ValueError:
            raise ConfigError(
                f"arrival {spec!r}: rate {arg!r} is not a number; valid forms: {ARRIVAL_FORMS}"
            ) from None
        return PoissonArrivals(rate)
    raise ConfigError(f"unknown arrival process {spec!r}; valid forms: {ARRIVAL_FORMS}")
