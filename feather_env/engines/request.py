"""A request as the simulator tracks it: vLLM's ``Request`` (``v1/request.py``), plus the state vLLM
keeps about it elsewhere: its KV blocks (``SingleTypeKVCacheManager.req_to_blocks`` and
``num_cached_block`` in ``v1/core/single_type_kv_cache_manager.py``) and its slot in the persistent
batch (``InputBatch.req_id_to_index`` in ``v1/worker/gpu_input_batch.py``).

Block keys: a prompt's full blocks are hashed once, chained, when the request is added
(:func:`feather_env.engines.kv_cache_manager.hash_prompt_blocks`), as vLLM's request block hasher
does. Output tokens are not known without a model, so a block holding any output token is keyed
by (request, block index): outputs are taken to be unique to their request.
"""

from __future__ import annotations

#: Output-block keys are negative (prompt-block keys are unsigned 64-bit digests); the block index
#: takes this many low bits, the request's serial number the rest.
OUTPUT_KEY_INDEX_BITS = 24


class SimRequest:
    """One request's scheduler, KV cache and persistent-batch state."""

    __slots__ = ("request_id", "serial", "num_prompt_tokens", "max_tokens", "block_hashes",
                 "num_output_tokens", "num_computed_tokens", "block_ids", "num_cached_blocks", "is_running",
                 "num_preemptions", "batch_index", "scheduled_step", "schedule_index", "in_decode")

    def __init__(self, request_id: str, serial: int, num_prompt_tokens: int, max_tokens: int,
                 block_hashes: list[int]) -> None:
        self.request_id = request_id
        self.serial = serial  # the order it was added in: keys its output blocks
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.block_hashes = block_hashes  # chained hashes of the prompt's full blocks
        self.num_output_tokens = 0
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.num_cached_blocks = 0  # leading blocks that carry their hash (vLLM num_cached_block)
        self.is_running = False
        self.num_preemptions = 0
        self.batch_index = -1  # persistent-batch slot, -1 when not in the batch
        self.scheduled_step = -1  # the last step it was scheduled in
        self.schedule_index = -1  # its index in that step's scheduling order
        self.in_decode = False  # sampled since its last (re)admission

    def block_keys(self, start: int, stop: int) -> list[int]:
        """The cache keys of its full blocks ``start`` to ``stop - 1``: the prompt's block hashes, then
        keys of its own for blocks that hold output tokens."""
        hashes = self.block_hashes
        num_hashes = len(hashes)
        if stop <= num_hashes:
            return hashes[start:stop]
        base = self.serial << OUTPUT_KEY_INDEX_BITS
        return hashes[start:] + [-(base + index) - 1 for index in range(max(start, num_hashes), stop)]
