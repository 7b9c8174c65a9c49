"""Prefix groups and the group decision: the structure, the core's order and decisions, the rule,
the scheduler names and the policy files that carry them; the trace-file arrivals."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from scheduler_runtime.batching import BatchingCore, CoreConfig
from scheduler_runtime.config import ConfigError
from scheduler_runtime.decision import (
    ADD,
    GROUP_OBS_NAMES,
    STOP,
    AlwaysAdd,
    ObservationSpec,
    PolicyFormatError,
    observation_kind,
)
from scheduler_runtime.groups import PrefixGroups
from scheduler_runtime.policy import TablePolicy, load_policy, write_policy
from scheduler_runtime.rules import GroupBins, GroupCapRule, TableBins
from scheduler_runtime.schedulers import FeatherRuntime, SchedulerConfig

CHUNK = 8
OBS = {name: i for i, name in enumerate(GROUP_OBS_NAMES)}


# ---------------------------------------------------------------------------- PrefixGroups


class GroupsMachine(RuleBasedStateMachine):
    """PrefixGroups against a naive model recomputed from plain sets at every step."""

    def __init__(self) -> None:
        super().__init__()
        self.groups = PrefixGroups(window=5)
        self.key: dict[str, int] = {}
        self.waiting: list[str] = []  # arrival order
        self.active: set[str] = set()
        self.arrivals: list[tuple[int, bool]] = []
        self.n = 0

    @rule(key=st.integers(0, 6))
    def arrive(self, key):
        live = {self.key[r] for r in self.waiting} | {self.key[r] for r in self.active}
        recent = {k for k, _ in self.arrivals[-5:]}
        self.arrivals.append((key, key in live or key in recent))
        rid = f"r{self.n}"
        self.n += 1
        self.key[rid] = key
        self.waiting.append(rid)
        self.groups.arrive(rid, key)

    @precondition(lambda self: self.waiting)
    @rule(pick=st.integers(0, 1000))
    def release(self, pick):
        rid = self.waiting.pop(pick % len(self.waiting))
        self.active.add(rid)
        self.groups.release(rid)

    @precondition(lambda self: self.active)
    @rule(pick=st.integers(0, 1000))
    def finish(self, pick):
        rid = sorted(self.active)[pick % len(self.active)]
        self.active.remove(rid)
        self.groups.finish(rid)

    @precondition(lambda self: self.waiting)
    @rule(pick=st.integers(0, 1000))
    def remove(self, pick):
        rid = self.waiting.pop(pick % len(self.waiting))
        self.groups.remove(rid)

    @invariant()
    def matches_the_model(self):
        g = self.groups
        g.check_consistency(set(self.waiting), self.active)
        flight = {self.key[r] for r in self.active}
        waiting_keys = {self.key[r] for r in self.waiting}
        assert g.num_in_flight == len(flight)
        assert g.num_waiting_groups == len(waiting_keys)
        assert g.waiting_in_flight() == sum(self.key[r] in flight for r in self.waiting)
        first = g.first_waiting_in_flight()
        if first is None:
            assert not waiting_keys & flight
        else:
            assert first in self.waiting and self.key[first] in flight
        out = dict(g.waiting_groups_out_of_flight())
        assert set(out) == waiting_keys - flight
        for key, rid in out.items():  # the oldest waiting request of its group
            assert rid == next(r for r in self.waiting if self.key[r] == key)
        recent = self.arrivals[-5:]
        assert g.sharing_rate == pytest.approx(sum(r for _, r in recent) / len(recent) if recent else 0.0)
        counts = Counter(k for k, _ in recent)
        for rid in self.waiting:
            key = self.key[rid]
            alone = (sum(self.key[r] == key for r in self.waiting) == 1 and key not in flight
                     and counts[key] <= 1)
            assert g.shares_nothing(rid) == (alone and 2 * sum(r for _, r in recent) < len(recent))
            assert g.in_flight(rid) == (key in flight)


TestGroupsMachine = GroupsMachine.TestCase
TestGroupsMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


# ---------------------------------------------------------------------------- the core's group decision


def documents(n_docs: int, per_doc: int, doc_len: int = 4 * CHUNK, seed: int = 0
              ) -> list[tuple[str, np.ndarray]]:
    """``per_doc`` questions on each of ``n_docs`` documents, interleaved (doc 0, 1, ..., 0, 1, ...)."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(3, 5000, doc_len) for _ in range(n_docs)]
    return [(f"d{i % n_docs}-q{i // n_docs}", np.concatenate([docs[i % n_docs], rng.integers(3, 5000, 3)]))
            for i in range(n_docs * per_doc)]


