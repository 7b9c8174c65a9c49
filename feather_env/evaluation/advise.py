"""``evaluate.py advise``: which scheduler and per-step token budget serve your traffic best under your SLOs.

    python evaluate.py advise --scenario mine.yaml --goodput ttft:5000 tpot:50 [--confirm] --out DIR

A user arrives with a trace (a scenario of it: ``python -m feather_env.scenarios new``) and latency
SLOs in ``vllm bench serve``'s terms (``--goodput ttft:MS tpot:MS e2el:MS``: a request is good when
it meets every one; goodput is good requests per second). ``advise`` answers: which setting meets
them best on this traffic, by how much over vLLM's default, and how sure that is.

1. **The simulator fitted to this machine** (:mod:`feather_env.evaluation.probe`): a short probe
   (one window of the trace, shortened: vLLM's own fcfs at the engine's budget and at 512 tokens,
   and a document cap at 256 tokens) is served on the real engine and on the simulator with every
   profile in ``configs/profiles/``; the profile with the smallest error (the worst of the makespan,
   mean TTFT and mean TPOT errors) is used. Over :data:`MAX_PROFILE_ERROR` the probe's own steps are
   fitted into a new profile, written to the output folder, and its in-sample error reported.
   ``--profile`` skips the probe.
2. **The search** (:func:`search`), in the simulator, on held-out windows of the trace (episode
   seeds from ``--first-seed``, never the probe's): every base scheduler (``fcfs``, ``lpm``,
   ``group-cap-K``, learned policy files) x every token budget (``NAME@TOKENS``) on the first
   windows, then the best :attr:`AdviseConfig.shortlist` and vLLM's default on every window.
3. **The report** of the best few and the default, with every figure of ``vllm bench serve``
   (goodput, output throughput, mean and P99 TTFT, TPOT and E2E), the prefix reuse each captures
   against what a perfect prefix cache would (:meth:`~feather_env.workloads.Workload.cached_prompt_tokens`),
   the offered request rate (no scheduler's goodput exceeds it), the hindsight per-window best (how
   much any policy choosing per window could still win over the best constant), and what-ifs: twice
   the KV cache, and 2 and 4 replicas behind the prefix router (:class:`~feather_env.cluster_sim.ClusterSim`).
4. **The recommendation** (:mod:`feather_env.evaluation.recommend`): the best setting (the simplest of
   those within :data:`~feather_env.evaluation.recommend.TIE` of the best's
   goodput: vLLM's fcfs before a baseline ordering before a document cap, the larger budget first)
   when its goodput beats the default's by more than the noise (:attr:`AdviseConfig.noise`) in the
   median window and it loses in none by more than it, else vLLM's default, with the reason
   (arrival-bound load, reuse beyond the cache, ...).
5. ``--confirm``: the recommendation and the default served on the real engine on the first
   held-out window, alternating, ``--repeats`` runs each; the measured goodput ratio beside the
   predicted one. ``--confirm-top K`` serves the simulator's best K settings too, and the engine
   decides among them (:func:`engine_choice`: the simplest within the noise of the best measured,
   or the default when nothing beats it beyond the noise): for settings the simulator cannot tell
   apart (within a few percent), the engine's own measurement is the better judge.

``DIR/advice.json`` (scripts read it): ``recommendation`` = {``scheduler``, ``max_num_batched_tokens``,
``serve_command``, ``predicted_goodput`` (requests/s), ``predicted_goodput_ratio``, ...},
``default``, ``candidates`` (every setting served, with its metrics), ``profile``, ``hindsight``,
``what_if``, and with ``--confirm`` ``confirm`` = {``measured_goodput``, ``measured_goodput_ratio``,
``runs``}. ``DIR/advice.md`` is the same as tables, ``DIR/goodput.png`` the candidates' goodput.
"""

from __future__ import annotations

import math
import shlex
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from feather_env.evaluation.advice_report import render_markdown, write_advice
from feather_env.evaluation.probe import MAX_PROFILE_ERROR, check_profile, probe_names, probe_overrides
from feather_env.evaluation.recommend import (
    confirm_names,
    engine_choice,
    hindsight,
    recommend,
    recommendation,
)
from feather_env.reporting import machine_info
from feather_env.scenarios import Scenario, load_scenario
from feather_env.serving_metrics import serving_metrics
from scheduler_runtime.config import ConfigError
from scheduler_runtime.prefix_index import DEFAULT_CHUNK_SIZE
from scheduler_runtime.schedulers import SchedulerConfig, split_budget, with_budget

