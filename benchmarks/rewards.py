"""Which reward trains the best end-to-end output throughput? Every learning agent, every reward.

    python -m benchmarks.rewards --json results/rewards.json [--scenario leval-kv-pressure] [--timesteps N]

Trains UCB, Q-learning and PPO (the configs of ``configs/runs/``) on the simulator with each of the
environment's rewards (``makespan``, ``latency``, ``decode_throughput``), then serves the same
held-out episodes with each trained policy and reports their end-to-end output throughput (output
tokens over the episodes' summed durations) and mean E2E latency, next to always-add. The reward
whose agents reach the best throughput, summed over the agents, is the environment's default
(``feather_env.env.REWARDS[0]``); the table goes in the README, section "Environment".
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agents.base import evaluate
from agents.registry import make_agent
from agents.run_config import load_config
from agents.training import make_env, run
from benchmarks import measured
from feather_env.engines.vllm_engine import REPO_ROOT
from feather_env.env import REWARDS as ALL_REWARDS
from feather_env.reporting import format_table, machine_info, write_json
from scheduler_runtime.policy import load_policy

#: The rewards compared on throughput: ``goodput`` asks for the user's SLOs (evaluate.py advise).
REWARDS = tuple(r for r in ALL_REWARDS if r != "goodput")

AGENTS = ("ucb", "qlearning", "ppo")
EVAL_SEED = 3_000_000


def render(res: dict[str, Any]) -> str:
    """The benchmark's figures in markdown: each agent's throughput under each reward."""
    rewards = list(res["totals"])
    rows = [[agent, *(by[r]["output_throughput"] for r in rewards)] for agent, by in res["results"].items()]
    rows.append(["always-add (reference)", *([res["always_add"]["output_throughput"]] * len(rewards))])
    return "\n".join([
        f"Agents trained {res['timesteps']:,} steps on the simulator with each reward, then serving "
        f"{len(res['eval_seeds'])} held-out `{res['scenario']}` episodes with the exported policy; e2e "
        f"output tokens/s ({measured(res)}; `python -m benchmarks.rewards --json results/rewards.json`):", "",
        format_table(["agent", *rewards], rows), "",
        f"Best by summed throughput: `{res['best']}`; the environment's default is `{res['default']}`."])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenario", default="leval-kv-pressure")
    p.add_argument("--timesteps", type=int, default=20_000)
    p.add_argument("--eval-episodes", type=int, default=8)
    p.add_argument("--agents", default=",".join(AGENTS))
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    agents = [a.strip() for a in args.agents.split(",") if a.strip()]
    seeds = [EVAL_SEED + i for i in range(args.eval_episodes)]
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for agent in agents:
            results[agent] = {}
            for reward in REWARDS:
                # the reward through load_config, so the run's resolved environments carry it
                cfg = load_config(REPO_ROOT / "configs" / "runs" / f"{agent}.yaml", agent,
                                  scenario=args.scenario, reward=reward, timesteps=args.timesteps,
                                  eval_every=0, checkpoint_every=0, eval_episodes=1, progress_bar=False,
                                  compare_with=[])
                res = run(cfg, Path(tmp) / f"{agent}-{reward}", verbose=False)
                policy = load_policy(res.policy_path)  # what would be deployed
                ev = evaluate(policy, make_env(cfg), seeds)
                keep = ("output_throughput", "mean_e2el_s", "prefix_hit_rate", "mean_return")
                results[agent][reward] = {k: ev[k] for k in keep} | {"train_wall_s": res.wall_s}
                print(f"  {agent} / {reward}: {ev['output_throughput']:.1f} tok/s, mean E2E "
                      f"{ev['mean_e2el_s']:.2f} s ({res.wall_s:.0f} s of training)", flush=True)
        ref_cfg = load_config(REPO_ROOT / "configs" / "runs" / "ucb.yaml", "ucb", scenario=args.scenario)
        env = make_env(ref_cfg)
        always = evaluate(make_agent("always-add", env=env), env, seeds)
    totals = {reward: sum(results[a][reward]["output_throughput"] for a in agents) for reward in REWARDS}
    best = max(totals, key=totals.get)
    out = {"benchmark": "rewards", "scenario": args.scenario, "timesteps": args.timesteps,
           "eval_seeds": seeds, "machine": machine_info(), "results": results,
           "always_add": {k: always[k] for k in ("output_throughput", "mean_e2el_s")},
           "totals": totals, "best": best, "default": REWARDS[0]}
    print(render(out))
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
