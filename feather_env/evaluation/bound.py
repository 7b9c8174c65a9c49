"""Lower bounds on an episode's makespan, from the engine's own measured rates: what no scheduler can beat.

Three bounds, each reported as the bound over a run's makespan (1.0 is the limit):

- :func:`makespan_bound`: every distinct prompt prefix prefilled exactly once and every output
  token decoded at the engine's peak batch rate; prefill time is the lone-request TTFT curve
  (probes at a few prompt lengths, interpolated through 0), charged ``p(L) - p(C)`` for a prompt
  of ``L`` tokens whose first ``C`` (whole KV blocks) an earlier prompt of the episode holds. The
  makespan is this sum, or the last arrival if later.
- the *episode bound* (:func:`add_episode_bound`): the same prefill term, decode at the best rate
  any run of the episode reached in its decode-only steps (the peak is reached on short prompts
  only: a long-context episode decodes at a fraction of it).
- the *arrival-aware bound* (:func:`add_arrival_bound`): no request is served before it arrives,
  so for every request ``k`` (in arrival order) the work of the requests arriving from ``a_k`` on
  (their distinct prefill and their output tokens at the episode's decode rate) is done after
  ``a_k``, and request ``k`` itself needs at least its own service alone (its unshared prefill,
  then one decode step per further token at its lone-request rate). The makespan is at least the
  largest ``a_k`` plus either. Under arrivals spread over time this is the bound that counts: the
  others charge the whole episode's work from t = 0.

And an upper bound on SLO attainment (:func:`prefill_attainment_bound`): how many requests can get
their first token within the TTFT SLO when the engine (or a fleet of them, pooled) computes prompt
tokens no faster than its peak rate. The admission and the routing headroom studies bound their
oracles with it.

A chunked-prefill step also decodes the running requests, so a schedule that overlaps the two can
pass a serial sum; a value above 1.0 says so.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["add_arrival_bound", "add_episode_bound", "arrival_order", "makespan_bound",
           "prefill_attainment_bound", "prefix_work"]


def prefix_work(workload: Any, block_size: int) -> list[tuple[int, int]]:
    """``(prompt tokens, tokens an earlier prompt holds in whole KV blocks)`` per request, in
    :func:`arrival_order`."""
    from scheduler_runtime.cht import ChunkedHashTree

    hasher = ChunkedHashTree(chunk_size=block_size)
    seen: set[int] = set()
    out = []
    for r in arrival_order(workload):
        hashes = [int(h) for h in hasher.hash_prompt(r.prompt_token_ids)[: r.prompt_len // block_size]]
        cached = 0
        for h in hashes:
            if h not in seen:
                break
            cached += block_size
        cached = min(cached, r.prompt_len - 1)  # vLLM computes at least the last prompt token
        seen.update(hashes)
        out.append((r.prompt_len, cached))
    return out


def arrival_order(workload: Any) -> list[Any]:
    """The requests by arrival time (ties: by id), the order :func:`prefix_work` reads them in."""
    return sorted(workload, key=lambda r: (r.arrival_time, r.request_id))


def _prefill_curve(isolated: Mapping[str, Any]) -> Any:
    lens = [0, *isolated["prompt_lens"]]
    ttft = [0.0, *isolated["ttft_s"]]

    def prefill(n: int) -> float:
        return float(np.interp(n, lens, ttft, right=ttft[-1] * n / lens[-1]))

    return prefill


def makespan_bound(
    workload: Any, block_size: int, isolated: Mapping[str, Any], decode_rate: float
) -> dict[str, Any]:
    """The makespan with each distinct prefix prefilled once, decode at ``decode_rate`` (module docstring).

    ``isolated``: the lone-request probes (``prompt_lens``, ``ttft_s``, ``tpot_s``). The result
    keeps, per request in arrival order, what :func:`add_arrival_bound` needs.
    """
    prefill = _prefill_curve(isolated)
    ordered = arrival_order(workload)
    work = prefix_work(workload, block_size)
    prefill_each = [prefill(length) - prefill(cached) for length, cached in work]
    prefill_s = sum(prefill_each)
    output_tokens = sum(r.output_len for r in workload)
    decode_s = output_tokens / decode_rate if decode_rate > 0 else math.inf
    last_arrival = max(r.arrival_time for r in workload)
    makespan = max(prefill_s + decode_s, last_arrival)
    prompt = sum(length for length, _ in work)
    distinct = sum(length - cached for length, cached in work)
    tpot = [float(np.interp(r.prompt_len, isolated["prompt_lens"], isolated["tpot_s"])) for r in ordered]
    return {
        "makespan_s": makespan,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "last_arrival_s": last_arrival,
        "output_throughput": output_tokens / makespan if makespan > 0 else None,
        "output_tokens": output_tokens,
        "decode_rate_tok_s": decode_rate,
        "prompt_tokens": prompt,
        "distinct_prompt_tokens": distinct,
        "hit_rate_ceiling": 1.0 - distinct / prompt if prompt else None,
        "per_request": {
            "arrival_s": [float(r.arrival_time) for r in ordered],
            "prefill_s": prefill_each,
            "output_tokens": [int(r.output_len) for r in ordered],
            "alone_decode_s": [max(0, r.output_len - 1) * t for r, t in zip(ordered, tpot, strict=True)],
        },
    }


def _decode_rate_of_runs(payload: Mapping[str, Any]) -> float | None:
    """The best decode-only rate any run of the episode reached (tokens/s)."""
    rates = [r for m in payload["runs"].values()
             for r in ((m.get("repeats") or {}).get("decode_tok_s") or [m.get("decode_tok_s")]) if r]
    return max(rates) if rates else None


def add_episode_bound(payload: dict[str, Any]) -> None:
    """The bound again, decoding at the best rate any run of this episode reached (its decode-only
    steps): ``payload["bound"]["episode_decode"]`` and each run's ``vs_bound_episode``."""
    bound = payload["bound"]
    rate = _decode_rate_of_runs(payload)
    if rate is None:
        return
    tokens = bound["output_tokens"]
    makespan = max(bound["prefill_s"] + tokens / rate, bound["last_arrival_s"])
    bound["episode_decode"] = {"decode_rate_tok_s": rate, "decode_s": tokens / rate, "makespan_s": makespan,
                               "output_throughput": tokens / makespan if makespan > 0 else None}
    for m in payload["runs"].values():
        m["vs_bound_episode"] = (makespan / m["duration"]) if m.get("duration") else None


