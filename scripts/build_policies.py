"""Train, select and ship the policies of ``policies/``: every agent on every scenario, the best kept.

    python scripts/build_policies.py [--scenarios a,b,...] [--timesteps N] [--reward R] [--out policies]
                                     [--general-profile PROFILE] [--general-only]

Every shipped policy answers the group decision (``feather/GroupAdmission-v0``: open a prefix
group or hold it). For each scenario, ``train.py`` trains UCB (seed 0), Q-learning (seeds 0 and
1) and PPO (seed 0) with ``configs/runs/<agent>.yaml`` on the simulator and the ``makespan``
reward (its return is minus the episode's makespan: for a fixed episode, the end-to-end output
throughput the policies are selected and judged on), each evaluated on the run's validation
episodes (``train.eval_seed + i``, seeds 1,000,000+; the benchmarks' held-out episodes are
2,000,000+ and are not used here). The run whose exported policy reached the highest validation
output throughput is shipped as ``policies/<scenario>.feather`` (ties: the earlier run of
:data:`RUNS`, the simpler agent). ``python -m agents.tuning`` picks the best constant cap
(``heuristic-tuned``, ``policies/heuristic-tuned/<scenario>.feather``).

A scenario whose episodes never ask the group decision (nothing shares a prefix: ShareGPT,
LongBench) has nothing to train on; it ships ``general.feather``, which serves it exactly as any
group policy does (every request joins at once). ``general.feather`` is the one rule that holds
best on every scenario: ``python -m agents.tuning --scenario a+b+...`` scores each cap, plain or
lifted while many groups wait, by its worst ratio to each scenario's own tuned cap
(``--general-profile``: the simulator profile of the machine it is for). Learned runs on the mix,
selected on the mix's pooled throughput, let the scenario with the most tokens per second choose
for all (on 2026-12-02 such a table answered as ``group-cap-5``, 0.94x the high-load file on the
engine). ``--general-only`` rebuilds ``general.feather`` and its copies over an existing
``build.json``.
``policies/README.md`` is written with every command, the configs and the figures. Each command is
run as a user would run it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from feather_env.reporting import format_table, machine_info  # noqa: E402
from feather_env.scenarios import EVALUATED_SCENARIOS as SCENARIOS  # noqa: E402

AGENTS = ("ucb", "qlearning", "ppo")
#: (agent, seed) of every training run, in tie-break order.
RUNS = (("ucb", 0), ("qlearning", 0), ("qlearning", 1), ("ppo", 0))
REFERENCES = ("always-add", "fcfs", "feather-heuristic", "group-cap-3", "heuristic-tuned", "general")
#: Validation episodes that decide whether a scenario asks the group decision at all.
PROBE_EPISODES = 4


def _run(cmd: list[str]) -> None:
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO)


def _policy_path(summary: dict[str, Any]) -> Path:
    path = Path(summary["policy"])
    return path if path.is_absolute() else REPO / path


def train(agent: str, seed: int, scenario: str, timesteps: int, reward: str,
          runs: Path) -> tuple[list[str], dict[str, Any]]:
    out = runs / f"{scenario}-{agent}-s{seed}"
    cmd = ["python", "train.py", "--agent", agent, "--config", f"configs/runs/{agent}.yaml", "--scenario",
           scenario, "--reward", reward, "--timesteps", str(timesteps), "--seed", str(seed),
           "--out", str(out.relative_to(REPO)), "--no-progress"]
    _run([sys.executable, *cmd[1:]])
    return cmd, json.loads((out / "summary.json").read_text())


def asks_group_decisions(scenario: str) -> bool:
    """Whether ``group-cap-3`` meets a single group decision on the scenario's first validation episodes."""
    from feather_env.env import FeatherEnv, play_episode

    env = FeatherEnv(scenario, "sim", decision="group")
    try:
        return any(play_episode(env, episode_seed=1_000_000 + i)["decisions"] for i in range(PROBE_EPISODES))
    finally:
        env.close()


