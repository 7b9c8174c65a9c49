"""``evaluate.py --endpoint`` against ``feather-serve`` vs the in-process evaluation of the same scheduler.

One small scenario episode (:data:`SCENARIO` with :data:`OVERRIDES`: a few L-Eval documents, every
question generating exactly :data:`OUTPUT_TOKENS` tokens, burst arrivals) is served, per scheduler,
by

1. the in-process evaluation (:func:`feather_env.evaluation.inprocess.serve_one` on one
   :class:`~feather_env.engines.vllm_backend.VLLMBackend`: engine clock, the scheduler deciding
   in ``schedule()``);
2. ``feather-serve --scheduler NAME`` on the same engine
   (:class:`~feather_env.evaluation.server.LocalServer`, sized by
   :func:`~feather_env.evaluation.server.server_args`), driven over HTTP by the endpoint client
   (:func:`~feather_env.evaluation.endpoint.evaluate_endpoint`: streamed, client wall clock),

:data:`REPEATS` times each, the two sides alternating. Both engines compute on core 1 (the
in-process engine and this process's thread while it steps it; the server's engine threads); the
HTTP client, and the server's API process and other threads, run on core 0. Each run starts with
a cold prefix cache (in-process: the backend clears it; served: ``POST /reset_prefix_cache``), and
each in-process run waits until nothing else runs on core 1 (vLLM's server worker polls for work
there for a second after a run). The figure is each side's median ``output_throughput`` (vLLM's:
output tokens / duration) and their ratio; the target is agreement within :data:`TARGET` (15%).

    python -m benchmarks.endpoint_agreement --json results/endpoint_agreement.json

Run it under ``flock /tmp/feather-engine.lock`` on the shared machine (about 3 minutes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import measured
from feather_env.engines.vllm_engine import send_vllm_logs_to, use_in_process_engine  # noqa: E402

use_in_process_engine()

from feather_env.reporting import format_table, machine_info, write_json  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SCENARIO = "leval-kv-pressure"
OUTPUT_TOKENS = 64
OVERRIDES = {"workload": {"max_prompt_tokens": 4096, "max_output_tokens": OUTPUT_TOKENS, "output": "max"},
             "episode": {"groups": 4, "max_per_group": 8, "arrival": "burst"}}
SCHEDULERS = ("feather-heuristic", "fcfs")
REPEATS = 3
TARGET = 0.15
ENGINE_CORE, CLIENT_CORE = "1", "0"
COMMAND = "python -m benchmarks.endpoint_agreement --json results/endpoint_agreement.json"


def _pin(core: str) -> None:
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {int(core)})


def measure(seed: int, repeats: int, out_dir: Path, progress: bool) -> dict[str, Any]:
    from dataclasses import replace

    from feather_env.engines.vllm_backend import VLLMBackend
    from feather_env.evaluation.endpoint import EndpointConfig, evaluate_endpoint
    from feather_env.evaluation.inprocess import InProcessConfig, scheduler_overrides, serve_one
    from feather_env.evaluation.report import summarize
    from feather_env.evaluation.server import LocalServer
    from feather_env.hostload import wait_for_quiet
    from feather_env.scenarios import load_scenario
    from scheduler_runtime.schedulers import SchedulerConfig

    scenario = load_scenario(SCENARIO, OVERRIDES)
    workload = scenario.episode_workload(seed)
    engine = replace(scenario.engine_config(), cpu_cores=ENGINE_CORE)
    knobs = {"chunk_size": scenario.scheduler.chunk_size, "max_wait": scenario.scheduler.max_wait}
    print(f"{SCENARIO} episode {seed}: {len(workload)} requests of {workload.num_groups} documents, "
          f"{OUTPUT_TOKENS} output tokens each; engine KV {engine.kv_cache_gib:g} GiB on core {ENGINE_CORE}",
          flush=True)
    send_vllm_logs_to(out_dir / "vllm.log")
    backend = VLLMBackend(engine)  # pins this thread to the engine's core while it steps the engine
    results: dict[str, Any] = {}
    try:
        config = InProcessConfig(schedulers=SCHEDULERS, engine=engine, **knobs)
        backend.serve(workload, SchedulerConfig.for_name("fcfs"))  # warm-up
        for name in SCHEDULERS:
            sched_file = None
            if name != "fcfs":  # what the in-process run configures (inprocess.scheduler_overrides)
                sched_file = out_dir / f"{name}.yaml"
                overrides = scheduler_overrides(name, knobs["chunk_size"], knobs["max_wait"])
                sched_file.write_text("".join(f"{k}: {str(v).lower() if isinstance(v, bool) else v}\n"
                                              for k, v in overrides.items()))
            rows: dict[str, list[dict[str, Any]]] = {"inprocess": [], "endpoint": []}
            with LocalServer(name, engine, log_path=out_dir / f"server-{name}.log", other_cores=CLIENT_CORE,
                             scheduler_config=sched_file) as server:
                client = EndpointConfig(server.url, label=f"{name}@feather-serve", reset_prefix_cache=True)
                _pin(CLIENT_CORE)
                evaluate_endpoint(workload, client, progress=False)  # the server's warm-up
                for _ in range(repeats):
                    _pin(ENGINE_CORE)
                    # the server's worker polls for work on the engine's core for a second after a run
                    wait_for_quiet(0.05, timeout_s=30.0, probe_s=0.5, cores=(int(ENGINE_CORE),))
                    run = serve_one(backend, name, workload, config, progress)
                    rows["inprocess"].append(summarize(run))
                    _pin(CLIENT_CORE)
                    # (no foreign-CPU figure here: the server is another process, foreign by definition)
                    rows["endpoint"].append(summarize(evaluate_endpoint(workload, client, progress=progress)))
            _pin(ENGINE_CORE)
            results[name] = _summary(rows)
    finally:
        backend.close()
    return {"workload": {**workload.describe(), "fingerprint": workload.fingerprint()},
            "engine": engine.to_dict(), "results": results}


def _summary(rows: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    keys = ("output_throughput", "duration", "mean_ttft_ms", "mean_tpot_ms", "mean_e2el_ms",
            "prefix_hit_rate", "foreign_cpu", "completed", "submitted")
    out: dict[str, Any] = {side: {k: [m.get(k) for m in ms] for k in keys} for side, ms in rows.items()}
    for side in rows:
        out[side]["median_output_throughput"] = statistics.median(out[side]["output_throughput"])
    a, b = out["inprocess"]["median_output_throughput"], out["endpoint"]["median_output_throughput"]
    out["ratio"] = b / a if a else None
    out["met"] = out["ratio"] is not None and abs(out["ratio"] - 1) <= TARGET
    out["all_completed"] = all(m["completed"] == m["submitted"] for ms in rows.values() for m in ms)
    return out


def render(res: dict[str, Any]) -> str:
    """The benchmark's figures in markdown: each side's median output throughput and their ratio."""
    w = res["workload"]
    rows, detail = [], []
    for name, r in res["results"].items():
        a, b = r["inprocess"], r["endpoint"]
        rows.append([f"`{name}`", f"{a['median_output_throughput']:.1f}",
                     f"{b['median_output_throughput']:.1f}", f"{r['ratio']:.3f}"])
        detail.append(f"`{name}` in-process " + ", ".join(f"{v:.1f}" for v in a["output_throughput"])
                      + "; endpoint " + ", ".join(f"{v:.1f}" for v in b["output_throughput"]))
    done = "yes" if all(r["all_completed"] for r in res["results"].values()) else "**no**"
    foreign = max(max(r["inprocess"]["foreign_cpu"]) for r in res["results"].values())
    return "\n".join([
        f"Scenario `{res['scenario']}` episode {res['seed']}, {w['requests']} requests of {w['groups']} "
        f"L-Eval documents (prompts mean {w['prompt_tokens_mean']:.0f} tokens), each generating exactly "
        f"{w['output_tokens_max']} tokens, burst; KV cache {res['engine']['kv_cache_gib']:g} GiB "
        f"({measured(res)}; `{res['command']}`):", "",
        format_table(["scheduler", "in-process output tok/s", "feather-serve output tok/s (endpoint)",
                      "endpoint / in-process"], rows), "",
        f"Every run: {res['repeats']} per side (output tok/s: {'; '.join(detail)}); every request completed "
        f"with its tokens: {done}; other processes used at most {foreign:.0%} of the engine's core during "
        f"the in-process runs."])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=str(REPO / "results" / "endpoint_agreement.json"))
    p.add_argument("--out", default=None, help="logs and scheduler files (default: runs/endpoint_agreement)")
    p.add_argument("--seed", type=int, default=0, help="episode seed")
    p.add_argument("--repeats", type=int, default=REPEATS)
    p.add_argument("--progress", action="store_true")
    args = p.parse_args(argv)
    out_dir = Path(args.out or REPO / "runs" / "endpoint_agreement")
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    res = measure(args.seed, args.repeats, out_dir, args.progress)
    payload = {"benchmark": "endpoint_agreement", "scenario": SCENARIO, "overrides": OVERRIDES,
               "seed": args.seed, "repeats": args.repeats, "schedulers": list(SCHEDULERS),
               "target": TARGET, "cores": {"engine": ENGINE_CORE, "client": CLIENT_CORE},
               "command": COMMAND, **res, "wall_s": time.perf_counter() - t0, "machine": machine_info()}
    print(render(payload))
    write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
