"""Simulated environment steps per second: FeatherEnv on the simulator backend, whole episodes.

    python -m benchmarks.env_speed --scenario leval-kv-pressure --json results/env_speed.json

Serves whole episodes of the scenario with a random valid policy and with always-add (each ADD
or STOP is one environment step) and reports steps/s, the median of interleaved repeats (round 1
of every row, then round 2, ...), so a slow spell of the shared host spreads over all rows. Each
run records the CPU time other processes used (``foreign_cpu``) as a fraction of the machine.
Target: ``steps_per_s`` >= 3,000 on ``leval-kv-pressure`` (the top-level figure is the median
over every run of every row).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks import measured
from feather_env.env import ADD, STOP, FeatherEnv
from feather_env.hostload import ForeignLoad
from feather_env.reporting import format_table, machine_info, write_json

TARGET_STEPS_PER_S = 3_000


def steps_per_second(env: FeatherEnv, policy: str, episodes: int, seed: int) -> tuple[float, int]:
    """(steps/s, steps) over ``episodes`` whole episodes (resets included)."""
    # The random policy's coins are drawn up front: what is timed is the environment, not
    # numpy's per-call overhead in the policy.
    coins = np.random.default_rng(seed).random(1 << 16).tolist()
    steps = 0
    t0 = time.perf_counter()
    for ep in range(episodes):
        env.reset(seed=seed + ep)
        done = False
        while not done:
            mask = env.action_masks()
            if policy == "always-add":
                action = ADD if mask[ADD] else STOP
            else:  # uniform over the valid actions
                action = ADD if mask[ADD] and (not mask[STOP] or coins[steps & 0xFFFF] < 0.5) else STOP
            _, _, terminated, truncated, _ = env.step(action)
            done = terminated or truncated
            steps += 1
    return steps / (time.perf_counter() - t0), steps


def render(res: dict[str, Any]) -> str:
    """The benchmark's figures in markdown: the overall median, then each policy's runs."""
    per_run = res.get("episodes_per_run")
    rows = []
    for r in res["results"]:
        rates = [x["steps_per_s"] for x in r["runs"]]
        steps = (f"{statistics.median(x['steps'] for x in r['runs']) / per_run:.0f}"
                 if per_run and all("steps" in x for x in r["runs"]) else "-")
        rows.append([res["scenario"], r["policy"], r["steps_per_s"], f"{min(rates):,.0f}-{max(rates):,.0f}",
                     steps, f"{max(x['foreign_cpu'] for x in r['runs']):.0%}"])
    n = max((len(r.get("runs", [])) for r in res["results"]), default=0)
    return "\n".join([
        f"Simulated environment steps per second on `{res['scenario']}`, whole episodes, median of {n} "
        f"interleaved repeats ({measured(res)}; `python -m benchmarks.env_speed --scenario "
        f"{res['scenario']} --json results/env_speed.json`): **{res['steps_per_s']:,.0f} steps/s** "
        "over every run.", "",
        format_table(["scenario", "policy", "steps/s", "range", "steps/episode", "max foreign CPU"], rows)])


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenario", default="leval-kv-pressure")
    p.add_argument("--episodes", type=int, default=10, help="episodes per run")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--profile", default=None, help="simulator profile (default: the shipped one)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    env = FeatherEnv(args.scenario, "sim", profile=args.profile)
    env.reset(seed=0)  # load and hash the scenario's pool outside the timing
    policies = ("random", "always-add")
    runs: dict[str, list[dict[str, float]]] = {policy: [] for policy in policies}
    for r in range(args.repeats):
        for policy in policies:
            with ForeignLoad() as load:
                rate, steps = steps_per_second(env, policy, args.episodes, seed=1000 * r)
            runs[policy].append({"steps_per_s": rate, "steps": steps, "foreign_cpu": load.fraction})
    results = []
    for policy in policies:
        med = statistics.median(run["steps_per_s"] for run in runs[policy])
        results.append({"policy": policy, "steps_per_s": med, "runs": runs[policy]})
    overall = statistics.median(run["steps_per_s"] for policy in policies for run in runs[policy])
    out = {"benchmark": "env_speed", "scenario": args.scenario, "machine": machine_info(),
           "steps_per_s": overall, "results": results, "target_steps_per_s": TARGET_STEPS_PER_S,
           "met": overall >= TARGET_STEPS_PER_S, "episodes_per_run": args.episodes}
    print(render(out))
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
