"""The simulated engine's own speed: shared-document episodes run to completion on SimEngine alone.

    python -m benchmarks.sim_engine_speed [--seeds 5] [--json results/sim_engine_speed.json]

Each episode (:func:`shared_document_episode`) is 128 questions about 16 documents of 6,000 tokens,
with a KV cache that holds 4 (or 16) documents: interleaved (question i asks about document i % 16)
or grouped (each document's questions in a row). It is timed from adding the requests (hashing
their prompts) until the last one finishes, every decode stretch fast-forwarded. Where
``benchmarks.env_speed`` times the whole environment on the simulator, this times the engine model
alone. ``tests/test_sim_engine.py`` runs the same episodes against vLLM's own scheduler.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks import measured
from feather_env.engines.sim_config import SimEngineConfig
from feather_env.engines.sim_engine import SimEngine
from feather_env.reporting import format_table, machine_info, write_json

#: (grouped, documents the KV cache holds): interleaved questions under KV pressure, the same grouped,
#: then grouped with the KV of every document (64 requests run at once).
CASES = ((False, 4), (True, 4), (True, 16))


def shared_document_episode(
    seed: int = 0, num_docs: int = 16, questions_per_doc: int = 8, doc_tokens: int = 6000,
    question_tokens: tuple[int, int] = (20, 80), output_tokens: tuple[int, int] = (20, 60), kv_docs: int = 4,
    max_num_seqs: int = 64, grouped: bool = False,
) -> tuple[SimEngineConfig, list[tuple[str, np.ndarray, int]]]:
    """The performance scenario: (config, [(request id, prompt, output tokens)]).

    Request i asks about document i % num_docs (interleaved) or, with ``grouped``, each
    document's questions come in a row; the KV cache holds ``kv_docs`` documents.
    """
    rng = np.random.default_rng(seed)
    docs = [rng.integers(3, 30000, doc_tokens) for _ in range(num_docs)]
    requests = []
    for i in range(num_docs * questions_per_doc):
        question = rng.integers(3, 30000, int(rng.integers(question_tokens[0], question_tokens[1] + 1)))
        doc = docs[i // questions_per_doc if grouped else i % num_docs]
        requests.append((f"q{i}", np.concatenate([doc, question]),
                         int(rng.integers(output_tokens[0], output_tokens[1] + 1))))
    block_size = 128
    num_blocks = kv_docs * -(-(doc_tokens + question_tokens[1] + output_tokens[1]) // block_size) + 1
    config = SimEngineConfig(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=8192, max_model_len=32768)
    return config, requests


def time_episode(seed: int = 0, grouped: bool = False, kv_docs: int = 4) -> dict[str, float]:
    """Time one :func:`shared_document_episode` run to completion, fast-forwarding every decode stretch.

    ``seconds`` covers adding the 128 requests (hashing their prompts) and running them.
    """
    config, requests = shared_document_episode(seed, grouped=grouped, kv_docs=kv_docs)
    sim = SimEngine(config)
    start = time.perf_counter()
    for rid, prompt, out in requests:
        sim.add_request(rid, prompt, out)
    steps = calls = stretches = 0
    while sim.has_unfinished_requests():
        k = sim.decode_horizon()
        if k > 0:
            steps += sim.advance_decode(k).num_steps
            stretches += 1
        else:
            sim.step()
            steps += 1
        calls += 1
    seconds = time.perf_counter() - start
    queries, hits = sim.prefix_cache_stats
    return {"seconds": seconds, "engine_steps": steps, "calls": calls, "stretches": stretches,
            "hit_rate": hits / queries if queries else 0.0}


def run(seeds: int = 5) -> dict[str, Any]:
    """Every case of :data:`CASES` over episode seeds ``0 .. seeds - 1``."""
    cases = []
    for grouped, kv_docs in CASES:
        episodes = [time_episode(seed, grouped=grouped, kv_docs=kv_docs) for seed in range(seeds)]
        cases.append({"grouped": grouped, "kv_docs": kv_docs, "episodes": episodes,
                      "median_ms": statistics.median(e["seconds"] for e in episodes) * 1e3})
    return {"benchmark": "sim_engine_speed", "machine": machine_info(), "seeds": seeds, "cases": cases}


def render(res: dict[str, Any]) -> str:
    """One row per case: the median episode time and what an episode took (medians over the seeds)."""
    rows = []
    for case in res["cases"]:
        episodes = case["episodes"]
        rows.append(["grouped" if case["grouped"] else "interleaved", case["kv_docs"], case["median_ms"],
                     statistics.median(e["engine_steps"] for e in episodes),
                     statistics.median(e["calls"] for e in episodes),
                     statistics.median(e["stretches"] for e in episodes),
                     f"{statistics.median(e['hit_rate'] for e in episodes):.1%}"])
    return "\n".join([
        f"SimEngine alone on 128-question shared-document episodes, median of {res['seeds']} seeds "
        f"({measured(res)}; `python -m benchmarks.sim_engine_speed`).", "",
        format_table(["documents", "KV holds (documents)", "episode ms", "engine steps", "calls",
                      "decode stretches", "hit rate"], rows)])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=5, help="episodes per case (seeds 0 .. N-1)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    out = run(args.seeds)
    print(render(out))
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
