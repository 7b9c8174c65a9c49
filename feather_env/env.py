"""FeatherEnv: the batching core's ADD/STOP decisions in the serving loop, as a Gymnasium environment.

Registered as ``feather/Batching-v0``; see :class:`FeatherEnv` for its manual.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.envs.registration import EnvSpec

from feather_env.engines.vllm_engine import EngineError
from feather_env.records import Advance, RequestTimeline
from feather_env.resolved import (
    SETTING_DEFAULTS,
    ResolvedEnv,
    resolve_env,
    resolve_envs,
)
from feather_env.rewards import (
    REWARD_CLASSES,
    REWARDS,
    DecodeThroughputReward,
    GoodputReward,
    LatencyReward,
    MakespanReward,
    Reward,
    parse_goodput_slos,
)
from feather_env.scenarios import Scenario
from feather_env.serving import ServingBackend
from feather_env.serving_metrics import serving_metrics
from scheduler_runtime.batching import BatchingCore
from scheduler_runtime.config import ConfigError
from scheduler_runtime.decision import (
    ADD,
    STOP,
    BatchingPolicy,
    observation_kind,
)
from scheduler_runtime.plugins import default_policy

__all__ = ["ADD", "REWARDS", "REWARD_CLASSES", "STOP", "DecodeThroughputReward", "FeatherEnv",
           "GoodputReward", "InvalidActionError", "LatencyReward", "MakespanReward", "NoDecisionError",
           "Reward", "ScenarioMix", "finish_episode", "parse_goodput_slos", "play_episode",
           "scheduler_policy"]

#: The scale of the group observation's counts (groups in flight, their waiting requests, waiting groups).
GROUP_COUNT_SCALE = 16.0
#: How many episodes in a row ``reset()`` may skip for needing no decision before it gives up.
MAX_EMPTY_EPISODES = 100


class NoDecisionError(ConfigError):
    """Episode after episode of the scenario needed no decision (see the manual's Episode End)."""


class InvalidActionError(ValueError):
    """The action is masked out in this state (see :meth:`FeatherEnv.action_masks`)."""


class FeatherEnv(gym.Env):
    """Serve an episode of a workload through continuous batching, answering the core's ADD/STOP decisions.

    ## Description
    An episode serves a sample of a scenario's workload (``configs/scenarios/NAME.yaml``: its
    documents and questions, their arrival process, the KV cache and batch size of the engine) on
    an engine: the real in-process vLLM engine, or a simulator of it. The engine's scheduler holds
    every arrived request in the batching core (:mod:`scheduler_runtime.batching`), as it does when
    serving; before each engine step the core opens a round and asks about its candidates, one at a
    time: the waiting request whose prefix the running batch shares most (Feather's Chunked Hash
    Tree), or the next one of another ordering (``scheduler``). Each ``step()`` answers the pending
    decision: ADD releases the candidate to the engine, STOP holds every waiting request until
    something changes (an arrival, a finish, a freed slot). Between decisions the engine runs: it
    admits released requests as its token budget and KV cache allow, prefills them (chunked, with
    whatever the prefix cache still holds), decodes, evicts cached prefixes under KV pressure, and
    finishes requests. The trade-off (Feather, arXiv 2605.06046; SVF, arXiv 2606.22327): a larger
    batch uses the hardware better, but admitting another document's question can break the
    locality of the shared KV and, under KV pressure, evict a document that waiting requests need,
    which must then be prefilled again.

    **Two decisions, two environment ids.** ``feather/Batching-v0`` (``decision="request"``, the
    default) is the paper's environment: ADD/STOP on every candidate, the three-entry state below.
    ``feather/GroupAdmission-v0`` (``decision="group"``) asks only when the candidate would open a
    *prefix group* (the requests sharing its first ``group_chunks`` chunks: an L-Eval document)
    that is not in flight (no request of it released and unfinished); requests of groups in flight
    join without a decision, and so do requests that share nothing on a workload that does not
    share (ShareGPT: :mod:`scheduler_runtime.groups`), so the group decision never throttles them.
    Its candidates come cached-first: a waiting group whose prefix the engine's cache holds before
    the CHT's best. ADD opens the group; STOP holds it (and every other new group) until the next
    engine step, while the groups in flight keep flowing. This is the lever that sets throughput
    under KV pressure with arrivals over time: how many documents are in flight, which comes next,
    and whether a new one waits. The ids are separate because the observation and its meaning
    differ; they serve the same episodes on the same engine.

    ## Action Space
    ``Discrete(2)``: 0 = STOP, 1 = ADD. ``action_masks()`` gives the valid actions (for
    MaskablePPO). A pending decision always has both valid: a candidate that does not fit the KV
    budget, or a full batch, ends the round without asking, and an empty batch is seeded without
    asking (STOP would leave the engine idle). A masked action raises :class:`InvalidActionError`.

    ## Observation Space
    ``Box(float32)``, the core's observation (:mod:`scheduler_runtime.decision`) in raw units,
    clipped to the bounds below (agents scale with :attr:`obs_scale`):

    | index | name | meaning | min | max |
    |---|---|---|---|---|
    | 0 | batch_size | requests released and not finished | 0 | max_num_seqs |
    | 1 | delta | shared-prefix chunks the batch loses by adding the candidate | -delta_clip | delta_clip |
    | 2 | w | other waiting requests sharing the candidate's new depth | 0 | episode requests |

    With ``extended_obs=True``, five more: 3 ``waiting`` (held requests, 0..episode requests),
    4 ``kv_usage`` (the engine's KV blocks in use, 0..1), 5 ``missing_chunks`` (the candidate's
    chunks no running request holds), 6 ``prompt_chunks`` (its prompt), 7 ``cached_chunks`` (its
    prompt in the engine's prefix cache now); 5-7 are in 0..delta_clip. Chunks are
    ``chunk_size`` tokens (the scenario's). After the last step the observation is all zeros.

    With ``decision="group"`` (``feather/GroupAdmission-v0``), the first three and then six more:

    | index | name | meaning | min | max |
    |---|---|---|---|---|
    | 3 | groups_in_flight | prefix groups with a request released and unfinished | 0 | max_num_seqs |
    | 4 | cached_fraction | the candidate's prompt share the engine's prefix cache holds now | 0 | 1 |
    | 5 | waiting_in_flight | requests of groups in flight that wait (held or queued) | 0 | episode requests |
    | 6 | waiting_groups | prefix groups with a held request (candidate's included) | 0 | episode requests |
    | 7 | kv_usage | the engine's KV cache in use or promised to the released requests' prompts | 0 | 1 |
    | 8 | oldest_wait | seconds the longest-held request has waited | 0 | max_wait (120 without) |

    ## Rewards
    From the engine's clock, for the time the engine ran between this decision and the next
    (an ADD that leaves the round open costs nothing):

    - ``"latency"`` (default): minus requests in the system (arrived, unfinished) x seconds,
      divided by the episode's requests: the return is minus the mean end-to-end latency.
    - ``"makespan"``: minus the seconds that passed. The return is minus the time from t = 0 to
      the last completion; for a fixed episode that is maximizing end-to-end output throughput.
    - ``"decode_throughput"``: the paper's reward, the decode throughput of the interval's
      decode-only steps in kilotokens/s (0 when none ran); its sum grows with the number of
      decisions, which suits a per-decision bandit more than return-maximizing RL.
    - ``"goodput"``: +1 per request finished in the interval that met every SLO of ``goodput_slos``
      (vLLM's ``--goodput``: ttft, tpot, e2el in ms); the return is the episode's good requests,
      which orders policies as ``request_goodput`` does when the makespan is arrival-bound (not
      divided by the duration, known only at the end: :class:`GoodputReward`).

    ``reward_scale`` multiplies any of them. The default is the reward that trained the best
    end-to-end output throughput: UCB, Q-learning and PPO trained 20,000 steps on the simulator
    with each reward, their exported policies serving 8 held-out ``leval-kv-pressure`` episodes
    (``benchmarks/rewards.py``, 2026-12-01; tokens/s, ucb / qlearning / ppo; always-add 175.2):

    ===================  =====  =========  =====
    reward               ucb    qlearning  ppo
    ===================  =====  =========  =====
    latency              172.5  172.9      175.2
    makespan             172.5  170.8      175.2
    decode_throughput    175.2  139.7      168.1
    ===================  =====  =========  =====

    Latency and makespan are within a few tokens/s of each other (latency's sum is higher by
    2.1); the paper's decode-throughput reward trained the worst Q-learning and PPO.

    ## Starting State
    ``reset(seed)`` draws episode ``seed'`` of the scenario (its requests, token ids and arrival
    times are a pure function of ``seed'``, itself drawn from the reset seed), empties the engine,
    clears its prefix cache, and runs the engine up to the first decision.

    ## Episode End
    Terminates when every request of the episode has been served, each exactly once with its
    tokens (checked; a violation raises :class:`~feather_env.engines.vllm_engine.EngineError`). An episode
    that needs no decision at all (too little traffic to fill the batch; the group decision on a
    workload without shared prefixes) is served to its end inside ``reset()``, which then draws
    the next episode (counted in :attr:`skipped_episodes` and ``info["skipped_episodes"]``; after
    :data:`MAX_EMPTY_EPISODES` such episodes in a row it raises ``ConfigError``). ``reset()`` with
    ``options={"episode_seed": S}`` serves episode ``S`` whatever it needs: one without a decision
    comes back already over (``info["no_decision"]``, :attr:`terminated`). Truncates when
    the clock passes ``max_episode_seconds`` (default: never), and when another environment on the
    same backend object started an episode meanwhile (an evaluation sharing the one real engine;
    ``info["interrupted"]``). If the engine fails mid-episode,
    ``step()`` raises ``EngineError`` and the episode is over: the next ``step()`` raises
    ``RuntimeError`` until ``reset()``, which starts a clean engine state (nothing is lost silently:
    the failed episode's requests are reported in the error).

    ## Info
    Every step: ``clock`` (engine seconds), ``decisions``. At the end, ``info["episode"]``: the
    episode's serving metrics in ``vllm bench serve``'s vocabulary (``output_throughput``,
    ``request_throughput``, ``mean_ttft_ms``, ``p99_e2el_ms``, ...; see
    :mod:`feather_env.serving_metrics`), ``prefix_hit_rate``, ``decisions``, ``adds``, ``stops``,
    ``preemptions``, ``engine_steps``, ``decode_tok_s``; with ``goodput_slos``, ``request_goodput``
    (good requests per second) and ``goodput_slos_ms``.

    ## Arguments
    - ``scenario``: a scenario name (``configs/scenarios/``), a YAML path, or a :class:`Scenario`;
      ``scenario_overrides``: per-section keys replacing the file's (``{"episode": {"groups": 4}}``).
      The arguments are resolved once (:func:`~feather_env.resolved.resolve_env`: every default
      applied, every value checked); ``scenario`` may also be such a
      :class:`~feather_env.resolved.ResolvedEnv`, given without the other settings
      (:meth:`FeatherEnv.from_resolved` builds from one too).
    - ``backend``: ``"sim"`` (default; ``profile``: its calibrated profile JSON), ``"vllm"`` (the
      real engine; ``llm``: a ``vllm.LLM`` built with ``FeatherScheduler`` to reuse), or a
      :class:`~feather_env.serving.ServingBackend`.
    - ``scheduler``: whose decisions the agent answers: ``"feather-heuristic"`` (default: the CHT's
      candidates), a baseline's ordering (``"fcfs"``, ``"lpm"``, ``"dfs-weight"``, ``"svf"``,
      ``"sjf"``), or a ``+svf`` Feather name; the baselines' own answer is always ADD.
    - ``decision``: ``"request"`` (the paper's, default) or ``"group"`` (see Description); ``None``:
      the scheduler's own (``group-cap-K`` names ask the group decision). With ``"group"`` the
      default ``scheduler`` is ``group-cap-3`` (its rule is :func:`scheduler_policy`'s answer).
    - ``engine_slowdown``: the simulator's step times multiplied by this factor, or by one drawn per
      episode from a range ``[low, high]`` (a machine whose speed varies; 1: the profile's machine).
    - ``reward`` (:data:`REWARDS`), ``reward_scale``; ``goodput_slos``: latency SLOs in ms,
      ``"ttft:5000 tpot:50"`` as ``vllm bench serve --goodput`` takes them or ``{"ttft": 5000.0}``,
      needed by the ``"goodput"`` reward and reported with any; ``extended_obs``; ``delta_clip`` (chunks);
      ``max_episode_seconds``; ``obs_max_requests``: the bound of ``w`` and ``waiting`` (default: the
      scenario's largest episode; :class:`ScenarioMix` sets one bound for all its scenarios).
    """

    metadata = {"render_modes": []}

    def __init__(
        self,
        scenario: str | Scenario | ResolvedEnv = "leval-kv-pressure",
        backend: str | ServingBackend | None = None,
        *,
        scenario_overrides: Mapping[str, Mapping[str, Any]] | None = None,
        scheduler: str | None = None,
        reward: str = "latency",
        reward_scale: float = 1.0,
        extended_obs: bool = False,
        decision: str | None = None,
        delta_clip: int = 64,
        max_episode_seconds: float | None = None,
        profile: str | None = None,
        llm: Any = None,
        obs_max_requests: int | None = None,
        engine_slowdown: float | Sequence[float] = 1.0,
        goodput_slos: Mapping[str, float] | str | None = None,
    ) -> None:
        super().__init__()
        settings = dict(scenario_overrides=scenario_overrides, scheduler=scheduler, reward=reward,
                        reward_scale=reward_scale, extended_obs=extended_obs, decision=decision,
                        delta_clip=delta_clip, max_episode_seconds=max_episode_seconds, profile=profile,
                        obs_max_requests=obs_max_requests, engine_slowdown=engine_slowdown,
                        goodput_slos=goodput_slos)
        if isinstance(scenario, ResolvedEnv):
            given = sorted(k for k, v in settings.items() if v != SETTING_DEFAULTS[k])
            if given:
                raise ConfigError(f"a resolved environment carries its settings: give none of {given} "
                                  "with it")
            resolved = scenario if not isinstance(backend, str) else scenario.on(backend)
        else:
            resolved = resolve_env(scenario, backend if isinstance(backend, str) else "sim", **settings)
        self._set_up(resolved, backend, llm)

    @classmethod
    def from_resolved(cls, resolved: ResolvedEnv, backend: ServingBackend | None = None, *,
                      llm: Any = None) -> FeatherEnv:
        """The environment of a resolved one (:func:`~feather_env.resolved.resolve_env`), on its
        backend, or on ``backend`` (an object to share); ``llm``: a ``vllm.LLM`` to reuse."""
        env = cls.__new__(cls)
        env._set_up(resolved, backend, llm)
        return env

    def _set_up(self, resolved: ResolvedEnv, backend: Any, llm: Any) -> None:
        """Set the environment up from ``resolved``: nothing is defaulted or read here."""
        #: What the environment is built from (:mod:`feather_env.resolved`).
        self.resolved = resolved
        self.scenario = resolved.scenario
        self.scheduler_config = resolved.scheduler
        self.scheduler_name = resolved.scheduler.name
        self.decision = resolved.scheduler.decision
        self.chunk_size = resolved.chunk_size
        reward_spec = resolved.reward
        #: The latency SLOs (ms) of the goodput reward and of ``info["episode"]["request_goodput"]``.
        self.goodput_slos = reward_spec.goodput_slos
        self.reward_kind = reward_spec.kind
        self.reward_fn: Reward = reward_spec.fn
        self._timeline_index: dict[str, RequestTimeline] = {}
        self.reward_scale = reward_spec.scale
        self.obs_kind = resolved.obs_kind
        self.extended_obs = self.obs_kind == "extended"
        self.delta_clip = delta_clip = resolved.delta_clip
        self.max_episode_seconds = resolved.max_episode_seconds
        self.engine_config = resolved.engine
        self.engine_slowdown = resolved.engine_slowdown
        self._owns_backend = not isinstance(backend, ServingBackend)
        self.backend = self._make_backend(backend, resolved, llm)
        if not self.backend.deterministic:
            # real-engine rewards are wall-clock measurements: say so to gymnasium's checks
            self.spec = EnvSpec("feather/Batching-v0", entry_point="feather_env.env:FeatherEnv",
                                nondeterministic=True)
        n_max = resolved.obs_max_requests
        names = resolved.obs_names
        if self.obs_kind == "group":
            # the oldest wait's bound: max_wait releases a request by then (2 minutes without it)
            max_wait = self.scenario.scheduler.max_wait
            wait_max = max_wait if max_wait else 120.0
            seqs = self.engine_config.max_num_seqs
            high = np.array([seqs, delta_clip, n_max, seqs, 1.0, n_max, n_max, 1.0, wait_max],
                            dtype=np.float32)
        else:
            high = np.array([self.engine_config.max_num_seqs, delta_clip, n_max, n_max, 1.0,
                             delta_clip, delta_clip, delta_clip], dtype=np.float32)[: len(names)]
        low = np.zeros(len(names), dtype=np.float32)
        low[1] = -delta_clip
        self.observation_space = spaces.Box(low=low, high=high, dtype=np.float32)
        self.action_space = spaces.Discrete(2)
        #: Divide observations by this to get values of order 1 (what PPO sees): the bounds, except
        #: the group counts, whose bounds are far above the handful a decision turns on.
        self.obs_scale = high.copy()
        if self.obs_kind == "group":
            self.obs_scale[[3, 5, 6]] = np.minimum(high[[3, 5, 6]], GROUP_COUNT_SCALE)
        self.obs_names = names
        self.core: BatchingCore | None = None
        self._runtime: Any = None
        self._requests: dict[str, Any] = {}
        self._terminated = True
        self._failed: str | None = None
        self._episode_requests = 0
        #: Episodes ``reset()`` drew and skipped because they needed no decision (Episode End).
        self.skipped_episodes = 0
        self._decode_tokens = 0
        self._decode_seconds = 0.0
        self._engine_steps = 0

    # -- gymnasium API --------------------------------------------------------------------------
    @property
    def spec(self) -> EnvSpec | None:  # type: ignore[override]
        return self._spec

    @spec.setter
    def spec(self, value: EnvSpec | None) -> None:
        backend = getattr(self, "backend", None)
        if value is not None and backend is not None and not backend.deterministic:
            value = dataclasses.replace(value, nondeterministic=True)
        self._spec = value

    _spec: EnvSpec | None = None

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        given = options.get("episode_seed") if options else None
        for _ in range(MAX_EMPTY_EPISODES):
            episode_seed = int(self.np_random.integers(2**31 - 1)) if given is None else int(given)
            self._start_episode(episode_seed)
            if not self._terminated or given is not None:
                break
            # served to the end without a decision to ask (every request went straight in):
            # nothing to learn from it, so draw another (counted)
            self.skipped_episodes += 1
        else:
            raise NoDecisionError(
                f"scenario {self.scenario.name!r}: {MAX_EMPTY_EPISODES} episodes in a row were served "
                f"without a single {self.decision} decision (every request was released as it arrived: "
                f"too little traffic for the batch, or, for the group decision, no shared prefixes); "
                f"raise the arrival rate or the episode's size, or lower engine.max_num_seqs")
        info = {"episode_requests": self._episode_requests, "episode_seed": self.episode_seed,
                "clock": self.backend.clock, "skipped_episodes": self.skipped_episodes}
        if self._terminated:
            info["no_decision"] = True  # the given episode needed none: it is already over
        return self._observe(), info

    def _start_episode(self, episode_seed: int) -> None:
        low, high = self.engine_slowdown
        if high > low or low != 1.0:
            if not hasattr(self.backend, "time_scale"):
                raise ConfigError("engine_slowdown applies to the simulator only")
            # drawn after the episode's seed, so episodes are the same with or without it
            self.backend.time_scale = low if high == low else float(self.np_random.uniform(low, high))
        episode = self.scenario.episode_workload(episode_seed)
        self.episode_seed = episode_seed
        self._requests = {r.request_id: r for r in episode}
        self.backend.admission_slos = dict(self.goodput_slos or {})  # what a setting's ~RULE reads
        runtime = self.backend.start(episode, self.scheduler_config)
        self._runtime = runtime
        self.core = runtime.core
        self._episode_requests = len(episode)
        self._terminated = False
        self._failed = None
        self._decode_tokens, self._decode_seconds, self._engine_steps = 0, 0.0, 0
        self._timeline_index = {}
        self._run_to_decision()

    @property
    def terminated(self) -> bool:
        """The episode is over (every request served); ``reset()`` starts the next."""
        return self._terminated

    def step(self, action: int):
        if self.core is None:
            raise RuntimeError("call reset() before step()")
        if self._failed is not None:
            raise RuntimeError(f"the episode ended with an engine failure ({self._failed}); call reset()")
        if self._terminated:
            raise RuntimeError("episode has terminated; call reset()")
        if self.backend.runtime is not self._runtime:
            # another environment on this backend (an evaluation sharing the one engine) started
            # an episode meanwhile: this one cannot go on, and says so by truncating
            self._terminated = True
            zeros = np.zeros(self.observation_space.shape, dtype=np.float32)
            return zeros, 0.0, False, True, {"interrupted": True, "clock": self.backend.clock}
        pending = self.core.pending
        assert pending is not None
        try:
            action = int(action)
        except (TypeError, ValueError):
            raise InvalidActionError(f"action must be 0 (STOP) or 1 (ADD), got {action!r}") from None
        if action not in (STOP, ADD):
            raise InvalidActionError(f"action must be 0 (STOP) or 1 (ADD), got {action}")
        if not pending.mask[action]:
            raise InvalidActionError(f"action {action} is masked out for candidate {pending.request_id!r}")
        self.core.decide(action)
        try:
            reward = self._run_to_decision()
        except EngineError as exc:
            self._failed = str(exc)
            raise
        info: dict[str, Any] = {"clock": self.backend.clock, "decisions": self.core.stats.decisions}
        truncated = (not self._terminated and self.max_episode_seconds is not None
                     and self.backend.clock >= self.max_episode_seconds)
        if self._terminated:
            info["episode"] = self.episode_metrics()
        return self._observe(), reward, self._terminated, truncated, info

    def action_masks(self) -> np.ndarray:
        """Valid actions as booleans ``[STOP, ADD]`` (MaskablePPO's convention)."""
        if self.core is None or self.core.pending is None:
            return np.array([True, False])
        return self.core.pending.mask.copy()

    def close(self) -> None:
        backend = getattr(self, "backend", None)
        if backend is not None and getattr(self, "_owns_backend", False):
            backend.close()

    # -- the loop --------------------------------------------------------------------------------
    def _run_to_decision(self) -> float:
        """Run the serving loop until the core has a pending decision or the episode ends.

        Before every engine advance the core opens a round (as vLLM's scheduler plans before every
        step); a round without decisions hands its releases to the engine at once.
        """
        core, backend = self.core, self.backend
        assert core is not None
        reward = 0.0
        while True:
            if not core.round_open:
                core.open_round(backend.clock, backend.free_slots(), backend.view)
            if core.pending is not None:
                return reward
            backend.release(core.close_round())
            if backend.done:
                backend.check_complete()
                self._terminated = True
                return reward
            adv = backend.advance()
            self._decode_tokens += adv.decode_tokens
            self._decode_seconds += adv.decode_seconds
            self._engine_steps += adv.steps
            reward += self._reward(adv)
            if self.max_episode_seconds is not None and backend.clock >= self.max_episode_seconds:
                if not core.round_open:
                    core.open_round(backend.clock, backend.free_slots(), backend.view)
                if core.pending is not None or backend.done:
                    continue
                # no decision to ask: the truncated episode ends here
                backend.release(core.close_round())
                return reward

    def _reward(self, adv: Advance) -> float:
        return self.reward_fn(adv, self._episode_requests, self._finished_timeline) * self.reward_scale

    def _finished_timeline(self, request_id: str) -> RequestTimeline:
        """The timeline of a request the backend reported finished (the goodput reward's lookup):
        an index of the backend's timelines, built once an episode and again only for a request it
        does not hold finished (one submitted since, or a backend that hands out copies)."""
        t = self._timeline_index.get(request_id)
        if t is None or not t.finished_count:
            self._timeline_index = {tl.request_id: tl for tl in self.backend.timelines()}
            t = self._timeline_index[request_id]
        return t

    def _observe(self) -> np.ndarray:
        core = self.core
        if core is None or core.pending is None:
            return np.zeros(self.observation_space.shape, dtype=np.float32)
        obs = core.observe(self.obs_kind)
        return np.clip(obs, self.observation_space.low, self.observation_space.high)

    # -- episode results -------------------------------------------------------------------------
    def episode_metrics(self) -> dict[str, Any]:
        """The finished (or current) episode's serving metrics, vLLM's names (see Info)."""
        core = self.core
        assert core is not None
        out = serving_metrics(self.backend.timelines(), goodput=self.goodput_slos)
        stats = core.stats
        out.update(decisions=stats.decisions, adds=stats.adds, stops=stats.stops,
                   preemptions=stats.preempted, engine_steps=self._engine_steps,
                   decode_tok_s=self._decode_tokens / self._decode_seconds if self._decode_seconds else 0.0,
                   clock_s=self.backend.clock, episode_seed=self.episode_seed,
                   scheduler=self.scheduler_name, scenario=self.scenario.name)
        admission = getattr(self.backend, "admission", None)
        if admission is not None:  # the slo rule's correction of its prediction (its largest this run)
            out["max_ttft_pace"] = admission.stats.max_ttft_pace
        return out

    # -- helpers -------------------------------------------------------------------------------------
    def _make_backend(self, backend: Any, resolved: ResolvedEnv, llm: Any) -> ServingBackend:
        if isinstance(backend, ServingBackend):
            return backend
        if backend is not None and not isinstance(backend, str):
            raise ConfigError(f"backend must be 'sim', 'vllm' or a ServingBackend, got {backend!r}")
        if resolved.backend.kind == "sim":
            from feather_env.engines.sim_backend import SimBackend

            return SimBackend(resolved.engine, resolved.backend.profile)
        from feather_env.engines.vllm_backend import VLLMBackend

        return VLLMBackend(resolved.engine, llm=llm)

    # read-only views for agents (the oracle) and tests
    @property
    def candidate_request(self) -> Any:
        """The pending decision's request (a :class:`~feather_env.workloads.Request`), or None."""
        if self.core is None or self.core.pending is None:
            return None
        return self._requests[self.backend.external_id(self.core.pending.request_id)]

    @property
    def batch_requests(self) -> list[Any]:
        """The requests of the running batch (released, unfinished), oldest release first."""
        if self.core is None:
            return []
        ext = self.backend.external_id
        return [self._requests[ext(rid)] for rid in self.core.active_ids()]

    @property
    def units(self) -> str:
        """The reward's unit (before ``reward_scale``)."""
        return self.reward_fn.units


class ScenarioMix(gym.Env):
    """Episodes of several scenarios, one drawn at random per ``reset``: what a policy that must
    serve them all (``policies/general.feather``) trains on.

    Every scenario gets its own :class:`FeatherEnv` (its own engine configuration); the
    observation bounds are shared (the largest episode of any of them), so one policy reads them
    all alike. ``reset(options={"scenario": NAME})`` picks one; the chosen one's attributes
    (``core``, ``backend``, ``candidate_request``, ...) are reachable through :attr:`current`.
    """

    metadata = {"render_modes": []}

    def __init__(self, scenarios: Sequence[str], backend: str = "sim", *, llm: Any = None,
                 **settings: Any) -> None:
        super().__init__()
        names = [str(s) for s in scenarios]
        self._set_up_mix(names, resolve_envs(names, backend, **settings), None, llm)

    @classmethod
    def from_resolved(cls, envs: Sequence[ResolvedEnv], backend: ServingBackend | None = None, *,
                      names: Sequence[str] | None = None, llm: Any = None) -> ScenarioMix:
        """The mix of resolved environments (:func:`~feather_env.resolved.resolve_envs`), named as the
        scenarios were given (``names``), else by their scenarios' names."""
        mix = cls.__new__(cls)
        mix._set_up_mix(list(names) if names is not None else [e.scenario.name for e in envs], envs, backend,
                        llm)
        return mix

    def _set_up_mix(self, names: list[str], envs: Sequence[ResolvedEnv], backend: ServingBackend | None,
                    llm: Any) -> None:
        self.envs = {n: FeatherEnv.from_resolved(e, backend, llm=llm)
                     for n, e in zip(names, envs, strict=True)}
        first = self.envs[names[0]]
        for n, env in self.envs.items():
            if env.observation_space != first.observation_space or env.chunk_size != first.chunk_size:
                raise ConfigError(f"scenario {n!r} observes differently from {names[0]!r} (batch size "
                                  f"bound or chunk size): they cannot share one policy")
        self.names = names
        #: Scenarios whose episodes never needed a decision (skipped once found).
        self.decision_free: list[str] = []
        self.current = first
        self.observation_space = first.observation_space
        self.action_space = first.action_space
        self.obs_scale = first.obs_scale
        self.obs_names = first.obs_names
        self.chunk_size = first.chunk_size

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        options = dict(options or {})
        name = options.pop("scenario", None)
        if name is None and options.get("episode_seed") is not None:
            # a given episode is the same episode for every agent, whatever was drawn before
            name = self.names[int(options["episode_seed"]) % len(self.names)]
        elif name is None:
            left = [n for n in self.names if n not in self.decision_free] or self.names
            name = left[int(self.np_random.integers(len(left)))]
        if name not in self.envs:
            raise ConfigError(f"scenario {name!r} is not in this mix {self.names}")
        while True:
            self.current = self.envs[name]
            try:
                obs, info = self.current.reset(seed=int(self.np_random.integers(2**31 - 1)),
                                               options=options or None)
            except NoDecisionError:
                # this scenario never needs the decision (the group decision on ShareGPT): the
                # mix draws from the others from now on, and says so in every info
                self.decision_free.append(name)
                left = [n for n in self.names if n not in self.decision_free]
                if not left:
                    raise
                name = left[int(self.np_random.integers(len(left)))]
                continue
            return obs, {**info, "scenario": name, "decision_free": list(self.decision_free)}

    def step(self, action: int):
        return self.current.step(action)

    def action_masks(self) -> np.ndarray:
        return self.current.action_masks()

    @property
    def core(self) -> BatchingCore | None:
        return self.current.core

    @property
    def terminated(self) -> bool:
        return self.current.terminated

    @property
    def scheduler_config(self) -> Any:
        """The scheduler configuration (every scenario of the mix serves the same scheduler)."""
        return self.current.scheduler_config

    def episode_metrics(self) -> dict[str, Any]:
        return self.current.episode_metrics()

    def close(self) -> None:
        for env in self.envs.values():
            env.close()


def scheduler_policy(env: FeatherEnv) -> BatchingPolicy:
    """The policy the environment's scheduler answers with when it serves (a fresh object):
    :func:`~scheduler_runtime.plugins.default_policy` of its configuration."""
    config = env.scheduler_config
    return default_policy(config.ordering, config.policy, config.group_cap)


def play_episode(env: FeatherEnv, policy: BatchingPolicy | None = None, *, seed: int | None = None,
                 episode_seed: int | None = None) -> dict[str, Any]:
    """Serve one episode answering every decision with ``policy`` (default: the scheduler's own,
    :func:`scheduler_policy`); returns ``info["episode"]`` and ``"return"``.

    The policy reads the core's raw observation (the environment's is clipped), as it does when
    serving; with an ``obs_spec`` of the extended names it gets the extended observation.
    """
    policy = policy if policy is not None else scheduler_policy(env)
    reset = getattr(policy, "reset", None)
    if reset is not None:
        reset()
    options = {"episode_seed": episode_seed} if episode_seed is not None else None
    env.reset(seed=seed, options=options)
    total = finish_episode(env, policy)
    out = dict(env.episode_metrics())
    out["return"] = total
    return out


def finish_episode(env: FeatherEnv, policy: BatchingPolicy) -> float:
    """Serve the rest of ``env``'s episode (from wherever it stands) answering every decision with
    ``policy`` on the core's raw observation (:func:`play_episode`); the rewards summed."""
    kind = observation_kind(policy)
    total = 0.0
    while not env.terminated:
        core = env.core
        assert core is not None and core.pending is not None
        action = int(policy.act(core.observe(kind), core.pending.mask))
        _, reward, terminated, truncated, _ = env.step(action)
        total += reward
        if terminated or truncated:
            break
    return total
