"""The multi-replica simulator (feather_env/cluster_sim.py): one replica is the environment's
simulator exactly, every request is served once, and the router's choice shows in the cache."""

from __future__ import annotations

import math

import pytest

from feather_env.cluster_sim import ClusterSim, distinct_documents
from feather_env.env import FeatherEnv, play_episode
from feather_env.scenarios import load_scenario
from feather_env.workloads import Workload
from scheduler_runtime.router import ROUTERS, RoundRobinRouter, make_router

# leval-kv-pressure, small: 6 documents x <= 4 questions cut at 2K tokens, on a KV cache of a few of them
OVERRIDES = {"episode": {"groups": 6, "max_per_group": 4}, "workload": {"max_prompt_tokens": 2048},
             "engine": {"kv_cache_gib": 0.03}}


@pytest.fixture(scope="module")
def scenario(data_dir):
    return load_scenario("leval-kv-pressure", {**OVERRIDES, "episode": {**OVERRIDES["episode"],
                                                                         "arrival": "poisson:4"}})


def test_one_replica_is_the_environments_simulator(scenario):
    """The same episode, served by one replica of the cluster and by the environment's simulator
    with the same scheduler answering its own decisions: the same clock, to the last request."""
    env = FeatherEnv(scenario, "sim")
    expected = play_episode(env, episode_seed=3)
    sim = ClusterSim(1, scenario.engine_config())
    got = sim.run(scenario.episode_workload(3), make_router("round-robin"))
    assert got.metrics["completed"] == expected["completed"] == len(scenario.episode_workload(3))
    for key in ("duration", "output_throughput", "mean_e2el_ms", "p99_ttft_ms", "prefix_hit_rate"):
        assert got.metrics[key] == pytest.approx(expected[key], rel=1e-9), key


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_every_request_is_served_once_under_every_router(scenario, name):
    workload = scenario.episode_workload(0)
    result = ClusterSim(3, scenario.engine_config()).run(workload, make_router(name))
    assert result.metrics["completed"] == len(workload) and result.metrics["failed"] == 0
    assert sum(result.requests_per_replica) == len(workload)
    assert result.replicas == 3 and result.max_over_mean >= 1.0


def test_affinity_shows_in_the_prefix_cache(scenario):
    """Round-robin sends each document's questions to every replica (each prefills it again);
    the prefix router keeps them together: a higher hit rate, and round-robin is even."""
    workload = scenario.episode_workload(1)
    sim = ClusterSim(3, scenario.engine_config())
    rr = sim.run(workload, make_router("round-robin"))
    ours = sim.run(workload, make_router("prefix"))
    assert ours.metrics["prefix_hit_rate"] > rr.metrics["prefix_hit_rate"] + 0.1
    assert max(rr.requests_per_replica) - min(rr.requests_per_replica) <= 1
    assert ours.router_state["affinity"] > 0


def test_distinct_documents_copies_are_new_prefixes(scenario):
    pool = scenario.pool
    docs = distinct_documents(pool, pool.num_groups + 3, seed=0, max_per_group=2)
    assert docs.num_groups == pool.num_groups + 3
    copies = [r for r in docs if "#" in r.request_id]
    assert 3 <= len(copies) <= 6
    for r in copies:  # a copy differs from its original in its first chunk, and in nothing else
        original = pool[r.request_id.split("#")[0]]
        diff = (r.prompt_token_ids != original.prompt_token_ids).nonzero()[0]
        assert diff.tolist() == [1] and r.output_len == original.output_len
        assert r.prefix_group != original.prefix_group
    fewer = distinct_documents(pool, 2, seed=0)
    assert fewer.num_groups == 2 and not math.isnan(fewer[0].arrival_time)


def test_bad_arguments():
    engine = load_scenario("leval-kv-pressure").engine_config()
    with pytest.raises(ValueError, match="replicas"):
        ClusterSim(0, engine)


class _FirstAllowed(RoundRobinRouter):
    """The first replica by name that is not avoided, recording what it is told (a tracking router)."""

    tracks_requests = True

    def __init__(self) -> None:
        super().__init__()
        self.finishes: list[tuple[str, int | None]] = []
        self.routings: list[tuple[str, str | None]] = []

    def choose(self, hashes, loads, avoid=(), *, tokens=None):
        return sorted(self._allowed(loads, avoid))[0]

    def routed(self, hashes, replica, *, tokens=None, request_id=None):
        self.routings.append((replica, request_id))

    def finished(self, request_id, *, output_tokens=None):
        self.finishes.append((request_id, output_tokens))


def test_a_request_one_replica_sheds_goes_to_another_and_is_rejected_only_by_all(scenario):
    """Under vLLM's ``queued-reqs:1`` every replica takes one request at a time: of three arriving at
    once, the first is served by replica 0, the second shed there and served by replica 1, the third
    shed by both (the router told of each shed attempt's end, with no output), each counted once."""
    workload = scenario.episode_workload(0)
    burst = Workload("burst", tuple(workload)[:3]).with_arrivals("burst")
    sim = ClusterSim(2, scenario.engine_config(), scheduler="feather-heuristic~queued-reqs:1",
                     reroute_shed=True)
    router = _FirstAllowed()
    run = sim.serve(burst, router)
    ids = [r.request_id for r in sorted(burst, key=lambda r: r.arrival_time)]
    outcomes = []
    while (arrival := run.next_arrival()) is not None:
        assert arrival.loads.keys().isdisjoint(arrival.avoid)
        outcomes.append((arrival.request.request_id, arrival.avoid,
                         run.route(router.choose(arrival.hashes, arrival.loads, arrival.avoid))))
    assert outcomes == [(ids[0], (), True), (ids[1], (), False), (ids[1], ("0",), True),
                        (ids[2], (), False), (ids[2], ("0",), True)]
    # all arrive at once, so nothing was served yet: the finishes so far are the shed attempts'
    assert router.finishes == [(ids[1], None), (ids[2], None), (ids[2], None)]
    result = run.finish()
    assert result.metrics["completed"] == 2 and result.metrics["rejected"] == 1
    assert sorted(t.request_id for t in run.timelines()) == sorted(ids)
    assert result.requests_per_replica == [1, 2]  # replica 1: one served, the last rejection
    assert run.rerouted == {("0", ids[1]), ("0", ids[2])}
    assert [r for r, _ in router.routings] == ["0", "0", "1", "0", "1"]
    with pytest.raises(RuntimeError, match="no arrival"):
        run.route("0")


def test_admission_in_the_fleet_sheds_past_capacity_and_serves_every_admitted_request(scenario):
    """Ours' ``slo`` rule on every replica, a burst past the fleet's capacity: some requests are rejected,
    every other one served once; without a rule every request is served; a rule that reads the TTFT SLO
    without one given is refused."""
    workload = scenario.episode_workload(2).with_arrivals("burst")
    slo = {"ttft": 300.0, "tpot": 1000.0}
    ruled = ClusterSim(2, scenario.engine_config(), scheduler="feather-heuristic~slo", admission_slos=slo)
    got = ruled.run(workload, make_router("prefix"), goodput=slo)
    m = got.metrics
    assert m["rejected"] > 0 and m["completed"] + m["rejected"] == len(workload) and m["failed"] == 0
    assert sum(got.requests_per_replica) == len(workload)
    plain = ClusterSim(2, scenario.engine_config()).run(workload, make_router("prefix"), goodput=slo)
    assert plain.metrics["completed"] == len(workload) and plain.metrics["rejected"] == 0
    with pytest.raises(ValueError, match="TTFT SLO"):
        ClusterSim(2, scenario.engine_config(), scheduler="feather-heuristic~slo")
