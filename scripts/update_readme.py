"""Rewrite the README's figure sections from the JSON files that the benchmarks wrote.

Each figure section of README.md sits between ``<!-- BEGIN name -->`` and
``<!-- END name -->``; this script replaces its body with a table rendered from
``results/<file>.json`` (with the date and machine recorded in that JSON), so no
figure in the README is typed by hand. ``make bench`` runs it last.

    python scripts/update_readme.py [--results results] [--readme README.md]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from feather_env.reporting import format_table  # noqa: E402


def _machine(res: dict[str, Any]) -> str:
    m = res.get("machine") or {}
    if isinstance(m, str):
        return m
    date = m.get("date") or res.get("date", "?")
    parts = sorted({(p.get("machine") or {}).get("date", "") for p in (res.get("scenarios") or {}).values()
                    if isinstance(p, dict)} - {""})
    if len(parts) > 1:  # a merged evaluation: its scenarios' dates, then the merge's
        date = f"{parts[0]} to {max(parts[-1], date)}"
    return f"measured {date} on {m.get('cpu', '?')}, {m.get('cores') or m.get('cpus', '?')} cores"


def render_prefix_homogeneity(res: dict[str, Any]) -> str:
    s = res["shape"]
    out = [f"{s['groups']} groups x {s['per_group']} requests, {s['prefix_len']}-token prefixes, "
           f"{s['suffix_len']}-token suffixes, {s['output_len']} output tokens ({_machine(res)}):", ""]
    n = s["groups"] * s["per_group"]
    order = res.get("order", "random")
    rows = [[f"{s['groups']} homogeneous batches of {s['per_group']}", res["homogeneous_tok_s"]],
            [f"1 heterogeneous batch of {n}, {order} order", res["heterogeneous_tok_s"]]]
    if res.get("heterogeneous_random_tok_s"):
        rows.append(["the same batch in a random arrival order", res["heterogeneous_random_tok_s"]])
    rows += [["the same batch sorted by prefix group", res.get("heterogeneous_sorted_tok_s") or "-"],
             [f"**homogeneous / heterogeneous ({order})**", f"**{res['ratio']:.2f}x**"]]
    if res.get("ratio_random"):
        rows.append(["homogeneous / heterogeneous (random arrival order)", f"{res['ratio_random']:.2f}x"])
    out.append(format_table(["schedule", "decode tok/s"], rows))
    runs = res.get("runs") or {}
    n_rep, n_extra = len(runs.get("ratio", [])), len(runs.get("heterogeneous_sorted", []))
    if n_rep > 1:
        extra = ("in every repeat" if n_extra >= n_rep else "in the first repeat" if n_extra == 1
                 else f"in the first {n_extra} repeats")
        out += ["", f"The ratio is the median of {n_rep} repeats: "
                + ", ".join(f"{r:.2f}" for r in runs["ratio"]) + f" (heterogeneous, {order} "
                + ", ".join(f"{v:,.0f}" for v in runs["heterogeneous"]) + " tok/s; homogeneous "
                + ", ".join(f"{v:,.0f}" for v in runs["homogeneous"])
                + f" tok/s). The other orders run {extra}."]
    if res.get("sweep"):
        groups = sorted({r["groups"] for r in res["sweep"]})
        batches = sorted({r["batch_size"] for r in res["sweep"]})
        cell = {(r["batch_size"], r["groups"]): r["decode_tok_s"] for r in res["sweep"]}
        out += ["", "Sweep, decode tok/s (rows: batch size; columns: prefix groups in the batch, "
                f"{order} order):", ""]
        out.append(format_table(["batch"] + [f"{g} groups" for g in groups],
                                [[b] + [cell.get((b, g), "-") for g in groups] for b in batches]))
        lo, hi = groups[0], groups[-1]
        equal = [f"{cell[(b, lo)] / cell[(b, hi)]:.2f}x at batch {b}" for b in batches
                 if (b, lo) in cell and (b, hi) in cell and cell[(b, hi)]]
        if lo != hi and equal:
            out += ["", f"At equal batch size, {lo} group vs {hi} groups: " + ", ".join(equal) + "."]
    return "\n".join(out)


def render_cht_overhead(res: dict[str, Any]) -> str:
    rows = [[r["structure"], r["waiting"], r["prompt_tokens"], r["decision_us"], r["insert_us"],
             f"{r.get('decisions_measured', '-')}/{r['waiting']}"] for r in res["results"]]
    out = [f"Chunk size {res.get('chunk_size')} tokens ({_machine(res)}):", "",
           format_table(["structure", "waiting", "prompt tokens", "decision us", "insert us",
                         "decisions measured"], rows), "", "Targets:", ""]
    for t in res.get("targets", []):
        value = (f"{t['value_us']:.1f} us" if "value_us" in t else f"{t['value_ratio']:,.0f}x")
        extra = ""
        others = [(label, t.get(key)) for label, key in (
            ("against LPM without SGLang's in-batch prefix check", "radix_lpm_nocheck_ratio"),
            ("against a tree of the running batch only", "radix_lpm_active_ratio")) if t.get(key)]
        if others:
            extra = " (" + "; ".join(f"{label}: {v:,.0f}x" for label, v in others) + ")"
        out.append(f"- {'met' if t['met'] else '**NOT met**'}: {t['target']}: {value}{extra}")
    return "\n".join(out)


def render_sim_validation(res: dict[str, Any]) -> str:
    """results/sim_validation.json (feather_env.calibrate --validate): the simulator's error."""
    rows = [[e["label"], e["seed"], e["requests"], e["real_duration_s"], e["sim_duration_s"],
             f"{e['makespan_ape']:.1%}", f"{e['real_hit_rate']:.1%}", f"{e['sim_hit_rate']:.1%}",
             _num(e["latency_median_ape"], "{:.1%}")] for e in res["episodes"]]
    return "\n".join([
        f"Simulator against the real engine on **{res['n']} fresh episodes** (other seeds than the "
        f"calibration; with and without KV pressure, burst and Poisson arrivals, four orderings; "
        f"{_machine(res)}; `python -m feather_env.calibrate --validate {res['profile']} "
        f"--json results/sim_validation.json`): **makespan MAPE {res['makespan_mape']:.3f}**, "
        f"**hit-rate error {res['hit_rate_abs_err']:.4f}** (absolute), median per-request E2E latency "
        f"error {res['latency_median_ape']:.3f}; {res.get('excluded_under_load', 0)} episodes left out "
        f"under foreign load.", "",
        format_table(["episode", "seed", "requests", "real makespan s", "sim makespan s", "error",
                      "real hit", "sim hit", "median latency error"], rows)])


