"""Unequal replicas: a replica's own speed and KV in the cluster simulator (feather_env/cluster_sim.py),
ours learning them (scheduler_runtime/learned_router.py), llm-d's predicted-latency peer
(scheduler_runtime/peer_routers.py) and benchmarks/unequal_replicas.py end to end."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feather_env.cluster_sim import ClusterSim, ReplicaSpec
from feather_env.scenarios import load_scenario
from feather_env.workloads import Request, Workload
from scheduler_runtime.learned_router import DecayedRate, LearnedRouter, chi2_quantile
from scheduler_runtime.peer_routers import LlmdPredictedLatencyRouter
from scheduler_runtime.router import PrefixAffinityRouter, PrefixHasher


@pytest.fixture(scope="module")
def engine():
    return load_scenario("leval-kv-pressure").engine_config()


def _requests(n: int, prompt: int, output: int, gap: float, start: float = 0.0) -> Workload:
    """``n`` distinct prompts (no shared prefix) arriving ``gap`` seconds apart."""
    rng = np.random.default_rng(7)
    return Workload("t", tuple(Request(f"r{i}", rng.integers(5, 30_000, prompt, dtype=np.int32), i, output,
                                       start + i * gap) for i in range(n)))


def _alone(engine, spec: ReplicaSpec, workload: Workload) -> dict:
    return ClusterSim(1, engine, profiles=[spec]).run(workload, PrefixAffinityRouter()).metrics


def test_a_replicas_profile_slows_its_prefill_and_its_decode_apart(engine):
    """One request at a time (no queue): a 3x prefill slowdown triples the TTFT and leaves the TPOT
    almost alone; a 2x decode slowdown doubles the TPOT."""
    work = _requests(4, 4000, 64, gap=30.0)
    base = _alone(engine, ReplicaSpec(), work)
    slow_prefill = _alone(engine, ReplicaSpec(prefill_slowdown=3.0), work)
    slow_decode = _alone(engine, ReplicaSpec(decode_slowdown=2.0), work)
    assert slow_prefill["mean_ttft_ms"] / base["mean_ttft_ms"] == pytest.approx(3.0, rel=0.15)
    assert slow_prefill["mean_tpot_ms"] / base["mean_tpot_ms"] == pytest.approx(1.0, abs=0.1)
    assert slow_decode["mean_tpot_ms"] / base["mean_tpot_ms"] == pytest.approx(2.0, rel=0.05)
    assert slow_decode["mean_ttft_ms"] < 1.5 * base["mean_ttft_ms"]


def test_a_drift_slows_a_replica_only_while_it_lasts(engine):
    """Requests 30 s apart on a replica 3x slower from 50 s to 110 s: those served in the drift take
    about 3x as long end to end, those before and after it as long as on an equal replica."""
    work = _requests(6, 3000, 32, gap=30.0, start=1.0)  # arrivals at 1, 31, 61, 91, 121, 151 s
    spec = ReplicaSpec(drift=((50.0, 3.0), (110.0, 1.0)))
    base = ClusterSim(1, engine).run(work, PrefixAffinityRouter())
    drift = ClusterSim(1, engine, profiles=[spec]).run(work, PrefixAffinityRouter())
    assert base.metrics["completed"] == drift.metrics["completed"] == 6
    assert spec.slowdowns_at(60.0) == (3.0, 3.0) and spec.slowdowns_at(120.0) == (1.0, 1.0)
    ratio = drift.metrics["mean_e2el_ms"] / base.metrics["mean_e2el_ms"]
    assert ratio == pytest.approx((4 * 1 + 2 * 3) / 6, rel=0.1)  # 2 of 6 requests in the drift


def test_a_replica_publishes_its_own_kv_as_vllm_does(engine):
    small = ReplicaSpec(kv_cache_gib=engine.kv_cache_gib / 4)
    sim = ClusterSim(2, engine, profiles=[ReplicaSpec(), small])
    seen: dict[str, dict] = {}

    class Reader(LearnedRouter):
        def scraped(self, replica, metrics):
            seen[replica] = dict(metrics["vllm:cache_config_info"])
            super().scraped(replica, metrics)

    router = Reader(cache_factor=1.25)  # the cache model on (off by default)
    sim.run(_requests(6, 1000, 8, gap=0.5), router)
    big_kv = seen["0"]["num_gpu_blocks"] * seen["0"]["block_size"]
    small_kv = seen["1"]["num_gpu_blocks"] * seen["1"]["block_size"]
    assert big_kv == engine.num_kv_blocks * engine.block_size
    assert small_kv == pytest.approx(big_kv / 4, rel=0.01)
    est = router.estimates()
    assert (est["0"]["kv_tokens"], est["1"]["kv_tokens"]) == (big_kv, small_kv)
    assert router.cached is not None and router.cached.limits["1"] < router.cached.limits["0"]


@settings(max_examples=60, deadline=None)
@given(rate=st.floats(1e-5, 1e-2), factor=st.floats(0.25, 4.0), tau=st.floats(2.0, 30.0),
       work=st.floats(1.0, 10_000.0), samples=st.integers(30, 200))
def test_a_decayed_rate_tracks_a_changed_rate(rate, factor, tau, work, samples):
    """``samples`` samples of one rate over 3 time constants, then as many of a rate ``factor`` times it
    (a speed change of up to 4x): exact before the change, within 20% of the new rate after it (the
    old samples, all older than 3 time constants, weigh at most exp(-3) of the whole)."""
    r = DecayedRate(tau)
    assert r.value is None
    dt = 3.0 * tau / samples
    for i in range(samples):
        r.add(i * dt, work * rate, work)
    assert r.value == pytest.approx(rate, rel=1e-9)
    new_rate = rate * factor
    for i in range(samples):
        r.add((samples + i) * dt, work * new_rate, work)
    assert abs(r.value / new_rate - 1) <= math.exp(-3.0) * abs(1 / factor - 1) + 1e-9 <= 0.2
    assert r.samples == 2 * samples


@settings(max_examples=60, deadline=None)
@given(times=st.lists(st.floats(0.0, 100.0), min_size=1, max_size=12),
       values=st.lists(st.floats(0.1, 10.0), min_size=12, max_size=12), tau=st.floats(1.0, 50.0))
def test_an_amended_sample_is_the_corrected_one_added_in_the_first_place(times, values, tau):
    """Each sample added as twice its value and amended later, at any point, to its value: the sums (and
    so the ratio and its error) are those of the corrected samples."""
    samples = sorted((t, v, 1.0 + i) for i, (t, v) in enumerate(zip(times, values, strict=False)))
    amended, exact = DecayedRate(tau), DecayedRate(tau)
    for t, v, w in samples:
        exact.add(t, v * w, w)
        amended.add(t, 2 * v * w, w)
    for t, v, w in reversed(samples):
        amended.amend(t, 2 * v * w, v * w, w)
    assert amended.value == pytest.approx(exact.value, rel=1e-9)
    if math.isfinite(exact.relative_error):
        assert amended.relative_error == pytest.approx(exact.relative_error, rel=1e-3, abs=1e-3)


@settings(max_examples=60, deadline=None)
@given(times=st.lists(st.floats(0.0, 100.0), min_size=1, max_size=12),
       values=st.lists(st.floats(0.1, 10.0), min_size=12, max_size=12), tau=st.floats(1.0, 50.0))
def test_a_late_sample_weighs_as_its_age_whatever_the_order(times, values, tau):
    """Samples reported out of order (a prefill sample held until its wait is reported) give the sums
    that the same samples in time order give: each weighs exp(-age / tau_s)."""
    samples = [(t, v, 1.0 + i) for i, (t, v) in enumerate(zip(times, values, strict=False))]
    late, ordered = DecayedRate(tau), DecayedRate(tau)
    for t, v, w in samples:
        late.add(t, v * w, w)
    for t, v, w in sorted(samples):
        ordered.add(t, v * w, w)
    assert late.value == pytest.approx(ordered.value, rel=1e-9)
    assert late.work == pytest.approx(ordered.work, rel=1e-9)
    assert late.last == ordered.last == max(times)
    latest = max(times)
    assert late.work == pytest.approx(sum(w * math.exp(-(latest - t) / tau) for t, _, w in samples), rel=1e-9)


@settings(max_examples=60, deadline=None)
@given(rate=st.floats(1e-5, 1e-2), noise=st.floats(0.05, 0.5), samples=st.integers(20, 400),
       seed=st.integers(0, 2**16))
def test_a_decayed_rate_s_relative_error_is_its_noise_over_root_n(rate, noise, samples, seed):
    """Samples of one rate with multiplicative noise of ``noise`` (standard deviation), their weights all
    1 (a time constant far longer than the run): the error is that of a mean of ``samples`` draws,
    ``noise / sqrt(samples)`` within the sampling error of a standard deviation; none before two
    samples, none for noiseless ones."""
    rng = np.random.default_rng(seed)
    r, exact = DecayedRate(1e9), DecayedRate(1e9)
    assert math.isinf(r.relative_error)
    r.add(0.0, rate * 100.0, 100.0)
    assert math.isinf(r.relative_error)
    for i in range(1, samples):
        r.add(float(i), rate * 100.0 * (1.0 + noise * rng.standard_normal()), 100.0)
    for i in range(samples):
        exact.add(float(i), rate * 100.0, 100.0)
    assert exact.relative_error == pytest.approx(0.0, abs=1e-6)
    expected = noise / math.sqrt(samples)
    # the sample standard deviation of n draws is within ~4 / sqrt(2n) of the true one (and the mean's
    # own error moves the ratio's denominator by ~noise / sqrt(n))
    assert abs(r.relative_error / expected - 1.0) <= 4.0 / math.sqrt(2 * samples) + 2.0 * expected


@pytest.mark.parametrize("k, z, table", [(1, 1.645, 3.841), (3, 1.645, 7.815), (7, 1.645, 14.067),
                                          (15, 1.645, 24.996), (63, 1.645, 82.529), (7, 2.326, 18.475)])
def test_chi2_quantile_matches_the_table(k, z, table):
    """Against chi-square's table (the 95th and 99th percentiles)."""
    assert chi2_quantile(k, z) == pytest.approx(table, rel=0.03)


