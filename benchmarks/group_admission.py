"""Which lever sets throughput under KV pressure with arrivals over time? Group admission, on the simulator.

    python -m benchmarks.group_admission [--episodes 8] [--json results/group_admission.json]

The request decision (the paper's ADD/STOP over the CHT's next candidate) leaves every scheduler
far from the bound when requests arrive over time. This benchmark serves the same held-out
episodes (seeds ``HELD_OUT_SEED + i``, identical for every row) of ``leval-kv-pressure-poisson``
with:

- the baselines ``fcfs``, ``lpm``, ``dfs-weight`` and ``feather-heuristic``;
- the group decision (:mod:`scheduler_runtime.groups`) answered by ``always-add`` (cached-first
  order alone: every new group opens), ``group-hold`` (cached-first + hold: a new group whose
  prefix is not cached waits while requests of the groups in flight wait) and ``group-cap-K``
  (the same, at most K groups in flight), K = 1..8;
- ``group-cap-K`` for K = 3, 5, 8 without the KV-pressure guard (``kv_min`` 0: the cap holds at
  any KV usage), on every scenario, the figures behind the guard's default;
- a reference that is not a lever: ``feather-heuristic`` with twice the KV cache.

Each row: output tok/s over all episodes, its ratio to ``feather-heuristic``, on how many episodes
it beat ``feather-heuristic`` and its smallest per-episode ratio, the prefix hit rate, mean and
P99 E2E latency, preemptions per episode. The same rows on the burst scenario
(``leval-kv-pressure``), on ``leval-high-load``, on ``leval-summaries`` (a cache that holds every
prompt: nothing to evict) and on ``sharegpt`` (where nothing shares: the group decision is never
asked, so no cap can throttle it) show where the lever matters.

Then the trace-arrival scenario (``leval-trace``: L-Eval documents arriving with the Splitwise
conversation trace's gaps): every constant K per episode, the best constant K over all episodes
and the best K per episode in hindsight, the reference a state-dependent policy should approach.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from typing import Any

from agents.base import HELD_OUT_SEED
from benchmarks import measured
from feather_env.env import FeatherEnv, play_episode
from feather_env.reporting import format_table, machine_info, write_json
from scheduler_runtime.decision import AlwaysAdd
from scheduler_runtime.rules import GroupCapRule

__all__ = ["episodes_row", "hindsight", "main", "render", "run"]

STUDY_SCENARIO = "leval-kv-pressure-poisson"
OTHER_SCENARIOS = ("leval-kv-pressure", "leval-high-load", "leval-summaries", "sharegpt")
TRACE_SCENARIO = "leval-trace"
CAPS = (1, 2, 3, 4, 5, 6, 8)
BASELINES = ("fcfs", "lpm", "dfs-weight", "feather-heuristic")
#: The variants of the other scenarios (the study's scenario serves them all).
SHORT = ("fcfs", "lpm", "feather-heuristic", "group-hold", "group-cap-2", "group-cap-3", "group-cap-4",
         "group-cap-8")
#: Caps also served without the KV-pressure guard (``kv_min`` 0: the cap holds at any KV usage),
#: the figures behind the guard's default (``GroupCapRule.kv_min``).
UNGUARDED_CAPS = (3, 5, 8)


def _episodes(env: FeatherEnv, seeds: Sequence[int], policy: Any = None) -> list[dict[str, Any]]:
    return [play_episode(env, policy, episode_seed=s) for s in seeds]


def episodes_row(eps: Sequence[dict[str, Any]], ref: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The figures of one variant's episodes ``eps`` against a reference's on the same seeds ``ref``:
    output tok/s over all of them, per-episode ratios, wins, latency, hit rate, preemptions."""
    tokens = sum(e["total_output_tokens"] for e in eps)
    duration = sum(e["duration"] for e in eps)
    prompt = sum(e["total_input_tokens"] for e in eps)
    requests = sum(e["completed"] for e in eps)
    ratios = [e["output_throughput"] / r["output_throughput"] for e, r in zip(eps, ref, strict=True)]
    return {
        "output_throughput": tokens / duration,
        "episode_throughput": [e["output_throughput"] for e in eps],
        "episode_ratios": ratios,
        "wins": sum(x > 1.0 + 1e-9 for x in ratios),
        "min_ratio": min(ratios),
        "prefix_hit_rate": sum(e["prefix_hit_rate"] * e["total_input_tokens"] for e in eps) / prompt,
        "mean_e2el_s": sum(e["mean_e2el_ms"] * e["completed"] for e in eps) / 1000 / requests,
        "p99_e2el_s": statistics.mean(e["p99_e2el_ms"] for e in eps) / 1000,
        "preemptions": statistics.mean(e["preemptions"] for e in eps),
        "decisions": statistics.mean(e["decisions"] for e in eps),
    }


