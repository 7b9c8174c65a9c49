"""Scenarios: a workload, how an episode samples it, and the engine it runs on, in one YAML file.

A scenario is what the environment trains on, what ``train.py --scenario`` and
``evaluate.py --scenario`` read, and what a results table is labelled with. The files live in
``configs/scenarios/NAME.yaml`` (:func:`available_scenarios` lists them)::

    description: "one line"
    workload:            # the request pool (feather_env.workloads.WorkloadConfig, all its keys)
      kind: leval
      max_prompt_tokens: 8192
    episode:             # how one episode is drawn from the pool (EpisodeConfig)
      groups: 16         # whole prefix groups (documents with their questions) ...
      max_per_group: 8   # ... with at most this many requests each
      requests: null     # or this many requests at random (after the groups, if both)
      arrival: burst     # burst | poisson:RATE | trace
    engine:              # feather_env.engine.EngineConfig: the KV cache, the batch, the token budget
      kv_cache_gib: 0.25
      max_num_seqs: 64
    scheduler:           # the batching core's knobs (ScenarioSchedulerConfig)
      chunk_size: 512
      max_wait: 60

Episode ``seed`` is a pure function of the scenario: :meth:`Scenario.episode` draws the same
requests, the same token ids and the same arrival times for the same seed, wherever it runs.
``evaluate.py --scenario NAME --seed S`` serves episode ``S``.

Errors are clear and early: an unknown scenario lists the available ones, an unknown key lists
the valid keys of its section, and a request that could never fit the scenario's KV cache is a
:class:`~scheduler_runtime.config.ConfigError` naming it, never a silent drop.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from feather_env.engine import REPO_ROOT, EngineConfig
from feather_env.workloads import Workload, WorkloadConfig, load_workload, sample_workload
from feather_env.workloads.arrivals import TraceFileArrivals, parse_arrival
from scheduler_runtime.config import ConfigError, from_mapping, load_yaml

__all__ = [
    "EVALUATED_SCENARIOS",
    "SCENARIO_DIR",
    "EpisodeConfig",
    "Scenario",
    "ScenarioSchedulerConfig",
    "available_scenarios",
    "load_scenario",
]

SCENARIO_DIR = REPO_ROOT / "configs" / "scenarios"
#: The scenarios a policy is shipped for and the evaluation serves (``leval-ample-kv`` is the
#: environment's contrast case: ample KV, where admission order barely matters).
EVALUATED_SCENARIOS = ("leval-kv-pressure", "leval-kv-pressure-poisson", "leval-trace", "leval-high-load",
                       "leval-summaries", "sharegpt", "longbench")
_SECTIONS = ("description", "workload", "episode", "engine", "scheduler")
#: Workload keys that belong to the episode (the pool must not sample by itself).
_EPISODE_KEYS = ("num_requests", "num_groups", "max_per_group", "arrival")


@dataclass(frozen=True)
class EpisodeConfig:
    """How an episode is drawn from the scenario's pool (see the module docstring)."""

    groups: int | None = None
    max_per_group: int | None = None
    requests: int | None = None
    arrival: str = "burst"

    def __post_init__(self) -> None:
        for name in ("groups", "max_per_group", "requests"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or value < 1):
                raise ConfigError(f"episode.{name} must be a positive integer or null, got {value!r}")
        parse_arrival(self.arrival)


@dataclass(frozen=True)
class ScenarioSchedulerConfig:
    """The batching core's knobs a scenario sets (the same for every ordering and policy)."""

    chunk_size: int = 512
    max_wait: float | None = 60.0

    def __post_init__(self) -> None:
        if isinstance(self.chunk_size, bool) or self.chunk_size < 1:
            raise ConfigError(f"scheduler.chunk_size must be >= 1, got {self.chunk_size!r}")
        if self.max_wait is not None and not (math.isfinite(self.max_wait) and self.max_wait >= 0):
            raise ConfigError(f"scheduler.max_wait must be a finite number >= 0 or null, "
                              f"got {self.max_wait!r}")


