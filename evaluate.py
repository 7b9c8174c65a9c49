"""Evaluate schedulers on a workload: in-process on the real vLLM engine, or against any running server.

    python evaluate.py (--scenario NAME [--seed S] | --workload KIND [workload knobs]) [--quick]
                       (--schedulers fcfs,lpm,feather-heuristic,... | --endpoint URL [--max-concurrency N])
                       [--label NAME] [--goodput "ttft:MS tpot:MS e2el:MS"] [--out DIR] [--verbose] [--check]
    python evaluate.py --scenario NAME --backend sim [--episodes N] [--profile PROFILE.json]
                       --schedulers fcfs,lpm,feather-heuristic,feather:runs/x/policy.feather,...
    python evaluate.py compare DIR [DIR ...] [--out DIR]
    python evaluate.py advise --scenario FILE --goodput "ttft:MS tpot:MS" [--confirm] --out DIR

One workload (the same requests, token ids, output lengths and arrival times) is built once: a
scenario's episode (``configs/scenarios/NAME.yaml`` or a scenario file, episode ``--seed``) or a
``--workload`` sample. Then either

- **in-process** (``--schedulers``): one real vLLM engine in this process serves it once per
  scheduler, each scheduler deciding as it does under ``feather-serve`` (``fcfs`` is vLLM's own
  scheduler), on the engine clock (:mod:`feather_env.evaluation.inprocess`); or
- **simulator** (``--backend sim --schedulers ...``): the calibrated simulator serves a scenario's
  episodes ``--seed`` .. ``--seed + --episodes - 1`` once per scheduler, each answering its own
  decisions, in a few seconds and without an engine (:mod:`feather_env.evaluation.simulated`); the
  same tables and JSON keys as in-process (what the simulator cannot measure is ``n/a``); or
- **endpoint** (``--endpoint URL``): any running OpenAI-compatible completions server serves it
  (``feather-serve`` with any scheduler, or vLLM's own server with no Feather in it), timed at this
  client from the streamed answers (:mod:`feather_env.evaluation.endpoint`).

Every request asks for exactly its output length and is checked to get it; failures are counted
and reported, never dropped (in-process, one stops the evaluation: it is a bug). Every run is
reported in ``vllm bench serve``'s vocabulary (``output_throughput``, ``mean_ttft_ms``,
``p99_e2el_ms``, ``request_goodput`` with ``--goodput``, ...) plus the scheduler's own figures
(:mod:`feather_env.evaluation.report`). ``compare`` merges results folders, in-process and
endpoint alike, into the same tables and plots. ``advise`` searches schedulers x caps x per-step
token budgets for the best goodput under the SLOs on held-out windows of a scenario, and
recommends one (:mod:`feather_env.evaluation.advise`).

Outputs in ``--out`` (default ``runs/eval-DATE-TIME``): ``results.json``, ``results.md``,
``results.csv``, ``requests.csv``, ``steps.csv`` (in-process), ``throughput.png``,
``latency_cdf.png``, ``batch_size.png`` (in-process) and, in-process, ``vllm.log`` (vLLM's own
log lines; ``--verbose`` prints them instead). Exit status: 0, 1 when a request failed, 2 on bad
input (one line, reported before anything starts or any file is written). ``--check`` makes every
check and prints the evaluation as resolved (the workload, the engine, each scheduler as the engine
resolves it), then stops: nothing is written, no engine starts, nothing is served.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from feather_env.engines.vllm_engine import (
    EngineConfig,
    EngineError,
    send_vllm_logs_to,
    use_in_process_engine,
)

use_in_process_engine()  # before vLLM is imported

from feather_env.evaluation import (  # noqa: E402
    EndpointConfig,
    EndpointError,
    InProcessConfig,
    SimConfig,
    compare,
    episodes_workload,
    evaluate_endpoint,
    evaluate_in_process,
    evaluate_simulated,
    fit_engine,
    metrics_tables,
    probe_server,
    resolve_schedulers,
    results_payload,
    scheduler_config,
    schedulers_table,
    validate_schedulers,
    write_results,
)
from feather_env.reporting import check_output_dir, check_output_file, machine_info  # noqa: E402
from feather_env.scenarios import Scenario, load_scenario  # noqa: E402
from feather_env.serving_metrics import parse_goodput  # noqa: E402
from feather_env.step_model import profile_note  # noqa: E402
from feather_env.workloads import DataNotFoundError, Workload, WorkloadConfig, WorkloadError  # noqa: E402
from feather_env.workloads import build_workload as _build_workload  # noqa: E402
from scheduler_runtime.config import ConfigError  # noqa: E402

WORKLOADS = ("leval", "longbench", "sharegpt", "splitwise", "synthetic")
DEFAULT_SCHEDULERS = "fcfs,feather-heuristic"
#: --quick: a smoke run of 12 short requests (3 L-Eval documents x 4 questions by default), each
#: generating exactly 8 tokens, on a small KV cache.
QUICK = {"num_groups": 3, "max_per_group": 4, "num_requests": 12, "max_prompt_tokens": 2048,
         "max_output_tokens": 8, "kv_cache_gib": 0.5}
#: The engine of a --workload run unless flags say otherwise.
WORKLOAD_ENGINE = {"kv_cache_gib": 4.0, "max_num_seqs": 64, "max_num_batched_tokens": 8192}


def _parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="python evaluate.py compare --help: merge results folders")
    what = p.add_argument_group("workload (one of --scenario, --workload; --quick alone: 12 L-Eval requests)")
    what.add_argument("--scenario", default=None, help="a scenario name (configs/scenarios) or YAML path")
    what.add_argument("--seed", type=int, default=0, help="episode seed (--scenario) or sampling seed")
    what.add_argument("--workload", choices=WORKLOADS, default=None)
    what.add_argument("--data-dir", default=None, help="data root, or the workload's own folder; default "
                      "$FEATHER_DATA_DIR, else ../shared/data")
    what.add_argument("--arrival", default=None, help="burst | poisson:RATE | trace (default: the "
                      "scenario's; --workload: trace for splitwise, burst otherwise)")
    what.add_argument("--num-requests", type=int, default=None, help="keep this many requests at random")
    what.add_argument("--rate-scale", type=float, default=None,
                      help="--scenario: its episodes at this x the trace's rate (episode.rate_scale)")
    what.add_argument("--num-groups", type=int, default=None, help="keep this many whole prefix groups")
    what.add_argument("--max-per-group", type=int, default=None, help="at most this many requests per group")
    what.add_argument("--tasks", default=None, help="comma-separated L-Eval/LongBench tasks (default: all)")
    what.add_argument("--max-prompt-tokens", type=int, default=None, help="prompt cap (L-Eval documents are "
                      "cut identically for all their questions; --workload default 16384)")
    what.add_argument("--max-output-tokens", type=int, default=None, help="output cap")
    what.add_argument("--output", choices=("answer", "max"), default=None, help="output length: the "
                      "reference answer's (capped), or exactly the cap for every request")
    what.add_argument("--longbench-group-size", type=int, default=1, help="LongBench: items sharing a "
                      "context")
    what.add_argument("--per-group", default=8, help="synthetic: requests per group (int or spec)")
    what.add_argument("--prefix-len", default=4000, help="synthetic: shared prefix tokens (int or spec)")
    what.add_argument("--suffix-len", default=20, help="synthetic: unique suffix tokens (int or spec)")
    what.add_argument("--output-len", default=128, help="synthetic: output tokens (int or spec)")
    what.add_argument("--quick", action="store_true", help="smoke run: 12 requests of <= 2048 prompt tokens "
                      "generating 8 tokens each, KV cache 0.5 GiB (unless given)")

    how = p.add_argument_group("where it runs (one of --schedulers, --endpoint)")
    how.add_argument("--schedulers", default=None, help=f"in-process: comma-separated scheduler names "
                     f"(default {DEFAULT_SCHEDULERS})")
    how.add_argument("--endpoint", default=None, help="a running OpenAI-compatible server, http://HOST:PORT")
    how.add_argument("--model", default=None, help="endpoint: the served model (default: its only one)")
    how.add_argument("--max-concurrency", type=int, default=None, help="endpoint: requests in flight at most")
    how.add_argument("--no-hints", action="store_true", help="endpoint: do not send the Feather hints "
                     "(vllm_xargs feather_output_len, feather_source)")
    how.add_argument("--reset-prefix-cache", action="store_true", help="endpoint: empty the server's prefix "
                     "cache first, as each in-process run starts (vLLM: VLLM_SERVER_DEV_MODE=1)")
    how.add_argument("--request-timeout", type=float, default=600.0, help="endpoint: seconds per request")
    how.add_argument("--label", default=None, help="name of the run (in-process: prefix of each scheduler's)")
    how.add_argument("--backend", choices=("vllm", "sim"), default="vllm", help="--schedulers on the real "
                     "in-process engine (vllm, default) or on the simulator (sim: a scenario's episodes)")
    how.add_argument("--episodes", type=int, default=1, help="sim: serve episodes --seed .. --seed + N - 1 "
                     "back to back (default 1)")
    how.add_argument("--profile", default=None, help="sim: the simulator's calibrated profile (default: the "
                     "shipped one; make one with python -m feather_env.calibrate)")
    how.add_argument("--engine-slowdown", type=float, default=1.0, help="sim: multiply the simulator's step "
                     "times by this factor (a machine slower than the profile's; default 1)")

    eng = p.add_argument_group("in-process engine (default: the scenario's; --workload: 4 GiB, 64, 8192)")
    eng.add_argument("--kv-cache-gib", type=float, default=None)
    eng.add_argument("--max-num-seqs", type=int, default=None, help="max running batch")
    eng.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget of one step")
    eng.add_argument("--cpu-cores", default=None, help='pin the engine (CPU backend), e.g. "1"')
    eng.add_argument("--chunk-size", type=int, default=None, help="the batching core's chunk size in tokens "
                     "(Feather's CHT; every scheduler but fcfs)")
    eng.add_argument("--max-wait", type=float, default=None, help="anti-starvation release (s) of every "
                     "scheduler but fcfs")
    eng.add_argument("--no-warmup", action="store_true", help="skip the throw-away warm-up batch")
    eng.add_argument("--no-isolated", action="store_true", help="skip the isolated probes (no slowdown)")
    eng.add_argument("--run-timeout", type=float, default=1800.0, help="seconds; longer runs are errors")
    eng.add_argument("--quiet-wait", type=float, default=0.0, help="wait up to S s for a quiet machine")
    eng.add_argument("--max-foreign", type=float, default=None, help="re-run a run during which other "
                     "processes used more than this fraction of the machine (e.g. 0.1)")
    eng.add_argument("--retries", type=int, default=2, help="re-runs allowed per scheduler (--max-foreign)")
    eng.add_argument("--repeats", type=int, default=1, help="runs per scheduler, alternating; metrics of "
                     "the run with the median output tok/s")

    out = p.add_argument_group("report")
    out.add_argument("--goodput", nargs="+", default=None, metavar="SLO:MS",
                     help="SLOs for request_goodput, as vllm bench serve: ttft:MS tpot:MS e2el:MS")
    out.add_argument("--percentiles", default="50,90,95,99", help="latency percentiles (default 50,90,95,99)")
    out.add_argument("--out", default=None, help="output folder (default runs/eval-DATE-TIME)")
    out.add_argument("--json", default=None, help="also write the results JSON here")
    out.add_argument("--no-plots", action="store_true")
    out.add_argument("--no-progress", action="store_true")
    out.add_argument("--verbose", action="store_true", help="vLLM's log lines on the terminal, not in a file")
    out.add_argument("--check", action="store_true", help="check every input as the evaluation does, print "
                     "it as resolved (the workload, the engine, each scheduler as it will serve) and stop: "
                     "nothing is written, no engine starts, no request is served")
    return p.parse_args(argv)


def _int_or_spec(value: int | str) -> int | str:
    return int(value) if isinstance(value, int) or str(value).isdigit() else str(value)


def _percentiles(spec: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in spec.split(",") if v.strip())
    except ValueError:
        raise ConfigError(f"--percentiles {spec!r}: comma-separated numbers, e.g. 50,90,99") from None
    if not values or any(not 0 < v < 100 for v in values):
        raise ConfigError(f"--percentiles {spec!r}: numbers strictly between 0 and 100")
    return values


def _engine_overrides(args: argparse.Namespace) -> dict[str, Any]:
    given = {"kv_cache_gib": args.kv_cache_gib, "max_num_seqs": args.max_num_seqs,
             "max_num_batched_tokens": args.max_num_batched_tokens, "cpu_cores": args.cpu_cores}
    return {k: v for k, v in given.items() if v is not None}


def build_scenario(args: argparse.Namespace, *, simulated: bool = False) -> tuple[Scenario, dict[str, Any]]:
    """The scenario of ``--scenario`` with the command line's overrides, and the engine flags given.

    The scenario file is read once (``--quick`` reads it first for the caps it lowers, then derives
    the scenario from what it read). ``simulated``: the engine flags and the scheduler knobs are the
    scenario's own (the simulator serves the scenario as given), else they are left to the caller."""
    engine_flags = _engine_overrides(args)
    overrides: dict[str, dict[str, Any]] = {"workload": {}, "episode": {}}
    for key, value in (("max_prompt_tokens", args.max_prompt_tokens),
                       ("max_output_tokens", args.max_output_tokens), ("output", args.output),
                       ("data_dir", args.data_dir)):
        if value is not None:
            overrides["workload"][key] = value
    for key, value in (("groups", args.num_groups), ("max_per_group", args.max_per_group),
                       ("requests", args.num_requests), ("arrival", args.arrival),
                       ("rate_scale", args.rate_scale)):
        if value is not None:
            overrides["episode"][key] = value
    source: str | Scenario = args.scenario
    if args.quick:
        source = base = load_scenario(args.scenario)
        for key in ("max_prompt_tokens", "max_output_tokens"):
            cap = QUICK[key]
            current = getattr(base.workload, key)
            overrides["workload"].setdefault(key, cap if current is None else min(cap, current))
        overrides["workload"].setdefault("output", "max")
        if base.episode.groups is not None:
            overrides["episode"].setdefault("groups", QUICK["num_groups"])
            overrides["episode"].setdefault("max_per_group", QUICK["max_per_group"])
        else:
            overrides["episode"].setdefault("requests", QUICK["num_requests"])
        # a small KV cache, unless the scenario's is smaller still
        engine_flags.setdefault("kv_cache_gib", min(QUICK["kv_cache_gib"], base.engine.kv_cache_gib))
    if simulated:
        overrides["engine"] = engine_flags
        knobs = (("chunk_size", args.chunk_size), ("max_wait", args.max_wait))
        overrides["scheduler"] = {k: v for k, v in knobs if v is not None}
    scenario = load_scenario(source, {k: v for k, v in overrides.items() if v})
    return scenario, engine_flags


