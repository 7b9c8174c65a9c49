"""The simulator's results, bit for bit: what a change that must not change behaviour is checked against.

    python scripts/sim_fingerprint.py --out results/sim_fingerprint.json [--episodes 4]
    python scripts/sim_fingerprint.py --compare results/sim_fingerprint.json

Every evaluated scenario's first held-out episodes (seeds ``HELD_OUT_SEED + i``), served on the
simulator by every ordering (``fcfs``, ``sjf``, ``svf``, ``lpm``, ``dfs-weight``), the request
decision's heuristic, the group decision's rules, and every policy file of ``policies/``
(shipped, heuristic-tuned, general). Each episode's record is exact: the engine clock at the end,
each request's first-scheduled, first-token and finish times and prefix hit, the decisions, adds,
stops and preemptions. ``--compare`` serves them again and lists every record that differs (exit 1),
or says they are identical (exit 0). The simulator is deterministic, so any difference is a change
of behaviour.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agents.base import HELD_OUT_SEED  # noqa: E402
from feather_env.env import FeatherEnv, play_episode  # noqa: E402
from feather_env.scenarios import EVALUATED_SCENARIOS  # noqa: E402

SCHEDULERS = ("fcfs", "sjf", "svf", "lpm", "dfs-weight", "feather-heuristic", "feather-heuristic+svf",
              "group-hold", "group-cap-3")


def _policy_files(scenario: str) -> dict[str, Path]:
    policies = REPO / "policies"
    files = {"shipped": policies / f"{scenario}.feather",
             "heuristic-tuned": policies / "heuristic-tuned" / f"{scenario}.feather",
             "general": policies / "general.feather"}
    return {k: p for k, p in files.items() if p.is_file()}


def episode_record(env: FeatherEnv, seed: int) -> dict[str, Any]:
    """One episode's exact outcome (floats as their repr, so equality is bit for bit)."""
    m = play_episode(env, episode_seed=seed)
    timelines = sorted(env.backend.timelines(), key=lambda t: t.request_id)
    rows = [(t.request_id, t.first_scheduled, t.first_token, t.finish, t.prefix_hit_tokens)
            for t in timelines]
    digest = hashlib.sha256(repr(rows).encode()).hexdigest()
    return {"clock": repr(env.backend.clock), "requests": digest, "decisions": m["decisions"],
            "adds": m["adds"], "stops": m["stops"], "preemptions": m["preemptions"],
            "output_throughput": repr(m["output_throughput"])}


def fingerprint(episodes: int) -> dict[str, Any]:
    seeds = [HELD_OUT_SEED + i for i in range(episodes)]
    out: dict[str, Any] = {}
    for scenario in EVALUATED_SCENARIOS:
        cells: dict[str, Any] = {}
        for name in SCHEDULERS:
            env = FeatherEnv(scenario, "sim", scheduler=name)
            cells[name] = [episode_record(env, s) for s in seeds]
            env.close()
        for alias, path in _policy_files(scenario).items():
            env = FeatherEnv(scenario, "sim", scheduler=f"feather:{path}")
            cells[alias] = [episode_record(env, s) for s in seeds]
            env.close()
        out[scenario] = cells
        print(f"{scenario}: {len(cells)} schedulers x {episodes} episodes", flush=True)
    return {"episodes": episodes, "seeds": seeds, "scenarios": out}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the fingerprint here")
    p.add_argument("--compare", help="serve again and compare with this fingerprint")
    p.add_argument("--episodes", type=int, default=4)
    args = p.parse_args(argv)
    if not args.out and not args.compare:
        p.error("give --out, --compare or both")
    if args.compare:
        old = json.loads(Path(args.compare).read_text())
        new = fingerprint(old["episodes"])
    else:
        new = fingerprint(args.episodes)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(new, indent=1) + "\n")
    if not args.compare:
        return 0
    diffs = [f"{sc}/{name}/episode {i}: {k} {a[k]} -> {b[k]}"
             for sc, cells in old["scenarios"].items() for name, eps in cells.items()
             for i, (a, b) in enumerate(zip(eps, new["scenarios"].get(sc, {}).get(name, [{}] * len(eps)),
                                            strict=True))
             for k in a if a[k] != b.get(k)]
    missing = [f"{sc}/{name}" for sc, cells in old["scenarios"].items() for name in cells
               if name not in new["scenarios"].get(sc, {})]
    for line in missing + diffs:
        print("DIFFERS: " + line)
    total = sum(len(eps) for cells in old["scenarios"].values() for eps in cells.values())
    print(f"{total} episode records compared: " + ("identical" if not (diffs or missing) else
                                                   f"{len(diffs)} differ, {len(missing)} missing"))
    return 1 if diffs or missing else 0


if __name__ == "__main__":
    raise SystemExit(main())
