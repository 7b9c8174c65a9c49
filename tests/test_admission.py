"""Admission past capacity (``scheduler_runtime.admission``): the rules' syntax, the controller's
bookkeeping under any sequence of events (hypothesis), vLLM's caps as vLLM 0.32 counts them, the
prefix-aware prediction, and the serving loop on the simulator: every request served, rejected or
aborted, exactly once, and a rule that sheds lifting attainment past capacity."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feather_env.serving_metrics import serving_metrics
from scheduler_runtime.admission import (
    AdmissionController,
    AdmissionRule,
    PrefixEstimate,
    StepTimeModel,
    attention_work,
    parse_slos,
    prompt_block_hashes,
    split_admission,
    with_admission,
)
from scheduler_runtime.config import ConfigError
from scheduler_runtime.schedulers import SchedulerConfig

SLOS = {"ttft": 5000.0, "tpot": 50.0}


# ------------------------------------------------------------------------------ syntax


@pytest.mark.parametrize("text, canonical", [
    ("none", "none"), ("slo", "slo:1"), ("slo:0.5", "slo:0.5"), ("deadline", "deadline"),
    ("queued-reqs:64", "queued-reqs:64"), ("queued-tokens:12000", "queued-tokens:12000"),
    ("deadline+slo:0.7", "slo:0.7+deadline"),
    ("queued-tokens:10+queued-reqs:3", "queued-reqs:3+queued-tokens:10"),
    ("slo+tpot", "slo:1+tpot"), ("tpot+slo:0.5+deadline", "slo:0.5+deadline+tpot"),
])
def test_rules_parse_to_one_canonical_text(text, canonical):
    rule = AdmissionRule.parse(text)
    assert str(rule) == canonical
    assert AdmissionRule.parse(str(rule)) == rule


@pytest.mark.parametrize("text", ["", "slo:0", "slo:-1", "slo:nan", "slo:inf", "slo:x", "queued-reqs",
                                  "queued-reqs:1.5", "queued-tokens:-3", "deadline:3", "none+slo", "none:1",
                                  "slo+slo:2", "bogus", "slo:0.5+", "tpot", "tpot:2+slo",
                                  "slo+tpot+tpot", "deadline+tpot"])
def test_bad_rules_are_one_clear_error(text):
    with pytest.raises(ConfigError, match="admission"):
        AdmissionRule.parse(text)


def test_a_setting_names_its_rule_after_a_tilde_and_a_path_keeps_its_own():
    assert split_admission("group-cap-8@256~slo:0.5") == ("group-cap-8@256", "slo:0.5")
    assert split_admission("feather:~/p.feather") == ("feather:~/p.feather", None)
    assert split_admission("feather:~/p.feather~deadline") == ("feather:~/p.feather", "deadline")
    assert with_admission("fcfs@512~slo", "queued-reqs:8") == "fcfs@512~queued-reqs:8"
    assert with_admission("fcfs@512~slo", None) == "fcfs@512"
    config = SchedulerConfig.for_name("group-cap-8@256~slo:0.50")
    assert (config.group_cap, config.max_num_batched_tokens, config.admission_rule) == (8, 256, "slo:0.5")
    assert SchedulerConfig.for_name("fcfs~queued-tokens:100").passthrough
    with pytest.raises(ConfigError, match="group-cap-8~slo:0"):
        SchedulerConfig.for_name("group-cap-8~slo:0")


def test_slos_are_the_goodput_pairs():
    assert parse_slos("ttft:5000 tpot:50") == SLOS
    for bad in ("ttft", "ttft:-1", "ttft:1 ttft:2", "foo:1", "ttft:inf"):
        with pytest.raises(ValueError):
            parse_slos(bad)


def test_rules_that_read_the_ttft_slo_refuse_to_start_without_it():
    for rule in ("slo", "deadline", "slo:2+deadline"):
        with pytest.raises(ConfigError, match="TTFT SLO"):
            AdmissionController(rule, {"tpot": 50})
    AdmissionController("queued-reqs:4", {})  # vLLM's caps need none
    with pytest.raises(ConfigError, match="TPOT SLO"):
        AdmissionController("slo+tpot", {"ttft": 5000})


# ------------------------------------------------------------------------------ vLLM's caps


def test_queued_reqs_counts_running_requests_too_as_vllm_does():
    c = AdmissionController("queued-reqs:2", {})
    assert c.offer("a", 100, [], 0.0).admit
    c.started("a", 0.1)  # running: still in flight for vLLM's count
    assert c.offer("b", 100, [], 0.2).admit
    d = c.offer("c", 100, [], 0.3)
    assert not d.admit and d.reason == "queued-reqs" and d.retry and d.retry_after_s >= 1
    c.finished("a")
    assert c.offer("c", 100, [], 0.4).admit


def test_queued_tokens_counts_full_prompts_until_the_first_token_and_not_the_new_one():
    c = AdmissionController("queued-tokens:1000", {}, block_size=16)
    assert c.offer("a", 999, [], 0.0).admit  # 0 queued before it: vLLM does not add the new prompt
    assert c.offer("b", 5000, [], 0.0).admit  # 999 < 1000
    assert not c.offer("c", 1, [], 0.0).admit  # 5999 >= 1000
    c.started("a", 1.0)
    c.started("b", 1.0)
    assert c.queued_tokens == 0 and c.offer("c", 1, [], 1.0).admit


# ------------------------------------------------------------------------------ ours


def test_the_prefix_estimate_counts_blocks_of_an_earlier_queued_request_as_held():
    tokens = list(range(1000))
    hashes = prompt_block_hashes(tokens, 128)
    assert len(hashes) == 7 and prompt_block_hashes(tokens[:300] + [5] * 700, 128)[:2] == hashes[:2]
    c = AdmissionController("slo", SLOS, block_size=128)
    cold = c.predicted_ttft(1000, 0)
    assert c.offer("a", 1000, hashes, 0.0).admit
    # the same document again: its blocks are held by the queued request, only the rest is priced
    assert c.prefix.cached_blocks(hashes) == 7
    warm_alone = c.alone_seconds(1000, 7 * 128)
    assert warm_alone < c.alone_seconds(1000, 0) and cold > 0


def test_the_backlogs_attention_is_each_queued_prompts_own_not_one_prompt_of_its_length():
    # attention only: the prediction is the sum of each prompt's own q * (c + (q + 1) / 2)
    model = StepTimeModel(const=0.0, per_request=0.0, per_token=0.0, per_decode_kv=0.0,
                          per_prefill_attn=1e-9)
    c = AdmissionController("slo:1000", {"ttft": 1000}, model=model, token_budget=8192, block_size=16)
    for i in range(50):
        assert c.offer(f"r{i}", 4000, [], 0.0).admit  # distinct prompts, nothing cached
    own = attention_work(4000, 0)
    assert c.predicted_ttft(4000, 0) == pytest.approx(51 * own * 1e-9)
    # linear in the queue: one more prompt adds one prompt's work, whatever the queue's length
    c.started("r0", 0.1)
    assert c.predicted_ttft(4000, 0) == pytest.approx(50 * own * 1e-9)
    c.finished("r1")  # left while queued
    assert c.predicted_ttft(4000, 0) == pytest.approx(49 * own * 1e-9)
    c.reset()
    assert c.predicted_ttft(4000, 0) == pytest.approx(own * 1e-9)


def test_prefix_estimate_is_an_lru_of_the_kv_cache_size():
    p = PrefixEstimate(3)
    p.touch([1, 2, 3])
    p.touch([4])  # evicts 1
    assert p.cached_blocks([1, 2]) == 0 and p.cached_blocks([2, 3, 4]) == 3 and len(p) == 3


def test_slo_rule_rejects_when_the_predicted_ttft_exceeds_f_times_the_slo_and_says_when_to_retry():
    model = StepTimeModel(const=0.01, per_request=0.0, per_token=1e-4, per_decode_kv=0.0,
                          per_prefill_attn=0.0)
    c = AdmissionController("slo:1", {"ttft": 1000}, model=model, token_budget=1000, block_size=16)
    admitted = 0
    for i in range(100):
        d = c.offer(f"r{i}", 900, [], 0.0)  # distinct prompts: no prefix shared
        if not d.admit:
            break
        admitted += 1
        assert d.predicted_ttft_s <= 1.0
    assert 3 <= admitted < 100
    assert d.reason == "slo" and d.retry and d.retry_after_s >= 1 and d.predicted_ttft_s > 1.0
    assert "exceeds 1 x the TTFT SLO" in d.message
    # a looser factor admits more of the same backlog
    loose = AdmissionController("slo:4", {"ttft": 1000}, model=model, token_budget=1000, block_size=16)
    assert sum(loose.offer(f"r{i}", 900, [], 0.0).admit for i in range(100)) > admitted


def _tpot_controller(tpot_ms: float) -> AdmissionController:
    model = StepTimeModel(const=0.01, per_request=0.0, per_token=1e-4, per_decode_kv=0.0,
                          per_prefill_attn=0.0)
    return AdmissionController("slo:100+tpot", {"ttft": 1000, "tpot": tpot_ms}, model=model,
                               token_budget=1000, block_size=16)


def test_the_tpot_term_bounds_the_prefill_admitted_per_window_by_the_tpot_slo():
    """With nothing running a decode step takes 10 ms: a 50-ms TPOT leaves 1 - 10/50 of the 2-s window
    to prefill, 1.6 s. A prompt of 900 tokens is one step of 100 ms, 90 ms more than a decode step. The
    first request slows nobody (nothing runs or waits ahead of it) and is not charged; 17 more fit (the
    TTFT rule, at 100 x the SLO, would take them all), the 19th is refused for the TPOT; once the window
    has passed, requests fit again. A tighter TPOT leaves less room."""
    from scheduler_runtime.admission import TPOT_WINDOW_S

    c = _tpot_controller(50)
    decisions = [c.offer(f"r{i}", 900, [], 0.0) for i in range(30)]
    assert [d.admit for d in decisions] == [True] * 18 + [False] * 12
    refused = decisions[18]
    assert refused.reason == "tpot" and refused.retry and "TPOT SLO of 50 ms" in refused.message
    assert decisions[0].predicted_ttft_s > 0  # the TTFT rule's prediction is kept on an admitted request
    assert c.stats.rejected["tpot"] == 12
    assert c.offer("later", 900, [], TPOT_WINDOW_S + 0.01).admit
    tight = _tpot_controller(20)  # 1 - 10/20: 1.0 s of the window, 11 prompts after the first
    assert sum(tight.offer(f"r{i}", 900, [], 0.0).admit for i in range(30)) == 12
    c.reset()
    assert sum(c.offer(f"s{i}", 900, [], 0.0).admit for i in range(30)) == 18


def test_the_tpot_term_charges_a_prefill_only_when_a_request_is_running_or_queued_ahead():
    """A prefill slows the decodes running while it runs: an arrival to an empty engine is admitted
    without a charge, however long its prefill, so the next arrival still finds the window's whole room;
    once the first has left, the engine is empty again and the next is free too."""
    c = _tpot_controller(50)
    assert c.offer("long", 990, [], 0.0).admit  # 100 ms over a decode step, 0 charged
    c.started("long", 0.1)
    assert sum(c.offer(f"r{i}", 900, [], 0.2).admit for i in range(30)) == 17  # 1.6 s / 90 ms
    refused = _tpot_controller(50)
    assert refused.offer("first", 900, [], 0.0).admit
    for i in range(18):
        refused.offer(f"r{i}", 900, [], 0.0)
    assert not refused.offer("late", 900, [], 0.0).admit  # the window is full
    for rid in ("first", *(f"r{i}" for i in range(18))):
        refused.finished(rid)
    assert len(refused) == 0 and refused.offer("alone", 900, [], 0.0).admit  # nobody to slow


def test_the_tpot_term_admits_one_prefill_per_window_when_the_decodes_alone_miss_the_tpot():
    """200 running requests make a decode step of 10 ms + 200 x 0.1 ms = 30 ms: within a 50-ms TPOT
    there is room for several prompts, over a 25-ms TPOT none, and only each window's first request
    fits (a decode-bound engine still takes work, one prompt at a time)."""
    fits = []
    for tpot_ms in (50, 25):
        c = _tpot_controller(tpot_ms)
        for i in range(200):  # each in a window of its own
            assert c.offer(f"run{i}", 1, [], -1000.0 + 3 * i).admit
            c.started(f"run{i}", -1000.0 + 3 * i)
        assert c.num_running == 200
        fits.append([c.offer(f"r{i}", 900, [], 0.0).admit for i in range(6)])
    assert sum(fits[0]) > 2
    assert fits[1] == [True, False, False, False, False, False]


def _paced(pace_ratio: float, n: int = 40) -> AdmissionController:
    """A controller whose admitted requests each saw ``pace_ratio`` x their predicted TTFT."""
    model = StepTimeModel(const=0.01, per_request=0.0, per_token=1e-4, per_decode_kv=0.0,
                          per_prefill_attn=0.0)
    c = AdmissionController("slo:1", {"ttft": 1000}, model=model, token_budget=1000, block_size=16)
    for i in range(n):
        d = c.offer(f"w{i}", 3000, [], 0.0)  # alone: ~0.33 s, well past a quarter of the SLO
        assert d.admit
        c.started(f"w{i}", pace_ratio * d.predicted_ttft_s / c.pace)
        c.finished(f"w{i}")
    return c


def test_the_slo_rule_scales_its_prediction_by_the_engines_measured_pace():
    """An engine slower than its model (every TTFT 1.5x the prediction) gets a pace of 1.5: the rule
    admits a backlog 1.5x shorter. One faster than its model keeps the model's own margin (pace 1)."""
    slow, fast = _paced(1.5), _paced(0.5)
    assert slow.pace == pytest.approx(1.5) and slow.stats.as_dict()["ttft_pace"] == pytest.approx(1.5)
    assert fast.pace == 1.0

    def backlog(c: AdmissionController) -> int:
        n = 0
        while c.offer(f"b{n}", 900, [], 100.0).admit:
            n += 1
        return n

    slow_n, fast_n = backlog(slow), backlog(fast)
    assert slow_n < fast_n and slow_n == pytest.approx(fast_n / 1.5, abs=1)
    # few samples, or predictions far below the SLO, leave the model alone
    assert _paced(3.0, n=7).pace == 1.0
    small = AdmissionController("slo:1", {"ttft": 60_000}, token_budget=1000, block_size=16)
    for i in range(20):
        small.offer(f"s{i}", 100, [], 0.0)
        small.started(f"s{i}", 50.0)
    assert small.pace == 1.0
    # the quantile, not the mean: one request in five late by 2x is enough
    mixed = AdmissionController("slo:1", {"ttft": 1000}, model=StepTimeModel(per_token=1e-4),
                                token_budget=1000, block_size=16)
    for i in range(50):
        d = mixed.offer(f"m{i}", 3000, [], 0.0)
        mixed.started(f"m{i}", (2.0 if i % 5 == 0 else 1.0) * d.predicted_ttft_s)
        mixed.finished(f"m{i}")
    assert mixed.pace == pytest.approx(2.0)
    # a deadline abort counts with its wait (a lower bound of its TTFT)
    aborts = AdmissionController("slo:1+deadline", {"ttft": 1000}, model=StepTimeModel(per_token=1e-4),
                                 token_budget=1000, block_size=16)
    for i in range(8):
        d = aborts.offer(f"a{i}", 3000, [], 0.0)
        aborts.finished(f"a{i}", aborted=True, now=3.0 * d.predicted_ttft_s)
    assert aborts.pace == pytest.approx(3.0) and aborts.stats.aborted == 8
    # a new episode forgets the pace; the counters keep its largest
    slow.reset()
    assert slow.pace == 1.0 and slow.stats.max_ttft_pace == pytest.approx(1.5)


