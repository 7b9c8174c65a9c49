"""Rollout over a base rule: what a group decision can add to the best constant cap.

Policy improvement by rollout (Bertsekas, *Rollout, Policy Iteration, and Distributed
Reinforcement Learning*, 2020): at a decision, serve the rest of the episode once per action on a
copy of the simulator, the base rule (``group-cap-K``) answering every later decision, and take
the action whose copy ends the episode sooner. On the simulator, an exact model of vLLM's
scheduler that replays the episode's own requests and arrivals, both copies meet the same future,
so the comparison has no noise, and it sees that future: the *lookahead* is clairvoyant, a
reference and not a deployable policy. With a deterministic model and a base rule that answers from
the state alone, the lookahead never ends an episode later than the base rule (the rollout's cost
improvement: at each step the base rule's own continuation is one of the two candidates), so
its gain is what one decision's better answer, made with perfect knowledge of the future, wins
over the rule on that episode.

Part of that gain is foresight over timing, not a better answer: a small change now (one more
document opened, or a step a few milliseconds longer) moves every later step against the
arrivals, and the episode's end by far more than the change. :func:`placebo_episode` measures it
as a control: it answers every decision as the base rule does, and chooses with the same
foresight only whether the engine runs *slower* until the next decision, which never helps in
expectation.

:func:`advantages` collects, along the base rule's own trajectories on training episodes, each
decision's advantage (episode duration after STOP minus after ADD, seconds) per state bin of the
tabular agents (:class:`~scheduler_runtime.rules.GroupBins`); :func:`distill` turns them into a
deployable policy (:class:`DeviationPolicy`): the base rule's answer, except in the bins where the
mean advantage is of the other sign by more than ``z`` standard errors. That is one step of
approximate policy iteration from the best cap, with the tabular agents' features and without
seeing the future: what those features let a learner win over the cap.
With :func:`distill_tree` the bins are the leaves of a regression tree of the advantages over the
raw observation (:class:`AdvantageTree`), cut where the advantage changes, not where the tabular
agents' bins were set.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from agents.base import ADD, STOP
from feather_env.env import FeatherEnv, finish_episode, play_episode
from scheduler_runtime.rules import GroupBins, open_choice, trusted_states

__all__ = ["AdvantageTree", "Advantages", "DeviationPolicy", "Partition", "advantages", "distill",
           "distill_tree", "lookahead_episode", "placebo_episode"]


def _duration_after(env: FeatherEnv, base: Any, action: int, time_scale: float | None = None) -> float:
    """The episode's duration after ``action`` now, then ``base``, on a copy of ``env``; with
    ``time_scale``, the copy's simulated engine runs at that scale until its next decision."""
    branch = copy.deepcopy(env)
    if time_scale is None:
        branch.step(action)
    else:
        own = branch.backend.time_scale
        branch.backend.time_scale = time_scale
        branch.step(action)
        branch.backend.time_scale = own
    finish_episode(branch, base)
    return float(branch.episode_metrics()["duration"])


def _durations(env: FeatherEnv, base: Any) -> dict[int, float]:
    """The episode's duration after each action now, then ``base``, each on a copy of ``env``."""
    return {action: _duration_after(env, base, action) for action in (STOP, ADD)}


class _Answering:
    """``base``'s answers, except at an owned decision: ``answer(obs, base's action, the durations
    after each action on copies of env)``."""

    def __init__(self, env: FeatherEnv, base: Any,
                 answer: Callable[[Sequence[float], int, dict[int, float]], int]) -> None:
        self.env, self.base, self.answer = env, base, answer
        self.obs_spec = base.obs_spec

    def act(self, obs: Sequence[float], mask: Sequence[bool]) -> int:
        action = int(self.base.act(obs, mask))
        if open_choice(obs, mask, self.base):
            action = self.answer(obs, action, _durations(self.env, self.base))
        return action


def _serve(env: FeatherEnv, base: Any, episode_seed: int,
           answer: Callable[[Sequence[float], int, dict[int, float]], int]) -> dict[str, Any]:
    """Serve episode ``episode_seed`` with ``base`` answering, except at owned decisions
    (:class:`_Answering`); the episode's metrics."""
    return play_episode(env, _Answering(env, base, answer), episode_seed=episode_seed)


def lookahead_episode(env: FeatherEnv, base: Any, episode_seed: int) -> dict[str, Any]:
    """Serve episode ``episode_seed`` answering each owned decision with the action whose copy ends
    the episode sooner, ``base`` answering the rest (ties: ``base``'s action). ``env``: a simulated
    group-decision environment. Returns the episode's metrics with ``decisions_owned`` and
    ``changed`` (owned decisions answered otherwise than ``base``)."""
    counts = {"decisions_owned": 0, "changed": 0}

    def sooner(obs: Sequence[float], action: int, durations: dict[int, float]) -> int:
        counts["decisions_owned"] += 1
        other = 1 - action
        if durations[other] < durations[action] - 1e-9:
            counts["changed"] += 1
            return other
        return action

    return {**_serve(env, base, episode_seed, sooner), **counts}


