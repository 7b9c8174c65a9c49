"""End-to-end serving metrics in ``vllm bench serve``'s vocabulary, from per-request timelines.

One definition for every figure of the toolkit (the environment's episodes, the evaluation, the
benchmarks), with ``vllm/benchmarks/serve.py``'s names and definitions:

- ``duration``: seconds from the first arrival to the last completion (vLLM: benchmark duration);
- ``request_throughput``, ``output_throughput``, ``total_token_throughput``: completed requests,
  generated tokens, and prompt + generated tokens per second of ``duration``;
- ``{mean,median,std,pNN}_ttft_ms``: arrival -> first token; ``..._tpot_ms``: (E2E latency - TTFT)
  / (output tokens - 1), requests with at least 2 tokens (the first token excluded);
  ``..._e2el_ms``: arrival -> last token; percentiles ``percentiles`` (vLLM's default is 99);
- ``request_goodput``: completed requests per second that met every SLO of ``goodput``
  (``{"ttft": ms, "tpot": ms, "e2el": ms}``, vLLM's ``--goodput``; a request with one token has
  TPOT 0 there, as in vLLM); ``None`` without SLOs.

Also, beyond vLLM's keys: ``prefix_hit_rate`` (prompt tokens served from the prefix cache when a
request was first scheduled / all prompt tokens), ``completed`` and ``submitted``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["RequestTimeline", "serving_metrics"]


@dataclass
class RequestTimeline:
    """One request's life on one clock (seconds; NaN where it never happened)."""

    request_id: str
    prompt_len: int
    output_len: int
    arrival: float
    first_scheduled: float = math.nan
    first_token: float = math.nan
    finish: float = math.nan
    tokens: int = 0
    prefix_hit_tokens: int = 0
    finished_count: int = 0
    source: str = ""

    @property
    def completed(self) -> bool:
        return self.finished_count == 1 and self.tokens == self.output_len

    @property
    def e2el(self) -> float:
        return self.finish - self.arrival

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float:
        """Seconds per output token after the first (0 for a request of one token, as vLLM)."""
        if self.tokens <= 1:
            return 0.0
        return (self.finish - self.first_token) / (self.tokens - 1)


def _stats(name: str, seconds: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    values = np.asarray(seconds if len(seconds) else [0.0], dtype=float) * 1000.0
    qs = np.percentile(values, [50.0, *percentiles])  # one call: numpy's overhead is per call
    out = {f"mean_{name}_ms": float(values.mean()), f"median_{name}_ms": float(qs[0]),
           f"std_{name}_ms": float(values.std())}
    for p, q in zip(percentiles, qs[1:], strict=True):
        word = str(int(p)) if int(p) == p else str(p)
        out[f"p{word}_{name}_ms"] = float(q)
    return out


def serving_metrics(
    timelines: Iterable[RequestTimeline],
    *,
    goodput: Mapping[str, float] | None = None,
    percentiles: Sequence[float] = (50, 90, 99),
    duration: float | None = None,
) -> dict[str, Any]:
    """The metrics of the module docstring over ``timelines`` (completed requests only).

    ``duration`` overrides first arrival -> last completion (e.g. a client's wall time).

    Raises:
        ValueError: an unknown goodput SLO name or a non-positive SLO.
    """
    reqs = list(timelines)
    done = [r for r in reqs if r.completed]
    if goodput:
        unknown = sorted(set(goodput) - {"ttft", "tpot", "e2el"})
        if unknown:
            raise ValueError(f"unknown goodput SLO(s) {unknown}; valid: ttft, tpot, e2el (milliseconds)")
        if any(not (v > 0 and math.isfinite(v)) for v in goodput.values()):
            raise ValueError(f"goodput SLOs must be positive milliseconds, got {dict(goodput)}")
    if duration is None:
        if done:
            duration = max(r.finish for r in done) - min(r.arrival for r in reqs)
        else:
            duration = 0.0
    dur = duration if duration > 0 else math.nan
    total_in = sum(r.prompt_len for r in done)
    total_out = sum(r.tokens for r in done)
    out: dict[str, Any] = {
        "submitted": len(reqs),
        "completed": len(done),
        "failed": len(reqs) - len(done),
        "duration": float(duration),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(done) / dur,
        "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
        "request_goodput": None,
    }
    if goodput:
        good = 0
        for r in done:
            if (r.ttft * 1000 <= goodput.get("ttft", math.inf)
                    and r.tpot * 1000 <= goodput.get("tpot", math.inf)
                    and r.e2el * 1000 <= goodput.get("e2el", math.inf)):
                good += 1
        out["request_goodput"] = good / dur
        out["goodput_slos_ms"] = dict(goodput)
    out.update(_stats("ttft", [r.ttft for r in done], percentiles))
    out.update(_stats("tpot", [r.tpot for r in done if r.tokens > 1], percentiles))
    out.update(_stats("e2el", [r.e2el for r in done], percentiles))
    prompt = sum(r.prompt_len for r in reqs)
    out["prefix_hit_rate"] = sum(r.prefix_hit_tokens for r in reqs) / prompt if prompt else 0.0
    return out
