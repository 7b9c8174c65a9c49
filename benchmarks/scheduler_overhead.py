"""Scheduler overhead inside the real engine: Feather's added time per engine step vs vLLM's own schedule().

Usage::

    python -m benchmarks.scheduler_overhead --json results/scheduler_overhead.json [--quick]
        [--waiting W ...] [--scheduler NAME ...] [--set KEY=VALUE ...]
    python -m benchmarks.scheduler_overhead --waiting 1000 --json results/scheduler_overhead_policies.json \
        --scheduler feather:policies/general.feather feather:policies/leval-high-load.feather ...

For each scheduler (``feather-heuristic+svf`` unless ``--scheduler``; several are measured one
after the other on one engine) and each queue length W (64, 500, 1,000, 10,000), one in-process
vLLM engine with ``FeatherScheduler`` receives W requests at once and serves them for ``--steps``
engine steps after ``--warmup`` steps; the queue stays near W because only a few requests finish
in that window. Requests: prompts of ``--prompt`` tokens in groups of 16 that share the first 90%
(a document) and differ in the rest (a question), groups interleaved in arrival order; outputs of
8-64 tokens (uniform, seeded), forced with ``ignore_eos``. Token ids are below 256, which Python
interns: vLLM keeps each prompt as a list of ints, and 10,000 long prompts of distinct int
objects would need gigabytes. Run it on one pinned core (``taskset -c 1``): the figures are
wall times of a single thread.

Per scheduler and queue length, in microseconds per engine step (per ``schedule()`` call):

* ``added_us_per_step``: Feather's added time, everything the subclass does that vLLM's own
  scheduler does not: the decision loop (``BatchingCore.plan``) and the hooks around it (moving
  released requests into vLLM's queue, the metrics export, the CHT and budget bookkeeping when
  the engine frees a request); ``plan_us_per_step`` + ``hook_us_per_step``.
* ``vllm_schedule_us_per_step``: vLLM's own ``schedule()`` on the same steps (the ``super()``
  call inside ``FeatherScheduler.schedule``, timed apart), and ``added_over_vllm``, the ratio.
* ``breakdown_us_per_step``: the added time by part: ``cht`` (the Chunked Hash Tree's queries and
  updates), ``policy`` (the observation, the policy's answer, the candidate order and the prefix
  groups, and the engine lookups they make), ``kv_budget`` (footprints and the peak check),
  ``loop`` (the round's own bookkeeping) and ``hooks`` (the rest). Timing every call shifts what
  it times, so the parts are measured on ``--breakdown-steps`` further steps with each of those
  methods timed (exclusive of the calls it makes; ``breakdown_timed_us_per_step`` is that
  window's total), and their shares of that window are applied to the untimed window's total.
* ``share_of_15ms_step``: the added time over a 15-ms engine step (an 8B model's decode step on
  a GPU); ``step_ms`` and ``overhead_fraction``: this engine's mean step and the share of it.
* ``arrival_us``: per new request, length prediction + CHT insert (once per request, when it
  arrives, outside ``schedule()``), of which ``prediction_us`` predicting.
  ``prediction_fraction`` puts that on the same footing as a steady state: the requests the
  scheduler released in the window times the prediction cost, over the window's step time.

What a scheduler should stay under at 1,000 waiting: its added time <= vLLM's own ``schedule()``
and <= 150 us (1% of a 15-ms step). The figures are the single-thread wall times of a CPU engine
whose step (tens of ms of Python and CPU kernels) flushes the caches between two ``schedule()``
calls: the same code runs several times faster in a loop of its own. Runs vary with the load of a
shared machine: compare within one run.

Measured 2026-12-06 (issue 51) on a shared 2-core AMD EPYC, the engine on core 1.
``feather-heuristic+svf`` at 1,000 waiting, Feather's added us per step, two code versions
alternating in one session, 5 runs each (``--waiting 1000 --steps 60``; medians): 162.1 before
the second cut, **130.2 after** (each run: 135.2, 129.0, 130.2, 127.2, 131.9), the same decisions.
What the cut removed: the float32 array built for every decision (a policy that declares
``reads_plain`` gets the base observation as a tuple of ints), the layers between vLLM's free hook
and the core (one ``BatchingCore.leave``), the CHT finish's several passes over a request's keys
(one), a function call per candidate (the heap peek inline) and a frozen dataclass per decision
(a named tuple). Full run of that code (``results/scheduler_overhead.json``): 23, 127, 131 and 123
us at 64, 500, 1,000 and 10,000 waiting, 0.05-0.17 of vLLM's own ``schedule()`` (426-786 us),
0.15-0.87% of a 15-ms step. Each shipped policy at 1,000 waiting
(``results/scheduler_overhead_policies.json``): 123-138 us, 0.82-0.92% of a 15-ms step. Each
release and each finish still goes through some fifteen Python calls in the cold caches an
engine step leaves; below that needs a compiled core.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from collections.abc import Callable
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


#: Where the attribution puts each wrapped method's own time (``_Attribution``): the CHT's
#: queries and updates; the policy (its observation, its answer, the candidate order and the prefix
#: groups it reads, the engine lookups they make); the KV budget (footprints and the peak check);
#: the round's own loop (``plan``'s bookkeeping). The hooks are the rest of Feather's time.
CATEGORIES = ("cht", "policy", "kv_budget", "loop")


def _targets(sched: Any) -> list[tuple[Any, str, str]]:
    """``(object, method, category)`` of every call Feather's ``schedule()`` and free hooks make."""
    core = sched.feather.core
    out = [(core.cht, m, "cht") for m in ("best_candidate", "candidate", "activate", "finish", "remove",
                                          "missing_count")]
    out += [(core, m, "kv_budget") for m in ("_footprint", "_footprint_of", "nothing_fits")]
    out += [(core.budget, m, "kv_budget") for m in ("fits", "charge", "release")]
    out += [(core, m, "policy") for m in ("observe", "kv_committed", "_oldest_waiting")]
    out += [(core.ordering, "next_candidate", "policy")]
    out += [(core, f"_ordering_{m}", "policy") for m in ("begin_round", "release", "finish", "remove")
            if getattr(core, f"_ordering_{m}", None) is not None]  # the ordering's hooks the core calls
    out += [(core.groups, m, "policy") for m in ("release", "finish", "remove", "in_flight", "shares_nothing",
                                                 "first_waiting_in_flight", "waiting_in_flight")]
    out += [(sched.feather_view, m, "policy") for m in ("kv_usage", "cached_prefix_tokens", "num_queued")]
    if core._volume_q is not None:
        out += [(core._volume_q, m, "policy") for m in ("peek", "discard")]
    out += [(core, "plan", "loop")]
    return out