def build_workload(args: argparse.Namespace) -> tuple[Workload, EngineConfig, dict[str, Any]]:
    """The workload of the command line, the in-process engine for it, and what to record about it."""
    if args.scenario is not None and args.workload is not None:
        raise ConfigError("give --scenario or --workload, not both")
    quick = args.quick
    if args.scenario is None and args.workload is None:
        if not quick:
            raise ConfigError("no workload: give --scenario NAME, --workload KIND, or --quick")
        args.workload = "leval"
    if args.scenario is not None:
        scenario, engine_flags = build_scenario(args)
        workload = scenario.episode_workload(args.seed)
        engine = replace(scenario.engine_config(), **engine_flags)
        knobs = {"chunk_size": scenario.scheduler.chunk_size, "max_wait": scenario.scheduler.max_wait}
        record = {"scenario": scenario.to_dict(), "episode_seed": args.seed}
    else:
        engine_flags = _engine_overrides(args)
        num_requests, num_groups, max_per_group = args.num_requests, args.num_groups, args.max_per_group
        max_prompt = 16384 if args.max_prompt_tokens is None else args.max_prompt_tokens
        max_output, output = args.max_output_tokens, args.output or "answer"
        if quick:
            if args.workload == "leval" and num_requests is None and num_groups is None:
                num_groups, max_per_group = QUICK["num_groups"], max_per_group or QUICK["max_per_group"]
            elif num_requests is None and num_groups is None:
                num_requests = QUICK["num_requests"]
            max_prompt = min(max_prompt, QUICK["max_prompt_tokens"])
            max_output = max_output or QUICK["max_output_tokens"]
            output = args.output or "max"
            engine_flags.setdefault("kv_cache_gib", QUICK["kv_cache_gib"])
        tasks = tuple(t.strip() for t in args.tasks.split(",") if t.strip()) if args.tasks else None
        wl: dict[str, Any] = dict(kind=args.workload, data_dir=args.data_dir, tasks=tasks,
                                  max_prompt_tokens=max_prompt, max_output_tokens=max_output,
                                  arrival=args.arrival, num_requests=num_requests, num_groups=num_groups,
                                  max_per_group=max_per_group, seed=args.seed,
                                  group_size=args.longbench_group_size, output=output)
        for key in ("per_group", "prefix_len", "suffix_len", "output_len"):
            wl[key] = _int_or_spec(getattr(args, key))
        config = WorkloadConfig(**wl)
        workload = _build_workload(config)
        engine = fit_engine(EngineConfig(**{**WORKLOAD_ENGINE, **engine_flags}), workload)
        knobs = {"chunk_size": None, "max_wait": None}
        record = {"workload_config": asdict(config)}
    if args.chunk_size is not None:
        knobs["chunk_size"] = args.chunk_size
    if args.max_wait is not None:
        knobs["max_wait"] = args.max_wait
    return workload, engine, {**record, "scheduler_knobs": knobs}


