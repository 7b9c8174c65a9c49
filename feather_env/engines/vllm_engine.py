"""The project's vLLM glue: one engine factory and the few things every engine user needs.

The environment's backend, the scheduler tests, the benchmarks and evaluate.py all start
their engine through :func:`build_llm` from an :class:`EngineConfig`, so that they measure
the same thing. The engine runs in-process (vLLM V1 with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
set by :func:`use_in_process_engine`) so that callers can drive ``step()`` themselves and
read the scheduler's decisions. The same module holds the rest of what touches vLLM's API:

- :func:`forced_length_params`: sampling parameters that generate exactly N tokens;
- :func:`tokens_prompt`: a token-id prompt;
- :class:`ScheduleTap`: what each ``schedule()`` of a scheduler decided;
- :func:`engine_core_of`: the in-process ``EngineCore`` of a ``vllm.LLM``;
- :func:`send_vllm_logs_to`: vLLM's log lines into a file instead of the terminal.
"""

from __future__ import annotations

import contextlib
import json
import logging
import logging.config
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from feather_env.hostload import pinned_cores
from scheduler_runtime.config import ConfigError, from_mapping, load_yaml
from scheduler_runtime.hardware import compute_dtype, kv_bytes_factor, kv_bytes_per_token, online_cores

REPO_ROOT = Path(__file__).resolve().parents[2]
#: The process environment every in-process engine of the project runs with (set before vLLM
#: is imported): scheduler and model in the calling process, so ``step()`` is synchronous and
#: the scheduler object is reachable; no tokenizer threads competing with the engine's.
ENGINE_ENVIRONMENT = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}
DEFAULT_MODEL_DIR = REPO_ROOT / "configs" / "models" / "tiny-llama"
GIB = 1 << 30


#: The model dtypes vLLM takes (its ``ModelDType``).
MODEL_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")


