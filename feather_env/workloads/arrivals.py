"""Arrival processes: when the requests of a workload reach the scheduler.

Three processes, named by a short spec string (:func:`parse_arrival`):

- ``"burst"``: every request at t = 0, the setting of SVF's latency bound;
- ``"poisson:RATE"``: a Poisson process of RATE requests per second (exponential gaps with
  mean 1/RATE, the first arrival one gap after t = 0), seeded;
- ``"trace"``: keep the timestamps the workload was loaded with (e.g. the Splitwise trace's
  ``arrived_at``); an error for a workload without timestamps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from scheduler_runtime.config import ConfigError

if TYPE_CHECKING:
    from feather_env.workloads.workload import Workload

ARRIVAL_FORMS = '"burst", "poisson:RATE" (requests/s, > 0) or "trace"'


class ArrivalProcess(Protocol):
    """Draws one arrival time (seconds) per request of a workload, in its queue order."""

    @property
    def spec(self) -> str: ...

    def arrival_times(self, workload: Workload, seed: int) -> np.ndarray: ...


@dataclass(frozen=True)
class BurstArrivals:
    """All requests arrive at t = 0."""

    @property
    def spec(self) -> str:
        return "burst"

    def arrival_times(self, workload: Workload, seed: int) -> np.ndarray:
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

    def arrival_times(self, workload: Workload, seed: int) -> np.ndarray:
        gaps = np.random.default_rng(seed).exponential(1.0 / self.rate, size=len(workload))
        return np.cumsum(gaps)


@dataclass(frozen=True)
class TraceArrivals:
    """The workload's own timestamps, as loaded (requests without them are an error)."""

    @property
    def spec(self) -> str:
        return "trace"

    def arrival_times(self, workload: Workload, seed: int) -> np.ndarray:
        from feather_env.workloads.workload import WorkloadError

        if workload.arrivals is None:
            raise WorkloadError(
                f'arrival "trace": workload {workload.name!r} has no timestamps of its own '
                f'(only trace files with an arrived_at column do); use "burst" or '
                f'"poisson:RATE"'
            )
        return np.array([r.arrival_time for r in workload])


def parse_arrival(spec: str) -> ArrivalProcess:
    """``"burst"`` | ``"poisson:RATE"`` | ``"trace"`` -> an arrival process.

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
    if kind == "poisson" and arg:
        try:
            rate = float(arg)
        except ValueError:
            raise ConfigError(
                f"arrival {spec!r}: rate {arg!r} is not a number; valid forms: {ARRIVAL_FORMS}"
            ) from None
        return PoissonArrivals(rate)
    raise ConfigError(f"unknown arrival process {spec!r}; valid forms: {ARRIVAL_FORMS}")
