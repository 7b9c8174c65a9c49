"""The bookkeeping of ``benchmarks/admission_burst.py``, without an engine: each outcome as the client
classifies it (on the wire, against a stand-in server), and the figures and verdicts of a fake run."""

from __future__ import annotations

import asyncio
import json
import os

import pytest
from aiohttp import web

from benchmarks.admission_burst import (
    GRACE_S,
    by_replica,
    classify,
    cpu_seconds,
    foreign_share,
    main,
    parse_requests_csv,
    render,
    request_body,
    requests_csv,
    rss_flat,
    send_one,
    summarize,
    tpot_s,
    verdicts,
)
from scheduler_runtime.serving.replicas import free_port

OVERLOADED = json.dumps({"error": {"message": "over capacity", "type": "overloaded", "code": 503,
                                   "param": None}})


@pytest.mark.parametrize("status, headers, body, kw, outcome", [
    (200, {}, "", {"done": True, "error_event": False, "tokens": 16}, "completed"),
    (200, {}, "", {"done": True, "error_event": False, "tokens": 15}, "other"),  # short answer
    (200, {}, "", {"done": False, "error_event": False, "tokens": 16}, "other"),  # no [DONE]
    (200, {}, "", {"done": True, "error_event": True, "tokens": 0}, "aborted"),
    (503, {"retry-after": "2"}, OVERLOADED, {}, "rejected"),
    (503, {"x-should-retry": "false"}, OVERLOADED, {}, "other"),  # never fits: no Retry-After
    (503, {"retry-after": "2"}, '{"error": {"type": "ServiceUnavailableError"}}', {}, "other"),  # vLLM's
    (503, {"retry-after": "2"}, "not json", {}, "other"),
    (429, {"retry-after": "2"}, OVERLOADED, {}, "other"),
    (500, {}, "boom", {}, "other"),
    (None, {}, "ClientConnectionError: refused", {}, "other"),
    (None, {}, "", {"timed_out": True}, "timeout"),
])
def test_outcomes(status, headers, body, kw, outcome):
    args = {"done": False, "error_event": False, "tokens": 0, **kw}
    assert classify(status, headers, body, expected_tokens=16, **args) == outcome


