"""Replay one workload through the real vLLM engine once per scheduler, and compare them.

    python evaluate.py --workload {leval,longbench,sharegpt,splitwise,synthetic} [--data-dir DIR]
                       --schedulers fcfs,lpm,dfs-weight,sjf,svf,svf-1bit,feather-heuristic,feather:PATH,...
                       [--arrival burst|poisson:RATE|trace] [--num-requests N] [--seed S]
                       --out DIR [--json PATH] [--quick] [knobs, see --help]

One workload (the same requests, the same token ids, the same arrival times) is built once;
then, for each scheduler name (see :mod:`scheduler_runtime.schedulers`), one in-process engine
is started with ``build_llm(config, **engine_overrides(name))``, warmed up with a throw-away
batch (its prefix cache then reset and the scheduler's state rebuilt), the workload is replayed
in real time (a request is added when the wall clock passes its arrival time; ``burst``: all at
t = 0), and the engine is shut down before the next one starts. Requests carry their true
length and source in ``SamplingParams.extra_args`` (``feather_output_len``, ``feather_source``),
which the schedulers read because the evaluation trusts its own clients (``trust_client_hints``),
and generate exactly their ``output_len`` tokens (``min_tokens == max_tokens``, ``ignore_eos``).

Every request must finish exactly once with its requested token count; anything else (a request
that never finishes, finishes twice, or returns the wrong number of tokens, or a run past
``--run-timeout``) is an :class:`EvaluationError`, never a silent drop.

Metrics per scheduler (times in seconds from the request's nominal arrival time):

- ``decode_tok_s``: tokens generated in decode-only engine steps (no prompt token scheduled) /
  the wall time of those steps, as :class:`feather_env.backends.VLLMBackend` defines it;
- ``e2e_req_s``, ``e2e_tok_s``: completed requests and generated tokens / the makespan (first
  arrival -> last completion);
- ``latency_*``: arrival -> last token (mean, P50, P95, P99); ``ttft_*``: arrival -> first token;
  ``tpot_*``: (last token - first token) / (output tokens - 1), requests with >= 2 tokens;
- ``queue_*``: arrival -> first scheduled by the engine (time held by the Feather scheduler plus
  time in vLLM's waiting queue);
- ``mean_running_batch``: requests in vLLM's running set after each step's schedule(), averaged
  over the steps with any running request; ``mean_decode_batch``: over decode-only steps;
- ``prefix_hit_rate``: prompt tokens served from the prefix cache when a request was first
  scheduled / all prompt tokens;
- ``scheduler_overhead_frac``: the Feather scheduler's own decision time (the core's ``plan``,
  from its counters) / the total wall time of the engine steps; ``None`` (n/a) for ``fcfs``,
  which is vLLM's own scheduler. ``scheduler_arrival_frac``: the same for its per-arrival work
  (CHT insert, length prediction);
- fairness: ``max_wait_s`` = the largest queueing delay; ``slowdown`` = latency / the request's
  *isolated estimate*, the time it would take alone on the idle engine with a cold prefix cache:
  ``ttft_iso(p) + (o - 1) * tpot_iso(p)`` for prompt length ``p`` and output length ``o``, with
  ``ttft_iso`` and ``tpot_iso`` measured once per evaluation (on the first engine, before its
  run) with lone probe requests at three prompt lengths and interpolated linearly.
  ``max_slowdown`` and ``slowdown_mean`` are reported (a request that benefits from the prefix
  cache can have a slowdown below 1);
- ``submitted``, ``completed``; ``preemptions`` (vLLM's, counted from its scheduler outputs);
- ``foreign_cpu``: CPU time other processes used during the replay, as a fraction of the
  machine (:mod:`feather_env.hostload`); timings above ~0.05 are suspect on a shared machine.
  With ``--max-foreign F`` a run during which other processes used more than F is re-run on a
  fresh engine (at most ``--retries`` times) and the least loaded run is kept; ``attempts`` and
  ``foreign_cpu_attempts`` say what happened.

Outputs in ``--out``: ``results.json`` (``{"schedulers": {NAME: {metric: value}}, "workload":
..., "engine": ..., "config": ..., "isolated": ..., "machine": ...}``), ``results.csv`` (one row
per scheduler), ``results.md`` (markdown tables), ``requests.csv`` (per-request timings),
``throughput.png``, ``latency_cdf.png`` and ``batch_size.png``. ``--json PATH`` writes the same
JSON elsewhere.
"""

from __future__ import annotations

import argparse
import csv
import gc
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from feather_env.engine import (  # noqa: E402  (before vLLM is imported)
    EngineConfig,
    ScheduleTap,
    engine_core_of,
    forced_length_params,
    tokens_prompt,
    use_in_process_engine,
)

use_in_process_engine()

import numpy as np  # noqa: E402

from feather_env.hostload import ForeignLoad, wait_for_quiet  # noqa: E402
from feather_env.reporting import format_table, machine_info, write_json  # noqa: E402
from feather_env.workloads import (  # noqa: E402
    DataNotFoundError,
    Request,
    Workload,
    WorkloadConfig,
    WorkloadError,
    build_workload,
)
from scheduler_runtime.config import ConfigError  # noqa: E402

