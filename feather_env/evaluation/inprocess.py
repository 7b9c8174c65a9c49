"""Schedulers on the real in-process engine: one workload served once per scheduler, as in production.

One :class:`~feather_env.engines.vllm_backend.VLLMBackend` (vLLM with the Feather scheduler class)
is started for the evaluation, warmed up with a throw-away batch, and serves the same episode (the
same requests, token ids and arrival times) once per scheduler name with :meth:`VLLMBackend.serve
<feather_env.engines.vllm_backend.VLLMBackend.serve>`: the scheduler answers its own decisions in
every ``schedule()``, as under ``feather-serve``, and ``fcfs`` is vLLM's own scheduler (the
passthrough configuration: nothing of Feather decides). Between schedulers the backend empties the
engine and clears its prefix cache.

Time is the engine clock (the sum of measured step times; an idle engine jumps to the next
arrival): arrivals, ``max_wait`` and every latency are on it, so nothing sleeps and the Python
bookkeeping between steps is not counted. Requests carry their true length and source in
``SamplingParams.extra_args``, which the schedulers read because the evaluation trusts its own
clients (``trust_client_hints``, :func:`scheduler_overrides`), and generate exactly their
``output_len`` tokens. A request that is not served exactly once with its tokens stops the
evaluation (:class:`~feather_env.engines.vllm_engine.EngineError`).

Per run, besides the timelines (:mod:`feather_env.evaluation.report`), :attr:`Run.extra
<feather_env.evaluation.report.Run>` holds ``decode_tok_s`` (decode-only steps), ``mean_running_batch``,
``mean_decode_batch``, ``engine_steps``, ``step_seconds``, ``preemptions``, the Feather scheduler's
counters (``scheduler_stats``) and overhead (``scheduler_overhead_frac``: its decision time / step
time; ``None`` for ``fcfs``), ``foreign_cpu`` (other processes' share of the machine during the run,
:mod:`feather_env.hostload`) and, with the isolated probes, ``max_slowdown`` / ``mean_slowdown``
(e2e latency / the request's time alone on the idle engine with a cold cache, from lone probe
requests at three prompt lengths, interpolated).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from feather_env.engines.vllm_engine import EngineConfig, EngineError
from feather_env.evaluation.report import IN_PROCESS, Run
from feather_env.hostload import ForeignLoad, wait_for_quiet
from feather_env.records import StepSample
from feather_env.reporting import format_table
from feather_env.serving_metrics import serving_metrics
from feather_env.workloads import Request, Workload
from scheduler_runtime.admission import AdmissionRule
from scheduler_runtime.config import ConfigError
from scheduler_runtime.schedulers import SchedulerConfig

__all__ = ["InProcessConfig", "IsolatedModel", "evaluate_in_process", "fit_engine", "measure_isolated",
           "random_requests", "scheduler_config", "scheduler_overrides", "schedulers_table", "serve_one",
           "validate_schedulers"]


@dataclass(frozen=True)
class InProcessConfig:
    """How the in-process evaluation runs (recorded in the results JSON).

    Attributes:
        schedulers: scheduler names (:mod:`scheduler_runtime.schedulers`), served in this order.
        engine: the engine every scheduler runs on (its ``max_model_len`` must fit the workload).
        chunk_size, max_wait: the batching core's chunk size and anti-starvation release, given to
            every scheduler but ``fcfs`` (:func:`scheduler_overrides`; ``None``: the scheduler's own).
        warmup: serve a throw-away batch once after the engine starts.
        isolated_probes: measure the isolated estimate (slowdown).
        run_timeout_s: a run longer than this (wall clock) is an error.
        quiet_wait_s: before each run, wait up to this long for other processes to go quiet.
        max_foreign, retries: re-run a run during which other processes used more than this
            fraction of the machine, at most ``retries`` times, and keep the least loaded run.
        repeats: serve every scheduler this many times, schedulers alternating; its metrics are those
            of the run with the median end-to-end output throughput, ``repeats`` lists every run's figures.
        label: prefix of the run labels (``LABEL/scheduler``); ``None``: the scheduler names.
        goodput: SLOs in ms (``{"ttft": 5000}``), which a setting's admission rule (``~RULE``) reads
            too; with ``repeats``, every run's ``request_goodput`` and ``slo_attainment`` are listed in
            ``repeats`` too.
    """

    schedulers: tuple[str, ...]
    engine: EngineConfig = field(default_factory=EngineConfig)
    chunk_size: int | None = None
    max_wait: float | None = None
    warmup: bool = True
    isolated_probes: bool = True
    run_timeout_s: float = 1800.0
    quiet_wait_s: float = 0.0
    max_foreign: float | None = None
    retries: int = 0
    repeats: int = 1
    label: str | None = None
    goodput: Mapping[str, float] | None = None

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ConfigError(f"repeats must be >= 1, got {self.repeats}")
        if self.retries < 0:
            raise ConfigError(f"retries must be >= 0, got {self.retries}")
        if not 0 < self.run_timeout_s < math.inf:
            raise ConfigError(f"run_timeout_s must be a finite number of seconds > 0, got "
                              f"{self.run_timeout_s}")
        if not 0 <= self.quiet_wait_s < math.inf:
            raise ConfigError(f"quiet_wait_s must be a finite number of seconds >= 0, got "
                              f"{self.quiet_wait_s}")
        if self.max_foreign is not None and not 0 <= self.max_foreign <= 1:
            raise ConfigError(f"max_foreign must be a fraction of the machine in [0, 1], got "
                              f"{self.max_foreign}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["schedulers"] = list(self.schedulers)
        return d


def validate_schedulers(names: Sequence[str], chunk_size: int | None = None,
                        max_wait: float | None = None, *, slos: Mapping[str, float] | None = None
                        ) -> tuple[str, ...]:
    """Check every name, and the knobs each gets, before anything starts: unknown name, duplicate,
    unreadable ``feather:PATH`` policy, a ``chunk_size`` or ``max_wait`` out of range, a chunk size
    that is not the policy's (the scheduler's own check at engine start, made here for every name),
    an admission rule (``~RULE``) that needs a TTFT SLO when ``slos`` has none.

    Raises:
        ConfigError: naming the bad entry and the known names.
    """
    from scheduler_runtime.plugins import PLUGIN_PREFIX
    from scheduler_runtime.schedulers import check_scheduler

    names = tuple(n.strip() for n in names if n.strip())
    if not names:
        raise ConfigError("no scheduler given: --schedulers fcfs,feather-heuristic,...")
    SchedulerConfig(chunk_size=chunk_size, max_wait=max_wait)  # the knobs, whichever names use them
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ConfigError(f"scheduler {name!r} is listed twice")
        seen.add(name)
        config = SchedulerConfig.for_name(name)  # unknown names raise ConfigError listing the known
        policy_file = config.policy and not config.policy.startswith(PLUGIN_PREFIX)
        if policy_file and not Path(config.policy).is_file():
            raise ConfigError(f"scheduler {name!r}: policy file {config.policy} does not exist")
        check_scheduler(name, **scheduler_overrides(name, chunk_size, max_wait))
        if AdmissionRule.parse(config.admission_rule).needs_slos and "ttft" not in (slos or {}):
            raise ConfigError(f"scheduler {name!r}: its admission rule {config.admission_rule!r} reads the "
                              "TTFT SLO: give --goodput ttft:MS (tpot:MS ...)")
    return names


def fit_engine(engine: EngineConfig, workload: Workload) -> EngineConfig:
    """``engine`` with ``max_model_len`` set to the workload's longest request (whole blocks, + 1 token)."""
    block = engine.block_size
    need = math.ceil((max(r.peak_tokens for r in workload) + 1) / block) * block
    return replace(engine, max_model_len=max(need, block))