def _simulated_scenario(args: argparse.Namespace) -> tuple[Scenario, SimConfig]:
    """``--backend sim``: the scenario (engine flags and scheduler knobs applied) and how to serve it,
    every input checked."""
    if args.scenario is None:
        raise ConfigError("--backend sim serves a scenario's episodes: give --scenario NAME (or a scenario "
                          "file; python -m feather_env.scenarios new makes one from a trace)")
    if args.endpoint is not None:
        raise ConfigError("--backend sim serves in the simulator; --endpoint is a running server: give one")
    if args.episodes < 1:
        raise ConfigError(f"--episodes must be >= 1, got {args.episodes}")
    if args.seed < 0:
        raise ConfigError(f"--seed must be >= 0, got {args.seed}")
    scenario, _ = build_scenario(args, simulated=True)
    if args.profile is not None:
        from feather_env.calibrate import load_profile

        load_profile(args.profile)
    names = tuple(n.strip() for n in (args.schedulers or DEFAULT_SCHEDULERS).split(",") if n.strip())
    slos = parse_goodput(args.goodput) if args.goodput else None
    config = SimConfig(names, tuple(range(args.seed, args.seed + args.episodes)), args.profile, args.label,
                       args.engine_slowdown, slos)
    validate_schedulers(config.schedulers, scenario.scheduler.chunk_size, scenario.scheduler.max_wait,
                        slos=slos)
    return scenario, config