@dataclass(frozen=True)
class EngineConfig:
    """Everything that shapes a vLLM engine of this project.

    Attributes:
        model_dir: local model directory (``config.json`` + tokenizer); weights are
            random (``load_format="dummy"``), nothing is downloaded.
        kv_cache_gib: KV cache size, set explicitly (on the CPU backend vLLM
            otherwise reserves a fraction of *host* memory).
        max_num_seqs: maximum running batch size.
        max_num_batched_tokens: token budget of one engine step (prefill chunking).
        max_model_len: longest prompt + output accepted.
        block_size: KV block size in tokens (the CPU backend's default is 128).
        enforce_eager: skip graph capture (start ~7 s instead of ~60 s, same decode speed on CPU).
        dtype: model dtype.
        enable_prefix_caching: reuse KV blocks of shared prefixes.
        scheduler_cls: dotted path of a vLLM scheduler class (``None``: vLLM's own).
        seed: sampling seed.
        skip_tokenizer_init: token-id prompts only (no text in, no text out).
        load_format: ``"dummy"`` for random weights.
        cpu_cores: CPU backend only: the cores the engine's OpenMP threads, and the calling
            thread that drives the in-process engine, are pinned to
            (``VLLM_CPU_OMP_THREADS_BIND``, e.g. ``"1"`` or ``"0-1"``); ``None`` keeps vLLM's
            automatic binding (every physical core). Benchmarks on a shared 2-core machine pin
            one core: vLLM's threads meet at a barrier every layer, so with two threads a
            single competing process can slow a step ~10x, while a pinned single thread
            leaves the other core to the competitor.
        extra: further keyword arguments passed to ``vllm.LLM`` unchanged.
    """

    model_dir: str = str(DEFAULT_MODEL_DIR)
    kv_cache_gib: float = 4.0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    max_model_len: int = 32768
    block_size: int = 128
    enforce_eager: bool = True
    dtype: str = "bfloat16"
    enable_prefix_caching: bool = True
    scheduler_cls: str | None = None
    seed: int = 0
    skip_tokenizer_init: bool = True
    load_format: str = "dummy"
    cpu_cores: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (isinstance(self.kv_cache_gib, int | float) and 0 < self.kv_cache_gib < float("inf")):
            raise ConfigError(f"kv_cache_gib must be a finite number > 0, got {self.kv_cache_gib!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not (Path(self.model_dir) / "config.json").is_file():
            raise ConfigError(f"model_dir {self.model_dir!r} has no config.json")
        if self.dtype not in MODEL_DTYPES:
            raise ConfigError(f"dtype must be one of {list(MODEL_DTYPES)}, got {self.dtype!r}")
        if self.cpu_cores is not None and not isinstance(self.cpu_cores, str):
            raise ConfigError(f"cpu_cores must be a string like '1' or '0-1', got {self.cpu_cores!r}")
        try:
            self.cores  # noqa: B018 - parsed here, once: a bad spec is refused with the config
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    @cached_property
    def cores(self) -> tuple[int, ...] | None:
        """The cores of ``cpu_cores`` (``None``: unpinned), parsed when the config is made."""
        return pinned_cores(self.cpu_cores)

    @property
    def compute_dtype(self) -> str:
        """The dtype the engine computes in on this machine (:mod:`scheduler_runtime.hardware`:
        float32 on an AVX2-only CPU for a bfloat16 model)."""
        return compute_dtype(self.dtype)

    @property
    def kv_cache_memory_bytes(self) -> int:
        """The KV cache bytes that hold ``kv_cache_gib``'s KV tokens in :attr:`compute_dtype` (the same
        number of tokens, at float32's size where the engine computes in float32)."""
        return int(int(self.kv_cache_gib * GIB) * kv_bytes_factor(self.dtype, self.compute_dtype))

    @property
    def kv_cache_tokens(self) -> int:
        """KV capacity in tokens for the bundled model family (bytes per token from config.json)."""
        return int(self.kv_cache_gib * GIB) // kv_bytes_per_token(self.model_dir, self.dtype)

    @property
    def num_kv_blocks(self) -> int:
        """KV blocks vLLM allocates for ``kv_cache_gib`` (its ``num_gpu_blocks``, the null block included)."""
        return self.kv_cache_tokens // self.block_size

    @property
    def usable_kv_tokens(self) -> int:
        """Tokens requests can hold: every block but vLLM's null block (0 for a cache of no block)."""
        return max(0, (self.num_kv_blocks - 1) * self.block_size)

    def check_startable(self) -> None:
        """Raise a :class:`ConfigError` naming the problem where vLLM could not start this engine on
        this machine: ``cpu_cores`` that are not the machine's (``os.sched_setaffinity`` would fail),
        a KV cache that cannot hold one request of ``max_model_len`` tokens (vLLM refuses to start,
        with a message about GPU memory utilization), or a step budget below the batch size (vLLM's
        own rule). The simulator needs none of these, so a config is not refused for them when it is
        made: every engine start and every command that will start one asks, before it writes
        anything."""
        machine = online_cores() if self.cores else set()
        missing = sorted(set(self.cores or ()) - machine)
        if missing:
            raise ConfigError(f"cpu_cores {self.cpu_cores!r}: core(s) {missing} are not among this machine's "
                              f"cores ({sorted(machine)})")
        if self.usable_kv_tokens < self.max_model_len:
            blocks = -(-self.max_model_len // self.block_size) + 1  # whole blocks, and vLLM's null block
            gib = blocks * self.block_size * self.kv_cache_gib / max(self.kv_cache_tokens, 1)
            raise ConfigError(f"the KV cache ({self.kv_cache_gib:g} GiB: {self.usable_kv_tokens:,} usable "
                              f"tokens) cannot hold one request of max_model_len {self.max_model_len:,} "
                              f"tokens, and vLLM would not start: give at least {gib:.3g} GiB, or a shorter "
                              "max_model_len")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                              f"max_num_seqs ({self.max_num_seqs}), or vLLM would not start")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None, where: str = "engine") -> EngineConfig:
        data = dict(data or {})
        if "model_dir" in data:
            data["model_dir"] = str(_resolve_path(data["model_dir"]))
        return from_mapping(cls, data, where=where)

    @classmethod
    def from_yaml(cls, path: str | Path) -> EngineConfig:
        return cls.from_dict(load_yaml(path), where=str(path))


