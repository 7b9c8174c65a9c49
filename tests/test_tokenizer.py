"""The bundled tokenizer: its files, special ids, lossless round trip, deterministic training."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from feather_env.workloads import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    count_tokens,
    encode_batch_ids,
    load_tokenizer,
    tokenizer_fingerprint,
)
from feather_env.workloads.tokenizer import DEFAULT_MODEL_DIR

REPO = Path(__file__).resolve().parents[1]


def _train_module():
    spec = importlib.util.spec_from_file_location(
        "train_tokenizer", REPO / "scripts" / "train_tokenizer.py"
    )
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def test_bundled_files_match_the_model_config() -> None:
    model_cfg = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    tok_cfg = json.loads((DEFAULT_MODEL_DIR / "tokenizer_config.json").read_text())
    tok = load_tokenizer()
    assert tok.get_vocab_size() == model_cfg["vocab_size"] == 8192
    assert (PAD_ID, BOS_ID, EOS_ID) == (
        model_cfg["pad_token_id"],
        model_cfg["bos_token_id"],
        model_cfg["eos_token_id"],
    )
    for token, token_id in (("<pad>", PAD_ID), ("<s>", BOS_ID), ("</s>", EOS_ID)):
        assert tok.token_to_id(token) == token_id
    assert tok_cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (tok_cfg["bos_token"], tok_cfg["eos_token"], tok_cfg["pad_token"]) == (
        "<s>",
        "</s>",
        "<pad>",
    )
    assert tok_cfg["model_max_length"] == model_cfg["max_position_embeddings"] == 65536


def test_load_tokenizer_is_cached_and_missing_dir_is_clear(tmp_path: Path) -> None:
    assert load_tokenizer() is load_tokenizer(DEFAULT_MODEL_DIR)
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path)


def test_round_trip_is_lossless_and_bos_is_added() -> None:
    tok = load_tokenizer()
    text = "The contract's term is 36 months.\n\tCafé, naïve, 中文, emoji 🙂 and code: x[i] += 1"
    with_special = tok.encode(text)
    assert with_special.ids[0] == BOS_ID
    plain = tok.encode(text, add_special_tokens=False).ids
    assert min(plain) >= 3
    assert tok.decode(plain) == text
    # English prose compresses like a real BPE (several characters per token).
    prose = "The quick brown fox jumps over the lazy dog near the river bank. " * 20
    assert len(prose) / len(tok.encode(prose, add_special_tokens=False).ids) > 3.0


def test_batch_helpers_agree_with_single_encode() -> None:
    tok = load_tokenizer()
    texts = ["first text", "", "a much longer second text with more words in it"] * 200
    ids = encode_batch_ids(tok, texts)
    assert len(ids) == len(texts)
    assert all(a.dtype == np.int32 for a in ids)
    for text, a in zip(texts[:3], ids[:3], strict=True):
        assert a.tolist() == tok.encode(text, add_special_tokens=False).ids
    np.testing.assert_array_equal(count_tokens(tok, texts), [a.size for a in ids])
    assert len(tokenizer_fingerprint(tok)) == 64


def test_training_is_deterministic_on_a_small_corpus() -> None:
    train = _train_module().train
    corpus = [
        f"document {i}: " + "shared prefix tokens and some words " * (i % 7 + 1) for i in range(300)
    ]
    a, b = train(corpus, vocab_size=300), train(corpus, vocab_size=300)
    digest = [hashlib.sha256(t.to_str().encode()).hexdigest() for t in (a, b)]
    assert digest[0] == digest[1]
    assert a.get_vocab_size() == 300
    assert [a.token_to_id(t) for t in ("<pad>", "<s>", "</s>")] == [0, 1, 2]
