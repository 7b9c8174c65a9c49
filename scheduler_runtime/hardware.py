"""What this machine computes the model in: bfloat16 where the CPU has instructions for it, else float32.

The bundled model is declared bfloat16 (``--dtype bfloat16``), and its KV cache is sized in that
dtype (``kv_cache_gib`` -> tokens). On an x86 CPU without AVX-512 (AVX2 only), PyTorch runs
bfloat16 matrix products through a slow path: a 512x256x512 product took 99 ms in bfloat16 and
1.8 ms in float32 on a 2-core AMD EPYC (AVX2) host, so an engine step there was several times
slower than in float32. There the engine computes in float32, with the same number of KV tokens
(twice the bytes), so a scenario's KV cache, the simulator and every admission decision stay the
same; only the step times change (which the simulator's per-machine profile absorbs).
``$FEATHER_ENGINE_DTYPE`` overrides the choice (e.g. ``bfloat16`` to measure the slow path).
"""

from __future__ import annotations

import functools
import os
import platform

__all__ = ["DTYPE_ENV", "compute_dtype", "cpu_isa", "kv_bytes_factor"]

DTYPE_ENV = "FEATHER_ENGINE_DTYPE"
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


#: Vector instruction sets that change the engine's speed, best first (what :func:`cpu_isa` names).
ISA_LEVELS = ("amx_bf16", "avx512_bf16", "avx512f", "avx2")


def cpu_isa() -> str | None:
    """The best of :data:`ISA_LEVELS` this CPU has (``"other"`` for none of them); ``None`` where the
    CPU's flags cannot be read. Two machines of one model name can differ here (AVX2-only and AVX-512
    AMD EPYC hosts), and the engine's step times with them."""
    flags = _cpu_flags()
    if not flags:
        return None
    return next((isa for isa in ISA_LEVELS if isa in flags), "other")


def _slow_bfloat16() -> bool:
    """An x86 CPU without AVX-512 (the bfloat16 slow path), and no CUDA device in use."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    flags = _cpu_flags()
    if not flags or "avx512f" in flags:
        return False
    try:
        import torch

        if torch.cuda.is_available():
            return False
    except Exception:  # noqa: BLE001 - no torch here: decide from the CPU alone
        pass
    return True


def compute_dtype(dtype: str) -> str:
    """The dtype the engine computes in for a model of ``dtype`` on this machine (module docstring)."""
    override = os.environ.get(DTYPE_ENV)
    if override:
        return override
    if dtype == "bfloat16" and _slow_bfloat16():
        return "float32"
    return dtype


def kv_bytes_factor(dtype: str, computed: str) -> float:
    """How many times the bytes of a ``dtype`` KV cache the same tokens take in ``computed``."""
    return _ITEMSIZE.get(computed, 2) / _ITEMSIZE.get(dtype, 2)