class _Placebo:
    """``base``'s answers at every decision; at an owned one, the engine also runs ``1 + slowdown``
    times slower until the next decision where a copy says that ends the episode sooner."""

    def __init__(self, env: FeatherEnv, base: Any, slowdown: float) -> None:
        self.env, self.base, self.slowdown = env, base, slowdown
        self.obs_spec = base.obs_spec
        self.scale: float | None = None  # the episode's own time scale, read at its first decision
        self.owned = self.slowed = 0

    def act(self, obs: Sequence[float], mask: Sequence[bool]) -> int:
        backend = self.env.backend
        if self.scale is None:
            self.scale = float(backend.time_scale)
        backend.time_scale = self.scale  # a slowed interval ends at the next decision
        action = int(self.base.act(obs, mask))
        if open_choice(obs, mask, self.base):
            self.owned += 1
            slow = self.scale * (1.0 + self.slowdown)
            if (_duration_after(self.env, self.base, action, slow)
                    < _duration_after(self.env, self.base, action) - 1e-9):
                self.slowed += 1
                backend.time_scale = slow
        return action


def placebo_episode(env: FeatherEnv, base: Any, episode_seed: int, slowdown: float = 0.3) -> dict[str, Any]:
    """The lookahead's control: serve episode ``episode_seed`` with ``base`` answering *every*
    decision, and at each owned one let the simulated engine run ``1 + slowdown`` times slower
    until the next decision where the copies say that ends the episode sooner.

    Slowing the engine never helps in expectation, and it answers nothing otherwise than ``base``;
    what it wins is what foresight wins by choosing between two futures that a small perturbation
    sets apart. The lookahead's gain above it is what its better *answers* win. Returns the
    episode's metrics with ``decisions_owned`` and ``slowed`` (owned decisions followed by a slowed
    interval). ``env``: a simulated group-decision environment."""
    placebo = _Placebo(env, base, slowdown)
    try:
        out = play_episode(env, placebo, episode_seed=episode_seed)
    finally:
        if placebo.scale is not None:
            env.backend.time_scale = placebo.scale  # the last slowed interval must not outlive the episode
    return {**out, "decisions_owned": placebo.owned, "slowed": placebo.slowed}


class Partition(Protocol):
    """Bins of the group observation: :class:`~scheduler_runtime.rules.GroupBins` or an
    :class:`AdvantageTree`'s leaves."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    def index(self, obs: Sequence[float]) -> int: ...


@dataclass
class Advantages:
    """Per state bin: the advantages of ADD over STOP (s) seen there and the base rule's answers;
    and every sample with its raw observation (``rows``), to partition again."""

    bins: Partition
    samples: dict[int, list[float]] = field(default_factory=dict)
    base_actions: dict[int, list[int]] = field(default_factory=dict)
    rows: list[tuple[tuple[float, ...], float, int]] = field(default_factory=list)

    def add(self, obs: Sequence[float], advantage: float, base_action: int) -> None:
        s = self.bins.index(obs)
        self.samples.setdefault(s, []).append(float(advantage))
        self.base_actions.setdefault(s, []).append(int(base_action))
        self.rows.append((tuple(float(x) for x in obs), float(advantage), int(base_action)))

    def rebinned(self, bins: Partition) -> Advantages:
        """The same samples in ``bins``."""
        out = Advantages(bins)
        for obs, advantage, base_action in self.rows:
            out.add(obs, advantage, base_action)
        return out


class AdvantageTree:
    """A least-squares regression tree (CART) of the advantages over the raw group observation,
    its leaves the bins: a partition fitted to where the advantage changes, finer than the tabular
    agents' bins wherever the samples support it (``depth`` levels, ``min_leaf`` samples a leaf)."""

    def __init__(self, obs: np.ndarray, advantage: np.ndarray, depth: int = 4, min_leaf: int = 100) -> None:
        if depth < 0 or min_leaf < 1:
            raise ValueError(f"depth must be >= 0 and min_leaf >= 1, got {depth}, {min_leaf}")
        #: Per node: ``(feature, threshold, left, right)``, or ``(-1, leaf, 0, 0)`` for a leaf.
        self.nodes: list[tuple[int, float, int, int]] = []
        self.num_leaves = 0
        self._grow(np.asarray(obs, dtype=float), np.asarray(advantage, dtype=float), depth, min_leaf)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_leaves,)

    def _grow(self, x: np.ndarray, y: np.ndarray, depth: int, min_leaf: int) -> int:
        node = len(self.nodes)
        self.nodes.append((-1, float(self.num_leaves), 0, 0))
        split = _best_split(x, y, min_leaf) if depth > 0 and len(y) >= 2 * min_leaf else None
        if split is None:
            self.num_leaves += 1
            return node
        feature, threshold = split
        left = x[:, feature] <= threshold
        a = self._grow(x[left], y[left], depth - 1, min_leaf)
        b = self._grow(x[~left], y[~left], depth - 1, min_leaf)
        self.nodes[node] = (feature, threshold, a, b)
        return node

    def index(self, obs: Sequence[float]) -> int:
        feature, threshold, left, right = self.nodes[0]
        while feature >= 0:
            feature, threshold, left, right = self.nodes[left if obs[feature] <= threshold else right]
        return int(threshold)