def run_simulated(args: argparse.Namespace) -> tuple[list[Any], dict[str, Any], Workload] | None:
    """``--backend sim``: every scheduler on the scenario's episodes (the runs, what to record, the
    episodes as one workload); ``None`` after ``--check``."""
    scenario, config = _simulated_scenario(args)
    workload = episodes_workload(scenario, config.seeds)
    print(_describe(workload))
    engine = scenario.engine_config()
    print(f"simulator: {_engine_line(engine)}, profile {config.profile or 'shipped'}; "
          f"episode(s) {', '.join(map(str, config.seeds))}")
    note = profile_note(config.profile, machine_info())
    if note:
        print(note)
    if args.check:
        resolved = resolve_schedulers(scenario, config)
        print(schedulers_table([r.scheduler for r in resolved.values()], engine))
        return None
    runs = evaluate_simulated(scenario, config)
    record = {"mode": "simulator", "scenario": scenario.to_dict(), "episode_seed": config.seeds[0],
              "engine": engine.to_dict(), "simulator": config.to_dict(),
              "scheduler_knobs": {"chunk_size": scenario.scheduler.chunk_size,
                                  "max_wait": scenario.scheduler.max_wait}}
    return runs, record, workload


def _engine_line(engine: EngineConfig) -> str:
    """The engine's figures as the evaluation prints them."""
    return (f"KV cache {engine.kv_cache_gib:g} GiB ({engine.kv_cache_tokens:,} tokens), max "
            f"{engine.max_num_seqs} running, {engine.max_num_batched_tokens} tokens/step")


