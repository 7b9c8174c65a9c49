"""Benchmarks: each module measures one thing and writes it as JSON (``python -m benchmarks.NAME --json
results/NAME.json``), and renders that JSON as markdown with its ``render(payload) -> str``: the table
it prints, and the one ``scripts/update_docs.py`` puts in ``docs/results.md`` and the README."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["knob_values", "measured", "num"]


def measured(payload: Mapping[str, Any]) -> str:
    """``measured DATE on CPU, N cores`` from a benchmark JSON's ``machine``; a JSON merged from runs of
    several dates (the evaluation, one scenario at a time) gives its first date to its last, and
    one whose scenarios ran on several machines names each machine's scenarios."""
    m = payload.get("machine") or {}
    if isinstance(m, str):
        return m
    date = m.get("date") or payload.get("date", "?")
    scenarios = {name: p for name, p in (payload.get("scenarios") or {}).items() if isinstance(p, Mapping)}
    parts = sorted({(p.get("machine") or {}).get("date", "") for p in scenarios.values()} - {""})
    if len(parts) > 1:
        date = f"{parts[0]} to {max(parts[-1], date)}"
    where = f"{m.get('cpu', '?')}, {m.get('cores') or m.get('cpus', '?')} cores"
    by_cpu: dict[str, list[str]] = {}
    for name, p in scenarios.items():
        by_cpu.setdefault((p.get("machine") or {}).get("cpu") or m.get("cpu", "?"), []).append(name)
    if len(by_cpu) > 1:
        where = " and ".join(f"{cpu} ({', '.join(names)})" for cpu, names in by_cpu.items())
        where += f", {m.get('cores') or m.get('cpus', '?')} cores"
    return f"measured {date} on {where}"


def num(value: float | None, fmt: str = "{:.2f}") -> str:
    """``value`` formatted, or ``n/a`` when it was not measured."""
    return "n/a" if value is None else fmt.format(value)


def knob_values(items: Sequence[str]) -> dict[str, Any]:
    """``KNOB=VALUE`` strings (a command line's repeated ``--learned``) as keyword arguments: a number, a
    boolean (``true``/``false``), ``None`` (``none``), else the name as given (``queue_time=off``). Raises
    ``ValueError`` on an item without ``=VALUE``."""
    out: dict[str, Any] = {}
    for item in items:
        key, _, value = item.partition("=")
        if not key or not value:
            raise ValueError(f"{item!r}: expected KNOB=VALUE")
        if value.lower() in ("true", "false"):
            out[key] = value.lower() == "true"
        elif value.lower() == "none":
            out[key] = None
        else:
            try:
                out[key] = float(value)
            except ValueError:
                out[key] = value
    return out
