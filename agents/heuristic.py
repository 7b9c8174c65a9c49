"""The static batching heuristic of the Feather authors' code, as an agent.

Rule (docs/design.md, "Batching policies"; implemented once, in
:class:`scheduler_runtime.rules.HeuristicRule`, so the agent and the exported policy agree):
ADD when the candidate loses at most ``delta_max`` (5) chunks of shared prefix, or at most
``delta_max_shared`` (7) when ``w >= w_shared`` (10) waiting requests share the new depth; each
such ADD raises a minimum-batch floor by 1 (cap ``floor_cap`` = 10). Any other candidate is
ADDed only while the batch is below the floor.

The environment admits the first request of each batch itself, so the rule's "empty batch ->
ADD" case never reaches the agent (it is still in the rule, for the runtime scheduler).

When the floor resets (``floor_reset``): at each episode by default, not at each batch. With a
per-batch reset the floor can never admit anything (every cheap ADD grows the batch and the
floor together), and on a workload without shared prefixes the first ADD of each batch has a
large delta (the seed request's whole prompt), so batches would stay at one request. A floor
that persists across batches learns, within the episode, that batches of ``floor_cap`` are
affordable. ``floor_reset: batch`` is available for comparison.

The heuristic has nothing to learn: ``learn`` plays it (so that ``train.py`` logs and evaluates
it like the other agents) and leaves it unchanged.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from agents.base import EpisodicAgent
from scheduler_runtime.policy import HeuristicPolicy, Policy
from scheduler_runtime.rules import HeuristicRule


@dataclass(frozen=True)
class HeuristicConfig:
    """Constants of the rule (chunks of ``env.chunk_size`` tokens for the deltas)."""

    delta_max: float = HeuristicRule.delta_max  # the runtime rule's defaults, one source for both
    delta_max_shared: float = HeuristicRule.delta_max_shared
    w_shared: float = HeuristicRule.w_shared
    floor_cap: int = HeuristicRule.floor_cap
    floor_init: int = HeuristicRule.floor_init
    floor_reset: str = HeuristicRule.floor_reset

    def __post_init__(self) -> None:
        if self.floor_reset not in ("episode", "batch"):
            raise ValueError(f"heuristic.floor_reset must be 'episode' or 'batch', got {self.floor_reset!r}")


class HeuristicAgent(EpisodicAgent):
    """The authors' static rule (see the module docstring)."""

    name = "heuristic"
    config_cls = HeuristicConfig

    def __init__(self, config: HeuristicConfig | None = None, *, seed: int = 0) -> None:
        super().__init__(config or HeuristicConfig(), seed=seed)
        self.rule = HeuristicRule(**asdict(self.config))

    def act(self, obs: np.ndarray, mask: np.ndarray) -> int:
        return self.rule.act(obs, mask)

    def reset(self) -> None:
        self.rule.reset()

    def to_policy(self) -> Policy:
        return HeuristicPolicy(self._require_spec(), HeuristicRule(**asdict(self.config)), agent=self.name)