def _describe(workload: Workload) -> str:
    d = workload.describe()
    return (f"workload {d['name']}: {d['requests']} requests, {d['groups']} prefix groups, prompts mean "
            f"{d['prompt_tokens_mean']:.0f} / max {d['prompt_tokens_max']} tokens, outputs mean "
            f"{d['output_tokens_mean']:.1f} / max {d['output_tokens_max']}, arrivals {d['arrivals']} over "
            f"{d['arrival_span_s']:.1f} s")


def _checked(out: Path) -> int:
    """``--check``'s last line, once every input passed."""
    print(f"checked: every input is valid; nothing was written to {out}, no engine started, nothing served")
    return 0


def _where(out: Path, written: Sequence[Path]) -> str:
    plots = [p.name for p in written if p.suffix == ".png"]
    line = f"results in {out}/: results.json, results.md, requests.csv"
    return line + (f"; plots {', '.join(plots)}" if plots else "")


def run(argv: Sequence[str], backend: Any = None) -> int:
    """``evaluate.py`` without a subcommand (module docstring). ``backend``: an in-process
    :class:`~feather_env.engines.vllm_backend.VLLMBackend` to serve on instead of starting one (tests)."""
    args = _parse_args(argv)
    t_all = time.perf_counter()
    # -- everything that can be wrong is checked before an engine starts or a request is sent
    if (args.schedulers is not None) and (args.endpoint is not None):
        raise ConfigError("give --schedulers (in-process) or --endpoint (a running server), not both: "
                          "a server runs its own scheduler")
    goodput = parse_goodput(args.goodput) if args.goodput else None
    percentiles = _percentiles(args.percentiles)
    sim_only = args.episodes != 1 or args.profile is not None or args.engine_slowdown != 1.0
    if args.backend != "sim" and sim_only:
        raise ConfigError("--episodes, --profile and --engine-slowdown are for --backend sim (the real "
                          "engine serves one episode, --seed)")
    out = _out_dir(args.out, "eval")
    if args.json:  # written last, after every run: a path that cannot take it is refused first
        check_output_file(args.json, "--json")
    if args.backend == "sim":
        simulated = run_simulated(args)
        if simulated is None:
            return _checked(out)
        runs, context, workload = simulated
        return _report(args, out, runs, workload, context, goodput, percentiles, t_all)
    endpoint = server = None
    if args.endpoint is not None:
        endpoint = EndpointConfig(args.endpoint, model=args.model, max_concurrency=args.max_concurrency,
                                  label=args.label, hints=not args.no_hints,
                                  reset_prefix_cache=args.reset_prefix_cache,
                                  request_timeout_s=args.request_timeout)
        server = probe_server(endpoint)
    else:
        if args.max_concurrency is not None or args.model is not None:
            raise ConfigError("--max-concurrency and --model are for --endpoint runs")
        schedulers = validate_schedulers((args.schedulers or DEFAULT_SCHEDULERS).split(","),
                                         args.chunk_size, args.max_wait, slos=goodput)
    workload, engine, record = build_workload(args)
    print(_describe(workload))
    progress = not args.no_progress
    if endpoint is not None:
        assert server is not None
        print(f"endpoint {server.root}, model {server.model}"
              + (f", at most {endpoint.max_concurrency} in flight" if endpoint.max_concurrency else "")
              + (": the server runs its own scheduler" if args.check else ""))
        if args.check:
            return _checked(out)
        runs = [evaluate_endpoint(workload, endpoint, progress=progress, server=server)]
        context: dict[str, Any] = {"mode": "endpoint", "endpoint": endpoint.to_dict()}
    else:
        engine.check_startable()  # the machine's cores, a KV cache and step budget vLLM starts with
        knobs = record["scheduler_knobs"]
        config = InProcessConfig(
            schedulers=schedulers, engine=engine, chunk_size=knobs["chunk_size"], max_wait=knobs["max_wait"],
            warmup=not args.no_warmup, isolated_probes=not args.no_isolated, run_timeout_s=args.run_timeout,
            quiet_wait_s=args.quiet_wait, max_foreign=args.max_foreign,
            retries=args.retries if args.max_foreign is not None else 0, repeats=args.repeats,
            label=args.label, goodput=goodput)
        line = (f"in-process engine: {_engine_line(engine)}, max model length {engine.max_model_len:,}, "
                f"cores {engine.cpu_cores or 'all'}")
        if args.check:
            print(line)
            configs = [scheduler_config(name, config.chunk_size, config.max_wait) for name in schedulers]
            print(schedulers_table(configs, engine))
            return _checked(out)
        if not args.verbose:
            send_vllm_logs_to(out / "vllm.log")
            line += f" (vLLM's log: {out / 'vllm.log'})"
        print(line)
        runs, info = evaluate_in_process(workload, config, progress=progress, backend=backend)
        context = {"mode": "in-process", "engine": engine.to_dict(), "inprocess": config.to_dict(), **info}
    return _report(args, out, runs, workload, {**record, **context}, goodput, percentiles, t_all)


