"""The KV cache manager: prefix-cache lookup, slot allocation, caching of full blocks, freeing.

Mirrors (paths inside the ``vllm`` package, vLLM 0.32) ``v1/core/kv_cache_manager.py``
(``KVCacheManager``) with the one cache group of ``v1/core/single_type_kv_cache_manager.py``
(``FullAttentionManager`` / ``SingleTypeKVCacheManager``), and the request block hasher of
``v1/core/kv_cache_utils.py``:

* ``get_computed_blocks``: the longest run of cached full blocks, capped at ``num_tokens - 1``
  tokens (no partial, sub-block hits);
* ``allocate_slots``: the full-sequence admission gate (``scheduler_reserve_full_isl``, on by
  default); the watermark (``SchedulerConfig.watermark``, 0 by default: ``int(watermark *
  num_blocks)`` blocks kept free when admitting a waiting or preempted request while any request
  is running); evictable hit blocks counted against the free blocks; caching of every full block
  up to ``min(computed + new, num_tokens)`` at allocation time (so a request admitted later in
  the same step already hits the blocks of one admitted before it);
* ``free``: a request's blocks returned in reverse order (its tail evicted first);
* the prefix-cache statistics (``PrefixCacheStats`` queries and hits, first admissions and
  resumed ones apart).

Block hashes: a prompt's full blocks are hashed once, chained (xxh3 of the block's tokens seeded
by the parent's hash), so equal prefixes give equal hashes as vLLM's block hasher does; only
equality matters.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

from feather_env.engines.block_pool import BlockPool
from feather_env.engines.request import SimRequest
from feather_env.engines.sim_config import SimEngineConfig

_hash_bytes = xxhash.xxh3_64_intdigest


def hash_prompt_blocks(tokens: np.ndarray, block_size: int) -> list[int]:
    """The chained hashes of the full blocks of ``tokens``."""
    array = np.ascontiguousarray(tokens, dtype=np.int64)
    data = memoryview(array.tobytes())
    stride = block_size * 8
    hashes: list[int] = []
    parent = 0
    for start in range(0, (len(array) // block_size) * stride, stride):
        parent = _hash_bytes(data[start : start + stride], parent)
        hashes.append(parent)
    return hashes


def cdiv(numerator: int, denominator: int) -> int:
    """Ceiling division (vLLM's ``cdiv``)."""
    return -(-numerator // denominator)


class KVCacheManager:
    """One full-attention cache group over a :class:`BlockPool`; requests carry their own blocks."""

    def __init__(self, config: SimEngineConfig) -> None:
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len
        self.enable_caching = config.enable_prefix_caching
        self.watermark_blocks = int(config.watermark * config.num_blocks)
        self.full_sequence_must_fit = config.scheduler_reserve_full_isl
        self.block_pool = BlockPool(config.num_blocks, config.enable_prefix_caching)
        self.prefix_cache_stats = [0, 0]  # queried, hit tokens of first admissions
        self.preempted_prefix_cache_stats = [0, 0]  # the same of resumed admissions

    def find_longest_cache_hit(self, block_keys: Sequence[int]) -> list[int]:
        """The cached blocks of the longest run of ``block_keys`` found in the cache, from the first
        (FullAttentionManager.find_longest_cache_hit; the first block inserted for a key)."""
        cached = self.block_pool.cached_block_hash_to_block
        blocks = []
        for key in block_keys:
            entry = cached.get(key)
            if entry is None:
                break
            blocks.append(entry if entry.__class__ is int else entry[0])  # type: ignore[index]
        return blocks

    def get_computed_blocks(self, request: SimRequest) -> list[int]:
        """The request's cached prefix: whole blocks, at most ``num_tokens - 1`` tokens."""
        if not self.enable_caching:
            return []
        num_blocks = (request.num_prompt_tokens + request.num_output_tokens - 1) // self.block_size
        return self.find_longest_cache_hit(request.block_keys(0, num_blocks))

    def can_allocate(self, request: SimRequest, computed_blocks: list[int], num_new_tokens: int,
                     has_running: bool) -> bool:
        """Whether ``allocate_slots`` would give a waiting request ``num_new_tokens`` beyond its
        ``computed_blocks`` (no side effects): the full-sequence gate, then this step's blocks, each
        with the evictable hit blocks and the watermark counted against the free blocks."""
        block_size, max_model_len = self.block_size, self.max_model_len
        num_computed_blocks = len(computed_blocks)
        ref_counts = self.block_pool.ref_counts
        num_evictable = 0
        for block in computed_blocks:
            if ref_counts[block] == 0:
                num_evictable += 1
        watermark = self.watermark_blocks if has_running else 0
        num_free = self.block_pool.num_free_blocks
        if self.full_sequence_must_fit:
            num_tokens = request.num_prompt_tokens + request.num_output_tokens
            full = max(cdiv(min(num_tokens, max_model_len), block_size) - num_computed_blocks, 0)
            if full + num_evictable + watermark > num_free:
                return False
        num_tokens_need_slot = min(num_computed_blocks * block_size + num_new_tokens, max_model_len)
        need = max(cdiv(num_tokens_need_slot, block_size) - num_computed_blocks, 0)
        return need + num_evictable + watermark <= num_free

    def allocate_new_computed_blocks(self, request: SimRequest, computed_blocks: list[int]) -> None:
        """Give a request being admitted its cache hit: the blocks (touched) become its first blocks."""
        self.block_pool.touch(computed_blocks)
        request.block_ids = computed_blocks
        request.num_cached_blocks = len(computed_blocks)

    def allocate_slots(self, request: SimRequest, num_tokens: int) -> bool:
        """Blocks for the request to hold ``num_tokens`` tokens (capped at ``max_model_len``), then
        cache its full blocks up to there (at most its known tokens); False, and nothing done, when
        the free queue is too short."""
        block_size = self.block_size
        max_model_len = self.max_model_len
        block_ids = request.block_ids
        num_tokens_need_slot = num_tokens if num_tokens < max_model_len else max_model_len
        num_new_blocks = -(-num_tokens_need_slot // block_size) - len(block_ids)
        if num_new_blocks > 0:
            pool = self.block_pool
            if num_new_blocks > pool.num_free_blocks:
                return False
            block_ids.extend(pool.get_new_blocks(num_new_blocks))
        known = request.num_prompt_tokens + request.num_output_tokens
        num_tokens_to_cache = num_tokens if num_tokens < known else known
        if num_tokens_to_cache // block_size > request.num_cached_blocks:
            self.cache_blocks(request, num_tokens_to_cache)
        return True

    def cache_blocks(self, request: SimRequest, num_tokens: int) -> None:
        """Key every full block of the request's first ``num_tokens`` tokens not keyed yet."""
        num_full_blocks = num_tokens // self.block_size
        num_cached_blocks = request.num_cached_blocks
        if num_cached_blocks >= num_full_blocks or not self.enable_caching:
            return
        self.block_pool.cache_full_blocks(request, num_cached_blocks, num_full_blocks)
        request.num_cached_blocks = num_full_blocks

    def free(self, request: SimRequest) -> None:
        """Return the request's blocks, tail first (evicted first)."""
        block_ids = request.block_ids
        if not block_ids:
            return
        self.block_pool.free_blocks(reversed(block_ids))
        request.block_ids = []  # a new list: StepResult snapshots keep the old one
        request.num_cached_blocks = 0

    def record_prefix_cache_stats(self, request: SimRequest, num_hit_tokens: int) -> None:
        """Count an admission's lookup: its whole known sequence queried, ``num_hit_tokens`` hit."""
        if self.enable_caching:
            stats = self.preempted_prefix_cache_stats if request.num_preemptions else self.prefix_cache_stats
            stats[0] += request.num_prompt_tokens + request.num_output_tokens
            stats[1] += num_hit_tokens

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash and the statistics; False, and nothing done, unless idle."""
        if not self.block_pool.reset_prefix_cache():
            return False
        self.prefix_cache_stats = [0, 0]
        self.preempted_prefix_cache_stats = [0, 0]
        return True
