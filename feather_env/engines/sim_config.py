"""The vLLM settings the simulator's decisions depend on.

Mirrors the fields of vLLM's ``SchedulerConfig`` (``config/scheduler.py``) and ``CacheConfig``
(``config/cache.py``) that the modelled scheduler, KV cache manager and block pool read, and
:meth:`SimEngineConfig.from_vllm` refuses a ``VllmConfig`` that uses what is not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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
