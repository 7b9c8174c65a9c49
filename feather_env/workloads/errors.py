"""The workloads' error: what a workload, a data file or an arrival process says when it cannot be
built or used (below every other module of :mod:`feather_env.workloads`, so each may raise it)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["WorkloadError", "not_utf8"]


class WorkloadError(ValueError):
    """A workload cannot be built or used: empty, duplicate ids, malformed input, bad sample."""


def not_utf8(where: str | Path, exc: UnicodeDecodeError) -> WorkloadError:
    """The error for a data file that is not UTF-8 text (``where``: the file, or file:line)."""
    return WorkloadError(f"{where}: not UTF-8 text (byte {exc.start}: {exc.reason})")
