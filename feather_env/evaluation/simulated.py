"""Schedulers on the simulator: a scenario's episodes served by each scheduler, reported as on the engine.

``evaluate.py --backend sim`` serves the same episodes (the same requests, token ids and arrival
times) with every scheduler on :class:`~feather_env.engines.sim_backend.SimBackend`, each
scheduler answering its own decisions as it does when serving
(:func:`feather_env.env.play_episode`: ``fcfs`` admits every arrival in order, a ``feather:PATH``
policy file answers the Chunked Hash Tree's candidates, ``lpm``/``dfs-weight``/``svf`` order the
queue and admit), on the simulator's clock. A run is a :class:`~feather_env.evaluation.report.Run`
of kind :data:`SIMULATOR`, so its metrics, tables and results folder are the in-process
evaluation's (:mod:`feather_env.evaluation.report`), and ``evaluate.py compare`` merges it with
real-engine folders.

Several episodes (``seeds``) are served back to back: each episode's timeline is shifted to start
when the previous one ended and its request ids get the episode seed as a prefix, so
``output_throughput`` is the output tokens of all episodes over their summed durations (as
:func:`agents.base.evaluate` counts it) and the latency percentiles are over every request.

The simulator takes stretches of identical decode steps at once, so it knows when a request's first
and last tokens came, not each step's: its inter-token latencies (``itl``) are each request's decode
time spread evenly over its tokens (``tpot`` is exact). What only the real engine measures is
``None`` here: the scheduler's own time (the simulator charges
the engine's step time only), other processes' CPU, the isolated probes (slowdown), the running
batch per engine step.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from feather_env.evaluation.report import SIMULATOR, Run
from feather_env.records import RequestTimeline
from feather_env.resolved import ResolvedEnv, resolve_env, slowdown_range
from feather_env.scenarios import Scenario
from feather_env.workloads import Workload
from scheduler_runtime.config import ConfigError

__all__ = ["SimConfig", "episodes_workload", "evaluate_simulated", "resolve_schedulers"]

#: The in-process figures the simulator does not measure (``None`` in its runs, same keys).
_NOT_MEASURED = ("decode_tokens", "decode_seconds", "mean_running_batch", "mean_decode_batch", "decode_steps",
                 "step_seconds", "scheduler_decision_s", "scheduler_overhead_frac", "scheduler_arrival_frac",
                 "foreign_cpu", "max_slowdown", "mean_slowdown")


@dataclass(frozen=True)
class SimConfig:
    """How the simulated evaluation runs (recorded in the results JSON).

    Attributes:
        schedulers: scheduler names, served in this order.
        seeds: the scenario's episode seeds, served back to back by every scheduler.
        profile: the simulator's calibrated profile (``None``: the shipped one).
        label: prefix of the run labels (``LABEL/scheduler``).
        engine_slowdown: the simulator's step times multiplied by this factor (a machine slower than the
            one its profile was fitted on; the environment's ``engine_slowdown``).
        slos: the latency SLOs (ms, ``--goodput``'s) that a setting's admission rule (``NAME~RULE``)
            reads; ``None``: none (a rule that needs them is refused).
    """

    schedulers: tuple[str, ...]
    seeds: tuple[int, ...] = (0,)
    profile: str | None = None
    label: str | None = None
    engine_slowdown: float = 1.0
    slos: dict[str, float] | None = None

    def __post_init__(self) -> None:
        slowdown_range(self.engine_slowdown)  # one factor > 0, or a clear error
        if not self.seeds:
            raise ConfigError("the simulated evaluation needs at least one episode")
        if any(s < 0 for s in self.seeds):
            raise ConfigError(f"episode seeds must be >= 0, got {list(self.seeds)}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["schedulers"], d["seeds"] = list(self.schedulers), list(self.seeds)
        return d


def episodes_workload(scenario: Scenario, seeds: Sequence[int]) -> Workload:
    """The episodes of ``seeds`` as one workload (what the results describe and fingerprint); one
    episode is exactly :meth:`Scenario.episode_workload`, so it matches a real-engine run of it."""
    if len(seeds) == 1:
        return scenario.episode_workload(int(seeds[0]))
    requests = [dataclasses.replace(r, request_id=f"{s}/{r.request_id}")
                for s in seeds for r in scenario.episode_workload(int(s))]
    return Workload(f"{scenario.name}/episodes{seeds[0]}-{seeds[-1]}", tuple(requests),
                    scenario.episode_workload(int(seeds[0])).arrivals)


def _shifted(timelines: Sequence[RequestTimeline], offset: float, prefix: str) -> list[RequestTimeline]:
    out = []
    for t in timelines:
        gaps = t.tokens - 1
        t = dataclasses.replace(t, itl=[(t.finish - t.first_token) / gaps] * gaps if gaps > 0 else [])
        t.request_id = prefix + t.request_id
        for key in ("arrival", "first_scheduled", "first_token", "finish", "last_output"):
            setattr(t, key, getattr(t, key) + offset)
        out.append(t)
    return out


def resolve_schedulers(scenario: Scenario, config: SimConfig) -> dict[str, ResolvedEnv]:
    """Each scheduler's environment of the simulated evaluation, checked (names and knobs) and resolved:
    the scenario resolved once on the simulator, each scheduler's differing from it in the scheduler
    alone (what :func:`evaluate_simulated` serves, and ``evaluate.py --check`` prints)."""
    from feather_env.evaluation.inprocess import validate_schedulers

    names = validate_schedulers(config.schedulers, scenario.scheduler.chunk_size, scenario.scheduler.max_wait,
                                slos=config.slos)
    resolved = resolve_env(scenario, "sim", profile=config.profile, engine_slowdown=config.engine_slowdown,
                           goodput_slos=config.slos or None)
    return {name: resolved.with_scheduler(name) for name in names}


def evaluate_simulated(scenario: Scenario, config: SimConfig, *, log: Callable[[str], None] | None = print
                       ) -> list[Run]:
    """Serve ``config.seeds`` of ``scenario`` once per scheduler on the simulator (module docstring).

    Raises:
        ConfigError: a bad scheduler name or profile (before anything is served).
        EngineError: a request not served exactly once with its tokens.
    """
    from feather_env.env import FeatherEnv, play_episode

    envs = {name: FeatherEnv.from_resolved(r) for name, r in resolve_schedulers(scenario, config).items()}
    multi = len(config.seeds) > 1
    runs = []
    for name, env in envs.items():
        t0 = time.perf_counter()
        timelines: list[RequestTimeline] = []
        episodes: list[dict[str, Any]] = []
        stats: dict[str, Any] = {}
        end = 0.0
        for seed in config.seeds:
            metrics = play_episode(env, episode_seed=int(seed))
            own = env.backend.timelines()
            offset = end - min(t.arrival for t in own) if timelines else 0.0
            timelines += _shifted(own, offset, f"{seed}/" if multi else "")
            end = max(t.finish for t in timelines)
            episodes.append(metrics)
            runtime = env.backend.runtime
            for key, value in (runtime.snapshot() if runtime is not None else {}).items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    stats[key] = stats.get(key, 0) + value
                else:
                    stats[key] = value
        wall = time.perf_counter() - t0
        label = f"{config.label}/{name}" if config.label else name
        extra: dict[str, Any] = {
            "scheduler": name,
            "decode_tok_s": float(np.mean([e["decode_tok_s"] for e in episodes])),
            "engine_steps": int(sum(e["engine_steps"] for e in episodes)),
            "preemptions": int(sum(e["preemptions"] for e in episodes)),
            "scheduler_stats": stats,
            **dict.fromkeys(_NOT_MEASURED),
            "attempts": 1,
            "foreign_cpu_attempts": [],
            "wall_s": wall,
        }
        runs.append(Run(label, SIMULATOR, timelines, extra=extra))
        if log is not None:
            m = episodes[-1]
            figures = f", {m['output_throughput']:.1f} output tok/s, hit {m['prefix_hit_rate']:.0%}"
            log(f"  {label}: {len(config.seeds)} episode(s) in {wall:.1f} s" + ("" if multi else figures))
    for env in envs.values():
        env.close()
    return runs