def _rates(router: LearnedRouter, seconds_per_token: dict[str, float], noise: float, samples: int) -> None:
    """``samples`` prefill samples per replica at its rate, each off by +-``noise`` in turn."""
    for name, rate in seconds_per_token.items():
        learned = router._replica(name)
        for i in range(samples):
            learned.prefill.add(float(i), 1000.0 * rate * (1.0 + noise * (-1) ** i), 1000.0)


def test_the_fleet_noise_test_separates_replicas_only_beyond_their_noise():
    """Two replicas 10% apart: equal by ``fleet_z`` with samples 30% off each way (their difference is
    well within the noise of 10 samples each), unequal with 1% off. A 3x slower replica stands out of
    noisy ones. The band alone weighs all three."""
    close = {"a": 1e-4, "b": 1.1e-4}
    for noise, separated in ((0.3, False), (0.01, True)):
        router = LearnedRouter(band=0.0, fleet_z=1.645, queue_time="off")  # the routing's samples alone
        _rates(router, close, noise, 10)
        assert (router.weights(close, 10.0)["b"] != 1.0) is separated
    slow = {"a": 1e-4, "b": 1e-4, "c": 1e-4, "d": 3e-4}
    gated, band = LearnedRouter(fleet_z=1.645, queue_time="off"), LearnedRouter(queue_time="off")
    for router in (gated, band):
        _rates(router, slow, 0.3, 10)
        assert router.weights(slow, 10.0)["d"] == pytest.approx(3.0, rel=0.05)


class _FakeFleet:
    """Replicas served one request at a time, each prefilling at its own seconds per token: drives a
    router with a clock of its own (no simulator)."""

    def __init__(self, router: LearnedRouter, speeds: dict[str, float], kv_tokens: int = 1 << 20) -> None:
        self.router, self.speeds, self.now = router, speeds, 0.0
        router.clock = lambda: self.now
        for name in speeds:
            router.scraped(name, {"vllm:cache_config_info": {"num_gpu_blocks": kv_tokens // 16,
                                                             "block_size": 16}})
        self.hasher = PrefixHasher()
        self.rng = np.random.default_rng(0)
        self.count = 0
        self.busy_until = dict.fromkeys(speeds, 0.0)

    def serve(self, seconds: float, gap: float = 0.5, prompt: int = 2000,
              chosen: bool = True) -> dict[str, int]:
        """A new prompt every ``gap`` seconds for ``seconds``, where the router chooses (``chosen``) or
        in turn (the router is told either way); each replica serves its prompts in order."""
        sent = dict.fromkeys(self.speeds, 0)
        end = self.now + seconds
        while self.now < end:
            self.now += gap
            ids = self.rng.integers(5, 30_000, prompt, dtype=np.int32)
            hashes = self.hasher.hash(ids)
            loads = {r: int(self.busy_until[r] > self.now) for r in self.speeds}
            replica = (self.router.choose(hashes, loads, tokens=prompt) if chosen
                       else sorted(self.speeds)[self.count % len(self.speeds)])
            rid = f"q{self.count}"
            self.count += 1
            self.router.routed(hashes, replica, tokens=prompt, request_id=rid)
            start = max(self.now, self.busy_until[replica])
            first = start + prompt * self.speeds[replica]
            self.busy_until[replica] = first
            sent[replica] += 1
            at = self.now
            self.now = first
            self.router.prefilled(rid)
            self.now = first + 0.05
            self.router.finished(rid, output_tokens=6)
            self.now = at
        return sent


