"""Simulated environment steps per second (FeatherEnv on the fitted SimBackend).

    python -m benchmarks.env_speed --json results/env_speed.json

Runs whole episodes with a random valid policy and with always-add on the default
workload (W=64 waiting, batches up to 64) and on an L-Eval-like mix, and reports steps/s
(median of repeats). Target: >= 10,000 steps/s.

The repeats are interleaved (round 1 of every row, then round 2, ...), so a slow spell of
the shared host spreads over all rows instead of taking every repeat of one row; each run
records the CPU time other processes used (``foreign_cpu``, steal time included) and the
hypervisor's steal time alone (``steal``), as fractions of the machine over the run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import numpy as np

from feather_env.env import ADD, STOP, FeatherEnv
from feather_env.hostload import ForeignLoad
from feather_env.reporting import format_table, machine_info, write_json
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
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    workloads = {
        "default (16 docs, 2K-8K tokens)": dict(workload=None, waiting=64, max_batch_size=64),
        "L-Eval-like (40 docs of 12K, 8 questions)": dict(
            workload=synthetic_workload(num_groups=40, per_group=8, prefix_len=12000, suffix_len=30,
                                        output_len="uniform:8:128", seed=1, name="leval-like"),
            waiting=128, max_batch_size=64),
    }
    envs = {name: FeatherEnv("sim", **kwargs) for name, kwargs in workloads.items()}
    cells = [(name, policy) for name in workloads for policy in ("random", "always-add")]
    runs: dict[tuple[str, str], list[dict[str, float]]] = {cell: [] for cell in cells}
    for r in range(args.repeats):
        for name, policy in cells:
            with ForeignLoad() as load:
                rate = steps_per_second(envs[name], policy, args.episodes, seed=100 * r)
            runs[(name, policy)].append({"steps_per_s": rate, "foreign_cpu": load.fraction,
                                         "steal": load.steal})
    rows, results = [], []
    for name, policy in cells:
        rates = [run["steps_per_s"] for run in runs[(name, policy)]]
        med = statistics.median(rates)
        results.append({"workload": name, "policy": policy, "steps_per_s": med, "runs": rates,
                        "foreign_cpu": [run["foreign_cpu"] for run in runs[(name, policy)]],
                        "steal": [run["steal"] for run in runs[(name, policy)]]})
        rows.append([name, policy, med, f"{min(rates):,.0f}-{max(rates):,.0f}"])
    print(format_table(["workload", "policy", "sim env steps/s", f"range of {args.repeats} runs"], rows))
    out = {"benchmark": "env_speed", "machine": machine_info(), "results": results,
           "target_steps_per_s": 10_000,
           "met": all(r["steps_per_s"] >= 10_000 for r in results)}
    print(f"target >= 10,000 steps/s: {'met' if out['met'] else 'NOT met'}")
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
