"""The batching core: which waiting requests join the running batch at each scheduler step.

This is the engine-free logic behind every scheduler of :mod:`scheduler_runtime.vllm_scheduler`
(Feather and the baselines). vLLM's subclass only moves requests between its queues; every
decision is taken here, so it can be tested and benchmarked without an engine.

State. A request is *waiting* (held back from the engine) or *active* (released: running in
the engine, or released and queued there until the engine's token budget or KV cache lets it
start, or preempted by the engine, which resumes it first). Active is "the batch the policy
formed". Requests are tracked by:

* a :class:`~scheduler_runtime.cht.ChunkedHashTree` over all of them (insert on arrival,
  activate on release, finish when the engine frees them, remove on abort). It gives Feather
  its best candidate and every ordering its prefix-aware KV accounting;
* for the baselines, the queue of their ordering: arrival order (``fcfs``), a
  :class:`~scheduler_runtime.svf.KeyQueue` (``sjf``, ``svf``), or a
  :class:`~scheduler_runtime.radix.RadixTree` (``lpm``, ``dfs-weight``);
* a :class:`~scheduler_runtime.svf.KVBudget`: each released request is charged its unshared
  prompt tokens (the CHT's missing chunks, at most its prompt) plus, with SVF's peak check,
  its output length estimate; the charge returns when it leaves.

Decision loop (:meth:`BatchingCore.plan`, once per engine step, with the free batch slots):

1. anti-starvation: a request that has waited ``max_wait`` seconds is released before
   anything else, oldest first, whatever the policy says; if it does not fit the KV budget,
   nothing else is released until it does (the batch drains), so it waits at most
   ``max_wait`` plus the rest of one batch;
2. seed: with an empty batch, Feather releases the smallest-volume request (SVF) when
   ``svf_seed`` is on, else the CHT's best candidate; a baseline releases its first request;
3. Feather: while the batch has free slots, ask the policy about the CHT's best candidate
   with the observation ``[batch size, delta, w]`` (requests, chunks, requests) and the mask
   ``[STOP valid, ADD valid]``: ADD releases it, STOP holds every waiting request until the
   next step. ADD is invalid when the candidate does not fit the KV budget (the loop stops
   without asking). Baselines release in their order until a request does not fit.

A STOP with nothing changed since (no arrival, release, finish or abort) is not asked again:
the policy sees the same observation, so the answer would be the same for a deterministic
policy; this keeps a long STOP cheap (``skipped_decisions``).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from scheduler_runtime.cht import ChunkedHashTree
from scheduler_runtime.prefix_index import (
    DEFAULT_CHUNK_SIZE,
    Candidate,
    DuplicateRequestError,
    UnknownRequestError,
    num_chunks,
)
from scheduler_runtime.radix import RadixTree
from scheduler_runtime.svf import KeyQueue, KVBudget, volume

__all__ = [
    "ADD",
    "ADMISSIONS",
    "ORDERINGS",
    "STOP",
    "AlwaysAdd",
    "BatchingCore",
    "BatchingPolicy",
    "CoreConfig",
    "CoreStats",
    "FeatherHeuristic",
]

STOP, ADD = 0, 1
#: How the next candidate is chosen: Feather (CHT + policy) or a baseline's order.
ORDERINGS = ("feather", "fcfs", "sjf", "svf", "lpm", "dfs-weight")
#: What a released request is charged against the KV capacity: nothing, its unshared prompt
#: tokens (the engine's own admission test, made at release time), or SVF's peak (unshared
#: prompt + output estimate).
ADMISSIONS = ("none", "prompt", "peak")


@runtime_checkable
class BatchingPolicy(Protocol):
    """An ADD/STOP policy (``scheduler_runtime.policy.load_policy`` returns one).

    ``obs`` is ``float32 [batch_size, delta, w]`` in raw units (requests, CHT chunks,
    requests); ``mask`` is ``bool [STOP valid, ADD valid]``; the answer is 0 (STOP) or
    1 (ADD). Optional: an ``obs_spec`` attribute whose ``names`` has seven entries asks for
    ``FeatherEnv(extended_obs=True)``'s observation (see :meth:`BatchingCore._observe`), and a
    ``reset()`` method, called once when the core starts using the policy.
    """

    def act(self, obs: np.ndarray, mask: np.ndarray) -> int: ...


class FeatherHeuristic:
    """The authors' static batching rule (``docs/design.md``, "Static heuristic").

    Empty batch: ADD. ADD when delta <= ``max_delta`` chunks, or <= ``max_delta_popular``
    when at least ``popular_w`` waiting requests share the new depth, and then raise a
    minimum-batch floor by one (at most ``floor_cap``); otherwise ADD only while the batch
    is smaller than the floor.

    The floor lives as long as the policy (:meth:`reset` restarts it), as in the authors'
    code and ``scheduler_runtime.policy.HeuristicRule``: restarting it with every batch
    would make it useless, since each cheap ADD grows the batch and the floor together.
    """

    def __init__(
        self, max_delta: int = 5, max_delta_popular: int = 7, popular_w: int = 10, floor_cap: int = 10
    ) -> None:
        self.max_delta = max_delta
        self.max_delta_popular = max_delta_popular
        self.popular_w = popular_w
        self.floor_cap = floor_cap
        self.floor = 0

    def reset(self) -> None:
        self.floor = 0

    def act(self, obs: np.ndarray, mask: np.ndarray) -> int:
        batch_size, delta, w = float(obs[0]), float(obs[1]), float(obs[2])
        if not mask[ADD]:
            return STOP
        if batch_size <= 0 or not mask[STOP]:
            return ADD
        if delta <= self.max_delta or (delta <= self.max_delta_popular and w >= self.popular_w):
            self.floor = min(self.floor + 1, self.floor_cap)
            return ADD
        return ADD if batch_size < self.floor else STOP


class AlwaysAdd:
    """ADD whenever ADD is valid: the baselines' admission (their order does the work)."""

    def act(self, obs: np.ndarray, mask: np.ndarray) -> int:
        return ADD if mask[ADD] else STOP


