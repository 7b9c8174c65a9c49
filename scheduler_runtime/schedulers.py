"""Scheduler names -> configuration, and the engine-free runtime the vLLM scheduler delegates to.

One name picks a scheduler; :func:`resolve` turns it into what vLLM needs (the scheduler
class's dotted path and the configuration it reads), so every caller (the tests, the server,
``evaluate.py``) starts the same thing from the same name:

==========================  ==========================================================
``fcfs``                    vLLM's own scheduler (first come, first served)
``sjf`` / ``oracle-sjf``    shortest predicted / true output first
``svf`` / ``oracle-svf``    smallest predicted / true volume first, SVF's peak check
``svf-1bit``                SVF with the short/long classifier's proxy lengths
``lpm`` / ``dfs-weight``    SGLang's longest prefix match (FCFS above 128 waiting) /
                            DFS-weight, per scheduling round over a radix tree
``feather-heuristic``       Feather: CHT + the authors' static ADD/STOP rule
``feather:PATH``            Feather with an exported policy (``scheduler_runtime.policy``); a
                            policy of the group observation answers the group decision
``group-cap-K``             Feather's group decision (``scheduler_runtime.groups``) answered by
                            the hand-made rule: cached group first, hold a new group while
                            requests of the groups in flight wait, at most K groups in flight
                            (K = 1..64); ``group-hold``: the same without a cap
``...+svf``                 a Feather name with SVF admission: smallest-volume seed of an
                            empty batch and SVF's peak check (``+svf-1bit``,
                            ``+oracle-svf``: with those lengths)
``NAME@TOKENS``             any name above with a per-step token budget of TOKENS
                            (vLLM's ``--max-num-batched-tokens``, chunked prefill's
                            size), e.g. ``fcfs@512``, ``group-cap-3@512``
``NAME~RULE``               any name above with an admission rule
                            (:mod:`scheduler_runtime.admission`), decided in front of
                            the engine: ``group-cap-8@256~slo:0.5``,
                            ``fcfs~queued-tokens:12000``, ``lpm~slo+deadline``
==========================  ==========================================================

The token budget bounds the tokens one engine step computes (decode tokens plus prefill chunks):
a small budget interleaves long prefills with the running requests' decode steps (lower TPOT,
later first tokens for long prompts), a large one prefills at once. A name without ``@TOKENS``
runs with the engine's own budget. The scheduler applies it inside the engine (vLLM's
``max_num_scheduled_tokens``), so one engine serves names of different budgets one after the
other; ``feather-serve`` also passes it to vLLM as ``--max-num-batched-tokens``.

Configuration (:class:`SchedulerConfig`) reaches the scheduler inside the engine from, in
increasing precedence: the scheduler class's default name, the JSON/YAML file named by
``$FEATHER_SCHEDULER_CONFIG``, and the engine's ``additional_config["feather_scheduler"]``
(``LLM(additional_config=...)``, ``--additional-config``).

Client hints. True output lengths (the ``oracle-*`` names) can come with each request, in its
sampling parameters' ``extra_args["feather_output_len"]`` (OpenAI API: ``extra_body={"vllm_xargs":
{"feather_output_len": N}}``), and the request's source (task) for the predictor as
``extra_args["feather_source"]`` (e.g. ``"leval/sci_fi"``). A client that lies about either
moves itself up the SJF/SVF queues, so both are read only when the configuration trusts its
clients (``trust_client_hints``: off by default, on in ``evaluate.py``, which replays its own
workload). Otherwise the oracle names take ``max_tokens`` (exact for benchmark requests, which
force their length with ``ignore_eos`` and ``min_tokens == max_tokens``) and the predictor
sees no source. A trusted hint is still checked, at arrival, outside the engine's busy loop:

* ``feather_output_len``: a finite real number (``bool`` is not one), clamped to
  ``[1, min(max_tokens, max_model_len)]``; anything else (a string such as ``"10"`` or
  ``"nan"``, a list, NaN, infinity) is replaced by ``max_tokens``;
* ``feather_source``: a string of at most :data:`MAX_SOURCE_CHARS` characters, else ignored.

A hint that was clamped or replaced is counted (``RuntimeStats.invalid_hints``,
``feather_scheduler_invalid_hints_total``); the request is served as any other.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import numpy as np

from scheduler_runtime.admission import AdmissionRule, split_admission
from scheduler_runtime.batching import BatchingCore, CoreConfig
from scheduler_runtime.config import ConfigError, check_core_knobs, checked_fields, load_mapping
from scheduler_runtime.decision import BatchingPolicy, EngineView, observation_kind
from scheduler_runtime.orderings import KEY_ORDERINGS, OrderingName
from scheduler_runtime.plugins import default_policy
from scheduler_runtime.predictor import OutputLengthPredictor, load_predictor
from scheduler_runtime.prefix_index import DEFAULT_CHUNK_SIZE
from scheduler_runtime.rules import MAX_GROUP_CAP, group_rule_cap

__all__ = [
    "ADDITIONAL_CONFIG_KEY",
    "BASELINE_NAMES",
    "CONFIG_ENV",
    "EXTRA_OUTPUT_LEN",
    "EXTRA_SOURCE",
    "MAX_SOURCE_CHARS",
    "FeatherRuntime",
    "SchedulerConfig",
    "check_scheduler",
    "engine_overrides",
    "load_scheduler_config",
    "resolve",
    "split_budget",
    "with_budget",
]

CONFIG_ENV = "FEATHER_SCHEDULER_CONFIG"
ADDITIONAL_CONFIG_KEY = "feather_scheduler"
EXTRA_OUTPUT_LEN = "feather_output_len"
EXTRA_SOURCE = "feather_source"
DEFAULT_NAME = "feather-heuristic+svf"
DEFAULT_MAX_WAIT = 60.0
#: The longest ``feather_source`` hint that is read (task names are a few dozen characters).
MAX_SOURCE_CHARS = 128
VLLM_SCHEDULER = "vllm.v1.core.sched.scheduler.Scheduler"
VLLM_ASYNC_SCHEDULER = "vllm.v1.core.sched.async_scheduler.AsyncScheduler"
FEATHER_SCHEDULER = "scheduler_runtime.serving.vllm_scheduler.FeatherScheduler"
FEATHER_ASYNC_SCHEDULER = "scheduler_runtime.serving.vllm_scheduler.FeatherAsyncScheduler"

#: name -> (ordering, output lengths, admission) of every baseline but fcfs.
_BASELINES: dict[str, tuple[str, str, str]] = {
    "sjf": (OrderingName.SJF, "predicted", "prompt"),
    "oracle-sjf": (OrderingName.SJF, "oracle", "prompt"),
    "svf": (OrderingName.SVF, "predicted", "peak"),
    "svf-1bit": (OrderingName.SVF, "1bit", "peak"),
    "oracle-svf": (OrderingName.SVF, "oracle", "peak"),
    "lpm": (OrderingName.LPM, "predicted", "prompt"),
    "dfs-weight": (OrderingName.DFS_WEIGHT, "predicted", "prompt"),
}
BASELINE_NAMES = ("fcfs", *_BASELINES)
#: "+svf" suffixes of a Feather name -> the output lengths of its SVF admission.
_SVF_SUFFIXES = {"+svf": "predicted", "+svf-1bit": "1bit", "+oracle-svf": "oracle"}
LENGTH_SOURCES = ("predicted", "1bit", "oracle")
#: ``NAME@TOKENS``: a scheduler name with its per-step token budget (module docstring).
_BUDGET_SUFFIX = re.compile(r"^(?P<base>.+)@(?P<tokens>[0-9]+)$")
#: The smallest per-step token budget a name may ask (a budget below one block of 16 tokens cannot
#: make progress on a prefill and vLLM refuses it below ``max_num_seqs``).
MIN_TOKEN_BUDGET = 16
MAX_TOKEN_BUDGET = 1 << 20


@dataclass(frozen=True)
class SchedulerConfig:
    """Everything the scheduler inside the engine is configured with.

    Build it with :meth:`for_name` (or :func:`load_scheduler_config`): the name sets the
    defaults of every other field, and given fields override them.

    Attributes:
        name: the scheduler name (module docstring).
        ordering: the core's ordering (:data:`~scheduler_runtime.core_config.ORDERINGS`);
            ``None`` for ``fcfs`` (vLLM decides alone).
        policy: Feather's policy file (``feather:PATH``); ``None``: the static heuristic.
        lengths: output lengths used for SJF keys, volumes and the peak check:
            ``predicted``, ``1bit`` (class proxies) or ``oracle`` (true, see module docstring).
        admission: ``none`` | ``prompt`` | ``peak`` (:data:`~scheduler_runtime.core_config.ADMISSIONS`).
        svf_seed: Feather: seed an empty batch with the smallest-volume request.
        chunk_size: CHT chunk size in tokens; ``None``: the policy's (its observation's
            ``chunk_size``), else 512.
        max_wait: seconds after which a waiting request is released whatever the policy or the
            ordering says (default 60 for every ordering, so a request with a long predicted or
            claimed output cannot starve); ``None`` switches anti-starvation off.
        predictor: predictor file; ``None``: the shipped ``configs/predictors/output_len.json``.
        kv_capacity_tokens: capacity for the admission check; ``None``: the engine's KV cache.
        clamp_to_max_tokens: cap predictions at the request's ``max_tokens``. Off by default:
            benchmark requests set ``max_tokens`` to their true length, so capping would hand
            the predicted schedulers the oracle's information.
        lpm_fcfs_fallback: ``lpm`` serves FCFS above this many waiting requests (SGLang: 128).
        trust_client_hints: read the requests' ``feather_output_len`` and ``feather_source``
            (module docstring). Off by default: on a public server a client could claim a short
            output to jump the queue.
        max_faults: the vLLM scheduler switches Feather off (it then runs as vLLM's fcfs until
            the engine restarts) at this many faults in Feather's own code; before that, each
            fault restarts Feather with a fresh runtime. Default 1: the first fault switches it off.
        decision: Feather's decision, ``request`` (ADD/STOP per candidate, the paper's) or
            ``group`` (only on opening a prefix group); a policy of the group observation
            answers the group decision whatever this says.
        group_chunks: the group decision's groups are the requests' first ``group_chunks`` chunks.
        group_cap: the group decision's rule (``group-cap-K``) when no policy is named: at most
            this many groups in flight; ``0``: no cap (``group-hold``).
        retain_held_prefixes: LRU-tail retention: after every round the free cached blocks of the
            held groups' prefixes move to the end of vLLM's eviction order (``free_block_queue``),
            so the prefix cache evicts what no held request needs first. Off by default.
        max_num_batched_tokens: the per-step token budget (``NAME@TOKENS``); ``None``: the
            engine's. Applied by the scheduler inside the engine; never above the engine's.
    """

    name: str = DEFAULT_NAME
    ordering: str | None = OrderingName.FEATHER
    policy: str | None = None
    lengths: str = "predicted"
    admission: str = "peak"
    svf_seed: bool = True
    chunk_size: int | None = None
    max_wait: float | None = DEFAULT_MAX_WAIT
    predictor: str | None = None
    kv_capacity_tokens: int | None = None
    clamp_to_max_tokens: bool = False
    lpm_fcfs_fallback: int | None = 128
    trust_client_hints: bool = False
    max_faults: int = 1
    decision: str = "request"
    group_chunks: int = 1
    group_cap: int | None = None
    retain_held_prefixes: bool = False
    max_num_batched_tokens: int | None = None
    admission_rule: str = "none"

    def __post_init__(self) -> None:
        if isinstance(self.ordering, OrderingName):  # a plain string in dumps and comparisons
            object.__setattr__(self, "ordering", self.ordering.value)
        # types first (a value built in code skips from_mapping), then ranges
        checked_fields(SchedulerConfig, {f.name: getattr(self, f.name) for f in fields(self)},
                       where="scheduler")
        if self.lengths not in LENGTH_SOURCES:
            raise ConfigError(f"scheduler.lengths must be one of {LENGTH_SOURCES}, got {self.lengths!r}")
        try:
            knobs = {"max_wait": self.max_wait, "lpm_fcfs_fallback": self.lpm_fcfs_fallback,
                     "group_chunks": self.group_chunks}
            check_core_knobs(**knobs, **({} if self.chunk_size is None else {"chunk_size": self.chunk_size}))
        except ValueError as exc:
            raise ConfigError(f"scheduler.{exc}") from None
        if self.kv_capacity_tokens is not None and self.kv_capacity_tokens < 1:
            raise ConfigError(f"scheduler.kv_capacity_tokens must be >= 1, got {self.kv_capacity_tokens}")
        if self.max_faults < 1:
            raise ConfigError(f"scheduler.max_faults must be >= 1, got {self.max_faults}")
        budget = self.max_num_batched_tokens
        if budget is not None and not MIN_TOKEN_BUDGET <= budget <= MAX_TOKEN_BUDGET:
            raise ConfigError(f"scheduler.max_num_batched_tokens must be in [{MIN_TOKEN_BUDGET}, "
                              f"{MAX_TOKEN_BUDGET}] tokens or null, got {budget}")
        object.__setattr__(self, "admission_rule", str(AdmissionRule.parse(self.admission_rule)))  # canonical
        if self.group_cap is not None and self.group_cap < 0:
            raise ConfigError(f"scheduler.group_cap must be >= 0 (0: no cap) or null, got {self.group_cap}")
        if self.ordering is not None:
            try:
                self.core_config(DEFAULT_CHUNK_SIZE)
            except ValueError as exc:
                raise ConfigError(f"scheduler {self.name!r}: {exc}") from None

    @classmethod
    def for_name(cls, name: str, **overrides: Any) -> SchedulerConfig:
        """The configuration of scheduler ``name`` (module docstring), with ``overrides``.

        Raises:
            ConfigError: an unknown name, an unknown field, or a value of the wrong type or range.
        """
        overrides = checked_fields(cls, overrides, where="scheduler config")
        return replace(_defaults_for(name), **overrides)

    @property
    def passthrough(self) -> bool:
        """True for ``fcfs``: requests go straight to vLLM's queue."""
        return self.ordering is None

    @property
    def uses_lengths(self) -> bool:
        """Whether output lengths matter (a key, a volume or the peak check reads them)."""
        return self.ordering in KEY_ORDERINGS or self.admission == "peak" or (
            self.ordering == OrderingName.FEATHER and self.svf_seed)

    def core_config(self, chunk_size: int, decision: str | None = None) -> CoreConfig:
        """The batching core's configuration (``decision`` overrides this one's: the policy's)."""
        assert self.ordering is not None
        return CoreConfig(ordering=self.ordering, admission=self.admission, svf_seed=self.svf_seed,
                          chunk_size=chunk_size, max_wait=self.max_wait,
                          lpm_fcfs_fallback=self.lpm_fcfs_fallback, decision=decision or self.decision,
                          group_chunks=self.group_chunks, retain_held_prefixes=self.retain_held_prefixes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def split_budget(name: str) -> tuple[str, int | None]:
    """``"group-cap-3@512"`` -> ``("group-cap-3", 512)``; a name without ``@TOKENS`` -> ``(name, None)``."""
    match = _BUDGET_SUFFIX.match(name)
    if match is None:
        return name, None
    return match["base"], int(match["tokens"])


def with_budget(name: str, tokens: int | None) -> str:
    """Scheduler ``name`` served with a per-step budget of ``tokens`` (``None``: the engine's)."""
    base, _ = split_budget(name)
    return base if tokens is None else f"{base}@{int(tokens)}"


def _defaults_for(name: str) -> SchedulerConfig:
    if not isinstance(name, str) or not name:
        raise ConfigError(f"scheduler name must be a non-empty string, got {name!r}")
    base, rule = split_admission(name)
    if rule is not None:
        try:
            parsed = AdmissionRule.parse(rule)
        except ConfigError as exc:
            raise ConfigError(f"scheduler {name!r}: {exc}") from None
        return replace(_defaults_for(base), name=name, admission_rule=str(parsed))
    base, budget = split_budget(name)
    if budget is not None:
        if not MIN_TOKEN_BUDGET <= budget <= MAX_TOKEN_BUDGET:
            raise ConfigError(f"scheduler {name!r}: the token budget after '@' must be in "
                              f"[{MIN_TOKEN_BUDGET}, {MAX_TOKEN_BUDGET}], got {budget}")
        return replace(_defaults_for(base), name=name, max_num_batched_tokens=budget)
    if name == "fcfs":
        return SchedulerConfig(name=name, ordering=None, admission="none", svf_seed=False, max_wait=None)
    if name in _BASELINES:
        ordering, lengths, admission = _BASELINES[name]
        return SchedulerConfig(name=name, ordering=ordering, lengths=lengths, admission=admission,
                               svf_seed=False)
    base, lengths = name, None
    for suffix, source in _SVF_SUFFIXES.items():
        if name.endswith(suffix):
            base, lengths = name[: -len(suffix)], source
            break
    group = group_rule_cap(base)
    if group is not None:
        return SchedulerConfig(name=name, ordering=OrderingName.FEATHER, decision="group", group_cap=group,
                               admission="peak" if lengths else "prompt", svf_seed=lengths is not None,
                               lengths=lengths or "predicted")
    if base == "feather-heuristic":
        policy = None
    elif base.startswith("feather:") and len(base) > len("feather:"):
        policy = base[len("feather:"):]
    else:
        raise ConfigError(
            f"unknown scheduler {name!r}; known: {list(BASELINE_NAMES)}, 'feather-heuristic', "
            f"'group-cap-K' (K = 1..{MAX_GROUP_CAP}), 'group-hold', 'feather:<checkpoint>', each Feather "
            f"name optionally + one of {list(_SVF_SUFFIXES)}; any name optionally @TOKENS (a per-step token "
            f"budget, e.g. fcfs@512)")
    if lengths is None:  # Feather alone: the engine's admission test, made at release time
        return SchedulerConfig(name=name, ordering=OrderingName.FEATHER, policy=policy, admission="prompt",
                               svf_seed=False)
    return SchedulerConfig(name=name, ordering=OrderingName.FEATHER, policy=policy, lengths=lengths,
                           admission="peak", svf_seed=True)


def load_scheduler_config(
    additional_config: Mapping[str, Any] | None = None,
    default_name: str = DEFAULT_NAME,
    environ: Mapping[str, str] | None = None,
) -> SchedulerConfig:
    """The configuration in effect inside an engine (precedence in the module docstring).

    ``$FEATHER_SCHEDULER_CONFIG`` names a JSON or YAML file (or holds inline JSON).
    """
    environ = os.environ if environ is None else environ
    merged: dict[str, Any] = {}
    source = environ.get(CONFIG_ENV)
    if source:
        merged.update(_read_config_source(source))
    if additional_config and isinstance(additional_config, Mapping):
        section = additional_config.get(ADDITIONAL_CONFIG_KEY)
        if section is not None:
            if not isinstance(section, Mapping):
                raise ConfigError(f"additional_config[{ADDITIONAL_CONFIG_KEY!r}] must be a mapping")
            merged.update(section)
    name = merged.pop("name", default_name)
    return SchedulerConfig.for_name(name, **merged)


def _read_config_source(source: str) -> dict[str, Any]:
    if source.lstrip().startswith("{"):
        try:
            data = json.loads(source)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"${CONFIG_ENV}: inline JSON is malformed: {exc}") from exc
    else:
        try:
            data = load_mapping(source)
        except ConfigError as exc:
            raise ConfigError(f"${CONFIG_ENV}: {exc}") from exc
        if ADDITIONAL_CONFIG_KEY in data:
            data = data[ADDITIONAL_CONFIG_KEY]
    if not isinstance(data, dict):
        raise ConfigError(f"${CONFIG_ENV}: expected a mapping, got {type(data).__name__}")
    return dict(data)