class _Attribution:
    """Exclusive wall time per category of wrapped methods (a stack of open timers), for the
    breakdown window: each target's bound method is shadowed by a timing wrapper on the instance
    (the policy, whose class may be frozen, by a proxy) and restored by :meth:`undo`."""

    def __init__(self, sched: Any) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float, dict.fromkeys(CATEGORIES, 0.0))
        self._stack: list[float] = []
        self._undo: list[Callable[[], None]] = []
        core = sched.feather.core
        for obj, name, category in _targets(sched):
            self._wrap(obj, name, category)
        policy = core.policy

        class _Timed:  # the core reads only ``policy.act`` in ``plan``
            act = staticmethod(self._timed(policy.act, "policy"))

        core.policy = _Timed()
        self._undo.append(lambda: setattr(core, "policy", policy))

    def _timed(self, fn: Callable[..., Any], category: str) -> Callable[..., Any]:
        stack, seconds, clock = self._stack, self.seconds, time.perf_counter

        def timed(*args: Any, **kwargs: Any) -> Any:
            stack.append(0.0)
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = clock() - t0
                seconds[category] += elapsed - stack.pop()
                if stack:
                    stack[-1] += elapsed

        return timed

    def _wrap(self, obj: Any, name: str, category: str) -> None:
        fn = getattr(obj, name)
        had = name in vars(obj)
        setattr(obj, name, self._timed(fn, category))
        self._undo.append(lambda: setattr(obj, name, fn) if had else delattr(obj, name))

    def undo(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo = []


def _own_seconds(stats: dict[str, Any]) -> float:
    return stats["decision_seconds"] + stats["hook_seconds"]


def _window(engine: Any, sched: Any, steps: int) -> tuple[dict[str, Any], dict[str, Any], list[float],
                                                          list[tuple[float, float]]]:
    """``steps`` engine steps: Feather's counters before and after, each step's wall time, and
    each step's (Feather's added seconds, vLLM's own schedule() seconds)."""
    before = last = sched.feather_stats()
    step_times, per_step = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - t0)
        now = sched.feather_stats()
        per_step.append((_own_seconds(now) - _own_seconds(last),
                         now["vllm_schedule_seconds"] - last["vllm_schedule_seconds"]))
        last = now
    return before, last, step_times, per_step


