"""Tabular Q-learning over the bandit's state bins (the paper evaluates it; no public hyperparameters).

State: the UCB bins ``(min(B // 4, 10), clip(delta, -5, 5), min(w // 4, 10))``; actions STOP/ADD.
Reward: the environment's own (default "latency": minus the requests in the system x seconds
between decisions, per request), so the undiscounted return is minus the mean end-to-end latency;
with "makespan", minus the episode's duration.

Our choices, and why:

- ``gamma = 1.0``: episodes are finite, and the return is then exactly the episode's figure.
  With ``gamma < 1`` a cost counts less the more decisions precede it, a bias that has nothing
  to do with throughput. In the serving loop the targets are noisy (the bins do not say how
  much work is left, which dominates the return to go): on a small leval-kv-pressure episode
  (``tests/test_agents.py``'s setting, 5,000 steps) ``gamma = 0.99`` reached 330.5 tokens/s
  against always-add's 332.9 and ``gamma = 1`` 298.9-311.2; the per-scenario builds choose.
- step size ``max(learning_rate, 1 / n(s, a))`` with ``learning_rate = 0.01``: a sample average
  over the first 100 visits of a pair (no bias from the initial 0), then a constant step that
  keeps tracking (the real engine drifts). The targets are very noisy (the bins hide how much
  work is left, which dominates the return to go), so the constant step must be small: in the
  earlier isolated-batch environment's simulator (20K steps, 20 episodes of seeds 3_000_000+), 0.1 learned to
  stop ShareGPT batches early (904-990 decode tok/s against 1093 for always-add) and 0.01 did
  not (1093 on three training seeds; L-Eval 531-540 against 540).
- epsilon-greedy, epsilon decaying linearly from 1.0 to 0.05 over the first 80% of training
  (``exploration_fraction``), then constant; greedy ties and unseen values break towards ADD.
  Q starts at 0, which is optimistic for the negative time-like rewards and adds exploration.
  Measured in the earlier environment with the earlier step 0.1 (L-Eval config, 20K steps, seeds
  3_000_000+): 0.8 gave 481-484 decode tok/s over two training seeds, 0.5 gave 453-476;
  ``gamma = 0.99`` did no better.
- Forced decisions (ADD masked, or the batch empty) are learned from like any other transition;
  the bootstrap takes the max over the next state's *valid* actions.

The deployed (exported) policy is greedy over visited actions, ADD in states never visited
(:func:`scheduler_runtime.rules.table_decision`, without the bandit's delta == 0 rule).

``baseline`` (the group decision): a hand-made rule the table departs from only where its own
estimates say the departure is real (safe policy improvement with baseline bootstrapping). Each
value's standard error comes from the targets' variance, tracked with the value's own step size
(``var <- (1 - a) (var + a td^2)``; the error is ``sqrt(var / n)`` while the step is ``1/n``,
``sqrt(var a / (2 - a))`` once it is constant); a state whose two values are not ``baseline_z``
standard errors apart, or where either action has fewer than ``baseline_min_visits`` visits, gets
the rule's answer (:func:`scheduler_runtime.rules.trusted_states`). ``"group-cap-K"`` and
``"group-hold"`` name the rule; ``"tuned"`` searches the caps on the evaluation environment before
training (:func:`agents.tuning.search_caps`, the training episodes ``python -m agents.tuning`` uses).
Why: a table's greedy answer between two values that differ by noise is arbitrary. The Poisson
table shipped on 2026-12-01 held cached documents at one and two groups in flight on values
0.001-0.004 apart over 800-1,900 visits each, where the tuned cap opens them; the simulator scored
the two alike, and the real engine put the table 0.3-9% behind the cap at and below its trained-for
load (docs/design.md, "On a faster machine"). Exploration and the
values are the same with or without a baseline: only the answers that are exported change.

Parallel workers merge by count-weighted means: ``Q(s, a)`` is the mean of the workers'
values weighted by how often each visited ``(s, a)`` since the last merge (unchanged where none
did); visit counts add up.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from agents.base import ADD, STOP, EpisodicAgent, TableBinsConfig
from scheduler_runtime.config import ConfigError
from scheduler_runtime.policy import Policy, TablePolicy
from scheduler_runtime.rules import GroupBins, GroupCapRule, TableBins, table_decision, trusted_states


@dataclass(frozen=True)
class QLearningConfig(TableBinsConfig):
    """Q-learning knobs (see the module docstring for the defaults' reasons)."""

    learning_rate: float = 0.01
    average_first: bool = True
    gamma: float = 1.0
    epsilon_start: float = 1.0
    epsilon_end: float = 0.05
    exploration_fraction: float = 0.8
    exploration_timesteps: int | None = None
    baseline: str | None = None
    baseline_z: float = 2.0
    baseline_min_visits: int = 30

    def __post_init__(self) -> None:
        if self.baseline is not None and self.baseline != "tuned":
            try:
                ok = GroupCapRule.from_name(str(self.baseline)) is not None
            except ValueError as exc:
                raise ValueError(f"qlearning.baseline: {exc}") from exc
            if not ok:
                raise ValueError(f"qlearning.baseline must be 'group-cap-K', 'group-hold', 'tuned' or null, "
                                 f"got {self.baseline!r}")
        if not (isinstance(self.baseline_z, int | float) and self.baseline_z >= 0):
            raise ValueError(f"qlearning.baseline_z must be >= 0, got {self.baseline_z!r}")
        if not (isinstance(self.baseline_min_visits, int) and self.baseline_min_visits >= 1):
            raise ValueError(f"qlearning.baseline_min_visits must be an integer >= 1, got "
                             f"{self.baseline_min_visits!r}")
        if not 0 < self.learning_rate <= 1:
            raise ValueError(f"qlearning.learning_rate must be in (0, 1], got {self.learning_rate}")
        if not 0 <= self.gamma <= 1:
            raise ValueError(f"qlearning.gamma must be in [0, 1], got {self.gamma}")
        for name in ("epsilon_start", "epsilon_end", "exploration_fraction"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"qlearning.{name} must be in [0, 1], got {getattr(self, name)}")

class QLearningAgent(EpisodicAgent):
    """Tabular Q-learning (see the module docstring)."""

    name = "qlearning"
    trainable = True
    config_cls = QLearningConfig

    def __init__(self, config: QLearningConfig | None = None, *, seed: int = 0) -> None:
        super().__init__(config or QLearningConfig(), seed=seed)
        self._use_bins(self.config.bins)
        #: Steps the epsilon schedule spans; set from the training length by ``learn``.
        self.exploration_timesteps = self.config.exploration_timesteps
        self._td: list[float] = []
        #: The rule the exported table falls back on (``config.baseline``, resolved by ``prepare``).
        self.baseline_rule: GroupCapRule | None = None
        if self.config.baseline not in (None, "tuned"):
            self.baseline_rule = GroupCapRule.from_name(self.config.baseline)

    def _use_bins(self, bins: TableBins | GroupBins) -> None:
        self.bins = bins
        n = bins.num_states
        self.q = np.zeros((n, 2), dtype=np.float64)
        self.visits = np.zeros((n, 2), dtype=np.int64)
        self.var = np.zeros((n, 2), dtype=np.float64)
        self._trusted_cache: list[bool] | None = None

    def observation_changed(self) -> None:
        bins = self.config.bins_for(self.obs_spec)
        if bins != self.bins:
            if self.visits.any():
                raise ValueError(f"agent {self.name!r} learned on other bins ({self.bins}) than this "
                                 f"observation's ({bins})")
            self._use_bins(bins)
        if self.config.baseline is not None and not isinstance(bins, GroupBins):
            raise ConfigError("qlearning.baseline is a group-decision rule: train with env.decision: group")

    def prepare(self, train_env: Any, eval_env: Any) -> None:
        super().prepare(train_env, eval_env)
        if self.config.baseline == "tuned" and self.baseline_rule is None:
            from agents.tuning import TUNE_SEED, search_caps

            self.baseline_rule, _ = search_caps(eval_env, [TUNE_SEED + i for i in range(8)])

    @property
    def epsilon(self) -> float:
        c = self.config
        span = self.exploration_timesteps or 1
        frac = min(self.num_timesteps / span, 1.0)
        return c.epsilon_start + frac * (c.epsilon_end - c.epsilon_start)

    def learn(self, env: Any, total_timesteps: int, callback: Any = None,
              reset_num_timesteps: bool = True) -> QLearningAgent:
        if self.config.exploration_timesteps is None:
            start = 0 if reset_num_timesteps else self.num_timesteps
            # The schedule spans a fraction of the whole run, also across resumes.
            self.exploration_timesteps = max(1, int(self.config.exploration_fraction
                                                    * (start + total_timesteps)))
        super().learn(env, total_timesteps, callback, reset_num_timesteps)
        return self

    # -- decisions -----------------------------------------------------------------------------
    def act(self, obs: np.ndarray, mask: np.ndarray) -> int:
        trusted = self._trusted() if self.baseline_rule is not None else None
        return table_decision(self.bins, self.q.ravel(), self.visits.ravel(), False, obs, mask,
                              self.baseline_rule, trusted)

    def stderr(self) -> np.ndarray:
        """Each value's standard error (see the module docstring), 0 where never visited."""
        n = np.maximum(self.visits, 1)
        lr = self.config.learning_rate
        frac = np.full(self.q.shape, lr / (2 - lr))
        if self.config.average_first:
            frac = np.where(1.0 / n >= lr, 1.0 / n, frac)
        return np.where(self.visits > 0, np.sqrt(self.var * frac), 0.0)

    def _trusted(self) -> list[bool]:
        """:func:`trusted_states` of the table, computed once per table (every update clears it)."""
        if self._trusted_cache is None:
            self._trusted_cache = trusted_states(self.q.ravel().tolist(), self.visits.ravel().tolist(),
                                                 self.stderr().ravel().tolist(), self.config.baseline_z,
                                                 self.config.baseline_min_visits)
        return self._trusted_cache

    def _greedy(self, s: int, mask: np.ndarray) -> int:
        if not mask[ADD]:
            return STOP
        if not mask[STOP]:
            return ADD
        return STOP if self.q[s, STOP] > self.q[s, ADD] else ADD

    def explore(self, obs: np.ndarray, mask: np.ndarray) -> int:
        if not mask[ADD]:
            return STOP
        if not mask[STOP] or obs[0] <= 0:
            return ADD
        if self.rng.random() < self.epsilon:
            return int(self.rng.integers(2))
        return self._greedy(self.bins.index(obs), mask)

    def observe(self, obs: np.ndarray, action: int, reward: float, next_obs: np.ndarray,
                next_mask: np.ndarray, done: bool, info: dict[str, Any]) -> None:
        s = self.bins.index(obs)
        target = reward
        if not done:
            s2 = self.bins.index(next_obs)
            target += self.config.gamma * max(self.q[s2, a] for a in (STOP, ADD) if next_mask[a])
        td = target - self.q[s, action]
        self.visits[s, action] += 1
        lr = self.config.learning_rate
        if self.config.average_first:  # a sample average for the first 1/learning_rate visits
            lr = max(lr, 1.0 / self.visits[s, action])
        self.q[s, action] += lr * td
        self.var[s, action] = (1 - lr) * (self.var[s, action] + lr * td * td)
        self._trusted_cache = None
        self._td.append(abs(td))

    def train_metrics(self) -> dict[str, float]:
        out = {"epsilon": self.epsilon, "states_visited": float((self.visits.sum(axis=1) > 0).sum())}
        if self._td:
            out["td_abs_error"] = float(np.mean(self._td))
            self._td = []
        return out

    # -- export, checkpoints, merging ----------------------------------------------------------
    def to_policy(self) -> Policy:
        meta: dict[str, Any] = {"gamma": self.config.gamma, "learning_rate": self.config.learning_rate}
        extra: dict[str, Any] = {}
        if self.baseline_rule is not None:
            trusted = self._trusted()
            meta.update(baseline=self.config.baseline, trusted_states=sum(trusted),
                        visited_states=int((self.visits.min(axis=1) > 0).sum()))
            extra = dict(baseline=self.baseline_rule, stderr=self.stderr().ravel().tolist(),
                         z=self.config.baseline_z, min_visits=self.config.baseline_min_visits)
        return TablePolicy(self._require_spec(), self.bins, self.q.ravel().tolist(),
                           self.visits.ravel().tolist(), False, agent=self.name, meta=meta, **extra)

    def state_dict(self) -> dict[str, np.ndarray]:
        out = {"q": self.q.copy(), "visits": self.visits.copy(), "var": self.var.copy(),
               "exploration_timesteps": np.array(self.exploration_timesteps or 0)}
        if self.baseline_rule is not None:  # a tuned rule is kept for the resumed run's export
            out["baseline_cap"] = np.array(self.baseline_rule.cap or 0)
        return out

    def load_state_dict(self, arrays: dict[str, np.ndarray]) -> None:
        if arrays["q"].shape != self.q.shape:
            raise ValueError(f"table shape {arrays['q'].shape} != {self.q.shape} of these bins")
        self.q = arrays["q"].astype(np.float64)
        self.visits = arrays["visits"].astype(np.int64)
        self.var = arrays["var"].astype(np.float64) if "var" in arrays else np.zeros_like(self.q)
        self._trusted_cache = None
        if "baseline_cap" in arrays:
            self.baseline_rule = GroupCapRule.from_cap(int(arrays["baseline_cap"]))
        self.exploration_timesteps = int(arrays["exploration_timesteps"]) or None

    @classmethod
    def merge(cls, base: dict[str, np.ndarray], workers: Sequence[dict[str, np.ndarray]]
              ) -> dict[str, np.ndarray]:
        """Count-weighted mean of the workers' Q-values and target variances (weights: visits since
        ``base``)."""
        q0, v0 = base["q"], base["visits"]
        var0 = base.get("var", np.zeros_like(q0))
        weight = np.zeros_like(q0)
        acc = np.zeros_like(q0)
        acc_var = np.zeros_like(q0)
        visits = v0.copy()
        for w in workers:
            dv = (w["visits"] - v0).astype(np.float64)
            acc += dv * w["q"]
            acc_var += dv * w.get("var", var0)
            weight += dv
            visits += w["visits"] - v0
        q = np.where(weight > 0, acc / np.maximum(weight, 1e-12), q0)
        var = np.where(weight > 0, acc_var / np.maximum(weight, 1e-12), var0)
        return {**base, "q": q, "visits": visits, "var": var}
