"""Decision latency of exported policies (``scheduler_runtime.policy``), per kind, in microseconds.

The runtime scheduler calls ``policy.act(obs, mask)`` once per ADD/STOP decision, so a decision
must cost far less than a decode step; the budget is 10 us. This measures every policy kind on
observations spread over the environment's range (a PPO-sized 64x64 tanh MLP, a full UCB table,
the heuristic, always-add), or the policy files given with ``--policy``. No torch is imported.

    python -m benchmarks.policy_latency [--policy runs/ppo-leval/policy.feather ...] [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from feather_env.reporting import format_table, machine_info, write_json
from scheduler_runtime.decision import ADD, ObservationSpec
from scheduler_runtime.policy import (
    ConstantPolicy,
    HeuristicPolicy,
    MLPPolicy,
    Policy,
    TablePolicy,
    load_policy,
)
from scheduler_runtime.rules import HeuristicRule, TableBins

BUDGET_US = 10.0
SPEC = ObservationSpec(names=("batch_size", "delta", "w"), low=(0.0, -64.0, 0.0), high=(64.0, 64.0, 64.0),
                       scale=(64.0, 64.0, 64.0), chunk_size=512)


def synthetic_policies(seed: int = 0) -> dict[str, Policy]:
    """One policy of each kind with random parameters (the cost does not depend on the values)."""
    rng = np.random.default_rng(seed)
    bins = TableBins()
    n = 2 * bins.num_states
    hidden = 64
    layers = [(rng.normal(size=(hidden, 3)), rng.normal(size=hidden)),
              (rng.normal(size=(hidden, hidden)) / 8, rng.normal(size=hidden)),
              (rng.normal(size=(2, hidden)) / 8, rng.normal(size=2))]
    return {
        "always-add (constant)": ConstantPolicy(SPEC, ADD),
        "heuristic": HeuristicPolicy(SPEC, HeuristicRule()),
        "ucb/qlearning (table)": TablePolicy(SPEC, bins, rng.normal(size=n).tolist(),
                                             rng.integers(0, 3, size=n).tolist(), True),
        "ppo (mlp 64x64 tanh)": MLPPolicy(SPEC, layers),
    }


def measure(policy: Policy, n: int = 20_000, repeats: int = 5, seed: int = 1) -> dict[str, Any]:
    """Median over ``repeats`` of the mean cost of ``n`` decisions (us), plus the best repeat."""
    rng = np.random.default_rng(seed)
    spec = policy.obs_spec
    low, high = np.array(spec.low), np.array(spec.high)
    # Observations as the environment emits them: float32 arrays of integers; masks mostly both valid.
    obs = [np.asarray(rng.integers(low.astype(int), high.astype(int) + 1), dtype=np.float32)
           for _ in range(1024)]
    masks = [np.array([True, bool(rng.random() > 0.1)]) for _ in range(1024)]
    act = policy.act
    per_call = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(n):
            act(obs[i & 1023], masks[i & 1023])
        per_call.append((time.perf_counter() - t0) / n * 1e6)
    return {"median_us": statistics.median(per_call), "best_us": min(per_call), "calls": n * repeats}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policy", nargs="*", default=[], help="exported policy files to measure too")
    p.add_argument("--calls", type=int, default=20_000)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    policies = synthetic_policies()
    for path in args.policy:
        policies[str(path)] = load_policy(path)
    rows, results = [], {}
    for name, policy in policies.items():
        res = measure(policy, args.calls)
        results[name] = res
        within = "yes" if res["median_us"] <= BUDGET_US else "NO"
        rows.append([name, res["median_us"], res["best_us"], within])
    print(format_table(["policy", "median us/decision", "best us/decision", f"<= {BUDGET_US:g} us"], rows))
    payload = {"budget_us": BUDGET_US, "results": results, "machine": machine_info()}
    write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