def _report(args: argparse.Namespace, out: Path, runs: Sequence[Any], workload: Workload,
            context: dict[str, Any], goodput: dict[str, float] | None, percentiles: tuple[float, ...],
            t_all: float) -> int:
    """Write the results folder, print the tables; exit status 1 when a request failed."""
    payload = results_payload(runs, goodput=goodput, percentiles=percentiles, workload={
        **workload.describe(), "fingerprint": workload.fingerprint()}, **context,
        wall_s=time.perf_counter() - t_all)
    d = payload["workload"]
    title = f"{d['name']}, {d['requests']} requests, arrivals {d['arrivals']} ({payload['machine']['date']})"
    written = write_results(out, payload, runs, title=title, plots=not args.no_plots)
    if args.json:
        from feather_env.reporting import write_json

        write_json(args.json, payload, quiet=True)
    print()
    print(metrics_tables(payload["runs"]))
    print()
    print(_where(out, written))
    failed = {label: m["failed"] for label, m in payload["runs"].items() if m["failed"]}
    if failed:
        print(f"FAILED requests: {failed} (why: 'errors' in {out / 'results.json'})", file=sys.stderr)
        return 1
    return 0


def run_compare(argv: Sequence[str]) -> int:
    """``evaluate.py compare DIR...``: merge results folders into one report."""
    p = argparse.ArgumentParser(prog="evaluate.py compare", description="Merge evaluation results folders "
                                "(in-process and endpoint alike) into the same tables and plots.")
    p.add_argument("dirs", nargs="+", help="results folders written by evaluate.py")
    p.add_argument("--out", default=None, help="output folder (default runs/compare-DATE-TIME)")
    p.add_argument("--no-plots", action="store_true")
    args = p.parse_args(argv)
    out = _out_dir(args.out, "compare")
    try:
        payload, written = compare(args.dirs, out, plots=not args.no_plots)
    except (FileNotFoundError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
    if not payload["same_workload"]:
        print("note: the folders did not serve the same workload (their workload fingerprints differ)")
    print(metrics_tables(payload["runs"]))
    print()
    print(_where(out, written))
    return 0


def _out_dir(given: str | None, command: str) -> Path:
    """``--out`` as given, else ``runs/COMMAND-DATE-TIME``, checked (:func:`check_output_dir`)."""
    out = Path(given or f"runs/{command}-{dt.datetime.now():%Y%m%d-%H%M%S}")
    check_output_dir(out, "--out")
    return out


def run_advise(argv: Sequence[str], backend: Any = None) -> int:
    """``evaluate.py advise``: the best scheduler, token budget and admission rule for the SLOs
    (:mod:`feather_env.evaluation.advise`)."""
    from feather_env.evaluation.advise import ADMISSION_RULES, DEFAULT_BUDGETS, AdviseConfig, advise, plan

    p = argparse.ArgumentParser(prog="evaluate.py advise", description="Which scheduler, per-step token "
                                "budget and admission rule serve a scenario's traffic best under latency "
                                "SLOs, searched in the simulator (tuned on some windows, reported on "
                                "held-out ones), against vLLM's default.")
    p.add_argument("--scenario", required=True, help="a scenario name or YAML file (your trace's: "
                   "python -m feather_env.scenarios new)")
    p.add_argument("--goodput", nargs="+", required=True,
                   help='the SLOs, as vLLM\'s --goodput: "ttft:MS tpot:MS e2el:MS" (any of them)')
    p.add_argument("--out", default=None, help="output folder: advice.json, advice.md, goodput.png (default "
                   "runs/advise-DATE-TIME)")
    p.add_argument("--confirm", action="store_true", help="serve the recommendation and the default on the "
                   "real engine (alternating, --repeats runs each) and print the measured ratio")
    p.add_argument("--repeats", type=int, default=3, help="--confirm: runs of each (default 3)")
    p.add_argument("--confirm-top", type=int, default=None, metavar="K",
                   help="serve the simulator's best K settings too and recommend the engine's pick among "
                   "them (implies --confirm)")
    p.add_argument("--windows", type=int, default=4, help="held-out windows (episodes) the best settings "
                   "are served on (default 4)")
    p.add_argument("--first-seed", type=int, default=100,
                   help="the first held-out episode seed (default 100)")
    p.add_argument("--schedulers", default=None, help="base scheduler names to search (default: fcfs, lpm, "
                   "group-cap-1,2,3,4,6,8)")
    p.add_argument("--policies", default=None,
                   help="learned policy files searched beside them (comma-separated)")
    p.add_argument("--budgets", default=None, help=f"per-step token budgets (default "
                   f"{','.join(map(str, DEFAULT_BUDGETS))} up to the engine's)")
    p.add_argument("--shortlist", type=int, default=6,
                   help="settings served on every window (default 6)")
    p.add_argument("--noise", type=float, default=0.03,
                   help="relative difference taken as noise (default 0.03)")
    p.add_argument("--admission", action=argparse.BooleanOptionalAction, default=None,
                   help="search admission rules with the schedulers, caps and budgets, ranked by SLO "
                   "attainment (default: on when --goodput has a ttft SLO)")
    p.add_argument("--admission-rules", default=None, help=f"the rules searched (default "
                   f"{','.join(ADMISSION_RULES)}; slo and deadline need a ttft SLO, slo+tpot a tpot "
                   "SLO too)")
    p.add_argument("--admission-bases", type=int, default=3, help="the best settings without a rule the "
                   "rules are searched on, beside fcfs at each budget (default 3)")
    p.add_argument("--thresholds", type=int, default=8,
                   help="log-spaced thresholds of each rule (default 8)")
    p.add_argument("--light-load", type=float, default=3.0, help="price the recommended rule at the "
                   "scenario's rate divided by this (default 3)")
    p.add_argument("--profile", default=None, help="the simulator's profile (default: chosen by a short "
                   "probe of the real engine, refitted when off by more than 10%%)")
    p.add_argument("--probe-window-s", type=float, default=20.0, help="the probe's window of the trace "
                   "(seconds of trace time, at most the scenario's window; default 20)")
    p.add_argument("--no-what-if", action="store_true", help="skip the 2x KV cache and replica what-ifs")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--check", action="store_true", help="check every input, print what the advice will serve "
                   "(the profile's choice, the settings and windows of the search, the what-ifs, what the "
                   "engine confirms) and stop: nothing is written, no engine starts, nothing is served")
    args = p.parse_args(argv)
    out = _out_dir(args.out, "advise")

    def names(text: str | None) -> tuple[str, ...] | None:
        return None if text is None else tuple(n.strip() for n in text.split(",") if n.strip())

    try:
        budgets = None if args.budgets is None else tuple(int(b) for b in names(args.budgets) or ())
    except ValueError:
        raise ConfigError(f"--budgets must be comma-separated integers, got {args.budgets!r}") from None
    config = AdviseConfig(slos=parse_goodput(args.goodput), windows=args.windows, first_seed=args.first_seed,
                          schedulers=names(args.schedulers), policies=names(args.policies) or (),
                          budgets=budgets, shortlist=args.shortlist, noise=args.noise, profile=args.profile,
                          what_if=not args.no_what_if, confirm=args.confirm or args.confirm_top is not None,
                          repeats=args.repeats,
                          confirm_top=1 if args.confirm_top is None else args.confirm_top,
                          probe_window_s=args.probe_window_s, admission=args.admission,
                          admission_rules=names(args.admission_rules) or ADMISSION_RULES,
                          admission_bases=args.admission_bases, thresholds=args.thresholds,
                          light_load=args.light_load)
    scenario = load_scenario(args.scenario)
    if args.check:
        print(plan(scenario, config))
        print(f"engine: {_engine_line(scenario.engine_config())}")
        return _checked(out)
    payload = advise(scenario, config, out, backend=backend, progress=not args.no_progress)
    print()
    print((out / "advice.md").read_text())
    print(f"wrote {out / 'advice.json'}, {out / 'advice.md'}, {out / 'goodput.png'}")
    return 0 if payload["recommendation"]["predicted_goodput"] is not None else 1


def main(argv: Sequence[str] | None = None, backend: Any = None) -> int:
    """The command line (module docstring); ``backend``: see :func:`run`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["compare"]:
            return run_compare(argv[1:])
        if argv[:1] == ["advise"]:
            return run_advise(argv[1:], backend=backend)
        return run(argv, backend=backend)
    except (ConfigError, DataNotFoundError, WorkloadError, EndpointError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except EngineError as exc:
        print(f"error: the engine did not serve the workload correctly: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
