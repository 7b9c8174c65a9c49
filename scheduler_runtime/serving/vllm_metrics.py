"""vLLM's ``/metrics`` text, read into what a router that observes the service is handed (engine-free).

:func:`parse_vllm_metrics` reads a replica's Prometheus text exposition (vLLM 0.32's names, from
``vllm/v1/metrics/loggers.py``) into the dict that :meth:`ReplicaRouter.scraped
<scheduler_runtime.router_base.ReplicaRouter.scraped>` takes, the same keys the cluster simulator's
``ReplicaSim.metrics()`` publishes:

* ``vllm:cache_config_info``: ``{"num_gpu_blocks": int, "block_size": int}`` (the info gauge's labels;
  the blocks summed over the replica's engines, data-parallel ranks each holding their own KV);
* gauges ``vllm:num_requests_running`` and ``vllm:num_requests_waiting`` (summed over engines) and
  ``vllm:kv_cache_usage_perc`` (their mean);
* the ``_sum`` and ``_count`` of the request-level histograms ``vllm:request_queue_time_seconds``,
  ``vllm:request_prefill_time_seconds``, ``vllm:request_decode_time_seconds``,
  ``vllm:request_prompt_tokens`` and ``vllm:request_generation_tokens``;
* counters ``vllm:prefix_cache_hits_total``, ``vllm:prefix_cache_queries_total``,
  ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total`` and ``vllm:request_success_total``
  (every ``finished_reason`` together), each summed over engines;
* ``process_start_time_seconds`` where the server publishes it (not under prometheus_client's
  multiprocess mode, which ``feather-serve`` uses).

Everything else (the buckets, ``_created`` samples, other families) is skipped without being parsed,
so a scrape costs one regular-expression pass over the text. Nothing raises: a line of a wanted family
that does not parse (a bad value, an unterminated last line of a cut-off answer, an info gauge without
its labels) is skipped and counted (:attr:`VllmScrape.skipped`); a key whose samples all failed is left
out, which the router takes as not published. :func:`restarted` tells a restarted server (its counters
went back, its KV changed) from the previous scrape of the same URL.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["COUNTERS", "GAUGES", "HISTOGRAMS", "MONOTONE_KEYS", "VllmScrape", "parse_vllm_metrics",
           "restarted"]

#: The request-level histograms whose ``_sum`` and ``_count`` are read.
HISTOGRAMS = ("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
              "vllm:request_decode_time_seconds", "vllm:request_prompt_tokens",
              "vllm:request_generation_tokens")
#: Counters read (their ``_total`` samples), summed over engines and other labels.
COUNTERS = ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries", "vllm:prompt_tokens",
            "vllm:generation_tokens", "vllm:request_success")
#: Gauges read: summed over engines, but ``vllm:kv_cache_usage_perc`` averaged.
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
_INFO = "vllm:cache_config_info"
_START = "process_start_time_seconds"
_MEAN = frozenset({"vllm:kv_cache_usage_perc"})

#: Keys that only grow while the same server runs: one that went back means a new server.
MONOTONE_KEYS = (*(f"{h}_count" for h in HISTOGRAMS), *(f"{c}_total" for c in COUNTERS))

_WANTED = (*(f"{h}_{part}" for h in HISTOGRAMS for part in ("sum", "count")),
           *(f"{c}_total" for c in COUNTERS), *GAUGES, _INFO, _START)
# one sample line of a wanted name: name, optional labels (quoted values may hold any of } , ") and the
# rest of the line (the value, then an optional timestamp)
_SAMPLE = re.compile(
    r"^(" + "|".join(re.escape(n) for n in sorted(_WANTED, key=len, reverse=True)) + r")"
    r"(?:\{((?:[^\"}]|\"(?:[^\"\\]|\\.)*\")*)\})?[ \t]+([^\n]*)$", re.MULTILINE)
_LABEL = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=\"((?:[^\"\\]|\\.)*)\"")


@dataclass
class VllmScrape:
    """One ``/metrics`` text, read: ``metrics`` (the router's dict, module docstring) and ``skipped``
    (lines of the wanted families that could not be read)."""

    metrics: dict[str, Any] = field(default_factory=dict)
    skipped: int = 0


def _value(rest: str) -> float | None:
    """A sample's value (the first field after the labels), ``None`` when it is not a number."""
    token = rest.split(None, 1)[0] if rest.strip() else ""
    try:
        value = float(token)
    except ValueError:
        return None
    return value


def parse_vllm_metrics(text: str) -> VllmScrape:
    """Read vLLM's exposition ``text`` (module docstring); never raises on bad or partial text."""
    out = VllmScrape()
    if not isinstance(text, str) or not text:
        return out
    if not text.endswith("\n"):  # cut off: the last line may be a number cut short
        cut = text.rfind("\n")
        tail = text[cut + 1:]
        text = text[:cut + 1] if cut >= 0 else ""
        if tail.startswith(_WANTED):
            out.skipped += 1
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    blocks = 0
    block_size: int | None = None
    info_seen = False
    for match in _SAMPLE.finditer(text):
        name, labels, rest = match.group(1), match.group(2), match.group(3)
        if name == _INFO:
            fields = dict(_LABEL.findall(labels or ""))
            try:
                n, size = int(fields["num_gpu_blocks"]), int(fields["block_size"])
            except (KeyError, ValueError):  # "None" before the engine sized its cache, or no labels
                out.skipped += 1
                continue
            if n < 0 or size < 1:
                out.skipped += 1
                continue
            if block_size is not None and size != block_size:  # engines that disagree: not one size
                out.skipped += 1
                continue
            blocks += n
            block_size = size
            info_seen = True
            continue
        value = _value(rest)
        if value is None or math.isnan(value):
            out.skipped += 1
            continue
        sums[name] = sums.get(name, 0.0) + value
        counts[name] = counts.get(name, 0) + 1
    metrics = out.metrics
    if info_seen and block_size is not None:
        metrics[_INFO] = {"num_gpu_blocks": blocks, "block_size": block_size}
    for name, total in sums.items():
        metrics[name] = total / counts[name] if name in _MEAN else total
    return out


def restarted(previous: Mapping[str, Any], now: Mapping[str, Any]) -> bool:
    """Whether ``now`` (a scrape) comes from a new server, not the one ``previous`` came from: a
    counter or a histogram's count went back, its ``process_start_time_seconds`` moved, or its KV
    (``vllm:cache_config_info``) changed."""
    for key in MONOTONE_KEYS:
        before, after = previous.get(key), now.get(key)
        if before is not None and after is not None and after < before:
            return True
    before, after = previous.get(_START), now.get(_START)
    if before is not None and after is not None and after != before:
        return True
    before, after = previous.get(_INFO), now.get(_INFO)
    return before is not None and after is not None and before != after
