"""A training run's configuration: one YAML file of four sections, each checked, read by :func:`load_config`.

The sections (``scenario``, ``env``, ``agent``, ``train``) and what each holds are in
:mod:`agents.training`'s docstring; this module parses and checks them (an unknown key is an
error that lists the valid ones; paths are resolved against the file that names them) into a
:class:`RunConfig`, the one object a run is configured by.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agents.envs import RunEnvs, RunStages
from feather_env.resolved import ResolvedEnv, check_settings, resolve_envs
from scheduler_runtime.config import ConfigError, from_mapping, load_yaml
from scheduler_runtime.orderings import BASELINE_ORDERINGS, OrderingName

__all__ = ["ORDERING_REFERENCES", "REFERENCES", "SECTIONS", "EnvSection", "RunConfig", "TrainSection",
           "load_config", "own_scheduler", "parse_config"]

SECTIONS = ("scenario", "env", "agent", "train")
#: What ``train.compare_with`` accepts: a policy answering the trained agent's own decisions
#: (``always-add``, ``heuristic``, ``oracle``, ``random``), or a baseline's ordering answered by
#: always-add (``fcfs``, ``lpm``, ``dfs-weight``, ``svf``, ``sjf``); any other Feather scheduler
#: name (``feather-heuristic``, ``group-cap-K``, ``group-hold``) serves with its own decision and
#: its own rule.
REFERENCES = ("always-add", "heuristic", "oracle", "random", *BASELINE_ORDERINGS)
#: The references served by a baseline's ordering (answered by always-add).
ORDERING_REFERENCES = BASELINE_ORDERINGS


def own_scheduler(name: str) -> bool:
    """Whether reference ``name`` serves with a scheduler of its own (a baseline's ordering, or a
    Feather scheduler's rule), on an environment of its own."""
    return name in ORDERING_REFERENCES or name not in REFERENCES


def _scheduler_reference(name: str) -> bool:
    """Whether ``name`` is a Feather scheduler that serves as a reference with its own rule."""
    from scheduler_runtime.schedulers import SchedulerConfig

    try:
        return SchedulerConfig.for_name(name).ordering == OrderingName.FEATHER
    except ConfigError:
        return False


# -- configuration ------------------------------------------------------------------------------
@dataclass(frozen=True)
class EnvSection:
    """``FeatherEnv`` arguments (see its manual); ``profile`` is the simulator's profile JSON.

    Its fields are ``FeatherEnv``'s keyword arguments but those a run sets itself (the scenario and
    its overrides, the backend, an engine object): ``tests/test_train.py`` holds the two together,
    so an argument the environment gains is a key the run config accepts. The values are checked
    by the environment's own check (:func:`feather_env.resolved.check_settings`); ``scheduler: null``
    is the environment's default for the decision (:func:`~feather_env.resolved.resolve_env` applies
    it; the run saves it by name). ``goodput_slos`` (also
    accepted as ``goodput``, ``train.py --goodput``'s name) is ``vllm bench serve --goodput``'s
    string, ``"ttft:5000 tpot:50"`` (milliseconds): the SLOs of ``reward: goodput``, reported as
    ``request_goodput`` with any reward."""

    scheduler: str | None = None
    reward: str = "latency"
    reward_scale: float = 1.0
    extended_obs: bool = False
    decision: str | None = None
    delta_clip: int = 64
    max_episode_seconds: float | None = None
    obs_max_requests: int | None = None
    engine_slowdown: float | tuple[float, float] = 1.0
    profile: str | None = None
    goodput_slos: str | None = None

    def __post_init__(self) -> None:
        try:
            check_settings(reward=self.reward, reward_scale=self.reward_scale, decision=self.decision,
                           delta_clip=self.delta_clip, max_episode_seconds=self.max_episode_seconds,
                           obs_max_requests=self.obs_max_requests, goodput_slos=self.goodput_slos)
        except ConfigError as exc:
            raise ConfigError(f"env.{exc}") from None


@dataclass(frozen=True)
class TrainSection:
    """How long and how to train, evaluate and checkpoint.

    Attributes:
        timesteps: environment steps (decisions) in total, over all environments.
        seed: seeds the agent and the training environments.
        backend: ``"sim"`` (the calibrated simulator) or ``"vllm"`` (the real engine).
        n_envs: environments in separate processes (1: in this process).
        eval_every: evaluate every this many timesteps (0: only at the end).
        eval_episodes: held-out episodes per evaluation, episode seeds ``eval_seed + i``.
        eval_seed: first held-out episode seed.
        eval_backend: where the held-out evaluation runs (``None``: ``backend``).
        checkpoint_every: checkpoint every this many timesteps (0: only at the end).
        sync_every: tabular agents with ``n_envs > 1``: steps per worker between merges.
        progress_bar: show a progress bar.
        compare_with: reference agents (:data:`REFERENCES`) evaluated at the end on the same
            held-out episodes, printed next to the trained agent (``make demo``).
        confirm_episodes: after a simulator evaluation, also serve the first this many held-out
            episodes on the real engine with the trained policy and the references (0: no).
    """

    timesteps: int = 20_000
    seed: int = 0
    backend: str = "sim"
    n_envs: int = 1
    eval_every: int = 5_000
    eval_episodes: int = 5
    eval_seed: int = 1_000_000
    eval_backend: str | None = None
    checkpoint_every: int = 10_000
    sync_every: int = 2_000
    progress_bar: bool = True
    compare_with: tuple[str, ...] = ()
    confirm_episodes: int = 0

    def __post_init__(self) -> None:
        for name in ("backend", "eval_backend"):
            value = getattr(self, name)
            if value is not None and value not in ("sim", "vllm"):
                raise ConfigError(f"train.{name} must be 'sim' or 'vllm', got {value!r}")
        for name in ("timesteps", "n_envs", "eval_episodes", "sync_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("eval_every", "checkpoint_every", "confirm_episodes", "seed", "eval_seed"):
            if getattr(self, name) < 0:
                raise ConfigError(f"train.{name} must be >= 0, got {getattr(self, name)}")
        if isinstance(self.compare_with, str):
            object.__setattr__(self, "compare_with", (self.compare_with,))
        bad = [n for n in self.compare_with if n not in REFERENCES and not _scheduler_reference(n)]
        if bad:
            raise ConfigError(f"train.compare_with: {bad} are not reference agents; choose from "
                              f"{list(REFERENCES)}")


@dataclass(frozen=True)
class RunConfig:
    """A whole run: the validated sections (``scenario`` stays a mapping: a name and overrides, as the
    saved config holds it) and the environments they resolve to (:attr:`envs`)."""

    agent_name: str
    agent: Any
    scenario: dict[str, Any]
    env: EnvSection = field(default_factory=EnvSection)
    train: TrainSection = field(default_factory=TrainSection)
    source: str = ""
    #: The run's environments resolved once (one per scenario of a mix; :func:`parse_config`), on
    #: ``train.backend``: every environment of the run is built from them.
    envs: tuple[ResolvedEnv, ...] = field(default=(), repr=False, compare=False)
    #: The agent's class (:func:`agents.registry.agent_class`), resolved with the config.
    agent_cls: type = field(init=False, repr=False, compare=False)
    #: The effective config as saved (:meth:`to_dict`), made once, with the config.
    saved: dict[str, Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        from agents.registry import agent_class

        object.__setattr__(self, "agent_cls", agent_class(self.agent_name))
        object.__setattr__(self, "saved", self.to_dict())

    @property
    def is_mix(self) -> bool:
        """Whether the run trains on a mix of scenarios (:class:`~feather_env.env.ScenarioMix`)."""
        return isinstance(self.scenario["name"], list | tuple)

    @property
    def environments(self) -> RunEnvs:
        """The run's environment resolved (:attr:`envs`, with a mix's names as given), on
        ``train.backend``: what every environment of the run is built from."""
        names = tuple(str(n) for n in self.scenario["name"]) if self.is_mix else None
        return RunEnvs(self.envs, names)

    @property
    def stages(self) -> RunStages:
        """The environment of every stage of the run (:class:`~agents.envs.RunStages`), derived from
        :attr:`environments` and the ``train`` section."""
        envs, train = self.environments, self.train
        evaluation = envs.on(train.eval_backend or train.backend)
        return RunStages(
            probe=envs.on("sim"), train=envs.on(train.backend), evaluation=evaluation,
            references={name: envs.with_scheduler(name) if own_scheduler(name) else None
                        for name in train.compare_with},
            real=envs.on("vllm") if train.confirm_episodes and evaluation.kind == "sim" else None)

    @property
    def scenario_name(self) -> str:
        """The scenario's name, or the names of a mix joined by ``+``."""
        name = self.scenario["name"]
        return "+".join(name) if isinstance(name, list | tuple) else str(name)

    @property
    def scenario_overrides(self) -> dict[str, Any]:
        return {k: v for k, v in self.scenario.items() if k != "name"}

    def to_dict(self) -> dict[str, Any]:
        """The effective config as a YAML-able mapping (the format :func:`load_config` reads)."""
        agent = {"name": self.agent_name, **(asdict(self.agent) if self.agent is not None else {})}
        return _plain_data({"scenario": self.scenario, "env": asdict(self.env), "agent": agent,
                       "train": asdict(self.train)})


def _plain_data(obj: Any) -> Any:
    """Tuples -> lists, recursively (YAML/JSON friendly)."""
    if isinstance(obj, Mapping):
        return {k: _plain_data(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_plain_data(v) for v in obj]
    return obj


def parse_config(data: Mapping[str, Any], agent: str | None = None, *, scenario: str | None = None,
                 where: str = "config", base_dir: str | Path | None = None) -> RunConfig:
    """Validate a config mapping; ``agent`` (``--agent``) must match ``agent.name`` if both exist;
    ``scenario`` (``--scenario``) replaces ``scenario.name``. The scenario itself is loaded and
    checked here (unknown names and keys fail before any training starts).

    Files the config names (a scenario file, a workload or arrival trace file in the scenario's
    overrides, ``env.profile``) are relative to ``base_dir`` (the config file's folder; default: the
    current one), ``--scenario`` to the current folder; the returned config holds them absolute, so
    its saved copy reads the same from anywhere. Every number must be finite."""
    from agents.registry import TRAINABLE, config_class

    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping")
    unknown = sorted(set(data) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"{where}: unknown section(s) {unknown}; valid sections are {list(SECTIONS)}")
    agent_section = dict(data.get("agent") or {})
    name = agent_section.pop("name", None)
    if agent is not None and name is not None and agent != name:
        raise ConfigError(f"{where}: --agent {agent} but the config's agent section is for {name!r}")
    name = agent or name
    if name is None:
        raise ConfigError(f"{where}: no agent given (--agent or agent.name); choose from {list(TRAINABLE)}")
    if name not in TRAINABLE:
        raise ConfigError(f"{where}: agent {name!r} cannot be trained; choose from {list(TRAINABLE)}")
    cls = config_class(name)
    try:
        agent_cfg = from_mapping(cls, agent_section, where=f"{where}: agent ({name})")
    except ValueError as exc:  # the config dataclasses' own range checks
        raise ConfigError(str(exc)) from exc
    base = Path(base_dir) if base_dir is not None else Path.cwd()
    env_section = dict(data.get("env") or {}) if isinstance(data.get("env"), Mapping) else data.get("env")
    if isinstance(env_section, dict) and "goodput" in env_section:  # the short name, as --goodput
        if "goodput_slos" in env_section:
            raise ConfigError(f"{where}: env.goodput and env.goodput_slos are one key; give it once")
        env_section["goodput_slos"] = env_section.pop("goodput")
    if isinstance(env_section, dict) and isinstance(env_section.get("profile"), str):
        env_section["profile"] = _anchor(env_section["profile"], base)
    env = from_mapping(EnvSection, env_section, where=f"{where}: env")
    train = from_mapping(TrainSection, data.get("train"), where=f"{where}: train")
    _check_numbers(where, {"agent": agent_cfg, "env": env, "train": train})
    scen = data.get("scenario")
    if scen is None:
        scen = {}
    if isinstance(scen, str):
        scen = {"name": scen}
    if not isinstance(scen, Mapping):
        raise ConfigError(f"{where}: scenario must be a name or a mapping with a 'name'")
    scen = _anchor_overrides(dict(scen), base)
    if scenario is not None:
        scen["name"] = _scenario_names(scenario, Path.cwd())
    elif "name" in scen:
        scen["name"] = _scenario_names(scen["name"], base)
    if "name" not in scen:
        raise ConfigError(f"{where}: no scenario given (--scenario or scenario.name)")
    overrides = {k: v for k, v in scen.items() if k != "name"}
    envs = resolve_envs(scen["name"], train.backend, scenario_overrides=overrides, **dataclasses.asdict(env))
    env = dataclasses.replace(env, scheduler=envs[0].scheduler.name)  # the default, saved by its name
    if getattr(agent_cfg, "baseline", None) is not None and envs[0].scheduler.decision != "group":
        raise ConfigError(f"{where}: agent.baseline is a rule of the group decision; set env.decision: group "
                          f"or remove it")
    return RunConfig(name, agent_cfg, scen, env, train, source=where, envs=envs)


def _anchor(path: str, base: Path) -> str:
    """``path`` made absolute against ``base`` (the folder of the file that names it)."""
    p = Path(path).expanduser()
    return str(p if p.is_absolute() else (base / p).resolve())


def _looks_like_file(name: str) -> bool:
    return name.endswith((".yaml", ".yml")) or os.sep in name


def _scenario_names(value: Any, base: Path) -> Any:
    """A scenario name, a scenario file (made absolute against ``base``), or a mix: a list, or names
    joined by ``+`` (``a+b``; a file whose own name holds a ``+`` is one scenario)."""
    if isinstance(value, list | tuple):
        return [_scenario_names(v, base) for v in value]
    if not isinstance(value, str):
        raise ConfigError(f"scenario name must be a string or a list of them, got {value!r}")
    if _looks_like_file(value) and (base / value).expanduser().is_file():
        return _anchor(value, base)
    if "+" in value:
        return [_scenario_names(v, base) for v in value.split("+")]
    return _anchor(value, base) if _looks_like_file(value) else value


def _anchor_overrides(scen: dict[str, Any], base: Path) -> dict[str, Any]:
    """The files a scenario override names (``workload.path``, ``workload.data_dir``, an episode's
    ``arrival: trace:FILE[:RATE]``), relative to the config file, made absolute."""
    workload = scen.get("workload")
    if isinstance(workload, Mapping):
        scen["workload"] = {k: _anchor(v, base) if k in ("path", "data_dir") and isinstance(v, str) and v
                            else v for k, v in workload.items()}
    episode = scen.get("episode")
    if isinstance(episode, Mapping) and isinstance(episode.get("arrival"), str):
        kind, _, rest = episode["arrival"].partition(":")
        if kind.strip().lower() == "trace" and rest:
            file, sep, rate = rest.rpartition(":")
            try:
                float(rate)
            except ValueError:
                file, sep, rate = rest, "", ""
            if (base / file).expanduser().is_file():
                scen["episode"] = {**episode, "arrival": f"trace:{_anchor(file, base)}{sep}{rate}"}
    return scen


def _check_numbers(where: str, sections: Mapping[str, Any]) -> None:
    """Every number of the run's sections finite (NaN and infinity are errors, not values), and a
    learning rate > 0 (a negative one ascends the loss)."""
    for section, obj in sections.items():
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            values = value if isinstance(value, list | tuple) else [value]
            for v in values:
                if isinstance(v, float) and not math.isfinite(v):
                    raise ConfigError(f"{where}: {section}.{f.name} must be a finite number, got {v!r}")
            if f.name == "learning_rate" and isinstance(value, int | float) and not value > 0:
                raise ConfigError(f"{where}: {section}.learning_rate must be > 0, got {value!r}")


def load_config(path: str | Path, agent: str | None = None, *, scenario: str | None = None,
                reward: str | None = None, profile: str | None = None, goodput: str | None = None,
                **train_overrides: Any) -> RunConfig:
    """Read and validate a YAML config; ``reward``, ``profile`` and ``goodput`` (the SLOs,
    ``"ttft:5000 tpot:50"``) replace ``env.*``, non-``None`` ``train_overrides`` replace ``train.*``."""
    data = load_yaml(path)
    overrides = {k: v for k, v in train_overrides.items() if v is not None}
    if overrides:
        data = {**data, "train": {**(data.get("train") or {}), **overrides}}
    if reward is not None:
        data = {**data, "env": {**(data.get("env") or {}), "reward": reward}}
    if goodput is not None:
        env = data.get("env") or {}
        if isinstance(env, Mapping):  # else parse_config says what is wrong with the section
            env = {k: v for k, v in env.items() if k not in ("goodput", "goodput_slos")}
            data = {**data, "env": {**env, "goodput_slos": goodput}}
    if profile is not None:
        data = {**data, "env": {**(data.get("env") or {}), "profile": str(Path(profile).resolve())}}
    return parse_config(data, agent, scenario=scenario, where=str(path), base_dir=Path(path).parent)