def resolve(name: str, *, async_scheduling: bool = False, **overrides: Any) -> tuple[str, dict[str, Any]]:
    """``(scheduler_cls dotted path, config mapping)`` of scheduler ``name``.

    The mapping goes into the engine's ``additional_config[ADDITIONAL_CONFIG_KEY]`` (see
    :func:`engine_overrides`). ``async_scheduling``: the class for vLLM's async scheduling
    (on by default on CUDA). ``overrides``: fields of :class:`SchedulerConfig`.
    """
    overrides = checked_fields(SchedulerConfig, overrides, where="scheduler config")
    config = SchedulerConfig.for_name(name, **overrides)
    if config.passthrough:
        cls = VLLM_ASYNC_SCHEDULER if async_scheduling else VLLM_SCHEDULER
    else:
        cls = FEATHER_ASYNC_SCHEDULER if async_scheduling else FEATHER_SCHEDULER
    return cls, {"name": name, **overrides}


def engine_overrides(name: str, *, async_scheduling: bool = False, **overrides: Any) -> dict[str, Any]:
    """Keyword overrides of ``feather_env.engines.vllm_engine.build_llm`` that start scheduler ``name``.

    ``build_llm(config, **engine_overrides("svf"))``; note that it sets ``extra`` (merge by
    hand if the engine config already has extra arguments).
    """
    cls, cfg = resolve(name, async_scheduling=async_scheduling, **overrides)
    return {"scheduler_cls": cls, "extra": {"additional_config": {ADDITIONAL_CONFIG_KEY: cfg}}}


