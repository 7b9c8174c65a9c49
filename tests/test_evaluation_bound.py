"""The evaluation's bounds: each distinct prefix prefilled once, decode at a rate, and no request
served before it arrives."""

from __future__ import annotations

import numpy as np
import pytest

from feather_env.evaluation.bound import (
    add_arrival_bound,
    add_episode_bound,
    arrival_bound,
    makespan_bound,
    prefix_work,
)
from feather_env.workloads.request import Request

BLOCK = 16


def _request(rid: str, tokens: list[int], output: int, arrival: float = 0.0) -> Request:
    return Request(rid, np.array(tokens, dtype=np.int32), 0, output, arrival)


def test_a_prompt_is_charged_only_past_the_whole_blocks_an_earlier_prompt_holds() -> None:
    doc = list(range(100, 100 + 3 * BLOCK + 5))  # 3 whole blocks and 5 tokens
    first = _request("a", doc + [1, 2], 4)
    second = _request("b", doc + [7, 8, 9], 4, arrival=1.0)
    other = _request("c", list(range(900, 900 + 2 * BLOCK)), 4, arrival=2.0)
    work = prefix_work([second, other, first], BLOCK)  # read in arrival order
    assert work == [(len(doc) + 2, 0), (len(doc) + 3, 3 * BLOCK), (2 * BLOCK, 0)]
    # a prompt held whole still computes its last token
    again = _request("d", list(range(900, 900 + 2 * BLOCK)), 4, arrival=3.0)
    assert prefix_work([other, again], BLOCK)[1] == (2 * BLOCK, 2 * BLOCK - 1)


def test_bound_is_prefill_of_the_distinct_tokens_plus_decode_at_the_rate() -> None:
    doc = list(range(100, 100 + 4 * BLOCK))
    reqs = [_request("a", doc + [1], 10), _request("b", doc + [2], 30)]
    # linear: 1 s per 160 tokens
    isolated = {"prompt_lens": [10 * BLOCK], "ttft_s": [1.0], "tpot_s": [0.01]}
    bound = makespan_bound(reqs, BLOCK, isolated, decode_rate=20.0)
    assert bound["prefill_s"] == pytest.approx((4 * BLOCK + 1 + 1) / (10 * BLOCK))
    assert bound["decode_s"] == pytest.approx(40 / 20.0)
    assert bound["output_tokens"] == 40
    assert bound["makespan_s"] == pytest.approx(bound["prefill_s"] + bound["decode_s"])
    assert bound["hit_rate_ceiling"] == pytest.approx(1 - (4 * BLOCK + 2) / (2 * (4 * BLOCK + 1)))
    late = makespan_bound([*reqs, _request("c", [5], 1, arrival=100.0)], BLOCK, isolated, 20.0)
    assert late["makespan_s"] == 100.0  # the last arrival when it comes later


def test_episode_bound_decodes_at_the_best_rate_any_run_reached() -> None:
    bound = {"prefill_s": 2.0, "decode_s": 1.0, "decode_rate_tok_s": 400.0, "output_tokens": 400,
             "last_arrival_s": 0.0}
    payload = {"bound": bound, "runs": {
        "a": {"duration": 10.0, "repeats": {"decode_tok_s": [80.0, 100.0]}},
        "b": {"duration": 8.0, "decode_tok_s": 50.0},
    }}
    add_episode_bound(payload)
    ep = bound["episode_decode"]
    assert ep["decode_rate_tok_s"] == 100.0
    assert ep["makespan_s"] == pytest.approx(2.0 + 400.0 / 100.0)
    assert payload["runs"]["a"]["vs_bound_episode"] == pytest.approx(0.6)
    assert payload["runs"]["b"]["vs_bound_episode"] == pytest.approx(0.75)


def test_arrival_bound_charges_the_work_that_arrives_after_each_request() -> None:
    # two requests at t = 0 and a late one at t = 10: the late one's own service binds
    per = {"arrival_s": [0.0, 0.0, 10.0], "prefill_s": [1.0, 1.0, 0.5], "output_tokens": [100, 100, 50],
           "alone_decode_s": [4.0, 4.0, 3.0]}
    b = arrival_bound(per, decode_rate=100.0)
    # from t = 0: 2.5 s prefill + 250 tokens / 100 = 5.0; from t = 10: max(0.5 + 0.5, 0.5 + 3.0) = 3.5
    assert b["makespan_s"] == pytest.approx(13.5) and b["binding_request"] == 2 and b["binding"] == "alone"
    # a burst: the serial sum from t = 0 (the episode bound's makespan)
    burst = dict(per, arrival_s=[0.0, 0.0, 0.0])
    assert arrival_bound(burst, 100.0)["makespan_s"] == pytest.approx(2.5 + 2.5)
    # in a payload: each run's share
    payload = {"bound": {"per_request": per}, "runs": {"a": {"duration": 27.0, "decode_tok_s": 100.0}}}
    add_arrival_bound(payload)
    assert payload["runs"]["a"]["vs_bound_arrival"] == pytest.approx(0.5)


def test_makespan_bound_keeps_each_request_for_the_arrival_bound() -> None:
    doc = list(range(100, 100 + 4 * BLOCK))
    reqs = [_request("b", doc + [2], 30, arrival=1.0), _request("a", doc + [1], 10)]
    isolated = {"prompt_lens": [10 * BLOCK], "ttft_s": [1.0], "tpot_s": [0.01]}
    per = makespan_bound(reqs, BLOCK, isolated, decode_rate=20.0)["per_request"]
    assert per["arrival_s"] == [0.0, 1.0] and per["output_tokens"] == [10, 30]
    assert per["alone_decode_s"] == pytest.approx([0.09, 0.29])
    assert per["prefill_s"][1] < per["prefill_s"][0]  # the second holds the document's blocks
