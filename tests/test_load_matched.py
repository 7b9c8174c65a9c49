"""The load-matched benchmark's speed estimate: the engine's lone prefills against the simulator's."""

from __future__ import annotations

import pytest

from benchmarks.load_matched import MIN_PROBE_TOKENS, _poisson_rate, machine_slowdown
from feather_env.engines.sim_backend import SimBackend
from feather_env.scenarios import load_scenario
from feather_env.step_model import features_from_columns


def _profile_prefill(engine: object, prompt: int) -> float:
    model = SimBackend(engine).model
    return float(model.predict_features(features_from_columns([prompt], [0], [0], [0], [True],
                                                              model.cache_tokens)))


@pytest.mark.parametrize("k", [0.5, 1.0, 2.25])
def test_an_engine_k_times_slower_than_the_profile_measures_k(k: float) -> None:
    engine = load_scenario("leval-kv-pressure-poisson").engine_config()
    lens = [256, 4096, 8192]
    # the short probe is off by another factor: its time is the step's fixed cost, not the prefill
    ttft = [3.0 * k * _profile_prefill(engine, lens[0])] + [k * _profile_prefill(engine, p) for p in lens[1:]]
    speed = machine_slowdown({"prompt_lens": lens, "ttft_s": ttft})
    assert speed["slowdown"] == pytest.approx(k)
    assert [q["prompt_tokens"] for q in speed["probes"]] == lens
    assert speed["probes"][0]["ratio"] == pytest.approx(3.0 * k)


def test_with_only_short_probes_every_probe_counts() -> None:
    engine = load_scenario("leval-kv-pressure-poisson").engine_config()
    lens = [64, 128, MIN_PROBE_TOKENS // 2]
    ttft = [2.0 * _profile_prefill(engine, p) for p in lens]
    assert machine_slowdown({"prompt_lens": lens, "ttft_s": ttft})["slowdown"] == pytest.approx(2.0)


def test_only_poisson_arrivals_are_rescaled() -> None:
    assert _poisson_rate("poisson:3.0") == 3.0
    for arrival in ("burst", "trace:data/x.csv:2", "poisson"):
        with pytest.raises(SystemExit, match="poisson:RATE"):
            _poisson_rate(arrival)
