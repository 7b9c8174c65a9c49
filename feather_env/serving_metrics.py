"""End-to-end serving metrics in ``vllm bench serve``'s vocabulary, from per-request timelines.

One definition for every figure of the toolkit (the environment's episodes, the evaluation, the
benchmarks), with ``vllm/benchmarks/serve.py``'s names and definitions:

- ``duration``: seconds from the first arrival to the last completion (vLLM: benchmark duration);
- ``request_throughput``, ``output_throughput``, ``total_token_throughput``: completed requests,
  generated tokens, and prompt + generated tokens per second of ``duration``;
- ``{mean,median,std,pNN}_ttft_ms``: arrival -> first token; ``..._tpot_ms``: (E2E latency - TTFT)
  / (output tokens - 1), requests with at least 2 tokens (the first token excluded);
  ``..._itl_ms``: the gaps between a request's successive outputs after the first, pooled over
  requests (vLLM's client measures one per streamed chunk: a chunk that carries several tokens is
  one gap, so mean ITL can exceed TPOT); ``..._e2el_ms``: arrival -> last token; percentiles
  ``percentiles`` (vLLM's default is 99);
- ``request_goodput``: completed requests per second that met every SLO of ``goodput``
  (``{"ttft": ms, "tpot": ms, "e2el": ms}``, vLLM's ``--goodput``, parsed by :func:`parse_goodput`;
  a request with one token has TPOT 0 there, as in vLLM); ``None`` without SLOs;
- ``max_output_tokens_per_s``, ``max_concurrent_requests``: the busiest one-second bucket from the
  first arrival, counting outputs (as vLLM does: chunks) and requests in flight.

Where arrival is the moment the request reached the server (``vllm bench serve``: when its client
sent it). Also, beyond vLLM's keys: ``prefix_hit_rate`` (prompt tokens served from the prefix
cache when a request was first scheduled / the prompt tokens of the requests not shed), and
``submitted``. ``completed`` is stricter than vLLM's (a successful response): a request served
exactly once with all of its tokens. Under an admission rule (:mod:`scheduler_runtime.admission`)
a request can also be ``rejected`` at arrival or ``aborted`` before its first token, each a clear
answer; the rest are ``failed``, so ``completed + rejected + aborted + failed == submitted``. With
SLOs, ``slo_attainment`` is the good requests over *submitted* ones (a shed request is not good:
shedding cannot inflate it as it can goodput), ``false_admit_fraction`` the admitted requests
that missed their TTFT (late, or aborted) over the admitted, and ``rejected_fraction`` the
rejected over submitted.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from feather_env.records import RequestTimeline
from scheduler_runtime.admission import SLO_NAMES, check_slos, parse_slos

__all__ = ["GOODPUT_SLOS", "check_slos", "meets_slos", "parse_goodput", "serving_metrics"]

#: The SLOs ``--goodput`` takes (vLLM's names), each in milliseconds; parsed and checked by the
#: admission rules' own functions (one reading of the syntax for the evaluation and for serving).
GOODPUT_SLOS = SLO_NAMES
parse_goodput = parse_slos


def _stats(name: str, seconds: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    values = np.asarray(seconds if len(seconds) else [0.0], dtype=float) * 1000.0
    qs = np.percentile(values, [50.0, *percentiles])  # one call: numpy's overhead is per call
    out = {f"mean_{name}_ms": float(values.mean()), f"median_{name}_ms": float(qs[0]),
           f"std_{name}_ms": float(values.std())}
    for p, q in zip(percentiles, qs[1:], strict=True):
        word = str(int(p)) if int(p) == p else str(p)
        out[f"p{word}_{name}_ms"] = float(q)
    return out


def meets_slos(r: RequestTimeline, goodput: Mapping[str, float]) -> bool:
    """Whether finished request ``r`` met every SLO of ``goodput`` (milliseconds; a missing one is no
    bound): vLLM's definition of a good request, the one ``request_goodput`` counts."""
    return (r.ttft * 1000 <= goodput.get("ttft", math.inf)
            and r.tpot * 1000 <= goodput.get("tpot", math.inf)
            and r.e2el * 1000 <= goodput.get("e2el", math.inf))


