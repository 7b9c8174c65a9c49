"""The contract shared by every prefix index: the Candidate record, errors, and the Protocol.

A prefix index holds two sets of requests: *waiting* (queued, not yet batched) and
*active* (in the running batch). It answers one question for the batching policy:
which waiting request would join the active batch at the least cost in shared prefix,
and what would the batch look like afterwards (:class:`Candidate`).

Depths are counted in *chunks* of ``chunk_size`` tokens, with the Chunked Hash Tree's
definition (``docs/design.md``, "Chunked Hash Tree"): a prompt of ``n`` tokens has
``ceil(n / chunk_size)`` keys; key ``k`` stands for its first ``min((k + 1) * chunk_size, n)``
tokens, so a trailing partial chunk is a key of its own. Two prompts therefore share their
common *full* chunks, and all of their chunks only when they are identical. Every
implementation (:class:`~scheduler_runtime.cht.ChunkedHashTree`,
:class:`~scheduler_runtime.radix.RadixTree`) reports depths with this one definition, so
their Candidates can be compared field by field.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol, runtime_checkable

import numpy as np

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "Candidate",
    "DuplicateRequestError",
    "PrefixIndex",
    "UnknownRequestError",
    "as_token_array",
    "num_chunks",
]

#: Default chunk size in tokens for every index. The authors' code used 50 and 500. 512 is the
#: nearest multiple of vLLM's KV block sizes (16 on GPU, 128 on CPU), so a shared chunk is a run
#: of whole shared KV blocks, and the batching policies' delta thresholds (5-7 chunks) keep about
#: the token span they have with 500-token chunks. The CHT's per-decision work grows with keys per
#: prompt (a 32K-token prompt is 64 keys here, 656 with 50-token chunks); at 512 it stays under
#: its 20 us budget with a margin on a small CPU (``benchmarks/cht_overhead.py``), at 256 it sat
#: at the limit.
DEFAULT_CHUNK_SIZE = 512

# Token ids are hashed as little-endian int32, so they must fit in one.
_TOKEN_MAX = np.iinfo(np.int32).max


class Candidate(NamedTuple):
    """The best waiting request to add next, and what adding it would do to the batch."""

    request_id: str
    #: Shared-prefix depth (chunks) of the active batch before adding; 0 for an empty batch.
    depth_before: int
    #: Shared-prefix depth after adding this candidate (its whole prompt if the batch is empty).
    depth_after: int
    #: OTHER waiting requests that share the candidate's first ``depth_after`` chunks
    #: (every other waiting request when ``depth_after == 0``).
    w: int

    @property
    def delta(self) -> int:
        """Chunks of shared prefix lost by adding the candidate (negative for an empty batch)."""
        return self.depth_before - self.depth_after


class DuplicateRequestError(ValueError):
    """``insert`` of a request id that is already waiting or active."""


class UnknownRequestError(KeyError):
    """``activate``/``finish``/``remove`` of an id that is not in the state the call needs."""


@runtime_checkable
class PrefixIndex(Protocol):
    """What a batching policy needs from a prefix index (CHT or the radix baselines)."""

    chunk_size: int

    def insert(self, request_id: str, token_ids: np.ndarray | Sequence[int]) -> None:
        """Add a waiting request. Raises DuplicateRequestError, ValueError (empty prompt)."""
        ...

    def best_candidate(self) -> Candidate | None:
        """The waiting request to add next (not removed from the queue); None if none waits."""
        ...

    def activate(self, request_id: str) -> None:
        """Move a waiting request into the active batch. Raises UnknownRequestError."""
        ...

    def finish(self, request_id: str) -> None:
        """Drop an active request (it completed). Raises UnknownRequestError."""
        ...

    def remove(self, request_id: str) -> None:
        """Abort a waiting or active request. Raises UnknownRequestError."""
        ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def num_active(self) -> int: ...

    @property
    def shared_depth(self) -> int:
        """Largest k such that every active request has the same first k chunks (0 if none)."""
        ...

    def waiting_ids(self) -> list[str]: ...

    def active_ids(self) -> list[str]: ...

    def __contains__(self, request_id: object) -> bool: ...

    def __len__(self) -> int: ...


def num_chunks(num_tokens: int, chunk_size: int) -> int:
    """Number of keys of a prompt: ``ceil(num_tokens / chunk_size)``."""
    return -(-num_tokens // chunk_size)


def as_token_array(token_ids: np.ndarray | Sequence[int]) -> np.ndarray:
    """Validate a prompt and return it as a 1-D little-endian int32 array.

    Raises ValueError for an empty prompt, a non-1-D or non-integer input, or ids outside
    ``[0, 2**31)``; callers check before they change any state, so a bad prompt leaves the
    index as it was.
    """
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError("token_ids must not be empty")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"token_ids must be integers, got dtype {arr.dtype}")
    if arr.dtype.itemsize > 4 or arr.dtype == np.uint32:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi > _TOKEN_MAX:
            raise ValueError(f"token ids must lie in [0, 2**31), got [{lo}, {hi}]")
    elif arr.dtype.kind == "i" and int(arr.min()) < 0:
        raise ValueError("token ids must be non-negative")
    return arr.astype("<i4", copy=False)


def check_chunk_size(chunk_size: int) -> int:
    """Return ``chunk_size`` if it is an int >= 1, else raise ValueError."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int | np.integer):
        raise ValueError(f"chunk_size must be an int, got {chunk_size!r}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return int(chunk_size)
