"""Prometheus counters of the Feather scheduler, for vLLM's ``/metrics`` endpoint.

The scheduler runs in vLLM's engine-core process, while ``/metrics`` is served by the API
server process. prometheus_client's multiprocess mode bridges the two: when
``PROMETHEUS_MULTIPROC_DIR`` is set *before* prometheus_client is imported (``feather-serve``
does it), every process writes its metrics to files in that directory, and vLLM's
``/metrics`` (which then reads the directory with a ``MultiProcessCollector``) shows the
scheduler's counters next to vLLM's own. Without that variable the counters live in the
process's default registry (in-process engines: read them with
``prometheus_client.generate_latest()`` or the scheduler's ``feather_stats()``).

Exported (label ``scheduler``: the scheduler name):

=========================================  ====================================================
``feather_scheduler_decisions_total``      ADD/STOP policy decisions
``feather_scheduler_add_total``            ... that were ADD
``feather_scheduler_stop_total``           ... that were STOP
``feather_scheduler_released_total``       requests released to the engine, label ``reason``
                                           (``policy``, ``seed``, ``max_wait``, ``order``,
                                           ``group``)
``feather_scheduler_capacity_stops_total`` releases refused by the KV admission check
``feather_scheduler_preempted_total``      preemptions of released requests by the engine
``feather_scheduler_decision_seconds_total``  time spent deciding (the core's ``plan``)
``feather_scheduler_schedule_calls_total`` ``schedule()`` calls
``feather_scheduler_prediction_seconds_total``  time spent predicting output lengths
``feather_scheduler_retained_blocks_total``  cached blocks of held groups moved to the end of
                                           vLLM's eviction order (``retain_held_prefixes``)
``feather_scheduler_invalid_hints_total``  trusted client hints clamped or replaced (see
                                           ``scheduler_runtime.schedulers``)
``feather_scheduler_faults_total``         exceptions in Feather's own code, label ``stage``
                                           (``arrive``, ``plan``, ``freed``, ``preempted``,
                                           ``metrics``, ``restart``); see
                                           ``scheduler_runtime.serving.vllm_scheduler``
``feather_scheduler_held_requests``        requests held back now (gauge)
``feather_scheduler_batch_requests``       requests in the formed batch now (gauge)
=========================================  ====================================================

And, from the API-server process of ``feather-serve --admission RULE``
(:mod:`scheduler_runtime.serving.admission_http`, no label ``scheduler``):

=========================================  ====================================================
``feather_admission_admitted_total``       requests admitted by the admission rule
``feather_admission_rejected_total``       requests rejected at arrival, label ``reason``
                                           (``slo``, ``never-fits``, ...)
``feather_admission_aborted_total``        admitted requests aborted before their first token,
                                           label ``reason`` (``deadline``)
``feather_admission_false_admits_total``   admitted requests that missed their TTFT SLO (a late
                                           first byte, or aborted)
``feather_admission_ttft_pace``            gauge: the ``slo`` rule's correction of its predicted
                                           TTFT by the measured one (1: the model's own)
=========================================  ====================================================
"""

from __future__ import annotations

import os
from typing import Any

from scheduler_runtime.batching import RELEASE_REASONS

__all__ = ["ADMISSION_METRIC_NAMES", "FAULT_STAGES", "METRIC_NAMES", "AdmissionMetrics", "SchedulerMetrics"]

#: Where the vLLM scheduler catches an exception of Feather's own code (label ``stage``).
FAULT_STAGES = ("arrive", "plan", "freed", "preempted", "metrics", "restart")

_COUNTERS = {
    # metric suffix: (snapshot key, help)
    "decisions": ("decisions", "ADD/STOP decisions asked of the batching policy"),
    "add": ("adds", "Policy decisions that were ADD"),
    "stop": ("stops", "Policy decisions that were STOP"),
    "capacity_stops": ("capacity_stops", "Releases refused by the KV admission (peak) check"),
    "preempted": ("preempted", "Preemptions of released requests by the engine"),
    "decision_seconds": ("decision_seconds", "Seconds spent in the scheduler's own decisions"),
    "schedule_calls": ("plan_calls", "schedule() calls that ran the decision loop"),
    "prediction_seconds": ("prediction_seconds", "Seconds spent predicting output lengths"),
    "invalid_hints": ("invalid_hints", "Trusted client hints that were clamped or replaced"),
    "retained_blocks": ("retained_blocks", "Free cached blocks moved to the end of the eviction order"),
}
METRIC_NAMES = tuple(f"feather_scheduler_{k}_total" for k in (*_COUNTERS, "released", "faults")) + (
    "feather_scheduler_held_requests",
    "feather_scheduler_batch_requests",
)

ADMISSION_METRIC_NAMES = (*(f"feather_admission_{k}_total"
                                for k in ("admitted", "rejected", "aborted", "false_admits")),
                          "feather_admission_ttft_pace")

_metrics: dict[str, Any] | None = None
_admission_metrics: dict[str, Any] | None = None


