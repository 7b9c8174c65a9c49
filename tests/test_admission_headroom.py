"""The admission headroom benchmark's pieces (``benchmarks/admission_headroom.py``) on a tiny simulated
episode: the Mooncake synthetic trace's 20-s windows replayed at 4x (5 s, ~80 requests, overloaded).

What is checked is bookkeeping and the inequalities the figures rest on, never a figure: rejecting
at arrival is removing the request from the workload, the hindsight oracle never does worse than
the setting it starts from and its figure is reproduced by serving its kept set, the counts add up
(kept + dropped = submitted, good <= kept), the upper bound is above everything achieved, and the
bandit's bookkeeping matches its pulls."""

from __future__ import annotations

import pytest

from benchmarks.admission_headroom import (
    FACTORS,
    IntervalUCB,
    Server,
    attainment_bound,
    bandit_episode,
    budget_of,
    hindsight_oracle,
    length_keep,
    placebo,
)

BASE = "group-cap-8@256"
RULE = f"{BASE}~slo:0.5"
SEED = 3


@pytest.fixture(scope="module")
def server(data_dir):
    return Server(4.0, overrides={"episode": {"window_s": 20}})


@pytest.fixture(scope="module")
def episode_ids(server):
    return [r.request_id for r in server.episode(SEED)]


def test_the_tiny_episode_is_overloaded_so_there_is_something_to_reject(server, episode_ids):
    assert 20 <= len(episode_ids) <= 300
    base = server.attainment(BASE, SEED)
    assert base["submitted"] == len(episode_ids) and base["rejected"] == 0
    assert base["good"] < base["submitted"]  # some request misses an SLO without admission


def test_rejecting_at_arrival_is_removing_the_request_from_the_workload(server, episode_ids):
    rule = server.attainment(RULE, SEED)
    assert rule["rejected"] > 0
    assert len(rule["admitted"]) + rule["rejected"] == rule["submitted"] == len(episode_ids)
    with_rule = {t.request_id: t for t in server.serve(RULE, SEED)}
    removed = {t.request_id: t for t in server.serve(BASE, SEED, keep=rule["admitted"])}
    assert set(removed) == set(rule["admitted"])
    for rid, t in removed.items():  # the same engine run, request by request
        assert t.first_token == pytest.approx(with_rule[rid].first_token)
        assert t.finish == pytest.approx(with_rule[rid].finish)
    # keeping every request is the setting's own run
    assert server.good(server.serve(BASE, SEED, keep=episode_ids)) == server.good(server.serve(BASE, SEED))


@pytest.mark.parametrize("addback_sims", [None, 6])
def test_the_oracle_prunes_to_good_requests_and_never_loses_to_its_start(server, episode_ids, addback_sims):
    base_good = server.good(server.serve(BASE, SEED))
    o = hindsight_oracle(server, BASE, SEED, addback_sims=addback_sims)
    n = len(episode_ids)
    assert o["submitted"] == n
    assert o["kept"] + o["dropped"] == n
    assert o["good"] <= o["kept"] <= n
    assert set(o["good_ids"]) <= set(o["kept_ids"]) <= set(episode_ids)
    assert o["first_good"] == len(base_good)  # its first serve is the setting's own run
    assert o["good"] >= len(base_good) and o["pruned_good"] <= o["good"]
    assert o["attainment"] == pytest.approx(o["good"] / n)
    assert o["sims"] >= o["prune_serves"] >= 1
    if addback_sims is not None:
        assert o["sims"] - o["prune_serves"] <= addback_sims
    # achievable: serving the kept set (the rest rejected at arrival) gives exactly its good requests
    assert server.good(server.serve(BASE, SEED, keep=o["kept_ids"])) == set(o["good_ids"])


def test_the_oracle_from_the_rules_admitted_set_never_loses_to_the_rule(server):
    rule = server.attainment(RULE, SEED)
    o = hindsight_oracle(server, BASE, SEED, start=rule["admitted"], addback_sims=4)
    assert o["first_good"] == rule["good"]
    assert o["good"] >= rule["good"]
    assert o["kept"] + o["dropped"] == rule["submitted"]


def test_the_placebo_rejects_the_asked_count_and_counts_over_every_submitted(server, episode_ids):
    rule = server.attainment(RULE, SEED)
    p = placebo(server, BASE, SEED, rule["rejected"], seeds=(0, 1, 2))
    n = len(episode_ids)
    assert p["submitted"] == n and p["rejects"] == rule["rejected"]
    assert [d["seed"] for d in p["draws"]] == [0, 1, 2]
    for d in p["draws"]:
        assert d["kept"] + d["rejected"] == n and d["rejected"] == rule["rejected"]
        assert 0 <= d["good"] <= d["kept"]
        assert d["attainment"] == pytest.approx(d["good"] / n)
    atts = sorted(d["attainment"] for d in p["draws"])
    assert p["attainment"] == atts[1]  # the median of three
    nothing = placebo(server, BASE, SEED, 0, seeds=(0,))
    assert nothing["draws"][0]["good"] == server.attainment(BASE, SEED)["good"]


def test_the_upper_bound_is_above_everything_served(server, episode_ids):
    bound = attainment_bound(server.scenario, server.episode(SEED), budget_of(BASE), slos=server.slos)
    assert bound["submitted"] == len(episode_ids)
    assert bound["good_max"] == min(bound["forms"].values())
    assert bound["never_fits_count"] + bound["good_max"] <= len(episode_ids)
    achieved = [server.attainment(BASE, SEED)["good"], server.attainment(RULE, SEED)["good"],
                hindsight_oracle(server, BASE, SEED, addback_sims=4)["good"]]
    assert bound["good_max"] >= max(achieved)


def test_the_length_cap_keeps_exactly_the_prompts_under_it(server, episode_ids):
    episode = server.episode(SEED)
    assert length_keep(episode, float("inf")) == episode_ids and length_keep(episode, 0) == []
    cap = sorted(r.prompt_len for r in episode)[len(episode_ids) // 2]
    got = server.length_cap(BASE, SEED, cap)
    assert got["rejected"] == sum(r.prompt_len > cap for r in episode)
    assert len(got["admitted"]) + got["rejected"] == got["submitted"] == len(episode_ids)
    assert 0 <= got["good"] <= len(got["admitted"])


def test_the_bandit_pulls_once_per_interval_with_arrivals_and_scores_every_pull(server):
    bandit = IntervalUCB(interval_s=1.0)
    episode = server.episode(SEED)
    intervals = {int(r.arrival_time // 1.0) for r in episode}
    got = bandit_episode(server, bandit, f"{BASE}~slo:1", SEED, "test")
    assert got["submitted"] == len(episode) and 0 <= got["good"] <= got["submitted"] - got["rejected"]
    assert sum(bandit.pulls) == len(intervals) == len(bandit.log)
    assert sum(len(r) for r in bandit.rewards) == sum(bandit.pulls)
    assert all(0.0 <= e["reward"] <= 1.0 and e["factor"] in FACTORS for e in bandit.log)
    # every arm is tried once before any is repeated
    first = [e["factor"] for e in sorted(bandit.log, key=lambda e: e["interval"])][: len(FACTORS)]
    assert len(set(first)) == len(first)
