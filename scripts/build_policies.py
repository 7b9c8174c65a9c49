"""Train, select and ship the policies of ``policies/``: every agent on every scenario, the best kept.

    python scripts/build_policies.py [--scenarios a,b,...] [--timesteps N] [--reward R] [--out policies]

For each scenario: ``train.py`` trains UCB, Q-learning and PPO (``configs/runs/<agent>.yaml``, on
the simulator, evaluated on its held-out episodes ``train.eval_seed + i``) with the ``makespan``
reward (its return is minus the episode's makespan: for a fixed episode, the end-to-end output
throughput the policies are selected and judged on; the configs' default, ``latency``, trades
throughput for latency where the workload lets it, e.g. ShareGPT), and
``python -m agents.tuning`` searches the heuristic's constants (``heuristic-tuned``). The agent
whose exported policy reached the highest held-out end-to-end output throughput is shipped as
``policies/<scenario>.feather`` (ties go to the earlier agent of ``AGENTS``: the simpler policy);
the tuned heuristic goes to ``policies/heuristic-tuned/<scenario>.feather``. ``general.feather`` is
PPO trained on a mix of every scenario (``--scenario a+b+...``). ``policies/README.md`` is written
with every command, the configs and the figures. Each command is run as a user would run it.
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
REFERENCES = ("always-add", "fcfs", "feather-heuristic", "heuristic-tuned", "general")


def _run(cmd: list[str]) -> None:
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO)


def train(agent: str, scenario: str, timesteps: int, reward: str,
          runs: Path) -> tuple[list[str], dict[str, Any]]:
    out = runs / f"{scenario}-{agent}"
    cmd = ["python", "train.py", "--agent", agent, "--config", f"configs/runs/{agent}.yaml", "--scenario",
           scenario, "--reward", reward, "--timesteps", str(timesteps), "--out", str(out.relative_to(REPO)),
           "--no-progress"]
    _run([sys.executable, *cmd[1:]])
    return cmd, json.loads((out / "summary.json").read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--timesteps", type=int, default=100_000)
    p.add_argument("--general-timesteps", type=int, default=200_000)
    p.add_argument("--reward", default="makespan")
    p.add_argument("--out", default=str(REPO / "policies"))
    args = p.parse_args()
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    out = Path(args.out)
    runs = REPO / "runs" / "policies"
    (out / "heuristic-tuned").mkdir(parents=True, exist_ok=True)
    records: dict[str, Any] = {"machine": machine_info(), "timesteps": args.timesteps, "reward": args.reward,
                               "scenarios": {}}
    for scenario in scenarios:
        results = {agent: train(agent, scenario, args.timesteps, args.reward, runs) for agent in AGENTS}
        best = max(AGENTS, key=lambda a: (results[a][1]["final_eval"]["output_throughput"], -AGENTS.index(a)))
        shutil.copyfile(results[best][1]["policy"] if Path(results[best][1]["policy"]).is_absolute()
                        else REPO / results[best][1]["policy"], out / f"{scenario}.feather")
        tuned_cmd = ["python", "-m", "agents.tuning", "--scenario", scenario, "--out",
                     f"policies/heuristic-tuned/{scenario}.feather"]
        _run([sys.executable, *tuned_cmd[1:]])
        records["scenarios"][scenario] = {
            "shipped": best, "command": " ".join(results[best][0]), "tuned_command": " ".join(tuned_cmd),
            "agents": {a: {"output_throughput": r[1]["final_eval"]["output_throughput"],
                           "mean_e2el_s": r[1]["final_eval"]["mean_e2el_s"], "command": " ".join(r[0]),
                           "timesteps": r[1]["num_timesteps"], "wall_s": r[1]["wall_s"]}
                       for a, r in results.items()}}
    mix = "+".join(scenarios)
    general_cmd, general = train("ppo", mix, args.general_timesteps, args.reward, runs)
    general_src = Path(general["policy"])
    shutil.copyfile(general_src if general_src.is_absolute() else REPO / general_src, out / "general.feather")
    records["general"] = {"agent": "ppo", "command": " ".join(general_cmd),
                          "output_throughput_mix": general["final_eval"]["output_throughput"]}
    references(out, records, runs)
    (out / "build.json").write_text(json.dumps(records, indent=1) + "\n")
    write_readme(out, records)
    return 0


def references(out: Path, records: dict[str, Any], runs: Path) -> None:
    """The baselines on each scenario's held-out episodes (those its agents were evaluated on).

    always-add and fcfs come from the shipped agent's own run (``compare_with``); the authors'
    heuristic, the tuned heuristic and ``general.feather`` are served here on the same seeds.
    """
    from agents.base import evaluate
    from agents.training import load_config
    from feather_env.env import FeatherEnv
    from scheduler_runtime.policy import HeuristicRule, load_policy

    for scenario, rec in records["scenarios"].items():
        summary = json.loads((runs / f"{scenario}-{rec['shipped']}" / "summary.json").read_text())
        cfg = load_config(REPO / "configs" / "runs" / f"{rec['shipped']}.yaml", scenario=scenario)
        seeds = [cfg.train.eval_seed + i for i in range(cfg.train.eval_episodes)]
        env = FeatherEnv(scenario, "sim")
        refs = {name: summary["comparison"][name]["output_throughput"] for name in ("always-add", "fcfs")}
        refs["feather-heuristic"] = evaluate(HeuristicRule(), env, seeds)["output_throughput"]
        for name, path in (("heuristic-tuned", out / "heuristic-tuned" / f"{scenario}.feather"),
                           ("general", out / "general.feather")):
            refs[name] = evaluate(load_policy(path), env, seeds)["output_throughput"]
        rec["references"] = refs
        env.close()


def write_readme(out: Path, records: dict[str, Any]) -> None:
    rows = []
    for scenario, rec in records["scenarios"].items():
        a = rec["agents"]
        r = rec["references"]
        rows.append([f"`{scenario}.feather`", rec["shipped"],
                     *(f"{a[x]['output_throughput']:.1f}" for x in AGENTS),
                     *(f"{r[x]:.1f}" for x in REFERENCES)])
    lines = [
        "# Shipped policies",
        "",
        "Every file here is a versioned policy file (`scheduler_runtime.policy`), served with",
        "`feather-serve --scheduler feather:policies/NAME.feather` or `evaluate.py --schedulers",
        "feather:policies/NAME.feather`, and made by `python scripts/build_policies.py`, which runs the",
        "commands below as a user would. Training is on the simulator (calibrated on the real engine,",
        "`configs/profiles/cpu-tiny-llama.json`); the figures are held-out end-to-end output tokens/s",
        f"on the simulator ({records['timesteps']:,} training steps each, reward `{records['reward']}`; "
        f"measured {records['machine']['date']} on {records['machine']['cpu']}). The real-engine figures of",
        "each file are in the README's evaluation tables (`benchmarks/evaluation.py`).",
        "",
        "- `<scenario>.feather`: the best of UCB, Q-learning and PPO on the scenario (ties: the",
        "  simpler agent, in that order).",
        "- `heuristic-tuned/<scenario>.feather`: the authors' heuristic with its constants searched on",
        "  the scenario (`python -m agents.tuning`), the baseline a learned policy must beat.",
        "- `general.feather`: PPO trained on a mix of every scenario, for a user who deploys one policy.",
        "",
        "Columns: each agent's held-out output tokens/s, then the baselines on the same episodes",
        "(`general` is `general.feather` served on the scenario).",
        "",
        format_table(["file", "shipped agent", *AGENTS, *REFERENCES], rows),
        "",
        "Commands (run from the repository root):",
        "",
    ]
    for scenario, rec in records["scenarios"].items():
        lines += [f"- `{scenario}.feather`: `{rec['command']}` (then copied from its `policy.feather`); "
                  f"tuned heuristic: `{rec['tuned_command']}`"]
    g = records["general"]
    lines += [f"- `general.feather`: `{g['command']}` (held-out output on the mix: "
              f"{g['output_throughput_mix']:.1f} tokens/s)", "",
              "Configs: `configs/runs/ucb.yaml`, `configs/runs/qlearning.yaml`, `configs/runs/ppo.yaml`; "
              "scenarios: `configs/scenarios/`. `build.json` has every figure.", "",
              "Fine-tuning on the real engine (`train.py ... --resume --backend vllm --eval-backend sim`, "
              "then `python -m agents.agreement SHIPPED FINE-TUNED --scenario NAME`) was tried on "
              "`leval-kv-pressure-poisson.feather` (UCB) and `leval-kv-pressure.feather` (PPO), 1,000 "
              "real-engine decisions each (2026-12-01): neither changed a decision on 8 held-out episodes, "
              "so the files here are the simulator's (docs/design.md, \"Policies in the serving loop\")."]
    (out / "README.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
