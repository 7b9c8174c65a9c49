"""Agents trained on the routing decision (``feather/Routing-v0``) against ours and the best tuned rule.

    python -m benchmarks.routing_agents [--fleet speed] [--load 0.8] [--train-seeds 10000,10001,10002]
                                        [--eval-seeds 0,1,2] [--agents bandit,imitation,ppo]
                                        [--ppo-steps 20000] [--bandit-pulls 48]
                                        [--headroom results/routing_headroom.json]
                                        [--json results/routing_agents.json]

The cell is :mod:`benchmarks.routing_headroom`'s (default: the ``speed`` fleet, 8 replicas, load 0.8,
L-Eval, SLO TTFT <= 5 s and TPOT <= 50 ms). The learners train on the tuning seeds' episodes
(10,000-10,002: documents and arrivals of their own, those the peers were tuned on) and are evaluated
greedily on the held-out seeds (0-2: the evaluation's documents, its arrivals), no learning there.
Every figure is SLO attainment (good requests over submitted):

- ``prefix-learned``: ours, the environment's advisor (:func:`~feather_env.routing_env.rule_action`:
  identical to ``ClusterSim.run`` with it, ``tests/test_routing_env.py``);
- ``best rule``: :mod:`benchmarks.routing_headroom`'s best deployable router on the same held-out
  seeds (ours and every peer, tuned where tuning moved it; chosen there in hindsight), read from
  ``--headroom`` (its per-seed figures; run again here when that file lacks the cell);
- ``ppo``: MaskablePPO (sb3-contrib; every replica always valid, so it is PPO) on the observation over
  its highs (in [0, 1]) and the environment's own rewards (credited at finish), ``--ppo-steps``
  steps over the training episodes in turn; ``n_steps=1024``, ``batch_size=256``, ``ent_coef=0.01``,
  ``gamma=0.99``, a 64x64 MLP; its deterministic policy. Warm-started (``--ppo-cold`` not): its policy
  is first cloned from ours' decisions on the training episodes (:func:`clone_ours`), then fine-tuned
  with learning rate 1e-4 and clip 0.1 (cold, 20,000 steps from a random policy, it held 14.5% on the
  held-out seeds against ours' 70.3%: 2026-12-06, the first run of this script);
- ``bandit``: UCB1 over the parameters of a scoring rule (:class:`ScoreRule`: per replica
  ``w_prefix x prefix + w_rule x rule - (in flight + 1) / prefill_speed ** alpha``, the load over the
  fleet's mean, on the environment's observation: the learned speeds, never the true ones), one arm
  per setting of :data:`ARMS` (16), one training episode per pull (``--bandit-pulls``; an arm's own
  pulls go through the training seeds in turn), reward the episode's attainment over ours' on the same
  episode; greedy: the arm of the highest mean;
- ``imitation`` (``--agents imitation``): the lookahead oracle distilled (:class:`Imitation`): the
  oracle of :mod:`benchmarks.routing_headroom` (same horizon and candidates) is run on the *training*
  seeds, recording at each arrival where it searched the features of each candidate it could have
  moved to (its row of the observation minus ours' choice's row, and the request's two) and whether it
  did; a logistic regression (L2, numpy) learns to predict a move; the policy, on what a router can
  see (the candidates named from the observation: ours' choice, the replica of least ``(in flight + 1)
  / learned prefill speed``, the owner of the longest known prefix), moves off ours' choice to the
  candidate of highest predicted probability when it is over a threshold, chosen of
  ``--imitation-thresholds`` (0.5, 0.3, 0.2, 0.1: moves are about 10% of the examples) by mean
  attainment on the training seeds;
- with the imitation on two training seeds or more, how predictable the oracle's moves are from what a
  router sees (:func:`move_predictability`): each training seed held out in turn, the imitation's
  logistic regression and a 64x64 MLP fitted on the others' examples, their AUC on its examples, and the
  oracle's attainment over ours' on the training seeds: whether the oracle's headroom is one a router
  could learn, or comes from the arrivals it looks ahead at;
- ``placebo``: ours, moving off ours' choice as often as the best learned agent that moves at all
  did on the held-out seeds (its share of decisions), at random decisions, to a random other observed
  candidate (:func:`random_moves`; median of 3 draws): whether *which* moves the agent makes matters,
  or only how many.

The best learned agent is the one of the highest mean attainment on the *training* seeds (greedy).

Reported per agent: held-out attainment per seed, the ratio to ours and to the best rule (median over
the seeds of the per-seed ratio, with its range), its training cost (wall seconds, steps or pulls).
A learned router is exported for ``feather-serve --router`` only where it beats ours beyond noise by
>= 1.03x (the issue's rule); the JSON says by how much each falls short.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np

from benchmarks import measured
from benchmarks.admission_agents import PPOTrainingEnv
from feather_env.reporting import format_table, machine_info, write_json
from feather_env.routing_env import FEATURES, RoutingEnv, rule_action

__all__ = ["ARMS", "ScoreRule", "UCBRules", "auc", "main", "move_predictability", "play", "render", "run",
           "train_ppo"]

Policy = Callable[[np.ndarray], int]
TRAIN_SEEDS = (10_000, 10_001, 10_002)
EVAL_SEEDS = (0, 1, 2)
SHIP_RATIO = 1.03


@dataclass(frozen=True)
class ScoreRule:
    """Route to the replica of the highest ``w_prefix x prefix + w_rule x rule - load / speed ** alpha``
    (``load``: its requests in flight plus one over the fleet's mean of the same; ``speed``: its learned
    prefill speed over the fleet's median, as observed). With ``w_rule`` 0 and ``alpha`` 0, prefix
    affinity bounded by load counted in requests; ``alpha`` 1 divides the load by the learned speed."""

    w_prefix: float
    w_rule: float
    alpha: float

    def scores(self, obs: np.ndarray, n: int, seqs: int, speed: np.ndarray | None = None) -> np.ndarray:
        """Each of the ``n`` replicas' score (``seqs``: the engine's max_num_seqs, the unit of
        ``in_flight``; ``speed``: prefill speeds to use instead of the observed ones)."""
        rows = obs[:n * len(FEATURES)].reshape(n, len(FEATURES)).astype(np.float64)
        load = rows[:, FEATURES.index("in_flight")] + 1.0 / seqs  # requests in flight + 1
        load = load / load.mean()
        s = rows[:, FEATURES.index("prefill_speed")] if speed is None else speed
        s = np.maximum(s, 0.05) ** self.alpha
        prefix, rule = rows[:, FEATURES.index("prefix")], rows[:, FEATURES.index("rule")]
        return self.w_prefix * prefix + self.w_rule * rule - load / s

    def act(self, obs: np.ndarray, env: RoutingEnv) -> int:
        return int(np.argmax(self.scores(obs, env.n, env.max_num_seqs)))

    def knobs(self) -> dict[str, float]:
        return {"w_prefix": self.w_prefix, "w_rule": self.w_rule, "alpha": self.alpha}


#: The bandit's arms: 4 x 2 x 2 settings.
ARMS = tuple(ScoreRule(p, r, a)
             for p, r, a in itertools.product((0.5, 1.0, 2.0, 4.0), (0.0, 0.5), (0.0, 1.0)))


def play(env: RoutingEnv, policy: Policy, seed: int) -> dict[str, Any]:
    """One episode (``seed``) with ``policy``; its figures."""
    obs, _ = env.reset(options={"episode_seed": seed})
    done, info, ret, moves = False, {}, 0.0, 0
    while not done:
        a = policy(obs)
        moves += a != env.rule
        obs, r, done, _, info = env.step(a)
        ret += r
    ep = info["episode"]
    return {"attainment": ep["attainment"], "good": ep["good"], "return": ret, "moves_off_ours": int(moves),
            "decisions": ep["requests"], "output_throughput": ep["output_throughput"],
            "requests_per_replica": ep["requests_per_replica"]}


def random_moves(env: RoutingEnv, rate: float, seed: int, draw: int = 0) -> dict[str, Any]:
    """The placebo: ours, except that at each decision, with probability ``rate``, the request goes to one
    of the other observed candidates (:func:`observed_candidates`) drawn at random."""
    rng = np.random.default_rng(1_000 * seed + draw)

    def policy(obs: np.ndarray) -> int:
        cands = observed_candidates(obs, env.n, env.max_num_seqs)
        if len(cands) > 1 and rng.random() < rate:
            return cands[1 + int(rng.integers(len(cands) - 1))]
        return cands[0]

    return play(env, policy, seed)


class UCBRules:
    """UCB1 over :data:`ARMS` (each pull: one training episode, reward its attainment over ours' on the
    same episode): every arm once, then ``argmax mean + c sqrt(2 ln N / n)``. An arm's ``k``-th pull plays
    the ``k``-th training seed (in turn). The reward is relative because the seeds' attainment differs
    far more (33%, 88%, 54% for ours) than the arms': with the plain attainment (the first runs of this
    script), an arm's mean was mostly which seeds it had drawn, and an arm pulled once on the hardest
    seed was never tried again."""

    def __init__(self, arms: Sequence[ScoreRule] = ARMS, c: float = 0.1) -> None:
        self.arms = list(arms)
        self.c = c
        self.n = np.zeros(len(self.arms), dtype=np.int64)
        self.means = np.zeros(len(self.arms))
        self.log: list[dict[str, Any]] = []
        self.ours: dict[int, float] = {}

    def train(self, env: RoutingEnv, seeds: Sequence[int], pulls: int) -> None:
        for _ in range(pulls):
            untried = np.flatnonzero(self.n == 0)
            if untried.size:
                i = int(untried[0])
            else:
                bonus = self.c * np.sqrt(2 * math.log(self.n.sum()) / self.n)
                i = int(np.argmax(self.means + bonus))
            seed = seeds[int(self.n[i]) % len(seeds)]  # an arm's own pulls go through the seeds in turn
            arm = self.arms[i]
            r = play(env, lambda o, arm=arm: arm.act(o, env), seed)["attainment"] / self._ours(env, seed)
            self.n[i] += 1
            self.means[i] += (r - self.means[i]) / self.n[i]
            self.log.append({"arm": i, "seed": seed, "attainment": r})

    def _ours(self, env: RoutingEnv, seed: int) -> float:
        """Ours' attainment on training episode ``seed`` (the reward's unit), played once."""
        if seed not in self.ours:
            self.ours[seed] = play(env, lambda o: rule_action(o, env.n), seed)["attainment"]
        return self.ours[seed]

    def best(self) -> ScoreRule:
        return self.arms[int(np.argmax(np.where(self.n > 0, self.means, -np.inf)))]

    def summary(self) -> dict[str, Any]:
        return {"arms": [{**a.knobs(), "pulls": int(n), "mean_over_ours": float(m)}
                         for a, n, m in zip(self.arms, self.n, self.means, strict=True)],
                "best": self.best().knobs(), "c": self.c, "ours_train_attainment": self.ours}


#: The per-candidate features of the imitation (rows of the observation, minus ours' choice's row).
IMITATION_FEATURES = ("prefix", "in_flight", "queued_tokens", "prefill_speed", "decode_speed", "kv_usage")


def _rows(obs: np.ndarray, n: int) -> np.ndarray:
    return obs[:n * len(FEATURES)].reshape(n, len(FEATURES)).astype(np.float64)


def move_features(obs: np.ndarray, n: int, rule: int, cand: int) -> np.ndarray:
    """What the imitation predicts a move from ours' choice ``rule`` to ``cand`` with."""
    rows = _rows(obs, n)
    cols = [FEATURES.index(f) for f in IMITATION_FEATURES]
    diff = rows[cand, cols] - rows[rule, cols]
    g = obs[n * len(FEATURES):].astype(np.float64)
    return np.concatenate([diff, rows[cand, cols], g, [1.0]])


