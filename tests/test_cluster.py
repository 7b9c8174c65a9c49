"""``feather-serve --replicas 2`` on loopback: two vLLM engines with Feather behind the prefix router,
started once per data plane (the proxy, scheduler_runtime/serving/proxy.py; Ray Serve,
scheduler_runtime/serving/cluster.py),
driven over HTTP as a client would (``FEATHER_TEST_REPLICA_CORES="0;0"`` pins both replicas to core 0).

The unit tests at the top need no engine: the exposition of ``/metrics`` and the command line.
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("ray.serve", reason="the [cluster] extra (ray[serve]) is not installed")

from benchmarks.cluster_server import REPO, ClusterServer  # noqa: E402
from feather_env.evaluation.endpoint import EndpointConfig, evaluate_endpoint, parse_prometheus  # noqa: E402
from feather_env.evaluation.report import summarize  # noqa: E402
from feather_env.workloads import Request, Workload  # noqa: E402
from scheduler_runtime.hardware import online_cores, parse_cores  # noqa: E402
from scheduler_runtime.serving import cluster, cluster_base  # noqa: E402

CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
SERVER_ARGS = ["--kv-cache-memory-bytes", str(128 << 20), "--max-model-len", "4096", "--max-num-seqs", "32",
               "--max-num-batched-tokens", "4096"]

EXPOSITION = """# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="tiny-llama"} %(hits)s
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny-llama"} %(running)s
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="1.0",model_name="tiny-llama"} %(fast)s
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="tiny-llama"} %(all)s
vllm:e2e_request_latency_seconds_count{engine="0",model_name="tiny-llama"} %(all)s
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="tiny-llama"} 2.5
"""


def _total(samples, name, **labels):
    return sum(v for n, lab, v in samples if n == name and all(lab.get(k) == x for k, x in labels.items()))


# ------------------------------------------------------------------------------------ no engine


def test_metrics_carry_the_replica_and_their_sums():
    texts = {"0": EXPOSITION % {"hits": 100, "running": 2, "fast": 3, "all": 5},
             "1": EXPOSITION % {"hits": 40, "running": 1, "fast": 1, "all": 4}}
    families = [cluster_base._families(text, replica) for replica, text in texts.items()]
    exposition = cluster_base._exposition(families)
    samples = parse_prometheus(cluster_base.replica_exposition(texts.items()))
    # one family, once: its HELP and TYPE, then every replica's samples (as Prometheus requires)
    assert exposition.count("# TYPE vllm:prefix_cache_hits_total counter") == 1
    # each replica's series, labelled; a client summing a metric over its samples gets the total
    assert _total(samples, "vllm:prefix_cache_hits_total", replica="0") == 100
    assert _total(samples, "vllm:prefix_cache_hits_total", replica="1") == 40
    assert _total(samples, "vllm:prefix_cache_hits_total") == 140
    # the sums, under their own names (so that they are not counted twice)
    assert _total(samples, "cluster:vllm:prefix_cache_hits_total") == 140
    assert _total(samples, "cluster:vllm:num_requests_running") == 3
    assert _total(samples, "cluster:vllm:e2e_request_latency_seconds_bucket", le="1.0") == 4
    assert _total(samples, "cluster:vllm:e2e_request_latency_seconds_count") == 9
    assert all("replica" not in lab for n, lab, _ in samples if n.startswith("cluster:"))


def test_replica_loss_is_told_apart_from_other_errors():
    from ray.exceptions import ActorDiedError, RayTaskError

    assert cluster._replica_lost(ActorDiedError())
    assert not cluster._replica_lost(ValueError("bad request"))
    assert not cluster._replica_lost(RayTaskError("f", "traceback", ValueError("x")))


def test_the_ray_router_is_told_each_replicas_kv_tokens():
    from scheduler_runtime.serving.ray_router import PrefixRequestRouter
    from scheduler_runtime.serving.serve import vllm_arguments

    args, _ = vllm_arguments(["--replicas", "2", "--data-plane", "ray"])
    config = cluster.ClusterConfig(replicas=2, data_plane="ray", vllm_args=tuple(args), chunk_size=256)
    assert config.kv_tokens == (2 * 1024 ** 3 // (128 * 4096) - 1) * 128  # 2 GiB, blocks of 128, less one
    app = cluster.build_app(config)  # the ingress bound to the engine deployment; nothing started
    engine = app._bound_deployment.init_args[0]._bound_deployment
    kwargs = engine._deployment_config.request_router_config.request_router_kwargs
    assert kwargs == config.router_kwargs()
    router = PrefixRequestRouter.__new__(PrefixRequestRouter)  # Ray's constructor needs a running Serve
    try:
        router.initialize_state(**kwargs)
        assert router.affinity.kv_tokens == config.kv_tokens and router.affinity.cached is not None
        assert router.affinity.chunk_size == 256
    finally:
        cluster_base.LIVE_ROUTERS.remove(router)


def test_rays_own_prefix_router_is_deployed_and_reads_the_prompt():
    from ray.serve.llm.request_router import PrefixCacheAffinityRouter

    from scheduler_runtime.serving.serve import vllm_arguments

    args, _ = vllm_arguments(["--replicas", "2", "--data-plane", "ray"])
    config = cluster.ClusterConfig(replicas=2, router="ray-prefix-affinity", data_plane="ray",
                                   vllm_args=tuple(args))
    app = cluster.build_app(config)  # nothing started
    engine = app._bound_deployment.init_args[0]._bound_deployment
    routed_by = engine._deployment_config.request_router_config.request_router_class
    assert routed_by == f"{PrefixCacheAffinityRouter.__module__}.{PrefixCacheAffinityRouter.__name__}"
    with pytest.raises(ValueError, match="needs --data-plane ray"):
        cluster.ClusterConfig(replicas=2, router="ray-prefix-affinity", data_plane="proxy")
    # the call's arguments as the ingress makes them: Ray's router finds the prompt (or the messages)
    router = PrefixCacheAffinityRouter.__new__(PrefixCacheAffinityRouter)
    for body, text in (({"model": "m", "prompt": "the document", "max_tokens": 4}, "the document"),
                       ({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, "hi")):
        call = SimpleNamespace(args=("completion", cluster.TextBody(body), None))
        assert text in router._extract_text_from_request(call)
        again = pickle.loads(pickle.dumps(cluster.TextBody(body)))  # as Ray sends it to the replica
        assert again == body and isinstance(again, cluster.TextBody)
    assert not hasattr(cluster.TextBody({"model": "m"}), "prompt")


def test_cluster_command_line(capsys):
    out = subprocess.run([sys.executable, "-m", "scheduler_runtime.serving.serve", "--replicas", "3",
                          "--router",
                          "pow2", "--data-plane", "ray", "--replica-cores", "0;1;0-1", "--print-command"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "x 3 replicas on Ray Serve, router pow2, cores per replica ['0', '1', '0-1']" in out.stdout
    for bad, message in ((["--replicas", "0"], "--replicas must be >= 1"),
                         (["--replicas", "2", "--replica-cores", "0;x"], "bad CPU core list 'x': cores like"),
                         (["--replicas", "2", "--replica-cores", f"0;{max(online_cores()) + 1}"],
                          "are not among this machine's cores"),
                         (["--replicas", "2", "--router", "random"], "invalid choice: 'random'"),
                         (["--replicas", "2", "--replica-cpus", "-1", "--print-command"],
                          "--replica-cpus and --replica-gpus must be >= 0"),
                         (["--replicas", "2", "--port", "http", "--print-command"],
                          "--port must be a port number, got 'http'"),
                         (["--replicas", "2", "--max-ongoing-requests", "0", "--print-command"],
                          "--max-ongoing-requests must be >= 1")):
        out = subprocess.run([sys.executable, "-m", "scheduler_runtime.serving.serve", *bad], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and message in out.stderr and not out.stdout, (bad, out.stderr)
    with pytest.raises(ValueError, match="--router"):
        cluster.ClusterConfig(replicas=2, router="nope")


# ------------------------------------------------------------------------------------ two engines


#: ``--replica-cores`` for the two replicas (e.g. ``"0;0"`` on a machine whose other core is busy);
#: unset: the default, one core each of the whole machine.
REPLICA_CORES = os.environ.get("FEATHER_TEST_REPLICA_CORES")


@pytest.fixture(scope="module", params=["proxy", "ray"])
def server(request, tmp_path_factory):
    """Two engine replicas behind the prefix router, once per data plane (the proxy; Ray Serve)."""
    root = tmp_path_factory.mktemp(f"cluster-{request.param}")
    template = root / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    # the session's in-process engine pins this process to one core, and a launched server inherits
    # that: launch it with every core of the machine, as a user's shell would
    pinned = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") and not REPLICA_CORES else None
    if pinned is not None:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    cores = ["--replica-cores", REPLICA_CORES] if REPLICA_CORES else []
    # on Ray, each replica's admission rule too, with a TTFT SLO no test request comes near (ten
    # minutes): only a client's own x-slo-ttft-ms can make one shed (the proxy's is checked in
    # tests/test_serve_admission.py)
    admission = ["--admission", "slo", "--slo", "ttft:600000"] if request.param == "ray" else []
    try:
        cluster = ClusterServer(2, "prefix", [*SERVER_ARGS, "--chat-template", str(template),
                                              "--data-plane", request.param, *cores, *admission],
                                log_path=root / "server.log")
        running = cluster.__enter__()
        running.data_plane = request.param
    finally:
        if pinned is not None:
            os.sched_setaffinity(0, pinned)
    try:
        yield running
    finally:
        cluster.__exit__(None, None, None)


def post(url: str, body: dict, timeout: float = 300.0):
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        return resp.status, dict(resp.headers), resp.read().decode()


def documents(n: int, tokens: int = 1024, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 8000, tokens).tolist() for _ in range(n)]


def complete(server, prompt, max_tokens: int = 4, **extra):
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0.0, **extra}
    return post(server.url + "/v1/completions", body)


@pytest.mark.engine
def test_replicas_are_pinned_to_their_own_cores(server):
    info = sorted(server.replica_info(), key=lambda r: r["rank"])
    assert [r["rank"] for r in info] == [0, 1]
    if REPLICA_CORES:
        expected = [sorted(set(parse_cores(c))) for c in REPLICA_CORES.split(";")]
        assert [r["affinity"] for r in info] == expected
    elif (os.cpu_count() or 1) >= 2:
        assert [r["affinity"] for r in info] == [[0], [1]]


@pytest.mark.engine
def test_completions_and_chat_streamed_or_not(server):
    status, headers, text = complete(server, "Hello there, how are you", max_tokens=6)
    body = json.loads(text)
    assert status == 200 and body["usage"]["completion_tokens"] == 6 and body["choices"][0]["text"]
    assert headers["x-feather-attempts"] == "1" and headers["x-feather-replica"][0] in "01"

    status, _, text = complete(server, list(range(10, 60)), max_tokens=5, stream=True,
                               stream_options={"include_usage": True})
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    # one chunk per token, unless the engine made two before the stream took one: vLLM then sends them as
    # one chunk (its output collector merges the deltas a slow consumer has not taken)
    assert 1 <= sum(1 for c in chunks if c["choices"]) <= 5 and chunks[-1]["usage"]["completion_tokens"] == 5

    chat = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Say something."}],
            "max_tokens": 3, "min_tokens": 3, "ignore_eos": True, "temperature": 0.0}
    status, _, text = post(server.url + "/v1/chat/completions", chat)
    body = json.loads(text)
    assert status == 200 and body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 3
    assert body["choices"][0]["message"]["role"] == "assistant"
    status, _, text = post(server.url + "/v1/chat/completions", {**chat, "stream": True})
    assert status == 200 and "chat.completion.chunk" in text and text.rstrip().endswith("data: [DONE]")

    # a bad request is vLLM's 400, not a retry or a 503
    request = urllib.request.Request(server.url + "/v1/completions", data=b'{"model": "nope", "prompt": "x"}',
                                     headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=60)
    assert err.value.code in (400, 404) and "error" in json.loads(err.value.read())


@pytest.mark.engine
def test_a_documents_questions_meet_on_one_replica(server):
    """12 new documents at once: the load bound (at most 8 of 12 in flight on one replica) spreads
    them over both replicas; then each document's later questions go where its first one went."""
    docs = documents(12, seed=1)
    rng = np.random.default_rng(2)

    async def first_round() -> list[str]:
        calls = [asyncio.to_thread(complete, server, doc + rng.integers(3, 8000, 8).tolist(), 16)
                 for doc in docs]
        return [headers["x-feather-replica"] for _, headers, _ in await asyncio.gather(*calls)]

    where = {i: {replica} for i, replica in enumerate(asyncio.run(first_round()))}
    assert len(set().union(*where.values())) == 2, where  # the documents spread over both
    for _ in range(2):
        for i, doc in enumerate(docs):
            _, headers, _ = complete(server, doc + rng.integers(3, 8000, 8).tolist(), max_tokens=2)
            where[i].add(headers["x-feather-replica"])
    assert all(len(replicas) == 1 for replicas in where.values()), where  # one replica per document


