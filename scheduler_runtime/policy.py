"""Exported batching policies: one versioned file format, and :func:`load_policy` that runs it.

Every agent of ``agents/`` (heuristic, UCB bandit, Q-learning, PPO, always-add) exports its
decision rule to one self-describing JSON file (``policy.feather``) that the runtime scheduler
loads **without stable-baselines3 or torch**: a table for the tabular agents, the rule's
constants for the heuristic, the actor MLP's weights for PPO (run by numpy).

File layout (``FORMAT_VERSION`` 1)::

    {
      "format": "feather-policy",        # what the file is
      "version": 1,                      # bumped on any incompatible change
      "kind": "heuristic" | "group-cap" | "table" | "mlp" | "constant",
      "agent": "ucb",                    # which agent wrote it (informative)
      "observation": {"names": [...], "low": [...], "high": [...], "scale": [...],
                      "chunk_size": 256},
      "action": {"names": ["STOP", "ADD"]},
      "params": {...},                   # the kind's parameters, see below
      "meta": {...},                     # training provenance (config, timesteps, ...)
      "sha256": "..."                    # of the canonical JSON of every other field
    }

The observation is the batching core's (:mod:`scheduler_runtime.decision` names its entries),
in raw units: batch size, delta in chunks of ``chunk_size`` tokens, w, and with the extended
names the rest; ``scale`` is ``FeatherEnv.obs_scale``. A loaded policy's ``act(obs, mask)``
takes exactly what the environment gives, which is what the serving core computes, and the
mask ``[STOP valid, ADD valid]``; values outside ``[low, high]`` are clipped first, as the
environment clips them.

Kinds and their ``params``:

- ``constant``: ``{"action": "ADD"|"STOP"}`` (``always-add``).
- ``heuristic``: the static rule of docs/design.md with its constants (see :class:`HeuristicRule`).
- ``group-cap``: the group decision's hand-made rule with its constants (see :class:`GroupCapRule`);
  its observation is the group one.
- ``table``: a value per (state bin, action) and its visit count, with the bins
  ``(min(B // batch_div, batch_max), clip(delta, -delta_clip, delta_clip), min(w // w_div, w_max))``
  (see :func:`table_decision`); used by the UCB bandit and Q-learning.
- ``mlp``: ``{"activation": "tanh", "layers": [{"weight": [[...]], "bias": [...]}, ...]}``,
  ``weight`` shaped ``(out, in)`` as in torch; the last layer outputs the logits of
  ``[STOP, ADD]``; the input is the clipped observation divided by ``scale``.

Any problem with a file (missing, truncated, not JSON, checksum mismatch, other format or
version, unknown kind, observation/action spec that is malformed or not the one expected,
parameters of the wrong type, shape or range, non-finite numbers) raises
:class:`PolicyFormatError` naming the file and the problem, when the file is loaded: a policy
that loads does not fail at its first decision because of its file.

Plug-in policies. :func:`load_policy_spec` also takes ``py:MODULE:ATTRIBUTE``: ATTRIBUTE of
the importable module MODULE is a class (or any callable) that is called without arguments and
returns an object with ``act(obs, mask) -> 0 | 1`` (optional: ``obs_spec``, an
:class:`ObservationSpec`, and ``reset()``), as :class:`~scheduler_runtime.batching.BatchingPolicy`
says. The scheduler names it ``feather:py:MODULE:ATTRIBUTE``. This runs the module's code inside
the engine, exactly as vLLM's own ``--scheduler-cls`` does: name only code you trust.

A decision costs a few microseconds (``benchmarks/policy_latency.py`` measures each kind).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
import numbers
import os
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from scheduler_runtime.decision import (
    ACTION_NAMES,
    ADD,
    BASE_OBS_NAMES,
    EXTENDED_OBS_NAMES,
    GROUP_OBS_NAMES,
    OBSERVATION_KINDS,
    STOP,
    AlwaysAdd,
)

__all__ = [
    "ACTION_NAMES",
    "ADD",
    "BASE_OBS_NAMES",
    "EXTENDED_OBS_NAMES",
    "FORMAT",
    "FORMAT_VERSION",
    "KINDS",
    "STOP",
    "ActionSpec",
    "ConstantPolicy",
    "GROUP_OBS_NAMES",
    "GroupBins",
    "GroupCapPolicy",
    "GroupCapRule",
    "HeuristicPolicy",
    "HeuristicRule",
    "MLPPolicy",
    "ObservationSpec",
    "Policy",
    "PolicyFormatError",
    "TableBins",
    "TablePolicy",
    "PLUGIN_PREFIX",
    "load_policy",
    "load_policy_spec",
    "policy_from_document",
    "bins_from_dict",
    "default_policy",
    "table_decision",
    "write_policy",
]

FORMAT = "feather-policy"
FORMAT_VERSION = 1
KINDS = ("constant", "heuristic", "group-cap", "table", "mlp")


def _is_number(x: Any) -> bool:
    """A finite real number that is not a bool (JSON ``true`` is not a weight)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def _all_numbers(x: Any) -> bool:
    """Every leaf of nested lists is a finite number (:func:`_is_number`)."""
    return all(_all_numbers(v) for v in x) if isinstance(x, list) else _is_number(x)


