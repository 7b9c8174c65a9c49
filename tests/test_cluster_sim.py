"""The multi-replica simulator (feather_env/cluster_sim.py): one replica is the environment's
simulator exactly, every request is served once, and the router's choice shows in the cache."""

from __future__ import annotations

import math

import pytest

from feather_env.cluster_sim import ClusterSim, distinct_documents
from feather_env.env import FeatherEnv, play_episode
from feather_env.scenarios import load_scenario
from scheduler_runtime.router import ROUTERS, make_router

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
