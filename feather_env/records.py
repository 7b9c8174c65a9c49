"""The records of the serving loop: plain data the engines, the environment and the evaluation pass around.

- :class:`RequestTimeline`: one request's life on one clock (arrival, first scheduled, first token,
  finish, tokens, prefix hit), from which every ``vllm bench serve`` figure is computed
  (:mod:`feather_env.serving_metrics`);
- :class:`Advance`: what one advance of an engine cost (the environment's rewards come from it);
- :class:`StepRequest` and :class:`MeasuredStep`: a measured engine step, as the step-time model
  is fitted on it (:mod:`feather_env.step_model`, :mod:`feather_env.calibrate`);
- :class:`StepSample`: an engine step of an in-process evaluation run (its timeline plots);
- :class:`Run`: one served episode of an evaluation, its timelines and what else was measured
  (:mod:`feather_env.evaluation`'s tables and plots read it).

The simulator's own step records (``StepResult``, ``ScheduledEntry``) mirror vLLM's scheduler
output and live with the simulator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Advance", "MeasuredStep", "RequestTimeline", "Run", "StepRequest", "StepSample"]


@dataclass
class RequestTimeline:
    """One request's life on one clock (seconds; NaN where it never happened)."""

    request_id: str
    prompt_len: int
    output_len: int
    arrival: float
    first_scheduled: float = math.nan
    first_token: float = math.nan
    finish: float = math.nan
    tokens: int = 0
    prefix_hit_tokens: int = 0
    finished_count: int = 0
    source: str = ""
    #: Seconds between successive outputs after the first (one per output that carried tokens).
    itl: list[float] = field(default_factory=list)
    #: When the latest output came (NaN before the first).
    last_output: float = math.nan
    #: What became of it when it was not served: ``"rejected"`` at arrival or ``"aborted"`` before
    #: its first token by the admission rule (:mod:`scheduler_runtime.admission`); "" otherwise.
    outcome: str = ""
    #: Why (the rule's reason: ``slo``, ``queued-tokens``, ``never-fits``, ``deadline``, ...).
    reason: str = ""

    @property
    def completed(self) -> bool:
        return self.finished_count == 1 and self.tokens == self.output_len and not self.outcome

    @property
    def shed(self) -> bool:
        """Rejected or aborted by the admission rule, with nothing served (a clear answer, not a failure)."""
        return self.outcome in ("rejected", "aborted") and self.finished_count == 0

    @property
    def e2el(self) -> float:
        return self.finish - self.arrival

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float:
        """Seconds per output token after the first (0 for a request of one token, as vLLM)."""
        if self.tokens <= 1:
            return 0.0
        return (self.finish - self.first_token) / (self.tokens - 1)

@dataclass
class Advance:
    """What one :meth:`ServingBackend.advance` cost.

    Attributes:
        seconds: clock time that passed (engine steps, and an idle jump to the next arrival).
        request_seconds: requests in the system (arrived, not finished) x seconds, summed.
        decode_tokens, decode_seconds: tokens and time of the steps that only decoded.
        steps: engine steps taken.
        finished: requests that finished (external ids).
    """

    seconds: float = 0.0
    request_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    steps: int = 0
    finished: list[str] = field(default_factory=list)

@dataclass(frozen=True)
class StepRequest:
    """One scheduled request of a step, as the step model sees it.

    Attributes:
        num_tokens: tokens computed this step (1 for a decode).
        num_computed: tokens already in its KV cache before this step.
        group: its first KV block (requests with the same first block share their prefix).
        shared_tokens: tokens of its prompt that came from the prefix cache (whole blocks).
        is_prefill: computing prompt tokens (or a resumed request's) rather than one decode token.
    """

    num_tokens: int
    num_computed: int
    group: int
    shared_tokens: int
    is_prefill: bool

@dataclass
class MeasuredStep:
    """One engine step as the calibration sees it: its requests in batch order, its time, and the
    requests waiting when it started (the scheduler's queue, which the step model does not price)."""

    batch: list[StepRequest]
    seconds: float
    waiting: int = 0

@dataclass
class StepSample:
    """One engine step of an in-process run: when it started (run clock), how long, what ran."""

    start: float
    seconds: float
    running: int
    scheduled: int
    decode_only: bool


@dataclass
class Run:
    """One served episode and what was measured beside the request timelines.

    Attributes:
        label: the run's name in tables and plots.
        kind: ``"in-process"``, ``"endpoint"`` or ``"simulator"`` (:mod:`feather_env.evaluation.report`).
        timelines: every request of the episode (failed ones included).
        duration: the run's duration when it is not first arrival -> last completion (endpoint).
        extra: figures only this kind of run measures (flat numbers, or small mappings).
        steps: in-process engine steps (plots).
        errors: request id -> why it failed (endpoint).
    """

    label: str
    kind: str
    timelines: list[RequestTimeline]
    duration: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    steps: list[StepSample] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
