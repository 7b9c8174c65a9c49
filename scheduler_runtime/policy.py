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
  (see :func:`table_decision`); used by the UCB bandit and Q-learning. Optionally ``baseline``
  (a ``group-cap`` rule's parameters), ``stderr`` (each value's standard error), ``z`` and
  ``min_visits``: the rule answers wherever the table's two values are not ``z`` standard errors
  apart over ``min_visits`` visits each (Q-learning's ``baseline``, :mod:`agents.qlearning`).
- ``mlp``: ``{"activation": "tanh", "layers": [{"weight": [[...]], "bias": [...]}, ...]}``,
  ``weight`` shaped ``(out, in)`` as in torch; the last layer outputs the logits of
  ``[STOP, ADD]``; the input is the clipped observation divided by ``scale``.

Any problem with a file (missing, truncated, not JSON, checksum mismatch, other format or
version, unknown kind, observation/action spec that is malformed or not the one expected,
parameters of the wrong type, shape or range, non-finite numbers) raises
:class:`PolicyFormatError` naming the file and the problem, when the file is loaded: a policy
that loads does not fail at its first decision because of its file.

A decision costs a few microseconds (``benchmarks/policy_latency.py`` measures each kind).
"""

from __future__ import annotations

import hashlib
import json
import os
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from scheduler_runtime.config import all_numbers, is_count, is_number
from scheduler_runtime.decision import (
    ACTION_NAMES,
    ADD,
    GROUP_OBS_NAMES,
    STOP,
    ActionSpec,
    ObservationSpec,
    PolicyFormatError,
)
from scheduler_runtime.rules import (
    GroupBins,
    GroupCapRule,
    HeuristicRule,
    TableBins,
    bins_from_dict,
    table_decision,
    trusted_states,
)

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "KINDS",
    "ConstantPolicy",
    "GroupCapPolicy",
    "HeuristicPolicy",
    "MLPPolicy",
    "Policy",
    "TablePolicy",
    "answers_as_rule",
    "load_policy",
    "policy_from_document",
    "write_policy",
]

FORMAT = "feather-policy"
FORMAT_VERSION = 1
KINDS = ("constant", "heuristic", "group-cap", "table", "mlp")


# -- loaded policies ------------------------------------------------------------------------------
class Policy(ABC):
    """A loaded policy: ``act(obs, mask) -> 0 (STOP) | 1 (ADD)``, obs in the environment's raw units."""

    kind: str = ""
    #: ``act`` reads any sequence of numbers (``_clip`` makes a list of it): the core may hand
    #: it a tuple (``decision.BatchingPolicy``)
    reads_plain: bool = True

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

    def pressured(self, obs: Sequence[float]) -> bool:
        """The rule's :meth:`GroupCapRule.pressured` on the observation as :meth:`act` reads it, so
        a loaded file serves as the baseline of :func:`~scheduler_runtime.rules.open_choice`."""
        return self.rule.pressured(self._clip(obs))

    def params(self) -> dict[str, Any]:
        return self.rule.params()


class TablePolicy(Policy):
    """Greedy action over a (state bin, action) table, see :func:`table_decision`; with a
    ``baseline`` rule (the group decision), the rule's answer wherever the table's two values are
    not ``z`` standard errors (``stderr``) apart over at least ``min_visits`` visits each
    (:func:`trusted_states`)."""

    kind = "table"

    def __init__(self, obs_spec: ObservationSpec, bins: TableBins | GroupBins, values: Sequence[float],
                 visits: Sequence[int], add_if_delta_zero: bool, *, baseline: GroupCapRule | None = None,
                 stderr: Sequence[float] | None = None, z: float = 2.0, min_visits: int = 30,
                 **kw: Any) -> None:
        super().__init__(obs_spec, **kw)
        self.bins = bins
        # Plain lists: indexing a list is several times cheaper than indexing a numpy array.
        self.values = [float(v) for v in values]
        self.visits = [int(v) for v in visits]
        self.add_if_delta_zero = add_if_delta_zero
        self.baseline = baseline
        self.stderr = [float(v) for v in stderr] if stderr is not None else [0.0] * len(self.values)
        self.z = float(z)
        self.min_visits = int(min_visits)
        self.trusted = (trusted_states(self.values, self.visits, self.stderr, self.z, self.min_visits)
                        if baseline is not None else None)

    def act(self, obs: Sequence[float], mask: Sequence[bool]) -> int:
        return table_decision(self.bins, self.values, self.visits, self.add_if_delta_zero,
                              self._clip(obs), mask, self.baseline, self.trusted)

    def departures(self) -> list[int] | None:
        """With a baseline: the states where the table answers otherwise than its baseline (trusted,
        and the greedy answer differs); ``[]``: the policy answers exactly as the baseline. None
        without a baseline, or when a bin holds states the baseline answers differently (a cap above
        the bins' ``in_flight_max``), so that no bin has one baseline answer to compare with."""
        if self.baseline is None or self.trusted is None or not isinstance(self.bins, GroupBins):
            return None
        if self.baseline.cap is not None and self.baseline.cap > self.bins.in_flight_max:
            return None
        both = [True, True]
        out = []
        for state, trusted in enumerate(self.trusted):
            if not trusted:
                continue
            obs = self.bins.representative(state, self.baseline.kv_min)
            if self.baseline.pressured(obs) and (  # below kv_min the rule answers the whole bin
                    table_decision(self.bins, self.values, self.visits, False, obs, both)
                    != self.baseline.act(obs, both)):
                out.append(state)
        return out

    def params(self) -> dict[str, Any]:
        out: dict[str, Any] = {"bins": self.bins.to_dict(), "values": self.values, "visits": self.visits,
                               "add_if_delta_zero": self.add_if_delta_zero}
        if self.baseline is not None:
            out.update(baseline=self.baseline.params(), stderr=self.stderr, z=self.z,
                       min_visits=self.min_visits)
        return out


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


def answers_as_rule(policy: Policy) -> GroupCapRule | None:
    """The ``group-cap`` rule ``policy`` answers exactly as in every state: a ``group-cap`` policy's
    own, or a table's baseline when it departs from it nowhere (:meth:`TablePolicy.departures`)."""
    if isinstance(policy, GroupCapPolicy):
        return policy.rule
    if isinstance(policy, TablePolicy) and policy.departures() == []:
        return policy.baseline
    return None


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
            return GroupCapPolicy(spec, _group_rule(params), **common)
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
    if not all(is_number(v) for v in values):
        raise ValueError("'values' must be finite numbers")
    if not all(is_count(v) for v in visits):
        raise ValueError("'visits' must be non-negative integers")
    extra = set(params) - {"bins", "values", "visits", "add_if_delta_zero", *_BASELINE_KEYS}
    if extra:
        raise ValueError(f"unknown keys {sorted(extra)}")
    add_if_delta_zero = params.get("add_if_delta_zero", False)
    if not isinstance(add_if_delta_zero, bool):
        raise ValueError(f"'add_if_delta_zero' must be true or false, got {add_if_delta_zero!r}")
    if "baseline" not in params:
        if set(params) & set(_BASELINE_KEYS):
            raise ValueError(f"{sorted(set(params) & set(_BASELINE_KEYS))} go with a 'baseline' rule")
        return TablePolicy(spec, bins, values, visits, add_if_delta_zero, **common)
    if not isinstance(bins, GroupBins):
        raise ValueError("a 'baseline' rule answers the group decision: it needs group bins")
    if not isinstance(params["baseline"], dict):
        raise ValueError("'baseline' must be a mapping of group-cap parameters")
    stderr, z, min_visits = params.get("stderr"), params.get("z", 2.0), params.get("min_visits", 30)
    if not isinstance(stderr, list) or len(stderr) != n or not all(is_number(v) and v >= 0 for v in stderr):
        raise ValueError(f"'stderr' must hold {n} finite numbers >= 0")
    if not (is_number(z) and z >= 0):
        raise ValueError(f"'z' must be a finite number >= 0, got {z!r}")
    if not is_count(min_visits, 1):
        raise ValueError(f"'min_visits' must be an integer >= 1, got {min_visits!r}")
    return TablePolicy(spec, bins, values, visits, add_if_delta_zero,
                       baseline=_group_rule(params["baseline"]), stderr=stderr, z=z, min_visits=min_visits,
                       **common)


def _group_rule(params: Mapping[str, Any]) -> GroupCapRule:
    """A file's ``group-cap`` rule. A file written before ``kv_min`` existed keeps the meaning it
    was written with: its rule holds at any KV usage (``kv_min = 0``)."""
    return GroupCapRule(**{"kv_min": 0.0, **params})


#: The ``table`` parameters of a baseline rule (:class:`TablePolicy`).
_BASELINE_KEYS = ("baseline", "stderr", "z", "min_visits")


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
        if not (all_numbers(layer["weight"]) and all_numbers(layer["bias"])):
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


