"""How much is there for a state-dependent group policy to win over the best constant cap, by regime?

    python -m benchmarks.hindsight_regimes [--episodes 16] [--profile P] [--json FILE]

The trace target of the group decision (a learned policy at 1.03x the best constant
``group-cap-K``) assumes the best cap moves with the load within an episode. This benchmark asks
the simulator, without a learner's noise, how much any choice of K could win, across the regimes
where a moving load should matter most: ``leval-trace`` at its shipped 4 requests/s and at 6, 8
and 12; with half and twice the KV cache; with fewer documents and more questions each, and the
reverse; and ``leval-kv-pressure-poisson`` at its shipped 3 requests/s and at 6 (a constant rate,
for contrast). For each regime, on the same held-out episodes:

- feather-heuristic and every constant K (:data:`benchmarks.group_admission.CAPS`), mean output
  tok/s per episode; the best constant K and its ratio to the heuristic;
- the best K per episode in hindsight (:func:`benchmarks.group_admission.hindsight`): a policy that
  knew each episode's load in advance and chose its one K for it;
- the best *load-reading* rule: each cap of 1..5 lifted while at least
  :data:`agents.tuning.LIFTS` groups wait (``GroupCapRule.lift_at``), the cap that gives way in a
  crowd.

The default profile is the simulator profile fitted to the machine the engine figures come from
(``configs/profiles/cpu-tiny-llama-xeon.json``).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from typing import Any

from agents.base import HELD_OUT_SEED
from agents.tuning import LIFTS
from benchmarks import measured
from benchmarks.group_admission import hindsight
from feather_env.env import FeatherEnv, play_episode
from feather_env.reporting import format_table, machine_info, write_json
from scheduler_runtime.rules import GroupCapRule

__all__ = ["REGIMES", "main", "regime", "render", "run"]

PROFILE = "configs/profiles/cpu-tiny-llama-xeon.json"
TRACE = "trace:splitwise_conv.csv:{}"
#: label -> (scenario, overrides of its sections).
REGIMES: dict[str, tuple[str, dict[str, dict[str, Any]]]] = {
    "trace 4 req/s (shipped)": ("leval-trace", {}),
    "trace 6 req/s": ("leval-trace", {"episode": {"arrival": TRACE.format(6)}}),
    "trace 8 req/s": ("leval-trace", {"episode": {"arrival": TRACE.format(8)}}),
    "trace 12 req/s": ("leval-trace", {"episode": {"arrival": TRACE.format(12)}}),
    "trace 4 req/s, KV 0.125 GiB": ("leval-trace", {"engine": {"kv_cache_gib": 0.125}}),
    "trace 8 req/s, KV 0.5 GiB": ("leval-trace", {"episode": {"arrival": TRACE.format(8)},
                                                  "engine": {"kv_cache_gib": 0.5}}),
    "trace 6 req/s, 16 docs x <=16 questions": (
        "leval-trace", {"episode": {"arrival": TRACE.format(6), "groups": 16, "max_per_group": 16}}),
    "trace 6 req/s, 48 docs x <=4 questions": (
        "leval-trace", {"episode": {"arrival": TRACE.format(6), "groups": 48, "max_per_group": 4}}),
    "poisson 3 req/s (shipped)": ("leval-kv-pressure-poisson", {}),
    "poisson 6 req/s": ("leval-kv-pressure-poisson", {"episode": {"arrival": "poisson:6"}}),
}
#: The caps tried lifted at each of :data:`agents.tuning.LIFTS`.
LIFTED_CAPS = (1, 2, 3, 4, 5)


def _mean_throughput(env: FeatherEnv, seeds: Sequence[int], policy: Any = None) -> float:
    return statistics.mean(play_episode(env, policy, episode_seed=s)["output_throughput"] for s in seeds)


def regime(scenario: str, overrides: dict[str, dict[str, Any]], seeds: Sequence[int],
           profile: str | None = PROFILE) -> dict[str, Any]:
    """One regime's figures: the heuristic, every constant K with the hindsight K, and the lifted caps."""
    heuristic = _mean_throughput(FeatherEnv(scenario, "sim", scheduler="feather-heuristic", profile=profile,
                                            scenario_overrides=overrides), seeds)
    out = hindsight(scenario, seeds, profile=profile, overrides=overrides)
    env = FeatherEnv(scenario, "sim", decision="group", profile=profile, scenario_overrides=overrides)
    rules = [GroupCapRule(cap=c, lift_at=lift) for c in LIFTED_CAPS for lift in LIFTS]
    lifted = {rule.name: _mean_throughput(env, seeds, rule) for rule in rules}
    best_lifted = max(lifted, key=lambda name: lifted[name])
    best = out["best_constant_mean"]
    return {**out, "scenario": scenario, "overrides": overrides, "heuristic": heuristic,
            "best_vs_heuristic": best / heuristic, "lifted": lifted, "best_lifted": best_lifted,
            "best_lifted_vs_best_constant": lifted[best_lifted] / best,
            "worst_cap_vs_best": min(statistics.mean(v) for v in out["per_k"].values()) / best}


def run(episodes: int = 16, profile: str | None = PROFILE,
        regimes: dict[str, tuple[str, dict[str, dict[str, Any]]]] = REGIMES) -> dict[str, Any]:
    """Every regime of ``regimes`` on held-out episodes ``HELD_OUT_SEED ..``, as JSON."""
    seeds = [HELD_OUT_SEED + i for i in range(episodes)]
    rows = {}
    for label, (scenario, overrides) in regimes.items():
        rows[label] = regime(scenario, overrides, seeds, profile)
        r = rows[label]
        print(f"  {label}: best K {r['best_constant_k']}, hindsight {r['hindsight_vs_best_constant']:.3f}x, "
              f"{r['best_lifted']} {r['best_lifted_vs_best_constant']:.3f}x", flush=True)
    return {"benchmark": "hindsight_regimes", "episodes": episodes, "seeds": seeds, "profile": profile,
            "regimes": rows, "machine": machine_info()}


def render(payload: dict[str, Any]) -> str:
    """The benchmark's table in markdown."""
    rows = [[label, f"{r['heuristic']:.1f}", str(r["best_constant_k"]), f"{r['best_vs_heuristic']:.3f}",
             f"{r['worst_cap_vs_best']:.3f}", f"{r['hindsight_vs_best_constant']:.3f}",
             f"{r['best_lifted']} {r['best_lifted_vs_best_constant']:.3f}"]
            for label, r in payload["regimes"].items()]
    head = (f"`{payload.get('command', 'python -m benchmarks.hindsight_regimes')}` ({measured(payload)}; "
            f"{payload['episodes']} held-out episodes per regime, simulator profile `{payload['profile']}`; "
            "mean output tok/s per episode):\n")
    return head + "\n" + format_table(
        ["regime", "feather-heuristic tok/s", "best constant K", "best K / heuristic", "worst K / best K",
         "hindsight K per episode / best K", "best lifted cap / best K"], rows)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=16)
    p.add_argument("--profile", default=PROFILE)
    p.add_argument("--json", default="results/hindsight_regimes.json")
    args = p.parse_args(argv)
    payload = run(args.episodes, args.profile)
    payload["command"] = (f"python -m benchmarks.hindsight_regimes --episodes {args.episodes} "
                          f"--profile {args.profile} --json {args.json}")
    print(render(payload))
    write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
