"""Request traces (CSV of token counts, optionally arrival times) as workloads without sharing.

The vidur simulator's processed traces give per request ``num_prefill_tokens`` (prompt) and
``num_decode_tokens`` (output), in Llama-2 tokens, and, for the Splitwise conversation trace,
``arrived_at`` in seconds (kept as ``arrival_time``; the workload's ``arrivals`` is then
``"trace"``). Prompt content is synthetic and unique per request: random ids (seeded) whose
first two tokens encode the row index, so no two requests share a prefix
(``prefix_group`` = the row index).
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from feather_env.workloads.datadir import require_file
from feather_env.workloads.request import Request
from feather_env.workloads.synthetic import random_tokens
from feather_env.workloads.workload import Workload, WorkloadError, not_utf8

PREFILL, DECODE, ARRIVAL = "num_prefill_tokens", "num_decode_tokens", "arrived_at"
OVERFLOW_MODES = ("truncate", "error")

# Workload kinds backed by the three vidur CSVs in the data's traces/ folder.
TRACE_FILES = {
    "splitwise": "splitwise_conv.csv",
    "sharegpt": "sharegpt_8k_filtered_stats_llama2_tokenizer.csv",
    "arxiv": "arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv",
}


@dataclass(frozen=True)
class TraceLengths:
    """The columns of a trace: per row its prompt and output tokens, arrival time, CSV line."""

    path: Path
    prefill: np.ndarray
    decode: np.ndarray
    arrived_at: np.ndarray | None
    lines: np.ndarray


def _parse_count(value: str | None, column: str, where: str) -> int:
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise WorkloadError(f"{where}: {column} is {value!r}, not a number") from None
    if not number.is_integer() or number < 1:
        raise WorkloadError(f"{where}: {column} must be an integer >= 1, got {value!r}")
    return int(number)


def read_trace(csv_path: str | os.PathLike[str], limit: int | None = None) -> TraceLengths:
    """Parse a trace CSV (the first ``limit`` rows); bad rows raise naming file and line."""
    path = require_file(csv_path, "traces")
    try:
        return _read_trace(path, limit)
    except UnicodeDecodeError as exc:
        raise not_utf8(path, exc) from None


def _read_trace(path: Path, limit: int | None) -> TraceLengths:
    prefill: list[int] = []
    decode: list[int] = []
    arrived: list[float] = []
    lines: list[int] = []
    with path.open(newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        columns = reader.fieldnames or []
        missing = [c for c in (PREFILL, DECODE) if c not in columns]
        if missing:
            raise WorkloadError(
                f"{path}: missing column(s) {missing}; found {columns}, "
                f"need {[PREFILL, DECODE]} (+ optional {ARRIVAL!r})"
            )
        has_arrival = ARRIVAL in columns
        for row in reader:
            if limit is not None and len(prefill) >= limit:
                break
            where = f"{path}:{reader.line_num}"
            if None in row or any(row.get(c) is None for c in columns):
                raise WorkloadError(f"{where}: expected {len(columns)} fields ({columns})")
            prefill.append(_parse_count(row[PREFILL], PREFILL, where))
            decode.append(_parse_count(row[DECODE], DECODE, where))
            if has_arrival:
                try:
                    t = float(row[ARRIVAL])
                except ValueError:
                    raise WorkloadError(
                        f"{where}: {ARRIVAL} is {row[ARRIVAL]!r}, not a number"
                    ) from None
                if not np.isfinite(t) or t < 0:
                    raise WorkloadError(f"{where}: {ARRIVAL} must be a time >= 0, got {t}")
                arrived.append(t)
            lines.append(reader.line_num)
    return TraceLengths(
        path,
        np.array(prefill, dtype=np.int64),
        np.array(decode, dtype=np.int64),
        np.array(arrived, dtype=np.float64) if has_arrival else None,
        np.array(lines, dtype=np.int64),
    )


def load_trace(
    csv_path: str | os.PathLike[str],
    *,
    max_prompt_tokens: int | None = 16384,
    max_output_tokens: int | None = None,
    overflow: str = "truncate",
    seed: int = 0,
    limit: int | None = None,
    vocab_size: int = 8192,
    name: str | None = None,
) -> Workload:
    """Load a trace CSV as a :class:`Workload` (see the module docstring).

    Args:
        csv_path: the CSV file.
        max_prompt_tokens: prompt cap (``None``: none); longer prompts are cut
            (``overflow="truncate"``) or raise (``"error"``) naming the row.
        max_output_tokens: output cap (``None``: the trace's decode tokens).
        seed: seeds the synthetic token content.
        limit: keep only the first ``limit`` rows (use :meth:`Workload.sample` for a random subset).
        vocab_size: token ids are drawn from ``[3, vocab_size)``.
        name: the workload's name (default: the file name without ``.csv``).

    Request ids are ``NAME/I`` (I: the row index in the file).
    """
    if overflow not in OVERFLOW_MODES:
        raise WorkloadError(f"overflow must be one of {OVERFLOW_MODES}, got {overflow!r}")
    if limit is not None and limit < 1:
        raise WorkloadError(f"limit must be >= 1 or None, got {limit}")
    trace = read_trace(csv_path, limit)
    if trace.prefill.size == 0:
        raise WorkloadError(f"{trace.path}: the trace has no rows")
    stem = name if name is not None else trace.path.stem
    prefill = trace.prefill
    if max_prompt_tokens is not None:
        over = np.flatnonzero(prefill > max_prompt_tokens)
        if over.size and overflow == "error":
            i = int(over[0])
            raise WorkloadError(
                f"trace request {stem}/{i} ({trace.path}:{trace.lines[i]}) has {prefill[i]} "
                f"prompt tokens > max_prompt_tokens={max_prompt_tokens}"
            )
        prefill = np.minimum(prefill, max_prompt_tokens)
    decode = trace.decode
    if max_output_tokens is not None:
        decode = np.minimum(decode, max_output_tokens)
    requests = [
        Request(
            request_id=f"{stem}/{i}",
            prompt_token_ids=random_tokens(int(prefill[i]), (seed, i), vocab_size, stamp=i),
            prefix_group=i,
            output_len=int(decode[i]),
            arrival_time=float(trace.arrived_at[i]) if trace.arrived_at is not None else 0.0,
            source=f"trace/{trace.path.stem}",
            meta={"line": int(trace.lines[i]), "prompt_tokens_full": int(trace.prefill[i])},
        )
        for i in range(prefill.size)
    ]
    return Workload(stem, tuple(requests), "trace" if trace.arrived_at is not None else None)
