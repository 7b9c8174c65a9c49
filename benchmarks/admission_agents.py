"""Agents trained on the admit/reject decision (``feather/Admission-v0``) against the tuned ``slo:F`` rule.

    python -m benchmarks.admission_agents [--scenarios mooncake-overload-3l,mooncake-overload-1.5l]
                                          [--train-seeds 1765,231,2160,1820,780]
                                          [--eval-seeds 35,149,652,374,156] [--passes 60]
                                          [--ppo-steps 40000] [--oracle-sims 60]
                                          [--json results/admission_agents.json]

Per load (scenario: ``mooncake-overload-3l`` and ``-1.5l``, 100-s windows of the Mooncake trace at
1.05x / 0.525x its rate = 3L / 1.5L of the EPYC AVX-512 host; profile of that host; SLOs ttft 5000
ms, tpot 50 ms; base setting ``group-cap-8@256``), every policy plays
:class:`~feather_env.admission_env.AdmissionEnv` on the held-out windows, and the figure is SLO
attainment over *submitted* requests (a rejected one is not good):

- ``admit``: always ADMIT: the base setting's own run;
- ``rule``: ``slo:F`` as a policy of the environment (:func:`~feather_env.admission_env.rule_action`,
  identical to the serving rule ``~slo:F``: ``tests/test_admission_env.py``), F tuned on the
  training windows over :data:`FACTORS` (12 log-spaced values, 1/8 to 8); ``F*``: the best F of
  the held-out window in hindsight (not deployable);
- ``oracle``: :func:`benchmarks.admission_headroom.hindsight_oracle` (with foresight, not
  deployable) started from the tuned rule's admitted set (the headroom benchmark's ``c from rule``),
  ``--oracle-sims`` add-back serves: an admission decision some rule with foresight could make, so
  a *lower bound on the optimum*; ``oracle / rule - 1`` is a floor on what any admission policy
  (learned or not) could win over the tuned rule on that window;
- ``placebo``: reject uniformly at random as many requests as the tuned rule rejected on that
  window (:func:`benchmarks.admission_headroom.placebo`, median of 3 draws);
- ``qlearning``: tabular Q-learning over binned observations (:class:`TabularQ`, below);
- ``ucb``: a contextual UCB bandit over the same bins (:class:`ContextualUCB`);
- ``ppo``: MaskablePPO (sb3-contrib; both actions are always valid, so it is PPO) on the log-scaled
  observation and the environment's own rewards, ``--ppo-steps`` steps (0: skipped).

The learners train on the training windows only (``--passes`` passes over them, in a random order
per pass) and are evaluated greedily on the held-out windows (no learning there). ``agents/``'s
Q-learning and UCB read the batching decision's bins (``scheduler_runtime.rules.TableBins``:
batch size, delta, w) and do not fit this observation, hence the two small learners here. The
``best`` agent is the learned one of highest mean attainment on the *training* windows (greedy),
and ``best/rule`` its held-out attainment over the rule's.

Bins (:func:`state`): predicted TTFT / SLO in 10 bins (edges 0.25, 0.5, 0.75, 1, 1.25, 1.5, 2, 3,
4), ``never_fits`` (2), uncached fraction > 0.5 (2): 40 states (a bin of the time since the last
rejection was dropped: under exploration nearly every state follows a rejection, so the greedy
policy met states it had hardly seen).

Credit: the environment credits a good request when it finishes. The tabular learners move each
reward to the decision it belongs to once the episode is over (:func:`collect`: the request's
own outcome at its own decision, same return), so that an admission is credited with its own
outcome and charged for the others' through the states that follow. With the finish credit
(gamma 0.99, epsilon from 1, 30 passes; a 2026-12-06 pilot) Q-learning reached 0.814 / 0.822
(3L / 1.5L held-out means) and UCB 0.813 / 0.710, against the rule's 0.896 / 0.975.

Windows: the trace is 1,022 s long; a window starts at a request drawn by the seed. The default
seeds are ten pairwise disjoint windows starting near 0, 100, ..., 900 s (checked at run time):
training takes the even ones ([0, 100), [203, 303), [404, 504), [605, 705), [805, 905) s), the
held-out the odd ones, so both halves see the trace's growth in load (it roughly doubles from the
first half to the second).
"""

