"""``evaluate.py advise``: which scheduler, per-step token budget and admission rule serve your traffic
best under your SLOs.

    python evaluate.py advise --scenario mine.yaml --goodput ttft:5000 tpot:50 [--confirm] --out DIR

A user arrives with a trace (a scenario of it: ``python -m feather_env.scenarios new``) and latency
SLOs in ``vllm bench serve``'s terms (``--goodput ttft:MS tpot:MS e2el:MS``: a request is good when
it meets every one; goodput is good requests per second, SLO attainment good requests over the
submitted ones). ``advise`` answers: which setting meets them best on this traffic, by how much over
vLLM's default, and how sure that is.

1. **The simulator fitted to this machine** (:mod:`feather_env.evaluation.probe`): a short probe
   (one window of the trace, shortened: vLLM's own fcfs at the engine's budget and at 512 tokens,
   and a document cap at 256 tokens) is served on the real engine and on the simulator with every
   profile in ``configs/profiles/``; the profile with the smallest error (the worst of the makespan,
   mean TTFT and mean TPOT errors) is used. Over :data:`MAX_PROFILE_ERROR` the probe's own steps are
   fitted into a new profile, written to the output folder, and its in-sample error reported.
   ``--profile`` skips the probe.
2. **The search** (:func:`search`), in the simulator, one search over schedulers, budgets and
   admission rules, on windows of the trace (episode seeds from ``--first-seed``, never the probe's;
   seeds whose windows are the same requests count once, :func:`split_windows`). It *tunes* on the
   first :attr:`AdviseConfig.search_windows` windows and *reports* on the others, the held-out ones
   (a trace no longer than its window has one window: then nothing is held out, and the report
   says so):

   - every base scheduler (``fcfs``, ``lpm``, ``group-cap-K``, learned policy files) x every token
     budget (``NAME@TOKENS``), without admission, on the tuning windows;
   - with admission (:attr:`AdviseConfig.admission`, on by default when the SLOs have a TTFT), every
     rule of :attr:`AdviseConfig.admission_rules` (:mod:`scheduler_runtime.admission`: vLLM's
     ``queued-tokens:N`` and ``queued-reqs:N``, ours ``slo:F``, ``deadline`` and ``slo:F+deadline``)
     over :attr:`AdviseConfig.thresholds` log-spaced thresholds (:func:`threshold_ladder`: queued
     tokens 1/8x-8x the TTFT SLO x the engine's prefill throughput, queued requests 1/4x-16x
     ``max_num_seqs``, the SLO factor 0.125-4), each extended by one more value beyond an edge (at most
     :data:`MAX_EXTENSIONS` times) while the best lies at that edge, on the tuning windows. To keep
     this affordable the rules are searched on the best :attr:`AdviseConfig.admission_bases` settings
     of the search without admission plus ``fcfs`` at each budget (what vLLM alone can serve), every
     rule on the same settings, windows and noise rule;
   - then the best :attr:`AdviseConfig.shortlist` settings without a rule, the default, and with
     admission the best ``shortlist`` settings with one, the best of each rule and the best with a
     vLLM cap (fcfs's and ours), on the held-out windows.

   Settings are ranked on the tuning windows by SLO attainment when admission rules are searched
   (a rule that sheds requests can raise goodput per second without serving more of them well;
   ties: the simpler setting, :func:`~feather_env.evaluation.recommend.simplicity`), else by goodput;
   goodput is reported beside attainment.
3. **The report** of the best few and the default, with every figure of ``vllm bench serve``
   (goodput, SLO attainment, rejected share, output throughput, mean and P99 TTFT, TPOT and E2E), the
   prefix reuse each captures against what a perfect prefix cache would
   (:meth:`~feather_env.workloads.Workload.cached_prompt_tokens`), the offered request rate (no
   scheduler's goodput exceeds it), the hindsight per-window best (how much any policy choosing per
   window could still win over the best constant), what-ifs (twice the KV cache, and 2 and 4
   replicas behind the prefix router, :class:`~feather_env.cluster_sim.ClusterSim`), and what an
   admission rule costs at light load (:func:`light_load`: the setting with and without its rule at
   1/:attr:`AdviseConfig.light_load` of the scenario's rate).
4. **The recommendation** (:mod:`feather_env.evaluation.recommend`): the best setting without a rule
   (the simplest of those within :data:`~feather_env.evaluation.recommend.TIE` of the best: vLLM's
   fcfs before a baseline ordering before a document cap, the larger budget first) when it beats the
   default by more than the noise (:attr:`AdviseConfig.noise`) in the median held-out window and
   loses in none by more than it, else vLLM's default, with the reason (arrival-bound load, reuse
   beyond the cache, ...); then the best setting with a rule instead only when it wins beyond the
   noise over the best setting without one (and over the default).
5. ``--confirm``: on the real engine, on the first held-out window, alternating, ``--repeats`` runs
   each: the recommendation, the default, the best setting without admission and, where the search
   served them, fcfs with the best vLLM cap and the best of ours with a vLLM cap (:func:`~feather_env.
   evaluation.recommend.roles`); the measured ratio beside the predicted one. ``--confirm-top K``
   serves the simulator's best K settings too, and the engine decides among them
   (:func:`engine_choice`: the simplest within the noise of the best measured, or the default when
   nothing beats it beyond the noise).

``DIR/advice.json`` (scripts read it): ``recommendation`` = {``scheduler``, ``max_num_batched_tokens``,
``admission`` (the rule, ``"none"`` without one), ``serve_command``, ``predicted_goodput``
(requests/s), ``predicted_goodput_ratio``, ``predicted_attainment``, ``ranked_by``, ...},
``default``, ``windows`` (``tuning``, ``held_out``, ``note``), ``candidates`` (every setting served,
with its metrics: held-out means, ``tuning`` means, the windows), ``admission_search`` (the rules,
their thresholds, the settings they were searched on), ``light_load``, ``profile``, ``hindsight``,
``what_if``, and with ``--confirm`` ``confirm`` = {``measured_goodput``, ``measured_goodput_ratio``,
``runs``, ``settings``: one entry per role with ``role``, ``name``, ``measured_attainment``,
``measured_goodput``, ``rejected_fraction``, ``false_admit_fraction``, ``runs``}. ``DIR/advice.md`` is
the same as tables, ``DIR/goodput.png`` the candidates' goodput.
"""

