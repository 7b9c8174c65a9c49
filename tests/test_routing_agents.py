"""The routing agents benchmark's measure of how learnable the oracle's moves are (its AUC and the
leave-one-seed-out fit behind it)."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.routing_agents import auc, move_predictability


def _pairwise_auc(scores: list[float], labels: list[int]) -> float:
    pos = [s for s, y in zip(scores, labels, strict=True) if y]
    neg = [s for s, y in zip(scores, labels, strict=True) if not y]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


@given(st.lists(st.tuples(st.integers(-5, 5), st.integers(0, 1)), min_size=2, max_size=60))
def test_auc_is_the_share_of_positive_negative_pairs_ordered(pairs: list[tuple[int, int]]) -> None:
    scores = [float(s) for s, _ in pairs]
    labels = [y for _, y in pairs]
    got = auc(scores, labels)
    if 0 < sum(labels) < len(labels):
        assert math.isclose(got, _pairwise_auc(scores, labels), abs_tol=1e-12)
    else:
        assert math.isnan(got)


def test_auc_ends() -> None:
    assert auc([0.1, 0.2, 0.8, 0.9], [0, 0, 1, 1]) == 1.0
    assert auc([0.9, 0.8, 0.2, 0.1], [0, 0, 1, 1]) == 0.0
    assert auc([0.5] * 4, [0, 1, 0, 1]) == 0.5


def _examples(rng: np.random.Generator, informative: bool) -> dict[int, tuple[list[np.ndarray], list[float]]]:
    out = {}
    for seed in range(3):
        x = rng.normal(size=(300, 5))
        y = (x[:, 0] + 0.3 * rng.normal(size=300) > 1.0) if informative else rng.random(300) < 0.15
        out[seed] = (list(x), list(y.astype(float)))
    return out


def test_predictability_tells_a_learnable_move_from_noise() -> None:
    rng = np.random.default_rng(0)
    learnable = move_predictability(_examples(rng, informative=True))
    noise = move_predictability(_examples(rng, informative=False))
    assert set(learnable["per_seed"]) == {"0", "1", "2"}
    assert learnable["logistic_auc_median"] > 0.95 and learnable["mlp_auc_median"] > 0.9
    assert learnable["mlp_precision_at_moves_median"] > 0.6
    assert 0.35 < noise["logistic_auc_median"] < 0.65 and 0.35 < noise["mlp_auc_median"] < 0.65
    for seed in noise["per_seed"].values():
        assert seed["examples"] == 300 and 0 < seed["moves"] < 300
        assert math.isclose(seed["base_rate"], seed["moves"] / 300)
