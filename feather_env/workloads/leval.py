"""L-Eval as a prefix-sharing workload: one request per (document, question), document first.

The L-Eval release (OpenLMLab/LEval) has 15 JSON-lines task files under
``Closed-ended-tasks/`` and ``Open-ended-tasks/``; each line holds a long document
(``input``), questions about it (``instructions``) and reference answers (``outputs``).
Every question on a document becomes a request whose prompt is::

    <s> DOCUMENT INSTRUCTION_TEMPLATE(question)

so all questions of a document share the document as a prefix (``prefix_group`` = one id per
unique document). Some files repeat a document on several lines (a second evaluation tag,
or, in gsm100, one 16-shot prompt with a different question per line): documents are
deduplicated by text across all selected files, their questions merged, and a question that
repeats on one document is kept once (first occurrence).

Lengths: with ``output="answer"`` (default) ``output_len`` is the token count of the reference
answer (at least 1, capped by ``max_output_tokens``; the L-Eval baselines generate at most 512
tokens). ``output="max"`` gives every request exactly ``max_output_tokens`` (what a run whose
model never stops early generates: a decode-dominated load, as serving benchmarks with a fixed
output length measure). A prompt longer than
``max_prompt_tokens`` either raises (``overflow="error"``) or has its *document* cut at the end
(``overflow="truncate"``) to the length that fits the document's longest question, so every
question of the document keeps exactly the same prefix.

Tokenizing all files takes seconds; the tokens of each file are cached on disk (see
:mod:`feather_env.workloads.cache`) keyed by the file's sha256, the tokenizer and the
template, so a repeated load takes a fraction of a second.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from feather_env.workloads.cache import (
    cache_dir,
    cache_key,
    file_sha256,
    load_arrays,
    save_arrays,
)
from feather_env.workloads.datadir import DataNotFoundError, resolve_data_dir
from feather_env.workloads.request import Request
from feather_env.workloads.tokenizer import (
    BOS_ID,
    encode_batch_ids,
    load_tokenizer,
    tokenizer_fingerprint,
)
from feather_env.workloads.workload import Workload, WorkloadError, iter_jsonl_objects

LEVAL_SUBDIRS = ("Closed-ended-tasks", "Open-ended-tasks")
DEFAULT_INSTRUCTION_TEMPLATE = "\n\nQuestion: {instruction}\nAnswer:"
OVERFLOW_MODES = ("truncate", "error")
OUTPUT_MODES = ("answer", "max")
_CACHE_VERSION = 1
_CACHE_ARRAYS = (
    "doc_hash",
    "doc_tok",
    "doc_off",
    "pair_doc",
    "pair_line",
    "pair_qidx",
    "instr_hash",
    "instr_tok",
    "instr_off",
    "answer_len",
)


def leval_task_files(leval_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """``{task: path}`` for every ``*.jsonl`` under the two task folders, sorted by path."""
    root = Path(leval_dir)
    files = sorted(p for sub in LEVAL_SUBDIRS for p in (root / sub).glob("*.jsonl"))
    return {p.stem: p for p in files}


def _select_tasks(leval_dir: Path, tasks: Sequence[str] | str | None) -> dict[str, Path]:
    available = leval_task_files(leval_dir)
    if not available:
        raise DataNotFoundError(
            f"no L-Eval task files (*.jsonl) under {leval_dir}/{{{','.join(LEVAL_SUBDIRS)}}}"
        )
    if tasks is None:
        return available
    if isinstance(tasks, str):
        tasks = [tasks]
    selected: dict[str, Path] = {}
    for name in tasks:
        stem = Path(name).name.removesuffix(".jsonl")
        if stem not in available:
            raise WorkloadError(
                f"unknown L-Eval task {name!r} in {leval_dir}; available: {sorted(available)}"
            )
        selected[stem] = available[stem]
    if not selected:
        raise WorkloadError(f"no L-Eval tasks selected (tasks={list(tasks)!r})")
    return dict(sorted(selected.items(), key=lambda kv: kv[1]))


def _text_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass
class _Parsed:
    docs: list[str]
    # per unique (document, instruction) pair of the file:
    pair_doc: list[int]
    pair_line: list[int]
    pair_qidx: list[int]  # index of the question among its document's questions in this file
    instructions: list[str]
    answers: list[str]


def _parse_file(path: Path) -> _Parsed:
    """Read one task file; malformed lines raise :class:`WorkloadError` with ``path:line``."""
    parsed = _Parsed([], [], [], [], [], [])
    doc_index: dict[str, int] = {}
    seen_pairs: set[tuple[int, str]] = set()
    per_doc: list[int] = []
    for lineno, item in iter_jsonl_objects(path):
        where = f"{path}:{lineno}"
        doc, instructions, outputs = (item.get(k) for k in ("input", "instructions", "outputs"))
        if not isinstance(doc, str) or not doc:
            raise WorkloadError(f"{where}: `input` must be a non-empty string")
        if not isinstance(instructions, list) or not all(
            isinstance(q, str) for q in instructions
        ):
            raise WorkloadError(f"{where}: `instructions` must be a list of strings")
        if not isinstance(outputs, list) or not all(isinstance(a, str) for a in outputs):
            raise WorkloadError(f"{where}: `outputs` must be a list of strings")
        if len(instructions) != len(outputs):
            raise WorkloadError(
                f"{where}: {len(instructions)} instructions but {len(outputs)} outputs"
            )
        d = doc_index.get(doc)
        if d is None:
            d = doc_index[doc] = len(parsed.docs)
            parsed.docs.append(doc)
            per_doc.append(0)
        for question, answer in zip(instructions, outputs, strict=True):
            if (d, question) in seen_pairs:
                continue
            seen_pairs.add((d, question))
            parsed.pair_doc.append(d)
            parsed.pair_line.append(lineno)
            parsed.pair_qidx.append(per_doc[d])
            per_doc[d] += 1
            parsed.instructions.append(question)
            parsed.answers.append(answer)
    return parsed


def _concat(arrays: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([a.size for a in arrays])
    flat = np.concatenate(arrays).astype(np.int32) if arrays else np.zeros(0, np.int32)
    return flat, offsets


def _split(flat: np.ndarray, offsets: np.ndarray) -> list[np.ndarray]:
    return [flat[offsets[i] : offsets[i + 1]] for i in range(offsets.size - 1)]


def _tokenize_file(path: Path, tokenizer: Tokenizer, template: str) -> dict[str, np.ndarray]:
    parsed = _parse_file(path)
    doc_tok, doc_off = _concat(encode_batch_ids(tokenizer, parsed.docs))
    prompts = [template.format(instruction=q) for q in parsed.instructions]
    instr_tok, instr_off = _concat(encode_batch_ids(tokenizer, prompts))
    answer_len = np.array(
        [ids.size for ids in encode_batch_ids(tokenizer, parsed.answers)], dtype=np.int64
    )
    return {
        "doc_hash": np.array([_text_hash(d) for d in parsed.docs], dtype="U64"),
        "doc_tok": doc_tok,
        "doc_off": doc_off,
        "pair_doc": np.array(parsed.pair_doc, dtype=np.int64),
        "pair_line": np.array(parsed.pair_line, dtype=np.int64),
        "pair_qidx": np.array(parsed.pair_qidx, dtype=np.int64),
        "instr_hash": np.array([_text_hash(q) for q in parsed.instructions], dtype="U64"),
        "instr_tok": instr_tok,
        "instr_off": instr_off,
        "answer_len": answer_len,
    }


def _consistent(a: dict[str, np.ndarray]) -> bool:
    """A cache entry's arrays agree with each other (guards against stale/corrupt entries)."""
    try:
        n_docs, n_pairs = a["doc_hash"].size, a["pair_doc"].size
        return (
            a["doc_off"].size == n_docs + 1
            and a["instr_off"].size == n_pairs + 1
            and a["doc_off"][-1] == a["doc_tok"].size
            and a["instr_off"][-1] == a["instr_tok"].size
            and all(
                a[k].size == n_pairs for k in ("pair_line", "pair_qidx", "instr_hash", "answer_len")
            )
            and (n_pairs == 0 or (0 <= a["pair_doc"].min() and a["pair_doc"].max() < n_docs))
        )
    except (KeyError, IndexError, ValueError):
        return False