def group_core(policy=None, **kw) -> BatchingCore:
    return BatchingCore(CoreConfig(chunk_size=CHUNK, decision="group", max_wait=None, **kw),
                        policy if policy is not None else GroupCapRule(cap=2))


class FakeEngine:
    """An engine view whose cache holds the documents named in ``cached`` and whose queue has
    ``queued`` requests (what the vLLM scheduler and the simulator report)."""

    def __init__(self, cached: set[str] = frozenset(), queued: int = 0) -> None:
        self.cached, self.queued = cached, queued

    def kv_usage(self) -> float:
        return 0.5

    def cached_prefix_tokens(self, request_id: str, limit: int | None = None) -> int:
        tokens = 4 * CHUNK if request_id.split("-")[0] in self.cached else 0
        return tokens if limit is None else min(tokens, limit)

    def num_queued(self) -> int:
        return self.queued


def test_requests_of_a_group_in_flight_join_without_a_decision():
    core = group_core(AlwaysAdd())
    for rid, tokens in documents(3, 4):
        core.arrive(rid, tokens, arrival=0.0, output_len=5)
    core.open_round(0.0, 64)
    asked = []
    while core.pending is not None:
        asked.append(core.pending.request_id)
        core.add()
    released = core.close_round()
    assert len(released) == 12
    # one decision per group opened after the seed: the seed's group joins freely
    opened = {a.split("-")[0] for a in asked} | {released[0].split("-")[0]}
    assert len(asked) == 2 and opened == {"d0", "d1", "d2"}
    assert core.stats.released["group"] == 12 - 1 - 2
    core.check_consistency()


def test_group_cap_holds_new_groups_and_lets_groups_in_flight_flow():
    core = group_core(GroupCapRule(cap=2, hold=False, kv_min=0.0))  # holds at any KV usage
    reqs = documents(5, 3)
    for rid, tokens in reqs:
        core.arrive(rid, tokens, arrival=0.0, output_len=5)
    released = core.plan(0.0, 64)
    docs = {r.split("-")[0] for r in released}
    assert len(docs) == 2 and len(released) == 6  # two documents, every question of each
    assert core.groups.num_in_flight == 2 and core.stats.stops == 1
    # a question of a document in flight arrives: it joins at once, the cap notwithstanding
    doc = sorted(docs)[0]
    core.arrive(f"{doc}-late", reqs[int(doc[1:])][1], arrival=1.0, output_len=5)
    assert core.plan(1.0, 64) == [f"{doc}-late"]
    # a document finishes: the next one opens
    for rid in [r for r in core.active_ids() if r.startswith(doc)]:
        core.finish(rid)
    nxt = core.plan(2.0, 64)
    assert len({r.split("-")[0] for r in nxt}) == 1 and len(nxt) == 3
    core.check_consistency()


