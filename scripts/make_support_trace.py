"""Write a support-chatbot trace: one shared system prompt, a few knowledge-base documents, timestamps.

    python scripts/make_support_trace.py --out support.jsonl [--requests 120] [--documents 12]
                                         [--rate 3.0] [--doc-words 5000] [--seed 0]

Every request is a chat (``messages``): the system prompt every conversation shares, then a user
turn that quotes one knowledge-base article (drawn with a popularity skew: a few articles are asked
about most) and asks a question about it. ``output_tokens`` is the answer's length and
``timestamp`` its arrival (exponential gaps scaled to a mean rate of exactly ``--rate``
requests/s, the first at 0). The text is
made up, word by word, from a seeded generator, so the same arguments write the same file; the
requests share exactly what such a chatbot's share (the system prompt, the article), nothing else.
With the defaults it is the trace of ``docs/workloads.md`` (120 requests, 12 articles of about 6,500
tokens, 3 requests/s: more than the engine serves when it prefills every article again);
``tests/data/support-small.jsonl``, which ``make test`` runs the walkthrough on, is ``--requests 24
--documents 4 --doc-words 400 --output-tokens 8:24 --rate 20``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

WORDS = (
    "account access adapter admin alert app archive backup balance battery billing browser cable "
    "cache calendar card cart charge checkout client cloud code config connection contract credit "
    "customer dashboard data database delivery device discount display domain download driver email "
    "error export feature file filter firmware folder form gateway guest hardware history import "
    "install invoice key laptop license link login mailbox meeting member message modem monitor "
    "network notification order package password payment permission phone plan policy port printer "
    "profile receipt record refund region report request reset router schedule screen server service "
    "session setting setup shipment signal software storage subscription support sync system tablet "
    "team ticket token transfer update upgrade upload user version video wallet warranty website "
    "window workspace"
).split()
VERBS = ("open", "reset", "update", "restore", "connect", "cancel", "renew", "export", "verify", "install",
         "remove", "change", "share", "transfer", "recover", "configure", "sync", "download", "upgrade")
FILLER = ("the", "a", "your", "this", "each", "any", "our", "when", "if", "then", "after", "before", "with",
          "without", "from", "to", "for", "on", "in", "is", "are", "can", "will", "should", "must", "may")
PROBLEMS = ("it shows an error", "nothing happens", "the page keeps loading", "I get logged out",
            "the total looks wrong", "it says access denied", "the light keeps blinking",
            "it worked yesterday", "the code expired", "the app crashes")


def _sentence(rng: np.random.Generator, n: int) -> str:
    words = [str(rng.choice(FILLER)) if rng.random() < 0.4 else str(rng.choice(WORDS)) for _ in range(n)]
    return words[0].capitalize() + " " + " ".join(words[1:]) + "."


def _paragraphs(rng: np.random.Generator, words: int) -> str:
    out, total = [], 0
    while total < words:
        para = [_sentence(rng, int(rng.integers(8, 20))) for _ in range(int(rng.integers(3, 7)))]
        total += sum(len(s.split()) for s in para)
        out.append(" ".join(para))
    return "\n\n".join(out)


def make_trace(requests: int, documents: int, rate: float, doc_words: int, output_tokens: tuple[int, int],
               seed: int) -> list[dict]:
    """The trace's rows (see the module docstring), deterministic for the arguments."""
    rng = np.random.default_rng(seed)
    system = ("You are the support assistant of Acme Cloud. Answer the customer's question using only the "
              "knowledge-base article quoted in the message. Be brief, polite and precise; give numbered "
              "steps when the customer must do something, and say so when the article does not answer the "
              "question. " + _paragraphs(rng, 120))
    docs = []
    for d in range(documents):
        topic = f"{rng.choice(VERBS)} {rng.choice(WORDS)}"
        body = _paragraphs(rng, int(doc_words * rng.uniform(0.8, 1.2)))
        docs.append(f"Knowledge-base article KB-{1000 + d}: how to {topic}\n\n{body}")
    popularity = 1.0 / np.arange(1, documents + 1) ** 0.7
    popularity /= popularity.sum()
    times = np.concatenate([[0.0], np.cumsum(rng.exponential(1.0 / rate, size=requests - 1))])
    if requests > 1:  # Poisson gaps, scaled so the mean rate is exactly ``rate``
        times *= (requests - 1) / rate / times[-1]
    lo, hi = output_tokens
    rows = []
    for i in range(requests):
        d = int(rng.choice(documents, p=popularity))
        question = (f"I tried to {rng.choice(VERBS)} my {rng.choice(WORDS)} but {rng.choice(PROBLEMS)}. "
                    f"{_sentence(rng, int(rng.integers(6, 14)))} What should I do?")
        rows.append({
            "request_id": f"support-{i:04d}",
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": f"Article:\n{docs[d]}\n\nQuestion: {question}"}],
            "output_tokens": int(rng.integers(lo, hi + 1)),
            "timestamp": round(float(times[i]), 3),
            "source": f"support/kb-{1000 + d}",
        })
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="the JSON-lines file to write")
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--documents", type=int, default=12)
    p.add_argument("--rate", type=float, default=3.0, help="mean arrivals per second (Poisson)")
    p.add_argument("--doc-words", type=int, default=5000, help="words per article (+-20%%)")
    p.add_argument("--output-tokens", default="32:160", help="LO:HI, each answer's length uniformly in it")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        lo, hi = (int(v) for v in args.output_tokens.split(":"))
    except ValueError:
        p.error(f"--output-tokens must be LO:HI, got {args.output_tokens!r}")
    if not (args.requests >= 1 and args.documents >= 1 and args.rate > 0 and args.doc_words >= 1
            and 1 <= lo <= hi and args.seed >= 0):
        p.error("--requests, --documents, --doc-words, --output-tokens must be >= 1, --rate > 0, --seed >= 0")
    rows = make_trace(args.requests, args.documents, args.rate, args.doc_words, (lo, hi), args.seed)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    span = rows[-1]["timestamp"]
    print(f"wrote {out}: {len(rows)} requests, {args.documents} articles, over {span:.1f} s "
          f"({(len(rows) - 1) / span if span else 0:.2f} requests/s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
