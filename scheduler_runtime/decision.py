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
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

__all__ = [
    "ACTION_NAMES",
    "ADD",
    "BASE_OBS_NAMES",
    "EXTENDED_OBS_NAMES",
    "STOP",
    "AlwaysAdd",
    "BatchingPolicy",
    "EngineView",
    "NoEngine",
    "wants_extended_obs",
]

STOP, ADD = 0, 1
ACTION_NAMES = ("STOP", "ADD")
BASE_OBS_NAMES = ("batch_size", "delta", "w")
EXTENDED_OBS_NAMES = BASE_OBS_NAMES + ("waiting", "kv_usage", "missing_chunks", "prompt_chunks",
                                       "cached_chunks")


def wants_extended_obs(policy: object) -> bool:
    """Whether ``policy`` asks for the extended observation: its ``obs_spec`` names all of
    :data:`EXTENDED_OBS_NAMES` (a policy without one gets the paper's three entries)."""
    return len(getattr(getattr(policy, "obs_spec", None), "names", ())) == len(EXTENDED_OBS_NAMES)


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

    def cached_prefix_tokens(self, request_id: str) -> int:
        """Prompt tokens of a held request that the prefix cache would serve if admitted now."""
        ...


class NoEngine:
    """The view of a core that runs without an engine (tests, benchmarks): nothing cached, empty."""

    def kv_usage(self) -> float:
        return 0.0

    def cached_prefix_tokens(self, request_id: str) -> int:
        return 0
