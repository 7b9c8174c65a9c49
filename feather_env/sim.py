"""A fast simulator of the real engine: predicts a batch's :class:`BatchResult` from its composition.

The cost model is fitted to measurements of :class:`~feather_env.backends.VLLMBackend`
by :mod:`feather_env.calibrate`; its error on fresh compositions is measured there too.

Decode step time (one token for every running request) is modelled as::

    t_step = c0 + c1 * B + c2 * T + c3 * M

with B the running requests, T the KV tokens they reference (sum of context lengths)
and M the KV tokens that miss a last-level cache of ``cache_tokens`` tokens when the
batch is walked in its order (an LRU reuse-distance model: a group's shared prefix is a
hit when it was read recently enough, every request's own tokens are a miss). M is what
makes a prefix-homogeneous batch cheap: its shared prefix is read once per layer and
then served from cache, while a heterogeneous batch in arrival order streams each
document from DRAM again and again. ``cache_tokens`` is fitted by grid search, the
coefficients by least squares.

Prefill (the batch's uncached prompt tokens, chunked by the engine's token budget)::

    t_prefill = p0 * steps + p1 * N + p2 * sum_i(n_i * s_i)

with N the uncached tokens, n_i and s_i each request's uncached and total prompt tokens.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from feather_env.backends import BatchResult, prefix_groups
from feather_env.workloads.request import Request
from scheduler_runtime.config import ConfigError

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PROFILE = REPO_ROOT / "configs" / "profiles" / "cpu-tiny-llama.json"
PROFILE_VERSION = 1
#: Batches up to this size are simulated in plain Python (same model, less overhead).
SMALL_BATCH = 16


@dataclass
class CostModel:
    """Fitted coefficients (seconds) of the decode-step and prefill models above."""

    cache_tokens: float
    decode: tuple[float, float, float, float]  # c0, c1 (per request), c2 (per KV token), c3 (per miss)
    prefill: tuple[float, float, float]  # p0 (per step), p1 (per token), p2 (per token x context)
    block_size: int = 128
    max_num_batched_tokens: int = 16384


@dataclass
class Composition:
    """A batch as the cost model sees it (in batch order)."""

    prompt: np.ndarray  # prompt tokens per request
    shared: np.ndarray  # tokens of the request's group prefix shared inside the batch (block-aligned)
    group: np.ndarray  # group index per request (0..G-1), in batch order
    output: np.ndarray  # output tokens per request


def composition_of(requests: Sequence[Request], block_size: int = 128) -> Composition:
    """Shared prefix per request = its group's common prefix in the batch, cut to whole blocks."""
    group = np.empty(len(requests), dtype=np.int64)
    shared = np.zeros(len(requests), dtype=np.int64)
    for g, (idx, lcp) in enumerate(prefix_groups(requests)):
        group[idx] = g
        shared[idx] = (lcp // block_size) * block_size
    prompt = np.array([r.prompt_len for r in requests], dtype=np.int64)
    output = np.array([r.output_len for r in requests], dtype=np.int64)
    return Composition(prompt=prompt, shared=np.minimum(shared, prompt), group=group, output=output)


def prefix_miss_flags(comp: Composition, cache_tokens: float, active: np.ndarray | None = None,
                      generated: float = 1.0) -> np.ndarray:
    """Whether each request's shared prefix misses the cache when the batch is walked in order.

    An LRU stack-distance model: a group's prefix is a hit when the distinct KV tokens read
    since its last read (other groups' prefixes, hit or not, once each, plus every request's
    own tokens) and the prefix itself fit ``cache_tokens``. Requests outside ``active`` are
    skipped (their flag is False).
    """
    n = len(comp.prompt)
    active = np.ones(n, dtype=bool) if active is None else active
    flags = np.zeros(n, dtype=bool)
    own_read = 0.0  # cumulative own tokens read so far
    # reads[k]: prefix tokens of the k-th prefix read if it is still its group's latest read,
    # else 0 (so a slice sums each group read since then once, at its latest read).
    reads: list[int] = []
    last_pos: dict[int, int] = {}  # group -> index in reads of its latest read
    own_at: dict[int, float] = {}  # group -> own_read at its last read
    group, shared, prompt = comp.group, comp.shared, comp.prompt
    for i in np.flatnonzero(active).tolist():
        g, p = int(group[i]), int(shared[i])
        own = float(prompt[i] - p) + generated
        if p > 0:
            seen = last_pos.get(g)
            if seen is None:
                flags[i] = True
            else:
                others = sum(reads[seen + 1:]) if seen + 1 < len(reads) else 0
                flags[i] = (own_read - own_at[g]) + others + p > cache_tokens
                reads[seen] = 0
            last_pos[g], own_at[g] = len(reads), own_read
            reads.append(p)
        own_read += own
    return flags


def step_features(comp: Composition, active: np.ndarray, generated: float, cache_tokens: float,
                  flags: np.ndarray | None = None) -> tuple[float, float, float]:
    """(B, T, M) of one decode step over the ``active`` requests (a boolean mask, batch order).

    ``flags``: precomputed :func:`prefix_miss_flags` (else computed for this active set).
    """
    idx = np.flatnonzero(active)
    if idx.size == 0:
        return 0.0, 0.0, 0.0
    if flags is None:
        flags = prefix_miss_flags(comp, cache_tokens, active, generated)
    ctx = comp.prompt[idx] + generated
    own = ctx - comp.shared[idx]
    misses = float(own.sum() + comp.shared[idx][flags[idx]].sum())
    return float(idx.size), float(ctx.sum()), misses


class SimBackend:
    """Predicts :class:`BatchResult` for a batch with a fitted :class:`CostModel` (deterministic).

    Mirrors :class:`~feather_env.backends.VLLMBackend` with ``warm_prefixes=True``: each
    group's common prefix is cached before the batch, the first output token comes from
    the prefill step, and the remaining ``output_len - 1`` tokens from decode steps.
    """

    deterministic = True

    def __init__(self, model: CostModel, *, kv_capacity_tokens: int = 1 << 20,
                 max_batch_size: int = 256, profile: dict[str, Any] | None = None) -> None:
        self.model = model
        self.kv_capacity_tokens = kv_capacity_tokens
        self.max_batch_size = max_batch_size
        self.profile = profile or {}

    @classmethod
    def from_profile(cls, path: str | Path | None = None) -> SimBackend:
        """Load a calibrated profile (default: the shipped CPU profile)."""
        profile = load_profile(path or DEFAULT_PROFILE)
        m = profile["model"]
        model = CostModel(cache_tokens=m["cache_tokens"], decode=tuple(m["decode"]),
                          prefill=tuple(m["prefill"]), block_size=m["block_size"],
                          max_num_batched_tokens=m["max_num_batched_tokens"])
        eng = profile.get("engine", {})
        return cls(model, kv_capacity_tokens=int(profile.get("kv_capacity_tokens", 1 << 20)),
                   max_batch_size=int(eng.get("max_num_seqs", 256)), profile=profile)

    def predict_step(self, comp: Composition, active: np.ndarray, generated: float,
                     flags: np.ndarray | None = None) -> float:
        c0, c1, c2, c3 = self.model.decode
        b, t, m = step_features(comp, active, generated, self.model.cache_tokens, flags)
        return c0 + c1 * b + c2 * t + c3 * m

    def predict_prefill(self, comp: Composition) -> float:
        new = np.maximum(comp.prompt - comp.shared, 1)
        return self._prefill_seconds(int(new.sum()), float((new * comp.prompt).sum()))

    def _prefill_seconds(self, new_tokens: int, new_times_prompt: float) -> float:
        """The prefill model from N (uncached tokens) and sum_i(n_i * s_i); steps from N."""
        p0, p1, p2 = self.model.prefill
        steps = max(1, math.ceil(new_tokens / self.model.max_num_batched_tokens))
        return p0 * steps + p1 * float(new_tokens) + p2 * new_times_prompt

    def run_batch(self, requests: Sequence[Request]) -> BatchResult:
        if not requests:
            raise ValueError("empty batch")
        if len(requests) > self.max_batch_size:
            raise ValueError(f"batch of {len(requests)} exceeds max batch size {self.max_batch_size}")
        if len(requests) <= SMALL_BATCH:
            return self._run_small(requests)
        return self._run_numpy(requests)

    def _run_numpy(self, requests: Sequence[Request]) -> BatchResult:
        comp = composition_of(requests, self.model.block_size)
        # Decode steps run in segments between request completions; within a segment the
        # step time is linear in the generated count, so its midpoint gives the exact sum.
        steps_needed = comp.output - 1
        bounds = np.unique(np.concatenate([[0], steps_needed]))
        lo, hi = bounds[:-1], bounds[1:]
        # Requests still running in a segment are the ones needing the most steps: sorted
        # that way, segment j runs the first n[j] of them, and its features are prefix sums.
        order = np.argsort(-steps_needed, kind="stable")
        n = np.searchsorted(-steps_needed[order], -lo, side="left")
        gen = 1 + (lo + hi - 1) / 2  # generated tokens at the segment's midpoint step
        own_cum = np.concatenate([[0], np.cumsum((comp.prompt - comp.shared)[order])])
        prompt_cum = np.concatenate([[0], np.cumsum(comp.prompt[order])])
        # Which prefixes miss depends on the running set: recompute it whenever the set has
        # shrunk by a tenth since the last computation.
        missed = np.empty(len(n), dtype=float)
        j = 0
        while j < len(n):
            active = steps_needed > lo[j]
            flags = prefix_miss_flags(comp, self.model.cache_tokens, active, 1 + lo[j])
            miss_cum = np.concatenate([[0], np.cumsum((comp.shared * flags)[order])])
            k = j + 1
            while k < len(n) and n[k] >= 0.9 * n[j]:
                k += 1
            missed[j:k] = miss_cum[n[j:k]]
            j = k
        c0, c1, c2, c3 = self.model.decode
        t_step = (c0 + c1 * n + c2 * (prompt_cum[n] + n * gen)
                  + c3 * (own_cum[n] + n * gen + missed))
        steps = hi - lo
        decode_s = float((steps * t_step).sum())
        decode_tokens = int((steps * n).sum())
        step_times = t_step.tolist()
        sizes = n.tolist()
        return BatchResult(
            num_requests=len(requests),
            decode_tokens=decode_tokens,
            decode_seconds=decode_s,
            prefill_seconds=self.predict_prefill(comp),
            output_tokens=int(comp.output.sum()),
            prompt_tokens=int(comp.prompt.sum()),
            prefix_hit_tokens=int(comp.shared.sum()),
            kv_blocks_used=0,
            step_times=step_times,
            step_batch_sizes=sizes,
        )

    def _run_small(self, requests: Sequence[Request]) -> BatchResult:
        """:meth:`run_batch` in plain Python: the same model, for batches where numpy's
        per-call overhead dominates (a random policy's batches of 1-3 requests)."""
        bs = self.model.block_size
        n_req = len(requests)
        prompt = [r.prompt_len for r in requests]
        output = [r.output_len for r in requests]
        group = [0] * n_req
        shared = [0] * n_req
        for g, (idx, lcp) in enumerate(prefix_groups(requests)):
            for i in idx:
                group[i] = g
                shared[i] = min((lcp // bs) * bs, prompt[i])
        own_all = [p - s for p, s in zip(prompt, shared, strict=True)]
        steps_needed = [o - 1 for o in output]
        bounds = sorted({0, *steps_needed})
        order = sorted(range(n_req), key=lambda i: -steps_needed[i])
        own_cum, prompt_cum = [0], [0]
        for i in order:
            own_cum.append(own_cum[-1] + own_all[i])
            prompt_cum.append(prompt_cum[-1] + prompt[i])
        cache_tokens = self.model.cache_tokens
        c0, c1, c2, c3 = self.model.decode
        decode_s, decode_tokens = 0.0, 0
        step_times: list[float] = []
        sizes: list[int] = []
        comp = Composition(prompt=prompt, shared=shared, group=group, output=output)  # lists
        miss_cum: list[float] = [0.0]
        n_ref = 0  # running-set size when the miss flags were last computed
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            n = sum(1 for x in steps_needed if x > lo)
            if n_ref == 0 or n < 0.9 * n_ref:
                # As run_batch: recompute which prefixes miss when the set shrank by a tenth.
                active = [x > lo for x in steps_needed]
                flags = prefix_miss_flags(comp, cache_tokens, active, 1 + lo)
                miss_cum = [0.0]
                for i in order:
                    miss_cum.append(miss_cum[-1] + (shared[i] if flags[i] else 0))
                n_ref = n
            missed = miss_cum[n]
            gen = 1 + (lo + hi - 1) / 2
            t = c0 + c1 * n + c2 * (prompt_cum[n] + n * gen) + c3 * (own_cum[n] + n * gen + missed)
            decode_s += (hi - lo) * t
            decode_tokens += (hi - lo) * n
            step_times.append(t)
            sizes.append(n)
        new = [max(p - s, 1) for p, s in zip(prompt, shared, strict=True)]
        prefill_s = self._prefill_seconds(
            sum(new), float(sum(a * b for a, b in zip(new, prompt, strict=True))))
        return BatchResult(
            num_requests=n_req,
            decode_tokens=decode_tokens,
            decode_seconds=decode_s,
            prefill_seconds=prefill_s,
            output_tokens=sum(output),
            prompt_tokens=sum(prompt),
            prefix_hit_tokens=sum(shared),
            kv_blocks_used=0,
            step_times=step_times,
            step_batch_sizes=sizes,
        )

    def close(self) -> None:
        pass


def load_profile(path: str | Path) -> dict[str, Any]:
    """Read and check a profile JSON; a missing or malformed file is a clear error."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"simulator profile not found: {path} "
                          "(make one with `python -m feather_env.calibrate --out PATH`)")
    try:
        profile = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: malformed profile JSON: {exc}") from exc
    if profile.get("version") != PROFILE_VERSION:
        raise ConfigError(f"{path}: profile version {profile.get('version')!r}, "
                          f"this toolkit reads version {PROFILE_VERSION}")
    model = profile.get("model", {})
    missing = [k for k in ("cache_tokens", "decode", "prefill", "block_size",
                           "max_num_batched_tokens") if k not in model]
    if missing:
        raise ConfigError(f"{path}: profile model lacks {missing}")
    return profile


@dataclass
class Measurement:
    """One calibration point: a composition and what the real engine measured for it."""

    spec: dict[str, Any]
    decode_steps: list[tuple[float, float, float, float]] = field(default_factory=list)
    prefill: tuple[float, float, float, float] | None = None  # (steps, N, sum n*s, seconds)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
