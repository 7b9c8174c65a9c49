"""LongBench as a workload of per-request lengths with synthetic token content.

The LongBench release keeps its texts on a model hub; the data folder holds only
``lengths/TASK.jsonl`` (one line per item: ``length`` of the context in words, or in
characters for the Chinese tasks, and the reference ``answers``) and
``config/dataset2maxlen.json`` (the official max new tokens per task). A request's prompt is
therefore synthetic: random token ids (>= 3, seeded) of the item's length in tokens.

Length conversion (words or characters -> tokens):

- English and code tasks: ``tokens = round(words * tokens_per_word)``, default **1.3**. A
  Llama-2-sized BPE vocabulary (32k) encodes English prose at about 0.75 words per token, the
  usual rule of thumb (~1.3 tokens per word); the vidur traces that this toolkit also replays
  are counted in Llama-2 tokens, so 1.3 keeps the two comparable. The bundled 8k-token
  tokenizer is coarser: it measures 1.49 tokens per whitespace word on L-Eval documents (4.0
  characters per token). Code has more tokens per whitespace word than prose; one factor is
  kept for all English tasks for simplicity.
- Chinese tasks (dureader, multifieldqa_zh, vcsum, lsht, passage_retrieval_zh):
  ``tokens = round(chars * tokens_per_char_zh)``, default **1.0**: an assumed middle value
  between tokenizers with a Chinese vocabulary (fewer than one token per character) and
  Llama-2's byte fallback (more than one); it is not measured here.

Output length: ``output="answer"`` uses the tokens of the reference answer ``answers[0]``
(encoded with ``tokenizer`` when one is given, for the English tasks; otherwise, and always
for the Chinese tasks, where an English-trained BPE would fall back to bytes, the same
factors as the prompt), at least 1 and at most the task's max new tokens;
``output="max"`` uses exactly the task's max new tokens (what a benchmark run that never
stops early would generate).

Sharing: LongBench does not record which items share a context, so by default
(``group_size=1``) every item is its own prefix group with no sharing. ``group_size=k > 1``
turns each run of ``k`` consecutive items of a task into one shared context: the group's
context has the mean context length of its items and is the common prefix of all of them;
each item appends its own ``question_tokens`` unique tokens (a question) after it.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from feather_env.workloads.datadir import DataNotFoundError, require_file, resolve_data_dir
from feather_env.workloads.request import Request
from feather_env.workloads.synthetic import random_tokens
from feather_env.workloads.tokenizer import count_tokens
from feather_env.workloads.workload import Workload, WorkloadError, iter_jsonl_objects, not_utf8

ZH_TASKS = frozenset({"dureader", "multifieldqa_zh", "vcsum", "lsht", "passage_retrieval_zh"})
OUTPUT_MODES = ("answer", "max")
OVERFLOW_MODES = ("truncate", "error")


def longbench_task_files(longbench_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """``{task: path}`` of every ``lengths/*.jsonl``, sorted by name."""
    return {p.stem: p for p in sorted((Path(longbench_dir) / "lengths").glob("*.jsonl"))}


def read_max_new_tokens(longbench_dir: str | os.PathLike[str]) -> dict[str, int]:
    """The official max new tokens per task (``config/dataset2maxlen.json``)."""
    path = require_file(Path(longbench_dir) / "config" / "dataset2maxlen.json", "longbench")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise not_utf8(path, exc) from None
    except json.JSONDecodeError as exc:
        raise WorkloadError(f"{path}:{exc.lineno}: malformed JSON: {exc.msg}") from None
    if not isinstance(data, dict) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in data.values()
    ):
        raise WorkloadError(f"{path}: expected an object of task -> positive int")
    return data


def read_lengths(path: str | os.PathLike[str]) -> list[tuple[int, str, int]]:
    """``(length, answers[0], line)`` per item of a ``lengths/TASK.jsonl`` file."""
    path = require_file(path, "longbench")
    items: list[tuple[int, str, int]] = []
    for lineno, item in iter_jsonl_objects(path):
        where = f"{path}:{lineno}"
        length, answers = item.get("length"), item.get("answers")
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise WorkloadError(f"{where}: `length` must be a positive integer, got {length!r}")
        if not isinstance(answers, list) or not answers or not isinstance(answers[0], str):
            raise WorkloadError(f"{where}: `answers` must be a non-empty list of strings")
        items.append((length, answers[0], lineno))
    return items


def _to_tokens(count: float, factor: float) -> int:
    return max(1, round(count * factor))


def load_longbench(
    data_dir: str | os.PathLike[str] | None = None,
    *,
    tasks: Sequence[str] | str | None = None,
    tokenizer: Tokenizer | None = None,
    tokens_per_word: float = 1.3,
    tokens_per_char_zh: float = 1.0,
    output: str = "answer",
    max_output_tokens: int | None = None,
    group_size: int = 1,
    question_tokens: int = 32,
    seed: int = 0,
    max_prompt_tokens: int | None = 16384,
    overflow: str = "truncate",
    vocab_size: int = 8192,
) -> Workload:
    """Load LongBench lengths as a :class:`Workload` (see the module docstring).

    Args:
        data_dir: the LongBench folder or the data root holding ``longbench/``.
        tasks: task names (``"narrativeqa"``, ...); ``None`` = every ``lengths/*.jsonl``.
        tokenizer: encodes English reference answers for ``output="answer"``.
        tokens_per_word, tokens_per_char_zh: length conversion factors (justified above).
        output: ``"answer"`` or ``"max"``.
        max_output_tokens: an extra output cap on top of the task's max new tokens.
        group_size: consecutive items per shared context (1: no sharing).
        question_tokens: unique tokens per item after a shared context (``group_size > 1``).
        seed: seeds the synthetic token content.
        max_prompt_tokens: prompt cap (``None``: no cap); ``overflow`` = ``"truncate"`` cuts
            the context (the shared one, identically for its group), ``"error"`` raises.
        vocab_size: token ids are drawn from ``[3, vocab_size)``.

    Request ids are ``longbench/TASK/I`` (I: the item's index in its file).
    """
    if output not in OUTPUT_MODES:
        raise WorkloadError(f"output must be one of {OUTPUT_MODES}, got {output!r}")
    if overflow not in OVERFLOW_MODES:
        raise WorkloadError(f"overflow must be one of {OVERFLOW_MODES}, got {overflow!r}")
    if group_size < 1:
        raise WorkloadError(f"group_size must be >= 1, got {group_size}")
    if group_size > 1 and question_tokens < 1:
        raise WorkloadError(f"question_tokens must be >= 1, got {question_tokens}")
    if not (tokens_per_word > 0 and tokens_per_char_zh > 0):
        raise WorkloadError("tokens_per_word and tokens_per_char_zh must be > 0")
    suffix = question_tokens if group_size > 1 else 0
    if max_prompt_tokens is not None and max_prompt_tokens < suffix + 1:
        raise WorkloadError(
            f"max_prompt_tokens={max_prompt_tokens} leaves no room for a context "
            f"(question_tokens={suffix})"
        )
    lb_dir = resolve_data_dir(data_dir, "longbench")
    available = longbench_task_files(lb_dir)
    if not available:
        raise DataNotFoundError(f"no LongBench length files (*.jsonl) under {lb_dir / 'lengths'}")
    if tasks is None:
        selected = list(available)
    else:
        selected = [tasks] if isinstance(tasks, str) else list(tasks)
        unknown = [t for t in selected if t not in available]
        if unknown:
            raise WorkloadError(
                f"unknown LongBench task(s) {unknown}; available: {list(available)}"
            )
        if not selected:
            raise WorkloadError("no LongBench tasks selected (tasks=[])")
    max_new = read_max_new_tokens(lb_dir)

    requests: list[Request] = []
    group_id = 0
    for task in selected:
        if task not in max_new:
            raise WorkloadError(
                f"task {task!r} has no entry in {lb_dir}/config/dataset2maxlen.json"
            )
        path = available[task]
        items = read_lengths(path)
        zh = task in ZH_TASKS
        factor = tokens_per_char_zh if zh else tokens_per_word
        contexts = [_to_tokens(length, factor) for length, _, _ in items]
        answers = [a for _, a, _ in items]
        if output == "max":
            outs = [max_new[task]] * len(items)
        else:
            if tokenizer is not None and not zh:
                raw = count_tokens(tokenizer, answers).tolist()
            elif zh:
                raw = [math.ceil(len(a) * factor) for a in answers]
            else:
                raw = [math.ceil(len(a.split()) * factor) for a in answers]
            outs = [min(max(1, n), max_new[task]) for n in raw]
        if max_output_tokens is not None:
            outs = [min(o, max_output_tokens) for o in outs]
        task_key = zlib.crc32(task.encode())
        for start in range(0, len(items), group_size):
            members = range(start, min(start + group_size, len(items)))
            full_len = context_len = round(float(np.mean([contexts[i] for i in members])))
            if max_prompt_tokens is not None and context_len + suffix > max_prompt_tokens:
                if overflow == "error":
                    i = members[0]
                    raise WorkloadError(
                        f"LongBench request longbench/{task}/{i} ({path}:{items[i][2]}) has "
                        f"{context_len + suffix} prompt tokens (length {items[i][0]} x "
                        f"{factor}) > max_prompt_tokens={max_prompt_tokens}"
                    )
                context_len = max_prompt_tokens - suffix
            context = random_tokens(context_len, (seed, task_key, start, 0), vocab_size, group_id)
            for i in members:
                prompt = context
                if suffix:
                    question = random_tokens(suffix, (seed, task_key, i, 1), vocab_size)
                    prompt = np.concatenate([context, question])
                requests.append(
                    Request(
                        request_id=f"longbench/{task}/{i}",
                        prompt_token_ids=prompt,
                        prefix_group=group_id,
                        output_len=outs[i],
                        source=f"longbench/{task}",
                        meta={
                            "task": task,
                            "line": items[i][2],
                            "length": items[i][0],
                            "unit": "chars" if zh else "words",
                            "context_tokens": int(context_len),
                            "truncated": bool(context_len < full_len),
                            "max_new_tokens": max_new[task],
                        },
                    )
                )
            group_id += 1
    if not requests:
        raise WorkloadError(f"LongBench: tasks {selected} in {lb_dir} have no items")
    name = "longbench" if tasks is None else "longbench[" + ",".join(selected) + "]"
    if group_size > 1:
        name += f"/g{group_size}"
    return Workload(name, tuple(requests))
