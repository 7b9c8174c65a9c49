"""The contextual bandit of the Feather authors' code (UCB over binned states).

State bins (:class:`scheduler_runtime.rules.TableBins`): ``(min(B // 4, 10), clip(delta, -5, 5),
min(w // 4, 10))``, 11 x 11 x 11 states, two arms (STOP, ADD) each.

Decisions, in order: the mask (ADD invalid -> STOP); an empty batch -> ADD (never reaches the
agent: the environment admits each batch's first request itself); ``delta == 0`` -> ADD (the
candidate costs no shared prefix); otherwise UCB over the state's arms: an untried arm first
(at random among untried ones), else ``argmax mean(s, a) + c * sqrt(ln(N(s) + 1) / n(s, a))`` with
``N(s)`` the state's pulls; ``c`` is in the credit's units (the authors used 200 for decode tokens/s).

Credit. In the paper an episode is one batch, and the batch's decode throughput is credited to
every decision that formed it. In the serving loop a decision's effect outlasts any batch (an
admission now decides what the prefix cache evicts later), so the credit of an arm is what
followed it until the episode ended: the environment's rewards from that decision on (``credit:
return_to_go``, the default; with the default latency reward, minus the request seconds still to
come per request). A Monte Carlo estimate of the arm's value: how much is left depends on when
in the episode the decision came, but that offset is shared by the two arms of a state and
cancels in the comparison. ``credit: episode`` credits every arm with its episode's end-to-end
output throughput instead (tokens/s): unbiased by phase, but episodes differ so much (other
documents, other lengths) that one decision's effect drowns; on a small leval-kv-pressure
episode it learned to STOP where always-add is best (229 against 333 tokens/s, return-to-go:
322; makespan reward, 3,000 steps, seed 0, ``tests/test_agents.py``'s setting). Decisions forced
by a mask or by the two rules above are not arms and are not credited.

``c`` is in units of the credit (seconds for ``return_to_go`` under the latency or makespan
rewards, tokens/s for ``episode``); 2.0 by default.

The deployed (exported) policy is greedy: the valid arm of highest mean among visited arms,
ADD for states never visited (:func:`scheduler_runtime.rules.table_decision`).

Parallel workers (``train.py --n-envs N``) merge exactly: counts add up, means are pooled
(count-weighted) over what each worker added since the last merge.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from agents.base import ADD, STOP, EpisodicAgent, TableBinsConfig
from scheduler_runtime.policy import Policy, TablePolicy
from scheduler_runtime.rules import GroupBins, TableBins, table_decision

CREDITS = ("episode", "return_to_go")


@dataclass(frozen=True)
class UCBConfig(TableBinsConfig):
    """Bandit knobs: exploration constant (reward units), credit, bins."""

    c: float = 2.0
    credit: str = "return_to_go"

    def __post_init__(self) -> None:
        if self.credit not in CREDITS:
            raise ValueError(f"ucb.credit must be one of {CREDITS}, got {self.credit!r}")
        if self.c < 0:
            raise ValueError(f"ucb.c must be >= 0, got {self.c}")

class UCBAgent(EpisodicAgent):
    """Contextual UCB bandit (see the module docstring)."""

    name = "ucb"
    trainable = True
    config_cls = UCBConfig

    def __init__(self, config: UCBConfig | None = None, *, seed: int = 0) -> None:
        super().__init__(config or UCBConfig(), seed=seed)
        self._use_bins(self.config.bins)
        self._pending: list[tuple[int, int, float]] = []  # (state, arm, return before it)
        self._return = 0.0
        self._abs_err: list[float] = []

    def _use_bins(self, bins: TableBins | GroupBins) -> None:
        self.bins = bins
        # the paper's rule (delta == 0 costs nothing: ADD) is the request decision's; in the group
        # decision delta is 0 whenever the batch shares no prefix, which says nothing of the cost
        self.add_if_delta_zero = not isinstance(bins, GroupBins)
        n = bins.num_states
        self.counts = np.zeros((n, 2), dtype=np.int64)
        self.means = np.zeros((n, 2), dtype=np.float64)

    def observation_changed(self) -> None:
        bins = self.config.bins_for(self.obs_spec)
        if bins != self.bins:
            if self.counts.any():
                raise ValueError(f"agent {self.name!r} learned on other bins ({self.bins}) than this "
                                 f"observation's ({bins})")
            self._use_bins(bins)

    # -- decisions -----------------------------------------------------------------------------
    def _forced(self, obs: np.ndarray, mask: np.ndarray) -> int | None:
        if not mask[ADD]:
            return STOP
        if not mask[STOP] or obs[0] <= 0 or (self.add_if_delta_zero and int(obs[1]) == 0):
            return ADD
        return None

    def act(self, obs: np.ndarray, mask: np.ndarray) -> int:
        return table_decision(self.bins, self.means.ravel(), self.counts.ravel(), self.add_if_delta_zero,
                              obs, mask)

    def explore(self, obs: np.ndarray, mask: np.ndarray) -> int:
        forced = self._forced(obs, mask)
        if forced is not None:
            return forced
        s = self.bins.index(obs)
        n = self.counts[s]
        untried = np.flatnonzero(n == 0)
        if untried.size:
            a = int(self.rng.choice(untried))
        else:
            bonus = self.config.c * np.sqrt(math.log(n.sum() + 1) / n)
            a = int(np.argmax(self.means[s] + bonus))
        self._pending.append((s, a, self._return))
        return a

    def observe(self, obs: np.ndarray, action: int, reward: float, next_obs: np.ndarray,
                next_mask: np.ndarray, done: bool, info: dict[str, Any]) -> None:
        self._return += reward
        if not done:
            return
        episode = info.get("feather_episode") or info.get("episode") or {}
        for s, a, before in self._pending:
            if self.config.credit == "episode":
                credit = float(episode["output_throughput"])
            else:
                credit = self._return - before
            self.counts[s, a] += 1
            self._abs_err.append(abs(credit - self.means[s, a]))
            self.means[s, a] += (credit - self.means[s, a]) / self.counts[s, a]
        self._pending = []
        self._return = 0.0

    def reset(self) -> None:
        self._pending = []
        self._return = 0.0

    def train_metrics(self) -> dict[str, float]:
        out = {"states_visited": float((self.counts.sum(axis=1) > 0).sum())}
        if self._abs_err:
            out["credit_abs_error"] = float(np.mean(self._abs_err))
            self._abs_err = []
        return out

    # -- export, checkpoints, merging ----------------------------------------------------------
    def to_policy(self) -> Policy:
        return TablePolicy(self._require_spec(), self.bins, self.means.ravel().tolist(),
                           self.counts.ravel().tolist(), self.add_if_delta_zero, agent=self.name,
                           meta={"credit": self.config.credit, "c": self.config.c})

    def state_dict(self) -> dict[str, np.ndarray]:
        return {"counts": self.counts.copy(), "means": self.means.copy()}

    def load_state_dict(self, arrays: dict[str, np.ndarray]) -> None:
        if arrays["counts"].shape != self.counts.shape:
            raise ValueError(f"table shape {arrays['counts'].shape} != {self.counts.shape} of these bins")
        self.counts = arrays["counts"].astype(np.int64)
        self.means = arrays["means"].astype(np.float64)

    @classmethod
    def merge(cls, base: dict[str, np.ndarray], workers: Sequence[dict[str, np.ndarray]]
              ) -> dict[str, np.ndarray]:
        """Pool the rewards each worker credited since ``base``: exact pooled means and counts."""
        n0, m0 = base["counts"], base["means"]
        counts = n0.copy()
        sums = n0 * m0
        for w in workers:
            counts += w["counts"] - n0
            sums += w["counts"] * w["means"] - n0 * m0
        means = np.divide(sums, counts, out=np.zeros_like(m0), where=counts > 0)
        return {"counts": counts, "means": means}