def scheduler_overrides(name: str, chunk_size: int | None, max_wait: float | None) -> dict[str, Any]:
    """The :class:`~scheduler_runtime.schedulers.SchedulerConfig` fields an evaluation sets.

    Client hints are trusted (the evaluation serves its own workload: true lengths and sources);
    ``chunk_size`` and ``max_wait`` are the batching core's knobs, given to every scheduler but ``fcfs``
    (vLLM's own scheduler, which takes none), as the simulator's environment gives a scenario's
    (:class:`~feather_env.scenarios.ScenarioSchedulerConfig`: the same for every ordering and policy).
    """
    if SchedulerConfig.for_name(name).passthrough:
        return {}
    overrides: dict[str, Any] = {"trust_client_hints": True}
    if chunk_size is not None:
        overrides["chunk_size"] = chunk_size
    if max_wait is not None:
        overrides["max_wait"] = max_wait
    return overrides


def scheduler_config(name: str, chunk_size: int | None = None,
                     max_wait: float | None = None) -> SchedulerConfig:
    """The configuration scheduler ``name`` serves with in the evaluation (:func:`scheduler_overrides`)."""
    return SchedulerConfig.for_name(name, **scheduler_overrides(name, chunk_size, max_wait))


def schedulers_table(configs: Sequence[SchedulerConfig], engine: EngineConfig) -> str:
    """Each scheduler as it will serve on ``engine`` (markdown, ``evaluate.py --check``): the ordering,
    the decision (a policy's: the one its observation answers), the per-step token budget, the admission
    test, the output lengths it reads, the CHT chunk size, the anti-starvation wait, the client hints."""
    from scheduler_runtime.schedulers import FeatherRuntime

    rows = []
    for c in configs:
        decision, chunk = "-", "-"
        if c.ordering == "feather":
            runtime = FeatherRuntime(c)  # as the engine resolves it: the policy's decision and chunk size
            chunk, kind = runtime.chunk_size, runtime.core.config.decision
            if c.policy is not None:
                decision = f"its policy ({kind})"
            elif kind == "group":
                decision = f"at most {c.group_cap} documents" if c.group_cap else "group, no cap"
            else:
                decision = "heuristic (request)"
        budget = min(c.max_num_batched_tokens or engine.max_num_batched_tokens, engine.max_num_batched_tokens)
        wait = "-" if c.max_wait is None else f"{c.max_wait:g}"
        rows.append([c.name, c.ordering or "vLLM's own", decision, f"{budget:,}", c.admission,
                     c.lengths if c.uses_lengths else "-", chunk, wait,
                     "-" if c.passthrough else "trusted" if c.trust_client_hints else "ignored"])
    return format_table(["scheduler", "ordering", "decision", "step tokens", "admission", "lengths",
                         "chunk", "max wait s", "client hints"], rows)


