"""A named, immutable list of requests: what a scheduler or an environment episode consumes.

The order of a :class:`Workload` is its queue order: the order in which requests reach the
scheduler when arrival times tie (all of them, for a burst). Sampling shuffles that order by
default, because a workload whose questions arrive grouped by document would already be
prefix-homogeneous under FCFS and leave the scheduler nothing to do.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, overload

import numpy as np

from feather_env.workloads.arrivals import ArrivalProcess, parse_arrival
from feather_env.workloads.errors import WorkloadError, not_utf8
from feather_env.workloads.request import Request


def iter_jsonl_objects(path: Path, max_line_bytes: int | None = None,
                       too_long: str = "") -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` for each non-blank line of a JSON-lines file.

    A line that is not UTF-8, malformed, or not a JSON object raises :class:`WorkloadError`
    naming it. With ``max_line_bytes`` a longer line raises too, before it is read whole (memory
    stays bounded); ``too_long`` says why such a line cannot be a valid one.
    """
    with open(path, "rb") as fh:
        lineno = 0
        while True:
            raw = fh.readline() if max_line_bytes is None else fh.readline(max_line_bytes + 2)
            if not raw:
                break
            lineno += 1
            where = f"{path}:{lineno}"
            if max_line_bytes is not None and len(raw.rstrip(b"\r\n")) > max_line_bytes:
                raise WorkloadError(f"{where}: line longer than {max_line_bytes} bytes{too_long}")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise not_utf8(where, exc) from None
            if lineno == 1:
                line = line.removeprefix("\ufeff")  # a byte-order mark some editors write
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise WorkloadError(f"{where}: malformed JSON line: {exc.msg}") from None
            if not isinstance(item, dict):
                raise WorkloadError(f"{where}: expected a JSON object, got {type(item).__name__}")
            yield lineno, item


def _common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


