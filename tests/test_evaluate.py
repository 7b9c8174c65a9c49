"""evaluate.py: in-process, against feather-serve and vLLM's own server, then compare; its errors; its report.

The end-to-end fixture runs the command lines a user types, each in a subprocess: ``evaluate.py
--quick`` in-process (one engine: fcfs, feather-heuristic, and the two policies train.py exported, a
Q-learning table alone and a PPO MLP with SVF admission), ``feather-serve`` on loopback with
``evaluate.py --endpoint URL --quick`` against it, the same against vLLM's own server (no Feather in
it), and ``evaluate.py compare`` over the three folders. The servers are sized like the in-process
engine (0.5 GiB KV). A second in-process run serves 8 LongBench requests with svf and oracle-svf on a
KV cache too small for all of them at once, SVF's setting. The other tests start no engine.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import evaluate
from feather_env.evaluation import endpoint, inprocess, report
from feather_env.evaluation.server import LocalServer, free_port
from feather_env.records import RequestTimeline
from feather_env.workloads import synthetic_workload
from scheduler_runtime.hardware import online_cores

REPO = Path(__file__).resolve().parent.parent
QUICK_SCHEDULERS = ("fcfs", "feather-heuristic")
#: Every key of vllm bench serve's result JSON that our results carry (percentile 99: vLLM's default).
VLLM_KEYS = ["duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
             "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
             "max_output_tokens_per_s", "max_concurrent_requests"] + [
    f"{stat}_{name}_ms" for name in ("ttft", "tpot", "itl", "e2el")
    for stat in ("mean", "median", "std", "p99")]


def _cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python evaluate.py ARGS`` as a user runs it (stdout and stderr together)."""
    return subprocess.run([sys.executable, str(REPO / "evaluate.py"), *args], cwd=REPO, timeout=timeout,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _requests(folder: Path) -> dict[str, list[dict[str, str]]]:
    rows: dict[str, list[dict[str, str]]] = {}
    with (folder / "requests.csv").open() as fh:
        for row in csv.DictReader(fh):
            rows.setdefault(row["run"], []).append(row)
    return rows


@pytest.fixture(scope="module")
def schedulers(exported_policies) -> tuple[str, ...]:
    return (*QUICK_SCHEDULERS, f"feather:{exported_policies['table']}",
            f"feather:{exported_policies['mlp']}+svf")


@pytest.fixture(scope="module")
def e2e(tmp_path_factory, data_dir, schedulers):
    root = tmp_path_factory.mktemp("evaluate")
    out = {"inprocess": root / "inprocess", "feather": root / "feather", "vllm": root / "vllm",
           "compare": root / "compare"}
    proc = _cli("--quick", "--schedulers", ",".join(schedulers), "--out", str(out["inprocess"]))
    assert proc.returncode == 0, proc.stdout[-4000:]
    console = {"inprocess": proc.stdout}
    _, engine, _ = evaluate.build_workload(evaluate._parse_args(["--quick"]))
    with LocalServer("feather-heuristic", engine, log_path=root / "feather-serve.log") as server:
        proc = _cli("--quick", "--endpoint", server.url, "--goodput", "ttft:60000", "e2el:60000",
                    "--reset-prefix-cache", "--out", str(out["feather"]))
        assert proc.returncode == 0, proc.stdout[-4000:] + server.log_tail()
        console["feather"] = proc.stdout
        # --check against the server: asked for its model, served nothing (its counters say)
        before, text = endpoint.read_metrics(server.url), io.StringIO()
        with contextlib.redirect_stdout(text):
            rc = evaluate.main(["--quick", "--endpoint", server.url, "--check", "--out", str(root / "chk")])
        after = endpoint.read_metrics(server.url)
        console["check"] = rc, text.getvalue(), endpoint._server_figures(before, after)
    with LocalServer(None, engine, log_path=root / "vllm-serve.log") as server:
        assert "scheduler_runtime" not in " ".join(server.command)
        proc = _cli("--quick", "--endpoint", server.url + "/v1", "--label", "vllm-own",
                    "--max-concurrency", "4", "--out", str(out["vllm"]))
        assert proc.returncode == 0, proc.stdout[-4000:] + server.log_tail()
        console["vllm"] = proc.stdout
    proc = _cli("compare", str(out["inprocess"]), str(out["feather"]), str(out["vllm"]),
                "--out", str(out["compare"]))
    assert proc.returncode == 0, proc.stdout[-4000:]
    console["compare"] = proc.stdout
    payloads = {k: json.loads((v / "results.json").read_text()) for k, v in out.items()}
    return out, payloads, console


@pytest.mark.engine
def test_every_request_of_every_run_completes_with_its_tokens(e2e, schedulers):
    out, payloads, _ = e2e
    n = payloads["inprocess"]["workload"]["requests"]
    assert 6 <= n <= 12
    labels = {"inprocess": list(schedulers), "vllm": ["vllm-own"]}
    for kind in ("inprocess", "feather", "vllm"):
        runs = payloads[kind]["runs"]
        if kind in labels:
            assert list(runs) == labels[kind]
        assert payloads[kind]["workload"]["fingerprint"] == payloads["inprocess"]["workload"]["fingerprint"]
        for label, rows in _requests(out[kind]).items():
            assert runs[label]["submitted"] == runs[label]["completed"] == len(rows) == n, label
            assert runs[label]["failed"] == 0 and "errors" not in runs[label]
            for r in rows:
                assert int(r["tokens"]) == int(r["output_len"]) == 8 and int(r["finished_count"]) == 1
                t = [float(r[k]) for k in ("arrival", "first_token", "finish")]
                assert all(math.isfinite(x) for x in t) and t[0] <= t[1] <= t[2], r


@pytest.mark.engine
def test_vllm_bench_serve_keys_are_present_and_agree_with_the_request_timelines(e2e):
    out, payloads, _ = e2e
    for kind in ("inprocess", "feather", "vllm"):
        for label, rows in _requests(out[kind]).items():
            m = payloads[kind]["runs"][label]
            missing = [k for k in VLLM_KEYS if k not in m]
            assert not missing, (label, missing)
            tokens = sum(int(r["tokens"]) for r in rows)
            prompt = sum(int(r["prompt_len"]) for r in rows)
            e2el = [float(r["finish"]) - float(r["arrival"]) for r in rows]
            ttft = [float(r["first_token"]) - float(r["arrival"]) for r in rows]
            tpot = [(float(r["finish"]) - float(r["first_token"])) / (int(r["tokens"]) - 1) for r in rows]
            # the same throughput, seconds vs milliseconds
            assert m["total_output_tokens"] == tokens and m["total_input_tokens"] == prompt
            assert m["output_throughput"] == pytest.approx(tokens / m["duration"])
            assert m["request_throughput"] == pytest.approx(len(rows) / m["duration"])
            assert m["total_token_throughput"] == pytest.approx((tokens + prompt) / m["duration"])
            assert m["mean_e2el_ms"] == pytest.approx(1000 * np.mean(e2el))
            assert m["mean_ttft_ms"] == pytest.approx(1000 * np.mean(ttft))
            assert m["mean_tpot_ms"] == pytest.approx(1000 * np.mean(tpot))  # the first token excluded
            assert m["duration"] >= max(e2el) > 0 and m["p99_e2el_ms"] >= m["median_e2el_ms"] > 0
            gaps = [len(r["itl"].split()) for r in rows]
            if kind == "inprocess":
                assert gaps == [7] * len(rows)  # one output per engine step: 8 tokens, 7 gaps
            else:
                assert all(1 <= g <= 7 for g in gaps)  # a streamed chunk may carry several tokens
    feather = next(iter(payloads["feather"]["runs"].values()))
    assert feather["goodput_slos_ms"] == {"ttft": 60000.0, "e2el": 60000.0}
    assert feather["request_goodput"] == pytest.approx(feather["request_throughput"])  # generous SLOs
    assert payloads["vllm"]["runs"]["vllm-own"]["request_goodput"] is None  # as vLLM without --goodput


@pytest.mark.engine
def test_endpoint_runs_read_the_servers_metrics(e2e):
    _, payloads, _ = e2e
    n = payloads["inprocess"]["workload"]["requests"]
    (label, feather), = payloads["feather"]["runs"].items()
    vllm = payloads["vllm"]["runs"]["vllm-own"]
    assert label.startswith("feather-heuristic@127.0.0.1:")  # named after the server's scheduler
    assert feather["server_scheduler"] == "feather-heuristic" and vllm["server_scheduler"] is None
    assert feather["prefix_cache_reset"] is True and vllm["prefix_cache_reset"] is False
    for m in (feather, vllm):
        s = m["server"]
        assert s["request_success"] == n and s["generation_tokens"] == m["total_output_tokens"]
        assert s["prompt_tokens"] == m["total_input_tokens"] and m["preemptions"] == 0
        assert 0 < m["prefix_hit_rate"] < 1  # 3 documents x several questions
    f = feather["server"]["feather"]
    assert f["released_total"] == n and f["decisions_total"] == f["add_total"] + f["stop_total"]
    # at most 4 in flight: the other requests waited for a slot at the client (vLLM's client_queue_time)
    assert vllm["max_concurrency"] == 4 and 0 < vllm["mean_client_queue_ms"] < vllm["max_client_queue_ms"]
    # the same scheduler on the same workload hits the prefix cache as often in-process and served
    inproc = payloads["inprocess"]["runs"]["feather-heuristic"]
    assert feather["prefix_hit_rate"] == pytest.approx(inproc["prefix_hit_rate"], abs=0.05)


@pytest.mark.engine
def test_check_against_a_server_asks_its_model_and_serves_nothing(e2e):
    out, _, console = e2e
    rc, text, figures = console["check"]
    assert rc == 0 and ", model " in text and ": the server runs its own scheduler" in text, text
    assert text.rstrip().endswith("nothing served")
    assert figures["server"]["request_success"] == 0 and figures["server"]["prompt_tokens"] == 0
    assert not (out["feather"].parent / "chk").exists()


@pytest.mark.engine
def test_in_process_runs_keep_the_schedulers_own_figures(e2e, schedulers):
    out, payloads, _ = e2e
    runs = payloads["inprocess"]["runs"]
    fcfs, feather = runs["fcfs"], runs["feather-heuristic"]
    n = fcfs["submitted"]
    assert fcfs["scheduler_stats"] is None and fcfs["scheduler_overhead_frac"] is None  # vLLM's own
    assert feather["scheduler_stats"]["finished"] == n and 0 <= feather["scheduler_overhead_frac"] < 1
    for name in schedulers[2:]:  # the exported policies decided in the engine
        stats = runs[name]["scheduler_stats"]
        assert stats["finished"] == n and stats["decisions"] == stats["adds"] + stats["stops"] > 0
        assert stats["faults"] == {}, name
    for m in runs.values():
        assert m["decode_tok_s"] > 0 and m["mean_running_batch"] >= 1 and m["preemptions"] == 0
        assert m["max_slowdown"] > 0 and 0 <= m["foreign_cpu"] <= 1 and m["prefix_hit_rate"] > 0.3
        assert 0 <= m["mean_queue_ms"] <= m["max_queue_ms"] <= m["mean_e2el_ms"] * 2
    assert (out["inprocess"] / "steps.csv").is_file() and (out["inprocess"] / "batch_size.png").is_file()
    log = (out["inprocess"] / "vllm.log").read_text()
    assert "Initializing a V1 LLM engine" in log  # vLLM's lines went to the run folder ...
    assert "Tokenizer not available" not in log  # ... and the warm-up traceback is gone


@pytest.mark.engine
def test_console_output_is_short_and_says_where_the_results_went(e2e):
    out, _, console = e2e
    for kind in ("inprocess", "feather", "vllm", "compare"):
        lines = console[kind].splitlines()
        assert len(lines) <= 40, (kind, console[kind])
        assert f"results in {out[kind]}/" in console[kind]
        assert not [x for x in lines if " INFO " in x or "WARNING" in x or "Traceback" in x], console[kind]
    assert "vllm.log" in console["inprocess"]


@pytest.mark.engine
def test_compare_merges_in_process_and_endpoint_runs(e2e):
    out, payloads, console = e2e
    merged = payloads["compare"]
    assert merged["same_workload"] is True
    expected = [*payloads["inprocess"]["runs"], *payloads["feather"]["runs"], *payloads["vllm"]["runs"]]
    assert list(merged["runs"]) == expected
    for kind in ("inprocess", "feather", "vllm"):
        for label, m in payloads[kind]["runs"].items():
            assert merged["runs"][label] == m and merged["sources"][label] == str(out[kind])
    for name in ("throughput.png", "latency_cdf.png", "batch_size.png", "results.md", "requests.csv"):
        assert (out["compare"] / name).stat().st_size > 0, name
    assert all(f"| {label} |" in console["compare"] for label in expected)


@pytest.fixture(scope="module")
def longbench_run(tmp_path_factory, data_dir):
    out = tmp_path_factory.mktemp("eval-longbench")
    proc = _cli("--workload", "longbench", "--data-dir", str(data_dir), "--schedulers", "svf,oracle-svf",
                "--num-requests", "8", "--max-prompt-tokens", "2048", "--output", "max",
                "--max-output-tokens", "32", "--kv-cache-gib", "0.03125", "--max-num-seqs", "16",
                "--arrival", "burst", "--seed", "1", "--out", str(out), "--no-progress", "--no-plots",
                "--no-isolated")
    assert proc.returncode == 0, proc.stdout[-4000:]
    return json.loads((out / "results.json").read_text())


@pytest.mark.engine
def test_svf_on_longbench_admits_by_volume_within_the_kv_cache(longbench_run):
    payload = longbench_run
    n = payload["workload"]["requests"]
    assert n == 8 and list(payload["runs"]) == ["svf", "oracle-svf"]
    for name, m in payload["runs"].items():
        assert m["submitted"] == m["completed"] == n, name
        assert m["p95_e2el_ms"] >= m["p50_e2el_ms"] > 0 and m["decode_tok_s"] > 0
        stats = m["scheduler_stats"]
        assert stats["finished"] == n and stats["faults"] == {}
        assert sum(stats["released"].values()) == n and stats["released"]["order"] > 0
        # 8 prompts of up to 2,048 tokens do not fit 8K KV tokens at once: the peak check refused some
        assert stats["capacity_stops"] > 0, stats
    assert payload["runs"]["svf"]["scheduler_stats"]["predictions"] == n  # predicted lengths
    assert payload["runs"]["oracle-svf"]["scheduler_stats"]["predictions"] == 0  # the true ones


# ------------------------------------------------------------------------------- no engine


@pytest.mark.parametrize("argv, message", [
    (["--quick", "--schedulers", "fcfs,nosuch"], "unknown scheduler 'nosuch'"),
    (["--quick", "--schedulers", "fcfs,fcfs"], "listed twice"),
    (["--quick", "--schedulers", "feather:/nonexistent/p.feather"], "does not exist"),
    (["--scenario", "nosuch"], "unknown scenario 'nosuch'"),
    (["--scenario", "sharegpt", "--workload", "leval"], "not both"),
    ([], "no workload"),
    (["--quick", "--goodput", "ttft:abc"], "NAME:MILLISECONDS"),
    (["--quick", "--goodput", "itl:50"], "unknown goodput SLO 'itl'"),
    (["--quick", "--percentiles", "50,100"], "between 0 and 100"),
    (["--quick", "--max-concurrency", "4"], "for --endpoint runs"),
    (["--quick", "--endpoint", "http://127.0.0.1:8000", "--max-concurrency", "0"], "max_concurrency"),
    (["--quick", "--endpoint", "localhost:8000"], "is not http://HOST:PORT"),
    (["--quick", "--endpoint", "http://127.0.0.1:8000", "--schedulers", "fcfs"], "not both"),
    # the engine would not start: vLLM's own words were about GPU memory, and a raw OSError
    (["--quick", "--kv-cache-gib", "0.0087"], "cannot hold one request of max_model_len 2,176 tokens"),
    (["--quick", "--cpu-cores", str(max(online_cores()) + 1)], "are not among this machine's cores"),
    # once accepted: 0 was taken for "no cap", and the others failed or meant nothing after the start
    (["--workload", "leval", "--max-prompt-tokens", "0"], "max_prompt_tokens must be >= 1"),
    (["--quick", "--run-timeout", "0"], "run_timeout_s must be a finite number of seconds > 0"),
    (["--quick", "--quiet-wait", "-1"], "quiet_wait_s must be a finite number of seconds >= 0"),
    (["--quick", "--max-foreign", "2"], "max_foreign must be a fraction of the machine in [0, 1]"),
    # written after every run, where it once was a traceback at the end
    (["--quick", "--json", str(Path(__file__).parent)], "is a folder: give the path of a file"),
    (["--quick", "--json", "/dev/null/x.json"], "--json's folder"),
])
@pytest.mark.parametrize("check", [[], ["--check"]], ids=["run", "check"])
def test_bad_input_is_a_clear_error_before_anything_starts(argv, message, check, tmp_path, capsys):
    assert evaluate.main([*argv, *check, "--out", str(tmp_path / "o")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.fixture
def policy_256(tmp_path) -> Path:
    from scheduler_runtime.decision import BASE_OBS_NAMES, ObservationSpec
    from scheduler_runtime.policy import ConstantPolicy, write_policy

    spec = ObservationSpec(names=BASE_OBS_NAMES, low=(0, -64, 0), high=(64, 64, 64), scale=(64, 64, 64),
                           chunk_size=256)
    return write_policy(tmp_path / "add256.feather", ConstantPolicy(spec))


@pytest.mark.parametrize("args, message", [
    (["--max-wait", "nan"], "max_wait must be a finite number"),
    (["--max-wait", "-1"], "max_wait must be a finite number"),
    (["--chunk-size", "0"], "chunk_size must be >= 1"),
    (["--schedulers", "fcfs,feather:{policy}", "--chunk-size", "512"], "in chunks of 256 tokens"),
    (["--schedulers", "fcfs,feather:py:fault_policies:FailsToBuild"], "could not be built"),
])
def test_bad_knobs_are_errors_before_the_first_engine(tmp_path, capsys, monkeypatch, policy_256, args,
                                                      message):
    """These once failed when that scheduler's engine started, after the earlier ones ran."""
    def no_engine(*a, **kw):
        raise AssertionError("an engine was started")

    monkeypatch.setattr(evaluate, "evaluate_in_process", no_engine)
    argv = ["--quick", "--schedulers", "fcfs,feather-heuristic", "--out", str(tmp_path / "o")]
    assert evaluate.main(argv + [a.format(policy=policy_256) for a in args]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_check_prints_each_scheduler_as_the_engine_resolves_it_and_starts_nothing(tmp_path, capsys,
                                                                                    monkeypatch, policy_256):
    def no_engine(*a, **kw):
        raise AssertionError("an engine was started")

    monkeypatch.setattr(evaluate, "evaluate_in_process", no_engine)
    monkeypatch.setattr(evaluate, "send_vllm_logs_to", no_engine)
    out = tmp_path / "o"
    names = ["fcfs", "group-cap-3@512", f"feather:{policy_256}", "oracle-svf"]
    assert evaluate.main(["--quick", "--schedulers", ",".join(names), "--max-wait", "5", "--check",
                          "--out", str(out)]) == 0
    text = capsys.readouterr().out
    _, engine, _ = evaluate.build_workload(evaluate._parse_args(["--quick"]))
    assert (f"KV cache {engine.kv_cache_gib:g} GiB ({engine.kv_cache_tokens:,} tokens), max "
            f"{engine.max_num_seqs} running, {engine.max_num_batched_tokens} tokens/step, max model length "
            f"{engine.max_model_len:,}") in text
    rows = {r.split(" | ")[0].strip("| "): r.strip("| ").split(" | ") for r in text.splitlines()
            if r.startswith("| ") and not r.startswith("| scheduler ")}
    assert list(rows) == names
    budget = f"{engine.max_num_batched_tokens:,}"
    # vLLM's own queue: no Feather knob applies
    assert rows["fcfs"][1:] == ["vLLM's own", "-", budget, "none", "-", "-", "-", "-"]
    # the document cap with its own step budget, Feather's knob given on the command line
    assert rows["group-cap-3@512"][1:] == ["feather", "at most 3 documents", "512", "prompt", "-", "512", "5",
                                           "trusted"]
    # a policy: measured in its own chunks of 256 tokens
    assert rows[f"feather:{policy_256}"][2:8] == ["its policy (request)", budget, "prompt", "-", "256", "5"]
    assert rows["oracle-svf"][1:] == ["svf", "-", budget, "peak", "oracle", "-", "5", "trusted"]
    assert text.rstrip().endswith("no engine started, nothing served")
    assert not out.exists()


def test_the_evaluation_trusts_its_own_hints_and_gives_every_scheduler_the_cores_knobs():
    for name in ("fcfs", "fcfs@512"):  # vLLM's own scheduler
        assert inprocess.scheduler_overrides(name, 64, 5.0) == {}
    # the core's knobs reach every other scheduler, as the simulator's environment gives them (a
    # document cap once lost them: only names starting with "feather" got them)
    for name in ("oracle-svf", "lpm", "feather-heuristic+svf", "group-cap-3@512", "group-hold"):
        assert inprocess.scheduler_overrides(name, 64, 5.0) == {
            "trust_client_hints": True, "chunk_size": 64, "max_wait": 5.0}, name
        assert inprocess.scheduler_overrides(name, None, None) == {"trust_client_hints": True}, name
    assert inprocess.scheduler_config("fcfs", 64, 5.0).passthrough  # vLLM's own scheduler


def test_an_unreachable_server_is_named_with_the_reason(tmp_path, capsys):
    port = free_port()  # nothing listens there
    rc = evaluate.main(["--quick", "--endpoint", f"http://127.0.0.1:{port}", "--out", str(tmp_path / "o")])
    assert rc == 2
    err = capsys.readouterr().err
    assert f"cannot reach http://127.0.0.1:{port}" in err and "connection refused" in err
    assert not (tmp_path / "o").exists()


def test_missing_data_says_where_to_get_it(tmp_path, capsys):
    assert evaluate.main(["--workload", "leval", "--data-dir", str(tmp_path / "nowhere"),
                          "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "nowhere" in err and "OpenLMLab/LEval" in err


def test_quick_scenario_episodes_are_small_and_keep_the_scenarios_engine(data_dir):
    args = evaluate._parse_args(["--scenario", "leval-kv-pressure", "--quick", "--seed", "2",
                                 "--cpu-cores", "1"])
    workload, engine, record = evaluate.build_workload(args)
    assert 2 <= len(workload) <= 12 and workload.num_groups <= 3
    assert max(r.prompt_len for r in workload) <= 2048 and {r.output_len for r in workload} == {8}
    assert engine.kv_cache_gib == 0.25 and engine.cpu_cores == "1"  # the scenario's KV cache (smaller)
    assert record["episode_seed"] == 2 and record["scheduler_knobs"] == {"chunk_size": 512, "max_wait": 60.0}
    again, _, _ = evaluate.build_workload(evaluate._parse_args(["--scenario", "leval-kv-pressure", "--quick",
                                                                "--seed", "2"]))
    assert again.fingerprint() == workload.fingerprint()  # episode seed -> the same requests


def test_endpoint_urls_are_normalized_or_rejected():
    assert endpoint.normalize_url("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"
    assert endpoint.normalize_url("http://h:1/v1") == endpoint.normalize_url("http://h:1/v1/completions/")
    assert endpoint.normalize_url("https://h/proxy/v1") == "https://h/proxy"
    for bad in ("127.0.0.1:8000", "ftp://h", "http://", "http://h:99999", "http://h:1?x=1"):
        with pytest.raises(evaluate.ConfigError):
            endpoint.normalize_url(bad)


def test_server_figures_from_prometheus_text():
    before = endpoint.parse_prometheus("""# HELP vllm:prefix_cache_queries x
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 10.0
vllm:num_preemptions_total{engine="0"} 1.0
vllm:request_queue_time_seconds_sum{engine="0"} 2.0
vllm:request_queue_time_seconds_count{engine="0"} 4.0
feather_scheduler_decisions_total{scheduler="feather-heuristic+svf"} 3.0
feather_scheduler_held_requests{scheduler="feather-heuristic+svf"} 0.0
""")
    after = [(n, lab, v * (3 if n.startswith("vllm:prefix_cache_queries") else 2)) for n, lab, v in before]
    fig = endpoint._server_figures(before, after)
    assert fig["prefix_hit_rate"] == pytest.approx(10 / 200)
    assert fig["preemptions"] == 1 and fig["server_scheduler"] == "feather-heuristic+svf"
    assert fig["server"]["mean_queue_ms"] == pytest.approx(1000 * 2.0 / 4.0)
    assert fig["server"]["feather"] == {"decisions_total": 3.0}
    assert endpoint._server_figures(None, after)["prefix_hit_rate"] is None  # a server without /metrics


def _fake_run(label: str, kind: str, seed: int, failed: int = 0) -> report.Run:
    rng = np.random.default_rng(seed)
    timelines = []
    for i in range(6):
        t = RequestTimeline(f"r{i}", 100 + i, 4, float(i) / 10, first_scheduled=float(i) / 10 + 0.01,
                            first_token=float(i) / 10 + 0.2, tokens=4, finished_count=1,
                            itl=rng.uniform(0.01, 0.02, 3).tolist())
        t.finish = t.first_token + sum(t.itl)
        timelines.append(t)
    errors = {}
    for t in timelines[:failed]:
        t.tokens, t.finished_count = 2, 0
        errors[t.request_id] = "HTTP 500: boom"
    steps = [report.StepSample(0.0, 0.2, 3, 3, False), report.StepSample(0.2, 0.01, 3, 3, True)]
    in_process = kind == report.IN_PROCESS
    return report.Run(label, kind, timelines, extra={"decode_tok_s": 300.0} if in_process else {},
                      steps=steps if in_process else [], errors=errors)


def test_results_folders_read_back_and_merge_with_failures_counted(tmp_path):
    a = [_fake_run("fcfs", report.IN_PROCESS, 0), _fake_run("x", report.IN_PROCESS, 1)]
    b = [_fake_run("x", report.ENDPOINT, 2, failed=2)]
    for folder, runs in (("a", a), ("b", b)):
        payload = report.results_payload(runs, workload={"fingerprint": "f1"}, goodput={"e2el": 250.0})
        report.write_results(tmp_path / folder, payload, runs, title=folder)
    payload, back = report.read_runs(tmp_path / "b")
    assert payload["runs"]["x"]["failed"] == 2 and payload["runs"]["x"]["completed"] == 4
    assert payload["runs"]["x"]["errors"] == {"r0": "HTTP 500: boom", "r1": "HTTP 500: boom"}
    (run,) = back
    assert sum((t.itl for t in run.timelines), []) == pytest.approx(sum((t.itl for t in b[0].timelines), []))
    assert [t.completed for t in run.timelines] == [False, False, True, True, True, True]
    merged, written = report.compare([tmp_path / "a", tmp_path / "b"], tmp_path / "c")
    assert list(merged["runs"]) == ["fcfs", "x", "x (b)"] and merged["same_workload"] is True
    assert merged["runs"]["x (b)"]["kind"] == report.ENDPOINT and merged["runs"]["x (b)"]["failed"] == 2
    assert {p.name for p in written} >= {"results.json", "throughput.png", "latency_cdf.png",
                                         "batch_size.png"}
    tables = report.metrics_tables(merged["runs"])
    assert "| x (b) | 4/6 |" in tables and "goodput req/s" in tables
    with pytest.raises(FileNotFoundError, match="not a results folder"):
        report.compare([tmp_path / "nowhere"], tmp_path / "d")


def test_runs_under_foreign_load_are_rerun_and_the_quietest_kept(monkeypatch):
    loads = iter([0.5, 0.3, 0.6])

    def fake_serve_one(backend, name, workload, config, progress):
        return report.Run(name, report.IN_PROCESS, [], extra={"foreign_cpu": next(loads)})

    monkeypatch.setattr(inprocess, "serve_one", fake_serve_one)
    monkeypatch.setattr(inprocess, "wait_for_quiet", lambda *a, **k: 0.0)
    workload = synthetic_workload(1, 2, 16, 4, 2, seed=0)
    cfg = inprocess.InProcessConfig(schedulers=("fcfs",), max_foreign=0.1, retries=2)
    run = inprocess._run_quiet(None, "fcfs", workload, cfg, False, None, lambda s: None)
    assert run.extra["foreign_cpu_attempts"] == [0.5, 0.3, 0.6] and run.extra["foreign_cpu"] == 0.3
    loads = iter([0.05])
    run = inprocess._run_quiet(None, "fcfs", workload, cfg, False, None, lambda s: None)
    assert run.extra["attempts"] == 1
    with pytest.raises(evaluate.ConfigError, match="repeats"):
        inprocess.InProcessConfig(schedulers=("fcfs",), repeats=0)
