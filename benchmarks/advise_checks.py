"""Does ``evaluate.py advise`` pick what the engine measured best, and keep vLLM's default where nothing wins?

    python -m benchmarks.advise_checks --json results/advise_checks.json

Part 1, the shipped L-Eval scenarios (and LongBench): ``advise`` searches, in the simulator on its
held-out episodes (seeds 100-103), the schedulers and policy files that ``benchmarks/evaluation.py``
served on the real engine (``results/evaluation.json``: fcfs, lpm, dfs-weight, svf,
feather-heuristic, the heuristic-tuned, shipped and general policy files), at the scenario's own
token budget, with an SLO no request misses (``e2el`` of 10^9 ms: goodput is then the request
throughput, the throughput the evaluation ranks by). The check: the engine's output throughput of
the recommended setting in ``results/evaluation.json`` (episode 0, the median of its runs) is within
3% of the best setting's there. The simulator profile is the one of the host each scenario was
measured on (``--profile-for``), so the simulator speaks for the same machine as the engine's table.

Part 1 on this machine's engine (``--engine --json results/advise_checks_engine.json``): the
table above is another host's, measured on episode 0, while ``advise`` predicts held-out windows.
Here ``advise --confirm-top`` serves every setting on the real engine on the first held-out window
(alternating, ``--repeats`` runs each, medians), with the profile its probe picks on this machine;
reported are the simulator's own pick and the engine's pick among the simulator's best ``--top``
(what ``advise --confirm-top 3`` recommends), each as a share of the best measured.

Part 2, a trace where nothing should win (ShareGPT: no shared prefixes): for throughput (the SLO
no request misses) and every budget, ``advise`` must recommend vLLM's default, or a setting whose
goodput is within the noise (3%) of it. The same with latency SLOs (TTFT <= 5 s, TPOT <= 50 ms) is
reported beside it: there a token budget can win (it cuts TPOT), and the engine has the last word.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from feather_env.evaluation.advise import AdviseConfig, advise
from feather_env.reporting import format_table, machine_info, write_json
from feather_env.scenarios import load_scenario

REPO = Path(__file__).resolve().parent.parent
#: Part 1's scenarios and the profile of the host their engine figures were measured on.
SCENARIOS = {
    "leval-kv-pressure": "cpu-tiny-llama-xeon.json",
    "leval-kv-pressure-poisson": "cpu-tiny-llama-xeon.json",
    "leval-trace": "cpu-tiny-llama-xeon.json",
    "leval-high-load": "cpu-tiny-llama-xeon.json",
    "leval-summaries": "cpu-tiny-llama-xeon.json",
    "longbench": "cpu-tiny-llama.json",
}
BASELINES = ("fcfs", "lpm", "dfs-weight", "svf", "feather-heuristic")
#: An SLO no request misses: goodput is the request throughput.
LOOSE = {"e2el": 1e9}
SLOS = {"ttft": 5000.0, "tpot": 50.0}


def policy_files(scenario: str) -> dict[str, str]:
    """The evaluation's policy labels -> their files (those that exist for the scenario)."""
    files = {
        "heuristic-tuned": REPO / "policies" / "heuristic-tuned" / f"{scenario}.feather",
        "shipped": REPO / "policies" / f"{scenario}.feather",
        "general": REPO / "policies" / "general.feather",
    }
    return {label: str(path) for label, path in files.items() if path.is_file()}


def _advise_over(
    name: str, baselines: Sequence[str], policies: dict[str, str], windows: int, noise: float, **extra: Any
) -> tuple[dict[str, str], dict[str, Any]]:
    """``advise`` on scenario ``name`` over ``baselines`` and the ``policies`` files (label -> path) at
    the scenario's own budget, every setting on every window, with no SLO missed (``extra``: more
    :class:`AdviseConfig` fields). Returns (setting name -> its label, the advice)."""
    labels = {b: b for b in baselines}
    labels.update({f"feather:{path}": label for label, path in policies.items()})
    scenario = load_scenario(name)
    config = AdviseConfig(
        LOOSE,
        windows=windows,
        search_windows=windows,
        schedulers=tuple(baselines),
        policies=tuple(policies.values()),
        budgets=(scenario.engine.max_num_batched_tokens,),
        shortlist=len(labels),
        what_if=False,
        noise=noise,
        **extra,
    )
    with tempfile.TemporaryDirectory() as tmp:
        return labels, advise(scenario, config, Path(tmp), progress=False, log=lambda _: None)