def test_a_request_that_can_never_fit_is_refused_with_no_retry():
    c = AdmissionController("slo", {"ttft": 100, "tpot": 50}, block_size=16)
    d = c.offer("huge", 200_000, [], 0.0)
    assert not d.admit and d.reason == "never-fits" and not d.retry and d.retry_after_s == 0
    assert c.stats.rejected["never-fits"] == 1 and len(c) == 0
    # a client's own tighter SLO can make a request never fit; it can never loosen the server's
    small = AdmissionController("slo", {"ttft": 5000}, block_size=16)
    assert small.offer("a", 2000, [], 0.0, ttft_ms=60_000).admit
    assert not small.offer("b", 2000, [], 0.0, ttft_ms=1).admit


def test_deadline_names_waiting_requests_once_even_an_idle_engine_would_be_late():
    c = AdmissionController("deadline", {"ttft": 1000}, block_size=16)
    assert c.offer("a", 100, [], 0.0).admit and c.offer("b", 100, [], 0.5).admit
    assert c.overdue(0.5) == []
    due = c.next_deadline()
    assert 0.9 < due < 1.0  # a's deadline less its own prefill
    assert c.overdue(due + 1e-6) == ["a"]
    c.started("b", 0.6)
    assert c.overdue(10.0) == ["a"]  # b started: never aborted
    c.finished("a", aborted=True)
    assert c.stats.aborted == 1 and c.stats.false_admits == 1 and c.next_deadline() == math.inf


