"""RoutingEnv: choose the replica of each arriving request on an unequal fleet, as a Gymnasium environment
(``feather/Routing-v0``).

See :class:`RoutingEnv` for its manual. The fleets, workloads and loads are those of
``benchmarks.unequal_replicas`` (``tests/test_routing_env.py`` checks that they agree), so that an
agent's attainment here is comparable with the routers measured there.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from feather_env.cluster_sim import (
    Arrival,
    ClusterRun,
    ClusterSim,
    ReplicaSpec,
    distinct_documents,
    drift_workload,
)
from feather_env.engines.vllm_engine import EngineConfig
from feather_env.scenarios import load_scenario
from feather_env.serving_metrics import meets_slos, parse_slos
from feather_env.workloads import Workload, WorkloadConfig, load_workload
from scheduler_runtime.learned_router import LearnedRouter
from scheduler_runtime.router import PrefixAffinityRouter, ReplicaRouter

__all__ = ["ADVISORS", "FEATURES", "FLEETS", "GLOBALS", "TUNE_SEED_BASE", "RoutingEnv",
           "fleet_capacity", "fleet_specs", "rule_action"]

#: The fleets (as ``benchmarks.unequal_replicas.fleets``).
FLEETS = ("speed", "kv", "drift", "equal")
#: The routers whose choice the observation carries (``rule``) and whose learning it shows.
ADVISORS = ("prefix-learned", "prefix")
#: Seeds from here draw documents of their own (``benchmarks.router_peers``' tuning seeds); below, the
#: evaluation's document set (drawn with ``seed = replicas``) with the seed's Poisson arrivals.
TUNE_SEED_BASE = 10_000
#: Each replica's features, in order (see :class:`RoutingEnv`'s table), and the request's.
FEATURES = ("prefix", "in_flight", "queued_tokens", "prefill_speed", "decode_speed", "kv_tokens",
            "kv_usage", "rule")
GLOBALS = ("prompt_tokens", "fleet_in_flight")
#: The observation's clip and its token units.
OBS_CLIP, QUEUE_SCALE, PROMPT_SCALE, SPEED_CLIP = 16.0, 16384.0, 8192.0, 4.0
#: The cluster's engine and the reference router of the capacity (``benchmarks.router_peers.REFERENCE``).
SCENARIO = "leval-kv-pressure"
REFERENCE: dict[str, Any] = {"load_factor": 1.25, "slack": 2, "new_prefix": "ring", "min_match": 0.0,
                             "cache_factor": 0.0, "balance_abs": math.inf, "spread": False}


def fleet_specs(fleet: str, n: int, drift_at: float = 40.0, drift_until: float = 100.0,
                factor: float = 3.0) -> list[ReplicaSpec]:
    """``fleet``'s replicas: ``speed``, every other replica 3x slower in prefill and 1.5x in decode;
    ``kv``, every other with a quarter of the KV; ``drift``, replica 0 ``factor`` x slower from
    ``drift_at`` to ``drift_until`` s; ``equal``."""
    if fleet == "speed":
        return [ReplicaSpec(prefill_slowdown=3.0, decode_slowdown=1.5) if i % 2 else ReplicaSpec()
                for i in range(n)]
    if fleet == "kv":
        return [ReplicaSpec(kv_cache_gib=0.0625) if i % 2 else ReplicaSpec() for i in range(n)]
    if fleet == "drift":
        return [ReplicaSpec(drift=((drift_at, factor), (drift_until, 1.0)))] + [ReplicaSpec()] * (n - 1)
    if fleet == "equal":
        return [ReplicaSpec()] * n
    raise ValueError(f"fleet must be one of {FLEETS}, got {fleet!r}")


def fleet_capacity(engine: EngineConfig, specs: Sequence[ReplicaSpec], workload: Workload) -> float:
    """The fleet's capacity in requests/s: each kind of replica's saturation throughput (a fleet of that
    kind alone, ``workload`` at once, :data:`REFERENCE`'s router) summed over the replicas, a drift
    left out (``benchmarks.unequal_replicas.capacity``)."""
    n = len(specs)
    per_kind: dict[ReplicaSpec, float] = {}
    total = 0.0
    for spec in specs:
        own = ReplicaSpec(spec.prefill_slowdown, spec.decode_slowdown, spec.kv_cache_gib, spec.max_num_seqs,
                          spec.max_num_batched_tokens)
        if own not in per_kind:
            sim = ClusterSim(n, engine, profiles=[own] * n)
            sat = sim.run(workload.with_arrivals("burst"), PrefixAffinityRouter(**REFERENCE))
            per_kind[own] = sat.metrics["request_throughput"] / n
        total += per_kind[own]
    return total


def rule_action(obs: np.ndarray, replicas: int) -> int:
    """The advisor's own choice, read from the observation (its ``rule`` column): following it at every
    step serves the episode exactly as ``ClusterSim.run`` with the advisor does."""
    rows = obs[:replicas * len(FEATURES)].reshape(replicas, len(FEATURES))
    return int(np.argmax(rows[:, FEATURES.index("rule")]))


def make_advisor(name: str) -> ReplicaRouter:
    """The advisor router ``name`` (:data:`ADVISORS`), at its defaults."""
    if name == "prefix-learned":
        return LearnedRouter()
    if name == "prefix":
        return PrefixAffinityRouter()
    raise ValueError(f"advisor must be one of {ADVISORS}, got {name!r}")


class RoutingEnv(gym.Env):
    """Serve an episode on the cluster simulator with an unequal fleet, choosing each request's replica.

    ## Description
    An episode is one workload of ``benchmarks.unequal_replicas``' cells: L-Eval, ``docs_per_replica``
    documents per replica with at most 8 questions each (the drift fleet: 3 such blocks one after the
    other), Poisson arrivals at ``load`` x the fleet's capacity (:func:`fleet_capacity`), served by
    ``replicas`` simulated replicas of ``leval-kv-pressure``'s engine with Feather's heuristic in each
    (:class:`~feather_env.cluster_sim.ClusterSim`, the fleet's :class:`~feather_env.cluster_sim.ReplicaSpec`
    s). The requests arrive one at a time in arrival order; before each, every replica runs up to its
    arrival (:meth:`~feather_env.cluster_sim.ClusterRun.next_arrival`) and the agent names the replica
    that serves it. The control is inverted with the cluster's steppable run
    (:class:`~feather_env.cluster_sim.ClusterRun`): ``ClusterSim.run`` is the same loop with a router's
    own choice.

    An **advisor** router (``advisor``: ``prefix-learned``, ours learning each replica's speed and KV,
    default; or ``prefix``) rides along: it is told every routing, first token, finish and the replicas'
    metrics at every arrival, exactly as ``benchmarks.unequal_replicas`` runs it, and its own choice for
    the request is part of the observation. An agent that always takes it serves the episode exactly
    as ``ClusterSim.run`` with the advisor (``tests/test_routing_env.py`` checks it request for request).

    ## Action Space
    ``Discrete(replicas)``: the replica's index; every replica is always valid (``action_masks()``).

    ## Observation Space
    ``Box(float32)`` of ``replicas x 8 + 2`` entries, at the request's arrival: per replica (row-major,
    replica order) the features below, then the request's two. Everything a router could know: the
    advisor's prefix table, its learned speeds and the replicas' published metrics, not the true speeds.

    | feature | meaning | range |
    |---|---|---|
    | prefix | the prompt's share the advisor's table says this replica was sent last (its longest | [0, 1] |
    |        | known prefix), 0 elsewhere | |
    | in_flight | requests routed here and not finished / the engine's max_num_seqs | [0, 16] |
    | queued_tokens | uncached prompt tokens routed here without a first token yet (the advisor's | [0, 16] |
    |               | count) / 16,384 | |
    | prefill_speed | the advisor's learned prefill speed here (tokens/s, as it routes by it) / | [0, 4] |
    |               | the fleet's median (1 before it knows; the ``prefix`` advisor learns none: 1) | |
    | decode_speed | the same for decode | [0, 4] |
    | kv_tokens | the KV tokens the replica publishes (``vllm:cache_config_info``) / the fleet's | [0, 1] |
    |           | largest | |
    | kv_usage | the replica's KV usage (``vllm:kv_cache_usage_perc``) | [0, 1] |
    | rule | 1 for the advisor's own choice, else 0 | {0, 1} |

    The request's: ``prompt_tokens`` / 8,192 (in [0, 16]); ``fleet_in_flight``, the requests in flight over
    ``replicas x max_num_seqs`` (in [0, 16]). After the last request the observation is all zeros.

    ## Rewards
    +1 for each request that finished meeting every SLO of ``slos`` (vLLM's definition,
    :func:`~feather_env.serving_metrics.meets_slos`; default TTFT <= 5 s, TPOT <= 50 ms), credited at the
    step in whose run of the replicas it finished (whether it met its SLOs is known only then, and no
    earlier than its own decision); the last step serves every replica to its end. The return is the
    episode's good requests, the cluster's own ``request_goodput x duration``, and return / requests is
    its SLO attainment (``info["episode"]["attainment"]``).

    ## Starting State and Episode End
    ``reset(seed)`` draws an episode seed among ``episode_seeds`` (default the evaluation's 0, 1, 2)
    from the reset seed; ``options={"episode_seed": S}`` serves episode ``S``: below
    :data:`TUNE_SEED_BASE` the evaluation's documents (drawn with ``seed = replicas``) with Poisson
    arrivals drawn with ``S``; from it, documents of its own (drawn with ``S + 100 x replicas``) and
    arrivals with ``S`` (``benchmarks.unequal_replicas``' tuning runs). Every replica starts empty. The
    episode terminates after the decision on its last request; every request is then checked to be
    served exactly once with its tokens.

    ## Info
    Every step: ``clock``, ``decisions``, ``good`` so far, ``rule`` (the advisor's choice for the next
    request). At the end ``info["episode"]``: the cluster's metrics
    (:class:`~feather_env.cluster_sim.ClusterResult`'s), ``attainment``, ``good``, ``return``,
    ``requests``, ``episode_seed``, ``requests_per_replica``.

    ## Arguments
    ``fleet`` (:data:`FLEETS`, default ``speed``), ``load`` (0.8; 1.0 the other cell), ``replicas`` (8),
    ``docs_per_replica`` (16), ``advisor``, ``slos`` (``"ttft:5000 tpot:50"`` or a mapping, ms),
    ``episode_seeds``, ``drift_blocks`` (3), ``drift_at`` / ``drift_until`` (40 / 100 s).
    """

    metadata = {"render_modes": []}

    def __init__(self, fleet: str = "speed", load: float = 0.8, *, replicas: int = 8,
                 docs_per_replica: int = 16,
                 advisor: str = "prefix-learned", slos: str | Mapping[str, float] = "ttft:5000 tpot:50",
                 episode_seeds: Sequence[int] | None = (0, 1, 2), drift_blocks: int = 3,
                 drift_at: float = 40.0, drift_until: float = 100.0) -> None:
        super().__init__()
        if advisor not in ADVISORS:
            raise ValueError(f"advisor must be one of {ADVISORS}, got {advisor!r}")
        if not load > 0 or replicas < 2:
            raise ValueError("load must be > 0 and replicas >= 2")
        self.fleet, self.load, self.n = fleet, float(load), int(replicas)
        self.docs_per_replica, self.drift_blocks = int(docs_per_replica), int(drift_blocks)
        self.advisor_name = advisor
        self.slos = parse_slos(slos) if isinstance(slos, str) else dict(slos)
        self.specs = fleet_specs(fleet, self.n, drift_at, drift_until)
        self.engine = load_scenario(SCENARIO).engine_config()
        self.sim = ClusterSim(self.n, self.engine, profiles=self.specs)
        self.names = list(self.sim.names)
        self.episode_seeds = None if episode_seeds is None else [int(s) for s in episode_seeds]
        self._pool: Workload | None = None
        self._episodes: dict[int, tuple[Workload, float]] = {}  # document seed -> (workload, capacity)
        self.max_num_seqs = self.engine.max_num_seqs
        f = len(FEATURES)
        row = np.array([1.0, OBS_CLIP, OBS_CLIP, SPEED_CLIP, SPEED_CLIP, 1.0, 1.0, 1.0], dtype=np.float32)
        high = np.concatenate([np.tile(row, self.n), np.array([OBS_CLIP, OBS_CLIP], dtype=np.float32)])
        assert high.size == self.n * f + len(GLOBALS)
        self.observation_space = spaces.Box(low=np.zeros_like(high), high=high, dtype=np.float32)
        self.action_space = spaces.Discrete(self.n)
        self.run: ClusterRun | None = None
        self.arrival: Arrival | None = None
        self.rule: int | None = None
        self._good = 0
        self._terminated = True
        self.episode_seed: int | None = None

    # -- episodes -----------------------------------------------------------------------------------
    def documents(self, episode_seed: int) -> tuple[Workload, float]:
        """The episode's requests (no arrival times yet) and the fleet's capacity on them (req/s)."""
        doc_seed = self.n if episode_seed < TUNE_SEED_BASE else episode_seed + 100 * self.n
        cached = self._episodes.get(doc_seed)
        if cached is None:
            if self._pool is None:
                self._pool = load_workload(WorkloadConfig(kind="leval", max_prompt_tokens=8192))
            pool = self._pool
            if self.fleet == "drift":
                w = drift_workload(pool, self.n, self.docs_per_replica, self.drift_blocks, seed=doc_seed)
                first = Workload("first block", w.requests[:len(w) // self.drift_blocks])
                cached = (w, fleet_capacity(self.engine, self.specs, first))
            else:
                w = distinct_documents(pool, self.docs_per_replica * self.n, seed=doc_seed, max_per_group=8)
                cached = (w, fleet_capacity(self.engine, self.specs, w))
            self._episodes[doc_seed] = cached
        return cached

    def episode(self, episode_seed: int) -> Workload:
        """Episode ``episode_seed``'s workload with its arrival times (see Starting State)."""
        w, cap = self.documents(episode_seed)
        return w.with_arrivals(f"poisson:{self.load * cap}", episode_seed)

    # -- gymnasium API --------------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        given = (options or {}).get("episode_seed")
        if given is not None:
            episode_seed = int(given)
        elif self.episode_seeds:
            episode_seed = self.episode_seeds[int(self.np_random.integers(len(self.episode_seeds)))]
        else:
            episode_seed = int(self.np_random.integers(TUNE_SEED_BASE))
        self.episode_seed = episode_seed
        timed = self.episode(episode_seed)
        self.run = self.sim.serve(timed, make_advisor(self.advisor_name), goodput=self.slos, scrape_s=0.0,
                                  record_finishes=True)
        self._good = 0
        self._terminated = False
        good = self._advance()
        assert good == 0
        return self._observe(), {"episode_seed": episode_seed, "episode_requests": len(self.run.requests),
                                 "clock": self.arrival.clock if self.arrival else 0.0}

    def step(self, action: int):
        if self._terminated or self.run is None:
            raise RuntimeError("the episode is over (or never started): call reset()")
        try:
            a = int(action)
        except (TypeError, ValueError):
            raise ValueError(f"action must be a replica index, got {action!r}") from None
        if not 0 <= a < self.n:
            raise ValueError(f"action must be in [0, {self.n}), got {a}")
        self.run.route(self.names[a])
        reward = float(self._advance())
        info: dict[str, Any] = {"clock": self.run.now, "decisions": self.run.i, "good": self._good,
                                "rule": self.rule}
        if self._terminated:
            info["episode"] = self.episode_metrics()
        return self._observe(), reward, self._terminated, False, info

    def action_masks(self) -> np.ndarray:
        """Every replica is always valid (MaskablePPO's convention)."""
        return np.ones(self.n, dtype=bool)

    @property
    def terminated(self) -> bool:
        return self._terminated

    # -- the loop -------------------------------------------------------------------------------
    def _advance(self) -> int:
        """Run to the next arrival (or, after the last, to the end); the good requests that finished on
        the way (credited, and counted into ``good``)."""
        run = self.run
        assert run is not None
        self.arrival = run.next_arrival()
        if self.arrival is None:
            run.finish()
            self._terminated = True
            self.rule = None
        else:
            router = run.router
            a = self.arrival
            self.rule = self.names.index(router.choose(a.hashes, a.loads, tokens=a.tokens))
        good = sum(1 for t in run.finished if t.completed and meets_slos(t, self.slos))
        run.finished.clear()
        self._good += good
        return good

    def features(self) -> np.ndarray:
        """The pending request's per-replica features (``replicas x 8``, :data:`FEATURES`, unclipped)."""
        run, a = self.run, self.arrival
        assert run is not None and a is not None and self.rule is not None
        router = run.router
        n, names = self.n, self.names
        out = np.zeros((n, len(FEATURES)), dtype=np.float64)
        if isinstance(router, PrefixAffinityRouter) and a.hashes is not None and len(a.hashes):
            level, owner = router.owner(a.hashes)
            if owner is not None:
                out[names.index(owner), 0] = min((level + 1) * router.chunk_size, a.tokens) / max(1, a.tokens)
        out[:, 1] = [a.loads[r] / self.max_num_seqs for r in names]
        est = router.estimates()
        metrics = [r.metrics() for r in run.replicas]
        for col, key in ((2, "queued_tokens"),):
            out[:, col] = [(est.get(r) or {}).get(key) or 0.0 for r in names]
        out[:, 2] /= QUEUE_SCALE
        for col, key in ((3, "routing_prefill_tok_s"), (4, "decode_tok_s")):
            vals = [(est.get(r) or {}).get(key) for r in names]
            known = [v for v in vals if v]
            med = statistics.median(known) if known else None
            out[:, col] = [v / med if v and med else 1.0 for v in vals]
        kv = [m["vllm:cache_config_info"]["num_gpu_blocks"] * m["vllm:cache_config_info"]["block_size"]
              for m in metrics]
        out[:, 5] = np.array(kv, dtype=float) / max(kv)
        out[:, 6] = [m["vllm:kv_cache_usage_perc"] for m in metrics]
        out[self.rule, 7] = 1.0
        return out

    def _observe(self) -> np.ndarray:
        if self._terminated:
            return np.zeros(self.observation_space.shape, dtype=np.float32)
        a = self.arrival
        assert a is not None
        rows = self.features()
        g = [a.tokens / PROMPT_SCALE, sum(a.loads.values()) / (self.n * self.max_num_seqs)]
        obs = np.concatenate([rows.ravel(), g]).astype(np.float32)
        return np.clip(obs, self.observation_space.low, self.observation_space.high)

    # -- results --------------------------------------------------------------------------------
    def episode_metrics(self) -> dict[str, Any]:
        """The finished episode's figures (see Info)."""
        run = self.run
        assert run is not None and run.result is not None
        res = run.result
        m = res.metrics
        return {**res.to_dict(), "attainment": self._good / len(run.requests), "good": self._good,
                "return": float(self._good), "requests": len(run.requests), "episode_seed": self.episode_seed,
                "request_goodput": m.get("request_goodput"), "duration": m.get("duration")}
