"""Feather toolkit: an RL environment for prefix-aware LLM batch scheduling on a real vLLM engine.

- :mod:`feather_env.env`: :class:`FeatherEnv`, registered as ``feather/Batching-v0`` (the paper's
  per-request ADD/STOP) and ``feather/GroupAdmission-v0`` (the same serving loop, the decision
  to open a prefix group), with its reward classes;
- :mod:`feather_env.routing_env`: :class:`RoutingEnv`, ``feather/Routing-v0``: the replica of each
  request on an unequal fleet of the cluster simulator;
- :mod:`feather_env.serving`: the serving loop an episode runs on (:class:`ServingBackend`);
- :mod:`feather_env.engines`: its two engines, the real one (``vllm_backend``; ``vllm_engine``
  builds every vLLM engine of the project) and the simulator (``sim_backend``, serving on the
  model of vLLM's scheduler, KV cache and persistent batch, one module per vLLM file, with a
  step-time model that :mod:`feather_env.calibrate` fits and validates);
- :mod:`feather_env.records`: the loop's records; :mod:`feather_env.serving_metrics`: the
  ``vllm bench serve`` figures computed from them;
- :mod:`feather_env.scenarios` and :mod:`feather_env.workloads`: what an episode serves;
- :mod:`feather_env.evaluation`: schedulers compared in-process, against an endpoint or in the
  simulator, and the bounds they are measured against.

Heavy modules (vLLM, the environment) are imported lazily, so ``import feather_env`` is cheap.
"""

import gymnasium as _gym

if "feather/Batching-v0" not in _gym.registry:
    _gym.register(id="feather/Batching-v0", entry_point="feather_env.env:FeatherEnv")
if "feather/GroupAdmission-v0" not in _gym.registry:
    _gym.register(id="feather/GroupAdmission-v0", entry_point="feather_env.env:FeatherEnv",
                  kwargs={"decision": "group"})
if "feather/Admission-v0" not in _gym.registry:
    _gym.register(id="feather/Admission-v0", entry_point="feather_env.admission_env:AdmissionEnv")
if "feather/Routing-v0" not in _gym.registry:
    _gym.register(id="feather/Routing-v0", entry_point="feather_env.routing_env:RoutingEnv")