__all__ = [
    "EvalConfig",
    "EvaluationError",
    "IsolatedModel",
    "RunRecord",
    "build_eval_workload",
    "engine_config_for",
    "evaluate",
    "main",
    "run_scheduler",
    "summarize",
    "validate_schedulers",
]

WORKLOADS = ("leval", "longbench", "sharegpt", "splitwise", "synthetic")
#: The --quick preset: a smoke run of a few short requests.
QUICK = {"num_requests": 12, "max_prompt_tokens": 2048, "max_output_tokens": 8}


class EvaluationError(RuntimeError):
    """A run did not serve its workload correctly (missing, duplicate or short requests, timeout)."""


# ------------------------------------------------------------------------------------ config


@dataclass(frozen=True)
class EvalConfig:
    """Everything one evaluation is configured with (recorded in the JSON).

    Attributes:
        workload: the workload section (:class:`~feather_env.workloads.WorkloadConfig`).
        schedulers: scheduler names, run in this order.
        engine: the engine every scheduler runs on (``max_model_len`` is raised to fit the
            workload's longest request when it is too small).
        chunk_size: CHT chunk size of the Feather names (``None``: the policy's, else 512).
        max_wait: Feather's anti-starvation release after this many seconds (``None``: the
            scheduler's default, 60 s).
        warmup: run a throw-away batch on each engine before its timed run.
        isolated_probes: measure the isolated estimate (fairness: max slowdown).
        run_timeout_s: a run that takes longer is an error.
        quiet_wait_s: before each run, wait up to this long for the machine to be quiet
            (foreign CPU < 5%); 0: do not wait.
        max_foreign: a run during which other processes used more than this fraction of the
            machine is re-run (fresh engine, after waiting for quiet), at most ``retries`` times;
            the run with the least foreign load is kept. ``None``: never re-run.
        retries: re-runs allowed per scheduler (see ``max_foreign``).
        repeats: run every scheduler this many times (fresh engine each, schedulers alternating);
            its reported metrics are those of the run with the median decode throughput, and
            ``repeats`` lists every run's decode tok/s, mean and P95 latency.
        progress: show a tqdm progress bar per scheduler.
        plots: write the PNG plots.
    """

    workload: WorkloadConfig
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
    progress: bool = True
    plots: bool = True

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["schedulers"] = list(self.schedulers)
        return d

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ConfigError(f"repeats must be >= 1, got {self.repeats}")


def validate_schedulers(names: Sequence[str], chunk_size: int | None = None,
                        max_wait: float | None = None) -> tuple[str, ...]:
    """Check every name, and the knobs each gets, before anything runs: unknown name, duplicate,
    unreadable ``feather:PATH`` policy, a ``chunk_size`` or ``max_wait`` out of range, a chunk
    size that is not the policy's (the scheduler's own check, made at its engine's start).

    Raises:
        ConfigError: naming the bad entry and the known names.
    """
    from scheduler_runtime.policy import PLUGIN_PREFIX
    from scheduler_runtime.schedulers import SchedulerConfig, check_scheduler

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
    return names


def scheduler_overrides(name: str, chunk_size: int | None, max_wait: float | None) -> dict[str, Any]:
    """The :class:`~scheduler_runtime.schedulers.SchedulerConfig` fields an evaluation sets.

    Client hints are trusted (the evaluation replays its own workload: true lengths and sources);
    ``chunk_size`` and ``max_wait`` are Feather's knobs (the Feather names only).
    """
    if name == "fcfs":
        return {}
    overrides: dict[str, Any] = {"trust_client_hints": True}
    if name.startswith("feather"):
        if chunk_size is not None:
            overrides["chunk_size"] = chunk_size
        if max_wait is not None:
            overrides["max_wait"] = max_wait
    return overrides


def build_eval_workload(config: WorkloadConfig) -> Workload:
    """The workload every scheduler replays (loaders' DataNotFoundError says where to get data)."""
    return build_workload(config)


def engine_config_for(base: EngineConfig, workload: Workload) -> EngineConfig:
    """``base`` with ``max_model_len`` raised (if needed) to the workload's longest request."""
    peak = max(r.peak_tokens for r in workload)
    need = int(math.ceil((peak + 1) / base.block_size) * base.block_size)
    if base.max_model_len >= need:
        return base
    return replace(base, max_model_len=need)


# ------------------------------------------------------------------------------------ records


@dataclass
class RequestRecord:
    """One request's timeline in a run (seconds from the run's start, NaN when it never happened)."""

    request_id: str
    prompt_len: int
    output_len: int
    arrival: float
    source: str = ""
    added: float = math.nan
    first_scheduled: float = math.nan
    first_token: float = math.nan
    finish: float = math.nan
    tokens: int = 0
    prefix_hit_tokens: int = 0
    finished_count: int = 0


@dataclass
class StepRow:
    """One engine step: start (s from run start), wall time, and what its schedule() decided."""

    start: float
    seconds: float
    scheduled_reqs: int
    scheduled_tokens: int
    new_reqs: int
    running: int
    decode_only: bool


@dataclass
class RunRecord:
    """Everything measured in one scheduler's run (input of :func:`summarize`)."""

    scheduler: str
    requests: dict[str, RequestRecord]
    steps: list[StepRow]
    engine_start_s: float
    replay_s: float
    foreign_cpu: float
    preemptions: int
    scheduler_stats: dict[str, Any] | None


