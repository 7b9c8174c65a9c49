"""Feather toolkit: an RL environment for prefix-aware LLM batch scheduling on a real vLLM engine.

- :mod:`feather_env.env`: :class:`FeatherEnv`, registered as ``feather/Batching-v0`` (the paper's
  per-request ADD/STOP) and ``feather/GroupAdmission-v0`` (the same serving loop, the decision
  to open a prefix group);
- :mod:`feather_env.backends`: :class:`VLLMBackend` (the real engine) and :class:`BatchResult`;
- :mod:`feather_env.sim`: :class:`SimBackend`, a cost model fitted to the engine
  (:mod:`feather_env.calibrate` fits and validates it), serving on :mod:`feather_env.engines`,
  the model of vLLM's scheduler, KV cache and persistent batch (one module per vLLM file);
- :mod:`feather_env.engine`: the one factory that builds every vLLM engine of the project;
- :mod:`feather_env.workloads`: requests and the benchmark workloads that produce them.

Heavy modules (vLLM, the environment) are imported lazily, so ``import feather_env`` is cheap.
"""

import gymnasium as _gym

if "feather/Batching-v0" not in _gym.registry:
    _gym.register(id="feather/Batching-v0", entry_point="feather_env.env:FeatherEnv")
if "feather/GroupAdmission-v0" not in _gym.registry:
    _gym.register(id="feather/GroupAdmission-v0", entry_point="feather_env.env:FeatherEnv",
                  kwargs={"decision": "group"})
