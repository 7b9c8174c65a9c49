"""The scheduler: one engine step at a time, or a stretch of identical decode steps at once.

Mirrors (paths inside the ``vllm`` package, vLLM 0.32) ``v1/core/sched/scheduler.py``:

* ``Scheduler.schedule``: RUNNING requests first, in order, under the token budget, with
  ``long_prefill_token_threshold`` (only when more than one request is running or waiting;
  optionally floored at a fair share of the budget), the ``max_model_len`` cap, and preemption
  of ``running[-1]`` when ``allocate_slots`` fails (``_preempt_request``: blocks freed, computed
  tokens reset, request prepended to WAITING, resumed later as a prefill of prompt + outputs so
  far). Then, only if nobody was preempted this step, WAITING requests in FCFS order up to
  ``max_num_seqs`` (``max_num_active_seqs``), each with a prefix-cache lookup, chunked against
  the remaining budget (or rejected whole when chunked prefill is off), stopping at the first
  request that cannot be allocated. ``_update_after_schedule`` advances the computed tokens.
* Between the two halves of a step, the model runner's update of the persistent batch
  (:class:`~feather_env.engines.input_batch.InputBatch`).
* ``Scheduler.update_from_output``: a request whose computed tokens reach its known tokens
  samples one token; it finishes when it has ``max_tokens`` outputs (or reaches
  ``max_model_len``), its blocks freed in scheduling order in that same step.
  ``Scheduler.finish_requests`` for aborts.

Fast-forward (not vLLM's): a stretch of pure-decode steps changes the KV state only by popping
blocks from the front of the free queue (one per request per block boundary, in running order)
and by caching the requests' own output blocks, so the blocks every request gets, and the step at
which an allocation would fail, follow from the free queue and the requests' lengths. A waiting
head that fails allocation keeps failing while free blocks only decrease and its hit blocks stay;
the stretch conservatively ends where one of its free hit blocks is popped
(:meth:`Scheduler.decode_horizon`, :meth:`Scheduler.advance_decode`).
"""

from __future__ import annotations

from collections import deque

from feather_env.engines.input_batch import InputBatch
from feather_env.engines.kv_cache_manager import KVCacheManager
from feather_env.engines.request import SimRequest
from feather_env.engines.sim_config import SimEngineConfig
from feather_env.engines.step_result import StepResult

# What trying to admit the head of WAITING would do (Scheduler._plan_admission).
_ADMITTED = 0
_OVER_BUDGET = 1  # rejected before allocation: chunked prefill is off and it does not fit the budget
_NO_FREE_BLOCKS = 2  # allocate_slots would fail


