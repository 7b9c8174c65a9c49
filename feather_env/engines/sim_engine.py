"""An exact, model-free discrete-event model of vLLM V1's serving loop (vLLM 0.32): :class:`SimEngine`.

The RL environment trains batching policies in a simulator and deploys them in vLLM, so the
simulator must take the same scheduling decisions as vLLM: which requests are admitted, how
many tokens each gets per step, which prefix-cache blocks hit, which cached blocks are evicted
and when, who is preempted, and in which order the persistent batch holds the scheduled
requests. vLLM's own ``Scheduler`` makes those decisions exactly but costs ~700 us per step
with 64 running requests; :class:`SimEngine` makes the same decisions in a few microseconds
per touched request and fast-forwards pure-decode stretches in O(running requests) per
stretch (:meth:`SimEngine.decode_horizon` / :meth:`SimEngine.advance_decode`).

:class:`SimEngine` is the simulator's ``EngineCore``: it checks and adds requests (hashing their
prompts' blocks, as vLLM's input processing does) and composes the parts, one module per vLLM
file it mirrors, so that each can be diffed against vLLM at an upgrade:

* :mod:`~feather_env.engines.scheduler`: ``v1/core/sched/scheduler.py``;
* :mod:`~feather_env.engines.kv_cache_manager`: ``v1/core/kv_cache_manager.py`` and
  ``v1/core/single_type_kv_cache_manager.py``;
* :mod:`~feather_env.engines.block_pool`: ``v1/core/block_pool.py`` and the free-block queue of
  ``v1/core/kv_cache_utils.py``;
* :mod:`~feather_env.engines.input_batch`: ``v1/worker/gpu_input_batch.py`` as
  ``v1/worker/gpu_model_runner.py`` drives it;
* :mod:`~feather_env.engines.request`: ``v1/request.py``;
* :mod:`~feather_env.engines.sim_config`: the fields of ``config/scheduler.py`` and ``config/cache.py``;
* :mod:`~feather_env.engines.step_result`: what a step reports.

Output blocks matter for exactness: once full they are cached, so they return to the LRU end of
the free queue instead of its front, and a preempted request hits its own output blocks when it
resumes.

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

from collections.abc import Sequence

import numpy as np

from feather_env.engines.input_batch import InputBatch
from feather_env.engines.kv_cache_manager import KVCacheManager, cdiv, hash_prompt_blocks
from feather_env.engines.request import SimRequest
from feather_env.engines.scheduler import Scheduler
from feather_env.engines.sim_config import SimEngineConfig
from feather_env.engines.step_result import StepResult

__all__ = ["SimEngine"]


class SimEngine:
    """vLLM V1's scheduler, KV cache manager and persistent batch, without a model."""

    def __init__(self, config: SimEngineConfig) -> None:
        self.config = config
        self.block_size = config.block_size
        self.enable_caching = config.enable_prefix_caching
        self.kv_cache_manager = KVCacheManager(config)
        self.block_pool = self.kv_cache_manager.block_pool
        self.input_batch = InputBatch()
        self.scheduler = Scheduler(config, self.kv_cache_manager, self.input_batch)
        self._next_serial = 0

    # ------------------------------------------------------------ requests

    def add_request(self, request_id: str, prompt_token_ids: np.ndarray | Sequence[int],
                    max_tokens: int) -> None:
        """Queue a request at the back of WAITING (vLLM ``Scheduler.add_request``)."""
        if request_id in self.scheduler.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        prompt = np.asarray(prompt_token_ids)
        if prompt.ndim != 1 or len(prompt) == 0:
            raise ValueError(f"request {request_id!r}: the prompt must be a non-empty 1-d token array")
        max_tokens = int(max_tokens)
        if max_tokens < 1:
            raise ValueError(f"request {request_id!r}: max_tokens must be at least 1, got {max_tokens}")
        num_prompt_tokens = len(prompt)
        max_model_len = self.config.max_model_len
        if num_prompt_tokens + max_tokens > max_model_len:
            raise ValueError(f"request {request_id!r}: prompt ({num_prompt_tokens}) + max_tokens "
                             f"({max_tokens}) exceeds max_model_len ({max_model_len})")
        # Its last step holds prompt + max_tokens - 1 tokens; more blocks than the pool has would
        # make vLLM preempt and re-admit it forever.
        block_size, num_usable = self.block_size, self.config.num_blocks - 1
        need = cdiv(num_prompt_tokens + max_tokens - 1, block_size)
        if need > num_usable:
            raise ValueError(f"request {request_id!r} needs {need} KV blocks of {block_size} tokens but the "
                             f"cache has {num_usable} usable blocks; it could never finish")
        hashes = hash_prompt_blocks(prompt, block_size) if self.enable_caching else []
        self.scheduler.add_request(SimRequest(request_id, self._next_serial, num_prompt_tokens, max_tokens,
                                              hashes))
        self._next_serial += 1

    def abort_request(self, request_id: str) -> None:
        """Finish a request now, freeing its blocks (vLLM ``finish_requests``); unknown ids are ignored."""
        self.scheduler.finish_request(request_id)

    # ------------------------------------------------------------ stepping

    def step(self) -> StepResult:
        """Exactly one vLLM engine step: schedule, model-runner batch update, update_from_output."""
        return self.scheduler.step()

    def decode_horizon(self) -> int:
        """How many next steps are guaranteed identical pure-decode steps (0: the next is not one);
        see :meth:`Scheduler.decode_horizon`."""
        return self.scheduler.decode_horizon()

    def advance_decode(self, k: int) -> StepResult:
        """Apply k pure-decode steps at once (1 <= k <= decode_horizon()).

        The entries describe the first of them; contexts grow by one token per step after it.
        """
        return self.scheduler.advance_decode(k)

    # ------------------------------------------------------------ the prefix cache

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash (vLLM's reset_prefix_cache); False, and nothing done, unless idle."""
        if not self.kv_cache_manager.reset_prefix_cache():
            return False
        self.scheduler.forget_decode_plan()
        return True

    def retain(self, prefixes: Sequence[Sequence[int]]) -> int:
        """Move the free cached blocks of each prefix (block hashes, as :meth:`block_hashes`
        gives) to the LRU end of the free queue, so they are evicted last: each prefix's first
        block last (vLLM frees a request's blocks tail first, so a prefix's head outlives its
        tail), and the later prefixes of ``prefixes`` after the earlier ones. What the
        ``retain_held_prefixes`` switch of the scheduler does to vLLM's ``free_block_queue``;
        returns the blocks moved."""
        if not self.enable_caching:
            return 0
        find_longest_cache_hit = self.kv_cache_manager.find_longest_cache_hit
        moved = self.block_pool.retain([find_longest_cache_hit(hashes) for hashes in prefixes])
        if moved:
            self.scheduler.forget_decode_plan()
        return moved

    def block_hashes(self, prompt_token_ids: np.ndarray | Sequence[int]) -> list[int]:
        """The chained hashes of the prompt's full blocks, as :meth:`add_request` computes them
        (a caller that looks the same prompt up again keeps them: :meth:`cached_prefix_tokens`)."""
        if not self.enable_caching:
            return []
        return hash_prompt_blocks(np.asarray(prompt_token_ids), self.block_size)

    def cached_prefix_tokens(self, prompt_token_ids: np.ndarray | Sequence[int],
                             limit: int | None = None, block_hashes: Sequence[int] | None = None) -> int:
        """Tokens a prefix-cache lookup of this prompt would hit now (no side effects): at most
        ``prompt - 1`` tokens (vLLM's cap) and at most ``limit``; ``block_hashes`` are the
        prompt's :meth:`block_hashes`, when the caller keeps them."""
        if not self.enable_caching:
            return 0
        num_tokens = len(prompt_token_ids)
        if num_tokens == 0:
            return 0
        block_size = self.block_size
        num_blocks = (num_tokens - 1) // block_size
        if limit is not None:
            num_blocks = min(num_blocks, max(0, int(limit)) // block_size)
        if block_hashes is None:
            prefix = np.asarray(prompt_token_ids)[: num_blocks * block_size]
            block_hashes = hash_prompt_blocks(prefix, block_size)
        # The length of find_longest_cache_hit's run, counted here: the observation asks this of
        # every waiting request at every decision.
        cached = self.block_pool.cached_block_hash_to_block
        hits = 0
        for key in block_hashes[:num_blocks]:
            if key not in cached:
                break
            hits += 1
        return hits * block_size

    @property
    def prefix_cache_stats(self) -> tuple[int, int]:
        """(queried, hit) tokens of first admissions since the last reset_prefix_cache.

        As vLLM's PrefixCacheStats ``queries`` / ``hits`` summed over steps (recorded when a
        request is admitted; its whole known sequence is the query).
        """
        queried, hit = self.kv_cache_manager.prefix_cache_stats
        return queried, hit

    @property
    def preempted_prefix_cache_stats(self) -> tuple[int, int]:
        """(queried, hit) tokens of resumed admissions (PrefixCacheStats.preempted_*)."""
        queried, hit = self.kv_cache_manager.preempted_prefix_cache_stats
        return queried, hit

    # ------------------------------------------------------------ state views

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def running_ids(self) -> list[str]:
        return [request.request_id for request in self.scheduler.running]

    def waiting_ids(self) -> list[str]:
        return [request.request_id for request in self.scheduler.waiting]

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    @property
    def kv_usage(self) -> float:
        """Fraction of usable blocks in use (BlockPool.get_usage, the kv_cache_usage metric)."""
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def persistent_order(self) -> list[str | None]:
        """Request ids by persistent-batch slot after the last step (None for holes; none after condense)."""
        return self.input_batch.request_ids()

    def request_blocks(self, request_id: str) -> list[int]:
        """A request's KV block ids (empty while it waits)."""
        return list(self.scheduler.requests[request_id].block_ids)

    def free_block_queue(self) -> list[int]:
        """Free block ids in eviction order (FreeKVCacheBlockQueue.get_all_free_blocks)."""
        return list(self.block_pool.free_block_ids())

    def cached_block_ids(self) -> set[int]:
        """Blocks that carry a prefix-cache hash."""
        return self.block_pool.cached_block_ids()