@dataclass
class IsolatedModel:
    """Time of a request alone on the idle engine (cold prefix cache), from lone probes.

    ``ttft_s[i]`` and ``tpot_s[i]`` were measured for a prompt of ``prompt_lens[i]`` tokens;
    other lengths are interpolated linearly (and held constant outside the probed range).
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


# ------------------------------------------------------------------------------------ engine


def _sampling(output_len: int, request: Request | None = None) -> Any:
    """Exactly ``output_len`` tokens, streamed as deltas, with the Feather hints of the request."""
    from scheduler_runtime.schedulers import EXTRA_OUTPUT_LEN, EXTRA_SOURCE

    extra: dict[str, Any] = {EXTRA_OUTPUT_LEN: int(output_len)}
    if request is not None and request.source:
        extra[EXTRA_SOURCE] = request.source
    return forced_length_params(output_len, extra_args=extra, delta=True)


def _drain(engine: Any, timeout_s: float = 600.0) -> None:
    deadline = time.perf_counter() + timeout_s
    while engine.has_unfinished_requests():
        if time.perf_counter() > deadline:
            raise EvaluationError(f"warm-up/probe requests did not finish within {timeout_s:.0f} s")
        engine.step()


def _warmup(llm: Any, tag: str, batch: int = 8, prompt_len: int = 512, output_len: int = 8) -> None:
    """A throw-away batch: the first engine steps after start-up are much slower than steady state."""
    rng = np.random.default_rng(12345)
    engine = llm.llm_engine
    for i in range(batch):
        engine.add_request(f"{tag}-warmup{i}", tokens_prompt(rng.integers(3, 8192, prompt_len)),
                           _sampling(output_len))
    _drain(engine)


def measure_isolated(llm: Any, max_prompt_len: int, output_tokens: int = 9) -> IsolatedModel:
    """Run lone probe requests (cold cache) at three prompt lengths up to ``max_prompt_len``."""
    engine = llm.llm_engine
    lens = sorted({max(1, min(256, max_prompt_len)), max(1, max_prompt_len // 2), max(1, max_prompt_len)})
    rng = np.random.default_rng(424242)
    ttft: list[float] = []
    tpot: list[float] = []
    for j, p in enumerate(lens):
        llm.reset_prefix_cache()
        engine.add_request(f"probe{j}", tokens_prompt(rng.integers(3, 8192, p)), _sampling(output_tokens))
        t0 = time.perf_counter()
        first = last = math.nan
        while engine.has_unfinished_requests():
            outs = engine.step()
            now = time.perf_counter()
            for out in outs:
                if out.outputs and out.outputs[0].token_ids:
                    if math.isnan(first):
                        first = now
                    last = now
        ttft.append(first - t0)
        tpot.append((last - first) / max(1, output_tokens - 1))
    llm.reset_prefix_cache()
    return IsolatedModel(lens, ttft, tpot, output_tokens)


def _scheduler_snapshot(scheduler: Any) -> dict[str, Any] | None:
    stats = getattr(scheduler, "feather_stats", None)
    if stats is None or getattr(scheduler, "feather", None) is None:
        return None
    return stats()


def _fresh_scheduler_state(scheduler: Any) -> None:
    """After the warm-up: rebuild the Feather runtime (policy state, counters) from its config."""
    if getattr(scheduler, "feather", None) is not None:
        scheduler.feather_configure(scheduler.feather_config)


def run_scheduler(
    name: str,
    workload: Workload,
    engine_config: EngineConfig,
    *,
    chunk_size: int | None = None,
    max_wait: float | None = None,
    warmup: bool = True,
    isolated: bool = False,
    run_timeout_s: float = 1800.0,
    quiet_wait_s: float = 0.0,
    progress: bool = True,
) -> tuple[RunRecord, IsolatedModel | None]:
    """Start an engine for scheduler ``name``, replay ``workload`` in real time, shut it down.

    Returns the run's record and, with ``isolated``, the isolated-time model measured on this
    engine before the run.

    Raises:
        EvaluationError: a request did not finish exactly once with its tokens, or the run
            took longer than ``run_timeout_s``.
    """
    from feather_env.engine import build_llm
    from scheduler_runtime.schedulers import engine_overrides

    overrides = engine_overrides(name, **scheduler_overrides(name, chunk_size, max_wait))
    extra = {**engine_config.extra, **overrides.pop("extra")}
    t_start = time.perf_counter()
    llm = build_llm(engine_config, extra=extra, **overrides)
    engine_start_s = time.perf_counter() - t_start
    try:
        core = engine_core_of(llm)
        scheduler = core.scheduler
        iso = None
        if warmup:
            _warmup(llm, "w")
        if isolated:
            iso = measure_isolated(llm, max(r.prompt_len for r in workload))
        llm.reset_prefix_cache()
        _fresh_scheduler_state(scheduler)
        if quiet_wait_s > 0:
            wait_for_quiet(0.05, timeout_s=quiet_wait_s)
        tap = ScheduleTap.on(scheduler)
        before = _scheduler_snapshot(scheduler)
        with ForeignLoad() as load:
            requests, steps, replay_s = _replay(llm, workload, tap, name, run_timeout_s, progress)
        after = _scheduler_snapshot(scheduler)
        stats = _stats_delta(before, after)
        return RunRecord(name, requests, steps, engine_start_s, replay_s, load.fraction, tap.preempted,
                         stats), iso
    finally:
        try:
            if llm.llm_engine.has_unfinished_requests():
                llm.llm_engine.abort_request(list(engine_core_of(llm).scheduler.requests), internal=True)
        except Exception:  # noqa: BLE001 - best effort before shutdown
            pass
        try:
            engine_core_of(llm).shutdown()
        except Exception:  # noqa: BLE001 - shutting down must not mask the original error
            pass
        del llm
        gc.collect()


def _stats_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    if after is None:
        return None
    out: dict[str, Any] = {}
    for key, value in after.items():
        prev = (before or {}).get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and isinstance(prev, int | float) \
                and key not in ("held", "batch", "kv_budget_used", "max_plan_seconds"):
            out[key] = value - prev
        elif isinstance(value, dict) and isinstance(prev, dict):
            out[key] = {k: v - prev.get(k, 0) for k, v in value.items()}
        else:
            out[key] = value
    return out


def _replay(
    llm: Any, workload: Workload, tap: ScheduleTap, name: str, timeout_s: float, progress: bool
) -> tuple[dict[str, RequestRecord], list[StepRow], float]:
    engine = llm.llm_engine
    order = sorted(workload, key=lambda r: r.arrival_time)  # stable: ties keep queue order
    records = {r.request_id: RequestRecord(r.request_id, r.prompt_len, r.output_len, float(r.arrival_time),
                                           r.source) for r in order}
    internal: dict[str, str] = {}
    steps: list[StepRow] = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(order), desc=f"{name:>22s}", unit="req", leave=True, file=sys.stderr)
    n_done = 0
    i = 0
    t0 = time.perf_counter()
    try:
        while True:
            now = time.perf_counter() - t0
            while i < len(order) and order[i].arrival_time <= now:
                r = order[i]
                rid = engine.add_request(r.request_id, tokens_prompt(r.prompt_token_ids),
                                         _sampling(r.output_len, r))
                internal[rid if isinstance(rid, str) else r.request_id] = r.request_id
                records[r.request_id].added = time.perf_counter() - t0
                i += 1
            busy = engine.has_unfinished_requests()
            if not busy:
                if i >= len(order):
                    break
                time.sleep(max(0.0, min(0.05, order[i].arrival_time - (time.perf_counter() - t0))))
                continue
            if now > timeout_s:
                raise EvaluationError(
                    f"scheduler {name!r}: run exceeded --run-timeout {timeout_s:.0f} s with "
                    f"{n_done}/{len(order)} requests finished")
            tap.reset()
            ts = time.perf_counter()
            outputs = engine.step()
            te = time.perf_counter()
            start, end = ts - t0, te - t0
            if tap.called:
                for rid, hit in tap.new:
                    ext = internal.get(rid) or _external_id(rid, records)
                    rec = records.get(ext) if ext is not None else None
                    if rec is not None and math.isnan(rec.first_scheduled):
                        rec.first_scheduled = start
                        rec.prefix_hit_tokens = hit
                steps.append(StepRow(start, end - start, tap.scheduled_reqs, tap.scheduled_tokens,
                                     len(tap.new), tap.running, tap.decode_only))
            for out in outputs:
                rec = records.get(out.request_id)
                if rec is None:
                    raise EvaluationError(f"scheduler {name!r}: the engine returned unknown request "
                                          f"{out.request_id!r}")
                n = sum(len(c.token_ids) for c in out.outputs)
                if n and math.isnan(rec.first_token):
                    rec.first_token = end
                rec.tokens += n
                if out.finished:
                    rec.finished_count += 1
                    if rec.finished_count > 1:
                        raise EvaluationError(f"scheduler {name!r}: request {rec.request_id} finished twice")
                    rec.finish = end
                    n_done += 1
                    if bar is not None:
                        bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    replay_s = time.perf_counter() - t0
    _check_complete(name, records)
    return records, steps, replay_s


def _external_id(internal_id: str, records: Mapping[str, RequestRecord]) -> str | None:
    """vLLM appends ``-XXXXXXXX`` to the caller's id; strip it."""
    base = internal_id.rsplit("-", 1)[0]
    return base if base in records else None


