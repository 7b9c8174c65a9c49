"""The one SSE reader (``scheduler_runtime/sse.py``) and the clients that read streams with it, against
stand-in workers (no engine)."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.standin import StandInWorkers
from scheduler_runtime.sse import SSE_DONE, UsageStrip, ask_usage, sse_events, stream_queue_seconds


async def _lines(chunks: Sequence[bytes]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk


def _read(chunks: Sequence[bytes]) -> list[Any]:
    async def main() -> list[Any]:
        return [e async for e in sse_events(_lines(chunks))]

    return asyncio.run(main())


def test_events_are_read_until_done():
    got = _read([b": a comment\n", b'data: {"a": 1}\n', b"\n", b"event: x\n", b'data:{"b": 2}\r\n', b"\n",
                 b"data: [DONE]\n", b'data: {"after": 1}\n'])
    assert got == [{"a": 1}, {"b": 2}, SSE_DONE]  # nothing after [DONE]
    assert _read([b'data: {"a": 1}\n']) == [{"a": 1}]  # a stream cut short: no SSE_DONE
    with pytest.raises(ValueError):
        _read([b"data: {not json\n"])


def test_the_clients_read_a_stand_ins_stream():
    """``evaluate.py --endpoint``'s sender, the fault benchmark's and the loopback benchmark's driver read
    the same stream: its tokens, its first token, its end."""
    import aiohttp

    from benchmarks.cluster_faults import OUTPUT_TOKENS, stream_one
    from benchmarks.frontend_loopback import drive
    from feather_env.evaluation.endpoint import EndpointConfig, _send
    from feather_env.workloads import Request

    with StandInWorkers(1) as workers:
        url = workers.urls[0]

        async def main() -> tuple[Any, Any, Any]:
            async with aiohttp.ClientSession() as session:
                request = Request("r0", [5] * 40, prefix_group=0, output_len=6)
                t0 = time.perf_counter()
                sent = await _send(session, url + "/v1/completions", request, EndpointConfig(url=url), "m",
                                   t0, None, {})
                faults = await stream_one(session, url, [5] * 40)
            return sent, faults, await drive(url, [("a prompt", 5), ("another", 3)])

        (timeline, _, error), faults, driven = asyncio.run(main())
    assert error is None and timeline.tokens == 6 and len(timeline.itl) == 5
    assert timeline.first_token <= timeline.finish
    assert faults["outcome"] == "completed" and faults["tokens"] == OUTPUT_TOKENS
    assert driven["completed"] == 2 and driven["output_tokens"] == 8
    assert json.loads(json.dumps(driven))  # plain figures


# ------------------------------------------------------------------ the usage a front end asks for itself

_TOKEN = b'data: {"id":"c","choices":[{"index":0,"text":"x \\"usage\\": []"}]}\n\n'
_USAGE = (b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":3},'
          b'"metrics":{"queue_time_ms":12.5,"time_to_first_token_ms":80.0}}\n\n')
_STREAM = _TOKEN * 3 + _USAGE + b"data: [DONE]\n\n"


@settings(max_examples=80, deadline=None)
@given(cuts=st.lists(st.integers(0, len(_STREAM)), max_size=12))
def test_the_usage_chunk_is_taken_out_however_the_stream_is_cut(cuts):
    """A stream cut into chunks anywhere: the client gets every other event whole and in order, the
    usage chunk alone is dropped (a token whose text quotes "usage" is not it), and nothing is left over."""
    bounds = [0, *sorted(cuts), len(_STREAM)]
    strip = UsageStrip()
    out = b"".join(strip.feed(_STREAM[a:b]) for a, b in itertools.pairwise(bounds)) + strip.flush()
    assert out == _TOKEN * 3 + b"data: [DONE]\n\n"
    assert strip.dropped == 1


def test_a_cut_off_stream_keeps_its_last_partial_event():
    strip = UsageStrip()
    assert strip.feed(_TOKEN + _TOKEN[:20]) == _TOKEN
    assert strip.flush() == _TOKEN[:20] and strip.flush() == b""


def test_the_reported_wait_is_read_from_the_last_bytes():
    assert stream_queue_seconds(_STREAM) == pytest.approx(0.0125)
    assert stream_queue_seconds(_TOKEN * 3 + b"data: [DONE]\n\n") is None  # not asked, or not reported
    assert stream_queue_seconds(b'"queue_time_ms": 1.5e3}') == pytest.approx(1.5)
    for bad in (b'"queue_time_ms":null}', b'"queue_time_ms":-4}', b'"queue_time_ms":"7"}',
                b'"queue_time_ms":1e999}', b'"queue_time_ms":1.2.3}'):
        assert stream_queue_seconds(bad) is None


def test_usage_is_asked_only_of_a_stream_whose_client_chose_no_stream_options():
    chat = {"stream": True, "messages": [{"role": "user", "content": "}"}]}
    for body in ({"prompt": "hi", "stream": True}, chat):
        raw = json.dumps(body).encode() + b" \n"
        asked = ask_usage(raw, body)
        assert asked is not None and json.loads(asked) == {**body, "stream_options": {"include_usage": True}}
    for body in ({"prompt": "hi"}, {"prompt": "hi", "stream": False}, {"prompt": "hi", "stream": "yes"},
                 {"prompt": "hi", "stream": True, "stream_options": {"include_usage": False}},
                 {"prompt": "hi", "stream": True, "stream_options": None}):
        assert ask_usage(json.dumps(body).encode(), body) is None


def test_a_stream_ends_with_its_done_event_whether_bytes_or_text():
    from scheduler_runtime.serving.admission_http import sse_error
    from scheduler_runtime.sse import DONE_EVENT, ends_stream

    assert DONE_EVENT == "data: [DONE]\n\n"
    for last in ('data: {"choices":[]}\n\n' + DONE_EVENT, sse_error({"error": {"message": "x"}})):
        assert ends_stream(last) and ends_stream(last.encode())
    for cut in ("data: [DONE]\n", 'data: {"choices":[]}\n\n', ""):
        assert not ends_stream(cut) and not ends_stream(cut.encode())
