"""Scheduler overhead inside the real engine: the Feather scheduler's own time vs engine step time.

Usage::

    python -m benchmarks.scheduler_overhead --json results/scheduler_overhead.json [--quick]
                                           [--scheduler NAME] [--set KEY=VALUE ...]

For each queue length W (100, 1,000, 10,000), one in-process vLLM engine with
``FeatherScheduler`` (``feather-heuristic+svf`` unless ``--scheduler``) receives W requests at
once and serves them for ``--steps`` engine steps after ``--warmup`` steps; the queue stays
near W because only a few requests finish in that window. Requests: prompts of ``--prompt``
tokens in groups of 16 that share the first 90% (a document) and differ in the rest (a
question), groups interleaved in arrival order; outputs of 8-64 tokens (uniform, seeded),
forced with ``ignore_eos``. Token ids are below 256, which Python interns: vLLM keeps each
prompt as a list of ints, and 10,000 long prompts of distinct int objects would need gigabytes.

Per queue length:

* ``overhead_fraction`` = the scheduler's own time in the window / the engine's step time in
  the window. Its own time is the decision loop (``BatchingCore.plan``: CHT candidates,
  policy, KV budget) plus the subclass's hooks (moving released requests into vLLM's queue,
  exporting metrics, CHT bookkeeping when requests are freed); step time is the wall time
  of ``LLMEngine.step()``, which includes all of it.
* ``decision_us_per_call``: that own time per ``schedule()`` call; ``decisions``: policy
  decisions in the window; ``step_ms``: mean engine step.
* ``arrival_us``: per new request, length prediction + CHT insert (once per request, when it
  arrives, outside ``schedule()``), of which ``prediction_us`` predicting.
  ``prediction_fraction`` puts that on the same footing as a steady state: the requests the
  scheduler released in the window times the prediction cost, over the window's step time.

What a scheduler should stay under: ``overhead_fraction <= 0.01`` at 1,000 waiting, prediction
<= 0.1% of step time. Runs vary with the load of a shared machine: compare within one run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np

from benchmarks import measured
from feather_env.reporting import format_table, machine_info, write_json

GROUP = 16
SHARED = 0.9


def make_prompts(num: int, prompt_len: int, seed: int) -> list[list[int]]:
    """``num`` prompts in interleaved groups of 16 sharing their first 90% (ids in [3, 256))."""
    rng = np.random.default_rng(seed)
    shared = int(prompt_len * SHARED)
    groups = -(-num // GROUP)
    docs = rng.integers(3, 256, (groups, shared))
    prompts = []
    for i in range(num):
        g = i % groups
        prompts.append(docs[g].tolist() + rng.integers(3, 256, prompt_len - shared).tolist())
    return prompts


def measure(llm: Any, waiting: int, args: argparse.Namespace) -> dict[str, Any]:
    from feather_env.engines.vllm_engine import engine_core_of, forced_length_params, tokens_prompt

    engine = llm.llm_engine
    sched = engine_core_of(llm).scheduler
    # its own requests: their source hint is trusted, as in evaluate.py
    sched.feather_configure({"name": args.scheduler, "trust_client_hints": True, **args.overrides})
    runtime = sched.feather
    rng = np.random.default_rng(waiting)
    prompts = make_prompts(waiting, args.prompt, seed=waiting)
    outputs = rng.integers(8, 65, waiting)
    ids = [f"w{waiting}-{i}" for i in range(waiting)]
    start = time.perf_counter()
    for rid, prompt, out in zip(ids, prompts, outputs.tolist(), strict=True):
        params = forced_length_params(out, extra_args={"feather_source": "leval/quality"})
        engine.add_request(rid, tokens_prompt(prompt), params)
    add_s = time.perf_counter() - start
    del prompts
    arrivals = runtime.stats.arrival_seconds
    predictions = runtime.stats.prediction_seconds / max(runtime.stats.predictions, 1)

    for _ in range(args.warmup):
        engine.step()
    before = runtime.snapshot()
    step_times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - t0)
    after = runtime.snapshot()

    own = (after["decision_seconds"] - before["decision_seconds"]) + (
        after["hook_seconds"] - before["hook_seconds"])
    calls = after["plan_calls"] - before["plan_calls"]
    released = sum(after["released"].values()) - sum(before["released"].values())
    window = float(sum(step_times))
    row = {
        "waiting": waiting,
        "held_at_end": after["held"],
        "batch_at_end": after["batch"],
        "steps": args.steps,
        "step_ms": 1e3 * window / args.steps,
        "scheduler_ms": 1e3 * own,
        "overhead_fraction": own / window,
        "decision_us_per_call": 1e6 * own / max(calls, 1),
        "plan_us_per_call": 1e6 * (after["decision_seconds"] - before["decision_seconds"]) / max(calls, 1),
        "hook_us_per_call": 1e6 * (after["hook_seconds"] - before["hook_seconds"]) / max(calls, 1),
        "decisions": after["decisions"] - before["decisions"],
        "released": released,
        "arrival_us": 1e6 * arrivals / waiting,
        "prediction_us": 1e6 * predictions,
        "prediction_fraction": released * predictions / window,
        "engine_add_request_us": 1e6 * add_s / waiting,
        "retained_blocks": after["retained_blocks"] - before["retained_blocks"],
    }
    # leave the engine empty for the next queue length
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    assert len(runtime.core) == 0 and runtime.core.cht.num_keys == 0
    return row


def render(res: dict[str, Any]) -> str:
    """The benchmark's figures in markdown: one row per queue length."""
    retained = any("retained_blocks" in r for r in res["results"])
    rows = [[r["waiting"], r["step_ms"], r["decision_us_per_call"], f"{r['overhead_fraction']:.4f}",
             r.get("decisions", "-"), r.get("arrival_us", "-"), r.get("prediction_us", "-"),
             f"{r['prediction_fraction']:.5f}", *([r.get("retained_blocks", "-")] if retained else [])]
            for r in res["results"]]
    settings = "".join(f", `{k}: {json.dumps(v)}`" for k, v in (res.get("overrides") or {}).items())
    return "\n".join([f"Scheduler `{res.get('scheduler')}`{settings} ({measured(res)}):", "",
                      format_table(["waiting", "engine step (ms)", "scheduler us / schedule()",
                                    "overhead fraction", "decisions", "arrival us / request",
                                    "prediction us / request", "prediction fraction",
                                    *(["retained blocks"] if retained else [])], rows)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None, help="write results here")
    parser.add_argument("--waiting", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--scheduler", default="feather-heuristic+svf")
    parser.add_argument("--prompt", type=int, default=2048, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="100 and 1000 waiting, 15 steps")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a scheduler configuration field (YAML value), e.g. retain_held_prefixes=true")
    args = parser.parse_args(argv)
    import yaml

    args.overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--set takes KEY=VALUE, got {item!r}")
        args.overrides[key] = yaml.safe_load(value)
    if args.quick:
        args.waiting, args.steps, args.warmup = [100, 1000], 15, 5

    from feather_env.engines.vllm_engine import EngineConfig, build_llm, engine_core_of
    from scheduler_runtime.schedulers import engine_overrides

    engine_config = EngineConfig(kv_cache_gib=2.0, max_num_seqs=args.max_num_seqs, max_model_len=8192,
                                 max_num_batched_tokens=8192)
    llm = build_llm(engine_config, **engine_overrides(args.scheduler))
    rows = []
    try:
        for waiting in args.waiting:
            row = measure(llm, waiting, args)
            rows.append(row)
            print(f"W={waiting}: overhead {row['overhead_fraction']:.4f} of step time", file=sys.stderr)
    finally:
        engine_core_of(llm).shutdown()

    payload = {
        "benchmark": "scheduler_overhead",
        "scheduler": args.scheduler,
        "overrides": args.overrides,
        "engine": engine_config.to_dict(),
        "prompt_tokens": args.prompt,
        "machine": machine_info(),
        "results": rows,
    }
    print(render(payload))
    write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
