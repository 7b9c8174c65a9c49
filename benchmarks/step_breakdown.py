"""Where an engine step's time goes, per scheduler: the forward pass against the schedule.

Usage::

    python -m benchmarks.step_breakdown --scenario leval-high-load \\
        --schedulers feather-heuristic,feather:policies/leval-high-load.feather [--repeats 2] [--json PATH]

Serves the scenario's episode 0 on one in-process vLLM engine with each scheduler in turn,
alternating, ``--repeats`` times, and times vLLM's own calls inside every engine step: the
scheduler's ``schedule()`` (Feather's planning included), the model executor's
``execute_model`` and ``sample_tokens`` (the forward pass and sampling) and the scheduler's
``update_from_output``. When two schedulers differ in output throughput, this says whether the
engine computed more slowly (forward time at the same batch) or the scheduling cost the time.
A diagnostic for one pair of runs, not a comparison of schedulers: ``benchmarks/evaluation.py``
is that.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from feather_env.reporting import format_table, machine_info, write_json

#: The timed calls: (label, owner, method); owner is "scheduler" or "executor".
TIMED = (
    ("schedule_s", "scheduler", "schedule"),
    ("forward_s", "executor", "execute_model"),
    ("sample_s", "executor", "sample_tokens"),
    ("update_s", "scheduler", "update_from_output"),
)


def _timed(method: Callable[..., Any], seconds: dict[str, float], label: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            seconds[label] += time.perf_counter() - start
    return call


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenario", default="leval-high-load")
    p.add_argument("--schedulers", default="feather-heuristic,feather:policies/leval-high-load.feather",
                   help="comma-separated scheduler names")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    from feather_env.engines.vllm_backend import VLLMBackend
    from feather_env.engines.vllm_engine import engine_core_of
    from feather_env.evaluation.inprocess import InProcessConfig, serve_one, validate_schedulers, warm_up
    from feather_env.scenarios import load_scenario
    from feather_env.serving_metrics import serving_metrics

    scenario = load_scenario(args.scenario)
    workload = scenario.episode_workload(0)
    engine = scenario.engine_config()
    names = validate_schedulers(args.schedulers.split(","), scenario.scheduler.chunk_size,
                                scenario.scheduler.max_wait)
    config = InProcessConfig(schedulers=tuple(names), engine=engine, chunk_size=scenario.scheduler.chunk_size,
                             max_wait=scenario.scheduler.max_wait, repeats=1)
    backend = VLLMBackend(engine)
    seconds: dict[str, float] = defaultdict(float)
    owners = {"scheduler": backend.scheduler, "executor": engine_core_of(backend.llm).model_executor}
    for label, owner, method in TIMED:
        target = owners[owner]
        if hasattr(target, method):
            setattr(target, method, _timed(getattr(target, method), seconds, label))
    runs: list[dict[str, Any]] = []
    try:
        warm_up(backend, engine.max_model_len)
        for repeat in range(args.repeats):
            for name in names:
                seconds.clear()
                start = time.perf_counter()
                run = serve_one(backend, name, workload, config, False)
                metrics = serving_metrics(run.timelines)
                runs.append({"scheduler": name, "repeat": repeat, "wall_s": time.perf_counter() - start,
                             "output_throughput": metrics["output_throughput"],
                             "steps": len(run.steps), **{label: seconds[label] for label, _, _ in TIMED}})
    finally:
        backend.close()
    headers = ["scheduler", "run", "output tok/s", "steps", "forward s", "sample s", "schedule s", "update s"]
    rows = [[r["scheduler"], r["repeat"], r["output_throughput"], r["steps"], r["forward_s"], r["sample_s"],
             r["schedule_s"], r["update_s"]] for r in runs]
    print(format_table(headers, rows))
    payload = {"benchmark": "step_breakdown", "scenario": args.scenario, "episode_seed": 0, "runs": runs,
               "engine": engine.to_dict(), "machine": machine_info()}
    write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