def _check_complete(name: str, records: Mapping[str, RequestRecord]) -> None:
    missing = [r.request_id for r in records.values() if r.finished_count == 0]
    if missing:
        raise EvaluationError(f"scheduler {name!r}: {len(missing)} of {len(records)} requests never "
                              f"finished: {missing[:5]}")
    wrong = {r.request_id: (r.tokens, r.output_len) for r in records.values() if r.tokens != r.output_len}
    if wrong:
        raise EvaluationError(f"scheduler {name!r}: {len(wrong)} requests returned the wrong number of "
                              f"tokens (got, want): {dict(list(wrong.items())[:5])}")


# ------------------------------------------------------------------------------------ metrics


def _pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if values.size else math.nan


def _mean(values: np.ndarray) -> float:
    return float(values.mean()) if values.size else math.nan


def summarize(run: RunRecord, isolated: IsolatedModel | None = None) -> dict[str, Any]:
    """The metrics of one run (module docstring); every value is a plain number or None."""
    recs = list(run.requests.values())
    arrival = np.array([r.arrival for r in recs])
    finish = np.array([r.finish for r in recs])
    first = np.array([r.first_token for r in recs])
    sched = np.array([r.first_scheduled for r in recs])
    out_len = np.array([r.output_len for r in recs])
    latency = finish - arrival
    ttft = first - arrival
    multi = out_len > 1
    tpot = (finish[multi] - first[multi]) / (out_len[multi] - 1)
    queue = sched - arrival
    queue = queue[~np.isnan(queue)]
    makespan = float(finish.max() - arrival.min())
    steps = run.steps
    step_s = float(sum(s.seconds for s in steps))
    dec = [s for s in steps if s.decode_only]
    decode_tokens = int(sum(s.scheduled_reqs for s in dec))
    decode_s = float(sum(s.seconds for s in dec))
    running = np.array([s.running for s in steps if s.running > 0])
    prompt_tokens = int(sum(r.prompt_len for r in recs))
    hits = int(sum(r.prefix_hit_tokens for r in recs))
    out_tokens = int(sum(r.tokens for r in recs))
    m: dict[str, Any] = {
        "submitted": len(recs),
        "completed": int(sum(1 for r in recs if r.finished_count == 1)),
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        "decode_tok_s": decode_tokens / decode_s if decode_s > 0 else 0.0,
        "decode_tokens": decode_tokens,
        "decode_seconds": decode_s,
        "makespan_s": makespan,
        "e2e_req_s": len(recs) / makespan if makespan > 0 else 0.0,
        "e2e_tok_s": out_tokens / makespan if makespan > 0 else 0.0,
        "latency_mean_s": _mean(latency),
        "latency_p50_s": _pct(latency, 50),
        "latency_p95_s": _pct(latency, 95),
        "latency_p99_s": _pct(latency, 99),
        "ttft_mean_s": _mean(ttft),
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p95_s": _pct(ttft, 95),
        "tpot_mean_s": _mean(tpot),
        "tpot_p95_s": _pct(tpot, 95),
        "queue_mean_s": _mean(queue),
        "queue_p95_s": _pct(queue, 95),
        "max_wait_s": float(queue.max()) if queue.size else math.nan,
        "mean_running_batch": _mean(running),
        "mean_decode_batch": _mean(np.array([s.scheduled_reqs for s in dec])),
        "prefix_hit_tokens": hits,
        "prefix_hit_rate": hits / prompt_tokens if prompt_tokens else 0.0,
        "engine_steps": len(steps),
        "decode_steps": len(dec),
        "step_seconds": step_s,
        "preemptions": run.preemptions,
        "scheduler_overhead_frac": None,
        "scheduler_arrival_frac": None,
        "scheduler_decision_s": None,
        "slowdown_mean": None,
        "max_slowdown": None,
        "foreign_cpu": run.foreign_cpu,
        "engine_start_s": run.engine_start_s,
        "replay_s": run.replay_s,
    }
    st = run.scheduler_stats
    if st is not None and step_s > 0:
        m["scheduler_decision_s"] = float(st.get("decision_seconds", 0.0))
        m["scheduler_overhead_frac"] = m["scheduler_decision_s"] / step_s
        m["scheduler_arrival_frac"] = float(st.get("arrival_seconds", 0.0)) / step_s
    if isolated is not None:
        iso = np.array([isolated.estimate(r.prompt_len, r.output_len) for r in recs])
        slow = latency / iso
        m["slowdown_mean"] = _mean(slow)
        m["max_slowdown"] = float(slow.max())
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in m.items()}