def _resolve_path(path: str | Path) -> Path:
    """Relative model paths are taken from the repository root, so configs work from any cwd."""
    p = Path(path)
    return p if p.is_absolute() or p.exists() else REPO_ROOT / p


def build_llm(config: EngineConfig | None = None, **overrides: Any):  # -> vllm.LLM
    """Start an in-process vLLM engine (``vllm.LLM``) for ``config``.

    ``overrides`` replace fields of ``config`` (validated the same way). The
    returned object's ``llm_engine`` can be stepped by the caller.
    """
    config = config or EngineConfig()
    if overrides:
        config = EngineConfig.from_dict({**config.to_dict(), **overrides})
    config.check_startable()
    use_in_process_engine()
    if config.cpu_cores is not None:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = config.cpu_cores
        # The in-process engine computes in this very thread (the OpenMP master): pin it too, or
        # it runs, and is slowed, wherever the scheduler puts it.
        cores = config.cores
        if cores and hasattr(os, "sched_setaffinity"):
            try:
                os.sched_setaffinity(0, cores)
            except OSError as exc:  # a cpuset (a container's) that leaves this process other cores
                raise ConfigError(f"cpu_cores {config.cpu_cores!r}: this process may not run there "
                                  f"({exc})") from None
        # One intra-op thread per pinned core. vLLM cannot change torch's thread count once it has
        # bound its threads, so a process that imported torch earlier (stable-baselines3 does) kept
        # two threads on one core, which meet at a barrier in every layer: an episode took 161 s
        # instead of 10 s.
        import torch

        torch.set_num_threads(max(1, len(cores)))
    from vllm import LLM

    kwargs: dict[str, Any] = dict(
        model=config.model_dir,
        load_format=config.load_format,
        dtype=config.compute_dtype,
        kv_cache_memory_bytes=config.kv_cache_memory_bytes,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=config.max_model_len,
        block_size=config.block_size,
        enforce_eager=config.enforce_eager,
        enable_prefix_caching=config.enable_prefix_caching,
        seed=config.seed,
        skip_tokenizer_init=config.skip_tokenizer_init,
        disable_log_stats=False,
    )
    if config.scheduler_cls:
        kwargs["scheduler_cls"] = config.scheduler_cls
    if _vllm_log_config is not None:
        from vllm.config.logging import LoggingConfig

        kwargs["logging_config"] = LoggingConfig(pylogging_config_file=str(_vllm_log_config))
    kwargs.update(config.extra)
    with contextlib.ExitStack() as stack:
        if _vllm_log_config is not None:
            stack.enter_context(_native_stderr_to(_vllm_log_file()))
        if config.skip_tokenizer_init:
            stack.enter_context(_no_chat_template_warmup())
        return LLM(**kwargs)


@contextlib.contextmanager
def _no_chat_template_warmup() -> Iterator[None]:
    """Build an engine without the chat-template part of ``LLM()``'s renderer warm-up.

    ``LLM.__init__`` warms up its renderer by rendering a chat message, which needs the
    tokenizer; an engine told not to load one (``skip_tokenizer_init``: token ids in and out,
    as every engine of this project) has none, so vLLM logged ``ValueError: Tokenizer not
    available when skip_tokenizer_init=True`` with a traceback at every start. Such an engine
    never renders a chat, so while it is built the warm-up skips that step when the renderer
    has no tokenizer, and still runs the rest (the multimodal warm-up; nothing for this model).
    """
    from vllm.renderers.base import BaseRenderer

    original = BaseRenderer.warmup

    def warmup(self: Any, chat_params: Any) -> None:
        if self.tokenizer is not None:
            original(self, chat_params)
            return
        if self._mm_warmup_future is not None:
            self._join_mm_warmup()
        self.warmup_mm()

    BaseRenderer.warmup = warmup
    try:
        yield
    finally:
        BaseRenderer.warmup = original