def _best_split(x: np.ndarray, y: np.ndarray, min_leaf: int) -> tuple[int, float] | None:
    """The (feature, threshold) whose split leaves the least squared error, each side at least
    ``min_leaf`` samples; None when no split lowers it."""
    n = len(y)
    best, best_sse = None, float(((y - y.mean()) ** 2).sum()) - 1e-12
    sizes = np.arange(1, n)  # samples left of a cut after position i - 1
    for feature in range(x.shape[1]):
        order = np.argsort(x[:, feature], kind="stable")
        xs, ys = x[order, feature], y[order]
        c1, c2 = np.cumsum(ys)[:-1], np.cumsum(ys * ys)[:-1]
        sse = (c2 - c1 * c1 / sizes) + ((c2[-1] + ys[-1] ** 2 - c2)
                                         - (c1[-1] + ys[-1] - c1) ** 2 / (n - sizes))
        valid = (xs[:-1] < xs[1:]) & (sizes >= min_leaf) & (n - sizes >= min_leaf)
        if not valid.any():
            continue
        i = int(np.argmin(np.where(valid, sse, np.inf)))
        if sse[i] < best_sse:
            best, best_sse = (feature, float((xs[i] + xs[i + 1]) / 2)), float(sse[i])
    return best


def advantages(env: FeatherEnv, base: Any, seeds: Sequence[int], bins: GroupBins | None = None) -> Advantages:
    """Along ``base``'s own trajectory on each episode of ``seeds``: at every owned decision, the
    duration after STOP minus the duration after ADD (positive: ADD ends sooner), per bin."""
    out = Advantages(bins or GroupBins())

    def record(obs: Sequence[float], action: int, durations: dict[int, float]) -> int:
        out.add(obs, durations[STOP] - durations[ADD], action)
        return action

    for seed in seeds:
        _serve(env, base, seed, record)
    return out


class DeviationPolicy:
    """``base``'s answers, except the action ``deviations[bin]`` in those bins of an owned decision."""

    def __init__(self, base: Any, bins: Partition, deviations: Mapping[int, int]) -> None:
        self.base, self.bins, self.deviations = base, bins, dict(deviations)
        self.obs_spec = base.obs_spec

    def act(self, obs: Sequence[float], mask: Sequence[bool]) -> int:
        if open_choice(obs, mask, self.base):
            action = self.deviations.get(self.bins.index(obs))
            if action is not None:
                return action
        return int(self.base.act(obs, mask))


def distill(adv: Advantages, base: Any, z: float = 2.0) -> tuple[DeviationPolicy, list[dict[str, Any]]]:
    """The policy that answers as ``base`` except where a bin's mean advantage disagrees with the
    base rule's (majority) answer there by more than ``z`` standard errors; and per bin its
    samples, mean, standard error, the base's answer and the policy's."""
    deviations: dict[int, int] = {}
    report = []
    for s in sorted(adv.samples):
        xs = np.asarray(adv.samples[s])
        mean = float(xs.mean())
        se = float(xs.std(ddof=1) / math.sqrt(len(xs))) if len(xs) > 1 else math.inf
        base_action = ADD if 2 * sum(adv.base_actions[s]) >= len(adv.base_actions[s]) else STOP
        better = ADD if mean > 0 else STOP
        # the advantage as a two-valued table (STOP 0, ADD the mean): the tables' significance rule
        significant = trusted_states([0.0, mean], [len(xs), len(xs)], [0.0, se], z, 2)[0]
        action = better if significant else base_action
        if action != base_action:
            deviations[s] = action
        report.append({"bin": [int(i) for i in np.unravel_index(s, adv.bins.shape)], "samples": len(xs),
                       "mean_advantage_s": mean, "se_s": se, "base": base_action, "policy": action})
    return DeviationPolicy(base, adv.bins, deviations), report


def distill_tree(adv: Advantages, base: Any, z: float = 2.0, depth: int = 4,
                 min_leaf: int = 100) -> tuple[DeviationPolicy, list[dict[str, Any]]]:
    """:func:`distill` over the leaves of an :class:`AdvantageTree` fitted to ``adv``'s samples on
    the raw observation, in place of the tabular agents' bins."""
    obs = np.array([row[0] for row in adv.rows])
    advantage = np.array([row[1] for row in adv.rows])
    return distill(adv.rebinned(AdvantageTree(obs, advantage, depth, min_leaf)), base, z)

