"""What ``evaluate.py advise`` concludes from the rows its search served: the recommendation rule, the
settings the engine confirms and the engine's own pick among them, and the hindsight headroom.

Every function here reads rows as :func:`feather_env.evaluation.advise.search` returns them (name ->
the means of ``vllm bench serve``'s metrics over the reported windows, ``tuning``: the same over the
tuning windows, the windows themselves, each marked ``held_out`` or not, and the ``stage`` they were
served in) and serves nothing: the rules can be read, tested and rerun on a saved ``advice.json``
without a simulator or an engine.

Settings are chosen on the tuning windows and judged on the held-out ones (on the tuning windows
when nothing was held out). ``key`` is the figure they are ranked by: ``request_goodput`` (good
requests per second), or ``slo_attainment`` (good requests over submitted ones) when the search
includes admission rules, since a rule that rejects requests can raise goodput per second of the
shorter run without serving more requests well.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from scheduler_runtime.admission import AdmissionRule, split_admission
from scheduler_runtime.schedulers import MAX_TOKEN_BUDGET, SchedulerConfig, split_budget

__all__ = [
    "TIE",
    "best_of",
    "confirm_names",
    "distinct",
    "engine_choice",
    "has_rule",
    "hindsight",
    "recommend",
    "recommendation",
    "roles",
    "simplicity",
    "split_setting",
    "tuned",
]

#: Settings whose figure is within this fraction of the best are equally good: the simplest is chosen.
TIE = 0.005
#: What a ratio of each ranking figure counts, for the reasons given.
_WHAT = {"request_goodput": "the requests per second", "slo_attainment": "the share of requests"}


def split_setting(name: str) -> tuple[str, int | None, str | None]:
    """``"group-cap-8@256~slo:0.5"`` -> ``("group-cap-8", 256, "slo:0.5")`` (``None`` for what it lacks)."""
    served, rule = split_admission(name)
    base, budget = split_budget(served)
    return base, budget, rule


def has_rule(name: str) -> bool:
    """Whether setting ``name`` carries an admission rule other than ``none``."""
    rule = split_setting(name)[2]
    return rule is not None and not AdmissionRule.parse(rule).is_none


def _ratio(a: float | None, b: float | None) -> float:
    """``a`` over ``b`` (``None`` is 0; both 0 is 1; over 0 is infinite)."""
    a, b = a or 0.0, b or 0.0
    return 1.0 if a == b == 0 else (a / b if b > 0 else math.inf)


def _reported(row: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The windows a row is judged on: the held-out ones, or every one when nothing was held out."""
    return [w for w in row["windows"] if w.get("held_out")] or list(row["windows"])


def _ratios(row: Mapping[str, Any], other: Mapping[str, Any], key: str = "request_goodput") -> list[float]:
    """Per reported window: the row's ``key`` over the other's."""
    return [_ratio(w.get(key), d.get(key)) for w, d in zip(_reported(row), _reported(other), strict=True)]


def tuned(row: Mapping[str, Any], key: str) -> float:
    """The row's ``key`` on the tuning windows (its mean when it has no tuning figures)."""
    return (row.get("tuning") or row).get(key) or 0.0


def _wins(ratios: Sequence[float], noise: float) -> bool:
    """A win beyond noise: the median window's ratio above ``1 + noise``, no window below ``1 - noise``."""
    return statistics.median(ratios) > 1 + noise and min(ratios) >= 1 - noise


def _span(ratios: Sequence[float], what: str, of: str) -> str:
    """``"1.32x the share of requests of X's in the median window (windows 1.00-1.65x)"``."""
    median, low, high = statistics.median(ratios), min(ratios), max(ratios)
    return f"{median:.2f}x {what} of {of} in the median window (windows {low:.2f}-{high:.2f}x)"


def hindsight(rows: Mapping[str, Mapping[str, Any]], best: str,
              key: str = "request_goodput") -> dict[str, Any]:
    """How much a choice per window could still win: per window, the best ``key`` of any setting
    served on every window over the best constant setting's; the mean and the largest."""
    full = [r for r in rows.values() if r["stage"] == "every window"]
    gains = [_ratio(max(r["windows"][i].get(key) or 0.0 for r in full), w.get(key))
             for i, w in enumerate(rows[best]["windows"])]
    finite = [g for g in gains if math.isfinite(g)]
    return {
        "mean_gain": float(np.mean(finite)) if finite else None,
        "max_gain": float(np.max(finite)) if finite else None,
        "per_window": gains,
        "settings": len(full),
        "figure": key,
    }


def _rule_simplicity(rule: str | None) -> tuple[int, float]:
    """Sort key of admission rules, simplest first: none, vLLM's caps, ours, combinations; then the
    one that holds back the fewest requests (the larger cap, the larger SLO factor)."""
    parsed = AdmissionRule.parse(rule)
    if parsed.is_none:
        return 0, 0.0
    terms = str(parsed).count("+") + 1
    if terms > 1:
        return 3, -(parsed.slo_factor or 0.0)
    if parsed.vllm_caps:
        return 1, -float(next(iter(parsed.vllm_caps.values())))
    return 2, -(parsed.slo_factor or math.inf)