@dataclass(frozen=True)
class Workload:
    """A named, immutable sequence of :class:`Request` with unique ids.

    Attributes:
        name: what the workload is (``"leval"``, ``"splitwise_conv"``, ...); samples extend it.
        requests: the requests in queue order.
        arrivals: where the requests' ``arrival_time`` values come from: ``None`` when none
            were assigned (all 0), ``"trace"`` when read from the data, else the spec of the
            arrival process applied by :meth:`with_arrivals` (``"burst"``, ``"poisson:2.0"``).

    An empty workload, or two requests with one id, raise :class:`WorkloadError`.
    """

    name: str
    requests: tuple[Request, ...] = field(repr=False)
    arrivals: str | None = None
    _index: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        requests = tuple(self.requests)
        object.__setattr__(self, "requests", requests)
        if not requests:
            raise WorkloadError(f"workload {self.name!r} is empty: it has no requests")
        index: dict[str, int] = {}
        for i, req in enumerate(requests):
            if not isinstance(req, Request):
                raise WorkloadError(
                    f"workload {self.name!r}: item {i} is a {type(req).__name__}, not a Request"
                )
            if req.request_id in index:
                raise WorkloadError(
                    f"workload {self.name!r}: duplicate request id {req.request_id!r} "
                    f"(positions {index[req.request_id]} and {i})"
                )
            index[req.request_id] = i
        object.__setattr__(self, "_index", index)

    def __repr__(self) -> str:
        return (
            f"Workload(name={self.name!r}, requests={len(self)}, groups={self.num_groups}, "
            f"arrivals={self.arrivals!r})"
        )

    # -- sequence protocol -------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.requests)

    @overload
    def __getitem__(self, key: int) -> Request: ...
    @overload
    def __getitem__(self, key: str) -> Request: ...
    def __getitem__(self, key: int | str) -> Request:
        """A request by position or by id."""
        if isinstance(key, str):
            return self.requests[self._index[key]]
        return self.requests[key]

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._index

    @property
    def request_ids(self) -> list[str]:
        return [r.request_id for r in self.requests]

    # -- groups ------------------------------------------------------------------------------
    @cached_property
    def _groups(self) -> dict[int, tuple[Request, ...]]:
        groups: dict[int, list[Request]] = {}
        for req in self.requests:
            groups.setdefault(req.prefix_group, []).append(req)
        return {g: tuple(members) for g, members in groups.items()}

    def groups(self) -> dict[int, tuple[Request, ...]]:
        """Requests by ``prefix_group``, groups in order of first appearance."""
        return dict(self._groups)

    @property
    def num_groups(self) -> int:
        return len(self._groups)

    # -- derived workloads -------------------------------------------------------------------
    def _derive(self, requests: Sequence[Request], name: str) -> Workload:
        return Workload(name, tuple(requests), self.arrivals)

    def sample(self, n: int, seed: int, *, shuffle: bool = True) -> Workload:
        """``n`` requests drawn without replacement, deterministic for ``seed``.

        With ``shuffle`` the result is in random order (a new queue order); without, the
        original relative order is kept.
        """
        if not 1 <= n <= len(self):
            raise WorkloadError(
                f"workload {self.name!r}: cannot sample {n} requests from {len(self)}"
            )
        rng = np.random.default_rng(seed)
        idx = rng.choice(len(self), size=n, replace=False)
        if not shuffle:
            idx = np.sort(idx)
        return self._derive([self.requests[i] for i in idx], f"{self.name}/sample{n}@{seed}")

    def sample_groups(
        self, n_groups: int, seed: int, max_per_group: int | None = None, *, shuffle: bool = True
    ) -> Workload:
        """Whole prefix groups (e.g. L-Eval documents with all their questions).

        Picks ``n_groups`` distinct groups at random (deterministic for ``seed``). With
        ``max_per_group`` a larger group contributes a random subset of that many requests.
        With ``shuffle`` the requests of the chosen groups are interleaved in random order;
        without, groups keep their original order and members stay together.
        """
        groups = list(self._groups.values())
        if not 1 <= n_groups <= len(groups):
            raise WorkloadError(
                f"workload {self.name!r}: cannot sample {n_groups} prefix groups from {len(groups)}"
            )
        if max_per_group is not None and max_per_group < 1:
            raise WorkloadError(f"max_per_group must be >= 1, got {max_per_group}")
        rng = np.random.default_rng(seed)
        chosen = np.sort(rng.choice(len(groups), size=n_groups, replace=False))
        picked: list[Request] = []
        for g in chosen:
            members = groups[g]
            if max_per_group is not None and len(members) > max_per_group:
                keep = np.sort(rng.choice(len(members), size=max_per_group, replace=False))
                members = tuple(members[i] for i in keep)
            picked.extend(members)
        if shuffle:
            picked = [picked[i] for i in rng.permutation(len(picked))]
        cap = "" if max_per_group is None else f"x{max_per_group}"
        return self._derive(picked, f"{self.name}/groups{n_groups}{cap}@{seed}")

    def shuffled(self, seed: int) -> Workload:
        """The same requests in a random queue order."""
        perm = np.random.default_rng(seed).permutation(len(self))
        return self._derive([self.requests[i] for i in perm], f"{self.name}/shuffled@{seed}")

    def with_arrivals(self, process: ArrivalProcess | str, seed: int = 0) -> Workload:
        """Assign arrival times with ``process`` (or its spec, see ``parse_arrival``).

        Times are drawn for the current queue order; the result is sorted by arrival time
        (stable, so ties keep the queue order).
        """
        if isinstance(process, str):
            process = parse_arrival(process)
        times = np.asarray(process.arrival_times(self, seed), dtype=np.float64)
        if times.shape != (len(self),):
            raise WorkloadError(
                f"{process.spec}: produced {times.shape} arrival times for {len(self)} requests"
            )
        order = np.argsort(times, kind="stable")
        reqs = [self.requests[i].with_arrival(float(times[i])) for i in order]
        return Workload(self.name, tuple(reqs), process.spec)

    def _arrival_order(self) -> np.ndarray:
        times = np.array([r.arrival_time for r in self.requests], dtype=np.float64)
        return np.argsort(times, kind="stable")

    def window(self, seconds: float, seed: int) -> Workload:
        """The requests of one time window of ``seconds`` of a timed trace, deterministic for ``seed``.

        The window starts at the arrival of a request drawn at random among those whose window ends
        within the trace (the first request when the trace is shorter than a window); it keeps the
        requests arriving in ``[start, start + seconds)``, their times shifted so the first is at 0.
        """
        if self.arrivals != "trace":
            raise WorkloadError(f"workload {self.name!r}: a time window needs timestamps of its own "
                                f"(arrivals {self.arrivals!r})")
        if not (math.isfinite(seconds) and seconds > 0):
            raise WorkloadError(f"window must be a finite number of seconds > 0, got {seconds!r}")
        order = self._arrival_order()
        times = np.array([self.requests[i].arrival_time for i in order], dtype=np.float64)
        fits = int(np.searchsorted(times, times[-1] - seconds, side="right"))
        start = times[int(np.random.default_rng(seed).integers(max(fits, 1)))]
        picked = [self.requests[i].with_arrival(float(t - start))
                  for i, t in zip(order, times, strict=True) if start <= t < start + seconds]
        return Workload(f"{self.name}/window{seconds:g}s@{seed}", tuple(picked), "trace")

    def max_window_requests(self, seconds: float) -> int:
        """The most requests any window of ``seconds`` (as :meth:`window` draws them) holds."""
        times = np.sort(np.array([r.arrival_time for r in self.requests], dtype=np.float64))
        ends = np.searchsorted(times, times + seconds, side="left")
        return int(np.max(ends - np.arange(times.size)))

    # -- summaries ---------------------------------------------------------------------------
    def cached_prompt_tokens(self, block_size: int, capacity_tokens: int | None = None) -> int:
        """Prompt tokens a prefix cache would serve, requests taken one at a time in arrival order.

        vLLM's rule: a request finds the whole blocks of ``block_size`` tokens that an earlier
        request's prompt filled with the same prefix, but never its last prompt token (it is
        computed to sample the first output). Without ``capacity_tokens`` the cache never evicts:
        over the prompt tokens, the ceiling of any scheduler's prefix hit rate on this workload.
        With it the cache holds at most ``capacity_tokens // block_size`` blocks and evicts the
        least recently used one when a request's block would exceed that (each block a request's
        prompt fills or finds is used then): roughly what a KV cache of that size keeps of the
        reuse when requests are served one after another. The result never exceeds the unbounded
        one and grows with the capacity (LRU keeps every block a smaller LRU cache holds).
        """
        if block_size < 1:
            raise WorkloadError(f"block_size must be >= 1, got {block_size}")
        if capacity_tokens is not None and capacity_tokens < 0:
            raise WorkloadError(f"capacity_tokens must be >= 0 or None, got {capacity_tokens}")
        limit = None if capacity_tokens is None else capacity_tokens // block_size
        cache: OrderedDict[int, None] = OrderedDict()  # block chain hashes, least recently used first
        total = 0
        for i in self._arrival_order():
            ids = self.requests[i].prompt_token_ids
            can_hit = (ids.size - 1) // block_size
            chain = 0
            hitting = True
            for b in range(ids.size // block_size):
                chain = hash((chain, ids[b * block_size:(b + 1) * block_size].tobytes()))
                found = chain in cache
                if hitting and b < can_hit and found:
                    total += block_size
                else:
                    hitting = False
                if not found:
                    cache[chain] = None
                    if limit is not None and len(cache) > limit:
                        cache.popitem(last=False)
                elif limit is not None:
                    cache.move_to_end(chain)
        return total

    def unique_prompt_tokens(self) -> int:
        """Prompt tokens after merging each group's common prefix (what a prefix cache stores)."""
        total = 0
        for members in self._groups.values():
            first = members[0].prompt_token_ids
            common = first.size
            for req in members[1:]:
                common = min(common, _common_prefix_len(first, req.prompt_token_ids))
            total += common + sum(r.prompt_len - common for r in members)
        return total

    def describe(self) -> dict[str, Any]:
        """Summary statistics.

        ``reuse_factor`` is total prompt tokens over :meth:`unique_prompt_tokens`: how many
        times each stored prefix token is used (1.0 without sharing).
        """
        prompt = np.array([r.prompt_len for r in self.requests], dtype=np.int64)
        output = np.array([r.output_len for r in self.requests], dtype=np.int64)
        arrivals = np.array([r.arrival_time for r in self.requests])
        unique = self.unique_prompt_tokens()
        return {
            "name": self.name,
            "requests": len(self),
            "groups": self.num_groups,
            "prompt_tokens_total": int(prompt.sum()),
            "prompt_tokens_mean": float(prompt.mean()),
            "prompt_tokens_max": int(prompt.max()),
            "output_tokens_mean": float(output.mean()),
            "output_tokens_max": int(output.max()),
            "unique_prompt_tokens": unique,
            "reuse_factor": float(prompt.sum() / unique),
            "arrivals": self.arrivals,
            "arrival_span_s": float(arrivals.max() - arrivals.min()),
        }

    def fingerprint(self) -> str:
        """sha256 over ids, tokens, groups, output lengths and arrivals: equal iff same content."""
        h = hashlib.sha256()
        for r in self.requests:
            h.update(r.request_id.encode())
            h.update(b"\0")
            h.update(np.ascontiguousarray(r.prompt_token_ids, dtype="<i4").tobytes())
            h.update(np.array([r.prefix_group, r.output_len], dtype="<i8").tobytes())
            h.update(np.array([r.arrival_time], dtype="<f8").tobytes())
        return h.hexdigest()
