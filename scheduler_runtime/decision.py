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
7      ``kv_usage``           fraction of the engine's KV cache blocks in use
8      ``oldest_wait``        seconds the longest-held request has waited
=====  =====================  ==================================================================

A policy asks for the group decision by naming :data:`GROUP_OBS_NAMES` in its observation spec
(:func:`observation_kind`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

__all__ = [
    "ACTION_NAMES",
    "ADD",
    "BASE_OBS_NAMES",
    "EXTENDED_OBS_NAMES",
    "GROUP_OBS_NAMES",
    "OBSERVATION_KINDS",
    "STOP",
    "AlwaysAdd",
    "BatchingPolicy",
    "EngineView",
    "NoEngine",
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
    computing it).
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
