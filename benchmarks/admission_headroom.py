"""How much is there to win in the admit/reject decision? Tuned rules against a hindsight oracle and a bound.

    python -m benchmarks.admission_headroom [--rates 4,6] [--tune-seeds 1765,1381]
                                            [--eval-seeds 1547,757] [--addback-sims 100]
                                            [--json results/admission_headroom.json]

Past its capacity an engine must refuse some requests (:mod:`scheduler_runtime.admission`); this
benchmark asks, on the simulator with the EPYC AVX-512 profile, how far the shipped rules are from
what any admission decision could reach. Scenario ``mooncake-synthetic`` (300-s windows of the
Mooncake trace, episode seed = a random window start), at each load ``--rates`` (the scenario's
``episode.rate_scale``), SLOs ``ttft:5000 tpot:50``; every figure is SLO attainment over the
*submitted* requests (:func:`feather_env.serving_metrics.serving_metrics`). Per load and held-out
window:

a. ``best constant``: the best setting without admission, ``group-cap-K@B`` (K in :data:`CAPS`, B in
   :data:`BUDGETS`) and ``fcfs@B``, chosen by mean attainment on the tuning windows;
b. ``slo:F`` on that setting, F in :data:`FACTORS` (tuned on the tuning windows; ``rule`` below),
   and vLLM's caps ``queued-tokens:N`` (:data:`TOKEN_CAPS`) and ``queued-reqs:N``
   (:data:`REQ_CAPS`), each tuned the same way; also the best F of the window in hindsight
   (``F*``), and a prompt-length cap (reject every prompt over P tokens, P in :data:`LENGTH_CAPS`,
   tuned the same way; a rule of the request alone, served by removing those requests);
c. ``oracle``: a hindsight oracle (:func:`hindsight_oracle`), with foresight, not deployable:
   serve the window with the best constant, drop the requests that missed an SLO, re-serve the
   kept ones (same arrival times: a rejected request costs the engine nothing, so rejecting at
   arrival *is* removing it from the workload; the tests check it request by request), until no
   kept request misses; then try adding the dropped ones back in arrival order, keeping them
   only if the count of good requests rises - in chunks, so that the add-back takes at most
   ``--addback-sims`` serves (one request at a time would take ~1,000 serves per window), in two
   passes with a prune after each. The same search also starts from the tuned rule's admitted set
   and from the best prompt-length cap of the window in hindsight (percentiles
   :data:`LENGTH_PERCENTILES` of its prompt lengths); ``oracle`` is the best of the three starts
   (``c from base``: the search from the best constant alone). Every set it serves is an
   admission decision some rule with foresight could make, so its figure is a *lower bound on
   the optimum*: the best admission decision reaches at least ``oracle``, i.e. ``oracle / rule -
   1`` is a floor on what a better rule could win over the tuned one, not a ceiling;
d. ``bound``: an upper bound on any admission decision's attainment with that setting's token
   budget (:func:`attainment_bound`: prefill work against the engine's peak token rate, globally
   and per interval; loose: it ignores decode work, KV limits and deadlines within an interval);
e. ``placebo``: reject uniformly at random as many requests as the tuned rule rejected on that
   window, serve the rest with the best constant (median of 3 random draws);
f. ``learned``: an online UCB1 bandit (:class:`IntervalUCB`) choosing F from :data:`FACTORS` for
   each 10-s interval of the episode's clock, rewarded by the attainment of the requests that
   arrived in the interval (delayed feedback: an interval counts once all its requests are
   answered). It learns over ``--bandit-passes`` passes of the tuning windows, then keeps
   learning online on the held-out windows (so held-out figures include its exploration).

Windows: the trace is 1,022 s long and a window starts at a request drawn uniformly among those
whose window ends in the trace, so every seed >= 0 is valid but windows overlap heavily (seeds 0, 2
and 3 all start near 600-620 s). At most three disjoint 300-s windows fit. The defaults tune on
the first half (seed 1765: [0, 300) s, seed 1381: [211, 511) s) and evaluate on the second (seed
1547: [511, 811) s, seed 757: [722, 1022) s): the tuning windows and the held-out windows never
share a request (checked), though each pair shares 89 s with its partner. The trace's load grows
over time (prompt tokens per 100 s roughly double from the first half to the second), so the
held-out windows are heavier than the tuning ones: tuned constants are tested under drift, which
the ``F* hindsight`` column separates from the rule's own limits.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from benchmarks import measured
from feather_env.env import FeatherEnv, play_episode
from feather_env.evaluation.bound import prefill_attainment_bound
from feather_env.records import RequestTimeline
from feather_env.reporting import format_table, machine_info, write_json
from feather_env.scenarios import Scenario, load_scenario
from feather_env.serving_metrics import meets_slos
from feather_env.step_model import load_profile
from feather_env.workloads import Workload
from scheduler_runtime.admission import AdmissionController, AdmissionRule

__all__ = ["BUDGETS", "CAPS", "FACTORS", "REQ_CAPS", "TOKEN_CAPS", "IntervalUCB", "Server",
           "attainment_bound", "bandit_episode", "base_settings", "budget_of", "hindsight_oracle",
           "length_keep", "main", "placebo", "render", "run"]

SCENARIO = "mooncake-synthetic"
PROFILE = "configs/profiles/cpu-tiny-llama-epyc-avx512.json"
SLOS = {"ttft": 5000.0, "tpot": 50.0}
CAPS = (4, 8, 16)
BUDGETS = (256, 512, 2048, 8192)
#: ``slo:F``: 8 log-spaced factors from 1/8 to 4.
FACTORS = tuple(float(f"{0.125 * 32 ** (k / 7):.3g}") for k in range(8))
#: ``queued-tokens:N``: 1K .. 128K tokens (a 5-s TTFT at 7-16K prefill tok/s is 35-80K queued tokens).
TOKEN_CAPS = tuple(1024 * 2**k for k in range(8))
#: ``queued-reqs:N``: 8 .. 1024 unfinished requests (the engine runs at most 64).
REQ_CAPS = tuple(8 * 2**k for k in range(8))
#: A prompt-length cap (reject every prompt longer than P tokens): 1024 .. 11585 tokens, sqrt(2) apart.
LENGTH_CAPS = tuple(round(1024 * 2 ** (k / 2)) for k in range(8))
#: The oracle's hindsight length-cap start: these percentiles of the window's prompt lengths.
LENGTH_PERCENTILES = tuple(40 + 2.5 * k for k in range(23))
TUNE_SEEDS = (1765, 1381)
EVAL_SEEDS = (1547, 757)
RATES = (4.0, 6.0)
INTERVAL_S = 10.0
PLACEBO_SEEDS = (0, 1, 2)
#: The interval lengths (episode seconds) of the bound's interval form (:func:`attainment_bound`).
BOUND_INTERVALS = (2.5, 5.0, 10.0, 20.0)


def base_settings() -> list[str]:
    """The settings without admission that the best constant is chosen from."""
    return [f"group-cap-{k}@{b}" for k in CAPS for b in BUDGETS] + [f"fcfs@{b}" for b in BUDGETS]


def length_keep(episode: Workload, cap: float) -> list[str]:
    """The requests of ``episode`` a prompt-length cap admits (prompt at most ``cap`` tokens)."""
    return [r.request_id for r in episode if r.prompt_len <= cap]


def budget_of(setting: str) -> int:
    """The per-step token budget of a ``NAME@B[~RULE]`` setting."""
    return int(setting.split("~", 1)[0].rsplit("@", 1)[1])


# ---------------------------------------------------------------------------------------- serving


class _FixedEpisode:
    """A scenario whose every episode is one given workload (the rest of the scenario forwarded)."""

    def __init__(self, scenario: Scenario, workload: Workload) -> None:
        self._scenario, self._workload = scenario, workload

    def episode_workload(self, seed: int) -> Workload:
        return self._workload

    def __getattr__(self, name: str) -> Any:
        return getattr(self._scenario, name)


class Server:
    """One load of the scenario on the simulator: episodes, or any subset of one, served by a setting.

    Args:
        rate: the scenario's ``episode.rate_scale``.
        scenario: its name (or a YAML path); ``overrides``: more per-section keys.
    """

    def __init__(self, rate: float, *, scenario: str = SCENARIO, profile: str | None = PROFILE,
                 slos: Mapping[str, float] = SLOS, overrides: Mapping[str, Mapping[str, Any]] | None = None
                 ) -> None:
        over = {k: dict(v) for k, v in (overrides or {}).items()}
        over["episode"] = {**over.get("episode", {}), "rate_scale": float(rate)}
        self.rate = float(rate)
        self.scenario = load_scenario(scenario, over)
        self.profile = profile
        self.slos = dict(slos)
        self.sims = 0
        self._envs: dict[str, FeatherEnv] = {}
        self._episodes: dict[int, Workload] = {}

    def episode(self, seed: int) -> Workload:
        """Episode ``seed`` (cached)."""
        if seed not in self._episodes:
            self._episodes[seed] = self.scenario.episode_workload(int(seed))
        return self._episodes[seed]

    def env(self, setting: str) -> FeatherEnv:
        if setting not in self._envs:
            self._envs[setting] = FeatherEnv(self.scenario, "sim", scheduler=setting, profile=self.profile,
                                             goodput_slos=self.slos)
        return self._envs[setting]

    def serve(self, setting: str, seed: int, keep: Iterable[str] | None = None,
              hook: Callable[[AdmissionController, Any], None] | None = None) -> list[RequestTimeline]:
        """The timelines of episode ``seed`` served by ``setting``; with ``keep``, only those requests
        of it (same arrival times: the others rejected at arrival, which costs the engine nothing).
        ``hook(controller, backend)`` is called with each episode's admission controller."""
        episode = self.episode(seed)
        env = self.env(setting)
        if keep is not None:
            keep = set(keep)
            requests = tuple(r for r in episode if r.request_id in keep)
            if not requests:
                return []
            env.scenario = _FixedEpisode(self.scenario, Workload(f"{episode.name}/kept{len(requests)}",
                                                                 requests, episode.arrivals))
        backend = env.backend
        if hook is not None:
            make = backend._admission_controller

            def controller(config: Any) -> AdmissionController | None:
                ctrl = make(config)
                if ctrl is not None:
                    hook(ctrl, backend)
                return ctrl

            backend._admission_controller = controller
        try:
            play_episode(env, episode_seed=int(seed))
        finally:
            env.scenario = self.scenario
            if hook is not None:
                del backend._admission_controller
        self.sims += 1
        return backend.timelines()

    def good(self, timelines: Iterable[RequestTimeline]) -> set[str]:
        """The requests that completed within every SLO."""
        return {t.request_id for t in timelines if t.completed and meets_slos(t, self.slos)}

    def attainment(self, setting: str, seed: int) -> dict[str, Any]:
        """Good over submitted, and the rejected count, of ``setting`` on episode ``seed``."""
        tl = self.serve(setting, seed)
        rejected = sum(1 for t in tl if t.outcome == "rejected")
        return {"good": len(self.good(tl)), "submitted": len(tl), "rejected": rejected,
                "attainment": len(self.good(tl)) / len(tl),
                "admitted": [t.request_id for t in tl if t.outcome != "rejected"]}


    def length_cap(self, setting: str, seed: int, cap: float) -> dict[str, Any]:
        """``setting`` on episode ``seed`` with every prompt longer than ``cap`` rejected at arrival
        (a rule of the request alone, so exactly serving the rest)."""
        keep = length_keep(self.episode(seed), cap)
        n = len(self.episode(seed))
        good = len(self.good(self.serve(setting, seed, keep=keep)))
        return {"good": good, "submitted": n, "rejected": n - len(keep), "attainment": good / n,
                "admitted": keep}


