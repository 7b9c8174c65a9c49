"""Per-replica engine arguments of ``feather-serve --replicas N``: ``--replica-args 'K: ARGS'``.

Every ``feather-serve`` option applies to every replica; ``--replica-args`` gives replica ``K`` (0-based)
engine arguments of its own, over the common ones, so that one machine can hold unequal replicas (a
smaller KV cache, fewer sequences, a smaller token budget)::

    feather-serve --replicas 2 --router prefix-learned \\
        --replica-args '1: --kv-cache-memory-bytes 268435456 --max-num-seqs 32'

Only the engine arguments of :data:`PER_REPLICA_ARGS` may differ between replicas: what sizes an
engine, not what it serves (the model, the scheduler) nor where (the host and port the proxy gives
it). A replica's cores are its entry of ``--replica-cores 'A;B'``, already one per replica. Each
argument is checked here, before any replica starts: a problem is a ``ValueError`` whose message
names the replica and the argument (``feather-serve`` reports it as a usage error). Under the ``slo``
and ``deadline`` admission rules each replica predicts with its own engine's figures, from the same
arguments (:meth:`~scheduler_runtime.serving.cluster_base.ClusterConfig.replica_admission`).

Nothing here imports vLLM, Ray or an HTTP server.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Sequence

__all__ = ["PER_REPLICA_ARGS", "check_replica_args", "parse_replica_args", "without_flags"]

#: The engine arguments a replica may have of its own (``--replica-args``), with their values' type
#: (each > 0; ``--gpu-memory-utilization`` at most 1).
PER_REPLICA_ARGS: dict[str, type] = {
    "--kv-cache-memory-bytes": int,
    "--max-num-seqs": int,
    "--max-num-batched-tokens": int,
    "--num-gpu-blocks-override": int,
    "--gpu-memory-utilization": float,
    "--long-prefill-token-threshold": int,
    "--max-num-partial-prefills": int,
}

#: Arguments that must not differ between replicas, and why (a clearer error than "unknown").
_SHARED = {
    "--port": "the proxy gives each replica a port of its own",
    "--host": "the proxy gives each replica a port of its own",
    "--model": "every replica serves the same model",
    "--served-model-name": "every replica serves the same model",
    "--tokenizer": "every replica serves the same model",
    "--scheduler": "every replica runs the same scheduler",
    "--scheduler-cls": "every replica runs the same scheduler",
    "--scheduler-config": "every replica runs the same scheduler",
    "--additional-config": "every replica runs the same scheduler",
    "--cores": "a replica's cores are its entry of --replica-cores 'A;B;...'",
    "--cpu-cores": "a replica's cores are its entry of --replica-cores 'A;B;...'",
    "--replica-cores": "a replica's cores are its entry of --replica-cores 'A;B;...'",
}


def _name(arg: str) -> str:
    """``--flag`` of ``--flag``, ``--flag=value`` or ``--flag_name`` (vLLM's parser takes all three)."""
    return "--" + arg.split("=", 1)[0][2:].replace("_", "-")


def check_replica_args(rank: int, args: Sequence[str]) -> tuple[str, ...]:
    """Replica ``rank``'s own engine arguments, checked, as ``("--flag", "value", ...)``.

    Raises:
        ValueError: an argument that is not one of :data:`PER_REPLICA_ARGS`, given twice, without a
            value or with a bad one; or no argument at all.
    """
    where = f"--replica-args {rank}"
    if not args:
        raise ValueError(f"{where}: no engine arguments")
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ValueError(f"{where}: {arg!r} is not an option (--flag value)")
        name = _name(arg)
        if name in _SHARED:
            raise ValueError(f"{where}: {name} cannot differ between replicas: {_SHARED[name]}")
        if name not in PER_REPLICA_ARGS:
            raise ValueError(f"{where}: {name} is not a per-replica engine argument (one of "
                             f"{', '.join(PER_REPLICA_ARGS)}); give the others once, for every replica")
        if name in out:
            raise ValueError(f"{where}: {name} given twice")
        if "=" in arg:
            value = arg.split("=", 1)[1]
            i += 1
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            value = args[i + 1]
            i += 2
        else:
            raise ValueError(f"{where}: {name} needs a value")
        kind = PER_REPLICA_ARGS[name]
        try:
            number = kind(value)
        except ValueError:
            what = "a whole number" if kind is int else "a number"
            raise ValueError(f"{where}: {name} must be {what}, got {value!r}") from None
        if not (math.isfinite(number) and number > 0) or (name == "--gpu-memory-utilization" and number > 1):
            bound = "in (0, 1]" if name == "--gpu-memory-utilization" else "> 0"
            raise ValueError(f"{where}: {name} must be {bound}, got {value}")
        out += [name, value]
    return tuple(out)


def parse_replica_args(specs: Sequence[str], replicas: int) -> tuple[tuple[str, ...], ...]:
    """``--replica-args`` given once per replica as ``'K: ARGS'`` (``K`` 0-based, ``ARGS`` shell words)
    as each of the ``replicas`` replicas' own arguments (``()`` for a replica not named).

    Raises:
        ValueError: a spec without ``K:``, a ``K`` that is not a replica, a replica named twice, or a
            bad argument (:func:`check_replica_args`).
    """
    per: list[tuple[str, ...] | None] = [None] * replicas
    for spec in specs:
        head, colon, tail = spec.partition(":")
        if not colon or not head.strip().isdigit():
            raise ValueError(f"--replica-args {spec!r}: expected 'K: ARGS', K the replica's index (0 to "
                             f"{replicas - 1})")
        rank = int(head)
        if rank >= replicas:
            raise ValueError(f"--replica-args {spec!r}: no replica {rank} (--replicas {replicas}: 0 to "
                             f"{replicas - 1})")
        if per[rank] is not None:
            raise ValueError(f"--replica-args: replica {rank} named twice (give its arguments in one)")
        try:
            words = shlex.split(tail)
        except ValueError as exc:
            raise ValueError(f"--replica-args {spec!r}: {exc}") from None
        per[rank] = check_replica_args(rank, words)
    return tuple(p or () for p in per)


def without_flags(args: Sequence[str], flags: Sequence[str]) -> list[str]:
    """``args`` without ``flags`` and their values (``--flag value``, ``--flag=value``, underscores too)."""
    names = {f for flag in flags for f in (flag, "--" + flag[2:].replace("-", "_"))}
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in names:
            skip = True
        elif a.split("=", 1)[0] not in names:
            out.append(a)
    return out
