"""serving_metrics against vLLM's own ``calculate_metrics`` (``vllm bench serve``), and --goodput parsing.

No engine: hand-made timelines are scored by both, and every key ``vllm bench serve`` writes for
them must agree.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from feather_env.records import RequestTimeline
from feather_env.serving_metrics import parse_goodput, serving_metrics

PERCENTILES = (50, 90, 99)


def _timelines(seed: int, n: int = 40) -> list[RequestTimeline]:
    """Requests with random arrivals, TTFTs and streamed chunks (some of several tokens), a few failed."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        arrival = float(rng.uniform(0, 5))
        first = arrival + float(rng.exponential(0.4))
        chunks = int(rng.integers(0, 30))  # chunks after the first (0: a one-chunk request)
        gaps = rng.exponential(0.03, chunks).tolist()
        per_chunk = rng.choice([1, 1, 1, 2, 3], size=chunks + 1)  # tokens each chunk carried
        tokens = int(per_chunk.sum())
        t = RequestTimeline(f"r{i}", int(rng.integers(10, 4000)), tokens, arrival,
                            first_scheduled=arrival, first_token=first, tokens=tokens,
                            finished_count=1, itl=gaps)
        t.finish = first + sum(gaps)  # the last chunk, as vLLM's client times the end
        if i % 13 == 5:
            t.tokens -= 1  # a short response: failed
        out.append(t)
    return out


def _vllm_metrics(timelines: list[RequestTimeline], duration: float, goodput: dict[str, float]):
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncOutput
    from vllm.benchmarks.serve import calculate_metrics

    outputs = []
    for t in timelines:
        outputs.append(RequestFuncOutput(
            success=t.completed, latency=t.finish - t.arrival, output_tokens=t.tokens if t.completed else 0,
            ttft=t.first_token - t.arrival, itl=list(t.itl), prompt_len=t.prompt_len, start_time=t.arrival))
    metrics, _ = calculate_metrics([], outputs, duration, None, list(PERCENTILES), goodput)
    return metrics


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_vllm_bench_serve_key_matches_vllms_own_calculation(seed):
    timelines = _timelines(seed)
    goodput = {"ttft": 600.0, "tpot": 40.0, "e2el": 1500.0}
    ours = serving_metrics(timelines, goodput=goodput, percentiles=PERCENTILES)
    theirs = _vllm_metrics(timelines, ours["duration"], goodput)
    assert ours["completed"] == theirs.completed and ours["failed"] == theirs.failed > 0
    assert ours["total_input_tokens"] == theirs.total_input
    assert ours["total_output_tokens"] == theirs.total_output
    for key in ("request_throughput", "request_goodput", "output_throughput", "total_token_throughput"):
        assert ours[key] == pytest.approx(getattr(theirs, key), rel=1e-12), key
    assert 0 < ours["request_goodput"] < ours["request_throughput"]  # the SLOs bite
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std"):
            key = f"{stat}_{name}_ms"
            assert ours[key] == pytest.approx(getattr(theirs, key), rel=1e-9), key
        for p, value in getattr(theirs, f"percentiles_{name}_ms"):
            assert ours[f"p{p}_{name}_ms"] == pytest.approx(value, rel=1e-9), (name, p)
    assert ours["max_output_tokens_per_s"] == theirs.max_output_tokens_per_s
    assert ours["max_concurrent_requests"] == theirs.max_concurrent_requests
    # several tokens per chunk: the pooled chunk gap is longer than the time per token
    assert ours["mean_itl_ms"] > ours["mean_tpot_ms"]


def test_goodput_zero_slo_and_no_slo_follow_vllm():
    timelines = _timelines(3)
    ours = serving_metrics(timelines, goodput={"ttft": 0.0})
    assert ours["request_goodput"] == pytest.approx(_vllm_metrics(timelines, ours["duration"],
                                                                  {"ttft": 0.0}).request_goodput)
    assert serving_metrics(timelines)["request_goodput"] is None  # vLLM: null without --goodput


def test_parse_goodput_reads_vllms_pairs_and_rejects_bad_specs():
    assert parse_goodput("ttft:500 tpot:50") == {"ttft": 500.0, "tpot": 50.0}
    assert parse_goodput(["e2el:2000", "ttft:0.5"]) == {"e2el": 2000.0, "ttft": 0.5}
    assert parse_goodput(None) == {} and parse_goodput("") == {}
    for bad, message in (("ttft", "NAME:MILLISECONDS"), ("ttft:abc", "NAME:MILLISECONDS"),
                         ("itl:5", "unknown goodput SLO 'itl'"), ("ttft:1 ttft:2", "twice"),
                         ("tpot:-1", ">= 0"), ("e2el:inf", "finite")):
        with pytest.raises(ValueError, match=message):
            parse_goodput(bad)


def test_a_request_without_outputs_counts_as_failed_not_dropped():
    ok = RequestTimeline("a", 10, 2, 0.0, first_token=0.5, finish=1.0, tokens=2, finished_count=1, itl=[0.5])
    lost = RequestTimeline("b", 10, 2, 0.0)
    m = serving_metrics([ok, lost])
    assert (m["submitted"], m["completed"], m["failed"]) == (2, 1, 1)
    assert m["mean_itl_ms"] == pytest.approx(500.0) and m["mean_tpot_ms"] == pytest.approx(500.0)
    assert math.isclose(m["output_throughput"], 2 / 1.0)
