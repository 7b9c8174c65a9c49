"""``feather-serve --replicas N --replica-args 'K: ARGS'``: per-replica engine arguments, checked, and
carried to the right replica process (paced stand-ins in place of engines: no vLLM starts)."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from typing import Any

import pytest
from test_proxy import Running, get

from benchmarks.standin import standin_command
from scheduler_runtime.serving.cluster_base import ClusterConfig, flag_value, replica_kv_tokens
from scheduler_runtime.serving.proxy import proxy_for
from scheduler_runtime.serving.replica_args import check_replica_args, parse_replica_args
from scheduler_runtime.serving.replicas import replicas_for
from scheduler_runtime.serving.serve import _parse

SMALL = "1: --kv-cache-memory-bytes 268435456 --max-num-seqs 32"


def test_specs_are_read_per_replica():
    per = parse_replica_args([SMALL, "0: --max-num-batched-tokens=2048"], 3)
    assert per == (("--max-num-batched-tokens", "2048"),
                   ("--kv-cache-memory-bytes", "268435456", "--max-num-seqs", "32"), ())
    assert check_replica_args(0, ["--max_num_seqs", "8"]) == ("--max-num-seqs", "8")  # vLLM's underscores


@pytest.mark.parametrize("specs, message", [
    (["2: --max-num-seqs 8"], "no replica 2 (--replicas 2: 0 to 1)"),
    (["--max-num-seqs 8"], "expected 'K: ARGS'"),
    (["one: --max-num-seqs 8"], "expected 'K: ARGS'"),
    (["1: --max-num-seqs 8", "1: --kv-cache-memory-bytes 9"], "replica 1 named twice"),
    (["1: --max-num-seqs 8 --max-num-seqs 9"], "--max-num-seqs given twice"),
    (["1: --enforce-eager"], "--enforce-eager is not a per-replica engine argument"),
    (["1: --port 9000"], "--port cannot differ between replicas"),
    (["1: --model other"], "every replica serves the same model"),
    (["1: --cpu-cores 1"], "its entry of --replica-cores"),
    (["1: --max-num-seqs"], "--max-num-seqs needs a value"),
    (["1: --max-num-seqs 0"], "must be > 0"),
    (["1: --kv-cache-memory-bytes 1G"], "must be a whole number, got '1G'"),
    (["1: --gpu-memory-utilization 1.5"], "in (0, 1]"),
    (["1: 8"], "'8' is not an option"),
    (["1:"], "no engine arguments"),
    (["1: --max-num-seqs '8"], "No closing quotation"),
])
def test_a_bad_spec_names_the_replica_and_the_argument(specs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_replica_args(specs, 2)


def test_feather_serve_takes_them_and_refuses_what_contradicts_them(capsys):
    _, _, cluster, _ = _parse(["--replicas", "2", "--replica-args", SMALL])
    assert cluster.replica_args == ((), ("--kv-cache-memory-bytes", "268435456", "--max-num-seqs", "32"))
    big, small = (cluster.replica_vllm_args(k) for k in range(2))
    assert big == cluster.vllm_args and flag_value(big, "--max-num-seqs", "none") == "none"
    # its own value replaces the common one, which is gone from its command line
    assert flag_value(small, "--kv-cache-memory-bytes", "") == "268435456"
    assert small.count("--kv-cache-memory-bytes") == 1 and flag_value(small, "--max-num-seqs", "") == "32"
    assert cluster.kv_tokens == (replica_kv_tokens(big), replica_kv_tokens(small))
    assert replica_kv_tokens(big) > 4 * replica_kv_tokens(small)
    for argv, message in (
            (["--replicas", "2", "--data-plane", "ray", "--replica-args", SMALL], "needs --data-plane proxy"),
            (["--replicas", "1", "--replica-args", "0: --max-num-seqs 8"], "needs --replicas N >= 2"),
            (["--replicas", "2", "--scheduler", "feather-heuristic@4096",
              "--replica-args", "1: --max-num-batched-tokens 2048"], "budget of 4096 tokens"),
            (["--replicas", "2", "--admission", "slo", "--slo", "ttft:5000", "--replica-args", SMALL],
             "one engine's figures"),
            (["--replicas", "2", "--replica-args", "1: --foo 1"], "not a per-replica engine argument")):
        with pytest.raises(SystemExit):
            _parse(argv)
        assert message in capsys.readouterr().err, argv
    with pytest.raises(ValueError, match="2 entries for 3 replicas"):
        ClusterConfig(replicas=3, replica_args=((), ()))
    with pytest.raises(ValueError, match="not a per-replica"):
        ClusterConfig(replicas=2, replica_args=((), ("--enforce-eager",)))


def test_the_help_documents_it(capsys):
    with pytest.raises(SystemExit):
        _parse(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--replica-args 'K: ARGS'" in text and "--kv-cache-memory-bytes" in text


def test_each_replica_process_gets_its_own_arguments_and_the_routers_see_its_kv():
    """Replica 1 is started with 1/8 of replica 0's KV and its own --max-num-seqs; a stand-in of each
    (its KV blocks from the arguments it got, its name from its --max-num-seqs) publishes them as
    vLLM does, and the learned router reads each one's own KV from its /metrics."""
    got: dict[int, Sequence[str]] = {}

    def command(vllm_args: Sequence[str], port: int) -> list[str]:
        got[port] = list(vllm_args)
        blocks = replica_kv_tokens(vllm_args) // 128 + 1  # with vLLM's null block
        return [*standin_command(vllm_args, port), "--kv-blocks", str(blocks), "--block-size", "128",
                "--name", "seqs-" + flag_value(vllm_args, "--max-num-seqs", "default"), "--decode-ms", "1"]

    _, _, cluster, _ = _parse(["--replicas", "2", "--router", "prefix-learned", "--scrape-period", "0.1",
                               "--replica-args", SMALL])
    replicas = replicas_for(cluster, command=command, visible_gpus=[])
    ports = [int(r.url.rsplit(":", 1)[1]) for r in replicas]
    assert flag_value(got[ports[0]], "--max-num-seqs", "default") == "default"
    assert flag_value(got[ports[1]], "--max-num-seqs", "") == "32"
    # the processes themselves: each one's command line carries its own arguments
    assert [r.command[r.command.index("--name") + 1] for r in replicas] == ["seqs-default", "seqs-32"]
    kv = [replica_kv_tokens(got[p]) for p in ports]
    proxy = proxy_for(cluster, replicas)
    running = Running(proxy)
    try:
        running.wait_healthy(2)
        deadline = time.monotonic() + 30.0
        while True:
            answer = json.loads(get(running.url + "/replicas")[1])
            est: dict[str, Any] = {str(r["rank"]): r["estimates"] for r in answer}
            if all(e and e.get("kv_tokens") for e in est.values()):
                break
            assert time.monotonic() < deadline, est
            time.sleep(0.05)
        # vllm:cache_config_info's blocks x block size (the null block in): what each replica was given
        assert [est["0"]["kv_tokens"], est["1"]["kv_tokens"]] == [k + 128 for k in kv]
        import psutil

        lines = [psutil.Process(r.process.pid).cmdline() for r in proxy.replicas if r.process is not None]
        assert [line[line.index("--name") + 1] for line in lines] == ["seqs-default", "seqs-32"]
    finally:
        running.stop()
    # the prefix router (not learning) is told each replica's KV from its own arguments
    told = ClusterConfig(replicas=2, vllm_args=cluster.vllm_args, replica_args=cluster.replica_args)
    prefix = proxy_for(told, replicas)
    assert prefix.router.cached.limits == {"0": round(1.25 * kv[0]), "1": round(1.25 * kv[1])}


def test_feather_serve_fronts_running_servers_with_worker_urls(capsys):
    """``feather-serve --worker-urls`` is the proxy over servers that already run (the unequal loopback
    benchmark's ours runs it over stand-ins); mixed with engine options it is a usage error."""
    from scheduler_runtime.serving.serve import main

    with pytest.raises(SystemExit) as exc:
        main(["--worker-urls", "127.0.0.1:1", "--router", "prefix-learned"])
    assert exc.value.code == 2
    assert "feather-serve: error: --worker-urls: '127.0.0.1:1'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parse(["--worker-urls", "http://127.0.0.1:1", "--max-num-seqs", "4"])
    assert "give it to feather-serve alone" in capsys.readouterr().err