@dataclass(frozen=True)
class CoreConfig:
    """Every knob of the batching core.

    Attributes:
        ordering: one of :data:`ORDERINGS`.
        admission: one of :data:`ADMISSIONS`.
        svf_seed: Feather only: seed an empty batch with the smallest-volume request (else
            with the CHT's best candidate, the environment's rule).
        chunk_size: CHT chunk size in tokens (delta and depths are in these chunks).
        max_wait: seconds after which a waiting request is released whatever the policy
            says; ``None`` disables it.
        lpm_fcfs_fallback: ``lpm`` serves FCFS when more requests than this wait (SGLang:
            128); ``None`` always matches.
    """

    ordering: str = "feather"
    admission: str = "peak"
    svf_seed: bool = True
    chunk_size: int = DEFAULT_CHUNK_SIZE
    max_wait: float | None = 60.0
    lpm_fcfs_fallback: int | None = 128

    def __post_init__(self) -> None:
        if self.ordering not in ORDERINGS:
            raise ValueError(f"ordering must be one of {ORDERINGS}, got {self.ordering!r}")
        if self.admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {ADMISSIONS}, got {self.admission!r}")
        if isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise ValueError(f"chunk_size must be an int >= 1, got {self.chunk_size!r}")
        if self.max_wait is not None and not (math.isfinite(self.max_wait) and self.max_wait >= 0):
            raise ValueError(f"max_wait must be finite seconds >= 0 or None, got {self.max_wait}")
        if self.lpm_fcfs_fallback is not None and self.lpm_fcfs_fallback < 0:
            raise ValueError(f"lpm_fcfs_fallback must be >= 0 or None, got {self.lpm_fcfs_fallback}")


@dataclass
class CoreStats:
    """Counters of the core (exported by the vLLM scheduler to ``/metrics``).

    ``decisions`` counts policy queries (``adds`` + ``stops``); releases by the seed, by
    ``max_wait`` and by a baseline's order are counted in ``released`` by reason.
    ``decision_seconds`` is the wall time spent in :meth:`BatchingCore.plan`.
    """

    plan_calls: int = 0
    decisions: int = 0
    adds: int = 0
    stops: int = 0
    skipped_decisions: int = 0
    capacity_stops: int = 0
    released: dict[str, int] = field(
        default_factory=lambda: {"policy": 0, "seed": 0, "max_wait": 0, "order": 0}
    )
    arrived: int = 0
    finished: int = 0
    aborted: int = 0
    preempted: int = 0
    decision_seconds: float = 0.0
    max_plan_seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Entry:
    __slots__ = ("request_id", "prompt_len", "output_len", "arrival", "footprint")

    def __init__(self, request_id: str, prompt_len: int, output_len: float, arrival: float) -> None:
        self.request_id = request_id
        self.prompt_len = prompt_len
        self.output_len = output_len
        self.arrival = arrival
        self.footprint = 0.0