# ---------------------------------------------------------------------------------------- oracle


def hindsight_oracle(server: Server, setting: str, seed: int, *, start: Iterable[str] | None = None,
                     addback_sims: int | None = 100, screen: set[str] | None = None) -> dict[str, Any]:
    """The hindsight oracle of the module docstring on episode ``seed`` served by ``setting``.

    ``start``: the first kept set (default: every request, i.e. the setting's own run). Prune:
    serve the kept set, keep only its good requests, until every kept request is good. Add back:
    the dropped requests (less ``screen``, requests that can never be good:
    :func:`attainment_bound`'s ``never_fits``) in arrival order, in chunks so that a pass takes
    at most ``addback_sims / 2`` serves (``None``: one request at a time, every one tried): a
    chunk is kept, less its own members that missed, when the count of good requests rises; then
    prune again, and a second pass over what is still dropped. Every set served is an achievable
    admission decision (reject the rest at arrival), so ``good``, the most good requests of any
    set served, is achievable with foresight: a lower bound on the optimum. Counts:
    ``kept + dropped == submitted``, ``good <= kept``.
    """
    episode = server.episode(seed)
    order = [r.request_id for r in episode]
    n = len(order)
    kept = set(order) if start is None else set(start)
    best_good: set[str] = set()
    best_kept: set[str] = set()
    history: list[dict[str, Any]] = []

    def serve(served: set[str], phase: str) -> set[str]:
        nonlocal best_good, best_kept
        good = server.good(server.serve(setting, seed, keep=served)) if served else set()
        history.append({"phase": phase, "kept": len(served), "good": len(good)})
        if len(good) > len(best_good) or not history[:-1]:
            best_good, best_kept = set(good), set(served)
        return good

    def prune(kept: set[str], phase: str) -> set[str]:
        while True:
            good = serve(kept, phase)
            if good == kept:
                return kept
            kept = good

    kept = prune(kept, "prune")
    first_good, pruned = history[0]["good"], len(kept)
    excluded = screen or set()
    candidates = [rid for rid in order if rid not in kept and rid not in excluded]
    tried = added = 0
    for _pass in range(2 if addback_sims is not None else 1):
        dropped = [rid for rid in order if rid not in kept and rid not in excluded]
        if not dropped:
            break
        size = 1 if addback_sims is None else max(1, math.ceil(len(dropped) / max(1, addback_sims // 2)))
        current = len(kept)  # every kept request is good after a prune
        for i in range(0, len(dropped), size):
            chunk = set(dropped[i:i + size])
            trial = kept | chunk
            good = serve(trial, "addback")
            tried += len(chunk)
            if len(good) > current:
                kept = trial - (chunk - good)
                current = len(good)
                added += len(chunk & good)
        kept = prune(kept, "prune")
    return {"submitted": n, "good": len(best_good), "kept": len(best_kept), "dropped": n - len(best_kept),
            "attainment": len(best_good) / n, "first_good": first_good, "pruned_good": pruned,
            "final_good": len(kept), "prune_serves": sum(1 for h in history if h["phase"] == "prune"),
            "addback_candidates": len(candidates), "addback_tried": tried, "addback_kept": added,
            "screened_out": len(excluded), "sims": len(history),
            "good_ids": sorted(best_good), "kept_ids": sorted(best_kept)}


# ---------------------------------------------------------------------------------------- bound


def attainment_bound(scenario: Scenario, episode: Workload, budget: int, profile: str | None = PROFILE,
                     slos: Mapping[str, float] = SLOS, intervals: Sequence[float] = BOUND_INTERVALS
                     ) -> dict[str, Any]:
    """An upper bound on the good requests of any admission decision on ``episode`` (loose):
    :func:`~feather_env.evaluation.bound.prefill_attainment_bound` at the engine's peak prefill rate.

    From the simulator's model: a step of ``N <= budget`` tokens takes at least ``c0 + c1 + c2 N``
    seconds (the profile's ``const``, ``requests``, ``tokens`` coefficients; the others are >= 0, and
    a step has at least one request), so in any stretch of ``D`` seconds the steps that lie inside it
    compute at most ``D x budget / (c0 + c1 + c2 budget)`` tokens (``N / t`` grows with ``N``); a
    request's own tokens, in steps of at most ``budget``, take at least ``ceil(own / budget) (c0 +
    c1) + c2 own`` seconds. The bound also ignores the per-request step cost of running decodes (a
    decode step costs >= ``c0 + c1 + c2``, far below the TPOT SLO).
    """
    prof = load_profile(profile)["step_model"]
    coef = dict(zip(prof["features"], prof["coef"], strict=True))
    c0, c1, c2 = float(coef["const"]), float(coef["requests"]), float(coef["tokens"])
    engine = scenario.engine_config()
    budget = min(int(budget), engine.max_num_batched_tokens)

    def own_seconds(start: int, own: int) -> float:
        return math.ceil(own / budget) * (c0 + c1) + c2 * own

    rate = budget / (c0 + c1 + c2 * budget)
    out = prefill_attainment_bound(list(episode), engine.block_size, rate, own_seconds, slos["ttft"] / 1000.0,
                                   intervals)
    return {**out, "prefill_tok_s": rate, "budget": budget}


# ---------------------------------------------------------------------------------------- placebo


def placebo(server: Server, setting: str, seed: int, rejects: int, seeds: Sequence[int] = PLACEBO_SEEDS
            ) -> dict[str, Any]:
    """Reject ``rejects`` requests of episode ``seed`` uniformly at random, serve the rest with
    ``setting``; attainment over all submitted per random seed, and the median."""
    ids = [r.request_id for r in server.episode(seed)]
    n = len(ids)
    draws = []
    for s in seeds:
        rejected = set(random.Random(s).sample(ids, min(rejects, n)))
        kept = [rid for rid in ids if rid not in rejected]
        good = server.good(server.serve(setting, seed, keep=kept))
        draws.append({"seed": s, "kept": len(kept), "rejected": len(rejected), "good": len(good),
                      "attainment": len(good) / n})
    return {"submitted": n, "rejects": rejects, "draws": draws,
            "attainment": statistics.median(d["attainment"] for d in draws)}


# ---------------------------------------------------------------------------------------- bandit


@dataclass
class IntervalUCB:
    """UCB1 over ``slo:F`` factors, one pull per interval of ``interval_s`` of the episode's clock.

    The reward of a pull is the attainment of the requests that arrived in its interval; it is
    known once every one of them has been answered (finished or rejected), so feedback is
    delayed: a pull waiting for it counts in the exploration term but not in the mean.
    """

    factors: tuple[float, ...] = FACTORS
    interval_s: float = INTERVAL_S
    c: float = 1.0
    pulls: list[int] = field(default_factory=list)
    rewards: list[list[float]] = field(default_factory=list)
    log: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.pulls = [0] * len(self.factors)
        self.rewards = [[] for _ in self.factors]

    def choose(self) -> int:
        for arm, n in enumerate(self.pulls):
            if n == 0:
                return arm
        total = sum(self.pulls)

        def score(arm: int) -> float:
            got = self.rewards[arm]
            if not got:
                return math.inf
            return statistics.fmean(got) + self.c * math.sqrt(2.0 * math.log(total) / self.pulls[arm])

        return max(range(len(self.factors)), key=score)

    def attach(self, slos: Mapping[str, float], phase: str) -> Callable[[AdmissionController, Any], None]:
        """A :meth:`Server.serve` hook: the controller's factor set per interval by the bandit."""
        return lambda ctrl, backend: self._episode(ctrl, backend, slos, phase)

    def _episode(self, ctrl: AdmissionController, backend: Any, slos: Mapping[str, float],
                 phase: str) -> None:
        timelines = {t.request_id: t for t in backend.timelines()}
        by_interval: dict[int, list[str]] = {}
        for rid, t in timelines.items():
            by_interval.setdefault(int(t.arrival // self.interval_s), []).append(rid)
        pending: dict[int, int] = {}  # interval -> arm, awaiting its reward
        state = {"interval": None}
        offer = ctrl.offer

        def resolve(final: bool = False) -> None:
            for k in sorted(pending):
                ts = [timelines[rid] for rid in by_interval[k]]
                if not final and not all(t.shed or t.finished_count for t in ts):
                    continue
                good = sum(1 for t in ts if t.completed and meets_slos(t, slos))
                arm = pending.pop(k)
                self.rewards[arm].append(good / len(ts))
                self.log.append({"phase": phase, "interval": k, "factor": self.factors[arm],
                                 "reward": good / len(ts), "requests": len(ts)})

        def hooked(request_id: str, prompt_len: int, block_hashes: Sequence[int], now: float, **kw: Any):
            k = int(now // self.interval_s)
            if k != state["interval"]:
                state["interval"] = k
                resolve()
                arm = self.choose()
                self.pulls[arm] += 1
                pending[k] = arm
                ctrl.rule = AdmissionRule(slo_factor=self.factors[arm])
            return offer(request_id, prompt_len, block_hashes, now, **kw)

        ctrl.offer = hooked  # type: ignore[method-assign]
        self._finish = lambda: resolve(final=True)

    def finish(self) -> None:
        """The episode ended: every pending interval's reward is known now."""
        fin = getattr(self, "_finish", None)
        if fin is not None:
            fin()
            self._finish = None

    def means(self) -> dict[str, float | None]:
        return {f"{f:g}": (statistics.fmean(r) if r else None) for f, r in zip(self.factors, self.rewards,
                                                                              strict=True)}


def bandit_episode(server: Server, bandit: IntervalUCB, setting: str, seed: int,
                   phase: str) -> dict[str, Any]:
    """One episode served with the bandit choosing F per interval (``setting``: a base ``~slo:F``)."""
    tl = server.serve(setting, seed, hook=bandit.attach(server.slos, phase))
    bandit.finish()
    good = len(server.good(tl))
    rejected = sum(1 for t in tl if t.outcome == "rejected")
    return {"good": good, "submitted": len(tl), "rejected": rejected, "attainment": good / len(tl)}


# ---------------------------------------------------------------------------------------- run


def window_span(server: Server, seed: int, pool_times: Mapping[str, float]) -> tuple[float, float]:
    """The episode's window in the trace's own seconds, ``[start, start + window_s)``."""
    start = min(pool_times[r.request_id] for r in server.episode(seed))
    return start, start + float(server.scenario.episode.window_s)


def _tune(server: Server, settings: Sequence[str], seeds: Sequence[int]) -> tuple[str, dict[str, float]]:
    means = {s: statistics.fmean(server.attainment(s, seed)["attainment"] for seed in seeds)
             for s in settings}
    return max(settings, key=lambda s: means[s]), means


def run_rate(rate: float, tune_seeds: Sequence[int], eval_seeds: Sequence[int], *, addback_sims: int | None,
             bandit_passes: int, profile: str | None = PROFILE, log: Callable[[str], None] = print
             ) -> dict[str, Any]:
    """Every figure of the module docstring at one load."""
    t0 = time.perf_counter()
    server = Server(rate, profile=profile)
    base, base_means = _tune(server, base_settings(), tune_seeds)
    slo_best, slo_means = _tune(server, [f"{base}~slo:{f:g}" for f in FACTORS], tune_seeds)
    qt_best, qt_means = _tune(server, [f"{base}~queued-tokens:{n}" for n in TOKEN_CAPS], tune_seeds)
    qr_best, qr_means = _tune(server, [f"{base}~queued-reqs:{n}" for n in REQ_CAPS], tune_seeds)
    len_means = {c: statistics.fmean(server.length_cap(base, seed, c)["attainment"] for seed in tune_seeds)
                 for c in LENGTH_CAPS}
    len_best = max(LENGTH_CAPS, key=lambda c: len_means[c])
    log(f"  rate {rate:g}: best constant {base} ({base_means[base]:.3f} on the tuning windows), "
        f"{slo_best} ({slo_means[slo_best]:.3f}), {qt_best} ({qt_means[qt_best]:.3f}), "
        f"{qr_best} ({qr_means[qr_best]:.3f}), length cap {len_best} ({len_means[len_best]:.3f}) "
        f"[{time.perf_counter() - t0:.0f} s]")
    bandit = IntervalUCB()
    train = []
    for p in range(bandit_passes):
        for seed in tune_seeds:
            train.append({"pass": p, "seed": seed,
                          **bandit_episode(server, bandit, f"{base}~slo:1", seed, "tune")})
    tuned_means = bandit.means()
    windows = {}
    for seed in eval_seeds:
        t1 = time.perf_counter()
        row: dict[str, Any] = {"seed": seed}
        a = server.attainment(base, seed)
        rule = server.attainment(slo_best, seed)
        qt = server.attainment(qt_best, seed)
        qr = server.attainment(qr_best, seed)
        hind = {f"{f:g}": server.attainment(f"{base}~slo:{f:g}", seed)["attainment"] for f in FACTORS}
        f_star = max(hind, key=lambda f: hind[f])
        bound = attainment_bound(server.scenario, server.episode(seed), budget_of(base), profile, server.slos)
        screen = set(bound["never_fits"])
        from_base = hindsight_oracle(server, base, seed, addback_sims=addback_sims, screen=screen)
        from_rule = hindsight_oracle(server, base, seed, start=rule["admitted"], addback_sims=addback_sims,
                                     screen=screen)
        lengths = np.array([r.prompt_len for r in server.episode(seed)])
        by_pct = {f"{q:g}": server.length_cap(base, seed, float(np.percentile(lengths, q)))
                  for q in LENGTH_PERCENTILES}
        pct = max(by_pct, key=lambda q: by_pct[q]["good"])
        from_len = hindsight_oracle(server, base, seed, start=by_pct[pct]["admitted"],
                                    addback_sims=addback_sims, screen=screen)
        from_len["length_percentile"] = float(pct)
        from_len["length_cap_good"] = by_pct[pct]["good"]
        starts = {"base": from_base, "rule": from_rule, "length": from_len}
        oracle_start = max(starts, key=lambda k: starts[k]["good"])
        oracle = starts[oracle_start]
        lc = server.length_cap(base, seed, len_best)
        plc = placebo(server, base, seed, rule["rejected"])
        learned = bandit_episode(server, bandit, f"{base}~slo:1", seed, "eval")
        n = a["submitted"]
        row.update({
            "submitted": n, "best_constant": a["attainment"], "rule": rule["attainment"],
            "rule_rejected": rule["rejected"], "queued_tokens": qt["attainment"],
            "queued_reqs": qr["attainment"],
            "queued_tokens_rejected": qt["rejected"], "queued_reqs_rejected": qr["rejected"],
            "slo_hindsight": hind, "f_star": f_star, "f_star_attainment": hind[f_star],
            "length_cap": lc["attainment"], "length_cap_rejected": lc["rejected"],
            "oracle": oracle["attainment"], "oracle_start": oracle_start,
            "oracle_starts": {k: {kk: vv for kk, vv in v.items() if not kk.endswith("_ids")}
                              for k, v in starts.items()},
            "bound": bound["attainment"],
            "bound_detail": {k: v for k, v in bound.items() if k != "never_fits"},
            "placebo": plc["attainment"], "placebo_detail": plc,
            "learned": learned["attainment"], "learned_rejected": learned["rejected"],
            "wall_s": time.perf_counter() - t1,
        })
        r = row["rule"]
        row["ratios"] = {"rule/best_constant": r / a["attainment"] if a["attainment"] else None,
                         "oracle/rule": row["oracle"] / r if r else None,
                         "bound/rule": row["bound"] / r if r else None,
                         "placebo/rule": row["placebo"] / r if r else None,
                         "learned/rule": row["learned"] / r if r else None}
        windows[str(seed)] = row
        sims = sum(o["sims"] for o in starts.values())
        log(f"  rate {rate:g} window {seed}: const {a['attainment']:.3f} rule {r:.3f} oracle "
            f"{row['oracle']:.3f} bound {row['bound']:.3f} placebo {row['placebo']:.3f} learned "
            f"{row['learned']:.3f} [{row['wall_s']:.0f} s, {sims} oracle sims]")
    return {"rate_scale": rate, "best_constant": base, "base_tuning": base_means, "slo_rule": slo_best,
            "slo_tuning": slo_means, "queued_tokens_rule": qt_best, "queued_tokens_tuning": qt_means,
            "queued_reqs_rule": qr_best, "queued_reqs_tuning": qr_means,
            "length_cap": len_best, "length_cap_tuning": {str(c): v for c, v in len_means.items()},
            "bandit": {"passes": bandit_passes, "train": train, "means_after_tuning": tuned_means,
                       "means_final": bandit.means(), "pulls": dict(zip((f"{f:g}" for f in FACTORS),
                                                                       bandit.pulls, strict=True)),
                       "log": bandit.log},
            "windows": windows, "sims": server.sims, "wall_s": time.perf_counter() - t0}


def run(rates: Sequence[float] = RATES, tune_seeds: Sequence[int] = TUNE_SEEDS,
        eval_seeds: Sequence[int] = EVAL_SEEDS, *, addback_sims: int | None = 100, bandit_passes: int = 3,
        profile: str | None = PROFILE, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every load of ``rates``, as JSON."""
    t0 = time.perf_counter()
    probe = Server(rates[0], profile=profile)
    pool_times = {r.request_id: float(r.arrival_time) for r in probe.scenario.pool}
    spans = {str(s): window_span(probe, s, pool_times) for s in (*tune_seeds, *eval_seeds)}
    overlap = [(t, e) for t in tune_seeds for e in eval_seeds
               if spans[str(t)][0] < spans[str(e)][1] and spans[str(e)][0] < spans[str(t)][1]]
    if overlap:
        log(f"  WARNING: tuning and held-out windows overlap in trace time: {overlap}")
    loads = {f"{r:g}": run_rate(r, tune_seeds, eval_seeds, addback_sims=addback_sims,
                                bandit_passes=bandit_passes, profile=profile, log=log) for r in rates}
    return {"benchmark": "admission_headroom", "scenario": SCENARIO, "profile": profile, "slos_ms": SLOS,
            "rates": list(rates), "tune_seeds": list(tune_seeds), "eval_seeds": list(eval_seeds),
            "window_spans_trace_s": spans, "tune_eval_overlap": overlap, "grids": {
                "caps": CAPS, "budgets": BUDGETS, "factors": FACTORS, "token_caps": TOKEN_CAPS,
                "req_caps": REQ_CAPS, "length_caps": LENGTH_CAPS,
                "length_percentiles": LENGTH_PERCENTILES, "bound_intervals": BOUND_INTERVALS,
                "interval_s": INTERVAL_S, "placebo_seeds": PLACEBO_SEEDS},
            "addback_sims": addback_sims, "bandit_passes": bandit_passes, "loads": loads,
            "wall_s": time.perf_counter() - t0, "machine": machine_info()}


def _r(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def render(payload: dict[str, Any]) -> str:
    """The benchmark's table in markdown."""
    rows = []
    for load in payload["loads"].values():
        for seed, w in load["windows"].items():
            q = w["ratios"]
            span = payload["window_spans_trace_s"][seed]
            rows.append([f"{load['rate_scale']:g}x", f"{seed} [{span[0]:.0f}, {span[1]:.0f}) s",
                         f"{w['best_constant']:.3f}", f"{w['rule']:.3f}", f"{w['queued_tokens']:.3f}",
                         f"{w['queued_reqs']:.3f}", f"{w['length_cap']:.3f}",
                         f"{w['f_star']} {w['f_star_attainment']:.3f}",
                         f"{w['oracle_starts']['base']['attainment']:.3f}",
                         f"{w['oracle']:.3f} ({w['oracle_start']})", f"{w['bound']:.3f}",
                         f"{w['placebo']:.3f}",
                         f"{w['learned']:.3f}",
                         _r(q["rule/best_constant"]), _r(q["oracle/rule"]), _r(q["bound/rule"]),
                         _r(q["placebo/rule"]), _r(q["learned/rule"])])
    tuned = "; ".join(f"{k}x: a `{v['best_constant']}`, b `{v['slo_rule'].split('~')[1]}`, "
                      f"`{v['queued_tokens_rule'].split('~')[1]}`, `{v['queued_reqs_rule'].split('~')[1]}`, "
                      f"length cap {v['length_cap']}"
                      for k, v in payload["loads"].items())
    head = (f"`{payload.get('command', 'python -m benchmarks.admission_headroom')}` ({measured(payload)}; "
            f"{payload['scenario']} on the simulator, profile `{payload['profile']}`, SLOs ttft 5000 ms / "
            f"tpot 50 ms; attainment = good / submitted; tuned on windows {payload['tune_seeds']}, held out "
            f"{payload['eval_seeds']}; tuned: {tuned}):\n")
    return head + "\n" + format_table(
        ["load", "window (trace s)", "a best const", "b slo:F", "b q-tokens", "b q-reqs", "len cap",
         "F* hindsight", "c from base", "c oracle (opt >=)", "d bound (opt <=)", "e placebo", "f learned",
         "rule/const", "oracle/rule", "bound/rule", "placebo/rule", "learned/rule"], rows)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", default=",".join(f"{r:g}" for r in RATES))
    p.add_argument("--tune-seeds", default=",".join(map(str, TUNE_SEEDS)))
    p.add_argument("--eval-seeds", default=",".join(map(str, EVAL_SEEDS)))
    p.add_argument("--addback-sims", type=int, default=100,
                   help="the oracle's add-back serves per start (-1: one request at a time, every one)")
    p.add_argument("--bandit-passes", type=int, default=3)
    p.add_argument("--profile", default=PROFILE)
    p.add_argument("--json", default="results/admission_headroom.json")
    args = p.parse_args(argv)
    rates = [float(x) for x in args.rates.split(",")]
    tune = [int(x) for x in args.tune_seeds.split(",")]
    evals = [int(x) for x in args.eval_seeds.split(",")]
    addback = None if args.addback_sims < 0 else args.addback_sims
    payload = run(rates, tune, evals, addback_sims=addback, bandit_passes=args.bandit_passes,
                  profile=args.profile)
    payload["command"] = (f"python -m benchmarks.admission_headroom --rates {args.rates} --tune-seeds "
                          f"{args.tune_seeds} --eval-seeds {args.eval_seeds} "
                          f"--addback-sims {args.addback_sims} "
                          f"--bandit-passes {args.bandit_passes} --json {args.json}")
    print(render(payload))
    write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