def simplicity(name: str) -> tuple[Any, ...]:
    """Sort key of equally good settings, simplest first: no admission rule before one
    (:func:`_rule_simplicity`); then vLLM's own fcfs, a baseline ordering, a document cap (the larger,
    the less it holds back), a policy file; then the larger token budget."""
    base, budget, rule = split_setting(name)
    cap = SchedulerConfig.for_name(base).group_cap
    if base == "fcfs":
        kind = 0
    elif not base.startswith(("group-", "feather")):
        kind = 1
    else:
        kind = 2 if cap is not None else 3
    return *_rule_simplicity(rule), kind, -(cap or 0), -(budget or MAX_TOKEN_BUDGET)


def best_of(rows: Mapping[str, Mapping[str, Any]], names: Sequence[str], key: str = "request_goodput") -> str:
    """The simplest of ``names`` within :data:`TIE` of the best ``key`` on the tuning windows."""
    top = max(tuned(rows[n], key) for n in names)
    return min((n for n in names if tuned(rows[n], key) >= (1 - TIE) * top), key=simplicity)


def recommend(
    rows: Mapping[str, Mapping[str, Any]],
    default: str,
    noise: float,
    offered: float,
    reuse: Mapping[str, float],
    key: str = "request_goodput",
) -> dict[str, Any]:
    """The recommendation by ``key`` (module docstring), in two steps.

    1. The best setting without an admission rule (on the tuning windows) if it beats the default
       beyond ``noise`` on the reported windows (its median window's ratio above ``1 + noise``, and no
       window below ``1 - noise``), else the default with the reason.
    2. The best setting with an admission rule, if any was searched, replaces it only when it wins
       beyond ``noise`` both over the best setting without one and over the default.
    """
    full = [n for n, r in rows.items() if r["stage"] == "every window"]
    plain = [n for n in full if not has_rule(n)]
    best = best_of(rows, plain, key)
    what = _WHAT[key]
    ratios = _ratios(rows[best], rows[default], key)
    d = rows[default]
    chosen, why = best, f"{best} meets the SLOs for " + _span(ratios, what, "vLLM's default")
    if best == default or not _wins(ratios, noise):
        chosen = default
        served_all = ((d["slo_attainment"] or 0) >= 1 - noise if key == "slo_attainment"
                      else (d["request_goodput"] or 0) >= (1 - noise) * offered)
        if served_all:
            why = (
                f"vLLM's default already meets the SLOs for {d['request_goodput']:.2f} of the "
                f"{offered:.2f} requests/s that arrive: the load is arrival-bound, no scheduler can "
                "serve more"
            )
        elif reuse["perfect_cache"] - reuse["engine_sized_cache"] > 0.5 * reuse["perfect_cache"]:
            why = (
                f"nothing beats vLLM's default beyond noise ({noise:.0%}): most prefix reuse lives beyond "
                f"the cache ({reuse['perfect_cache']:.0%} of prompt tokens with a perfect cache, "
                f"{reuse['engine_sized_cache']:.0%} with one of the engine's size); see the 2x KV what-if"
            )
        else:
            why = (
                f"nothing beats vLLM's default beyond noise ({noise:.0%}): the best setting, {best}, meets "
                f"the SLOs for {_span(ratios, what, 'the default')}"
            )
    ruled = [n for n in full if has_rule(n)]
    best_rule = best_of(rows, ruled, key) if ruled else None
    if best_rule is not None:
        over_best, over_default = _ratios(rows[best_rule], rows[best], key), _ratios(rows[best_rule], d, key)
        if _wins(over_best, noise) and _wins(over_default, noise):
            chosen, why = best_rule, (
                f"{best_rule} meets the SLOs for "
                + _span(over_best, what, f"the best setting without admission ({best})")
                + f", and for {statistics.median(over_default):.2f}x {what} of vLLM's default"
            )
        else:
            why += (f"; no admission rule wins beyond noise over the best setting without one: the best "
                    f"rule, {best_rule}, meets the SLOs for {_span(over_best, what, best)}")
    out = recommendation(rows, chosen, default, best, why, key)
    out["best_with_admission"] = best_rule
    return out


