"""The serving loop's engines: the real vLLM engine in-process, and a simulator of it.

- ``vllm_engine``: the one factory of every vLLM engine of the project (:class:`EngineConfig`,
  ``build_llm``) and the hooks that read a step; ``vllm_backend``: the real engine as a
  :class:`~feather_env.serving.ServingBackend`;
- ``sim_backend``: the simulator as a serving backend, its steps timed by the fitted step model;
  it serves on :class:`~feather_env.engines.sim_engine.SimEngine`, vLLM V1's serving loop without
  a model, one module per vLLM file it mirrors: ``scheduler``, ``kv_cache_manager`` over
  ``block_pool``, ``input_batch``; ``request``, ``sim_config`` and ``step_result`` hold the request
  state, the settings and what a step reports. Each of those modules' docstring names the vLLM
  source it mirrors (paths inside the ``vllm`` package, vLLM 0.32).
"""
