"""Your own requests as a workload: a JSON-lines or CSV file of prompts, output lengths and timestamps.

A scenario names the file with ``workload: {kind: custom, path: FILE}`` (FILE relative to the
scenario file); the format follows the extension (``.jsonl`` / ``.json``: one JSON object per line;
``.csv``: a header row). Each row is one request:

- its prompt, exactly one of
  - ``prompt``: text, tokenized with the model's tokenizer as the server does (``<s>`` first);
  - ``prompt_token_ids``: token ids, used as they are (each must be in the model's vocabulary);
  - ``messages``: a chat, ``[{"role": ..., "content": ...}, ...]``, rendered with the model's chat
    template (``chat_template`` in its ``tokenizer_config.json`` or a ``chat_template.jinja``)
    where it has one, else as ``"ROLE: CONTENT"`` blocks ending in ``"assistant:"``;
- ``output_tokens`` (or ``max_tokens``): how many tokens it generates, an integer >= 1;
- optionally ``timestamp`` (or ``arrival_time``): when it arrives, in seconds (>= 0). Either every
  row has one or none does; the earliest becomes t = 0.
- optionally ``request_id`` (unique) and ``source`` (the task, a feature of the length predictor).

In CSV, ``prompt_token_ids`` and ``messages`` are JSON text in their cell. Other fields are ignored,
so the file ``python -m feather_env.workloads export`` writes (and ``vllm bench serve
--dataset-name custom`` reads) loads as it is; its ``arrival_time`` is the timestamp.

Shared prefixes come from the content: requests that share a system prompt, a document or a chat
history share their first tokens, and the prefix cache, the Chunked Hash Tree and the simulator
find them there. ``prefix_group`` (for describing and sampling the pool) is derived too: the
prefix every request shares (a system prompt) is set aside, and requests whose next
:data:`GROUP_KEY_TOKENS` tokens agree form one group (the same document, the same conversation).

The file is read as a stream and checked row by row before anything else is built: a malformed
line, a missing or ill-typed field, a token id outside the vocabulary, a timestamp that is not a
finite time >= 0, a request longer than the model's context or than the KV cache can ever hold
(``max_request_tokens``, the scenario's), each raise :class:`~feather_env.workloads.WorkloadError`
naming the file and line. A line longer than any request that could fit is refused before it is
read whole, so memory stays bounded by the requests kept.

Mooncake traces (``format: mooncake``)
--------------------------------------
The FAST'25 trace release of Mooncake (kvcache-ai/Mooncake) has no text: one JSON line per
request with ``timestamp`` (milliseconds from the start), ``input_length`` and ``output_length``
(tokens) and ``hash_ids``, the prompt's blocks of :data:`MOONCAKE_BLOCK_TOKENS` tokens (two
requests whose first k ids agree share their first k blocks of prompt; the last block may be
partial)::

    {"timestamp": 27482, "input_length": 1200, "output_length": 52, "hash_ids": [46, 47, 48]}

With ``workload: {kind: custom, path: FILE, format: mooncake}`` each id becomes a fixed block of
``block_tokens`` token ids (default 512: the trace's own sizes) drawn from ``[3, vocab_size)`` of
the model's vocabulary by a generator seeded by the id, so an id is the same tokens in every
request and every run. The prompt is its blocks joined and cut to
``ceil(input_length * block_tokens / 512)`` tokens, the output ``max(1, round(output_length *
block_tokens / 512))`` tokens: a smaller ``block_tokens`` scales every length (and the prefix
sharing with it) down by ``block_tokens / 512``. A request arrives at ``timestamp / 1000`` s; its
source (a feature of the length predictor) is ``mooncake/<file name without extension>``. Each
row is checked as the others (a missing or non-integer field, a negative length or id, a
timestamp that is not a finite number >= 0, fewer ``hash_ids`` than ``ceil(input_length / 512)``
raise :class:`~feather_env.workloads.WorkloadError` naming the file and line; further ids are not
used), and so is each request it makes (the model's context, the KV cache, the caps).

A relative ``path`` not found where it is named (beside the scenario file) is looked up under the
data root (:func:`resolve_custom_path`): a scenario may name ``traces/mooncake/synthetic_trace.jsonl``.
"""

