"""A replica killed during a 200-request run: what each request got, and how long until it serves again.

    flock /tmp/feather-engine.lock python -m benchmarks.cluster_faults --json results/cluster_faults.json

``feather-serve --replicas 2 --router prefix`` serves 200 streamed completions (12 documents of
1,500 tokens, a short question each, 32 output tokens, at most 16 in flight). When a quarter of them
have been answered, the process of the replica of rank 0 gets SIGKILL (its vLLM engine core dies
with it). Each request's outcome, as the client sees it:

* ``completed``: HTTP 200, a stream ending with ``[DONE]``, exactly its 32 tokens;
* ``retried``: completed after one retry on the other replica (``x-feather-attempts: 2``: the killed
  replica had not streamed anything yet);
* ``error_before_answer``: HTTP 503 with vLLM's error body (the retry failed too);
* ``error_mid_stream``: the stream ends with an SSE ``error`` event (tokens had already been sent).

Then: the seconds from the kill until ``/health`` counts 2 healthy replicas again, and until a
request is answered by the new replica of rank 0 (probes every half second). Nothing is served
twice: on each live replica, the completions vLLM counts (``vllm:request_success_total``) equal the
completions the client received from it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import measured
from benchmarks.cluster_loopback import per_replica
from benchmarks.cluster_server import ClusterServer
from feather_env.reporting import format_table, machine_info, write_json
from scheduler_runtime.sse import SSE_DONE, sse_events

SERVER_ARGS = ["--kv-cache-memory-bytes", str(256 << 20), "--max-model-len", "2048", "--max-num-seqs", "32",
               "--max-num-batched-tokens", "4096"]
REQUESTS, DOCUMENTS, DOC_TOKENS, OUTPUT_TOKENS, CONCURRENCY = 200, 12, 1500, 32, 16
KILL_AFTER = REQUESTS // 4
COMMAND = ("flock /tmp/feather-engine.lock python -m benchmarks.cluster_faults "
           "--json results/cluster_faults.json")


async def stream_one(session: Any, url: str, prompt: list[int]) -> dict[str, Any]:
    """One streamed completion: its outcome (module docstring), replica and attempts."""
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": OUTPUT_TOKENS, "min_tokens": OUTPUT_TOKENS,
            "ignore_eos": True, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    out: dict[str, Any] = {"replica": None, "attempts": None, "tokens": 0, "outcome": "other"}
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            out["replica"] = resp.headers.get("x-feather-replica")
            out["attempts"] = int(resp.headers.get("x-feather-attempts", "0") or 0)
            if resp.status != 200:
                out["outcome"] = "error_before_answer" if resp.status == 503 else f"http_{resp.status}"
                out["message"] = (await resp.text())[:300]
                return out
            done, error = False, None
            async for event in sse_events(resp.content):
                if event is SSE_DONE:
                    done = True
                    break
                if "error" in event:
                    error = event["error"]["message"]
                elif event.get("usage"):
                    out["tokens"] = event["usage"]["completion_tokens"]
            if error is not None:
                out["outcome"], out["message"] = "error_mid_stream", error[:300]
            elif done and out["tokens"] == OUTPUT_TOKENS:
                out["outcome"] = "retried" if out["attempts"] == 2 else "completed"
    except Exception as exc:  # noqa: BLE001 - a dropped connection is an outcome too
        out["outcome"], out["message"] = "connection_error", repr(exc)[:300]
    return out


async def run(server: ClusterServer, seed: int) -> dict[str, Any]:
    import aiohttp

    rng = np.random.default_rng(seed)
    docs = [rng.integers(3, 8000, DOC_TOKENS).tolist() for _ in range(DOCUMENTS)]
    prompts = [docs[int(rng.integers(DOCUMENTS))] + rng.integers(3, 8000, 8).tolist()
               for _ in range(REQUESTS)]
    victim = next(r for r in server.replica_info() if r["rank"] == 0)
    semaphore = asyncio.Semaphore(CONCURRENCY)
    answered = 0
    killed = asyncio.Event()
    kill_time: list[float] = []

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def one(prompt: list[int]) -> dict[str, Any]:
            nonlocal answered
            async with semaphore:
                result = await stream_one(session, server.url, prompt)
            answered += 1
            if answered >= KILL_AFTER and not killed.is_set():
                killed.set()
                os.kill(victim["pid"], signal.SIGKILL)
                kill_time.append(time.monotonic())
            return result

        t0 = time.monotonic()
        results = await asyncio.gather(*(one(p) for p in prompts))
        run_s = time.monotonic() - t0
        # until the new replica of rank 0 answers
        await asyncio.to_thread(server.wait_healthy, 2, 600.0)
        healthy_s = time.monotonic() - kill_time[0]
        probes = []
        served_again_s = None
        while time.monotonic() - kill_time[0] < 900:
            probe = await stream_one(session, server.url, rng.integers(3, 8000, 600).tolist())
            probes.append(probe)
            if probe["outcome"] == "completed" and (probe["replica"] or "").startswith("0/") \
                    and probe["replica"] != f"0/{victim['replica_id']}":
                served_again_s = time.monotonic() - kill_time[0]
                break
            await asyncio.sleep(0.5)
    return {"results": results, "probes": probes, "victim": victim, "run_s": run_s,
            "healthy_again_s": healthy_s, "served_again_s": served_again_s}


def render(res: dict[str, Any]) -> str:
    """The figures in markdown: what the requests got, when the replica served again, the ledger."""
    s = res["summary"]
    rows = [["completed with their tokens", s["completed"]], ["... of them after one retry", s["retried"]],
            ["clear error before any token (HTTP 503)", s["error_before_answer"]],
            ["clear error mid-stream (SSE error event)", s["error_mid_stream"]],
            ["anything else", s["other"]],
            ["completed by the killed replica before it died", s["completed_by_killed_replica"]],
            ["seconds from the kill until 2 replicas are healthy", s["healthy_again_s"]],
            ["seconds from the kill until the new replica answers", s["served_again_s"]]]
    ledger = [[k, v["vllm_counted"], v["client_received"]] for k, v in res["ledger"].items()]
    return "\n".join([
        f"`feather-serve --replicas 2 --router prefix`, {s['requests']} streamed requests "
        f"({res['documents']} documents of {res['doc_tokens']} tokens, {res['output_tokens']} output tokens, "
        f"{res['concurrency']} in flight); the replica of rank 0 gets SIGKILL after "
        f"{res['kill_after_answered']} answers ({measured(res)}; `{res['command']}`):", "",
        format_table(["request outcome", "count or seconds"], rows), "",
        f"None served twice: {'yes' if s['none_served_twice'] else 'NO'} (each live replica's vLLM count of "
        "completions equals what the client received from it):", "",
        format_table(["live replica", "completions vLLM counted", "completions the client received"],
                     ledger)])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/cluster-faults")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    with ClusterServer(2, "prefix", SERVER_ARGS, log_path=Path(args.out) / "server.log") as server:
        measured = asyncio.run(run(server, args.seed))
        text = server.metrics()
        replicas_after = server.replica_info()
        stop = server.stop()
    results, probes = measured["results"], measured["probes"]
    outcomes = Counter(r["outcome"] for r in results)
    # none served twice: each live replica counted exactly the completions the client got from it
    counted = per_replica(text, "vllm:request_success_total")
    received = Counter(r["replica"] for r in [*results, *probes] if r["outcome"] in ("completed", "retried"))
    live = {str(r["rank"]): f"{r['rank']}/{r['replica_id']}" for r in replicas_after}
    ledger = {rank: {"vllm_counted": counted.get(rank, 0.0), "client_received": received.get(key, 0)}
              for rank, key in live.items()}
    none_twice = all(v["vllm_counted"] == v["client_received"] for v in ledger.values())
    killed_key = f"0/{measured['victim']['replica_id']}"
    summary = {
        "requests": len(results), "completed": outcomes["completed"] + outcomes["retried"],
        "completed_first_try": outcomes["completed"], "retried": outcomes["retried"],
        "error_before_answer": outcomes["error_before_answer"],
        "error_mid_stream": outcomes["error_mid_stream"],
        "other": sum(v for k, v in outcomes.items()
                     if k not in ("completed", "retried", "error_before_answer", "error_mid_stream")),
        "completed_by_killed_replica": received.get(killed_key, 0),
        "healthy_again_s": measured["healthy_again_s"], "served_again_s": measured["served_again_s"],
        "none_served_twice": none_twice,
    }
    out = {"benchmark": "cluster_faults", "command": COMMAND, "machine": machine_info(),
           "server_args": SERVER_ARGS, "requests": REQUESTS, "documents": DOCUMENTS, "doc_tokens": DOC_TOKENS,
           "output_tokens": OUTPUT_TOKENS, "concurrency": CONCURRENCY, "kill_after_answered": KILL_AFTER,
           "summary": summary, "ledger": ledger,
           "victim": measured["victim"], "replicas_after": replicas_after, "run_s": measured["run_s"],
           "errors": [r for r in results if r["outcome"] not in ("completed", "retried")],
           "sigterm": stop}
    print(render(out))
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