class Scheduler:
    """vLLM's ``Scheduler`` over a :class:`KVCacheManager`, driving the persistent batch."""

    def __init__(self, config: SimEngineConfig, kv_cache_manager: KVCacheManager,
                 input_batch: InputBatch) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.block_pool = kv_cache_manager.block_pool
        self.input_batch = input_batch
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len
        self.max_num_scheduled_tokens = min(config.max_num_scheduled_tokens or config.max_num_batched_tokens,
                                            config.max_num_batched_tokens)
        self.input_budget = config.max_num_batched_tokens
        self.max_num_active_reqs = config.max_num_active_seqs or config.max_num_seqs
        self.requests: dict[str, SimRequest] = {}
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.finished_requests: list[SimRequest] = []  # finished or aborted since the last step
        self.step_count = 0
        # (steps, block-boundary events) of the coming decode stretch; None once the state changes.
        self._decode_plan: tuple[int, list[tuple[int, int]]] | None = None

    def forget_decode_plan(self) -> None:
        """The state changed (from outside too: the prefix cache): the decode horizon is planned again."""
        self._decode_plan = None

    # ------------------------------------------------------------ requests

    def add_request(self, request: SimRequest) -> None:
        """Queue a request at the back of WAITING."""
        self.requests[request.request_id] = request
        self.waiting.append(request)
        self._decode_plan = None

    def finish_request(self, request_id: str) -> None:
        """Abort a request now, freeing its blocks (finish_requests); unknown ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        if request.is_running:
            self.running.remove(request)
            request.is_running = False
        else:
            self.waiting.remove(request)
        self.kv_cache_manager.free(request)
        self.finished_requests.append(request)
        self._decode_plan = None

    # ------------------------------------------------------------ one step

    def step(self) -> StepResult:
        """Exactly one vLLM engine step: schedule, the model runner's batch update, update_from_output."""
        self._decode_plan = None
        self.step_count += 1
        step = self.step_count
        threshold = self._long_prefill_threshold()
        scheduled: list[SimRequest] = []
        num_scheduled: list[int] = []
        budget, preempted = self._schedule_running(self.max_num_scheduled_tokens, threshold, scheduled,
                                                   num_scheduled)
        num_from_running = len(scheduled)
        new_requests: list[SimRequest] = []
        resumed_requests: list[SimRequest] = []
        admitted: list[tuple[str, int]] = []
        if not preempted:
            new_requests, resumed_requests, admitted = self._schedule_waiting(budget, threshold, scheduled,
                                                                              num_scheduled)
        num_computed, is_prefill, block_ids = self._update_after_schedule(scheduled, num_scheduled, step)
        finished_before, self.finished_requests = self.finished_requests, []
        self.input_batch.update_states(finished_before, scheduled, num_from_running, new_requests,
                                       resumed_requests, step)
        finished, first_token = self._update_from_output(scheduled)
        return StepResult(
            admitted=admitted,
            preempted=[request.request_id for request in preempted],
            finished=[request.request_id for request in finished],
            first_token=first_token,
            _request_ids=[request.request_id for request in scheduled],
            _num_scheduled=num_scheduled,
            _num_computed=num_computed,
            _block_ids=block_ids,
            _is_prefill=is_prefill,
            _batch_order=self.input_batch.schedule_order(),
            _block_size=self.block_size,
        )

    def _long_prefill_threshold(self) -> int:
        """This step's cap on one request's tokens (0: none)."""
        num_eligible = len(self.running) + len(self.waiting)
        threshold = self.config.long_prefill_token_threshold if num_eligible > 1 else 0
        if threshold > 0 and self.config.long_prefill_token_threshold_adaptive:
            threshold = max(threshold, self.input_budget // num_eligible)
        return threshold

    def _schedule_running(self, budget: int, threshold: int, scheduled: list[SimRequest],
                          num_scheduled: list[int]) -> tuple[int, list[SimRequest]]:
        """RUNNING requests, in order, preempting from the back when blocks run out (schedule's first
        loop); appends to ``scheduled`` / ``num_scheduled``, returns the budget left and the preempted."""
        running = self.running
        block_size, max_model_len = self.block_size, self.max_model_len
        allocate_slots = self.kv_cache_manager.allocate_slots
        preempted: list[SimRequest] = []
        index = 0
        while index < len(running) and budget > 0:
            request = running[index]
            num_computed = request.num_computed_tokens
            num_new_tokens = request.num_prompt_tokens + request.num_output_tokens - num_computed
            if 0 < threshold < num_new_tokens:
                num_new_tokens = threshold
            if num_new_tokens > budget:
                num_new_tokens = budget
            if num_new_tokens > max_model_len - num_computed - 1:
                num_new_tokens = max_model_len - num_computed - 1
            if num_new_tokens <= 0:
                index += 1
                continue
            num_tokens = num_computed + num_new_tokens
            # Most steps of a request fit its last block and fill none: nothing to allocate or cache.
            if (num_tokens > len(request.block_ids) * block_size
                    or num_tokens // block_size > request.num_cached_blocks):
                while not allocate_slots(request, num_tokens):
                    victim = running.pop()
                    self._preempt_request(victim)
                    preempted.append(victim)
                    if victim is request:
                        break
                if not request.is_running:
                    break
            scheduled.append(request)
            num_scheduled.append(num_new_tokens)
            budget -= num_new_tokens
            index += 1
        return budget, preempted

    def _schedule_waiting(self, budget: int, threshold: int, scheduled: list[SimRequest],
                          num_scheduled: list[int]
                          ) -> tuple[list[SimRequest], list[SimRequest], list[tuple[str, int]]]:
        """WAITING requests, FCFS, until one does not fit (schedule's second loop); appends to
        ``scheduled`` / ``num_scheduled``, returns the new and the resumed requests and (request id,
        hit tokens) of each admission."""
        kv_cache_manager = self.kv_cache_manager
        running, waiting = self.running, self.waiting
        block_size = self.block_size
        new_requests: list[SimRequest] = []
        resumed_requests: list[SimRequest] = []
        admitted: list[tuple[str, int]] = []
        while budget > 0 and waiting:
            if len(running) >= self.max_num_active_reqs:
                break
            request = waiting[0]
            num_new_tokens, computed_blocks, outcome = self._plan_admission(request, budget, threshold)
            if outcome != _ADMITTED:
                break
            num_hit_tokens = len(computed_blocks) * block_size
            kv_cache_manager.allocate_new_computed_blocks(request, computed_blocks)
            kv_cache_manager.allocate_slots(request, num_hit_tokens + num_new_tokens)  # fits: planned
            kv_cache_manager.record_prefix_cache_stats(request, num_hit_tokens)
            waiting.popleft()
            running.append(request)
            request.is_running = True
            request.in_decode = False
            request.num_computed_tokens = num_hit_tokens
            (resumed_requests if request.num_preemptions else new_requests).append(request)
            admitted.append((request.request_id, num_hit_tokens))
            scheduled.append(request)
            num_scheduled.append(num_new_tokens)
            budget -= num_new_tokens
        return new_requests, resumed_requests, admitted

    def _plan_admission(self, request: SimRequest, budget: int, threshold: int) -> tuple[int, list[int], int]:
        """(tokens to schedule, its cache hit's blocks, outcome) of admitting ``request`` now, the head
        of WAITING; no side effects. Outcome: _ADMITTED, _OVER_BUDGET or _NO_FREE_BLOCKS."""
        kv_cache_manager = self.kv_cache_manager
        computed_blocks = kv_cache_manager.get_computed_blocks(request)
        num_tokens = request.num_prompt_tokens + request.num_output_tokens
        num_new_tokens = num_tokens - len(computed_blocks) * self.block_size
        if 0 < threshold < num_new_tokens:
            num_new_tokens = threshold
        if not self.config.enable_chunked_prefill and num_new_tokens > budget:
            return 0, computed_blocks, _OVER_BUDGET
        if num_new_tokens > budget:
            num_new_tokens = budget
        if not kv_cache_manager.can_allocate(request, computed_blocks, num_new_tokens, bool(self.running)):
            return 0, computed_blocks, _NO_FREE_BLOCKS
        return num_new_tokens, computed_blocks, _ADMITTED

    def _preempt_request(self, request: SimRequest) -> None:
        """Free its blocks, reset it, put it back at the head of WAITING."""
        self.kv_cache_manager.free(request)
        request.is_running = False
        request.in_decode = False
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def _update_after_schedule(self, scheduled: list[SimRequest], num_scheduled: list[int], step: int
                               ) -> tuple[list[int], list[bool], list[list[int]]]:
        """Advance each scheduled request's computed tokens and mark it with the step and its index;
        returns the snapshot a StepResult needs: computed tokens before, is-prefill, block lists."""
        num_computed: list[int] = []
        is_prefill: list[bool] = []
        block_ids: list[list[int]] = []
        for index, request in enumerate(scheduled):
            num_new_tokens = num_scheduled[index]
            computed = request.num_computed_tokens
            num_computed.append(computed)
            # A decode computes exactly the latest sampled token; anything else computes known
            # prompt (or, after a resume, prompt + output) tokens.
            is_prefill.append(num_new_tokens != 1 or not request.num_output_tokens
                              or computed != request.num_prompt_tokens + request.num_output_tokens - 1)
            block_ids.append(request.block_ids)
            request.num_computed_tokens = computed + num_new_tokens
            request.scheduled_step = step
            request.schedule_index = index
        return num_computed, is_prefill, block_ids

    def _update_from_output(self, scheduled: list[SimRequest]) -> tuple[list[SimRequest], list[str]]:
        """Sample, stop, free: returns the finished requests and the ids of those with a first token."""
        max_model_len = self.max_model_len
        free = self.kv_cache_manager.free
        finished: list[SimRequest] = []
        first_token: list[str] = []
        for request in scheduled:
            if request.num_computed_tokens >= request.num_prompt_tokens + request.num_output_tokens:
                request.num_output_tokens += 1
                request.in_decode = True
                if request.num_output_tokens == 1:
                    first_token.append(request.request_id)
                if (request.num_output_tokens >= request.max_tokens
                        or request.num_prompt_tokens + request.num_output_tokens >= max_model_len):
                    finished.append(request)
                    free(request)
        if finished:
            for request in finished:
                request.is_running = False
                del self.requests[request.request_id]
            self.running = [request for request in self.running if request.is_running]
            self.finished_requests.extend(finished)
        return finished, first_token

    # ------------------------------------------------------------ fast forward

    def decode_horizon(self) -> int:
        """How many next steps are guaranteed identical pure-decode steps (0: the next is not one).

        In such a step every running request gets one token, nobody is admitted, preempted or
        finishes, and the persistent batch keeps its order. The stretch ends before the first
        step where a request would finish, a block allocation would fail, or an allocation
        would evict a block the head of WAITING hits (the only change that could let it in).
        """
        plan = self._decode_plan
        if plan is None:
            plan = self._decode_plan = self._plan_decode_stretch()
        return plan[0]

    def _plan_decode_stretch(self) -> tuple[int, list[tuple[int, int]]]:
        """(steps, [(step, running index)] of each block boundary a request crosses, sorted)."""
        running = self.running
        budget = self.max_num_scheduled_tokens
        if not running or self.finished_requests or len(running) > budget:
            return 0, []
        if len(running) != len(self.input_batch):
            return 0, []
        num_steps = self.max_model_len
        for request in running:
            if not request.in_decode or request.batch_index < 0:
                return 0, []
            remaining = request.max_tokens - request.num_output_tokens
            if remaining < num_steps:
                num_steps = remaining
        num_steps -= 1  # the step where a request samples its last token is not fast-forwarded
        if num_steps <= 0:
            return 0, []
        watched: set[int] = set()
        waiting = self.waiting
        if waiting and len(running) < self.max_num_active_reqs and budget - len(running) > 0:
            _, computed_blocks, outcome = self._plan_admission(waiting[0], budget - len(running),
                                                               self._long_prefill_threshold())
            if outcome == _ADMITTED:
                return 0, []
            if outcome == _NO_FREE_BLOCKS and not self.config.scheduler_reserve_full_isl:
                # A stretch only pops free blocks (one fewer free block each) and caches the
                # running requests' own output blocks (never in the head's chain). Checked against
                # its whole sequence, the head needs cdiv(tokens) - hit + evictable hit blocks:
                # popping one of its free hit blocks lowers that by at most one, as the free count
                # drops by one, so it keeps failing. Checked against its first chunk only, a
                # shorter hit also shrinks the chunk's own need; end the stretch where a free hit
                # block would be popped rather than prove that harmless too.
                watched = set(self.block_pool.in_free_queue(computed_blocks))
        block_size = self.block_size
        events: list[tuple[int, int]] = []
        for index, request in enumerate(running):
            # the first step whose token starts a new block
            step = (1 - (request.num_prompt_tokens + request.num_output_tokens)) % block_size
            while step < num_steps:
                events.append((step, index))
                step += block_size
        if not events:
            return num_steps, events
        events.sort()
        num_free = self.block_pool.num_free_blocks
        free_blocks = self.block_pool.free_block_ids()  # the blocks the events pop, in order
        used = 0
        for step, _ in events:
            if step >= num_steps:
                break
            if used >= num_free or (watched and next(free_blocks) in watched):
                num_steps = step
                break
            used += 1
        return num_steps, events

    def advance_decode(self, num_steps: int) -> StepResult:
        """Apply ``num_steps`` pure-decode steps at once (1 <= num_steps <= decode_horizon()).

        The entries describe the first of them; contexts grow by one token per step after it.
        """
        horizon = self.decode_horizon()
        if not 1 <= num_steps <= horizon:
            raise ValueError(f"advance_decode({num_steps}) needs 1 <= k <= decode_horizon() = {horizon}")
        assert self._decode_plan is not None
        events = self._decode_plan[1]
        running = self.running
        request_ids = [request.request_id for request in running]
        num_computed = [request.num_computed_tokens for request in running]
        block_ids = [request.block_ids for request in running]
        get_new_blocks = self.block_pool.get_new_blocks
        for step, index in events:
            if step >= num_steps:
                break
            running[index].block_ids.extend(get_new_blocks(1))
        self.step_count += num_steps
        last_step = self.step_count
        cache_blocks = self.kv_cache_manager.cache_blocks
        for index, request in enumerate(running):
            request.num_computed_tokens += num_steps
            request.num_output_tokens += num_steps
            cache_blocks(request, request.num_prompt_tokens + request.num_output_tokens - 1)
            request.scheduled_step = last_step
            request.schedule_index = index
        self._decode_plan = None
        num_running = len(running)
        return StepResult(
            admitted=[], preempted=[], finished=[], first_token=[], num_steps=num_steps,
            _request_ids=request_ids, _num_scheduled=[1] * num_running, _num_computed=num_computed,
            _block_ids=block_ids, _is_prefill=[False] * num_running,
            _batch_order=self.input_batch.schedule_order(), _block_size=self.block_size,
        )