from __future__ import annotations

import math
import shlex
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from feather_env.evaluation.advice_report import render_markdown, write_advice
from feather_env.evaluation.probe import MAX_PROFILE_ERROR, check_profile, probe_names, probe_overrides
from feather_env.evaluation.recommend import (
    TIE,
    best_of,
    confirm_names,
    distinct,
    engine_choice,
    has_rule,
    hindsight,
    recommend,
    recommendation,
    roles,
    split_setting,
    tuned,
)
from feather_env.reporting import machine_info
from feather_env.scenarios import Scenario, load_scenario
from feather_env.serving_metrics import serving_metrics
from scheduler_runtime.admission import AdmissionRule, StepTimeModel, with_admission
from scheduler_runtime.config import ConfigError
from scheduler_runtime.prefix_index import DEFAULT_CHUNK_SIZE
from scheduler_runtime.schedulers import SchedulerConfig, split_budget, with_budget

__all__ = [
    "ADMISSION_RULES",
    "AdviseConfig",
    "MAX_PROFILE_ERROR",
    "advise",
    "candidate_names",
    "check_profile",
    "checked_names",
    "confirm",
    "light_load",
    "plan",
    "render_markdown",
    "search",
    "serve_command",
    "simulated_windows",
    "split_windows",
    "threshold_ladder",
]

DEFAULT_CAPS = (1, 2, 3, 4, 6, 8)
DEFAULT_BUDGETS = (256, 512, 1024, 2048, 4096, 8192)
#: vLLM's default on a scenario's engine: its own fcfs scheduler at the engine's token budget.
DEFAULT_SCHEDULER = "fcfs"
#: The admission rules the search tries (:mod:`scheduler_runtime.admission`), each over its thresholds.
ADMISSION_RULES = ("queued-tokens", "queued-reqs", "slo", "deadline", "slo+deadline", "slo+tpot")
#: Each thresholded rule's range, as factors of its centre (:func:`threshold_ladder`).
THRESHOLD_SPAN = {"queued-tokens": (1 / 8, 8.0), "queued-reqs": (1 / 4, 16.0), "slo": (1 / 8, 4.0),
                  "slo+deadline": (1 / 8, 4.0), "slo+tpot": (1 / 8, 4.0)}
#: At most this many values are added beyond an edge of a rule's thresholds.
MAX_EXTENSIONS = 3
#: The metrics a candidate's row reports (``vllm bench serve``'s names), averaged over windows.
ROW_METRICS = (
    "request_goodput",
    "slo_attainment",
    "rejected_fraction",
    "false_admit_fraction",
    "output_throughput",
    "request_throughput",
    "mean_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "p99_tpot_ms",
    "mean_e2el_ms",
    "p99_e2el_ms",
    "prefix_hit_rate",
    "completed",
    "submitted",
    "aborted",
)


@dataclass(frozen=True)
class AdviseConfig:
    """What ``advise`` searches and how (module docstring).

    Attributes:
        slos: the goodput SLOs in ms (``{"ttft": 5000, "tpot": 50}``).
        windows: episodes (windows of the trace) the search draws: the first ``search_windows`` tune,
            the others are held out (repeats of one window count once).
        first_seed: the first episode seed (the probe uses ``first_seed - 1``).
        search_windows: the tuning windows: every setting is served on them.
        schedulers: base scheduler names (no ``@TOKENS``); ``None``: fcfs, lpm, group-cap-K of
            :data:`DEFAULT_CAPS`.
        policies: learned policy files (``feather:PATH``) searched beside them.
        budgets: per-step token budgets; ``None``: :data:`DEFAULT_BUDGETS` up to the engine's.
        shortlist: settings without a rule (and, with admission, with one) served on the held-out
            windows after the tuning.
        top: settings reported beside the default.
        noise: the relative difference taken as noise (median and worst window).
        profile: the simulator's profile; ``None``: chosen by the engine probe.
        probe_window_s: the probe's window (trace seconds; shorter than the scenario's); a scenario
            without windows (whole episodes) is probed on one whole episode.
        what_if: serve the what-ifs (2x KV cache, 2 and 4 replicas).
        confirm: serve the recommendation, the default and the other roles on the real engine.
        repeats: runs of each in ``confirm``.
        confirm_top: with ``confirm``, also serve the simulator's best ``confirm_top`` settings and
            recommend the engine's pick among them (:func:`engine_choice`); 1: the simulator's pick.
        admission: search admission rules; ``None``: when the SLOs have a TTFT.
        admission_rules: the rules searched (of :data:`ADMISSION_RULES`; those that read the TTFT SLO
            only with one, ``slo+tpot`` only with a TPOT SLO too).
        admission_bases: the best settings without a rule the rules are searched on (beside fcfs at
            each budget).
        thresholds: log-spaced thresholds of each rule (at least 8 for a search worth the name).
        light_load: the light load the recommended rule is priced at: the scenario's rate / this.
    """

    slos: Mapping[str, float]
    windows: int = 4
    first_seed: int = 100
    search_windows: int = 2
    schedulers: tuple[str, ...] | None = None
    policies: tuple[str, ...] = ()
    budgets: tuple[int, ...] | None = None
    shortlist: int = 6
    top: int = 3
    noise: float = 0.03
    profile: str | None = None
    probe_window_s: float = 20.0
    what_if: bool = True
    confirm: bool = False
    repeats: int = 3
    confirm_top: int = 1
    admission: bool | None = None
    admission_rules: tuple[str, ...] = ADMISSION_RULES
    admission_bases: int = 3
    thresholds: int = 8
    light_load: float = 3.0

    def __post_init__(self) -> None:
        if not self.slos:
            raise ConfigError("advise needs the SLOs it optimizes: --goodput ttft:MS tpot:MS (vLLM's names)")
        for name in ("windows", "search_windows", "shortlist", "top", "repeats", "confirm_top",
                     "admission_bases"):
            if getattr(self, name) < 1:
                raise ConfigError(f"advise: {name} must be >= 1, got {getattr(self, name)}")
        if self.first_seed < 1:
            raise ConfigError(
                f"advise: first_seed must be >= 1 (the probe uses the seed before it), got {self.first_seed}"
            )
        if not 0 <= self.noise < 1:
            raise ConfigError(f"advise: noise must be in [0, 1), got {self.noise}")
        if not self.probe_window_s > 0:
            raise ConfigError(f"advise: probe_window_s must be > 0, got {self.probe_window_s}")
        unknown = [r for r in self.admission_rules if r not in ADMISSION_RULES]
        if unknown or not self.admission_rules:
            raise ConfigError(f"advise: unknown admission rule(s) {unknown or '(none given)'}; valid: "
                              f"{', '.join(ADMISSION_RULES)}")
        if self.thresholds < 2:
            raise ConfigError(f"advise: thresholds must be >= 2, got {self.thresholds}")
        if not (self.light_load > 1 and math.isfinite(self.light_load)):
            raise ConfigError(f"advise: light_load must be a finite divisor of the rate > 1, got "
                              f"{self.light_load}")

    @property
    def seeds(self) -> tuple[int, ...]:
        return tuple(range(self.first_seed, self.first_seed + self.windows))

    @property
    def rules(self) -> tuple[str, ...]:
        """The admission rules the search tries: none without admission; those reading the TTFT SLO
        (``slo``, ``deadline``) only with one, and ``slo+tpot`` only with a TPOT SLO as well."""
        if not (self.admission if self.admission is not None else "ttft" in self.slos):
            return ()
        return tuple(r for r in self.admission_rules if ("ttft" in self.slos or r.startswith("queued"))
                     and ("tpot" in self.slos or "tpot" not in r.split("+")))

    @property
    def rank_by(self) -> str:
        """The figure settings are ranked by: SLO attainment when rules are searched, else goodput."""
        return "slo_attainment" if self.rules else "request_goodput"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["slos"] = dict(self.slos)
        d["rules_searched"] = list(self.rules)
        d["ranked_by"] = self.rank_by
        return d