@dataclass
class IsolatedModel:
    """Time of a request alone on the idle engine (cold prefix cache), from lone probes.

    ``ttft_s[i]`` and ``tpot_s[i]`` were measured for a prompt of ``prompt_lens[i]`` tokens; other
    lengths are interpolated linearly (and held constant outside the probed range).
    """

    prompt_lens: list[int]
    ttft_s: list[float]
    tpot_s: list[float]
    probe_output_tokens: int = 9

    def estimate(self, prompt_len: int, output_len: int) -> float:
        ttft = float(np.interp(prompt_len, self.prompt_lens, self.ttft_s))
        tpot = float(np.interp(prompt_len, self.prompt_lens, self.tpot_s))
        return ttft + max(0, output_len - 1) * tpot

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def random_requests(tag: str, prompt_lens: Sequence[int], output_len: int, seed: int) -> Workload:
    """Requests of random token ids (no shared prefix): the warm-up batch and the probes."""
    rng = np.random.default_rng(seed)
    return Workload(tag, tuple(Request(f"{tag}{i}", rng.integers(3, 8192, p), -1, output_len)
                               for i, p in enumerate(prompt_lens)))


def _passthrough() -> SchedulerConfig:
    return SchedulerConfig.for_name("fcfs")


def warm_up(backend: Any, max_model_len: int) -> None:
    """Serve a throw-away batch (8 random prompts of up to 512 tokens): the first steps after an
    engine starts are much slower than the steady state."""
    prompt = min(512, max_model_len - 9)
    backend.serve(random_requests("warmup-", [prompt] * 8, 8, 12345), _passthrough())


