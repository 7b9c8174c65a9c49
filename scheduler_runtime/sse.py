"""Server-sent events of an OpenAI-compatible stream: the one reader of them, and the output tokens a
relayed stream carries.

* :func:`sse_events`: the JSON events of a streamed answer read line by line (aiohttp's
  ``response.content``), as every client of this project reads them (``evaluate.py --endpoint``, the
  serving benchmarks);
* :func:`stream_output_tokens`: the output tokens of a stream a front end relays without parsing it
  (the proxy, the Ray Serve ingress), from its event count and its last bytes.

No HTTP client or server is imported here.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

__all__ = ["SSE_DONE", "sse_events", "stream_output_tokens"]


class _Done:
    """The type of :data:`SSE_DONE`."""

    def __repr__(self) -> str:
        return "SSE_DONE"


#: What :func:`sse_events` yields last for a stream that ended with ``data: [DONE]``.
SSE_DONE: Any = _Done()


async def sse_events(lines: AsyncIterable[bytes]) -> AsyncIterator[Any]:
    """Each ``data:`` line's JSON of an SSE stream given line by line, then :data:`SSE_DONE` if the
    stream ends with ``data: [DONE]`` (nothing is read after it). Blank separator lines, comments and
    other fields are skipped; the space after ``data:`` is optional.

    Raises:
        ValueError: a ``data:`` line that is not JSON (``json.JSONDecodeError``).
    """
    async for raw in lines:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            yield SSE_DONE
            return
        yield json.loads(data)


def stream_output_tokens(events: int, tail: bytes, chat: bool, choices: int = 1) -> int | None:
    """The output tokens of one choice of a streamed answer: the last ``usage`` block's
    ``completion_tokens`` in ``tail`` (the stream's last bytes; there when the client asked
    ``stream_options.include_usage``), else its ``events`` (SSE events, each one engine step of one
    choice: one token) less ``[DONE]`` and, for a chat, the role chunk vLLM sends first. Over
    ``choices`` (the request's ``n``); ``None`` when nothing is left to count."""
    at = tail.rfind(b'"completion_tokens":')
    if at >= 0:
        digits = tail[at + 20:at + 40].lstrip()
        end = 0
        while end < len(digits) and digits[end:end + 1].isdigit():
            end += 1
        if end:
            return max(0, int(digits[:end]) // max(1, choices))
    if tail.rstrip().endswith(b"data: [DONE]"):
        events -= 1
    if chat:
        events -= choices
    tokens = events // max(1, choices)
    return tokens if tokens > 0 else None
