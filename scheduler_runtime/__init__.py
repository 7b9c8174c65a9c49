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

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "Candidate",
    "ChunkedHashTree",
    "DuplicateRequestError",
    "PrefixIndex",
    "RadixTree",
    "UnknownRequestError",
]
