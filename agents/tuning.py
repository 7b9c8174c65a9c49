"""``heuristic-tuned``: the group decision's hand-made rule with its cap searched per scenario.

    python -m agents.tuning --scenario NAME --out policies/heuristic-tuned/NAME.feather

The baseline a learned policy must beat is the best hand-made rule fitted to the workload too:
``group-cap-K`` (:class:`~scheduler_runtime.rules.GroupCapRule`: cached group first, hold a new
group while work of the groups in flight waits, at most K groups in flight) with K chosen per
scenario. The search serves each candidate, ``group-hold`` (no cap) then K = :data:`CAPS` from
the largest down, on the same training episodes of the scenario on the simulator; the best by
end-to-end output throughput is kept (ties: the earlier candidate, the least restrictive, so a
workload where the cap never binds keeps no cap) and exported as a ``group-cap`` policy file with
its search recorded in ``meta``. The held-out evaluation is the benchmarks' business; the
training episodes here use their own seeds.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from agents.base import evaluate
from feather_env.env import FeatherEnv
from scheduler_runtime.decision import ObservationSpec
from scheduler_runtime.policy import GroupCapPolicy, write_policy
from scheduler_runtime.rules import GroupCapRule

__all__ = ["CAPS", "TUNE_SEED", "main", "search_caps", "tune_group_cap"]

TUNE_SEED = 4_000_000
#: The caps tried after ``group-hold``, least restrictive first.
CAPS = (8, 6, 5, 4, 3, 2, 1)


def search_caps(env: Any, seeds: Sequence[int]) -> tuple[GroupCapRule, list[dict[str, Any]]]:
    """The best of ``group-hold`` and :data:`CAPS` on ``env``'s episodes ``seeds`` (a group-decision
    environment), by end-to-end output throughput (ties: the earlier, least restrictive), and
    every candidate's figure."""
    tried: list[dict[str, Any]] = []
    best: tuple[float, GroupCapRule] | None = None
    for cap in (None, *CAPS):
        rule = GroupCapRule(cap=cap)
        tput = evaluate(rule, env, seeds)["output_throughput"]
        tried.append({**rule.params(), "output_throughput": tput})
        if best is None or tput > best[0] + 1e-9:
            best = (tput, rule)
    assert best is not None
    return best[1], tried


def tune_group_cap(scenario: str, episodes: int = 8, profile: str | None = None,
                   log: Any = print) -> tuple[GroupCapRule, dict[str, Any]]:
    """The best cap on ``episodes`` training episodes of ``scenario`` (simulator), and the search."""
    env = FeatherEnv(scenario, "sim", profile=profile, decision="group")
    seeds = [TUNE_SEED + i for i in range(episodes)]
    try:
        rule, tried = search_caps(env, seeds)
    finally:
        env.close()
    best = max(t["output_throughput"] for t in tried)
    log(f"{scenario}: best of {len(tried)} rules {rule.name} -> {best:.1f} tok/s")
    return rule, {"scenario": scenario, "episodes": seeds, "tried": tried, "best": rule.name,
                  "best_output_throughput": best}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenario", required=True)
    p.add_argument("--out", required=True, help="the policy file to write")
    p.add_argument("--episodes", type=int, default=8)
    p.add_argument("--profile", default=None)
    args = p.parse_args(argv)
    rule, search = tune_group_cap(args.scenario, args.episodes, args.profile)
    env = FeatherEnv(args.scenario, "sim", profile=args.profile, decision="group")
    policy = GroupCapPolicy(ObservationSpec.from_env(env), rule, agent="heuristic-tuned",
                            meta={"search": search, "command": "python -m agents.tuning " + " ".join(
                                argv if argv is not None else sys.argv[1:])})
    write_policy(args.out, policy)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