def _simulated_ratios(payload: dict[str, Any], labels: dict[str, str]) -> dict[str, float]:
    """Each searched setting's simulated goodput over fcfs's, by label."""
    default = payload["candidates"]["fcfs"]["request_goodput"]
    return {labels[n]: r["request_goodput"] / default
            for n, r in payload["candidates"].items() if n in labels}


def check_scenario(
    name: str, profile: str, evaluation: dict[str, Any], windows: int, noise: float
) -> dict[str, Any]:
    """Part 1 for one scenario."""
    measured = {label: m["output_throughput"] for label, m in evaluation["scenarios"][name]["runs"].items()}
    policies = {label: path for label, path in policy_files(name).items() if label in measured}
    by_name, payload = _advise_over(name, [b for b in BASELINES if b in measured], policies, windows, noise,
                                    profile=str(REPO / "configs" / "profiles" / profile))
    rec = payload["recommendation"]["scheduler"]
    label = by_name[rec]
    best = max(measured, key=measured.get)
    return {
        "scenario": name,
        "profile": profile,
        "recommended": rec,
        "recommended_label": label,
        "recommended_engine_tok_s": measured[label],
        "best_label": best,
        "best_engine_tok_s": measured[best],
        "ratio_to_best": measured[label] / measured[best],
        "within_3pct": measured[label] >= 0.97 * measured[best],
        "predicted_ratio_to_default": payload["recommendation"]["predicted_goodput_ratio"],
        "why": payload["recommendation"]["why"],
        "noise": noise,
        "simulated_ratio_to_fcfs": _simulated_ratios(payload, by_name),
        "wall_s": payload["wall_s"],
    }


def check_scenario_on_engine(name: str, windows: int, noise: float, repeats: int, top: int) -> dict[str, Any]:
    """Part 1 on this machine's engine (``--engine``): ``advise --confirm-top`` over every setting the
    evaluation serves, so the engine measures all of them on the first held-out window (alternating,
    ``repeats`` runs each, medians), with the profile its own probe picks on this machine. Reported:
    the simulator's pick and the engine's pick among the simulator's best ``top`` (what
    ``--confirm-top top`` recommends), each as a share of the best measured."""
    from feather_env.evaluation.recommend import confirm_names, engine_choice

    policies = policy_files(name)
    labels, payload = _advise_over(name, BASELINES, policies, windows, noise, confirm=True, repeats=repeats,
                                   confirm_top=len(BASELINES) + len(policies))
    runs = payload["confirm"]["runs"]
    measured = {n: r["output_throughput"] for n, r in runs.items()}
    best = max(measured, key=measured.get)
    sim_pick = payload["confirm"]["simulator_recommendation"]
    shortlist = confirm_names(payload["candidates"], sim_pick, "fcfs", top)
    top_pick, why = engine_choice({n: runs[n] for n in shortlist}, "fcfs", noise)
    return {
        "scenario": name,
        "window": payload["confirm"]["seed"],
        "repeats": repeats,
        "profile": payload["profile"]["profile"],
        "probe_error": payload["profile"]["error"],
        "engine_tok_s": {labels[n]: measured[n] for n in measured},
        "engine_tok_s_per_run": {labels[n]: r.get("output_throughput_per_run") for n, r in runs.items()},
        "best_label": labels[best],
        "simulator_pick": labels[sim_pick],
        "simulator_pick_ratio_to_best": measured[sim_pick] / measured[best],
        f"confirm_top_{top}": [labels[n] for n in shortlist],
        "confirm_top_pick": labels[top_pick],
        "confirm_top_pick_ratio_to_best": measured[top_pick] / measured[best],
        "confirm_top_why": why,
        "within_3pct": measured[top_pick] >= 0.97 * measured[best],
        "simulated_ratio_to_fcfs": _simulated_ratios(payload, labels),
        "wall_s": payload["wall_s"],
    }


def check_never_worse(name: str, windows: int, slos: dict[str, float]) -> dict[str, Any]:
    """Part 2: the recommendation on a trace without shared prefixes, for ``slos``."""
    scenario = load_scenario(name)
    config = AdviseConfig(
        slos,
        windows=windows,
        profile=str(REPO / "configs" / "profiles" / "cpu-tiny-llama.json"),
        what_if=False,
    )
    with tempfile.TemporaryDirectory() as tmp:
        payload = advise(scenario, config, Path(tmp), progress=False, log=lambda _: None)
    rec = payload["recommendation"]
    return {
        "scenario": name,
        "slos_ms": slos,
        "recommended": rec["scheduler"],
        "predicted_goodput_ratio": rec["predicted_goodput_ratio"],
        "ratio_range": rec["ratio_range"],
        "default_goodput": payload["default"]["request_goodput"],
        "why": rec["why"],
        "default_or_within_noise": rec["scheduler"] == "fcfs" or abs(rec["ratio_median"] - 1) <= 0.03,
        "wall_s": payload["wall_s"],
    }


