"""Fit the simulator's step-time model on real-engine episodes, and measure its error on fresh ones.

    python -m feather_env.calibrate --out configs/profiles/cpu-tiny-llama.json
    python -m feather_env.calibrate --validate configs/profiles/cpu-tiny-llama.json --json PATH
    python -m feather_env.calibrate --scenario mine.yaml --out mine-profile.json   # on your workload
    python -m feather_env.calibrate --validate NEW.json --rescore OLD-VALIDATION.json  # no engine

Calibration serves episodes of several scenarios on the real engine
(:class:`~feather_env.engines.vllm_backend.VLLMBackend`, the engine pinned to one core) with several
schedulers (their own answers: :func:`~feather_env.env.play_episode`), records every engine
step (its requests in the persistent batch's order and its wall time), and fits
:class:`~feather_env.step_model.StepCostModel` to them. Admission, prefix caching, eviction,
chunked prefill and the batch's order are not fitted: the simulator models them exactly
(:mod:`feather_env.engines`); only the step time is.

Validation serves *fresh* episodes (other seeds than the calibration, with and without KV
pressure, burst and Poisson arrivals, several schedulers) on the real engine and on the
simulator with the new profile, the same episode and the same policy, and writes::

    {"makespan_mape": ..., "latency_median_ape": ..., "hit_rate_abs_err": ..., "n": ..., ...}

- ``makespan_mape``: mean over episodes of |sim - real| / real of the episode's duration;
- ``latency_median_ape``: the median over all requests of all episodes of |sim - real| / real of
  the request's end-to-end latency (requests matched by id);
- ``hit_rate_abs_err``: mean over episodes of |sim - real| of the prefix-cache hit rate;
- ``mean_ttft_mape``, ``mean_tpot_mape``: mean over episodes of |sim - real| / real of the episode's
  mean TTFT and mean TPOT (what a goodput SLO reads);
- ``n``: episodes compared (runs under foreign CPU load above ``MAX_FOREIGN_LOAD`` are re-run once,
  then left out and counted in ``excluded_under_load``).

``--rescore`` scores another profile on the engine episodes an earlier ``--validate --scenario
... --json`` recorded: each re-simulated (same scenario, scheduler and seed) against the recorded
figures, so profiles are compared on the very same engine runs without serving them again.

``--scenario NAME`` (a name or a scenario file, e.g. your own trace's) replaces both plans by that
scenario's episodes (:func:`scenario_plan`): the engine is then calibrated, and validated, on the
workload it will serve. ``--schedulers a,b`` (with ``--scenario``) serves them with other
schedulers, e.g. ``group-cap-3`` or ``feather:POLICY``: the error where a policy is trained.
Every input error (a flag out of range, a scenario or file that cannot be read, a scheduler that
does not exist, an output that cannot be written) is one line and exit status 2, before an engine
starts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from feather_env.engines.vllm_engine import EngineConfig, use_in_process_engine
from feather_env.hostload import ForeignLoad
from feather_env.records import StepRequest
from feather_env.reporting import machine_info, write_json
from feather_env.scenarios import Scenario, load_scenario
from feather_env.serving import env_scheduler_config
from feather_env.serving_metrics import serving_metrics
from feather_env.step_model import (
    DEFAULT_PROFILE,
    FEATURE_NAMES,
    PROFILE_VERSION,
    fit_step_model,
    load_profile,
    step_features,
)

__all__ = ["CALIBRATION_PLAN", "DEFAULT_PROFILE", "PROFILE_VERSION", "VALIDATION_PLAN", "EpisodeSpec",
           "load_profile", "main", "scenario_plan"]

#: Episodes during which other processes used more than this share of the machine are re-run.
MAX_FOREIGN_LOAD = 0.10


@dataclass(frozen=True)
class EpisodeSpec:
    """One episode to serve: a scenario (a name, a file, or a loaded one) with overrides, a scheduler,
    an episode seed."""

    scenario: str | Scenario
    scheduler: str
    seed: int
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    label: str = ""

    def load(self) -> Scenario:
        return load_scenario(self.scenario, self.overrides)


def _kv(gib: float, prompt: int, groups: int, per: int, arrival: str = "burst", out: int | None = None,
        seqs: int = 64) -> dict[str, dict[str, Any]]:
    workload: dict[str, Any] = {"max_prompt_tokens": prompt}
    if out is not None:
        workload["max_output_tokens"] = out
    return {"workload": workload, "episode": {"groups": groups, "max_per_group": per, "arrival": arrival},
            "engine": {"kv_cache_gib": gib, "max_num_seqs": seqs}}


_SCHEDULERS = ("fcfs", "lpm", "feather-heuristic")
#: Calibration: whole leval-kv-pressure episodes, smaller L-Eval episodes under KV pressure and
#: with ample KV (burst and Poisson, prompts of 2K-8K), and ShareGPT; episode seeds 1-99.
CALIBRATION_PLAN: tuple[EpisodeSpec, ...] = tuple(
    [EpisodeSpec("leval-kv-pressure", s, seed, {}, f"full-{s}")
     for s, seed in (("fcfs", 1), ("feather-heuristic", 2), ("lpm", 3))]
    + [EpisodeSpec("leval-kv-pressure", s, seed, _kv(0.05, 4096, 6, 6), f"pressure-4k-{s}")
       for s, seed in zip(_SCHEDULERS, (11, 12, 13), strict=True)]
    + [EpisodeSpec("leval-kv-pressure", s, seed, _kv(0.1, 8192, 4, 8), f"pressure-8k-{s}")
       for s, seed in zip(_SCHEDULERS, (14, 15, 16), strict=True)]
    + [EpisodeSpec("leval-kv-pressure", s, seed, _kv(1.0, 2048, 8, 8, out=64), f"ample-2k-{s}")
       for s, seed in zip(_SCHEDULERS, (17, 18, 19), strict=True)]
    + [EpisodeSpec("leval-kv-pressure", s, seed, _kv(0.05, 4096, 6, 6, arrival="poisson:1.5"),
                   f"poisson-4k-{s}") for s, seed in zip(_SCHEDULERS, (20, 21, 22), strict=True)]
    + [EpisodeSpec("sharegpt", "fcfs", 23, {"episode": {"requests": 30}}, "sharegpt-fcfs")]
)
#: Validation: fresh episode seeds (1000+), with and without KV pressure, burst and Poisson, four
#: orderings; whole leval-kv-pressure episodes first.
VALIDATION_PLAN: tuple[EpisodeSpec, ...] = tuple(
    [EpisodeSpec("leval-kv-pressure", s, 1000 + i, {}, f"full-{s}")
     for i, s in enumerate(("fcfs", "feather-heuristic", "lpm", "dfs-weight"))]
    + [EpisodeSpec("leval-kv-pressure", s, 1010 + i, _kv(0.06, 4096, 6, 6), f"pressure-{s}")
       for i, s in enumerate(_SCHEDULERS)]
    + [EpisodeSpec("leval-kv-pressure", s, 1020 + i, _kv(0.12, 8192, 5, 6), f"pressure-8k-{s}")
       for i, s in enumerate(_SCHEDULERS)]
    + [EpisodeSpec("leval-kv-pressure", s, 1030 + i, _kv(1.0, 4096, 6, 6, out=48), f"ample-{s}")
       for i, s in enumerate(_SCHEDULERS)]
    + [EpisodeSpec("leval-kv-pressure", s, 1040 + i, _kv(0.06, 4096, 6, 6, arrival="poisson:1.0"),
                   f"poisson-{s}") for i, s in enumerate(_SCHEDULERS)]
)


def scenario_plan(scenario: str, episodes: int = 1, *, validation: bool = False,
                  schedulers: Sequence[str] | None = None) -> tuple[EpisodeSpec, ...]:
    """Episodes of one scenario to calibrate on (seeds 1, 2, ...; fcfs, lpm, feather-heuristic each)
    or to validate on (fresh seeds 1000, 1001, ...; dfs-weight too), ``episodes`` per scheduler.
    ``schedulers`` replaces those: e.g. the ``group-cap-K`` rule a policy will be trained against,
    whose batches the built-in schedulers never form."""
    if schedulers is None:
        schedulers = (*_SCHEDULERS, "dfs-weight") if validation else _SCHEDULERS
    first = 1000 if validation else 1
    name = Path(scenario).stem
    return tuple(EpisodeSpec(scenario, s, first + i * len(schedulers) + j, {}, f"{name}-{s}-{i}")
                 for i in range(episodes) for j, s in enumerate(schedulers))


class _Engines:
    """One real engine per distinct engine configuration, built on first use (one at a time);
    ``shared``: one engine to serve every episode on (not closed here)."""

    def __init__(self, shared: Any = None) -> None:
        self.config: EngineConfig | None = None
        self.backend: Any = None
        self.shared = shared

    def get(self, spec: EpisodeSpec) -> Any:
        """The engine of ``spec``'s scenario; a new one first serves a throw-away episode of it
        (another seed): the first steps after start-up are much slower than steady state."""
        from feather_env.engines.vllm_backend import VLLMBackend

        if self.shared is not None:
            return self.shared
        config = spec.load().engine_config()
        if self.config != config:
            self.close()
            self.backend = VLLMBackend(config)
            self.config = config
            _serve(EpisodeSpec(spec.scenario, spec.scheduler, spec.seed + 500_000, _warm_up(spec)),
                   self.backend, record=False)
        return self.backend

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()
            self.backend = None
            self.config = None


#: A trace's throw-away warm-up episode is a window this long (trace seconds), not a whole one.
WARM_UP_WINDOW_S = 20.0


def _warm_up(spec: EpisodeSpec) -> dict[str, dict[str, Any]]:
    """The warm-up episode's overrides: ``spec``'s, with a trace's window cut to
    :data:`WARM_UP_WINDOW_S` (start-up is over within it; a whole window could take minutes)."""
    window = spec.load().episode.window_s
    if window is None or window <= WARM_UP_WINDOW_S:
        return spec.overrides
    return {**spec.overrides, "episode": {**spec.overrides.get("episode", {}), "window_s": WARM_UP_WINDOW_S}}


def _serve(spec: EpisodeSpec, backend: Any, record: bool) -> tuple[dict[str, Any], Any, float]:
    """One episode on ``backend`` with the scheduler's own answers: (metrics, env, foreign load)."""
    from feather_env.env import FeatherEnv, play_episode

    backend.record_steps = record
    env = FeatherEnv(spec.load(), backend, scheduler=spec.scheduler)
    with ForeignLoad(env.engine_config.cores) as load:
        metrics = play_episode(env, episode_seed=spec.seed)
    return metrics, env, load.fraction