_EVENTS = st.lists(st.tuples(st.sampled_from(["offer", "start", "finish", "abort"]),
                             st.integers(0, 11), st.integers(1, 4000)), max_size=80)


@settings(max_examples=200, deadline=None)
@given(events=_EVENTS, rule=st.sampled_from(["queued-reqs:5", "queued-tokens:6000", "slo:0.5",
                                             "slo+deadline", "deadline", "slo+tpot"]))
def test_the_controllers_counts_always_match_its_requests(events, rule):
    """Whatever the order of events (repeats, unknown ids included), the queue, the running batch
    and vLLM's token count are exactly those of the requests it tracks, and every decision counts once."""
    c = AdmissionController(rule, {"ttft": 2000, "tpot": 1000}, block_size=16, kv_capacity_tokens=4096)
    live: dict[str, tuple[int, bool]] = {}
    decisions = 0
    now = 0.0
    for kind, i, n in events:
        rid = f"r{i}"
        now += 0.01
        if kind == "offer":
            if rid in live:
                with pytest.raises(ValueError):
                    c.offer(rid, n, [], now)
                continue
            d = c.offer(rid, n, prompt_block_hashes(list(range(i, i + n)), 16), now)
            decisions += 1
            if d.admit:
                live[rid] = (n, False)
            else:
                assert d.reason and d.message
        elif kind == "start":
            c.started(rid, now)
            if rid in live:
                live[rid] = (live[rid][0], True)
        else:
            c.finished(rid, aborted=kind == "abort" and rid in live)
            live.pop(rid, None)
        assert len(c) == len(live)
        assert c.num_queued == sum(1 for _, s in live.values() if not s)
        assert c.queued_tokens == sum(n for n, s in live.values() if not s)
        assert set(c.overdue(now)) <= {r for r, (_, s) in live.items() if not s}
    stats = c.stats.as_dict()
    assert stats["admitted"] + stats["rejected_total"] == decisions