def _budgets(scenario: Scenario, config: AdviseConfig) -> list[int]:
    """The budgets searched: those given (or :data:`DEFAULT_BUDGETS`) below the engine's, and the engine's."""
    engine_budget = scenario.engine.max_num_batched_tokens
    return sorted({b for b in (config.budgets or DEFAULT_BUDGETS) if b < engine_budget} | {engine_budget})


def candidate_names(scenario: Scenario, config: AdviseConfig) -> list[str]:
    """Every setting the search serves without admission: base name x budget (the engine's own budget
    is the plain name).

    Raises:
        ConfigError: a base name that is not a scheduler, or carries its own ``@TOKENS``; a policy file
            that does not load, or measures in other chunks than the scenario's (every base is
            checked as the evaluation checks its schedulers, before the engine probe starts).
    """
    from feather_env.evaluation.inprocess import validate_schedulers

    engine_budget = scenario.engine.max_num_batched_tokens
    bases = list(config.schedulers or ("fcfs", "lpm", *(f"group-cap-{k}" for k in DEFAULT_CAPS)))
    bases += [p if p.startswith("feather:") else f"feather:{p}" for p in config.policies]
    for base in bases:
        if split_budget(base)[1] is not None:
            raise ConfigError(
                f"advise: scheduler {base!r} names its own budget; give base names and --budgets"
            )
        if split_setting(base)[2] is not None:
            raise ConfigError(f"advise: scheduler {base!r} names its own admission rule; advise searches the "
                              "rules itself (--admission-rules)")
    validate_schedulers(bases, scenario.scheduler.chunk_size, scenario.scheduler.max_wait)
    names = []
    for base in bases:
        for budget in _budgets(scenario, config):
            names.append(base if budget == engine_budget else with_budget(base, budget))
    if DEFAULT_SCHEDULER not in names:
        names.insert(0, DEFAULT_SCHEDULER)
    return names


