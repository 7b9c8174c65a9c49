"""The request record every workload loader produces and every scheduler consumes."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, eq=False)
class Request:
    """One inference request of a workload.

    Attributes:
        request_id: unique id inside its workload.
        prompt_token_ids: prompt as token ids (``np.int32``; shared prefix first).
        prefix_group: id of the shared-prefix group (e.g. the L-Eval document);
            requests of one group share their first tokens. -1 when unknown/none.
        output_len: true number of tokens to generate (the reference answer's length).
        arrival_time: seconds from the start of the workload.
        source: task or file the request came from (e.g. ``"leval/sci_fi"``).
    """

    request_id: str
    prompt_token_ids: np.ndarray
    prefix_group: int
    output_len: int
    arrival_time: float = 0.0
    source: str = ""
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        ids = np.asarray(self.prompt_token_ids, dtype=np.int32)
        ids.setflags(write=False)
        object.__setattr__(self, "prompt_token_ids", ids)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"request {self.request_id!r}: prompt must be a non-empty 1-D sequence")
        if self.output_len < 1:
            raise ValueError(f"request {self.request_id!r}: output_len must be >= 1, got {self.output_len}")

    @property
    def prompt_len(self) -> int:
        return int(self.prompt_token_ids.size)

    @property
    def peak_tokens(self) -> int:
        """KV tokens held at the end of decode (prompt + output): SVF's peak."""
        return self.prompt_len + self.output_len

    @property
    def volume(self) -> float:
        """SVF volume: area of the KV footprint over the decode life, ``s*o + (o^2+o)/2``."""
        s, o = self.prompt_len, self.output_len
        return float(s * o + (o * o + o) / 2)

    def with_arrival(self, arrival_time: float) -> Request:
        return Request(
            self.request_id, self.prompt_token_ids, self.prefix_group, self.output_len,
            arrival_time, self.source, self.meta,
        )
