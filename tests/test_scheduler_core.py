"""The batching core and its pieces without an engine: lifecycle, starvation, SVF, orderings, config.

A small discrete-time engine model (:func:`simulate`) drives the core as vLLM's subclass does:
each step asks ``plan(now, free slots)``, runs every active request one token, and reports
finished ones. Hypothesis drives the core's state machine with arbitrary interleavings of
arrivals, plans, finishes, aborts and preemptions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from scheduler_runtime.batching import BatchingCore, CoreConfig
from scheduler_runtime.config import ConfigError
from scheduler_runtime.decision import ADD, STOP
from scheduler_runtime.orderings import ORDERINGS
from scheduler_runtime.predictor import OutputLengthPredictor, load_predictor
from scheduler_runtime.prefix_index import DuplicateRequestError, UnknownRequestError
from scheduler_runtime.rules import HeuristicRule
from scheduler_runtime.schedulers import (
    ADDITIONAL_CONFIG_KEY,
    CONFIG_ENV,
    FeatherRuntime,
    SchedulerConfig,
    engine_overrides,
    load_scheduler_config,
    resolve,
)
from scheduler_runtime.svf import KeyQueue, KVBudget, peak, volume

CHUNK = 16


@dataclass
class Req:
    rid: str
    tokens: np.ndarray
    output_len: int
    arrival: float = 0.0


def grouped(n_groups: int, per_group: int, prefix: int, seed: int, out=(1, 30), suffix: int = 5) -> list[Req]:
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(3, 5000, prefix) for _ in range(n_groups)]
    reqs = []
    for i in range(n_groups * per_group):
        g = i % n_groups
        tokens = np.concatenate([prefixes[g], rng.integers(3, 5000, suffix)])
        reqs.append(Req(f"g{g}-{i}", tokens, int(rng.integers(out[0], out[1] + 1))))
    return reqs


def simulate(core: BatchingCore, reqs: list[Req], slots: int, dt: float = 1.0, max_steps: int = 100_000):
    """Run ``reqs`` through ``core`` in a one-token-per-step engine model.

    Returns ``(release_time, finish_time)`` per id; checks every request is released and
    finished exactly once and that the core is empty (nothing left in the CHT) at the end.
    """
    pending = sorted(reqs, key=lambda r: r.arrival)
    remaining: dict[str, int] = {}
    released_at: dict[str, float] = {}
    finished_at: dict[str, float] = {}
    now, i = 0.0, 0
    for _ in range(max_steps):
        while i < len(pending) and pending[i].arrival <= now:
            r = pending[i]
            core.arrive(r.rid, r.tokens, arrival=r.arrival, output_len=r.output_len)
            i += 1
        for rid in core.plan(now, slots - len(remaining)):
            assert rid not in released_at, f"{rid} released twice"
            released_at[rid] = now
            remaining[rid] = next(r.output_len for r in reqs if r.rid == rid)
        assert len(remaining) <= slots
        assert_within_budget(core)
        for rid in list(remaining):
            remaining[rid] -= 1
            if remaining[rid] == 0:
                del remaining[rid]
                assert rid not in finished_at, f"{rid} finished twice"
                finished_at[rid] = now
                core.finish(rid)
        now += dt
        if i == len(pending) and not len(core):
            break
    else:
        raise AssertionError("simulation did not drain")
    assert set(released_at) == set(finished_at) == {r.rid for r in reqs}
    core.check_consistency()
    assert core.cht.num_keys == 0 and len(core) == 0
    return released_at, finished_at


def assert_within_budget(core: BatchingCore) -> None:
    """The admitted set fits the KV budget, unless it is one request admitted alone."""
    budget = core.budget
    if budget.capacity is not None:
        assert budget.used <= budget.capacity or core.num_active <= 1, (budget.used, core.num_active)


class AlwaysStop:
    def act(self, obs, mask):
        return STOP if mask[STOP] else ADD


class Recorder:
    """Wraps a policy and records every (obs, mask) it is asked."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[tuple[np.ndarray, np.ndarray]] = []

    def act(self, obs, mask):
        self.calls.append((obs.copy(), mask.copy()))
        return self.inner.act(obs, mask)


# ---------------------------------------------------------------------------- heuristic


def test_heuristic_follows_the_design_rule():
    h = HeuristicRule()
    ok = np.array([True, True])
    assert h.act(np.array([0, -9, 0]), np.array([False, True])) == ADD  # empty batch
    assert h.act(np.array([3, 5, 0]), ok) == ADD and h.floor == 1
    assert h.act(np.array([3, 7, 10]), ok) == ADD and h.floor == 2  # popular prefix
    assert h.act(np.array([3, 7, 9]), ok) == STOP
    assert h.act(np.array([1, 30, 0]), ok) == ADD  # batch below the floor
    for _ in range(20):
        h.act(np.array([4, 0, 0]), ok)
    assert h.floor == 10  # capped
    assert h.act(np.array([9, 30, 0]), ok) == ADD and h.act(np.array([10, 30, 0]), ok) == STOP
    assert h.act(np.array([3, 0, 0]), np.array([True, False])) == STOP  # ADD masked
    h.reset()
    assert h.floor == 0


# ---------------------------------------------------------------------------- lifecycle