__all__ = [
    "AdviseConfig",
    "MAX_PROFILE_ERROR",
    "advise",
    "candidate_names",
    "check_profile",
    "checked_names",
    "confirm",
    "plan",
    "render_markdown",
    "search",
    "serve_command",
    "simulated_windows",
]

DEFAULT_CAPS = (1, 2, 3, 4, 6, 8)
DEFAULT_BUDGETS = (256, 512, 1024, 2048, 4096, 8192)
#: vLLM's default on a scenario's engine: its own fcfs scheduler at the engine's token budget.
DEFAULT_SCHEDULER = "fcfs"
#: The metrics a candidate's row reports (``vllm bench serve``'s names), averaged over windows.
ROW_METRICS = (
    "request_goodput",
    "output_throughput",
    "request_throughput",
    "mean_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "p99_tpot_ms",
    "mean_e2el_ms",
    "p99_e2el_ms",
    "prefix_hit_rate",
    "completed",
)


@dataclass(frozen=True)
class AdviseConfig:
    """What ``advise`` searches and how (module docstring).

    Attributes:
        slos: the goodput SLOs in ms (``{"ttft": 5000, "tpot": 50}``).
        windows: held-out episodes (windows of the trace) every shortlisted setting is served on.
        first_seed: the first held-out episode seed (the probe uses ``first_seed - 1``).
        search_windows: windows the whole grid is served on before the shortlist.
        schedulers: base scheduler names (no ``@TOKENS``); ``None``: fcfs, lpm, group-cap-K of
            :data:`DEFAULT_CAPS`.
        policies: learned policy files (``feather:PATH``) searched beside them.
        budgets: per-step token budgets; ``None``: :data:`DEFAULT_BUDGETS` up to the engine's.
        shortlist: settings served on every window after the first pass.
        top: settings reported beside the default.
        noise: the relative goodput difference taken as noise (median and worst window).
        profile: the simulator's profile; ``None``: chosen by the engine probe.
        probe_window_s: the probe's window (trace seconds; shorter than the scenario's); a scenario
            without windows (whole episodes) is probed on one whole episode.
        what_if: serve the what-ifs (2x KV cache, 2 and 4 replicas).
        confirm: serve the recommendation and the default on the real engine.
        repeats: runs of each in ``confirm``.
        confirm_top: with ``confirm``, also serve the simulator's best ``confirm_top`` settings and
            recommend the engine's pick among them (:func:`engine_choice`); 1: the simulator's pick.
    """

    slos: Mapping[str, float]
    windows: int = 4
    first_seed: int = 100
    search_windows: int = 2
    schedulers: tuple[str, ...] | None = None
    policies: tuple[str, ...] = ()
    budgets: tuple[int, ...] | None = None
    shortlist: int = 6
    top: int = 3
    noise: float = 0.03
    profile: str | None = None
    probe_window_s: float = 20.0
    what_if: bool = True
    confirm: bool = False
    repeats: int = 3
    confirm_top: int = 1

    def __post_init__(self) -> None:
        if not self.slos:
            raise ConfigError("advise needs the SLOs it optimizes: --goodput ttft:MS tpot:MS (vLLM's names)")
        for name in ("windows", "search_windows", "shortlist", "top", "repeats", "confirm_top"):
            if getattr(self, name) < 1:
                raise ConfigError(f"advise: {name} must be >= 1, got {getattr(self, name)}")
        if self.first_seed < 1:
            raise ConfigError(
                f"advise: first_seed must be >= 1 (the probe uses the seed before it), got {self.first_seed}"
            )
        if not 0 <= self.noise < 1:
            raise ConfigError(f"advise: noise must be in [0, 1), got {self.noise}")
        if not self.probe_window_s > 0:
            raise ConfigError(f"advise: probe_window_s must be > 0, got {self.probe_window_s}")

    @property
    def seeds(self) -> tuple[int, ...]:
        return tuple(range(self.first_seed, self.first_seed + self.windows))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["slos"] = dict(self.slos)
        return d