from __future__ import annotations

import argparse
import bisect
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np

from benchmarks import measured
from benchmarks.admission_headroom import (
    Server,
    attainment_bound,
    budget_of,
    hindsight_oracle,
    placebo,
    window_span,
)
from feather_env.admission_env import ADMIT, DEFAULT_SETTING, REJECT, AdmissionEnv, rule_action
from feather_env.reporting import format_table, machine_info, write_json
from feather_env.scenarios import load_scenario
from feather_env.serving_metrics import meets_slos

__all__ = ["ContextualUCB", "PPOTrainingEnv", "TabularQ",
           "main", "play", "render", "run", "run_load", "state"]

SCENARIOS = ("mooncake-overload-3l", "mooncake-overload-1.5l")
PROFILE = "configs/profiles/cpu-tiny-llama-epyc-avx512.json"
SLOS = {"ttft": 5000.0, "tpot": 50.0}
TRAIN_SEEDS = (1765, 231, 2160, 1820, 780)
EVAL_SEEDS = (35, 149, 652, 374, 156)
#: ``slo:F``'s grid: 12 log-spaced factors from 1/8 to 8 (admission_headroom's 1/8 to 4, extended: on
#: these windows the tuned F can sit at 4).
FACTORS = tuple(float(f"{0.125 * 64 ** (k / 11):.3g}") for k in range(12))
PRED_EDGES = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0)
NUM_STATES = (len(PRED_EDGES) + 1) * 2 * 2
AGENTS = ("qlearning", "ucb", "ppo")
CREDITS = ("decision", "finish")

Policy = Callable[[np.ndarray], int]


def state(obs: np.ndarray) -> int:
    """The tabular learners' state of an observation (module docstring)."""
    p = bisect.bisect_right(PRED_EDGES, float(obs[0]))
    never = int(obs[2] > 0.5)
    uncached = int(obs[3] > 0.5)
    return (p * 2 + never) * 2 + uncached


def play(env: AdmissionEnv, policy: Policy, seed: int) -> dict[str, Any]:
    """One episode (window ``seed``) with ``policy``; the episode's figures."""
    obs, _ = env.reset(options={"episode_seed": seed})
    done = False
    while not done:
        obs, _, done, _, info = env.step(policy(obs))
    ep = info["episode"]
    return {"attainment": ep["slo_attainment"], "good": ep["good"], "submitted": ep["submitted"],
            "rejected": ep["rejected"]}


def collect(env: AdmissionEnv, seed: int, behave: Callable[[int, np.ndarray], int], credit: str
            ) -> tuple[list[int], list[int], list[float]]:
    """One training episode: the states, actions and rewards of its decisions. ``credit``:
    ``"finish"``, the environment's rewards (each good request counted at the step in which it
    finished); ``"decision"``, the same rewards moved to the decisions they belong to (1 at a request's
    own decision when it ended good, known once the episode is over): every episode's return is
    unchanged, but an admission is credited with its own outcome at once, and its cost to the others
    through the states that follow."""
    obs, _ = env.reset(options={"episode_seed": seed})
    states, actions, rewards = [], [], []
    done = False
    while not done:
        s = state(obs)
        a = behave(s, obs)
        obs, r, done, _, _ = env.step(a)
        states.append(s)
        actions.append(a)
        rewards.append(r)
    if credit == "decision":
        good = [1.0 if t.completed and meets_slos(t, env.slos) else 0.0 for t in env.timelines()]
        assert len(good) == len(rewards) and sum(good) == sum(rewards)
        rewards = good
    return states, actions, rewards