def _file_tokens(
    path: Path, tokenizer: Tokenizer, template: str, tok_fp: str, use_cache: bool
) -> dict[str, np.ndarray]:
    if not use_cache:
        return _tokenize_file(path, tokenizer, template)
    key = cache_key(
        version=_CACHE_VERSION, file=file_sha256(path), tokenizer=tok_fp, template=template
    )
    entry = cache_dir("leval") / f"{path.stem}-{key[:24]}.npz"
    arrays = load_arrays(entry, _CACHE_ARRAYS)
    if arrays is None or not _consistent(arrays):
        arrays = _tokenize_file(path, tokenizer, template)
        save_arrays(entry, arrays)
    return arrays


@dataclass
class _Question:
    task: str
    path: Path
    line: int
    request_id: str
    instruction: np.ndarray
    answer_tokens: int


def load_leval(
    data_dir: str | os.PathLike[str] | None = None,
    tokenizer: Tokenizer | None = None,
    *,
    tasks: Sequence[str] | str | None = None,
    max_prompt_tokens: int | None = 16384,
    max_output_tokens: int | None = 512,
    overflow: str = "truncate",
    instruction_template: str = DEFAULT_INSTRUCTION_TEMPLATE,
    output: str = "answer",
    add_bos: bool = True,
    cache: bool = True,
) -> Workload:
    """Load L-Eval as a :class:`Workload` (see the module docstring for the request format).

    Args:
        data_dir: the L-Eval folder or the data root holding ``leval/`` (default: see
            :func:`~feather_env.workloads.datadir.resolve_data_dir`).
        tokenizer: default the bundled one (:func:`load_tokenizer`).
        tasks: task names (file stems such as ``"sci_fi"``); ``None`` = all 15 files.
        max_prompt_tokens: prompt cap (``None``: no cap).
        max_output_tokens: output cap (``None``: the answer's length).
        overflow: ``"truncate"`` the document or raise (``"error"``) for a too-long prompt.
        instruction_template: format string with ``{instruction}``, appended after the document.
        output: ``"answer"`` (reference answer length) or ``"max"`` (``max_output_tokens`` each).
        add_bos: start every prompt with ``<s>`` (id 1), as a Llama tokenizer does.
        cache: use the on-disk token cache.

    Request ids are ``leval/TASK/dD/qQ`` (D: the document's index in its file, Q: the
    question's index on that document), stable whatever tasks are selected.
    """
    if overflow not in OVERFLOW_MODES:
        raise WorkloadError(f"overflow must be one of {OVERFLOW_MODES}, got {overflow!r}")
    if "{instruction}" not in instruction_template:
        raise WorkloadError(
            f"instruction_template must contain '{{instruction}}', got {instruction_template!r}"
        )
    try:
        instruction_template.format(instruction="")
    except (KeyError, IndexError, ValueError) as exc:
        raise WorkloadError(
            f"instruction_template {instruction_template!r} is not a valid format string "
            f"with only {{instruction}} ({exc!r}); write literal braces as {{{{ }}}}"
        ) from None
    if output not in OUTPUT_MODES:
        raise WorkloadError(f"output must be one of {OUTPUT_MODES}, got {output!r}")
    if output == "max" and max_output_tokens is None:
        raise WorkloadError('output="max" needs max_output_tokens (the fixed output length)')
    if max_prompt_tokens is not None and max_prompt_tokens < 2:
        raise WorkloadError(f"max_prompt_tokens must be >= 2 or None, got {max_prompt_tokens}")
    if max_output_tokens is not None and max_output_tokens < 1:
        raise WorkloadError(f"max_output_tokens must be >= 1 or None, got {max_output_tokens}")
    leval_dir = resolve_data_dir(data_dir, "leval")
    files = _select_tasks(leval_dir, tasks)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer()
    tok_fp = tokenizer_fingerprint(tokenizer)

    # Merge files: one group per unique document text, questions deduplicated per document.
    group_of: dict[str, int] = {}
    group_docs: list[np.ndarray] = []
    group_questions: list[list[_Question]] = []
    seen_pairs: set[tuple[str, str]] = set()
    for task, path in files.items():
        a = _file_tokens(path, tokenizer, instruction_template, tok_fp, cache)
        docs = _split(a["doc_tok"], a["doc_off"])
        instrs = _split(a["instr_tok"], a["instr_off"])
        for p in range(a["pair_doc"].size):
            d = int(a["pair_doc"][p])
            doc_hash, instr_hash = str(a["doc_hash"][d]), str(a["instr_hash"][p])
            if (doc_hash, instr_hash) in seen_pairs:
                continue
            seen_pairs.add((doc_hash, instr_hash))
            g = group_of.get(doc_hash)
            if g is None:
                g = group_of[doc_hash] = len(group_docs)
                group_docs.append(docs[d])
                group_questions.append([])
            group_questions[g].append(
                _Question(
                    task,
                    path,
                    int(a["pair_line"][p]),
                    f"leval/{task}/d{d}/q{int(a['pair_qidx'][p])}",
                    instrs[p],
                    int(a["answer_len"][p]),
                )
            )

    prefix = np.array([BOS_ID] if add_bos else [], dtype=np.int32)
    requests: list[Request] = []
    for g, (doc, questions) in enumerate(zip(group_docs, group_questions, strict=True)):
        longest = max(questions, key=lambda q: q.instruction.size)
        keep = doc.size
        if max_prompt_tokens is not None:
            room = max_prompt_tokens - prefix.size - longest.instruction.size
            if doc.size > room:
                total = prefix.size + doc.size + longest.instruction.size
                if overflow == "error":
                    raise WorkloadError(
                        f"L-Eval request {longest.request_id} ({longest.path}:{longest.line}) "
                        f"has {total} prompt tokens (document {doc.size}, instruction "
                        f"{longest.instruction.size}) > max_prompt_tokens={max_prompt_tokens}; "
                        f'use overflow="truncate" or raise max_prompt_tokens'
                    )
                if room < 1:
                    raise WorkloadError(
                        f"L-Eval request {longest.request_id} ({longest.path}:{longest.line}): "
                        f"its instruction alone has {longest.instruction.size} tokens, leaving "
                        f"no room for the document under max_prompt_tokens={max_prompt_tokens}"
                    )
                keep = room
        shared = np.concatenate([prefix, doc[:keep]])
        for q in questions:
            output_len = max(1, q.answer_tokens)
            if output == "max" and max_output_tokens is not None:
                output_len = max_output_tokens
            elif max_output_tokens is not None:
                output_len = min(output_len, max_output_tokens)
            requests.append(
                Request(
                    request_id=q.request_id,
                    prompt_token_ids=np.concatenate([shared, q.instruction]),
                    prefix_group=g,
                    output_len=output_len,
                    source=f"leval/{q.task}",
                    meta={
                        "task": q.task,
                        "line": q.line,
                        "document_tokens": int(keep),
                        "document_tokens_full": int(doc.size),
                        "truncated": bool(keep < doc.size),
                        "instruction_tokens": int(q.instruction.size),
                        "answer_tokens": q.answer_tokens,
                    },
                )
            )
    if not requests:
        raise WorkloadError(
            f"L-Eval: tasks {sorted(files)} in {leval_dir} produced no requests "
            "(no lines with instructions)"
        )
    name = "leval" if tasks is None else "leval[" + ",".join(files) + "]"
    return Workload(name, tuple(requests))