def render(out: dict[str, Any]) -> str:
    rows = [
        [
            r["scenario"],
            f"`{r['recommended_label']}`",
            f"{r['recommended_engine_tok_s']:.1f}",
            f"`{r['best_label']}`",
            f"{r['best_engine_tok_s']:.1f}",
            f"{r['ratio_to_best']:.3f}",
            "yes" if r["within_3pct"] else "no",
        ]
        for r in out["leval"]
    ]
    lines = [
        f"`advise` against the engine's table (measured {out['machine']['date']} on {out['machine']['cpu']}; "
        f"simulator on held-out episodes, goodput with no SLO missed = request throughput):",
        "",
        format_table(
            [
                "scenario",
                "advise recommends",
                "its engine tok/s",
                "engine's best",
                "best tok/s",
                "ratio",
                "within 3%",
            ],
            rows,
        ),
        "",
    ]
    for r in out["never_worse"]:
        slos = ", ".join(f"{k} <= {v:g} ms" for k, v in r["slos_ms"].items())
        lines.append(
            f"- `{r['scenario']}` ({slos}): `advise` recommends `{r['recommended']}` "
            f"({r['predicted_goodput_ratio']:.3f}x the default's goodput in the simulator): {r['why']}."
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--never-worse", default="sharegpt")
    p.add_argument("--noise", type=float, default=0.03, help="advise's noise for part 1 (part 2 keeps 3%%)")
    p.add_argument("--engine", action="store_true", help="part 1 on this machine's engine (advise "
                   "--confirm-top over every setting; no part 2)")
    p.add_argument("--repeats", type=int, default=3, help="--engine: runs of each setting (default 3)")
    p.add_argument("--top", type=int, default=3, help="--engine: the --confirm-top K reported (default 3)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    if args.engine:
        return main_engine(args, t0)
    evaluation = json.loads((REPO / "results" / "evaluation.json").read_text())
    out: dict[str, Any] = {
        "benchmark": "advise_checks",
        "machine": machine_info(),
        "leval": [],
        "never_worse": [],
    }
    for name in (s for s in args.scenarios.split(",") if s):
        out["leval"].append(check_scenario(name, SCENARIOS[name], evaluation, args.windows, args.noise))
        last = out["leval"][-1]
        print(
            f"  {name}: {last['recommended_label']} ({last['ratio_to_best']:.3f} of the engine's best)",
            flush=True,
        )
    for name in (s for s in args.never_worse.split(",") if s):
        for slos in (LOOSE, SLOS):
            out["never_worse"].append(check_never_worse(name, args.windows, slos))
    out["wall_s"] = time.perf_counter() - t0
    print(render(out))
    write_json(args.json, out)
    return 0


def main_engine(args: argparse.Namespace, t0: float) -> int:
    """``--engine``: part 1 measured on this machine (:func:`check_scenario_on_engine`)."""
    out: dict[str, Any] = {"benchmark": "advise_checks --engine", "machine": machine_info(), "leval": []}
    for name in (s for s in args.scenarios.split(",") if s):
        r = check_scenario_on_engine(name, args.windows, args.noise, args.repeats, args.top)
        out["leval"].append(r)
        print(f"  {name}: simulator {r['simulator_pick']} ({r['simulator_pick_ratio_to_best']:.3f} of the "
              f"engine's best, {r['best_label']}), --confirm-top {args.top}: {r['confirm_top_pick']} "
              f"({r['confirm_top_pick_ratio_to_best']:.3f})", flush=True)
        write_json(args.json, {**out, "wall_s": time.perf_counter() - t0})
    out["wall_s"] = time.perf_counter() - t0
    rows = [[r["scenario"], f"`{r['simulator_pick']}`", f"{r['simulator_pick_ratio_to_best']:.3f}",
             f"`{r['confirm_top_pick']}`", f"{r['confirm_top_pick_ratio_to_best']:.3f}",
             f"`{r['best_label']}`", f"{r['engine_tok_s'][r['best_label']]:.1f}",
             "yes" if r["within_3pct"] else "no"] for r in out["leval"]]
    print(f"`advise` on this machine's engine ({out['machine']['date']}, {out['machine']['cpu']}; every "
          f"setting served on the first held-out window, {args.repeats} alternating runs, medians):\n")
    print(format_table(["scenario", "simulator's pick", "share of best", f"--confirm-top {args.top}",
                        "share of best", "engine's best", "best tok/s", "within 3%"], rows))
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
