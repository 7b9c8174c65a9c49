"""Engine-free scheduling runtime: prefix indexes (CHT, radix baselines) and the policies on top.

Everything here is plain Python + numpy, testable and benchmarkable without starting vLLM;
the thin vLLM scheduler subclass wires it into the engine.
"""

from scheduler_runtime.cht import ChunkedHashTree
from scheduler_runtime.prefix_index import (
    DEFAULT_CHUNK_SIZE,
    Candidate,
    DuplicateRequestError,
    PrefixIndex,
    UnknownRequestError,
)
from scheduler_runtime.radix import RadixTree


def __getattr__(name: str):
    # The policy loader and the vLLM scheduler classes are imported on first use, so that
    # `import scheduler_runtime` stays cheap and free of vLLM.
    if name == "load_policy":
        from scheduler_runtime.policy import load_policy

        return load_policy
    if name in ("PolicyFormatError", "ObservationSpec"):
        from scheduler_runtime import decision

        return getattr(decision, name)
    if name in ("FeatherScheduler", "FeatherAsyncScheduler"):
        from scheduler_runtime.serving import vllm_scheduler

        return getattr(vllm_scheduler, name)
    raise AttributeError(f"module 'scheduler_runtime' has no attribute {name!r}")

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "Candidate",
    "ChunkedHashTree",
    "FeatherAsyncScheduler",
    "FeatherScheduler",
    "ObservationSpec",
    "PolicyFormatError",
    "DuplicateRequestError",
    "PrefixIndex",
    "RadixTree",
    "UnknownRequestError",
    "load_policy",
]