@pytest.mark.parametrize("ordering", ORDERINGS)
@pytest.mark.parametrize("admission", ["prompt", "peak"])
def test_every_request_is_released_and_finished_exactly_once(ordering, admission):
    reqs = grouped(5, 8, prefix=70, seed=1)
    rng = np.random.default_rng(2)
    for r in reqs:
        r.arrival = float(rng.integers(0, 40))
    core = BatchingCore(CoreConfig(ordering=ordering, admission=admission, chunk_size=CHUNK, max_wait=50.0),
                        kv_capacity_tokens=600)
    simulate(core, reqs, slots=8)
    assert core.stats.arrived == core.stats.finished == len(reqs)
    assert sum(core.stats.released.values()) == len(reqs)
    if ordering == "feather":
        assert core.stats.decisions == core.stats.adds + core.stats.stops
        assert core.stats.released["policy"] == core.stats.adds


def test_stop_holds_the_rest_until_the_batch_drains():
    reqs = grouped(3, 4, prefix=64, seed=3, out=(5, 5))
    core = BatchingCore(CoreConfig(chunk_size=CHUNK, max_wait=None, svf_seed=False, admission="none"),
                        policy=AlwaysStop())
    released, _ = simulate(core, reqs, slots=16)
    # One request per batch: each waits for the previous one to finish (5 steps).
    assert sorted(released.values()) == [5.0 * k for k in range(len(reqs))]
    assert core.stats.stops >= 1 and core.stats.released["seed"] == len(reqs)
    # A STOP is not asked again while nothing changes.
    assert core.stats.skipped_decisions > 0


def test_policy_sees_batch_size_delta_and_w_of_the_cht_candidate():
    reqs = grouped(2, 6, prefix=64, seed=4)
    rec = Recorder(HeuristicRule())
    core = BatchingCore(CoreConfig(chunk_size=CHUNK, max_wait=None, svf_seed=False, admission="none"), rec)
    for r in reqs:
        core.arrive(r.rid, r.tokens, arrival=0.0, output_len=r.output_len)
    core.plan(0.0, 100)
    assert rec.calls, "the policy was never asked"
    obs, mask = rec.calls[0]
    assert obs.dtype == np.float32 and obs.shape == (3,) and mask.tolist() == [True, True]
    assert obs[0] == 1  # the seed is in the batch
    # same group as the seed: loses only the seed's own last chunk (5-token suffix)
    assert obs[1] == 1 and obs[2] == 4
    sizes = [int(o[0]) for o, _ in rec.calls]
    assert sizes == list(range(1, len(sizes) + 1))


class PlainRecorder(Recorder):
    """A policy that reads any sequence of numbers (``reads_plain``): the core hands it a tuple."""

    reads_plain = True

    def act(self, obs, mask):
        self.calls.append((obs, mask.copy()))
        return self.inner.act(obs, mask)


def test_a_policy_reading_plain_numbers_gets_the_same_observation_as_a_tuple():
    reqs = grouped(5, 7, prefix=90, seed=12)
    recorders, released = [], []
    for recorder in (Recorder(HeuristicRule()), PlainRecorder(HeuristicRule())):
        core = BatchingCore(CoreConfig(chunk_size=CHUNK, max_wait=None), recorder, kv_capacity_tokens=2_000)
        released.append(simulate(core, reqs, slots=6)[0])
        recorders.append(recorder)
    arrays, plain = recorders[0].calls, recorders[1].calls
    assert len(arrays) == len(plain) > 20
    assert all(type(obs) is tuple and all(type(x) is int for x in obs) for obs, _ in plain)
    assert [o.tolist() for o, _ in arrays] == [list(o) for o, _ in plain]
    assert released[0] == released[1]  # the same decisions, at the same times


def test_leave_finishes_or_aborts_and_ignores_an_unknown_id():
    reqs = grouped(2, 4, prefix=40, seed=13)
    core = BatchingCore(CoreConfig(chunk_size=CHUNK))
    for r in reqs:
        core.arrive(r.rid, r.tokens, arrival=0.0, output_len=r.output_len)
    first, second = core.plan(0.0, 2)
    waiting = core.waiting_ids()[0]
    assert core.leave(first, aborted=False) and core.stats.finished == 1 and core.stats.aborted == 0
    assert core.leave(second, aborted=True) and core.stats.aborted == 1
    assert core.leave(waiting, aborted=False) and core.stats.aborted == 2  # freed before release
    before = (core.waiting_ids(), core.active_ids(), core.cht.num_keys)
    assert not core.leave("never-held", aborted=False)
    assert (core.waiting_ids(), core.active_ids(), core.cht.num_keys) == before
    assert core.stats.finished == 1 and core.stats.aborted == 2
    core.check_consistency()