def measure(llm: Any, waiting: int, args: argparse.Namespace, scheduler: str) -> dict[str, Any]:
    from feather_env.engines.vllm_engine import engine_core_of, forced_length_params, tokens_prompt

    engine = llm.llm_engine
    sched = engine_core_of(llm).scheduler
    # its own requests: their source hint is trusted, as in evaluate.py
    sched.feather_configure({"name": scheduler, "trust_client_hints": True, **args.overrides})
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
    before, after, step_times, step_own = _window(engine, sched, args.steps)
    # the breakdown: the next steps again, with every call of Feather's timed by category
    attribution = _Attribution(sched)
    try:
        b_before, b_after, _, _ = _window(engine, sched, args.breakdown_steps)
    finally:
        attribution.undo()

    steps = after["schedule_calls"] - before["schedule_calls"]
    plan_s = after["decision_seconds"] - before["decision_seconds"]
    hook_s = after["hook_seconds"] - before["hook_seconds"]
    own = plan_s + hook_s
    vllm_s = after["vllm_schedule_seconds"] - before["vllm_schedule_seconds"]
    calls = after["plan_calls"] - before["plan_calls"]
    released = sum(after["released"].values()) - sum(before["released"].values())
    window = float(sum(step_times))
    per_step = 1e6 / max(steps, 1)
    # the categories' shares of the timed window's own time, applied to the clean window's
    timed_own = _own_seconds(b_after) - _own_seconds(b_before)
    timed_steps = b_after["schedule_calls"] - b_before["schedule_calls"]
    shares = {c: attribution.seconds[c] / timed_own if timed_own > 0 else 0.0 for c in CATEGORIES}
    shares["hooks"] = max(0.0, 1.0 - sum(shares.values()))
    row = {
        "scheduler": scheduler,
        "waiting": waiting,
        "held_at_end": after["held"],
        "batch_at_end": after["batch"],
        "steps": steps,
        "step_ms": 1e3 * window / args.steps,
        "added_us_per_step": own * per_step,
        "vllm_schedule_us_per_step": vllm_s * per_step,
        "added_over_vllm": own / vllm_s if vllm_s > 0 else None,
        # the median step: robust to a step that another process interrupted (a shared machine)
        "added_us_median_step": 1e6 * float(np.median([a for a, _ in step_own])),
        "vllm_schedule_us_median_step": 1e6 * float(np.median([v for _, v in step_own])),
        "breakdown_us_per_step": {c: share * own * per_step for c, share in shares.items()},
        "breakdown_steps": timed_steps,
        "breakdown_timed_us_per_step": 1e6 * timed_own / max(timed_steps, 1),
        "share_of_15ms_step": own * per_step / 15000.0,
        "scheduler_ms": 1e3 * own,
        "overhead_fraction": own / window,
        "plan_us_per_step": plan_s * per_step,
        "hook_us_per_step": hook_s * per_step,
        "plan_calls": calls,
        "decision_us_per_call": 1e6 * own / max(calls, 1),
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
    """The benchmark's figures in markdown: one row per scheduler and queue length."""
    rows_in = res["results"]
    settings = "".join(f", `{k}: {json.dumps(v)}`" for k, v in (res.get("overrides") or {}).items())
    if not any("added_us_per_step" in r for r in rows_in):  # a JSON of the first version
        retained = any("retained_blocks" in r for r in rows_in)
        rows = [[r["waiting"], r["step_ms"], r["decision_us_per_call"], f"{r['overhead_fraction']:.4f}",
                 r.get("decisions", "-"), r.get("arrival_us", "-"), r.get("prediction_us", "-"),
                 f"{r['prediction_fraction']:.5f}", *([r.get("retained_blocks", "-")] if retained else [])]
                for r in rows_in]
        return "\n".join([f"Scheduler `{res.get('scheduler')}`{settings} ({measured(res)}):", "",
                          format_table(["waiting", "engine step (ms)", "scheduler us / schedule()",
                                        "overhead fraction", "decisions", "arrival us / request",
                                        "prediction us / request", "prediction fraction",
                                        *(["retained blocks"] if retained else [])], rows)])
    schedulers = list(dict.fromkeys(r.get("scheduler", res.get("scheduler")) for r in rows_in))
    several = len(schedulers) > 1
    rows = []
    for r in rows_in:
        b = r["breakdown_us_per_step"]
        rows.append([*([f"`{r['scheduler']}`"] if several else []), r["waiting"],
                     b["cht"], b["policy"], b["kv_budget"], b["loop"], b["hooks"], r["added_us_per_step"],
                     r["vllm_schedule_us_per_step"], r.get("added_us_median_step", "-"),
                     r.get("vllm_schedule_us_median_step", "-"),
                     "-" if r["added_over_vllm"] is None else f"{r['added_over_vllm']:.2f}",
                     f"{r['share_of_15ms_step']:.2%}", r["step_ms"], f"{r['overhead_fraction']:.2%}",
                     r.get("decisions", "-"), r.get("arrival_us", "-")])
    names = ", ".join(f"`{s}`" for s in schedulers)
    who = f"Schedulers {names}" if several else f"Scheduler {names}"
    return "\n".join([
        f"{who}{settings} ({measured(res)}); us per engine step (mean, and the median step), "
        "Feather's added time by part:", "",
        format_table([*(["scheduler"] if several else []), "waiting", "CHT", "policy", "KV budget",
                      "round loop", "hooks", "Feather added", "vLLM schedule()", "Feather, median step",
                      "vLLM, median step", "added / vLLM",
                      "added / 15-ms step", "engine step (ms)", "added / this step", "decisions",
                      "arrival us / request"], rows)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None, help="write results here")
    parser.add_argument("--waiting", type=int, nargs="+", default=[64, 500, 1000, 10000])
    parser.add_argument("--scheduler", nargs="+", default=["feather-heuristic+svf"],
                        help="one or more Feather schedulers, measured one after the other on one engine")
    parser.add_argument("--prompt", type=int, default=2048, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--breakdown-steps", type=int, default=20,
                        help="steps after the window, timed by part (the breakdown's shares)")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="64 and 1000 waiting, 15 steps")
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
        args.waiting, args.steps, args.warmup, args.breakdown_steps = [64, 1000], 15, 5, 10

    from feather_env.engines.vllm_engine import EngineConfig, build_llm, engine_core_of
    from scheduler_runtime.schedulers import engine_overrides

    engine_config = EngineConfig(kv_cache_gib=2.0, max_num_seqs=args.max_num_seqs, max_model_len=8192,
                                 max_num_batched_tokens=8192)
    llm = build_llm(engine_config, **engine_overrides(args.scheduler[0]))
    rows = []
    try:
        for scheduler in args.scheduler:
            for waiting in args.waiting:
                row = measure(llm, waiting, args, scheduler)
                rows.append(row)
                print(f"{scheduler} W={waiting}: Feather {row['added_us_per_step']:.1f} us/step, vLLM "
                      f"schedule() {row['vllm_schedule_us_per_step']:.1f} us/step, "
                      f"step {row['step_ms']:.1f} ms",
                      file=sys.stderr)
    finally:
        engine_core_of(llm).shutdown()

    payload = {
        "benchmark": "scheduler_overhead",
        "scheduler": args.scheduler[0] if len(args.scheduler) == 1 else args.scheduler,
        "overrides": args.overrides,
        "engine": engine_config.to_dict(),
        "prompt_tokens": args.prompt,
        "machine": machine_info(),
        "results": rows,
    }
    payload["table"] = render(payload)
    print(payload["table"])
    write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