# ------------------------------------------------------------------------------ the serving loop


@pytest.fixture(scope="module")
def overload_runs():
    """One Mooncake window at 4x its rate on the simulator (past this host's capacity), with and
    without admission, as ``evaluate.py --backend sim`` serves it."""
    from feather_env.evaluation.simulated import SimConfig, evaluate_simulated
    from feather_env.scenarios import load_scenario

    scenario = load_scenario("mooncake-synthetic")
    names = ("group-cap-8@256", "group-cap-8@256~slo:0.5", "group-cap-8@256~deadline",
             "fcfs@256~queued-reqs:64")
    config = SimConfig(names, (0,), "configs/profiles/cpu-tiny-llama-epyc-avx512.json", slos=SLOS)
    runs = evaluate_simulated(scenario, config, log=None)
    return {r.label: (r, serving_metrics(r.timelines, goodput=SLOS)) for r in runs}


def test_every_request_gets_exactly_one_outcome(overload_runs):
    for run, m in overload_runs.values():
        assert m["completed"] + m["rejected"] + m["aborted"] + m["failed"] == m["submitted"]
        assert m["failed"] == 0
        for t in run.timelines:
            if t.shed:
                assert t.tokens == 0 and t.finished_count == 0 and t.reason
                assert t.outcome == "rejected" or math.isnan(t.first_scheduled)  # aborted before any step
            else:
                assert t.completed


