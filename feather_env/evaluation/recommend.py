"""What ``evaluate.py advise`` concludes from the rows its search served: the recommendation rule, the
settings the engine confirms and the engine's own pick among them, and the hindsight headroom.

Every function here reads rows as :func:`feather_env.evaluation.advise.search` returns them (name ->
the means of ``vllm bench serve``'s metrics over windows, the windows themselves, and the ``stage``
they were served in) and serves nothing: the rules can be read, tested and rerun on a saved
``advice.json`` without a simulator or an engine.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from typing import Any

import numpy as np

from scheduler_runtime.schedulers import MAX_TOKEN_BUDGET, SchedulerConfig, split_budget

__all__ = ["TIE", "confirm_names", "engine_choice", "hindsight", "recommend", "recommendation", "simplicity"]

#: Settings whose goodput is within this fraction of the best are equally good: the simplest is chosen.
TIE = 0.005


def _ratio(a: float | None, b: float | None) -> float:
    """Goodput ``a`` over ``b`` (``None`` is 0; both 0 is 1; over 0 is infinite)."""
    a, b = a or 0.0, b or 0.0
    return 1.0 if a == b == 0 else (a / b if b > 0 else math.inf)


def _ratios(row: Mapping[str, Any], default: Mapping[str, Any]) -> list[float]:
    """Per window: the row's goodput over the default's."""
    return [_ratio(w["request_goodput"], d["request_goodput"])
            for w, d in zip(row["windows"], default["windows"], strict=True)]


def hindsight(rows: Mapping[str, Mapping[str, Any]], best: str) -> dict[str, Any]:
    """How much a choice per window could still win: per window, the best goodput of any setting
    served on every window over the best constant setting's; the mean and the largest."""
    full = [r for r in rows.values() if r["stage"] == "every window"]
    gains = [_ratio(max(r["windows"][i]["request_goodput"] or 0.0 for r in full), w["request_goodput"])
             for i, w in enumerate(rows[best]["windows"])]
    finite = [g for g in gains if math.isfinite(g)]
    return {
        "mean_gain": float(np.mean(finite)) if finite else None,
        "max_gain": float(np.max(finite)) if finite else None,
        "per_window": gains,
        "settings": len(full),
    }


def simplicity(name: str) -> tuple[int, int, int]:
    """Sort key of equally good settings, simplest first: vLLM's own fcfs, a baseline ordering, a
    document cap (the larger, the less it holds back), a policy file; then the larger token budget."""
    base, budget = split_budget(name)
    cap = SchedulerConfig.for_name(base).group_cap
    if base == "fcfs":
        kind = 0
    elif not base.startswith(("group-", "feather")):
        kind = 1
    else:
        kind = 2 if cap is not None else 3
    return kind, -(cap or 0), -(budget or MAX_TOKEN_BUDGET)


def recommend(
    rows: Mapping[str, Mapping[str, Any]],
    default: str,
    noise: float,
    offered: float,
    reuse: Mapping[str, float],
) -> dict[str, Any]:
    """The best setting if it beats the default beyond ``noise`` (its median window's goodput ratio
    above ``1 + noise``, and no window below ``1 - noise``), else the default with the reason."""
    full = [n for n, r in rows.items() if r["stage"] == "every window"]
    top = max(rows[n]["request_goodput"] or 0.0 for n in full)
    # among the settings within TIE of the best, the simplest (vLLM's own fcfs first, the largest budget)
    best = min((n for n in full if (rows[n]["request_goodput"] or 0.0) >= (1 - TIE) * top), key=simplicity)
    ratios = _ratios(rows[best], rows[default])
    median = statistics.median(ratios)
    d = rows[default]
    chosen, why = (
        best,
        (
            f"{best} meets the SLOs for {median:.2f}x the requests per second of vLLM's default "
            f"in the median window (windows: {min(ratios):.2f}-{max(ratios):.2f}x)"
        ),
    )
    if best == default or not (median > 1 + noise and min(ratios) >= 1 - noise):
        chosen = default
        if (d["request_goodput"] or 0) >= (1 - noise) * offered:
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
                f"nothing beats vLLM's default beyond noise ({noise:.0%}): the best setting, {best}, is "
                f"{median:.2f}x its goodput in the median window (windows {min(ratios):.2f}-"
                f"{max(ratios):.2f}x)"
            )
    return recommendation(rows, chosen, default, best, why)


