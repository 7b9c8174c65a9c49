"""The README's evaluation: every scenario on the real vLLM engine, every scheduler, against a bound.

    python -m benchmarks.evaluation [--scenarios a,b] [--repeats 3] [--no-sweep] [--quick]
                                    [--json results/evaluation.json]

For each evaluated scenario (:data:`~feather_env.scenarios.EVALUATED_SCENARIOS`), episode :data:`EPISODE_SEED`
(the requests ``evaluate.py --scenario NAME`` serves) is served in-process
(:func:`feather_env.evaluation.evaluate_in_process`: one engine sized by the scenario, pinned to
core 1; every scheduler deciding as under ``feather-serve``) by:

- the baselines ``fcfs`` (vLLM's own scheduler), ``lpm``, ``dfs-weight`` and ``svf``
  (LongBench adds ``sjf`` and ``svf-1bit``);
- ``feather-heuristic`` (the authors' constants) and ``heuristic-tuned``
  (``policies/heuristic-tuned/<scenario>.feather``; when the search kept the authors' constants it
  *is* ``feather-heuristic`` and is not served twice);
- ``shipped`` (``policies/<scenario>.feather``) and ``general`` (``policies/general.feather``);
- the ``+svf`` combinations ``feather-heuristic+svf`` and ``shipped+svf``.

Schedulers alternate, ``--repeats`` times (default 3); each row is the run with the median output
throughput, every run's figures beside it. The figures are ``vllm bench serve``'s (output and
request throughput, TTFT/TPOT/ITL/E2EL means and percentiles, goodput), plus the prefix hit rate,
preemptions and the scheduler's own time as a fraction of the engine's step time. Time is the
engine clock (:mod:`feather_env.evaluation.inprocess`).

**Goodput SLOs** are stated per scenario from the workload itself, not from any scheduler: a
request is good when its TTFT and its E2E latency are each within :data:`SLO_FACTOR` times the
median of the same figure for the episode's requests served alone on the idle engine (the
isolated probes).

**The bounds** (:mod:`feather_env.evaluation.bound`): the makespan bound (every distinct prompt
prefix prefilled once, decode at the engine's peak rate, :func:`peak_decode_rate`: as many short
requests at once as ``max_num_seqs`` and the KV cache allow), the episode bound (decode at the
best rate any run of the episode reached) and the arrival-aware bound (no request served before
it arrives). Each scheduler is reported as a bound over its makespan (1.0 is the limit).

**The load sweep** (``leval-kv-pressure-poisson`` at :data:`SWEEP_RATES` requests/s, one run each)
draws output throughput and P99 E2E latency against the request rate, one line per scheduler
(``results/eval_sweep.png``).

It prints each scenario's table and the targets of the issue with whether each was met; nothing
is tuned to meet them. ``--quick``: a smaller episode of each scenario (:data:`QUICK_EPISODE`, answers
capped at :data:`QUICK_MAX_OUTPUT` tokens), one run per scheduler without waiting for a quiet
machine, two sweep rates (a smoke run whose figures are not the README's). Run it under
``flock /tmp/feather-engine.lock`` on the shared machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from feather_env.engine import use_in_process_engine  # noqa: E402  (before vLLM is imported)

use_in_process_engine()

from feather_env.evaluation.bound import add_arrival_bound, add_episode_bound, makespan_bound  # noqa: E402
from feather_env.reporting import format_table, machine_info, write_json  # noqa: E402
from feather_env.scenarios import EVALUATED_SCENARIOS as SCENARIOS  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

__all__ = ["SCENARIOS", "check_targets", "main", "makespan_bound", "run_scenario", "scheduler_set"]

#: The scenarios whose KV cache binds (the issue's "KV-pressure scenarios").
KV_PRESSURE = ("leval-kv-pressure", "leval-kv-pressure-poisson", "leval-high-load")
EPISODE_SEED = 0
REPEATS = 3
#: Scenarios served more often: sharegpt's runs take 9 s, and their run-to-run spread (+-6-12% on
#: 2026-12-01) is wider than the 2% margin its target (every shipped policy >= 0.98x fcfs) asks.
REPEATS_BY_SCENARIO = {"sharegpt": 7}
SLO_FACTOR = 10.0
SWEEP_SCENARIO = "leval-kv-pressure-poisson"
SWEEP_RATES = (1.0, 2.0, 3.0, 6.0)
SWEEP_SCHEDULERS = ("fcfs", "lpm", "dfs-weight", "feather-heuristic", "shipped")
#: --quick: a smaller episode of each scenario.
QUICK_EPISODE = {"grouped": {"groups": 2, "max_per_group": 3}, "ungrouped": {"requests": 6}}
#: --quick: answers capped at this many tokens (a scenario's own lower cap is kept).
QUICK_MAX_OUTPUT = 64
QUICK_SWEEP_RATES = (2.0, 6.0)
#: Names shown in the tables for the policy files.
ALIASES = ("heuristic-tuned", "shipped", "general", "shipped+svf")


def policy_paths(scenario: str, policies: Path) -> dict[str, Path]:
    """The policy files of ``scenario``: alias -> path (only those that exist)."""
    paths = {
        "heuristic-tuned": policies / "heuristic-tuned" / f"{scenario}.feather",
        "shipped": policies / f"{scenario}.feather",
        "general": policies / "general.feather",
    }
    return {k: p for k, p in paths.items() if p.is_file()}


def _same_as_authors(path: Path) -> bool:
    """Whether a heuristic policy file holds the authors' constants (it then is feather-heuristic)."""
    from scheduler_runtime.policy import HeuristicPolicy, HeuristicRule, load_policy

    policy = load_policy(path)
    return isinstance(policy, HeuristicPolicy) and policy.rule.params() == HeuristicRule().params()