def arrival_bound(per_request: Mapping[str, Any], decode_rate: float) -> dict[str, Any]:
    """``max_k a_k + max(remaining work from k on, request k alone)`` (module docstring)."""
    arrivals = per_request["arrival_s"]
    prefill = per_request["prefill_s"]
    tokens = per_request["output_tokens"]
    alone = per_request["alone_decode_s"]
    best, at, binding = 0.0, 0, "remaining"
    rest_prefill, rest_tokens = 0.0, 0
    for k in range(len(arrivals) - 1, -1, -1):
        rest_prefill += prefill[k]
        rest_tokens += tokens[k]
        remaining = rest_prefill + rest_tokens / decode_rate
        own = prefill[k] + alone[k]
        value = arrivals[k] + max(remaining, own)
        if value > best:
            best, at, binding = value, k, "remaining" if remaining >= own else "alone"
    total = sum(tokens)
    return {"makespan_s": best, "decode_rate_tok_s": decode_rate, "binding_request": at,
            "binding_arrival_s": arrivals[at] if arrivals else 0.0, "binding": binding,
            "output_throughput": total / best if best > 0 else None}


def add_arrival_bound(payload: dict[str, Any]) -> None:
    """The arrival-aware bound at the episode's decode rate: ``payload["bound"]["arrival"]`` and
    each run's ``vs_bound_arrival``."""
    bound = payload["bound"]
    rate = _decode_rate_of_runs(payload)
    per_request = bound.get("per_request")
    if rate is None or not per_request:
        return
    bound["arrival"] = arrival_bound(per_request, rate)
    makespan = bound["arrival"]["makespan_s"]
    for m in payload["runs"].values():
        m["vs_bound_arrival"] = (makespan / m["duration"]) if m.get("duration") else None


