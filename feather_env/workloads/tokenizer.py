"""The bundled tokenizer (``configs/models/tiny-llama/tokenizer.json``) and batch encoding helpers.

The tokenizer is a byte-level BPE with 8192 tokens trained on L-Eval text by
``scripts/train_tokenizer.py``; ids 0, 1, 2 are ``<pad>``, ``<s>``, ``</s>``, so every content
token id is >= 3 (synthetic workloads draw from the same range).
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from feather_env.workloads.datadir import REPO_ROOT

DEFAULT_MODEL_DIR = REPO_ROOT / "configs" / "models" / "tiny-llama"
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
FIRST_CONTENT_ID = 3
# Batches bound the memory of the Encoding objects (offsets, masks) held at once.
_ENCODE_BATCH = 256


@functools.lru_cache(maxsize=8)
def _load(path: str, mtime_ns: int) -> Tokenizer:
    return Tokenizer.from_file(path)


def load_tokenizer(model_dir: str | os.PathLike[str] | None = None) -> Tokenizer:
    """The ``tokenizer.json`` of ``model_dir`` (default: the bundled tiny-llama), cached.

    Raises :class:`FileNotFoundError` naming the missing file.
    """
    path = Path(model_dir if model_dir is not None else DEFAULT_MODEL_DIR) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"tokenizer not found: {path} does not exist "
            f"(the bundled one is made by `python scripts/train_tokenizer.py`)"
        )
    path = path.resolve()
    return _load(str(path), path.stat().st_mtime_ns)


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """sha256 of the tokenizer's serialized form: a cache key for tokenized data."""
    return hashlib.sha256(tokenizer.to_str().encode()).hexdigest()


def encode_batch_ids(
    tokenizer: Tokenizer, texts: Sequence[str], *, add_special_tokens: bool = False
) -> list[np.ndarray]:
    """Token ids (``np.int32``) of each text, encoded in parallel batches."""
    out: list[np.ndarray] = []
    for start in range(0, len(texts), _ENCODE_BATCH):
        batch = list(texts[start : start + _ENCODE_BATCH])
        for enc in tokenizer.encode_batch(batch, add_special_tokens=add_special_tokens):
            out.append(np.asarray(enc.ids, dtype=np.int32))
    return out


def count_tokens(
    tokenizer: Tokenizer, texts: Sequence[str], *, add_special_tokens: bool = False
) -> np.ndarray:
    """Number of tokens of each text (``np.int64``)."""
    return np.array(
        [
            ids.size
            for ids in encode_batch_ids(tokenizer, texts, add_special_tokens=add_special_tokens)
        ],
        dtype=np.int64,
    )
