"""``benchmarks/unequal_loopback.py`` end to end over stand-in workers (no engine): the replicas' unequal
KV sizes, the noisy neighbour, every front end, the figures."""

from __future__ import annotations

import json

import psutil
import pytest

from benchmarks import unequal_loopback as ul
from benchmarks.cluster_loopback import SERVER_ARGS
from benchmarks.frontend_loopback import SERVED
from scheduler_runtime.serving.cluster_base import replica_kv_tokens
from scheduler_runtime.serving.replica_args import without_flags
from scheduler_runtime.serving.serve import vllm_arguments


def test_the_replicas_hold_the_kv_tokens_asked_for_on_this_machine():
    setup = ul.replica_setup(16384, 4.0, standin=False)
    held = []
    for own in setup:  # as frontend_loopback.plain_replicas starts them, completed by feather-serve
        args, _ = vllm_arguments([*without_flags(SERVER_ARGS, own[::2]), *own, *SERVED])
        held.append(replica_kv_tokens(args))
    assert held == [65536, 16384]
    # the small one holds a whole prompt of the engine's longest (--max-model-len), and 4 documents
    assert int(SERVER_ARGS[SERVER_ARGS.index("--max-model-len") + 1]) <= held[1] < 5 * 4096


def test_the_whole_benchmark_runs_on_stand_ins(tmp_path, capsys):
    before = {p.pid for p in psutil.Process().children(recursive=True)}  # other tests' may be there
    out = ul.main(["--standin", "--repeats", "1", "--out", str(tmp_path / "runs"),
                   "--json", str(tmp_path / "u.json")])
    assert json.loads((tmp_path / "u.json").read_text())["benchmark"] == "unequal_loopback"
    assert [r["front_end"] for r in out["runs"]] == list(ul.FRONT_ENDS)
    n = ul.STANDIN_DOCS * ul.STANDIN_QUESTIONS
    for run in out["runs"]:
        assert run["completed"] == run["submitted"] == n and run["output_tokens"] == n * ul.STANDIN_TOKENS
        assert sum(run["replica_requests"]) == n
        assert set(run["attainment"]) == set(out["slos"]) and run["attainment"][ul.ISSUE_SLO] == 1.0
        assert 0 < run["p50_ttft_ms"] <= run["p99_ttft_ms"] and run["p50_tpot_ms"] > 0
    ours = out["runs"][0]["learned"]  # the stand-ins' KV, read from their metrics: 4 to 1
    assert ours["0"]["kv_tokens"] == 4 * ours["1"]["kv_tokens"] and ours["0"]["prefill_samples"] > 0
    assert all(run["learned"] is None and run["queue_reports"] is None for run in out["runs"][1:])
    # ours read every stream's wait: the stand-ins report it, and the proxy asked their usage chunks
    assert out["runs"][0]["queue_reports"] == n
    auto = next(s for s in out["slos"] if s.startswith("auto"))
    assert 0 < out["slos"][auto]["ttft"] < 5000
    assert out["versus"]["best_sglang"] in ul.SGLANG and out["versus"]["output_throughput"] > 0
    text = capsys.readouterr().out
    assert "ours / sglang" in text and "target >= 1.15" in text
    # the small replica's stand-in publishes a quarter of the big one's KV blocks; nothing is left running
    blocks = [int(own[own.index("--kv-blocks") + 1]) for own in out["replica_args"]]
    assert blocks == [4 * blocks[1], blocks[1]]
    assert not {p.pid for p in psutil.Process().children(recursive=True)} - before


@pytest.mark.parametrize("argv", [["--front-ends", "nginx"], ["--repeats", "0"], ["--slo", "ttft:x"],
                                  ["--kv-ratio", "0.5"], ["--documents", "31"]])
def test_bad_options_are_usage_errors(argv):
    with pytest.raises(SystemExit):
        ul.main(["--standin", *argv])


def test_the_auto_slo_sits_at_the_pooled_medians():
    def run(ttft: float, e2e: float) -> dict:
        return {"requests": [{"ttft_s": ttft, "e2e_s": e2e, "tokens": 32, "completed": True}]}

    runs = [run(0.5, 1.5), run(0.7, 1.7), run(0.9, 2.5)]
    slos = ul.slo_pairs([ul.AUTO], runs)
    (name, pair), = slos.items()
    assert pair == {"ttft": 700, "tpot": 33} and name == "auto (ttft:700 tpot:33)"  # 1.0 s / 31 tokens
    # a request at the median meets it: two of the three here
    assert [ul.figures(r, slos)["attainment"][name] for r in runs] == [1.0, 1.0, 0.0]