def observed_candidates(obs: np.ndarray, n: int, seqs: int) -> list[int]:
    """A router's candidates from the observation alone: ours' choice, the replica of least
    ``(in flight + 1) / learned prefill speed``, the owner of the longest known prefix."""
    rows = _rows(obs, n)
    rule = int(np.argmax(rows[:, FEATURES.index("rule")]))
    out = [rule]
    speed = np.maximum(rows[:, FEATURES.index("prefill_speed")], 0.05)
    cost = (rows[:, FEATURES.index("in_flight")] + 1.0 / seqs) / speed
    for i in np.argsort(cost, kind="stable"):
        if int(i) not in out:
            out.append(int(i))
            break
    prefix = rows[:, FEATURES.index("prefix")]
    owner = int(np.argmax(prefix))
    if prefix[owner] > 0 and owner not in out:
        out.append(owner)
    return out


class Imitation:
    """The lookahead oracle distilled into a move-or-not classifier (module docstring)."""

    def __init__(self, threshold: float = 0.5, l2: float = 1e-2) -> None:
        self.threshold, self.l2 = threshold, l2
        self.w: np.ndarray | None = None
        self.mean: np.ndarray | None = None
        self.scale: np.ndarray | None = None
        self.examples = 0
        self.moves = 0

    def collect(self, env: RoutingEnv, seed: int, horizon: int, others: int,
                log: Callable[[str], None] | None = None) -> tuple[list[np.ndarray], list[float], float]:
        """The oracle on training episode ``seed``: its move examples and its attainment."""
        from benchmarks.routing_headroom import candidates, lookahead_score

        obs, _ = env.reset(options={"episode_seed": seed})
        xs: list[np.ndarray] = []
        ys: list[float] = []
        done, info = False, {}
        while not done:
            cands = candidates(env, others)
            best = cands[0]
            if len(cands) > 1:
                scores = {c: lookahead_score(env, c, horizon) for c in cands}
                top = max(scores.values())
                best = cands[0] if scores[cands[0]] == top else next(c for c in cands if scores[c] == top)
                for c in cands[1:]:
                    xs.append(move_features(obs, env.n, cands[0], c))
                    ys.append(1.0 if c == best else 0.0)
            obs, _, done, _, info = env.step(best)
        if log:
            log(f"    imitation: oracle on training seed {seed}: {info['episode']['attainment']:.3f}, "
                f"{int(sum(ys))} moves of {len(ys)} examples")
        return xs, ys, info["episode"]["attainment"]

    def fit(self, xs: Sequence[np.ndarray], ys: Sequence[float], iters: int = 300) -> None:
        """L2 logistic regression by Newton's method on standardized features."""
        x = np.array(xs)
        y = np.array(ys)
        self.mean = x.mean(axis=0)
        self.scale = x.std(axis=0)
        self.mean[-1], self.scale[-1] = 0.0, 1.0  # the bias column
        self.scale[self.scale == 0] = 1.0
        z = (x - self.mean) / self.scale
        w = np.zeros(z.shape[1])
        reg = self.l2 * np.eye(z.shape[1])
        reg[-1, -1] = 0.0
        for _ in range(iters):
            p = 1.0 / (1.0 + np.exp(-z @ w))
            grad = z.T @ (p - y) / len(y) + reg @ w
            hess = (z * (p * (1 - p))[:, None]).T @ z / len(y) + reg + 1e-9 * np.eye(len(w))
            step = np.linalg.solve(hess, grad)
            w -= step
            if np.abs(step).max() < 1e-8:
                break
        self.w = w
        self.examples, self.moves = len(y), int(y.sum())

    def prob(self, x: np.ndarray) -> float:
        assert self.w is not None and self.mean is not None and self.scale is not None
        return float(1.0 / (1.0 + np.exp(-((x - self.mean) / self.scale) @ self.w)))

    def act(self, obs: np.ndarray, env: RoutingEnv) -> int:
        cands = observed_candidates(obs, env.n, env.max_num_seqs)
        rule = cands[0]
        best, p_best = rule, self.threshold
        for c in cands[1:]:
            p = self.prob(move_features(obs, env.n, rule, c))
            if p > p_best:
                best, p_best = c, p
        return best

    def summary(self) -> dict[str, Any]:
        names = ([f"d_{f}" for f in IMITATION_FEATURES] + list(IMITATION_FEATURES)
                 + ["prompt_tokens", "fleet_in_flight", "bias"])
        return {"threshold": self.threshold, "l2": self.l2, "examples": self.examples, "moves": self.moves,
                "weights": dict(zip(names, map(float, self.w if self.w is not None else []), strict=False))}