def test_aborted_requests_leave_nothing_in_the_cht():
    reqs = grouped(4, 6, prefix=50, seed=5)
    for ordering in ORDERINGS:
        core = BatchingCore(CoreConfig(ordering=ordering, chunk_size=CHUNK), kv_capacity_tokens=10_000)
        for r in reqs:
            core.arrive(r.rid, r.tokens, arrival=0.0, output_len=r.output_len)
        released = core.plan(0.0, 5)
        assert released
        for rid in released[:2]:
            core.remove(rid)  # aborted while active
        for rid in core.waiting_ids()[::2]:
            core.remove(rid)  # aborted while waiting
        core.check_consistency()
        for rid in core.waiting_ids() + core.active_ids():
            core.remove(rid)
        core.check_consistency()
        assert len(core) == 0 and core.cht.num_keys == 0 and core.budget.used == 0
        radix = getattr(core.ordering, "radix", None)
        if radix is not None:
            assert radix.is_empty_tree()
        with pytest.raises(UnknownRequestError):
            core.remove(reqs[0].rid)


def test_errors_leave_the_state_unchanged():
    core = BatchingCore(CoreConfig(chunk_size=CHUNK))
    core.arrive("a", np.arange(3, 40), arrival=0.0, output_len=4)
    with pytest.raises(DuplicateRequestError):
        core.arrive("a", np.arange(3, 40), arrival=0.0, output_len=4)
    with pytest.raises(ValueError):
        core.arrive("b", np.array([], dtype=np.int32), arrival=0.0, output_len=4)
    with pytest.raises(UnknownRequestError):
        core.finish("a")  # waiting, not active
    with pytest.raises(UnknownRequestError):
        core.preempted("a")
    core.check_consistency()
    assert core.waiting_ids() == ["a"]


def test_preemption_keeps_the_request_in_the_batch():
    reqs = grouped(2, 3, prefix=40, seed=6)
    core = BatchingCore(CoreConfig(chunk_size=CHUNK, admission="none"))
    for r in reqs:
        core.arrive(r.rid, r.tokens, arrival=0.0, output_len=r.output_len)
    released = core.plan(0.0, 3)
    victim = released[-1]
    core.preempted(victim)
    core.preempted(victim)  # preempted again after resuming
    assert core.is_active(victim) and core.stats.preempted == 2
    core.check_consistency()
    # resumed and finished like any other
    core.finish(victim)
    assert victim not in core
    core.check_consistency()


# ---------------------------------------------------------------------------- the step API


def stepped(core: BatchingCore, policy, kind: str = "base"):
    """A planner that answers each pending decision from outside, as the environment does."""

    def plan(now: float, slots: int, engine=None) -> list[str]:
        core.open_round(now, slots, engine)
        while (pending := core.pending) is not None:
            core.decide(policy.act(core.observe(kind), pending.mask))
        return core.close_round()

    return plan


@pytest.mark.parametrize("ordering", ORDERINGS)
def test_stepping_the_decisions_releases_what_plan_releases(ordering):
    reqs = grouped(4, 6, prefix=64, seed=21)
    rng = np.random.default_rng(22)
    for r in reqs:
        r.arrival = float(rng.integers(0, 30))
    cfg = CoreConfig(ordering=ordering, chunk_size=CHUNK, max_wait=15.0)
    by_plan = BatchingCore(cfg, policy=HeuristicRule(), kv_capacity_tokens=700)
    by_step = BatchingCore(cfg, policy=HeuristicRule(), kv_capacity_tokens=700)
    outside = HeuristicRule()  # the agent: a second copy of the same rule, fed by observe()
    first = simulate(by_plan, reqs, slots=6)
    by_step.plan = stepped(by_step, outside)  # type: ignore[method-assign]
    second = simulate(by_step, reqs, slots=6)
    assert first == second
    assert by_plan.stats.decisions == by_step.stats.decisions > 0


class FakeEngine:
    def __init__(self, usage: float, cached: dict[str, int]):
        self.usage, self.cached = usage, cached

    def kv_usage(self) -> float:
        return self.usage

    def cached_prefix_tokens(self, request_id: str) -> int:
        return self.cached.get(request_id, 0)


