"""The ADD/STOP decision: its actions, its observation's names, and what a policy is.

Defined once here and used by everything that decides or learns to decide: the batching core
(:mod:`scheduler_runtime.batching`, which computes the observation), the exported policy files
(:mod:`scheduler_runtime.policy`), the environment (``feather_env.env``) and the agents.

The observation of a pending decision (raw units; :meth:`BatchingCore.observe` computes it):

=====  ==================  =====================================================================
index  name                meaning
=====  ==================  =====================================================================
0      ``batch_size``      requests in the batch: released by the scheduler and not finished
1      ``delta``           shared-prefix chunks the batch loses by adding the candidate
2      ``w``               other waiting requests that share the candidate's new depth
3      ``waiting``         requests the scheduler holds (the candidate included)
4      ``kv_usage``        fraction of the engine's KV cache blocks in use (vLLM's kv_cache_usage)
5      ``missing_chunks``  the candidate's chunks that no request of the batch holds
6      ``prompt_chunks``   the candidate's prompt, in chunks
7      ``cached_chunks``   the candidate's prompt chunks the engine's prefix cache holds right now
=====  ==================  =====================================================================

The paper's state is the first three (:data:`BASE_OBS_NAMES`); a policy asks for all of them
(:data:`EXTENDED_OBS_NAMES`) through its observation spec. Chunks are the CHT's
(``chunk_size`` tokens).

The group decision (``BatchingCore`` with ``decision="group"``: the policy is asked only about a
candidate that would open a prefix group not in flight, :mod:`scheduler_runtime.groups`) observes
the paper's three entries and then :data:`GROUP_OBS_NAMES`' others:

=====  =====================  ==================================================================
index  name                   meaning
=====  =====================  ==================================================================
3      ``groups_in_flight``   prefix groups with a request in the batch (released, not finished)
4      ``cached_fraction``    the candidate's prompt fraction that the engine's prefix cache holds
5      ``waiting_in_flight``  requests of groups in flight that wait: held by the scheduler or
                              queued in the engine (released, not yet running)
6      ``waiting_groups``     prefix groups with a held request (the candidate's included)
7      ``kv_usage``           fraction of the engine's KV cache in use or promised: the larger of
                              its blocks in use and the admitted requests' footprints over the
                              KV capacity (``BatchingCore.kv_committed``)
8      ``oldest_wait``        seconds the longest-held request has waited
=====  =====================  ==================================================================

A policy asks for the group decision by naming :data:`GROUP_OBS_NAMES` in its observation spec
(:func:`observation_kind`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from scheduler_runtime.config import is_count, is_number

__all__ = [
    "ACTION_NAMES",
    "ADD",
    "BASE_OBS_NAMES",
    "EXTENDED_OBS_NAMES",
    "GROUP_OBS_NAMES",
    "OBSERVATION_KINDS",
    "STOP",
    "ActionSpec",
    "AlwaysAdd",
    "BatchingPolicy",
    "EngineView",
    "NoEngine",
    "ObservationSpec",
    "PolicyFormatError",
    "observation_kind",
    "observation_names",
]

STOP, ADD = 0, 1
ACTION_NAMES = ("STOP", "ADD")
BASE_OBS_NAMES = ("batch_size", "delta", "w")
EXTENDED_OBS_NAMES = BASE_OBS_NAMES + ("waiting", "kv_usage", "missing_chunks", "prompt_chunks",
                                       "cached_chunks")

GROUP_OBS_NAMES = BASE_OBS_NAMES + ("groups_in_flight", "cached_fraction", "waiting_in_flight",
                                    "waiting_groups", "kv_usage", "oldest_wait")
#: The observation a policy reads, by the names of its spec.
OBSERVATION_KINDS = {"base": BASE_OBS_NAMES, "extended": EXTENDED_OBS_NAMES, "group": GROUP_OBS_NAMES}


def observation_names(kind: str) -> tuple[str, ...]:
    """The names of observation ``kind`` (:data:`OBSERVATION_KINDS`)."""
    try:
        return OBSERVATION_KINDS[kind]
    except KeyError:
        raise ValueError(f"observation kind must be one of {list(OBSERVATION_KINDS)}, got {kind!r}") from None


def observation_kind(policy: object) -> str:
    """Which observation ``policy`` reads: ``"group"`` when its ``obs_spec`` names
    :data:`GROUP_OBS_NAMES` (it answers the group decision), ``"extended"`` for
    :data:`EXTENDED_OBS_NAMES`, else ``"base"`` (a policy without a spec gets the paper's three)."""
    names = tuple(getattr(getattr(policy, "obs_spec", None), "names", ()))
    for kind in ("group", "extended"):
        if names == OBSERVATION_KINDS[kind]:
            return kind
    return "base"


@runtime_checkable
class BatchingPolicy(Protocol):
    """An ADD/STOP policy (``scheduler_runtime.policy.load_policy`` returns one).

    ``obs`` is ``float32`` in raw units (the table in the module docstring: the first three
    entries, or all of them when the policy's ``obs_spec.names`` is :data:`EXTENDED_OBS_NAMES`);
    ``mask`` is ``bool [STOP valid, ADD valid]``; the answer is 0 (STOP) or 1 (ADD).
    Optional: ``reset()``, called once when the core starts using the policy, and
    ``observes = False`` for a policy that never reads the observation (the core then skips
    computing it), and ``reads_plain = True`` for one whose ``act`` reads any sequence of
    numbers: on the base observation the core then hands it a tuple of ints (the same values,
    without building an array at every decision).
    """

    def act(self, obs: np.ndarray, mask: np.ndarray) -> int: ...


class AlwaysAdd:
    """ADD whenever ADD is valid: the baselines' admission (their order does the work)."""

    observes = False

    def act(self, obs: np.ndarray, mask: np.ndarray) -> int:
        return ADD if mask[ADD] else STOP


class EngineView(Protocol):
    """What the core may read of the engine it schedules for (the observation's engine entries).

    The vLLM scheduler answers from vLLM's KV cache manager, the simulator from its model of it.
    """

    def kv_usage(self) -> float:
        """Fraction of the KV cache's blocks in use, 0..1."""
        ...

    def cached_prefix_tokens(self, request_id: str, limit: int | None = None) -> int:
        """Prompt tokens of a held request that the prefix cache would serve if admitted now
        (looking at most ``limit`` tokens deep, when given: the cheaper check of a group's prefix)."""
        ...

    def num_queued(self) -> int:
        """Requests released to the engine that wait in its queue (not running yet)."""
        ...

    def retain_prefixes(self, request_ids: Sequence[str]) -> int:
        """Move the free cached blocks of these held requests' prompts to the end of the engine's
        eviction order (the later ids' after the earlier ones'); the blocks moved."""
        ...


class NoEngine:
    """The view of a core that runs without an engine (tests, benchmarks): nothing cached, empty."""

    def kv_usage(self) -> float:
        return 0.0

    def cached_prefix_tokens(self, request_id: str, limit: int | None = None) -> int:
        return 0

    def num_queued(self) -> int:
        return 0

    def retain_prefixes(self, request_ids: Sequence[str]) -> int:
        return 0


# -- what a policy observes and answers (a policy file states both) ---------------------------------
class PolicyFormatError(ValueError):
    """A policy file cannot be used: names the file and what is wrong with it."""

    def __init__(self, path: str | os.PathLike[str] | None, problem: str) -> None:
        self.path = None if path is None else str(path)
        self.problem = problem
        where = "policy" if path is None else f"policy file {str(path)!r}"
        super().__init__(f"{where}: {problem}")


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
        """The spec of a ``FeatherEnv``, any wrapper of one, or a vectorized env of them (SB3's
        ``VecEnv``: read from its first env's ``raw_observation_space``, ``obs_scale``,
        ``obs_names`` and ``chunk_size``)."""
        if hasattr(env, "get_attr") and hasattr(env, "num_envs"):
            space, scale, names, chunk = (env.get_attr(a, [0])[0] for a in (
                "raw_observation_space", "obs_scale", "obs_names", "chunk_size"))
        else:
            env = getattr(env, "unwrapped", env)
            space, scale, names, chunk = env.observation_space, env.obs_scale, env.obs_names, env.chunk_size
        return cls(names=tuple(names), low=tuple(float(x) for x in space.low),
                   high=tuple(float(x) for x in space.high), scale=tuple(float(x) for x in scale),
                   chunk_size=int(chunk))

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
            if not isinstance(v, list) or len(v) != n or not all(is_number(x) for x in v):
                raise PolicyFormatError(path, f"'observation.{key}' must be {n} finite numbers, got {v!r}")
            vectors[key] = tuple(float(x) for x in v)
        if any(s <= 0 for s in vectors["scale"]):
            raise PolicyFormatError(path, f"'observation.scale' must be > 0, got {list(vectors['scale'])}")
        if any(lo > hi for lo, hi in zip(vectors["low"], vectors["high"], strict=True)):
            raise PolicyFormatError(path, "'observation.low' exceeds 'observation.high'")
        chunk = data.get("chunk_size")
        if chunk is not None and not is_count(chunk, 1):
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
