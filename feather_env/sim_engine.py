"""An exact, model-free discrete-event model of vLLM V1's serving loop (vLLM 0.32).

The RL environment trains batching policies in a simulator and deploys them in vLLM, so the
simulator must take the same scheduling decisions as vLLM: which requests are admitted, how
many tokens each gets per step, which prefix-cache blocks hit, which cached blocks are evicted
and when, who is preempted, and in which order the persistent batch holds the scheduled
requests. vLLM's own ``Scheduler`` makes those decisions exactly but costs ~700 us per step
with 64 running requests; :class:`SimEngine` makes the same decisions in a few microseconds
per touched request and fast-forwards pure-decode stretches in O(running requests) per
stretch (:meth:`SimEngine.decode_horizon` / :meth:`SimEngine.advance_decode`).

What is modelled, and the vLLM source it mirrors (paths inside the ``vllm`` package):

* ``v1/core/sched/scheduler.py`` ``Scheduler.schedule``: RUNNING requests first, in order,
  under the token budget, with ``long_prefill_token_threshold`` (only when more than one
  request is running or waiting; optionally floored at a fair share of the budget), the
  ``max_model_len`` cap, and preemption of ``running[-1]`` when ``allocate_slots`` fails
  (blocks freed, computed tokens reset, request prepended to WAITING, resumed later as a
  prefill of prompt + outputs so far). Then, only if nobody was preempted this step, WAITING
  requests in FCFS order up to ``max_num_seqs`` (``max_num_active_seqs``), each with a
  prefix-cache lookup, chunked against the remaining budget (or rejected whole when chunked
  prefill is off), stopping at the first request that cannot be allocated.
* ``Scheduler.update_from_output``: a request whose computed tokens reach its known tokens
  samples one token; it finishes when it has ``max_tokens`` outputs (or reaches
  ``max_model_len``), its blocks freed in scheduling order in that same step.
  ``Scheduler.finish_requests`` for aborts.
* ``v1/core/kv_cache_manager.py`` ``allocate_slots`` / ``get_computed_blocks``: longest hit of
  cached full blocks capped at ``num_tokens - 1`` tokens; the full-sequence admission gate
  (``scheduler_reserve_full_isl``, on by default); the watermark (``SchedulerConfig.watermark``,
  0 by default: ``int(watermark * num_blocks)`` blocks kept free when admitting a waiting or
  preempted request while any request is running); evictable hit blocks counted against the
  free blocks; caching of every full block up to ``min(computed + new, num_tokens)`` at
  allocation time (so a request admitted later in the same step already hits the blocks of
  one admitted before it).
* ``v1/core/single_type_kv_cache_manager.py`` ``FullAttentionManager`` /
  ``SingleTypeKVCacheManager``: block counts, touching hit blocks, freeing a request's blocks
  in reverse order.
* ``v1/core/block_pool.py`` / ``v1/core/kv_cache_utils.py``: ``num_blocks`` blocks of which
  block 0 is the null block; the free-block queue (initially by block id; allocation pops
  from the front, evicting a popped block's hash; freed blocks without a hash are prepended
  (LIFO reuse), freed cached blocks appended (LRU), each group in the order freed); the
  cached-block hash map, which keeps duplicate blocks for one hash and returns the first one
  inserted; ``reset_prefix_cache``.
* ``v1/worker/gpu_input_batch.py`` ``InputBatch.add_request`` / ``remove_request`` /
  ``condense`` and ``v1/worker/gpu_model_runner.py`` ``_update_states`` (the V1 model runner
  the CPU worker uses; vLLM picks it on CPU because Triton has no CPU backend there): each
  step removes finished and unscheduled requests, adds new requests then the scheduled
  requests not in the batch (running, then resumed) into the lowest free slot first else at
  the end, then moves the last requests into the remaining holes. The CPU attention builder
  (``v1/attention/backends/cpu_attn.py``) leaves ``reorder_batch_threshold`` at ``None``
  (``v1/attention/backend.py``), so the batch is not reordered further.

Block hashes: a prompt's full blocks are hashed once, chained (xxh3 of the block's tokens
seeded by the parent's hash), so equal prefixes give equal hashes as vLLM's block hasher
does; only equality matters. Output tokens are not known without a model: a block holding
any output token is keyed by (request, block index), i.e. outputs are taken to be unique to
their request. Output blocks do matter for exactness: once full they are cached, so they
return to the LRU end of the free queue instead of its front, and a preempted request hits
its own output blocks when it resumes.

``ScheduledEntry.is_prefill`` is False exactly when the entry computes one token, its
request's latest sampled one (the shape of a decode); everything else computes prompt tokens
or, after a resume, replays prompt + output tokens.

Fast-forward: a stretch of pure-decode steps changes the KV state only by popping blocks from
the front of the free queue (one per request per block boundary, in running order) and by
caching the requests' own output blocks, so the blocks every request gets, and the step at
which an allocation would fail, follow from the free queue and the requests' lengths. A
waiting head that fails allocation keeps failing while free blocks only decrease and its hit
blocks stay; the stretch conservatively ends where one of its free hit blocks is popped.

Not modelled (this project does not run them): speculative decoding, async scheduling (vLLM
turns it off on CPU), pipeline parallelism, KV connectors, LoRA, multimodal inputs,
structured output, priority scheduling, hybrid / sliding-window KV cache groups, partial
(sub-block) prefix hits, stop strings or EOS (requests generate exactly ``max_tokens``
tokens), the V2 model runner (``VLLM_USE_V2_MODEL_RUNNER=1``), and GPU attention backends
whose metadata builder reorders the batch (``reorder_batch_threshold`` set: FlashInfer, MLA).
Output tokens of different requests are assumed to differ: with greedy decoding, identical
prompts produce identical outputs in vLLM, whose output blocks would then be shared.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

_hash_bytes = xxhash.xxh3_64_intdigest
#: Output-block keys are negative (prompt-block keys are unsigned 64-bit digests).
_OUT_KEY_BITS = 24


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class SimEngineConfig:
    """The vLLM settings the serving loop's decisions depend on.

    Attributes:
        num_blocks: KV cache blocks, including vLLM's null block (``num_gpu_blocks``).
        block_size: tokens per KV block.
        max_num_seqs: running-request limit (``SchedulerConfig.max_num_seqs``).
        max_num_batched_tokens: token budget of one step.
        max_model_len: longest prompt + output.
        enable_chunked_prefill: split a prefill across steps when it exceeds the budget.
        enable_prefix_caching: reuse cached full blocks of equal prefixes.
        max_num_scheduled_tokens: scheduler-side token budget (``None``: the batched budget).
        max_num_active_seqs: admission limit into RUNNING (``None``: ``max_num_seqs``).
        long_prefill_token_threshold: cap on one request's tokens per step (0: none).
        long_prefill_token_threshold_adaptive: floor that cap at budget / eligible requests.
        watermark: fraction of ``num_blocks`` kept free when admitting waiting requests.
        scheduler_reserve_full_isl: admit a waiting request only if its whole known sequence
            fits, not just its first chunk.
    """

    num_blocks: int
    block_size: int = 128
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    max_model_len: int = 32768
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    max_num_scheduled_tokens: int | None = None
    max_num_active_seqs: int | None = None
    long_prefill_token_threshold: int = 0
    long_prefill_token_threshold_adaptive: bool = False
    watermark: float = 0.0
    scheduler_reserve_full_isl: bool = True

    def __post_init__(self) -> None:
        if self.num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (one is vLLM's null block): {self.num_blocks}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_num_active_seqs is not None and not 1 <= self.max_num_active_seqs <= self.max_num_seqs:
            raise ValueError("max_num_active_seqs must be between 1 and max_num_seqs")
        if self.max_num_scheduled_tokens is not None and self.max_num_scheduled_tokens < 1:
            raise ValueError("max_num_scheduled_tokens must be positive")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be non-negative")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # vLLM's SchedulerConfig rejects this too: such prompts could never be scheduled.
            raise ValueError("without chunked prefill max_num_batched_tokens must be >= max_model_len")

    @classmethod
    def from_vllm(cls, vllm_config: Any, num_gpu_blocks: int) -> SimEngineConfig:
        """The configuration of a real ``VllmConfig``; ValueError if it uses what is not modelled."""
        sc = vllm_config.scheduler_config
        cc = vllm_config.cache_config
        pc = vllm_config.parallel_config
        unsupported = []
        if vllm_config.speculative_config is not None:
            unsupported.append("speculative decoding")
        if sc.async_scheduling:
            unsupported.append("async scheduling")
        if str(sc.policy) != "fcfs":
            unsupported.append(f"scheduling policy {sc.policy!r}")
        if vllm_config.lora_config is not None:
            unsupported.append("LoRA")
        if vllm_config.kv_transfer_config is not None:
            unsupported.append("KV connectors")
        if pc.pipeline_parallel_size > 1 or pc.decode_context_parallel_size > 1:
            unsupported.append("pipeline / decode context parallelism")
        if vllm_config.model_config.is_encoder_decoder:
            unsupported.append("encoder-decoder models")
        if unsupported:
            raise ValueError("SimEngine does not model " + ", ".join(unsupported))
        return cls(
            num_blocks=int(num_gpu_blocks),
            block_size=int(cc.block_size),
            max_num_seqs=int(sc.max_num_seqs),
            max_num_batched_tokens=int(sc.max_num_batched_tokens),
            max_model_len=int(vllm_config.model_config.max_model_len),
            enable_chunked_prefill=bool(sc.enable_chunked_prefill),
            enable_prefix_caching=bool(cc.enable_prefix_caching),
            max_num_scheduled_tokens=sc.max_num_scheduled_tokens,
            max_num_active_seqs=sc.max_num_active_seqs,
            long_prefill_token_threshold=int(sc.long_prefill_token_threshold),
            long_prefill_token_threshold_adaptive=bool(sc.long_prefill_token_threshold_adaptive),
            watermark=float(sc.watermark),
            scheduler_reserve_full_isl=bool(sc.scheduler_reserve_full_isl),
        )


@dataclass(slots=True)
class ScheduledEntry:
    """One scheduled request of a step, in persistent-batch order."""

    request_id: str
    num_tokens: int  # tokens scheduled this step (1 for a decode)
    num_computed: int  # tokens already in its KV cache before this step
    block_ids: tuple[int, ...]  # its KV blocks (physical ids) during this step
    is_prefill: bool  # computing prompt (or resumed) tokens rather than one decode token


@dataclass(eq=False)
class StepResult:
    """What one engine step (or a fast-forwarded decode stretch) did.

    The per-request views are built on first access from a snapshot taken in scheduling order
    during the step (block lists are append-only while a request runs, so a list and a length
    pin its blocks); a consumer that reads only ``admitted`` / ``finished`` pays nothing for them.
    """

    admitted: list[tuple[str, int]]  # newly scheduled (or resumed) requests and their hit tokens
    preempted: list[str]
    finished: list[str]
    first_token: list[str]
    num_steps: int = 1  # >1 for a fast-forwarded decode stretch (see SimEngine.advance_decode)
    # Snapshot, in scheduling order (running requests, then admissions), and the batch order.
    _ids: list[str] = field(default_factory=list, repr=False)
    _ntok: list[int] = field(default_factory=list, repr=False)
    _ncomp: list[int] = field(default_factory=list, repr=False)
    _blocks: list[list[int]] = field(default_factory=list, repr=False)
    _prefill: list[bool] = field(default_factory=list, repr=False)
    _order: list[int] = field(default_factory=list, repr=False)  # scheduling index of each slot
    _block_size: int = field(default=1, repr=False)
    _entries: list[ScheduledEntry] | None = field(default=None, repr=False)

    @property
    def scheduled(self) -> list[tuple[str, int]]:
        """(request id, tokens) in the scheduler's order (vLLM's ``num_scheduled_tokens``)."""
        return list(zip(self._ids, self._ntok, strict=True))

    @property
    def entries(self) -> list[ScheduledEntry]:
        """The scheduled requests in persistent-batch order (of the first step of a stretch)."""
        if self._entries is None:
            bs = self._block_size
            ids, ntok, ncomp, blocks = self._ids, self._ntok, self._ncomp, self._blocks
            self._entries = [
                ScheduledEntry(ids[k], ntok[k], ncomp[k], tuple(blocks[k][: -(-(ncomp[k] + ntok[k]) // bs)]),
                               self._prefill[k])
                for k in self._order
            ]
        return self._entries

    @property
    def request_ids(self) -> list[str]:
        """Scheduled request ids in persistent-batch order."""
        return [self._ids[k] for k in self._order]

    @property
    def num_scheduled(self) -> list[int]:
        """Tokens scheduled per request (persistent-batch order; per step of a stretch)."""
        return [self._ntok[k] for k in self._order]

    @property
    def num_computed(self) -> list[int]:
        """Tokens already cached per request before the (first) step, persistent-batch order."""
        return [self._ncomp[k] for k in self._order]

    @property
    def is_prefill(self) -> list[bool]:
        """Per request, persistent-batch order: not a decode (see ScheduledEntry.is_prefill)."""
        return [self._prefill[k] for k in self._order]

    @property
    def first_block(self) -> list[int]:
        """Per request, persistent-batch order: its first KV block (shared by a shared cached prefix)."""
        return [self._blocks[k][0] for k in self._order]

    @property
    def total_tokens(self) -> int:
        """Tokens scheduled in one step."""
        return sum(self._ntok)


class _Req:
    """A request's scheduler state (vLLM ``Request`` + its KV blocks + its batch slot)."""

    __slots__ = ("rid", "serial", "P", "max_tokens", "hashes", "num_out", "num_computed", "blocks",
                 "num_cached", "running", "num_preemptions", "slot", "mark", "sidx", "in_decode")

    def __init__(self, rid: str, serial: int, prompt_len: int, max_tokens: int, hashes: list[int]):
        self.rid = rid
        self.serial = serial
        self.P = prompt_len
        self.max_tokens = max_tokens
        self.hashes = hashes  # chained hashes of the prompt's full blocks
        self.num_out = 0
        self.num_computed = 0
        self.blocks: list[int] = []
        self.num_cached = 0  # leading blocks that carry their hash (vLLM num_cached_block)
        self.running = False
        self.num_preemptions = 0
        self.slot = -1  # persistent-batch index, -1 when not in the batch
        self.mark = -1  # last step it was scheduled in
        self.sidx = -1  # its index in that step's scheduling order
        self.in_decode = False  # sampled since its last (re)admission


