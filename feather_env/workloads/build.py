"""One config object for every workload kind, and :func:`build_workload` that turns it into one.

A run's ``workload:`` section (YAML) becomes a :class:`WorkloadConfig` through
:func:`scheduler_runtime.config.from_mapping`, so a misspelt key is an error listing the valid ones.
``build_workload`` then loads the data, samples the episode's requests and assigns arrivals,
in that order:

1. load: ``leval`` | ``longbench`` | ``sharegpt`` | ``splitwise`` | ``arxiv`` (the three vidur
   CSVs in the data's ``traces/``) | ``synthetic`` | ``custom`` (your own requests: ``path``, a
   JSON-lines or CSV file, or with ``format: mooncake`` a Mooncake trace,
   :mod:`feather_env.workloads.custom`);
2. ``num_groups`` (with ``max_per_group``): keep that many whole prefix groups (for
   ``synthetic`` it is the number of groups generated, unless the caller samples them from the
   pool: a scenario's ``episode.groups``);
3. ``num_requests``: keep that many requests at random;
4. ``arrival``: ``"burst"`` | ``"poisson:RATE"`` | ``"trace"``; ``None`` means ``"trace"``
   for a workload with its own timestamps (splitwise, a custom file with timestamps) and
   ``"burst"`` otherwise.

Every step is seeded by ``seed``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

from feather_env.workloads.arrivals import parse_arrival
from feather_env.workloads.custom import MOONCAKE_BLOCK_TOKENS, ROW_FORMATS, load_custom, resolve_custom_path
from feather_env.workloads.datadir import resolve_data_dir
from feather_env.workloads.leval import DEFAULT_INSTRUCTION_TEMPLATE, load_leval
from feather_env.workloads.longbench import load_longbench
from feather_env.workloads.synthetic import parse_length_spec, synthetic_workload
from feather_env.workloads.tokenizer import load_tokenizer
from feather_env.workloads.traces import TRACE_FILES, load_trace
from feather_env.workloads.workload import Workload
from scheduler_runtime.config import ConfigError, from_mapping

WORKLOAD_KINDS = ("leval", "longbench", *TRACE_FILES, "synthetic", "custom")
DEFAULT_MAX_OUTPUT_TOKENS = {"leval": 512}


@dataclass(frozen=True)
class WorkloadConfig:
    """Every knob of a workload.

    Attributes:
        kind: ``leval`` | ``longbench`` | ``sharegpt`` | ``splitwise`` | ``arxiv`` | ``synthetic`` |
            ``custom``.
        path: ``custom`` only: the JSON-lines or CSV file of requests (a scenario resolves a
            relative path against its own folder, else under the data root).
        data_dir: data root (or the kind's own folder); ``None``: ``$FEATHER_DATA_DIR``, else
            ``../shared/data`` beside the repository.
        tasks: L-Eval / LongBench task names (``None``: all).
        max_prompt_tokens: prompt cap (``None``: none); ``overflow`` decides what happens above it.
        max_output_tokens: output cap; ``None``: 512 for L-Eval (the L-Eval baselines' cap),
            the task's max new tokens for LongBench, none for traces and synthetic.
        overflow: ``"truncate"`` or ``"error"``.
        arrival: ``"burst"`` | ``"poisson:RATE"`` | ``"trace"`` | ``None`` (see module docstring).
        num_requests: keep this many requests at random (``None``: all).
        num_groups: keep this many whole prefix groups (synthetic: groups to generate).
        max_per_group: at most this many requests per kept group.
        seed: seeds content, sampling and arrivals.
        instruction_template: L-Eval question template (``{instruction}``).
        tokens_per_word, tokens_per_char_zh, output, group_size, question_tokens: LongBench
            (see :func:`~feather_env.workloads.longbench.load_longbench`).
        per_group, prefix_len, suffix_len, output_len: synthetic lengths (int or spec such as
            ``"uniform:LO:HI"``, see :func:`~feather_env.workloads.synthetic.parse_length_spec`).
        vocab_size: range of synthetic token ids, ``[3, vocab_size)``.
        format: ``custom`` only: ``"requests"`` (a prompt per row) or ``"mooncake"`` (a Mooncake
            trace: lengths and block hash ids, see :mod:`feather_env.workloads.custom`).
        block_tokens: ``format: mooncake`` only: tokens per hash id (default 512, the trace's own
            lengths; less scales every length by ``block_tokens / 512``).
    """

    kind: str = "leval"
    path: str | None = None
    data_dir: str | None = None
    tasks: tuple[str, ...] | None = None
    max_prompt_tokens: int | None = 16384
    max_output_tokens: int | None = None
    overflow: str = "truncate"
    arrival: str | None = None
    num_requests: int | None = None
    num_groups: int | None = None
    max_per_group: int | None = None
    seed: int = 0
    instruction_template: str = DEFAULT_INSTRUCTION_TEMPLATE
    tokens_per_word: float = 1.3
    tokens_per_char_zh: float = 1.0
    output: str = "answer"
    group_size: int = 1
    question_tokens: int = 32
    per_group: int | str = 8
    prefix_len: int | str = 4000
    suffix_len: int | str = 20
    output_len: int | str = 128
    vocab_size: int = 8192
    format: str = "requests"
    block_tokens: int = MOONCAKE_BLOCK_TOKENS

    def __post_init__(self) -> None:
        if self.kind not in WORKLOAD_KINDS:
            raise ConfigError(
                f"workload.kind: unknown kind {self.kind!r}; valid: {list(WORKLOAD_KINDS)} "
                "(your own requests: kind: custom, path: FILE)"
            )
        if self.kind == "custom" and not self.path:
            raise ConfigError("workload.path: kind custom reads your requests from a file: give its path "
                              "(JSON lines or CSV)")
        if self.kind != "custom" and self.path is not None:
            raise ConfigError(f"workload.path is for kind custom (your own requests), not {self.kind!r}")
        if self.format not in ROW_FORMATS:
            raise ConfigError(f"workload.format must be one of {list(ROW_FORMATS)}, got {self.format!r}")
        if self.kind != "custom" and self.format != "requests":
            raise ConfigError(f"workload.format is for kind custom (a file of requests), not {self.kind!r}")
        if (isinstance(self.block_tokens, bool) or not isinstance(self.block_tokens, int)
                or self.block_tokens < 1):
            raise ConfigError(f"workload.block_tokens must be an integer >= 1, got {self.block_tokens!r}")
        if self.format != "mooncake" and self.block_tokens != MOONCAKE_BLOCK_TOKENS:
            raise ConfigError(f"workload.block_tokens (tokens per hash id of a Mooncake trace) is for "
                              f"format: mooncake, not {self.format!r}")
        if self.overflow not in ("truncate", "error"):
            raise ConfigError(
                f"workload.overflow must be 'truncate' or 'error', got {self.overflow!r}"
            )
        if self.output not in ("answer", "max"):
            raise ConfigError(f"workload.output must be 'answer' or 'max', got {self.output!r}")
        if isinstance(self.tasks, str):
            object.__setattr__(self, "tasks", (self.tasks,))
        for name in (
            "num_requests",
            "num_groups",
            "max_per_group",
            "max_prompt_tokens",
            "max_output_tokens",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"workload.{name} must be >= 1 or null, got {value}")
        for name in ("group_size", "vocab_size"):
            if getattr(self, name) < (1 if name == "group_size" else 4):
                raise ConfigError(f"workload.{name} must be >= {1 if name == 'group_size' else 4}, "
                                  f"got {getattr(self, name)}")
        if self.seed < 0 or self.question_tokens < 0:
            raise ConfigError(f"workload.seed and workload.question_tokens must be >= 0, got "
                              f"{self.seed} and {self.question_tokens}")
        for name in ("tokens_per_word", "tokens_per_char_zh"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"workload.{name} must be a finite number > 0, got {value!r}")
        if self.arrival is not None:
            parse_arrival(self.arrival)
        for name in ("per_group", "prefix_len", "suffix_len", "output_len"):
            parse_length_spec(getattr(self, name), name=f"workload.{name}")

    @classmethod
    def from_mapping(
        cls, data: Mapping[str, Any] | None, where: str = "workload"
    ) -> WorkloadConfig:
        """From a dict or YAML section; unknown keys raise :class:`ConfigError` (lists keys)."""
        return from_mapping(cls, data, where=where)


def build_workload(
    cfg: WorkloadConfig | Mapping[str, Any], tokenizer: Tokenizer | None = None
) -> Workload:
    """Load, sample and time a workload as ``cfg`` says (see the module docstring).

    ``tokenizer`` (default: the bundled one) encodes L-Eval text and LongBench answers.
    """
    if not isinstance(cfg, WorkloadConfig):
        cfg = WorkloadConfig.from_mapping(cfg)
    return sample_workload(load_workload(cfg, tokenizer), cfg)


def load_workload(cfg: WorkloadConfig, tokenizer: Tokenizer | None = None, *,
                  model_dir: str | os.PathLike[str] | None = None, max_request_tokens: int | None = None,
                  capacity_note: str = "") -> Workload:
    """Step 1 of :func:`build_workload`: every request of the data, as ``cfg`` caps them.

    ``model_dir``: the model whose tokenizer, vocabulary and context a custom file is read with
    (default: the bundled one). ``max_request_tokens``: prompt + output tokens a request may hold
    (a scenario's KV cache; ``capacity_note`` describes it): a custom file or a synthetic workload
    with a larger request raises before the pool is built.
    """
    max_out = cfg.max_output_tokens
    if max_out is None:
        max_out = DEFAULT_MAX_OUTPUT_TOKENS.get(cfg.kind)
    if cfg.kind == "leval":
        workload = load_leval(
            cfg.data_dir,
            tokenizer if tokenizer is not None else load_tokenizer(),
            tasks=cfg.tasks,
            max_prompt_tokens=cfg.max_prompt_tokens,
            max_output_tokens=max_out,
            overflow=cfg.overflow,
            instruction_template=cfg.instruction_template,
            output=cfg.output,
        )
    elif cfg.kind == "longbench":
        workload = load_longbench(
            cfg.data_dir,
            tasks=cfg.tasks,
            tokenizer=tokenizer if tokenizer is not None else load_tokenizer(),
            tokens_per_word=cfg.tokens_per_word,
            tokens_per_char_zh=cfg.tokens_per_char_zh,
            output=cfg.output,
            max_output_tokens=max_out,
            group_size=cfg.group_size,
            question_tokens=cfg.question_tokens,
            seed=cfg.seed,
            max_prompt_tokens=cfg.max_prompt_tokens,
            overflow=cfg.overflow,
            vocab_size=cfg.vocab_size,
        )
    elif cfg.kind in TRACE_FILES:
        workload = load_trace(
            resolve_data_dir(cfg.data_dir, "traces") / TRACE_FILES[cfg.kind],
            max_prompt_tokens=cfg.max_prompt_tokens,
            max_output_tokens=max_out,
            overflow=cfg.overflow,
            seed=cfg.seed,
            vocab_size=cfg.vocab_size,
            name=cfg.kind,
        )
    elif cfg.kind == "custom":
        assert cfg.path is not None
        workload = load_custom(
            resolve_custom_path(cfg.path, data_dir=cfg.data_dir),
            tokenizer=tokenizer,
            model_dir=model_dir,
            max_prompt_tokens=cfg.max_prompt_tokens,
            max_output_tokens=max_out,
            overflow=cfg.overflow,
            max_request_tokens=max_request_tokens,
            capacity_note=capacity_note,
            format=cfg.format,
            block_tokens=cfg.block_tokens,
        )
    else:
        workload = synthetic_workload(
            cfg.num_groups if cfg.num_groups is not None else 8,
            cfg.per_group,
            cfg.prefix_len,
            cfg.suffix_len,
            cfg.output_len,
            seed=cfg.seed,
            vocab_size=cfg.vocab_size,
            max_prompt_tokens=cfg.max_prompt_tokens,
            max_output_tokens=max_out,
            overflow=cfg.overflow,
            max_request_tokens=max_request_tokens,
            capacity_note=capacity_note,
        )
    return workload


def sample_workload(workload: Workload, cfg: WorkloadConfig, *, groups_from_pool: bool | None = None
                    ) -> Workload:
    """Steps 2-4 of :func:`build_workload`: the groups, requests and arrivals ``cfg`` asks for.

    ``groups_from_pool``: whether ``cfg.num_groups`` samples whole groups of ``workload`` (default:
    for every kind but ``synthetic``, whose ``num_groups`` is what it generated).
    """
    if groups_from_pool is None:
        groups_from_pool = cfg.kind != "synthetic"
    if cfg.num_groups is not None and groups_from_pool:
        workload = workload.sample_groups(cfg.num_groups, cfg.seed, cfg.max_per_group)
    elif cfg.max_per_group is not None:
        workload = workload.sample_groups(workload.num_groups, cfg.seed, cfg.max_per_group)
    if cfg.num_requests is not None:
        workload = workload.sample(cfg.num_requests, cfg.seed)
    arrival = cfg.arrival
    if arrival is None:
        arrival = "trace" if workload.arrivals == "trace" else "burst"
    return workload.with_arrivals(parse_arrival(arrival), cfg.seed)