def _is_count(x: Any, low: int = 0) -> bool:
    """An int (not a bool) >= ``low``."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= low


class PolicyFormatError(ValueError):
    """A policy file cannot be used: names the file and what is wrong with it."""

    def __init__(self, path: str | os.PathLike[str] | None, problem: str) -> None:
        self.path = None if path is None else str(path)
        self.problem = problem
        where = "policy" if path is None else f"policy file {str(path)!r}"
        super().__init__(f"{where}: {problem}")


# -- specs ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ObservationSpec:
    """What the policy's observation means: names (in order), bounds and scale, delta's unit."""

    names: tuple[str, ...] = BASE_OBS_NAMES
    low: tuple[float, ...] = ()
    high: tuple[float, ...] = ()
    scale: tuple[float, ...] = ()
    chunk_size: int | None = None

    @classmethod
    def from_env(cls, env: Any) -> ObservationSpec:
        """The spec of a ``FeatherEnv`` (or any wrapper of one)."""
        env = getattr(env, "unwrapped", env)
        n = env.observation_space.shape[0]
        names = getattr(env, "obs_names", None) or (
            EXTENDED_OBS_NAMES if n == len(EXTENDED_OBS_NAMES) else BASE_OBS_NAMES[:n])
        return cls(
            names=tuple(names),
            low=tuple(float(x) for x in env.observation_space.low),
            high=tuple(float(x) for x in env.observation_space.high),
            scale=tuple(float(x) for x in env.obs_scale),
            chunk_size=int(env.chunk_size),
        )

    def to_dict(self) -> dict[str, Any]:
        return {"names": list(self.names), "low": list(self.low), "high": list(self.high),
                "scale": list(self.scale), "chunk_size": self.chunk_size}

    @classmethod
    def from_dict(cls, data: Any, path: Any = None) -> ObservationSpec:
        if not isinstance(data, Mapping):
            raise PolicyFormatError(path, "'observation' must be a mapping")
        unknown = set(data) - {"names", "low", "high", "scale", "chunk_size"}
        if unknown:
            raise PolicyFormatError(path, f"'observation' has unknown keys {sorted(unknown)}")
        names = data.get("names")
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            raise PolicyFormatError(path, "'observation.names' must be a non-empty list of strings")
        if tuple(names) not in OBSERVATION_KINDS.values():
            known = "; ".join(f"{kind} {list(v)}" for kind, v in OBSERVATION_KINDS.items())
            raise PolicyFormatError(path, f"observation names {names} are none of the environment's: {known}")
        n = len(names)
        vectors = {}
        for key in ("low", "high", "scale"):
            v = data.get(key)
            if not isinstance(v, list) or len(v) != n or not all(_is_number(x) for x in v):
                raise PolicyFormatError(path, f"'observation.{key}' must be {n} finite numbers, got {v!r}")
            vectors[key] = tuple(float(x) for x in v)
        if any(s <= 0 for s in vectors["scale"]):
            raise PolicyFormatError(path, f"'observation.scale' must be > 0, got {list(vectors['scale'])}")
        if any(lo > hi for lo, hi in zip(vectors["low"], vectors["high"], strict=True)):
            raise PolicyFormatError(path, "'observation.low' exceeds 'observation.high'")
        chunk = data.get("chunk_size")
        if chunk is not None and not _is_count(chunk, 1):
            raise PolicyFormatError(path, f"'observation.chunk_size' must be a positive int, got {chunk!r}")
        return cls(tuple(names), vectors["low"], vectors["high"], vectors["scale"], chunk)

    def mismatch(self, expected: ObservationSpec) -> str | None:
        """Why this spec differs from ``expected`` (``None`` when compatible).

        Names must be equal; ``scale`` and ``chunk_size`` too when ``expected`` states them
        (a policy trained with other scales or chunk sizes reads its inputs wrongly).
        """
        if self.names != expected.names:
            return f"observation names {list(self.names)} != expected {list(expected.names)}"
        if expected.scale and not np.allclose(self.scale, expected.scale, rtol=1e-6, atol=0):
            return f"observation scale {list(self.scale)} != expected {list(expected.scale)}"
        if expected.chunk_size is not None and self.chunk_size != expected.chunk_size:
            return f"delta is in chunks of {self.chunk_size} tokens, expected {expected.chunk_size}"
        return None


@dataclass(frozen=True)
class ActionSpec:
    """The action space: index -> name. Only ``("STOP", "ADD")`` exists in format version 1."""

    names: tuple[str, ...] = ACTION_NAMES

    def to_dict(self) -> dict[str, Any]:
        return {"names": list(self.names)}

    @classmethod
    def from_dict(cls, data: Any, path: Any = None) -> ActionSpec:
        if not isinstance(data, Mapping) or tuple(data.get("names") or ()) != ACTION_NAMES:
            raise PolicyFormatError(path, f"action spec must be {{'names': {list(ACTION_NAMES)}}}, "
                                          f"got {data!r}")
        return cls()


# -- decision rules (shared by the agents and the loaded policies) --------------------------------
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
            if not _is_number(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)!r}")
        for name in ("floor_cap", "floor_init"):
            if not _is_count(getattr(self, name)):
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


@dataclass
class GroupCapRule:
    """``group-cap-K``: the hand-made rule of the group decision (cached-first order + hold + cap).

    Asked only when the candidate would open a prefix group that is not in flight (the batching
    core's group decision, whose order puts a cached group first). STOP (hold the new group) when
    ``cap`` groups are in flight already, or, with ``hold``, when the candidate's prefix is not
    cached (less than ``cached_min`` of its prompt) while requests of the groups in flight still
    wait; otherwise ADD. ``cap=None`` never caps (cached-first + hold alone).
    """

    cap: int | None = 3
    hold: bool = True
    cached_min: float = 0.5
    obs_spec: ClassVar[ObservationSpec]

    def __post_init__(self) -> None:
        if self.cap is not None and not _is_count(self.cap, 1):
            raise ValueError(f"cap must be an integer >= 1 or None, got {self.cap!r}")
        if not (_is_number(self.cached_min) and 0 <= self.cached_min <= 1):
            raise ValueError(f"cached_min must be in [0, 1], got {self.cached_min!r}")

    def params(self) -> dict[str, Any]:
        return {"cap": self.cap, "hold": self.hold, "cached_min": self.cached_min}

    def act(self, obs: Sequence[float], mask: Sequence[bool]) -> int:
        if not mask[ADD]:
            return STOP
        if not mask[STOP]:
            return ADD
        if self.cap is not None and obs[_GROUPS_IN_FLIGHT] >= self.cap:
            return STOP
        if self.hold and obs[_CACHED_FRACTION] < self.cached_min and obs[_WAITING_IN_FLIGHT] > 0:
            return STOP
        return ADD


_GROUPS_IN_FLIGHT = GROUP_OBS_NAMES.index("groups_in_flight")
_CACHED_FRACTION = GROUP_OBS_NAMES.index("cached_fraction")
_WAITING_IN_FLIGHT = GROUP_OBS_NAMES.index("waiting_in_flight")
_WAITING_GROUPS = GROUP_OBS_NAMES.index("waiting_groups")
_KV_USAGE = GROUP_OBS_NAMES.index("kv_usage")
GroupCapRule.obs_spec = ObservationSpec(names=GROUP_OBS_NAMES)  # it answers the group decision


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
            if not _is_count(getattr(self, name), low):
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
            if not _is_count(getattr(self, name), low):
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


def table_decision(bins: TableBins | GroupBins, values: Sequence[float], visits: Sequence[int],
                   add_if_delta_zero: bool, obs: Sequence[float], mask: Sequence[bool]) -> int:
    """Greedy action of a tabular policy (``values``/``visits`` flat, ``2 * state + action``).

    Order of the rules: masks; an empty batch ADDs; ``add_if_delta_zero`` (the bandit's rule)
    ADDs when the candidate loses no shared prefix; otherwise the visited valid action of
    highest value, ties and never-visited states going to ADD (what a batch-maximizing
    scheduler would do, i.e. the baseline the policy must improve on).
    """
    if not mask[ADD]:
        return STOP
    if not mask[STOP] or obs[0] <= 0:
        return ADD
    if add_if_delta_zero and int(obs[1]) == 0:
        return ADD
    s = 2 * bins.index(obs)
    if visits[s] > 0 and (visits[s + 1] <= 0 or values[s] > values[s + 1]):
        return STOP
    return ADD


# -- loaded policies ------------------------------------------------------------------------------
class Policy(ABC):
    """A loaded policy: ``act(obs, mask) -> 0 (STOP) | 1 (ADD)``, obs in the environment's raw units."""

    kind: str = ""

    def __init__(self, obs_spec: ObservationSpec, agent: str = "", meta: dict[str, Any] | None = None,
                 path: str | None = None) -> None:
        self.obs_spec = obs_spec
        self.action_spec = ActionSpec()
        self.agent = agent
        self.meta = meta or {}
        self.path = path
        self._low = obs_spec.low
        self._high = obs_spec.high

    @abstractmethod
    def act(self, obs: Sequence[float], mask: Sequence[bool]) -> int:
        """The action for raw observation ``obs`` and validity mask ``[STOP, ADD]``."""

    def reset(self) -> None:  # noqa: B027 - optional hook, most policies are stateless
        """Start of an episode (serving: of the policy's use); only the heuristic keeps state."""

    def _clip(self, obs: Sequence[float]) -> list[float]:
        # tolist() first: Python floats compare several times faster than numpy scalars.
        values = obs.tolist() if isinstance(obs, np.ndarray) else obs
        return [min(max(x, lo), hi) for x, lo, hi in zip(values, self._low, self._high, strict=False)]

    @abstractmethod
    def params(self) -> dict[str, Any]:
        """The kind's ``params`` as stored in the file."""

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(agent={self.agent!r}, obs={list(self.obs_spec.names)}, "
                f"path={self.path!r})")


class ConstantPolicy(Policy):
    """Always the same action when it is valid (``always-add``: fill the batch to its limit)."""

    kind = "constant"

    def __init__(self, obs_spec: ObservationSpec, action: int = ADD, **kw: Any) -> None:
        super().__init__(obs_spec, **kw)
        self.action = action

    def act(self, obs: Sequence[float], mask: Sequence[bool]) -> int:
        if mask[self.action]:
            return self.action
        return 1 - self.action

    def params(self) -> dict[str, Any]:
        return {"action": ACTION_NAMES[self.action]}


class HeuristicPolicy(Policy):
    """:class:`HeuristicRule` with the exported constants (stateful: call :meth:`reset`)."""

    kind = "heuristic"

    def __init__(self, obs_spec: ObservationSpec, rule: HeuristicRule, **kw: Any) -> None:
        super().__init__(obs_spec, **kw)
        self.rule = rule

    def act(self, obs: Sequence[float], mask: Sequence[bool]) -> int:
        return self.rule.act(self._clip(obs), mask)

    def reset(self) -> None:
        self.rule.reset()

    def params(self) -> dict[str, Any]:
        return self.rule.params()


class GroupCapPolicy(Policy):
    """:class:`GroupCapRule` with the exported constants (the group observation)."""

    kind = "group-cap"

    def __init__(self, obs_spec: ObservationSpec, rule: GroupCapRule, **kw: Any) -> None:
        super().__init__(obs_spec, **kw)
        self.rule = rule

    def act(self, obs: Sequence[float], mask: Sequence[bool]) -> int:
        return self.rule.act(self._clip(obs), mask)

    def params(self) -> dict[str, Any]:
        return self.rule.params()


class TablePolicy(Policy):
    """Greedy action over a (state bin, action) table, see :func:`table_decision`."""

    kind = "table"

    def __init__(self, obs_spec: ObservationSpec, bins: TableBins | GroupBins, values: Sequence[float],
                 visits: Sequence[int], add_if_delta_zero: bool, **kw: Any) -> None:
        super().__init__(obs_spec, **kw)
        self.bins = bins
        # Plain lists: indexing a list is several times cheaper than indexing a numpy array.
        self.values = [float(v) for v in values]
        self.visits = [int(v) for v in visits]
        self.add_if_delta_zero = add_if_delta_zero

    def act(self, obs: Sequence[float], mask: Sequence[bool]) -> int:
        return table_decision(self.bins, self.values, self.visits, self.add_if_delta_zero,
                              self._clip(obs), mask)

    def params(self) -> dict[str, Any]:
        return {"bins": self.bins.to_dict(), "values": self.values, "visits": self.visits,
                "add_if_delta_zero": self.add_if_delta_zero}


class MLPPolicy(Policy):
    """A tanh (or relu) MLP over the scaled observation; ADD iff its ADD logit is the larger one.

    At load time the scale and the first bias are folded into the first layer (input
    ``[obs..., 1]``) and the last layer is reduced to the difference of the two logits, and the
    hidden activations are computed into preallocated buffers: a decision is a few numpy calls
    and no allocation but the input vector. The buffers make an instance unsafe to share between
    threads; load one per thread.
    """

    kind = "mlp"

    def __init__(self, obs_spec: ObservationSpec, layers: Sequence[tuple[np.ndarray, np.ndarray]],
                 activation: str = "tanh", **kw: Any) -> None:
        super().__init__(obs_spec, **kw)
        if activation not in ("tanh", "relu"):
            raise ValueError(f"unknown activation {activation!r}")
        if len(layers) < 2:
            raise ValueError("an MLP policy needs at least one hidden layer and the output layer")
        self.activation = activation
        self.layers = [(np.asarray(w, dtype=np.float64), np.asarray(b, dtype=np.float64))
                       for w, b in layers]
        scale = np.asarray(obs_spec.scale, dtype=np.float64)
        w0, b0 = self.layers[0]
        # [x_raw, 1] @ [[(W / scale).T], [b]] == (x_raw / scale) @ W.T + b
        self._first = np.vstack([(w0 / scale).T, b0[None, :]])
        self._rest = [(w.T.copy(), b) for w, b in self.layers[1:-1]]
        self._bufs = [np.empty(w.shape[0]) for w, _ in self.layers[:-1]]
        w_out, b_out = self.layers[-1]
        self._w_diff = (w_out[ADD] - w_out[STOP]).copy()
        self._b_diff = float(b_out[ADD] - b_out[STOP])

    def _activate(self, h: np.ndarray) -> None:
        if self.activation == "tanh":
            np.tanh(h, out=h)
        else:
            np.maximum(h, 0.0, out=h)

    def logits(self, obs: Sequence[float]) -> np.ndarray:
        """Both logits ``[STOP, ADD]`` (for inspection; :meth:`act` computes only their difference)."""
        h = np.asarray(self._clip(obs), dtype=np.float64) / np.asarray(self.obs_spec.scale)
        for w, b in self.layers[:-1]:
            h = w @ h + b
            self._activate(h)
        w, b = self.layers[-1]
        return w @ h + b

    def act(self, obs: Sequence[float], mask: Sequence[bool]) -> int:
        if not mask[ADD]:
            return STOP
        if not mask[STOP]:
            return ADD
        x = self._clip(obs)
        x.append(1.0)
        h = self._bufs[0]
        np.dot(np.array(x), self._first, out=h)
        self._activate(h)
        for (w, b), buf in zip(self._rest, self._bufs[1:], strict=True):
            np.dot(h, w, out=buf)
            np.add(buf, b, out=buf)
            self._activate(buf)
            h = buf
        return ADD if float(h @ self._w_diff) + self._b_diff > 0.0 else STOP

    def params(self) -> dict[str, Any]:
        return {"activation": self.activation,
                "layers": [{"weight": w.tolist(), "bias": b.tolist()} for w, b in self.layers]}


# -- file I/O -------------------------------------------------------------------------------------
def _canonical(body: Mapping[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def write_policy(path: str | os.PathLike[str], policy: Policy) -> Path:
    """Write ``policy`` to ``path`` in the versioned format (atomically: temp file + rename)."""
    body = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "kind": policy.kind,
        "agent": policy.agent,
        "observation": policy.obs_spec.to_dict(),
        "action": policy.action_spec.to_dict(),
        "params": policy.params(),
        "meta": policy.meta,
    }
    try:
        checksum = hashlib.sha256(_canonical(body)).hexdigest()
    except (TypeError, ValueError) as exc:  # non-JSON or non-finite values in params/meta
        raise PolicyFormatError(path, f"cannot serialize policy: {exc}") from exc
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({**body, "sha256": checksum}, indent=1, sort_keys=True, allow_nan=False)
                   + "\n")
    os.replace(tmp, path)
    return path


def load_policy(path: str | os.PathLike[str], obs_spec: ObservationSpec | None = None) -> Policy:
    """Read a policy file and return a ready-to-call :class:`Policy`.

    ``obs_spec`` (optional) is the observation the caller will feed: names, and scale and
    chunk size where given, must match the file's (see :meth:`ObservationSpec.mismatch`).
    Raises :class:`PolicyFormatError` naming the file and the problem.
    """
    path = Path(path)
    if not path.is_file():
        raise PolicyFormatError(path, "no such file")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise PolicyFormatError(path, f"cannot read: {exc}") from exc
    if not raw.strip():
        raise PolicyFormatError(path, "file is empty")
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PolicyFormatError(path, f"not a valid policy document (truncated or corrupted JSON: {exc})"
                                ) from exc
    return policy_from_document(doc, path=path, obs_spec=obs_spec)


#: ``load_policy_spec("py:MODULE:ATTRIBUTE")`` builds a plug-in policy (module docstring).
PLUGIN_PREFIX = "py:"


def load_policy_spec(spec: str) -> Any:
    """The policy a scheduler name's ``feather:SPEC`` points at: a policy file, or a plug-in.

    ``py:MODULE:ATTRIBUTE`` builds a plug-in policy (module docstring); anything else is a
    policy file path (:func:`load_policy`). Raises :class:`PolicyFormatError`.
    """
    if not isinstance(spec, str) or not spec:
        raise PolicyFormatError(None, f"policy must be a file path or {PLUGIN_PREFIX}MODULE:ATTRIBUTE, "
                                      f"got {spec!r}")
    if spec.startswith(PLUGIN_PREFIX):
        return _load_plugin_policy(spec)
    return load_policy(spec)


def _load_plugin_policy(spec: str) -> Any:
    def error(problem: str) -> PolicyFormatError:
        return PolicyFormatError(None, f"plug-in {spec!r}: {problem}")

    module_name, _, attribute = spec[len(PLUGIN_PREFIX):].partition(":")
    if not module_name or not attribute:
        raise error(f"expected {PLUGIN_PREFIX}MODULE:ATTRIBUTE (e.g. py:mypackage.policies:MyPolicy)")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any error in the user's module, ImportError included
        raise error(f"cannot import module {module_name!r}: {type(exc).__name__}: {exc}") from exc
    factory = getattr(module, attribute, None)
    if factory is None:
        raise error(f"module {module_name!r} has no attribute {attribute!r}")
    if not callable(factory):
        raise error(f"{module_name}.{attribute} has no act(obs, mask): it is a {type(factory).__name__}, "
                    "not a policy class or factory")
    try:
        policy = factory()
    except Exception as exc:
        raise error(f"{module_name}.{attribute}() could not be built: {type(exc).__name__}: {exc}") from exc
    if not callable(getattr(policy, "act", None)):
        raise error(f"{module_name}.{attribute}() returned a {type(policy).__name__}, "
                    "which has no act(obs, mask)")
    spec_attr = getattr(policy, "obs_spec", None)
    if spec_attr is not None and not isinstance(spec_attr, ObservationSpec):
        raise error(f"its obs_spec must be an ObservationSpec, got {type(spec_attr).__name__}")
    reset = getattr(policy, "reset", None)
    if reset is not None and not callable(reset):
        raise error("its reset attribute is not callable")
    return policy


def policy_from_document(doc: Any, *, path: str | os.PathLike[str] | None = None,
                         obs_spec: ObservationSpec | None = None) -> Policy:
    """Validate a parsed policy document (see the module docstring) and build its :class:`Policy`."""
    if not isinstance(doc, dict):
        raise PolicyFormatError(path, f"expected a JSON object, got {type(doc).__name__}")
    if doc.get("format") != FORMAT:
        raise PolicyFormatError(path, f"not a {FORMAT} file (format={doc.get('format')!r})")
    version = doc.get("version")
    if version != FORMAT_VERSION:
        raise PolicyFormatError(path, f"format version {version!r}; this toolkit reads version "
                                      f"{FORMAT_VERSION} (re-export the policy with a matching train.py)")
    checksum = doc.get("sha256")
    body = {k: v for k, v in doc.items() if k != "sha256"}
    try:
        actual = hashlib.sha256(_canonical(body)).hexdigest()
    except (TypeError, ValueError) as exc:
        raise PolicyFormatError(path, f"corrupted: {exc}") from exc
    if checksum != actual:
        raise PolicyFormatError(path, "corrupted: sha256 checksum does not match the content")
    missing = [k for k in ("kind", "observation", "action", "params") if k not in doc]
    if missing:
        raise PolicyFormatError(path, f"missing fields {missing}")
    spec = ObservationSpec.from_dict(doc["observation"], path)
    ActionSpec.from_dict(doc["action"], path)
    if obs_spec is not None:
        problem = spec.mismatch(obs_spec)
        if problem:
            raise PolicyFormatError(path, f"observation spec mismatch: {problem}")
    kind, params = doc["kind"], doc["params"]
    if not isinstance(params, dict):
        raise PolicyFormatError(path, "'params' must be a mapping")
    common = dict(agent=str(doc.get("agent", "")), meta=doc.get("meta") or {},
                  path=None if path is None else str(path))
    try:
        if kind == "constant":
            action = params.get("action")
            if action not in ACTION_NAMES:
                raise ValueError(f"constant action must be one of {list(ACTION_NAMES)}, got {action!r}")
            return ConstantPolicy(spec, ACTION_NAMES.index(action), **common)
        if kind == "heuristic":
            return HeuristicPolicy(spec, HeuristicRule(**params), **common)
        if kind == "group-cap":
            if spec.names != GROUP_OBS_NAMES:
                raise ValueError("a group-cap rule reads the group observation")
            return GroupCapPolicy(spec, GroupCapRule(**params), **common)
        if kind == "table":
            return _table_from_params(spec, params, common)
        if kind == "mlp":
            return _mlp_from_params(spec, params, common)
    except PolicyFormatError:
        raise
    except (TypeError, ValueError, KeyError) as exc:
        raise PolicyFormatError(path, f"bad {kind!r} parameters: {exc}") from exc
    raise PolicyFormatError(path, f"unknown policy kind {kind!r}; known kinds: {list(KINDS)}")


def _table_from_params(spec: ObservationSpec, params: dict[str, Any], common: dict[str, Any]) -> TablePolicy:
    bins = bins_from_dict(params["bins"])
    if isinstance(bins, GroupBins) != (spec.names == GROUP_OBS_NAMES):
        raise ValueError("group bins go with the group observation, the paper's bins with the others")
    n = 2 * bins.num_states
    values, visits = params["values"], params["visits"]
    if not isinstance(values, list) or len(values) != n:
        raise ValueError(f"'values' must hold {n} numbers (bins {bins.shape} x 2 actions)")
    if not isinstance(visits, list) or len(visits) != n:
        raise ValueError(f"'visits' must hold {n} counts (bins {bins.shape} x 2 actions)")
    if not all(_is_number(v) for v in values):
        raise ValueError("'values' must be finite numbers")
    if not all(_is_count(v) for v in visits):
        raise ValueError("'visits' must be non-negative integers")
    extra = set(params) - {"bins", "values", "visits", "add_if_delta_zero"}
    if extra:
        raise ValueError(f"unknown keys {sorted(extra)}")
    add_if_delta_zero = params.get("add_if_delta_zero", False)
    if not isinstance(add_if_delta_zero, bool):
        raise ValueError(f"'add_if_delta_zero' must be true or false, got {add_if_delta_zero!r}")
    return TablePolicy(spec, bins, values, visits, add_if_delta_zero, **common)


def _mlp_from_params(spec: ObservationSpec, params: dict[str, Any], common: dict[str, Any]) -> MLPPolicy:
    layers = params["layers"]
    if not isinstance(layers, list) or not layers:
        raise ValueError("'layers' must be a non-empty list")
    extra = set(params) - {"layers", "activation"}
    if extra:
        raise ValueError(f"unknown keys {sorted(extra)}")
    parsed = []
    fan_in = len(spec.names)
    for i, layer in enumerate(layers):
        if not isinstance(layer, dict) or set(layer) != {"weight", "bias"}:
            raise ValueError(f"layer {i}: must be {{'weight': [[...]], 'bias': [...]}}")
        if not (_all_numbers(layer["weight"]) and _all_numbers(layer["bias"])):
            raise ValueError(f"layer {i}: weights must be finite numbers")
        w = np.asarray(layer["weight"], dtype=np.float64)
        b = np.asarray(layer["bias"], dtype=np.float64)
        if w.ndim != 2 or b.ndim != 1 or w.shape != (b.shape[0], fan_in):
            raise ValueError(f"layer {i}: weight {w.shape} / bias {b.shape} do not take {fan_in} inputs")
        if not (np.isfinite(w).all() and np.isfinite(b).all()):
            raise ValueError(f"layer {i}: non-finite weights")
        parsed.append((w, b))
        fan_in = w.shape[0]
    if fan_in != len(ACTION_NAMES):
        raise ValueError(f"the last layer must output {len(ACTION_NAMES)} logits, outputs {fan_in}")
    activation = params.get("activation", "tanh")
    if activation not in ("tanh", "relu"):
        raise ValueError(f"'activation' must be 'tanh' or 'relu', got {activation!r}")
    return MLPPolicy(spec, parsed, activation, **common)


def default_policy(ordering: str | None, policy: str | None = None, group_cap: int | None = None) -> Any:
    """The policy a scheduler answers its decisions with, the one place that chooses it.

    A baseline's ordering (``fcfs``, ``lpm``, ...): always-add (its order does the work). Feather:
    the ``policy`` spec when given (a file or a plug-in, :func:`load_policy_spec`), else
    ``group-cap-K``'s rule when ``group_cap`` is given (0: no cap), else the authors' heuristic.
    """
    if ordering != "feather":
        return AlwaysAdd()
    if policy:
        return load_policy_spec(policy)
    if group_cap is not None:
        return GroupCapRule(cap=group_cap or None)
    return HeuristicRule()