def candidate_names(scenario: Scenario, config: AdviseConfig) -> list[str]:
    """Every setting the search serves: base name x budget (the engine's own budget is the plain name).

    Raises:
        ConfigError: a base name that is not a scheduler, or carries its own ``@TOKENS``; a policy file
            that does not load, or measures in other chunks than the scenario's (every base is
            checked as the evaluation checks its schedulers, before the engine probe starts).
    """
    from feather_env.evaluation.inprocess import validate_schedulers

    engine_budget = scenario.engine.max_num_batched_tokens
    bases = list(config.schedulers or ("fcfs", "lpm", *(f"group-cap-{k}" for k in DEFAULT_CAPS)))
    bases += [p if p.startswith("feather:") else f"feather:{p}" for p in config.policies]
    budgets = sorted({b for b in (config.budgets or DEFAULT_BUDGETS) if b < engine_budget} | {engine_budget})
    for base in bases:
        if split_budget(base)[1] is not None:
            raise ConfigError(
                f"advise: scheduler {base!r} names its own budget; give base names and --budgets"
            )
    validate_schedulers(bases, scenario.scheduler.chunk_size, scenario.scheduler.max_wait)
    names = []
    for base in bases:
        for budget in budgets:
            names.append(base if budget == engine_budget else with_budget(base, budget))
    if DEFAULT_SCHEDULER not in names:
        names.insert(0, DEFAULT_SCHEDULER)
    return names


# -- serving windows in the simulator ------------------------------------------------------------
def _window_metrics(
    scenario: Scenario, name: str, seeds: Sequence[int], profile: str | None, slos: Mapping[str, float]
) -> list[dict[str, Any]]:
    """``name`` on each window of ``seeds`` in the simulator: the serving metrics of each window."""
    from feather_env.env import FeatherEnv, play_episode

    env = FeatherEnv(scenario, "sim", scheduler=name, profile=profile)
    out = []
    try:
        for seed in seeds:
            play_episode(env, episode_seed=int(seed))
            m = serving_metrics(env.backend.timelines(), goodput=slos)
            m["seed"] = int(seed)
            out.append(m)
    finally:
        env.close()
    return out


