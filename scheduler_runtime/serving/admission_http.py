"""Admission past capacity in the HTTP front end: an ASGI middleware of vLLM's API server that admits,
rejects or aborts each completion request by a rule of :mod:`scheduler_runtime.admission`.

``feather-serve --admission slo --slo "ttft:2000 tpot:100"`` computes :class:`AdmissionSettings` from its
options and the engine's arguments (token budget, batch size, KV cache, block size, the tokenizer, and
the step-time model of ``--admission-profile``, by default the shipped profile of this kind of machine),
puts them in the environment variable :data:`ENV_VAR` (JSON) and starts vLLM's server with
``--middleware scheduler_runtime.serving.admission_http.AdmissionMiddleware``, which reads them back in
the API-server process. For ``POST /v1/completions`` and ``POST /v1/chat/completions`` the middleware,
before any byte of the response:

* reads the body and tokenizes the prompt with the served model's tokenizer (a completion's text
  prompt as vLLM does, with the special tokens, or its token ids as they are; a batch of prompts counts
  as one request of all their tokens, keyed by the first prompt's blocks; chat messages rendered with
  the tokenizer's chat template when it has one, else *approximated* by encoding their concatenated
  text contents), hashes its blocks of the engine's block size, and asks its
  :class:`~scheduler_runtime.admission.AdmissionController`;
* rejects with HTTP 503 (or ``--admission-status 429``), ``Retry-After: SECONDS`` and an OpenAI-style
  body of type ``overloaded`` saying why; a request that can never meet its SLOs gets
  ``x-should-retry: false`` and no ``Retry-After``; both carry ``x-feather-admission: REASON``, which
  the proxy of ``--replicas N`` reads to answer it as a shed (with ``--reroute-shed``: to try another
  replica);
* lets a client tighten (never loosen) the SLOs of its request with ``x-slo-ttft-ms`` /
  ``x-slo-tpot-ms`` (a malformed value is an HTTP 400);
* tracks each admitted request: its first body chunk sent is its first token (``started``; for a
  non-streaming request that is its whole answer, so its TTFT as the rule sees it is its latency),
  its response's end, its client's disconnect or an error is its end (``finished``);
* under the ``deadline`` rule, aborts a request that has sent nothing yet once it can no longer meet
  its TTFT: the downstream call is cancelled (vLLM aborts the request in the engine, as for a client
  that disconnects), and the client gets an SSE event ``data: {"error": {... "type": "deadline"}}``
  then ``data: [DONE]`` (a streaming request) or an HTTP 504 with that body.

Everything else (``/health``, ``/metrics``, other paths, a body that is not JSON or holds no prompt)
passes through untouched. The counters ``feather_admission_*`` (:class:`~scheduler_runtime.serving.metrics.
AdmissionMetrics`) show on the server's ``/metrics``. This module imports neither vLLM nor an HTTP
framework: it is plain ASGI, testable with a fake application.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from scheduler_runtime.admission import (
    AdmissionController,
    AdmissionRule,
    Decision,
    StepTimeModel,
    prompt_block_hashes,
)
from scheduler_runtime.config import ConfigError
from scheduler_runtime.serving.cluster_base import error_body, flag_value, replica_kv_tokens
from scheduler_runtime.sse import DONE_EVENT

__all__ = ["ADMISSION_HEADER", "ADMISSION_PATHS", "DEFAULT_PROFILE", "ENV_VAR", "SLO_HEADERS", "TPOT_HEADER",
           "TTFT_HEADER", "WATCH_PERIOD_S", "AdmissionGate", "AdmissionMiddleware", "AdmissionSettings",
           "DeadlineAborted", "deadline_error", "load_tokenizer", "prompt_tokens", "rejection_response",
           "request_slos", "sse_error"]

#: The environment variable that carries :class:`AdmissionSettings` (JSON) to the API-server process.
ENV_VAR = "FEATHER_ADMISSION"
#: The paths whose requests are admitted or rejected (POST).
ADMISSION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
#: Request headers that tighten the request's SLOs (milliseconds): header -> SLO name.
TTFT_HEADER, TPOT_HEADER = "x-slo-ttft-ms", "x-slo-tpot-ms"
SLO_HEADERS = {TTFT_HEADER: "ttft", TPOT_HEADER: "tpot"}
#: The response header of a rejection, naming its reason (the proxy reads it).
ADMISSION_HEADER = "x-feather-admission"
#: The shipped step-time profile used where none was measured on this kind of machine (the rule
#: predicts with :func:`scheduler_runtime.hardware.machine_profile`'s unless a profile is named).
DEFAULT_PROFILE = Path(__file__).resolve().parents[2] / "configs" / "profiles" / "cpu-tiny-llama.json"
#: vLLM's defaults of its OpenAI server on CPU, where the command line does not say.
VLLM_CPU_SERVER_BUDGET, VLLM_CPU_SERVER_MAX_SEQS = 2048, 128
#: Seconds between two checks of the deadline rule while requests wait.
WATCH_PERIOD_S = 0.05
#: The HTTP status of a request aborted by the deadline rule (not streaming).
DEADLINE_STATUS = 504

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]
ASGIApp = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]


# ------------------------------------------------------------------------------------ settings


@dataclass(frozen=True)
class AdmissionSettings:
    """What the middleware needs, computed by ``feather-serve`` (:meth:`for_server`) and passed in
    :data:`ENV_VAR` (:meth:`to_json`, :meth:`from_env`).

    Attributes:
        rule: the rule's text (``"slo:0.5+deadline"``).
        slos: the SLOs in milliseconds (``--slo``).
        status: the HTTP status of a rejection (503 or 429).
        tokenizer: the served model's tokenizer (a directory or a hub name).
        block_size, token_budget, max_num_seqs, kv_capacity_tokens: the engine's, as its arguments say.
        step_model: the profile's ``step_model`` mapping (:meth:`StepTimeModel.from_profile`).
    """

    rule: str
    slos: dict[str, float]
    status: int = 503
    tokenizer: str = ""
    block_size: int = 16
    token_budget: int = VLLM_CPU_SERVER_BUDGET
    max_num_seqs: int = VLLM_CPU_SERVER_MAX_SEQS
    kv_capacity_tokens: int = 1 << 20
    step_model: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def for_server(cls, rule: str, slos: Mapping[str, float], status: int, vllm_args: Sequence[str],
                   token_budget: int | None = None, profile: str | Path | None = None) -> AdmissionSettings:
        """The settings of a server started with ``vllm_args`` (``feather-serve``'s, completed).

        ``token_budget``: the scheduler name's ``@TOKENS`` (else ``--max-num-batched-tokens``, else
        vLLM's CPU server default). ``profile``: the step-time profile whose ``step_model`` the rule
        predicts with (``feather-serve --admission-profile``; ``None``: the shipped profile of this
        kind of machine, :func:`scheduler_runtime.hardware.machine_profile`).

        Raises:
            ConfigError: a bad rule, SLOs the rule cannot use, bad engine figures, or a profile without
                a step model.
        """
        if profile is None:
            from scheduler_runtime.hardware import machine_profile

            profile = machine_profile()
        try:
            data = json.loads(Path(profile).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"the admission profile {profile} cannot be read: {exc}") from None
        step_model = data.get("step_model") if isinstance(data, dict) else None
        if not isinstance(step_model, dict):
            raise ConfigError(f"the admission profile {profile} has no step_model")
        try:
            StepTimeModel.from_profile(step_model)
        except ConfigError as exc:
            raise ConfigError(f"the admission profile {profile}: {exc}") from None
        base = cls(rule=str(AdmissionRule.parse(rule)), slos=dict(slos), status=int(status),
                   step_model=step_model)
        return base.for_engine(vllm_args, token_budget)

    def for_engine(self, vllm_args: Sequence[str], token_budget: int | None = None) -> AdmissionSettings:
        """These settings (rule, SLOs, status, step model) with the engine figures of a server started
        with ``vllm_args``: its tokenizer, block size, token budget, ``--max-num-seqs`` and KV cache in
        tokens (:func:`~scheduler_runtime.serving.cluster_base.replica_kv_tokens`; ``1 << 20`` where the
        arguments do not say). What :meth:`for_server` computes, and each replica of ``feather-serve
        --replicas N --replica-args 'K: ARGS'`` from its own arguments
        (:meth:`~scheduler_runtime.serving.cluster_base.ClusterConfig.replica_admission`).

        ``token_budget``: as :meth:`for_server`'s.

        Raises:
            ConfigError: an engine argument that is not an integer, or figures the rule cannot use.
        """
        try:
            budget = token_budget or int(flag_value(vllm_args, "--max-num-batched-tokens",
                                                    str(VLLM_CPU_SERVER_BUDGET)))
            seqs = int(flag_value(vllm_args, "--max-num-seqs", str(VLLM_CPU_SERVER_MAX_SEQS)))
            block = int(flag_value(vllm_args, "--block-size", "16"))
        except ValueError as exc:
            raise ConfigError(f"admission: an engine argument is not an integer: {exc}") from None
        model = flag_value(vllm_args, "--model", "")
        settings = replace(self, tokenizer=flag_value(vllm_args, "--tokenizer", model), block_size=block,
                           token_budget=budget, max_num_seqs=seqs,
                           kv_capacity_tokens=replica_kv_tokens(vllm_args) or 1 << 20)
        settings.controller()  # checked as the server will build it
        return settings

    def controller(self) -> AdmissionController:
        """A fresh controller of these settings."""
        return AdmissionController(self.rule, self.slos, model=StepTimeModel.from_profile(self.step_model),
                                   token_budget=self.token_budget, max_num_seqs=self.max_num_seqs,
                                   kv_capacity_tokens=self.kv_capacity_tokens, block_size=self.block_size)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> AdmissionSettings | None:
        """The settings in :data:`ENV_VAR` (``None`` when it is not set).

        Raises:
            ConfigError: it is set to something else than :meth:`to_json`'s output.
        """
        text = (os.environ if environ is None else environ).get(ENV_VAR)
        if not text:
            return None
        try:
            return cls(**json.loads(text))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{ENV_VAR} does not hold admission settings: {exc}") from None


# ------------------------------------------------------------------------------------ requests


def request_slos(headers: Mapping[str, str]) -> dict[str, float]:
    """The SLOs a request's ``x-slo-*-ms`` headers ask for (milliseconds; lower-case header names).

    Raises:
        ValueError: a value that is not a finite number of milliseconds >= 0, naming the header.
    """
    out = {}
    for header, name in SLO_HEADERS.items():
        text = headers.get(header)
        if text is None:
            continue
        try:
            ms = float(text)
        except ValueError:
            ms = math.nan
        if not (ms >= 0 and math.isfinite(ms)):
            raise ValueError(f"header {header} must be a finite number of milliseconds >= 0, got {text!r}")
        out[name] = ms
    return out


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)


def _chat_text(messages: Sequence[Any]) -> str | None:
    parts = []
    for m in messages:
        if not isinstance(m, Mapping):
            return None
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, Mapping)
                              and isinstance(p.get("text", ""), str))
        if isinstance(content, str):
            parts.append(content)
    return "\n".join(parts)


def prompt_tokens(body: Mapping[str, Any], chat: bool, tokenizer: Any) -> list[list[int]] | None:
    """The token ids of the request's prompts as the engine will see them (module docstring; one
    prompt but for a completion's batch), ``None`` when the body holds no prompt the rule can read
    (vLLM then answers it, an error most likely)."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        if getattr(tokenizer, "chat_template", None):
            try:
                ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
            except Exception:  # noqa: BLE001 - vLLM reports a message its template cannot render
                ids = None
            if isinstance(ids, Mapping) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            if _is_token_list(ids):
                return [list(ids)]
        text = _chat_text(messages)  # no template: the contents' tokens, an approximation
        return None if text is None else [list(tokenizer.encode(text))]
    prompt = body.get("prompt")
    special = body.get("add_special_tokens", True) is not False
    prompts = prompt if isinstance(prompt, list) and prompt and not _is_token_list(prompt) else [prompt]
    out = []
    for p in prompts:
        if isinstance(p, str):
            out.append(list(tokenizer.encode(p, add_special_tokens=special)))
        elif _is_token_list(p):
            out.append(list(p))
        else:
            return None
    return out


def rejection_response(decision: Decision, status: int) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """``(status, headers, body)`` of a rejected request (module docstring)."""
    if decision.retry:
        message = (f"the server is over capacity: {decision.message} (reason: {decision.reason}); retry "
                   f"after {decision.retry_after_s} s")
        headers = [(b"retry-after", str(decision.retry_after_s).encode())]
    else:
        message = f"this request cannot be served: {decision.message} (reason: {decision.reason})"
        headers = [(b"x-should-retry", b"false")]
    headers += [(ADMISSION_HEADER.encode(), decision.reason.encode())]
    return status, headers, json.dumps(error_body(message, status, "overloaded")).encode()


def load_tokenizer(name: str) -> Any:
    """The served model's tokenizer (``transformers.AutoTokenizer``, as vLLM loads it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


# ------------------------------------------------------------------------------------ the middleware


class _Flight:
    """One admitted request in flight."""

    __slots__ = ("aborted", "start", "started", "stream", "task")

    def __init__(self, stream: bool) -> None:
        self.stream = stream
        self.started = False
        self.aborted = False
        self.start: dict | None = None  # the held http.response.start
        self.task: asyncio.Future | None = None


async def _send_json(send: Send, status: int, body: bytes,
                     headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def deadline_error() -> dict[str, Any]:
    """The error body of a request aborted by the deadline rule (an HTTP 504's, or an SSE event's)."""
    message = ("the request was aborted before its first token: it could no longer meet its "
               "time-to-first-token SLO (admission rule 'deadline')")
    return error_body(message, DEADLINE_STATUS, "deadline")


def sse_error(error: Mapping[str, Any]) -> str:
    """A stream's end on an error: the SSE event ``data: {"error": ...}`` then ``data: [DONE]``."""
    return f"data: {json.dumps(error)}\n\n{DONE_EVENT}"


class DeadlineAborted(Exception):
    """The deadline rule aborted the request (:meth:`AdmissionGate.run`)."""


class AdmissionGate:
    """One engine's admission in a front end: its controller, the requests it admitted in flight, and
    the deadline rule's watcher, which cancels the awaited call of a request that can no longer meet
    its TTFT. The ASGI middleware is one; the Ray Serve engine replica holds one.

    Args:
        settings: the settings (``None``: from :data:`ENV_VAR`, which must then be set).
        clock: seconds, monotonic (tests pass a fake one).

    Raises:
        ConfigError: no settings.
    """

    def __init__(self, settings: AdmissionSettings | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        from scheduler_runtime.serving.metrics import AdmissionMetrics

        settings = settings or AdmissionSettings.from_env()
        if settings is None:
            raise ConfigError(f"admission needs its settings in {ENV_VAR}: start the server with "
                              "feather-serve --admission RULE")
        self.settings = settings
        self.controller = settings.controller()
        self.clock = clock
        self.metrics = AdmissionMetrics()
        self._flights: dict[str, _Flight] = {}
        self._ids = itertools.count()
        self._watcher: asyncio.Task | None = None

    def admit(self, prompts: Sequence[Sequence[int]], slos: Mapping[str, float]) -> tuple[str, Decision]:
        """Offer a request of these prompts' token ids (keyed by the first's blocks) with its own SLOs
        (:func:`request_slos`): its id in this gate and the decision."""
        rid = f"admission-{next(self._ids)}"
        hashes = prompt_block_hashes(prompts[0], self.settings.block_size)
        decision = self.controller.offer(rid, sum(map(len, prompts)), hashes, self.clock(),
                                         ttft_ms=slos.get("ttft"), tpot_ms=slos.get("tpot"))
        self.metrics.push(self.controller.stats)
        return rid, decision

    def begin(self, rid: str, stream: bool) -> _Flight:
        """An admitted request starts downstream; the gate holds its flight until :meth:`end`."""
        flight = self._flights[rid] = _Flight(stream)
        return flight

    async def run(self, rid: str, call: Awaitable[Any]) -> Any:
        """Await ``call`` as a task the deadline rule may cancel while request ``rid`` has sent nothing.

        Raises:
            DeadlineAborted: the rule cancelled it.
        """
        flight = self._flights[rid]
        flight.task = asyncio.ensure_future(call)
        if self.controller.rule.deadline and self._watcher is None:
            self._watcher = asyncio.ensure_future(self._watch())
        try:
            result = await flight.task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if not flight.aborted or (current is not None and current.cancelling()):
                raise
            raise DeadlineAborted from None
        if flight.aborted:  # the call swallowed its cancellation: what it sent was held back
            raise DeadlineAborted
        return result

    def first_byte(self, rid: str) -> None:
        """The request's first byte goes out: its first token (a stream's), or its whole answer."""
        flight = self._flights[rid]
        if flight.started:
            return
        flight.started = True
        # a whole answer's latency is not a TTFT: only a stream's first byte times the pace
        self.controller.started(rid, self.clock(), timed=flight.stream)
        self.metrics.push(self.controller.stats)

    def end(self, rid: str) -> None:
        """The request left (answered, aborted, failed, or its client went away)."""
        flight = self._flights.pop(rid)
        if flight.task is not None and not flight.task.done():
            flight.task.cancel()
        self.controller.finished(rid, aborted=flight.aborted, now=self.clock())
        self.metrics.push(self.controller.stats)

    def check_deadlines(self) -> list[str]:
        """Abort the waiting requests the deadline rule names now (their downstream calls are
        cancelled; each answers its client); returns their ids."""
        out = []
        for rid in self.controller.overdue(self.clock()):
            flight = self._flights.get(rid)
            if flight is None or flight.started or flight.aborted or flight.task is None:
                continue
            flight.aborted = True
            flight.task.cancel()
            out.append(rid)
        return out

    async def _watch(self) -> None:
        """While requests wait, :meth:`check_deadlines` every :data:`WATCH_PERIOD_S`."""
        try:
            while self.controller.num_queued:
                self.check_deadlines()
                await asyncio.sleep(WATCH_PERIOD_S)
        finally:
            self._watcher = None


class AdmissionMiddleware(AdmissionGate):
    """The ASGI middleware (module docstring); vLLM builds it as ``AdmissionMiddleware(app)``.

    Args:
        app: the application it fronts.
        settings: the settings (``None``: from :data:`ENV_VAR`, which must then be set).
        tokenizer: the tokenizer (``None``: :func:`load_tokenizer` of the settings' tokenizer).
        clock: seconds, monotonic (tests pass a fake one).

    Raises:
        ConfigError: no settings.
    """

    def __init__(self, app: ASGIApp, settings: AdmissionSettings | None = None, *, tokenizer: Any = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(settings, clock=clock)
        self.app = app
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(self.settings.tokenizer)

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        admitted_path = scope.get("method") == "POST" and scope.get("path") in ADMISSION_PATHS
        if scope.get("type") != "http" or not admitted_path:
            await self.app(scope, receive, send)
            return
        raw, disconnected = await _read_body(receive)
        if disconnected:
            return
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive()

        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        try:
            slos = request_slos(headers)
        except ValueError as exc:
            await _send_json(send, 400, json.dumps(error_body(str(exc), 400, "BadRequestError")).encode())
            return
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            body = None
        prompts = prompt_tokens(body, scope["path"].endswith("/chat/completions"), self.tokenizer) \
            if isinstance(body, dict) else None
        if not sum(map(len, prompts or ())):  # nothing the rule can read: vLLM answers it
            await self.app(scope, replay, send)
            return
        assert prompts is not None and isinstance(body, dict)
        rid, decision = self.admit(prompts, slos)
        if not decision.admit:
            status, extra, payload = rejection_response(decision, self.settings.status)
            await _send_json(send, status, payload, extra)
            return
        await self._serve(rid, bool(body.get("stream")), scope, replay, send)

    async def _serve(self, rid: str, stream: bool, scope: MutableMapping[str, Any],
                     receive: Receive, send: Send) -> None:
        """Run the admitted request downstream, tracking its first byte and its end (module docstring)."""
        flight = self.begin(rid, stream)

        async def tracked_send(message: dict) -> None:
            if flight.aborted:  # the deadline rule answered it
                return
            kind = message["type"]
            if kind == "http.response.start":  # held until the first body chunk: nothing sent yet
                flight.start = message
                return
            if kind == "http.response.body" and not flight.started:
                self.first_byte(rid)
                if flight.start is not None:
                    await send(flight.start)
            await send(message)

        try:
            try:
                await self.run(rid, self.app(scope, receive, tracked_send))
            except DeadlineAborted:
                await self._send_deadline(send, flight)
        finally:
            self.end(rid)

    async def _send_deadline(self, send: Send, flight: _Flight) -> None:
        """A request aborted by the deadline rule: its error, as an SSE event or an HTTP 504."""
        error = deadline_error()
        if not flight.stream:
            await _send_json(send, DEADLINE_STATUS, json.dumps(error).encode())
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
        await send({"type": "http.response.body", "more_body": False, "body": sse_error(error).encode()})


async def _read_body(receive: Receive) -> tuple[bytes, bool]:
    """The request's whole body, and whether the client went away meanwhile."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"", True
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks), False
