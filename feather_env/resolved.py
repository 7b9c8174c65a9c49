"""An environment resolved once: the scenario, its engine, the scheduler, the reward, the backend.

:func:`resolve_env` is the one place where an environment's settings (a scenario name or file and
its overrides, a scheduler name, the decision, the reward, the observation's bounds, the backend)
become values: every default applied, every value checked, the scenario loaded (its pool with it)
and the engine fitted to its longest request. What it returns, a :class:`ResolvedEnv`, is all a
:class:`~feather_env.env.FeatherEnv` is built from; the environment reads no scenario file and
applies no default of its own. A training run resolves its environments once
(:func:`agents.run_config.parse_config`) and builds every environment of the run (training,
evaluation, the reference agents, the workers) from them.

Two derived forms, both through the same steps: :meth:`ResolvedEnv.on` (the same environment on
another backend) and :meth:`ResolvedEnv.with_scheduler` (a reference agent's own scheduler).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from feather_env.engines.vllm_engine import EngineConfig
from feather_env.rewards import (
    GOODPUT_NEEDS_SLOS,
    REWARDS,
    GoodputReward,
    Reward,
    make_reward,
    parse_goodput_slos,
)
from feather_env.scenarios import EpisodeConfig, Scenario, load_scenario
from feather_env.serving import env_scheduler_config
from scheduler_runtime.config import ConfigError
from scheduler_runtime.decision import observation_names
from scheduler_runtime.schedulers import SchedulerConfig

__all__ = ["BACKENDS", "DEFAULT_GROUP_SCHEDULER", "SETTING_DEFAULTS", "BackendSpec", "ResolvedEnv",
           "RewardSpec", "check_settings", "resolve_env", "resolve_envs", "slowdown_range"]

#: The scheduler whose decisions the agent answers in the group decision, unless one is named.
DEFAULT_GROUP_SCHEDULER = "group-cap-3"
#: The backends an environment names (an object of :class:`~feather_env.serving.ServingBackend` serves too).
BACKENDS = ("sim", "vllm")


@dataclass(frozen=True)
class RewardSpec:
    """The reward (:data:`~feather_env.rewards.REWARDS`), its scale, and the goodput SLOs (ms) it and
    ``info["episode"]["request_goodput"]`` read; ``fn``, the reward itself, is made here, once, and
    every environment built from the spec calls it."""

    kind: str = "latency"
    scale: float = 1.0
    goodput_slos: Mapping[str, float] | None = None
    fn: Reward = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "fn", make_reward(self.kind, self.goodput_slos))


@dataclass(frozen=True)
class BackendSpec:
    """Where the episodes are served: ``sim`` (with ``profile``, the simulator's profile JSON; ``None``:
    the shipped one) or ``vllm``."""

    kind: str = "sim"
    profile: str | None = None


@dataclass(frozen=True)
class ResolvedEnv:
    """Everything an environment is built from, resolved and checked (:func:`resolve_env`).

    Attributes:
        scenario: the loaded scenario (its pool is loaded once, with it).
        engine: the engine to serve it on (``max_model_len`` fits the pool's longest request).
        scheduler: the scheduler's configuration inside the environment (the scenario's knobs applied).
        reward: the reward, its scale and the goodput SLOs.
        backend: the backend's kind and the simulator's profile.
        obs_kind: ``base``, ``extended`` or ``group``.
        obs_names: the observation's names (``obs_kind``'s, set from it).
        delta_clip: the bound of ``delta`` and the chunk counts (chunks).
        obs_max_requests: the bound of the request counts (the scenario's largest episode, or given).
        max_episode_seconds: truncate an episode there (``None``: never).
        engine_slowdown: the simulator's step times multiplied by a factor drawn in ``(low, high)``.
    """

    scenario: Scenario
    engine: EngineConfig
    scheduler: SchedulerConfig
    reward: RewardSpec
    backend: BackendSpec
    obs_kind: str
    delta_clip: int
    obs_max_requests: int
    max_episode_seconds: float | None
    engine_slowdown: tuple[float, float]
    obs_names: tuple[str, ...] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "obs_names", observation_names(self.obs_kind))

    @property
    def episode(self) -> EpisodeConfig:
        """How an episode is drawn from the scenario's pool."""
        return self.scenario.episode

    @property
    def chunk_size(self) -> int:
        """The CHT's chunk size (the scenario's)."""
        return self.scenario.scheduler.chunk_size

    def on(self, backend: str) -> ResolvedEnv:
        """The same environment served on ``backend`` (``sim`` or ``vllm``)."""
        return replace(self, backend=replace(self.backend, kind=_backend_kind(backend)))

    def with_scheduler(self, name: str) -> ResolvedEnv:
        """The environment of a reference agent: scheduler ``name`` with its own decision and the base
        (or group) observation, all else the same."""
        scheduler = _scheduler(self.scenario, name, None)
        return replace(self, scheduler=scheduler, obs_kind=_obs_kind(scheduler, name, extended_obs=False))


def slowdown_range(value: float | Sequence[float]) -> tuple[float, float]:
    """``engine_slowdown`` as ``(low, high)``: one factor, or a range drawn per episode."""
    problem = f"engine_slowdown must be a factor > 0 or a range [low, high] of them, got {value!r}"
    try:
        low, high = (value, value) if isinstance(value, int | float) else tuple(value)  # type: ignore[misc]
        ok = 0 < low <= high < float("inf")
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ConfigError(problem)
    return float(low), float(high)


def _backend_kind(backend: str) -> str:
    if backend not in BACKENDS:
        raise ConfigError(f"backend must be 'sim', 'vllm' or a ServingBackend, got {backend!r}")
    return backend


def _scheduler(scenario: Scenario, name: str, decision: str | None) -> SchedulerConfig:
    """Scheduler ``name`` with the scenario's knobs (and ``decision``, when given) inside the environment."""
    knobs = scenario.scheduler
    overrides = {} if decision is None else {"decision": decision}
    return env_scheduler_config(name, chunk_size=knobs.chunk_size, max_wait=knobs.max_wait, **overrides)


def _obs_kind(scheduler: SchedulerConfig, name: str, *, extended_obs: bool) -> str:
    """The observation of the scheduler's decision; the group decision's checks."""
    if scheduler.decision == "group":
        if scheduler.ordering != "feather":
            raise ConfigError(f"the group decision needs a Feather scheduler, not {name!r}")
        if extended_obs:
            raise ConfigError("the group decision has its own observation: extended_obs is for the "
                              "request decision")
        return "group"
    return "extended" if extended_obs else "base"


def check_settings(*, reward: str = "latency", reward_scale: float = 1.0, decision: str | None = None,
                   delta_clip: int = 64, max_episode_seconds: float | None = None,
                   obs_max_requests: int | None = None,
                   goodput_slos: Mapping[str, float] | str | None = None) -> dict[str, float] | None:
    """The one check of an environment's own settings (those that need no scenario): each error names
    the setting (a run config's ``env`` section prefixes it with ``env.``). Returns the goodput SLOs
    (ms), parsed, or ``None``; the other settings (``scheduler``, ``engine_slowdown``, ...) are checked
    as :func:`resolve_env` resolves them.

    Raises:
        ConfigError: a setting out of its range, or the goodput reward without SLOs.
    """
    if reward not in REWARDS:
        raise ConfigError(f"reward must be one of {REWARDS}, got {reward!r}")
    if not (isinstance(reward_scale, int | float) and math.isfinite(reward_scale) and reward_scale > 0):
        raise ConfigError(f"reward_scale must be a finite number > 0, got {reward_scale!r} "
                          "(it multiplies every reward: 0 or NaN leaves nothing to learn)")
    slos = parse_goodput_slos(goodput_slos)
    if reward == GoodputReward.name and slos is None:
        raise ConfigError(GOODPUT_NEEDS_SLOS)
    if not (isinstance(delta_clip, int) and delta_clip >= 1):
        raise ConfigError(f"delta_clip must be an integer >= 1, got {delta_clip!r}")
    seconds = max_episode_seconds
    if seconds is not None and not (math.isfinite(seconds) and seconds > 0):
        raise ConfigError(f"max_episode_seconds must be a finite number > 0 or None, got {seconds!r}")
    if obs_max_requests is not None and not (isinstance(obs_max_requests, int) and obs_max_requests >= 1):
        raise ConfigError(f"obs_max_requests must be an integer >= 1 or None, got {obs_max_requests!r}")
    if decision not in (None, "request", "group"):
        raise ConfigError(f"decision must be 'request' or 'group', got {decision!r}")
    return slos


def resolve_env(
    scenario: str | Scenario = "leval-kv-pressure",
    backend: str = "sim",
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
    obs_max_requests: int | None = None,
    engine_slowdown: float | Sequence[float] = 1.0,
    goodput_slos: Mapping[str, float] | str | None = None,
) -> ResolvedEnv:
    """Resolve an environment's settings (:class:`~feather_env.env.FeatherEnv`'s arguments, its manual)
    into a :class:`ResolvedEnv`: every default applied, every value checked, the scenario loaded.

    Raises:
        ConfigError: an unknown scenario, scheduler, reward or backend, a bad value, or settings that
            do not go together (the group decision with another scheduler than Feather's, ...).
    """
    slos = check_settings(reward=reward, reward_scale=reward_scale, decision=decision, delta_clip=delta_clip,
                          max_episode_seconds=max_episode_seconds, obs_max_requests=obs_max_requests,
                          goodput_slos=goodput_slos)
    if scheduler is None:
        scheduler = DEFAULT_GROUP_SCHEDULER if decision == "group" else "feather-heuristic"
    loaded = load_scenario(scenario, scenario_overrides)
    config = _scheduler(loaded, scheduler, decision)
    obs_kind = _obs_kind(config, scheduler, extended_obs=bool(extended_obs))
    engine = loaded.engine_config()
    slowdown = slowdown_range(engine_slowdown)
    return ResolvedEnv(
        scenario=loaded, engine=engine, scheduler=config,
        reward=RewardSpec(reward, float(reward_scale), slos),
        backend=BackendSpec(_backend_kind(backend), profile),
        obs_kind=obs_kind, delta_clip=delta_clip,
        obs_max_requests=obs_max_requests if obs_max_requests is not None else loaded.max_episode_requests,
        max_episode_seconds=max_episode_seconds, engine_slowdown=slowdown)


#: :func:`resolve_env`'s settings (its keyword arguments) and their defaults.
SETTING_DEFAULTS: dict[str, Any] = {
    name: p.default for name, p in inspect.signature(resolve_env).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY}


def resolve_envs(scenarios: str | Scenario | Sequence[str | Scenario], backend: str = "sim",
                 **settings: Any) -> tuple[ResolvedEnv, ...]:
    """One scenario, or a mix of them (:class:`~feather_env.env.ScenarioMix`), resolved with the same
    ``settings`` (:func:`resolve_env`'s). The scenarios of a mix share one bound of the request counts
    (the largest episode of any of them), so one policy reads them all alike."""
    if isinstance(scenarios, str | Scenario):
        return (resolve_env(scenarios, backend, **settings),)
    if not scenarios:
        raise ConfigError("a scenario mix needs at least one scenario")
    settings = {k: v for k, v in settings.items() if k != "obs_max_requests"}
    envs = [resolve_env(s, backend, **settings) for s in scenarios]
    bound = max(e.obs_max_requests for e in envs)
    return tuple(dataclasses.replace(e, obs_max_requests=bound) for e in envs)
