"""One vocabulary for every evaluation run, and how runs are written, read back and compared.

A :class:`Run` is one served episode: a scheduler on the in-process engine
(:mod:`feather_env.evaluation.inprocess`), a running server over HTTP
(:mod:`feather_env.evaluation.endpoint`), or the simulator
(:mod:`feather_env.evaluation.simulated`). :func:`summarize` turns it into one flat mapping:

- ``vllm bench serve``'s keys, with its definitions (:func:`feather_env.serving_metrics.serving_metrics`:
  ``request_throughput``, ``output_throughput``, ``mean_ttft_ms``, ``p99_e2el_ms``, ITL, goodput, ...);
- ``mean_queue_ms`` and ``max_queue_ms``: arrival -> first scheduled by the engine (in-process only);
- what only one kind can measure, from :attr:`Run.extra` (decode throughput of decode-only steps,
  running batch, the Feather scheduler's overhead, slowdown, foreign CPU for in-process runs; the
  server's ``/metrics`` for endpoint runs, whose ``prefix_hit_rate`` is the server's);
- ``label``, ``kind`` and, for failures, ``errors`` (request id -> why).

A results folder holds ``results.json`` (:func:`results_payload`: ``{"runs": {LABEL: metrics}, ...}``),
``results.csv`` (a row per run), ``results.md`` (the tables), ``requests.csv`` (every request's
timeline per run), ``steps.csv`` (in-process runs: engine steps) and the plots. :func:`read_runs` reads
one back; :func:`compare` merges folders, in-process and endpoint alike, into the same files.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from feather_env.evaluation.plots import write_plots
from feather_env.records import RequestTimeline, Run, StepSample
from feather_env.reporting import format_table, machine_info, write_json
from feather_env.serving_metrics import serving_metrics

__all__ = [
    "DEFINITIONS",
    "ENDPOINT",
    "IN_PROCESS",
    "PERCENTILES",
    "SIMULATOR",
    "Run",
    "compare",
    "metrics_tables",
    "read_runs",
    "results_payload",
    "summarize",
    "write_results",
]

IN_PROCESS = "in-process"
ENDPOINT = "endpoint"
SIMULATOR = "simulator"
#: Percentiles of every latency distribution (vLLM's default is 99 alone).
PERCENTILES = (50, 90, 95, 99)

DEFINITIONS = {
    "duration": "seconds from the first arrival to the last completion (endpoint: the client's wall time "
                "from the first request sent, as vllm bench serve)",
    "request_throughput / output_throughput / total_token_throughput":
        "completed requests, output tokens, prompt + output tokens per second of duration",
    "ttft": "arrival -> first token (ms); endpoint: request sent -> first streamed chunk",
    "tpot": "(e2el - ttft) / (output tokens - 1), requests of >= 2 tokens (ms)",
    "itl": "gaps between a request's successive outputs after the first, pooled (ms; one per streamed chunk)",
    "e2el": "arrival -> last token (ms)",
    "request_goodput": "completed requests per second that met every --goodput SLO (ttft, tpot, e2el in ms)",
    "completed": "served exactly once with exactly its requested tokens (failed: the others but the "
                 "rejected and aborted)",
    "rejected / aborted": "refused at arrival / aborted before the first token by the setting's admission "
                          "rule (~RULE); completed + rejected + aborted + failed = submitted",
    "slo_attainment": "requests that met every --goodput SLO / submitted requests (a shed request is "
                      "not good)",
    "false_admit_fraction": "admitted requests that missed the TTFT SLO (late or aborted) / admitted",
    "queue": "arrival -> first scheduled by the engine (in-process)",
    "decode_tok_s": "tokens of decode-only engine steps / wall time of those steps (in-process)",
    "prefix_hit_rate": "prompt tokens found in the prefix cache / prompt tokens (in-process: when a request "
                       "was first scheduled; endpoint: the server's vllm:prefix_cache_hits / queries)",
    "scheduler_overhead_frac": "Feather scheduler decision time / total engine step time (n/a for fcfs)",
    "max_slowdown": "max over requests of e2el / its isolated estimate (alone, cold cache)",
    "foreign_cpu": "other processes' CPU time / (cores x run wall time)",
}


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, np.generic):
        return _clean(value.item())
    if isinstance(value, Mapping):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def summarize(run: Run, *, goodput: Mapping[str, float] | None = None,
              percentiles: Sequence[float] = PERCENTILES) -> dict[str, Any]:
    """The flat metrics of ``run`` (module docstring); NaN becomes ``None``."""
    m: dict[str, Any] = {"label": run.label, "kind": run.kind}
    m.update(serving_metrics(run.timelines, goodput=goodput, percentiles=percentiles, duration=run.duration))
    queue = [t.first_scheduled - t.arrival for t in run.timelines if math.isfinite(t.first_scheduled)]
    m["mean_queue_ms"] = 1000 * float(np.mean(queue)) if queue else None
    m["max_queue_ms"] = 1000 * float(np.max(queue)) if queue else None
    m.update(run.extra)
    if run.errors:
        m["errors"] = dict(run.errors)
    return _clean(m)


# ------------------------------------------------------------------------------------ tables

#: (header, metric, format); format "done" is completed/submitted.
_TABLE_MAIN = [
    ("run", None, None), ("done", None, "done"), ("output tok/s", "output_throughput", "{:.1f}"),
    ("req/s", "request_throughput", "{:.2f}"), ("TTFT ms", "mean_ttft_ms", "{:.0f}"),
    ("P99 TTFT", "p99_ttft_ms", "{:.0f}"), ("TPOT ms", "mean_tpot_ms", "{:.1f}"),
    ("ITL ms", "mean_itl_ms", "{:.1f}"), ("E2EL ms", "mean_e2el_ms", "{:.0f}"),
    ("P99 E2EL", "p99_e2el_ms", "{:.0f}"), ("goodput req/s", "request_goodput", "{:.2f}"),
    ("attainment", "slo_attainment", "{:.3f}"), ("rejected", "rejected_fraction", "{:.1%}"),
    ("aborted", "aborted", "{:d}"), ("false admits", "false_admit_fraction", "{:.1%}"),
]
#: Columns shown only when some run has a value other than nothing or zero (SLOs, an admission rule).
_OPTIONAL = {"request_goodput", "slo_attainment", "false_admit_fraction", "rejected_fraction", "aborted"}
_TABLE_MORE = [
    ("run", None, None), ("kind", "kind", None), ("decode tok/s", "decode_tok_s", "{:.1f}"),
    ("batch", "mean_running_batch", "{:.1f}"), ("prefix hit", "prefix_hit_rate", "{:.0%}"),
    ("queue ms", "mean_queue_ms", "{:.0f}"), ("max queue ms", "max_queue_ms", "{:.0f}"),
    ("max slowdown", "max_slowdown", "{:.1f}"), ("sched overhead", "scheduler_overhead_frac", "{:.2%}"),
    ("preempt", "preemptions", "{:d}"), ("foreign CPU", "foreign_cpu", "{:.0%}"),
]


def _fmt(m: Mapping[str, Any], key: str | None, fmt: str | None) -> str:
    if fmt == "done":
        return f"{m.get('completed')}/{m.get('submitted')}"
    value = m.get(key) if key else None
    if value is None:
        return "n/a"
    if fmt is None:
        return str(value)
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def metrics_tables(runs: Mapping[str, Mapping[str, Any]]) -> str:
    """Two markdown tables: vLLM's serving figures, then the scheduler's (queue, batch, overhead)."""
    out = []
    for cols in (_TABLE_MAIN, _TABLE_MORE):
        cols = [c for c in cols if c[1] not in _OPTIONAL
                or any(m.get(c[1]) is not None for m in runs.values()) and (
                    c[1] not in ("rejected_fraction", "aborted") or any(m.get(c[1]) for m in runs.values()))]
        rows = [[label] + [_fmt(m, key, fmt) for _, key, fmt in cols[1:]] for label, m in runs.items()]
        out.append(format_table([h for h, _, _ in cols], rows))
    return "\n\n".join(out)


# ------------------------------------------------------------------------------------ files


def results_payload(runs: Sequence[Run], *, goodput: Mapping[str, float] | None = None,
                    percentiles: Sequence[float] = PERCENTILES, **context: Any) -> dict[str, Any]:
    """``{"runs": {label: summarize(run)}, **context, "machine": ..., "definitions": ...}``.

    Raises:
        ValueError: two runs with one label.
    """
    labels = [r.label for r in runs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"run labels must be unique, got {labels}")
    payload: dict[str, Any] = {"runs": {r.label: summarize(r, goodput=goodput, percentiles=percentiles)
                                        for r in runs}}
    payload.update(_clean(context))
    payload.setdefault("goodput_slos_ms", dict(goodput) if goodput else None)
    payload.setdefault("machine", machine_info())
    payload["definitions"] = DEFINITIONS
    return payload


_REQUEST_COLUMNS = ("request_id", "source", "prompt_len", "output_len", "arrival", "first_scheduled",
                    "first_token", "finish", "tokens", "finished_count", "prefix_hit_tokens", "outcome",
                    "reason")
_STEP_COLUMNS = ("start", "seconds", "running", "scheduled", "decode_only")


def write_results(out_dir: str | Path, payload: Mapping[str, Any], runs: Sequence[Run], *,
                  title: str = "", plots: bool = True) -> list[Path]:
    """Write the results folder (module docstring); returns the files written, the JSON first."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "results.json", out / "results.md", out / "results.csv", out / "requests.csv"]
    write_json(out / "results.json", dict(payload), quiet=True)
    (out / "results.md").write_text(f"# Evaluation: {title}\n\n{metrics_tables(payload['runs'])}\n")
    _write_metrics_csv(out / "results.csv", payload["runs"])
    with (out / "requests.csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["run", *_REQUEST_COLUMNS, "itl"])
        for run in runs:
            for t in run.timelines:
                w.writerow([run.label] + [getattr(t, c) for c in _REQUEST_COLUMNS]
                           + [" ".join(f"{g:.9g}" for g in t.itl)])
    if any(run.steps for run in runs):
        written.append(out / "steps.csv")
        with (out / "steps.csv").open("w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["run", *_STEP_COLUMNS])
            for run in runs:
                for s in run.steps:
                    w.writerow([run.label, s.start, s.seconds, s.running, s.scheduled, int(s.decode_only)])
    if plots:
        written += write_plots(out, runs, payload["runs"], title)
    return written


def _write_metrics_csv(path: Path, runs: Mapping[str, Mapping[str, Any]]) -> None:
    keys: list[str] = []
    for m in runs.values():
        keys += [k for k, v in m.items() if k not in keys and not isinstance(v, dict | list)]
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(keys)
        for m in runs.values():
            w.writerow(["" if m.get(k) is None else m.get(k) for k in keys])


def read_runs(results_dir: str | Path) -> tuple[dict[str, Any], list[Run]]:
    """A results folder read back: its payload and its runs (timelines, steps, errors).

    Raises:
        FileNotFoundError: the folder has no ``results.json``.
        ValueError: the folder's files are not an evaluation's (naming the file, and the line of a
            CSV file).
    """
    folder = Path(results_dir)
    path = folder / "results.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder} is not a results folder: {path} does not exist")
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: malformed JSON: {exc}") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("runs"), dict) or not all(
            isinstance(m, dict) for m in payload["runs"].values()):
        raise ValueError(f"{path} has no 'runs' mapping: not written by evaluate.py")
    timelines: dict[str, list[RequestTimeline]] = {label: [] for label in payload["runs"]}
    for row, where in _csv_rows(folder / "requests.csv"):
        try:
            t = RequestTimeline(row["request_id"], int(row["prompt_len"]), int(row["output_len"]),
                                float(row["arrival"]), source=row["source"])
            for key in ("first_scheduled", "first_token", "finish"):
                setattr(t, key, float(row[key]))
            for key in ("tokens", "finished_count", "prefix_hit_tokens"):
                setattr(t, key, int(row[key]))
            t.itl = [float(g) for g in (row.get("itl") or "").split()]
            t.outcome, t.reason = row.get("outcome") or "", row.get("reason") or ""  # absent before admission
            timelines.setdefault(row["run"], []).append(t)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{where}: not a request row of evaluate.py ({type(exc).__name__}: {exc})"
                             ) from None
    steps: dict[str, list[StepSample]] = {}
    for row, where in _csv_rows(folder / "steps.csv"):
        try:
            steps.setdefault(row["run"], []).append(StepSample(
                float(row["start"]), float(row["seconds"]), int(row["running"]), int(row["scheduled"]),
                bool(int(row["decode_only"]))))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{where}: not an engine-step row of evaluate.py ({type(exc).__name__}: {exc})"
                             ) from None
    runs = [Run(label, m.get("kind", IN_PROCESS), timelines.get(label, []), steps=steps.get(label, []),
                errors=m.get("errors") or {}) for label, m in payload["runs"].items()]
    return payload, runs


