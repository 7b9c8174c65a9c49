"""Where and when a figure was measured, and how it is written: machine description, JSON output, tables.

Shared by evaluate.py, the calibration and every benchmark (a low module: it imports nothing of
the toolkit)."""

from __future__ import annotations

import datetime as _dt
import json
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
