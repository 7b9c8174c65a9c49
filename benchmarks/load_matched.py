"""A Poisson scenario served at the load it was written for, on a machine that runs at another speed.

    python -m benchmarks.load_matched [--scenario leval-kv-pressure-poisson] [--repeats 3]
                                      [--rate R] [--json results/load_matched.json] [--merge]

A scenario's Poisson rate is in requests per second, so how loaded it leaves the engine depends on
the machine: on an engine ``k`` times slower than the one the simulator's profile was fitted on,
``poisson:R`` loads it as ``poisson:k*R`` would have loaded that one, and a scheduler's gain changes
with the load (a cap on documents wins less the heavier the load; the design notes). The
evaluation (:mod:`benchmarks.evaluation`) serves every scenario at its stated rate; this benchmark
serves one at the rate that gives it, on this machine as it runs now, the load of the machine the
policies were trained for:

1. ``k`` (:func:`machine_slowdown`): the isolated probes (a lone request on the idle engine, cold
   cache, at the scenario's prompt lengths, :func:`~feather_env.evaluation.inprocess.measure_isolated`)
   against the same prefills predicted by the simulator's profile, the median ratio over the probes
   of at least :data:`MIN_PROBE_TOKENS` tokens (prefill-bound, as the L-Eval workloads are);
2. the scenario's episode 0 at ``poisson:R/k`` (or ``--rate``), served as the evaluation serves
   it (:func:`benchmarks.evaluation.run_scenario`: one engine, :data:`SCHEDULERS` alternating
   ``--repeats`` times, the run with the median output throughput, the bounds);
3. the simulator told the machine is ``k`` times slower, on the same episode at the same rate
   (``evaluate.py --backend sim --engine-slowdown k --arrival poisson:R/k``): what it predicted.

It prints the scenario's table and the evaluation's ratios. The JSON holds a list of such runs:
``--merge`` keeps the runs of an existing ``--json`` made on other machines or at other rates (a run of
the same machine and rate is replaced), so one file can show how the figures move with the machine's
speed; :func:`render` (``docs/results.md``) and :func:`render_headline` (the README) show every run.
Run it under ``flock /tmp/feather-engine.lock`` on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks import measured
from feather_env.engines.vllm_engine import use_in_process_engine  # noqa: E402  (before vLLM is imported)

use_in_process_engine()

from benchmarks.evaluation import (  # noqa: E402
    EPISODE_SEED,
    REPO,
    _bounds,
    comparisons,
    comparisons_table,
    engine_key,
    run_scenario,
    summary_table,
)
from feather_env.reporting import format_table, machine_info, write_json  # noqa: E402
from scheduler_runtime.config import ConfigError  # noqa: E402

__all__ = ["SCHEDULERS", "machine_slowdown", "main", "merge_runs", "render", "render_headline"]

SCENARIO = "leval-kv-pressure-poisson"
#: The evaluation's schedulers without the SVF ones (the question here is the group decision).
SCHEDULERS = ("fcfs", "lpm", "dfs-weight", "feather-heuristic", "heuristic-tuned", "shipped", "general")
#: Probes shorter than this are dominated by the step's fixed cost, not by the prefill.
MIN_PROBE_TOKENS = 1024


def machine_slowdown(isolated: Mapping[str, Any], profile: str | Path | None = None) -> dict[str, Any]:
    """How many times slower this engine runs than the simulator's profile predicts.

    ``isolated``: the isolated probes (``IsolatedModel.to_dict()``); ``profile``: the simulator's
    profile (default: the shipped one). Each probe's TTFT against the profile's step model for one
    lone prefill of the same prompt; the median over the probes of at least
    :data:`MIN_PROBE_TOKENS` tokens (all of them when none is that long).
    """
    from feather_env.calibrate import load_profile
    from feather_env.records import StepRequest
    from feather_env.step_model import StepCostModel

    model = StepCostModel.from_dict(load_profile(profile)["step_model"])
    probes = []
    for p, ttft in zip(isolated["prompt_lens"], isolated["ttft_s"], strict=True):
        predicted = model.predict([StepRequest(int(p), 0, 0, 0, True)])
        probes.append({"prompt_tokens": int(p), "engine_ttft_s": float(ttft), "profile_prefill_s": predicted,
                       "ratio": float(ttft) / predicted})
    long = [q["ratio"] for q in probes if q["prompt_tokens"] >= MIN_PROBE_TOKENS]
    long = long or [q["ratio"] for q in probes]
    return {"slowdown": statistics.median(long), "probes": probes}


def _poisson_rate(arrival: str) -> float:
    from feather_env.workloads.arrivals import PoissonArrivals, parse_arrival

    try:
        process = parse_arrival(arrival)
    except ConfigError:
        process = None
    if not isinstance(process, PoissonArrivals):
        raise SystemExit(f"the scenario's arrivals are {arrival!r}; this benchmark rescales poisson:RATE")
    return process.rate


def simulated(scenario: str, arrival: str, slowdown: float, aliases: Mapping[str, str]) -> dict[str, Any]:
    """The simulator's figures for the same episode at ``arrival``, ``slowdown`` times slower."""
    from feather_env.evaluation.report import summarize
    from feather_env.evaluation.simulated import SimConfig, evaluate_simulated
    from feather_env.scenarios import load_scenario

    sc = load_scenario(load_scenario(scenario), {"episode": {"arrival": arrival}})
    names = tuple(aliases.values())
    config = SimConfig(schedulers=names, seeds=(EPISODE_SEED,), engine_slowdown=slowdown)
    runs = evaluate_simulated(sc, config, log=None)
    alias_of = {n: a for a, n in aliases.items()}
    out = {}
    for run in runs:
        m = summarize(run)
        out[alias_of[run.label]] = {k: m[k] for k in ("output_throughput", "mean_e2el_ms")}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    from feather_env.engines.vllm_backend import VLLMBackend
    from feather_env.engines.vllm_engine import send_vllm_logs_to
    from feather_env.evaluation.inprocess import measure_isolated, warm_up
    from feather_env.scenarios import load_scenario

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenario", default=SCENARIO, help="a scenario with poisson:RATE arrivals")
    p.add_argument("--repeats", type=int, default=3, help="runs per scheduler, alternating")
    p.add_argument("--rate", type=float, default=None,
                   help="serve at this rate instead of the scenario's divided by the measured slowdown")
    p.add_argument("--json", default=str(REPO / "results" / "load_matched.json"))
    p.add_argument("--out", default=None, help="the run folder (default: results/eval beside --json)")
    p.add_argument("--merge", action="store_true",
                   help="keep the runs of an existing --json of other machines or rates")
    args = p.parse_args(argv)
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    if args.rate is not None and not args.rate > 0:
        raise SystemExit("--rate must be > 0")
    json_path = Path(args.json)
    out_root = Path(args.out) if args.out else json_path.parent / "eval"
    send_vllm_logs_to(out_root / "vllm.log")
    t0 = time.perf_counter()
    scenario = load_scenario(args.scenario)
    stated = _poisson_rate(scenario.episode.arrival)
    engine = scenario.engine_config()
    workload = scenario.episode_workload(EPISODE_SEED)
    backend = VLLMBackend(engine)
    engines = {engine_key(engine): backend}
    try:
        warm_up(backend, engine.max_model_len)
        isolated = measure_isolated(backend, max(r.prompt_len for r in workload))
        speed = machine_slowdown(isolated.to_dict())
        rate = args.rate if args.rate is not None else stated / speed["slowdown"]
        arrival = f"poisson:{rate:.3g}"
        print(f"machine slowdown {speed['slowdown']:.2f} (isolated probes / the profile's prefill): "
              f"serving {args.scenario} at {arrival} (stated poisson:{stated:g})", flush=True)
        payload = run_scenario(args.scenario, policies=REPO / "policies", repeats=args.repeats, quick=False,
                               out_root=out_root, overrides={"episode": {"arrival": arrival}},
                               only=SCHEDULERS, label=f"{args.scenario}-rate-{rate:.3g}", engines=engines)
    finally:
        backend.close()
    sim = simulated(args.scenario, arrival, speed["slowdown"], payload["schedulers"])
    comp = comparisons({args.scenario: payload})[args.scenario]
    result = {
        "benchmark": "load_matched",
        "scenario": args.scenario,
        "stated_arrival": f"poisson:{stated:g}",
        "arrival": arrival,
        "speed": speed,
        "payload": payload,
        "comparisons": comp,
        "simulator": sim,
        "wall_s": time.perf_counter() - t0,
        "machine": machine_info(),
        "command": "python -m benchmarks.load_matched" + (f" --rate {args.rate:g}" if args.rate else "")
                   + (" --merge" if args.merge else ""),
    }
    print("\n" + _render_run(result))
    earlier = runs_of(json.loads(json_path.read_text())) if args.merge and json_path.is_file() else []
    write_json(json_path, {"benchmark": "load_matched", "runs": merge_runs(earlier, result)})
    return 0