class SimEngine:
    """vLLM V1's scheduler, KV cache manager and persistent batch, without a model."""

    def __init__(self, config: SimEngineConfig) -> None:
        self.config = config
        c = config
        self._bs = c.block_size
        self._N = c.num_blocks
        self._mml = c.max_model_len
        self._caching = c.enable_prefix_caching
        self._budget0 = min(c.max_num_scheduled_tokens or c.max_num_batched_tokens, c.max_num_batched_tokens)
        self._input_budget = c.max_num_batched_tokens
        self._max_active = c.max_num_active_seqs or c.max_num_seqs
        self._watermark = int(c.watermark * c.num_blocks)
        self._thr = c.long_prefill_token_threshold
        # Free-block queue: a doubly linked list over block ids with sentinels N (head) and
        # N + 1 (tail), as FreeKVCacheBlockQueue; block 0 (null block) is never in it.
        N = self._N
        self._head, self._tail = N, N + 1
        self._nxt = list(range(1, N + 2)) + [-1]
        self._prv = [-1] + list(range(0, N)) + [N - 1]
        self._nxt[N] = 1
        self._prv[1] = N
        self._nxt[N - 1] = N + 1
        self._prv[N + 1] = N - 1
        self._num_free = N - 1
        self._ref = [0] * N
        self._ref[0] = 1  # the null block is always "used"
        self._bhash: list[int | None] = [None] * N
        #: block hash -> block id, or list of block ids (duplicates, first inserted first)
        self._map: dict[int, int | list[int]] = {}
        self._requests: dict[str, _Req] = {}
        self._waiting: deque[_Req] = deque()
        self._running: list[_Req] = []
        self._batch: list[_Req | None] = []
        self._pending_removal: list[_Req] = []
        self._serial = 0
        self._step_no = 0
        self._version = 0  # bumped by every state change; keys the decode-horizon plan
        self._plan: tuple[int, int, list[tuple[int, int]]] | None = None
        self._stats = [0, 0]  # queries, hits of first admissions
        self._preempted_stats = [0, 0]

    # ----------------------------------------------------------------- requests

    def _hash_prompt(self, tokens: np.ndarray) -> list[int]:
        arr = np.ascontiguousarray(tokens, dtype=np.int64)
        mv = memoryview(arr.tobytes())
        step = self._bs * 8
        out: list[int] = []
        h = 0
        for start in range(0, (len(arr) // self._bs) * step, step):
            h = _hash_bytes(mv[start : start + step], h)
            out.append(h)
        return out

    def add_request(self, request_id: str, prompt_token_ids: np.ndarray | Sequence[int],
                    max_tokens: int) -> None:
        """Queue a request at the back of WAITING (vLLM ``Scheduler.add_request``)."""
        if request_id in self._requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        prompt = np.asarray(prompt_token_ids)
        if prompt.ndim != 1 or len(prompt) == 0:
            raise ValueError(f"request {request_id!r}: the prompt must be a non-empty 1-d token array")
        max_tokens = int(max_tokens)
        if max_tokens < 1:
            raise ValueError(f"request {request_id!r}: max_tokens must be at least 1, got {max_tokens}")
        P = len(prompt)
        if P + max_tokens > self._mml:
            raise ValueError(f"request {request_id!r}: prompt ({P}) + max_tokens ({max_tokens}) exceeds "
                             f"max_model_len ({self._mml})")
        # Its last step holds P + max_tokens - 1 tokens; more blocks than the pool has would
        # make vLLM preempt and re-admit it forever.
        need = _cdiv(P + max_tokens - 1, self._bs)
        if need > self._N - 1:
            raise ValueError(f"request {request_id!r} needs {need} KV blocks of {self._bs} tokens but the "
                             f"cache has {self._N - 1} usable blocks; it could never finish")
        hashes = self._hash_prompt(prompt) if self._caching else []
        r = _Req(request_id, self._serial, P, max_tokens, hashes)
        self._serial += 1
        self._requests[request_id] = r
        self._waiting.append(r)
        self._version += 1

    def abort_request(self, request_id: str) -> None:
        """Finish a request now, freeing its blocks (vLLM ``finish_requests``); unknown ids are ignored."""
        r = self._requests.pop(request_id, None)
        if r is None:
            return
        if r.running:
            self._running.remove(r)
            r.running = False
        else:
            self._waiting.remove(r)
        self._free_blocks(r)
        self._pending_removal.append(r)
        self._version += 1

    # --------------------------------------------------------------- block pool

    def _popleft(self, n: int) -> list[int]:
        """Take n blocks from the front of the free queue, evicting their cached hashes."""
        nxt, ref, bhash = self._nxt, self._ref, self._bhash
        out = []
        b = nxt[self._head]
        for _ in range(n):
            out.append(b)
            key = bhash[b]
            if key is not None:
                self._map_pop(key, b)
                bhash[b] = None
            ref[b] = 1
            b = nxt[b]
        nxt[self._head] = b
        self._prv[b] = self._head
        self._num_free -= n
        return out

    def _map_pop(self, key: int, b: int) -> None:
        v = self._map[key]
        if v.__class__ is int:
            del self._map[key]
        else:
            v.remove(b)  # type: ignore[union-attr]
            if not v:
                del self._map[key]

    def _free_blocks(self, r: _Req) -> None:
        """Return a request's blocks, tail first (KVCacheManager.free -> BlockPool.free_blocks)."""
        blocks = r.blocks
        if not blocks:
            return
        ref, bhash = self._ref, self._bhash
        first: list[int] = []
        last: list[int] = []
        caching = self._caching
        for b in reversed(blocks):
            ref[b] -= 1
            if ref[b] == 0:
                if caching and bhash[b] is not None:
                    last.append(b)
                else:
                    first.append(b)
        nxt, prv = self._nxt, self._prv
        if first:
            p = self._head
            old_first = nxt[p]
            for b in first:
                prv[b] = p
                nxt[p] = b
                p = b
            nxt[p] = old_first
            prv[old_first] = p
        if last:
            t = prv[self._tail]
            for b in last:
                nxt[t] = b
                prv[b] = t
                t = b
            nxt[t] = self._tail
            prv[self._tail] = t
        self._num_free += len(first) + len(last)
        r.blocks = []  # a new list: StepResult snapshots keep the old one
        r.num_cached = 0

    def retain(self, prefixes: Sequence[Sequence[int]]) -> int:
        """Move the free cached blocks of each prefix (block hashes, as :meth:`block_hashes`
        gives) to the LRU end of the free queue, so they are evicted last: each prefix's first
        block last (vLLM frees a request's blocks tail first, so a prefix's head outlives its
        tail), and the later prefixes of ``prefixes`` after the earlier ones. What the
        ``retain_held_prefixes`` switch of the scheduler does to vLLM's ``free_block_queue``;
        returns the blocks moved."""
        if not self._caching:
            return 0
        m, ref, nxt, prv = self._map, self._ref, self._nxt, self._prv
        moved = 0
        for hashes in prefixes:
            blocks = []
            for key in hashes:
                v = m.get(key)
                if v is None:
                    break
                blocks.append(v if v.__class__ is int else v[0])  # type: ignore[index]
            for b in reversed(blocks):
                if ref[b]:
                    continue  # held by a request: not in the free queue
                p, n = prv[b], nxt[b]
                nxt[p], prv[n] = n, p
                t = prv[self._tail]
                nxt[t], prv[b], nxt[b], prv[self._tail] = b, t, self._tail, b
                moved += 1
        if moved:
            self._version += 1
        return moved

    def _cache_blocks(self, r: _Req, num_tokens: int) -> None:
        nfull = num_tokens // self._bs
        j = r.num_cached
        if j >= nfull or not self._caching:
            return
        m, bhash, blocks = self._map, self._bhash, r.blocks
        hashes = r.hashes
        nh = len(hashes)
        while j < nfull:
            key = hashes[j] if j < nh else -((r.serial << _OUT_KEY_BITS) + j) - 1
            b = blocks[j]
            v = m.get(key)
            if v is None:
                m[key] = b
            elif v.__class__ is int:
                m[key] = [v, b]  # type: ignore[list-item]
            else:
                v.append(b)  # type: ignore[union-attr]
            bhash[b] = key
            j += 1
        r.num_cached = nfull

    def _lookup(self, r: _Req) -> list[int]:
        """Longest run of cached full blocks, at most num_tokens - 1 tokens (get_computed_blocks)."""
        if not self._caching:
            return []
        limit = (r.P + r.num_out - 1) // self._bs
        m = self._map
        out = []
        hashes = r.hashes
        for j in range(limit):
            key = hashes[j] if j < len(hashes) else -((r.serial << _OUT_KEY_BITS) + j) - 1
            v = m.get(key)
            if v is None:
                break
            out.append(v if v.__class__ is int else v[0])  # type: ignore[index]
        return out

    def _admission(self, r: _Req, budget: int, thr: int) -> tuple[int, list[int], int]:
        """(tokens to schedule, hit blocks, reason) for the head of WAITING; no side effects.

        reason: 0 admitted, 1 rejected before allocation (chunked prefill off and it does not
        fit the budget), 2 allocation failed.
        """
        hit = self._lookup(r)
        H = len(hit)
        bs = self._bs
        num_tokens = r.P + r.num_out
        n = num_tokens - H * bs
        if 0 < thr < n:
            n = thr
        if not self.config.enable_chunked_prefill and n > budget:
            return 0, hit, 1
        if n > budget:
            n = budget
        ref = self._ref
        evictable = 0
        for b in hit:
            if ref[b] == 0:
                evictable += 1
        wm = self._watermark if self._running else 0
        free = self._num_free
        mml = self._mml
        if self.config.scheduler_reserve_full_isl:
            full = max(_cdiv(min(num_tokens, mml), bs) - H, 0)
            if full + evictable + wm > free:
                return 0, hit, 2
        need = max(_cdiv(min(H * bs + n, mml), bs) - H, 0)
        if need + evictable + wm > free:
            return 0, hit, 2
        return n, hit, 0

    # --------------------------------------------------------------------- step

    def _threshold(self) -> int:
        num_eligible = len(self._running) + len(self._waiting)
        thr = self._thr if num_eligible > 1 else 0
        if thr > 0 and self.config.long_prefill_token_threshold_adaptive:
            thr = max(thr, self._input_budget // num_eligible)
        return thr

    def step(self) -> StepResult:
        """Exactly one vLLM engine step: schedule, model-runner batch update, update_from_output."""
        self._version += 1
        self._step_no += 1
        mark = self._step_no
        bs = self._bs
        mml = self._mml
        budget = self._budget0
        thr = self._threshold()
        running = self._running
        sched: list[_Req] = []
        ns: list[int] = []
        preempted: list[_Req] = []

        # RUNNING requests, in order (Scheduler.schedule, first loop).
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            nc = r.num_computed
            n = r.P + r.num_out - nc
            if 0 < thr < n:
                n = thr
            if n > budget:
                n = budget
            if n > mml - nc - 1:
                n = mml - nc - 1
            if n <= 0:
                i += 1
                continue
            upto = nc + n
            need = -(-(upto if upto < mml else mml) // bs) - len(r.blocks)
            while need > self._num_free:
                victim = running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is r:
                    break
            if not r.running:
                break
            if need > 0:
                r.blocks.extend(self._popleft(need))
            tokens = r.P + r.num_out
            if (upto if upto < tokens else tokens) // bs > r.num_cached:
                self._cache_blocks(r, upto if upto < tokens else tokens)
            sched.append(r)
            ns.append(n)
            budget -= n
            i += 1

        # WAITING requests, FCFS, only if nobody was preempted (second loop).
        num_from_running = len(sched)
        new_reqs: list[_Req] = []
        resumed: list[_Req] = []
        admitted: list[tuple[str, int]] = []
        if not preempted:
            waiting = self._waiting
            while budget > 0 and waiting:
                if len(running) >= self._max_active:
                    break
                r = waiting[0]
                n, hit, reason = self._admission(r, budget, thr)
                if reason:
                    break
                ref = self._ref
                for b in hit:
                    if ref[b] == 0:
                        p, q = self._prv[b], self._nxt[b]
                        self._nxt[p] = q
                        self._prv[q] = p
                        self._num_free -= 1
                    ref[b] += 1
                H = len(hit)
                hit_tokens = H * bs
                r.blocks = hit
                r.num_cached = H
                upto = hit_tokens + n
                need = _cdiv(upto if upto < mml else mml, bs) - H
                if need > 0:
                    hit.extend(self._popleft(need))
                tokens = r.P + r.num_out
                self._cache_blocks(r, upto if upto < tokens else tokens)
                if self._caching:
                    stats = self._preempted_stats if r.num_preemptions else self._stats
                    stats[0] += tokens
                    stats[1] += hit_tokens
                waiting.popleft()
                running.append(r)
                r.running = True
                r.in_decode = False
                r.num_computed = hit_tokens
                (resumed if r.num_preemptions else new_reqs).append(r)
                admitted.append((r.rid, hit_tokens))
                sched.append(r)
                ns.append(n)
                budget -= n

        # Scheduler._update_after_schedule, with the snapshot the StepResult needs.
        ncs: list[int] = []
        prefill: list[bool] = []
        blocks: list[list[int]] = []
        for k, r in enumerate(sched):
            n = ns[k]
            nc = r.num_computed
            ncs.append(nc)
            # A decode computes exactly the latest sampled token; anything else computes known
            # prompt (or, after a resume, prompt + output) tokens.
            prefill.append(n != 1 or not r.num_out or nc != r.P + r.num_out - 1)
            blocks.append(r.blocks)
            r.num_computed = nc + n
            r.mark = mark
            r.sidx = k

        # Model runner: the persistent batch (GPUModelRunner._update_states).
        self._update_batch(sched, num_from_running, new_reqs, resumed, mark)

        # update_from_output: sample, stop, free.
        finished: list[_Req] = []
        first_token: list[str] = []
        for r in sched:
            if r.num_computed >= r.P + r.num_out:
                r.num_out += 1
                r.in_decode = True
                if r.num_out == 1:
                    first_token.append(r.rid)
                if r.num_out >= r.max_tokens or r.P + r.num_out >= mml:
                    finished.append(r)
                    self._free_blocks(r)
        if finished:
            for r in finished:
                r.running = False
                del self._requests[r.rid]
            self._running = [r for r in running if r.running]
            self._pending_removal.extend(finished)

        return StepResult(
            admitted=admitted,
            preempted=[r.rid for r in preempted],
            finished=[r.rid for r in finished],
            first_token=first_token,
            _ids=[r.rid for r in sched],
            _ntok=ns,
            _ncomp=ncs,
            _blocks=blocks,
            _prefill=prefill,
            _order=[r.sidx for r in self._batch],  # type: ignore[union-attr]
            _block_size=bs,
        )

    def _preempt(self, r: _Req) -> None:
        """Scheduler._preempt_request: free, reset, back to the head of WAITING."""
        self._free_blocks(r)
        r.running = False
        r.in_decode = False
        r.num_computed = 0
        r.num_preemptions += 1
        self._waiting.appendleft(r)

    def _update_batch(self, sched: list[_Req], num_from_running: int, new_reqs: list[_Req],
                      resumed: list[_Req], mark: int) -> None:
        """GPUModelRunner._update_states on the persistent batch (InputBatch)."""
        batch = self._batch
        holes: list[int] = []
        # Finished (and aborted) requests since the last step, then the unscheduled ones.
        for r in self._pending_removal:
            if r.slot >= 0:
                holes.append(r.slot)
                batch[r.slot] = None
                r.slot = -1
        self._pending_removal = []
        for k, r in enumerate(batch):
            if r is not None and r.mark != mark:
                holes.append(k)
                batch[k] = None
                r.slot = -1
        # Adds fill the lowest hole first (BatchUpdateBuilder.pop_removed), else append:
        # new requests, then scheduled running requests not in the batch, then resumed ones.
        heapq.heapify(holes)
        for r in new_reqs:
            self._add_to_batch(r, holes)
        for k in range(num_from_running):
            r = sched[k]
            if r.slot < 0:
                self._add_to_batch(r, holes)
        for r in resumed:
            self._add_to_batch(r, holes)
        if holes:
            self._condense(sorted(holes, reverse=True), len(batch) - len(holes))

    def _add_to_batch(self, r: _Req, holes: list[int]) -> None:
        batch = self._batch
        if holes:
            k = heapq.heappop(holes)
            batch[k] = r
        else:
            k = len(batch)
            batch.append(r)
        r.slot = k

    def _condense(self, empty: list[int], num_reqs: int) -> None:
        """InputBatch.condense: move the last requests into the lowest holes."""
        batch = self._batch
        last = num_reqs + len(empty) - 1
        while empty:
            while last in empty:
                last -= 1
            e = empty[-1]
            if e >= last:
                break
            empty.pop()
            r = batch[last]
            batch[e] = r
            batch[last] = None
            r.slot = e  # type: ignore[union-attr]
            last -= 1
        del batch[num_reqs:]

    # ------------------------------------------------------------ fast forward

    def decode_horizon(self) -> int:
        """How many next steps are guaranteed identical pure-decode steps (0: the next is not one).

        In such a step every running request gets one token, nobody is admitted, preempted or
        finishes, and the persistent batch keeps its order. The stretch ends before the first
        step where a request would finish, a block allocation would fail, or an allocation
        would evict a block the head of WAITING hits (the only change that could let it in).
        """
        plan = self._plan
        if plan is not None and plan[0] == self._version:
            return plan[1]
        k, events = self._horizon()
        self._plan = (self._version, k, events)
        return k

    def _horizon(self) -> tuple[int, list[tuple[int, int]]]:
        running = self._running
        if not running or self._pending_removal or len(running) > self._budget0:
            return 0, []
        if len(running) != len(self._batch):
            return 0, []
        k = self._mml
        for r in running:
            if not r.in_decode or r.slot < 0:
                return 0, []
            rem = r.max_tokens - r.num_out
            if rem < k:
                k = rem
        k -= 1  # the step where a request samples its last token is not fast-forwarded
        if k <= 0:
            return 0, []
        relevant: set[int] = set()
        waiting = self._waiting
        if waiting and len(running) < self._max_active and self._budget0 - len(running) > 0:
            n, hit, reason = self._admission(waiting[0], self._budget0 - len(running), self._threshold())
            if reason == 0:
                return 0, []
            if reason == 2 and not self.config.scheduler_reserve_full_isl:
                # A stretch only pops free blocks (one fewer free block each) and caches the
                # running requests' own output blocks (never in the head's chain). Checked against
                # its whole sequence, the head needs cdiv(tokens) - hit + evictable hit blocks:
                # popping one of its free hit blocks lowers that by at most one, as the free count
                # drops by one, so it keeps failing. Checked against its first chunk only, a
                # shorter hit also shrinks the chunk's own need; end the stretch where a free hit
                # block would be popped rather than prove that harmless too.
                ref = self._ref
                relevant = {b for b in hit if ref[b] == 0}
        bs = self._bs
        events: list[tuple[int, int]] = []
        for idx, r in enumerate(running):
            s = (1 - (r.P + r.num_out)) % bs  # first step whose token starts a new block
            while s < k:
                events.append((s, idx))
                s += bs
        if not events:
            return k, events
        events.sort()
        free = self._num_free
        nxt = self._nxt
        b = nxt[self._head]
        used = 0
        for s, _ in events:
            if s >= k:
                break
            if used >= free or (relevant and b in relevant):
                k = s
                break
            used += 1
            b = nxt[b]
        return k, events

    def advance_decode(self, k: int) -> StepResult:
        """Apply k pure-decode steps at once (1 <= k <= decode_horizon()).

        The entries describe the first of them; contexts grow by one token per step after it.
        """
        horizon = self.decode_horizon()
        if not 1 <= k <= horizon:
            raise ValueError(f"advance_decode({k}) needs 1 <= k <= decode_horizon() = {horizon}")
        assert self._plan is not None
        events = self._plan[2]
        running = self._running
        ids = [r.rid for r in running]
        ncomp = [r.num_computed for r in running]
        blocks = [r.blocks for r in running]
        for s, idx in events:
            if s >= k:
                break
            running[idx].blocks.extend(self._popleft(1))
        self._step_no += k
        mark = self._step_no
        for idx, r in enumerate(running):
            r.num_computed += k
            r.num_out += k
            self._cache_blocks(r, r.P + r.num_out - 1)
            r.mark = mark
            r.sidx = idx
        self._version += 1
        n = len(running)
        return StepResult(
            admitted=[], preempted=[], finished=[], first_token=[], num_steps=k,
            _ids=ids, _ntok=[1] * n, _ncomp=ncomp, _blocks=blocks, _prefill=[False] * n,
            _order=[r.sidx for r in self._batch],  # type: ignore[union-attr]
            _block_size=self._bs,
        )

    # ------------------------------------------------------------- cache admin

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash (vLLM's reset_prefix_cache); False, and nothing done, unless idle."""
        if self._num_free != self._N - 1:
            return False
        self._map.clear()
        self._bhash = [None] * self._N
        self._stats = [0, 0]
        self._preempted_stats = [0, 0]
        self._version += 1
        return True

    # ------------------------------------------------------------- state views

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def running_ids(self) -> list[str]:
        return [r.rid for r in self._running]

    def waiting_ids(self) -> list[str]:
        return [r.rid for r in self._waiting]

    def has_unfinished_requests(self) -> bool:
        return bool(self._running or self._waiting)

    @property
    def kv_usage(self) -> float:
        """Fraction of usable blocks in use (BlockPool.get_usage, the kv_cache_usage metric)."""
        return 1.0 - self._num_free / (self._N - 1)

    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    def block_hashes(self, prompt_token_ids: np.ndarray | Sequence[int]) -> list[int]:
        """The chained hashes of the prompt's full blocks, as :meth:`add_request` computes them
        (a caller that looks the same prompt up again keeps them: :meth:`cached_prefix_tokens`)."""
        return self._hash_prompt(np.asarray(prompt_token_ids)) if self._caching else []

    def cached_prefix_tokens(self, prompt_token_ids: np.ndarray | Sequence[int],
                             limit: int | None = None, block_hashes: Sequence[int] | None = None) -> int:
        """Tokens a prefix-cache lookup of this prompt would hit now (no side effects): at most
        ``prompt - 1`` tokens (vLLM's cap) and at most ``limit``; ``block_hashes`` are the
        prompt's :meth:`block_hashes`, when the caller keeps them."""
        if not self._caching:
            return 0
        n = len(prompt_token_ids)
        if n == 0:
            return 0
        blocks = (n - 1) // self._bs
        if limit is not None:
            blocks = min(blocks, max(0, int(limit)) // self._bs)
        if block_hashes is None:
            block_hashes = self._hash_prompt(np.asarray(prompt_token_ids)[: blocks * self._bs])
        hits = 0
        m = self._map
        for key in block_hashes[:blocks]:
            if key not in m:
                break
            hits += 1
        return hits * self._bs

    @property
    def prefix_cache_stats(self) -> tuple[int, int]:
        """(queried, hit) tokens of first admissions since the last reset_prefix_cache.

        As vLLM's PrefixCacheStats ``queries`` / ``hits`` summed over steps (recorded when a
        request is admitted; its whole known sequence is the query).
        """
        return self._stats[0], self._stats[1]

    @property
    def preempted_prefix_cache_stats(self) -> tuple[int, int]:
        """(queried, hit) tokens of resumed admissions (PrefixCacheStats.preempted_*)."""
        return self._preempted_stats[0], self._preempted_stats[1]

    def persistent_order(self) -> list[str | None]:
        """Request ids by persistent-batch slot after the last step (None for holes; none after condense)."""
        return [None if r is None else r.rid for r in self._batch]

    def request_blocks(self, request_id: str) -> list[int]:
        """A request's KV block ids (empty while it waits)."""
        return list(self._requests[request_id].blocks)

    def free_block_queue(self) -> list[int]:
        """Free block ids in eviction order (FreeKVCacheBlockQueue.get_all_free_blocks)."""
        out = []
        b = self._nxt[self._head]
        while b != self._tail:
            out.append(b)
            b = self._nxt[b]
        return out

    def cached_block_ids(self) -> set[int]:
        """Blocks that carry a prefix-cache hash."""
        return {b for b, key in enumerate(self._bhash) if key is not None}