def check_scheduler(name: str, **overrides: Any) -> SchedulerConfig:
    """The configuration of scheduler ``name``, after loading everything its engine will load.

    The policy (file or plug-in) and the predictor are read and checked against the
    configuration (e.g. a ``chunk_size`` that is not the policy's), as the scheduler does at
    engine start, so a command line can refuse them before any model loads.

    Raises:
        ConfigError: naming the scheduler and the problem.
    """
    config = SchedulerConfig.for_name(name, **overrides)
    if not config.passthrough:
        try:
            FeatherRuntime(config)
        except ConfigError:
            raise
        except ValueError as exc:  # PolicyFormatError, a bad predictor file
            raise ConfigError(f"scheduler {name!r}: {exc}") from exc
    return config


# ---------------------------------------------------------------------------- the runtime


def _policy_chunk_size(policy: BatchingPolicy) -> int | None:
    spec = getattr(policy, "obs_spec", None)
    return getattr(spec, "chunk_size", None)


@dataclass
class RuntimeStats:
    """Costs outside the core's decision loop (its ``plan`` time is ``decision_seconds``).

    ``arrival_seconds``: handling new requests (length prediction + CHT insert), of which
    ``prediction_seconds`` predicting; ``hook_seconds``: the vLLM subclass's own work in
    ``schedule()`` around the decision loop (moving released requests, exporting metrics)
    and when requests are freed (CHT finish). ``invalid_hints``: trusted client hints that were
    clamped or replaced (module docstring).
    """

    predictions: int = 0
    prediction_seconds: float = 0.0
    arrival_seconds: float = 0.0
    hook_seconds: float = 0.0
    invalid_hints: int = 0