# -- windows ------------------------------------------------------------------------------------
def split_windows(scenario: Scenario, config: AdviseConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(tuning seeds, held-out seeds) of :attr:`AdviseConfig.seeds`, seeds whose windows hold the same
    requests counted once (a trace no longer than its window, or a scenario of whole episodes that are
    the whole trace, has one window): the first ``search_windows`` distinct ones tune, the rest are
    held out (none, possibly)."""
    distinct: dict[str, int] = {}
    for seed in config.seeds:
        distinct.setdefault(scenario.episode_workload(seed).fingerprint(), seed)
    seeds = tuple(distinct.values())
    return seeds[: config.search_windows], seeds[config.search_windows:]


def windows_note(config: AdviseConfig, tuning: Sequence[int], held: Sequence[int]) -> str:
    """One sentence on which windows tuned the settings and which report them."""
    listed = ", ".join(map(str, tuning))
    if held:
        return (f"tuned on window(s) {listed}, reported on {len(held)} held-out window(s) "
                f"{', '.join(map(str, held))}")
    if len(tuning) < min(config.windows, config.search_windows + 1):
        why = f"the trace has only {len(tuning)} distinct window(s) for {config.windows} seed(s)"
    else:
        why = "every window tuned (--windows is not above the tuning windows)"
    return f"tuned and reported on window(s) {listed}: nothing was held out ({why})"


# -- serving windows in the simulator ------------------------------------------------------------
def _window_metrics(
    scenario: Scenario, name: str, seeds: Sequence[int], profile: str | None, slos: Mapping[str, float]
) -> list[dict[str, Any]]:
    """``name`` on each window of ``seeds`` in the simulator (its admission rule reading ``slos``): the
    serving metrics of each window."""
    from feather_env.env import FeatherEnv, play_episode

    env = FeatherEnv(scenario, "sim", scheduler=name, profile=profile, goodput_slos=dict(slos))
    out = []
    try:
        for seed in seeds:
            play_episode(env, episode_seed=int(seed))
            m = serving_metrics(env.backend.timelines(), goodput=slos)
            m["seed"] = int(seed)
            out.append(m)
    finally:
        env.close()
    return out


def _means(windows: Sequence[Mapping[str, Any]]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for key in ROW_METRICS:
        values = [w[key] for w in windows if w.get(key) is not None and math.isfinite(w[key])]
        out[key] = float(np.mean(values)) if values else None
    return out


def _row(name: str, windows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A candidate's figures: each metric's mean over its held-out windows (over every one when none
    is held out), ``tuning``: the means over its tuning windows, and the windows themselves."""
    held = [w for w in windows if w.get("held_out")]
    tuning = [w for w in windows if not w.get("held_out")] or list(windows)
    _, budget, rule = split_setting(name)
    row: dict[str, Any] = {"scheduler": name, "max_num_batched_tokens": budget,
                           "admission": str(AdmissionRule.parse(rule)), **_means(held or windows)}
    row["tuning"] = _means(tuning)
    row["windows"] = [{k: w.get(k) for k in ("seed", "held_out", *ROW_METRICS)} for w in windows]
    return row


class _Server:
    """Serves settings on windows in the simulator for one search, counting the windows served."""

    def __init__(self, scenario: Scenario, config: AdviseConfig, profile: str | None,
                 progress: Callable[[int], None] | None) -> None:
        self.scenario, self.config, self.profile, self.progress = scenario, config, profile, progress
        self.served = 0

    def windows(self, name: str, seeds: Sequence[int], held_out: bool) -> list[dict[str, Any]]:
        if not seeds:
            return []
        out = _window_metrics(self.scenario, name, seeds, self.profile, self.config.slos)
        for w in out:
            w["held_out"] = held_out
        self.served += len(out)
        if self.progress is not None:
            self.progress(len(out))
        return out


# -- admission thresholds ----------------------------------------------------------------------
def prefill_tokens_per_s(scenario: Scenario, profile: str | None) -> float:
    """The engine's prefill throughput in the profile's step model: one full budget of prompt tokens."""
    from feather_env.step_model import load_profile

    model = StepTimeModel.from_profile(load_profile(profile))
    budget = scenario.engine.max_num_batched_tokens
    return budget / model.prefill_seconds(budget, 0, budget, 0, 0.0)


def _rounded(rule: str, value: float) -> float | int:
    """A threshold as the rule takes it: whole requests or tokens (at least 1), a factor of 3 digits."""
    return max(1, round(value)) if rule.startswith("queued") else float(f"{value:.3g}")


def threshold_ladder(scenario: Scenario, config: AdviseConfig, profile: str | None, rule: str) -> list[Any]:
    """The thresholds ``rule`` is searched over: :attr:`AdviseConfig.thresholds` log-spaced values
    spanning :data:`THRESHOLD_SPAN` around its centre (queued tokens: the TTFT SLO x the engine's
    prefill throughput; queued requests: ``max_num_seqs``; the SLO factor: 1), ascending, distinct;
    ``[None]`` for ``deadline``, which has none."""
    if rule not in THRESHOLD_SPAN:
        return [None]
    if rule == "queued-tokens":
        slo_s = config.slos.get("ttft", config.slos.get("e2el", 1000.0)) / 1000.0
        centre = slo_s * prefill_tokens_per_s(scenario, profile)
    elif rule == "queued-reqs":
        centre = float(scenario.engine.max_num_seqs)
    else:
        centre = 1.0
    low, high = THRESHOLD_SPAN[rule]
    values = np.geomspace(centre * low, centre * high, config.thresholds)
    return sorted({_rounded(rule, float(v)) for v in values})


def rule_text(rule: str, value: Any) -> str:
    """The rule's text at threshold ``value`` (``"slo+deadline"``, 0.5 -> ``"slo:0.5+deadline"``)."""
    if value is None:
        return rule
    head, _, tail = rule.partition("+")
    text = f"{head}:{value:g}" if isinstance(value, float) else f"{head}:{value}"
    return str(AdmissionRule.parse(text + (f"+{tail}" if tail else "")))


def rule_kind(name: str) -> str:
    """The rule of :data:`ADMISSION_RULES` a setting's admission rule is (``"none"`` without one)."""
    parsed = AdmissionRule.parse(split_setting(name)[2])
    if parsed.slo_factor is not None and parsed.deadline:
        return "slo+deadline"
    if parsed.slo_factor is not None and parsed.tpot:
        return "slo+tpot"
    for kind, on in (("queued-tokens", parsed.queued_tokens is not None),
                     ("queued-reqs", parsed.queued_reqs is not None),
                     ("slo", parsed.slo_factor is not None), ("deadline", parsed.deadline)):
        if on:
            return kind
    return "none"


def _beyond(rule: str, values: Sequence[Any], upper: bool) -> Any:
    """One more threshold past the upper (or lower) edge of ``values``, at the ladder's ratio; ``None``
    when there is none (a cap below 1, or rounding onto a value already served)."""
    ratio = values[-1] / values[-2] if upper else values[1] / values[0]
    value = _rounded(rule, values[-1] * ratio if upper else values[0] / ratio)
    if value in values or (rule.startswith("queued") and value < 1) or value <= 0:
        return None
    return value


def _rule_search(server: _Server, rows: dict[str, dict[str, Any]], base: str, rule: str,
                 ladder: Sequence[Any], tuning: Sequence[int], key: str) -> dict[str, Any]:
    """``rule`` on setting ``base`` over the thresholds of ``ladder`` on the tuning windows, extended
    beyond an edge while the best lies there (beating its neighbour beyond the tie margin); the rows
    join ``rows``. Returns what was searched: thresholds, the best, the extensions."""
    served: dict[Any, str] = {}

    def serve(value: Any) -> None:
        name = with_admission(base, rule_text(rule, value))
        if name not in rows:
            rows[name] = {**_row(name, server.windows(name, tuning, False)), "stage": "thresholds"}
        served[value] = name

    for value in ladder:
        serve(value)
    extended = 0
    while ladder[0] is not None and extended < MAX_EXTENSIONS:
        values = sorted(served)
        best = best_of(rows, [served[v] for v in values], key)
        at = values.index(next(v for v in values if served[v] == best))
        edge = {0: (False, 1), len(values) - 1: (True, len(values) - 2)}.get(at)
        if edge is None:
            break
        upper, neighbour = edge
        if tuned(rows[best], key) <= (1 + TIE) * tuned(rows[served[values[neighbour]]], key):
            break  # the edge is no better than the next value in: nothing to look for beyond it
        value = _beyond(rule, values, upper)
        if value is None:
            break
        serve(value)
        extended += 1
    best = best_of(rows, list(served.values()), key)
    return {"base": base, "rule": rule, "thresholds": sorted(v for v in served if v is not None) or None,
            "extended": extended, "best": best}


def _at(base: str, budget: int, engine_budget: int) -> str:
    return base if budget == engine_budget else with_budget(base, budget)


def _shortlist(rows: Mapping[str, Mapping[str, Any]], config: AdviseConfig, key: str) -> list[str]:
    """What the held-out windows serve: the best ``shortlist`` settings without a rule and the default;
    with rules, the best ``shortlist`` settings with one, the best of each rule, and the best with a
    vLLM cap (fcfs's and ours); each by its figures on the tuning windows."""
    def ranked(names: Sequence[str]) -> list[str]:
        return sorted(names, key=lambda n: -tuned(rows[n], key))

    plain = ranked([n for n in rows if not has_rule(n)])
    short = [n for n in plain if n != DEFAULT_SCHEDULER][: config.shortlist] + [DEFAULT_SCHEDULER]
    ruled = ranked([n for n in rows if has_rule(n)])
    if ruled:
        short += ruled[: config.shortlist]
        for kind in config.rules:
            of_kind = [n for n in ruled if rule_kind(n) == kind]
            if of_kind:
                short.append(best_of(rows, of_kind, key))
        capped = roles(rows, DEFAULT_SCHEDULER, DEFAULT_SCHEDULER, DEFAULT_SCHEDULER, key, names=ruled)
        short += [capped[r] for r in ("vllm-queue-cap", "ours-with-vllm-cap") if r in capped]
    return list(dict.fromkeys(short))


def search(
    scenario: Scenario,
    config: AdviseConfig,
    profile: str | None,
    names: Sequence[str],
    *,
    progress: Callable[[int], None] | None = None,
    windows: tuple[Sequence[int], Sequence[int]] | None = None,
) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """The search of the module docstring: every setting of ``names`` (:func:`checked_names`) on the
    tuning windows; with :attr:`AdviseConfig.rules`, every rule over its thresholds on the best
    :attr:`~AdviseConfig.admission_bases` of them and fcfs at each budget (:func:`_rule_search`); then
    the shortlist (:func:`_shortlist`) on the held-out windows. ``windows``: (tuning seeds, held-out
    seeds), :func:`split_windows`'s by default.

    Returns name -> row (:func:`_row`), rows on every window first (best held-out figure of
    :attr:`~AdviseConfig.rank_by` first), then the others (best tuning figure first); and what each
    rule searched on each setting (thresholds, extensions, best).
    """
    tuning, held = windows or split_windows(scenario, config)
    key = config.rank_by
    server = _Server(scenario, config, profile, progress)
    rows: dict[str, dict[str, Any]] = {}
    for name in names:
        rows[name] = {**_row(name, server.windows(name, tuning, False)), "stage": "grid"}
    searched: list[dict[str, Any]] = []
    if config.rules:
        engine_budget = scenario.engine.max_num_batched_tokens
        plain = sorted(rows, key=lambda n: -tuned(rows[n], key))
        fcfs = [_at(DEFAULT_SCHEDULER, b, engine_budget) for b in _budgets(scenario, config)]
        ladders = {rule: threshold_ladder(scenario, config, profile, rule) for rule in config.rules}
        for base in dict.fromkeys([*plain[: config.admission_bases], *fcfs]):
            for rule in config.rules:
                searched.append(_rule_search(server, rows, base, rule, ladders[rule], tuning, key))
    short = _shortlist(rows, config, key)
    for name in short:
        rows[name] = {**_row(name, rows[name]["windows"] + server.windows(name, held, True)),
                      "stage": "every window"}
    full = sorted(short, key=lambda n: -(rows[n][key] or 0.0))
    others = sorted((n for n in rows if n not in short), key=lambda n: -tuned(rows[n], key))
    return {n: rows[n] for n in full + others}, searched


def light_load(
    scenario: Scenario, config: AdviseConfig, profile: str | None, name: str, seeds: Sequence[int]
) -> dict[str, Any]:
    """What setting ``name``'s admission rule costs at a light load: ``name`` with and without its rule
    on ``seeds`` at the scenario's rate / :attr:`AdviseConfig.light_load` (``episode.rate_scale``
    divided by it): each one's attainment, goodput, rejected and false-admit fractions, and the
    attainment ratio with the rule over without (1: it costs nothing there)."""
    rate = scenario.episode.rate_scale / config.light_load
    lighter = load_scenario(scenario, {"episode": {"rate_scale": rate}})
    plain = with_admission(name, None)
    keys = ("slo_attainment", "request_goodput", "rejected_fraction", "false_admit_fraction")
    figures = {label: {k: _means(_window_metrics(lighter, n, seeds, profile, config.slos))[k] for k in keys}
               for label, n in (("with_rule", name), ("without_rule", plain))}
    with_rule, without = figures["with_rule"], figures["without_rule"]
    return {
        "setting": name,
        "admission": str(AdmissionRule.parse(split_setting(name)[2])),
        "without_rule_setting": plain,
        "rate_scale": rate,
        "rate_divisor": config.light_load,
        "windows": list(seeds),
        **figures,
        "rejected_fraction": with_rule["rejected_fraction"],
        "attainment_ratio": (with_rule["slo_attainment"] / without["slo_attainment"]
                             if without["slo_attainment"] else None),
    }


def window_facts(scenario: Scenario, seeds: Sequence[int]) -> tuple[dict[str, float], float]:
    """What the windows offer whatever serves them, each window built once: the share of prompt tokens
    a perfect prefix cache would serve and one of the engine's KV size, evicting least recently used
    (what any scheduler could capture at best), means over the windows; and the requests per second
    arriving (mean: no scheduler's goodput is above it)."""
    block = scenario.engine.block_size
    perfect, lru, rates = [], [], []
    for seed in seeds:
        w = scenario.episode_workload(int(seed))
        total = sum(r.prompt_len for r in w)
        perfect.append(w.cached_prompt_tokens(block) / total)
        lru.append(w.cached_prompt_tokens(block, capacity_tokens=scenario.kv_capacity_tokens) / total)
        times = [r.arrival_time for r in w]
        span = max(times) - min(times)
        rates.append(len(times) / span if span > 0 else math.inf)
    reuse = {"perfect_cache": float(np.mean(perfect)), "engine_sized_cache": float(np.mean(lru))}
    return reuse, float(np.mean(rates))


def what_if(
    scenario: Scenario, names: Sequence[str], config: AdviseConfig, profile: str | None,
    seeds: Sequence[int] | None = None,
) -> dict[str, dict[str, Any]]:
    """Goodput of ``names`` on ``seeds`` (default: every seed) with twice the KV cache, and behind the
    prefix router at 2 and 4 replicas (the same windows, arriving as they do; each replica the
    scenario's engine; the cluster simulator applies no admission rule: a setting's replicas are
    served without its rule, ``replicas_without_rule``)."""
    from feather_env.cluster_sim import ClusterSim
    from scheduler_runtime.router import make_router

    seeds = list(seeds or config.seeds)
    keys = ("request_goodput", "output_throughput", "mean_ttft_ms", "mean_tpot_ms", "prefix_hit_rate")
    out: dict[str, dict[str, Any]] = {}
    bigger = load_scenario(scenario, {"engine": {"kv_cache_gib": 2 * scenario.engine.kv_cache_gib}})
    for name in names:
        kv = _means(_window_metrics(bigger, name, seeds, profile, config.slos))
        entry: dict[str, Any] = {"2x_kv_cache": {k: kv[k] for k in keys}}
        for n in (2, 4):
            cluster = ClusterSim(n, scenario.engine_config(), scheduler=with_admission(name, None),
                                 profile=profile)
            windows = [
                cluster.run(
                    scenario.episode_workload(int(seed)), make_router("prefix"), goodput=config.slos
                ).metrics
                for seed in seeds
            ]
            entry[f"{n}_replicas"] = {k: float(np.mean([w[k] for w in windows])) for k in keys}
        entry["replicas_without_rule"] = has_rule(name)
        out[name] = entry
    return out


# -- serving the recommendation -------------------------------------------------------------------
def serve_command(scenario: Scenario, name: str, slos: Mapping[str, float] | None = None) -> str:
    """The ``feather-serve`` command that serves ``name`` on the scenario's engine, on this machine (its
    compute dtype and the KV bytes that hold the scenario's KV tokens in it), with the scenario's
    scheduler knobs where they are not the name's own (as the simulator served it), and for an
    admission rule that reads them (``slo``, ``deadline``) the SLOs ``slos`` (``--slo``)."""
    e = scenario.engine
    args = ["feather-serve", "--scheduler", name, "--max-num-seqs", str(e.max_num_seqs),
            "--kv-cache-memory-bytes", str(e.kv_cache_memory_bytes), "--dtype", e.compute_dtype]
    if slos and AdmissionRule.parse(split_setting(name)[2]).needs_slos:
        args += ["--slo", " ".join(f"{k}:{v:g}" for k, v in slos.items())]
    if split_setting(name)[1] is None:
        args += ["--max-num-batched-tokens", str(e.max_num_batched_tokens)]
    config, knobs = SchedulerConfig.for_name(name), scenario.scheduler
    if not config.passthrough:  # vLLM's own fcfs takes no knob
        if knobs.max_wait != config.max_wait:
            args += ["--max-wait", "none" if knobs.max_wait is None else f"{knobs.max_wait:g}"]
        if knobs.chunk_size != DEFAULT_CHUNK_SIZE:  # a policy's own is the scenario's (candidate_names)
            args += ["--chunk-size", str(knobs.chunk_size)]
    return shlex.join(args)


def confirm(
    scenario: Scenario,
    names: Sequence[str],
    config: AdviseConfig,
    *,
    backend: Any = None,
    log: Callable[[str], None] = print,
    seed: int | None = None,
) -> dict[str, Any]:
    """Serve ``names`` on the real engine on window ``seed`` (default: the first seed), alternating,
    ``config.repeats`` runs each, admission rules reading ``config.slos``: each one's goodput and SLO
    attainment per run and their medians, with the figures of its median run."""
    from feather_env.evaluation.inprocess import InProcessConfig, evaluate_in_process

    seed = config.seeds[0] if seed is None else seed
    workload = scenario.episode_workload(seed)
    cfg = InProcessConfig(
        schedulers=tuple(dict.fromkeys(names)),
        engine=scenario.engine_config(),
        chunk_size=scenario.scheduler.chunk_size,
        max_wait=scenario.scheduler.max_wait,
        isolated_probes=False,
        repeats=config.repeats,
        goodput=dict(config.slos),
    )
    runs, _ = evaluate_in_process(workload, cfg, progress=False, log=log, backend=backend)
    out: dict[str, Any] = {"seed": seed, "repeats": config.repeats, "runs": {}}
    for name, run in zip(cfg.schedulers, runs, strict=True):
        m = serving_metrics(run.timelines, goodput=config.slos)
        repeats = run.extra.get("repeats", {})
        per = repeats.get("request_goodput") or [m["request_goodput"]]
        attained = repeats.get("slo_attainment") or [m["slo_attainment"]]
        out["runs"][name] = {
            "request_goodput_per_run": per,
            "slo_attainment_per_run": attained,
            "output_throughput_per_run": repeats.get("output_throughput") or [m["output_throughput"]],
            **{k: m.get(k) for k in ROW_METRICS},
            "request_goodput": statistics.median(per),
            "slo_attainment": statistics.median(attained),
        }
    return out


def confirmed_settings(runs: Mapping[str, Mapping[str, Any]], served_roles: Mapping[str, str]
                       ) -> list[dict[str, Any]]:
    """``confirm.settings``: one entry per role (``served_roles``: role -> setting) with what the engine
    measured of its setting (medians over its runs; the fractions of the median run)."""
    return [{"role": role, "name": name,
             "measured_attainment": runs[name]["slo_attainment"],
             "measured_goodput": runs[name]["request_goodput"],
             "rejected_fraction": runs[name]["rejected_fraction"],
             "false_admit_fraction": runs[name]["false_admit_fraction"],
             "runs": len(runs[name]["request_goodput_per_run"])}
            for role, name in served_roles.items()]


def checked_names(scenario: Scenario, config: AdviseConfig) -> list[str]:
    """Every input of :func:`advise` checked, before an engine starts: the settings it searches without
    admission (:func:`candidate_names`, returned), a given profile (loaded), and the scenario's engine
    where the probe or the confirmation will start it (:meth:`EngineConfig.check_startable`)."""
    names = candidate_names(scenario, config)
    if config.profile is not None:
        from feather_env.calibrate import load_profile

        load_profile(config.profile)
    if config.profile is None or config.confirm:  # the probe or the confirmation starts the engine
        scenario.engine_config().check_startable()
    return names


def simulated_windows(scenario: Scenario, config: AdviseConfig, settings: int,
                      windows: tuple[Sequence[int], Sequence[int]] | None = None) -> int:
    """The windows the search serves in the simulator for ``settings`` settings without admission: each
    on the tuning windows, then the shortlist and the default on the held-out ones; with admission
    rules, at least (before extensions beyond an edge) every rule's thresholds on its settings on the
    tuning windows, and at most the shortlist of ruled settings on the held-out ones."""
    tuning, held = windows or split_windows(scenario, config)
    plain = min(config.shortlist, settings - 1) + 1
    if not config.rules:
        return settings * len(tuning) + plain * len(held)
    bases = min(config.admission_bases, settings) + len(_budgets(scenario, config))
    per_base = sum(1 if r == "deadline" else config.thresholds for r in config.rules)
    ruled = config.shortlist + len(config.rules) + 2
    return ((settings + bases * per_base) * len(tuning) + (plain + ruled) * len(held))


def plan(scenario: Scenario, config: AdviseConfig) -> str:
    """What :func:`advise` will serve for ``scenario`` (``evaluate.py advise --check``), every input
    checked as it checks them (:func:`checked_names`): the SLOs, how the profile is chosen, the
    settings, rules and windows of the search, the what-ifs and what the engine confirms."""
    names = checked_names(scenario, config)
    tuning, held = split_windows(scenario, config)
    slos = ", ".join(f"{k} {v:g} ms" for k, v in config.slos.items())
    if config.profile is not None:
        profile = f"profile: {config.profile} (given)"
    else:
        window = probe_overrides(scenario, config.probe_window_s).get("episode", {}).get("window_s")
        profile = (f"profile: chosen by a probe on the real engine first (episode seed "
                   f"{config.first_seed - 1}, " + (f"a {window:g} s window" if window is not None
                                                     else "one whole episode")
                   + f"; {', '.join(probe_names(scenario))}): the best of configs/profiles, refitted on the "
                   f"probe above {MAX_PROFILE_ERROR:.0%} error")
    shortlist = min(config.shortlist, len(names) - 1)
    confirm_what = (f"the default and the simulator's best {config.confirm_top} (the engine picks)"
                    if config.confirm_top > 1 else "the recommendation and the default")
    if config.rules:
        confirm_what += (", the best setting without admission, fcfs with the best vLLM cap and the best "
                         "of ours with one")
    engine_budget = scenario.engine.max_num_batched_tokens
    bases = list(dict.fromkeys(split_budget(n)[0] for n in names))
    budgets = sorted({split_budget(n)[1] or engine_budget for n in names})
    count = simulated_windows(scenario, config, len(names), (tuning, held))
    held_text = (f"held-out window(s) {', '.join(map(str, held))}" if held
                 else "no other window: nothing was held out")
    admission = (f"admission: {', '.join(config.rules)} over {config.thresholds} thresholds each (extended "
                 f"beyond an edge while the best lies there), on the best {config.admission_bases} "
                 f"settings and fcfs at each budget; ranked by SLO attainment" if config.rules
                 else "admission: not searched; ranked by goodput")
    return "\n".join([
        f"advise on {scenario.name}, goodput SLOs {slos}",
        profile,
        f"search: {len(names)} settings on window(s) {', '.join(map(str, tuning))}, then the best "
        f"{shortlist} and the default on {held_text}: "
        + (f"{count} simulated windows" if not config.rules else f"about {count} simulated windows"),
        f"settings: {len(bases)} schedulers ({', '.join(bases)}) x {len(budgets)} per-step token budgets "
        f"({', '.join(map(str, budgets))}; {engine_budget}: the engine's)",
        admission,
        "what-ifs: " + ("2x KV cache, 2 and 4 replicas behind the prefix router" if config.what_if
                        else "none"),
        "confirm: " + (f"on the real engine, window {(held or tuning)[0]}: {confirm_what}, {config.repeats} "
                       "runs each" if config.confirm else "none (the simulator's advice alone)"),
    ])


def advise(
    scenario: Scenario,
    config: AdviseConfig,
    out_dir: str | Path,
    *,
    backend: Any = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The whole advice (module docstring): written to ``out_dir`` (``advice.json``, ``advice.md``,
    ``goodput.png``) and returned.

    Raises:
        ConfigError: a bad scheduler, budget or profile (before anything is served).
        EngineError: a request not served exactly once on the engine (probe, confirm).
    """
    from tqdm import tqdm

    out = Path(out_dir)
    t0 = time.perf_counter()
    names = checked_names(scenario, config)  # every input checked before an engine starts
    default, key = DEFAULT_SCHEDULER, config.rank_by
    if config.profile is not None:
        profile_info: dict[str, Any] = {
            "profile": config.profile,
            "error": None,
            "refitted": False,
            "checked": False,
        }
    else:
        log("checking the simulator against this machine (a short probe on the real engine) ...")
        probe = check_profile(scenario, out, seed=config.first_seed - 1, window_s=config.probe_window_s,
                              backend=backend, log=log)
        profile_info = {**probe, "checked": True}
    profile = profile_info["profile"]
    log(
        f"simulator profile: {profile}"
        + (
            f" (probe error {profile_info['error']:.1%})"
            if profile_info.get("error") is not None
            else " (given)"
        )
    )
    tuning, held = split_windows(scenario, config)
    reported = held or tuning
    total = simulated_windows(scenario, config, len(names), (tuning, held))
    with tqdm(total=total, desc="advise: simulated windows", disable=not progress, unit="window") as bar:
        rows, searched = search(scenario, config, profile, names, progress=bar.update, windows=(tuning, held))
    reuse, offered = window_facts(scenario, reported)
    rec = recommend(rows, default, config.noise, offered, reuse, key)
    rec["serve_command"] = serve_command(scenario, rec["scheduler"], config.slos)
    best = rec["best_searched"]
    full = [n for n, r in rows.items() if r["stage"] == "every window"]
    shown = list(dict.fromkeys([*distinct(rows, full)[: config.top], rec["scheduler"], best, default]))
    payload: dict[str, Any] = {
        "scenario": scenario.name,
        "scenario_source": scenario.source,
        "slos_ms": dict(config.slos),
        "config": config.to_dict(),
        "machine": machine_info(),
        "profile": profile_info,
        "windows": {"tuning": list(tuning), "held_out": list(held),
                    "note": windows_note(config, tuning, held)},
        "recommendation": rec,
        "default": {
            "scheduler": default,
            "max_num_batched_tokens": scenario.engine.max_num_batched_tokens,
            "what": "vLLM's own fcfs scheduler at the engine's token budget",
            "serve_command": serve_command(scenario, default),
            **_brief(rows[default]),
        },
        "shown": shown,
        "candidates": rows,
        "admission_search": {"rules": list(config.rules), "ranked_by": key, "searched": searched},
        "offered_request_rate": offered,
        "prefix_reuse_available": reuse,
        "hindsight": hindsight(rows, best_of(rows, full, key), key),
    }
    priced = rec["scheduler"] if has_rule(rec["scheduler"]) else rec.get("best_with_admission")
    if priced is not None:
        log(f"what {priced}'s admission rule costs at 1/{config.light_load:g} of the load ...")
        payload["light_load"] = light_load(scenario, config, profile, priced, reported)
    if config.what_if:
        log("what-ifs: 2x KV cache, 2 and 4 replicas behind the prefix router ...")
        payload["what_if"] = what_if(
            scenario, list(dict.fromkeys([rec["scheduler"], default])), config, profile, reported
        )
    if config.confirm:
        served_roles = roles(rows, rec["scheduler"], default, best, key)
        top = confirm_names(rows, rec["scheduler"], default, config.confirm_top, key)
        served = list(dict.fromkeys([*served_roles.values(), *top]))
        log(
            f"confirming on the real engine: {', '.join(served)}, {config.repeats} runs each, "
            f"window {reported[0]} ..."
        )
        measured = confirm(scenario, served, config, backend=backend, log=log, seed=reported[0])
        if config.confirm_top > 1:  # the engine has the last word among the simulator's best
            chosen, why = engine_choice(measured["runs"], default, config.noise, key)
            measured["simulator_recommendation"] = rec["scheduler"]
            if chosen != rec["scheduler"]:
                rec = {**recommendation(rows, chosen, default, best, why, key),
                       "serve_command": serve_command(scenario, chosen, config.slos)}
            else:
                rec = {**rec, "why": why}
            rec["decided_by"] = "engine"
            payload["recommendation"] = rec
            served_roles["recommendation"] = rec["scheduler"]
        mine, theirs = measured["runs"][rec["scheduler"]], measured["runs"][default]
        measured["measured_goodput"] = mine["request_goodput"]
        measured["measured_goodput_ratio"] = (
            mine["request_goodput"] / theirs["request_goodput"] if theirs["request_goodput"] else None
        )
        measured["measured_attainment"] = mine["slo_attainment"]
        window = next(w for w in rows[rec["scheduler"]]["windows"] if w["seed"] == reported[0])
        measured["predicted_goodput_this_window"] = window["request_goodput"]
        measured["predicted_attainment_this_window"] = window["slo_attainment"]
        measured["predicted_error"] = (
            abs(window["request_goodput"] - mine["request_goodput"]) / mine["request_goodput"]
            if mine["request_goodput"]
            else None
        )
        measured["settings"] = confirmed_settings(measured["runs"], served_roles)
        payload["confirm"] = measured
    payload["wall_s"] = time.perf_counter() - t0
    write_advice(out, payload)
    return payload


def _brief(row: Mapping[str, Any]) -> dict[str, Any]:
    return {k: row.get(k) for k in ROW_METRICS}
