"""The decision rules, shared by the agents that learn or play them and the policy files that carry them.

- :class:`HeuristicRule`: the Feather authors' static ADD/STOP rule (the request decision);
- :class:`GroupCapRule`: ``group-cap-K``, the group decision's hand-made rule;
- the tabular agents' state bins, :class:`TableBins` (the request decision, the authors' bins) and
  :class:`GroupBins` (the group decision), and :func:`table_decision`, the greedy answer of a
  value table over them, or its baseline rule's where the table cannot tell its two answers apart
  (:func:`trusted_states`).

Engine-free and file-free: :mod:`scheduler_runtime.policy` writes and reads them as policy files.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import numpy as np

from scheduler_runtime.config import ConfigError, is_count, is_number
from scheduler_runtime.decision import ADD, GROUP_OBS_NAMES, STOP, ObservationSpec

__all__ = ["MAX_GROUP_CAP", "GroupBins", "GroupCapRule", "HeuristicRule", "TableBins", "bins_from_dict",
           "group_rule_cap", "open_choice", "table_decision", "trusted_states"]


@dataclass
class HeuristicRule:
    """The static rule of the Feather authors' code (docs/design.md, "Batching policies").

    ADD when ``delta <= delta_max`` chunks, or ``delta <= delta_max_shared`` when
    ``w >= w_shared``; such an ADD also raises a minimum-batch ``floor`` by one (up to
    ``floor_cap``). Any other candidate is ADDed only while the batch is below the floor.
    Masks win: ADD is never chosen when invalid, STOP never on an empty batch.

    ``floor_reset`` says when the floor returns to ``floor_init``:

    - ``"episode"`` (default): at :meth:`reset` only (an environment episode; in serving, the
      policy's lifetime). The floor is then a running estimate of how large batches can get on
      this workload: after a few cheap ADDs every batch is at least ``floor_cap``, which keeps
      a workload without shared prefixes (where the first ADD of each batch has a large delta)
      from being served one request at a time.
    - ``"batch"``: at every new batch (detected as the batch size not growing). Each cheap ADD
      raises the batch size and the floor together, so the floor never admits anything: the rule
      degenerates to the delta thresholds alone. Kept for comparison.
    """

    #: ``act`` reads any sequence of numbers (the core hands it a tuple: ``decision.BatchingPolicy``)
    reads_plain: ClassVar[bool] = True

    delta_max: float = 5
    delta_max_shared: float = 7
    w_shared: float = 10
    floor_cap: int = 10
    floor_init: int = 0
    floor_reset: str = "episode"
    floor: int = field(default=0, init=False)
    _last_batch: float = field(default=-1.0, init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("delta_max", "delta_max_shared", "w_shared"):
            if not is_number(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)!r}")
        for name in ("floor_cap", "floor_init"):
            if not is_count(getattr(self, name)):
                raise ValueError(f"{name} must be an integer >= 0, got {getattr(self, name)!r}")
        if self.floor_init > self.floor_cap:
            raise ValueError(f"floor_init {self.floor_init} exceeds floor_cap {self.floor_cap}")
        if self.floor_reset not in ("episode", "batch"):
            raise ValueError(f"floor_reset must be 'episode' or 'batch', got {self.floor_reset!r}")
        self.floor = self.floor_init

    def params(self) -> dict[str, Any]:
        return {"delta_max": self.delta_max, "delta_max_shared": self.delta_max_shared,
                "w_shared": self.w_shared, "floor_cap": self.floor_cap, "floor_init": self.floor_init,
                "floor_reset": self.floor_reset}

    def reset(self) -> None:
        self.floor = self.floor_init
        self._last_batch = -1.0

    def act(self, obs: Sequence[float], mask: Sequence[bool]) -> int:
        if not mask[ADD]:
            return STOP
        b = float(obs[0])
        if self.floor_reset == "batch" and b <= self._last_batch:
            self.floor = self.floor_init
        self._last_batch = b
        if not mask[STOP] or b <= 0:
            return ADD
        delta, w = float(obs[1]), float(obs[2])
        if delta <= self.delta_max or (w >= self.w_shared and delta <= self.delta_max_shared):
            self.floor = min(self.floor + 1, self.floor_cap)
            return ADD
        return ADD if b < self.floor else STOP


#: The largest K of a ``group-cap-K`` name.
MAX_GROUP_CAP = 64


def group_rule_cap(base: str) -> int | None:
    """The cap of a ``group-cap-K`` / ``group-hold`` base name (0: no cap), None for other names."""
    if base == "group-hold":
        return 0
    if base.startswith("group-cap-"):
        k = base[len("group-cap-"):]
        if k.isdigit() and 1 <= int(k) <= MAX_GROUP_CAP and k == str(int(k)):
            return int(k)
        raise ConfigError(f"scheduler {base!r}: K of group-cap-K must be an integer 1..{MAX_GROUP_CAP}")
    return None


@dataclass
class GroupCapRule:
    """``group-cap-K``: the hand-made rule of the group decision (cached-first order + hold + cap).

    Asked only when the candidate would open a prefix group that is not in flight (the batching
    core's group decision, whose order puts a cached group first). STOP (hold the new group) when
    ``cap`` groups are in flight already, or, with ``hold``, when the candidate's prefix is not
    cached (less than ``cached_min`` of its prompt) while requests of the groups in flight still
    wait; otherwise ADD. ``cap=None`` never caps (cached-first + hold alone).

    Both hold the new group back to keep the cached prefixes of the groups in flight from being
    evicted. While less than ``kv_min`` of the KV cache is in use or promised (the observation's
    ``kv_usage``: ``BatchingCore.kv_committed``) there is nothing to evict, so the rule ADDs: on
    a cache that holds every prompt (``leval-summaries``) a cap would only cut concurrency, which
    the engine measured at -12% for a cap of 5. On the simulator ``kv_min = 0.2`` turns every cap
    into ``group-hold`` on ``leval-summaries`` and leaves the tuned cap of every other scenario
    as it was (docs/design.md).

    ``lift_at`` (None: never) lifts the cap while at least that many groups wait (the
    observation's ``waiting_groups``; the hold still applies): a cap that depends on the load.
    The best constant cap rises with the load, so one constant cannot serve a light stream of
    documents and a crowd of them alike (``group-cap-5`` against ``group-cap-6`` on the Poisson and
    high-load scenarios, docs/design.md); a file for both needs the cap to give way in a crowd.
    """

    cap: int | None = 3
    hold: bool = True
    cached_min: float = 0.5
    kv_min: float = 0.2
    lift_at: int | None = None
    obs_spec: ClassVar[ObservationSpec] = ObservationSpec(names=GROUP_OBS_NAMES)  # the group decision's

    def __post_init__(self) -> None:
        if self.cap is not None and not is_count(self.cap, 1):
            raise ValueError(f"cap must be an integer >= 1 or None, got {self.cap!r}")
        if not (is_number(self.cached_min) and 0 <= self.cached_min <= 1):
            raise ValueError(f"cached_min must be in [0, 1], got {self.cached_min!r}")
        if not (is_number(self.kv_min) and 0 <= self.kv_min <= 1):
            raise ValueError(f"kv_min must be in [0, 1], got {self.kv_min!r}")
        if self.lift_at is not None and not is_count(self.lift_at, 1):
            raise ValueError(f"lift_at must be an integer >= 1 or None, got {self.lift_at!r}")

    @classmethod
    def from_name(cls, name: str) -> GroupCapRule | None:
        """The rule a scheduler name ``group-cap-K`` / ``group-hold`` stands for (defaults
        otherwise), None for any other name; a malformed K is a ``ConfigError``."""
        cap = group_rule_cap(name)
        return None if cap is None else cls.from_cap(cap)

    @classmethod
    def from_cap(cls, cap: int) -> GroupCapRule:
        """The rule of a cap as scheduler configs and checkpoints count it (0: no cap, ``group-hold``)."""
        return cls(cap=cap or None)

    def params(self) -> dict[str, Any]:
        """The rule's parameters as a policy file writes them (``lift_at`` only when set, so a file
        of a rule without it is the file written before it existed)."""
        out = {"cap": self.cap, "hold": self.hold, "cached_min": self.cached_min, "kv_min": self.kv_min}
        if self.lift_at is not None:
            out["lift_at"] = self.lift_at
        return out

    @property
    def name(self) -> str:
        """``group-cap-K`` or ``group-hold`` (the scheduler names of the rule with the default hold);
        ``group-cap-K-lift-M`` with ``lift_at`` (a policy file's rule, not a scheduler name)."""
        if self.cap is None:
            return "group-hold"
        return f"group-cap-{self.cap}" + (f"-lift-{self.lift_at}" if self.lift_at is not None else "")

    def lifted(self, obs: Sequence[float]) -> bool:
        """Whether enough groups wait (``lift_at``) for the cap to give way."""
        return self.lift_at is not None and bool(obs[_WAITING_GROUPS] >= self.lift_at)

    def pressured(self, obs: Sequence[float]) -> bool:
        """Whether the KV cache is in use enough (``kv_min``) for holding a group back to matter."""
        return bool(obs[_KV_USAGE] >= self.kv_min)

    def act(self, obs: Sequence[float], mask: Sequence[bool]) -> int:
        if not mask[ADD]:
            return STOP
        if not mask[STOP] or not self.pressured(obs):
            return ADD
        if self.cap is not None and obs[_GROUPS_IN_FLIGHT] >= self.cap and not self.lifted(obs):
            return STOP
        if self.hold and obs[_CACHED_FRACTION] < self.cached_min and obs[_WAITING_IN_FLIGHT] > 0:
            return STOP
        return ADD


_GROUPS_IN_FLIGHT = GROUP_OBS_NAMES.index("groups_in_flight")
_CACHED_FRACTION = GROUP_OBS_NAMES.index("cached_fraction")
_WAITING_IN_FLIGHT = GROUP_OBS_NAMES.index("waiting_in_flight")
_WAITING_GROUPS = GROUP_OBS_NAMES.index("waiting_groups")
_KV_USAGE = GROUP_OBS_NAMES.index("kv_usage")


@dataclass(frozen=True)
class TableBins:
    """The bandit's state bins: ``(min(B // batch_div, batch_max), clip(delta, ±delta_clip),
    min(w // w_div, w_max))``, defaults as in the authors' code."""

    batch_div: int = 4
    batch_max: int = 10
    delta_clip: int = 5
    w_div: int = 4
    w_max: int = 10

    def __post_init__(self) -> None:
        for name, low in (("batch_div", 1), ("w_div", 1), ("batch_max", 0), ("delta_clip", 0), ("w_max", 0)):
            if not is_count(getattr(self, name), low):
                raise ValueError(f"bins.{name} must be an integer >= {low}, got {getattr(self, name)!r}")

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.batch_max + 1, 2 * self.delta_clip + 1, self.w_max + 1)

    @property
    def num_states(self) -> int:
        a, b, c = self.shape
        return a * b * c

    def index(self, obs: Sequence[float]) -> int:
        """Flat state index of a raw observation (values are truncated to integers)."""
        b = min(max(int(obs[0]), 0) // self.batch_div, self.batch_max)
        d = min(max(int(obs[1]), -self.delta_clip), self.delta_clip) + self.delta_clip
        w = min(max(int(obs[2]), 0) // self.w_div, self.w_max)
        return (b * (2 * self.delta_clip + 1) + d) * (self.w_max + 1) + w

    def to_dict(self) -> dict[str, int]:
        return {"batch_div": self.batch_div, "batch_max": self.batch_max, "delta_clip": self.delta_clip,
                "w_div": self.w_div, "w_max": self.w_max}


@dataclass(frozen=True)
class GroupBins:
    """The tabular agents' state bins of the group decision: ``(min(groups_in_flight, in_flight_max),
    min(waiting_in_flight, waiting_in_flight_max), cached_fraction >= 0.5, min(waiting_groups //
    waiting_groups_div, waiting_groups_max), min(int(kv_usage * kv_levels), kv_levels - 1))``: the
    cap (groups in flight), the hold (work of the groups in flight that waits, and whether the
    candidate is cached), the load (groups waiting) and the KV pressure.

    The defaults (9 x 3 x 2 x 2 x 1 = 108 states: load as fewer or more than 8 groups waiting, no
    KV levels) learned the best constant cap's decisions on ``leval-kv-pressure-poisson`` within
    1% on three seeds out of three (Q-learning, 40,000 steps); four load and four KV levels (1,080
    states) left seeds up to 3% behind it, the same steps spread over ten times the states."""

    in_flight_max: int = 8
    waiting_in_flight_max: int = 2
    waiting_groups_div: int = 8
    waiting_groups_max: int = 1
    kv_levels: int = 1
    kind: ClassVar[str] = "group"

    def __post_init__(self) -> None:
        for name, low in (("in_flight_max", 0), ("waiting_in_flight_max", 0), ("waiting_groups_div", 1),
                          ("waiting_groups_max", 0), ("kv_levels", 1)):
            if not is_count(getattr(self, name), low):
                raise ValueError(f"bins.{name} must be an integer >= {low}, got {getattr(self, name)!r}")

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.in_flight_max + 1, self.waiting_in_flight_max + 1, 2, self.waiting_groups_max + 1,
                self.kv_levels)

    @property
    def num_states(self) -> int:
        return int(np.prod(self.shape))

    def index(self, obs: Sequence[float]) -> int:
        """Flat state index of a raw group observation."""
        g = min(max(int(obs[_GROUPS_IN_FLIGHT]), 0), self.in_flight_max)
        wf = min(max(int(obs[_WAITING_IN_FLIGHT]), 0), self.waiting_in_flight_max)
        c = int(obs[_CACHED_FRACTION] >= 0.5)
        wg = min(max(int(obs[_WAITING_GROUPS]), 0) // self.waiting_groups_div, self.waiting_groups_max)
        kv = min(max(int(obs[_KV_USAGE] * self.kv_levels), 0), self.kv_levels - 1)
        return int(np.ravel_multi_index((g, wf, c, wg, kv), self.shape))

    def representative(self, state: int, kv_min: float = 0.0) -> list[float]:
        """A raw group observation (a batch under way) that falls in flat state ``state``: its KV
        usage is the bin's least at or above ``kv_min`` where the bin reaches that, else the least."""
        g, wf, c, wg, kv = (int(i) for i in np.unravel_index(state, self.shape))
        obs = [0.0] * len(GROUP_OBS_NAMES)
        obs[0] = 1.0
        obs[_GROUPS_IN_FLIGHT], obs[_WAITING_IN_FLIGHT], obs[_CACHED_FRACTION] = g, wf, float(c)
        obs[_WAITING_GROUPS] = wg * self.waiting_groups_div
        low, high = kv / self.kv_levels, (kv + 1) / self.kv_levels
        reaches = kv_min < high or kv == self.kv_levels - 1  # the last bin holds usage 1.0
        obs[_KV_USAGE] = max(low, kv_min) if reaches else low
        return obs

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "in_flight_max": self.in_flight_max,
                "waiting_in_flight_max": self.waiting_in_flight_max,
                "waiting_groups_div": self.waiting_groups_div, "waiting_groups_max": self.waiting_groups_max,
                "kv_levels": self.kv_levels}


def bins_from_dict(data: Mapping[str, Any]) -> TableBins | GroupBins:
    """The bins a table policy file names: :class:`GroupBins` for ``"kind": "group"``, else the
    paper's :class:`TableBins`."""
    data = dict(data)
    if data.pop("kind", None) == "group":
        return GroupBins(**data)
    return TableBins(**data)


def trusted_states(values: Sequence[float], visits: Sequence[int], stderr: Sequence[float], z: float,
                   min_visits: int) -> list[bool]:
    """Per state, whether a value table's greedy answer is trusted over its baseline rule: both
    actions visited at least ``min_visits`` times and their values more than ``z`` standard errors
    of the difference apart (``stderr``: of each value, flat ``2 * state + action`` like
    ``values``). Elsewhere :func:`table_decision` answers as the baseline does: a table departs
    from the rule it is measured against only where its own estimates say the departure is real
    (safe policy improvement with baseline bootstrapping, Laroche et al., ICML 2019, with the
    values' standard errors added to its visit threshold)."""
    out = []
    for s in range(0, len(values), 2):
        seen = visits[s] >= min_visits and visits[s + 1] >= min_visits
        out.append(bool(seen and abs(values[s] - values[s + 1]) > z * math.hypot(stderr[s], stderr[s + 1])))
    return out


class Pressured(Protocol):
    """A baseline of :func:`open_choice`: :class:`GroupCapRule`, or a loaded ``group-cap`` file."""

    def pressured(self, obs: Sequence[float]) -> bool: ...


def open_choice(obs: Sequence[float], mask: Sequence[bool], baseline: Pressured | None = None) -> bool:
    """A choice a learned answer may take from ``baseline``: both actions valid, a batch under way
    and, with a baseline, the KV cache in use enough for the rule to hold
    (:meth:`GroupCapRule.pressured`); the rule answers every other."""
    pressured = baseline is None or baseline.pressured(obs)
    return bool(mask[ADD]) and bool(mask[STOP]) and obs[0] > 0 and pressured


def table_decision(bins: TableBins | GroupBins, values: Sequence[float], visits: Sequence[int],
                   add_if_delta_zero: bool, obs: Sequence[float], mask: Sequence[bool],
                   baseline: GroupCapRule | None = None, trusted: Sequence[bool] | None = None) -> int:
    """Greedy action of a tabular policy (``values``/``visits`` flat, ``2 * state + action``).

    Order of the rules: masks; an empty batch ADDs; ``add_if_delta_zero`` (the bandit's rule)
    ADDs when the candidate loses no shared prefix; otherwise the visited valid action of highest
    value, ties and never-visited states going to ADD (what a batch-maximizing scheduler would
    do, i.e. the baseline the policy must improve on).

    With a ``baseline`` rule the table answers only the choices that are open (both actions valid,
    a batch under way, the KV cache in use enough for the rule to hold: ``GroupCapRule.pressured``)
    in the states it ``trusts`` (:func:`trusted_states`), by value; the rule answers everything
    else, so that a table whose trusted states all agree with the rule answers exactly as the rule.
    """
    if baseline is not None:
        if not (open_choice(obs, mask, baseline) and trusted is not None and trusted[bins.index(obs)]):
            return baseline.act(obs, mask)
    elif not mask[ADD]:
        return STOP
    elif not mask[STOP] or obs[0] <= 0:
        return ADD
    elif add_if_delta_zero and int(obs[1]) == 0:
        return ADD
    s = 2 * bins.index(obs)
    if visits[s] > 0 and (visits[s + 1] <= 0 or values[s] > values[s + 1]):
        return STOP
    return ADD