def _relative(router: LearnedRouter, replica: str, other: str) -> float:
    est = router.estimates()
    return est[other]["prefill_tok_s"] / est[replica]["prefill_tok_s"]  # its seconds per token over other's


@settings(max_examples=5, deadline=None)
@given(slowdown=st.floats(2.0, 4.0))
def test_the_learned_speed_converges_and_adapts_within_60_s(slowdown):
    """Served in turn: a replica ``slowdown`` x slower than the others is learned so; when it becomes as
    fast as the others, and slow again, its estimate is within 20% of the truth 60 s later."""
    base = 1e-4
    fleet = _FakeFleet(LearnedRouter(), {"a": base * slowdown, "b": base, "c": base})
    for speed, truth in ((base * slowdown, slowdown), (base, 1.0), (base * slowdown, slowdown)):
        fleet.speeds["a"] = speed
        fleet.serve(60.0, gap=0.3, chosen=False)
        assert _relative(fleet.router, "a", "b") == pytest.approx(truth, rel=0.2)
    assert fleet.router.estimates()["a"]["prefill_samples"] > 0


def test_a_replica_believed_slow_is_noticed_when_it_is_fast_again():
    """Routed by the learned router itself, a slow replica gets little traffic; when it is fast again,
    the estimate's decaying trust sends it requests, and its learned speed is back within 20% in 60 s."""
    base = 1e-4
    fleet = _FakeFleet(LearnedRouter(), {"a": base * 3, "b": base, "c": base})
    fleet.serve(60.0)
    assert _relative(fleet.router, "a", "b") == pytest.approx(3.0, rel=0.2)
    fleet.speeds["a"] = base
    sent = fleet.serve(60.0)
    assert sent["a"] > 0
    assert _relative(fleet.router, "a", "b") == pytest.approx(1.0, rel=0.2)


def test_the_learned_router_sends_fewer_new_prefixes_to_a_slow_replica():
    fleet = _FakeFleet(LearnedRouter(), {"a": 4e-4, "b": 1e-4, "c": 1e-4})
    fleet.serve(30.0)
    sent = fleet.serve(60.0, gap=0.15)
    assert sent["a"] < min(sent["b"], sent["c"])
    assert fleet.router.state()["weighted"] > 0