class BatchingCore:
    """Feather's batching decisions (or a baseline's) over waiting and active requests.

    See the module docstring for the state and the decision loop.

    Args:
        config: the core's knobs.
        policy: Feather's ADD/STOP policy (default :class:`FeatherHeuristic`); ignored by
            the baselines, which release in their order (:class:`AlwaysAdd`).
        kv_capacity_tokens: KV capacity for the admission check; ``None``: unlimited.
    """

    def __init__(
        self,
        config: CoreConfig | None = None,
        policy: BatchingPolicy | None = None,
        kv_capacity_tokens: int | None = None,
    ) -> None:
        self.config = config or CoreConfig()
        cfg = self.config
        if cfg.ordering == "feather":
            self.policy: BatchingPolicy = policy if policy is not None else FeatherHeuristic()
        else:
            self.policy = AlwaysAdd()
        spec = getattr(self.policy, "obs_spec", None)
        self._extended_obs = len(getattr(spec, "names", ())) == 7
        reset = getattr(self.policy, "reset", None)
        if reset is not None:
            reset()
        self.chunk_size = cfg.chunk_size
        self.cht = ChunkedHashTree(cfg.chunk_size)
        self.budget = KVBudget(kv_capacity_tokens if cfg.admission != "none" else None)
        self.radix: RadixTree | None = None
        if cfg.ordering in ("lpm", "dfs-weight"):
            self.radix = RadixTree(cfg.ordering, cfg.chunk_size, cfg.lpm_fcfs_fallback)  # type: ignore[arg-type]
        self._key_q: KeyQueue | None = KeyQueue() if cfg.ordering in ("sjf", "svf") else None
        self._volume_q: KeyQueue | None = (
            KeyQueue() if cfg.ordering == "feather" and cfg.svf_seed else None
        )
        self._waiting: dict[str, _Entry] = {}
        self._active: dict[str, _Entry] = {}
        self._arrivals: deque[_Entry] = deque()  # arrival order, stale entries skipped lazily
        self._version = 0  # bumped by every change a policy could observe
        self._stop_version = -1  # _version at the last STOP
        self.stats = CoreStats()

    # ------------------------------------------------------------------ request lifecycle

    def add(
        self,
        request_id: str,
        token_ids: np.ndarray | Sequence[int],
        *,
        arrival: float,
        output_len: float,
    ) -> None:
        """A request arrived: it waits until :meth:`plan` releases it.

        Args:
            token_ids: its prompt.
            arrival: its arrival time (same clock as ``plan``'s ``now``, seconds).
            output_len: the output length estimate its scheduler uses (predicted, 1-bit proxy
                or true): the SJF key, the volume's ``o`` and the peak check's output.

        Raises:
            DuplicateRequestError: the id is already waiting or active.
            ValueError: empty or invalid prompt.
        """
        if request_id in self._waiting or request_id in self._active:
            raise DuplicateRequestError(f"request {request_id!r} is already in the core")
        tokens = np.asarray(token_ids)
        self.cht.insert(request_id, tokens)  # validates the prompt before anything else changes
        entry = _Entry(request_id, int(tokens.size), max(float(output_len), 1.0), float(arrival))
        if self.radix is not None:
            self.radix.insert(request_id, tokens)
        if self._key_q is not None:
            key = entry.output_len if self.config.ordering == "sjf" else volume(
                entry.prompt_len, entry.output_len)
            self._key_q.push(request_id, key)
        if self._volume_q is not None:
            self._volume_q.push(request_id, volume(entry.prompt_len, entry.output_len))
        self._waiting[request_id] = entry
        self._arrivals.append(entry)
        self._version += 1
        self.stats.arrived += 1

    def finish(self, request_id: str) -> None:
        """An active request completed (the engine freed it).

        Raises:
            UnknownRequestError: it is not active.
        """
        if request_id not in self._active:
            raise UnknownRequestError(f"request {request_id!r} is not active")
        self._drop_active(request_id)
        self.stats.finished += 1

    def remove(self, request_id: str) -> None:
        """Abort a waiting or active request: nothing of it stays in the core.

        Raises:
            UnknownRequestError: it is neither waiting nor active.
        """
        if request_id in self._active:
            self._drop_active(request_id)
        else:
            if self._waiting.pop(request_id, None) is None:
                raise UnknownRequestError(f"request {request_id!r} is neither waiting nor active")
            self.cht.remove(request_id)
            if self.radix is not None:
                self.radix.remove(request_id)
            self._leave_queues(request_id)
            self._version += 1
        self.stats.aborted += 1

    def _drop_active(self, request_id: str) -> None:
        del self._active[request_id]
        self.cht.finish(request_id)
        if self.radix is not None:
            self.radix.finish(request_id)
        self.budget.release(request_id)
        self._version += 1

    def preempted(self, request_id: str) -> None:
        """The engine preempted an active request. It stays in the batch: the engine puts it
        at the head of its own queue and resumes it before anything new, so the formed batch
        is unchanged; only the counter moves."""
        if request_id not in self._active:
            raise UnknownRequestError(f"request {request_id!r} is not active")
        self.stats.preempted += 1

    # ------------------------------------------------------------------ decisions

    def plan(self, now: float, free_slots: int) -> list[str]:
        """Decide which waiting requests to release now, in release order.

        Args:
            now: current time (the clock of ``add``'s ``arrival``).
            free_slots: how many more requests the batch can hold (the engine's max batch
                size minus its running and already released requests).
        """
        start = time.perf_counter()
        released: list[str] = []
        try:
            if self._waiting and free_slots > 0:
                self._plan(now, free_slots, released)
        finally:
            elapsed = time.perf_counter() - start
            stats = self.stats
            stats.plan_calls += 1
            stats.decision_seconds += elapsed
            if elapsed > stats.max_plan_seconds:
                stats.max_plan_seconds = elapsed
        return released

    def _plan(self, now: float, free_slots: int, released: list[str]) -> None:
        cfg = self.config
        # 1. anti-starvation, oldest first; an overdue request that does not fit blocks the rest
        if cfg.max_wait is not None:
            while free_slots > 0:
                entry = self._oldest_waiting()
                if entry is None or now - entry.arrival < cfg.max_wait:
                    break
                if not self.budget.fits(self._footprint(entry.request_id)):
                    self.stats.capacity_stops += 1
                    return
                self._release(entry.request_id, "max_wait", released)
                free_slots -= 1
        if not self._waiting or free_slots <= 0:
            return
        # 2. seed an empty batch
        if not self._active:
            if cfg.ordering == "feather":
                if self._volume_q is not None:
                    seed = self._volume_q.peek()
                else:
                    cand = self.cht.best_candidate()
                    seed = cand.request_id if cand is not None else None
                assert seed is not None
                self._release(seed, "seed", released)
                free_slots -= 1
        if cfg.ordering == "feather":
            self._feather_loop(free_slots, released)
        else:
            self._baseline_loop(free_slots, released)

    def _feather_loop(self, free_slots: int, released: list[str]) -> None:
        stats = self.stats
        mask = np.ones(2, dtype=bool)
        while free_slots > 0 and self._waiting:
            cand = self.cht.best_candidate()
            assert cand is not None
            if not self.budget.fits(self._footprint(cand.request_id)):
                stats.capacity_stops += 1
                return
            if self._stop_version == self._version:
                stats.skipped_decisions += 1
                return
            mask[STOP] = bool(self._active)
            mask[ADD] = True
            action = int(self.policy.act(self._observe(cand), mask))
            stats.decisions += 1
            if action == ADD:
                stats.adds += 1
                self._release(cand.request_id, "policy", released)
                free_slots -= 1
            else:
                if not mask[STOP]:
                    raise ValueError("the policy answered STOP on an empty batch (masked out)")
                stats.stops += 1
                self._stop_version = self._version
                return

    def _baseline_loop(self, free_slots: int, released: list[str]) -> None:
        for request_id in self._baseline_order():
            if free_slots <= 0:
                return
            if request_id not in self._waiting:
                continue  # released earlier in this round (e.g. as overdue or seed)
            if not self.budget.fits(self._footprint(request_id)):
                self.stats.capacity_stops += 1
                return
            self._release(request_id, "order", released)
            free_slots -= 1

    def _baseline_order(self) -> Iterator[str]:
        """The baseline's order over the waiting requests, computed once per round.

        SGLang sorts its waiting queue once per scheduling round (``calc_priority``) and then
        adds in that order; the radix orderings do the same here, so a round matches every
        waiting request once, not once per admission.
        """
        ordering = self.config.ordering
        if ordering == "fcfs":
            while True:
                entry = self._oldest_waiting()
                if entry is None:
                    return
                yield entry.request_id
        if self._key_q is not None:
            while True:
                rid = self._key_q.peek()
                if rid is None:
                    return
                yield rid
        radix = self.radix
        assert radix is not None
        if ordering == "dfs-weight":
            yield from radix.dfs_weight_order()
            return
        waiting = radix.waiting_ids()  # insertion (arrival) order
        fallback = self.config.lpm_fcfs_fallback
        if fallback is not None and len(waiting) > fallback:
            yield from waiting  # SGLang: no prefix matching above the threshold
            return
        matched = {rid: radix.match_length(rid) for rid in waiting}
        yield from sorted(waiting, key=lambda rid: -matched[rid])  # stable: FCFS among ties

    def _observe(self, cand: Candidate) -> np.ndarray:
        """The policy's observation, unclipped (a loaded policy clips to its training bounds).

        Extended: ``[batch size, delta, w, waiting, KV budget used / capacity, candidate's
        missing chunks, candidate's prompt chunks]``; the KV share counts outputs only under
        SVF's peak check (``admission="peak"``), as the environment does.
        """
        delta = cand.depth_before - cand.depth_after
        if not self._extended_obs:
            return np.array([len(self._active), delta, cand.w], dtype=np.float32)
        entry = self._waiting[cand.request_id]
        return np.array(
            [
                len(self._active),
                delta,
                cand.w,
                len(self._waiting),
                min(self.budget.fraction, 1.0),
                self.cht.missing_count(cand.request_id),
                num_chunks(entry.prompt_len, self.chunk_size),
            ],
            dtype=np.float32,
        )

    def _footprint(self, request_id: str) -> float:
        """KV tokens the request adds to the batch at its peak (0 with admission 'none')."""
        admission = self.config.admission
        if admission == "none":
            return 0.0
        entry = self._waiting[request_id]
        unshared = min(self.cht.missing_count(request_id) * self.chunk_size, entry.prompt_len)
        return float(unshared) + (entry.output_len if admission == "peak" else 0.0)

    def _leave_queues(self, request_id: str) -> None:
        """Drop a request that stops waiting from the length-ordered queues (if any)."""
        for queue in (self._key_q, self._volume_q):
            if queue is not None:
                queue.discard(request_id)

    def _release(self, request_id: str, reason: str, released: list[str]) -> None:
        footprint = self._footprint(request_id)  # before activation: against the batch without it
        entry = self._waiting.pop(request_id)
        self.cht.activate(request_id)
        if self.radix is not None:
            self.radix.activate(request_id)
        self._leave_queues(request_id)
        entry.footprint = footprint
        self.budget.charge(request_id, footprint)
        self._active[request_id] = entry
        self._version += 1
        self.stats.released[reason] += 1
        released.append(request_id)

    def _oldest_waiting(self) -> _Entry | None:
        arrivals, waiting = self._arrivals, self._waiting
        while arrivals:
            entry = arrivals[0]
            if waiting.get(entry.request_id) is entry:
                return entry
            arrivals.popleft()
        return None

    # ------------------------------------------------------------------ introspection

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_active(self) -> int:
        return len(self._active)

    def waiting_ids(self) -> list[str]:
        """Waiting ids in arrival order."""
        return list(self._waiting)

    def active_ids(self) -> list[str]:
        """Active ids in release order."""
        return list(self._active)

    def is_waiting(self, request_id: str) -> bool:
        return request_id in self._waiting

    def is_active(self, request_id: str) -> bool:
        return request_id in self._active

    def arrival_of(self, request_id: str) -> float:
        entry = self._waiting.get(request_id) or self._active.get(request_id)
        if entry is None:
            raise UnknownRequestError(f"request {request_id!r} is neither waiting nor active")
        return entry.arrival

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._waiting or request_id in self._active

    def __len__(self) -> int:
        return len(self._waiting) + len(self._active)

    def check_consistency(self) -> None:
        """Recompute the invariants between the structures; AssertionError on a mismatch.

        O(requests + keys); for tests and debugging.
        """
        waiting, active = set(self._waiting), set(self._active)
        assert not waiting & active, "a request is both waiting and active"
        assert set(self.cht.waiting_ids()) == waiting, "CHT waiting set"
        assert set(self.cht.active_ids()) == active, "CHT active set"
        self.cht.check_consistency()
        if self.radix is not None:
            assert set(self.radix.waiting_ids()) == waiting, "radix waiting set"
            assert set(self.radix.active_ids()) == active, "radix active set"
        for queue in (self._key_q, self._volume_q):
            if queue is not None:
                assert len(queue) == len(waiting) and all(r in queue for r in waiting), "key queue"
        assert len(self.budget) == len(active) and all(r in self.budget for r in active), "budget"
        used = sum(e.footprint for e in self._active.values())
        assert abs(self.budget.used - used) <= 1e-6 * max(1.0, used), "budget total"
        live = [e for e in self._arrivals if self._waiting.get(e.request_id) is e]
        assert len(live) == len(waiting), "arrival queue"
        if not self._waiting and not self._active:
            assert self.cht.num_keys == 0, "keys left in the CHT"
