"""``feather-serve --replicas N --replica-args 'K: ARGS'``: per-replica engine arguments, checked, and
carried to the right replica process (paced stand-ins in place of engines: no vLLM starts)."""

from __future__ import annotations

import json
import re
import shlex
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest
from test_proxy import Running, get

from benchmarks.standin import standin_command
from scheduler_runtime.admission import prompt_block_hashes
from scheduler_runtime.serving.admission_http import DEFAULT_PROFILE, ENV_VAR, AdmissionSettings
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
            (["--replicas", "2", "--replica-args", "1: --foo 1"], "not a per-replica engine argument")):
        with pytest.raises(SystemExit):
            _parse(argv)
        assert message in capsys.readouterr().err, argv
    with pytest.raises(ValueError, match="2 entries for 3 replicas"):
        ClusterConfig(replicas=3, replica_args=((), ()))
    with pytest.raises(ValueError, match="not a per-replica"):
        ClusterConfig(replicas=2, replica_args=((), ("--enforce-eager",)))


ADMISSION = ["--admission", "slo+deadline", "--slo", "ttft:5000 tpot:100", "--admission-profile",
             str(DEFAULT_PROFILE)]


def test_each_replica_gets_admission_settings_of_its_own_arguments(capsys):
    """The slo and deadline rules predict with each replica's own engine figures: its KV cache, its
    --max-num-seqs and its token budget, from the common arguments and its --replica-args."""
    _, _, cluster, common = _parse(["--replicas", "3", *ADMISSION, "--replica-args", SMALL,
                                    "--replica-args", "2: --max-num-batched-tokens 512"])
    assert common is not None and cluster.admission == common
    big, small, slow = (cluster.replica_admission(k) for k in range(3))
    assert big == common  # no arguments of its own: the common settings
    assert small is not None and slow is not None
    assert small.kv_capacity_tokens == replica_kv_tokens(cluster.replica_vllm_args(1))
    assert small.kv_capacity_tokens < big.kv_capacity_tokens
    assert (small.max_num_seqs, small.token_budget) == (32, big.token_budget)
    assert (slow.token_budget, slow.kv_capacity_tokens, slow.max_num_seqs) == (512, big.kv_capacity_tokens,
                                                                              big.max_num_seqs)
    for own in (small, slow):  # the rule, SLOs, status, tokenizer and step model are the fleet's
        assert replace(own, kv_capacity_tokens=big.kv_capacity_tokens, max_num_seqs=big.max_num_seqs,
                       token_budget=big.token_budget) == big
    # the scheduler name's @TOKENS is every replica's budget unless one gives its own (the same one)
    _, _, at, _ = _parse(["--replicas", "2", "--scheduler", "fcfs@4096", *ADMISSION, "--replica-args", SMALL])
    assert [at.replica_admission(k).token_budget for k in range(2)] == [4096, 4096]
    assert at.replica_admission(1).max_num_seqs == 32
    # and the rule decides by them: a long prompt cannot meet its TTFT at a replica's small budget
    # (never-fits, the proxy tries another replica), and is admitted at the large one
    controllers = [replace(s, slos={"ttft": 0.0}).controller() for s in (big, slow)]
    prompt = list(range(8000))
    alone = [c.alone_seconds(len(prompt)) for c in controllers]
    assert alone[0] < alone[1]
    ttft_ms = 1000.0 * (alone[0] + alone[1]) / 2
    hashes = prompt_block_hashes(prompt, big.block_size)
    decisions = [replace(s, slos={"ttft": ttft_ms}).controller().offer("r", len(prompt), hashes, 0.0)
                 for s in (big, slow)]
    assert decisions[0].admit and not decisions[1].admit
    assert decisions[1].reason == "never-fits" and not decisions[1].retry


def test_each_replica_process_is_started_with_its_own_admission_settings():
    """Each replica's API server reads its settings from its own environment (the middleware's
    :data:`ENV_VAR`), set per replica over the one feather-serve's process holds."""
    _, _, cluster, common = _parse(["--replicas", "2", *ADMISSION, "--replica-args", SMALL])
    replicas = replicas_for(cluster, command=lambda args, port: ["true"], visible_gpus=[])
    got = [AdmissionSettings.from_env(r.env) for r in replicas]
    assert got == [common, cluster.replica_admission(1)] and got[0] != got[1]
    assert got[1] is not None and got[1].max_num_seqs == 32
    # without a middleware no replica is told any
    _, _, plain, _ = _parse(["--replicas", "2", "--replica-args", SMALL])
    plain_replicas = replicas_for(plain, command=lambda args, port: ["true"], visible_gpus=[])
    assert all(ENV_VAR not in r.env for r in plain_replicas)


def test_print_command_shows_each_replicas_own_admission_settings(capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parse(["--replicas", "3", *ADMISSION, "--replica-args", SMALL,
                "--replica-args", "2: --long-prefill-token-threshold 512", "--print-command"])
    assert exit_info.value.code == 0
    first, *lines = capsys.readouterr().out.strip().splitlines()
    env = shlex.split(first)[0].split("=", 1)
    common = AdmissionSettings.from_env({env[0]: env[1]})
    assert common is not None
    _, _, cluster, _ = _parse(["--replicas", "3", *ADMISSION, "--replica-args", SMALL])
    small = cluster.replica_admission(1)
    assert small is not None
    assert lines[1:] == [
        "# replica 1: --kv-cache-memory-bytes 268435456 --max-num-seqs 32",
        f"# replica 1: {ENV_VAR} as above but "
        f'{{"kv_capacity_tokens": {small.kv_capacity_tokens}, "max_num_seqs": 32}}',
        "# replica 2: --long-prefill-token-threshold 512"]  # the same admission settings: no line


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