def _create() -> dict[str, Any] | None:
    """The process's metric objects, created once (a second engine reuses them)."""
    global _metrics
    if _metrics is not None:
        return _metrics
    try:
        from prometheus_client import Counter, Gauge
    except ImportError:  # metrics are optional; the counters stay readable via feather_stats()
        return None
    # In multiprocess mode a gauge needs an aggregation across processes; one engine core
    # per server holds these, so the live processes' sum is the value.
    gauge_kw = {"multiprocess_mode": "livesum"} if os.environ.get("PROMETHEUS_MULTIPROC_DIR") else {}
    metrics: dict[str, Any] = {
        key: Counter(f"feather_scheduler_{key}", help_text, ["scheduler"])
        for key, (_, help_text) in _COUNTERS.items()
    }
    metrics["released"] = Counter("feather_scheduler_released", "Requests released to the engine",
                                  ["scheduler", "reason"])
    metrics["faults"] = Counter("feather_scheduler_faults", "Exceptions in the Feather scheduler's own code",
                                ["scheduler", "stage"])
    metrics["held"] = Gauge("feather_scheduler_held_requests", "Requests held back by the scheduler",
                            ["scheduler"], **gauge_kw)
    metrics["batch"] = Gauge("feather_scheduler_batch_requests", "Requests in the formed batch",
                             ["scheduler"], **gauge_kw)
    _metrics = metrics
    return metrics


class SchedulerMetrics:
    """Pushes a scheduler's counters to Prometheus as increments since the last push.

    It reads the counters' attributes directly and keeps the labelled children, so a push costs
    a few microseconds (more inside an engine step: the scheduler's ``_StepMetrics`` throttles its
    pushes while requests are held).
    """

    def __init__(self, scheduler_name: str) -> None:
        self.name = scheduler_name
        self._last: dict[str, float] = {}
        self._children: dict[str, Any] = {}
        metrics = _create()
        if metrics is None:
            return
        # Created now, so /metrics lists every series (at 0) from the start.
        for key, metric in metrics.items():
            if key == "released":
                for reason in RELEASE_REASONS:
                    self._children[f"released/{reason}"] = metric.labels(scheduler_name, reason)
            elif key == "faults":
                for stage in FAULT_STAGES:
                    self._children[f"faults/{stage}"] = metric.labels(scheduler_name, stage)
            else:
                self._children[key] = metric.labels(scheduler_name)

    def fault(self, stage: str) -> None:
        """Count one fault at ``stage`` (one of :data:`FAULT_STAGES`)."""
        child = self._children.get(f"faults/{stage}")
        if child is not None:
            child.inc()

    def push(self, stats: Any, runtime_stats: Any, held: int, batch: int) -> None:
        """Export a :class:`~scheduler_runtime.batching.CoreStats` and its runtime's stats."""
        children = self._children
        if not children:
            return
        last = self._last
        for key, (field, _) in _COUNTERS.items():
            value = getattr(stats, field, None)
            if value is None:
                value = getattr(runtime_stats, field)
            delta = value - last.get(key, 0)
            if delta > 0:
                children[key].inc(delta)
                last[key] = value
        for reason, value in stats.released.items():
            key = f"released/{reason}"
            delta = value - last.get(key, 0)
            if delta > 0:
                children[key].inc(delta)
                last[key] = value
        self.gauges(held, batch)

    def gauges(self, held: int, batch: int) -> None:
        """Set the two gauges (held requests, requests in the formed batch)."""
        children = self._children
        if children:
            children["held"].set(held)
            children["batch"].set(batch)


def _create_admission() -> dict[str, Any] | None:
    """The admission counters of the process, created once."""
    global _admission_metrics
    if _admission_metrics is None:
        try:
            from prometheus_client import Counter, Gauge
        except ImportError:
            return None
        _admission_metrics = {
            "ttft_pace": Gauge("feather_admission_ttft_pace", "The slo rule's correction of its "
                               "predicted TTFT by the measured one (1: the model's own)"),
            "admitted": Counter("feather_admission_admitted", "Requests admitted by the admission rule"),
            "rejected": Counter("feather_admission_rejected", "Requests rejected by the admission rule at "
                                "arrival, by reason", ["reason"]),
            "aborted": Counter("feather_admission_aborted", "Admitted requests aborted before their first "
                               "token, by reason", ["reason"]),
            "false_admits": Counter("feather_admission_false_admits", "Admitted requests that missed their "
                                    "TTFT SLO (late first byte, or aborted)"),
        }
    return _admission_metrics


class AdmissionMetrics:
    """Pushes an admission controller's :class:`~scheduler_runtime.admission.AdmissionStats` to
    Prometheus as increments since the last push (aborts are the deadline rule's, ``reason="deadline"``)."""

    def __init__(self) -> None:
        from scheduler_runtime.admission import REASONS

        self._last: dict[str, float] = {}
        self._children: dict[str, Any] = {}
        metrics = _create_admission()
        if metrics is None:
            return
        # created now, so /metrics lists every series (at 0) from the start
        self._pace = metrics["ttft_pace"]
        self._pace.set(1.0)
        self._children = {"admitted": metrics["admitted"], "false_admits": metrics["false_admits"],
                          "aborted": metrics["aborted"].labels("deadline")}
        for reason in REASONS[:-1]:
            self._children[f"rejected/{reason}"] = metrics["rejected"].labels(reason)

    def push(self, stats: Any) -> None:
        """Export the counts of ``stats`` (an ``AdmissionStats``) not exported yet."""
        if not self._children:
            return
        self._pace.set(stats.ttft_pace)
        values = {"admitted": stats.admitted, "aborted": stats.aborted, "false_admits": stats.false_admits,
                  **{f"rejected/{reason}": n for reason, n in stats.rejected.items()}}
        for key, value in values.items():
            delta = value - self._last.get(key, 0)
            if delta > 0:
                child = self._children.get(key)
                if child is None:  # a reason not listed at start
                    child = self._children[key] = _create_admission()["rejected"].labels(key.split("/", 1)[1])
                child.inc(delta)
                self._last[key] = value
