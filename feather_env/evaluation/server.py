"""A local OpenAI-compatible server in a subprocess, sized like an in-process engine (tests, benchmarks).

:class:`LocalServer` starts ``feather-serve`` (``python -m scheduler_runtime.serving.serve``, a Feather
scheduler or ``fcfs``) or vLLM's own server with no Feather in it (``python -m
vllm.entrypoints.launchers.api_server.entry``, what ``vllm serve`` runs) on a free loopback port,
with its engine core in a process of its own as in production, waits until ``/health`` answers,
and stops it (SIGINT, then SIGKILL of its process group) on exit. Both get the engine of an
:class:`~feather_env.engines.vllm_engine.EngineConfig` (:func:`server_args`: the bundled model with random
weights, the KV cache, batch and token budget, block size, eager mode), so that a server and the
in-process evaluation serve on the same engine; the engine's ``cpu_cores`` pins the server's engine
threads (``VLLM_CPU_OMP_THREADS_BIND``), and ``other_cores`` the rest of the server (its API server
process, the engine process's other threads), so that HTTP and detokenization do not run on the
engine's core. The server runs with ``VLLM_SERVER_DEV_MODE=1``, so that a client can empty its
prefix cache between runs (``POST /reset_prefix_cache``). Everything it prints goes to ``log_path``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import TracebackType

from feather_env.engines.vllm_engine import EngineConfig
from feather_env.hostload import pinned_cores
from scheduler_runtime.serving.replicas import die_with_parent, free_port

__all__ = ["LocalServer", "free_port", "server_args"]

REPO_ROOT = Path(__file__).resolve().parents[2]
VLLM_SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"
SERVED_MODEL_NAME = "tiny-llama"


def server_args(engine: EngineConfig) -> list[str]:
    """vLLM server flags for the engine that :func:`~feather_env.engines.vllm_engine.build_llm`
    builds from ``engine``.

    Text in and out (the server loads the model's tokenizer: it detokenizes its answers), which
    costs the API server some CPU that an in-process engine does not spend.
    """
    args = ["--model", engine.model_dir, "--served-model-name", SERVED_MODEL_NAME,
            "--load-format", engine.load_format, "--dtype", engine.compute_dtype,
            "--kv-cache-memory-bytes", str(engine.kv_cache_memory_bytes),
            "--max-num-seqs", str(engine.max_num_seqs),
            "--max-num-batched-tokens", str(engine.max_num_batched_tokens),
            "--max-model-len", str(engine.max_model_len), "--block-size", str(engine.block_size),
            "--seed", str(engine.seed), "--host", "127.0.0.1"]
    if engine.enforce_eager:
        args.append("--enforce-eager")
    args.append("--enable-prefix-caching" if engine.enable_prefix_caching else "--no-enable-prefix-caching")
    return args


class LocalServer:
    """A server subprocess on loopback (module docstring); a context manager.

    Args:
        scheduler: a scheduler name for ``feather-serve``, or ``None`` for vLLM's own server.
        engine: the engine to serve on (default: :class:`EngineConfig`'s defaults).
        log_path: where the server's output goes.
        extra_args: more server flags (they win over the defaults).
        scheduler_config: a ``--scheduler-config`` file for ``feather-serve``.
        other_cores: pin the server's processes to these cores (``"0"``, ``"0-1"``), its engine
            threads excepted (they follow the engine's ``cpu_cores``); ``None``: not pinned.
        start_timeout_s: how long to wait for ``/health``.
    """

    def __init__(self, scheduler: str | None, engine: EngineConfig | None = None, *,
                 log_path: str | Path, extra_args: tuple[str, ...] = (),
                 scheduler_config: str | Path | None = None, other_cores: str | None = None,
                 start_timeout_s: float = 300.0) -> None:
        self.engine = engine or EngineConfig()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self.start_timeout_s = start_timeout_s
        self.other_cores = pinned_cores(other_cores)
        args = [*server_args(self.engine), "--port", str(self.port), *extra_args]
        if scheduler is None:
            self.command = [sys.executable, "-m", VLLM_SERVER_MODULE, *args]
        else:
            self.command = [sys.executable, "-m", "scheduler_runtime.serving.serve", "--scheduler", scheduler,
                        *args]
            if scheduler_config is not None:
                self.command += ["--scheduler-config", str(scheduler_config)]
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> LocalServer:
        env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
        # the server's default: its engine core in a process of its own
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        env.pop("VLLM_LOGGING_CONFIG_PATH", None)
        env["VLLM_SERVER_DEV_MODE"] = "1"  # /reset_prefix_cache (loopback only)
        if self.engine.cpu_cores is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.engine.cpu_cores
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cores = self.other_cores

        def pin() -> None:  # in the child, before exec: its processes inherit the mask
            die_with_parent()
            if cores and hasattr(os, "sched_setaffinity"):
                os.sched_setaffinity(0, cores)

        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(self.command, cwd=REPO_ROOT, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=pin)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} at start:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2.0):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"server not up after {self.start_timeout_s:.0f} s:\n"
                                       f"{self.log_tail()}") from None
                time.sleep(0.5)

    def log_tail(self, chars: int = 4000) -> str:
        """The end of the server's output."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """Stop the server (SIGINT, as Ctrl-C; SIGKILL of its group if it does not exit); its exit code."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return None if proc is None else proc.returncode
        proc.send_signal(signal.SIGINT)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait(timeout=30)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
