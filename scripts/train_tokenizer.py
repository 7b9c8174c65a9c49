"""Train the bundled byte-level BPE tokenizer of ``configs/models/tiny-llama`` on L-Eval text.

The bundled model has random weights, so the tokenizer only has to turn the workload's
text into realistic token sequences (about 4 characters per token on English prose, like
the Llama tokenizers the papers used). It is trained on the L-Eval release itself: every
unique document and every instruction, files in sorted order, documents deduplicated by
text. Training is deterministic: the corpus order is fixed and the BPE trainer runs on one
thread (``RAYON_NUM_THREADS=1``; with tokenizers 0.23 two threads gave the same bytes too);
run it twice and compare the sha256 of the output (the script prints it). The whole corpus
(~12 M characters) trains in a few seconds.

Usage::

    python scripts/train_tokenizer.py [--data-dir ../shared/data] [--out configs/models/tiny-llama]

Writes ``tokenizer.json`` and ``tokenizer_config.json`` (loadable by
``transformers.PreTrainedTokenizerFast`` and vLLM).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from feather_env.workloads.datadir import resolve_data_dir  # noqa: E402

VOCAB_SIZE = 8192
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2 as in config.json
MODEL_MAX_LENGTH = 65536
# None: use whole documents (the full corpus is ~12 M characters and trains in seconds on
# one thread). A number cuts each document to that many characters, deterministically.
MAX_CHARS_PER_DOCUMENT: int | None = None


def leval_texts(
    leval_dir: Path, max_chars_per_document: int | None = MAX_CHARS_PER_DOCUMENT
) -> list[str]:
    """Unique L-Eval documents and instructions, files in sorted order, first occurrence kept."""
    files = sorted(leval_dir.glob("*-tasks/*.jsonl"))
    if not files:
        raise SystemExit(f"no L-Eval *.jsonl files under {leval_dir}")
    seen_docs: set[str] = set()
    seen_instructions: set[str] = set()
    texts: list[str] = []
    for path in files:
        with path.open(encoding="utf-8") as fh:
            for line in fh:
                if not line.strip():
                    continue
                item = json.loads(line)
                doc = item["input"]
                if doc not in seen_docs:
                    seen_docs.add(doc)
                    texts.append(doc[:max_chars_per_document])
                for instruction in item["instructions"]:
                    if instruction not in seen_instructions:
                        seen_instructions.add(instruction)
                        texts.append(instruction)
    return texts


def train(texts: list[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Byte-level BPE; ``<pad>``/``<s>``/``</s>`` at ids 0/1/2; encode prefixes ``<s>``."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    bos = SPECIAL_TOKENS[1]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A",
        pair=f"{bos} $A {bos} $B",
        special_tokens=[(bos, tokenizer.token_to_id(bos))],
    )
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != expected_id:
            raise RuntimeError(
                f"{token} got id {tokenizer.token_to_id(token)}, expected {expected_id}"
            )
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(f"vocab size {tokenizer.get_vocab_size()} != {vocab_size}")
    return tokenizer


def tokenizer_config() -> dict:
    """``tokenizer_config.json`` for ``transformers.PreTrainedTokenizerFast``."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": None,
        "model_max_length": MODEL_MAX_LENGTH,
        "padding_side": "left",
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(i): {
                "content": tok,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, tok in enumerate(SPECIAL_TOKENS)
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--data-dir",
        default=None,
        help="data root holding leval/ (default: $FEATHER_DATA_DIR, else ../shared/data)",
    )
    parser.add_argument("--out", default=str(REPO_ROOT / "configs" / "models" / "tiny-llama"))
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = parser.parse_args(argv)

    start = time.perf_counter()
    texts = leval_texts(resolve_data_dir(args.data_dir, "leval"))
    tokenizer = train(texts, args.vocab_size)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_path = out / "tokenizer.json"
    tokenizer.save(str(tokenizer_path), pretty=False)
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    digest = hashlib.sha256(tokenizer_path.read_bytes()).hexdigest()
    print(
        f"trained on {len(texts)} texts ({sum(map(len, texts)) / 1e6:.1f} M chars) in "
        f"{time.perf_counter() - start:.1f} s; vocab {tokenizer.get_vocab_size()}; "
        f"{tokenizer_path} sha256 {digest}"
    )
    return 0


if __name__ == "__main__":
    # One trainer thread: set before the tokenizers library starts its (lazy) thread pool.
    os.environ["RAYON_NUM_THREADS"] = "1"
    raise SystemExit(main())
