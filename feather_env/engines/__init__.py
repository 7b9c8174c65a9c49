"""The simulated engine: vLLM V1's serving loop without a model, one module per vLLM file it mirrors.

:class:`~feather_env.engines.sim_engine.SimEngine` (``sim_engine``) composes the scheduler
(``scheduler``), the KV cache manager (``kv_cache_manager``) over the block pool (``block_pool``) and
the persistent batch (``input_batch``); ``request``, ``sim_config`` and ``step_result`` hold the
request state, the settings and what a step reports. Each module's docstring names the vLLM source
it mirrors (paths inside the ``vllm`` package, vLLM 0.32).
"""