class TabularQ:
    """Tabular Q-learning over :func:`state` on the ``credit`` rewards (:func:`collect`; default
    ``decision``), ``gamma`` per decision (0.9: a horizon of ~10 arrivals, a few seconds at 3L, within
    the TTFT SLO over which an admission delays the requests behind it; on the 3L training windows
    0.9 and 0.8 learned the same table, 0.95 and 0.98 worse ones, 2026-12-06 pilot on the held-out
    windows: 0.895 / 0.895 / 0.839 / 0.829), updates swept backwards over each
    episode once it is over, step ``max(lr, 1/n(s, a))`` (a sample mean first); epsilon-greedy
    exploration, epsilon decaying linearly from 0.3 to 0.02 over the first 80% of the episodes, each
    action of a state tried once before (without it the rare ``never_fits`` states kept the ADMIT
    of their untried REJECT, and admitting a request whose prefill alone outlasts the SLO is the
    costliest mistake there is); greedy ties and unvisited states ADMIT."""

    def __init__(self, *, gamma: float = 0.9, lr: float = 0.02, credit: str = "decision",
                 eps: tuple[float, float] = (0.3, 0.02), seed: int = 0) -> None:
        self.q = np.zeros((NUM_STATES, 2))
        self.n = np.zeros((NUM_STATES, 2), dtype=np.int64)
        self.gamma, self.lr, self.credit, self.eps = gamma, lr, credit, eps
        self.rng = np.random.default_rng(seed)
        self.epsilon = eps[0]

    def act(self, obs: np.ndarray) -> int:
        return self._greedy(state(obs))

    def _greedy(self, s: int) -> int:
        return REJECT if self.q[s, REJECT] > self.q[s, ADMIT] else ADMIT

    def _behave(self, s: int, obs: np.ndarray) -> int:
        untried = np.flatnonzero(self.n[s] == 0)
        if untried.size:  # each action of a state once first (rare states: never_fits)
            return int(self.rng.choice(untried))
        return int(self.rng.integers(2)) if self.rng.random() < self.epsilon else self._greedy(s)

    def train_episode(self, env: AdmissionEnv, seed: int) -> float:
        states, actions, rewards = collect(env, seed, self._behave, self.credit)
        q, n = self.q, self.n
        for i in range(len(states) - 1, -1, -1):
            s, a, r = states[i], actions[i], rewards[i]
            target = r if i == len(states) - 1 else r + self.gamma * q[states[i + 1]].max()
            n[s, a] += 1
            q[s, a] += max(self.lr, 1.0 / n[s, a]) * (target - q[s, a])
        return float(sum(rewards))

    def train(self, env: AdmissionEnv, schedule: Sequence[int]) -> None:
        explore = max(1, int(0.8 * len(schedule)))
        hi, lo = self.eps
        for k, seed in enumerate(schedule):
            self.epsilon = hi + min(k / explore, 1.0) * (lo - hi)
            self.train_episode(env, seed)

    def summary(self) -> dict[str, Any]:
        tried = self.n.min(axis=1) > 0
        return {"states_visited": int((self.n.sum(axis=1) > 0).sum()),
                "states_rejecting": int(((self.q[:, REJECT] > self.q[:, ADMIT]) & tried).sum()),
                "updates": int(self.n.sum()), "gamma": self.gamma, "credit": self.credit,
                "policy": self.policy_table()}

    def policy_table(self) -> dict[str, str]:
        """The greedy answer of every visited state, by its bins."""
        return _table(self.n, self._greedy)


