"""The replica processes of ``feather-serve --replicas N``'s proxy data plane: how one is started
(its command, port, cores, OpenMP binding and GPUs) and the record the proxy supervises it by.

:class:`~scheduler_runtime.serving.proxy.ReplicaProxy` starts, probes, restarts and routes to these;
nothing here serves HTTP.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from scheduler_runtime.serving.admission_http import ENV_VAR as ADMISSION_ENV
from scheduler_runtime.serving.cluster_base import ClusterConfig, core_binding, gpu_groups
from scheduler_runtime.serving.replica_args import without_flags

__all__ = ["MAX_RESTART_DELAY_S", "RESTART_DELAY_S", "STABLE_S", "Replica", "die_with_parent", "free_port",
           "replica_command", "replicas_for"]

#: Restart back-off: the first delay, the longest, and how long a replica must live to reset it.
RESTART_DELAY_S, MAX_RESTART_DELAY_S, STABLE_S = 1.0, 30.0, 60.0

_REPLICA_PROGRAM = ("import sys; from scheduler_runtime.serving.serve import run_vllm_server; "
                    "run_vllm_server(sys.argv[1:])")


def replica_command(vllm_args: Sequence[str], port: int) -> list[str]:
    """One replica process: vLLM's server with ``feather-serve``'s arguments, on 127.0.0.1:``port``."""
    args = without_flags(vllm_args, ("--host", "--port"))
    return [sys.executable, "-c", _REPLICA_PROGRAM, *args, "--host", "127.0.0.1", "--port", str(port)]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class Replica:
    """One engine replica: a process this proxy supervises (``command``), or a running server (``url``).

    Attributes:
        rank: its index (its ``replica`` label, stable across restarts).
        url: ``http://127.0.0.1:PORT``.
        command: the process to run (``None``: a server someone else runs; never restarted).
        env: its extra environment; cores: the CPU cores it is pinned to (``None``: not pinned).
    """

    rank: int
    url: str
    command: list[str] | None = None
    env: dict[str, str] = field(default_factory=dict)
    cores: list[int] | None = None
    process: subprocess.Popen[bytes] | None = None
    healthy: bool = False
    in_flight: int = 0
    restarts: int = 0
    failures: int = 0
    #: this incarnation has passed a health check (until then failed probes only wait for it)
    ever_healthy: bool = False
    started_at: float = 0.0
    next_start: float = 0.0
    restart_delay: float = RESTART_DELAY_S
    last_probe: float = 0.0

    @property
    def name(self) -> str:
        return str(self.rank)

    @property
    def replica_id(self) -> str:
        """This incarnation: ``pid-PID`` for a process of ours, else the URL's port."""
        if self.process is not None:
            return f"pid-{self.process.pid}"
        return "port-" + self.url.rsplit(":", 1)[-1]

    def start(self) -> None:
        """Start the process (its own process group, pinned, dying with this process on Linux)."""
        assert self.command is not None
        cores = self.cores

        def prepare() -> None:  # in the child, before exec
            if cores is not None and hasattr(os, "sched_setaffinity"):
                os.sched_setaffinity(0, cores)
            die_with_parent()

        self.process = subprocess.Popen(self.command, env={**os.environ, **self.env}, start_new_session=True,
                                        preexec_fn=prepare)
        self.started_at = time.monotonic()
        self.healthy = self.ever_healthy = False  # a starting engine fails probes for a while
        self.failures = 0

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the process's whole group (the vLLM server and its engine core)."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, sig)

    def info(self) -> dict[str, Any]:
        """What ``GET /replicas`` says of it."""
        pid = self.process.pid if self.process is not None else None
        affinity = None
        if pid is not None and hasattr(os, "sched_getaffinity"):
            with contextlib.suppress(OSError):
                affinity = sorted(os.sched_getaffinity(pid))
        return {"rank": self.rank, "replica_id": self.replica_id, "url": self.url, "pid": pid,
                "cores": self.cores, "affinity": affinity, "healthy": self.healthy,
                "in_flight": self.in_flight, "restarts": self.restarts}


def _parent_death_signal() -> Callable[[], None]:
    """A function for the child that asks Linux for SIGTERM when this process dies (no-op elsewhere);
    looked up in the parent, as a ``preexec_fn`` should import nothing."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return lambda: None
    pr_set_pdeathsig = 1
    return lambda: prctl(pr_set_pdeathsig, signal.SIGTERM)


#: For ``subprocess.Popen(preexec_fn=...)``: the child is sent SIGTERM when the process that started
#: it dies, even by SIGKILL or by a SIGTERM that skips every ``finally``. A replica then never
#: outlives its ``feather-serve``, nor a server the test or benchmark that started it.
die_with_parent: Callable[[], None] = _parent_death_signal()


def replicas_for(config: ClusterConfig, command: Callable[[Sequence[str], int], list[str]] = replica_command,
                 visible_gpus: Sequence[str] | None = None) -> list[Replica]:
    """``config``'s replica processes (not started): ports, cores, OpenMP binding, GPUs, each one's
    engine arguments (:meth:`ClusterConfig.replica_vllm_args`: the common ones and its own) and, with an
    admission middleware, its own settings in its environment (:meth:`ClusterConfig.replica_admission`,
    computed from those arguments)."""
    if visible_gpus is None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        visible_gpus = visible.split(",") if visible else [str(i) for i in range(_cuda_devices())]
    gpus = gpu_groups(config.replicas, config.replica_gpus, visible_gpus)
    replicas = []
    for k in range(config.replicas):
        port = free_port()
        env: dict[str, str] = {}
        cores = None
        if config.replica_cores:
            cores, env = core_binding(config.replica_cores[k % len(config.replica_cores)])
        if gpus[k] is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus[k]
        admission = config.replica_admission(k)
        if admission is not None:
            env[ADMISSION_ENV] = admission.to_json()
        replicas.append(Replica(rank=k, url=f"http://127.0.0.1:{port}",
                                command=command(config.replica_vllm_args(k), port), env=env, cores=cores))
    return replicas


def _cuda_devices() -> int:
    with contextlib.suppress(ImportError):
        import torch

        return int(torch.cuda.device_count())
    return 0