def render_env_speed(res: dict[str, Any]) -> str:
    """results/env_speed.json (benchmarks/env_speed.py): simulated environment steps per second."""
    rows = []
    for r in res["results"]:
        rates = [x["steps_per_s"] for x in r["runs"]]
        rows.append([res["scenario"], r["policy"], r["steps_per_s"], f"{min(rates):,.0f}-{max(rates):,.0f}",
                     f"{max(x['foreign_cpu'] for x in r['runs']):.0%}"])
    verdict = "met" if res.get("met") else "**NOT met**"
    n = max((len(r.get("runs", [])) for r in res["results"]), default=0)
    return "\n".join([
        f"Simulated environment steps per second on `{res['scenario']}`, whole episodes, median of {n} "
        f"interleaved repeats ({_machine(res)}; `python -m benchmarks.env_speed --scenario "
        f"{res['scenario']} --json results/env_speed.json`): **{res['steps_per_s']:,.0f} steps/s** "
        f"(target >= {res.get('target_steps_per_s', 3000):,}: {verdict}).", "",
        format_table(["scenario", "policy", "steps/s", "range", "max foreign CPU"], rows)])


def render_env_orderings(res: dict[str, Any]) -> str:
    """results/env_orderings.json (benchmarks/env_orderings.py): the orderings in the environment."""
    names = list(res["results"]["sim"])
    rows = []
    for name in names:
        row: list[Any] = [f"`{name}`"]
        for backend in ("sim", "vllm"):
            r = res["results"][backend].get(name)
            row += ([r["output_throughput"], f"{r['vs_fcfs']:.2f}x", f"{r['prefix_hit_rate']:.0%}",
                     r["mean_e2el_s"]] if r else ["-"] * 4)
        rows.append(row)
    t = res["target"]
    met = ", ".join(f"{b}: {'met' if m else '**NOT met**'}" for b, m in t["met"].items())
    return "\n".join([
        f"The reference orderings served in the environment on `{res['scenario']}` episodes "
        f"0-{res['sim_episodes'] - 1} (simulator) and 0-{res['real_episodes'] - 1} (real engine, "
        f"orderings alternating; {_machine(res)}; `python -m benchmarks.env_orderings --json "
        f"results/env_orderings.json`). End-to-end output throughput over the episodes:", "",
        format_table(["ordering", "sim tok/s", "sim vs fcfs", "sim hit", "sim mean E2E s", "real tok/s",
                      "real vs fcfs", "real hit", "real mean E2E s"], rows), "",
        f"Target `{t['ordering']}` >= {t['vs_fcfs']}x fcfs: {met}."])


