"""What can a group decision add to the best constant cap? A lookahead over the cap, on the simulator.

    python -m benchmarks.rollout_gain [--episodes 8] [--train-episodes 24] [--json results/rollout_gain.json]

The shipped policies match the scenario's best constant cap (``heuristic-tuned``) and no more. Is
that the learners' fault, or is there little to win over the cap? For each scenario with arrivals
over time, on the same held-out episodes (seeds ``HELD_OUT_SEED + i``) of the simulator, this
serves (:mod:`agents.rollout`):

- the scenario's tuned cap (``policies/heuristic-tuned/<scenario>.feather``), the reference;
- the **clairvoyant lookahead** over it: at every owned group decision, the rest of the episode
  served on a copy of the simulator after each action, the cap answering later, and the action
  whose copy ends sooner taken. It knows the episode's future arrivals, so it is not deployable:
  it says what better answers to the decisions, one at a time, could win on the episode;
- its control, the **placebo lookahead** (:func:`agents.rollout.placebo_episode`): the cap's
  answers at every decision, and with the same foresight, at each owned decision, the choice to
  run the simulated engine 30% (a second row: 100%) slower until the next one. That never helps
  in expectation and changes no answer, so what it wins is what foresight wins on the episode's
  timing alone; the lookahead's gain above it is the part its answers win;
- the **distilled table**: one step of approximate policy iteration. The advantages of ADD over
  STOP along the cap's own trajectories on the tuning episodes (:data:`agents.tuning.TUNE_SEED`
  on), averaged per state bin of the tabular agents; the cap's answer except in bins where the
  mean advantage disagrees by more than two standard errors. Deployable: what the agents'
  features let a learner win over the cap, measured without a learner's noise;
- the **distilled tree**: the same, with a regression tree of the advantages over the raw
  observation (depth 4, at least 100 samples a leaf) in place of the bins; deployable;
- the shipped policy (``policies/<scenario>.feather``) beside them.

Each row: output tok/s over all episodes, its ratio to the cap, the smallest, median and largest
per-episode ratio, mean E2E latency; the lookahead's share of owned decisions it answered otherwise
than the cap; the distilled table's bins that deviate.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agents.base import HELD_OUT_SEED
from agents.rollout import advantages, distill, distill_tree, lookahead_episode, placebo_episode
from agents.tuning import TUNE_SEED
from benchmarks import measured
from benchmarks.group_admission import episodes_row
from feather_env.env import FeatherEnv, play_episode
from feather_env.reporting import format_table, machine_info, write_json
from scheduler_runtime.policy import load_policy

__all__ = ["SCENARIOS", "main", "render", "run_scenario"]

SCENARIOS = ("leval-kv-pressure-poisson", "leval-trace")
REPO = Path(__file__).resolve().parent.parent
#: How much slower the placebo may run the engine until the next decision (0.3: 30%), a row each.
PLACEBO_SLOWDOWNS = (0.3, 1.0)
#: The distilled tree's depth and fewest samples a leaf (:class:`agents.rollout.AdvantageTree`).
TREE_DEPTH, TREE_MIN_LEAF = 4, 100


def run_scenario(scenario: str, episodes: int, train_episodes: int, z: float = 2.0,
                 log: Any = print, profile: str | None = None) -> dict[str, Any]:
    """The cap, the lookahead over it and its placebo, the distilled table and the shipped policy
    on ``scenario`` (the simulator with ``profile``, default the shipped one)."""
    t0 = time.perf_counter()
    cap = load_policy(REPO / "policies" / "heuristic-tuned" / f"{scenario}.feather")
    shipped = load_policy(REPO / "policies" / f"{scenario}.feather")
    env = FeatherEnv(scenario, "sim", decision="group", profile=profile)
    seeds = [HELD_OUT_SEED + i for i in range(episodes)]
    base_eps = [play_episode(env, cap, episode_seed=s) for s in seeds]
    look_eps = [lookahead_episode(env, cap, s) for s in seeds]
    log(f"{scenario}: lookahead served ({time.perf_counter() - t0:.0f} s)")
    placebo_eps = {x: [placebo_episode(env, cap, s, x) for s in seeds] for x in PLACEBO_SLOWDOWNS}
    log(f"{scenario}: placebo served ({time.perf_counter() - t0:.0f} s)")
    train_seeds = [TUNE_SEED + i for i in range(train_episodes)]
    adv = advantages(env, cap, train_seeds)
    table, bins = distill(adv, cap, z=z)
    tree, leaves = distill_tree(adv, cap, z=z, depth=TREE_DEPTH, min_leaf=TREE_MIN_LEAF)
    log(f"{scenario}: advantages of {train_episodes} tuning episodes ({time.perf_counter() - t0:.0f} s)")
    dist_eps = [play_episode(env, table, episode_seed=s) for s in seeds]
    tree_eps = [play_episode(env, tree, episode_seed=s) for s in seeds]
    ship_eps = [play_episode(env, shipped, episode_seed=s) for s in seeds]
    env.close()
    owned = sum(e["decisions_owned"] for e in look_eps)
    rows = {key: episodes_row(eps, base_eps) for key, eps in
            (("cap", base_eps), ("lookahead", look_eps),
             *((f"placebo {x:.0%}", eps) for x, eps in placebo_eps.items()),
             ("distilled", dist_eps), ("tree", tree_eps), ("shipped", ship_eps))}
    for row in rows.values():
        row["vs_cap"] = row["output_throughput"] / rows["cap"]["output_throughput"]
    return {
        "scenario": scenario,
        "cap": cap.meta.get("search", {}).get("best", "heuristic-tuned"),
        "held_out_seeds": seeds,
        "train_seeds": [train_seeds[0], train_seeds[-1]],
        "z": z,
        "rows": rows,
        "lookahead_owned": owned,
        "lookahead_changed": sum(e["changed"] for e in look_eps),
        "placebo_slowed": {f"{x:.0%}": sum(e["slowed"] for e in eps) for x, eps in placebo_eps.items()},
        "profile": profile,
        "distilled_bins": bins,
        "distilled_deviations": sum(b["policy"] != b["base"] for b in bins),
        "tree_leaves": leaves,
        "tree_deviations": sum(b["policy"] != b["base"] for b in leaves),
        "wall_s": time.perf_counter() - t0,
    }


def render(res: dict[str, Any]) -> str:
    """The JSON as markdown: a table per scenario and what the lookahead and the table changed."""
    scenarios = list(res["scenarios"].values())
    out = [f"`{res['command']}` ({measured(res)}; {len(scenarios[0]['held_out_seeds'])} held-out "
           "episodes per scenario, identical for every row; ratios are to the tuned cap):", ""]
    names = {"cap": "the tuned cap ({cap})",
             "lookahead": "clairvoyant lookahead over the cap (not deployable)",
             "distilled": "distilled table (the cap + significant bins)",
             "tree": "distilled tree (the cap + significant leaves)", "shipped": "shipped policy"}
    for sc in scenarios:
        rows = []
        for key, r in sc["rows"].items():
            ratios = r["episode_ratios"]
            name = (names[key].format(cap=sc["cap"]) if not key.startswith("placebo ") else
                    f"its placebo: the cap's answers, the engine {key.removeprefix('placebo ')} slower "
                    "where that ends sooner")
            rows.append([name, f"{r['output_throughput']:.1f}",
                         f"{r['vs_cap']:.3f}",
                         f"{min(ratios):.3f} / {statistics.median(ratios):.3f} / {max(ratios):.3f}",
                         f"{r['mean_e2el_s']:.2f}"])
        train = sc["train_seeds"][1] - sc["train_seeds"][0] + 1
        slowed = " and ".join(f"{n} ({x})" for x, n in sc["placebo_slowed"].items())
        out += [f"**{sc['scenario']}**", "",
                format_table(["variant", "output tok/s", "vs cap", "per episode: min / median / max",
                              "mean E2E s"], rows), "",
                f"The lookahead answered {sc['lookahead_changed']} of {sc['lookahead_owned']} owned "
                "decisions otherwise than the cap; the placebos answered none otherwise and ran the "
                f"engine slower until the next decision after {slowed} of them; the distilled table "
                f"deviates from it in {sc['distilled_deviations']} of {len(sc['distilled_bins'])} visited "
                f"bins, the distilled tree in {sc['tree_deviations']} of its {len(sc['tree_leaves'])} "
                f"leaves (advantages from {train} tuning episodes, z = {sc['z']:g}).", ""]
    return "\n".join(out).rstrip("\n")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--episodes", type=int, default=8, help="held-out episodes per scenario")
    p.add_argument("--train-episodes", type=int, default=24,
                   help="tuning episodes the table's advantages come from")
    p.add_argument("--profile", default=None, help="simulator profile (default: the shipped one)")
    p.add_argument("--json", default="results/rollout_gain.json")
    args = p.parse_args(argv)
    if args.episodes < 1 or args.train_episodes < 2:
        raise SystemExit("--episodes must be >= 1 and --train-episodes >= 2")
    t0 = time.perf_counter()
    payload = {
        "benchmark": "rollout_gain",
        "scenarios": {sc: run_scenario(sc, args.episodes, args.train_episodes, profile=args.profile)
                      for sc in args.scenarios.split(",")},
        "machine": machine_info(),
        "command": f"python -m benchmarks.rollout_gain --episodes {args.episodes} "
                   f"--train-episodes {args.train_episodes}"
                   + (f" --profile {args.profile}" if args.profile else ""),
    }
    payload["wall_s"] = time.perf_counter() - t0
    print(render(payload))
    write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
