"""Server-sent events of an OpenAI-compatible stream: the one reader of them, and the output tokens a
relayed stream carries.

* :func:`sse_events`: the JSON events of a streamed answer read line by line (aiohttp's
  ``response.content``), as every client of this project reads them (``evaluate.py --endpoint``, the
  serving benchmarks);
* :func:`stream_output_tokens`: the output tokens of a stream a front end relays without parsing it
  (the proxy, the Ray Serve ingress), from its event count and its last bytes;
* :func:`stream_queue_seconds`: the wait before its first step that the server reported on the same
  last bytes (vLLM's per-request metrics, ``metrics.queue_time_ms`` of the final usage chunk);
* :func:`ask_usage` and :class:`UsageStrip`: a front end that needs that chunk asks for it in a stream
  whose client did not (``stream_options.include_usage``), and takes it out of what the client gets.

No HTTP client or server is imported here.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import AsyncIterable, AsyncIterator, Mapping
from typing import Any

__all__ = ["DONE_EVENT", "SSE_DONE", "UsageStrip", "ask_usage", "ends_stream", "needs_usage", "sse_events",
           "stream_output_tokens", "stream_queue_seconds"]


class _Done:
    """The type of :data:`SSE_DONE`."""

    def __repr__(self) -> str:
        return "SSE_DONE"


#: What :func:`sse_events` yields last for a stream that ended with ``data: [DONE]``.
SSE_DONE: Any = _Done()

#: The event that ends an OpenAI-style stream, as a server writes it.
DONE_EVENT = "data: [DONE]\n\n"
_DONE_BYTES = DONE_EVENT.encode()


def ends_stream(chunk: str | bytes) -> bool:
    """Whether ``chunk``, the last one written to a client, ends with :data:`DONE_EVENT`: the client then
    has the whole answer (a front end counts it served, even if the client leaves before the end of the
    chunked body, as SSE clients do)."""
    return chunk.endswith(_DONE_BYTES if isinstance(chunk, bytes) else DONE_EVENT)


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


_NUMBER = re.compile(rb"\s*(-?[0-9][0-9.eE+-]*)")


def stream_queue_seconds(tail: bytes) -> float | None:
    """The seconds a streamed request waited at its server before its first scheduled step, as the
    server reported it in ``tail`` (the stream's last bytes): the last ``"queue_time_ms":`` there, vLLM's
    per-request metrics on the final usage chunk (``--enable-per-request-metrics``, with
    ``stream_options.include_usage``). ``None`` where there is none, or it is not a number >= 0."""
    at = tail.rfind(b'"queue_time_ms":')
    if at < 0:
        return None
    match = _NUMBER.match(tail, at + 16)
    if match is None:
        return None
    try:
        seconds = float(match.group(1)) / 1000.0
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


#: What :func:`ask_usage` adds to a request's body.
INCLUDE_USAGE = b'"stream_options":{"include_usage":true}'


def needs_usage(body: Mapping[str, Any]) -> bool:
    """Whether a front end that reads a stream's usage chunk must ask for it in ``body``: a streamed
    request whose client set no ``stream_options`` (one that chose its own is left as it is)."""
    return body.get("stream") is True and "stream_options" not in body


def ask_usage(raw: bytes, body: Mapping[str, Any]) -> bytes | None:
    """``raw``, the JSON object ``body`` of a streamed request whose client set no ``stream_options``,
    asking for the stream's final usage chunk (:data:`INCLUDE_USAGE` added as its last member), for a front
    end that reads it and strips it again (:class:`UsageStrip`); ``None`` where the body is left as it is
    (not a stream, or its client chose its own stream options)."""
    if not needs_usage(body):
        return None
    end = raw.rstrip().rfind(b"}")
    if end < 0 or not raw[:end].strip(b" \t\r\n{"):
        return None
    return raw[:end] + b"," + INCLUDE_USAGE + raw[end:]


def _is_usage(event: bytes) -> bool:
    """Whether an SSE event is a stream's usage chunk: its JSON has a ``usage`` and no choices."""
    data = event.strip()
    if not data.startswith(b"data:") or b'"usage"' not in data:
        return False
    try:
        payload = json.loads(data[5:])
    except ValueError:
        return False
    return isinstance(payload, dict) and "usage" in payload and payload.get("choices") == []


class UsageStrip:
    """What the client of a relayed stream gets where the front end asked for the usage chunk itself
    (:func:`ask_usage`): the stream's events as they come, whole (a partial event waits for the rest), less
    the usage chunk. :meth:`flush` at the end gives back what is left of a cut-off event."""

    def __init__(self) -> None:
        self._rest = b""
        #: usage chunks taken out
        self.dropped = 0

    def feed(self, chunk: bytes) -> bytes:
        """The complete events of what came so far and ``chunk``, the usage chunk left out."""
        data = self._rest + chunk if self._rest else chunk
        cut = data.rfind(b"\n\n")
        if cut < 0:
            self._rest = data
            return b""
        whole, self._rest = data[:cut + 2], data[cut + 2:]
        if b'"usage"' not in whole:
            return whole
        events = whole[:-2].split(b"\n\n")
        kept = [e for e in events if not _is_usage(e)]
        self.dropped += len(events) - len(kept)
        return b"".join(e + b"\n\n" for e in kept)

    def flush(self) -> bytes:
        """What came after the last complete event."""
        rest, self._rest = self._rest, b""
        return rest