# ------------------------------------------------------------------------------------ outputs

#: columns of the markdown tables: (header, metric, format)
_TABLE_MAIN = [
    ("scheduler", None, None), ("done", "completed", "{:d}"), ("decode tok/s", "decode_tok_s", "{:.1f}"),
    ("e2e tok/s", "e2e_tok_s", "{:.1f}"), ("req/s", "e2e_req_s", "{:.3f}"),
    ("lat mean s", "latency_mean_s", "{:.2f}"), ("P50", "latency_p50_s", "{:.2f}"),
    ("P95", "latency_p95_s", "{:.2f}"), ("P99", "latency_p99_s", "{:.2f}"),
    ("TTFT s", "ttft_mean_s", "{:.2f}"), ("TPOT ms", "tpot_mean_s", "ms"),
]
_TABLE_MORE = [
    ("scheduler", None, None), ("queue s", "queue_mean_s", "{:.2f}"), ("max wait s", "max_wait_s", "{:.2f}"),
    ("max slowdown", "max_slowdown", "{:.1f}"), ("batch", "mean_running_batch", "{:.1f}"),
    ("decode batch", "mean_decode_batch", "{:.1f}"), ("prefix hit", "prefix_hit_rate", "{:.1%}"),
    ("sched overhead", "scheduler_overhead_frac", "{:.2%}"), ("preempt", "preemptions", "{:d}"),
    ("foreign CPU", "foreign_cpu", "{:.0%}"),
]


