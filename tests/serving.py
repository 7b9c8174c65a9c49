"""Helpers of the server tests: start ``feather-serve`` on a free loopback port, read ``/metrics``.

The server runs as a subprocess with its engine core in a process of its own, as in production
(``VLLM_ENABLE_V1_MULTIPROCESSING`` unset), and its own Prometheus multiprocess directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
START_TIMEOUT_S = 240
#: A small server: 512 MiB of KV cache, short sequences, a modest batch.
SMALL_SERVER = ["--kv-cache-memory-bytes", str(512 << 20), "--max-model-len", "4096",
                "--max-num-seqs", "64", "--max-num-batched-tokens", "4096"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def feather_serve_command() -> list[str]:
    """The installed ``feather-serve`` console script (what a user runs)."""
    script = shutil.which("feather-serve", path=str(Path(sys.executable).parent))
    assert script, "the feather-serve console script is not installed next to this Python"
    return [script]


@contextlib.contextmanager
def running_server(command: Sequence[str], log_path: Path, *, pythonpath: Sequence[Path] = ()
                   ) -> Iterator[tuple[str, subprocess.Popen]]:
    """Start ``command`` (``feather-serve ...`` without ``--port``), wait for ``/health``,
    yield ``(base URL, process)``; the process is killed at exit unless it already stopped."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server's default: engine core in its own process
    if pythonpath:
        paths = [*map(str, pythonpath), *filter(None, [env.get("PYTHONPATH")])]
        env["PYTHONPATH"] = os.pathsep.join(paths)
    with log_path.open("w") as log:
        proc = subprocess.Popen([*command, "--port", str(port)], cwd=REPO, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                get(base + "/health", timeout=2.0)
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"server not up after {START_TIMEOUT_S} s:\n{log_path.read_text()[-4000:]}")
                time.sleep(1.0)
        yield base, proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # only if the test did not stop it cleanly
            proc.wait(timeout=30)


def wait_until_idle(base: str, timeout_s: float = 120.0) -> str:
    """``/metrics`` once vLLM reports no running and no waiting request (a liveness check: the
    timeout only bounds how long a stuck request is waited for)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = get(base + "/metrics")
        busy = metric(text, "vllm:num_requests_running") + metric(text, "vllm:num_requests_waiting")
        if busy == 0:
            return text
        if time.monotonic() > deadline:
            raise AssertionError(f"requests still in the engine after {timeout_s} s: {busy}")
        time.sleep(0.5)


class Prompts:
    """Prompts of 8 shared 1,024-token documents with unique 16-token questions."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.docs = [self.rng.integers(3, 8000, 1024) for _ in range(8)]
        self.count = 0

    def next(self) -> list[int]:
        doc = self.docs[self.count % len(self.docs)]
        self.count += 1
        return np.concatenate([doc, self.rng.integers(3, 8000, 16)]).tolist()


async def run_completions(base: str, jobs):
    """Run ``(kind, rid, prompt, max_tokens, hint)`` jobs concurrently; ``{rid: outcome}``.

    ``kind`` ``complete``: a completion of exactly ``max_tokens`` tokens with ``hint`` as its
    ``feather_output_len``; outcome ``("ok", id, completion tokens, finish reason)`` or
    ``("status", HTTP status)``. ``disconnect``: a streamed one whose client goes away after two
    chunks; outcome ``("disconnected", chunks read)``.
    """
    import openai

    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)

    def body(max_tokens, hint):
        return {"ignore_eos": True, "min_tokens": max_tokens, "vllm_xargs": {"feather_output_len": hint}}

    async def complete(rid, prompt, max_tokens, hint):
        try:
            resp = await client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=max_tokens,
                                                   temperature=0.0, extra_body=body(max_tokens, hint))
        except openai.APIStatusError as exc:
            return rid, ("status", exc.status_code)
        return rid, ("ok", resp.id, resp.usage.completion_tokens, resp.choices[0].finish_reason)

    async def disconnect(rid, prompt, max_tokens, hint):
        stream = await client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=max_tokens,
                                                 temperature=0.0, stream=True,
                                                 extra_body=body(max_tokens, hint))
        chunks = 0
        async for _ in stream:
            chunks += 1
            if chunks == 2:
                break
        await stream.close()  # the client goes away mid-stream
        return rid, ("disconnected", chunks)

    runners = {"complete": complete, "disconnect": disconnect}
    try:
        results = await asyncio.gather(*(runners[kind](*args) for kind, *args in jobs))
    finally:
        await client.close()
    return dict(results)