def _stand_in() -> web.Application:
    """Answers by the prompt's first token id: 1 streams 4 tokens, 2 sheds, 3 aborts mid-stream
    (deadline), 4 fails, 5 hangs past the client's timeout."""
    async def complete(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        kind = body["prompt"][0]
        assert body["stream"] and body["ignore_eos"] and body["max_tokens"] == 4
        if kind == 2:
            return web.Response(status=503, text=OVERLOADED, content_type="application/json",
                                headers={"Retry-After": "3", "x-feather-admission": "slo"})
        if kind == 4:
            return web.Response(status=500, text="internal error")
        if kind == 5:
            await asyncio.sleep(1.5)
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        if kind == 3:
            await resp.write(b'data: {"error": {"type": "deadline", "message": "late"}}\n\ndata: [DONE]\n\n')
            return resp
        for _ in range(4):
            await resp.write(b'data: {"choices": [{"text": "x"}]}\n\n')
        await resp.write(b'data: {"choices": [], "usage": {"completion_tokens": 4}}\n\ndata: [DONE]\n\n')
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    return app


def test_send_one_classifies_what_the_wire_carries():
    import aiohttp

    async def main_() -> list[dict]:
        runner = web.AppRunner(_stand_in())
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with aiohttp.ClientSession() as session:
                return await asyncio.gather(*(
                    send_one(session, f"http://127.0.0.1:{port}", request_body([kind, 7, 7], 4),
                             prompt_tokens=3, max_tokens=4, timeout_s=0.5) for kind in (1, 2, 3, 4, 5)))
        finally:
            await runner.cleanup()

    ok, shed, aborted, failed, hung = asyncio.run(main_())
    assert ok["outcome"] == "completed" and ok["tokens"] == 4
    assert 0 < ok["status_s"] <= ok["ttft_s"] <= ok["e2e_s"]
    assert shed["outcome"] == "rejected" and shed["status"] == 503 and shed["retry_after"] == "3"
    assert shed["reason"] == "slo" and shed["ttft_s"] is None and shed["status_s"] < 1.0
    assert aborted["outcome"] == "aborted" and aborted["ttft_s"] is None
    assert failed["outcome"] == "other" and failed["detail"] == "internal error"
    assert hung["outcome"] == "timeout" and hung["status"] is None


def _result(burst: int, outcome: str, *, ttft: float | None = None, status_s: float = 0.01,
            e2e: float | None = None) -> dict:
    tokens = 16 if outcome == "completed" else 0
    e2e = e2e if e2e is not None else (ttft or 0.0) + 15 * 0.05  # 50 ms per token after the first
    return {"burst": burst, "outcome": outcome, "prompt_tokens": 1000, "status_s": status_s, "ttft_s": ttft,
            "e2e_s": e2e, "tokens": tokens}


def fake_results() -> list[dict]:
    """Two bursts: burst 0 accepts 3 (one late) and rejects 5, burst 1 accepts 2 (one aborted)."""
    out = [_result(0, "completed", ttft=0.5), _result(0, "completed", ttft=1.9, e2e=1.9 + 15 * 0.3),
           _result(0, "completed", ttft=2.5)]
    out += [_result(0, "rejected", status_s=0.010 * (k + 1)) for k in range(5)]
    out += [_result(1, "completed", ttft=1.0), _result(1, "aborted"), _result(1, "rejected", status_s=0.3),
            _result(1, "other"), _result(1, "timeout")]
    return out


def test_the_figures_of_a_fake_run():
    s = summarize(fake_results(), bursts=2, burst_s=10.0, prefill_tps=200.0, ttft_slo_s=2.0, tpot_slo_s=0.1)
    assert s["sent"] == 13
    assert s["counts"] == {"completed": 4, "rejected": 6, "aborted": 1, "timeout": 1, "other": 1}
    # time to 503 over the rejected: 10..50 ms and 300 ms
    assert s["p50_503_ms"] == pytest.approx(35.0) and s["max_503_ms"] == pytest.approx(300.0)
    assert 50.0 < s["p99_503_ms"] < 300.0
    # accepted: completed or aborted (5); met: completed within 2 s (3: 0.5, 1.9, 1.0)
    assert s["accepted"] == 5 and s["ttft_met"] == 3 and s["ttft_met_frac"] == pytest.approx(0.6)
    # and the TPOT SLO too ((e2e - ttft) / 15): 0.5 and 1.0 at 50 ms, not 1.9 at 300 ms
    assert s["slo_met"] == 2 and s["slo_met_frac"] == pytest.approx(0.4)
    assert s["p50_tpot_ms"] == pytest.approx(50.0) and s["p99_tpot_ms"] > 250.0
    # capacity per burst: 200 tokens/s (two engines) x (10 + 2) s = 2,400 tokens
    assert GRACE_S == 2.0 and s["capacity_tokens_per_burst"] == pytest.approx(2400.0)
    assert [b["accepted_prompt_tokens"] for b in s["per_burst"]] == [3000, 2000]
    assert [b["admitted_work"] for b in s["per_burst"]] == pytest.approx([3000 / 2400, 2000 / 2400])
    assert [b["sent"] for b in s["per_burst"]] == [8, 5]
    assert s["admitted_work"] == pytest.approx(5000 / 4800)
    v = verdicts(s, healthy=True, flat=True)
    assert v == {"nothing else": False, "p99 time to 503": False, "ttft met": False, "admitted work": True,
                 "healthy": True, "memory flat": True}
    clean = [r for r in fake_results() if r["outcome"] not in ("other", "timeout", "aborted")
             and (r["ttft_s"] or 0) <= 2.0 and r["status_s"] < 0.2]
    v = verdicts(summarize(clean, bursts=2, burst_s=10.0, prefill_tps=100.0, ttft_slo_s=2.0),
                 healthy=True, flat=None)
    assert v == {"nothing else": True, "p99 time to 503": True, "ttft met": True, "admitted work": True,
                 "healthy": True, "memory flat": None}


def test_nothing_measured_is_not_a_verdict():
    s = summarize([], bursts=1, burst_s=10.0, prefill_tps=100.0, ttft_slo_s=2.0)
    assert s["p99_503_ms"] is None and s["ttft_met_frac"] is None and s["admitted_work"] == 0.0
    v = verdicts(s, healthy=False, flat=None)
    assert v["p99 time to 503"] is None and v["ttft met"] is None and v["admitted work"] is False
    assert not v["healthy"] and v["nothing else"]


def test_per_replica_figures_and_the_foreign_cpu_share():
    results = [{**r, "replica": f"{k % 2}/pid-{k % 2}"} for k, r in enumerate(fake_results())]
    # accepted: completed 0.5 (rank 0), 1.9 (1), 2.5 (0); burst 1: completed 1.0 (rank 0), aborted (1)
    assert by_replica(results, 2.0) == {"0": {"accepted": 3, "ttft_met": 2, "p50_ttft_s": 1.0},
                                        "1": {"accepted": 2, "ttft_met": 1, "p50_ttft_s": 1.9}}
    cores = os.cpu_count() or 1
    before = {"t": 0.0, "busy": 100.0, "steal": 1.0, "mine": 50.0}
    after = {"t": 10.0, "busy": 100.0 + 6.0 * cores, "steal": 1.0 + 0.5 * cores, "mine": 50.0 + 4.0 * cores}
    share = foreign_share(before, after)
    assert share == pytest.approx({"foreign": 0.2, "steal": 0.05})
    assert foreign_share(after, after) == {"foreign": 0.0, "steal": 0.0}
    now = cpu_seconds(os.getpid())
    assert now["busy"] > 0 and now["mine"] > 0 and set(now) == {"t", "busy", "steal", "mine"}


def test_requests_travel_as_csv_lines_and_read_back():
    results = [{**r, "k": k, "status": 200 if r["outcome"] == "completed" else 503, "reason": None,
                "retry_after": None, "replica": "0/pid-7"} for k, r in enumerate(fake_results())]
    lines = requests_csv(results)
    assert lines[0] == "burst,k,outcome,status,status_s,ttft_s,e2e_s,tokens,reason,retry_after,replica"
    assert lines[1] == "0,0,completed,200,0.0100,0.5000,1.2500,16,,,0/pid-7"
    back = parse_requests_csv(lines, 1000)
    assert back[0] == {"prompt_tokens": 1000, "burst": 0, "k": 0, "outcome": "completed", "status": 200,
                       "status_s": 0.01, "ttft_s": 0.5, "e2e_s": 1.25, "tokens": 16, "reason": None,
                       "retry_after": None, "replica": "0/pid-7"}
    kw = {"bursts": 2, "burst_s": 10.0, "prefill_tps": 100.0, "ttft_slo_s": 2.0, "tpot_slo_s": 0.1}
    assert summarize(back, **kw) == summarize(results, **kw)
    assert tpot_s({"ttft_s": 1.0, "e2e_s": 2.5, "tokens": 16}) == pytest.approx(0.1)
    assert tpot_s({"ttft_s": 1.0, "e2e_s": 2.5, "tokens": 1}) is None
    assert tpot_s({"ttft_s": None, "e2e_s": 2.5, "tokens": 16}) is None


def test_memory_flat_compares_the_last_after_burst_reading_with_the_first():
    assert rss_flat([1000.0, 1200.0, 1090.0]) is True
    assert rss_flat([1000.0, 1050.0, 1110.0]) is False
    assert rss_flat([1000.0, 1000.0, 899.0]) is False
    assert rss_flat([1000.0]) is None


def test_render_a_fake_payload():
    s = summarize(fake_results(), bursts=2, burst_s=10.0, prefill_tps=100.0, ttft_slo_s=2.0)
    s["by_replica"] = by_replica(fake_results(), 2.0)
    run = {"replicas": 1, "probe": {"prefill_tps": 100.0, "engines": [{"prefill_tps": 100.0}]}, "summary": s,
           "health_end": 200, "health": {"polls": 40, "failures": 0}, "rss_mib_before": {"total": 900.0},
           "rss_mib_after": [{"total": 1000.0}, {"total": 1010.0}], "max_send_lag_s": 0.004,
           "foreign_cpu": [{"foreign": 0.02, "steal": 0.0}, {"foreign": 0.31, "steal": 0.01}],
           "verdicts": verdicts(s, healthy=True, flat=True)}
    payload = {"bursts": 2, "burst_seconds": 10.0, "rate": 40.0, "prompt_tokens": 3600, "max_tokens": 16,
               "quiet_seconds": 20.0, "scheduler": "fcfs", "admission": "slo", "slo": "ttft:2000 tpot:100",
               "command": "python -m benchmarks.admission_burst", "machine": {"date": "today", "cpu": "CPU",
                                                                              "cores": 2},
               "runs": [run]}
    text = render(payload)
    assert "| --replicas 1 | target |" in text
    assert "| prefill tokens/s per engine (median of probes) | 100 |" in text
    assert "| other processes' CPU share, each burst | 2%, 31% |" in text
    assert "| ... per replica: met / accepted (median TTFT s) | -: 3/5 (1.45) |" in text
    assert "| accepted that met TTFT and TPOT (no target) | 60% (3/5) |" in text  # no TPOT SLO: TTFT only
    # burst 1: 3 x 1,000 accepted prompt tokens over 100 tokens/s x (10 + 2) s
    assert "| rejected | 6 |" in text and "| other | 1 | 0 |" in text and "| 250% (3 req) | >= 70% |" in text
    assert "- `--replicas 1`: nothing else MISSED, p99 time to 503 MISSED" in text
    assert "| server RSS MiB: before, after each burst | 900, 1000, 1010 |" in text


@pytest.mark.parametrize("argv", [["--replicas", "0"], ["--replicas", "x"], ["--rate", "0"],
                                  ["--slo", "tpot:100"], ["--slo", "ttft:soon"]])
def test_bad_options_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and "error:" in capsys.readouterr().err