def test_cached_first_order_and_the_hold():
    reqs = documents(3, 2, seed=1)
    core = group_core(GroupCapRule(cap=8, hold=True))
    for rid, tokens in reqs:
        core.arrive(rid, tokens, arrival=0.0, output_len=5)
    seed = core.plan(0.0, 1, FakeEngine())  # one slot: the seed alone
    assert len(seed) == 1
    first = seed[0].split("-")[0]
    others = sorted({r.split("-")[0] for r, _ in reqs} - {first})
    # the engine caches the last of the other documents: it is the next candidate
    engine = FakeEngine(cached={others[-1]}, queued=3)
    core.open_round(1.0, 64, engine)
    # the in-flight document's other question joined first, then the cached document is asked
    assert core.pending is not None and core.pending.request_id.startswith(others[-1])
    obs = core.observe("group")
    assert obs[OBS["cached_fraction"]] > 0.5 and obs[OBS["groups_in_flight"]] == 1
    assert obs[OBS["waiting_in_flight"]] == 3  # the engine's queue
    core.add()  # the cached document is admitted although requests wait in the engine
    assert core.pending is not None and core.pending.request_id.startswith(others[0])
    assert core.observe("group")[OBS["cached_fraction"]] == 0.0
    assert GroupCapRule(cap=8).act(core.observe("group"), core.pending.mask) == STOP  # held: not cached
    core.stop()
    assert {r.split("-")[0] for r in core.close_round()} == {first, others[-1]}
    core.check_consistency()


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_the_search_skipped_when_nothing_fits_the_budget_changes_no_round(data):
    """The cached-first search is skipped when no waiting request fits the KV budget
    (``BatchingCore.nothing_fits``): every round releases what the full search releases, and
    whenever the floor says nothing fits, no waiting request does."""
    rng = np.random.default_rng(data.draw(st.integers(0, 10_000)))
    capacity = data.draw(st.integers(CHUNK, 24 * CHUNK))
    cap = data.draw(st.integers(1, 4))
    cores = [BatchingCore(CoreConfig(chunk_size=CHUNK, decision="group", max_wait=None),
                          GroupCapRule(cap=cap), kv_capacity_tokens=capacity) for _ in range(2)]
    cores[1].nothing_fits = lambda fewest_missing: False  # the full search, every time
    reqs = documents(data.draw(st.integers(2, 6)), data.draw(st.integers(1, 4)),
                     doc_len=int(rng.choice([2 * CHUNK, 4 * CHUNK])), seed=int(rng.integers(1000)))
    floored = 0
    for step in range(12):
        for rid, tokens in reqs[step * 3:step * 3 + 3]:
            cut = int(rng.integers(CHUNK // 2, tokens.size + 1))
            out = int(rng.integers(1, 3 * CHUNK))
            for core in cores:
                core.arrive(rid, tokens[:cut], arrival=float(step), output_len=out)
        engine = FakeEngine(cached={f"d{i}" for i in range(6) if rng.random() < 0.3})
        core = cores[0]
        best = core.cht.best_candidate()
        if best is not None and core.nothing_fits(core.cht.missing_count(best.request_id)):
            floored += 1
            assert not any(core.budget.fits(core._footprint(r)) for r in core.waiting_ids())
        slots = int(rng.integers(1, 8))
        assert cores[0].plan(float(step), slots, engine) == cores[1].plan(float(step), slots, engine)
        done = [r for r in cores[0].active_ids() if rng.random() < 0.4]
        for core in cores:
            for rid in done:
                core.finish(rid)
    assert cores[0].stats.capacity_stops == cores[1].stats.capacity_stops
    cores[0].check_consistency()
    event("the floor ended a round" if floored else "the floor never ended a round")


def test_requests_that_share_nothing_are_never_held():
    rng = np.random.default_rng(3)
    core = group_core(GroupCapRule(cap=1))
    for i in range(40):  # ShareGPT-like: every prompt its own
        core.arrive(f"u{i}", rng.integers(3, 5000, int(rng.integers(5, 50))), arrival=0.0, output_len=5)
    released = core.plan(0.0, 64)
    assert len(released) == 40 and core.stats.decisions == 0


def test_the_group_observation():
    core = group_core(AlwaysAdd())
    for rid, tokens in documents(4, 2):
        core.arrive(rid, tokens, arrival=0.0, output_len=5)
    core.open_round(3.0, 64, FakeEngine(queued=2))
    obs = core.observe("group")
    assert obs.shape == (len(GROUP_OBS_NAMES),)
    assert obs[OBS["batch_size"]] == 2  # the seed and its document's other question
    assert obs[OBS["groups_in_flight"]] == 1
    assert obs[OBS["waiting_groups"]] == 3
    assert obs[OBS["waiting_in_flight"]] == 2
    assert obs[OBS["kv_usage"]] == 0.5
    assert obs[OBS["oldest_wait"]] == 3.0
    core.close_round()


@pytest.mark.parametrize("kv_min, docs", [(0.0, 1), (0.2, 2), (0.35, 4)])
def test_the_cap_holds_once_kv_min_of_the_cache_is_in_use_or_promised(kv_min, docs):
    """A released prompt counts in ``kv_usage`` at once (its footprint over the capacity), before
    the engine holds a block of it: a burst cannot slip past the cap while the cache fills."""
    reqs = documents(6, 2, doc_len=4 * CHUNK - 3)  # two questions of 4 chunks on each document
    capacity = 10 * 5 * CHUNK  # a document promises a tenth of the cache: its 4 chunks, then 1
    core = BatchingCore(CoreConfig(chunk_size=CHUNK, decision="group", max_wait=None, admission="prompt"),
                        GroupCapRule(cap=1, hold=False, kv_min=kv_min), kv_capacity_tokens=capacity)
    for rid, tokens in reqs:
        core.arrive(rid, tokens, arrival=0.0, output_len=5)
    released = core.plan(0.0, 64)  # no engine: nothing is in use, all is promised
    assert len(released) == 2 * docs
    assert core.kv_committed() == pytest.approx(docs / 10)
    assert core.stats.stops == 1  # then the cap held the next document
    core.check_consistency()


def test_a_policy_of_one_decision_is_refused_by_the_other():
    with pytest.raises(ValueError, match="group"):
        BatchingCore(CoreConfig(chunk_size=CHUNK), GroupCapRule())
    with pytest.raises(ValueError, match="feather ordering"):
        CoreConfig(ordering="lpm", decision="group")


# ---------------------------------------------------------------------------- names and files


def test_group_cap_names():
    config = SchedulerConfig.for_name("group-cap-3")
    assert config.decision == "group" and config.group_cap == 3 and config.ordering == "feather"
    runtime = FeatherRuntime(config)
    assert runtime.core.config.decision == "group" and runtime.core.policy.cap == 3
    assert FeatherRuntime(SchedulerConfig.for_name("group-hold")).core.policy.cap is None
    svf = SchedulerConfig.for_name("group-cap-2+svf")
    assert svf.admission == "peak" and svf.svf_seed and svf.decision == "group"
    for bad in ("group-cap-0", "group-cap-65", "group-cap-03", "group-cap-x"):
        with pytest.raises(ConfigError, match="group-cap"):
            SchedulerConfig.for_name(bad)


def test_a_group_policy_file_serves_the_group_decision(tmp_path):
    spec = ObservationSpec(names=GROUP_OBS_NAMES, low=(0.0,) * 9, high=(64.0,) * 9, scale=(64.0,) * 9,
                           chunk_size=CHUNK)
    bins = GroupBins()
    values = [0.0] * (2 * bins.num_states)
    visits = [0] * (2 * bins.num_states)
    path = write_policy(tmp_path / "g.feather", TablePolicy(spec, bins, values, visits, False, agent="ucb"))
    policy = load_policy(path)
    assert observation_kind(policy) == "group" and isinstance(policy.bins, GroupBins)
    runtime = FeatherRuntime(SchedulerConfig.for_name(f"feather:{path}"))
    assert runtime.core.config.decision == "group" and runtime.chunk_size == CHUNK
    # a policy of the request decision cannot answer the group decision
    base = ObservationSpec(low=(0.0, -64.0, 0.0), high=(64.0,) * 3, scale=(64.0,) * 3, chunk_size=CHUNK)
    paper = TableBins()
    request = write_policy(tmp_path / "r.feather", TablePolicy(base, paper, [0.0] * (2 * paper.num_states),
                                                               [0] * (2 * paper.num_states), True))
    with pytest.raises(ConfigError, match="group"):
        FeatherRuntime(SchedulerConfig.for_name(f"feather:{request}", decision="group"))
    # the paper's bins over the group observation: refused when the file loads
    mixed = write_policy(tmp_path / "m.feather", TablePolicy(spec, paper, [0.0] * (2 * paper.num_states),
                                                             [0] * (2 * paper.num_states), False))
    with pytest.raises(PolicyFormatError, match="group bins"):
        load_policy(mixed)


def test_the_group_cap_rule():
    rule = GroupCapRule(cap=3)
    obs = np.zeros(len(GROUP_OBS_NAMES), dtype=np.float32)
    mask = np.array([True, True])
    obs[OBS["groups_in_flight"]] = 3
    assert rule.act(obs, mask) == ADD  # an empty cache: nothing to keep, nothing held
    obs[OBS["kv_usage"]] = rule.kv_min
    assert rule.act(obs, mask) == STOP
    obs[OBS["groups_in_flight"]] = 2
    assert rule.act(obs, mask) == ADD
    obs[OBS["waiting_in_flight"]] = 1  # work of the groups in flight waits, the candidate is not cached
    assert rule.act(obs, mask) == STOP
    obs[OBS["cached_fraction"]] = 0.9
    assert rule.act(obs, mask) == ADD
    assert rule.act(obs, np.array([False, True])) == ADD  # an empty batch is never held
    with pytest.raises(ValueError):
        GroupCapRule(cap=0)