@pytest.mark.engine
def test_metrics_are_every_replicas_and_evaluate_reads_them(server):
    docs = documents(3, tokens=600, seed=3)
    rng = np.random.default_rng(4)
    requests = [Request(f"q{i}", np.array(docs[i % 3] + rng.integers(3, 8000, 6).tolist()), i % 3, 4)
                for i in range(9)]
    config = EndpointConfig(server.url, label="cluster", max_concurrency=3, reset_prefix_cache=True)
    metrics = summarize(evaluate_endpoint(Workload("docs", tuple(requests)), config, progress=False))
    assert metrics["completed"] == 9 and metrics["failed"] == 0
    assert metrics["prefix_hit_rate"] is not None and metrics["prefix_hit_rate"] > 0.3
    samples = parse_prometheus(server.metrics())
    for name in ("vllm:request_success_total", "feather_scheduler_schedule_calls_total"):
        per = [_total(samples, name, replica=r) for r in ("0", "1")]
        assert _total(samples, name) == sum(per) == _total(samples, "cluster:" + name) > 0, name
    assert _total(samples, "feather_router_decisions_total") >= 9
    assert _total(samples, "feather_cluster_replicas", state="answered") == 2


@pytest.mark.engine
def test_on_ray_a_request_every_replica_sheds_is_one_clear_rejection(server):
    """A client's 1-µs TPOT SLO: the replica's rule refuses it (it could never fit), and the ingress
    answers that rejection once (it does not try the other replica: ``--reroute-shed`` is off), 503
    with x-should-retry: false; sheds are not errors."""
    if server.data_plane != "ray":
        pytest.skip("the proxy's admission is tests/test_serve_admission.py's")
    body = {"model": "tiny-llama", "prompt": documents(1, tokens=64, seed=9)[0], "max_tokens": 2}
    errors = _total(parse_prometheus(server.metrics()), "feather_cluster_errors_total")
    request = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json", "x-slo-tpot-ms": "0.001"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=60)
    error = refused.value
    assert error.code == 503 and error.headers["x-feather-admission"] == "never-fits"
    assert error.headers["x-should-retry"] == "false" and error.headers["x-feather-attempts"] == "1"
    assert json.loads(error.read())["error"]["type"] == "overloaded"
    assert complete(server, body["prompt"], max_tokens=2)[0] == 200  # without the header: served
    samples = parse_prometheus(server.metrics())
    assert _total(samples, "feather_cluster_shed_total", outcome="rejected") == 1
    assert _total(samples, "feather_cluster_requests_total", outcome="shed") == 1
    assert _total(samples, "feather_admission_rejected_total", reason="never-fits") == 1
    assert _total(samples, "feather_cluster_errors_total") == errors


