"""Admission past capacity: serve an arriving request, reject it at once, or abort it before its first token.

Past its capacity an engine that admits everything builds an unbounded queue and serves requests
that are already late. The rules here decide at arrival, before any byte of the response, from
state that the front end (vLLM's API server, the proxy, the environment's serving loop) can keep
by itself:

- ``none``: admit everything (vLLM's default, and Feather's before this module);
- ``queued-reqs:N``: vLLM 0.32's ``--max-num-queued-reqs``, as ``AsyncLLM.check_admission``
  counts it: reject when the unfinished requests (waiting *and* running) plus this one would
  exceed ``N``;
- ``queued-tokens:N``: vLLM 0.32's ``--max-num-queued-tokens``, as it counts it: reject while the
  full prompts of the requests still in their prefill (prefix-cache hits included: vLLM's
  docstring calls the count conservative) reach ``N`` tokens; this request's own prompt is not
  added;
- ``slo[:F]``: ours: reject when the predicted time to first token exceeds ``F`` x the TTFT SLO
  (default :data:`DEFAULT_SLO_FACTOR`). The prediction counts only the prompt tokens that neither
  the prefix cache nor an earlier queued request of the same prefix already holds (a prefix index
  of block hashes, :class:`PrefixEstimate`), priced by the step-time model fitted to the machine
  (:class:`StepTimeModel`) with the running batch's decode steps interleaved, and scaled by the
  engine's measured pace (below);
- ``deadline``: admit, then abort a waiting request once it can no longer meet its TTFT SLO: when
  even its own prefill on an idle engine would end past its deadline (at the latest when the
  deadline passes).
- ``tpot`` (with ``slo``: ``slo+tpot``): also reject while the prefill admitted over the last
  :data:`TPOT_WINDOW_S` seconds would slow the running decodes past the TPOT SLO. A step that carries
  a prefill chunk is slower than a decode step (on a CPU, several times slower): past capacity a queue
  that always holds a prompt makes every step such a step, and the requests already decoding miss
  their TPOT while every first token is on time, which the TTFT rule cannot see. Over a window of
  ``H`` seconds and ``n`` steps, each a decode step ``d`` (the running batch's, by the model) plus its
  prefill's extra time, the mean step ``H / n`` stays within the TPOT SLO while that extra time stays
  within ``H * (1 - d / TPOT)``: the term admits a request while the window's extra time, its own
  included (its prefill's steps by the model, times the pace, less as many decode steps), fits. A
  prefill slows only the requests decoding while it runs, those running and those queued ahead of it
  (decoding by then): with neither it slows nobody, and it is admitted without a charge to the window.

The model is fitted on one engine alone on its machine; served beside other engines, or on a busier
or slower machine, the same steps take longer. The ``slo`` rule therefore corrects its prediction by
the engine's *pace*: the :data:`PACE_QUANTILE` quantile of measured over predicted TTFT among the
last :data:`PACE_WINDOW` admitted requests whose prediction mattered (at least :data:`PACE_MIN_SHARE`
of their TTFT SLO), once :data:`PACE_MIN_SAMPLES` are in, never below 1 (an engine faster than its
model keeps the model's margin) nor above :data:`PACE_MAX`. A request aborted by the deadline rule
counts with the time it waited (a lower bound). The quantile, not the mean: past capacity the rule
fills the queue to its limit, so the requests admitted last sit at the limit, and with a mean pace
half of them would miss it.

Rules combine with ``+`` (``slo:0.8+deadline``). A request that could never meet its SLO (its own
prefill alone on an idle engine takes longer than its TTFT SLO, or one decode step alone longer
than its TPOT SLO) is rejected by every rule but ``none`` and the vLLM caps, as *never fits*:
retrying cannot help (``x-should-retry: false``).

A setting names its rule after ``~``: ``group-cap-8@256~slo:0.5`` is ``group-cap-8`` at a budget
of 256 tokens per step, with the rule ``slo:0.5`` (:func:`split_admission`). The SLOs come as
vLLM's ``--goodput`` pairs (``"ttft:5000 tpot:50"``, milliseconds: :func:`parse_slos`).

The state is :class:`AdmissionController`'s, fed by its owner's events: :meth:`~AdmissionController.offer`
at arrival (which admits or rejects), :meth:`~AdmissionController.started` at the first token,
:meth:`~AdmissionController.finished` when the request leaves (finished or aborted), and
:meth:`~AdmissionController.overdue` for the deadline rule. Engine-free: plain Python.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from scheduler_runtime.config import ConfigError

__all__ = [
    "ADMISSION_KINDS",
    "DEFAULT_SLO_FACTOR",
    "SLO_NAMES",
    "AdmissionController",
    "AdmissionRule",
    "AdmissionStats",
    "Decision",
    "PrefixEstimate",
    "StepTimeModel",
    "attention_work",
    "check_slos",
    "parse_slos",
    "prompt_block_hashes",
    "split_admission",
    "with_admission",
]

#: The SLOs a rule and ``--goodput`` take (vLLM's names), each in milliseconds.
SLO_NAMES = ("ttft", "tpot", "e2el")
#: The rule kinds, in the order the docs list them.
ADMISSION_KINDS = ("none", "queued-reqs", "queued-tokens", "slo", "deadline", "tpot")
#: ``slo`` without a factor: reject when the predicted TTFT exceeds this x the TTFT SLO.
DEFAULT_SLO_FACTOR = 1.0
#: The separator of a setting's admission rule (``NAME~RULE``); ``/`` would clash with ``feather:PATH``.
RULE_SEPARATOR = "~"
#: The pace (module docstring): this quantile of measured over predicted TTFT ...
PACE_QUANTILE = 0.9
#: ... among the last this many admitted requests ...
PACE_WINDOW = 64
#: ... whose predicted TTFT was at least this share of their TTFT SLO, once this many are in ...
PACE_MIN_SHARE = 0.25
PACE_MIN_SAMPLES = 8
#: ... clipped to [1, PACE_MAX].
PACE_MAX = 4.0
#: The ``tpot`` term (module docstring): the window, in seconds, over which it bounds the prefill admitted
#: (the best of 0.5, 2 and 10 s in ``benchmarks.tpot_term``).
TPOT_WINDOW_S = 2.0
#: Reasons a request is refused or aborted (the counters' labels).
REASONS = ("queued-reqs", "queued-tokens", "slo", "tpot", "never-fits", "deadline")


# ---------------------------------------------------------------------------------------- SLOs


def parse_slos(spec: str | Sequence[str] | None) -> dict[str, float]:
    """``"ttft:500 tpot:50"`` (or ``["ttft:500", "tpot:50"]``, vLLM's ``--goodput`` pairs) -> SLOs in ms.

    Raises:
        ValueError: a pair that is not ``NAME:MS``, an unknown name, a repeated name, or a negative
            or non-finite value (vLLM accepts 0).
    """
    if spec is None:
        return {}
    pairs = spec.split() if isinstance(spec, str) else [p for item in spec for p in str(item).split()]
    slos: dict[str, float] = {}
    for pair in pairs:
        name, sep, value = pair.partition(":")
        try:
            ms = float(value) if sep else math.nan
        except ValueError:
            ms = math.nan
        if not sep or math.isnan(ms):
            raise ValueError(f"goodput SLO {pair!r} is not NAME:MILLISECONDS (e.g. ttft:500 tpot:50)")
        if name not in SLO_NAMES:
            raise ValueError(f"unknown goodput SLO {name!r}; valid: {', '.join(SLO_NAMES)} (milliseconds)")
        if name in slos:
            raise ValueError(f"goodput SLO {name!r} is given twice")
        if not (ms >= 0 and math.isfinite(ms)):
            raise ValueError(f"goodput SLO {pair!r}: the value must be a finite number of milliseconds >= 0")
        slos[name] = ms
    return slos


def check_slos(slos: Mapping[str, float]) -> dict[str, float]:
    """``slos`` checked (vLLM's names, finite milliseconds >= 0) and returned as a plain dict.

    Raises:
        ValueError: an unknown SLO name, or a value that is not a number, negative, NaN or infinite.
    """
    unknown = sorted(set(slos) - set(SLO_NAMES))
    if unknown:
        raise ValueError(f"unknown goodput SLO(s) {unknown}; valid: ttft, tpot, e2el (milliseconds)")
    try:
        bad = any(isinstance(v, bool) or not (v >= 0 and math.isfinite(v)) for v in slos.values())
    except TypeError:  # not a number
        bad = True
    if bad:
        raise ValueError(f"goodput SLOs must be finite milliseconds >= 0, got {dict(slos)}")
    return {name: float(ms) for name, ms in slos.items()}


# ---------------------------------------------------------------------------------------- rules


@dataclass(frozen=True)
class AdmissionRule:
    """One admission setting: a ``+``-joined list of rule terms (module docstring).

    Attributes:
        queued_reqs: vLLM's request cap (``None``: none).
        queued_tokens: vLLM's token cap (``None``: none).
        slo_factor: ``slo:F``'s F (``None``: the rule is off).
        deadline: abort waiting requests that can no longer meet their TTFT.
        tpot: also bound the prefill admitted per window so that the decodes keep their TPOT SLO.
    """

    queued_reqs: int | None = None
    queued_tokens: int | None = None
    slo_factor: float | None = None
    deadline: bool = False
    tpot: bool = False

    def __post_init__(self) -> None:
        for name in ("queued_reqs", "queued_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ConfigError(f"admission {name.replace('_', '-')} must be an integer >= 0, "
                                  f"got {value!r}")
        f = self.slo_factor
        if f is not None and (isinstance(f, bool) or not isinstance(f, int | float)
                              or not (0 < f < math.inf)):
            raise ConfigError(f"admission slo factor must be a finite number > 0, got {f!r}")
        if self.tpot and f is None:
            raise ConfigError("admission term 'tpot' is a bound added to the 'slo' rule: give it with slo "
                              "(e.g. slo+tpot)")

    @classmethod
    def parse(cls, text: str | None) -> AdmissionRule:
        """``"none"``, ``"queued-reqs:N"``, ``"queued-tokens:N"``, ``"slo"``, ``"slo:F"``, ``"deadline"``,
        or several joined by ``+`` -> the rule.

        Raises:
            ConfigError: an unknown term, a bad number, or a term given twice.
        """
        if text is None:
            return cls()
        if not isinstance(text, str) or not text.strip():
            raise ConfigError(f"admission rule must be a non-empty string, got {text!r}")
        fields_: dict[str, Any] = {}
        for term in text.strip().split("+"):
            kind, sep, arg = term.partition(":")
            if kind not in ADMISSION_KINDS:
                raise ConfigError(f"unknown admission rule {term!r} in {text!r}; valid: none, queued-reqs:N, "
                                  f"queued-tokens:N, slo[:F], deadline, tpot (with slo; joined by '+')")
            if kind == "none":
                if sep or text.strip() != "none":
                    raise ConfigError(f"admission rule 'none' takes no value and no other term, got {text!r}")
                return cls()
            key = {"queued-reqs": "queued_reqs", "queued-tokens": "queued_tokens", "slo": "slo_factor",
                   "deadline": "deadline", "tpot": "tpot"}[kind]
            if key in fields_:
                raise ConfigError(f"admission rule {text!r} names {kind!r} twice")
            if kind in ("deadline", "tpot"):
                if sep:
                    raise ConfigError(f"admission rule {kind!r} takes no value, got {term!r}")
                fields_[key] = True
            elif kind == "slo":
                fields_[key] = _number(term, arg, float) if sep else DEFAULT_SLO_FACTOR
            else:
                if not sep:
                    raise ConfigError(f"admission rule {kind!r} needs a value: {kind}:N")
                fields_[key] = _number(term, arg, int)
        return cls(**fields_)

    @property
    def is_none(self) -> bool:
        """Admits everything and aborts nothing."""
        return self == AdmissionRule()

    @property
    def needs_slos(self) -> bool:
        """Whether the rule reads the SLOs (``slo``, ``deadline``)."""
        return self.slo_factor is not None or self.deadline

    @property
    def vllm_caps(self) -> dict[str, int]:
        """vLLM's own flags for the cap terms (``{"max_num_queued_reqs": N, ...}``)."""
        out = {}
        if self.queued_reqs is not None:
            out["max_num_queued_reqs"] = self.queued_reqs
        if self.queued_tokens is not None:
            out["max_num_queued_tokens"] = self.queued_tokens
        return out

    def __str__(self) -> str:
        terms = []
        if self.queued_reqs is not None:
            terms.append(f"queued-reqs:{self.queued_reqs}")
        if self.queued_tokens is not None:
            terms.append(f"queued-tokens:{self.queued_tokens}")
        if self.slo_factor is not None:
            terms.append(f"slo:{self.slo_factor:g}")
        if self.deadline:
            terms.append("deadline")
        if self.tpot:
            terms.append("tpot")
        return "+".join(terms) or "none"


def _number(term: str, arg: str, kind: type) -> Any:
    try:
        value = kind(arg)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise ConfigError(f"admission rule {term!r}: {arg!r} is not {what}") from None
    return value


def split_admission(name: str) -> tuple[str, str | None]:
    """``"group-cap-8@256~slo:0.5"`` -> ``("group-cap-8@256", "slo:0.5")``; no rule -> ``(name, None)``.

    The rule is what follows the last ``~`` when it starts with a rule kind, so a policy path with
    a ``~`` in it (``feather:~/p.feather``) is not split.
    """
    idx = name.rfind(RULE_SEPARATOR)
    if idx < 0:
        return name, None
    rule = name[idx + 1:]
    if rule.split("+", 1)[0].split(":", 1)[0] not in ADMISSION_KINDS:
        return name, None
    return name[:idx], rule


def with_admission(name: str, rule: AdmissionRule | str | None) -> str:
    """Setting ``name`` with admission ``rule`` (replacing any it had; ``none``/``None``: without one)."""
    base, _ = split_admission(name)
    text = str(AdmissionRule.parse(rule) if isinstance(rule, str) else (rule or AdmissionRule()))
    return base if text == "none" else f"{base}{RULE_SEPARATOR}{text}"


# ---------------------------------------------------------------------------------------- predictions


@dataclass(frozen=True)
class StepTimeModel:
    """One engine step's seconds, the simulator's step model without its locality term.

    ``t = const + per_request * R + per_token * N + per_decode_kv * D + per_prefill_attn * A`` (R
    scheduled requests, N tokens, D KV tokens the decodes read, A prefill attention work ``sum q *
    (c + (q + 1) / 2)``); ``per_decode_kv`` is the simulator's ``decode_kv`` plus its miss term (a
    decode whose context misses the cache: the pessimistic end). Build it from a profile's
    ``step_model`` with :meth:`from_profile`.
    """

    const: float = 0.005
    per_request: float = 2e-4
    per_token: float = 4e-5
    per_decode_kv: float = 5e-7
    per_prefill_attn: float = 6e-8

    @classmethod
    def from_profile(cls, profile: Mapping[str, Any]) -> StepTimeModel:
        """From a profile JSON's mapping (``{"step_model": {"coef": [...], "features": [...]}}``, or the
        ``step_model`` mapping itself).

        Raises:
            ConfigError: no coefficients of the simulator's six features.
        """
        model = profile.get("step_model", profile)
        try:
            coef = dict(zip(model["features"], model["coef"], strict=True))
            return cls(const=float(coef["const"]), per_request=float(coef["requests"]),
                       per_token=float(coef["tokens"]),
                       per_decode_kv=float(coef["decode_kv"]) + float(coef.get("decode_kv_miss", 0.0)),
                       per_prefill_attn=float(coef["prefill_attn"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"the step model has no coefficients of the simulator's features: {exc!r}"
                              ) from None

    def step(self, requests: float, tokens: float, decode_kv: float = 0.0,
             prefill_attn: float = 0.0) -> float:
        """Seconds of one step."""
        return (self.const + self.per_request * requests + self.per_token * tokens
                + self.per_decode_kv * decode_kv + self.per_prefill_attn * prefill_attn)

    @staticmethod
    def prefill_chunk(budget: int, running: int) -> int:
        """The prompt tokens one step computes beside ``running`` decodes (at least 16)."""
        return max(16, budget - running)

    def prefill_seconds(self, tokens: float, cached: float, budget: int, running: int,
                        running_kv: float, attention: float | None = None) -> float:
        """Seconds to prefill ``tokens`` on top of ``cached`` in chunks of the budget left by ``running``
        decoding requests (reading ``running_kv`` KV tokens), those decodes included.

        ``attention``: the prefill attention work when ``tokens`` are several prompts' (the sum of
        each one's :func:`attention_work`); by default that of one prompt."""
        if tokens <= 0:
            return 0.0
        chunk = self.prefill_chunk(budget, running)
        steps = math.ceil(tokens / chunk)
        per_step = self.step(running + 1, running + min(chunk, tokens), running_kv)
        if attention is None:
            attention = attention_work(tokens, cached)
        return steps * per_step + self.per_prefill_attn * attention


def attention_work(uncached: float, cached: float) -> float:
    """A prompt's prefill attention work, ``q * (c + (q + 1) / 2)`` for ``q`` tokens to compute on top
    of ``c`` cached ones (the step model's ``prefill_attn`` feature)."""
    return uncached * (cached + (uncached + 1) / 2.0)


def prompt_block_hashes(token_ids: Sequence[int] | np.ndarray, block_size: int) -> list[int]:
    """Chained hashes of the prompt's full blocks of ``block_size`` tokens (the CHT's hashing, so
    two prompts share the first ``k`` hashes exactly when they share their first ``k`` blocks)."""
    from scheduler_runtime.cht import ChunkedHashTree

    tokens = np.asarray(token_ids, dtype=np.int32)
    full = len(tokens) // block_size
    if full == 0:
        return []
    return [int(h) for h in ChunkedHashTree(block_size).hash_prompt(tokens[: full * block_size])]


class PrefixEstimate:
    """The blocks the engine's prefix cache holds, as the front end can know them: an LRU of the
    block hashes of the prompts admitted, at most ``capacity_blocks`` (the engine's KV cache).

    A request's blocks enter when it is admitted, so a later request of the same prefix finds them
    whether the earlier one is still queued or already in the cache.
    """

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = max(0, int(capacity_blocks))
        self._lru: OrderedDict[int, None] = OrderedDict()

    def cached_blocks(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` are held."""
        lru = self._lru
        n = 0
        for h in hashes:
            if h not in lru:
                break
            n += 1
        return n

    def touch(self, hashes: Sequence[int]) -> None:
        """The blocks of a request just admitted: most recently used, evicting the oldest beyond capacity."""
        lru = self._lru
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
        while len(lru) > self.capacity:
            lru.popitem(last=False)

    def clear(self) -> None:
        self._lru.clear()

    def __len__(self) -> int:
        return len(self._lru)


class Decision(NamedTuple):
    """The answer to :meth:`AdmissionController.offer`.

    Attributes:
        admit: serve it.
        reason: why it was rejected (one of :data:`REASONS`), "" when admitted.
        retry_after_s: whole seconds after which a retry may be admitted (``Retry-After``); 0 when
            admitted or never.
        retry: whether a retry can ever help (False for *never fits*: ``x-should-retry: false``).
        predicted_ttft_s: the rule's predicted TTFT (NaN when it did not predict).
        message: one sentence for the error body.
    """

    admit: bool
    reason: str = ""
    retry_after_s: int = 0
    retry: bool = True
    predicted_ttft_s: float = math.nan
    message: str = ""


@dataclass
class AdmissionStats:
    """Counts of one controller's decisions (the Prometheus counters read them).

    ``false_admits``: admitted requests that then missed their TTFT SLO (late first token, or
    aborted by the deadline rule). ``ttft_pace``: the ``slo`` rule's correction of its predicted
    TTFT now (a gauge, module docstring); ``max_ttft_pace``: the largest it has been.
    """

    admitted: int = 0
    rejected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS[:-1], 0))
    aborted: int = 0
    false_admits: int = 0
    ttft_pace: float = 1.0
    max_ttft_pace: float = 1.0

    def as_dict(self) -> dict[str, Any]:
        return {"admitted": self.admitted, "rejected": dict(self.rejected),
                "rejected_total": sum(self.rejected.values()), "aborted": self.aborted,
                "false_admits": self.false_admits, "ttft_pace": self.ttft_pace,
                "max_ttft_pace": self.max_ttft_pace}


class _Entry:
    __slots__ = ("arrival", "attention", "cached", "deadline", "latest_start", "predicted", "prompt",
                 "started", "uncached")

    def __init__(self, arrival: float, prompt: int, cached: int, deadline: float, alone: float,
                 predicted: float = math.nan) -> None:
        self.arrival = arrival
        self.prompt = prompt
        self.cached = cached
        self.uncached = prompt - cached
        self.attention = attention_work(self.uncached, cached)
        self.deadline = deadline
        self.latest_start = deadline - alone  # past this, even an idle engine is late
        self.predicted = predicted  # the model's TTFT at admission, before the pace; NaN: not a sample
        self.started = False


class AdmissionController:
    """One engine's admission state and rule (module docstring).

    Args:
        rule: the rule (an :class:`AdmissionRule` or its text).
        slos: the SLOs in milliseconds (``{"ttft": 5000, "tpot": 50}``); ``slo`` and ``deadline``
            need ``ttft``.
        model: the step-time model (``None``: :class:`StepTimeModel`'s defaults).
        token_budget: tokens one engine step computes (the setting's ``@TOKENS`` or the engine's).
        max_num_seqs: the engine's largest running batch.
        kv_capacity_tokens: the engine's KV cache in tokens (the prefix estimate's size).
        block_size: the engine's KV block size (the prefix estimate's unit).

    Raises:
        ConfigError: a rule that needs a TTFT SLO without one, or bad engine figures.
    """

    def __init__(self, rule: AdmissionRule | str | None, slos: Mapping[str, float] | None = None, *,
                 model: StepTimeModel | None = None, token_budget: int = 8192, max_num_seqs: int = 256,
                 kv_capacity_tokens: int = 1 << 20, block_size: int = 16) -> None:
        self.rule = rule if isinstance(rule, AdmissionRule) else AdmissionRule.parse(rule)
        try:
            self.slos = check_slos(slos or {})
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.rule.needs_slos and "ttft" not in self.slos:
            raise ConfigError(f"admission rule {str(self.rule)!r} needs a TTFT SLO (--slo ttft:MS)")
        if self.rule.tpot and "tpot" not in self.slos:
            raise ConfigError(f"admission rule {str(self.rule)!r} needs a TPOT SLO (--slo tpot:MS)")
        for name, value in (("token_budget", token_budget), ("max_num_seqs", max_num_seqs),
                            ("block_size", block_size)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"admission {name} must be an integer >= 1, got {value!r}")
        self.model = model or StepTimeModel()
        self.token_budget = token_budget
        self.max_num_seqs = max_num_seqs
        self.block_size = block_size
        self.prefix = PrefixEstimate(max(1, int(kv_capacity_tokens)) // block_size)
        self.stats = AdmissionStats()
        self._entries: dict[str, _Entry] = {}
        self._queued_tokens = 0  # full prompts of the queued (vLLM's count)
        self._queued_uncached = 0  # what the queued still have to prefill (ours)
        self._queued_attention = 0.0  # the sum of their own prefill attention work
        self._queued = 0
        self._running_kv = 0
        self._ratios: deque[float] = deque(maxlen=PACE_WINDOW)  # measured / predicted TTFT
        self._prefill_admitted: deque[tuple[float, float]] = deque()  # the tpot term's (time, seconds)
        self._prefill_window_s = 0.0

    # -- the state ------------------------------------------------------------------------------
    @property
    def num_queued(self) -> int:
        """Admitted requests waiting for their first token."""
        return self._queued

    @property
    def num_running(self) -> int:
        """Admitted requests past their first token, not finished."""
        return len(self._entries) - self._queued

    @property
    def queued_tokens(self) -> int:
        """The full prompts of the queued requests (vLLM's ``--max-num-queued-tokens`` count)."""
        return self._queued_tokens

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def ttft_slo_s(self, ttft_ms: float | None = None) -> float:
        """The TTFT SLO in seconds, tightened by a per-request ``ttft_ms`` (inf without one)."""
        slo = self.slos.get("ttft", math.inf)
        if ttft_ms is not None:
            slo = min(slo, ttft_ms)
        return slo / 1000.0

    def alone_seconds(self, prompt_len: int, cached: int = 0) -> float:
        """The request's own prefill on an idle engine: a lower bound of its TTFT."""
        return self.model.prefill_seconds(prompt_len - cached, cached, self.token_budget, 0, 0.0)

    @property
    def pace(self) -> float:
        """The correction of the model's TTFT by the engine's measured pace (module docstring)."""
        return self.stats.ttft_pace

    def predicted_ttft(self, prompt_len: int, cached: int) -> float:
        """Seconds until a request arriving now would see its first token, FCFS behind the queue, by
        the model alone (the ``slo`` rule scales it by :attr:`pace`): the steps that prefill the
        queued requests' uncached tokens and its own, and each prompt's own attention work (not
        that of one prompt of the backlog's length)."""
        running = min(self.num_running, self.max_num_seqs)
        uncached = prompt_len - cached
        backlog = self._queued_uncached + uncached
        attention = self._queued_attention + attention_work(uncached, cached)
        return self.model.prefill_seconds(backlog, cached, self.token_budget, running, self._running_kv,
                                          attention)

    # -- the events -----------------------------------------------------------------------------
    def offer(self, request_id: str, prompt_len: int, block_hashes: Sequence[int], now: float, *,
              ttft_ms: float | None = None, tpot_ms: float | None = None) -> Decision:
        """A request arrives: admit it (it is then tracked until :meth:`finished`) or reject it.

        ``ttft_ms`` / ``tpot_ms``: the request's own SLOs (a client's ``x-slo-*`` headers), which only
        tighten the configured ones.

        Raises:
            ValueError: ``request_id`` is already tracked, or ``prompt_len`` < 1.
        """
        if request_id in self._entries:
            raise ValueError(f"request {request_id!r} is already admitted")
        if prompt_len < 1:
            raise ValueError(f"request {request_id!r}: a prompt needs at least one token")
        rule = self.rule
        cached = min(prompt_len - 1, self.prefix.cached_blocks(block_hashes) * self.block_size)
        slo = self.ttft_slo_s(ttft_ms)
        tpot = min(self.slos.get("tpot", math.inf), tpot_ms if tpot_ms is not None else math.inf) / 1000.0
        decision = Decision(True)
        alone = self.alone_seconds(prompt_len, cached)
        model = math.nan
        if rule.queued_reqs is not None and len(self._entries) + 1 > rule.queued_reqs:
            decision = self._reject("queued-reqs", f"the engine has reached its limit of {rule.queued_reqs} "
                                    "requests in flight")
        elif rule.queued_tokens is not None and self._queued_tokens >= rule.queued_tokens:
            decision = self._reject("queued-tokens", f"the engine has reached its prefill token backlog "
                                    f"limit of {rule.queued_tokens} tokens")
        elif rule.needs_slos:
            if alone > slo or self.model.step(1, 1, prompt_len) > tpot:
                decision = self._reject("never-fits", f"this request cannot meet its SLOs even on an idle "
                                        f"server (its prefill alone takes ~{alone:.2f} s)", retry=False)
            elif rule.slo_factor is not None:
                model = self.predicted_ttft(prompt_len, cached)
                predicted = model * self.pace
                limit = rule.slo_factor * slo
                if predicted > limit:
                    decision = self._reject("slo", f"the predicted time to first token, {predicted:.2f} s, "
                                            f"exceeds {rule.slo_factor:g} x the TTFT SLO of {slo:g} s",
                                            wait=predicted - limit, predicted=predicted)
                else:
                    decision = Decision(True, predicted_ttft_s=predicted)
            if decision.admit and rule.tpot:
                room = self._decode_room(prompt_len - cached, cached, now, tpot)
                decision = decision if room.admit else room
        if decision.admit:
            self.prefix.touch(block_hashes)
            sample = model if model >= PACE_MIN_SHARE * slo else math.nan
            entry = _Entry(now, prompt_len, cached, now + slo, alone, sample)
            self._entries[request_id] = entry
            self._queued += 1
            self._queued_tokens += prompt_len
            self._queued_uncached += entry.uncached
            self._queued_attention += entry.attention
            self.stats.admitted += 1
        return decision

    def _decode_room(self, uncached: int, cached: int, now: float, tpot: float) -> Decision:
        """The ``tpot`` term: admit while the prefill time admitted over the last :data:`TPOT_WINDOW_S`
        seconds, this request's included, leaves the running decodes a mean step within ``tpot``. Over
        a window of ``H`` seconds of ``n`` steps, each a decode step ``d`` plus its prefill's extra
        time, the mean step ``H / n`` stays within ``tpot`` while the extra time stays within
        ``H * (1 - d / tpot)``; a request's extra time is its prefill's steps (the model's, times the
        pace) less as many decode steps. The first request of a window always fits, and one with no
        request running or queued ahead (no decode to slow) fits without a charge."""
        window = self._prefill_admitted
        while window and window[0][0] <= now - TPOT_WINDOW_S:
            self._prefill_window_s -= window.popleft()[1]
        if not self._entries:
            return Decision(True)
        running = min(self.num_running, self.max_num_seqs)
        decode = self.model.step(running, running, self._running_kv)
        steps = math.ceil(uncached / self.model.prefill_chunk(self.token_budget, running))
        prefill = self.model.prefill_seconds(uncached, cached, self.token_budget, running, self._running_kv)
        cost = max(0.0, prefill * self.pace - steps * decode)
        room = max(0.0, 1.0 - decode / tpot) * TPOT_WINDOW_S
        if window and self._prefill_window_s + cost > room:
            return self._reject("tpot", f"the prefill admitted over the last {TPOT_WINDOW_S:g} s would "
                                f"slow the running requests past the TPOT SLO of {1000 * tpot:g} ms")
        window.append((now, cost))
        self._prefill_window_s += cost
        return Decision(True)

    def _reject(self, reason: str, message: str, *, retry: bool = True, wait: float = 1.0,
                predicted: float = math.nan) -> Decision:
        self.stats.rejected[reason] = self.stats.rejected.get(reason, 0) + 1
        return Decision(False, reason, 0 if not retry else max(1, math.ceil(wait)), retry, predicted, message)

    def started(self, request_id: str, now: float, *, timed: bool = True) -> None:
        """Its first token came (its prefill is over); unknown or already started ids are ignored.
        ``timed=False``: ``now`` is not its first token's time (a non-streaming answer's end), so it
        does not count toward the pace."""
        entry = self._entries.get(request_id)
        if entry is None or entry.started:
            return
        entry.started = True
        self._queued -= 1
        self._queued_tokens -= entry.prompt
        self._queued_uncached -= entry.uncached
        self._queued_attention -= entry.attention
        self._running_kv += entry.prompt
        if now > entry.deadline:
            self.stats.false_admits += 1
        if timed:
            self._measured(entry, now)

    def finished(self, request_id: str, *, aborted: bool = False, now: float | None = None) -> None:
        """It left (finished, failed, or aborted: ``aborted`` counts an abort by the deadline rule,
        whose wait until ``now`` counts toward the pace); unknown ids are ignored."""
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return
        if aborted and not entry.started and now is not None:
            self._measured(entry, now)
        if entry.started:
            self._running_kv -= entry.prompt
        else:
            self._queued -= 1
            self._queued_tokens -= entry.prompt
            self._queued_uncached -= entry.uncached
            self._queued_attention -= entry.attention
        if aborted:
            self.stats.aborted += 1
            self.stats.false_admits += 1

    def _measured(self, entry: _Entry, now: float) -> None:
        """A TTFT (or a wait past the deadline) measured: update the pace."""
        if not entry.predicted > 0:
            return
        self._ratios.append((now - entry.arrival) / entry.predicted)
        if len(self._ratios) >= PACE_MIN_SAMPLES:
            q = float(np.quantile(np.fromiter(self._ratios, float), PACE_QUANTILE))
            pace = min(PACE_MAX, max(1.0, q))
            self.stats.ttft_pace = pace
            self.stats.max_ttft_pace = max(self.stats.max_ttft_pace, pace)

    def overdue(self, now: float) -> list[str]:
        """The deadline rule: queued requests that can no longer meet their TTFT (their own prefill on
        an idle engine would end past their deadline), oldest first; empty without the rule."""
        if not self.rule.deadline:
            return []
        out = []
        for rid, entry in self._entries.items():
            if not entry.started and now > entry.latest_start:
                out.append(rid)
        return out

    def next_deadline(self) -> float:
        """The earliest moment :meth:`overdue` can name a request it does not name now (inf when none)."""
        if not self.rule.deadline:
            return math.inf
        return min((e.latest_start for e in self._entries.values() if not e.started), default=math.inf)

    def reset(self) -> None:
        """Forget every request, the prefix estimate and the pace (a new episode); the counters stay."""
        self._entries.clear()
        self.prefix.clear()
        self._ratios.clear()
        self.stats.ttft_pace = 1.0
        self._prefill_admitted.clear()
        self._prefill_window_s = 0.0
        self._queued = self._queued_tokens = self._queued_uncached = self._running_kv = 0
        self._queued_attention = 0.0
