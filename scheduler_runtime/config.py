"""Typed, validated configuration objects shared by every part of the toolkit.

Every knob of a run lives in a dataclass; YAML or dict input is turned into one
with :func:`from_mapping`, which rejects unknown keys with a message that lists
the valid ones (a typo in a config must never be silently ignored).
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration file or mapping is invalid (unknown key, wrong type, bad value)."""


def is_number(x: Any) -> bool:
    """A finite real number that is not a bool (JSON ``true`` is not a weight)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def all_numbers(x: Any) -> bool:
    """Every leaf of nested lists is a finite number (:func:`is_number`)."""
    return all(all_numbers(v) for v in x) if isinstance(x, list) else is_number(x)


def is_count(x: Any, low: int = 0) -> bool:
    """An int (not a bool) >= ``low``."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= low


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """Convert ``value`` to ``annotation`` where that is unambiguous (int -> float, list -> tuple)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        if len(non_none) == 1:
            return _coerce(value, non_none[0], where)
        return value
    if dataclasses.is_dataclass(annotation) and isinstance(value, Mapping):
        return from_mapping(annotation, value, where=where)
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if origin is tuple and isinstance(value, list):
        return tuple(value)
    if annotation in (int, float, str, bool) and not isinstance(value, annotation):
        raise ConfigError(f"{where}: expected {annotation.__name__}, got {value!r}")
    if annotation is int and isinstance(value, bool):
        raise ConfigError(f"{where}: expected int, got {value!r}")
    return value


def from_mapping(cls: type[T], data: Mapping[str, Any] | None, *, where: str = "") -> T:
    """Build dataclass ``cls`` from ``data``; unknown keys raise :class:`ConfigError`.

    ``where`` names the source (file and section) in error messages.
    """
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where or cls.__name__}: expected a mapping, got {type(data).__name__}")
    kwargs = checked_fields(cls, data, where=where)
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required field is missing
        raise ConfigError(f"{where or cls.__name__}: {exc}") from exc


def checked_fields(cls: type, data: Mapping[str, Any], *, where: str = "") -> dict[str, Any]:
    """``data``'s values converted to the types of dataclass ``cls``'s fields, without building one
    (for overrides of another instance: ``dataclasses.replace(base, **checked_fields(...))``).

    Unknown keys and values of the wrong type raise :class:`ConfigError`.
    """
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - fields)
    label = where or cls.__name__
    if unknown:
        raise ConfigError(
            f"{label}: unknown key(s) {unknown}; valid keys are {sorted(fields)}"
        )
    hints = typing.get_type_hints(cls)
    return {name: _coerce(value, hints[name], f"{label}.{name}") for name, value in data.items()}


def _read_utf8(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None


def load_mapping(path: str | Path) -> dict[str, Any]:
    """Read a mapping from a ``.json`` file, else from YAML (:func:`load_yaml`); a missing,
    malformed or non-UTF-8 file, or one that holds no mapping, is a :class:`ConfigError` naming it."""
    path = Path(path)
    if path.suffix != ".json":
        return load_yaml(path)
    return _load_file(path, "JSON", json.loads, json.JSONDecodeError)


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping; a missing, malformed or non-UTF-8 file is a :class:`ConfigError` naming it."""
    return _load_file(Path(path), "YAML", yaml.safe_load, yaml.YAMLError)


def _load_file(path: Path, kind: str, parse: Any, error: type[Exception]) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}" if not path.exists()
                          else f"{path}: not a regular file (a config is a {kind} file)")
    text = _read_utf8(path)
    try:
        data = parse(text)
    except error as exc:
        raise ConfigError(f"{path}: malformed {kind}: {exc}") from exc
    if data is None and kind == "YAML":  # an empty YAML file is an empty mapping
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at top level, got {type(data).__name__}")
    return data


_UNSET: Any = object()


def check_core_knobs(*, chunk_size: Any = _UNSET, max_wait: Any = _UNSET, lpm_fcfs_fallback: Any = _UNSET,
                     group_chunks: Any = _UNSET) -> None:
    """The one check of the core's numeric knobs, wherever they are set (the batching core's
    ``CoreConfig``, the scheduler's configuration, a scenario's ``scheduler`` section); only the
    given ones are checked.

    Raises:
        ValueError: naming the knob and the value.
    """
    for name, value in (("chunk_size", chunk_size), ("group_chunks", group_chunks)):
        if value is not _UNSET and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be >= 1 (an integer), got {value!r}")
    if max_wait is not _UNSET and max_wait is not None and not (
            isinstance(max_wait, int | float) and not isinstance(max_wait, bool)
            and math.isfinite(max_wait) and max_wait >= 0):
        raise ValueError(f"max_wait must be a finite number of seconds >= 0 (or null: no anti-starvation), "
                         f"got {max_wait!r}")
    fallback = lpm_fcfs_fallback
    if fallback is not _UNSET and fallback is not None and (
            isinstance(fallback, bool) or not isinstance(fallback, int) or fallback < 0):
        raise ValueError(f"lpm_fcfs_fallback must be >= 0 or null, got {fallback!r}")