def render_rewards(res: dict[str, Any]) -> str:
    """results/rewards.json (benchmarks/rewards.py): which reward trains the best throughput."""
    rewards = list(res["totals"])
    rows = [[agent, *(by[r]["output_throughput"] for r in rewards)] for agent, by in res["results"].items()]
    rows.append(["always-add (reference)", *([res["always_add"]["output_throughput"]] * len(rewards))])
    return "\n".join([
        f"Agents trained {res['timesteps']:,} steps on the simulator with each reward, then serving "
        f"{len(res['eval_seeds'])} held-out `{res['scenario']}` episodes with the exported policy; e2e "
        f"output tokens/s ({_machine(res)}; `python -m benchmarks.rewards --json results/rewards.json`):", "",
        format_table(["agent", *rewards], rows), "",
        f"Best by summed throughput: `{res['best']}`; the environment's default is `{res['default']}`."])


def _num(value: Any, fmt: str = "{:.2f}") -> str:
    return "n/a" if value is None else fmt.format(value)


def _episode_bound(b: dict[str, Any]) -> str:
    ep = b.get("episode_decode")
    if not ep:
        return ""
    return (f"; episode bound (decode at the best rate a run reached, {ep['decode_rate_tok_s']:.0f} tok/s): "
            f"makespan {ep['makespan_s']:.1f} s, {ep['output_throughput']:.1f} output tok/s")


def render_evaluation(res: dict[str, Any]) -> str:
    """results/evaluation.json (benchmarks/evaluation.py): one table per scenario, the sweep, the targets."""
    from benchmarks.evaluation import summary_table

    quick = (" **quick smoke run (smaller episodes, one run each), not the real figures**"
             if res.get("quick") else "")
    walls = ", ".join(f"{k} {v / 60:.0f} min" for k, v in (res.get("wall_s_by_part") or {}).items())
    out = [f"`{res.get('command', 'python -m benchmarks.evaluation')}` ({_machine(res)}; wall time "
           f"{walls}; engine pinned to one core){quick}. Schedulers alternate (repeats: per scenario); "
           "each row is the run with the median output throughput. Latencies in ms "
           "from arrival on the engine clock, in `vllm bench serve`'s names; goodput: requests within "
           f"both SLOs ({res.get('slo_factor', 10):g}x the median isolated TTFT and E2EL of the episode's "
           "requests); sched time / step time: the Feather scheduler's decisions over the engine's step "
           "time; vs bound, vs episode bound: each bound's makespan over the run's.", ""]
    for name, p in (res.get("scenarios") or {}).items():
        w, b, slo = p["workload"], p["bound"], p.get("goodput_slos_ms") or {}
        out += [f"**{name}** ({p['scenario'].get('description', '')}): {w['requests']} requests, "
                f"{w['groups']} prefix groups, arrivals {w['arrivals']}, KV cache "
                f"{p['engine']['kv_cache_gib']:g} GiB. Goodput SLOs: TTFT <= {slo.get('ttft', 0):,.0f} ms, "
                f"E2EL <= {slo.get('e2el', 0):,.0f} ms. Bound: makespan {b['makespan_s']:.1f} s "
                f"({b['prefill_s']:.1f} s prefilling {b['distinct_prompt_tokens']:,} distinct of "
                f"{b['prompt_tokens']:,} prompt tokens, hit-rate ceiling {b['hit_rate_ceiling']:.0%}; "
                f"{b['decode_s']:.1f} s decoding at the engine's peak {b['decode_rate_tok_s']:.0f} tok/s), "
                f"{b['output_throughput']:.1f} output tok/s{_episode_bound(b)}. Each scheduler ran "
                f"{(p.get('inprocess') or {}).get('repeats', res.get('repeats', 1))} time(s).",
                "", summary_table(p), ""]
        reps = {n: m["repeats"]["output_throughput"] for n, m in p["runs"].items() if m.get("repeats")}
        if reps:
            out += ["Output tok/s of every run: " + "; ".join(
                f"`{n}` " + ", ".join(f"{v:.1f}" for v in vals) for n, vals in reps.items()) + ".", ""]
    sweep = res.get("sweep")
    if sweep:
        rates = sweep["rates"]
        rows = [[f"`{n}`", *(f"{q['output_throughput']:.1f} / {q['p99_e2el_ms'] / 1000:.1f} s" for q in pts)]
                for n, pts in sweep["points"].items()]
        out += [f"Load sweep, `{sweep['scenario']}` (one run per point; output tok/s / P99 E2E latency), "
                "`results/eval_sweep.png`:", "",
                format_table(["scheduler", *(f"{r:g} req/s" for r in rates)], rows), "",
                "![load sweep](results/eval_sweep.png)", ""]
    targets = res.get("targets") or {}
    if targets:
        out += ["Targets:", ""]
        out += [f"- {'met' if t['met'] else '**NOT met**'}: {name}: {t['value']} (target {t['target']}; "
                f"{t['detail']})" for name, t in targets.items()]
    return "\n".join(out).rstrip()


