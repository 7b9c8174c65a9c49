"""Simulated environment steps per second (FeatherEnv on the fitted SimBackend).

    python -m benchmarks.env_speed --json results/env_speed.json

Runs whole episodes with a random valid policy and with always-add on the default
workload (W=64 waiting, batches up to 64) and on an L-Eval-like mix, and reports steps/s
(median of repeats). Target: >= 10,000 steps/s.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import numpy as np

from benchmarks.common import format_table, machine_info, write_json
from feather_env.env import ADD, STOP, FeatherEnv
from feather_env.workloads import synthetic_workload


def steps_per_second(env: FeatherEnv, policy: str, episodes: int, seed: int) -> float:
    # The random policy's coins are drawn up front: what is timed is the environment, not
    # numpy's per-call overhead in the policy (a Generator.choice per step costs ~15 us).
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
            _, _, done, _, _ = env.step(action)
            steps += 1
    return steps / (time.perf_counter() - t0)


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    workloads = {
        "default (16 docs, 2K-8K tokens)": dict(workload=None, waiting=64, max_batch_size=64),
        "L-Eval-like (40 docs of 12K, 8 questions)": dict(
            workload=synthetic_workload(num_groups=40, per_group=8, prefix_len=12000, suffix_len=30,
                                        output_len="uniform:8:128", seed=1, name="leval-like"),
            waiting=128, max_batch_size=64),
    }
    rows, results = [], []
    for name, kwargs in workloads.items():
        env = FeatherEnv("sim", **kwargs)
        for policy in ("random", "always-add"):
            runs = [steps_per_second(env, policy, args.episodes, seed=100 * r)
                    for r in range(args.repeats)]
            med = statistics.median(runs)
            results.append({"workload": name, "policy": policy, "steps_per_s": med, "runs": runs})
            rows.append([name, policy, med])
    print(format_table(["workload", "policy", "sim env steps/s"], rows))
    out = {"benchmark": "env_speed", "machine": machine_info(), "results": results,
           "target_steps_per_s": 10_000,
           "met": all(r["steps_per_s"] >= 10_000 for r in results)}
    print(f"target >= 10,000 steps/s: {'met' if out['met'] else 'NOT met'}")
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
