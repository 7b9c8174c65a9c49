"""Feather toolkit: an RL environment and runtime scheduler for prefix-aware LLM batch scheduling.

Subpackages: ``feather_env.workloads`` (requests and the benchmark workloads that produce
them), plus the environment, the Chunked Hash Tree and the SVF ordering added by later modules.
"""

# exports added by later modules
