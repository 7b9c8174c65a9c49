"""benchmarks/evaluation.py's makespan bound: each distinct prefix prefilled once, decode at a rate."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.evaluation import add_episode_bound, makespan_bound, prefix_work
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
    isolated = {"prompt_lens": [10 * BLOCK], "ttft_s": [1.0]}  # linear: 1 s per 160 tokens
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