@pytest.mark.engine
def test_a_killed_replica_is_restarted_and_nothing_is_lost(server):
    """SIGKILL one replica's process while requests are in flight: each request is answered (served,
    or retried once on the other replica, or a clear error), and the replica serves again."""
    victim = next(r for r in server.replica_info() if r["rank"] == 0)
    docs = documents(4, tokens=1500, seed=5)

    async def one(i: int) -> tuple[int, str, str]:
        def call():
            try:
                status, headers, text = complete(server, docs[i % 4] + [7, 8, i], max_tokens=24)
                return status, headers.get("x-feather-replica", ""), text
            except urllib.error.HTTPError as exc:
                return exc.code, "", exc.read().decode()
        return await asyncio.to_thread(call)

    async def run():
        tasks = [asyncio.create_task(one(i)) for i in range(12)]
        await asyncio.sleep(1.0)
        os.kill(victim["pid"], signal.SIGKILL)
        return await asyncio.gather(*tasks)

    t0 = time.monotonic()
    results = asyncio.run(run())
    for status, _, text in results:
        if status == 200:
            assert json.loads(text)["usage"]["completion_tokens"] == 24
        else:
            assert status == 503 and "failed" in json.loads(text)["error"]["message"]
    assert sum(1 for s, _, _ in results if s == 200) >= 6
    while True:  # a new process of rank 0, healthy
        server.wait_healthy(2, timeout_s=300)
        new = next((r for r in server.replica_info() if r["rank"] == 0), {"pid": victim["pid"]})
        back = time.monotonic() - t0
        if new["pid"] != victim["pid"] and new.get("healthy", True):
            break
        assert back < 300, new
        time.sleep(1.0)
    status, _, _ = complete(server, docs[0] + [1, 2, 3], max_tokens=2)
    assert status == 200
    assert not _pid_alive(victim["pid"])


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.engine
def test_sigterm_stops_everything_it_started(server):
    report = server.stop()
    assert report["returncode"] == 0, server.log_tail()
    assert report["processes"] >= 4 and report["left_over"] == [], report
