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

:func:`advantages` collects, along the base rule's own trajectories on training episodes, each
decision's advantage (episode duration after STOP minus after ADD, seconds) per state bin of the
tabular agents (:class:`~scheduler_runtime.rules.GroupBins`); :func:`distill` turns them into a
deployable policy (:class:`DeviationPolicy`): the base rule's answer, except in the bins where the
mean advantage is of the other sign by more than ``z`` standard errors. That is one step of
approximate policy iteration from the best cap, with the tabular agents' features and without
seeing the future: what those features let a learner win over the cap.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agents.base import ADD, STOP
from feather_env.env import FeatherEnv, finish_episode, play_episode
from scheduler_runtime.rules import GroupBins, open_choice, trusted_states

__all__ = ["DeviationPolicy", "advantages", "distill", "lookahead_episode"]


def _durations(env: FeatherEnv, base: Any) -> dict[int, float]:
    """The episode's duration after each action now, then ``base``, each on a copy of ``env``."""
    out = {}
    for action in (STOP, ADD):
        branch = copy.deepcopy(env)
        branch.step(action)
        finish_episode(branch, base)
        out[action] = float(branch.episode_metrics()["duration"])
    return out


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


@dataclass
class Advantages:
    """Per state bin: the advantages of ADD over STOP (s) seen there and the base rule's answers."""

    bins: GroupBins
    samples: dict[int, list[float]] = field(default_factory=dict)
    base_actions: dict[int, list[int]] = field(default_factory=dict)

    def add(self, obs: Sequence[float], advantage: float, base_action: int) -> None:
        s = self.bins.index(obs)
        self.samples.setdefault(s, []).append(float(advantage))
        self.base_actions.setdefault(s, []).append(int(base_action))


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

    def __init__(self, base: Any, bins: GroupBins, deviations: Mapping[int, int]) -> None:
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