def best_of(scenario: str, timesteps: int, reward: str, runs: Path) -> dict[str, Any]:
    results = {f"{a}-s{s}": (a, s, *train(a, s, scenario, timesteps, reward, runs)) for a, s in RUNS}
    order = list(results)
    best = max(order, key=lambda k: (results[k][3]["final_eval"]["output_throughput"], -order.index(k)))
    return {"shipped": best, "command": " ".join(results[best][2]), "policy": _policy_path(results[best][3]),
            "runs": {k: {"agent": a, "seed": s, "output_throughput": r["final_eval"]["output_throughput"],
                         "mean_e2el_s": r["final_eval"]["mean_e2el_s"], "command": " ".join(cmd),
                         "timesteps": r["num_timesteps"], "wall_s": r["wall_s"]}
                     for k, (a, s, cmd, r) in results.items()}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--timesteps", type=int, default=60_000)
    p.add_argument("--general-profile", default=None,
                   help="the simulator profile general.feather is searched on (default: the default profile)")
    p.add_argument("--general-only", action="store_true",
                   help="rebuild general.feather and its copies over the existing build.json")
    p.add_argument("--reward", default="makespan")
    p.add_argument("--out", default=str(REPO / "policies"))
    args = p.parse_args()
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    out = Path(args.out)
    runs = REPO / "runs" / "policies"
    (out / "heuristic-tuned").mkdir(parents=True, exist_ok=True)
    if args.general_only:
        records = json.loads((out / "build.json").read_text())
    else:
        records = {"machine": machine_info(), "timesteps": args.timesteps, "reward": args.reward,
                   "runs": [f"{a}-s{s}" for a, s in RUNS], "scenarios": {}}
        for scenario in scenarios:
            records["scenarios"][scenario] = build_scenario(scenario, out, args.timesteps, args.reward, runs)
            (out / "build.json").write_text(json.dumps(records, indent=1) + "\n")  # progress survives a crash
    records["general"] = build_general(list(records["scenarios"]), out, args.general_profile)
    for scenario, rec in records["scenarios"].items():
        if rec.get("decision_free"):
            shutil.copyfile(out / "general.feather", out / f"{scenario}.feather")
    references(out, records)
    (out / "build.json").write_text(json.dumps(records, indent=1) + "\n")
    write_readme(out, records)
    return 0


def _rel(path: Path) -> str:
    """``path`` as the commands in ``build.json`` write it: relative to the repository when inside it."""
    full = path.resolve()
    return str(full.relative_to(REPO) if full.is_relative_to(REPO) else path)


def build_scenario(scenario: str, out: Path, timesteps: int, reward: str, runs: Path) -> dict[str, Any]:
    """The scenario's tuned cap, then its best learned run (``general`` where it asks no decision)."""
    tuned = out / "heuristic-tuned" / f"{scenario}.feather"
    tuned_cmd = ["python", "-m", "agents.tuning", "--scenario", scenario, "--out", _rel(tuned)]
    _run([sys.executable, *tuned_cmd[1:]])
    rec: dict[str, Any] = {"tuned_command": " ".join(tuned_cmd)}
    if asks_group_decisions(scenario):
        best = best_of(scenario, timesteps, reward, runs)
        shutil.copyfile(best.pop("policy"), out / f"{scenario}.feather")
        rec.update(best)
    else:
        rec.update(shipped="general", decision_free=True)
    return rec


def build_general(scenarios: list[str], out: Path, profile: str | None) -> dict[str, Any]:
    """``general.feather``: the worst-ratio search over every scenario (``agents.tuning``)."""
    path = out / "general.feather"
    cmd = ["python", "-m", "agents.tuning", "--scenario", "+".join(scenarios), "--out", _rel(path),
           *(["--profile", profile] if profile else [])]
    _run([sys.executable, *cmd[1:]])
    search = json.loads(path.read_text())["meta"]["search"]
    return {"shipped": "heuristic-tuned", "command": " ".join(cmd), "rule": search["best"],
            "worst_ratio": search["best_worst_ratio"]}


def references(out: Path, records: dict[str, Any]) -> None:
    """Every shipped file and the baselines on each scenario's validation episodes (the runs')."""
    from agents.base import evaluate
    from agents.run_config import load_config
    from feather_env.env import FeatherEnv, scheduler_policy
    from scheduler_runtime.decision import AlwaysAdd
    from scheduler_runtime.policy import load_policy

    cfg = load_config(REPO / "configs" / "runs" / "qlearning.yaml")
    seeds = [cfg.train.eval_seed + i for i in range(cfg.train.eval_episodes)]
    for scenario, rec in records["scenarios"].items():
        refs: dict[str, float] = {}
        group = FeatherEnv(scenario, "sim", decision="group")
        for name in ("fcfs", "feather-heuristic", "group-cap-3"):
            env = FeatherEnv(scenario, "sim", scheduler=name)
            refs[name] = evaluate(scheduler_policy(env), env, seeds)["output_throughput"]
            env.close()
        refs["always-add"] = evaluate(AlwaysAdd(), group, seeds)["output_throughput"]
        for name, path in (("heuristic-tuned", out / "heuristic-tuned" / f"{scenario}.feather"),
                           ("general", out / "general.feather"), ("shipped", out / f"{scenario}.feather")):
            refs[name] = evaluate(load_policy(path), group, seeds)["output_throughput"]
        group.close()
        rec["references"] = refs


def answers(path: Path) -> str:
    """What a shipped file answers as: a ``group-cap`` rule in every state (a table that departs from
    its baseline nowhere), or how many states it departs from its baseline in."""
    from scheduler_runtime.policy import TablePolicy, answers_as_rule, load_policy

    policy = load_policy(path)
    rule = answers_as_rule(policy)
    if rule is not None:
        return f"`{rule.name}`"
    if isinstance(policy, TablePolicy) and policy.baseline is not None:
        return f"`{policy.baseline.name}` but in {len(policy.departures() or [])} states"
    return "its own"


def write_readme(out: Path, records: dict[str, Any]) -> None:
    names = records["runs"]
    rows = []
    for scenario, rec in records["scenarios"].items():
        r = rec["references"]
        runs = rec.get("runs") or {}
        rows.append([f"`{scenario}.feather`", rec["shipped"], answers(out / f"{scenario}.feather"),
                     *(f"{runs[n]['output_throughput']:.1f}" if n in runs else "-" for n in names),
                     *(f"{r[x]:.1f}" for x in REFERENCES)])
    lines = [
        "# Shipped policies",
        "",
        "Every file here is a versioned policy file (`scheduler_runtime.policy`) that answers the group",
        "decision (`feather/GroupAdmission-v0`: open a prefix group or hold it), served with",
        "`feather-serve --scheduler feather:policies/NAME.feather` or `evaluate.py --schedulers",
        "feather:policies/NAME.feather`: the file's observation names tell the scheduler to ask the",
        "group decision, and its chunk size is the scheduler's. Made by `python scripts/build_policies.py`,",
        "which runs the commands below as a user would. Training is on the simulator (calibrated on the",
        "real engine, `configs/profiles/cpu-tiny-llama.json`); the figures are end-to-end output tokens/s on",
        f"the runs' validation episodes ({records['timesteps']:,} training steps each, reward "
        f"`{records['reward']}`; measured {records['machine']['date']} on {records['machine']['cpu']}). The",
        "real-engine figures of each file are in the evaluation (`docs/results.md`).",
        "",
        "- `<scenario>.feather`: the best of the runs (UCB, Q-learning with two seeds, PPO) on the",
        "  scenario's validation episodes; a scenario that never asks the group decision (nothing",
        "  shares a prefix) ships `general.feather`, which serves it as any group policy does.",
        "  Q-learning's table answers as the scenario's tuned cap except in the states where its two",
        "  values are two standard errors apart (`baseline: tuned`, `agents/qlearning.py`); where no",
        "  such state departs from the cap, the file answers exactly as `heuristic-tuned` (column",
        "  `answers as`) and the evaluation serves it once, under that name.",
        "- `heuristic-tuned/<scenario>.feather`: the best constant cap `group-cap-K` on the scenario",
        "  (`python -m agents.tuning`), the baseline a learned policy must match.",
        "- `general.feather`, for a user who deploys one policy: the cap, plain or lifted while many",
        "  groups wait, whose worst ratio to each scenario's own tuned cap is highest (`python -m",
        "  agents.tuning --scenario a+b+...`, on the simulator profile of the machine it is for).",
        "",
        "Columns: each run's validation output tokens/s, then the references on the same episodes",
        "(`always-add`: the group decision answered ADD, every new document opens at once).",
        "",
        format_table(["file", "shipped", "answers as", *names, *REFERENCES], rows),
        "",
        "Commands (run from the repository root):",
        "",
    ]
    for scenario, rec in records["scenarios"].items():
        how = (f"`{rec['command']}` (then copied from its `policy.feather`)" if "command" in rec
               else "`general.feather` (the scenario never asks the group decision)")
        lines += [f"- `{scenario}.feather`: {how}; tuned cap: `{rec['tuned_command']}`"]
    g = records["general"]
    general = answers(out / "general.feather")
    lines += [f"- `general.feather` (answers as {general}; worst ratio {g['worst_ratio']:.3f} on the "
              f"tuning episodes): `{g['command']}`", "",
              "Configs: `configs/runs/ucb.yaml`, `configs/runs/qlearning.yaml`, `configs/runs/ppo.yaml`; "
              "scenarios: `configs/scenarios/`. `build.json` has every figure."]
    (out / "README.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