class FeatherRuntime:
    """What the vLLM scheduler subclass delegates to: output lengths, the core, counters.

    Engine-free: it takes prompts as token ids and sampling fields as plain values.

    Args:
        config: the scheduler configuration (not ``fcfs``).
        kv_capacity_tokens: the engine's KV capacity (``config.kv_capacity_tokens`` wins).
        max_model_len: the engine's longest sequence: the upper bound of an output-length hint.
        policy: a policy object instead of ``config.policy`` (tests).
        predictor: a predictor instead of ``config.predictor`` (tests).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv_capacity_tokens: int | None = None,
        *,
        max_model_len: int | None = None,
        policy: BatchingPolicy | None = None,
        predictor: OutputLengthPredictor | None = None,
    ) -> None:
        if config.passthrough:
            raise ConfigError("fcfs is vLLM's own scheduler: it has no Feather runtime")
        self.config = config
        self.max_model_len = max_model_len
        if policy is None:
            policy = default_policy(config.ordering, config.policy, config.group_cap)
        # a policy that reads the group observation answers the group decision
        decision = "group" if policy is not None and observation_kind(policy) == "group" else config.decision
        policy_chunk = _policy_chunk_size(policy) if policy is not None else None
        if config.chunk_size is not None and policy_chunk is not None and config.chunk_size != policy_chunk:
            raise ConfigError(f"scheduler.chunk_size={config.chunk_size} but the policy {config.policy} "
                              f"measures delta in chunks of {policy_chunk} tokens")
        self.chunk_size = config.chunk_size or policy_chunk or DEFAULT_CHUNK_SIZE
        self.predictor: OutputLengthPredictor | None = None
        if config.uses_lengths and config.lengths != "oracle":
            self.predictor = predictor if predictor is not None else load_predictor(config.predictor)
        capacity = config.kv_capacity_tokens or kv_capacity_tokens
        try:
            core_config = config.core_config(self.chunk_size, decision)
            self.core = BatchingCore(core_config, policy, capacity)
        except ValueError as exc:  # a policy of one decision named with the other's config
            raise ConfigError(f"scheduler {config.name!r}: {exc}") from exc
        self.stats = RuntimeStats()

    def output_length(
        self,
        token_ids: np.ndarray,
        max_tokens: int | None,
        extra_args: Mapping[str, Any] | None,
    ) -> float:
        """The output length the core uses for this request: finite, >= 1 (module docstring)."""
        config = self.config
        if not config.uses_lengths:
            return float(max_tokens or 1)
        extra = extra_args if config.trust_client_hints and extra_args else {}
        upper = self._length_bound(max_tokens)
        if config.lengths == "oracle":
            hint = self._output_len_hint(extra.get(EXTRA_OUTPUT_LEN), upper)
            return hint if hint is not None else float(upper or 1)
        predictor = self.predictor
        assert predictor is not None
        source = self._source_hint(extra.get(EXTRA_SOURCE))
        start = time.perf_counter()
        if config.lengths == "1bit":
            length = predictor.proxy_length(predictor.predict_long(token_ids, source))
        else:
            length = predictor.predict(token_ids, source)
        self.stats.predictions += 1
        self.stats.prediction_seconds += time.perf_counter() - start
        if config.clamp_to_max_tokens and max_tokens:
            length = min(length, float(max_tokens))
        return length

    def _length_bound(self, max_tokens: int | None) -> int | None:
        """The longest output a request can have: its ``max_tokens``, at most ``max_model_len``."""
        bounds = [b for b in (max_tokens, self.max_model_len) if b]
        return max(1, min(bounds)) if bounds else None

    def _output_len_hint(self, value: Any, upper: int | None) -> float | None:
        """A trusted ``feather_output_len`` in ``[1, upper]``; None when absent or not a finite number."""
        if value is None:
            return None
        length: float | None = None
        if (isinstance(value, numbers.Real) and not isinstance(value, bool)
                and (isinstance(value, numbers.Integral) or math.isfinite(value))):
            clamped = max(value, 1) if upper is None else min(max(value, 1), upper)
            try:
                length = float(clamped)
            except OverflowError:  # an integer beyond float range, with no bound to clamp it to
                length = None
        if length is None or length != value:
            self.stats.invalid_hints += 1
        return length

    def _source_hint(self, value: Any) -> str:
        """A trusted ``feather_source``; "" when absent or not a short string."""
        if value is None:
            return ""
        if isinstance(value, str) and len(value) <= MAX_SOURCE_CHARS:
            return value
        self.stats.invalid_hints += 1
        return ""

    def arrive(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int] | np.ndarray,
        *,
        now: float,
        max_tokens: int | None = None,
        extra_args: Mapping[str, Any] | None = None,
        prompt_hashes: np.ndarray | None = None,
    ) -> None:
        """A new request: predict its length and hold it in the core (``prompt_hashes``: see
        :meth:`BatchingCore.arrive`)."""
        start = time.perf_counter()
        tokens = np.asarray(prompt_token_ids, dtype=np.int32)
        self.core.arrive(request_id, tokens, arrival=now,
                         output_len=self.output_length(tokens, max_tokens, extra_args),
                         prompt_hashes=prompt_hashes)
        self.stats.arrival_seconds += time.perf_counter() - start

    def plan(self, now: float, free_slots: int, engine: EngineView | None = None) -> list[str]:
        """Ids to release to the engine now, in order (see :meth:`BatchingCore.plan`)."""
        return self.core.plan(now, free_slots, engine)

    def left_engine(self, request_id: str, aborted: bool) -> bool:
        """The engine freed a request (finished, or aborted/errored); False for one the core does
        not know (:meth:`BatchingCore.leave`)."""
        return self.core.leave(request_id, aborted=aborted)

    def preempted(self, request_id: str) -> None:
        if self.core.is_active(request_id):
            self.core.preempted(request_id)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.core

    def snapshot(self) -> dict[str, Any]:
        """Every counter, for logs, tests and ``/metrics``."""
        out = self.core.stats.as_dict()
        out.update(asdict(self.stats))
        out["held"] = self.core.num_waiting
        out["batch"] = self.core.num_active
        out["kv_budget_used"] = self.core.budget.used
        out["scheduler"] = self.config.name
        return out
