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

A mix (``--scenario A+B+...``) is searched for one rule that holds on every member: each member's
episodes are served apart, each candidate is scored by its worst ratio to the member's best plain
candidate (the member's own tuned cap), and the candidates include the caps lifted while
:data:`LIFTS` groups wait (``GroupCapRule.lift_at``), since no constant cap holds on both a
scenario whose load leaves few groups waiting and one where hundreds wait. ``policies/general.feather``
is this search's rule. Pooling the members' episodes instead (their summed tokens over summed
durations) lets the member with the most tokens per second choose for all.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from agents.base import evaluate
from feather_env.env import FeatherEnv, ScenarioMix
from scheduler_runtime.config import ConfigError
from scheduler_runtime.decision import ObservationSpec
from scheduler_runtime.policy import GroupCapPolicy, write_policy
from scheduler_runtime.rules import GroupCapRule

__all__ = ["CAPS", "LIFTS", "TUNE_SEED", "group_env", "main", "search_caps", "search_worst_ratio",
           "tune_group_cap"]

TUNE_SEED = 4_000_000
#: The caps tried after ``group-hold``, least restrictive first.
CAPS = (8, 6, 5, 4, 3, 2, 1)
#: The waiting-group counts at which a mix's search tries lifting each cap, largest first.
LIFTS = (32, 24, 16, 12, 8)


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


def search_worst_ratio(envs: Mapping[str, Any], seeds: Sequence[int]
                       ) -> tuple[GroupCapRule, list[dict[str, Any]]]:
    """The rule whose worst ratio over ``envs`` (name -> group-decision environment) to each
    environment's best plain candidate (``group-hold`` or a cap of :data:`CAPS`) is highest, among
    the plain candidates and each cap lifted at each of :data:`LIFTS`; ties: the earlier (plain
    first, then larger caps and later lifts). Every candidate's figures are returned."""
    rules = [GroupCapRule(cap=c) for c in (None, *CAPS)]
    rules += [GroupCapRule(cap=c, lift_at=lift) for c in CAPS for lift in LIFTS]
    plain = len(CAPS) + 1
    tput: dict[str, list[float]] = {
        name: [evaluate(rule, env, seeds)["output_throughput"] for rule in rules]
        for name, env in envs.items()}
    own = {name: max(figs[:plain]) for name, figs in tput.items()}
    tried: list[dict[str, Any]] = []
    best: tuple[float, GroupCapRule] | None = None
    for i, rule in enumerate(rules):
        ratios = {name: tput[name][i] / own[name] if own[name] else 1.0 for name in envs}
        worst = min(ratios.values())
        tried.append({**rule.params(), "worst_ratio": worst, "ratio": ratios,
                      "output_throughput": {name: tput[name][i] for name in envs}})
        if best is None or worst > best[0] + 1e-9:
            best = (worst, rule)
    assert best is not None
    return best[1], tried


def group_env(scenario: str, profile: str | None = None) -> Any:
    """The simulator's group-decision environment of ``scenario``, or of the mix ``A+B+...``
    (a :class:`~feather_env.env.ScenarioMix`: its members observe with one shared bound, as the
    mix's policy file records)."""
    members = scenario.split("+")
    if len(members) > 1:
        return ScenarioMix(members, "sim", profile=profile, decision="group")
    return FeatherEnv(scenario, "sim", profile=profile, decision="group")


def tune_group_cap(scenario: str, env: Any, episodes: int = 8,
                   log: Any = print) -> tuple[GroupCapRule, dict[str, Any]]:
    """The best cap on ``episodes`` training episodes of ``scenario`` served on ``env``, its
    :func:`group_env` (the caller's to close), and the search; a mix (``A+B``) by
    :func:`search_worst_ratio` over its members."""
    seeds = [TUNE_SEED + i for i in range(episodes)]
    if isinstance(env, ScenarioMix):
        rule, tried = search_worst_ratio(env.envs, seeds)
        worst = max(t["worst_ratio"] for t in tried)
        log(f"{scenario}: best of {len(tried)} rules {rule.name} -> worst ratio {worst:.3f}")
        return rule, {"scenario": scenario, "episodes": seeds, "tried": tried, "best": rule.name,
                      "best_worst_ratio": worst}
    rule, tried = search_caps(env, seeds)
    best = max(t["output_throughput"] for t in tried)
    log(f"{scenario}: best of {len(tried)} rules {rule.name} -> {best:.1f} tok/s")
    return rule, {"scenario": scenario, "episodes": seeds, "tried": tried, "best": rule.name,
                  "best_output_throughput": best}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenario", required=True, help="a scenario, or a mix A+B+... (one rule for all)")
    p.add_argument("--out", required=True, help="the policy file to write")
    p.add_argument("--episodes", type=int, default=8)
    p.add_argument("--profile", default=None)
    args = p.parse_args(argv)
    try:
        env = group_env(args.scenario, args.profile)  # names and profile checked before the search
    except (ConfigError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        spec = ObservationSpec.from_env(env)
        rule, search = tune_group_cap(args.scenario, env, args.episodes)
    finally:
        env.close()
    policy = GroupCapPolicy(spec, rule, agent="heuristic-tuned",
                            meta={"search": search, "command": "python -m agents.tuning " + " ".join(
                                argv if argv is not None else sys.argv[1:])})
    write_policy(args.out, policy)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