def test_shedding_past_capacity_lifts_attainment_and_cuts_the_queue(overload_runs):
    _, base = overload_runs["group-cap-8@256"]
    _, slo = overload_runs["group-cap-8@256~slo:0.5"]
    _, deadline = overload_runs["group-cap-8@256~deadline"]
    assert base["rejected"] == base["aborted"] == 0 and base["slo_attainment"] < 0.5
    assert slo["rejected"] > 0 and slo["slo_attainment"] >= 2 * base["slo_attainment"]
    assert slo["p99_ttft_ms"] < 5000 and slo["false_admit_fraction"] < 0.05
    assert deadline["aborted"] > 0 and deadline["slo_attainment"] > base["slo_attainment"]
    run, _ = overload_runs["group-cap-8@256~deadline"]
    assert all(t.reason == "deadline" for t in run.timelines if t.outcome == "aborted")


def test_a_rule_that_needs_slos_is_refused_before_anything_is_served():
    from feather_env.evaluation.simulated import SimConfig, evaluate_simulated
    from feather_env.scenarios import load_scenario

    with pytest.raises(ConfigError, match="--goodput ttft"):
        evaluate_simulated(load_scenario("mooncake-synthetic"), SimConfig(("fcfs~slo",), (0,)), log=None)


@pytest.mark.engine
def test_the_real_engine_serves_rejects_and_aborts_each_request_exactly_once(env_backend):
    """The in-process engine past capacity (a burst of L-Eval requests, a 1.5-s TTFT SLO): the
    rule's rejections never reach vLLM, the deadline's aborts leave its queue before any step,
    the rest are served with their tokens, and the engine serves a plain episode afterwards."""
    import dataclasses

    from feather_env.scenarios import load_scenario
    from feather_env.workloads import Workload

    episode = load_scenario("leval-kv-pressure").episode_workload(0)
    burst = Workload("burst", tuple(dataclasses.replace(r, arrival_time=0.0) for r in episode.requests[:24]))
    env_backend.admission_slos = {"ttft": 1500.0}
    try:
        for name in ("group-cap-3~slo:0.5", "fcfs~deadline"):
            timelines = env_backend.serve(burst, SchedulerConfig.for_name(name, trust_client_hints=True))
            m = serving_metrics(timelines, goodput={"ttft": 1500.0})
            assert m["completed"] + m["rejected"] + m["aborted"] == m["submitted"] == 24, name
            assert m["failed"] == 0 and m["completed"] > 0, name
            assert (m["rejected"] if "slo" in name else m["aborted"]) > 0, name
            assert all(t.tokens == 0 and math.isnan(t.first_token) for t in timelines if t.shed)
    finally:
        env_backend.admission_slos = {}
    plain = env_backend.serve(burst, SchedulerConfig.for_name("fcfs"))
    assert all(t.completed for t in plain)
