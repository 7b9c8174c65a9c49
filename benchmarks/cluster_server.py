"""``feather-serve --replicas N`` on a free loopback port: started, waited for, stopped with SIGTERM.

Shared by the cluster benchmarks (:mod:`benchmarks.cluster_loopback`, :mod:`benchmarks.cluster_faults`)
and the two-replica test (``tests/test_cluster.py``). :meth:`ClusterServer.stop` sends SIGTERM to the
command, as an operator would, and reports how long it took to exit and which of the processes it
had started (Ray's, the engine replicas', their vLLM engine cores) were still alive afterwards.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

from scheduler_runtime.serving.replicas import die_with_parent, free_port

REPO = Path(__file__).resolve().parent.parent
#: Replicas that start each a vLLM engine: minutes on a loaded 2-core machine at worst.
START_TIMEOUT_S = 420.0


def http_get(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


class ClusterError(RuntimeError):
    """The cluster did not start, or did not stop cleanly."""


class ClusterServer:
    """``feather-serve --replicas N --router R [args]`` as a context manager (see the module docstring).

    Args:
        replicas, router: the cluster's.
        args: further ``feather-serve`` arguments (vLLM's and the scheduler's), applied to every replica.
        log_path: the command's output.
    """

    def __init__(self, replicas: int, router: str, args: Sequence[str] = (), *, log_path: str | Path) -> None:
        self.replicas = replicas
        self.router = router
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [sys.executable, "-m", "scheduler_runtime.serving.serve", "--replicas", str(replicas),
                        "--router", router, "--port", str(self.port), *args]
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen[bytes] | None = None
        self.start_s = float("nan")
        self.stop_report: dict[str, Any] = {}
        self._started: dict[int, str] = {}

    def __enter__(self) -> ClusterServer:
        env = {k: v for k, v in os.environ.items() if k not in ("PROMETHEUS_MULTIPROC_DIR",
                                                               "VLLM_ENABLE_V1_MULTIPROCESSING")}
        env["VLLM_SERVER_DEV_MODE"] = "1"  # POST /reset_prefix_cache
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(self.command, cwd=REPO, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=die_with_parent)
        try:
            self.wait_healthy(self.replicas, START_TIMEOUT_S)
        except BaseException:
            self.kill()
            raise
        self.start_s = time.monotonic() - t0
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.stop()

    # -- state ------------------------------------------------------------------------------------
    def health(self) -> dict[str, Any] | None:
        """``GET /health``'s body; ``None`` before the application answers (the proxy's 404 text)."""
        try:
            text = http_get(self.url + "/health", timeout=5.0)
        except urllib.error.HTTPError as exc:  # 503 while no replica is healthy: still an answer
            text = exc.read().decode(errors="replace")
        except OSError:
            return None
        try:
            body = json.loads(text)
        except ValueError:
            return None
        return body if isinstance(body, dict) else None

    def wait_healthy(self, replicas: int, timeout_s: float) -> float:
        """Wait until ``replicas`` engine replicas are healthy; returns the seconds waited."""
        t0 = time.monotonic()
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise ClusterError(f"feather-serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            h = self.health()
            if h and h.get("healthy_replicas", 0) >= replicas:
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                raise ClusterError(f"{replicas} healthy replicas not reached after {timeout_s:.0f} s "
                                   f"(last /health {h}):\n{self.log_tail()}")
            time.sleep(1.0)

    def replica_info(self) -> list[dict[str, Any]]:
        """``GET /replicas``: every engine replica's id, rank, process and cores."""
        return json.loads(http_get(self.url + "/replicas"))

    def metrics(self) -> str:
        return http_get(self.url + "/metrics", timeout=30.0)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    # -- stopping ----------------------------------------------------------------------------------
    def _descendants(self) -> dict[int, str]:
        assert self.proc is not None
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return {}
        out = {}
        for c in children:
            try:
                out[c.pid] = " ".join(c.cmdline())[:120] or c.name()
            except psutil.Error:
                continue
        return out

    def stop(self, timeout_s: float = 90.0) -> dict[str, Any]:
        """SIGTERM the command; returns ``{"exit_s", "returncode", "processes", "left_over"}``."""
        assert self.proc is not None
        started = self._descendants()
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        exit_s = time.monotonic() - t0
        time.sleep(3.0)  # children shutting down after their parent
        left = {pid: cmd for pid, cmd in started.items() if _alive(pid)}
        self.stop_report = {"exit_s": exit_s, "returncode": code, "processes": len(started),
                            "left_over": [f"{pid} {cmd}" for pid, cmd in left.items()]}
        if code is None or left:
            self.kill(left)
        return self.stop_report

    def kill(self, extra: dict[int, str] | None = None) -> None:
        """Force everything down (a failed start, or a stop that left processes behind)."""
        if self.proc is not None and self.proc.poll() is None:
            pids = self._descendants()
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
            extra = {**pids, **(extra or {})}
        for pid in extra or {}:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
