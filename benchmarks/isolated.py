"""The paper's isolated-batch experiment: run one formed batch to completion and measure it.

Feather's paper measures the decode throughput of a batch formed in isolation, its prefixes
warmed first; :class:`IsolatedBatchRunner` does that on the real vLLM V1 engine, in-process,
and measures decode throughput from the engine steps that schedule no prefill token (prefill
time is reported apart). ``benchmarks/prefix_homogeneity.py`` is built on it. It is not the
environment: the environment serves whole episodes through continuous batching
(:mod:`feather_env.serving`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from feather_env.engines.vllm_engine import (
    EngineConfig,
    EngineError,
    ScheduleTap,
    build_llm,
    engine_core_of,
    forced_length_params,
    shutdown_engine,
    tokens_prompt,
)
from feather_env.hostload import ForeignLoad, wait_for_quiet
from feather_env.workloads.request import Request


@dataclass
class BatchResult:
    """What running one batch cost.

    Attributes:
        num_requests: requests in the batch.
        decode_tokens: tokens generated in decode-only steps (the throughput numerator).
        decode_seconds: wall time of the decode-only steps.
        prefill_seconds: wall time of steps that scheduled any prefill token.
        output_tokens: all tokens generated (including the first token of each request).
        prompt_tokens: prompt tokens of the batch.
        prefix_hit_tokens: prompt tokens served from the prefix cache.
        kv_blocks_used: peak KV blocks held during the batch.
        step_times: wall time of each decode-only step (seconds).
        step_batch_sizes: running requests in each decode-only step.
        foreign_cpu: CPU time other processes used during the batch, as a fraction of the
            machine (see :mod:`feather_env.hostload`); timings above ~0.05 are suspect.
    """

    num_requests: int
    decode_tokens: int
    decode_seconds: float
    prefill_seconds: float
    output_tokens: int
    prompt_tokens: int
    prefix_hit_tokens: int = 0
    kv_blocks_used: int = 0
    step_times: list[float] = field(default_factory=list)
    step_batch_sizes: list[int] = field(default_factory=list)
    foreign_cpu: float = 0.0

    @property
    def decode_tok_s(self) -> float:
        """Decode throughput (tokens/s) over decode-only steps; 0 when there were none."""
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def total_seconds(self) -> float:
        return self.decode_seconds + self.prefill_seconds

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["decode_tok_s"] = self.decode_tok_s
        return d


class IsolatedBatchRunner:
    """Runs batches on a real in-process vLLM engine, one batch at a time.

    The engine is built once and reused across batches and episodes. A batch runs
    to completion before ``run_batch`` returns, so nothing leaks into the next one.

    Args:
        engine: engine configuration (``max_num_seqs`` bounds the batch size).
        warm_prefixes: before timing a batch, prefill each prefix group's common
            prefix once, so the timed batch only prefills its unique suffixes (the
            paper measured an isolated decode loop). Decode throughput is measured
            over decode-only steps either way; warming makes that window cover the
            whole batch instead of its tail.
        reset_prefix_cache: drop the prefix cache before each batch (each batch then
            pays its full prefill; off by default, as in a serving engine).
        llm: an already built ``vllm.LLM`` to reuse (e.g. one per test session).
    """

    def __init__(
        self,
        engine: EngineConfig | None = None,
        *,
        warm_prefixes: bool = True,
        reset_prefix_cache: bool = False,
        llm: Any = None,
    ) -> None:
        self.engine_config = engine or EngineConfig()
        self.warm_prefixes = warm_prefixes
        self.reset_prefix_cache = reset_prefix_cache
        self.llm = llm if llm is not None else build_llm(self.engine_config)
        self._engine = self.llm.llm_engine
        core = engine_core_of(self.llm)
        self._scheduler = core.scheduler
        self._tap = ScheduleTap.on(self._scheduler)
        self._batch_no = 0
        self._closed = False

    # -- public ---------------------------------------------------------------
    @property
    def max_batch_size(self) -> int:
        return self.engine_config.max_num_seqs

    @property
    def kv_capacity_tokens(self) -> int:
        """KV cache capacity in tokens, as the engine allocated it."""
        pool = self._scheduler.kv_cache_manager.block_pool
        return (pool.num_gpu_blocks - 1) * self.engine_config.block_size

    def run_batch(self, requests: Sequence[Request]) -> BatchResult:
        """Run ``requests`` as one batch to completion and measure it.

        Raises:
            ValueError: empty batch, duplicate ids, batch larger than ``max_num_seqs``,
                or a request longer than the engine's ``max_model_len``.
            EngineError: the engine failed or did not return every request exactly once
                with its requested number of tokens.
        """
        if self._closed:
            raise EngineError("backend is closed")
        self._validate(requests)
        if self._engine.has_unfinished_requests():
            raise EngineError("engine has unfinished requests from elsewhere; batches must be isolated")
        self._batch_no += 1
        tag = f"b{self._batch_no}"
        try:
            if self.reset_prefix_cache:
                self.llm.reset_prefix_cache()
            if self.warm_prefixes:
                self._warm(requests, tag)
            with ForeignLoad() as load:
                result = self._run(requests, tag)
            result.foreign_cpu = load.fraction
            return result
        except EngineError:
            self._abort_all()
            raise
        except Exception as exc:  # engine internals: report which batch failed and why
            self._abort_all()
            raise EngineError(f"vLLM engine failed during batch {tag} "
                              f"({len(requests)} requests): {exc!r}") from exc

    def run_batch_quiet(self, requests: Sequence[Request], *, max_foreign: float = 0.05,
                        retries: int = 3, wait_s: float = 120.0) -> BatchResult:
        """Benchmarks: wait until the machine is quiet, run, and re-run a batch that ran under load.

        Returns the run with the least foreign load (its ``foreign_cpu`` says how clean it was).
        """
        best: BatchResult | None = None
        for _ in range(retries + 1):
            wait_for_quiet(max_foreign, timeout_s=wait_s)
            result = self.run_batch(requests)
            if best is None or result.foreign_cpu < best.foreign_cpu:
                best = result
            if result.foreign_cpu <= max_foreign:
                break
        assert best is not None
        return best

    def warmup(self, batch_size: int = 8, prompt_len: int = 512, output_len: int = 8) -> None:
        """Run a throw-away batch: the first steps after start-up are much slower than steady state."""
        rng = np.random.default_rng(12345)
        self.run_batch([Request(f"warmup{i}", rng.integers(3, 8192, prompt_len), -1, output_len)
                        for i in range(min(batch_size, self.max_batch_size))])

    def close(self) -> None:
        """Release the engine (the process can build a new one afterwards)."""
        if self._closed:
            return
        self._closed = True
        shutdown_engine(self.llm)
        self.llm = None
        self._engine = None

    # -- internals ------------------------------------------------------------
    def _validate(self, requests: Sequence[Request]) -> None:
        if not requests:
            raise ValueError("empty batch")
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError("duplicate request ids in batch")
        if len(requests) > self.engine_config.max_num_seqs:
            raise ValueError(f"batch of {len(requests)} exceeds max_num_seqs="
                             f"{self.engine_config.max_num_seqs}")
        limit = self.engine_config.max_model_len
        for r in requests:
            if r.peak_tokens > limit:
                raise ValueError(f"request {r.request_id!r}: prompt {r.prompt_len} + output "
                                 f"{r.output_len} tokens exceeds max_model_len={limit}")

    def _warm(self, requests: Sequence[Request], tag: str) -> None:
        """Prefill each group's common prefix once (one token generated, discarded)."""
        prefixes = common_prefixes(requests)
        for i, prefix in enumerate(prefixes):
            self._engine.add_request(f"{tag}-warm{i}", tokens_prompt(prefix), forced_length_params(1))
        while self._engine.has_unfinished_requests():
            self._engine.step()

    def _run(self, requests: Sequence[Request], tag: str) -> BatchResult:
        expected = {f"{tag}-{r.request_id}": r.output_len for r in requests}
        for r in requests:
            self._engine.add_request(f"{tag}-{r.request_id}", tokens_prompt(r.prompt_token_ids),
                                     forced_length_params(r.output_len))
        pool = self._scheduler.kv_cache_manager.block_pool
        decode_tokens = 0
        decode_s = prefill_s = 0.0
        hits = 0
        peak_blocks = 0
        step_times: list[float] = []
        step_sizes: list[int] = []
        produced: dict[str, int] = {}
        max_steps = 4 * (sum(expected.values()) + sum(r.prompt_len for r in requests)) + 100
        for _ in range(max_steps):
            if not self._engine.has_unfinished_requests():
                break
            tap = self._tap
            tap.reset()
            t0 = time.perf_counter()
            outputs = self._engine.step()
            dt = time.perf_counter() - t0
            peak_blocks = max(peak_blocks, pool.num_gpu_blocks - pool.get_num_free_blocks())
            if tap.called and tap.scheduled_reqs:
                hits += sum(hit for _, hit in tap.new)
                if tap.decode_only:
                    decode_tokens += tap.scheduled_reqs
                    decode_s += dt
                    step_times.append(dt)
                    step_sizes.append(tap.scheduled_reqs)
                else:
                    prefill_s += dt
            for out in outputs:
                if not out.finished:
                    continue
                if out.request_id in produced:
                    raise EngineError(f"request {out.request_id} finished twice")
                produced[out.request_id] = len(out.outputs[0].token_ids)
        else:
            raise EngineError(f"batch {tag} did not finish within {max_steps} engine steps")
        missing = sorted(set(expected) - set(produced))
        if missing:
            raise EngineError(f"batch {tag}: {len(missing)} requests never finished: {missing[:5]}")
        wrong = {k: (produced[k], v) for k, v in expected.items() if produced[k] != v}
        if wrong:
            raise EngineError(f"batch {tag}: wrong token counts (got, want): {dict(list(wrong.items())[:5])}")
        return BatchResult(
            num_requests=len(requests),
            decode_tokens=decode_tokens,
            decode_seconds=decode_s,
            prefill_seconds=prefill_s,
            output_tokens=sum(produced.values()),
            prompt_tokens=sum(r.prompt_len for r in requests),
            prefix_hit_tokens=hits,
            kv_blocks_used=peak_blocks,
            step_times=step_times,
            step_batch_sizes=step_sizes,
        )

    def _abort_all(self) -> None:
        """Leave the engine empty after a failure so the next batch starts clean."""
        try:
            # The scheduler keys requests by internal id; the output processor by ours.
            internal = list(self._scheduler.requests)
            if internal:
                self._engine.abort_request(internal, internal=True)
            if self._engine.has_unfinished_requests():
                self._engine.abort_request(list(self._engine.output_processor.request_states))
        except Exception:  # noqa: BLE001 - best effort; the original error is re-raised
            pass