def _fmt(value: Any, fmt: str | None) -> str:
    if value is None:
        return "n/a"
    if fmt == "ms":
        return f"{1000 * value:.1f}"
    if fmt is None:
        return str(value)
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def metrics_tables(schedulers: Mapping[str, Mapping[str, Any]]) -> str:
    """Two markdown tables (throughput and latency; queueing, fairness and internals)."""
    out = []
    for cols in (_TABLE_MAIN, _TABLE_MORE):
        rows = [[name] + [_fmt(m.get(key), fmt) for _, key, fmt in cols[1:]]
                for name, m in schedulers.items()]
        out.append(format_table([h for h, _, _ in cols], rows))
    return "\n\n".join(out)


def _write_csv(path: Path, schedulers: Mapping[str, Mapping[str, Any]]) -> None:
    keys: list[str] = []
    for m in schedulers.values():
        keys += [k for k, v in m.items() if k not in keys and not isinstance(v, dict | list)]
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["scheduler", *keys])
        for name, m in schedulers.items():
            w.writerow([name] + ["" if m.get(k) is None else m.get(k) for k in keys])


def _write_requests_csv(path: Path, runs: Sequence[RunRecord]) -> None:
    cols = ["request_id", "source", "prompt_len", "output_len", "arrival", "first_scheduled",
            "first_token", "finish", "tokens", "prefix_hit_tokens"]
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["scheduler", *cols])
        for run in runs:
            for r in run.requests.values():
                w.writerow([run.scheduler] + [getattr(r, c) for c in cols])


def write_plots(out: Path, runs: Sequence[RunRecord], schedulers: Mapping[str, Mapping[str, Any]],
                title: str) -> list[Path]:
    """throughput.png (bars), latency_cdf.png, batch_size.png (running requests over time)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths: list[Path] = []

    def save(fig: Any, name: str, ax: Any = None) -> None:
        """Title, grid and legend of a one-axis figure (``ax``), then write and close it."""
        if ax is not None:
            ax.set_title(title, fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(out / name)
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)

    names = list(schedulers)
    x = np.arange(len(names))
    fig, axes = plt.subplots(1, 2, figsize=(max(7.0, 1.3 * len(names) + 4), 3.8))
    for ax, key, label in ((axes[0], "decode_tok_s", "decode tok/s (decode-only steps)"),
                           (axes[1], "e2e_tok_s", "end-to-end tok/s (makespan)")):
        vals = [schedulers[n].get(key) or 0.0 for n in names]
        ax.bar(x, vals, color="tab:blue")
        ax.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(label)
        for xi, v in zip(x, vals, strict=True):
            ax.annotate(f"{v:.0f}", (xi, v), ha="center", va="bottom", fontsize=7)
    fig.suptitle(title, fontsize=9)
    save(fig, "throughput.png")

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for run in runs:
        lat = np.sort([r.finish - r.arrival for r in run.requests.values()])
        ax.step(lat, np.arange(1, lat.size + 1) / lat.size, where="post", label=run.scheduler)
    ax.set_xlabel("latency (s, arrival -> last token)")
    ax.set_ylabel("fraction of requests")
    save(fig, "latency_cdf.png", ax)

    fig, ax = plt.subplots(figsize=(7, 4))
    for run in runs:
        t = [s.start for s in run.steps]
        ax.step(t, [s.running for s in run.steps], where="post", label=run.scheduler, lw=0.9)
    ax.set_xlabel("time since the run started (s)")
    ax.set_ylabel("running requests (after schedule())")
    save(fig, "batch_size.png", ax)
    return paths


# ------------------------------------------------------------------------------------ driver


def evaluate(
    config: EvalConfig,
    out_dir: str | Path | None,
    json_path: str | Path | None = None,
    *,
    workload: Workload | None = None,
    log: Callable[[str], None] = print,
    retry_until: float | None = None,
) -> dict[str, Any]:
    """Run every scheduler of ``config`` on one workload; write the outputs; return the JSON payload.

    ``retry_until``: a ``time.monotonic()`` deadline after which runs under foreign load are no
    longer re-run (keeps a benchmark inside its time budget).

    Raises:
        ConfigError: a bad scheduler name or knob (before any engine starts).
        DataNotFoundError: the workload's data is not on disk (the message says where to get it).
        EvaluationError: a run did not serve every request exactly once with its tokens.
    """
    names = validate_schedulers(config.schedulers, config.chunk_size, config.max_wait)
    t_all = time.perf_counter()
    if workload is None:
        workload = build_eval_workload(config.workload)
    engine = engine_config_for(config.engine, workload)
    desc = workload.describe()
    log(f"workload {desc['name']}: {desc['requests']} requests, {desc['groups']} prefix groups, "
        f"prompt mean {desc['prompt_tokens_mean']:.0f} / max {desc['prompt_tokens_max']} tokens, "
        f"output mean {desc['output_tokens_mean']:.1f} / max {desc['output_tokens_max']}, "
        f"reuse {desc['reuse_factor']:.2f}x, arrivals {desc['arrivals']} over {desc['arrival_span_s']:.1f} s")
    runs: list[RunRecord] = []
    results: dict[str, dict[str, Any]] = {}
    isolated: IsolatedModel | None = None
    done: dict[str, list[tuple[RunRecord, dict[str, Any]]]] = {name: [] for name in names}
    for rep in range(config.repeats):  # schedulers alternate, so slow phases of the machine hit all
        for name in names:
            run, iso, attempts = _run_quiet(name, workload, engine, config, isolated is None, retry_until,
                                            log)
            isolated = isolated or iso
            m = summarize(run, isolated)
            m["attempts"] = len(attempts)
            m["foreign_cpu_attempts"] = attempts
            m["scheduler_stats"] = run.scheduler_stats
            done[name].append((run, m))
            tag = f"{name} #{rep + 1}" if config.repeats > 1 else name
            log(f"  {tag:>24s}: {m['completed']}/{m['submitted']} done, "
                f"decode {m['decode_tok_s']:.1f} tok/s, e2e {m['e2e_tok_s']:.1f} tok/s, "
                f"latency mean {m['latency_mean_s']:.2f} s "
                f"P95 {m['latency_p95_s']:.2f} s, batch {m['mean_running_batch'] or 0:.1f}, "
                f"hit {m['prefix_hit_rate']:.0%}, foreign CPU {m['foreign_cpu']:.0%} "
                f"(engine start {m['engine_start_s']:.1f} s, replay {m['replay_s']:.1f} s)")
    for name in names:
        # Every metric comes from one run: the one with the median decode throughput.
        ranked = sorted(done[name], key=lambda e: e[1]["decode_tok_s"])
        run, m = ranked[(len(ranked) - 1) // 2]
        if config.repeats > 1:
            m["repeats"] = {k: [e[1][k] for e in done[name]]
                            for k in ("decode_tok_s", "latency_mean_s", "latency_p95_s", "foreign_cpu")}
        runs.append(run)
        results[name] = m
    payload: dict[str, Any] = {
        "schedulers": results,
        "workload": {**desc, "config": asdict(config.workload), "fingerprint": workload.fingerprint()},
        "engine": engine.to_dict(),
        "config": config.to_dict(),
        "isolated": isolated.to_dict() if isolated is not None else None,
        "machine": machine_info(),
        "wall_s": time.perf_counter() - t_all,
        "definitions": _DEFINITIONS,
    }
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "results.json", payload)
        _write_csv(out / "results.csv", results)
        _write_requests_csv(out / "requests.csv", runs)
        title = (f"{desc['name']}, {desc['requests']} requests, arrivals {desc['arrivals']} "
                 f"({payload['machine']['date']})")
        (out / "results.md").write_text(f"# Evaluation: {title}\n\n{metrics_tables(results)}\n")
        if config.plots:
            write_plots(out, runs, results, title)
    if json_path is not None:
        write_json(json_path, payload)
    return payload


def _run_quiet(
    name: str, workload: Workload, engine: EngineConfig, config: EvalConfig, isolated: bool,
    retry_until: float | None, log: Callable[[str], None],
) -> tuple[RunRecord, IsolatedModel | None, list[float]]:
    """One scheduler's run, re-run while other processes loaded the machine (``config.max_foreign``)."""
    best: tuple[RunRecord, IsolatedModel | None] | None = None
    attempts: list[float] = []
    for attempt in range(1 + max(0, config.retries)):
        if attempt:
            wait_for_quiet(0.05, timeout_s=max(config.quiet_wait_s, 30.0))
        run, iso = run_scheduler(
            name, workload, engine, chunk_size=config.chunk_size, max_wait=config.max_wait,
            warmup=config.warmup, isolated=config.isolated_probes and isolated,
            run_timeout_s=config.run_timeout_s, quiet_wait_s=config.quiet_wait_s, progress=config.progress)
        attempts.append(run.foreign_cpu)
        if best is None or run.foreign_cpu < best[0].foreign_cpu:
            best = (run, iso)
        if config.max_foreign is None or run.foreign_cpu <= config.max_foreign:
            break
        if retry_until is not None and time.monotonic() > retry_until:
            log(f"  {name}: foreign CPU {run.foreign_cpu:.0%} during the run, no time left to re-run it")
            break
        if attempt < config.retries:
            log(f"  {name}: foreign CPU {run.foreign_cpu:.0%} > {config.max_foreign:.0%} during the run "
                f"(other processes competed for the cores): re-running")
    assert best is not None
    return best[0], best[1], attempts


