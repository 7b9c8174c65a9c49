"""The batching core's vocabulary: the orderings' names, its configuration, its counters and records.

Below both the core (:mod:`scheduler_runtime.batching`) and its orderings
(:mod:`scheduler_runtime.orderings`), which share these: an ordering reads the core through
:class:`CoreView`, and the core builds its ordering with :func:`~scheduler_runtime.orderings.make_ordering`.
Both modules re-export the names they used to define.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any, NamedTuple, Protocol

import numpy as np

from scheduler_runtime.cht import ChunkedHashTree
from scheduler_runtime.config import check_core_knobs
from scheduler_runtime.decision import EngineView
from scheduler_runtime.groups import PrefixGroups
from scheduler_runtime.prefix_index import DEFAULT_CHUNK_SIZE, Candidate
from scheduler_runtime.radix import RADIX_ORDERINGS

__all__ = [
    "ADMISSIONS",
    "BASELINE_ORDERINGS",
    "DECISIONS",
    "KEY_ORDERINGS",
    "ORDERINGS",
    "RELEASE_REASONS",
    "CoreConfig",
    "CoreStats",
    "CoreView",
    "Decision",
    "Entry",
    "OrderingName",
]


class OrderingName(StrEnum):
    """The orderings' names: Feather's (CHT + policy) and the baselines' orders."""

    FEATHER = "feather"
    FCFS = "fcfs"
    SJF = "sjf"
    SVF = "svf"
    LPM = RADIX_ORDERINGS[0]
    DFS_WEIGHT = RADIX_ORDERINGS[1]


#: Every ordering's name.
ORDERINGS = tuple(o.value for o in OrderingName)
#: The baselines' orderings (answered by always-add).
BASELINE_ORDERINGS = tuple(o for o in ORDERINGS if o != OrderingName.FEATHER.value)
#: The orderings by a per-request key.
KEY_ORDERINGS = (OrderingName.SJF.value, OrderingName.SVF.value)


#: What the policy decides: ADD/STOP on every candidate (the paper's decision), or only on a
#: candidate that would open a prefix group that is not in flight (``scheduler_runtime.groups``).
DECISIONS = ("request", "group")
#: Why a request was released (:class:`CoreStats`).
RELEASE_REASONS = ("policy", "seed", "max_wait", "order", "group")
#: What a released request is charged against the KV capacity: nothing, its unshared prompt
#: tokens (the engine's own admission test, made at release time), or SVF's peak (unshared
#: prompt + output estimate).
ADMISSIONS = ("none", "prompt", "peak")


@dataclass(frozen=True)
class CoreConfig:
    """Every knob of the batching core.

    Attributes:
        ordering: one of :data:`ORDERINGS`.
        admission: one of :data:`ADMISSIONS`.
        svf_seed: seed an empty batch with the smallest-volume request (else with the
            ordering's first candidate).
        chunk_size: CHT chunk size in tokens (delta and depths are in these chunks).
        max_wait: seconds after which a waiting request is released whatever the policy
            says; ``None`` disables it.
        lpm_fcfs_fallback: ``lpm`` serves FCFS when more requests than this wait (SGLang:
            128); ``None`` always matches.
        decision: one of :data:`DECISIONS` (``group`` needs the ``feather`` ordering).
        group_chunks: a request's prefix group is its first ``group_chunks`` CHT chunks.
        retain_held_prefixes: at the end of every round, ask the engine to evict the cached
            prefixes of the held groups last (:meth:`~scheduler_runtime.decision.EngineView.retain_prefixes`;
            the largest group's last of all).
    """

    ordering: str = OrderingName.FEATHER
    admission: str = "peak"
    svf_seed: bool = True
    chunk_size: int = DEFAULT_CHUNK_SIZE
    max_wait: float | None = 60.0
    lpm_fcfs_fallback: int | None = 128
    decision: str = "request"
    group_chunks: int = 1
    retain_held_prefixes: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.ordering, OrderingName):  # a plain string in dumps and comparisons
            object.__setattr__(self, "ordering", self.ordering.value)
        if self.decision not in DECISIONS:
            raise ValueError(f"decision must be one of {DECISIONS}, got {self.decision!r}")
        if self.decision == "group" and self.ordering != OrderingName.FEATHER:
            raise ValueError(f"the group decision needs the feather ordering, not {self.ordering!r}")
        if self.ordering not in ORDERINGS:
            raise ValueError(f"ordering must be one of {ORDERINGS}, got {self.ordering!r}")
        if self.admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {ADMISSIONS}, got {self.admission!r}")
        check_core_knobs(chunk_size=self.chunk_size, max_wait=self.max_wait,
                         lpm_fcfs_fallback=self.lpm_fcfs_fallback, group_chunks=self.group_chunks)


@dataclass
class CoreStats:
    """Counters of the core (exported by the vLLM scheduler to ``/metrics``).

    ``decisions`` counts answered decisions (``adds`` + ``stops``); releases are counted in
    ``released`` by reason: ``seed``, ``max_wait``, an ADD (``policy`` for Feather's ordering,
    ``order`` for a baseline's, so ``/metrics`` tells the two apart), or ``group``: with the group
    decision, a request released without one (its group is in flight, or it shares nothing).
    ``decision_seconds`` is the wall time spent in :meth:`BatchingCore.plan`.
    """

    plan_calls: int = 0
    decisions: int = 0
    adds: int = 0
    stops: int = 0
    skipped_decisions: int = 0
    capacity_stops: int = 0
    released: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(RELEASE_REASONS, 0))
    arrived: int = 0
    finished: int = 0
    aborted: int = 0
    preempted: int = 0
    decision_seconds: float = 0.0
    max_plan_seconds: float = 0.0
    retained_blocks: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Entry:
    """The core's record of one request: what its ordering and its KV charge read."""

    __slots__ = ("request_id", "prompt_len", "output_len", "arrival", "footprint")

    def __init__(self, request_id: str, prompt_len: int, output_len: float, arrival: float) -> None:
        self.request_id = request_id
        self.prompt_len = prompt_len
        self.output_len = output_len
        self.arrival = arrival
        self.footprint = 0.0


class Decision(NamedTuple):
    """The pending decision: ADD ``request_id`` to the batch, or STOP (see :meth:`BatchingCore.observe`).

    ``mask`` is ``[STOP valid, ADD valid]``; a pending decision always has ADD valid (a candidate
    that does not fit ends the round instead) and STOP valid (an empty batch is seeded). A named
    tuple (immutable, as a frozen dataclass, and built several times faster: one per decision).
    """

    request_id: str
    mask: np.ndarray


class CoreView(Protocol):
    """What an ordering reads (and the candidate it caches) of the core it serves
    (:class:`~scheduler_runtime.batching.BatchingCore`)."""

    config: CoreConfig
    chunk_size: int
    cht: ChunkedHashTree
    groups: PrefixGroups
    group_tokens: int
    _waiting: dict[str, Entry]
    _engine: EngineView
    _candidate_cache: Candidate | None

    def _oldest_waiting(self) -> Entry | None: ...

    def nothing_fits(self, fewest_missing: int) -> bool: ...
