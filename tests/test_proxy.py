"""The proxy data plane of ``feather-serve --replicas N`` (scheduler_runtime/serving/proxy.py),
with stand-ins.

No engine: the replicas are :mod:`benchmarks.standin` processes the proxy starts and supervises, as it
would start vLLM servers. The faults are asked through the request body (a stand-in exits before
answering, or mid-stream), so every case of the fault contract is exercised for real: a process dies,
its connection breaks, the proxy retries or reports, and restarts it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import psutil
import pytest

from benchmarks.cluster_server import REPO
from benchmarks.standin import standin_command
from feather_env.engines.vllm_engine import DEFAULT_MODEL_DIR, EngineConfig
from feather_env.evaluation.endpoint import parse_prometheus
from scheduler_runtime.hardware import online_cores
from scheduler_runtime.router import PrefixHasher
from scheduler_runtime.serving.cluster_base import ClusterConfig, flag_value, replica_kv_tokens
from scheduler_runtime.serving.proxy import CHARS_PER_TOKEN, ReplicaProxy, proxy_for, request_keys
from scheduler_runtime.serving.replicas import Replica, free_port, replica_command, replicas_for
from scheduler_runtime.serving.serve import vllm_arguments


class Running:
    """A :class:`ReplicaProxy` serving from a thread of its own (its own event loop)."""

    def __init__(self, proxy: ReplicaProxy) -> None:
        self.proxy = proxy
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.status: int | None = None
        self._ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self._ready.wait(10)
        deadline = time.monotonic() + 10.0
        while self.thread.is_alive():  # until it listens
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1.0).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the proxy does not listen"
                time.sleep(0.05)

    def _run(self) -> None:
        async def main() -> None:
            self.loop = asyncio.get_running_loop()
            self.stop_event = asyncio.Event()
            self._ready.set()
            self.status = await self.proxy.serve("127.0.0.1", self.port, self.stop_event)

        asyncio.run(main())

    def wait_healthy(self, n: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while sum(r.healthy for r in self.proxy.replicas) < n:
            assert time.monotonic() < deadline, [r.info() for r in self.proxy.replicas]
            time.sleep(0.1)

    def stop(self) -> None:
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.stop_event.set)
            self.thread.join(60)


def spawned(n: int, router: str = "prefix") -> ReplicaProxy:
    config = ClusterConfig(replicas=n, router=router)
    return ReplicaProxy(replicas_for(config, command=standin_command, visible_gpus=[]), router)


@pytest.fixture(scope="module")
def cluster():
    running = Running(spawned(2))
    try:
        running.wait_healthy(2)
        yield running
    finally:
        running.stop()


def post(url: str, body: dict[str, Any], path: str = "/v1/completions") -> tuple[int, dict[str, str], str]:
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, dict(resp.headers), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read().decode()


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def name_of(cluster: Running, rank: int) -> str:
    """A stand-in's name in fault requests (its port)."""
    return cluster.proxy.replicas[rank].url.rsplit(":", 1)[1]


def rank_of(headers: dict[str, str]) -> int:
    return int(headers["x-feather-replica"].split("/")[0])


def served(cluster: Running, rank: int) -> list[Any]:
    return json.loads(get(cluster.proxy.replicas[rank].url + "/standin/served")[1])


def documents(n: int, tokens: int = 1500, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 8000, tokens).tolist() for _ in range(n)]


# ------------------------------------------------------------------------------------ keys, no server