def _row(name: str, windows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A candidate's figures: each metric's mean over its windows, and the windows themselves."""
    row: dict[str, Any] = {"scheduler": name, "max_num_batched_tokens": split_budget(name)[1]}
    for key in ROW_METRICS:
        values = [w[key] for w in windows if w.get(key) is not None and math.isfinite(w[key])]
        row[key] = float(np.mean(values)) if values else None
    row["windows"] = [{k: w.get(k) for k in ("seed", *ROW_METRICS)} for w in windows]
    return row


def search(
    scenario: Scenario,
    config: AdviseConfig,
    profile: str | None,
    names: Sequence[str],
    *,
    progress: Callable[[int], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Every setting of ``names`` (:func:`checked_names`) on the first
    :attr:`~AdviseConfig.search_windows` windows, then the shortlist and the default on every window:
    name -> row (:func:`_row`), rows on every window first, best goodput first."""
    seeds = config.seeds
    first = seeds[: config.search_windows]
    rows: dict[str, dict[str, Any]] = {}
    for name in names:
        rows[name] = _row(name, _window_metrics(scenario, name, first, profile, config.slos))
        rows[name]["stage"] = "grid"
        if progress is not None:
            progress(len(first))
    ranked = sorted(rows, key=lambda n: -(rows[n]["request_goodput"] or 0.0))
    default = DEFAULT_SCHEDULER
    short = [n for n in ranked if n != default][: config.shortlist] + [default]
    rest = seeds[config.search_windows :]
    for name in short:
        windows = rows[name]["windows"]
        if rest:
            windows = windows + _window_metrics(scenario, name, rest, profile, config.slos)
        rows[name] = {**_row(name, windows), "stage": "every window"}
        if progress is not None:
            progress(len(rest))
    full = sorted(short, key=lambda n: -(rows[n]["request_goodput"] or 0.0))
    others = [n for n in ranked if n not in short]
    return {n: rows[n] for n in full + others}


def window_facts(scenario: Scenario, seeds: Sequence[int]) -> tuple[dict[str, float], float]:
    """What the windows offer whatever serves them, each window built once: the share of prompt tokens
    a perfect prefix cache would serve and one of the engine's KV size, evicting least recently used
    (what any scheduler could capture at best), means over the windows; and the requests per second
    arriving (mean: no scheduler's goodput is above it)."""
    block = scenario.engine.block_size
    perfect, lru, rates = [], [], []
    for seed in seeds:
        w = scenario.episode_workload(int(seed))
        total = sum(r.prompt_len for r in w)
        perfect.append(w.cached_prompt_tokens(block) / total)
        lru.append(w.cached_prompt_tokens(block, capacity_tokens=scenario.kv_capacity_tokens) / total)
        times = [r.arrival_time for r in w]
        span = max(times) - min(times)
        rates.append(len(times) / span if span > 0 else math.inf)
    reuse = {"perfect_cache": float(np.mean(perfect)), "engine_sized_cache": float(np.mean(lru))}
    return reuse, float(np.mean(rates))


def what_if(
    scenario: Scenario, names: Sequence[str], config: AdviseConfig, profile: str | None
) -> dict[str, dict[str, Any]]:
    """Goodput of ``names`` with twice the KV cache, and behind the prefix router at 2 and 4 replicas
    (the same windows, arriving as they do; each replica the scenario's engine)."""
    from feather_env.cluster_sim import ClusterSim
    from scheduler_runtime.router import make_router

    keys = ("request_goodput", "output_throughput", "mean_ttft_ms", "mean_tpot_ms", "prefix_hit_rate")
    out: dict[str, dict[str, Any]] = {}
    bigger = load_scenario(scenario, {"engine": {"kv_cache_gib": 2 * scenario.engine.kv_cache_gib}})
    for name in names:
        kv = _row(name, _window_metrics(bigger, name, config.seeds, profile, config.slos))
        entry: dict[str, Any] = {"2x_kv_cache": {k: kv[k] for k in keys}}
        for n in (2, 4):
            cluster = ClusterSim(n, scenario.engine_config(), scheduler=name, profile=profile)
            windows = [
                cluster.run(
                    scenario.episode_workload(int(seed)), make_router("prefix"), goodput=config.slos
                ).metrics
                for seed in config.seeds
            ]
            entry[f"{n}_replicas"] = {k: float(np.mean([w[k] for w in windows])) for k in keys}
        out[name] = entry
    return out


# -- serving the recommendation -------------------------------------------------------------------
def serve_command(scenario: Scenario, name: str) -> str:
    """The ``feather-serve`` command that serves ``name`` on the scenario's engine, on this machine (its
    compute dtype and the KV bytes that hold the scenario's KV tokens in it), with the scenario's
    scheduler knobs where they are not the name's own (as the simulator served it)."""
    e = scenario.engine
    args = ["feather-serve", "--scheduler", name, "--max-num-seqs", str(e.max_num_seqs),
            "--kv-cache-memory-bytes", str(e.kv_cache_memory_bytes), "--dtype", e.compute_dtype]
    if split_budget(name)[1] is None:
        args += ["--max-num-batched-tokens", str(e.max_num_batched_tokens)]
    config, knobs = SchedulerConfig.for_name(name), scenario.scheduler
    if not config.passthrough:  # vLLM's own fcfs takes no knob
        if knobs.max_wait != config.max_wait:
            args += ["--max-wait", "none" if knobs.max_wait is None else f"{knobs.max_wait:g}"]
        if knobs.chunk_size != DEFAULT_CHUNK_SIZE:  # a policy's own is the scenario's (candidate_names)
            args += ["--chunk-size", str(knobs.chunk_size)]
    return shlex.join(args)


def confirm(
    scenario: Scenario,
    names: Sequence[str],
    config: AdviseConfig,
    *,
    backend: Any = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Serve ``names`` (the recommendation, the default) on the real engine on the first held-out
    window, alternating, ``config.repeats`` runs each: each one's goodput per run and the median's."""
    from feather_env.evaluation.inprocess import InProcessConfig, evaluate_in_process

    workload = scenario.episode_workload(config.seeds[0])
    cfg = InProcessConfig(
        schedulers=tuple(dict.fromkeys(names)),
        engine=scenario.engine_config(),
        chunk_size=scenario.scheduler.chunk_size,
        max_wait=scenario.scheduler.max_wait,
        isolated_probes=False,
        repeats=config.repeats,
        goodput=dict(config.slos),
    )
    runs, _ = evaluate_in_process(workload, cfg, progress=False, log=log, backend=backend)
    out: dict[str, Any] = {"seed": config.seeds[0], "repeats": config.repeats, "runs": {}}
    for name, run in zip(cfg.schedulers, runs, strict=True):
        m = serving_metrics(run.timelines, goodput=config.slos)
        per = run.extra.get("repeats", {}).get("request_goodput") or [m["request_goodput"]]
        out["runs"][name] = {
            "request_goodput_per_run": per,
            "output_throughput_per_run": run.extra.get("repeats", {}).get("output_throughput")
            or [m["output_throughput"]],
            "request_goodput": statistics.median(per),
            **{k: m.get(k) for k in ROW_METRICS if k != "request_goodput"},
        }
    return out


def checked_names(scenario: Scenario, config: AdviseConfig) -> list[str]:
    """Every input of :func:`advise` checked, before an engine starts: the settings it searches
    (:func:`candidate_names`, returned), a given profile (loaded), and the scenario's engine where the
    probe or the confirmation will start it (:meth:`EngineConfig.check_startable`)."""
    names = candidate_names(scenario, config)
    if config.profile is not None:
        from feather_env.calibrate import load_profile

        load_profile(config.profile)
    if config.profile is None or config.confirm:  # the probe or the confirmation starts the engine
        scenario.engine_config().check_startable()
    return names


def simulated_windows(settings: int, config: AdviseConfig) -> int:
    """The windows the search serves in the simulator for ``settings`` settings: each on the first
    ``search_windows``, then the shortlist and the default on the other windows."""
    return settings * config.search_windows + (min(config.shortlist, settings - 1) + 1) * (
        config.windows - config.search_windows)


def plan(scenario: Scenario, config: AdviseConfig) -> str:
    """What :func:`advise` will serve for ``scenario`` (``evaluate.py advise --check``), every input
    checked as it checks them (:func:`checked_names`): the SLOs, how the profile is chosen, the
    settings and windows of the search, the what-ifs and what the engine confirms."""
    names = checked_names(scenario, config)
    seeds = config.seeds
    slos = ", ".join(f"{k} {v:g} ms" for k, v in config.slos.items())
    if config.profile is not None:
        profile = f"profile: {config.profile} (given)"
    else:
        window = probe_overrides(scenario, config.probe_window_s).get("episode", {}).get("window_s")
        profile = (f"profile: chosen by a probe on the real engine first (episode seed "
                   f"{config.first_seed - 1}, " + (f"a {window:g} s window" if window is not None
                                                     else "one whole episode")
                   + f"; {', '.join(probe_names(scenario))}): the best of configs/profiles, refitted on the "
                   f"probe above {MAX_PROFILE_ERROR:.0%} error")
    search_seeds = seeds[: config.search_windows]
    shortlist = min(config.shortlist, len(names) - 1)
    confirm_what = (f"the default and the simulator's best {config.confirm_top} (the engine picks)"
                    if config.confirm_top > 1 else "the recommendation and the default")
    engine_budget = scenario.engine.max_num_batched_tokens
    bases = list(dict.fromkeys(split_budget(n)[0] for n in names))
    budgets = sorted({split_budget(n)[1] or engine_budget for n in names})
    return "\n".join([
        f"advise on {scenario.name}, goodput SLOs {slos}",
        profile,
        f"search: {len(names)} settings on window(s) {', '.join(map(str, search_seeds))}, then the best "
        f"{shortlist} and the default on window(s) {', '.join(map(str, seeds))}: "
        f"{simulated_windows(len(names), config)} simulated windows",
        f"settings: {len(bases)} schedulers ({', '.join(bases)}) x {len(budgets)} per-step token budgets "
        f"({', '.join(map(str, budgets))}; {engine_budget}: the engine's)",
        "what-ifs: " + ("2x KV cache, 2 and 4 replicas behind the prefix router" if config.what_if
                        else "none"),
        "confirm: " + (f"on the real engine, window {seeds[0]}: {confirm_what}, {config.repeats} runs each"
                       if config.confirm else "none (the simulator's advice alone)"),
    ])


def advise(
    scenario: Scenario,
    config: AdviseConfig,
    out_dir: str | Path,
    *,
    backend: Any = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The whole advice (module docstring): written to ``out_dir`` (``advice.json``, ``advice.md``,
    ``goodput.png``) and returned.

    Raises:
        ConfigError: a bad scheduler, budget or profile (before anything is served).
        EngineError: a request not served exactly once on the engine (probe, confirm).
    """
    from tqdm import tqdm

    out = Path(out_dir)
    t0 = time.perf_counter()
    names = checked_names(scenario, config)  # every input checked before an engine starts
    default = DEFAULT_SCHEDULER
    if config.profile is not None:
        profile_info: dict[str, Any] = {
            "profile": config.profile,
            "error": None,
            "refitted": False,
            "checked": False,
        }
    else:
        log("checking the simulator against this machine (a short probe on the real engine) ...")
        probe = check_profile(scenario, out, seed=config.first_seed - 1, window_s=config.probe_window_s,
                              backend=backend, log=log)
        profile_info = {**probe, "checked": True}
    profile = profile_info["profile"]
    log(
        f"simulator profile: {profile}"
        + (
            f" (probe error {profile_info['error']:.1%})"
            if profile_info.get("error") is not None
            else " (given)"
        )
    )
    total = simulated_windows(len(names), config)
    with tqdm(total=total, desc="advise: simulated windows", disable=not progress, unit="window") as bar:
        rows = search(scenario, config, profile, names, progress=bar.update)
    reuse, offered = window_facts(scenario, config.seeds)
    rec = recommend(rows, default, config.noise, offered, reuse)
    rec["serve_command"] = serve_command(scenario, rec["scheduler"])
    best = rec["best_searched"]
    full = [n for n, r in rows.items() if r["stage"] == "every window"]
    shown = list(dict.fromkeys([*full[: config.top], rec["scheduler"], default]))
    payload: dict[str, Any] = {
        "scenario": scenario.name,
        "scenario_source": scenario.source,
        "slos_ms": dict(config.slos),
        "config": config.to_dict(),
        "machine": machine_info(),
        "profile": profile_info,
        "recommendation": rec,
        "default": {
            "scheduler": default,
            "max_num_batched_tokens": scenario.engine.max_num_batched_tokens,
            "what": "vLLM's own fcfs scheduler at the engine's token budget",
            "serve_command": serve_command(scenario, default),
            **_brief(rows[default]),
        },
        "shown": shown,
        "candidates": rows,
        "offered_request_rate": offered,
        "prefix_reuse_available": reuse,
        "hindsight": hindsight(rows, best),
    }
    if config.what_if:
        log("what-ifs: 2x KV cache, 2 and 4 replicas behind the prefix router ...")
        payload["what_if"] = what_if(
            scenario, list(dict.fromkeys([rec["scheduler"], default])), config, profile
        )
    if config.confirm:
        served = confirm_names(rows, rec["scheduler"], default, config.confirm_top)
        log(
            f"confirming on the real engine: {', '.join(served)}, {config.repeats} runs each, "
            f"window {config.seeds[0]} ..."
        )
        measured = confirm(scenario, served, config, backend=backend, log=log)
        if config.confirm_top > 1:  # the engine has the last word among the simulator's best
            chosen, why = engine_choice(measured["runs"], default, config.noise)
            measured["simulator_recommendation"] = rec["scheduler"]
            if chosen != rec["scheduler"]:
                rec = {**recommendation(rows, chosen, default, best, why),
                       "serve_command": serve_command(scenario, chosen)}
            else:
                rec = {**rec, "why": why}
            rec["decided_by"] = "engine"
            payload["recommendation"] = rec
        mine, theirs = measured["runs"][rec["scheduler"]], measured["runs"][default]
        measured["measured_goodput"] = mine["request_goodput"]
        measured["measured_goodput_ratio"] = (
            mine["request_goodput"] / theirs["request_goodput"] if theirs["request_goodput"] else None
        )
        window = rows[rec["scheduler"]]["windows"][0]["request_goodput"]
        measured["predicted_goodput_this_window"] = window
        measured["predicted_error"] = (
            abs(window - mine["request_goodput"]) / mine["request_goodput"]
            if mine["request_goodput"]
            else None
        )
        payload["confirm"] = measured
    payload["wall_s"] = time.perf_counter() - t0
    write_advice(out, payload)
    return payload


def _brief(row: Mapping[str, Any]) -> dict[str, Any]:
    return {k: row.get(k) for k in ROW_METRICS}