from __future__ import annotations

import csv
import functools
import json
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from feather_env.workloads.datadir import require_file, resolve_data_dir
from feather_env.workloads.request import Request
from feather_env.workloads.tokenizer import DEFAULT_MODEL_DIR, load_tokenizer
from feather_env.workloads.workload import Workload, WorkloadError, iter_jsonl_objects, not_utf8
from scheduler_runtime.config import ConfigError, load_mapping

__all__ = ["CUSTOM_FORMATS", "GROUP_KEY_TOKENS", "MOONCAKE_BLOCK_TOKENS", "ROW_FORMATS", "ModelInfo",
           "load_custom", "model_info", "render_chat", "resolve_custom_path"]

CUSTOM_FORMATS = (".jsonl", ".json", ".csv")
#: What a row is: ``requests`` (a prompt, an output length, a timestamp) or ``mooncake`` (lengths and
#: block hash ids; module docstring).
ROW_FORMATS = ("requests", "mooncake")
#: Tokens per block of a Mooncake trace's ``hash_ids``.
MOONCAKE_BLOCK_TOKENS = 512
MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
PROMPT_FIELDS = ("prompt", "prompt_token_ids", "messages")
OUTPUT_FIELDS = ("output_tokens", "max_tokens")
TIME_FIELDS = ("timestamp", "arrival_time")
#: Tokens after the prefix every request shares that decide a request's prefix group.
GROUP_KEY_TOKENS = 32
#: An upper bound of the bytes one token takes in a line (JSON escapes included): a longer line
#: cannot hold a request that fits.
_BYTES_PER_TOKEN = 64
_ENCODE_BATCH = 256


@dataclass(frozen=True)
class ModelInfo:
    """What the loader needs of the model: its vocabulary, context length and chat template."""

    model_dir: str
    vocab_size: int
    max_len: int
    chat_template: str | None
    bos_token: str = "<s>"
    eos_token: str = "</s>"


def model_info(model_dir: str | os.PathLike[str] | None = None) -> ModelInfo:
    """The vocabulary size and context length (``config.json``) and the chat template of ``model_dir``
    (default: the bundled model)."""
    folder = Path(model_dir if model_dir is not None else DEFAULT_MODEL_DIR).resolve()
    stamps = tuple(p.stat().st_mtime_ns if p.is_file() else 0 for p in
                   (folder / n for n in ("config.json", "tokenizer_config.json", "chat_template.jinja")))
    return _model_info(str(folder), stamps)


@functools.lru_cache(maxsize=8)
def _model_info(folder: str, stamps: tuple[int, ...]) -> ModelInfo:
    config = _read_json(Path(folder) / "config.json")
    vocab = config.get("vocab_size")
    max_len = config.get("max_position_embeddings")
    if not isinstance(vocab, int) or not isinstance(max_len, int):
        raise WorkloadError(f"{folder}/config.json: needs integer vocab_size and max_position_embeddings")
    tok_config = _read_json(Path(folder) / "tokenizer_config.json", missing_ok=True)
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    jinja_file = Path(folder) / "chat_template.jinja"
    if not template and jinja_file.is_file():
        template = jinja_file.read_text(encoding="utf-8")

    def token(key: str, default: str) -> str:
        value = tok_config.get(key, default)
        return value.get("content", default) if isinstance(value, Mapping) else str(value or default)

    return ModelInfo(folder, vocab, max_len, template if isinstance(template, str) else None,
                     token("bos_token", "<s>"), token("eos_token", "</s>"))


def _read_json(path: Path, missing_ok: bool = False) -> dict[str, Any]:
    if missing_ok and not path.is_file():
        return {}
    try:
        return load_mapping(path)
    except ConfigError as exc:
        raise WorkloadError(f"the model's configuration: {exc}") from None


@functools.lru_cache(maxsize=4)
def _compiled_template(template: str) -> Any:
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