#: The dictConfig file that sends vLLM's log records to a file (:func:`send_vllm_logs_to`).
_vllm_log_config: Path | None = None


def send_vllm_logs_to(log_file: str | Path | None) -> Path | None:
    """From now on, vLLM's log records go to ``log_file`` (appended) instead of the terminal.

    For command lines that print their own progress: vLLM logs tens of INFO and WARNING lines per
    engine start. It uses vLLM's own mechanism, a ``logging.config.dictConfig`` file
    (``VLLM_LOGGING_CONFIG_PATH``, read when vLLM is imported, and ``LoggingConfig`` given to every
    engine :func:`build_llm` starts), written next to the log and applied at once; Python warnings
    raised meanwhile go to the same file, and so does what native code writes to stderr while an
    engine starts. ``None`` puts vLLM's own configuration back (its lines on the terminal).

    Returns the path of the dictConfig file (``None`` when restoring).
    """
    global _vllm_log_config
    if log_file is None:
        if _vllm_log_config is not None:
            _vllm_log_config = None
            os.environ.pop("VLLM_LOGGING_CONFIG_PATH", None)
            logging.captureWarnings(False)
            if "vllm.logger" in sys.modules:
                from vllm.config.logging import LoggingConfig
                from vllm.logger import configure_logging

                configure_logging(LoggingConfig(pylogging_config_file=None))
        return None
    log_file = Path(log_file).resolve()
    log_file.parent.mkdir(parents=True, exist_ok=True)
    handler = {"class": "logging.FileHandler", "filename": str(log_file), "mode": "a",
               "formatter": "plain", "encoding": "utf-8"}
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "%(levelname)s %(asctime)s [%(name)s] %(message)s"}},
        "handlers": {"file": handler},
        "loggers": {"vllm": {"handlers": ["file"], "level": "INFO", "propagate": False},
                    "py.warnings": {"handlers": ["file"], "level": "WARNING", "propagate": False}},
    }
    path = log_file.with_name(log_file.name + ".config.json")
    path.write_text(json.dumps(config, indent=1) + "\n")
    _vllm_log_config = path
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(path)
    logging.captureWarnings(True)
    # Now too: vLLM may already be configured, and some of its modules log at import time,
    # before vLLM reads the file.
    logging.config.dictConfig(config)
    return path


def _vllm_log_file() -> Path:
    assert _vllm_log_config is not None
    return _vllm_log_config.with_name(_vllm_log_config.name.removesuffix(".config.json"))


@contextlib.contextmanager
def _native_stderr_to(path: Path) -> Iterator[None]:
    """File descriptor 2 goes to ``path`` while inside (torch's C++ warnings bypass ``logging``)."""
    fd = 2
    sys.stderr.flush()
    saved = os.dup(fd)
    with open(path, "ab") as target:
        os.dup2(target.fileno(), fd)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, fd)
        os.close(saved)


class EngineError(RuntimeError):
    """The engine failed, or did not serve its requests exactly once with their tokens."""


def use_in_process_engine() -> None:
    """Set :data:`ENGINE_ENVIRONMENT` (values already set by the user win).

    Call it before vLLM is imported: command lines call it at the top, :func:`build_llm`
    calls it too.
    """
    for key, value in ENGINE_ENVIRONMENT.items():
        os.environ.setdefault(key, value)


def engine_core_of(llm: Any) -> Any:
    """The in-process ``EngineCore`` of a ``vllm.LLM`` (needs :func:`use_in_process_engine`)."""
    client = llm.llm_engine.engine_core
    core = getattr(client, "engine_core", None)
    if core is None:
        raise EngineError(
            "the vLLM engine runs in a separate process; set VLLM_ENABLE_V1_MULTIPROCESSING=0 "
            "before vLLM is imported (feather_env.engines.vllm_engine.use_in_process_engine does this)"
        )
    return core