def _serve_quiet(spec: EpisodeSpec, backend: Any, max_foreign: float, *, record: bool,
                 log: Callable[[str], None] | None = None) -> tuple[dict[str, Any], Any, float]:
    """:func:`_serve`, served once more when other processes used more than ``max_foreign`` of the
    engine's cores during it (they slow it); the second run's figures stand, whatever its load."""
    for attempt in range(2):
        metrics, env, foreign = _serve(spec, backend, record=record)
        if foreign <= max_foreign or attempt:
            break
        (log or _log)(f"  {spec.label}: foreign CPU {foreign:.0%} during the episode: re-running")
    return metrics, env, foreign


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def calibrate(plan: Sequence[EpisodeSpec], steps_out: str | Path | None = None, *,
              backend: Any = None, max_foreign: float = MAX_FOREIGN_LOAD) -> dict[str, Any]:
    """Serve ``plan`` on the real engine, fit the step model, and return the profile.

    ``steps_out``: also write every measured step (JSON: seconds, the requests waiting as it
    started, and its requests' columns), for analysis of the fit. ``backend``: a
    :class:`~feather_env.engines.vllm_backend.VLLMBackend` to serve every episode on (else one engine
    per engine configuration is started). ``max_foreign``: episodes during which other processes
    used more of the machine are re-run once, then left out.

    Raises:
        RuntimeError: every episode was left out (the machine was never quiet enough).
    """
    engines = _Engines(backend)
    steps: list[tuple[list[Any], float]] = []
    waiting: list[int] = []  # the requests waiting as each step started (in the steps file)
    episodes = []
    t0 = time.perf_counter()
    try:
        for i, spec in enumerate(plan):
            backend = engines.get(spec)
            metrics, _, foreign = _serve_quiet(spec, backend, max_foreign, record=True)
            if foreign > max_foreign:
                _log(f"  {spec.label}: foreign CPU {foreign:.0%} again: left out of the fit")
                continue
            measured = [(m.batch, m.seconds) for m in backend.measured_steps]
            steps.extend(measured)
            waiting.extend(m.waiting for m in backend.measured_steps)
            episodes.append({"label": spec.label, "seed": spec.seed, "scheduler": spec.scheduler,
                             "steps": len(measured), "duration_s": metrics["duration"],
                             "prefix_hit_rate": metrics["prefix_hit_rate"], "foreign_cpu": foreign})
            _log(f"[calibrate {i + 1}/{len(plan)} {time.perf_counter() - t0:5.0f}s] {spec.label}: "
                 f"{metrics['completed']} requests, {len(measured)} steps, {metrics['duration']:.1f} s, "
                 f"hit {metrics['prefix_hit_rate']:.0%}, foreign CPU {foreign:.0%}")
    finally:
        engines.close()
    if len(steps) < len(FEATURE_NAMES):
        raise RuntimeError(
            f"{len(steps)} engine steps measured in {len(episodes)} of {len(plan)} episodes: too few to fit "
            f"(episodes with other processes using more than {max_foreign:.0%} of the machine are left out): "
            "run it on a quieter machine, or raise --max-foreign")
    if steps_out:
        columns = [[[r.num_tokens, r.num_computed, r.group, r.shared_tokens, int(r.is_prefill)] for r in b]
                   for b, _ in steps]
        write_json(steps_out, {"episodes": episodes, "steps": [
            {"seconds": t, "waiting": w, "batch": c}
            for (_, t), w, c in zip(steps, waiting, columns, strict=True)]})
    return fit_profile(steps, episodes)