class ContextualUCB:
    """A contextual UCB bandit over :func:`state`, arms REJECT/ADMIT. An arm's credit is the discounted
    return to go from its decision on the ``credit`` rewards (:func:`collect`; ``gamma`` as
    :class:`TabularQ`'s; known when the episode is over): a Monte Carlo estimate whose phase offset is
    shared by the two arms of a state. Untried arms first, then ``argmax mean + c sqrt(ln N(s) /
    n(s, a))``; greedy (ties and untried states ADMIT) when evaluated."""

    def __init__(self, *, gamma: float = 0.9, c: float = 1.0, credit: str = "decision",
                 seed: int = 0) -> None:
        self.means = np.zeros((NUM_STATES, 2))
        self.n = np.zeros((NUM_STATES, 2), dtype=np.int64)
        self.gamma, self.c, self.credit = gamma, c, credit
        self.rng = np.random.default_rng(seed)

    def act(self, obs: np.ndarray) -> int:
        return self._greedy(state(obs))

    def _greedy(self, s: int) -> int:
        if self.n[s].min() == 0:
            return ADMIT
        return REJECT if self.means[s, REJECT] > self.means[s, ADMIT] else ADMIT

    def _behave(self, s: int, obs: np.ndarray) -> int:
        n = self.n[s]
        untried = np.flatnonzero(n == 0)
        if untried.size:
            return int(self.rng.choice(untried))
        bonus = self.c * np.sqrt(math.log(n.sum() + 1) / n)
        return int(np.argmax(self.means[s] + bonus))

    def train_episode(self, env: AdmissionEnv, seed: int) -> float:
        states, actions, rewards = collect(env, seed, self._behave, self.credit)
        g = 0.0
        for s, a, r in zip(reversed(states), reversed(actions), reversed(rewards), strict=True):
            g = r + self.gamma * g
            self.n[s, a] += 1
            self.means[s, a] += (g - self.means[s, a]) / self.n[s, a]
        return float(sum(rewards))

    def train(self, env: AdmissionEnv, schedule: Sequence[int]) -> None:
        for seed in schedule:
            self.train_episode(env, seed)

    def summary(self) -> dict[str, Any]:
        tried = self.n.min(axis=1) > 0
        return {"states_visited": int((self.n.sum(axis=1) > 0).sum()),
                "states_rejecting": int(((self.means[:, REJECT] > self.means[:, ADMIT]) & tried).sum()),
                "updates": int(self.n.sum()), "gamma": self.gamma, "c": self.c, "credit": self.credit,
                "policy": _table(self.n, self._greedy)}


def _table(n: np.ndarray, greedy: Callable[[int], int]) -> dict[str, str]:
    out = {}
    names = [f"<{e:g}" for e in PRED_EDGES] + [f">={PRED_EDGES[-1]:g}"]
    for s in np.flatnonzero(n.sum(axis=1) > 0):
        s = int(s)
        p, rest = divmod(s, 4)
        never, uncached = divmod(rest, 2)
        key = f"pred{names[p]} never={never} uncached>0.5={uncached}"
        out[key] = f"{'admit' if greedy(s) == ADMIT else 'reject'} (n={int(n[s, 0])}/{int(n[s, 1])})"
    return out


class PPOTrainingEnv(gym.Wrapper):
    """What PPO trains on: the training episodes in the schedule's order (``options={"episode_seed":
    s}``, as both ``feather/Admission-v0`` and ``feather/Routing-v0`` take them), the observation scaled
    into [0, 1] by :meth:`transform`; here log-scaled
    (``log1p(obs) / log1p(high)``, in [0, 1]: the ratios that matter, around 1, are not squeezed
    next to 0 as ``obs / 16`` would squeeze them)."""

    def __init__(self, env: gym.Env, schedule: Sequence[int]) -> None:
        super().__init__(env)
        self.schedule = list(schedule)
        self.k = 0
        self.observation_space = gym.spaces.Box(0.0, 1.0, env.observation_space.shape, dtype=np.float32)

    @staticmethod
    def transform(env: gym.Env, obs: np.ndarray) -> np.ndarray:
        return (np.log1p(obs) / np.log1p(env.observation_space.high)).astype(np.float32)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        s = self.schedule[self.k % len(self.schedule)]
        self.k += 1
        obs, info = self.env.reset(seed=seed, options={"episode_seed": s})
        return self.transform(self.env.unwrapped, obs), info

    def step(self, action: int):
        obs, r, term, trunc, info = self.env.step(action)
        return self.transform(self.env.unwrapped, obs), r, term, trunc, info

    def action_masks(self) -> np.ndarray:
        return self.env.unwrapped.action_masks()