def test_request_keys_follow_the_prompts_prefix_without_tokenizing():
    hasher = PrefixHasher(512)
    doc = list(range(3, 1203))
    keys, tokens = request_keys({"prompt": doc + [1, 2]}, False, hasher)
    assert tokens == 1202 and np.array_equal(keys, hasher.hash(doc + [1, 2]))  # the CHT's own keys
    other, _ = request_keys({"prompt": [doc + [5]]}, False, hasher)  # a batch: its first prompt
    assert list(other[:2]) == list(keys[:2]) and other[2] != keys[2]

    text = "a document " * 800  # 8,800 bytes: 5 chunks of 2,048
    k1, t1 = request_keys({"prompt": text + "question one?"}, False, hasher)
    k2, _ = request_keys({"prompt": text + "question two?"}, False, hasher)
    assert len(k1) == 5 and t1 == -(-(len(text) + 13) // CHARS_PER_TOKEN)
    assert list(k1[:4]) == list(k2[:4]) and k1[4] != k2[4]

    messages = [{"role": "system", "content": text}, {"role": "user", "content": "first?"}]
    c1, _ = request_keys({"messages": messages}, True, hasher)
    parts = [{"role": "system", "content": [{"type": "text", "text": text}]},
             {"role": "user", "content": "2nd?"}]
    c2, _ = request_keys({"messages": parts}, True, hasher)
    assert list(c1[:4]) == list(c2[:4]) and c1[-1] != c2[-1]
    for body, chat in (({}, False), ({"prompt": ""}, False), ({"prompt": [-1]}, False),
                       ({"messages": 3}, True), ({"messages": ["x"]}, True)):
        assert request_keys(body, chat, hasher) == (None, None), body


def test_replica_command_and_configuration():
    args = ["--model", "m", "--port", "8000", "--host=0.0.0.0", "--max_num_seqs", "4"]
    command = replica_command(args, 9001)
    assert command[:2] == [sys.executable, "-c"]
    assert command[3:] == ["--model", "m", "--max_num_seqs", "4", "--host", "127.0.0.1", "--port", "9001"]
    replicas = replicas_for(ClusterConfig(replicas=3, replica_cores=("0", "1", "0-1"), vllm_args=("--x",)),
                            visible_gpus=[])
    assert [r.cores for r in replicas] == [[0], [1], [0, 1]]
    assert [r.env["VLLM_CPU_OMP_THREADS_BIND"] for r in replicas] == ["0", "1", "0,1"]
    assert len({r.url for r in replicas}) == 3
    gpus = replicas_for(ClusterConfig(replicas=2, replica_gpus=2), visible_gpus=list("0123"))
    assert [r.env["CUDA_VISIBLE_DEVICES"] for r in gpus] == ["0,1", "2,3"]
    with pytest.raises(ValueError, match="whole GPUs"):
        replicas_for(ClusterConfig(replicas=2, replica_gpus=0.5), visible_gpus=["0"])
    with pytest.raises(ValueError, match="--ray-address needs --data-plane ray"):
        ClusterConfig(replicas=2, ray_address="auto")
    with pytest.raises(ValueError, match="--data-plane"):
        ClusterConfig(replicas=2, data_plane="grpc")
    with pytest.raises(ValueError, match="router"):
        ReplicaProxy([Replica(0, "http://127.0.0.1:1")], "random")


def test_a_cluster_is_checked_where_it_is_made():
    """Code that builds a :class:`ClusterConfig` gets feather-serve's checks: cores this machine does
    not have are refused for replicas that run here (not on a Ray cluster's nodes), as are negative
    resources (feather-serve reports the same messages: ``test_cluster_command_line``)."""
    beyond = str(max(online_cores()) + 1)
    local = re.escape(f"--replica-cores '{beyond}': core(s) [{beyond}] are not among this machine's cores")
    with pytest.raises(ValueError, match=local):
        ClusterConfig(replicas=2, replica_cores=("0", beyond))
    with pytest.raises(ValueError, match="are not among"):  # a local Ray instance runs them here too
        ClusterConfig(replicas=2, data_plane="ray", replica_cores=("0", beyond))
    remote = ClusterConfig(replicas=2, data_plane="ray", ray_address="auto", replica_cores=("0", beyond))
    assert remote.replica_cores == ("0", beyond)  # the nodes' cores are not this machine's to check
    with pytest.raises(ValueError, match="--replica-cores: bad CPU core list 'x'"):
        ClusterConfig(replicas=2, replica_cores=("0", "x"))
    for resources in ({"replica_cpus": -1.0}, {"replica_gpus": -0.5}):
        with pytest.raises(ValueError, match="--replica-cpus and --replica-gpus must be >= 0"):
            ClusterConfig(replicas=2, **resources)


def test_the_prefix_router_is_told_each_replicas_kv_tokens():
    # feather-serve's defaults: 2 GiB of KV (twice that where the engine computes in float32, the
    # same tokens), blocks of 128: what the simulator's engine of that size holds
    args, _ = vllm_arguments(["--replicas", "2"])
    config = ClusterConfig(replicas=2, vllm_args=tuple(args), chunk_size=256)
    usable = EngineConfig(kv_cache_gib=2.0, block_size=128).usable_kv_tokens
    assert config.kv_tokens == usable == (2 * 1024 ** 3 // (128 * 4096) - 1) * 128
    proxy = proxy_for(config, replicas_for(config, command=standin_command, visible_gpus=[]))
    assert proxy.router.kv_tokens == usable and proxy.router.cached is not None
    assert proxy.router.chunk_size == 256 and proxy.router.load_factor == config.load_factor
    assert proxy_for(ClusterConfig(replicas=2, router="pow2", vllm_args=tuple(args)),
                     [Replica(0, "http://127.0.0.1:1")]).router.name == "pow2"

    model, kv = ("--model", str(DEFAULT_MODEL_DIR)), ("--kv-cache-memory-bytes", str(128 << 20))
    base = (*model, *kv, "--dtype", "bfloat16", "--block-size", "16")
    assert replica_kv_tokens(base) == EngineConfig(kv_cache_gib=0.125, block_size=16).usable_kv_tokens
    assert replica_kv_tokens((*base, "--dtype=float32")) == replica_kv_tokens(base) // 2 - 8  # 2x bytes/token
    assert replica_kv_tokens((*base, "--kv_cache_dtype", "fp8")) == 2 * replica_kv_tokens(base) + 16
    # two tensor-parallel ranks: each holds half of the KV heads in the same bytes
    assert replica_kv_tokens((*base, "--tensor-parallel-size", "2")) == 2 * replica_kv_tokens(base) + 16
    # vLLM's --num-gpu-blocks-override: that many blocks whatever the bytes (a hub model's too)
    assert replica_kv_tokens((*base, "--num-gpu-blocks-override", "65")) == 64 * 16
    assert replica_kv_tokens(("--model", "meta-llama/Llama-3.1-8B", "--num_gpu_blocks_override=9")) == 8 * 16
    # unknown: vLLM sizes the cache at start, a hub model, dtype auto; then the cache model is off
    assert replica_kv_tokens((*model, "--dtype", "bfloat16")) is None
    assert replica_kv_tokens(("--model", "meta-llama/Llama-3.1-8B", *kv, "--dtype", "bfloat16")) is None
    assert replica_kv_tokens((*model, *kv)) is None
    external = ReplicaProxy([Replica(0, "http://127.0.0.1:1"), Replica(1, "http://127.0.0.1:2")])
    assert external.router.kv_tokens is None and external.router.cached is None
    assert flag_value(["--port", "1", "--port=2"], "--port", "0") == "2"


def test_feather_serve_chooses_the_data_plane():
    def serve(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "scheduler_runtime.serving.serve", *args], cwd=REPO,
                              capture_output=True, text=True, timeout=120)

    out = serve("--replicas", "2", "--replica-cores", "0;1", "--print-command")
    assert out.returncode == 0 and "x 2 replicas behind the proxy, router prefix" in out.stdout, out.stderr
    out = serve("--replicas", "2", "--data-plane", "ray", "--print-command")
    assert out.returncode == 0 and "x 2 replicas on Ray Serve" in out.stdout, out.stderr
    out = serve("--replicas", "2", "--data-plane", "proxy", "--ray-address", "auto")
    assert out.returncode == 2 and "--ray-address needs --data-plane ray" in out.stderr, out.stderr


# ------------------------------------------------------------------------------------ two stand-ins


def test_a_documents_questions_follow_its_prefix(cluster):
    docs = documents(8, seed=1)
    where: dict[int, set[int]] = {i: set() for i in range(8)}
    for round_ in range(3):
        for i, doc in enumerate(docs):
            status, headers, _ = post(cluster.url, {"prompt": doc + [round_, i], "max_tokens": 2})
            assert status == 200 and headers["x-feather-attempts"] == "1"
            where[i].add(rank_of(headers))
    assert all(len(r) == 1 for r in where.values()), where  # one replica per document
    assert set().union(*where.values()) == {0, 1}, where  # the documents spread over both
    text = "a shared document. " * 400
    ranks = {rank_of(post(cluster.url, {"prompt": text + f"q{i}", "max_tokens": 2})[1]) for i in range(4)}
    chat = [{"role": "user", "content": text}]
    ranks_chat = {rank_of(post(cluster.url, {"messages": chat + [{"role": "user", "content": f"q{i}"}]},
                               "/v1/chat/completions")[1]) for i in range(4)}
    assert len(ranks) == 1 and len(ranks_chat) == 1


def test_streams_pass_through_unchanged(cluster):
    body = {"prompt": "hello", "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}
    status, headers, text = post(cluster.url, body)
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    rank = rank_of(headers)
    _, direct_headers, direct = post(cluster.proxy.replicas[rank].url, body)
    # the same bytes as the replica's own answer, but for the id that counts its requests
    assert text.replace(f"-{_count(text)}\"", "\"") == direct.replace(f"-{_count(direct)}\"", "\"")
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] == 5
    status, headers, text = post(cluster.url, {"prompt": [1, 2, 3], "max_tokens": 3})
    assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 3
    assert headers["Content-Type"].startswith("application/json")


def _count(text: str) -> str:
    return json.loads(text.splitlines()[0][6:])["id"].rsplit("-", 1)[1]


def test_bad_requests_are_answered_here(cluster):
    request = urllib.request.Request(cluster.url + "/v1/completions", data=b"{not json",
                                     headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=30)
    assert err.value.code == 400 and "not JSON" in json.loads(err.value.read())["error"]["message"]
    status, text = get(cluster.url + "/v1/models")
    assert status == 200 and json.loads(text)["data"][0]["id"] == "stand-in"


def test_health_and_metrics_carry_every_replica(cluster):
    status, text = get(cluster.url + "/health")
    assert status == 200 and json.loads(text) == {"healthy_replicas": 2, "replicas": 2}
    for i in range(16):  # new prefixes: spread by their hash
        post(cluster.url, {"prompt": [9, 9, i], "max_tokens": 1})
    samples = parse_prometheus(get(cluster.url + "/metrics")[1])

    def total(name: str, **labels: str) -> float:
        return sum(v for n, lab, v in samples
                   if n == name and all(lab.get(k) == x for k, x in labels.items()))

    per = [total("vllm:request_success_total", replica=r) for r in ("0", "1")]
    assert all(p > 0 for p in per)
    assert total("vllm:request_success_total") == sum(per) == total("cluster:vllm:request_success_total")
    assert total("feather_cluster_requests_total", outcome="ok") >= 4
    assert total("feather_router_decisions_total") >= 4
    assert total("feather_cluster_replicas", state="answered") == 2
    info = json.loads(get(cluster.url + "/replicas")[1])
    assert [r["rank"] for r in info] == [0, 1] and all(r["healthy"] and r["pid"] for r in info)


def test_a_replica_lost_before_answering_is_retried_once_and_restarted(cluster):
    doc = documents(1, seed=7)[0]
    _, headers, _ = post(cluster.url, {"prompt": doc + [1], "max_tokens": 2})
    first = rank_of(headers)
    old_pid = cluster.proxy.replicas[first].process.pid
    restarts = cluster.proxy.replicas[first].restarts
    body = {"prompt": doc + [2], "max_tokens": 4, "user": "retried",
            "standin": {"die_on": [name_of(cluster, first)]}}
    status, headers, text = post(cluster.url, body)
    assert status == 200 and headers["x-feather-attempts"] == "2" and rank_of(headers) == 1 - first
    assert json.loads(text)["usage"]["completion_tokens"] == 4
    assert served(cluster, 1 - first).count("retried") == 1
    cluster.wait_healthy(2)
    replica = cluster.proxy.replicas[first]
    assert replica.restarts == restarts + 1 and replica.process.pid != old_pid
    assert "retried" not in served(cluster, first)  # the new incarnation never saw it


def test_503_when_every_replica_is_lost(cluster):
    cluster.wait_healthy(2)
    body = {"prompt": [5, 6, 7], "max_tokens": 2, "user": "doomed",
            "standin": {"die_on": [name_of(cluster, 0), name_of(cluster, 1)]}}
    status, headers, text = post(cluster.url, body)
    assert status == 503 and "on the retry too" in json.loads(text)["error"]["message"]
    # both come back
    cluster.wait_healthy(2)
    assert post(cluster.url, {"prompt": [5, 6, 8], "max_tokens": 1})[0] == 200


def test_a_replica_lost_mid_stream_ends_the_stream_with_an_error_event(cluster):
    cluster.wait_healthy(2)
    body = {"prompt": [11, 12], "max_tokens": 8, "stream": True,
            "standin": {"die_after": {name_of(cluster, 0): 3, name_of(cluster, 1): 3}}}
    status, headers, text = post(cluster.url, body)
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert status == 200 and headers["x-feather-attempts"] == "1"
    assert len(events) == 5 and events[-1] == "[DONE]"
    assert "mid-stream" in json.loads(events[-2])["error"]["message"]
    cluster.wait_healthy(2)


def test_a_kill_under_load_serves_nothing_twice(cluster):
    """40 requests in flight at once, one replica SIGKILLed: each request is answered once (served,
    retried, or a clear error), and the surviving replica served exactly what it answered."""
    cluster.wait_healthy(2)
    docs = documents(4, seed=9)
    victim = cluster.proxy.replicas[0].process.pid
    survivor_before = len(served(cluster, 1))

    def one(i: int) -> tuple[int, dict[str, str], str]:
        return post(cluster.url, {"prompt": docs[i % 4] + [i], "max_tokens": 4, "user": f"u{i}",
                                  "standin": {"delay_s": 0.5}})

    with ThreadPoolExecutor(40) as pool:
        futures = [pool.submit(one, i) for i in range(40)]
        time.sleep(0.3)
        os.kill(victim, signal.SIGKILL)
        results = [f.result() for f in futures]
    ok = [h for s, h, _ in results if s == 200]
    assert all(s in (200, 503) for s, _, _ in results)
    assert len(ok) >= 20
    by_survivor = sorted(f"u{i}" for i, (s, h, _) in enumerate(results) if s == 200 and rank_of(h) == 1)
    assert sorted(served(cluster, 1)[survivor_before:]) == by_survivor  # nothing extra, nothing twice
    cluster.wait_healthy(2)


# ------------------------------------------------------------------------------------ other set-ups


def test_no_healthy_replica_is_a_503():
    running = Running(ReplicaProxy([Replica(0, f"http://127.0.0.1:{free_port()}")]))
    try:
        status, text = get(running.url + "/health")
        assert status == 503 and json.loads(text)["healthy_replicas"] == 0
        status, _, text = post(running.url, {"prompt": "x"})
        assert status == 503 and "no engine replica is healthy" in json.loads(text)["error"]["message"]
    finally:
        running.stop()


def test_a_replica_that_fails_to_start_ends_the_command():
    bad = Replica(0, f"http://127.0.0.1:{free_port()}", command=[sys.executable, "-c", "raise SystemExit(3)"])
    running = Running(ReplicaProxy([bad]))
    running.thread.join(30)
    assert running.status == 1 and "status 3" in running.proxy.failed_start


def test_a_replica_whose_process_cannot_be_made_ends_the_command_with_the_reason():
    """A replica pinned to a core this process may not use once failed in ``Popen`` (``sched_setaffinity``
    in the child): supervision died with it, and the proxy served on without that replica, unsupervised.
    (``feather-serve`` refuses such ``--replica-cores`` itself; this is the proxy's own guard.)"""
    beyond = max(online_cores()) + 1
    bad = Replica(0, f"http://127.0.0.1:{free_port()}", command=[sys.executable, "-c", "pass"],
                  cores=[beyond])
    running = Running(ReplicaProxy([bad]))
    running.thread.join(30)
    assert running.status == 1 and "replica 0 could not start (SubprocessError" in running.proxy.failed_start


def test_a_slow_starting_replica_is_waited_for_after_a_restart():
    """Failed probes of a replica that is still starting (an engine loading) do not kill it."""
    port = free_port()
    command = [*standin_command((), port), "--start-delay", "3"]
    running = Running(ReplicaProxy([Replica(0, f"http://127.0.0.1:{port}", command=command)]))
    try:
        running.wait_healthy(1)
        replica = running.proxy.replicas[0]
        first = replica.process.pid
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not (replica.healthy and replica.process is not None and replica.process.pid != first):
            assert time.monotonic() < deadline, replica.info()
            time.sleep(0.1)
        assert replica.restarts == 1
    finally:
        running.stop()


def test_pow2_router_and_the_max_ongoing_bound():
    proxy = spawned(2, router="pow2")
    proxy.max_ongoing = 1
    running = Running(proxy)
    try:
        running.wait_healthy(2)
        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(lambda i: post(running.url, {"prompt": [i], "max_tokens": 1,
                                                                 "standin": {"delay_s": 0.3}}), range(6)))
        assert all(s == 200 for s, _, _ in results)
        assert {rank_of(h) for _, h, _ in results} == {0, 1}
    finally:
        running.stop()
    assert all(r.process.poll() is not None for r in proxy.replicas)  # stopped with the proxy


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl's parent-death signal is Linux's")
def test_a_child_started_with_die_with_parent_does_not_outlive_a_killed_parent(tmp_path):
    # the parent (a test, a benchmark, feather-serve) is SIGKILLed: no finally runs, yet its server goes
    parent_program = (
        "import subprocess, sys, time\n"
        "from scheduler_runtime.serving.replicas import die_with_parent\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'],"
        " start_new_session=True, preexec_fn=die_with_parent)\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(300)\n")
    parent = subprocess.Popen([sys.executable, "-c", parent_program], cwd=REPO, stdout=subprocess.PIPE)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    assert psutil.pid_exists(child)
    parent.kill()
    parent.wait(timeout=30)
    deadline = time.monotonic() + 30
    while True:
        try:
            if psutil.Process(child).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        assert time.monotonic() < deadline, "the child outlived its killed parent"
        time.sleep(0.1)