_DEFINITIONS = {
    "decode_tok_s": "tokens of decode-only engine steps / wall time of those steps",
    "e2e_tok_s": "generated tokens / makespan (first arrival -> last completion)",
    "latency": "nominal arrival -> last token",
    "ttft": "nominal arrival -> first token",
    "tpot": "(last token - first token) / (output tokens - 1)",
    "queue": "nominal arrival -> first scheduled by the engine",
    "max_slowdown": "max over requests of latency / isolated estimate (alone, cold cache)",
    "scheduler_overhead_frac": "Feather core decision time / total engine step time (n/a for fcfs)",
    "prefix_hit_rate": "prompt tokens found in the prefix cache when first scheduled / prompt tokens",
    "foreign_cpu": "other processes' CPU time / (cores x replay wall time)",
}


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", required=True, choices=WORKLOADS)
    p.add_argument("--data-dir", default=None, help="data root, or the workload's own folder "
                   "(leval/, longbench/ or traces/); default $FEATHER_DATA_DIR, else ../shared/data")
    p.add_argument("--schedulers", required=True, help="comma-separated scheduler names")
    p.add_argument("--arrival", default=None, help="burst | poisson:RATE | trace (default: trace for "
                   "splitwise, burst otherwise)")
    p.add_argument("--num-requests", type=int, default=None, help="keep this many requests at random")
    p.add_argument("--num-groups", type=int, default=None, help="keep this many whole prefix groups "
                   "(L-Eval documents; synthetic: groups to generate)")
    p.add_argument("--max-per-group", type=int, default=None, help="at most this many requests per group")
    p.add_argument("--tasks", default=None, help="comma-separated L-Eval/LongBench tasks (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-prompt-tokens", type=int, default=16384, help="prompt cap (L-Eval: documents "
                   "are cut, identically for every question of a document)")
    p.add_argument("--max-output-tokens", type=int, default=None, help="output cap (default: L-Eval 512, "
                   "LongBench the task's max new tokens, traces none)")
    p.add_argument("--output", choices=("answer", "max"), default="answer", help="L-Eval/LongBench output "
                   "length: the reference answer's (capped), or exactly the cap for every request "
                   "(decode-dominated, as a model that never stops early)")
    p.add_argument("--longbench-group-size", type=int, default=1, help="LongBench: consecutive items "
                   "sharing one context (1: no sharing)")
    p.add_argument("--per-group", default=8, help="synthetic: requests per group (int or spec such as "
                   "uniform:4:12)")
    p.add_argument("--prefix-len", default=4000, help="synthetic: shared prefix tokens (int or spec)")
    p.add_argument("--suffix-len", default=20, help="synthetic: unique suffix tokens (int or spec)")
    p.add_argument("--output-len", default=128, help="synthetic: output tokens (int or spec)")
    p.add_argument("--kv-cache-gib", type=float, default=4.0)
    p.add_argument("--max-num-seqs", type=int, default=64, help="max running batch")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="token budget of one step")
    p.add_argument("--cpu-cores", default=None, help='pin the engine\'s threads (CPU backend), e.g. "1"')
    p.add_argument("--chunk-size", type=int, default=None, help="Feather CHT chunk size in tokens")
    p.add_argument("--max-wait", type=float, default=None, help="Feather anti-starvation release (s)")
    p.add_argument("--no-warmup", action="store_true", help="skip the throw-away warm-up batch")
    p.add_argument("--no-isolated", action="store_true", help="skip the isolated probes (no slowdown)")
    p.add_argument("--run-timeout", type=float, default=1800.0, help="seconds; longer runs are errors")
    p.add_argument("--quiet-wait", type=float, default=0.0, help="wait up to S seconds for a quiet machine "
                   "before each run")
    p.add_argument("--max-foreign", type=float, default=None, help="re-run a run during which other "
                   "processes used more than this fraction of the machine (e.g. 0.1)")
    p.add_argument("--retries", type=int, default=2, help="re-runs allowed per scheduler with --max-foreign")
    p.add_argument("--repeats", type=int, default=1, help="runs per scheduler, alternating; metrics of the "
                   "run with the median decode tok/s")
    p.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK} unless given")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--json", default=None, help="also write the JSON here")
    return p.parse_args(argv)


