"""Can a STOP gated on KV pressure beat the baselines? A grid of rules on the simulator.

    python -m benchmarks.admission_rules [--scenarios a,b] [--episodes 8]
                                         [--json results/admission_rules.json]

Under KV pressure, admitting a request of a new document can evict a document that other waiting
requests need. The learned agents (``benchmarks/agents.py``) converge to always-add, so this
benchmark asks the question directly, with rules a person would write from the extended
observation (the engine's KV usage and the candidate's prompt chunks missing from its prefix
cache): *STOP when ``kv_usage > k`` and ``missing_chunks > m``, else ADD*, over the CHT's order.
Each rule and the baselines (``fcfs``, ``lpm``, ``dfs-weight``, ``feather-heuristic``) serve the
same held-out episodes of each KV-pressure scenario (the agents benchmark's seeds); the table
gives end-to-end output tok/s, its ratio to fcfs and to the better of lpm/dfs-weight, mean E2E
latency and the prefix hit rate. ``k = 2`` never stops (always-add over the CHT).
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Sequence
from typing import Any

from agents.base import HELD_OUT_SEED as EVAL_SEED
from agents.base import evaluate
from benchmarks import measured
from feather_env.env import FeatherEnv, scheduler_policy
from feather_env.reporting import format_table, machine_info, write_json
from scheduler_runtime.decision import ADD, EXTENDED_OBS_NAMES, STOP, ObservationSpec

SCENARIOS = ("leval-kv-pressure", "leval-kv-pressure-poisson", "leval-high-load")
BASELINES = ("fcfs", "lpm", "dfs-weight", "feather-heuristic")
KV_LEVELS = (0.5, 0.7, 0.8, 0.9, 0.95, 2.0)
MISSING_LEVELS = (0, 4, 16, 64)


class KVGatedRule:
    """STOP when the engine's KV usage exceeds ``kv`` and the candidate misses more than
    ``missing`` prompt chunks in the prefix cache; otherwise ADD."""

    obs_spec = ObservationSpec(names=EXTENDED_OBS_NAMES)  # the extended observation

    def __init__(self, kv: float, missing: int) -> None:
        self.kv, self.missing = kv, missing
        self._kv = EXTENDED_OBS_NAMES.index("kv_usage")
        self._miss = EXTENDED_OBS_NAMES.index("missing_chunks")

    def reset(self) -> None:
        """No state between episodes."""

    def act(self, obs: Sequence[float], mask: Sequence[bool]) -> int:
        """STOP or ADD for one pending decision."""
        if mask[STOP] and obs[self._kv] > self.kv and obs[self._miss] > self.missing:
            return STOP
        return ADD


def run(scenario: str, episodes: int) -> dict[str, Any]:
    """Every baseline and rule on ``episodes`` held-out episodes of ``scenario``."""
    seeds = [EVAL_SEED + i for i in range(episodes)]
    rows: dict[str, dict[str, Any]] = {}
    for name in BASELINES:
        env = FeatherEnv(scenario, "sim", scheduler=name)
        rows[name] = evaluate(scheduler_policy(env), env, seeds)
    env = FeatherEnv(scenario, "sim", extended_obs=True)
    for kv, missing in itertools.product(KV_LEVELS, MISSING_LEVELS):
        rows[f"kv>{kv:g},miss>{missing}"] = evaluate(KVGatedRule(kv, missing), env, seeds)
    fcfs = rows["fcfs"]["output_throughput"]
    best = max(rows["lpm"]["output_throughput"], rows["dfs-weight"]["output_throughput"])
    for r in rows.values():
        r["vs_fcfs"] = r["output_throughput"] / fcfs
        r["vs_best_radix"] = r["output_throughput"] / best
    rules = {n: r for n, r in rows.items() if n.startswith("kv>")}
    top = max(rules, key=lambda n: rules[n]["output_throughput"])
    return {"seeds": seeds, "rows": rows, "best_rule": top,
            "best_rule_vs_best_radix": rows[top]["vs_best_radix"],
            "heuristic_vs_best_radix": rows["feather-heuristic"]["vs_best_radix"]}


def render(res: dict[str, Any], top: int = 6) -> str:
    """The benchmark's figures in markdown: per scenario, the baselines and the ``top`` rules by output
    throughput."""
    out = [f"`{res.get('command', 'python -m benchmarks.admission_rules')}` ({measured(res)}; the simulator, "
           f"{res['episodes']} held-out episodes per scenario; rule `kv>k,miss>m`: STOP when the KV cache is "
           "more than k full and the candidate misses more than m cached chunks; `kv>2` never stops):"]
    for scenario, r in res["scenarios"].items():
        rules = sorted((n for n in r["rows"] if n.startswith("kv>")),
                       key=lambda n: -r["rows"][n]["output_throughput"])
        shown = sorted([n for n in r["rows"] if not n.startswith("kv>")] + rules[:top],
                       key=lambda n: -r["rows"][n]["output_throughput"])
        rows = [[f"`{n}`", f"{x['output_throughput']:.1f}", f"{x['vs_fcfs']:.2f}x",
                 f"{x['vs_best_radix']:.3f}x", f"{x['mean_e2el_s']:.2f}", f"{x['prefix_hit_rate']:.0%}"]
                for n, x in ((n, r["rows"][n]) for n in shown)]
        out += ["", f"**{scenario}** (the baselines and the best {min(top, len(rules))} of {len(rules)} "
                f"rules; best rule `{r['best_rule']}`: {r['best_rule_vs_best_radix']:.3f}x the better of "
                f"lpm/dfs-weight, feather-heuristic {r['heuristic_vs_best_radix']:.3f}x):", "",
                format_table(["rule", "output tok/s", "vs fcfs", "vs better of lpm/dfs-weight", "mean E2E s",
                              "prefix hit"], rows)]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--episodes", type=int, default=8)
    p.add_argument("--json", default="results/admission_rules.json")
    args = p.parse_args(argv)
    out: dict[str, Any] = {}
    for scenario in [s for s in args.scenarios.split(",") if s]:
        out[scenario] = run(scenario, args.episodes)
    payload = {"benchmark": "admission_rules", "episodes": args.episodes, "scenarios": out,
               "machine": machine_info(),
               "command": "python -m benchmarks.admission_rules --json " + args.json}
    print(render(payload))
    write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