def prefill_attainment_bound(requests: Sequence[Any], block_size: int, rate: float,
                             own_seconds: Callable[[int, int], float], ttft_s: float,
                             intervals: Sequence[float],
                             work: Callable[[int, int], float] | None = None) -> dict[str, Any]:
    """An upper bound on the requests of ``requests`` (arrival times as given) whose first token can
    come within ``ttft_s`` of their arrival, whatever is admitted, scheduled or routed (loose).

    Facts used (each bound only drops constraints):

    1. Prompt work is done no faster than ``rate`` units a second, in any stretch of time: computing
       the ``n`` prompt tokens that follow the first ``start`` of a prompt is ``work(start, n)`` units
       (default ``n``: tokens, and ``rate`` the engine's peak prefill tokens/s). A fleet's rate is the
       sum of its replicas' (a pooled server of that rate can do whatever the fleet does, so routing
       is relaxed away with the replicas' boundaries).
    2. The cache starts empty and holds whole blocks (``block_size`` tokens) keyed by their whole
       prefix; a request's tokens are computed in steps that start after it arrives. A good request's
       first token comes within ``ttft_s`` of its arrival, after every prompt block of it was computed
       (by itself, or by a request that cached it: one cache for all, of unbounded size) and its
       partial last block by itself.
    3. Global form: every block of a good request is computed in ``[0, T]``, ``T = last arrival +
       ttft_s``; charging each block ``block / count(b)`` to each of the ``count(b)`` requests holding
       it, the good set's charges never exceed the tokens computed in ``[0, T]``. Interval form (each
       ``L`` of ``intervals``): cut the arrivals into ``[s, s + L)``; the good requests arriving in one
       need, inside ``[s, s + L + ttft_s]``, every block of theirs that no request arriving before
       ``s`` holds (only those can have computed it earlier), charged ``work / count(b)`` over the
       requests arriving in ``[s, s + L + ttft_s)`` (only they can compute it in time). The count of
       each interval is bounded separately and summed.
    4. ``never_fits``: a request's tokens from its first block that no other request holds (only it
       can compute them), the ``n`` after its first ``start``, take at least ``own_seconds(start, n)``;
       longer than ``ttft_s``: never good.

    In each form the count is the largest number of the cheapest eligible requests whose charges fit
    the capacity; the bound is the smallest over the forms. It ignores decode work and the TPOT SLO,
    the KV cache's size (evictions recompute blocks), preemptions, the order of deadlines inside an
    interval, and charges prefix sharing fractionally: so it is loose.
    """
    from scheduler_runtime.admission import prompt_block_hashes

    cost = work or (lambda start, n: float(n))
    ordered = sorted(requests, key=lambda r: r.arrival_time)
    arrival = np.array([float(r.arrival_time) for r in ordered])
    hashes = [prompt_block_hashes(r.prompt_token_ids, block_size) for r in ordered]
    tails = [r.prompt_len - len(hs) * block_size for r, hs in zip(ordered, hashes, strict=True)]
    tail_work = [cost(len(hs) * block_size, tail) for hs, tail in zip(hashes, tails, strict=True)]
    block_work = [cost(k * block_size, block_size) for k in range(max(map(len, hashes), default=0))]
    count: dict[int, int] = {}
    for hs in hashes:
        for h in hs:
            count[h] = count.get(h, 0) + 1
    never = set()
    for r, hs, tail in zip(ordered, hashes, tails, strict=True):
        first_own = next((i for i, h in enumerate(hs) if count[h] == 1), len(hs))
        if own_seconds(first_own * block_size, (len(hs) - first_own) * block_size + tail) > ttft_s:
            never.add(r.request_id)

    def fit(members: Sequence[int], holders: Sequence[int], seen: set[int], capacity: float) -> int:
        cnt: dict[int, int] = {}
        for j in holders:
            for h in hashes[j]:
                if h not in seen:
                    cnt[h] = cnt.get(h, 0) + 1
        costs = sorted(sum(block_work[k] / cnt[h] for k, h in enumerate(hashes[i]) if h not in seen)
                       + tail_work[i] for i in members if ordered[i].request_id not in never)
        return int(np.searchsorted(np.cumsum(costs), capacity, side="right")) if costs else 0

    n = len(ordered)
    horizon = float(arrival.max()) + ttft_s
    forms = {"global": fit(range(n), range(n), set(), horizon * rate)}
    for length in intervals:
        total, seen = 0, set()
        s = 0.0
        while s <= arrival.max():
            lo, hi = np.searchsorted(arrival, [s, s + length])
            end = np.searchsorted(arrival, s + length + ttft_s)
            total += fit(range(lo, hi), range(lo, end), seen, (length + ttft_s) * rate)
            for i in range(lo, hi):
                seen.update(hashes[i])
            s += length
        forms[f"interval {length:g} s"] = total
    best = min(forms.values())
    return {"good_max": best, "submitted": n, "attainment": best / n, "forms": forms,
            "never_fits": sorted(never), "never_fits_count": len(never), "horizon_s": horizon,
            "rate": rate, "block": block_size,
            "prompt_tokens": int(sum(r.prompt_len for r in ordered))}