def render_agents(res: dict[str, Any]) -> str:
    """results/agents.json (benchmarks/agents.py): every agent and reference, per scenario (simulator)."""
    out = [f"`python -m benchmarks.agents --json results/agents.json --plot results/agents_learning.png` "
           f"({_machine(res)}; {res['timesteps']:,} training steps per agent, reward `{res.get('reward')}`, "
           f"{res['eval_episodes']} held-out episodes on the simulator; end-to-end output tok/s and its "
           "ratio to fcfs):", ""]
    scenarios = list(res["results"])
    first = res["results"][scenarios[0]]
    names = [*first["agents"], *first["references"]]
    rows = []
    for name in names:
        row: list[Any] = [name]
        for sc in scenarios:
            r = res["results"][sc]["agents"].get(name) or res["results"][sc]["references"].get(name)
            row.append(f"{r['output_throughput']:.1f} ({r['vs_fcfs']:.2f}x)" if r else "-")
        rows.append(row)
    out += [format_table(["agent", *scenarios], rows), "", "![learning curves](results/agents_learning.png)"]
    return "\n".join(out)


def render_scheduler_overhead(res: dict[str, Any]) -> str:
    rows = [[r["waiting"], r["step_ms"], r["decision_us_per_call"], f"{r['overhead_fraction']:.4f}",
             f"{r['prediction_fraction']:.5f}"] for r in res["results"]]
    return "\n".join([f"Scheduler `{res.get('scheduler')}` ({_machine(res)}):", "",
                      format_table(["waiting", "engine step (ms)", "scheduler us / schedule()",
                                    "overhead fraction", "prediction fraction"], rows)])


def render_endpoint_agreement(res: dict[str, Any]) -> str:
    """results/endpoint_agreement.json (benchmarks/endpoint_agreement.py): in-process vs feather-serve."""
    w = res["workload"]
    rows, detail = [], []
    for name, r in res["results"].items():
        a, b = r["inprocess"], r["endpoint"]
        rows.append([f"`{name}`", f"{a['median_output_throughput']:.1f}",
                     f"{b['median_output_throughput']:.1f}", f"{r['ratio']:.3f}",
                     "met" if r["met"] else "**NOT met**"])
        detail.append(f"`{name}` in-process " + ", ".join(f"{v:.1f}" for v in a["output_throughput"])
                      + "; endpoint " + ", ".join(f"{v:.1f}" for v in b["output_throughput"]))
    done = all(r["all_completed"] for r in res["results"].values())
    foreign = max(max(r["inprocess"]["foreign_cpu"]) for r in res["results"].values())
    return "\n".join([
        f"Scenario `{res['scenario']}` episode {res['seed']}, {w['requests']} requests of {w['groups']} "
        f"L-Eval documents (prompts mean {w['prompt_tokens_mean']:.0f} tokens), each generating exactly "
        f"{w['output_tokens_max']} tokens, burst; KV cache {res['engine']['kv_cache_gib']:g} GiB "
        f"({_machine(res)}; `{res['command']}`):", "",
        format_table(["scheduler", "in-process output tok/s", "feather-serve output tok/s (endpoint)",
                      "endpoint / in-process", f"within {res['target']:.0%}"], rows), "",
        f"Every run: {res['repeats']} per side (output tok/s: {'; '.join(detail)}); every request completed "
        f"with its tokens: {done}; other processes used at most {foreign:.0%} of the engine's core during "
        f"the in-process runs."])


