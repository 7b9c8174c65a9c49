"""Reference policies: what the learned agents are measured against.

- ``always-add``: ADD whenever it is valid, i.e. fill every batch to the size/KV limit; what a
  batch-maximizing scheduler does. Exportable (a ``constant`` policy), so the runtime can serve
  with it as a baseline.
- ``oracle``: knows the prefix-group ids of the requests (the runtime does not): ADD iff the
  candidate belongs to the group of the running batch's oldest request, i.e. one prefix group
  in the batch at a time. Not exportable.
- ``random``: a valid action uniformly at random (tests' lower bar). Not exportable.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

from agents.base import ADD, STOP, EpisodicAgent, NotExportableError
from scheduler_runtime.decision import AlwaysAdd
from scheduler_runtime.policy import ConstantPolicy, Policy


class AlwaysAddAgent(EpisodicAgent):
    """:class:`~scheduler_runtime.decision.AlwaysAdd` as an agent (it plays, logs and exports as one);
    its policy file is the ``constant`` ADD kind."""

    name = "always-add"
    _rule = AlwaysAdd()

    def act(self, obs: np.ndarray, mask: np.ndarray) -> int:
        return self._rule.act(obs, mask)

    def to_policy(self) -> Policy:
        return ConstantPolicy(self._require_spec(), ADD, agent=self.name)


class OracleAgent(EpisodicAgent):
    """One prefix group per batch, from the requests' group ids (reads the environment)."""

    name = "oracle"

    def __init__(self, config: Any = None, *, seed: int = 0, env: gym.Env | None = None) -> None:
        super().__init__(config, seed=seed)
        self.env = None if env is None else env.unwrapped

    def bind(self, env: gym.Env) -> None:
        super().bind(env)
        self.env = env.unwrapped

    def act(self, obs: np.ndarray, mask: np.ndarray) -> int:
        if self.env is None:
            raise RuntimeError("the oracle reads prefix groups from the environment: bind(env) first")
        if not mask[ADD]:
            return STOP
        batch = self.env.batch_requests
        if not batch:
            return ADD
        cand = self.env.candidate_request
        return ADD if cand is not None and cand.prefix_group == batch[0].prefix_group else STOP

    def to_policy(self) -> Policy:
        raise NotExportableError("the oracle needs prefix-group ids, which a serving engine does not have")


class RandomAgent(EpisodicAgent):
    """A valid action uniformly at random (seeded)."""

    name = "random"

    def act(self, obs: np.ndarray, mask: np.ndarray) -> int:
        valid = np.flatnonzero(mask)
        return int(self.rng.choice(valid))

    def to_policy(self) -> Policy:
        raise NotExportableError("the random policy is for tests only")
