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
      window_s: null     # a timed trace: a window of so many seconds (drawn before the above)
      arrival: burst     # burst | poisson:RATE | trace | trace:FILE[:RATE]; default: the
                         # trace's own timestamps when the pool has them, else burst
      rate_scale: 1.0    # the episode's arrival times divided by this (2: twice as fast), after the
                         # window is drawn (window_s is in the trace's own seconds)
    engine:              # EngineConfig (feather_env.engines.vllm_engine): KV cache, batch, token budget
      kv_cache_gib: 0.25
      max_num_seqs: 64
    scheduler:           # the batching core's knobs (ScenarioSchedulerConfig)
      chunk_size: 512
      max_wait: 60

Episode ``seed`` is a pure function of the scenario: :meth:`Scenario.episode` draws the same
requests, the same token ids and the same arrival times for the same seed, wherever it runs.
``evaluate.py --scenario NAME --seed S`` serves episode ``S``.

Paths in a scenario file (``workload.path``, ``workload.data_dir``, an arrival's ``trace:FILE``)
are relative to the file's folder; a relative ``workload.path`` not found there is looked up under
the data root (``workload.data_dir``, else ``$FEATHER_DATA_DIR``), so a scenario may name
``traces/mooncake/synthetic_trace.jsonl``, and a ``trace:FILE`` under the data root's ``traces/``.

Errors are clear and early: an unknown scenario lists the available ones, an unknown key lists
the valid keys of its section, and a request that could never fit the scenario's KV cache is a
:class:`~scheduler_runtime.config.ConfigError` naming it, never a silent drop (a ``custom`` file or
a ``synthetic`` workload is checked request by request before its pool is built:
:class:`~feather_env.workloads.WorkloadError`, naming the file and line).

A scenario for your own trace, in one command (it prints what it found and writes the file)::

    python -m feather_env.scenarios new --trace requests.jsonl --kv-cache-gib 0.5 --out mine.yaml
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from feather_env.engines.vllm_engine import REPO_ROOT, EngineConfig
from feather_env.reporting import check_output_file
from feather_env.workloads import Workload, WorkloadConfig, load_workload, sample_workload
from feather_env.workloads.arrivals import TraceFileArrivals, parse_arrival
from feather_env.workloads.custom import resolve_custom_path
from scheduler_runtime.config import ConfigError, check_core_knobs, from_mapping, load_yaml

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
#: Prefix groups a synthetic scenario's pool has at least (its episodes draw ``episode.groups``).
SYNTHETIC_POOL_GROUPS = 8


@dataclass(frozen=True)
class EpisodeConfig:
    """How an episode is drawn from the scenario's pool (see the module docstring)."""

    groups: int | None = None
    max_per_group: int | None = None
    requests: int | None = None
    window_s: float | None = None
    arrival: str | None = None
    rate_scale: float = 1.0

    def __post_init__(self) -> None:
        for name in ("groups", "max_per_group", "requests"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or value < 1):
                raise ConfigError(f"episode.{name} must be a positive integer or null, got {value!r}")
        if self.window_s is not None and not (math.isfinite(self.window_s) and self.window_s > 0):
            raise ConfigError(f"episode.window_s must be a finite number of seconds > 0 or null, "
                              f"got {self.window_s!r}")
        if self.arrival is not None:
            parse_arrival(self.arrival)
        scale = self.rate_scale
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not (math.isfinite(scale)
                                                                                 and scale > 0):
            raise ConfigError(f"episode.rate_scale must be a finite number > 0 (2: the trace replayed twice "
                              f"as fast), got {scale!r}")


@dataclass(frozen=True)
class ScenarioSchedulerConfig:
    """The batching core's knobs a scenario sets (the same for every ordering and policy)."""

    chunk_size: int = 512
    max_wait: float | None = 60.0

    def __post_init__(self) -> None:
        try:
            check_core_knobs(chunk_size=self.chunk_size, max_wait=self.max_wait)
        except ValueError as exc:
            raise ConfigError(f"scheduler.{exc}") from None


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
        capacity = self.kv_capacity_tokens
        workload = self.workload
        if workload.kind == "synthetic":
            workload = replace(workload, num_groups=max(SYNTHETIC_POOL_GROUPS, self.episode.groups or 0))
        note = f" ({self.engine.kv_cache_gib:g} GiB, engine.kv_cache_gib of scenario {self.name!r})"
        pool = load_workload(workload, model_dir=self.engine.model_dir, max_request_tokens=capacity,
                             capacity_note=note)
        if self.episode.window_s is not None and pool.arrivals != "trace":
            raise ConfigError(f"scenario {self.name!r}: episode.window_s draws time windows of a trace, but "
                              f"the {workload.kind} workload has no timestamps")
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
        """Episode ``seed``: the same requests, tokens and arrivals for the same seed.

        A timed trace keeps its timestamps unless ``episode.arrival`` says otherwise; with
        ``episode.window_s`` the episode is a time window of it drawn for ``seed``, else all of it.
        With ``episode.rate_scale`` the episode's arrival times are then divided by it.
        """
        ep = self.episode
        cfg = replace(self.workload, num_groups=ep.groups, max_per_group=ep.max_per_group,
                      num_requests=ep.requests, arrival=ep.arrival, seed=int(seed))
        pool = self.pool if ep.window_s is None else self.pool.window(ep.window_s, int(seed))
        episode = sample_workload(pool, cfg, groups_from_pool=True)
        if ep.rate_scale != 1.0:  # 1.0 leaves every float as it is
            episode = Workload(f"{episode.name}/rate{ep.rate_scale:g}x",
                               tuple(r.with_arrival(r.arrival_time / ep.rate_scale) for r in episode),
                               episode.arrivals)
        return episode

    @property
    def max_episode_requests(self) -> int:
        """An upper bound of the requests in one episode (observation bounds; ``rate_scale`` changes
        when the requests arrive, not how many there are)."""
        ep = self.episode
        n = len(self.pool)
        if ep.groups is not None:
            sizes = sorted((len(m) for m in self.pool.groups().values()), reverse=True)
            if ep.max_per_group is not None:
                sizes = [min(s, ep.max_per_group) for s in sizes]
            n = sum(sizes[: ep.groups])
        elif ep.max_per_group is not None:
            n = sum(min(len(m), ep.max_per_group) for m in self.pool.groups().values())
        if ep.window_s is not None:
            n = min(n, self.pool.max_window_requests(ep.window_s))
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
        if source is not None and isinstance(data["workload"], Mapping):
            base = Path(source).parent
            workload_data = dict(data["workload"])
            if "data_dir" in workload_data:
                workload_data["data_dir"] = _anchor_path(workload_data["data_dir"], base)
            if "path" in workload_data:
                data_dir = workload_data.get("data_dir")
                workload_data["path"] = _anchor_path(workload_data["path"], base, data_root=True,
                                                     data_dir=data_dir if isinstance(data_dir, str) else None)
            data = {**data, "workload": workload_data}
        workload = WorkloadConfig.from_mapping(data["workload"], where=f"{where}: workload")
        sampled = [k for k in _EPISODE_KEYS if getattr(workload, k) is not None]
        if sampled:
            raise ConfigError(f"{where}: workload.{sampled[0]} belongs in the 'episode' section "
                              f"(groups, max_per_group, requests, arrival)")
        episode = data.get("episode")
        if isinstance(episode, Mapping) and source is not None:
            episode = {**episode, "arrival": _anchor_trace(episode.get("arrival"), Path(source).parent)}
            data = {**data, "episode": episode}
        engine = data.get("engine")
        if source is not None and isinstance(engine, Mapping) and isinstance(engine.get("model_dir"), str):
            beside = Path(source).parent / Path(engine["model_dir"]).expanduser()
            if beside.is_dir():  # else the engine's own rule (as given, else the repository's)
                data = {**data, "engine": {**engine, "model_dir": str(beside.resolve())}}
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


def _anchor_path(value: Any, base_dir: Path, *, data_root: bool = False, data_dir: str | None = None) -> Any:
    """A relative path named in a scenario file, made absolute against the file's folder. With
    ``data_root`` (``workload.path``) one not found there is looked up under the data root
    (``data_dir``, the workload's, else ``$FEATHER_DATA_DIR``: :func:`resolve_custom_path`)."""
    if not isinstance(value, str) or not value:
        return value
    path = Path(value).expanduser()
    if path.is_absolute():
        return str(path)
    if data_root:
        return str(resolve_custom_path(path, base_dir, data_dir).resolve())
    return str((base_dir / path).resolve())


def _anchor_trace(arrival: Any, base_dir: Path) -> Any:
    """A ``trace:FILE[:RATE]`` arrival whose FILE lies in the scenario file's folder (or below it),
    with FILE made absolute (a path in a scenario is relative to the scenario); any other spec
    unchanged (a FILE of the data root's traces/ is found there when the episode is drawn)."""
    if not isinstance(arrival, str) or not arrival.strip().lower().startswith("trace:"):
        return arrival
    process = parse_arrival(arrival, base_dir)  # checks the spec and finds FILE
    if isinstance(process, TraceFileArrivals) and process.path.is_relative_to(base_dir):  # found beside it
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
        if path.suffix in (".yaml", ".yml") and not path.is_file() and not (SCENARIO_DIR / path).is_file():
            raise ConfigError(f"scenario file not found: {path}")
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


# -- python -m feather_env.scenarios new -------------------------------------------------------------
def describe_trace(scenario: Scenario) -> list[str]:
    """What a scenario's pool holds, in a few lines: requests, time span and rate, prompt and output
    lengths, prefix groups, the prompt tokens a perfect prefix cache would serve and the share of
    them an LRU cache the size of the engine's KV cache would keep serving."""
    import numpy as np

    pool = scenario.pool
    prompt = np.array([r.prompt_len for r in pool])
    output = np.array([r.output_len for r in pool])
    times = np.array([r.arrival_time for r in pool])
    block = scenario.engine.block_size
    kv = scenario.kv_capacity_tokens
    cached = pool.cached_prompt_tokens(block)
    cached_lru = pool.cached_prompt_tokens(block, kv)
    scale = scenario.episode.rate_scale
    if pool.arrivals == "trace" and times.max() > times.min():
        span = float(times.max() - times.min())
        rate = (len(pool) - 1) / span
        timing = f"timestamps over {span:,.1f} s, a mean rate of {rate:.2f} requests/s"
        if scale != 1.0:
            timing += f"; episodes replay it {scale:g}x as fast ({rate * scale:.2f} requests/s)"
    else:
        timing = "no timestamps (an episode arrives as a burst unless episode.arrival says otherwise)"
    return [
        f"{len(pool)} requests, {timing}",
        f"prompts: mean {prompt.mean():,.0f}, median {np.median(prompt):,.0f}, max {prompt.max():,} tokens; "
        f"outputs: mean {output.mean():,.1f}, max {output.max():,} tokens",
        f"prefix sharing: a perfect prefix cache (blocks of {block} tokens, no eviction) would serve "
        f"{cached / prompt.sum():.1%} of the {int(prompt.sum()):,} prompt tokens; {pool.num_groups} prefix "
        f"groups",
        f"prefix reuse: an LRU cache of the engine's {kv:,} tokens would serve "
        f"{cached_lru / prompt.sum():.1%} (requests one after another, in arrival order)",
        f"KV cache: {scenario.engine.kv_cache_gib:g} GiB = {kv:,} tokens, "
        f"{kv / (prompt.mean() + output.mean()):.1f}x a mean request; episodes of up to "
        f"{scenario.max_episode_requests} requests",
    ]


def new_scenario(trace: str | Path, out: str | Path, *, kv_cache_gib: float = 4.0, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 8192, cpu_cores: str | None = None,
                 window_s: float | None = None, arrival: str | None = None, description: str | None = None,
                 force: bool = False, format: str = "requests", block_tokens: int | None = None,
                 rate_scale: float | None = None) -> tuple[Scenario, dict[str, Any]]:
    """A ``custom`` scenario for ``trace`` written to ``out`` (the trace's path relative to it), after
    its pool loaded and passed every check: nothing is written when the trace or a knob is bad.

    ``format``, ``block_tokens`` (``workload.format``, ``workload.block_tokens``: a Mooncake trace)
    and ``rate_scale`` (``episode.rate_scale``) are written when given (``format`` when not the
    default)."""
    import os

    out, trace = Path(out), Path(trace)
    if out.suffix not in (".yaml", ".yml"):
        raise ConfigError(f"--out must name a .yaml file, got {str(out)!r}")
    try:
        check_output_file(out, "--out", "a .yaml file")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if out.exists() and not force:
        raise ConfigError(f"{out} exists; choose another --out or pass --force to replace it")
    if not trace.is_file():
        raise ConfigError(f"trace file not found: {trace}")
    rel = os.path.relpath(trace.resolve(), out.resolve().parent)
    engine: dict[str, Any] = {"kv_cache_gib": kv_cache_gib, "max_num_seqs": max_num_seqs,
                              "max_num_batched_tokens": max_num_batched_tokens}
    if cpu_cores is not None:
        engine["cpu_cores"] = cpu_cores
    episode: dict[str, Any] = {}
    if window_s is not None:
        episode["window_s"] = window_s
    if arrival is not None:
        episode["arrival"] = arrival
    if rate_scale is not None:
        episode["rate_scale"] = rate_scale
    workload: dict[str, Any] = {"kind": "custom", "path": rel}
    if format != "requests":
        workload["format"] = format
    if block_tokens is not None:
        workload["block_tokens"] = block_tokens
    data: dict[str, Any] = {
        "description": description or f"your own requests: {trace.name}",
        "workload": {**workload, "max_prompt_tokens": None},
        "episode": episode,
        "engine": engine,
    }
    scenario = Scenario.from_mapping(out.stem, data, str(out))
    scenario.pool  # noqa: B018 - loads and checks every request before anything is written
    return scenario, data


def main(argv: list[str] | None = None) -> int:
    """``python -m feather_env.scenarios new ...`` (see :func:`new_scenario`) and ``list``."""
    import argparse
    import shlex
    import sys

    import yaml

    from feather_env.workloads import DataNotFoundError, WorkloadError

    p = argparse.ArgumentParser(prog="python -m feather_env.scenarios",
                                description="Scenarios: list them, or make one from your own trace.")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the scenarios in configs/scenarios/")
    new = sub.add_parser("new", help="a scenario from a JSON-lines or CSV trace of your requests, or a "
                         "Mooncake trace (feather_env.workloads.custom)")
    new.add_argument("--trace", required=True, help="the trace (.jsonl or .csv)")
    new.add_argument("--format", choices=("requests", "mooncake"), default="requests",
                     help="requests: a prompt per row (default); mooncake: a Mooncake trace (timestamp, "
                     "input_length, output_length, hash_ids)")
    new.add_argument("--block-tokens", type=int, default=None, help="--format mooncake: tokens per hash id "
                     "(default 512, the trace's own lengths; less scales every length by N/512)")
    new.add_argument("--out", required=True, help="the scenario file to write (.yaml)")
    new.add_argument("--kv-cache-gib", type=float, default=4.0, help="the engine's KV cache (GiB; default 4)")
    new.add_argument("--max-num-seqs", type=int, default=64, help="max running batch (default 64)")
    new.add_argument("--max-num-batched-tokens", type=int, default=8192, help="token budget of a step")
    new.add_argument("--cpu-cores", default=None, help='pin the engine (CPU backend), e.g. "1"')
    new.add_argument("--window-s", type=float, default=None, help="episodes are time windows of this many "
                     "seconds of the trace (default: an episode is the whole trace)")
    new.add_argument("--arrival", default=None, help="burst | poisson:RATE | trace (default: the trace's "
                     "timestamps when it has them, else burst)")
    new.add_argument("--rate-scale", type=float, default=None, help="divide an episode's arrival times by "
                     "this (2: the trace replayed twice as fast; after the --window-s window is drawn)")
    new.add_argument("--description", default=None)
    new.add_argument("--force", action="store_true", help="replace --out if it exists")
    args = p.parse_args(argv)
    if args.command == "list":
        for name in available_scenarios():
            print(f"{name}: {load_scenario(name).description}")
        return 0
    try:
        scenario, data = new_scenario(args.trace, args.out, kv_cache_gib=args.kv_cache_gib,
                                      max_num_seqs=args.max_num_seqs,
                                      max_num_batched_tokens=args.max_num_batched_tokens,
                                      cpu_cores=args.cpu_cores, window_s=args.window_s, arrival=args.arrival,
                                      description=args.description, force=args.force, format=args.format,
                                      block_tokens=args.block_tokens, rate_scale=args.rate_scale)
        lines = describe_trace(scenario)
    except (ConfigError, DataNotFoundError, WorkloadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"trace {args.trace}:")
    for line in lines:
        print(f"  {line}")
    command = shlex.join(sys.argv[1:] if argv is None else argv)
    header = (f"# Made by: python -m feather_env.scenarios {command}\n"
              "# Paths are relative to this file. Keys: feather_env/scenarios.py (docstring).\n")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(header + yaml.safe_dump(data, sort_keys=False))
    episode = (f"a {args.window_s:g} s window of the trace, drawn per seed" if args.window_s
               else "the whole trace")
    if scenario.episode.rate_scale != 1.0:
        episode += f", replayed {scenario.episode.rate_scale:g}x as fast"
    print(f"wrote {args.out}: an episode is {episode}")
    print(f"next: python evaluate.py advise --scenario {args.out} --goodput ttft:5000 tpot:50 "
          f"--out runs/{Path(args.out).stem}-advice   # the best scheduler and budget for your SLOs")
    print(f"  or: python train.py --agent ucb --config configs/runs/ucb.yaml --scenario {args.out} "
          f"--out runs/{Path(args.out).stem}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