def shutdown_engine(llm: Any) -> None:
    """Shut an in-process engine down; best effort (closing must not mask an earlier error)."""
    try:
        engine_core_of(llm).shutdown()
    except Exception:  # noqa: BLE001 - the caller may be handling the error that brought it here
        pass


def forced_length_params(output_len: int, *, extra_args: Mapping[str, Any] | None = None,
                         delta: bool = False) -> Any:
    """``SamplingParams`` that generate exactly ``output_len`` tokens (token ids only).

    ``min_tokens == max_tokens`` with ``ignore_eos``: a benchmark request's length is its own,
    whatever the random weights sample. ``extra_args`` reach the scheduler (the Feather hints);
    ``delta``: each output carries only the new tokens (streaming consumers).
    """
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    n = int(output_len)
    kwargs: dict[str, Any] = {}
    if delta:
        kwargs["output_kind"] = RequestOutputKind.DELTA
    return SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, detokenize=False,
                          temperature=0.0, extra_args=dict(extra_args) if extra_args else None,
                          **kwargs)


def tokens_prompt(token_ids: Sequence[int] | Any) -> Any:
    """A vLLM prompt of token ids (a numpy array or any sequence of ints)."""
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=[int(t) for t in token_ids])


class ScheduleTap:
    """What the last ``schedule()`` of a vLLM scheduler decided (vLLM's internal request ids).

    Installed once per scheduler instance (:meth:`on`), wrapping its ``schedule``: every user
    of one engine reads the same tap. ``called`` says whether ``schedule()`` ran since
    :meth:`reset`; ``preempted`` counts preemptions since the tap was installed.
    """

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        #: Also record, per scheduled request, its tokens in the KV cache before the step, its
        #: first KV block and its prompt length (``detail``); off by default (it costs a dict
        #: lookup per scheduled request).
        self.record_detail = False
        self.detail: dict[str, tuple[int, int, int]] = {}
        self.called = False
        self.new: list[tuple[str, int]] = []  # (request id, prefix-cache hit tokens) admitted
        self.num_scheduled: dict[str, int] = {}
        self.scheduled_reqs = 0
        self.scheduled_tokens = 0
        self.running = 0
        self.preempted = 0
        original = scheduler.schedule

        def schedule(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            self.called = True
            self.new = [(r.req_id, int(r.num_computed_tokens)) for r in out.scheduled_new_reqs]
            self.num_scheduled = dict(out.num_scheduled_tokens)
            self.scheduled_reqs = len(out.num_scheduled_tokens)
            self.scheduled_tokens = int(out.total_num_scheduled_tokens)
            self.running = len(scheduler.running)
            self.preempted += len(out.preempted_req_ids or ())
            if self.record_detail:
                requests, manager = scheduler.requests, scheduler.kv_cache_manager
                detail = {}
                for rid, n in self.num_scheduled.items():
                    req = requests[rid]
                    blocks = manager.get_block_ids(rid)[0]
                    # schedule() already advanced num_computed_tokens by the scheduled tokens
                    detail[rid] = (req.num_computed_tokens - n, blocks[0] if blocks else -1,
                                   req.num_prompt_tokens)
                self.detail = detail
            return out

        scheduler.schedule = schedule

    @classmethod
    def on(cls, scheduler: Any) -> ScheduleTap:
        """The scheduler's tap, installed on first use."""
        tap = scheduler.__dict__.get("_feather_schedule_tap")
        if tap is None:
            tap = cls(scheduler)
            scheduler._feather_schedule_tap = tap
        return tap

    def reset(self) -> None:
        self.called = False
        self.new = []
        self.num_scheduled = {}
        self.detail = {}
        self.scheduled_reqs = self.scheduled_tokens = self.running = 0

    @property
    def decode_only(self) -> bool:
        """The last step scheduled one token for each of its requests and admitted none."""
        return self.scheduled_reqs > 0 and not self.new and self.scheduled_tokens == self.scheduled_reqs
