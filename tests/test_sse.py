"""The one SSE reader (``scheduler_runtime/sse.py``) and the clients that read streams with it, against
stand-in workers (no engine)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest

from benchmarks.standin import StandInWorkers
from scheduler_runtime.sse import SSE_DONE, sse_events


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