def _busiest_second(done: Sequence[RequestTimeline]) -> tuple[float, int]:
    """vLLM's ``max_output_tokens_per_s`` and ``max_concurrent_requests``: the largest count, over
    one-second buckets from the first arrival, of outputs (the first token, then one per ITL gap)
    and of requests in flight (every bucket from its arrival's to its finish's)."""
    if not done:
        return 0.0, 0
    start = min(r.arrival for r in done)
    buckets = int(np.ceil(max(r.finish for r in done) - start)) + 1
    # every output's time: a cumulative sum restarted at each request's first token
    sizes = np.array([1 + len(r.itl) for r in done])
    values = np.fromiter(itertools.chain.from_iterable((r.first_token - start, *r.itl) for r in done),
                         dtype=float, count=int(sizes.sum()))
    total = np.cumsum(values)
    ends = np.cumsum(sizes)
    before = np.repeat(np.concatenate([[0.0], total[ends[:-1] - 1]]), sizes)
    idx = (total - before).astype(int)
    outputs = np.bincount(idx[(idx >= 0) & (idx < buckets)], minlength=buckets)
    first = np.array([int(r.arrival - start) for r in done])
    last = np.array([int(r.finish - start) for r in done])
    flight = np.zeros(buckets + 1, dtype=int)
    np.add.at(flight, first, 1)
    np.add.at(flight, last + 1, -1)
    return float(outputs.max()), int(np.cumsum(flight).max())


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
        check_slos(goodput)
    if duration is None:
        if done:
            duration = max(r.finish for r in done) - min(r.arrival for r in reqs)
        else:
            duration = 0.0
    dur = duration if duration > 0 else math.nan
    total_in = sum(r.prompt_len for r in done)
    total_out = sum(r.tokens for r in done)
    rejected = sum(1 for r in reqs if r.shed and r.outcome == "rejected")
    aborted = sum(1 for r in reqs if r.shed and r.outcome == "aborted")
    out: dict[str, Any] = {
        "submitted": len(reqs),
        "completed": len(done),
        "rejected": rejected,
        "aborted": aborted,
        "failed": len(reqs) - len(done) - rejected - aborted,
        "rejected_fraction": rejected / len(reqs) if reqs else 0.0,
        "duration": float(duration),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(done) / dur,
        "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
        "request_goodput": None,
    }
    out["slo_attainment"] = out["false_admit_fraction"] = None
    if goodput:
        good = sum(1 for r in done if meets_slos(r, goodput))
        out["request_goodput"] = good / dur
        out["goodput_slos_ms"] = dict(goodput)
        out["slo_attainment"] = good / len(reqs) if reqs else 0.0
        if "ttft" in goodput:  # admitted, then late: a late first token, or aborted waiting
            admitted = len(reqs) - rejected
            late = aborted + sum(1 for r in done if r.ttft * 1000 > goodput["ttft"])
            out["false_admit_fraction"] = late / admitted if admitted else 0.0
    out.update(_stats("ttft", [r.ttft for r in done], percentiles))
    out.update(_stats("tpot", [r.tpot for r in done if r.tokens > 1], percentiles))
    out.update(_stats("itl", [gap for r in done for gap in r.itl], percentiles))
    out.update(_stats("e2el", [r.e2el for r in done], percentiles))
    out["max_output_tokens_per_s"], out["max_concurrent_requests"] = _busiest_second(done)
    served = [r for r in reqs if not r.shed]
    prompt = sum(r.prompt_len for r in served)
    out["prefix_hit_rate"] = sum(r.prefix_hit_tokens for r in served) / prompt if prompt else 0.0
    return out