@dataclass(frozen=True)
class Scenario:
    """A named workload pool, its episode sampling, its engine and its scheduler knobs."""

    name: str
    workload: WorkloadConfig
    episode: EpisodeConfig = field(default_factory=EpisodeConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    scheduler: ScenarioSchedulerConfig = field(default_factory=ScenarioSchedulerConfig)
    description: str = ""
    source: str | None = None

    @cached_property
    def pool(self) -> Workload:
        """Every request the episodes draw from (loaded once per scenario object)."""
        pool = load_workload(self.workload)
        capacity = self.kv_capacity_tokens
        too_big = [r for r in pool if r.peak_tokens > capacity]
        if too_big:
            worst = max(too_big, key=lambda r: r.peak_tokens)
            raise ConfigError(
                f"scenario {self.name!r}: {len(too_big)} of {len(pool)} requests can never fit the KV "
                f"cache of {capacity} tokens ({self.engine.kv_cache_gib:g} GiB), e.g. {worst.request_id!r} "
                f"with {worst.prompt_len} prompt + {worst.output_len} output tokens; lower "
                f"workload.max_prompt_tokens / max_output_tokens or raise engine.kv_cache_gib")
        return pool

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the scenario's KV cache holds for requests (whole blocks, vLLM's null block out)."""
        return self.engine.usable_kv_tokens

    def engine_config(self) -> EngineConfig:
        """The engine to serve the scenario on: ``max_model_len`` fits the pool's longest request."""
        peak = max(r.peak_tokens for r in self.pool)
        block = self.engine.block_size
        need = int(math.ceil((peak + 1) / block) * block)
        return replace(self.engine, max_model_len=max(need, block))

    def episode_workload(self, seed: int) -> Workload:
        """Episode ``seed``: the same requests, tokens and arrivals for the same seed."""
        ep = self.episode
        cfg = replace(self.workload, num_groups=ep.groups, max_per_group=ep.max_per_group,
                      num_requests=ep.requests, arrival=ep.arrival, seed=int(seed))
        return sample_workload(self.pool, cfg)

    @property
    def max_episode_requests(self) -> int:
        """An upper bound of the requests in one episode (observation bounds)."""
        ep = self.episode
        n = len(self.pool)
        if ep.groups is not None:
            sizes = sorted((len(m) for m in self.pool.groups().values()), reverse=True)
            if ep.max_per_group is not None:
                sizes = [min(s, ep.max_per_group) for s in sizes]
            n = sum(sizes[: ep.groups])
        elif ep.max_per_group is not None:
            n = sum(min(len(m), ep.max_per_group) for m in self.pool.groups().values())
        if ep.requests is not None:
            n = min(n, ep.requests)
        return n

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description,
                "workload": dataclasses.asdict(self.workload), "episode": dataclasses.asdict(self.episode),
                "engine": self.engine.to_dict(), "scheduler": dataclasses.asdict(self.scheduler),
                "source": self.source}

    @classmethod
    def from_mapping(cls, name: str, data: Mapping[str, Any], source: str | None = None) -> Scenario:
        """Build and check a scenario from its YAML mapping (``source`` names the file in errors)."""
        where = source or f"scenario {name!r}"
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
        unknown = sorted(set(data) - set(_SECTIONS))
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {unknown}; valid keys are {list(_SECTIONS)}")
        if "workload" not in data:
            raise ConfigError(f"{where}: a scenario needs a 'workload' section")
        workload = WorkloadConfig.from_mapping(data["workload"], where=f"{where}: workload")
        sampled = [k for k in _EPISODE_KEYS if getattr(workload, k) is not None]
        if sampled:
            raise ConfigError(f"{where}: workload.{sampled[0]} belongs in the 'episode' section "
                              f"(groups, max_per_group, requests, arrival)")
        episode = data.get("episode")
        if isinstance(episode, Mapping) and source is not None:
            episode = {**episode, "arrival": _anchor_trace(episode.get("arrival"), Path(source).parent)}
            data = {**data, "episode": episode}
        description = data.get("description", "")
        if not isinstance(description, str):
            raise ConfigError(f"{where}: description must be a string")
        return cls(
            name=name,
            workload=workload,
            episode=from_mapping(EpisodeConfig, data.get("episode"), where=f"{where}: episode"),
            engine=EngineConfig.from_dict(data.get("engine"), where=f"{where}: engine"),
            scheduler=from_mapping(ScenarioSchedulerConfig, data.get("scheduler"),
                                   where=f"{where}: scheduler"),
            description=description,
            source=source,
        )


def _anchor_trace(arrival: Any, base_dir: Path) -> Any:
    """A ``trace:FILE[:RATE]`` arrival whose FILE lies beside the scenario file, with FILE made
    absolute (a path in a scenario is relative to the scenario); any other spec unchanged (a FILE
    of the data root's traces/ is found there when the episode is drawn)."""
    if not isinstance(arrival, str) or not arrival.strip().lower().startswith("trace:"):
        return arrival
    process = parse_arrival(arrival, base_dir)  # checks the spec and finds FILE
    if isinstance(process, TraceFileArrivals) and process.path.parent.resolve() == base_dir.resolve():
        return process.spec
    return arrival


def available_scenarios() -> list[str]:
    """Names of the scenario files in ``configs/scenarios/``."""
    return sorted(p.stem for p in SCENARIO_DIR.glob("*.yaml"))


def load_scenario(name_or_path: str | Path | Scenario,
                  overrides: Mapping[str, Mapping[str, Any]] | None = None) -> Scenario:
    """A scenario by name (``configs/scenarios/NAME.yaml``) or by the path of a YAML file.

    ``overrides``: per-section keys replacing the file's (``{"episode": {"groups": 4}}``); they
    are checked like the file's own keys.

    Raises:
        ConfigError: unknown scenario (lists the available ones), unknown section or key, bad value.
    """
    if isinstance(name_or_path, Scenario):
        if not overrides:
            return name_or_path
        data = {k: v for k, v in name_or_path.to_dict().items() if k in _SECTIONS}
        name, source = name_or_path.name, name_or_path.source
    else:
        path = Path(name_or_path)
        if path.suffix not in (".yaml", ".yml") or not path.is_file():
            candidate = SCENARIO_DIR / f"{name_or_path}.yaml"
            if not candidate.is_file():
                raise ConfigError(f"unknown scenario {str(name_or_path)!r}; available: "
                                  f"{available_scenarios()} (or the path of a scenario YAML file)")
            path = candidate
        data = load_yaml(path)
        name, source = path.stem, str(path)
    for section, values in (overrides or {}).items():
        if section not in _SECTIONS or section == "description":
            raise ConfigError(f"scenario override: unknown section {section!r}; valid: {list(_SECTIONS[1:])}")
        if not isinstance(values, Mapping):
            raise ConfigError(f"scenario override {section!r}: expected a mapping")
        data[section] = {**dict(data.get(section) or {}), **values}
    return Scenario.from_mapping(name, data, source)