def recommendation(
    rows: Mapping[str, Mapping[str, Any]], chosen: str, default: str, best: str, why: str
) -> dict[str, Any]:
    """The ``recommendation`` record of ``chosen`` with its simulated figures."""
    r, d = rows[chosen], rows[default]
    chosen_ratios = _ratios(r, d)
    return {
        "scheduler": chosen,
        "max_num_batched_tokens": split_budget(chosen)[1],
        "predicted_goodput": r["request_goodput"],
        "predicted_goodput_ratio": (
            r["request_goodput"] / d["request_goodput"] if d["request_goodput"] else None
        ),
        "ratio_per_window": chosen_ratios,
        "ratio_median": statistics.median(chosen_ratios),
        "ratio_range": [min(chosen_ratios), max(chosen_ratios)],
        "best_searched": best,
        "why": why,
    }


def confirm_names(
    rows: Mapping[str, Mapping[str, Any]], recommended: str, default: str, top: int
) -> list[str]:
    """What ``--confirm`` serves on the engine: the simulator's ``top`` distinct settings by goodput
    (of those served on every window; settings the simulator serves identically, e.g. document caps
    where nothing is shared, count once, by their simplest name), the recommendation if it is not
    among them, and the default."""
    full = [n for n, r in rows.items() if r["stage"] == "every window"]
    alike: dict[tuple[Any, ...], list[str]] = {}
    for n in full:
        alike.setdefault(_served_alike(rows[n]), []).append(n)
    distinct = sorted((min(names, key=simplicity) for names in alike.values()),
                      key=lambda n: -(rows[n]["request_goodput"] or 0.0))
    return list(dict.fromkeys([recommended, *distinct[:top], default]))


def _served_alike(row: Mapping[str, Any]) -> tuple[Any, ...]:
    """A setting's simulated figures on every window: equal for settings the simulator served alike."""
    return tuple(
        tuple(round(w.get(k) or 0.0, 6) for k in ("request_goodput", "output_throughput", "mean_ttft_ms",
                                                  "mean_tpot_ms"))
        for w in row["windows"]
    )


def engine_choice(runs: Mapping[str, Mapping[str, Any]], default: str, noise: float) -> tuple[str, str]:
    """The engine's pick among the confirmed settings (``runs``: name -> its median ``request_goodput``):
    the simplest of those within ``noise`` of the best measured, or the default when that does not
    beat the default's goodput by more than ``noise``. Returns (name, why)."""
    good = {n: r["request_goodput"] or 0.0 for n, r in runs.items()}
    top = max(good.values())
    best = min((n for n, g in good.items() if g >= (1 - noise) * top), key=simplicity)
    base = good[default]
    if best != default and (base == 0 and good[best] > 0 or good[best] > (1 + noise) * base):
        ratio = f"{good[best] / base:.2f}x" if base else "more than"
        return best, (
            f"measured on the engine: {best} meets the SLOs for {ratio} the requests per second of "
            f"vLLM's default ({good[best]:.2f} against {base:.2f}), the simplest of the settings within "
            f"{noise:.0%} of the best measured ({max(good, key=good.get)}, {top:.2f})"
        )
    return default, (
        f"measured on the engine: no confirmed setting beats vLLM's default beyond noise ({noise:.0%}): "
        f"the best, {max(good, key=good.get)}, served {top:.2f} requests/s within the SLOs against {base:.2f}"
    )


