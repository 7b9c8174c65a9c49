"""The KV block pool: free-block queue, cached-block hash map, eviction.

Mirrors (paths inside the ``vllm`` package, vLLM 0.32) ``v1/core/block_pool.py`` (``BlockPool``,
``BlockHashToBlockMap``) and the ``FreeKVCacheBlockQueue`` of ``v1/core/kv_cache_utils.py``:

* ``num_blocks`` blocks, of which block 0 is the null block (always in use, never free);
* the free-block queue, a doubly linked list over block ids, initially by block id. Allocation
  pops from the front, evicting a popped block's hash; freed blocks without a hash are prepended
  (LIFO reuse), freed cached blocks appended (LRU), each group in the order freed;
* the cached-block hash map, which keeps duplicate blocks for one hash and returns the first one
  inserted;
* ``reset_prefix_cache``, and :meth:`BlockPool.retain` (not vLLM's: what the scheduler's
  ``retain_held_prefixes`` switch does to vLLM's free-block queue).

Blocks are ints and their state lives in lists indexed by block id (reference counts, hashes,
the queue's links), so the hot loops run on local lists rather than on block objects.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from feather_env.engines.request import SimRequest


class BlockPool:
    """The blocks, their reference counts and hashes, the free-block queue and the hash map."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        # Free-block queue (FreeKVCacheBlockQueue): a doubly linked list over block ids with the
        # sentinels num_blocks (head) and num_blocks + 1 (tail); block 0 is never in it.
        head, tail = num_blocks, num_blocks + 1
        self.head, self.tail = head, tail
        self.next_free = list(range(1, num_blocks + 2)) + [-1]
        self.prev_free = [-1] + list(range(0, num_blocks)) + [num_blocks - 1]
        self.next_free[head] = 1
        self.prev_free[1] = head
        self.next_free[num_blocks - 1] = tail
        self.prev_free[tail] = num_blocks - 1
        self.num_free_blocks = num_blocks - 1
        self.ref_counts = [0] * num_blocks
        self.ref_counts[0] = 1  # the null block is always "used"
        self.block_hashes: list[int | None] = [None] * num_blocks
        #: block hash -> block id, or list of block ids (duplicates, first inserted first)
        self.cached_block_hash_to_block: dict[int, int | list[int]] = {}

    # ------------------------------------------------------------ allocation and freeing

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks from the front of the free queue, evicting their cached hashes."""
        next_free, ref_counts, block_hashes = self.next_free, self.ref_counts, self.block_hashes
        head = self.head
        blocks = []
        block = next_free[head]
        for _ in range(num_blocks):
            blocks.append(block)
            key = block_hashes[block]
            if key is not None:
                self._remove_block_hash(key, block)
                block_hashes[block] = None
            ref_counts[block] = 1
            block = next_free[block]
        next_free[head] = block
        self.prev_free[block] = head
        self.num_free_blocks -= num_blocks
        return blocks

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference on each block (hit by a new request), removing free ones from the queue."""
        ref_counts, next_free, prev_free = self.ref_counts, self.next_free, self.prev_free
        for block in blocks:
            if ref_counts[block] == 0:
                previous, following = prev_free[block], next_free[block]
                next_free[previous] = following
                prev_free[following] = previous
                self.num_free_blocks -= 1
            ref_counts[block] += 1

    def free_blocks(self, ordered_blocks: Iterable[int]) -> None:
        """Drop a reference on each block, first-evicted first; the blocks no one holds any more go
        to the free queue: uncached ones to its front, cached ones to its end."""
        ref_counts, block_hashes = self.ref_counts, self.block_hashes
        evict_first: list[int] = []
        evict_last: list[int] = []
        caching = self.enable_caching
        for block in ordered_blocks:
            ref_counts[block] -= 1
            if ref_counts[block] == 0:
                if caching and block_hashes[block] is not None:
                    evict_last.append(block)
                else:
                    evict_first.append(block)
        if evict_first:  # FreeKVCacheBlockQueue.prepend_n
            self._link(self.head, self.next_free[self.head], evict_first)
        if evict_last:  # FreeKVCacheBlockQueue.append_n
            self._link(self.prev_free[self.tail], self.tail, evict_last)
        self.num_free_blocks += len(evict_first) + len(evict_last)

    def _link(self, previous: int, following: int, blocks: list[int]) -> None:
        """Chain ``blocks``, in order, into the free queue between two adjacent nodes."""
        next_free, prev_free = self.next_free, self.prev_free
        for block in blocks:
            next_free[previous] = block
            prev_free[block] = previous
            previous = block
        next_free[previous] = following
        prev_free[following] = previous

    def retain(self, prefixes: Iterable[Sequence[int]]) -> int:
        """Move the free blocks of each prefix (block ids, in order) to the end of the free queue, so
        they are evicted last: each prefix's first block last (vLLM frees a request's blocks tail
        first, so a prefix's head outlives its tail), and later prefixes after earlier ones. Held
        blocks are not in the queue and stay where they are. Returns the blocks moved."""
        ref_counts, next_free, prev_free = self.ref_counts, self.next_free, self.prev_free
        tail = self.tail
        moved = 0
        for blocks in prefixes:
            for block in reversed(blocks):
                if ref_counts[block]:
                    continue  # held by a request: not in the free queue
                previous, following = prev_free[block], next_free[block]
                next_free[previous], prev_free[following] = following, previous
                last = prev_free[tail]
                next_free[last], prev_free[block] = block, last
                next_free[block], prev_free[tail] = tail, block
                moved += 1
        return moved

    def free_block_ids(self) -> Iterator[int]:
        """The free blocks in eviction order (FreeKVCacheBlockQueue.get_all_free_blocks), lazily."""
        next_free, tail = self.next_free, self.tail
        block = next_free[self.head]
        while block != tail:
            yield block
            block = next_free[block]

    def in_free_queue(self, blocks: Iterable[int]) -> list[int]:
        """The blocks among ``blocks`` that no request holds (evictable, in the free queue)."""
        ref_counts = self.ref_counts
        return [block for block in blocks if ref_counts[block] == 0]

    # ------------------------------------------------------------ the prefix cache

    def cache_full_blocks(self, request: SimRequest, num_cached_blocks: int, num_full_blocks: int) -> None:
        """Give the request's blocks ``num_cached_blocks`` to ``num_full_blocks`` their keys."""
        cached, block_hashes = self.cached_block_hash_to_block, self.block_hashes
        block_ids = request.block_ids
        keys = request.block_keys(num_cached_blocks, num_full_blocks)
        for offset, key in enumerate(keys, num_cached_blocks):
            block = block_ids[offset]
            entry = cached.get(key)
            if entry is None:
                cached[key] = block
            elif entry.__class__ is int:
                cached[key] = [entry, block]  # type: ignore[list-item]
            else:
                entry.append(block)  # type: ignore[union-attr]
            block_hashes[block] = key

    def _remove_block_hash(self, key: int, block: int) -> None:
        """BlockHashToBlockMap.pop: forget that ``block`` holds ``key``."""
        cached = self.cached_block_hash_to_block
        entry = cached[key]
        if entry.__class__ is int:
            del cached[key]
        else:
            entry.remove(block)  # type: ignore[union-attr]
            if not entry:
                del cached[key]

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; False, and nothing done, unless every block is free."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        self.cached_block_hash_to_block.clear()
        self.block_hashes = [None] * self.num_blocks
        return True

    def cached_block_ids(self) -> set[int]:
        """Blocks that carry a prefix-cache hash."""
        return {block for block, key in enumerate(self.block_hashes) if key is not None}

    def get_usage(self) -> float:
        """Fraction of usable blocks in use (the kv_cache_usage metric)."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)