class _Weighing(LearnedRouter):
    """The learned router, counting the decisions on which some weight left 1; its cache model off unless
    asked (as the weights' studies ran it)."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("cache_factor", 0.0)
        super().__init__(**kwargs)
        self.decisions = self.moved = 0

    def choose(self, hashes: Any, loads: Any, avoid: Any = (), *, tokens: int | None = None) -> str:
        self.decisions += 1
        self.moved += any(w != 1.0 for w in self.weights(loads.keys(), self.clock()).values())
        return super().choose(hashes, loads, avoid, tokens=tokens)


def test_the_fleet_noise_test_keeps_equal_replicas_equal_and_still_weighs_slow_ones(data_dir):
    """On router_peers' four equal replicas (L-Eval at load 0.8, seed 0, in the simulator), the band alone
    lets a weight leave 1 on most decisions, the first seconds' estimates being noise; with the fleet's
    noise test (``fleet_z=1.645``) on fewer. On the speed fleet (two of four replicas 3x slower in
    prefill), the gate still weighs nearly every decision, and ends with the slow replicas weighted
    above the fast ones."""
    from benchmarks.router_peers import cell_runs
    from benchmarks.unequal_replicas import DEFAULT_SLO, fleets

    runs = cell_runs("uniform", 4, [0])
    _, timed = runs.timed(0.8)[0]
    gate = {"fleet_z": 1.645}
    band, gated = _Weighing(queue_time="off"), _Weighing(queue_time="off", **gate)  # its study: no wait read
    for router in (band, gated):
        runs.sim.run(timed, router, goodput=DEFAULT_SLO, scrape_s=0.0)
    assert band.moved > 0.4 * band.decisions
    assert gated.moved < 0.7 * band.moved
    speed = ClusterSim(4, runs.sim.engine, profiles=fleets(4, 0.0, 0.0)["speed"])
    slow = _Weighing(queue_time="off", **gate)
    speed.run(timed, slow, goodput=DEFAULT_SLO, scrape_s=0.0)
    assert slow.moved > 0.8 * slow.decisions
    w = slow.weights(["0", "1", "2", "3"], slow.clock())
    assert min(w["1"], w["3"]) > max(w["0"], w["2"])


def test_forget_drops_what_was_learned():
    fleet = _FakeFleet(LearnedRouter(), {"a": 2e-4, "b": 1e-4})
    fleet.serve(10.0)
    assert "a" in fleet.router.estimates()
    fleet.router.forget("a")
    assert "a" not in fleet.router.estimates()


def _first_burst(router: LearnedRouter, kv: dict[str, int], docs: int = 8,
                 prompt: int = 4000) -> dict[str, int]:
    """``docs`` new documents routed at once, none finished, nothing learned (loads: requests in flight),
    to replicas publishing ``kv`` tokens: the documents each replica was given."""
    for name, tokens in kv.items():
        router.scraped(name, {"vllm:cache_config_info": {"num_gpu_blocks": tokens // 16, "block_size": 16}})
    hasher, rng = PrefixHasher(), np.random.default_rng(3)
    loads, given = dict.fromkeys(kv, 0), dict.fromkeys(kv, 0)
    for i in range(docs):
        hashes = hasher.hash(rng.integers(5, 30_000, prompt, dtype=np.int32))
        replica = router.choose(hashes, loads, tokens=prompt)
        router.routed(hashes, replica, tokens=prompt, request_id=f"d{i}")
        loads[replica] += 1
        given[replica] += 1
    return given


def test_a_new_document_is_not_placed_where_it_would_overflow_the_kv():
    """Eight 4,000-token documents at once on replicas of 65,536 and 12,288 KV tokens: ours alone (the
    default) splits them by load, 4/4 (the small one overflows); with the guard (filling a replica's KV
    to the brim, its default) the small one is given what fits, 3; filling 90% (``kv_fill``), 2."""
    kv = {"a": 65_536, "b": 12_288}
    assert _first_burst(LearnedRouter(), kv) == {"a": 4, "b": 4}
    guarded = LearnedRouter(kv_guard=True)
    assert _first_burst(guarded, kv) == {"a": 5, "b": 3}
    assert guarded.state()["kv_guarded"] == 1
    assert guarded.kv_room(["a", "b"], 4000) == {"a": pytest.approx(24_000 / 65_536)}
    tenth = LearnedRouter(kv_guard=True, kv_fill=0.9)
    assert _first_burst(tenth, kv) == {"a": 6, "b": 2}
    assert tenth.state()["kv_guarded"] == 4  # b, the less loaded, is ours' choice four times more
    assert tenth.kv_room(["a", "b"], 4000) == {"a": pytest.approx(28_000 / 65_536)}  # b: 12,000 > 90%
    with pytest.raises(ValueError):
        LearnedRouter(kv_guard=True, kv_fill=1.5)


def test_the_kv_guard_counts_what_was_sent_before_the_kv_was_known():
    """A proxy may route its first requests before its first scrape: the guard still counts them, and
    once each replica's KV is read, its LRU is cut to it."""
    router = LearnedRouter(kv_guard=True)
    hasher, rng = PrefixHasher(), np.random.default_rng(7)
    for i in range(4):  # four 4,000-token documents to b, nothing known yet
        hashes = hasher.hash(rng.integers(5, 30_000, 4000, dtype=np.int32))
        router.routed(hashes, "b", tokens=4000, request_id=f"early{i}")
    assert router.kv_room(["a", "b"], 4000) == {}  # silent until every KV is known
    for name, tokens in {"a": 65_536, "b": 12_288}.items():
        router.scraped(name, {"vllm:cache_config_info": {"num_gpu_blocks": tokens // 16, "block_size": 16}})
    assert router.resident.size["b"] == 12_000  # the least recent document is out: three fit
    assert router.kv_room(["a", "b"], 4000) == {"a": pytest.approx(4000 / 65_536)}


def test_the_kv_guard_leaves_equal_replicas_to_ours():
    for tokens in (12_288, 65_536):  # full, and with room on both
        kv = dict.fromkeys(("a", "b"), tokens)
        guarded = LearnedRouter(kv_guard=True)
        assert _first_burst(guarded, kv) == _first_burst(LearnedRouter(), kv)
        assert guarded.kv_room(["a", "b"], 100) == {} and guarded.state()["kv_guarded"] == 0


def _evictions(router: LearnedRouter, kv: dict[str, int]) -> int:
    """Five 2,048-token documents to ``a`` (its cache model, 1.25 x its KV, keeps the last ones), then the
    first again: the evictions ours' cache model declared while routing."""
    for name, tokens in kv.items():
        router.scraped(name, {"vllm:cache_config_info": {"num_gpu_blocks": tokens // 16, "block_size": 16}})
    hasher, rng = PrefixHasher(), np.random.default_rng(5)
    docs = [hasher.hash(rng.integers(5, 30_000, 2048, dtype=np.int32)) for _ in range(5)]
    for i, hashes in enumerate(docs):
        router.routed(hashes, "a", tokens=2048, request_id=f"d{i}")
    router.choose(docs[0], {"a": 0, "b": 0}, tokens=2048)
    return router.counts["evicted"]


def test_the_cache_model_routes_only_on_a_homogeneous_fleet_with_homogeneous_cache():
    """With ``homogeneous_cache``, ours' cache model routes (declares the first document evicted from
    ``a``) where both replicas publish 4,096 KV tokens, as it does without the flag, and does not where
    their KV differs; off, it never does."""
    equal, mixed = {"a": 4096, "b": 4096}, {"a": 4096, "b": 16_384}
    at_routing = {"cache_factor": 1.25, "cache_clock": "routed"}
    assert _evictions(LearnedRouter(**at_routing), equal) == 1
    assert _evictions(LearnedRouter(**at_routing), mixed) == 1
    assert _evictions(LearnedRouter(**at_routing, homogeneous_cache=True), equal) == 1
    assert _evictions(LearnedRouter(**at_routing, homogeneous_cache=True), mixed) == 0
    assert _evictions(LearnedRouter(cache_factor=0.0), equal) == 0


def _docs_to_a(router: LearnedRouter, order: list[int], finish: bool = True) -> list[np.ndarray]:
    """Five 2,048-token documents routed to ``a`` in turn (both replicas publish 4,096 KV tokens: the
    cache model, 1.25 x, keeps two), prefilled (and finished) in ``order``."""
    for name in "ab":
        router.scraped(name, {"vllm:cache_config_info": {"num_gpu_blocks": 256, "block_size": 16}})
    hasher, rng = PrefixHasher(), np.random.default_rng(5)
    docs = [hasher.hash(rng.integers(5, 30_000, 2048, dtype=np.int32)) for _ in range(5)]
    for i, hashes in enumerate(docs):
        router.routed(hashes, "a", tokens=2048, request_id=f"d{i}")
    for i in order:
        router.prefilled(f"d{i}")
        if finish:
            router.finished(f"d{i}", output_tokens=8)
    return docs


def test_on_the_engines_clock_a_prompt_enters_the_cache_model_when_it_is_prefilled():
    """``cache_clock="prefilled"``: the first document, routed first but prefilled last, is the most
    recent in the model (kept), where the routing's clock declared it evicted; the one prefilled first is
    evicted instead."""
    for clock, evicted in (("routed", 1), ("prefilled", 0)):
        router = LearnedRouter(cache_factor=1.25, cache_clock=clock)
        docs = _docs_to_a(router, [4, 3, 2, 1, 0])
        router.choose(docs[0], {"a": 0, "b": 0}, tokens=2048)
        assert router.counts["evicted"] == evicted
    assert router.cache_holds(router.cached, docs[4]) == {}
    router.choose(docs[4], {"a": 0, "b": 0}, tokens=2048)
    assert router.counts["evicted"] == 1


def test_on_the_engines_clock_a_prefix_in_flight_counts_as_held():
    """A document whose request is still in flight on ``a`` (not prefilled, or prefilled and not finished)
    stays there, though four others entered the model since; once it finishes it is held only as the LRU
    holds it. The work counted for the learned speed is its uncached part by the same reading, with
    ``work_by="model"``."""
    router = LearnedRouter(cache_factor=1.25, cache_clock="prefilled", work_by="model")
    docs = _docs_to_a(router, [1, 2, 3, 4])  # d0 routed, not prefilled
    assert router.cache_holds(router.cached, docs[0]) == {"a": 4}
    assert router.choose(docs[0], {"a": 0, "b": 5}, tokens=2048) == "a"  # not the least loaded
    assert router._uncached(docs[0], 2048, ("a", "b")) == {"a": 0.0, "b": 2048.0}
    router.prefilled("d0")  # enters the model now: the most recent
    router.finished("d0", output_tokens=8)
    assert router.cache_holds(router.cached, docs[0]) == {"a": 4}
    assert router.counts["evicted"] == 0
    router.forget("a")
    assert router.cache_holds(router.cached, docs[0]) == {} and not router._to_cache


def test_by_default_the_work_is_counted_by_what_was_sent():
    """``work_by="sent"`` (the default): the speeds' work reads an LRU of 1 x KV of the prompts each replica
    was sent, not the routing's model: the document in flight on ``a``, which the model holds, was sent
    four documents ago, and that LRU (two documents) counts it uncached."""
    router = LearnedRouter(cache_factor=1.25)
    docs = _docs_to_a(router, [1, 2, 3, 4])
    assert router.seen is not router.cached
    assert router.cache_holds(router.cached, docs[0]) == {"a": 4}
    assert router._uncached(docs[0], 2048, ("a", "b")) == {"a": 2048.0, "b": 2048.0}
    assert router._uncached(docs[4], 2048, ("a", "b")) == {"a": 0.0, "b": 2048.0}


@pytest.mark.parametrize(("move_room", "loads", "to"), [
    (2, {"a": 4, "b": 3}, "a"),  # the least loaded has no room: the document stays and is prefilled again
    (2, {"a": 4, "b": 2}, "b"),  # room there: it moves
    (None, {"a": 4, "b": 3}, "b"),  # always moves (the eleventh session's rule)
    (2, {"a": 12, "b": 3}, "b"),  # the owner at the load bound (1.5 x 16 / 2 = 12): it moves
])
def test_an_evicted_document_moves_only_to_a_replica_with_room(move_room, loads, to):
    """The first of five documents prefilled on ``a`` is evicted there by the cache model (it holds two);
    where it goes with ``move_room`` (a load bound of 1.5 x the mean)."""
    router = LearnedRouter(cache_factor=1.25, move_room=move_room, load_factor=1.5)
    docs = _docs_to_a(router, [0, 1, 2, 3, 4])
    assert router.choose(docs[0], loads, tokens=2048) == to
    assert router.counts["evicted"] == 1
    assert router.counts["kept"] == (to == "a")


def test_the_cache_clock_and_the_work_and_the_room_are_checked():
    with pytest.raises(ValueError, match="cache_clock"):
        LearnedRouter(cache_clock="sent")
    with pytest.raises(ValueError, match="work_by"):
        LearnedRouter(work_by="prompt")
    with pytest.raises(ValueError, match="move_room"):
        LearnedRouter(move_room=-1)


def test_the_learned_router_is_told_no_kv():
    with pytest.raises(ValueError):
        LearnedRouter(kv_tokens=1000)


def _llmd_pick(router: LlmdPredictedLatencyRouter, fast: float, slow: float, rounds: int) -> list[str]:
    """Train on requests whose TTFT was ``fast`` ms per 1,000 prompt tokens on pod "fast" and ``slow``
    on pod "slow" (both with the same metrics, TPOT 20 ms), then route 20 new prompts of 2,000 tokens."""
    now = [0.0]
    router.clock = lambda: now[0]
    hasher = PrefixHasher()
    rng = np.random.default_rng(1)
    metrics = {"vllm:kv_cache_usage_perc": 0.1, "vllm:num_requests_waiting": 0,
               "vllm:num_requests_running": 1}
    for pod in ("fast", "slow"):
        router.scraped(pod, metrics)
    for i in range(rounds):
        for pod, ms in (("fast", fast), ("slow", slow)):
            n = int(rng.integers(500, 4000))
            h = hasher.hash(rng.integers(5, 30_000, n, dtype=np.int32))
            router.routed(h, pod, tokens=n, request_id=f"{pod}{i}")
            now[0] += ms * n / 1000 / 1000
            router.prefilled(f"{pod}{i}")
            now[0] += 0.02 * 9
            router.finished(f"{pod}{i}", output_tokens=10)
    picks = []
    for _ in range(20):
        n = 2000
        h = hasher.hash(rng.integers(5, 30_000, n, dtype=np.int32))
        picks.append(router.choose(h, {"fast": 1, "slow": 1}, tokens=n))
    return picks


def test_llmd_per_pod_models_pick_the_faster_pod_when_all_else_is_equal():
    picks = _llmd_pick(LlmdPredictedLatencyRouter(ttft_slo_ms=None, per_pod=True, seed=0), 100.0, 300.0, 30)
    assert picks == ["fast"] * len(picks)


def test_llmd_slo_headroom_prefers_the_pod_that_meets_the_slo():
    """With SLOs the slow pod's predicted TTFT (0.3 s per K tokens: 0.6 s) misses a 0.4 s SLO and the
    fast one's meets it: the positive tier is the fast pod (up to the 1% exploration)."""
    router = LlmdPredictedLatencyRouter(ttft_slo_ms=400.0, tpot_slo_ms=100.0, per_pod=True, seed=0)
    picks = _llmd_pick(router, 100.0, 300.0, 30)
    assert picks.count("fast") >= 18


def test_llmd_pooled_model_cannot_tell_pods_apart_by_speed():
    """llm-d's predictor assumes every pod alike: one model for the pool predicts the same for pods with
    the same metrics, however differently they served (ties broken by the router's draw)."""
    router = LlmdPredictedLatencyRouter(ttft_slo_ms=None, per_pod=False, seed=0)
    _llmd_pick(router, 100.0, 300.0, 30)
    fast, slow = (router.features(p, 2000, 0.0) for p in ("fast", "slow"))
    model = router._model("fast")[0]
    assert model is router._model("slow")[0]
    assert model.predict(fast[0]) == model.predict(slow[0])


def test_the_benchmark_runs_end_to_end(tmp_path, data_dir):
    from benchmarks import unequal_replicas

    out = unequal_replicas.main(["--quick", "--json", str(tmp_path / "u.json")])
    assert (tmp_path / "u.json").exists()
    assert [c["fleet"] for c in out["cells"]] == list(unequal_replicas.FLEETS)
    for c in out["cells"]:
        assert set(unequal_replicas.ROUTERS) <= set(c["routers"])
        tuned = {r for r in c["routers"] if r.endswith(" (tuned)")}
        assert set(c["routers"]) == set(unequal_replicas.ROUTERS) | tuned
        assert not tuned or c["fleet"] != "equal"  # the peers are tuned on the unequal fleets only
        for r in c["routers"].values():
            assert 0.0 <= r["attainment"] <= 1.0 and r["output_throughput"] > 0
            # no router beats the no-queueing bound with each replica at its own speed
            assert r["over_bound_output_throughput"] <= 1.0 + 1e-9
        assert c["routers"]["prefix-learned"]["learned_over_this_output_throughput"] == 1.0
    assert set(out["tuning"]) == {"speed", "kv", "drift"}
    for peers in out["tuning"].values():
        assert set(peers) == set(unequal_replicas.TUNED)
        for t in peers.values():  # the setting of the highest tuning attainment
            assert t["attainment"] == max(g["attainment"] for g in t["grid"])
    speed = next(c for c in out["cells"] if c["fleet"] == "speed")
    equal = next(c for c in out["cells"] if c["fleet"] == "equal")
    assert speed["capacity_req_s"] < equal["capacity_req_s"]  # half the fleet is slower
    drift = next(c for c in out["cells"] if c["fleet"] == "drift")
    assert len(drift["drift"]) == 1 and [p["slowdown"] for p in drift["drift"][0]] == [1.0, 3.0, 1.0]


def test_the_fleet_bound_takes_each_request_at_the_fastest_kind(engine):
    from benchmarks.unequal_replicas import fleet_bound

    slow = ReplicaSpec(prefill_slowdown=3.0, decode_slowdown=1.5)
    timed = _requests(4, 2000, 8, gap=0.2)
    mixed = fleet_bound(engine, [ReplicaSpec(), slow], timed, {})
    fast = fleet_bound(engine, [ReplicaSpec()] * 2, timed, {})
    slow_only = fleet_bound(engine, [slow] * 2, timed, {})
    assert mixed == pytest.approx(fast) and slow_only < fast


def test_the_learned_router_adapts_at_rays_routing_stats_period(data_dir):
    """Ray Serve hands a router each replica's metrics every 10 s (``request_routing_stats_period_s``'s
    default), the proxy every 1 s. In the simulator's drift fleet (8 replicas, replica 0 3x slower from
    40 s to 100 s, load 0.8), the learned router read every 10 s serves as it does read at every arrival:
    the speeds come from the requests it routes; the metrics bring the KV size, read at the first arrival
    whatever the period. Within 60 s of the slowdown its learned speed of replica 0 falls past the band
    (its weight leaves 1), and within 60 s of the recovery it is back within 20% of the others'. Measured
    from each request's first step (``queue_time="service"``, the default), the slow phase's speed is
    0.5-0.7 of the others', not the hardware's 1/3: the slowed replica is sent less, so its own requests
    wait behind fewer; from the routing (``"off"``, with the cache model off as its study ran) it comes
    within 20% of 1/3."""
    from benchmarks.unequal_replicas import (
        DEFAULT_SLO,
        _attainment,
        _Traced,
        capacity,
        convergence,
        drift_workload,
        speed_ratios,
    )
    from benchmarks.unequal_replicas import fleets as fleet_specs
    from feather_env.workloads import load_workload
    from feather_env.workloads.build import WorkloadConfig

    n, at, until = 8, 40.0, 100.0
    engine = load_scenario("leval-kv-pressure").engine_config()
    pool = load_workload(WorkloadConfig(kind="leval", max_prompt_tokens=8192))
    specs = fleet_specs(n, at, until)["drift"]
    work = drift_workload(pool, n, 16, 3, seed=n)
    rate = 0.8 * capacity(engine, specs, Workload("first block", work.requests[:len(work) // 3]))["req_s"]
    timed = work.with_arrivals(f"poisson:{rate}", 1)
    sim = ClusterSim(n, engine, profiles=specs)
    out = {}
    for scrape_s, mode in ((0.0, "service"), (10.0, "service"), (10.0, "off")):
        router = _Traced(queue_time=mode, **({} if mode == "service" else {"cache_factor": 0.0}))
        result = sim.run(timed, router, goodput=DEFAULT_SLO, scrape_s=scrape_s)
        phases = convergence(router.trace, "0", [(0.0, at, 1.0), (at, until, 3.0), (until, math.inf, 1.0)])
        out[scrape_s, mode] = (_attainment(result, len(timed)), result.metrics["output_throughput"], phases,
                               {e["kv_tokens"] for e in router.estimates().values()}, router)
    (att_1, out_1, _, kv_1, _) = out[0.0, "service"]
    (att_10, out_10, phases, kv_10, served) = out[10.0, "service"]
    assert att_10 >= 0.99 * att_1 and out_10 >= 0.99 * out_1
    assert kv_10 == kv_1 and None not in kv_10
    recovered = phases[2]
    assert recovered["first_s"] is not None and recovered["first_s"] <= 60.0, phases
    band = 1.0 / (1.0 + served.band)  # a speed this far below the others' moves the weight
    past = [t - at for t, ratio in speed_ratios(served.trace, "0") if at <= t < until and ratio < band]
    assert past and past[0] <= 60.0
    slow = out[10.0, "off"][2][1]
    assert slow["first_s"] is not None and slow["first_s"] <= 60.0, slow


def test_the_knob_study_runs_ours_variants_beside_today_s_default(tmp_path, data_dir):
    """``benchmarks.unequal_replicas_cache``: every variant asked for and today's default (the reference,
    always run), on the benchmark's held-out draws, each run kept; an unknown variant is a usage error."""
    from benchmarks import unequal_replicas_cache as study

    out = study.main(["--seeds", "2", "--held-out", "--fleets", "kv", "--loads", "1.0",
                      "--variant", "learned, KV guard, fill 0.9", "--variant", "prefix-informed",
                      "--json", str(tmp_path / "k.json")])
    assert (tmp_path / "k.json").exists() and out["seeds"] == [0, 1] and out["held_out"]
    rows = {c["router"]: c for c in out["cells"]}
    assert set(rows) == {study.REFERENCE, "learned, KV guard, fill 0.9", "prefix-informed"}
    assert rows[study.REFERENCE]["over_reference_attainment"] == 1.0
    for row in rows.values():
        assert len(row["runs"]) == 2 and 0.0 <= row["attainment"] <= 1.0
    with pytest.raises(SystemExit):
        study.main(["--variant", "learned, no such knob"])


def test_the_cache_model_reading_asks_the_engines_what_they_held(tmp_path, data_dir):
    """``benchmarks.cache_model_reading``: at load 1 on the speed fleet ours' cache model declares documents
    evicted, the owner's engine held some of them at most, and every request's uncached tokens are read by
    the model, by what was sent and by the engine, split by where the model's holding came from."""
    from benchmarks import cache_model_reading

    out = cache_model_reading.main(["--seeds", "1", "--fleets", "speed", "--json", str(tmp_path / "c.json")])
    assert (tmp_path / "c.json").exists()
    (cell,) = out["cells"]
    assert cell["evictions_per_seed"][0] > 0
    assert 0 <= cell["owner_held_per_seed"][0] <= cell["evictions_per_seed"][0]
    rows = cell["uncached_tokens"]
    assert sum(rows[s]["requests"] for s in cache_model_reading.SOURCES) == rows["all"]["requests"] > 0
    assert rows["none"]["model"] > rows["model"]["model"]  # a prefix held nowhere is counted uncached
    assert all(rows["all"][k] > 0 for k in ("model", "sent", "engine"))


def test_the_equal_replica_check_runs_both_routers_on_router_peers_runs(tmp_path, data_dir):
    """``benchmarks.equal_learned --quick``: today's default and ours learned on the same run, the ratio of
    ours learned over today's default taken from those runs, and the table says how many cells meet 0.98x."""
    from benchmarks import equal_learned
    from benchmarks.router_peers import OURS
    from benchmarks.unequal_replicas import OURS_LEARNED

    out = equal_learned.main(["--quick", "--json", str(tmp_path / "e.json")])
    assert (tmp_path / "e.json").exists() and out["seeds"] == [0]
    (cell,) = out["cells"]
    today, ours = cell["routers"][OURS], cell["routers"][OURS_LEARNED]
    assert cell["replicas"] == 4 and cell["load"] == 1.0
    for row in (today, ours):
        assert len(row["runs"]) == 1 and 0.0 < row["attainment"] <= 1.0
        assert row["attainment_slo2"] <= row["attainment"]  # the tighter pair attains no more
    assert today["learned_over_this_attainment"] == pytest.approx(ours["attainment"] / today["attainment"])
    assert "of 1." in equal_learned.render(out)


def test_the_equal_replica_check_runs_the_tuned_peers_beside_ours_learned(tmp_path, data_dir):
    """``--peers-from``: each of router_peers' peers at the knobs that run tuned (at its defaults where it
    tuned none), on the same runs; the best one named per cell with ours learned over it, and the cells
    where a peer leads by more than 2% counted. A file that is not a router_peers run is a usage error."""
    import json

    from benchmarks import equal_learned
    from benchmarks.router_peers import PEERS
    from benchmarks.unequal_replicas import OURS_LEARNED

    tuned = tmp_path / "peers.json"
    tuned.write_text(json.dumps({"tuned": {"dynamo-kv": {"overlap_score_weight": 8.0}}}))
    out = equal_learned.main(["--quick", "--peers-from", str(tuned)])
    assert out["peers"] == {p: ({"overlap_score_weight": 8.0} if p == "dynamo-kv" else {}) for p in PEERS}
    routers = out["cells"][0]["routers"]
    labels = [equal_learned.peer_label(p) for p in PEERS]
    assert set(labels) <= set(routers)
    (row,), behind = equal_learned.peer_rows(out)
    best = max(labels, key=lambda r: routers[r]["attainment"])
    ratio = routers[OURS_LEARNED]["attainment"] / routers[best]["attainment"]
    assert row[3] == best and behind == (ratio < 1 / 1.02)
    assert "beats ours learned by more than 2%" in equal_learned.render(out)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(SystemExit):
        equal_learned.main(["--quick", "--peers-from", str(tmp_path / "bad.json")])


def test_with_the_cache_model_on_and_its_weights_pinned_ours_learned_routes_as_today_s_default(data_dir):
    """What separates ours learned from today's default on equal replicas is its cache model (1 x the KV it
    reads, entered when prefilled, an evicted document moved only to a replica with room) and its learned
    weights: with the model at today's 1.25 x the KV, entered at routing, every evicted document moved, and a
    band no estimate leaves, told nothing, it routes each request as today's default, told the KV, does."""
    from benchmarks import equal_learned
    from benchmarks.router_peers import OURS

    out = equal_learned.main(["--quick", "--learned", "cache_factor=1.25", "--learned", "cache_clock=routed",
                              "--learned", "move_room=none", "--learned", "band=10"])
    assert out["learned"] == {"cache_factor": 1.25, "cache_clock": "routed", "move_room": None, "band": 10.0}
    today = out["cells"][0]["routers"][OURS]
    assert today["learned_over_this_attainment"] == 1.0
    assert today["learned_over_this_output_throughput"] == 1.0
    with pytest.raises(SystemExit):
        equal_learned.main(["--quick", "--learned", "no_such_knob=1"])


def test_router_cost_alternates_its_passes_side_by_side():
    """``alternate``: both routers built and warmed, then one timed pass each in turn, the order reversed
    every other round; otherwise each router's warm-up and passes one after another. The unequal
    benchmark's cost measures every router it compares so, with as many runs each as repeats."""
    from benchmarks import unequal_replicas
    from benchmarks.routing import router_cost

    log: list[str] = []

    class Logged(PrefixAffinityRouter):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.label = name

        def choose(self, hashes: Any, loads: Any, avoid: Any = (), *, tokens: int | None = None) -> str:
            log.append(self.label)
            return super().choose(hashes, loads, avoid, tokens=tokens)

    def blocks(prefixes: int) -> list[str]:
        return [log[i] for i in range(0, len(log), prefixes)]

    factories = {name: (lambda name=name: Logged(name)) for name in ("a", "b")}
    out = router_cost(4, 5, prompt_tokens=1024, repeats=3, routers=factories, alternate=True)
    assert blocks(5) == ["a", "b", "a", "b", "b", "a", "a", "b"]  # warm-ups, then passes in turn
    assert out["alternating"] and all(len(r["runs_us"]) == 3 for r in out["routers"].values())
    log.clear()
    router_cost(4, 5, prompt_tokens=1024, repeats=2, routers=factories)
    assert blocks(5) == ["a", "a", "a", "b", "b", "b"]
    cost = unequal_replicas.cost(replicas=4, prefixes=5, repeats=2)
    assert set(cost["routers"]) == {*unequal_replicas.COST_ROUTERS, unequal_replicas.WHOLE_PROMPTS}
    assert all(len(r["runs_us"]) == 2 for r in cost["routers"].values())


@pytest.mark.parametrize("report", ["before", "after", "none"])
def test_a_reported_queue_time_starts_the_prefill_at_its_first_step(report):
    """Routed at 0 s, first token at 3 s, having waited 2 s at the replica, finished at 5 s. With
    ``queue_time="service"`` the prefill sample is 1 s, whether the wait is reported before the first token
    (as a server could) or after it (vLLM reports it on the stream's last chunk: the sample is 3 s, from
    the routing, until then); with no report it stays 3 s. With ``"off"``, 3 s and the report ignored."""
    for mode in ("service", "off"):
        router = LearnedRouter(queue_time=mode, overhead_tokens=0)
        now = [0.0]
        router.clock = lambda now=now: now[0]
        router.routed(None, "a", tokens=1000, request_id="r")
        now[0] = 3.0
        if report == "before":
            router.scheduled("r", 2.0)
        router.prefilled("r")
        reads = mode != "off"
        from_step_now = 1.0 if reads and report == "before" else 3.0
        est = router.estimates()["a"]
        assert est["prefill_tok_s"] == pytest.approx(1000 / from_step_now)
        now[0] = 5.0
        if report == "after":
            router.scheduled("r", 2.0)
        from_step = 1.0 if reads and report != "none" else 3.0
        router.finished("r", output_tokens=4)
        est = router.estimates()["a"]
        assert est["prefill_tok_s"] == pytest.approx(1000 / from_step)
        assert router.replicas["a"].prefill.samples == 1
        assert router.counts["queue_reports"] == (reads and report != "none")
        router.scheduled("r", 2.0)  # a report after the finish, or twice: nothing more
        assert router.replicas["a"].prefill.samples == 1
        assert not router._queued and not router._held and not router._requests
    with pytest.raises(ValueError, match="queue_time must be one of"):
        LearnedRouter(queue_time=True)  # type: ignore[arg-type]


def test_told_each_request_s_queue_time_equal_replicas_stay_equal_and_slow_ones_stand_out(data_dir):
    """The simulator reports each request's wait before its first step (``scheduled``) at its end, as
    vLLM does. On router_peers' four equal replicas (L-Eval, load 0.8, seed 0) the estimates' noise was
    that wait (a request held while the replica's batch decodes): with ``queue_time`` some weight leaves 1
    on 36 of the 263 decisions (while provisional samples wait for their reports; none when the report
    came at the first token), against 157 without. On the speed fleet of 4, the weights still move, and
    the slow replicas' learned prefill speed is under half the fast ones'."""
    from benchmarks.router_peers import cell_runs
    from benchmarks.unequal_replicas import DEFAULT_SLO, fleets

    runs = cell_runs("uniform", 4, [0])
    _, timed = runs.timed(0.8)[0]
    told, untold = _Weighing(queue_time="service"), _Weighing(queue_time="off")
    for router in (told, untold):
        runs.sim.run(timed, router, goodput=DEFAULT_SLO, scrape_s=0.0)
    assert told.moved < 0.2 * told.decisions and untold.moved > 0.4 * untold.decisions
    speed = ClusterSim(4, runs.sim.engine, profiles=fleets(4, 0.0, 0.0)["speed"])
    slow = _Weighing(queue_time="service")
    speed.run(timed, slow, goodput=DEFAULT_SLO, scrape_s=0.0)
    assert slow.moved > 0.8 * slow.decisions
    est = {r: e["prefill_tok_s"] for r, e in slow.estimates().items()}
    assert 2.0 * max(est["1"], est["3"]) < min(est["0"], est["2"])


def test_the_drift_share_takes_ours_learned_knobs_and_refuses_unknown_ones(data_dir):
    """``--drift-share --share-learned KNOB=VALUE``: ours learned's two runs use the knob (the JSON says
    which), a different knob changes what ours learned does, and a knob it lacks is a usage error."""
    from benchmarks import unequal_replicas

    args = ["--drift-share", "--replicas", "4", "--docs-per-replica", "2", "--share-blocks", "2",
            "--seeds", "1", "--share-slow-at", "4", "--share-recover-at", "8", "--share-load", "0.9",
            "--share-window", "2", "--share-step", "1"]
    base = unequal_replicas.main(args)
    fast = unequal_replicas.main([*args, "--share-learned", "tau_s=1", "--share-learned", "band=0"])
    assert base["learned"] == {} and fast["learned"] == {"tau_s": 1.0, "band": 0.0}
    for ref in ("informed-slow", "informed-equal"):  # the references do not move
        assert fast["runs"][ref] == base["runs"][ref]
    assert base["runs"]["learned-drift"][0] and fast["runs"]["learned-drift"] != base["runs"]["learned-drift"]
    with pytest.raises(SystemExit):
        unequal_replicas.main([*args, "--share-learned", "no_such_knob=1"])
    with pytest.raises(SystemExit):
        unequal_replicas.main([*args, "--share-learned", "tau_s"])


def test_held_out_draws_give_each_seed_its_own_documents(data_dir):
    """``--first-seed 20000``: each held-out seed draws a workload of its own (as a tuning seed does), not
    the evaluation's one document set; seeds below 10,000 share that set; a mix is refused."""
    from benchmarks.router_peers import HELD_OUT_DRAWS, TUNE_SEED_BASE
    from benchmarks.unequal_replicas import FleetDraws, fleets, own_draws
    from feather_env.workloads import WorkloadConfig, load_workload

    engine = load_scenario("leval-kv-pressure").engine_config()
    pool = load_workload(WorkloadConfig(kind="leval", max_prompt_tokens=8192))
    draws = FleetDraws(engine, pool, 4, docs_per_replica=4)
    specs = fleets(4, 40.0, 100.0)["kv"]
    assert not own_draws([0, 1]) and own_draws([HELD_OUT_DRAWS, HELD_OUT_DRAWS + 1])
    with pytest.raises(ValueError, match="mix"):
        own_draws([0, TUNE_SEED_BASE])
    shared = draws.held_out("kv", specs, [0, 1])
    assert shared[0][1] is shared[1][1]  # one document set, each seed its arrivals
    own = draws.held_out("kv", specs, [HELD_OUT_DRAWS, HELD_OUT_DRAWS + 1])

    def heads(w: Workload) -> list[tuple[int, ...]]:
        return [tuple(r.prompt_token_ids[:64]) for r in w]

    docs = [set(heads(w)) for _, w, _ in own]
    assert docs[0] != docs[1] and docs[0] != set(heads(shared[0][1]))
    # drawn as a tuning seed's workload is: with seed + 100 x replicas
    assert heads(own[0][1]) == heads(draws.draw("kv", specs, HELD_OUT_DRAWS + 400)[0])
    for _, w, cap in own:
        assert len(w) > 0 and cap["req_s"] > 0


def test_the_equal_grid_on_held_out_draws(tmp_path, data_dir):
    """``benchmarks.equal_learned --quick --first-seed 20000``: the grid's cell on a held-out draw, said so in
    the table's head; the evaluation's seeds say theirs."""
    from benchmarks import equal_learned
    from benchmarks.router_peers import HELD_OUT_DRAWS

    out = equal_learned.main(["--quick", "--first-seed", str(HELD_OUT_DRAWS)])
    assert out["seeds"] == [HELD_OUT_DRAWS]
    assert "1 draws of their own documents and arrivals, seeds 20,000-20,000" in equal_learned.render(out)
    with pytest.raises(SystemExit):
        equal_learned.main(["--quick", "--first-seed", "-1"])
