"""A workload as the JSON lines ``vllm bench serve --dataset-name custom`` reads, for vLLM's own tool.

vLLM's ``CustomDataset`` (``vllm/benchmarks/datasets/datasets.py``) reads one JSON object per line
with a text ``prompt`` (it tokenizes it to count the prompt, and by default wraps it in the model's
chat template: pass ``--skip-chat-template``) and an integer ``output_tokens``; other fields are
ignored. Our prompts are token ids, so each is decoded to text with the workload's tokenizer (the
bundled one by default), without the leading ``<s>``: the server's tokenizer adds it back. Every
line also carries ``request_id``, ``source``, ``prefix_group`` and ``arrival_time`` (vLLM ignores
them; its own ``--request-rate`` sets the arrivals).

Re-encoding the decoded text gives back our token ids for text workloads (L-Eval), up to a few
tokens where a document was cut or meets its question; for workloads of random token ids
(LongBench lengths, traces, synthetic) the text re-encodes to a different length. :func:`export_jsonl`
measures that drift and reports it (:class:`ExportSummary`), so a replay's lengths are known.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from feather_env.workloads.tokenizer import BOS_ID, load_tokenizer
from feather_env.workloads.workload import Workload

__all__ = ["ExportSummary", "export_jsonl"]


@dataclass(frozen=True)
class ExportSummary:
    """What was written, and how far re-encoding the text moves the prompt lengths (tokens)."""

    path: str
    requests: int
    prompt_tokens: int
    output_tokens: int
    reencoded_prompt_tokens: int
    max_length_drift: int
    exact_prompts: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def export_jsonl(workload: Workload, path: str | Path, tokenizer: Any = None) -> ExportSummary:
    """Write ``workload`` to ``path`` in ``CustomDataset``'s format (module docstring), in queue order."""
    tok = tokenizer if tokenizer is not None else load_tokenizer()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    drift: list[int] = []
    exact = 0
    reencoded = 0
    with path.open("w", encoding="utf-8") as fh:
        for r in workload:
            ids = [int(t) for t in r.prompt_token_ids]
            body = ids[1:] if ids and ids[0] == BOS_ID else ids
            text = tok.decode(body, skip_special_tokens=True)
            again = tok.encode(text, add_special_tokens=True).ids  # what the server will count
            reencoded += len(again)
            drift.append(abs(len(again) - len(ids)))
            exact += int(list(again) == ids)
            line = {"prompt": text, "output_tokens": int(r.output_len), "request_id": r.request_id,
                    "source": r.source, "prefix_group": int(r.prefix_group),
                    "arrival_time": float(r.arrival_time)}
            fh.write(json.dumps(line, ensure_ascii=False) + "\n")
    return ExportSummary(str(path), len(workload), int(sum(r.prompt_len for r in workload)),
                         int(sum(r.output_len for r in workload)), reencoded,
                         int(np.max(drift)) if drift else 0, exact)