def scheduler_set(scenario: str, policies: Path) -> tuple[dict[str, str], dict[str, str]]:
    """``(alias -> scheduler name to serve, alias -> alias it is identical to)`` for ``scenario``."""
    files = policy_paths(scenario, policies)
    names = {n: n for n in ("fcfs", "lpm", "dfs-weight", "svf")}
    if scenario == "longbench":
        names.update({"sjf": "sjf", "svf-1bit": "svf-1bit"})
    names["feather-heuristic"] = "feather-heuristic"
    same: dict[str, str] = {}
    for alias, path in files.items():
        rel = path.relative_to(REPO) if path.is_relative_to(REPO) else path
        if alias == "heuristic-tuned" and _same_as_authors(path):
            same[alias] = "feather-heuristic"
            continue
        names[alias] = f"feather:{rel}"
    names["feather-heuristic+svf"] = "feather-heuristic+svf"
    if "shipped" in files:
        names["shipped+svf"] = f"{names['shipped']}+svf"
    return names, same


# ------------------------------------------------------------------------------------ the bound


#: The decode probe: this many tokens of prompt and of output per request.
PROBE_PROMPT, PROBE_OUTPUT = 32, 64


def peak_decode_rate(backend: Any, engine: Any, config: Any) -> float:
    """The engine's best decode rate (tokens/s of decode-only steps): as many short requests at once
    as ``max_num_seqs`` and the KV cache allow, served by vLLM's own scheduler (cold cache)."""
    from feather_env.evaluation.inprocess import random_requests, serve_one

    per_request = -(-(PROBE_PROMPT + PROBE_OUTPUT) // engine.block_size) * engine.block_size
    batch = max(1, min(engine.max_num_seqs, engine.usable_kv_tokens // per_request))
    probe = random_requests("decode-probe-", [PROBE_PROMPT] * batch, PROBE_OUTPUT, 777)
    run = serve_one(backend, "fcfs", probe, replace(config, schedulers=("fcfs",)), False)
    return float(run.extra["decode_tok_s"])


def goodput_slos(isolated: Any, workload: Any) -> dict[str, float]:
    """TTFT and E2EL SLOs (ms): :data:`SLO_FACTOR` x the median of the requests' isolated figures."""
    import numpy as np

    ttft = [float(np.interp(r.prompt_len, isolated.prompt_lens, isolated.ttft_s)) for r in workload]
    e2el = [isolated.estimate(r.prompt_len, r.output_len) for r in workload]
    return {
        "ttft": round(1000 * SLO_FACTOR * statistics.median(ttft), 1),
        "e2el": round(1000 * SLO_FACTOR * statistics.median(e2el), 1),
    }


# ------------------------------------------------------------------------------------ running


def _quick_overrides(scenario: Any) -> dict[str, Any]:
    grouped = scenario.episode.groups is not None
    cap = scenario.workload.max_output_tokens
    cap = QUICK_MAX_OUTPUT if cap is None else min(cap, QUICK_MAX_OUTPUT)
    return {"episode": QUICK_EPISODE["grouped" if grouped else "ungrouped"],
            "workload": {"max_output_tokens": cap}}


def run_scenario(
    name: str,
    *,
    policies: Path,
    repeats: int,
    quick: bool,
    out_root: Path,
    progress: bool = False,
    overrides: Mapping[str, Any] | None = None,
    only: Sequence[str] | None = None,
    label: str | None = None,
    engines: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Serve scenario ``name``'s episode with every scheduler of :func:`scheduler_set`; its payload.

    ``engines``: engines to reuse, by their configuration (the caller closes them); a new one is
    added there. Without it, the scenario starts its own engine and closes it.
    """
    from feather_env.evaluation import InProcessConfig, evaluate_in_process, results_payload, write_results
    from feather_env.evaluation.inprocess import IsolatedModel
    from feather_env.scenarios import load_scenario

    t0 = time.perf_counter()
    scenario = load_scenario(name)
    sections: dict[str, dict[str, Any]] = _quick_overrides(scenario) if quick else {}
    for section, values in (overrides or {}).items():
        sections[section] = {**sections.get(section, {}), **values}
    scenario = load_scenario(scenario, sections)
    workload = scenario.episode_workload(EPISODE_SEED)
    engine = scenario.engine_config()
    names, same = scheduler_set(name, policies)
    if only is not None:
        names = {a: n for a, n in names.items() if a in only}
        same = {a: b for a, b in same.items() if a in only or b in names}
    config = InProcessConfig(
        schedulers=tuple(names.values()),
        engine=engine,
        chunk_size=scenario.scheduler.chunk_size,
        max_wait=scenario.scheduler.max_wait,
        repeats=repeats,
        quiet_wait_s=0.0 if quick else 3.0,  # a smoke run does not wait for a quiet machine
    )
    title = label or name
    print(
        f"\n== {title}: {len(workload)} requests; {', '.join(names)}"
        + (f" ({', '.join(f'{a} = {b}' for a, b in same.items())})" if same else ""),
        flush=True,
    )
    from feather_env.serving import VLLMBackend

    key = json.dumps(engine.to_dict(), sort_keys=True)
    backend = engines.get(key) if engines is not None else None
    if backend is None:
        backend = VLLMBackend(engine)
        if engines is not None:
            engines[key] = backend
    try:
        runs, info = evaluate_in_process(workload, config, progress=progress, backend=backend)
        decode_rate = peak_decode_rate(backend, engine, config)
    finally:
        if engines is None:
            backend.close()
    alias_of = {n: a for a, n in names.items()}
    runs = [replace(r, label=alias_of[r.label]) for r in runs]
    isolated = IsolatedModel(**info["isolated"])
    slos = goodput_slos(isolated, workload)
    bound = makespan_bound(workload, engine.block_size, info["isolated"], decode_rate)
    payload = results_payload(
        runs,
        goodput=slos,
        scenario=scenario.to_dict(),
        episode_seed=EPISODE_SEED,
        workload={**workload.describe(), "fingerprint": workload.fingerprint()},
        engine=engine.to_dict(),
        inprocess=config.to_dict(),
        schedulers=names,
        identical=same,
        bound=bound,
        **info,
        wall_s=time.perf_counter() - t0,
    )
    for m in payload["runs"].values():
        m["vs_bound"] = (bound["makespan_s"] / m["duration"]) if m.get("duration") else None
    add_episode_bound(payload)
    add_arrival_bound(payload)
    write_results(out_root / title, payload, runs, title=f"{title} ({payload['machine']['date']})")
    payload.pop("definitions", None)
    print(summary_table(payload), flush=True)
    return payload


def figure(payload: Mapping[str, Any], alias: str, key: str) -> float | None:
    """A scheduler's figure, following ``identical`` (heuristic-tuned = feather-heuristic)."""
    alias = payload.get("identical", {}).get(alias, alias)
    m = payload["runs"].get(alias)
    return None if m is None else m.get(key)


#: (header, key, format) of the per-scenario table.
COLUMNS = (
    ("done", None, "done"),
    ("output tok/s", "output_throughput", "{:.1f}"),
    ("req/s", "request_throughput", "{:.2f}"),
    ("mean TTFT ms", "mean_ttft_ms", "{:,.0f}"),
    ("mean TPOT ms", "mean_tpot_ms", "{:.1f}"),
    ("mean E2EL ms", "mean_e2el_ms", "{:,.0f}"),
    ("P50 E2EL", "median_e2el_ms", "{:,.0f}"),
    ("P99 E2EL", "p99_e2el_ms", "{:,.0f}"),
    ("goodput req/s", "request_goodput", "{:.2f}"),
    ("prefix hit", "prefix_hit_rate", "{:.0%}"),
    ("preempt", "preemptions", "{:d}"),
    ("sched time / step time", "scheduler_overhead_frac", "{:.2%}"),
    ("vs bound", "vs_bound", "{:.2f}"),
    ("vs episode bound", "vs_bound_episode", "{:.2f}"),
    ("vs arrival bound", "vs_bound_arrival", "{:.2f}"),
)


def _cell(m: Mapping[str, Any], key: str | None, fmt: str) -> str:
    if fmt == "done":
        return f"{m['completed']}/{m['submitted']}"
    v = m.get(key) if key else None
    if v is None:
        return "-"
    return fmt.format(int(v)) if fmt == "{:d}" else fmt.format(v)


def summary_table(payload: Mapping[str, Any]) -> str:
    """One row per scheduler (the identical ones say so), vLLM's figures, hit rate, overhead, bound."""
    rows = []
    for alias, m in payload["runs"].items():
        rows.append([f"`{alias}`", *(_cell(m, k, f) for _, k, f in COLUMNS)])
    for alias, other in payload.get("identical", {}).items():
        rows.append(
            [
                f"`{alias}`",
                f"= `{other}` (the search kept the authors' constants)",
                *([""] * (len(COLUMNS) - 1)),
            ]
        )
    return format_table(["scheduler", *(h for h, _, _ in COLUMNS)], rows)


# ------------------------------------------------------------------------------------ targets


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _target(value: float | None, op: str, bound: float, detail: str) -> dict[str, Any]:
    met = value is not None and (value >= bound if op == ">=" else value <= bound)
    return {
        "value": None if value is None else round(value, 4),
        "target": f"{op} {bound:g}",
        "met": bool(met),
        "detail": detail,
    }


FEATHER = (
    "feather-heuristic",
    "heuristic-tuned",
    "shipped",
    "general",
    "feather-heuristic+svf",
    "shipped+svf",
)


def _best(payload: Mapping[str, Any], names: Sequence[str], key: str = "output_throughput") -> str | None:
    have = [n for n in names if figure(payload, n, key) is not None]
    return max(have, key=lambda n: figure(payload, n, key)) if have else None


def _episode_detail(p: Mapping[str, Any]) -> str:
    ep = p["bound"].get("episode_decode")
    if not ep:
        return ""
    share = figure(p, "shipped", "vs_bound_episode")
    return (f"; at the episode's best decode rate ({ep['decode_rate_tok_s']:.0f} tok/s) the bound is "
            f"{ep['output_throughput']:.1f} tok/s and shipped reaches "
            + ("-" if share is None else f"{share:.2f}") + " of it")


def check_targets(scenarios: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The issue's targets from the scenarios' payloads (absent scenarios or runs are skipped)."""
    t: dict[str, dict[str, Any]] = {}
    out = "output_throughput"

    def tput(p: Mapping[str, Any], n: str) -> float | None:
        return figure(p, n, out)

    def vs(
        p: Mapping[str, Any], a: str, b: str, op: str, bound: float, key: str = out
    ) -> dict[str, Any] | None:
        x, y = figure(p, a, key), figure(p, b, key)
        if x is None or y is None:
            return None
        return _target(_ratio(x, y), op, bound, f"{a} {x:,.1f} vs {b} {y:,.1f}")

    def put(name: str, target: dict[str, Any] | None) -> None:
        if target is not None:
            t[name] = target

    if "leval-kv-pressure" in scenarios:
        p = scenarios["leval-kv-pressure"]
        best = _best(p, FEATHER)
        if best:
            put(
                f"leval-kv-pressure: best Feather ({best}) output tok/s vs fcfs",
                vs(p, best, "fcfs", ">=", 2.0),
            )
            put(
                f"leval-kv-pressure: best Feather ({best}) mean E2EL vs fcfs",
                vs(p, best, "fcfs", "<=", 0.6, "mean_e2el_ms"),
            )
        put(
            "leval-kv-pressure: shipped output tok/s vs the bound",
            _target(
                figure(p, "shipped", "vs_bound"),
                ">=",
                0.85,
                f"bound {p['bound']['output_throughput']:.1f} tok/s "
                f"(makespan {p['bound']['makespan_s']:.1f} s)" + _episode_detail(p),
            ),
        )
    for sc in KV_PRESSURE:
        if sc not in scenarios:
            continue
        p = scenarios[sc]
        put(f"{sc}: shipped vs feather-heuristic", vs(p, "shipped", "feather-heuristic", ">=", 1.0))
        base = _best(p, ("lpm", "dfs-weight"))
        if base:
            put(f"{sc}: shipped vs the better of lpm/dfs-weight ({base})", vs(p, "shipped", base, ">=", 1.0))
    wins = []
    for sc in KV_PRESSURE:
        if sc in scenarios and _best(scenarios[sc], ("lpm", "dfs-weight")):
            p = scenarios[sc]
            base = _best(p, ("lpm", "dfs-weight"))
            for key in (out, "request_goodput"):
                r = _ratio(figure(p, "shipped", key), figure(p, base, key))
                if r is not None:
                    wins.append((r, f"{sc} {key}: shipped / {base} = {r:.3f}"))
    if wins:
        r, detail = max(wins)
        t[
            "some KV-pressure scenario: shipped >= 1.1x the better of lpm/dfs-weight (throughput or goodput)"
        ] = _target(r, ">=", 1.1, "best: " + detail)
    if "leval-high-load" in scenarios:
        p = scenarios["leval-high-load"]
        best = _best(p, FEATHER)
        if best:
            put(f"leval-high-load: best Feather ({best}) vs fcfs", vs(p, best, "fcfs", ">=", 2.0))
            put(f"leval-high-load: best Feather ({best}) vs lpm", vs(p, best, "lpm", ">=", 1.5))
            put(f"leval-high-load: best Feather ({best}) vs dfs-weight", vs(p, best, "dfs-weight", ">=", 1.0))
        frac = figure(p, "feather-heuristic", "scheduler_overhead_frac")
        dfs = figure(p, "dfs-weight", "scheduler_overhead_frac")
        put(
            "leval-high-load: Feather's scheduler time / engine step time",
            _target(
                frac,
                "<=",
                0.01,
                f"feather-heuristic {frac:.3%}; dfs-weight {dfs:.3%}"
                if frac is not None and dfs is not None
                else "n/a",
            ),
        )
    if "leval-summaries" in scenarios:
        put(
            "leval-summaries: shipped vs fcfs", vs(scenarios["leval-summaries"], "shipped", "fcfs", ">=", 1.0)
        )
    if "sharegpt" in scenarios:
        p = scenarios["sharegpt"]
        for n in ("shipped", "general", "heuristic-tuned"):
            put(f"sharegpt: {n} vs fcfs", vs(p, n, "fcfs", ">=", 0.98))
    if "longbench" in scenarios:
        p = scenarios["longbench"]
        put("longbench: svf mean E2EL vs fcfs", vs(p, "svf", "fcfs", "<=", 0.8, "mean_e2el_ms"))
        put("longbench: svf P95 E2EL vs sjf P95", vs(p, "svf", "sjf", "<=", 1.0, "p95_e2el_ms"))
        r = _ratio(figure(p, "svf-1bit", "mean_e2el_ms"), figure(p, "svf", "mean_e2el_ms"))
        if r is not None:
            t["longbench: svf-1bit mean E2EL within 10% of svf"] = _target(
                abs(r - 1.0), "<=", 0.10, f"svf-1bit / svf = {r:.3f} (value = |ratio - 1|)"
            )
    for sc, p in scenarios.items():
        put(
            f"{sc}: shipped vs feather-heuristic (>= 0.98)", vs(p, "shipped", "feather-heuristic", ">=", 0.98)
        )
        put(f"{sc}: general vs shipped", vs(p, "general", "shipped", ">=", 0.95))
    bad = [
        f"{sc}/{n}"
        for sc, p in scenarios.items()
        for n, m in p["runs"].items()
        if m["completed"] != m["submitted"]
    ]
    t["every cell: completed == submitted"] = {
        "value": not bad,
        "target": "True",
        "met": not bad,
        "detail": "all complete" if not bad else f"incomplete: {bad}",
    }
    return t


# ------------------------------------------------------------------------------------ the sweep


def run_sweep(
    *, policies: Path, rates: Sequence[float], quick: bool, out_root: Path, progress: bool = False
) -> dict[str, Any]:
    """:data:`SWEEP_SCENARIO` at each rate, :data:`SWEEP_SCHEDULERS`, one run each, on one engine."""
    points: dict[str, list[dict[str, Any]]] = {}
    engines: dict[str, Any] = {}
    try:
        payloads = [(rate, run_scenario(
            SWEEP_SCENARIO,
            policies=policies,
            repeats=1,
            quick=quick,
            out_root=out_root,
            progress=progress,
            overrides={"episode": {"arrival": f"poisson:{rate:g}"}},
            only=SWEEP_SCHEDULERS,
            label=f"sweep-{rate:g}",
            engines=engines,
        )) for rate in rates]
    finally:
        for backend in engines.values():
            backend.close()
    for rate, payload in payloads:
        for alias, m in payload["runs"].items():
            points.setdefault(alias, []).append(
                {
                    "rate": rate,
                    "output_throughput": m["output_throughput"],
                    "p99_e2el_ms": m["p99_e2el_ms"],
                    "mean_e2el_ms": m["mean_e2el_ms"],
                    "completed": m["completed"],
                    "submitted": m["submitted"],
                }
            )
    return {"scenario": SWEEP_SCENARIO, "rates": list(rates), "points": points}


def plot_sweep(sweep: Mapping[str, Any], path: Path) -> None:
    """Output throughput and P99 E2E latency against the request rate, one line per scheduler."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for alias, pts in sweep["points"].items():
        x = [p["rate"] for p in pts]
        a.plot(x, [p["output_throughput"] for p in pts], marker="o", label=alias)
        b.plot(x, [p["p99_e2el_ms"] / 1000 for p in pts], marker="o", label=alias)
    a.set(xlabel="request rate (req/s)", ylabel="output tok/s", title=f"{sweep['scenario']}: throughput")
    b.set(xlabel="request rate (req/s)", ylabel="P99 E2E latency (s)", title="P99 E2E latency")
    a.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------ main


def _print_targets(targets: Mapping[str, Mapping[str, Any]]) -> None:
    print("\nTargets:")
    for name, t in targets.items():
        print(
            f"  [{'met' if t['met'] else 'NOT met'}] {name}: {t['value']} (target {t['target']}); "
            f"{t['detail']}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    from feather_env.engine import send_vllm_logs_to

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=str(REPO / "results" / "evaluation.json"))
    p.add_argument("--out", default=None, help="per-scenario folders (default: results/eval beside --json)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--policies", default=str(REPO / "policies"), help="the shipped policies' folder")
    p.add_argument(
        "--repeats", type=int, default=None,
        help=f"runs per scheduler (default {REPEATS}, {REPEATS_BY_SCENARIO}; quick 1)",
    )
    p.add_argument("--no-sweep", action="store_true", help="skip the load sweep")
    p.add_argument(
        "--merge",
        action="store_true",
        help="keep the scenarios of an existing --json that this run does not serve",
    )
    p.add_argument("--quick", action="store_true", help="a smaller episode per scenario, one run each")
    p.add_argument("--progress", action="store_true", help="tqdm progress bars")
    args = p.parse_args(argv)
    json_path = Path(args.json)
    out_root = Path(args.out) if args.out else json_path.parent / "eval"
    policies = Path(args.policies).resolve()
    repeats = args.repeats or (1 if args.quick else REPEATS)
    # a scenario's own count applies unless --repeats or --quick chose one
    fixed = bool(args.repeats or args.quick)
    wanted = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = sorted(set(wanted) - set(SCENARIOS))
    if unknown:
        raise SystemExit(f"unknown scenarios {unknown}; known: {list(SCENARIOS)}")
    send_vllm_logs_to(out_root / "vllm.log")
    t0 = time.perf_counter()
    previous: dict[str, Any] = {}
    if args.merge and json_path.is_file():
        previous = json.loads(json_path.read_text())
    results: dict[str, Any] = dict(previous.get("scenarios", {})) if args.merge else {}
    walls: dict[str, float] = dict(previous.get("wall_s_by_part", {})) if args.merge else {}
    for name in wanted:
        results[name] = run_scenario(
            name,
            policies=policies,
            repeats=repeats if fixed else REPEATS_BY_SCENARIO.get(name, repeats),
            quick=args.quick,
            out_root=out_root,
            progress=args.progress,
        )
        walls[name] = results[name]["wall_s"]
    sweep = previous.get("sweep") if args.merge else None
    if not args.no_sweep:
        s0 = time.perf_counter()
        sweep = run_sweep(
            policies=policies,
            rates=QUICK_SWEEP_RATES if args.quick else SWEEP_RATES,
            quick=args.quick,
            out_root=out_root,
            progress=args.progress,
        )
        plot_sweep(sweep, json_path.parent / "eval_sweep.png")
        walls["sweep"] = time.perf_counter() - s0
    targets = check_targets(results)
    _print_targets(targets)
    wall = time.perf_counter() - t0
    print(f"\nwall time: {wall:.0f} s")
    write_json(
        json_path,
        {
            "benchmark": "evaluation",
            "quick": args.quick,
            "repeats": repeats,
            "scenarios": results,
            "sweep": sweep,
            "targets": targets,
            "slo_factor": SLO_FACTOR,
            "episode_seed": EPISODE_SEED,
            "wall_s": wall,
            "wall_s_by_part": walls,
            "machine": machine_info(),
            "command": "python -m benchmarks.evaluation" + (" --quick" if args.quick else ""),
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