def compare(scenario: str, names: Sequence[str], seeds: Sequence[int],
            extra: dict[str, tuple[FeatherEnv, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """Rows of ``names`` (scheduler names served with their own rule) and ``extra`` (label ->
    (env, policy)) on ``seeds``, each against feather-heuristic's episodes."""
    runs = {name: _episodes(FeatherEnv(scenario, "sim", scheduler=name), seeds) for name in names}
    for label, (env, policy) in (extra or {}).items():
        runs[label] = _episodes(env, seeds, policy)
    ref = runs["feather-heuristic"]
    rows = {label: episodes_row(eps, ref) for label, eps in runs.items()}
    base = rows["feather-heuristic"]["output_throughput"]
    for r in rows.values():
        r["vs_heuristic"] = r["output_throughput"] / base
    return rows


def hindsight(scenario: str, seeds: Sequence[int], caps: Sequence[int] = CAPS, profile: str | None = None,
              overrides: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Every constant K on every episode; the best constant K and the best K per episode (on the
    simulator with ``profile``, the scenario's sections replaced by ``overrides``)."""
    per_k = {}
    for k in caps:
        env = FeatherEnv(scenario, "sim", scheduler=f"group-cap-{k}", profile=profile,
                         scenario_overrides=overrides)
        per_k[k] = [e["output_throughput"] for e in _episodes(env, seeds)]
    mean = {k: statistics.mean(v) for k, v in per_k.items()}
    best_k = max(caps, key=lambda k: mean[k])
    per_episode = [max(caps, key=lambda k, i=i: per_k[k][i]) for i in range(len(seeds))]
    hind = [per_k[k][i] for i, k in enumerate(per_episode)]
    return {"seeds": list(seeds), "per_k": {str(k): v for k, v in per_k.items()}, "best_constant_k": best_k,
            "best_constant_mean": mean[best_k], "hindsight_k": per_episode,
            "hindsight_mean": statistics.mean(hind),
            "hindsight_vs_best_constant": statistics.mean(hind) / mean[best_k]}


def unguarded(scenario: str) -> dict[str, tuple[FeatherEnv, Any]]:
    """The rows of :data:`UNGUARDED_CAPS` with ``kv_min`` 0, for :func:`compare`'s ``extra``."""
    env = FeatherEnv(scenario, "sim", decision="group")
    return {f"group-cap-{k}, kv_min 0": (env, GroupCapRule(cap=k, kv_min=0.0)) for k in UNGUARDED_CAPS}


def run(episodes: int = 8, trace_episodes: int = 16) -> dict[str, Any]:
    """Every table of the module docstring, as JSON."""
    seeds = [HELD_OUT_SEED + i for i in range(episodes)]
    names = (*BASELINES, "group-hold", *(f"group-cap-{k}" for k in CAPS))
    extra = {
        "always-add (group decision)": (FeatherEnv(STUDY_SCENARIO, "sim", decision="group"), AlwaysAdd()),
        "feather-heuristic, 2x KV cache": (
            FeatherEnv(STUDY_SCENARIO, "sim", scenario_overrides={"engine": {"kv_cache_gib": 0.5}}), None),
    }
    study = compare(STUDY_SCENARIO, names, seeds, {**extra, **unguarded(STUDY_SCENARIO)})
    others = {sc: compare(sc, SHORT, seeds, unguarded(sc)) for sc in OTHER_SCENARIOS}
    trace = hindsight(TRACE_SCENARIO, [HELD_OUT_SEED + i for i in range(trace_episodes)])
    return {"benchmark": "group_admission", "episodes": episodes, "seeds": seeds,
            "study": {"scenario": STUDY_SCENARIO, "rows": study}, "others": others,
            "trace": {"scenario": TRACE_SCENARIO, **trace}, "machine": machine_info()}


def _table(rows: dict[str, dict[str, Any]], episodes: int) -> str:
    out = [[label, f"{r['output_throughput']:.1f}", f"{r['vs_heuristic']:.3f}", f"{r['wins']}/{episodes}",
            f"{r['min_ratio']:.3f}", f"{r['prefix_hit_rate']:.0%}", f"{r['mean_e2el_s']:.2f}",
            f"{r['p99_e2el_s']:.1f}", f"{r['preemptions']:.1f}"] for label, r in rows.items()]
    return format_table(["variant", "output tok/s", "vs feather-heuristic", "wins", "min ratio", "prefix hit",
                         "mean E2E s", "P99 E2E s", "preemptions/episode"], out)


def render(payload: dict[str, Any]) -> str:
    """The benchmark's tables in markdown."""
    n = payload["episodes"]
    parts = [f"`{payload.get('command', 'python -m benchmarks.group_admission')}` ({measured(payload)}):\n",
             f"**{payload['study']['scenario']}** ({n} held-out episodes, simulator)\n",
             _table(payload["study"]["rows"], n)]
    for scenario, rows in payload["others"].items():
        parts += [f"\n**{scenario}**\n", _table(rows, n)]
    t = payload["trace"]
    ks = list(t["per_k"])
    means = [f"{statistics.mean(t['per_k'][k]):.1f}" for k in ks]
    parts += [f"\n**{t['scenario']}**: constant K over {len(t['seeds'])} held-out episodes (output tok/s)\n",
              format_table(["K", *ks], [["output tok/s", *means]]),
              f"\nBest constant K = {t['best_constant_k']} ({t['best_constant_mean']:.1f} tok/s); "
              f"the best K per episode in hindsight {t['hindsight_k']} reaches "
              f"{t['hindsight_mean']:.1f} tok/s, "
              f"{t['hindsight_vs_best_constant']:.3f}x the best constant."]
    return "\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=8)
    p.add_argument("--trace-episodes", type=int, default=16)
    p.add_argument("--json", default="results/group_admission.json")
    args = p.parse_args(argv)
    payload = run(args.episodes, args.trace_episodes)
    payload["command"] = f"python -m benchmarks.group_admission --episodes {args.episodes} --json {args.json}"
    print(render(payload))
    write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