def measure_isolated(backend: Any, max_prompt_len: int, output_tokens: int = 9) -> IsolatedModel:
    """Serve one lone request (cold cache, vLLM's own scheduler) at three prompt lengths."""
    lens = sorted({max(1, min(256, max_prompt_len)), max(1, max_prompt_len // 2), max(1, max_prompt_len)})
    ttft: list[float] = []
    tpot: list[float] = []
    for j, p in enumerate(lens):
        (t,) = backend.serve(random_requests(f"probe{j}-", [p], output_tokens, 424242 + j), _passthrough())
        ttft.append(t.ttft)
        tpot.append(t.tpot)
    return IsolatedModel(lens, ttft, tpot, output_tokens)


def evaluate_in_process(
    workload: Workload,
    config: InProcessConfig,
    *,
    progress: bool = True,
    log: Callable[[str], None] = print,
    retry_until: float | None = None,
    backend: Any = None,
) -> tuple[list[Run], dict[str, Any]]:
    """Serve ``workload`` once per scheduler of ``config`` (module docstring).

    Returns the runs (one per scheduler, in order) and what the evaluation measured beside them
    (``engine_start_s``, ``isolated``). ``retry_until``: a ``time.monotonic()`` deadline after
    which runs under foreign load are no longer re-run. ``backend``: a
    :class:`~feather_env.engines.vllm_backend.VLLMBackend` to reuse (else one is started and closed).

    Raises:
        ConfigError: a bad scheduler name (before the engine starts).
        EngineError: a request not served exactly once with its tokens, or a run past the timeout.
    """
    names = validate_schedulers(config.schedulers, config.chunk_size, config.max_wait, slos=config.goodput)
    need = max(r.peak_tokens for r in workload) + 1
    if config.engine.max_model_len < need:
        raise ConfigError(f"engine max_model_len {config.engine.max_model_len} < the workload's longest "
                          f"request ({need - 1} prompt + output tokens)")
    info: dict[str, Any] = {}
    own = backend is None
    if own:
        from feather_env.engines.vllm_backend import VLLMBackend

        t0 = time.perf_counter()
        backend = VLLMBackend(config.engine)
        info["engine_start_s"] = time.perf_counter() - t0
    backend.admission_slos = dict(config.goodput or {})  # what a setting's ~RULE reads
    try:
        if config.warmup:
            warm_up(backend, config.engine.max_model_len)
        isolated = None
        if config.isolated_probes:
            isolated = measure_isolated(backend, max(r.prompt_len for r in workload))
            info["isolated"] = isolated.to_dict()
        done: dict[str, list[Run]] = {name: [] for name in names}
        for _ in range(config.repeats):  # schedulers alternate, so slow phases of the machine hit all
            for name in names:
                run = _run_quiet(backend, name, workload, config, progress, retry_until, log)
                if isolated is not None:
                    slow = [t.e2el / isolated.estimate(t.prompt_len, t.output_len) for t in run.timelines]
                    run.extra["max_slowdown"] = float(np.max(slow))
                    run.extra["mean_slowdown"] = float(np.mean(slow))
                done[name].append(run)
        runs = []
        for name in names:
            every = done[name]
            metrics = [serving_metrics(r.timelines, goodput=config.goodput) for r in every]
            order = sorted(range(len(every)), key=lambda i: metrics[i]["output_throughput"])
            run = every[order[(len(order) - 1) // 2]]  # every figure from one run: the median's
            if config.repeats > 1:
                run.extra["repeats"] = {
                    "output_throughput": [m["output_throughput"] for m in metrics],
                    "mean_e2el_ms": [m["mean_e2el_ms"] for m in metrics],
                    "decode_tok_s": [r.extra["decode_tok_s"] for r in every],
                    "foreign_cpu": [r.extra["foreign_cpu"] for r in every]}
                if config.goodput:
                    run.extra["repeats"]["request_goodput"] = [m["request_goodput"] for m in metrics]
                    run.extra["repeats"]["slo_attainment"] = [m["slo_attainment"] for m in metrics]
            runs.append(run)
        return runs, info
    finally:
        if own:
            backend.close()


def _run_quiet(backend: Any, name: str, workload: Workload, config: InProcessConfig, progress: bool,
               retry_until: float | None, log: Callable[[str], None]) -> Run:
    """One scheduler's run, re-run while other processes loaded the machine (``config.max_foreign``)."""
    best: Run | None = None
    attempts: list[float] = []
    for attempt in range(1 + config.retries):
        if attempt or config.quiet_wait_s > 0:
            wait_for_quiet(0.05, timeout_s=max(config.quiet_wait_s, 30.0 if attempt else 0.0))
        run = serve_one(backend, name, workload, config, progress)
        attempts.append(run.extra["foreign_cpu"])
        if best is None or run.extra["foreign_cpu"] < best.extra["foreign_cpu"]:
            best = run
        if config.max_foreign is None or run.extra["foreign_cpu"] <= config.max_foreign:
            break
        if retry_until is not None and time.monotonic() > retry_until:
            log(f"  {name}: foreign CPU {run.extra['foreign_cpu']:.0%} during the run, no time left to "
                "re-run it")
            break
        if attempt < config.retries:
            log(f"  {name}: foreign CPU {run.extra['foreign_cpu']:.0%} > {config.max_foreign:.0%} during the "
                f"run (other processes competed for the cores): re-running")
    assert best is not None
    best.extra["attempts"] = len(attempts)
    best.extra["foreign_cpu_attempts"] = attempts
    return best


def serve_one(backend: Any, name: str, workload: Workload, config: InProcessConfig, progress: bool) -> Run:
    """Serve ``workload`` with scheduler ``name`` on ``backend`` and measure it (module docstring)."""
    sched = scheduler_config(name, config.chunk_size, config.max_wait)
    label = f"{config.label}/{name}" if config.label else name
    tap = backend.tap
    preempted0 = tap.preempted
    steps: list[StepSample] = []
    decode = [0, 0.0]  # tokens, seconds
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(workload), desc=f"{label:>24s}", unit="req", leave=True, file=sys.stderr,
                   dynamic_ncols=True)
    deadline = time.perf_counter() + config.run_timeout_s

    def on_advance(adv: Any) -> None:
        if adv.steps:
            steps.append(StepSample(backend.clock - adv.seconds, adv.seconds, tap.running, tap.scheduled_reqs,
                                    tap.decode_only))
            decode[0] += adv.decode_tokens
            decode[1] += adv.decode_seconds
        if bar is not None and adv.finished:
            bar.update(len(adv.finished))
        if time.perf_counter() > deadline:
            raise EngineError(f"scheduler {name!r}: run exceeded {config.run_timeout_s:.0f} s (wall clock) "
                              f"with {sum(t.finished_count for t in backend.timelines())}/{len(workload)} "
                              "requests finished")

    t0 = time.perf_counter()
    try:
        with ForeignLoad(config.engine.cores) as load:
            timelines = backend.serve(workload, sched, on_advance)
    finally:
        if bar is not None:
            bar.close()
    wall = time.perf_counter() - t0
    step_s = float(sum(s.seconds for s in steps))
    running = [s.running for s in steps if s.running > 0]
    dec = [s.scheduled for s in steps if s.decode_only]
    stats = backend.scheduler.feather_stats() if backend.runtime is not None else None
    extra: dict[str, Any] = {
        "scheduler": name,
        "decode_tok_s": decode[0] / decode[1] if decode[1] > 0 else 0.0,
        "decode_tokens": decode[0],
        "decode_seconds": decode[1],
        "mean_running_batch": float(np.mean(running)) if running else None,
        "mean_decode_batch": float(np.mean(dec)) if dec else None,
        "engine_steps": len(steps),
        "decode_steps": len(dec),
        "step_seconds": step_s,
        "preemptions": tap.preempted - preempted0,
        "scheduler_stats": stats,
        "scheduler_decision_s": None,
        "scheduler_overhead_frac": None,
        "scheduler_arrival_frac": None,
        "foreign_cpu": load.fraction,
        "max_slowdown": None,  # with the isolated probes: evaluate_in_process
        "mean_slowdown": None,
        "wall_s": wall,
    }
    if stats is not None and step_s > 0:
        extra["scheduler_decision_s"] = float(stats.get("decision_seconds", 0.0))
        extra["scheduler_overhead_frac"] = extra["scheduler_decision_s"] / step_s
        extra["scheduler_arrival_frac"] = float(stats.get("arrival_seconds", 0.0)) / step_s
    return Run(label, IN_PROCESS, timelines, extra=extra, steps=steps)