def render_chat(messages: list[dict[str, str]], info: ModelInfo) -> tuple[str, bool]:
    """A chat as prompt text, and whether the tokenizer should add its special tokens (``<s>``).

    With the model's chat template: the template's text (it writes its own special tokens), with
    the generation prompt; without one: ``"ROLE: CONTENT"`` blocks and ``"assistant:"``.
    """
    if info.chat_template:
        text = _compiled_template(info.chat_template).render(
            messages=messages, add_generation_prompt=True, bos_token=info.bos_token,
            eos_token=info.eos_token)
        return text, False
    return "".join(f"{m['role']}: {m['content']}\n\n" for m in messages) + "assistant:", True


# -- reading rows -------------------------------------------------------------------------------
def _csv_rows(path: Path, max_line_bytes: int, too_long: str) -> Iterator[tuple[int, dict[str, Any]]]:
    old = csv.field_size_limit()
    csv.field_size_limit(max_line_bytes)
    lineno = 0
    try:
        with path.open(newline="", encoding="utf-8-sig") as fh:
            reader = csv.DictReader(fh)
            try:
                if reader.fieldnames is None:
                    return
                for row in reader:
                    lineno = reader.line_num
                    if None in row:
                        raise WorkloadError(f"{path}:{lineno}: more fields than the header's "
                                            f"{len(reader.fieldnames)}")
                    yield lineno, {k: v for k, v in row.items() if v not in (None, "")}
            except csv.Error as exc:
                where = f"{path}:{reader.line_num or lineno + 1}"
                if "field larger than field limit" in str(exc):
                    raise WorkloadError(f"{where}: a field longer than {max_line_bytes} bytes"
                                        f"{too_long}") from None
                raise WorkloadError(f"{where}: malformed CSV: {exc}") from None
    except UnicodeDecodeError as exc:
        raise not_utf8(f"{path} (after line {lineno})", exc) from None
    finally:
        csv.field_size_limit(old)


def _rows(path: Path, max_line_bytes: int, too_long: str) -> Iterator[tuple[int, dict[str, Any]]]:
    if path.suffix.lower() == ".csv":
        return _csv_rows(path, max_line_bytes, too_long)
    return iter_jsonl_objects(path, max_line_bytes, too_long)