def _csv_rows(path: Path) -> Any:
    """``(row, "FILE:LINE")`` for each row of a results CSV (none when the file is absent)."""
    if not path.is_file():
        return
    try:
        with path.open(newline="", encoding="utf-8") as fh:
            reader = csv.DictReader(fh)
            for row in reader:
                yield row, f"{path}:{reader.line_num}"
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except csv.Error as exc:
        raise ValueError(f"{path}: malformed CSV: {exc}") from None


def compare(results_dirs: Sequence[str | Path], out_dir: str | Path, *, plots: bool = True
            ) -> tuple[dict[str, Any], list[Path]]:
    """Merge results folders into one: the runs of all of them in the same tables and plots.

    Each run keeps the metrics its own evaluation computed; a label used by two folders gets the
    folder's name appended. The payload records where every run came from and whether the folders
    served the same workload (``same_workload``: equal workload fingerprints).

    Raises:
        FileNotFoundError / ValueError: as :func:`read_runs`; no folder given.
    """
    if not results_dirs:
        raise ValueError("compare needs at least one results folder")
    inputs = {Path(folder).resolve() for folder in results_dirs}
    if Path(out_dir).resolve() in inputs:
        raise ValueError(f"the output folder {out_dir} is one of the folders to compare: it would be "
                         "overwritten; give another --out")
    merged: dict[str, Any] = {}
    all_runs: list[Run] = []
    sources: dict[str, str] = {}
    fingerprints: dict[str, str | None] = {}
    for folder in results_dirs:
        payload, runs = read_runs(folder)
        fingerprints[str(folder)] = (payload.get("workload") or {}).get("fingerprint")
        for run in runs:
            label = run.label
            if label in merged:
                label = f"{label} ({Path(folder).name})"
            n = 2
            while label in merged:
                label = f"{run.label} ({Path(folder).name}, {n})"
                n += 1
            metrics = dict(payload["runs"][run.label], label=label)
            run.label = label
            merged[label] = metrics
            sources[label] = str(folder)
            all_runs.append(run)
    prints = set(fingerprints.values())
    same = len(prints) == 1 and None not in prints
    out = {"runs": merged, "sources": sources, "workload_fingerprints": fingerprints,
           "same_workload": same, "machine": machine_info(), "definitions": DEFINITIONS}
    title = f"{len(all_runs)} runs from {len(results_dirs)} folders"
    if not same:
        title += " (different workloads)"
    return out, write_results(out_dir, out, all_runs, title=title, plots=plots)
