"""Every agent and the reference orderings, per scenario, in the serving-loop environment.

    python -m benchmarks.agents --json results/agents.json --plot results/agents_learning.png
                                [--scenarios leval-kv-pressure,...] [--timesteps N] [--eval-episodes K]

Per scenario: UCB, Q-learning and PPO are trained on the simulator with their run configs
(``configs/runs/<agent>.yaml``: the group decision; ``train.py``'s library code; reward
``--reward``, default ``makespan`` as for the shipped policies), evaluated every ``timesteps / 5``
steps on held-out episodes (the learning curves), and their exported policies serve the held-out
episodes at the end; the references serve the same episodes: always-add on the group decision
(every new group opens), the best constant cap's rule ``group-cap-3``, the authors' heuristic on
the request decision, and the fcfs, lpm and dfs-weight orderings. A scenario that never asks the
group decision (nothing shares a prefix) has nothing to train on: its agents are reported as such.
Reported: end-to-end output throughput over the episodes, mean E2E latency and prefix hit rate;
the PNG shows each scenario's learning curves against the references. The real-engine figures of
the shipped policies are ``benchmarks/evaluation.py``'s.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agents.base import HELD_OUT_SEED as EVAL_SEED
from agents.base import evaluate
from agents.run_config import load_config
from agents.training import make_env, run
from benchmarks import measured
from feather_env.engines.vllm_engine import REPO_ROOT
from feather_env.env import FeatherEnv, NoDecisionError, scheduler_policy
from feather_env.reporting import format_table, machine_info, write_json
from feather_env.scenarios import EVALUATED_SCENARIOS
from scheduler_runtime.decision import AlwaysAdd
from scheduler_runtime.policy import load_policy

LEARNED = ("ucb", "qlearning", "ppo")
REFERENCES = ("always-add", "group-cap-3", "feather-heuristic", "fcfs", "lpm", "dfs-weight")
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
        try:
            res = run(cfg, tmp / f"{scenario}-{agent}", verbose=False)
        except NoDecisionError:
            out["decision_free"] = True
            print(f"  {scenario}: no episode asks the group decision; nothing to train", flush=True)
            break
        ev = evaluate(load_policy(res.policy_path), make_env(cfg), seeds)  # the exported policy
        out["agents"][agent] = {k: ev[k] for k in KEYS} | {"train_wall_s": res.wall_s,
                                                           "timesteps": res.num_timesteps}
        out["curves"][agent] = [(h["timesteps"], h["output_throughput"]) for h in res.eval_history]
        print(f"  {scenario} / {agent}: {ev['output_throughput']:.1f} tok/s ({res.wall_s:.0f} s)", flush=True)
    for name in REFERENCES:
        if name == "always-add":
            env, policy = FeatherEnv(scenario, "sim", decision="group"), AlwaysAdd()
        else:
            env = FeatherEnv(scenario, "sim", scheduler=name)
            policy = scheduler_policy(env)
        ev = evaluate(policy, env, seeds)
        env.close()
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


def render(res: dict[str, Any]) -> str:
    """The benchmark's figures in markdown: every agent and reference (rows) on every scenario."""
    out = [f"`python -m benchmarks.agents --json results/agents.json --plot results/agents_learning.png` "
           f"({measured(res)}; {res['timesteps']:,} training steps per agent, reward `{res.get('reward')}`, "
           f"{res['eval_episodes']} held-out episodes on the simulator; end-to-end output tok/s and its "
           "ratio to fcfs):", ""]
    by_scenario = res["results"]
    names = list(dict.fromkeys(n for group in ("agents", "references") for sc in by_scenario.values()
                               for n in sc[group]))
    rows = []
    for name in names:
        row: list[Any] = [name]
        for sc in by_scenario.values():
            r = sc["agents"].get(name) or sc["references"].get(name)
            row.append(f"{r['output_throughput']:.1f} ({r['vs_fcfs']:.2f}x)" if r else "-")
        rows.append(row)
    out.append(format_table(["agent", *by_scenario], rows))
    free = [f"`{name}`" for name, sc in by_scenario.items() if sc.get("decision_free")]
    if free:
        out += ["", f"No episode of {', '.join(free)} asks the group decision (nothing shares a prefix), so "
                "no agent was trained there."]
    return "\n".join(out)


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
    out = {"benchmark": "agents", "machine": machine_info(), "timesteps": args.timesteps,
           "reward": args.reward, "eval_episodes": args.eval_episodes, "eval_seed": EVAL_SEED,
           "results": results}
    print(render(out))
    write_json(args.json, out)
    if args.plot:
        plot(results, args.plot)
    return out


if __name__ == "__main__":
    main()
