"""The simulator's cost model, its fit, and the shipped profile."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feather_env.backends import BatchResult
from feather_env.calibrate import ROBUST_PERCENTILE, fit, raw_measurement, robust_step_time
from feather_env.sim import (
    DEFAULT_PROFILE,
    PROFILE_VERSION,
    CostModel,
    SimBackend,
    composition_of,
    load_profile,
    step_features,
)
from feather_env.workloads import synthetic_workload
from feather_env.workloads.request import Request
from scheduler_runtime.config import ConfigError


def _batch(groups: int, per_group: int, prefix: int, out: int, seed: int = 0) -> list[Request]:
    wl = synthetic_workload(num_groups=groups, per_group=per_group, prefix_len=prefix, suffix_len=16,
                            output_len=out, seed=seed)
    return list(wl)


def test_composition_shares_whole_blocks_of_each_group_prefix():
    reqs = _batch(3, 4, 1000, 8)
    comp = composition_of(reqs, block_size=128)
    assert sorted(set(comp.group.tolist())) == [0, 1, 2]
    # the 1000-token group prefix (plus whatever the suffixes share) is cut to whole blocks
    assert set(comp.shared.tolist()) == {896}
    lone = composition_of(reqs[:1], block_size=128)
    assert lone.shared.tolist() == [0]


def test_miss_model_separates_sorted_from_interleaved_batches():
    reqs = _batch(8, 8, 8000, 8)
    by_group = sorted(reqs, key=lambda r: r.prefix_group)
    interleaved = [by_group[i * 8 + j] for j in range(8) for i in range(8)]
    active = np.ones(64, bool)
    _, t1, m_sorted = step_features(composition_of(by_group), active, 1, cache_tokens=20000)
    _, t2, m_inter = step_features(composition_of(interleaved), active, 1, cache_tokens=20000)
    assert t1 == t2
    # sorted: each document read once; interleaved: every read of a document misses
    assert m_sorted < 8 * 8000 + 64 * 200
    assert m_inter > 60 * 7000


def test_sim_batch_result_accounts_every_token():
    sim = SimBackend(CostModel(30000, (0.004, 6e-5, 6e-8, 2e-7), (0.01, 1e-6, 1e-10)))
    reqs = _batch(2, 5, 2000, 9)
    reqs = [Request(r.request_id, r.prompt_token_ids, r.prefix_group, 3 + i) for i, r in enumerate(reqs)]
    res = sim.run_batch(reqs)
    assert res.output_tokens == sum(r.output_len for r in reqs)
    assert res.decode_tokens == sum(r.output_len - 1 for r in reqs)
    assert res.decode_seconds > 0 and res.prefill_seconds > 0
    assert res.step_batch_sizes[0] == 10 and res.step_batch_sizes[-1] == 1
    with pytest.raises(ValueError, match="empty"):
        sim.run_batch([])


def test_fit_recovers_a_known_model():
    """Measurements generated from a known cost model are fitted back to it."""
    truth = CostModel(32768.0, (0.004, 6e-5, 7e-8, 2.5e-7), (0.012, 1.5e-6, 7e-11))
    sim = SimBackend(truth)
    rng = np.random.default_rng(0)
    measurements = []
    for i in range(40):
        g = int(rng.integers(1, 9))
        reqs = _batch(g, int(rng.integers(1, 9)), int(rng.choice([1000, 4000, 12000])), 12, seed=i)
        if rng.random() < 0.5:
            reqs = [reqs[j] for j in rng.permutation(len(reqs))]
        res = sim.run_batch(reqs)
        # a real run's steps: every request active for all decode steps (equal outputs)
        steps = [sim.predict_step(composition_of(reqs), np.ones(len(reqs), bool), 1 + k)
                 for k in range(11)]
        real = BatchResult(len(reqs), 11 * len(reqs), sum(steps), res.prefill_seconds,
                           12 * len(reqs), res.prompt_tokens, step_times=steps,
                           step_batch_sizes=[len(reqs)] * 11)
        measurements.append(raw_measurement({"i": i}, reqs, real, 128))
    model, mape = fit(measurements, 128, 16384)
    assert mape < 0.01
    assert model.cache_tokens == pytest.approx(truth.cache_tokens, rel=0.3)
    assert model.decode[3] == pytest.approx(truth.decode[3], rel=0.1)


def test_robust_step_time_ignores_bursts_of_contention():
    clean = [0.05] * 8
    assert robust_step_time(clean + [0.5, 0.6]) == pytest.approx(0.05)
    assert 0 < ROBUST_PERCENTILE < 50


def test_shipped_profile_loads_and_carries_the_effect():
    profile = load_profile(DEFAULT_PROFILE)
    assert profile["version"] == PROFILE_VERSION
    assert profile["measurements"], "the profile keeps its measurements for --refit"
    sim = SimBackend.from_profile()
    # L-Eval-sized documents (docs/design.md: the cliff is sharp at 12K-token prefixes)
    reqs = _batch(8, 32, 12000, 32, seed=5)
    hom = [sim.run_batch([r for r in reqs if r.prefix_group == g]) for g in range(8)]
    mixed = sim.run_batch([reqs[i] for i in np.random.default_rng(0).permutation(len(reqs))])
    hom_tput = sum(r.decode_tokens for r in hom) / sum(r.decode_seconds for r in hom)
    assert hom_tput > 1.5 * mixed.decode_tok_s


def test_shipped_profile_is_the_fit_of_its_own_measurements():
    profile = load_profile(DEFAULT_PROFILE)
    m = profile["model"]
    model, _ = fit(profile["measurements"], m["block_size"], m["max_num_batched_tokens"])
    assert model.cache_tokens == m["cache_tokens"]
    np.testing.assert_allclose(model.decode, m["decode"], rtol=1e-6)


def test_bad_profiles_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_profile(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="malformed"):
        load_profile(bad)
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"version": 0, "model": {}}))
    with pytest.raises(ConfigError, match="version"):
        load_profile(old)
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"version": PROFILE_VERSION, "model": {"decode": [0, 0, 0, 0]}}))
    with pytest.raises(ConfigError, match="lacks"):
        load_profile(partial)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 700), st.integers(1, 40)),
                min_size=1, max_size=16),
       st.sampled_from([500.0, 3000.0, 1e6]))
def test_small_batch_path_equals_numpy_path(specs, cache_tokens):
    """The plain-Python path for small batches is the numpy model, step for step."""
    rng = np.random.default_rng(len(specs))
    docs = {g: rng.integers(3, 8000, 600, dtype=np.int32) for g in range(4)}
    reqs = []
    for i, (g, suffix, out) in enumerate(specs):
        prompt = np.concatenate([docs[g], rng.integers(3, 8000, suffix, dtype=np.int32)])
        reqs.append(Request(f"r{i}", prompt, g, out))
    sim = SimBackend(CostModel(cache_tokens, (0.004, 6e-5, 6e-8, 2e-7), (0.01, 1e-6, 1e-10),
                               max_num_batched_tokens=1024))
    small, ref = sim._run_small(reqs), sim._run_numpy(reqs)
    assert small.step_batch_sizes == ref.step_batch_sizes
    assert small.step_times == pytest.approx(ref.step_times, rel=1e-12)
    assert small.decode_seconds == pytest.approx(ref.decode_seconds, rel=1e-12)
    assert small.prefill_seconds == pytest.approx(ref.prefill_seconds, rel=1e-12)
    for field_name in ("decode_tokens", "output_tokens", "prompt_tokens", "prefix_hit_tokens",
                       "num_requests"):
        assert getattr(small, field_name) == getattr(ref, field_name)