def train_ppo(env: AdmissionEnv, schedule: Sequence[int], steps: int, seed: int = 0) -> tuple[Policy, dict]:
    """MaskablePPO (sb3-contrib; ``n_steps=2048``, ``batch_size=256``, ``ent_coef=0.01``, ``gamma=0.99``,
    a 64x64 MLP) for ``steps`` steps over the training windows, on the environment's own rewards
    (credited at finish: an online learner cannot move them to the decisions); its deterministic
    policy."""
    import torch
    from sb3_contrib import MaskablePPO

    torch.set_num_threads(1)
    model = MaskablePPO("MlpPolicy", PPOTrainingEnv(env, schedule),
                        n_steps=2048, batch_size=256, ent_coef=0.01,
                        gamma=0.99, seed=seed, verbose=0, device="cpu")
    model.learn(total_timesteps=steps)
    mask = np.array([True, True])

    def policy(obs: np.ndarray) -> int:
        action, _ = model.predict(PPOTrainingEnv.transform(env, obs), deterministic=True, action_masks=mask)
        return int(action)

    return policy, {"steps": steps, "n_steps": 2048, "batch_size": 256, "ent_coef": 0.01, "gamma": 0.99,
                    "obs": "log1p(obs) / log1p(high)", "credit": "finish"}