def render_policy_agreement(res: dict[str, Any]) -> str:
    """results/policy_agreement.json (benchmarks/policy_agreement.py): decisions that differ."""
    rows = []
    for scenario, by_pair in res["scenarios"].items():
        for pair, r in by_pair.items():
            h, e = r["held_out"], r["evaluation_episode"]
            rows.append([f"`{scenario}`", pair, f"{h['differ']} of {h['decisions']}",
                         f"{e['differ']} of {e['decisions']}"])
    return "\n".join([
        f"`python -m benchmarks.policy_agreement --json results/policy_agreement.json` ({_machine(res)}; "
        f"the simulator, {res['episodes']} held-out episodes and the evaluation's episode "
        f"{res['evaluation_episode']}; decisions where the second policy answers otherwise than the first):",
        "", format_table(["scenario", "policies", "differ, held-out episodes", "differ, evaluated episode"],
                         rows)])


RENDERERS: dict[str, tuple[str, Callable[[dict[str, Any]], str]]] = {
    "scheduler_overhead": ("scheduler_overhead.json", render_scheduler_overhead),
    "agents": ("agents.json", render_agents),
    "prefix_homogeneity": ("prefix_homogeneity.json", render_prefix_homogeneity),
    "cht_overhead": ("cht_overhead.json", render_cht_overhead),
    "sim_validation": ("sim_validation.json", render_sim_validation),
    "env_speed": ("env_speed.json", render_env_speed),
    "env_orderings": ("env_orderings.json", render_env_orderings),
    "rewards": ("rewards.json", render_rewards),
    "evaluation": ("evaluation.json", render_evaluation),
    "endpoint_agreement": ("endpoint_agreement.json", render_endpoint_agreement),
    "policy_agreement": ("policy_agreement.json", render_policy_agreement),
}


def render_env_manual() -> str:
    """FeatherEnv's docstring, the environment's manual, as the README shows it (one source)."""
    import inspect

    from feather_env.env import FeatherEnv

    doc = inspect.getdoc(FeatherEnv) or ""
    body = doc.split("\n", 1)[1].strip() if "\n" in doc else doc
    body = body.replace("\n## ", "\n#### ")
    if body.startswith("## "):
        body = "#### " + body[3:]
    summary = "<details><summary><code>help(feather_env.env.FeatherEnv)</code>: the manual</summary>"
    return f"{summary}\n\n{body}\n\n</details>"


def update(readme: str, results: Path, renderers=RENDERERS, only: set[str] | None = None
           ) -> tuple[str, list[str]]:
    done = []
    pattern = re.compile(r"(<!-- BEGIN env_manual -->\n).*?(<!-- END env_manual -->)", re.S)
    if pattern.search(readme) and (only is None or "env_manual" in only):
        body = render_env_manual()
        readme = pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(2), readme)
        done.append("env_manual")
    for name, (fname, render) in renderers.items():
        if only is not None and name not in only:
            continue
        path = results / fname
        pattern = re.compile(rf"(<!-- BEGIN {re.escape(name)} -->\n).*?(<!-- END {re.escape(name)} -->)",
                             re.S)
        if not path.is_file() or not pattern.search(readme):
            continue
        body = render(json.loads(path.read_text()))
        readme = pattern.sub(lambda m, body=body: m.group(1) + body + "\n" + m.group(2), readme)
        done.append(name)
    return readme, done


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", default="results")
    p.add_argument("--readme", default="README.md")
    p.add_argument("--only", default=None,
                   help=f"comma-separated sections (default all: env_manual, {', '.join(RENDERERS)})")
    args = p.parse_args()
    readme = Path(args.readme)
    only = None
    if args.only:
        only = {s.strip() for s in args.only.split(",") if s.strip()}
        unknown = only - set(RENDERERS) - {"env_manual"}
        if unknown:
            raise SystemExit(f"unknown sections {sorted(unknown)}; known: {['env_manual', *RENDERERS]}")
    text, done = update(readme.read_text(), Path(args.results), only=only)
    readme.write_text(text)
    print(f"updated README sections: {', '.join(done) or 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
