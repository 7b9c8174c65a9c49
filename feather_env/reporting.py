"""Where and when a figure was measured, and how it is written: machine description, JSON output, tables,
and how sure a median over seeds is (:func:`median_interval`).

Shared by evaluate.py, the calibration and every benchmark (a low module: it imports nothing of
the toolkit)."""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from scheduler_runtime.hardware import cpu_isa, cpu_model


def machine_info() -> dict[str, Any]:
    """Where and when a figure was measured (goes into every benchmark JSON)."""
    cpu = cpu_model()
    mem_gib = None
    try:
        mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        pass
    return {
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu,
        "isa": cpu_isa(),
        "cores": os.cpu_count(),
        "memory_gib": mem_gib,
        "python": platform.python_version(),
    }


def write_json(path: str | Path | None, payload: dict[str, Any], *, quiet: bool = False) -> None:
    """Write ``payload`` as indented JSON (and say so, unless ``quiet``)."""
    if not path:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=float) + "\n")
    if not quiet:
        print(f"wrote {path}")


def median_interval(values: Sequence[float], level: float = 0.9) -> tuple[float, float, float]:
    """A distribution-free confidence interval for the median of ``values`` (independent draws, e.g. one
    ratio per seed): the order statistics ``x(k)`` and ``x(n + 1 - k)`` with the largest ``k`` whose
    interval covers the median with probability at least ``level`` (the binomial sign test's interval).
    Returns ``(low, high, coverage)``; where no ``k`` reaches ``level`` (too few values: 3 give at most
    75%), the whole range and its coverage, ``1 - 2 / 2 ** n``."""
    if not values:
        raise ValueError("median_interval needs at least one value")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    x = sorted(values)
    n = len(x)

    def below(k: int) -> float:  # P(Binomial(n, 1/2) < k): the median lies below x(k)
        return sum(math.comb(n, i) for i in range(k)) / 2.0**n

    k = 1
    while k + 1 <= (n + 1) // 2 and 1.0 - 2.0 * below(k + 1) >= level:
        k += 1
    return x[k - 1], x[n - k], 1.0 - 2.0 * below(k)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-markdown table (prints well in a terminal too)."""

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.1f}" if abs(v) >= 10 else f"{v:.3g}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def check_output_dir(path: str | Path, what: str = "the output folder") -> None:
    """Raise ``ValueError`` unless ``path`` is a folder, or can be created as one, by this user.

    Commands call it before they start, so that a bad ``--out`` fails first. Nothing is left behind:
    whether the nearest existing folder takes a new entry is tried with a temporary folder, removed
    at once (permission bits do not tell, e.g. for root or a read-only mount).
    """
    import tempfile

    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{what} {path} exists and is not a folder")
    parent = next((p for p in [path, *path.absolute().parents] if p.exists()), Path("/"))
    if not parent.is_dir():
        raise ValueError(f"{what} {path}: {parent} is not a folder")
    try:
        tempfile.TemporaryDirectory(dir=parent, prefix=".feather-write-check-").cleanup()
    except OSError as exc:
        raise ValueError(f"{what} {path}: cannot write in {parent} ({exc.strerror or exc})") from None


def check_output_file(path: str | Path, what: str, kind: str = "a file") -> None:
    """Raise ``ValueError`` unless ``path`` can be written as a file: it is no folder, and its folder
    is one or can be made (:func:`check_output_dir`). ``what`` names the flag, ``kind`` the file."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{what} {path} is a folder: give the path of {kind}")
    check_output_dir(path.parent, f"{what}'s folder")
