"""evaluate.py end to end on a tiny L-Eval workload and a small LongBench one, plus its error paths.

The L-Eval test starts four real engines (fcfs, feather-heuristic, and the two policies
train.py exported: a Q-learning table alone and a PPO MLP with SVF admission, ~3-20 s each)
on 12 L-Eval requests cut to 1024 prompt tokens with 4 output tokens. The LongBench test
starts two (svf, oracle-svf) on 8 requests generating their task's maximum tokens,
with a KV cache too small for all of them at once, SVF's setting. The other tests start none.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

import evaluate
from feather_env.workloads import DataNotFoundError


@pytest.fixture(scope="module")
def schedulers(exported_policies) -> tuple[str, ...]:
    return ("fcfs", "feather-heuristic", f"feather:{exported_policies['table']}",
            f"feather:{exported_policies['mlp']}+svf")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, data_dir, schedulers):
    out = tmp_path_factory.mktemp("eval")
    rc = evaluate.main([
        "--workload", "leval", "--data-dir", str(data_dir), "--schedulers", ",".join(schedulers),
        "--num-groups", "3", "--max-per-group", "4", "--max-prompt-tokens", "1024",
        "--max-output-tokens", "4", "--kv-cache-gib", "0.5", "--max-num-seqs", "16",
        "--arrival", "poisson:20", "--seed", "3", "--out", str(out / "run"),
        "--json", str(out / "copy.json"), "--no-progress",
    ])
    assert rc == 0
    return out


@pytest.mark.engine
def test_outputs_exist_and_every_request_completes(tiny_run, schedulers):
    run = tiny_run / "run"
    for name in ("results.json", "results.csv", "results.md", "requests.csv", "throughput.png",
                 "latency_cdf.png", "batch_size.png"):
        assert (run / name).is_file() and (run / name).stat().st_size > 0, name
    payload = json.loads((run / "results.json").read_text())
    assert json.loads((tiny_run / "copy.json").read_text())["schedulers"] == payload["schedulers"]
    assert list(payload["schedulers"]) == list(schedulers)
    n = payload["workload"]["requests"]
    assert 3 < n <= 12 and payload["workload"]["groups"] == 3 and payload["machine"]["cores"]
    for name, m in payload["schedulers"].items():
        assert m["submitted"] == m["completed"] == n, name
        assert n <= m["output_tokens"] <= 4 * n  # answers may be shorter than the cap
        assert m["decode_tok_s"] > 0 and m["e2e_tok_s"] > 0 and m["e2e_req_s"] > 0
        assert m["latency_p99_s"] >= m["latency_p95_s"] >= m["latency_p50_s"] > 0
        assert m["latency_mean_s"] >= m["ttft_mean_s"] > 0
        assert m["ttft_mean_s"] >= m["queue_mean_s"] >= 0
        assert m["max_wait_s"] >= m["queue_mean_s"]
        assert m["max_slowdown"] > 0 and m["mean_running_batch"] >= 1
        assert 0 <= m["prefix_hit_rate"] <= 1 and 0 <= m["foreign_cpu"] <= 1
        assert m["makespan_s"] >= m["latency_mean_s"]
    assert payload["schedulers"]["fcfs"]["scheduler_overhead_frac"] is None
    feather = payload["schedulers"]["feather-heuristic"]
    assert 0 <= feather["scheduler_overhead_frac"] < 1
    assert feather["scheduler_stats"]["finished"] == n
    # three documents, four questions each: the prefix cache must be hit
    assert feather["prefix_hit_rate"] > 0.3
    for name in schedulers[2:]:  # the exported policies decided in the engine
        stats = payload["schedulers"][name]["scheduler_stats"]
        assert stats["finished"] == n and stats["decisions"] == stats["adds"] + stats["stops"] > 0
        assert stats["faults"] == {}, name
    # per-request rows: every request once per scheduler, timeline in order
    with (run / "requests.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == n * len(schedulers)
    for r in rows:
        t = [float(r[k]) for k in ("arrival", "first_scheduled", "first_token", "finish")]
        assert all(math.isfinite(x) for x in t) and t[0] <= t[1] <= t[2] <= t[3], r
        assert int(r["tokens"]) == int(r["output_len"])
    with (run / "results.csv").open() as fh:
        table = list(csv.DictReader(fh))
    assert [r["scheduler"] for r in table] == list(schedulers)
    assert "| fcfs |" in (run / "results.md").read_text()


@pytest.fixture(scope="module")
def longbench_run(tmp_path_factory, data_dir):
    out = tmp_path_factory.mktemp("eval-longbench")
    rc = evaluate.main([
        "--workload", "longbench", "--data-dir", str(data_dir), "--schedulers", "svf,oracle-svf",
        "--num-requests", "8", "--max-prompt-tokens", "2048", "--output", "max", "--max-output-tokens", "32",
        "--kv-cache-gib", "0.03125", "--max-num-seqs", "16", "--arrival", "burst", "--seed", "1",
        "--out", str(out), "--no-progress", "--no-plots", "--no-isolated",
    ])
    assert rc == 0
    return json.loads((out / "results.json").read_text())


@pytest.mark.engine
def test_svf_on_longbench_admits_by_volume_within_the_kv_cache(longbench_run):
    payload = longbench_run
    n = payload["workload"]["requests"]
    assert n == 8 and list(payload["schedulers"]) == ["svf", "oracle-svf"]
    for name, m in payload["schedulers"].items():
        assert m["submitted"] == m["completed"] == n, name
        assert m["latency_p95_s"] >= m["latency_p50_s"] > 0 and m["decode_tok_s"] > 0
    for name in ("svf", "oracle-svf"):
        stats = payload["schedulers"][name]["scheduler_stats"]
        assert stats["finished"] == n and stats["faults"] == {}
        assert sum(stats["released"].values()) == n and stats["released"]["order"] > 0
        # 8 prompts of up to 2,048 tokens do not fit 8K KV tokens at once: the peak check refused some
        assert stats["capacity_stops"] > 0, stats
    assert payload["schedulers"]["svf"]["scheduler_stats"]["predictions"] == n  # predicted lengths
    assert payload["schedulers"]["oracle-svf"]["scheduler_stats"]["predictions"] == 0  # the true ones


def test_unknown_scheduler_is_a_clear_error_before_any_engine(tmp_path, capsys):
    rc = evaluate.main(["--workload", "leval", "--schedulers", "fcfs,nosuch", "--out", str(tmp_path / "o")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "unknown scheduler 'nosuch'" in err and "feather-heuristic" in err
    assert not (tmp_path / "o").exists()


def test_missing_policy_file_is_a_clear_error(tmp_path, capsys):
    rc = evaluate.main(["--workload", "leval", "--schedulers", f"feather:{tmp_path}/none.feather",
                        "--out", str(tmp_path / "o")])
    assert rc == 2 and "does not exist" in capsys.readouterr().err


@pytest.fixture
def policy_256(tmp_path) -> Path:
    from scheduler_runtime.policy import BASE_OBS_NAMES, ConstantPolicy, ObservationSpec, write_policy

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
    """Issue 12, M4: these failed when that scheduler's engine started, after the earlier ones ran."""
    def no_engine(*a, **kw):
        raise AssertionError("an engine was started")

    monkeypatch.setattr(evaluate, "run_scheduler", no_engine)
    argv = ["--workload", "leval", "--schedulers", "fcfs,feather-heuristic", "--out", str(tmp_path / "o")]
    rc = evaluate.main(argv + [a.format(policy=policy_256) for a in args])
    assert rc == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_the_evaluation_trusts_its_own_hints_and_gives_feather_its_knobs():
    assert evaluate.scheduler_overrides("fcfs", 64, 5.0) == {}
    assert evaluate.scheduler_overrides("oracle-svf", 64, 5.0) == {"trust_client_hints": True}
    assert evaluate.scheduler_overrides("feather-heuristic+svf", 64, 5.0) == {
        "trust_client_hints": True, "chunk_size": 64, "max_wait": 5.0}


