"""Where the benchmark data lives, and the errors that say how to get it.

The data (L-Eval, LongBench lengths, vidur traces) is never part of the repository. A loader
finds its folder with :func:`resolve_data_dir`, in this order:

1. an explicit path (a command-line flag or ``data_dir`` in a workload config);
2. the environment variable ``FEATHER_DATA_DIR``;
3. ``../shared/data`` beside the repository root, if it exists.

Each names the data *root* holding ``leval/``, ``longbench/`` and ``traces/``; pointing it at
one of those folders directly also works.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_VAR = "FEATHER_DATA_DIR"
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DATA_DIR = REPO_ROOT.parent / "shared" / "data"

# What each subfolder must contain, and where a user gets it.
_MARKERS: dict[str, tuple[str, ...]] = {
    "leval": ("Closed-ended-tasks", "Open-ended-tasks"),
    "longbench": ("lengths",),
    "traces": ("splitwise_conv.csv", "sharegpt_8k_filtered_stats_llama2_tokenizer.csv"),
}
_SOURCES: dict[str, str] = {
    "leval": (
        "L-Eval comes from the OpenLMLab/LEval release (https://github.com/OpenLMLab/LEval): "
        "copy its LEval-data/Closed-ended-tasks/*.jsonl and LEval-data/Open-ended-tasks/*.jsonl "
        "to DATA/leval/Closed-ended-tasks/ and DATA/leval/Open-ended-tasks/"
    ),
    "longbench": (
        "LongBench comes from THUDM/LongBench (https://github.com/THUDM/LongBench): "
        "DATA/longbench/lengths/TASK.jsonl (one line per item with `length` and `answers`) "
        "and DATA/longbench/config/dataset2maxlen.json from the release's config/"
    ),
    "traces": (
        "the traces come from the vidur simulator (https://github.com/microsoft/vidur), "
        "data/processed_traces/*.csv (splitwise_conv.csv, "
        "sharegpt_8k_filtered_stats_llama2_tokenizer.csv, "
        "arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv), copied to DATA/traces/"
    ),
}


class DataNotFoundError(FileNotFoundError):
    """A data folder or file is missing; the message says where it looked and how to get it."""


def data_source_hint(subdir: str) -> str:
    """One sentence on where the data of ``subdir`` comes from (empty for unknown subdirs)."""
    return _SOURCES.get(subdir, "")


def missing_data_message(path: Path, subdir: str, how: str = "") -> str:
    """The text of a :class:`DataNotFoundError`: the path, why it was looked at, how to fix it."""
    msg = f"{subdir or 'workload'} data not found: {path} does not exist"
    if how:
        msg += f" (looked there because {how})"
    msg += (
        f"; give the data root with a --data-dir flag or `data_dir` in the workload config, "
        f"or set {ENV_VAR}=/path/to/data (default: {DEFAULT_DATA_DIR})"
    )
    hint = data_source_hint(subdir)
    if hint:
        msg += f". {hint}"
    return msg


def _has_markers(path: Path, subdir: str) -> bool:
    return any((path / m).exists() for m in _MARKERS.get(subdir, ()))


def resolve_data_dir(explicit: str | os.PathLike[str] | None, subdir: str) -> Path:
    """The folder of ``subdir`` (``"leval"``, ``"longbench"``, ``"traces"``) under the data root.

    Precedence: ``explicit`` > ``$FEATHER_DATA_DIR`` > ``../shared/data`` beside the repo.
    ``explicit`` may name the root or the subfolder itself. Raises
    :class:`DataNotFoundError` naming the missing path, the env var and the data's source.
    """
    if explicit is not None and str(explicit) != "":
        root, how = Path(explicit).expanduser(), "it was given explicitly"
    elif os.environ.get(ENV_VAR):
        root, how = Path(os.environ[ENV_VAR]).expanduser(), f"{ENV_VAR} is set"
    else:
        root, how = DEFAULT_DATA_DIR, "it is the default location"
    candidate = root / subdir
    if candidate.is_dir():
        return candidate
    if root.is_dir() and (root.name == subdir or _has_markers(root, subdir)):
        return root
    missing = candidate if root.is_dir() else root
    raise DataNotFoundError(missing_data_message(missing, subdir, how))


def require_file(path: str | os.PathLike[str], subdir: str = "") -> Path:
    """``path`` as a :class:`Path` if it is a file, else :class:`DataNotFoundError` naming it."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataNotFoundError(missing_data_message(path, subdir))
    return path
