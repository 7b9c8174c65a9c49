"""The advice's files (:mod:`feather_env.evaluation.advise`): ``advice.json`` for scripts, ``advice.md``
(the recommendation, the best few and the default as tables, the admission rules searched and what
the recommended one costs at light load, what else the search found, the engine's confirmation by
role) and ``goodput.png`` (every candidate's predicted goodput)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from feather_env.evaluation.recommend import simplicity
from feather_env.reporting import format_table, write_json

__all__ = ["render_markdown", "write_advice"]


def write_advice(out: Path, payload: Mapping[str, Any]) -> None:
    """Write ``advice.json``, ``advice.md`` and ``goodput.png`` of ``payload`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "advice.json", payload, quiet=True)
    (out / "advice.md").write_text(render_markdown(payload))
    _plot(payload, out / "goodput.png")


def _fmt(v: Any, spec: str) -> str:
    return "n/a" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)


def render_markdown(payload: Mapping[str, Any]) -> str:
    """``advice.md``: the recommendation, the best few and the default, and what else the search found."""
    rows, rec, slos = payload["candidates"], payload["recommendation"], payload["slos_ms"]
    slo_text = ", ".join(f"{k.upper()} <= {v:g} ms" for k, v in slos.items())
    default = payload["default"]["scheduler"]
    ranked = "SLO attainment" if rec.get("ranked_by") == "slo_attainment" else "goodput"
    windows = payload["windows"]["note"]
    lines = [
        f"# Advice for {payload['scenario']} (SLOs: {slo_text})",
        "",
        f"**Recommendation: `{rec['scheduler']}`** (admission rule: {rec.get('admission', 'none')}): "
        f"{rec['why']}.",
        "",
        f"Serve it with: `{rec['serve_command']}`",
        "",
        f"Predicted SLO attainment {_fmt(rec.get('predicted_attainment'), '.1%')} of the requests "
        f"({_fmt(payload['default'].get('slo_attainment'), '.1%')} with vLLM's default, `{default}`), "
        f"goodput {_fmt(rec['predicted_goodput'], '.2f')} req/s, "
        f"{_fmt(rec['predicted_goodput_ratio'], '.2f')}x the default's "
        f"({_fmt(payload['default']['request_goodput'], '.2f')} req/s); per window "
        f"{_fmt(rec['ratio_range'][0], '.2f')}-{_fmt(rec['ratio_range'][1], '.2f')}x its {ranked}.",
        "",
        f"Windows: {windows}. Ranked by {ranked}"
        + (" (good requests over submitted ones: a rule that sheds requests gains nothing by it)"
           if ranked == "SLO attainment" else "") + ".",
        "",
    ]
    headers = [
        "setting",
        "attainment",
        "rejected",
        "goodput req/s",
        "x default",
        "output tok/s",
        "mean TTFT ms",
        "P99 TTFT ms",
        "mean TPOT ms",
        "P99 TPOT ms",
        "mean E2EL ms",
        "P99 E2EL ms",
        "prefix hit",
    ]
    d = rows[default]["request_goodput"]
    table = []
    for name in payload["shown"]:
        r = rows[name]
        table.append(
            [
                f"`{name}`" + (" (vLLM default)" if name == default else ""),
                _fmt(r.get("slo_attainment"), ".1%"),
                _fmt(r.get("rejected_fraction"), ".1%"),
                _fmt(r["request_goodput"], ".2f"),
                _fmt(r["request_goodput"] / d if d else None, ".2f"),
                _fmt(r["output_throughput"], ".1f"),
                _fmt(r["mean_ttft_ms"], ".0f"),
                _fmt(r["p99_ttft_ms"], ".0f"),
                _fmt(r["mean_tpot_ms"], ".1f"),
                _fmt(r["p99_tpot_ms"], ".1f"),
                _fmt(r["mean_e2el_ms"], ".0f"),
                _fmt(r["p99_e2el_ms"], ".0f"),
                _fmt(r["prefix_hit_rate"], ".1%"),
            ]
        )
    lines += [
        f"## The best settings and the default (simulator: {windows})",
        "",
        format_table(headers, table),
        "",
    ]
    lines += _admission_lines(payload)
    reuse, hs = payload["prefix_reuse_available"], payload["hindsight"]
    lines += [
        "## What the search found",
        "",
        f"- Settings searched: {len(rows)} (schedulers x per-step token budgets"
        + (" x admission rules and thresholds" if payload["admission_search"]["rules"] else "")
        + f"); the best {sum(r['stage'] == 'every window' for r in rows.values())} on every window.",
        f"- Offered load: {payload['offered_request_rate']:.2f} requests/s arrive; no setting's goodput "
        "is above it.",
        f"- Prefix reuse available: {reuse['perfect_cache']:.1%} of prompt tokens with a perfect prefix "
        f"cache, {reuse['engine_sized_cache']:.1%} with an LRU cache of the engine's KV size; the "
        f"recommendation captures {_fmt(rows[rec['scheduler']]['prefix_hit_rate'], '.1%')}.",
        f"- Hindsight: choosing the best of the {hs['settings']} settings per window would be "
        f"{_fmt(hs['mean_gain'], '.3f')}x the best constant on average (at most "
        f"{_fmt(hs['max_gain'], '.3f')}x): what any adaptive or learned policy could still win.",
        f"- Simulator profile: `{payload['profile']['profile']}`"
        + (
            f", probe error {payload['profile']['error']:.1%} (worst of makespan, mean TTFT, mean TPOT)"
            if payload["profile"].get("error") is not None
            else ""
        )
        + ".",
    ]
    if "what_if" in payload:
        lines += [
            "",
            "## What if",
            "",
            format_table(
                ["setting", "as is", "2x KV cache", "2 replicas", "4 replicas"],
                [
                    [
                        f"`{n}`",
                        _fmt(rows[n]["request_goodput"], ".2f"),
                        *(
                            _fmt(w[k]["request_goodput"], ".2f")
                            for k in ("2x_kv_cache", "2_replicas", "4_replicas")
                        ),
                    ]
                    for n, w in payload["what_if"].items()
                ],
            ),
            "",
            "Goodput in requests/s; replicas behind the prefix router (`feather-serve --replicas N`)"
            + (", served without their admission rule (the cluster simulator applies none)"
               if any(w.get("replicas_without_rule") for w in payload["what_if"].values()) else "") + ".",
        ]
    if "confirm" in payload:
        c = payload["confirm"]
        lines += [
            "",
            f"## Confirmed on the real engine (window {c['seed']}, {c['repeats']} alternating runs each)",
            "",
            format_table(
                ["role", "setting", "attainment (median)", "goodput req/s (median)", "runs", "rejected",
                 "false admits", "output tok/s", "mean TTFT ms", "mean TPOT ms"],
                [
                    [
                        s["role"],
                        f"`{s['name']}`",
                        _fmt(s["measured_attainment"], ".1%"),
                        _fmt(s["measured_goodput"], ".2f"),
                        ", ".join(_fmt(g, ".2f") for g in c["runs"][s["name"]]["request_goodput_per_run"]),
                        _fmt(s["rejected_fraction"], ".1%"),
                        _fmt(s["false_admit_fraction"], ".1%"),
                        _fmt(c["runs"][s["name"]]["output_throughput"], ".1f"),
                        _fmt(c["runs"][s["name"]]["mean_ttft_ms"], ".0f"),
                        _fmt(c["runs"][s["name"]]["mean_tpot_ms"], ".1f"),
                    ]
                    for s in _confirmed(c)
                ],
            ),
            "",
            f"Measured ratio {_fmt(c['measured_goodput_ratio'], '.2f')}x the default; predicted "
            f"{_fmt(rec['predicted_goodput_ratio'], '.2f')}x (mean of the windows); the simulator's goodput "
            f"on this window {_fmt(c['predicted_goodput_this_window'], '.2f')} req/s against "
            f"{_fmt(c['measured_goodput'], '.2f')} measured.",
        ]
        if "simulator_recommendation" in c:
            lines += [
                "",
                f"The engine decided among the simulator's best: it recommends `{rec['scheduler']}`; "
                f"the simulator alone picked `{c['simulator_recommendation']}`.",
            ]
    lines += [
        "",
        f"Made on {payload['machine'].get('date', '')} ({payload['machine'].get('cpu', '')}) in "
        f"{payload['wall_s']:.0f} s.",
    ]
    return "\n".join(lines) + "\n"


def _confirmed(c: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The confirmation's rows: its settings by role, then any other setting it served (``--confirm-top``)."""
    settings = list(c.get("settings", []))
    named = {s["name"] for s in settings}
    for name, r in c["runs"].items():
        if name not in named:
            settings.append({"role": "simulator's best", "name": name,
                             "measured_attainment": r.get("slo_attainment"),
                             "measured_goodput": r["request_goodput"],
                             "rejected_fraction": r.get("rejected_fraction"),
                             "false_admit_fraction": r.get("false_admit_fraction")})
    return settings


def _admission_lines(payload: Mapping[str, Any]) -> list[str]:
    """The admission section: the best setting of each rule searched (on the held-out windows, with the
    thresholds searched on its base), and what the recommended (or the best) rule costs at light load;
    nothing when no rule was searched."""
    search = payload.get("admission_search") or {}
    if not search.get("rules"):
        return []
    rows = payload["candidates"]
    reported = [e for e in search["searched"] if rows[e["best"]]["stage"] == "every window"]
    best: dict[str, Mapping[str, Any]] = {}
    for rule in search["rules"]:  # the best attainment, equal ones going to the simplest setting
        entries = [e for e in reported if e["rule"] == rule]
        if entries:
            best[rule] = min(entries, key=lambda e: (-(rows[e["best"]]["slo_attainment"] or 0.0),
                                                     simplicity(e["best"])))
    table = []
    for rule, entry in best.items():
        r, ladder = rows[entry["best"]], entry["thresholds"]
        table.append([rule, f"`{entry['best']}`", _fmt(r["slo_attainment"], ".1%"),
                      _fmt(r["request_goodput"], ".2f"), _fmt(r["rejected_fraction"], ".1%"),
                      _fmt(r["false_admit_fraction"], ".1%"),
                      f"{len(ladder)}: {ladder[0]:g}-{ladder[-1]:g}" if ladder else "-"])
    lines = [
        "## Admission rules",
        "",
        f"Rules searched: {', '.join(search['rules'])}, each over log-spaced thresholds (extended past an "
        f"edge while the best lay there) on {len({e['base'] for e in search['searched']})} settings; the "
        "best of each on the reported windows (rejected requests count against the attainment):",
        "",
        format_table(["rule", "best setting", "attainment", "goodput req/s", "rejected", "false admits",
                      "thresholds searched"], table),
        "",
    ]
    light = payload.get("light_load")
    if light is not None:
        w, wo = light["with_rule"], light["without_rule"]
        lines += [
            f"At light load (the scenario's rate / {light['rate_divisor']:g}), `{light['setting']}` rejects "
            f"{_fmt(light['rejected_fraction'], '.1%')} of the requests and attains "
            f"{_fmt(w['slo_attainment'], '.1%')} against {_fmt(wo['slo_attainment'], '.1%')} without its "
            f"rule (`{light['without_rule_setting']}`): an attainment ratio of "
            f"{_fmt(light['attainment_ratio'], '.3f')}.",
            "",
        ]
    return lines


def _plot(payload: Mapping[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["candidates"]
    names = [n for n, r in rows.items() if r["stage"] == "every window"]
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(names) + 1.5))
    values = [rows[n]["request_goodput"] or 0.0 for n in names]
    colors = [
        "tab:green"
        if n == payload["recommendation"]["scheduler"]
        else "tab:gray"
        if n == payload["default"]["scheduler"]
        else "tab:blue"
        for n in names
    ]
    ax.barh(names[::-1], values[::-1], color=colors[::-1])
    ax.axvline(payload["offered_request_rate"], color="k", linestyle="--", label="offered request rate")
    ax.set_xlabel("goodput (requests/s meeting every SLO)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
