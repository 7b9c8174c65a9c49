"""A small on-disk cache of numpy arrays (tokenized data), robust to corrupt or stale files.

Entries live under ``$FEATHER_CACHE_DIR`` (default ``~/.cache/feather``) as ``.npz`` files
named by a key that hashes everything the content depends on. A file that cannot be read
(truncated, corrupt, wrong arrays) counts as a miss and is rebuilt; a cache folder that
cannot be written only costs the speed-up.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

CACHE_ENV_VAR = "FEATHER_CACHE_DIR"


def cache_dir(subdir: str = "") -> Path:
    """``$FEATHER_CACHE_DIR/subdir``, else ``~/.cache/feather/subdir`` (not created here)."""
    base = os.environ.get(CACHE_ENV_VAR) or Path.home() / ".cache" / "feather"
    return Path(base) / subdir


def file_sha256(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def cache_key(**parts: Any) -> str:
    """A stable hash of JSON-serializable ``parts``."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def load_arrays(path: Path, required: tuple[str, ...]) -> dict[str, np.ndarray] | None:
    """The arrays in ``path``, or ``None`` when it is missing, unreadable or lacks ``required``."""
    if not path.is_file():
        return None
    try:
        # Our own handle: np.load leaks the one it opens when the archive is corrupt.
        with open(path, "rb") as fh, np.load(fh, allow_pickle=False) as data:
            if not set(required) <= set(data.files):
                return None
            return {name: data[name] for name in data.files}
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile):
        return None


def save_arrays(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Write ``arrays`` atomically (temp file + rename); failures only warn."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                np.savez(fh, **arrays)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        warnings.warn(f"could not write cache file {path}: {exc}", stacklevel=2)
