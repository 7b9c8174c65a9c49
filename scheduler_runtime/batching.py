"""The batching core: which waiting requests join the running batch, one ADD/STOP decision at a time.

This is the engine-free logic behind every scheduler of :mod:`scheduler_runtime.serving.vllm_scheduler`
(Feather and the baselines) and behind the environment (``feather_env.env``), which steps it
decision by decision. vLLM's subclass only moves requests between its queues; every decision is
taken here, so it can be tested, benchmarked and trained on without an engine.

State. A request is *waiting* (held back from the engine) or *active* (released: running in
the engine, or released and queued there until the engine's token budget or KV cache lets it
start, or preempted by the engine, which resumes it first). Active is "the batch the policy
formed". Requests are tracked by:

* a :class:`~scheduler_runtime.cht.ChunkedHashTree` over all of them (insert on arrival,
  activate on release, finish when the engine frees them, remove on abort). It gives Feather
  its best candidate and every ordering its observation and prefix-aware KV accounting;
* the candidate order of the configured :class:`Ordering` (one small class per ordering, chosen
  by :func:`make_ordering`): the CHT's best candidate (``feather``), arrival order (``fcfs``), a
  :class:`~scheduler_runtime.svf.KeyQueue` (``sjf``, ``svf``), or a
  :class:`~scheduler_runtime.radix.RadixTree` (``lpm``, ``dfs-weight``);
* a :class:`~scheduler_runtime.svf.KVBudget`: each released request is charged its unshared
  prompt tokens (the CHT's missing chunks, at most its prompt) plus, with SVF's peak check,
  its output length estimate; the charge returns when it leaves.

A *round* of decisions (once per engine step; :meth:`BatchingCore.open_round` opens it with the
free batch slots, :meth:`BatchingCore.close_round` closes it and returns what was released, in order):

1. anti-starvation: a request that has waited ``max_wait`` seconds is released before
   anything else, oldest first, whatever the policy says; if it does not fit the KV budget,
   nothing else is released until it does (the batch drains), so it waits at most
   ``max_wait`` plus the rest of one batch;
2. seed: an empty batch gets its first request without a decision (STOP would be meaningless):
   with ``svf_seed`` the smallest-volume request, else the ordering's first candidate;
3. decisions: while the batch has free slots, the ordering's next candidate is the *pending
   decision* (:attr:`BatchingCore.pending`): its observation (:meth:`BatchingCore.observe`,
   the names are in :mod:`scheduler_runtime.decision`) and its mask ``[STOP valid, ADD valid]``.
   :meth:`BatchingCore.add` releases it and moves to the next candidate; :meth:`BatchingCore.stop`
   holds every waiting request until the next round. A candidate that does not fit the KV
   budget ends the round without a decision (ADD would be invalid, STOP is then forced).

:meth:`BatchingCore.plan` is that loop with a policy answering each decision: what the vLLM
scheduler calls. The baselines answer with :class:`~scheduler_runtime.decision.AlwaysAdd`
(their order does the work); Feather with its policy (default: the authors' heuristic,
:class:`~scheduler_runtime.rules.HeuristicRule`). The environment answers with the agent.

A STOP with nothing changed since (no arrival, release, finish or abort) is not asked again:
the policy would see the same batch and candidate, so a deterministic policy would answer the
same; this keeps a long STOP cheap (``skipped_decisions``), in serving and in the environment.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

import numpy as np

from scheduler_runtime.cht import ChunkedHashTree
from scheduler_runtime.core_config import (
    ADMISSIONS,
    DECISIONS,
    RELEASE_REASONS,
    CoreConfig,
    CoreStats,
    Decision,
    Entry,
    OrderingName,
)
from scheduler_runtime.decision import (
    ADD,
    STOP,
    BatchingPolicy,
    EngineView,
    NoEngine,
    observation_kind,
)
from scheduler_runtime.groups import PrefixGroups
from scheduler_runtime.orderings import Ordering, make_ordering
from scheduler_runtime.plugins import default_policy
from scheduler_runtime.prefix_index import (
    Candidate,
    DuplicateRequestError,
    UnknownRequestError,
    num_chunks,
)
from scheduler_runtime.svf import KeyQueue, KVBudget, volume

__all__ = [
    "ADMISSIONS",
    "DECISIONS",
    "RELEASE_REASONS",
    "BatchingCore",
    "CoreConfig",
    "CoreStats",
    "Decision",
]

# ---------------------------------------------------------------------------------- the core


def _mask(stop_valid: bool) -> np.ndarray:
    mask = np.array([stop_valid, True])
    mask.flags.writeable = False  # shared by every pending decision
    return mask


#: A pending decision's mask ``[STOP valid, ADD valid]``, by whether the batch has a request.
_MASKS = (_mask(False), _mask(True))


class BatchingCore:
    """Batching decisions of an ordering and a policy over waiting and active requests.

    See the module docstring for the state, the round and the decisions.

    Args:
        config: the core's knobs.
        policy: the ADD/STOP policy :meth:`plan` asks (default: Feather's heuristic for the
            ``feather`` ordering, :class:`~scheduler_runtime.decision.AlwaysAdd` for the others).
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
        if policy is None:
            policy = default_policy(cfg.ordering)
        self.policy: BatchingPolicy = policy
        self.policy_obs_kind = observation_kind(policy)
        reads_group = self.policy_obs_kind == "group"
        if reads_group != (cfg.decision == "group") and getattr(policy, "obs_spec", None):
            raise ValueError(f"the policy reads the {self.policy_obs_kind!r} observation but the core "
                             f"asks the {cfg.decision!r} decision")
        self._policy_observes = getattr(policy, "observes", True)
        #: the base observation handed over as a tuple of ints (no float32 array) to a policy that
        #: reads any sequence (``reads_plain``): the same numbers, exactly, at a fraction of the cost
        self._plain_obs = self.policy_obs_kind == "base" and getattr(policy, "reads_plain", False)
        reset = getattr(policy, "reset", None)
        if reset is not None:
            reset()
        self.chunk_size = cfg.chunk_size
        self.cht = ChunkedHashTree(cfg.chunk_size)
        self.groups = PrefixGroups()
        #: How deep the cached-first order looks into a waiting group's prefix (tokens).
        self.group_tokens = cfg.group_chunks * cfg.chunk_size
        self._group_decision = cfg.decision == "group"
        self.budget = KVBudget(kv_capacity_tokens if cfg.admission != "none" else None)
        self._volume_q: KeyQueue | None = KeyQueue() if cfg.svf_seed else None
        self._waiting: dict[str, Entry] = {}
        self._active: dict[str, Entry] = {}
        self._arrivals: deque[Entry] = deque()  # arrival order, stale entries skipped lazily
        # the shortest prompt and output estimate that ever arrived: floors under every waiting
        # request's (:meth:`nothing_fits`)
        self._shortest_prompt, self._shortest_output = float("inf"), float("inf")
        self._version = 0  # bumped by every change a policy could observe
        self._stop_version = -1  # _version at the last STOP
        self.ordering = make_ordering(self)
        # The ordering's hooks that do something, bound once: a no-op of the base class (most
        # of them, for Feather's own ordering) is not called at every release and finish.
        hooks = {name: getattr(self.ordering, name) if getattr(type(self.ordering), name) is not
                 getattr(Ordering, name) else None
                 for name in ("arrive", "release", "finish", "remove", "begin_round")}
        self._ordering_arrive = hooks["arrive"]
        self._ordering_release = hooks["release"]
        self._ordering_finish = hooks["finish"]
        self._ordering_remove = hooks["remove"]
        self._ordering_begin_round = hooks["begin_round"]
        self._add_reason = "policy" if cfg.ordering == OrderingName.FEATHER else "order"
        # the open round: free slots left, released ids, the pending decision
        self._round_open = False
        self._free = 0
        self._released: list[str] = []
        self._pending: Decision | None = None
        self._candidate_cache: Candidate | None = None
        #: (candidate, _version, its footprint) as _next_decision checked it against the budget
        self._fit: tuple[str, int, float] | None = None
        self._engine: EngineView = NoEngine()
        self._now = 0.0
        self.stats = CoreStats()

    # ------------------------------------------------------------------ request lifecycle

    def arrive(
        self,
        request_id: str,
        token_ids: np.ndarray | Sequence[int],
        *,
        arrival: float,
        output_len: float,
        prompt_hashes: np.ndarray | None = None,
    ) -> None:
        """A request arrived: it waits until a round releases it.

        Args:
            token_ids: its prompt.
            arrival: its arrival time (the clock of ``open_round``'s ``now``, seconds).
            output_len: the output length estimate its scheduler uses (predicted, 1-bit proxy
                or true): the SJF key, the volume's ``o`` and the peak check's output.
            prompt_hashes: the prompt's ``self.cht.hash_prompt(token_ids)``, when the caller
                keeps them (the simulator serves the same prompts in episode after episode).

        Raises:
            DuplicateRequestError: the id is already waiting or active.
            ValueError: empty or invalid prompt.
        """
        if request_id in self._waiting or request_id in self._active:
            raise DuplicateRequestError(f"request {request_id!r} is already in the core")
        tokens = np.asarray(token_ids)
        # validates the prompt before anything else changes
        if prompt_hashes is None:
            self.cht.insert(request_id, tokens)
        else:
            self.cht.insert_hashed(request_id, prompt_hashes)
        entry = Entry(request_id, int(tokens.size), max(float(output_len), 1.0), float(arrival))
        self.groups.arrive(request_id, self.cht.prefix_hash(request_id, self.config.group_chunks))
        if self._ordering_arrive is not None:
            self._ordering_arrive(entry, tokens)
        if self._volume_q is not None:
            self._volume_q.push(request_id, volume(entry.prompt_len, entry.output_len))
        self._waiting[request_id] = entry
        self._arrivals.append(entry)
        self._shortest_prompt = min(self._shortest_prompt, entry.prompt_len)
        self._shortest_output = min(self._shortest_output, entry.output_len)
        self._changed()
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

    def leave(self, request_id: str, *, aborted: bool) -> bool:
        """The engine freed a request: :meth:`finish` an active one, :meth:`remove` one aborted or
        still waiting; False (and nothing changes) for an id the core does not know. One call on
        the engine's hot path instead of a membership test and a dispatch."""
        if request_id in self._active:
            self._drop_active(request_id)
            if aborted:
                self.stats.aborted += 1
            else:
                self.stats.finished += 1
            return True
        if request_id in self._waiting:
            self.remove(request_id)
            return True
        return False

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
            self.groups.remove(request_id)
            if self._ordering_remove is not None:
                self._ordering_remove(request_id)
            if self._volume_q is not None:
                self._volume_q.discard(request_id)
            self._changed()
        self.stats.aborted += 1

    def _drop_active(self, request_id: str) -> None:
        del self._active[request_id]
        if self._round_open and request_id in self._released:
            self._released.remove(request_id)  # gone before the round handed it to the engine
        self.cht.finish(request_id)
        self.groups.finish(request_id)
        if self._ordering_finish is not None:
            self._ordering_finish(request_id)
        self.budget.release(request_id)
        self._version += 1  # _changed, inline (once per request the engine frees)
        if self._pending is not None:
            self._changed_during_round()

    def preempted(self, request_id: str) -> None:
        """The engine preempted an active request. It stays in the batch: the engine puts it
        at the head of its own queue and resumes it before anything new, so the formed batch
        is unchanged; only the counter moves."""
        if request_id not in self._active:
            raise UnknownRequestError(f"request {request_id!r} is not active")
        self.stats.preempted += 1

    def _changed(self) -> None:
        self._version += 1
        if self._pending is not None:
            self._changed_during_round()

    def _changed_during_round(self) -> None:
        # an arrival or finish during an open round: the candidate may no longer be best
        self._pending = None
        self._next_decision()

    # ------------------------------------------------------------------ a round of decisions

    def open_round(self, now: float, free_slots: int, engine: EngineView | None = None) -> None:
        """Open a round: release the overdue and the seed, then stop at the first decision.

        Args:
            now: current time (the clock of ``arrive``'s ``arrival``).
            free_slots: how many more requests the batch can hold (the engine's max batch
                size minus its running and already released requests).
            engine: what the observation reads of the engine (KV usage, cached prefixes).

        Raises:
            RuntimeError: a round is already open.
        """
        if self._round_open:
            raise RuntimeError("a round is already open: close_round() it first")
        self._round_open = True
        self._now = float(now)
        self._free = max(0, int(free_slots))
        self._released = []
        self._engine = engine if engine is not None else NoEngine()
        if not self._waiting or self._free <= 0:
            return
        cfg = self.config
        # 1. anti-starvation, oldest first; an overdue request that does not fit blocks the rest
        if cfg.max_wait is not None:
            while self._free > 0:
                entry = self._oldest_waiting()
                if entry is None or now - entry.arrival < cfg.max_wait:
                    break
                if not self.budget.fits(self._footprint(entry.request_id)):
                    self.stats.capacity_stops += 1
                    self._free = 0
                    return
                self._release(entry.request_id, "max_wait")
        if not self._waiting or self._free <= 0:
            return
        if self._ordering_begin_round is not None:
            self._ordering_begin_round()
        # 2. seed an empty batch and 3. the first decision
        self._next_decision()

    @property
    def pending(self) -> Decision | None:
        """The decision the open round waits for (None: the round is over, call :meth:`close_round`)."""
        return self._pending

    @property
    def round_open(self) -> bool:
        return self._round_open

    def observe(self, kind: str = "base") -> np.ndarray:
        """The observation of the pending decision, raw and unclipped (``float32``).

        ``kind`` is one of :data:`~scheduler_runtime.decision.OBSERVATION_KINDS` (the names are
        there, and in :mod:`scheduler_runtime.decision`'s tables). A loaded policy clips to its
        training bounds; the environment clips to its observation space.

        Raises:
            RuntimeError: no decision is pending.
        """
        pending = self._pending
        if pending is None:
            raise RuntimeError("no decision is pending")
        if kind == "base":
            return np.array(self._base_observation(pending), dtype=np.float32)
        cand = self._pending_candidate(pending)
        delta = cand.depth_before - cand.depth_after
        rid = pending.request_id
        entry = self._waiting[rid]
        engine = self._engine
        if kind == "extended":
            return np.array(
                [
                    len(self._active),
                    delta,
                    cand.w,
                    len(self._waiting),
                    engine.kv_usage(),
                    self.cht.missing_count(rid),
                    num_chunks(entry.prompt_len, self.chunk_size),
                    engine.cached_prefix_tokens(rid) // self.chunk_size,
                ],
                dtype=np.float32,
            )
        if kind != "group":
            raise ValueError(f"observation kind must be 'base', 'extended' or 'group', got {kind!r}")
        groups = self.groups
        oldest = self._oldest_waiting()
        return np.array(
            [
                len(self._active),
                delta,
                cand.w,
                groups.num_in_flight,
                engine.cached_prefix_tokens(rid) / entry.prompt_len,
                groups.waiting_in_flight() + engine.num_queued(),
                groups.num_waiting_groups,
                self.kv_committed(),
                max(0.0, self._now - oldest.arrival) if oldest is not None else 0.0,
            ],
            dtype=np.float32,
        )

    def _pending_candidate(self, pending: Decision) -> Candidate:
        cand = self._candidate_cache
        if cand is None or cand.request_id != pending.request_id:
            cand = self.cht.candidate(pending.request_id)
            self._candidate_cache = cand
        return cand

    def _base_observation(self, pending: Decision) -> tuple[int, int, int]:
        """The pending decision's ``(batch size, delta, w)``."""
        cand = self._candidate_cache  # _pending_candidate, inline (the hot path of every decision)
        if cand is None or cand.request_id != pending.request_id:
            cand = self._pending_candidate(pending)
        return len(self._active), cand.depth_before - cand.depth_after, cand.w

    def kv_committed(self) -> float:
        """The KV cache's share in use or promised (the group observation's ``kv_usage``): the
        larger of the engine's blocks in use and the admitted requests' footprints over the
        admission budget's capacity. The engine's usage lags a release by a step or more (a
        released prompt holds no block until it is prefilled); the footprints count it at once."""
        usage = self._engine.kv_usage()
        if self.budget.capacity is None:
            return usage
        return max(usage, min(1.0, self.budget.used / self.budget.capacity))

    def add(self) -> None:
        """Answer the pending decision with ADD: release its candidate."""
        pending = self._pending  # _require_pending, inline
        if pending is None:
            raise RuntimeError("no decision is pending")
        self.stats.decisions += 1
        self.stats.adds += 1
        self._pending = None
        self._release(pending.request_id, self._add_reason)
        self._next_decision()

    def stop(self) -> None:
        """Answer the pending decision with STOP: hold every waiting request until the next round."""
        self._require_pending()
        self.stats.decisions += 1
        self.stats.stops += 1
        self._stop_version = self._version
        self._pending = None

    def decide(self, action: int) -> None:
        """:meth:`add` (``ADD``) or :meth:`stop` (``STOP``).

        Raises:
            ValueError: another action, or one the mask rules out.
        """
        pending = self._require_pending()
        if action not in (STOP, ADD):
            raise ValueError(f"action must be {STOP} (STOP) or {ADD} (ADD), got {action!r}")
        if not pending.mask[action]:
            raise ValueError(f"action {action} is masked out for request {pending.request_id!r}")
        if action == ADD:
            self.add()
        else:
            self.stop()

    def close_round(self) -> list[str]:
        """Close the round; the ids it released, in release order (a pending decision is dropped,
        as a STOP that is asked again next round)."""
        if not self._round_open:
            raise RuntimeError("no round is open")
        self._round_open = False
        self._pending = None
        released, self._released = self._released, []
        if self.config.retain_held_prefixes and self._waiting:
            self._retain_held_prefixes()
        return released

    def _retain_held_prefixes(self) -> None:
        """One held request per group not in flight, the largest group last (evicted last)."""
        waiting = self.groups
        reps = sorted(waiting.waiting_groups_out_of_flight(), key=lambda kv: waiting.waiting_size(kv[0]))
        if reps:
            self.stats.retained_blocks += self._engine.retain_prefixes([rid for _, rid in reps])

    def plan(self, now: float, free_slots: int, engine: EngineView | None = None) -> list[str]:
        """One round answered by :attr:`policy`: the ids to release now, in release order.

        Args: as :meth:`open_round`.
        """
        start = time.perf_counter()
        try:
            self.open_round(now, free_slots, engine)
            policy, kind = self.policy, self.policy_obs_kind
            observes, plain = self._policy_observes, self._plain_obs
            while (pending := self._pending) is not None:
                if plain:
                    obs = self._base_observation(pending)
                else:
                    obs = self.observe(kind) if observes else None
                action = int(policy.act(obs, pending.mask))  # type: ignore[arg-type]
                if action == ADD:
                    self.add()
                elif action == STOP:
                    self.stop()
                else:
                    raise ValueError(f"the policy answered {action!r}, not STOP ({STOP}) or ADD ({ADD})")
            return self.close_round()
        finally:
            if self._round_open:  # the policy raised: leave no half-open round behind
                self.close_round()
            elapsed = time.perf_counter() - start
            stats = self.stats
            stats.plan_calls += 1
            stats.decision_seconds += elapsed
            if elapsed > stats.max_plan_seconds:
                stats.max_plan_seconds = elapsed

    def _require_pending(self) -> Decision:
        if self._pending is None:
            raise RuntimeError("no decision is pending")
        return self._pending

    def _next_decision(self) -> None:
        """Make the ordering's next candidate the pending decision, or end the round's decisions.

        An empty batch is seeded first, without a decision (STOP would be meaningless there): with
        ``svf_seed`` by the smallest-volume request, else by the ordering's first candidate. This
        also holds when the batch empties during an open round.
        """
        if not self._round_open or self._free <= 0 or not self._waiting:
            return
        if not self._active:
            seed = self._volume_q.peek() if self._volume_q is not None else self.ordering.next_candidate()
            assert seed is not None
            self._release(seed, "seed")
            if self._free <= 0 or not self._waiting:
                return
        while True:
            rid = self.ordering.next_candidate()
            if rid is None:
                return
            footprint = self._footprint(rid)
            if not self.budget.fits(footprint):
                self.stats.capacity_stops += 1
                return
            # what _release charges if nothing changes before the candidate is released
            self._fit = (rid, self._version, footprint)
            if self._group_decision and (self.groups.in_flight(rid) or self.groups.shares_nothing(rid)):
                # the group decision is only about opening a group: this request joins freely
                self._release(rid, "group")
                if self._free <= 0 or not self._waiting:
                    return
                continue
            # a STOP with nothing changed since is not asked again; the group decision reads the
            # engine's queue and cache, which change at every step, so it is always asked
            if self._stop_version == self._version and not self._group_decision:
                self.stats.skipped_decisions += 1
                return
            self._pending = Decision(rid, _MASKS[bool(self._active)])
            return

    # ------------------------------------------------------------------ internals

    def _footprint(self, request_id: str) -> float:
        """KV tokens the request adds to the batch at its peak (0 with admission 'none')."""
        entry = self._waiting[request_id]
        # _footprint_of, inline (the hot path of every decision)
        admission = self.config.admission
        if admission == "none":
            return 0.0
        unshared = min(self.cht.missing_count(request_id) * self.chunk_size, entry.prompt_len)
        return float(unshared) + (entry.output_len if admission == "peak" else 0.0)

    def _footprint_of(self, missing: int, prompt_len: float, output_len: float) -> float:
        """The footprint of a request that misses ``missing`` chunks of the batch's prefixes;
        it never decreases when an argument grows."""
        admission = self.config.admission
        if admission == "none":
            return 0.0
        unshared = min(missing * self.chunk_size, prompt_len)
        return float(unshared) + (output_len if admission == "peak" else 0.0)

    def nothing_fits(self, fewest_missing: int) -> bool:
        """Whether no waiting request fits the KV budget, when ``fewest_missing`` is the fewest
        chunks a waiting request misses (the CHT's best candidate's): then no ordering can find
        one that does, and the round ends at the budget whichever candidate it names (an
        ordering that searches its candidate asks this first). Decided from a floor under
        every waiting request's footprint: that many missing chunks, the shortest prompt and
        output estimate that ever arrived. With admission 'none' the budget has no capacity and
        everything fits."""
        return not self.budget.fits(self._footprint_of(fewest_missing, self._shortest_prompt,
                                                       self._shortest_output))

    def _release(self, request_id: str, reason: str) -> None:
        # before activation: against the batch without it. A footprint changes only with the
        # missing chunks, which change only with a change that bumps _version (a release, finish
        # or abort), so the one _next_decision computed for this candidate at this version holds.
        fit = self._fit
        if fit is not None and fit[0] == request_id and fit[1] == self._version:
            footprint = fit[2]
        else:
            footprint = self._footprint(request_id)
        entry = self._waiting.pop(request_id)
        self.cht.activate(request_id)
        self.groups.release(request_id)
        if self._ordering_release is not None:
            self._ordering_release(request_id)
        if self._volume_q is not None:
            self._volume_q.discard(request_id)
        entry.footprint = footprint
        self.budget.charge(request_id, footprint)
        self._active[request_id] = entry
        self._version += 1
        self._free -= 1
        self.stats.released[reason] += 1
        self._released.append(request_id)

    def _oldest_waiting(self) -> Entry | None:
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

    def oldest_arrival(self) -> float | None:
        """Arrival time of the longest-waiting request (None when none waits)."""
        entry = self._oldest_waiting()
        return None if entry is None else entry.arrival

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
        self.groups.check_consistency(waiting, active)
        radix = getattr(self.ordering, "radix", None)
        if radix is not None:
            assert set(radix.waiting_ids()) == waiting, "radix waiting set"
            assert set(radix.active_ids()) == active, "radix active set"
        for queue in (getattr(self.ordering, "queue", None), self._volume_q):
            if queue is not None:
                assert len(queue) == len(waiting) and all(r in queue for r in waiting), "key queue"
        assert len(self.budget) == len(active) and all(r in self.budget for r in active), "budget"
        used = sum(e.footprint for e in self._active.values())
        assert abs(self.budget.used - used) <= 1e-6 * max(1.0, used), "budget total"
        live = [e for e in self._arrivals if self._waiting.get(e.request_id) is e]
        assert len(live) == len(waiting), "arrival queue"
        if self._pending is not None:
            assert self._round_open and self._pending.request_id in waiting, "pending decision"
        if not self._waiting and not self._active:
            assert self.cht.num_keys == 0, "keys left in the CHT"