def test_missing_data_dir_says_where_to_get_the_data(tmp_path, capsys):
    rc = evaluate.main(["--workload", "leval", "--data-dir", str(tmp_path / "nowhere"),
                        "--schedulers", "fcfs", "--out", str(tmp_path / "o")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "nowhere" in err and "OpenLMLab/LEval" in err
    with pytest.raises(DataNotFoundError, match="LongBench"):
        evaluate.build_eval_workload(evaluate.WorkloadConfig(kind="longbench", data_dir=str(tmp_path)))


def test_incomplete_runs_are_errors_not_drops():
    rec = {f"r{i}": evaluate.RequestRecord(f"r{i}", 10, 3, 0.0) for i in range(3)}
    for r in rec.values():
        r.finished_count, r.tokens = 1, 3
    evaluate._check_complete("x", rec)
    rec["r1"].finished_count = 0
    with pytest.raises(evaluate.EvaluationError, match="1 of 3 requests never finished.*r1"):
        evaluate._check_complete("x", rec)
    rec["r1"].finished_count, rec["r2"].tokens = 1, 2
    with pytest.raises(evaluate.EvaluationError, match="wrong number of tokens"):
        evaluate._check_complete("x", rec)


def test_runs_under_foreign_load_are_rerun_and_the_quietest_kept(monkeypatch):
    loads = iter([0.5, 0.3, 0.6])
    seen = []

    def fake_run(name, workload, engine, **kw):
        run = evaluate.RunRecord(name, {}, [], 0.0, 0.0, next(loads), 0, None)
        seen.append(kw["isolated"])
        return run, None

    monkeypatch.setattr(evaluate, "run_scheduler", fake_run)
    monkeypatch.setattr(evaluate, "wait_for_quiet", lambda *a, **k: 0.0)
    cfg = evaluate.EvalConfig(workload=evaluate.WorkloadConfig(), schedulers=("fcfs",), max_foreign=0.1,
                              retries=2)
    run, _, attempts = evaluate._run_quiet("fcfs", None, None, cfg, True, None, lambda s: None)
    assert attempts == [0.5, 0.3, 0.6] and run.foreign_cpu == 0.3 and seen == [True] * 3
    loads = iter([0.05])
    run, _, attempts = evaluate._run_quiet("fcfs", None, None, cfg, False, None, lambda s: None)
    assert attempts == [0.05]


def test_summarize_on_a_hand_made_run():
    reqs = {}
    for i, (arr, sch, first, fin) in enumerate([(0.0, 0.0, 1.0, 2.0), (0.0, 1.0, 2.0, 4.0)]):
        r = evaluate.RequestRecord(f"r{i}", 100, 5, arr, first_scheduled=sch, first_token=first, finish=fin,
                                   tokens=5, prefix_hit_tokens=50 * i, finished_count=1)
        reqs[r.request_id] = r
    steps = [evaluate.StepRow(0.0, 1.0, 1, 100, 1, 1, False), evaluate.StepRow(1.0, 0.5, 2, 2, 0, 2, True),
             evaluate.StepRow(1.5, 0.5, 2, 2, 0, 2, True)]
    run = evaluate.RunRecord("fake", reqs, steps, 1.0, 4.0, 0.0, 0, {"decision_seconds": 0.2,
                                                                       "arrival_seconds": 0.1})
    iso = evaluate.IsolatedModel([1, 1000], [0.5, 0.5], [0.125, 0.125])
    m = evaluate.summarize(run, iso)
    assert m["decode_tok_s"] == pytest.approx(4 / 1.0)
    assert m["latency_mean_s"] == pytest.approx(3.0) and m["ttft_mean_s"] == pytest.approx(1.5)
    assert m["tpot_mean_s"] == pytest.approx((1 / 4 + 2 / 4) / 2)
    assert m["queue_mean_s"] == pytest.approx(0.5) and m["max_wait_s"] == pytest.approx(1.0)
    assert m["max_slowdown"] == pytest.approx(4.0 / 1.0)  # isolated: 0.5 + 4 * 0.125 = 1.0 s
    assert m["prefix_hit_rate"] == pytest.approx(50 / 200)
    assert m["e2e_req_s"] == pytest.approx(2 / 4.0) and m["makespan_s"] == pytest.approx(4.0)
    assert m["scheduler_overhead_frac"] == pytest.approx(0.2 / 2.0)
    assert m["mean_running_batch"] == pytest.approx(5 / 3)


def test_script_help_runs_without_an_engine():
    with pytest.raises(SystemExit) as exc:
        evaluate.main(["--help"])
    assert exc.value.code == 0
    assert Path(evaluate.__file__).name == "evaluate.py"


def test_repeats_alternate_schedulers_and_report_the_median_run(monkeypatch):
    decode = {"fcfs": iter([300.0, 100.0, 200.0]), "sjf": iter([50.0, 70.0, 60.0])}
    order = []

    def fake_run_quiet(name, workload, engine, config, isolated, retry_until, log):
        order.append(name)
        return evaluate.RunRecord(name, {}, [], 0.0, 0.0, 0.0, 0, None), None, [0.0]

    def fake_summarize(run, isolated=None):
        d = next(decode[run.scheduler])
        return {"decode_tok_s": d, "latency_mean_s": 1000 / d, "latency_p95_s": 2000 / d, "foreign_cpu": 0.0,
                "completed": 1, "submitted": 1, "e2e_tok_s": 1.0, "mean_running_batch": 1.0,
                "prefix_hit_rate": 0.0, "engine_start_s": 0.0, "replay_s": 0.0}

    monkeypatch.setattr(evaluate, "_run_quiet", fake_run_quiet)
    monkeypatch.setattr(evaluate, "summarize", fake_summarize)
    wl = evaluate.WorkloadConfig(kind="synthetic", num_groups=2, per_group=2, prefix_len=64, suffix_len=8,
                                 output_len=4)
    cfg = evaluate.EvalConfig(workload=wl, schedulers=("fcfs", "sjf"), repeats=3)
    out = evaluate.evaluate(cfg, None, log=lambda s: None)
    assert order == ["fcfs", "sjf"] * 3
    fcfs, sjf = out["schedulers"]["fcfs"], out["schedulers"]["sjf"]
    assert fcfs["decode_tok_s"] == 200.0 and fcfs["latency_mean_s"] == pytest.approx(5.0)
    assert fcfs["repeats"]["decode_tok_s"] == [300.0, 100.0, 200.0]
    assert sjf["decode_tok_s"] == 60.0
    with pytest.raises(evaluate.ConfigError, match="repeats"):
        evaluate.EvalConfig(workload=wl, schedulers=("fcfs",), repeats=0)