def load_steps(path: str | Path) -> tuple[list[tuple[list[StepRequest], float]], list[dict[str, Any]]]:
    """Steps and episodes written by ``--steps-out`` (to fit again without an engine); a file that is
    not one is a :class:`~scheduler_runtime.config.ConfigError` naming it."""
    from scheduler_runtime.config import ConfigError, load_mapping

    path = Path(path)
    if path.suffix != ".json":
        raise ConfigError(f"{path}: a steps file is the JSON --steps-out writes")
    data = load_mapping(path)
    try:
        steps = [([StepRequest(int(q), int(c), int(g), int(h), bool(pre)) for q, c, g, h, pre in s["batch"]],
                  float(s["seconds"])) for s in data["steps"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{path}: not a steps file of --steps-out ({type(exc).__name__}: {exc})") from None
    if len(steps) < len(FEATURE_NAMES) or not all(np.isfinite(t) and t > 0 for _, t in steps):
        raise ConfigError(f"{path}: needs at least {len(FEATURE_NAMES)} steps, each of a finite time > 0")
    return steps, list(data.get("episodes", []))


def load_steps_files(paths: str) -> tuple[list[tuple[list[StepRequest], float]], list[dict[str, Any]]]:
    """The steps and episodes of comma-separated ``--steps-out`` files, in order (:func:`load_steps`
    on each): a fit over several runs, e.g. whole windows served by different schedulers."""
    from scheduler_runtime.config import ConfigError

    names = [name.strip() for name in paths.split(",")]
    if not all(names) or len(set(names)) != len(names):
        raise ConfigError(f"--from-steps {paths!r}: distinct comma-separated files")
    steps: list[tuple[list[StepRequest], float]] = []
    episodes: list[dict[str, Any]] = []
    for name in names:
        more, eps = load_steps(name)
        steps += more
        episodes += eps
    return steps, episodes


def fit_profile(steps: Sequence[tuple[Sequence[StepRequest], float]],
                episodes: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Fit the step model to measured steps; the profile JSON (see the module docstring)."""
    model, mape = fit_step_model(steps)
    _log(f"fit on {len(steps)} steps: coef {dict(zip(FEATURE_NAMES, model.coef, strict=True))}, "
         f"cache {model.cache_tokens:.0f} tokens, step MAPE {mape:.3f}")
    feats = np.array([step_features(b, model.cache_tokens) for b, _ in steps])
    times = np.array([t for _, t in steps])
    pred = feats @ np.asarray(model.coef)
    return {
        "version": PROFILE_VERSION,
        "step_model": model.to_dict(),
        "fit": {"step_mape": mape, "steps": len(steps), "episodes": list(episodes),
                "total_seconds_real": float(times.sum()), "total_seconds_pred": float(pred.sum())},
        "measured_on": machine_info(),
        "command": _command_line(),
    }


def _command_line() -> str:
    """The command that is running, as a user typed it (``calibrate`` or ``evaluate.py advise``)."""
    program = Path(sys.argv[0]).name
    head = "python -m feather_env.calibrate" if program == "calibrate.py" else f"python {program}"
    return " ".join([head, *sys.argv[1:]])


def validate(profile_path: str | Path, plan: Sequence[EpisodeSpec], *, backend: Any = None,
             max_foreign: float = MAX_FOREIGN_LOAD) -> dict[str, Any]:
    """Serve ``plan`` on the real engine and on the simulator; the error figures of the docstring
    (``backend``, ``max_foreign``: as :func:`calibrate`)."""
    from feather_env.engines.sim_backend import SimBackend

    load_profile(profile_path)
    engines = _Engines(backend)
    rows: list[dict[str, Any]] = []
    apes: list[float] = []
    excluded = 0
    t0 = time.perf_counter()
    try:
        for i, spec in enumerate(plan):
            scenario = spec.load()
            real, real_env, foreign = _serve_quiet(spec, engines.get(spec), max_foreign, record=False)
            if foreign > max_foreign:
                excluded += 1
                _log(f"  {spec.label}: foreign CPU {foreign:.0%}: left out")
                continue
            real_lat = {t.request_id: t.e2el for t in real_env.backend.timelines()}
            sim, sim_env, _ = _serve(spec, SimBackend(scenario.engine_config(), profile_path), record=False)
            sim_lat = {t.request_id: t.e2el for t in sim_env.backend.timelines()}
            ep_apes = [abs(sim_lat[r] - real_lat[r]) / real_lat[r] for r in real_lat if real_lat[r] > 0]
            apes.extend(ep_apes)
            real_m = serving_metrics(real_env.backend.timelines())
            real_fig = {"mean_ttft_ms": real_m["mean_ttft_ms"], "mean_tpot_ms": real_m["mean_tpot_ms"],
                        "requests": real["completed"], "duration_s": real["duration"],
                        "hit_rate": real["prefix_hit_rate"], "output_throughput": real["output_throughput"]}
            row = {**_compared(spec, real_fig, sim, serving_metrics(sim_env.backend.timelines())),
                   "latency_median_ape": float(np.median(ep_apes)) if ep_apes else None,
                   "foreign_cpu": foreign}
            rows.append(row)
            _log(f"[validate {i + 1}/{len(plan)} {time.perf_counter() - t0:5.0f}s] {spec.label}: "
                 f"makespan real {real['duration']:.1f} s sim {sim['duration']:.1f} s "
                 f"(APE {row['makespan_ape']:.3f}), hit real {real['prefix_hit_rate']:.3f} "
                 f"sim {sim['prefix_hit_rate']:.3f}")
    finally:
        engines.close()
    if not rows:
        raise RuntimeError(f"no validation episode ran with other processes using at most {max_foreign:.0%} "
                           "of the machine: run it on a quieter machine, or raise --max-foreign")
    return {
        **_summary(rows, profile_path),
        "latency_median_ape": float(np.median(apes)) if apes else None,
        "excluded_under_load": excluded,
    }


def _compared(spec: EpisodeSpec, real: dict[str, Any], sim: dict[str, Any],
              sim_m: dict[str, Any]) -> dict[str, Any]:
    """One validation row: the engine's figures of an episode (``real``: ``mean_ttft_ms``,
    ``mean_tpot_ms``, ``requests``, ``duration_s``, ``hit_rate``, ``output_throughput``) beside the
    simulator's (its episode metrics ``sim`` and serving metrics ``sim_m``), and their errors."""
    ape = {k: abs(sim_m[f"mean_{k}_ms"] - real[f"mean_{k}_ms"]) / real[f"mean_{k}_ms"]
           if real[f"mean_{k}_ms"] else None for k in ("ttft", "tpot")}
    return {"label": spec.label, "scheduler": spec.scheduler, "seed": spec.seed,
            "real_mean_ttft_ms": real["mean_ttft_ms"], "sim_mean_ttft_ms": sim_m["mean_ttft_ms"],
            "real_mean_tpot_ms": real["mean_tpot_ms"], "sim_mean_tpot_ms": sim_m["mean_tpot_ms"],
            "mean_ttft_ape": ape["ttft"], "mean_tpot_ape": ape["tpot"],
            "requests": real["requests"], "real_duration_s": real["duration_s"],
            "sim_duration_s": sim["duration"],
            "makespan_ape": abs(sim["duration"] - real["duration_s"]) / real["duration_s"],
            "real_hit_rate": real["hit_rate"], "sim_hit_rate": sim["prefix_hit_rate"],
            "hit_rate_abs_err": abs(sim["prefix_hit_rate"] - real["hit_rate"]),
            "real_output_throughput": real["output_throughput"],
            "sim_output_throughput": sim["output_throughput"]}


def _summary(rows: Sequence[dict[str, Any]], profile_path: str | Path) -> dict[str, Any]:
    return {
        "makespan_mape": float(np.mean([r["makespan_ape"] for r in rows])),
        "hit_rate_abs_err": float(np.mean([r["hit_rate_abs_err"] for r in rows])),
        "mean_ttft_mape": _mean_of(rows, "mean_ttft_ape"),
        "mean_tpot_mape": _mean_of(rows, "mean_tpot_ape"),
        "n": len(rows),
        "profile": str(profile_path),
        "machine": machine_info(),
        "episodes": rows,
    }


def rescore(profile_path: str | Path, validation: dict[str, Any]) -> dict[str, Any]:
    """Score ``profile_path`` on the engine episodes a ``--validate --scenario ... --json`` run recorded
    (``validation``): each episode re-simulated (same scenario, scheduler and seed) against the
    engine's recorded figures; no engine. The same figures as :func:`validate`, without the
    per-request latency error (the recording keeps episode figures only)."""
    from feather_env.engines.sim_backend import SimBackend
    from scheduler_runtime.config import ConfigError

    load_profile(profile_path)
    if not validation.get("plan"):
        raise ConfigError("--rescore needs a validation of one scenario (--validate --scenario ... --json)")
    rows = []
    for old in validation["episodes"]:
        spec = EpisodeSpec(validation["plan"]["scenario"], old["scheduler"], old["seed"], {}, old["label"])
        sim, sim_env, _ = _serve(spec, SimBackend(spec.load().engine_config(), profile_path), record=False)
        real = {k: old[f"real_{k}"] for k in ("mean_ttft_ms", "mean_tpot_ms", "duration_s", "hit_rate",
                                              "output_throughput")}
        rows.append({**_compared(spec, {**real, "requests": old["requests"]}, sim,
                                 serving_metrics(sim_env.backend.timelines())),
                     "foreign_cpu": old.get("foreign_cpu")})
    return {**_summary(rows, profile_path), "rescored": validation.get("command")}


def _mean_of(rows: Sequence[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return float(np.mean(values)) if values else None


def _check_args(args: argparse.Namespace) -> tuple[EpisodeSpec, ...]:
    """Every input of the command line checked before an engine starts; the plan to serve."""
    from feather_env.reporting import check_output_dir
    from feather_env.workloads import DataNotFoundError, WorkloadError
    from scheduler_runtime.config import ConfigError

    if args.episodes is not None and args.episodes < 1:
        raise ConfigError(f"--episodes must be >= 1, got {args.episodes}")
    if not 0 <= args.max_foreign <= 1:
        raise ConfigError(f"--max-foreign must be a share of the machine in [0, 1], got {args.max_foreign}")
    if args.from_steps and not args.out:
        raise ConfigError("--from-steps fits a profile: give --out PROFILE.json")
    for flag, value in (("--out", args.out), ("--json", args.json), ("--steps-out", args.steps_out)):
        if value is None:
            continue
        if not value.endswith(".json"):
            raise ConfigError(f"{flag} must name a .json file, got {value!r}")
        try:
            check_output_dir(Path(value).parent, f"{flag} {value}: its folder")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if args.validate:
        load_profile(args.validate)
    if args.from_steps:
        load_steps_files(args.from_steps)
        return ()
    schedulers = None
    if args.schedulers is not None:
        if args.scenario is None:
            raise ConfigError("--schedulers goes with --scenario (the built-in plans name their own)")
        schedulers = [name.strip() for name in args.schedulers.split(",")]
        if not all(schedulers) or len(set(schedulers)) != len(schedulers):
            raise ConfigError(f"--schedulers {args.schedulers!r}: distinct comma-separated names")
    if args.scenario is not None:
        plan = scenario_plan(args.scenario, args.episodes or 1, validation=bool(args.validate),
                             schedulers=schedulers)
    else:
        plan = VALIDATION_PLAN if args.validate else CALIBRATION_PLAN
        plan = plan[: args.episodes] if args.episodes else plan
    try:
        for spec in plan:  # the scenarios, their pools and the episodes, before any engine
            spec.load().episode_workload(spec.seed)
    except (DataNotFoundError, WorkloadError) as exc:
        raise ConfigError(str(exc)) from None
    for name in schedulers or ():  # a misspelt name or a bad policy file, before any engine
        try:
            env_scheduler_config(name, chunk_size=plan[0].load().scheduler.chunk_size)
        except ConfigError:
            raise
        except ValueError as exc:  # a policy file that does not load
            raise ConfigError(f"--schedulers: {name!r}: {exc}") from None
    return plan


def main(argv: Sequence[str] | None = None, backend: Any = None) -> int:
    """The command line (module docstring); ``backend``: an engine to serve on (see :func:`calibrate`)."""
    from scheduler_runtime.config import ConfigError

    p = argparse.ArgumentParser(description="Fit the simulator on real-engine episodes, or validate it.")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--out", help="serve the calibration episodes, fit, and write a profile here")
    mode.add_argument("--validate", help="profile to validate on fresh episodes")
    p.add_argument("--json", help="with --validate: write the error figures here")
    p.add_argument("--rescore", default=None, metavar="VALIDATION_JSON",
                   help="with --validate: no engine; score the profile on the engine episodes that an "
                   "earlier --validate --scenario ... --json recorded (re-simulated with this profile)")
    p.add_argument("--steps-out", help="with --out: also write every measured step here (JSON)")
    p.add_argument("--from-steps", help="with --out: fit the steps of --steps-out files, comma-separated "
                   "(no engine)")
    p.add_argument("--scenario", default=None, help="calibrate (or validate) on this scenario's episodes "
                   "(a name or a scenario file) instead of the built-in plan")
    p.add_argument("--schedulers", default=None, help="with --scenario: comma-separated schedulers to "
                   "serve its episodes with (default: fcfs, lpm, feather-heuristic; dfs-weight too when "
                   "validating), e.g. group-cap-3 or feather:POLICY to measure the error on the batches a "
                   "policy forms")
    p.add_argument("--max-foreign", type=float, default=MAX_FOREIGN_LOAD, help="re-run, then leave out, an "
                   "episode during which other processes used more than this share of the machine (default "
                   f"{MAX_FOREIGN_LOAD})")
    p.add_argument("--episodes", type=int, default=None,
                   help="serve only the first N episodes of the plan (default: all; validation has "
                        f"{len(VALIDATION_PLAN)}, calibration {len(CALIBRATION_PLAN)}); with --scenario: N "
                        "episodes per scheduler (default 1)")
    args = p.parse_args(argv)
    if args.rescore:
        return _rescore_main(args)
    use_in_process_engine()
    try:
        plan = _check_args(args)
    except ConfigError as exc:
        print(f"calibrate: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    try:
        if args.out:
            profile = (fit_profile(*load_steps_files(args.from_steps)) if args.from_steps
                       else calibrate(plan, args.steps_out, backend=backend, max_foreign=args.max_foreign))
        else:
            result = validate(args.validate, plan, backend=backend, max_foreign=args.max_foreign)
    except RuntimeError as exc:
        print(f"calibrate: {exc}", file=sys.stderr)
        return 1
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(profile, indent=1) + "\n")
        print(f"wrote {args.out}")
        return 0
    print(f"validation on {result['n']} fresh episodes: makespan MAPE {result['makespan_mape']:.3f}, "
          f"latency median APE {result['latency_median_ape']:.3f}, "
          f"hit-rate abs err {result['hit_rate_abs_err']:.4f}")
    if args.json:
        names = list(dict.fromkeys(e.scheduler for e in plan))  # in the plan's order
        result["plan"] = None if args.scenario is None else {"scenario": args.scenario, "schedulers": names}
        flags = [("--scenario", args.scenario), ("--schedulers", args.schedulers),
                 ("--episodes", args.episodes), ("--json", args.json)]
        result["command"] = " ".join(["python -m feather_env.calibrate --validate", args.validate,
                                      *(f"{flag} {value}" for flag, value in flags if value is not None)])
        write_json(args.json, result)
    return 0


def _rescore_main(args: argparse.Namespace) -> int:
    """``--validate PROFILE --rescore VALIDATION_JSON [--json OUT]`` (:func:`rescore`)."""
    from scheduler_runtime.config import ConfigError, load_mapping

    try:
        if not args.validate or args.out or args.scenario or args.schedulers or args.episodes:
            raise ConfigError("--rescore goes with --validate PROFILE (and --json); the episodes are the "
                              "file's")
        result = rescore(args.validate, load_mapping(args.rescore))  # checks the profile first
    except ConfigError as exc:  # names its own file (the profile or the validation)
        print(f"calibrate: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except (OSError, KeyError, TypeError) as exc:  # a validation file without the recorded figures
        print(f"calibrate: error: {args.rescore}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    for r in result["episodes"]:
        print(f"  {r['label']}: makespan {r['makespan_ape']:.1%}, mean TTFT {r['mean_ttft_ape']:.1%}, "
              f"mean TPOT {r['mean_tpot_ape']:.1%}")
    print(f"rescored on {result['n']} recorded episodes: makespan MAPE {result['makespan_mape']:.3f}, "
          f"mean TTFT MAPE {result['mean_ttft_mape']:.3f}, mean TPOT MAPE {result['mean_tpot_mape']:.3f}")
    if args.json:
        result["command"] = (f"python -m feather_env.calibrate --validate {args.validate} "
                             f"--rescore {args.rescore} --json {args.json}")
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