def test_pending_decision_observation_mask_and_answers():
    reqs = grouped(2, 3, prefix=64, seed=23)  # 69 tokens: 5 chunks of 16
    core = BatchingCore(CoreConfig(chunk_size=CHUNK, max_wait=None, svf_seed=False, admission="none"))
    for r in reqs:
        core.arrive(r.rid, r.tokens, arrival=0.0, output_len=r.output_len)
    with pytest.raises(RuntimeError, match="no decision"):
        core.add()
    engine = FakeEngine(0.25, {reqs[2].rid: 40})
    core.open_round(0.0, 3, engine)
    with pytest.raises(RuntimeError, match="already open"):
        core.open_round(0.0, 3)
    seed = core.active_ids()
    assert len(seed) == 1 and core.pending is not None  # the seed needed no decision
    pending = core.pending
    assert pending.mask.tolist() == [True, True] and core.is_waiting(pending.request_id)
    # the candidate is the seed's sibling: same document, so the batch keeps 4 chunks of 5
    obs = core.observe("extended")
    assert obs.dtype == np.float32 and obs.shape == (8,)
    assert obs[:4].tolist() == [1, 1, 1, 5] and obs[4] == np.float32(0.25)  # w: one more sibling
    assert obs[5] == 1 and obs[6] == 5  # misses its own last chunk; 69 tokens = 5 chunks
    assert obs[7] == (40 // CHUNK if pending.request_id == reqs[2].rid else 0)
    assert core.observe().tolist() == obs[:3].tolist()
    with pytest.raises(ValueError):
        core.decide(7)
    core.add()
    assert core.num_active == 2 and core.pending is not None
    core.stop()
    assert core.pending is None and core.round_open
    released = core.close_round()
    assert released == seed + [pending.request_id] and not core.round_open
    # nothing changed since the STOP: the next round asks nothing, until a request arrives
    core.open_round(1.0, 3)
    assert core.pending is None and core.close_round() == []
    assert core.stats.skipped_decisions == 1
    core.arrive("new", np.arange(3, 30), arrival=1.0, output_len=3)
    core.open_round(1.0, 3)
    assert core.pending is not None
    core.close_round()  # a pending decision left unanswered is simply asked again next round
    core.open_round(2.0, 1)
    assert core.pending is not None and core.close_round() == []
    core.check_consistency()


def test_baseline_candidates_are_observed_like_feathers():
    reqs = grouped(3, 2, prefix=64, seed=24)
    core = BatchingCore(CoreConfig(ordering="fcfs", chunk_size=CHUNK, admission="none", svf_seed=False))
    for r in reqs:
        core.arrive(r.rid, r.tokens, arrival=0.0, output_len=r.output_len)
    core.open_round(0.0, 4)
    assert core.active_ids() == [reqs[0].rid]  # fcfs seeds with the oldest
    assert core.pending.request_id == reqs[1].rid  # and asks about the next oldest
    obs = core.observe()
    # another document than the seed's: the batch loses its whole shared prefix (5 chunks)
    assert obs.tolist() == [1, 5, 4]
    core.add()
    assert core.pending.request_id == reqs[2].rid
    assert core.observe()[1] == 0  # the batch shares nothing any more: nothing left to lose


def test_a_failing_policy_leaves_no_open_round():
    class Broken:
        def act(self, obs, mask):
            raise RuntimeError("policy bug")

    core = BatchingCore(CoreConfig(chunk_size=CHUNK, admission="none"), policy=Broken())
    for r in grouped(1, 3, prefix=32, seed=25):
        core.arrive(r.rid, r.tokens, arrival=0.0, output_len=r.output_len)
    with pytest.raises(RuntimeError, match="policy bug"):
        core.plan(0.0, 4)
    assert not core.round_open and core.num_active == 1  # the seed went out before the decision
    core.check_consistency()


# ---------------------------------------------------------------------------- starvation


def test_a_release_charges_the_footprint_of_the_batch_it_joins():
    """The footprint checked for the pending candidate is reused at its release only while
    nothing changed: here the candidate is held (STOP), the request whose prefix it shared
    finishes, and it is released as overdue; it is charged its whole prompt, as the reference
    core (which always computes afresh) charges it."""
    reqs = grouped(1, 2, prefix=40, seed=3, suffix=5)
    cores = [core_cls(CoreConfig(chunk_size=8, admission="prompt", max_wait=3.0), AlwaysStop(),
                      kv_capacity_tokens=10_000) for core_cls in (BatchingCore, ReferenceCore)]
    for core in cores:
        for r in reqs:
            core.arrive(r.rid, r.tokens, arrival=0.0, output_len=r.output_len)
        assert core.plan(0.0, 2) == [reqs[0].rid]  # the seed; the other is asked and held
        assert core.stats.stops == 1
        core.finish(reqs[0].rid)
        assert core.plan(5.0, 2) == [reqs[1].rid]  # overdue
        assert core.stats.released["max_wait"] == 1
        assert core._active[reqs[1].rid].footprint == len(reqs[1].tokens)
    assert _decision_state(cores[0]) == _decision_state(cores[1])


def test_no_request_waits_beyond_max_wait_plus_one_batch():
    """A policy that always STOPs and SVF seeding would starve the big request forever.

    The bound needs a load the batch can serve (here: 4 slots, one arrival every 2 steps
    of at most 8 steps each); an overloaded queue grows whatever the order.
    """
    max_wait, batch_steps = 20.0, 8
    rng = np.random.default_rng(7)
    reqs = [Req("big", rng.integers(3, 5000, 400), batch_steps)]
    for i in range(100):  # a steady stream of small requests
        reqs.append(Req(f"s{i}", rng.integers(3, 5000, 20), int(rng.integers(1, batch_steps + 1)), 2.0 * i))
    core = BatchingCore(CoreConfig(chunk_size=CHUNK, max_wait=max_wait, svf_seed=True, admission="peak"),
                        policy=AlwaysStop(), kv_capacity_tokens=450)
    released, _ = simulate(core, reqs, slots=4)
    arrival = {r.rid: r.arrival for r in reqs}
    waits = {rid: released[rid] - arrival[rid] for rid in released}
    # one batch = the longest a running request can still take
    assert max(waits.values()) <= max_wait + batch_steps, sorted(waits.items(), key=lambda kv: -kv[1])[:3]
    assert core.stats.released["max_wait"] > 0
    assert waits["big"] >= max_wait  # it really was held back (SVF never seeds it)


def test_overdue_request_that_does_not_fit_blocks_newer_ones():
    core = BatchingCore(CoreConfig(chunk_size=CHUNK, max_wait=5.0, admission="peak"), kv_capacity_tokens=100)
    core.arrive("small", np.arange(3, 33), arrival=0.0, output_len=10)
    assert core.plan(0.0, 4) == ["small"]  # seed
    core.arrive("big", np.arange(3, 83), arrival=0.0, output_len=10)  # 90 > 100 - 40 free
    core.arrive("late", np.arange(200, 210), arrival=6.0, output_len=1)
    assert core.plan(6.0, 4) == []  # big is overdue and does not fit: nothing jumps ahead
    core.finish("small")
    assert core.plan(6.0, 4) == ["big"]  # and late (11 more tokens) does not fit beside big (90)


# ---------------------------------------------------------------------------- SVF


def test_volume_and_peak():
    assert volume(10, 4) == 10 * 4 + (16 + 4) / 2
    assert peak(10, 4) == 14
    assert volume(0, 1) == 1.0


def test_key_queue_orders_by_key_then_arrival_with_lazy_removal():
    q = KeyQueue()
    for rid, key in [("a", 3), ("b", 1), ("c", 3), ("d", 0.5)]:
        q.push(rid, key)
    assert q.discard("d") and not q.discard("d")
    assert list(q.ordered()) == ["b", "a", "c"]
    assert q.pop() == "b" and q.peek() == "a" and len(q) == 2
    for i in range(500):
        q.push(f"x{i}", i)
        q.discard(f"x{i}")
    assert len(q._heap) < 200  # rebuilt, not grown without bound


def test_kv_budget_admits_alone_what_never_fits():
    b = KVBudget(100)
    assert b.fits(1000)  # empty: served alone rather than never
    b.charge("a", 1000)
    assert not b.fits(1)
    b.release("a")
    assert b.used == 0 and b.fits(100) and not KVBudget(None).capacity


@pytest.mark.parametrize("ordering,key", [("svf", lambda r: volume(r.tokens.size, r.output_len)),
                                          ("sjf", lambda r: r.output_len)])
def test_svf_and_sjf_release_in_ascending_key(ordering, key):
    rng = np.random.default_rng(8)
    reqs = [Req(f"r{i}", rng.integers(3, 5000, int(rng.integers(5, 200))), int(rng.integers(1, 100)))
            for i in range(40)]
    core = BatchingCore(CoreConfig(ordering=ordering, admission="none", chunk_size=CHUNK))
    for r in reqs:
        core.arrive(r.rid, r.tokens, arrival=0.0, output_len=r.output_len)
    order = core.plan(0.0, 1000)
    by_id = {r.rid: r for r in reqs}
    keys = [key(by_id[rid]) for rid in order]
    assert keys == sorted(keys) and len(order) == 40


def test_svf_peak_check_bounds_the_batch_and_counts_a_shared_prefix_once():
    reqs = grouped(1, 10, prefix=96, seed=9, out=(10, 10), suffix=16)  # 112 tokens, 96 shared
    svf = CoreConfig(ordering="svf", admission="peak", chunk_size=CHUNK)
    core = BatchingCore(svf, kv_capacity_tokens=300)
    for r in reqs:
        core.arrive(r.rid, r.tokens, arrival=0.0, output_len=r.output_len)
    released = core.plan(0.0, 100)
    # first: 112 + 10; each next one: its 16 unshared tokens + 10 -> 122 + 26 * 6 = 278 <= 300
    assert len(released) == 7
    assert core.budget.used <= 300 and core.stats.capacity_stops == 1
    rng = np.random.default_rng(10)
    for ordering in ("svf", "feather"):
        core = BatchingCore(CoreConfig(ordering=ordering, admission="peak", chunk_size=CHUNK),
                            kv_capacity_tokens=500)
        reqs = [Req(f"u{i}", rng.integers(3, 5000, 80), 20) for i in range(20)]
        simulate(core, reqs, slots=20)  # checks the budget after every step
    core = BatchingCore(svf, kv_capacity_tokens=500)
    for r in reqs:
        core.arrive(r.rid, r.tokens, arrival=0.0, output_len=r.output_len)
    core.plan(0.0, 20)
    assert core.num_active == 5 and core.budget.used == 500  # 5 x (80 + 20)


def test_feather_seeds_an_empty_batch_by_smallest_volume():
    rng = np.random.default_rng(11)
    core = BatchingCore(CoreConfig(chunk_size=CHUNK, svf_seed=True, admission="none"), policy=AlwaysStop())
    core.arrive("short-prompt-long-output", rng.integers(3, 5000, 10), arrival=0.0, output_len=500)
    core.arrive("small-volume", rng.integers(3, 5000, 60), arrival=0.0, output_len=2)
    assert core.plan(0.0, 4) == ["small-volume"]
    # without SVF the CHT's best candidate (fewest chunks) seeds
    core = BatchingCore(CoreConfig(chunk_size=CHUNK, svf_seed=False, admission="none"), policy=AlwaysStop())
    core.arrive("short-prompt-long-output", rng.integers(3, 5000, 10), arrival=0.0, output_len=500)
    core.arrive("small-volume", rng.integers(3, 5000, 60), arrival=0.0, output_len=2)
    assert core.plan(0.0, 4) == ["short-prompt-long-output"]


# ---------------------------------------------------------------------------- SGLang orderings


def test_lpm_prefers_the_longest_match_and_falls_back_to_fcfs_above_the_threshold():
    rng = np.random.default_rng(12)
    doc = rng.integers(3, 5000, 64)
    for fallback, expect_match in ((128, True), (2, False)):
        core = BatchingCore(CoreConfig(ordering="lpm", admission="none", chunk_size=CHUNK,
                                       lpm_fcfs_fallback=fallback))
        core.arrive("seed", np.concatenate([doc, [7, 7]]), arrival=0.0, output_len=1)
        assert core.plan(0.0, 1) == ["seed"]
        core.arrive("other1", rng.integers(3, 5000, 66), arrival=0.0, output_len=1)
        core.arrive("other2", rng.integers(3, 5000, 66), arrival=0.0, output_len=1)
        core.arrive("sibling", np.concatenate([doc, [9, 9]]), arrival=0.0, output_len=1)
        first = core.plan(0.0, 1)
        assert first == (["sibling"] if expect_match else ["other1"])


def test_dfs_weight_round_follows_the_radix_order():
    reqs = grouped(3, 5, prefix=40, seed=13)
    core = BatchingCore(CoreConfig(ordering="dfs-weight", admission="none", chunk_size=CHUNK))
    for r in reqs[:1]:
        core.arrive(r.rid, r.tokens, arrival=0.0, output_len=1)
    core.plan(0.0, 1)
    for r in reqs[1:]:
        core.arrive(r.rid, r.tokens, arrival=0.0, output_len=1)
    expected = core.ordering.radix.dfs_weight_order()
    assert core.plan(0.0, 100) == expected


# ---------------------------------------------------------------------------- state machine


class ReferenceCore(BatchingCore):
    """The core without its shortcut: every release computes its footprint afresh."""

    def _release(self, request_id: str, reason: str) -> None:
        self._fit = None
        super()._release(request_id, reason)


def _decision_state(core: BatchingCore) -> tuple:
    """Everything a decision changes (the timers and the round counter aside)."""
    stats = core.stats.as_dict()
    for timing in ("plan_calls", "decision_seconds", "max_plan_seconds"):
        stats.pop(timing)
    pending = core.pending
    return (core.waiting_ids(), core.active_ids(), stats, core.budget.used, core._version,
            core._stop_version, None if pending is None else (pending.request_id, pending.mask.tolist()),
            [core._active[r].footprint for r in core.active_ids()])


class CoreMachine(RuleBasedStateMachine):
    """Arbitrary interleavings of the core's operations keep every structure consistent, and
    the core decides as :class:`ReferenceCore` (its twin, given the same operations) does."""

    def __init__(self) -> None:
        super().__init__()
        self.core: BatchingCore
        self.next_id = 0
        self.rng = np.random.default_rng(0)
        self.prefixes = [self.rng.integers(3, 500, 40) for _ in range(3)]
        self.gone: set[str] = set()
        self.aborted_active = 0
        self.now = 0.0

    @initialize(ordering=st.sampled_from(ORDERINGS), admission=st.sampled_from(["none", "prompt", "peak"]),
                svf_seed=st.booleans(), max_wait=st.sampled_from([None, 0.0, 3.0]), group=st.booleans())
    def start(self, ordering, admission, svf_seed, max_wait, group):
        decision = "group" if group and ordering == "feather" else "request"
        config = CoreConfig(ordering=ordering, admission=admission, svf_seed=svf_seed, chunk_size=8,
                            max_wait=max_wait, decision=decision)
        self.core = BatchingCore(config, kv_capacity_tokens=200)
        self.ref = ReferenceCore(config, kv_capacity_tokens=200)

    @rule(group=st.integers(0, 3), suffix=st.integers(1, 20), out=st.integers(1, 50))
    def arrive(self, group, suffix, out):
        head = self.prefixes[group] if group < 3 else np.zeros(0, dtype=np.int64)
        tokens = np.concatenate([head, self.rng.integers(3, 500, suffix)])
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.core.arrive(rid, tokens, arrival=self.now, output_len=out)
        self.ref.arrive(rid, tokens, arrival=self.now, output_len=out)

    @precondition(lambda self: not self.core.round_open)
    @rule(slots=st.integers(0, 6), dt=st.sampled_from([0.0, 1.0, 5.0]))
    def plan(self, slots, dt):
        self.now += dt
        before = set(self.core.active_ids())
        state = _decision_state(self.core)
        released = self.core.plan(self.now, slots)
        assert released == self.ref.plan(self.now, slots)
        if slots == 0:  # the vLLM scheduler skips such a round: it must change nothing
            assert not released and _decision_state(self.core) == state
        assert len(released) == len(set(released)) <= slots
        assert not set(released) & before and not set(released) & self.gone
        assert all(self.core.is_active(r) for r in released)

    # the step API, as the environment drives it: open a round, answer decisions, close it
    @precondition(lambda self: not self.core.round_open)
    @rule(slots=st.integers(0, 6), dt=st.sampled_from([0.0, 1.0, 5.0]))
    def begin(self, slots, dt):
        self.now += dt
        self.round_active = set(self.core.active_ids())
        self.round_slots = slots
        self.core.open_round(self.now, slots)
        self.ref.open_round(self.now, slots)

    @precondition(lambda self: self.core.pending is not None)
    @rule(action=st.sampled_from([ADD, STOP]))
    def decide(self, action):
        pending = self.core.pending
        obs = self.core.observe("extended")
        assert obs.shape == (8,) and obs[0] == self.core.num_active
        assert pending.mask.tolist() == [True, True]
        if self.core.config.decision == "group":
            # the group decision is asked only about opening a group that shares
            groups = self.core.groups
            assert not groups.in_flight(pending.request_id)
            assert not groups.shares_nothing(pending.request_id)
            g = self.core.observe("group")
            assert g.shape == (9,) and g[3] == groups.num_in_flight and g[6] == groups.num_waiting_groups
        self.core.decide(action)
        self.ref.decide(action)
        if action == ADD:
            assert self.core.is_active(pending.request_id)
        else:
            assert self.core.pending is None and self.core.is_waiting(pending.request_id)

    @precondition(lambda self: self.core.round_open)
    @rule()
    def end(self):
        released = self.core.close_round()
        assert released == self.ref.close_round()
        assert len(released) == len(set(released)) <= self.round_slots
        assert not set(released) & self.round_active and not set(released) & self.gone
        assert all(self.core.is_active(r) for r in released)

    @precondition(lambda self: self.core.num_active > 0)
    @rule(pick=st.integers(0, 10_000))
    def finish(self, pick):
        active = self.core.active_ids()
        rid = active[pick % len(active)]
        self.core.finish(rid)
        self.ref.finish(rid)
        self.gone.add(rid)

    @precondition(lambda self: len(self.core) > 0)
    @rule(pick=st.integers(0, 10_000))
    def abort(self, pick):
        ids = self.core.waiting_ids() + self.core.active_ids()
        rid = ids[pick % len(ids)]
        self.aborted_active += self.core.is_active(rid)
        self.core.remove(rid)
        self.ref.remove(rid)
        self.gone.add(rid)

    @precondition(lambda self: self.core.num_active > 0)
    @rule(pick=st.integers(0, 10_000))
    def preempt(self, pick):
        active = self.core.active_ids()
        self.core.preempted(active[pick % len(active)])
        self.ref.preempted(active[pick % len(active)])

    @invariant()
    def consistent(self):
        assert _decision_state(self.core) == _decision_state(self.ref)
        self.core.check_consistency()
        stats = self.core.stats
        assert stats.arrived == len(self.core) + len(self.gone)
        # every release is accounted for exactly once: still active, finished, or aborted
        assert sum(stats.released.values()) == self.core.num_active + stats.finished + self.aborted_active
        assert stats.decisions == stats.adds + stats.stops
        assert_within_budget(self.core)


TestCoreMachine = CoreMachine.TestCase
TestCoreMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------- names, config, runtime


def test_resolve_maps_every_name():
    assert resolve("fcfs")[0] == "vllm.v1.core.sched.scheduler.Scheduler"
    assert resolve("fcfs", async_scheduling=True)[0].endswith("AsyncScheduler")
    for name in ("sjf", "oracle-sjf", "svf", "svf-1bit", "oracle-svf", "lpm", "dfs-weight",
                 "feather-heuristic", "feather-heuristic+svf", "feather:/x/p.json+svf-1bit"):
        cls, cfg = resolve(name)
        assert cls == "scheduler_runtime.serving.vllm_scheduler.FeatherScheduler" and cfg["name"] == name
        assert resolve(name, async_scheduling=True)[0].endswith("FeatherAsyncScheduler")
    c = SchedulerConfig.for_name("feather:/x/p.json+oracle-svf")
    assert (c.policy, c.lengths, c.admission, c.svf_seed) == ("/x/p.json", "oracle", "peak", True)
    c = SchedulerConfig.for_name("feather-heuristic")
    assert (c.policy, c.admission, c.svf_seed, c.max_wait) == (None, "prompt", False, 60.0)
    assert SchedulerConfig.for_name("svf-1bit").lengths == "1bit"
    assert SchedulerConfig.for_name("lpm").max_wait == 60.0  # every ordering has a finite default
    over = engine_overrides("svf", max_wait=3.0)
    assert over["extra"]["additional_config"][ADDITIONAL_CONFIG_KEY] == {"name": "svf", "max_wait": 3.0}
    with pytest.raises(ConfigError, match="unknown scheduler"):
        SchedulerConfig.for_name("sjf+svf")
    with pytest.raises(ConfigError, match="unknown scheduler"):
        resolve("feather:")


def test_config_precedence_env_then_additional_config(tmp_path):
    path = tmp_path / "sched.yaml"
    path.write_text("name: svf\nmax_wait: 12\n")
    env = {CONFIG_ENV: str(path)}
    assert load_scheduler_config(None, "lpm", environ={}).name == "lpm"
    c = load_scheduler_config(None, "lpm", environ=env)
    assert (c.name, c.max_wait, c.admission) == ("svf", 12.0, "peak")
    extra = {ADDITIONAL_CONFIG_KEY: {"max_wait": 1.5, "chunk_size": 64}}
    c = load_scheduler_config(extra, "lpm", environ=env)
    assert (c.name, c.max_wait, c.chunk_size) == ("svf", 1.5, 64)
    c = load_scheduler_config(None, "x", environ={CONFIG_ENV: json.dumps({"name": "sjf"})})
    assert c.ordering == "sjf"
    with pytest.raises(ConfigError, match="unknown key"):
        load_scheduler_config({ADDITIONAL_CONFIG_KEY: {"max_wiat": 1}}, "svf", environ={})


def test_runtime_output_lengths_per_mode():
    tokens = np.arange(3, 300)
    oracle = FeatherRuntime(SchedulerConfig.for_name("oracle-svf", trust_client_hints=True), 10_000)
    assert oracle.output_length(tokens, 50, {"feather_output_len": 7}) == 7
    assert oracle.output_length(tokens, 50, None) == 50  # max_tokens when not given
    pred = load_predictor()
    svf = FeatherRuntime(SchedulerConfig.for_name("svf", trust_client_hints=True), 10_000, predictor=pred)
    assert svf.output_length(tokens, 50, {"feather_source": "leval/gsm100"}) == pytest.approx(
        pred.predict(tokens, "leval/gsm100"))
    one_bit = FeatherRuntime(SchedulerConfig.for_name("svf-1bit"), 10_000, predictor=pred)
    assert one_bit.output_length(tokens, 50, None) in (pred.proxy_short, pred.proxy_long)
    clamp = FeatherRuntime(SchedulerConfig.for_name("svf", clamp_to_max_tokens=True), 10_000, predictor=pred)
    assert clamp.output_length(tokens, 1, {"feather_source": "leval/news_summ"}) == 1.0
    # a scheduler that never reads lengths does not predict
    lpm = FeatherRuntime(SchedulerConfig.for_name("lpm"), 10_000)
    assert lpm.predictor is None
    lpm.arrive("a", tokens, now=0.0, max_tokens=5)
    assert lpm.stats.predictions == 0 and lpm.core.num_waiting == 1
    lpm.left_engine("a", aborted=True)
    assert len(lpm.core) == 0


def test_feather_checkpoint_loads_through_load_policy(tmp_path):
    from scheduler_runtime.decision import BASE_OBS_NAMES, ObservationSpec
    from scheduler_runtime.policy import ConstantPolicy, write_policy

    spec = ObservationSpec(names=BASE_OBS_NAMES, low=(0, -64, 0), high=(64, 64, 64), scale=(64, 64, 64),
                           chunk_size=256)
    path = write_policy(tmp_path / "stop.feather", ConstantPolicy(spec, STOP))
    runtime = FeatherRuntime(SchedulerConfig.for_name(f"feather:{path}+svf"), 100_000)
    assert runtime.chunk_size == 256  # delta in the policy's chunks
    assert type(runtime.core.policy).__name__ == "ConstantPolicy"
    for i in range(3):
        runtime.arrive(f"r{i}", np.arange(3, 40 + i), now=0.0, max_tokens=4)
    assert len(runtime.plan(0.0, 8)) == 1  # seed, then the policy STOPs
    assert runtime.snapshot()["stops"] == 1
    with pytest.raises(ConfigError, match="chunks of 256"):
        FeatherRuntime(SchedulerConfig.for_name(f"feather:{path}", chunk_size=512), 100_000)
    with pytest.raises(ValueError, match="no such file"):
        FeatherRuntime(SchedulerConfig.for_name(f"feather:{tmp_path}/missing.feather"), 100_000)


# ---------------------------------------------------------------------------- predictor


def test_shipped_predictor_reports_heldout_accuracy():
    pred = load_predictor()
    m = pred.metrics
    assert m["heldout_requests"] > 1000
    # better than a constant, and the classifier better than the majority class
    assert m["mae_tokens"] < m["mae_baseline_train_median"]
    assert m["classifier_accuracy"] > m["classifier_baseline_majority"] + 0.2
    assert pred.proxy_short < pred.threshold < pred.proxy_long
    tokens = np.random.default_rng(0).integers(3, 8000, 16_000).astype(np.int32)
    # task matters: a summary is predicted longer than a multiple-choice letter
    assert pred.predict(tokens, "leval/news_summ") > 10 * pred.predict(tokens, "leval/tpo")


def test_predictor_round_trips_and_rejects_other_files(tmp_path):
    rng = np.random.default_rng(1)
    lens = rng.integers(10, 1000, 200)
    tails = [rng.integers(3, 100, 64) for _ in range(200)]
    sources = ["a/x" if i % 2 else "b/y" for i in range(200)]
    y = np.where(np.array(sources) == "a/x", 5, 300) + rng.integers(0, 3, 200)
    model = OutputLengthPredictor.fit(lens, tails, sources, y, threshold=64)
    assert model.predict(tails[1], "a/x") < 20 < 200 < model.predict(tails[0], "b/y")
    assert model.predict_long(tails[0], "b/y") and not model.predict_long(tails[1], "a/x")
    model.save(tmp_path / "p.json")
    again = OutputLengthPredictor.load(tmp_path / "p.json")
    assert again.predict(tails[3], "a/x") == pytest.approx(model.predict(tails[3], "a/x"))
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a Feather"):
        OutputLengthPredictor.load(tmp_path / "bad.json")