def _run_key(run: Mapping[str, Any]) -> tuple[str, str, str]:
    return run["scenario"], run["machine"].get("cpu", "?"), run["arrival"]


def runs_of(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The runs of a results JSON (``{"runs": [...]}``, or one run as the first version wrote it)."""
    return [dict(r) for r in doc["runs"]] if "runs" in doc else [dict(doc)]


def merge_runs(earlier: Sequence[Mapping[str, Any]], run: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``earlier`` without any run of ``run``'s scenario, machine (CPU model) and rate, then ``run``;
    in the order they were measured."""
    kept = [dict(r) for r in earlier if _run_key(r) != _run_key(run)]
    return sorted([*kept, dict(run)], key=lambda r: r["machine"].get("date", ""))


def render(doc: Mapping[str, Any]) -> str:
    """Every run of the JSON in markdown (:func:`_render_run`), the one measured first first."""
    return "\n\n".join(_render_run(r) for r in runs_of(doc))


def _speed(slowdown: float) -> str:
    if slowdown >= 1:
        return f"{slowdown:.2f}x slower than the simulator's profile"
    return f"{1 / slowdown:.2f}x faster than the simulator's profile"


def _render_run(res: Mapping[str, Any]) -> str:
    """One load-matched run: the slowdown and rate, the scenario's table, the ratios, and the
    simulator's prediction beside the engine's figures."""
    payload, speed = res["payload"], res["speed"]
    probes = ", ".join(f"{q['prompt_tokens']:,} tokens {q['engine_ttft_s']:.2f} s vs "
                       f"{q['profile_prefill_s']:.2f} s" for q in speed["probes"])
    w = payload["workload"]
    why = ("the rate given with `--rate`" if "--rate" in res["command"] else
           f"the stated rate divided by the slowdown ({speed['slowdown']:.2f}), the load the policies were "
           "trained for")
    lines = [
        f"`{res['scenario']}` at `{res['arrival']}`"
        + (f" instead of `{res['stated_arrival']}` " if res["arrival"] != res["stated_arrival"]
           else ", its stated rate ")
        + f"({measured(res)}; `{res['command']}`): this machine ran {_speed(speed['slowdown'])} "
        f"(lone prefills on the idle engine against the profile's: {probes}); served at {why}. "
        f"Episode {EPISODE_SEED}: "
        f"{w.get('requests', '?')} requests; the run with the median output throughput of "
        f"{payload['inprocess']['repeats']} alternating runs per scheduler.",
        "",
        _bounds(payload["bound"]) + ".",
        "",
        summary_table(payload),
        "",
        comparisons_table({res["scenario"]: res["comparisons"]}),
        "",
        "The simulator on the same episode at the same rate, its step times multiplied by "
        f"{speed['slowdown']:.2f} (output tok/s, engine / simulator):",
        "",
    ]
    head = ["", *res["simulator"]]
    row_e = ["engine", *(_tput(payload["runs"].get(a)) for a in res["simulator"])]
    row_s = ["simulator", *(f"{m['output_throughput']:.1f}" for m in res["simulator"].values())]
    lines.append(format_table(head, [row_e, row_s]))
    return "\n".join(lines)


def render_headline(doc: Mapping[str, Any]) -> str:
    """The README's block: the evaluation's ratios at each run's rate, a row per run."""
    runs = runs_of(doc)
    rows = {f"{r['scenario']} at `{r['arrival']}`, {_cpu(r)} ({_speed(r['speed']['slowdown'])})":
            r["comparisons"] for r in runs}
    dates = sorted(r["machine"].get("date", "?") for r in runs)
    return "\n".join([
        "The Poisson scenario at other rates (`python -m benchmarks.load_matched [--rate R] --merge`, "
        f"measured {dates[0]} to {dates[-1]} on {', '.join(dict.fromkeys(_cpu(r) for r in runs))}; each "
        "run's command and figures: [docs/results.md](docs/results.md#load-matched)). Without `--rate`, the "
        "stated rate over the machine's measured slowdown: the load the policies were trained for.",
        "",
        comparisons_table(rows),
    ])


def _cpu(run: Mapping[str, Any]) -> str:
    return " ".join(run["machine"].get("cpu", "?").replace("(R)", "").replace(" Processor", "").split())


def _tput(m: Mapping[str, Any] | None) -> str:
    return "-" if m is None else f"{m['output_throughput']:.1f}"


if __name__ == "__main__":
    raise SystemExit(main())