def _json_cell(value: Any, field: str, where: str) -> Any:
    """A CSV cell holding JSON (``prompt_token_ids``, ``messages``); JSON rows are already parsed."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise WorkloadError(f"{where}: {field} is not JSON ({exc.msg})") from None


def _number(value: Any, field: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise WorkloadError(f"{where}: {field} must be a number, got {value!r}")
    try:
        return float(value)
    except ValueError:
        raise WorkloadError(f"{where}: {field} must be a number, got {value!r}") from None


def _count(value: Any, field: str, where: str, minimum: int = 1) -> int:
    number = _number(value, field, where)
    if not (math.isfinite(number) and number.is_integer() and minimum <= number < 2**31):
        raise WorkloadError(f"{where}: {field} must be an integer >= {minimum}, got {value!r}")
    return int(number)


def _messages(value: Any, where: str) -> list[dict[str, str]]:
    value = _json_cell(value, "messages", where)
    if not isinstance(value, list) or not value:
        raise WorkloadError(f"{where}: messages must be a non-empty list of {{'role', 'content'}} objects")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise WorkloadError(f"{where}: messages[{i}] needs a 'role' (a string) and a 'content'")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI's content parts: the text ones
            texts = [p.get("text") for p in content if isinstance(p, Mapping) and p.get("type") == "text"]
            if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
                raise WorkloadError(f"{where}: messages[{i}].content: only text parts are supported")
            content = "".join(texts)
        if not isinstance(content, str):
            raise WorkloadError(f"{where}: messages[{i}].content must be a string, got {content!r}")
        out.append({"role": m["role"], "content": content})
    return out


@dataclass
class _Row:
    line: int
    output: int
    timestamp: float | None
    request_id: str | None
    source: str
    text: str | None = None
    special: bool = True
    ids: np.ndarray | None = None


def _parse_row(path: Path, lineno: int, item: Mapping[str, Any], info: ModelInfo) -> _Row:
    where = f"{path}:{lineno}"
    given = [f for f in PROMPT_FIELDS if item.get(f) is not None]
    if not given:
        raise WorkloadError(f"{where}: no prompt: a row needs one of {list(PROMPT_FIELDS)} "
                            f"(found fields {sorted(item)})")
    if len(given) > 1:
        raise WorkloadError(f"{where}: give one of {list(PROMPT_FIELDS)}, not {given}")
    outputs = {f: _count(item[f], f, where) for f in OUTPUT_FIELDS if item.get(f) is not None}
    if not outputs:
        raise WorkloadError(f"{where}: no output length: a row needs 'output_tokens' (or 'max_tokens'), "
                            f"the number of tokens the request generates")
    if len(set(outputs.values())) > 1:
        raise WorkloadError(f"{where}: output_tokens and max_tokens differ ({outputs}); give one")
    times = [f for f in TIME_FIELDS if item.get(f) is not None]
    timestamp = None
    if times:
        timestamp = _number(item[times[0]], times[0], where)
        if not (math.isfinite(timestamp) and timestamp >= 0):
            raise WorkloadError(f"{where}: {times[0]} must be a finite time in seconds >= 0, "
                                f"got {item[times[0]]!r}")
    rid = item.get("request_id")
    if rid is not None and (isinstance(rid, bool) or not isinstance(rid, str | int) or str(rid) == ""):
        raise WorkloadError(f"{where}: request_id must be a non-empty string or an integer, got {rid!r}")
    source = item.get("source", "")
    row = _Row(lineno, outputs.popitem()[1], timestamp, None if rid is None else str(rid),
               source if isinstance(source, str) else str(source))
    field = given[0]
    if field == "prompt":
        if not isinstance(item["prompt"], str) or not item["prompt"]:
            raise WorkloadError(f"{where}: prompt must be non-empty text, got {item['prompt']!r:.80}")
        row.text = item["prompt"]
    elif field == "messages":
        try:
            row.text, row.special = render_chat(_messages(item["messages"], where), info)
        except WorkloadError:
            raise
        except Exception as exc:  # the model's template (jinja2) refused the chat
            raise WorkloadError(f"{where}: the chat template cannot render these messages: {exc}") from None
    else:
        ids = _json_cell(item["prompt_token_ids"], "prompt_token_ids", where)
        if (not isinstance(ids, list) or not ids
                or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
            raise WorkloadError(f"{where}: prompt_token_ids must be a non-empty list of integers")
        bad = [t for t in ids if not 0 <= t < info.vocab_size]
        if bad:
            raise WorkloadError(f"{where}: token id {bad[0]} is outside the model's vocabulary "
                                f"(0..{info.vocab_size - 1}, {info.model_dir})")
        row.ids = np.asarray(ids, dtype=np.int32)
    return row


class _MooncakeBlocks:
    """The fixed block of ``block_tokens`` token ids of each Mooncake hash id, drawn once per id from
    ``[3, vocab_size)`` by a generator seeded by the id (module docstring)."""

    def __init__(self, vocab_size: int, block_tokens: int) -> None:
        self.vocab_size, self.block_tokens = vocab_size, block_tokens
        self.blocks: dict[int, np.ndarray] = {}

    def block(self, hash_id: int) -> np.ndarray:
        block = self.blocks.get(hash_id)
        if block is None:
            block = np.random.default_rng(hash_id).integers(3, self.vocab_size, size=self.block_tokens,
                                                            dtype=np.int32)
            self.blocks[hash_id] = block
        return block

    def prompt(self, hash_ids: list[int], tokens: int) -> np.ndarray:
        """The first ``tokens`` tokens of the blocks of ``hash_ids``."""
        need = -(-tokens // self.block_tokens)
        return np.concatenate([self.block(h) for h in hash_ids[:need]])[:tokens]


def _parse_mooncake_row(path: Path, lineno: int, item: Mapping[str, Any], blocks: _MooncakeBlocks) -> _Row:
    where = f"{path}:{lineno}"
    missing = [f for f in MOONCAKE_FIELDS if item.get(f) is None]
    if missing:
        raise WorkloadError(f"{where}: a Mooncake row needs {list(MOONCAKE_FIELDS)}; no {missing} "
                            f"(found fields {sorted(item)})")
    millis = _number(item["timestamp"], "timestamp", where)
    if not (math.isfinite(millis) and millis >= 0):
        raise WorkloadError(f"{where}: timestamp must be a finite time in milliseconds >= 0, "
                            f"got {item['timestamp']!r}")
    input_length = _count(item["input_length"], "input_length", where)
    output_length = _count(item["output_length"], "output_length", where, minimum=0)
    ids = item["hash_ids"]
    if not isinstance(ids, list) or not all(type(h) is int for h in ids):
        raise WorkloadError(f"{where}: hash_ids must be a list of integers, got {ids!r:.80}")
    if ids and min(ids) < 0:
        raise WorkloadError(f"{where}: hash_ids must be integers >= 0, got {min(ids)}")
    need = -(-input_length // MOONCAKE_BLOCK_TOKENS)
    if len(ids) < need:
        raise WorkloadError(f"{where}: input_length {input_length} needs {need} hash_ids (one per "
                            f"{MOONCAKE_BLOCK_TOKENS}-token block), got {len(ids)}")
    scale = blocks.block_tokens
    tokens = -(-input_length * scale // MOONCAKE_BLOCK_TOKENS)
    row = _Row(lineno, max(1, round(output_length * scale / MOONCAKE_BLOCK_TOKENS)), millis / 1000, None,
               f"mooncake/{path.stem}")
    row.ids = blocks.prompt(ids, tokens)
    return row


def resolve_custom_path(path: str | os.PathLike[str], base_dir: str | os.PathLike[str] | None = None,
                        data_dir: str | os.PathLike[str] | None = None) -> Path:
    """A custom workload's file: as given when absolute; a relative one beside ``base_dir`` (the
    scenario file's folder; default: the working directory), else under the data root
    (``data_dir``, else ``$FEATHER_DATA_DIR``, else ``../shared/data``: :func:`resolve_data_dir`),
    else (found nowhere) the path beside ``base_dir``, for the error that names it."""
    given = Path(path).expanduser()
    if given.is_absolute():
        return given
    beside = given if base_dir is None else Path(base_dir) / given
    if beside.is_file():
        return beside
    first, rest = (given.parts[0], given.parts[1:]) if len(given.parts) > 1 else ("", given.parts)
    if first in (".", ".."):
        return beside
    try:  # the first folder as resolve_data_dir finds it (the root may be that folder itself)
        under = resolve_data_dir(data_dir, first).joinpath(*rest)
    except FileNotFoundError:
        return beside
    return under if under.is_file() else beside


# -- the workload --------------------------------------------------------------------------------
def load_custom(
    path: str | os.PathLike[str],
    *,
    tokenizer: Tokenizer | None = None,
    model_dir: str | os.PathLike[str] | None = None,
    name: str | None = None,
    max_prompt_tokens: int | None = None,
    max_output_tokens: int | None = None,
    overflow: str = "truncate",
    max_request_tokens: int | None = None,
    capacity_note: str = "",
    format: str = "requests",
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> Workload:
    """The requests of a JSON-lines or CSV file (see the module docstring), in file order.

    Args:
        path: the file (``.jsonl``, ``.json`` or ``.csv``); a relative one not found in the working
            directory is looked up under the data root (:func:`resolve_custom_path`).
        tokenizer, model_dir: the model's tokenizer and folder (vocabulary, context, chat template);
            default: the bundled model.
        name: the workload's name (default: the file name without its extension).
        max_prompt_tokens: prompt cap; a longer prompt keeps its first tokens (``overflow="truncate"``)
            or raises (``"error"``).
        max_output_tokens: output cap.
        max_request_tokens: prompt + output tokens a request may hold at most (the KV cache's
            capacity); a larger request raises naming its line. ``capacity_note`` says what the
            capacity is in that error.
        format: ``"requests"`` (a prompt per row) or ``"mooncake"`` (a Mooncake trace: lengths
            and block hash ids, JSON lines; module docstring).
        block_tokens: ``mooncake`` only: tokens per hash id (512: the trace's own lengths; less
            scales every length by ``block_tokens / 512``).

    Raises:
        WorkloadError: naming the file and line (module docstring).
        DataNotFoundError: the file does not exist.
    """
    if overflow not in ("truncate", "error"):
        raise WorkloadError(f"overflow must be 'truncate' or 'error', got {overflow!r}")
    if format not in ROW_FORMATS:
        raise WorkloadError(f"format must be one of {list(ROW_FORMATS)}, got {format!r}")
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
        raise WorkloadError(f"block_tokens must be an integer >= 1, got {block_tokens!r}")
    if format != "mooncake" and block_tokens != MOONCAKE_BLOCK_TOKENS:
        raise WorkloadError(f"block_tokens (tokens per Mooncake hash id) is for format 'mooncake', "
                            f"not {format!r}")
    path = require_file(resolve_custom_path(path))
    args = (name, max_prompt_tokens, max_output_tokens, overflow, max_request_tokens, capacity_note,
            format, block_tokens)
    info = model_info(model_dir)
    if tokenizer is None:  # the model's own tokenizer: the same file gives the same workload
        stat = path.stat()
        return _load_cached(str(path.resolve()), stat.st_mtime_ns, stat.st_size, info, *args)
    return _load(path, tokenizer, info, *args)


@functools.lru_cache(maxsize=4)
def _load_cached(path: str, mtime_ns: int, size: int, info: ModelInfo, *args: Any) -> Workload:
    """:func:`_load` of an unchanged file with the model's tokenizer (scenario objects of one file
    share the pool: workloads are immutable)."""
    return _load(Path(path), None, info, *args)


def _load(path: Path, tokenizer: Tokenizer | None, info: ModelInfo, name: str | None,
          max_prompt_tokens: int | None, max_output_tokens: int | None, overflow: str,
          max_request_tokens: int | None, capacity_note: str, format: str, block_tokens: int) -> Workload:
    if path.suffix.lower() not in CUSTOM_FORMATS:
        raise WorkloadError(f"{path}: a custom workload is JSON lines ({', '.join(CUSTOM_FORMATS[:2])}) "
                            f"or CSV (.csv), by extension; got {path.suffix or 'no extension'!r}")
    if format == "mooncake":
        if path.suffix.lower() == ".csv":
            raise WorkloadError(f"{path}: a Mooncake trace is JSON lines (.jsonl), not CSV")
        parse = functools.partial(_parse_mooncake_row, blocks=_MooncakeBlocks(info.vocab_size, block_tokens))
    else:
        parse = functools.partial(_parse_row, info=info)
    tok = tokenizer if tokenizer is not None else load_tokenizer(info.model_dir)
    limit = info.max_len if max_request_tokens is None else min(info.max_len, max_request_tokens)
    if max_prompt_tokens is not None and overflow == "truncate":
        limit = max(limit, max_prompt_tokens)  # a longer prompt is cut, not refused
    max_line = _BYTES_PER_TOKEN * limit + (1 << 16)
    too_long = f": no request that long fits (at most {limit} tokens)"
    loader = _Loader(path, tok, info, max_prompt_tokens, max_output_tokens, overflow, max_request_tokens,
                     capacity_note)
    for lineno, item in _rows(path, max_line, too_long):
        loader.add(parse(path, lineno, item))
    return loader.workload(name if name is not None else path.stem)


class _Loader:
    """Collects parsed rows, tokenizes them in batches and checks each as it is complete."""

    def __init__(self, path: Path, tok: Tokenizer, info: ModelInfo, max_prompt: int | None,
                 max_output: int | None, overflow: str, max_request: int | None, note: str) -> None:
        self.path, self.tok, self.info = path, tok, info
        self.max_prompt, self.max_output, self.overflow = max_prompt, max_output, overflow
        self.max_request, self.note = max_request, note
        self.pending: list[_Row] = []
        self.done: list[_Row] = []
        self.ids_seen: dict[str, int] = {}
        self.timed: tuple[int, bool] | None = None  # (first line, whether it had a timestamp)

    def add(self, row: _Row) -> None:
        where = f"{self.path}:{row.line}"
        has_time = row.timestamp is not None
        if self.timed is None:
            self.timed = (row.line, has_time)
        elif self.timed[1] != has_time:
            first, timed = self.timed
            raise WorkloadError(f"{where}: {'no' if not has_time else 'a'} timestamp, but line {first} "
                                f"{'has one' if timed else 'has none'}: give every row a timestamp, or none")
        if row.request_id is not None:
            if row.request_id in self.ids_seen:
                raise WorkloadError(f"{where}: request_id {row.request_id!r} is also on line "
                                    f"{self.ids_seen[row.request_id]}")
            self.ids_seen[row.request_id] = row.line
        self.pending.append(row)  # rows are finished in file order, in batches
        if len(self.pending) >= _ENCODE_BATCH:
            self._encode()

    def _encode(self) -> None:
        for special in (True, False):
            rows = [r for r in self.pending if r.ids is None and r.special == special]
            if not rows:
                continue
            encoded = self.tok.encode_batch([r.text for r in rows], add_special_tokens=special)
            for row, enc in zip(rows, encoded, strict=True):
                row.ids = np.asarray(enc.ids, dtype=np.int32)
                row.text = None
        pending, self.pending = self.pending, []
        for row in pending:
            self._finish(row)

    def _finish(self, row: _Row) -> None:
        where = f"{self.path}:{row.line}"
        assert row.ids is not None
        n = int(row.ids.size)
        if n == 0:
            raise WorkloadError(f"{where}: the prompt has no tokens")
        if self.max_prompt is not None and n > self.max_prompt:
            if self.overflow == "error":
                raise WorkloadError(f"{where}: prompt of {n} tokens > max_prompt_tokens={self.max_prompt}")
            row.ids = row.ids[: self.max_prompt].copy()
            n = self.max_prompt
        if self.max_output is not None:
            row.output = min(row.output, self.max_output)
        peak = n + row.output
        if peak > self.info.max_len:
            raise WorkloadError(f"{where}: {n} prompt + {row.output} output tokens exceed the model's "
                                f"context of {self.info.max_len} tokens (max_position_embeddings, "
                                f"{self.info.model_dir}/config.json)")
        if self.max_request is not None and peak > self.max_request:
            raise WorkloadError(f"{where}: {n} prompt + {row.output} output tokens can never fit the KV "
                                f"cache of {self.max_request} tokens{self.note}; raise engine.kv_cache_gib, "
                                "or cap the request (workload.max_prompt_tokens / max_output_tokens)")
        self.done.append(row)

    def workload(self, name: str) -> Workload:
        if self.pending:
            self._encode()
        rows = self.done
        if not rows:
            raise WorkloadError(f"{self.path}: no requests (the file is empty)")
        timed = rows[0].timestamp is not None
        t0 = min(r.timestamp for r in rows) if timed else 0.0  # type: ignore[type-var]
        groups = _prefix_groups([r.ids for r in rows])  # type: ignore[misc]
        stem = self.path.stem
        requests = tuple(
            Request(request_id=r.request_id if r.request_id is not None else f"{stem}/{r.line}",
                    prompt_token_ids=r.ids, prefix_group=g, output_len=r.output,
                    arrival_time=float(r.timestamp - t0) if timed else 0.0,  # type: ignore[operator]
                    source=r.source or f"custom/{stem}", meta={"line": r.line})
            for r, g in zip(rows, groups, strict=True))
        return Workload(name, requests, "trace" if timed else None)


def _prefix_groups(prompts: list[np.ndarray]) -> list[int]:
    """Each prompt's group (module docstring): the :data:`GROUP_KEY_TOKENS` tokens after the prefix
    every prompt shares; groups numbered in order of first appearance."""
    first = prompts[0]
    shared = first.size
    for ids in prompts[1:]:
        n = min(shared, ids.size)
        diff = np.flatnonzero(first[:n] != ids[:n])
        shared = int(diff[0]) if diff.size else n
    keys: dict[bytes, int] = {}
    return [keys.setdefault(ids[shared:shared + GROUP_KEY_TOKENS].tobytes(), len(keys)) for ids in prompts]