def auc(scores: Sequence[float], labels: Sequence[float]) -> float:
    """The area under the ROC curve of ``scores`` for binary ``labels`` (the chance that a positive
    scores above a negative, ties half): 0.5 is chance; ``nan`` without both classes."""
    s, y = np.asarray(scores, dtype=np.float64), np.asarray(labels) > 0.5
    pos, neg = int(y.sum()), int((~y).sum())
    if not pos or not neg:
        return math.nan
    order = np.argsort(s, kind="stable")
    ranks = np.empty(len(s))
    ranks[order] = np.arange(1, len(s) + 1)
    for v in np.unique(s):  # ties share their mean rank
        tied = s == v
        ranks[tied] = ranks[tied].mean()
    return float((ranks[y].sum() - pos * (pos + 1) / 2) / (pos * neg))


def _mlp_scores(x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, epochs: int = 300,
                seed: int = 0) -> np.ndarray:
    """A 64x64 MLP's move probability for ``x_test``, fitted to ``(x_train, y_train)`` (standardized
    features, binary cross-entropy, Adam 1e-3, weight decay 1e-4, full batch)."""
    import torch

    torch.manual_seed(seed)
    mu, sd = x_train.mean(axis=0), x_train.std(axis=0) + 1e-9
    x = torch.as_tensor((x_train - mu) / sd, dtype=torch.float32)
    y = torch.as_tensor(y_train, dtype=torch.float32)
    net = torch.nn.Sequential(torch.nn.Linear(x.shape[1], 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                              torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.Adam(net.parameters(), lr=1e-3, weight_decay=1e-4)
    for _ in range(epochs):
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(net(x).squeeze(1), y)
        loss.backward()
        opt.step()
    with torch.no_grad():
        return torch.sigmoid(net(torch.as_tensor((x_test - mu) / sd, dtype=torch.float32)).squeeze(1)).numpy()


def move_predictability(examples: dict[int, tuple[Sequence[np.ndarray], Sequence[float]]]) -> dict[str, Any]:
    """How well the oracle's moves can be told from what a router sees: for each training seed, the
    imitation's logistic regression and a 64x64 MLP fitted on the other seeds' examples, their AUC on
    that seed's (0.5: chance), and the MLP's precision among its ``k`` most confident examples (``k``:
    the seed's moves; the base rate is the seed's share of moves)."""
    per_seed = {}
    for s, (xs, ys) in examples.items():
        rest = [t for t in examples if t != s]
        x_tr = np.concatenate([np.asarray(examples[t][0]) for t in rest])
        y_tr = np.concatenate([np.asarray(examples[t][1]) for t in rest])
        x_te, y_te = np.asarray(xs), np.asarray(ys)
        logistic = Imitation()
        logistic.fit(list(x_tr), list(y_tr))
        mlp = _mlp_scores(x_tr, y_tr, x_te)
        k = int(y_te.sum())
        top = np.argsort(-mlp, kind="stable")[:k]
        per_seed[str(s)] = {"examples": len(y_te), "moves": k, "base_rate": k / len(y_te),
                            "logistic_auc": auc([logistic.prob(x) for x in x_te], y_te),
                            "mlp_auc": auc(mlp, y_te),
                            "mlp_precision_at_moves": float(y_te[top].mean()) if k else math.nan}
    return {"per_seed": per_seed, **{f"{m}_median": statistics.median(v[m] for v in per_seed.values())
                                      for m in ("logistic_auc", "mlp_auc", "mlp_precision_at_moves",
                                                "base_rate")}}


def _load_examples(path: str | None, seeds: Sequence[int], horizon: int,
                   others: int) -> dict[int, tuple[list[np.ndarray], list[float], float]] | None:
    """The oracle's examples per training seed from ``path`` (an ``.npz`` of :func:`_save_examples`),
    when it holds every seed with this horizon and candidates; else ``None``."""
    if not path:
        return None
    try:
        data = np.load(path)
    except FileNotFoundError:
        return None
    out = {}
    for s in seeds:
        key = f"{s}_{horizon}_{others}"
        if f"x_{key}" not in data:
            return None
        out[s] = (list(data[f"x_{key}"]), list(data[f"y_{key}"]), float(data[f"att_{key}"]))
    return out


def _save_examples(path: str | None, seed: int, xs: Sequence[np.ndarray], ys: Sequence[float], att: float,
                   horizon: int, others: int) -> None:
    if not path:
        return
    try:
        old = dict(np.load(path))
    except FileNotFoundError:
        old = {}
    key = f"{seed}_{horizon}_{others}"
    old.update({f"x_{key}": np.array(xs), f"y_{key}": np.array(ys), f"att_{key}": np.array(att)})
    np.savez(path, **old)


class _PPOEnv(PPOTrainingEnv):
    """What PPO trains on: the training seeds' episodes in turn, the observation over its highs."""

    @staticmethod
    def transform(env: gym.Env, obs: np.ndarray) -> np.ndarray:
        return (obs / env.observation_space.high).astype(np.float32)


def clone_ours(model: Any, env: RoutingEnv, seeds: Sequence[int], updates: int = 2000) -> dict[str, Any]:
    """Behaviour cloning of ours into ``model``'s policy: its decisions on the training episodes, the
    policy's log-likelihood of them maximized (Adam, 1e-3, batches of 256, ``updates`` of them); the
    clone's accuracy on them."""
    import torch

    xs, ys = [], []
    for s in seeds:
        obs, _ = env.reset(options={"episode_seed": s})
        done = False
        while not done:
            a = rule_action(obs, env.n)
            xs.append(_PPOEnv.transform(env, obs))
            ys.append(a)
            obs, _, done, _, _ = env.step(a)
    x, y = torch.as_tensor(np.array(xs)), torch.as_tensor(np.array(ys))
    policy = model.policy
    opt = torch.optim.Adam(policy.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    epochs = max(1, math.ceil(updates / math.ceil(len(x) / 256)))
    for _ in range(epochs):
        perm = torch.randperm(len(x), generator=gen)
        for i in range(0, len(x), 256):
            idx = perm[i:i + 256]
            loss = -policy.get_distribution(x[idx]).log_prob(y[idx]).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():
        pred = policy.get_distribution(x).distribution.probs.argmax(dim=1)
    return {"bc_samples": len(y), "bc_epochs": epochs, "bc_accuracy": float((pred == y).float().mean())}


def train_ppo(env: RoutingEnv, seeds: Sequence[int], steps: int, seed: int = 0,
              warm_start: bool = True) -> tuple[Policy, dict[str, Any]]:
    """MaskablePPO for ``steps`` steps on the training seeds (module docstring), with ``warm_start`` its
    policy first cloned from ours (:func:`clone_ours`) and fine-tuned gently (learning rate 1e-4, clip
    0.1); its deterministic policy."""
    import torch
    from sb3_contrib import MaskablePPO

    torch.set_num_threads(1)
    knobs: dict[str, Any] = {"n_steps": 1024, "batch_size": 256, "ent_coef": 0.01, "gamma": 0.99}
    if warm_start:
        knobs.update(learning_rate=1e-4, clip_range=0.1)
    model = MaskablePPO("MlpPolicy", _PPOEnv(env, seeds), seed=seed, verbose=0, device="cpu", **knobs)
    bc: dict[str, Any] = {}
    if warm_start:
        bc = clone_ours(model, env, seeds)
    model.learn(total_timesteps=steps)
    mask = np.ones(env.n, dtype=bool)

    def policy(obs: np.ndarray) -> int:
        action, _ = model.predict(_PPOEnv.transform(env, obs), deterministic=True, action_masks=mask)
        return int(action)

    return policy, {"steps": steps, **knobs, "obs": "obs / high", "credit": "finish",
                    "warm_start": warm_start, **bc}


def _spread(xs: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def best_rule_rows(path: str | None, fleet: str, load: float,
                   seeds: Sequence[int]) -> tuple[str, list[float]] | None:
    """The best rule's name and per-seed attainment from a :mod:`benchmarks.routing_headroom` JSON."""
    if not path:
        return None
    try:
        with open(path) as f:
            payload = json.load(f)
    except FileNotFoundError:
        return None
    for c in payload.get("cells") or []:
        if c["fleet"] == fleet and c["load"] == load and list(c["seeds"]) == list(seeds):
            name = c["best_rule"]
            return name, [r["attainment"] for r in c["rows"][name]]
    return None


def run(fleet: str = "speed", load: float = 0.8, train_seeds: Sequence[int] = TRAIN_SEEDS,
        eval_seeds: Sequence[int] = EVAL_SEEDS, *, agents: Sequence[str] = ("bandit", "imitation", "ppo"),
        ppo_steps: int = 20_000, bandit_pulls: int = 48,
        imitation_thresholds: Sequence[float] = (0.5, 0.3, 0.2, 0.1), imitation_cache: str | None = None,
        placebo_draws: int = 3,
        horizon: int = 30, others: int = 1, ppo_warm_start: bool = True,
        headroom: str | None = "results/routing_headroom.json",
        seed: int = 0, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every figure of the module docstring on one cell."""
    env = RoutingEnv(fleet, load, episode_seeds=train_seeds)
    n = env.n
    rows: dict[str, list[dict[str, Any]]] = {}
    training: dict[str, Any] = {}
    t0 = time.perf_counter()
    rows["prefix-learned"] = [play(env, lambda o: rule_action(o, n), s) for s in eval_seeds]
    log(f"  ours: {time.perf_counter() - t0:.0f} s")
    best = best_rule_rows(headroom, fleet, load, eval_seeds)
    if best is None:
        from benchmarks.routing_headroom import load_tuning, serve_router
        from benchmarks.unequal_replicas import router_factories

        factories = router_factories(env.specs, env.engine, env.slos,
                                     load_tuning("results/unequal_replicas.json", fleet))
        scored = {name: [serve_router(env, f, s)["attainment"] for s in eval_seeds]
                  for name, f in factories.items() if name not in ("prefix-informed", "prefix-learned-place")}
        name = max(scored, key=lambda k: statistics.fmean(scored[k]))
        best = (name, scored[name])
    best_name, best_att = best
    if "bandit" in agents:
        t0 = time.perf_counter()
        bandit = UCBRules()
        bandit.train(env, train_seeds, bandit_pulls)
        arm = bandit.best()
        training["bandit"] = {**bandit.summary(), "pulls": bandit_pulls, "wall_s": time.perf_counter() - t0}
        log(f"  bandit: {bandit_pulls} pulls in {time.perf_counter() - t0:.0f} s, best {arm.knobs()}")
        rows["bandit"] = [play(env, lambda o: arm.act(o, env), s) for s in eval_seeds]
        training["bandit"]["train_attainment"] = [play(env, lambda o: arm.act(o, env), s)["attainment"]
                                                  for s in train_seeds]
    if "imitation" in agents:
        t0 = time.perf_counter()
        imitation = Imitation()
        xs: list[np.ndarray] = []
        ys: list[float] = []
        oracle_train = []
        per_seed: dict[int, tuple[Sequence[np.ndarray], Sequence[float]]] = {}
        cached = _load_examples(imitation_cache, train_seeds, horizon, others)
        for s in train_seeds:
            if cached is not None:
                x, y, att = cached[s]
            else:
                x, y, att = imitation.collect(env, s, horizon, others, log)
                _save_examples(imitation_cache, s, x, y, att, horizon, others)
            xs += x
            ys += y
            per_seed[s] = (x, y)
            oracle_train.append(att)
        imitation.fit(xs, ys)
        # the threshold: of imitation_thresholds, the highest mean attainment on the training seeds
        # (of equals the highest threshold: the fewest moves)
        by_threshold = {}
        for th in sorted(imitation_thresholds, reverse=True):
            imitation.threshold = th
            by_threshold[th] = [play(env, lambda o: imitation.act(o, env), s)["attainment"]
                                for s in train_seeds]
        imitation.threshold = max(by_threshold, key=lambda th: (statistics.fmean(by_threshold[th]), th))
        training["imitation"] = {**imitation.summary(), "horizon": horizon, "others": others,
                                 "oracle_train_attainment": oracle_train, "wall_s": time.perf_counter() - t0,
                                 "train_attainment_by_threshold": {str(k): v
                                                                   for k, v in by_threshold.items()},
                                 "train_attainment": by_threshold[imitation.threshold],
                                 "ours_train_attainment": [play(env, lambda o: rule_action(o, env.n), s)[
                                     "attainment"] for s in train_seeds]}
        if len(train_seeds) > 1:
            training["imitation"]["predictability"] = move_predictability(per_seed)
        log(f"  imitation: {len(ys)} examples, threshold {imitation.threshold:g}, in "
            f"{time.perf_counter() - t0:.0f} s")
        rows["imitation"] = [play(env, lambda o: imitation.act(o, env), s) for s in eval_seeds]
    if "ppo" in agents and ppo_steps > 0:
        t0 = time.perf_counter()
        policy, info = train_ppo(env, train_seeds, ppo_steps, seed=seed, warm_start=ppo_warm_start)
        training["ppo"] = {**info, "wall_s": time.perf_counter() - t0}
        log(f"  ppo: {ppo_steps} steps in {time.perf_counter() - t0:.0f} s")
        rows["ppo"] = [play(env, policy, s) for s in eval_seeds]
        training["ppo"]["train_attainment"] = [play(env, policy, s)["attainment"] for s in train_seeds]
    learned = [k for k in ("ppo", "bandit", "imitation") if k in rows]
    # the best learned agent: of the highest mean attainment on the *training* seeds
    top = max(learned, key=lambda k: statistics.fmean(training[k]["train_attainment"]))
    # the placebo moves as often as the best learned agent that moves at all
    moving = [k for k in learned if sum(r["moves_off_ours"] for r in rows[k])] or [top]
    ref = max(moving, key=lambda k: statistics.fmean(training[k]["train_attainment"]))
    rate = sum(r["moves_off_ours"] for r in rows[ref]) / sum(r["decisions"] for r in rows[ref])
    draws = [[random_moves(env, rate, s, d) for d in range(placebo_draws)] for s in eval_seeds]
    rows["placebo"] = [{**sorted(ds, key=lambda r: r["attainment"])[len(ds) // 2], "draws": ds}
                       for ds in draws]
    training["placebo"] = {"of": ref, "move_rate": rate, "draws": placebo_draws}
    ours = [r["attainment"] for r in rows["prefix-learned"]]
    ratios = {}
    for name, rs in rows.items():
        att = [r["attainment"] for r in rs]
        ratios[name] = {"over_ours": _spread([a / b for a, b in zip(att, ours, strict=True)]),
                        f"over_best_rule ({best_name})": _spread([a / b for a, b in zip(att, best_att,
                                                                                          strict=True)]),
                        "mean_attainment": statistics.fmean(att)}
    ship = ratios[top]["over_ours"]["min"] >= SHIP_RATIO
    return {"fleet": fleet, "load": load, "train_seeds": list(train_seeds), "eval_seeds": list(eval_seeds),
            "best_rule": best_name, "best_rule_attainment": best_att, "rows": rows, "ratios": ratios,
            "training": training, "best_learned": top,
            "ship": {"rule": f"every held-out seed >= {SHIP_RATIO}x ours", "ships": ship,
                     "best_learned_over_ours_median": ratios[top]["over_ours"]["median"],
                     "short_of_1.03_by": SHIP_RATIO - ratios[top]["over_ours"]["median"]}}


def _r(x: dict[str, float]) -> str:
    return f"{x['median']:.3f} ({x['min']:.3f}-{x['max']:.3f})"


def _predictability_text(c: dict[str, Any]) -> list[str]:
    im = c["training"].get("imitation", {})
    pred = im.get("predictability")
    if not pred:
        return []
    gain = [a / b for a, b in zip(im["oracle_train_attainment"], im["ours_train_attainment"], strict=True)]
    return ["", f"What the imitation learns from: the oracle is {statistics.median(gain):.3f}x ours on the "
            f"training seeds (median per seed, {min(gain):.3f}-{max(gain):.3f}); its moves told from what a "
            f"router sees, each training seed held out in turn: AUC {pred['logistic_auc_median']:.3f} "
            f"(logistic) and {pred['mlp_auc_median']:.3f} (64x64 MLP), median per seed (0.5: chance); the "
            f"MLP's most confident examples, as many as the seed's moves, are moves in "
            f"{100 * pred['mlp_precision_at_moves_median']:.0f}% (the base rate: "
            f"{100 * pred['base_rate_median']:.0f}%)."]


def render(payload: dict[str, Any]) -> str:
    """The figures in markdown."""
    c = payload["cell"]
    seeds = c["eval_seeds"]
    key = next(k for k in c["ratios"]["prefix-learned"] if k.startswith("over_best_rule"))
    rows = [[name, f"{100 * c['ratios'][name]['mean_attainment']:.1f}%"]
            + [f"{100 * r['attainment']:.1f}%" for r in rs]
            + [_r(c["ratios"][name]["over_ours"]), _r(c["ratios"][name][key])]
            for name, rs in c["rows"].items()]
    rows.append([f"best rule: {c['best_rule']}", f"{100 * statistics.fmean(c['best_rule_attainment']):.1f}%"]
                + [f"{100 * a:.1f}%" for a in c["best_rule_attainment"]] + ["-", "1"])
    out = [f"**{c['fleet']} fleet, load {c['load']:g}**: trained on seeds {c['train_seeds']}, held-out seeds "
           f"{seeds}; ratios: median over the held-out seeds of the per-seed ratio (min-max).", "",
           format_table(["policy", "mean attainment", *[f"seed {s}" for s in seeds], "/ ours", "/ best rule"],
                        rows), "",
           f"Best learned: `{c['best_learned']}`, {c['ship']['best_learned_over_ours_median']:.3f}x ours "
           f"(ships at >= {SHIP_RATIO}x on every seed: {'yes' if c['ship']['ships'] else 'no'}).",
           *_predictability_text(c),
           "", f"{measured(payload)}; `{payload['command']}`: {payload['wall_s'] / 60:.1f} min wall on one "
           "core."]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fleet", default="speed")
    p.add_argument("--load", type=float, default=0.8)
    p.add_argument("--train-seeds", default=",".join(map(str, TRAIN_SEEDS)))
    p.add_argument("--eval-seeds", default=",".join(map(str, EVAL_SEEDS)))
    p.add_argument("--agents", default="bandit,imitation,ppo", help="of bandit, imitation, ppo")
    p.add_argument("--ppo-steps", type=int, default=20_000)
    p.add_argument("--imitation-thresholds", default="0.5,0.3,0.2,0.1",
                   help="the imitation's move thresholds, one chosen on the training seeds")
    p.add_argument("--imitation-cache", default=None,
                   help="an .npz keeping the oracle's training examples (read when it has them)")
    p.add_argument("--ppo-cold", action="store_true", help="PPO from a random policy (no cloning of ours)")
    p.add_argument("--horizon", type=int, default=30, help="the imitated oracle's")
    p.add_argument("--bandit-pulls", type=int, default=48)
    p.add_argument("--headroom", default="results/routing_headroom.json")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.0f} s] {msg}", file=sys.stderr, flush=True)

    cell = run(args.fleet, args.load, [int(s) for s in args.train_seeds.split(",")],
               [int(s) for s in args.eval_seeds.split(",")], agents=args.agents.split(","),
               ppo_steps=args.ppo_steps, bandit_pulls=args.bandit_pulls,
               imitation_thresholds=[float(x) for x in args.imitation_thresholds.split(",")],
               imitation_cache=args.imitation_cache, horizon=args.horizon,
               ppo_warm_start=not args.ppo_cold, headroom=args.headroom,
               log=log)
    payload = {"benchmark": "routing_agents", "machine": machine_info(),
               "command": "python -m benchmarks.routing_agents " + " ".join(
                   argv if argv is not None else sys.argv[1:]),
               "cell": cell, "wall_s": time.perf_counter() - start}
    print(render(payload))
    write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