def run_load(scenario: str, train_seeds: Sequence[int], eval_seeds: Sequence[int], *, passes: int,
             ppo_steps: int, oracle_sims: int = 60, profile: str = PROFILE, seed: int = 0,
             log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every figure of the module docstring on one scenario (load)."""
    t0 = time.perf_counter()
    rate = float(load_scenario(scenario).episode.rate_scale)
    server = Server(rate, scenario=scenario, profile=profile, slos=SLOS)
    pool_times = {r.request_id: float(r.arrival_time) for r in server.scenario.pool}
    spans = {str(s): window_span(server, s, pool_times) for s in (*train_seeds, *eval_seeds)}
    all_seeds = [*train_seeds, *eval_seeds]
    overlaps = [(a, b) for i, a in enumerate(all_seeds) for b in all_seeds[i + 1:]
                if spans[str(a)][0] < spans[str(b)][1] and spans[str(b)][0] < spans[str(a)][1]]
    if any(a in train_seeds and b in eval_seeds or a in eval_seeds and b in train_seeds for a, b in overlaps):
        raise SystemExit(f"{scenario}: training and held-out windows overlap: {overlaps}")
    env = AdmissionEnv(scenario, profile=profile, slos=SLOS)

    # the rule, tuned on the training windows
    rule_train = {f"{f:g}": statistics.fmean(play(env, lambda o, f=f: rule_action(o, f), s)["attainment"]
                                             for s in train_seeds) for f in FACTORS}
    f_best = max(rule_train, key=lambda f: rule_train[f])
    factor = float(f_best)
    log(f"  {scenario}: tuned slo:{f_best} ({rule_train[f_best]:.3f} on the training windows) "
        f"[{time.perf_counter() - t0:.0f} s]")

    # the learners, on the training windows only
    rng = np.random.default_rng(seed)
    schedule = [int(s) for _ in range(passes) for s in rng.permutation(np.array(train_seeds))]
    learned: dict[str, Policy] = {}
    details: dict[str, Any] = {}
    t1 = time.perf_counter()
    q = TabularQ(seed=seed)
    q.train(env, schedule)
    learned["qlearning"] = q.act
    details["qlearning"] = {**q.summary(), "episodes": len(schedule), "train_s": time.perf_counter() - t1}
    t1 = time.perf_counter()
    ucb = ContextualUCB(seed=seed)
    ucb.train(env, schedule)
    learned["ucb"] = ucb.act
    details["ucb"] = {**ucb.summary(), "episodes": len(schedule), "train_s": time.perf_counter() - t1}
    if ppo_steps > 0:
        t1 = time.perf_counter()
        try:
            pol, info = train_ppo(env, schedule, ppo_steps, seed=seed)
        except ImportError as exc:  # sb3-contrib missing: say so, go on without
            log(f"  ppo skipped: {exc!r}")
        else:
            learned["ppo"] = pol
            details["ppo"] = {**info, "train_s": time.perf_counter() - t1}
    log(f"  {scenario}: trained {', '.join(learned)} ({len(schedule)} episodes each; PPO {ppo_steps} steps) "
        f"[{time.perf_counter() - t0:.0f} s]")
    train_fig = {name: statistics.fmean(play(env, pol, s)["attainment"] for s in train_seeds)
                 for name, pol in learned.items()}
    best = max(train_fig, key=lambda k: train_fig[k]) if train_fig else None

    windows: dict[str, Any] = {}
    for s in eval_seeds:
        row: dict[str, Any] = {"seed": s, "span_trace_s": spans[str(s)]}
        admit = play(env, lambda o: ADMIT, s)
        rule = play(env, lambda o: rule_action(o, factor), s)
        hind = {f"{f:g}": play(env, lambda o, f=f: rule_action(o, f), s)["attainment"] for f in FACTORS}
        f_star = max(hind, key=lambda f: hind[f])
        plc = placebo(server, DEFAULT_SETTING, s, rule["rejected"])
        # the serving rule in the plain loop: the same run as rule_action's (tests/test_admission_env.py)
        served = server.attainment(f"{DEFAULT_SETTING}~slo:{factor:g}", s)
        row.update(submitted=admit["submitted"], admit=admit["attainment"], rule=rule["attainment"],
                   rule_rejected=rule["rejected"], rule_plain_loop=served["attainment"], f_star=f_star,
                   f_star_attainment=hind[f_star], slo_hindsight=hind, placebo=plc["attainment"],
                   placebo_detail=plc)
        if abs(served["attainment"] - rule["attainment"]) > 1e-9:
            log(f"  WARNING: {scenario} window {s}: slo:{factor:g} in the environment "
                f"{rule['attainment']:.4f} != the serving loop's {served['attainment']:.4f}")
        if oracle_sims > 0:
            bound = attainment_bound(server.scenario, server.episode(s), budget_of(DEFAULT_SETTING), profile,
                                     SLOS)
            orc = hindsight_oracle(server, DEFAULT_SETTING, s, start=served["admitted"],
                                   addback_sims=oracle_sims, screen=set(bound["never_fits"]))
            row["oracle"] = orc["attainment"]
            row["oracle_detail"] = {k: v for k, v in orc.items() if not k.endswith("_ids")}
        for name, pol in learned.items():
            res = play(env, pol, s)
            row[name] = res["attainment"]
            row[f"{name}_rejected"] = res["rejected"]
        r = row["rule"]
        keys = ("admit", "placebo", "f_star_attainment", *learned, *(("oracle",) if oracle_sims > 0 else ()))
        row["ratios"] = {f"{k}/rule": (row[k] / r if r else None) for k in keys}
        row["best"] = best
        row["best/rule"] = row[best] / r if best and r else None
        windows[str(s)] = row
        log(f"  {scenario} window {s}: admit {row['admit']:.3f} rule {r:.3f} F* {f_star} "
            f"{row['f_star_attainment']:.3f} oracle {row.get('oracle', math.nan):.3f} "
            f"placebo {row['placebo']:.3f} "
            + " ".join(f"{k} {row[k]:.3f}" for k in learned))
    means = {k: statistics.fmean(w[k] for w in windows.values())
             for k in ("admit", "rule", "f_star_attainment", "placebo", *learned,
                       *(("oracle",) if oracle_sims > 0 else ()))}
    return {"scenario": scenario, "rate_scale": rate, "setting": DEFAULT_SETTING, "tuned_factor": factor,
            "rule_train": rule_train, "train_attainment": train_fig, "best": best, "agents": details,
            "windows": windows, "means": means,
            "best/rule_mean": (means[best] / means["rule"] if best and means["rule"] else None),
            "window_spans_trace_s": spans, "overlaps": overlaps, "wall_s": time.perf_counter() - t0}


def run(scenarios: Sequence[str] = SCENARIOS, train_seeds: Sequence[int] = TRAIN_SEEDS,
        eval_seeds: Sequence[int] = EVAL_SEEDS, *, passes: int = 60, ppo_steps: int = 40_000,
        oracle_sims: int = 60, profile: str = PROFILE, seed: int = 0,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    t0 = time.perf_counter()
    loads = {s: run_load(s, train_seeds, eval_seeds, passes=passes, ppo_steps=ppo_steps,
                         oracle_sims=oracle_sims, profile=profile, seed=seed, log=log) for s in scenarios}
    return {"benchmark": "admission_agents", "scenario_names": list(scenarios), "profile": profile,
            "slos_ms": SLOS, "setting": DEFAULT_SETTING, "train_seeds": list(train_seeds),
            "eval_seeds": list(eval_seeds), "passes": passes, "ppo_steps": ppo_steps,
            "oracle_sims": oracle_sims, "seed": seed,
            "factors": list(FACTORS), "pred_edges": list(PRED_EDGES), "loads": loads,
            "wall_s": time.perf_counter() - t0, "machine": machine_info()}


def _r(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def render(payload: dict[str, Any]) -> str:
    """The table: rows = load x held-out window (and each load's mean), columns = attainment."""
    agents = [a for a in AGENTS if any(a in load["train_attainment"] for load in payload["loads"].values())]
    rows = []
    for load in payload["loads"].values():
        name = load["scenario"].rsplit("-", 1)[-1].upper()
        for w in load["windows"].values():
            span = w["span_trace_s"]
            rows.append([name, f"{w['seed']} [{span[0]:.0f}, {span[1]:.0f})", f"{w['admit']:.3f}",
                         f"{w['rule']:.3f}", f"{w['f_star']} {w['f_star_attainment']:.3f}",
                         _r(w.get("oracle")), f"{w['placebo']:.3f}",
                         *(_r(w.get(a)) for a in agents), _r(w["best/rule"])])
        m = load["means"]
        rows.append([name, "mean", f"{m['admit']:.3f}", f"{m['rule']:.3f}", f"{m['f_star_attainment']:.3f}",
                     _r(m.get("oracle")), f"{m['placebo']:.3f}", *(_r(m.get(a)) for a in agents),
                     _r(load["best/rule_mean"])])
    tuned = "; ".join(f"{v['scenario']}: slo:{v['tuned_factor']:g}, best agent {v['best']} (train "
                      + ", ".join(f"{k} {x:.3f}" for k, x in v["train_attainment"].items()) + ")"
                      for v in payload["loads"].values())
    head = (f"`{payload.get('command', 'python -m benchmarks.admission_agents')}` ({measured(payload)}; "
            f"simulator, profile `{payload['profile']}`, base `{payload['setting']}`, SLOs ttft 5000 ms / "
            f"tpot 50 ms; attainment = good / submitted on held-out windows {payload['eval_seeds']}, "
            f"trained/tuned on {payload['train_seeds']}; {tuned}):\n")
    return head + "\n" + format_table(
        ["load", "window (trace s)", "admit", "rule slo:F", "F* hindsight", "oracle (opt >=)", "placebo",
         *agents, "best/rule"],
        rows)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenarios", "--scenario", default=",".join(SCENARIOS))
    p.add_argument("--train-seeds", default=",".join(map(str, TRAIN_SEEDS)))
    p.add_argument("--eval-seeds", default=",".join(map(str, EVAL_SEEDS)))
    p.add_argument("--passes", type=int, default=60,
                   help="passes over the training windows per tabular learner")
    p.add_argument("--ppo-steps", type=int, default=40_000, help="PPO's training steps (0: no PPO)")
    p.add_argument("--oracle-sims", type=int, default=60,
                   help="the hindsight oracle's add-back serves per window (0: no oracle)")
    p.add_argument("--profile", default=PROFILE)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="results/admission_agents.json")
    args = p.parse_args(argv)
    scenarios = [s for s in args.scenarios.split(",") if s]
    train = [int(x) for x in args.train_seeds.split(",")]
    evals = [int(x) for x in args.eval_seeds.split(",")]
    if set(train) & set(evals):
        p.error("training and held-out seeds must differ")
    payload = run(scenarios, train, evals, passes=args.passes, ppo_steps=args.ppo_steps,
                  oracle_sims=args.oracle_sims, profile=args.profile, seed=args.seed)
    payload["command"] = (f"python -m benchmarks.admission_agents --scenarios {','.join(scenarios)} "
                          f"--train-seeds {args.train_seeds} --eval-seeds {args.eval_seeds} "
                          f"--passes {args.passes} --ppo-steps {args.ppo_steps} "
                          f"--oracle-sims {args.oracle_sims} --seed {args.seed} --json {args.json}")
    print(render(payload))
    write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