def _int_or_spec(value: int | str) -> int | str:
    return int(value) if isinstance(value, int) or str(value).isdigit() else str(value)


def config_from_args(args: argparse.Namespace) -> EvalConfig:
    """The :class:`EvalConfig` of parsed command-line arguments (``--quick`` fills unset knobs)."""
    num_requests, max_prompt, max_output = args.num_requests, args.max_prompt_tokens, args.max_output_tokens
    if args.quick:
        if num_requests is None and args.num_groups is None:
            num_requests = QUICK["num_requests"]
        max_prompt = min(max_prompt, QUICK["max_prompt_tokens"]) if max_prompt else QUICK["max_prompt_tokens"]
        max_output = max_output or QUICK["max_output_tokens"]
    kind = args.workload
    tasks = tuple(t.strip() for t in args.tasks.split(",") if t.strip()) if args.tasks else None
    wl: dict[str, Any] = dict(kind=kind, data_dir=args.data_dir, tasks=tasks, max_prompt_tokens=max_prompt,
                              max_output_tokens=max_output, arrival=args.arrival, num_requests=num_requests,
                              num_groups=args.num_groups, max_per_group=args.max_per_group, seed=args.seed,
                              group_size=args.longbench_group_size, output=args.output)
    for key in ("per_group", "prefix_len", "suffix_len", "output_len"):
        wl[key] = _int_or_spec(getattr(args, key))
    engine = EngineConfig(kv_cache_gib=args.kv_cache_gib, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens, cpu_cores=args.cpu_cores,
                          max_model_len=256)  # raised to the workload's longest request
    return EvalConfig(
        workload=WorkloadConfig(**wl),
        schedulers=tuple(args.schedulers.split(",")),
        engine=engine,
        chunk_size=args.chunk_size,
        max_wait=args.max_wait,
        warmup=not args.no_warmup,
        isolated_probes=not args.no_isolated,
        run_timeout_s=args.run_timeout,
        quiet_wait_s=args.quiet_wait,
        max_foreign=args.max_foreign,
        retries=args.retries if args.max_foreign is not None else 0,
        repeats=args.repeats,
        progress=not args.no_progress,
        plots=not args.no_plots,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    try:
        config = config_from_args(args)
        payload = evaluate(config, args.out, args.json)
    except (ConfigError, DataNotFoundError, WorkloadError, EvaluationError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print()
    print(metrics_tables(payload["schedulers"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
