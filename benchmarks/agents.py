"""Every agent and the reference orderings, per scenario, in the serving-loop environment.

    python -m benchmarks.agents --json results/agents.json --plot results/agents_learning.png
                                [--scenarios leval-kv-pressure,...] [--timesteps N] [--eval-episodes K]

Per scenario: UCB, Q-learning and PPO are trained on the simulator with their run configs
(``configs/runs/<agent>.yaml``, ``train.py``'s library code; reward ``--reward``, default
``makespan`` as for the shipped policies), evaluated every ``timesteps / 5``
steps on held-out episodes (the learning curves), and their exported policies serve the held-out
episodes at the end; the references serve the same episodes: always-add and the heuristic over
the CHT's candidates, and the fcfs, lpm and dfs-weight orderings. Reported: end-to-end output
throughput over the episodes, mean E2E latency and prefix hit rate; the PNG shows each scenario's
learning curves against the references. The real-engine figures of the shipped policies are
``benchmarks/evaluation.py``'s.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agents.base import HELD_OUT_SEED as EVAL_SEED
from agents.base import evaluate
from agents.training import load_config, make_env, reference_policy, run
from feather_env.engine import REPO_ROOT
from feather_env.reporting import format_table, machine_info, write_json
from feather_env.scenarios import EVALUATED_SCENARIOS
from scheduler_runtime.policy import load_policy

LEARNED = ("ucb", "qlearning", "ppo")
REFERENCES = ("always-add", "heuristic", "fcfs", "lpm", "dfs-weight")
KEYS = ("output_throughput", "mean_e2el_s", "prefix_hit_rate", "mean_return")


def run_scenario(scenario: str, timesteps: int, eval_episodes: int, tmp: Path,
                 agents: Sequence[str] = LEARNED, reward: str = "makespan") -> dict[str, Any]:
    """Train every agent on ``scenario`` and evaluate it and the references on the same episodes."""
    seeds = [EVAL_SEED + i for i in range(eval_episodes)]
    out: dict[str, Any] = {"agents": {}, "references": {}, "curves": {}}
    for agent in agents:
        cfg = load_config(REPO_ROOT / "configs" / "runs" / f"{agent}.yaml", agent, scenario=scenario,
                          reward=reward, timesteps=timesteps, eval_every=max(1, timesteps // 5),
                          eval_episodes=eval_episodes, eval_seed=EVAL_SEED, checkpoint_every=0,
                          progress_bar=False, compare_with=[])
        res = run(cfg, tmp / f"{scenario}-{agent}", verbose=False)
        ev = evaluate(load_policy(res.policy_path), make_env(cfg), seeds)  # the exported policy
        out["agents"][agent] = {k: ev[k] for k in KEYS} | {"train_wall_s": res.wall_s,
                                                           "timesteps": res.num_timesteps}
        out["curves"][agent] = [(h["timesteps"], h["output_throughput"]) for h in res.eval_history]
        print(f"  {scenario} / {agent}: {ev['output_throughput']:.1f} tok/s ({res.wall_s:.0f} s)", flush=True)
    base = load_config(REPO_ROOT / "configs" / "runs" / "heuristic.yaml", "heuristic", scenario=scenario)
    for name in REFERENCES:
        env = make_env(base, scheduler=name if name in ("fcfs", "lpm", "dfs-weight") else None)
        ev = evaluate(reference_policy(name, env), env, seeds)
        out["references"][name] = {k: ev[k] for k in KEYS}
    fcfs = out["references"]["fcfs"]["output_throughput"]
    for group in ("agents", "references"):
        for res in out[group].values():
            res["vs_fcfs"] = res["output_throughput"] / fcfs
    return out


def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = list(results)
    fig, axes = plt.subplots(1, len(scenarios), figsize=(5.5 * len(scenarios), 4), squeeze=False)
    for ax, scenario in zip(axes[0], scenarios, strict=True):
        res = results[scenario]
        for agent, curve in res["curves"].items():
            if curve:
                xs, ys = zip(*curve, strict=True)
                ax.plot(xs, ys, marker="o", label=agent)
        for name, style in (("always-add", ":"), ("fcfs", "--"), ("lpm", "-.")):
            ax.axhline(res["references"][name]["output_throughput"], ls=style, color="gray", lw=1, label=name)
        ax.set_title(scenario, fontsize=9)
        ax.set_xlabel("training steps (simulator)")
        ax.set_ylabel("held-out e2e output tok/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenarios", default=",".join(EVALUATED_SCENARIOS))
    p.add_argument("--reward", default="makespan", help="the agents' reward (the shipped policies' too)")
    p.add_argument("--agents", default=",".join(LEARNED))
    p.add_argument("--timesteps", type=int, default=20_000)
    p.add_argument("--eval-episodes", type=int, default=8)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args(argv)
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    agents = [a.strip() for a in args.agents.split(",") if a.strip()]
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for scenario in scenarios:
            results[scenario] = run_scenario(scenario, args.timesteps, args.eval_episodes, Path(tmp), agents,
                                             args.reward)
    for scenario, res in results.items():
        rows = [[name, r["output_throughput"], f"{r['vs_fcfs']:.2f}x", r["mean_e2el_s"],
                 f"{r['prefix_hit_rate']:.0%}"]
                for group in ("agents", "references") for name, r in res[group].items()]
        print(f"\n{scenario}:")
        print(format_table(["agent", "e2e tok/s", "vs fcfs", "mean E2E s", "prefix hit"], rows))
    out = {"benchmark": "agents", "machine": machine_info(), "timesteps": args.timesteps,
           "reward": args.reward, "eval_episodes": args.eval_episodes, "eval_seed": EVAL_SEED,
           "results": results}
    write_json(args.json, out)
    if args.plot:
        plot(results, args.plot)
    return out


if __name__ == "__main__":
    main()
