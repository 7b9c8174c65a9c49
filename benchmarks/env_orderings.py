"""Does the environment rank the orderings as the real engine does? The reference orderings served
in FeatherEnv, on the simulator and on the real engine, on the same episodes.

    python -m benchmarks.env_orderings --json results/env_orderings.json [--sim-episodes N]
                                        [--real-episodes N] [--groups N]

Each reference ordering answers its own decisions (always-add for the baselines, the authors'
heuristic for Feather: :func:`feather_env.env.play_episode`) on episodes ``0..N-1`` of the
scenario (default ``leval-kv-pressure``). Reported per ordering and backend: end-to-end output
throughput over the episodes (output tokens / summed durations), its ratio to fcfs, the prefix
hit rate and the mean E2E latency. Real-engine episodes alternate the orderings (episode 0 of every
ordering, then episode 1, ...), the engine pinned to one core, and the CPU time other processes
used on that core is recorded per episode. The JSON also records whether feather-heuristic reached
:data:`TARGET` (1.8x fcfs) on each backend.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from typing import Any

from benchmarks import measured
from feather_env.engines.vllm_engine import use_in_process_engine

use_in_process_engine()

from feather_env.env import FeatherEnv, play_episode  # noqa: E402
from feather_env.hostload import ForeignLoad, pinned_cores  # noqa: E402
from feather_env.reporting import format_table, machine_info, write_json  # noqa: E402
from feather_env.scenarios import load_scenario  # noqa: E402

ORDERINGS = ("fcfs", "lpm", "dfs-weight", "feather-heuristic")
TARGET = ("feather-heuristic", 1.8)


def _aggregate(episodes: Sequence[dict[str, Any]]) -> dict[str, Any]:
    tokens = sum(e["total_output_tokens"] for e in episodes)
    duration = sum(e["duration"] for e in episodes)
    requests = sum(e["completed"] for e in episodes)
    return {"output_throughput": tokens / duration, "duration_s": duration,
            "prefix_hit_rate": statistics.mean(e["prefix_hit_rate"] for e in episodes),
            "mean_e2el_s": sum(e["mean_e2el_ms"] * e["completed"] for e in episodes) / 1000 / requests,
            "episodes": [{k: e.get(k) for k in ("episode_seed", "output_throughput", "duration",
                                                "prefix_hit_rate", "mean_e2el_ms", "preemptions",
                                                "engine_steps", "completed", "foreign_cpu")}
                         for e in episodes]}


def run(scenario: str, orderings: Sequence[str], sim_episodes: int, real_episodes: int,
        groups: int | None = None) -> dict[str, Any]:
    """Every ordering on the episodes of ``scenario`` (``groups``: episodes of that many prefix
    groups instead of the scenario's), on the simulator and the real engine."""
    sc = load_scenario(scenario)
    if groups is not None:
        sc = load_scenario(sc, {"episode": {"groups": groups}})
    results: dict[str, dict[str, Any]] = {"sim": {}, "vllm": {}}
    for name in orderings:
        env = FeatherEnv(sc, "sim", scheduler=name)
        results["sim"][name] = _aggregate([play_episode(env, episode_seed=s) for s in range(sim_episodes)])
    if real_episodes:
        from feather_env.engines.vllm_backend import VLLMBackend

        backend = VLLMBackend(sc.engine_config())
        cores = pinned_cores(sc.engine_config().cpu_cores)
        envs = {name: FeatherEnv(sc, backend, scheduler=name) for name in orderings}
        play_episode(envs[orderings[0]], episode_seed=10_000)  # warm-up: first steps are slow
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in orderings}
        try:
            for seed in range(real_episodes):
                for name in orderings:
                    with ForeignLoad(cores) as load:
                        ep = play_episode(envs[name], episode_seed=seed)
                    ep["foreign_cpu"] = load.fraction
                    runs[name].append(ep)
                    print(f"  real {name} episode {seed}: {ep['output_throughput']:.1f} tok/s, "
                          f"{ep['duration']:.1f} s, hit {ep['prefix_hit_rate']:.0%}, "
                          f"foreign CPU {load.fraction:.0%}", flush=True)
        finally:
            backend.close()
        results["vllm"] = {name: _aggregate(eps) for name, eps in runs.items()}
    for by_name in results.values():
        if "fcfs" in by_name:
            base = by_name["fcfs"]["output_throughput"]
            for res in by_name.values():
                res["vs_fcfs"] = res["output_throughput"] / base
    return results


def render(res: dict[str, Any]) -> str:
    """The benchmark's figures in markdown: each ordering on the simulator and on the real engine."""
    rows = []
    for name in res["results"]["sim"]:
        row: list[Any] = [f"`{name}`"]
        for backend in ("sim", "vllm"):
            r = res["results"][backend].get(name)
            row += ([r["output_throughput"], f"{r['vs_fcfs']:.2f}x", f"{r['prefix_hit_rate']:.0%}",
                     r["mean_e2el_s"]] if r else ["-"] * 4)
        rows.append(row)
    return "\n".join([
        f"The reference orderings served in the environment on `{res['scenario']}` episodes "
        f"0-{res['sim_episodes'] - 1} (simulator) and 0-{res['real_episodes'] - 1} (real engine, "
        f"orderings alternating; {measured(res)}; `python -m benchmarks.env_orderings --json "
        f"results/env_orderings.json`). End-to-end output throughput over the episodes:", "",
        format_table(["ordering", "sim tok/s", "sim vs fcfs", "sim hit", "sim mean E2E s", "real tok/s",
                      "real vs fcfs", "real hit", "real mean E2E s"], rows)])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenario", default="leval-kv-pressure")
    p.add_argument("--orderings", default=",".join(ORDERINGS))
    p.add_argument("--sim-episodes", type=int, default=10)
    p.add_argument("--real-episodes", type=int, default=3)
    p.add_argument("--groups", type=int, default=None,
                   help="episodes of this many prefix groups (documents) instead of the scenario's")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    orderings = tuple(o.strip() for o in args.orderings.split(",") if o.strip())
    results = run(args.scenario, orderings, args.sim_episodes, args.real_episodes, args.groups)
    name, ratio = TARGET
    met = {b: results[b][name]["vs_fcfs"] >= ratio for b in ("sim", "vllm") if name in results[b]}
    out = {"benchmark": "env_orderings", "scenario": args.scenario, "machine": machine_info(),
           "sim_episodes": args.sim_episodes, "real_episodes": args.real_episodes, "groups": args.groups,
           "results": results,
           "target": {"ordering": name, "vs_fcfs": ratio, "met": met}}
    print(render(out))
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