def recommendation(
    rows: Mapping[str, Mapping[str, Any]],
    chosen: str,
    default: str,
    best: str,
    why: str,
    key: str = "request_goodput",
) -> dict[str, Any]:
    """The ``recommendation`` record of ``chosen`` with its simulated figures (``ratio_*``: of ``key``
    over the default's, per reported window)."""
    r, d = rows[chosen], rows[default]
    chosen_ratios = _ratios(r, d, key)
    rule = split_setting(chosen)[2]
    return {
        "scheduler": chosen,
        "max_num_batched_tokens": split_setting(chosen)[1],
        "admission": str(AdmissionRule.parse(rule)),
        "ranked_by": key,
        "predicted_goodput": r["request_goodput"],
        "predicted_goodput_ratio": (
            r["request_goodput"] / d["request_goodput"] if d["request_goodput"] else None
        ),
        "predicted_attainment": r.get("slo_attainment"),
        "predicted_attainment_ratio": (
            r["slo_attainment"] / d["slo_attainment"] if r.get("slo_attainment") is not None
            and d.get("slo_attainment") else None
        ),
        "predicted_rejected_fraction": r.get("rejected_fraction"),
        "ratio_per_window": chosen_ratios,
        "ratio_median": statistics.median(chosen_ratios),
        "ratio_range": [min(chosen_ratios), max(chosen_ratios)],
        "best_searched": best,
        "best_without_admission": best,
        "why": why,
    }


def roles(rows: Mapping[str, Mapping[str, Any]], recommended: str, default: str, best: str,
          key: str = "request_goodput", names: Sequence[str] | None = None) -> dict[str, str]:
    """The settings ``--confirm`` serves by role: ``recommendation``, ``default``, ``no-admission`` (the
    best setting without a rule), and where the search served vLLM's caps, ``vllm-queue-cap`` (fcfs
    with the best of vLLM's caps, its budget the best) and ``ours-with-vllm-cap`` (the best of our
    schedulers with one of vLLM's caps); each the best by ``key`` of ``names`` (default: those served
    on every window)."""
    full = list(names) if names is not None else [n for n, r in rows.items() if r["stage"] == "every window"]
    out = {"recommendation": recommended, "default": default, "no-admission": best}
    capped = [n for n in full if has_rule(n)
              and AdmissionRule.parse(split_setting(n)[2]).vllm_caps
              and not AdmissionRule.parse(split_setting(n)[2]).needs_slos]
    for role, names in (("vllm-queue-cap", [n for n in capped if split_setting(n)[0] == "fcfs"]),
                        ("ours-with-vllm-cap", [n for n in capped if split_setting(n)[0] != "fcfs"])):
        if names:
            out[role] = best_of(rows, names, key)
    return out


def confirm_names(
    rows: Mapping[str, Mapping[str, Any]], recommended: str, default: str, top: int,
    key: str = "request_goodput",
) -> list[str]:
    """What ``--confirm-top`` serves on the engine: the simulator's ``top`` distinct settings by ``key``
    (of those served on every window; settings the simulator serves identically, e.g. document caps
    where nothing is shared, count once, by their simplest name), the recommendation if it is not
    among them, and the default."""
    full = [n for n, r in rows.items() if r["stage"] == "every window"]
    ranked = sorted(distinct(rows, full), key=lambda n: -tuned(rows[n], key))
    return list(dict.fromkeys([recommended, *ranked[:top], default]))


def distinct(rows: Mapping[str, Mapping[str, Any]], names: Sequence[str]) -> list[str]:
    """``names`` with the settings the simulator served alike (equal figures on every window, e.g.
    document caps where nothing is shared) counted once, by their simplest name, in the order of each
    group's first name."""
    alike: dict[tuple[Any, ...], list[str]] = {}
    for n in names:
        alike.setdefault(_served_alike(rows[n]), []).append(n)
    return [min(group, key=simplicity) for group in alike.values()]


def _served_alike(row: Mapping[str, Any]) -> tuple[Any, ...]:
    """A setting's simulated figures on every window: equal for settings the simulator served alike."""
    return tuple(
        tuple(round(w.get(k) or 0.0, 6) for k in ("request_goodput", "output_throughput", "mean_ttft_ms",
                                                  "mean_tpot_ms", "slo_attainment"))
        for w in row["windows"]
    )


def engine_choice(runs: Mapping[str, Mapping[str, Any]], default: str, noise: float,
                  key: str = "request_goodput") -> tuple[str, str]:
    """The engine's pick among the confirmed settings (``runs``: name -> its median ``key``): the
    simplest of those within ``noise`` of the best measured, or the default when that does not beat the
    default's by more than ``noise``. Returns (name, why)."""
    good = {n: r.get(key) or 0.0 for n, r in runs.items()}
    top = max(good.values())
    best = min((n for n, g in good.items() if g >= (1 - noise) * top), key=simplicity)
    base = good[default]
    what = _WHAT[key]
    if best != default and (base == 0 and good[best] > 0 or good[best] > (1 + noise) * base):
        ratio = f"{good[best] / base:.2f}x" if base else "more than"
        return best, (
            f"measured on the engine: {best} meets the SLOs for {ratio} {what} of "
            f"vLLM's default ({good[best]:.2f} against {base:.2f}), the simplest of the settings within "
            f"{noise:.0%} of the best measured ({max(good, key=good.get)}, {top:.2f})"
        )
    return default, (
        f"measured on the engine: no confirmed setting beats vLLM's default beyond noise ({noise:.0%}): "
        f"the best, {max(good, key=good.get)}, measured {top:.2f} against {base:.2f} ({key})"
    )
