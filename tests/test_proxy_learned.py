"""The proxy feeding the learned router (``--router prefix-learned``) from what vLLM publishes and from
the streams it relays: :mod:`scheduler_runtime.serving.vllm_metrics` and the proxy's scrapes, first
tokens and finishes.

No engine: vLLM's ``/metrics`` is a hand-written exposition in vLLM 0.32's names
(``tests/data/vllm_metrics_sample.txt``), and the replicas are paced stand-ins
(:class:`benchmarks.standin.StandInWorkers`) of unequal speed and KV that publish vLLM's metrics.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_proxy import Running, get, post

from benchmarks.standin import StandInWorkers, standin_command
from feather_env.evaluation.endpoint import parse_prometheus
from scheduler_runtime.learned_router import LearnedRouter
from scheduler_runtime.router import PrefixAffinityRouter
from scheduler_runtime.serving.cluster_base import ClusterConfig, estimates_exposition
from scheduler_runtime.serving.proxy import ReplicaProxy, parse_per_worker, proxy_for
from scheduler_runtime.serving.proxy import main as proxy_main
from scheduler_runtime.serving.replicas import Replica, replicas_for
from scheduler_runtime.serving.serve import _parse
from scheduler_runtime.serving.vllm_metrics import parse_vllm_metrics, restarted
from scheduler_runtime.sse import stream_output_tokens

SAMPLE = Path(__file__).resolve().parent / "data" / "vllm_metrics_sample.txt"


# ------------------------------------------------------------------------------------ the parser


def test_a_vllm_exposition_is_read_into_the_routers_dict():
    scrape = parse_vllm_metrics(SAMPLE.read_text())
    m = scrape.metrics
    assert scrape.skipped == 0
    assert m["vllm:cache_config_info"] == {"num_gpu_blocks": 4095, "block_size": 128}
    assert m["vllm:num_requests_running"] == 3 and m["vllm:num_requests_waiting"] == 2
    assert m["vllm:kv_cache_usage_perc"] == 0.4375
    assert m["vllm:request_prefill_time_seconds_sum"] == 112.5
    assert m["vllm:request_queue_time_seconds_sum"] == 188.75
    assert m["vllm:request_decode_time_seconds_sum"] == 1319.25
    assert m["vllm:request_prompt_tokens_sum"] == 412672 and m["vllm:request_prompt_tokens_count"] == 199
    assert m["vllm:request_generation_tokens_sum"] == 25344
    assert m["vllm:prefix_cache_hits_total"] == 301056 and m["vllm:prefix_cache_queries_total"] == 412672
    assert m["vllm:request_success_total"] == 199  # every finished_reason together
    assert not any(k.endswith(("_bucket", "_created")) for k in m)
    assert "vllm:num_requests_waiting_by_reason" not in m and "vllm:prompt_tokens_cached_total" not in m
    # the keys the simulator's replicas publish (ReplicaSim.metrics) are all there
    from feather_env.cluster_sim import _SERVED_KEYS

    assert set(_SERVED_KEYS) <= set(m)
    router = LearnedRouter()
    router.scraped("0", m)
    assert router.estimates()["0"]["kv_tokens"] == 4095 * 128


def test_data_parallel_engines_are_summed():
    text = "".join(f'vllm:cache_config_info{{engine="{e}",block_size="16",num_gpu_blocks="100"}} 1.0\n'
                   f'vllm:num_requests_running{{engine="{e}",model_name="m"}} {e + 1}\n'
                   f'vllm:kv_cache_usage_perc{{engine="{e}",model_name="m"}} {0.2 * (e + 1)}\n'
                   for e in range(2))
    m = parse_vllm_metrics(text).metrics
    assert m["vllm:cache_config_info"] == {"num_gpu_blocks": 200, "block_size": 16}
    assert m["vllm:num_requests_running"] == 3 and m["vllm:kv_cache_usage_perc"] == pytest.approx(0.3)


@pytest.mark.parametrize("text, skipped", [
    ("", 0), ("<html>502 Bad Gateway</html>", 0), ("\x00\xff garbage {{{\n", 0),
    ('vllm:num_requests_running{engine="0"} abc\n', 1),
    ('vllm:num_requests_running{engine="0"} NaN\n', 1),
    ('vllm:cache_config_info{engine="0",block_size="16",num_gpu_blocks="None"} 1.0\n', 1),
    ("vllm:cache_config_info 1.0\n", 1),
    ('vllm:request_prefill_time_seconds_sum{engine="0"} 12.5', 1),  # cut off: no newline at the end
])
def test_bad_or_partial_text_is_skipped_and_counted(text, skipped):
    scrape = parse_vllm_metrics(text)
    assert scrape.metrics == {} and scrape.skipped == skipped


def test_a_cut_off_answer_keeps_what_came_whole():
    text = SAMPLE.read_text()
    cut = text[:text.index("vllm:request_decode_time_seconds_sum") + 45]
    scrape = parse_vllm_metrics(cut)
    assert scrape.skipped == 1 and "vllm:request_decode_time_seconds_sum" not in scrape.metrics
    assert scrape.metrics["vllm:request_prefill_time_seconds_sum"] == 112.5
    assert parse_vllm_metrics(None).metrics == {}  # type: ignore[arg-type]


def test_a_restarted_server_is_told_from_its_counters():
    before = parse_vllm_metrics(SAMPLE.read_text()).metrics
    assert not restarted(before, before)
    assert restarted(before, {**before, "vllm:request_success_total": 0.0})
    assert restarted(before, {**before, "vllm:cache_config_info": {"num_gpu_blocks": 1, "block_size": 128}})
    assert restarted(before, {**before, "process_start_time_seconds": 2e9})
    assert not restarted(before, {"vllm:num_requests_running": 0.0})  # nothing to compare


def test_a_streams_output_tokens():
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":12,"total_tokens":21}}\n\n'
    assert stream_output_tokens(99, usage + b"data: [DONE]\n\n", chat=False) == 12
    assert stream_output_tokens(99, usage + b"data: [DONE]\n\n", chat=False, choices=2) == 6
    done = b'data: {"choices":[{"text":"x"}]}\n\ndata: [DONE]\n\n'
    assert stream_output_tokens(9, done, chat=False) == 8  # 8 token events and [DONE]
    assert stream_output_tokens(10, done, chat=True) == 8  # and the role chunk first
    assert stream_output_tokens(17, done, chat=False, choices=2) == 8
    assert stream_output_tokens(1, b"data: [DONE]\n\n", chat=False) is None
    escaped = b'data: {"choices":[{"text":"\\"completion_tokens\\": 5"}]}\n\ndata: [DONE]\n\n'
    assert stream_output_tokens(2, escaped, chat=False) == 1  # a quoted one in the text is not the usage


# ------------------------------------------------------------------------------------ configuration


def test_the_learned_router_is_chosen_and_told_only_what_is_given():
    urls = [Replica(0, "http://127.0.0.1:1"), Replica(1, "http://127.0.0.1:2")]
    proxy = ReplicaProxy(urls, "prefix-learned")
    assert isinstance(proxy.router, LearnedRouter) and proxy.tracks and proxy.observes
    assert proxy.router.told is None and proxy.router.told_kv_tokens is None
    told = ReplicaProxy(urls, "prefix-learned", kv_tokens=[4096, 16384], replica_weights=[1.0, 0.5])
    assert told.router.told_kv_tokens == {"0": 4096, "1": 16384}
    assert told.router.told("1", 0.0) == (2.0, 2.0) and told.router.told("0", 0.0) == (1.0, 1.0)
    prefix = ReplicaProxy(urls, "prefix", kv_tokens=[4096, 16384])  # unequal KV in ours' cache model
    assert isinstance(prefix.router, PrefixAffinityRouter) and not prefix.observes
    assert prefix.router.cached.limits == {"0": round(1.25 * 4096), "1": round(1.25 * 16384)}
    with pytest.raises(ValueError, match="3 values for 2 replicas"):
        ReplicaProxy(urls, "prefix-learned", kv_tokens=[1, 2, 3])
    with pytest.raises(ValueError, match="learned router"):
        ReplicaProxy(urls, "prefix", replica_weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="must be > 0"):
        ReplicaProxy(urls, "prefix-learned", replica_weights=[1.0, 0.0])
    assert parse_per_worker("1,0.5", "--replica-weights") == [1.0, 0.5]
    with pytest.raises(ValueError, match="--kv-tokens"):
        parse_per_worker("4096,x", "--kv-tokens", integer=True)


def test_feather_serve_takes_the_learned_router(capsys):
    _, _, cluster, _ = _parse(["--replicas", "2", "--router", "prefix-learned", "--replica-weights", "1,0.5",
                               "--scrape-period", "0.5", "--replica-cores", "0;0"])
    assert cluster.router == "prefix-learned" and cluster.replica_weights == (1.0, 0.5)
    proxy = proxy_for(cluster, [Replica(0, "http://127.0.0.1:1"), Replica(1, "http://127.0.0.1:2")])
    # told no KV even where the engine arguments give it: it reads vllm:cache_config_info
    assert cluster.kv_tokens is not None and proxy.router.told_kv_tokens is None
    assert proxy.scrape_period_s == 0.5 and proxy.router.told("1", 0.0) == (2.0, 2.0)
    _, _, on_ray, _ = _parse(["--replicas", "2", "--router", "prefix-learned", "--data-plane", "ray"])
    assert on_ray.router == "prefix-learned" and on_ray.data_plane == "ray"
    for argv, message in ((["--data-plane", "ray", "--replica-weights", "1,2"], "names its replicas"),
                          (["--replica-weights", "1"], "1 weights for 2 replicas")):
        with pytest.raises(SystemExit):
            _parse(["--replicas", "2", "--router", "prefix-learned", "--replica-cores", "0;0", *argv])
        assert message in capsys.readouterr().err
    with pytest.raises(ValueError, match="prefix-learned only"):
        ClusterConfig(replicas=2, replica_weights=(1.0, 1.0))


def test_the_kv_guard_reaches_the_learned_router_on_every_path(capsys):
    urls = [Replica(0, "http://127.0.0.1:1"), Replica(1, "http://127.0.0.1:2")]
    assert ReplicaProxy(urls, "prefix-learned", kv_guard=True).router.kv_guard
    assert not ReplicaProxy(urls, "prefix-learned").router.kv_guard
    with pytest.raises(ValueError, match="learned router"):
        ReplicaProxy(urls, "prefix", kv_guard=True)
    _, _, cluster, _ = _parse(["--replicas", "2", "--router", "prefix-learned", "--kv-guard",
                               "--replica-cores", "0;0"])
    assert cluster.kv_guard and proxy_for(cluster, urls).router.kv_guard
    knobs = cluster.learned_router_kwargs()  # what Ray Serve's request router is built with
    assert knobs["kv_guard"] is True and "kv_tokens" not in knobs
    assert LearnedRouter(**knobs).kv_guard
    with pytest.raises(SystemExit):
        _parse(["--replicas", "2", "--router", "prefix", "--kv-guard", "--replica-cores", "0;0"])
    assert "--kv-guard is a knob of --router prefix-learned only" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # over running servers: the proxy's own command line
        proxy_main(["--worker-urls", "http://127.0.0.1:1", "--router", "prefix", "--kv-guard"])
    assert "--kv-guard" in capsys.readouterr().err


def test_the_queue_time_switch_reaches_the_router_and_the_replicas_engine_flag_on_every_path():
    """``--queue-time service`` (the learned router reads each stream's reported wait; the
    default): its replicas, the proxy's and Ray Serve's, start with vLLM's ``--enable-per-request-metrics``
    (once, even where given); with ``--queue-time off``, or another router, their arguments are left as
    they are."""
    urls = [Replica(0, "http://127.0.0.1:1"), Replica(1, "http://127.0.0.1:2")]
    base = ["--replicas", "2", "--replica-cores", "0;0"]
    modes = (([], "service"), (["--queue-time", "service"], "service"), (["--queue-time", "off"], "off"))
    for switch, mode in modes:
        _, _, cluster, _ = _parse([*base, "--router", "prefix-learned", *switch])
        on = mode != "off"
        assert cluster.reads_queue_time is on and cluster.learned_router_kwargs()["queue_time"] == mode
        proxy = proxy_for(cluster, urls)
        assert proxy.router.queue_time == mode and proxy.reads_wait is on
        assert LearnedRouter(**cluster.learned_router_kwargs()).queue_time == mode  # Ray Serve's router
        for rank in (0, 1):
            assert cluster.replica_vllm_args(rank).count("--enable-per-request-metrics") == int(on)
    _, _, given, _ = _parse([*base, "--router", "prefix-learned", "--enable-per-request-metrics"])
    assert given.replica_vllm_args(1).count("--enable-per-request-metrics") == 1
    _, _, prefix, _ = _parse([*base, "--router", "prefix"])
    assert not prefix.reads_queue_time and "--enable-per-request-metrics" not in prefix.replica_vllm_args(0)
    assert not proxy_for(prefix, urls).reads_wait
    assert not ReplicaProxy(urls, "pow2").reads_wait
    with pytest.raises(SystemExit):
        _parse([*base, "--router", "prefix-learned", "--queue-time", "yes"])
    with pytest.raises(ValueError, match="--queue-time must be one of"):
        ClusterConfig(replicas=2, router="prefix-learned", queue_time="on")


def test_the_estimates_exposition():
    text = estimates_exposition({"0": {"prefill_tok_s": 5000.0, "decode_tok_s": None, "kv_tokens": 4096,
                                       "prefill_samples": 3, "decode_samples": 0}}, {"ok": 2}, 1)
    samples = parse_prometheus(text)
    assert ("feather_router_replica_prefill_tok_s", {"replica": "0"}, 5000.0) in samples
    assert ("feather_router_replica_kv_tokens", {"replica": "0"}, 4096.0) in samples
    assert not any(n == "feather_router_replica_decode_tok_s" for n, _, _ in samples)  # not learned yet
    assert ("feather_router_replica_samples", {"replica": "0", "kind": "prefill"}, 3.0) in samples
    assert ("feather_router_scrapes_total", {"outcome": "ok"}, 2.0) in samples


# ------------------------------------------------------------------------------------ two paced workers

FAST = {"prefill_s_per_token": 2e-5, "decode_s_per_token": 0.002, "kv_blocks": 1024, "block_size": 16}
SLOW = {"prefill_s_per_token": 1e-4, "decode_s_per_token": 0.008, "kv_blocks": 256, "block_size": 16}


def _estimates(url: str) -> dict[str, Any]:
    return {str(r["rank"]): r["estimates"] for r in json.loads(get(url + "/replicas")[1])}


def _wait(check: Any, timeout_s: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_the_proxy_learns_a_fast_and_a_slow_worker_and_forgets_a_restarted_one():
    rng = np.random.default_rng(3)
    with StandInWorkers(2, paces=[FAST, SLOW]) as workers:
        replicas = [Replica(k, url) for k, url in enumerate(workers.urls)]
        running = Running(ReplicaProxy(replicas, "prefix-learned", scrape_period_s=0.1))
        try:
            running.wait_healthy(2)
            # both KV sizes come from the scrapes before anything is served
            _wait(lambda: all(e and e["kv_tokens"] for e in _estimates(running.url).values()))
            est = _estimates(running.url)
            assert est["0"]["kv_tokens"] == 1024 * 16 and est["1"]["kv_tokens"] == 256 * 16

            def one(i: int) -> tuple[int, dict[str, str], str]:
                body: dict[str, Any] = {"prompt": rng.integers(3, 8000, 600).tolist(), "max_tokens": 8,
                                        "stream": True}
                if i % 2:  # half of them with the usage block, half counted by their events
                    body["stream_options"] = {"include_usage": True}
                return post(running.url, body)

            with ThreadPoolExecutor(4) as pool:
                results = list(pool.map(one, range(48)))
            assert all(status == 200 and text.rstrip().endswith("data: [DONE]")
                       for status, _, text in results)
            est = _estimates(running.url)
            fast, slow = est["0"], est["1"]
            # both served at first (nothing learned: ours' least loaded), then mostly the fast one
            assert slow["prefill_samples"] >= 1 and slow["decode_samples"] >= 1, est
            assert fast["prefill_samples"] > 3 * slow["prefill_samples"], est
            assert fast["prefill_tok_s"] > 2 * slow["prefill_tok_s"], est
            assert fast["decode_tok_s"] > 2 * slow["decode_tok_s"], est
            # the decode speed is about the workers' own: 1 / 2 ms and 1 / 8 ms per token
            assert 200 < fast["decode_tok_s"] < 600 and 60 < slow["decode_tok_s"] < 150, est
            assert fast["queued_tokens"] == slow["queued_tokens"] == 0
            # 8 output tokens each, from the usage block or counted from the events alike
            assert running.proxy.router._output.value == pytest.approx(8.0)
            samples = parse_prometheus(get(running.url + "/metrics")[1])
            gauges = {(n, lab.get("replica"), lab.get("kind")): v for n, lab, v in samples
                      if n.startswith("feather_router_replica_")}
            assert gauges[("feather_router_replica_prefill_tok_s", "0", None)] == pytest.approx(
                fast["prefill_tok_s"], rel=0.5)
            assert gauges[("feather_router_replica_kv_tokens", "1", None)] == 256 * 16
            assert gauges[("feather_router_replica_samples", "1", "decode")] == slow["decode_samples"]
            assert any(n == "feather_router_scrapes_total" and lab["outcome"] == "ok" and v > 0
                       for n, lab, v in samples)

            # a new server behind worker 1's URL: its counters went back, so what was learned goes
            workers.restart(1)
            _wait(lambda: running.proxy.scrapes["restarted"] >= 1)
            est = _wait(lambda: (e := _estimates(running.url))["1"] and e["1"]["kv_tokens"] and e)
            assert est["1"]["prefill_samples"] == est["1"]["decode_samples"] == 0
            assert est["1"]["prefill_tok_s"] is None or est["1"]["prefill_tok_s"] == est["0"]["prefill_tok_s"]
            assert est["1"]["kv_tokens"] == 256 * 16
            assert est["0"]["prefill_samples"] == fast["prefill_samples"]  # the other one keeps its own
        finally:
            running.stop()


def test_a_replica_process_that_dies_is_forgotten_and_relearned():
    """``feather-serve --replicas N``'s path: the proxy's own replica processes (paced stand-ins); one
    SIGKILLed is restarted, and what was learned of it goes with it (its KV comes back by a scrape)."""
    def command(vllm_args: Any, port: int) -> list[str]:
        return [*standin_command(vllm_args, port), "--kv-blocks", "64", "--decode-ms", "1"]

    config = ClusterConfig(replicas=2, router="prefix-learned")
    proxy = ReplicaProxy(replicas_for(config, command=command, visible_gpus=[]), "prefix-learned",
                         scrape_period_s=0.1)
    running = Running(proxy)
    try:
        running.wait_healthy(2)
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda i: post(running.url, {"prompt": [i] * 300, "max_tokens": 4, "stream": True}),
                          range(16)))
        # the KV comes from a scrape, whose period is not tied to the requests: wait for both
        est = _wait(lambda: (e := _estimates(running.url)) and all(r.get("kv_tokens") for r in e.values())
                    and e, 30.0)
        assert all(e["prefill_samples"] > 0 and e["kv_tokens"] == 64 * 16 for e in est.values()), est
        victim = proxy.replicas[1]
        pid = victim.process.pid
        os.kill(pid, signal.SIGKILL)
        _wait(lambda: victim.process is not None and victim.process.pid != pid and victim.healthy, 30.0)
        est = _wait(lambda: (e := _estimates(running.url))["1"] and e["1"]["kv_tokens"] and e)
        assert est["1"]["prefill_samples"] == 0 and est["0"]["prefill_samples"] > 0, est
    finally:
        running.stop()


def test_the_proxy_reads_each_streams_reported_wait_and_strips_the_usage_it_asked_for():
    """``queue_time`` (``service``, the default): a stream whose client set no stream options is asked for its
    usage chunk, whose ``metrics.queue_time_ms`` (the stand-in's wait before its prefill, as vLLM's
    ``--enable-per-request-metrics`` reports it) reaches the router before the finish, and the client
    gets the stream without it; a client that asked for usage gets it, metrics and all. With
    ``queue_time="off"`` the body goes as it came."""
    paced = {**SLOW, "prefill_s_per_token": 3e-4, "per_request_metrics": True}
    with StandInWorkers(1, paces=[paced]) as workers:
        replicas = [Replica(0, workers.urls[0])]
        for queue_time in ("service", "off"):
            running = Running(ReplicaProxy(replicas, "prefix-learned", scrape_period_s=0.1,
                                           queue_time=queue_time))
            try:
                running.wait_healthy(1)

                def one(i: int, url: str = running.url) -> tuple[int, dict[str, str], str]:
                    body: dict[str, Any] = {"prompt": [i + 3] * 600, "max_tokens": 4, "stream": True}
                    if i % 2:
                        body["stream_options"] = {"include_usage": True}
                    return post(url, body)

                with ThreadPoolExecutor(6) as pool:  # one prefill at a time: most of them wait
                    results = list(pool.map(one, range(12)))
                for i, (status, _, text) in enumerate(results):
                    events = [e for e in text.split("\n\n") if e.strip()]
                    assert status == 200 and events[-1] == "data: [DONE]"
                    usage = [json.loads(e[5:]) for e in events[:-1] if '"usage"' in e]
                    assert len(events) == 4 + 1 + len(usage)  # four tokens, [DONE], the usage if asked
                    assert len(usage) == i % 2
                    if usage:
                        assert usage[0]["metrics"]["queue_time_ms"] >= 0
                router = running.proxy.router
                reports = 12 if queue_time == "service" else 0
                assert router.counts["queue_reports"] == reports, [t[-200:] for _, _, t in results]
                exposed = parse_prometheus(get(running.url + "/metrics")[1])
                assert ("feather_router_queue_reports_total", {}, float(reports)) in exposed
                assert not router._held and not router._requests
                waits = [json.loads(e[5:])["metrics"]["queue_time_ms"] for _, _, text in results
                         for e in text.split("\n\n") if '"usage"' in e]
                assert max(waits) > 100.0, waits  # 600 tokens at 0.3 ms each, served one at a time
            finally:
                running.stop()


def test_a_client_that_stops_reading_at_done_was_served_and_its_stream_still_teaches():
    """An SSE client stops at ``data: [DONE]`` and closes the connection, as SSE clients do, before the
    proxy ends the chunked stream (the stand-in holds its end back). The whole answer was relayed: the
    outcome is ``ok`` and the router still hears the stream's output tokens and reported wait (before,
    such a stream counted as ``client_gone`` and taught nothing: a quarter of the loopback's streams)."""
    paced = {**SLOW, "per_request_metrics": True}
    with StandInWorkers(1, paces=[paced]) as workers:
        running = Running(ReplicaProxy([Replica(0, workers.urls[0])], "prefix-learned", scrape_period_s=0.1))
        try:
            running.wait_healthy(1)
            body = {"prompt": [7] * 300, "max_tokens": 4, "stream": True, "standin": {"linger_s": 0.5}}
            raw = json.dumps(body).encode()
            with socket.create_connection(("127.0.0.1", running.port), timeout=10) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             + f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
                got = b""
                while b"data: [DONE]" not in got:
                    data = sock.recv(65536)
                    assert data, got
                    got += data
            assert b'"usage"' not in got  # the chunk the proxy asked for stays with the proxy
            router = running.proxy.router
            _wait(lambda: not router._requests)
            assert router.counts["queue_reports"] == 1
            assert router._output.value == pytest.approx(4.0)
            assert running.proxy.stats.counts[("0", "ok")] == 1
            assert running.proxy.stats.counts[("0", "client_gone")] == 0
        finally:
            running.stop()
