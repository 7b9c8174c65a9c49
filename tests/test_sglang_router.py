"""The real sglang-router (the ``peers`` extra) in front of stand-in workers: it forwards a completion
to one worker and its answer back, and the simulator's ``sglang-cache-aware`` makes its decisions
(benchmarks.router_fidelity, on a short replay). Skipped only where sglang_router is not installed."""

from __future__ import annotations

import importlib.util

import pytest

from benchmarks.router_fidelity import (
    ID_FIELD,
    SGLANG_DEFAULT,
    TARGET,
    RealRun,
    SGLangRouter,
    compare,
    leval_replay,
    post_json,
    replay_sglang,
    request_body,
)
from benchmarks.standin import StandInWorkers
from scheduler_runtime.router import make_router

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("sglang_router") is None,
    reason="sglang_router is not installed (pip install -e '.[peers]'; make test does)")


def test_one_completion_through_the_router_reaches_one_worker_unchanged():
    with StandInWorkers(2, id_field=ID_FIELD) as workers, SGLangRouter(workers.urls) as router:
        body = request_body("only-one", "A document. " * 50 + "\n\nQuestion: what?\nAnswer:")
        answer = post_json(router.url + "/v1/completions", body)
        assert len(workers.received) == 1
        got = workers.received[0]
        assert got.request_id == "only-one"
        # every field the client sent arrives as sent (the router adds its own defaults beside them)
        assert {k: got.body.get(k) for k in body} == body
        assert answer == got.answer  # the client gets that worker's answer


def test_the_simulated_cache_aware_decides_as_the_real_router():
    replay = leval_replay(100, seed=1)
    real = RealRun(*replay_sglang(replay.prompts(), 2, SGLANG_DEFAULT, concurrency=8, seed=1))
    assert len(real.chosen) == 100 and set(real.chosen) == {0, 1}
    row = compare(replay, real, lambda: make_router("sglang-cache-aware", **SGLANG_DEFAULT))
    assert row["identical"] >= TARGET, row