def prefix_groups(requests: Sequence[Request]) -> list[tuple[list[int], int]]:
    """Group the batch by prefix group: ``(member indices, their common prefix length)``.

    Groups come in first-seen order; a request without a group (``prefix_group < 0``)
    is a group of its own. A group of one request has common prefix length 0.
    """
    members: dict[int, list[int]] = {}
    for i, r in enumerate(requests):
        key = r.prefix_group if r.prefix_group >= 0 else -1 - i
        members.setdefault(key, []).append(i)
    out = []
    for idx in members.values():
        first = requests[idx[0]].prompt_token_ids
        n = first.size if len(idx) > 1 else 0
        for j in idx[1:]:
            other = requests[j].prompt_token_ids
            m = min(n, other.size)
            diff = np.flatnonzero(first[:m] != other[:m])
            n = int(diff[0]) if diff.size else m
        out.append((idx, n))
    return out


def common_prefixes(requests: Sequence[Request]) -> list[list[int]]:
    """Token prefix to warm for each prefix group of ``requests`` (first-seen order).

    A group's longest common prefix; a group of one request yields its whole prompt
    minus the last token (vLLM always computes the last prompt token).
    """
    out = []
    for idx, n in prefix_groups(requests):
        first = requests[idx[0]].prompt_token_ids
        n = n if len(idx) > 1 else first.size - 1
        if n > 0:
            out.append(first[:n].tolist())
    return out
