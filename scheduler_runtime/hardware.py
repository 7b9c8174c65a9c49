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
import json
import os
import platform
from pathlib import Path

__all__ = ["DTYPE_ENV", "PROFILES_DIR", "compute_dtype", "cpu_isa", "cpu_model", "kv_bytes_factor",
           "kv_bytes_per_token", "machine_profile", "online_cores", "parse_cores", "same_machine"]

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


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what :mod:`platform` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


#: The simulator's step-time profiles shipped with the toolkit, one per kind of machine.
PROFILES_DIR = Path(__file__).resolve().parents[1] / "configs" / "profiles"
#: The shipped profile used where none was measured on this kind of machine.
DEFAULT_PROFILE_NAME = "cpu-tiny-llama.json"


def same_machine(a: dict, b: dict) -> bool:
    """Two ``machine_info`` records known to be one kind of machine: the same CPU model name and the
    same vector ISA, both recorded (one model name covers AVX2-only and AVX-512 hosts)."""
    return a.get("isa") is not None and a.get("cpu") == b.get("cpu") and a.get("isa") == b.get("isa")


def machine_profile(directory: str | Path = PROFILES_DIR) -> Path:
    """The shipped step-time profile measured on this kind of machine (:func:`same_machine`: CPU model
    and ISA), the first by name; else ``cpu-tiny-llama.json``. What the admission rule predicts with
    when no profile is named (the in-process engine, ``feather-serve --admission``)."""
    here = {"cpu": cpu_model(), "isa": cpu_isa()}
    directory = Path(directory)
    for path in sorted(directory.glob("*.json")):
        try:
            measured = json.loads(path.read_text(encoding="utf-8")).get("measured_on") or {}
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(measured, dict) and same_machine(measured, here):
            return path
    return directory / DEFAULT_PROFILE_NAME


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


def kv_bytes_per_token(model_dir: str | Path, dtype: str = "bfloat16", *, tensor_parallel: int = 1,
                       pipeline_parallel: int = 1) -> int:
    """Bytes of KV cache one token occupies on one worker: layers x 2 (K and V) x kv heads x head dim x
    the dtype's size, from the model's ``config.json`` (``dtype``: a model dtype, or a KV cache dtype
    such as ``fp8``, one byte). With ``tensor_parallel`` ranks each holds its share of the KV heads (at
    least one), with ``pipeline_parallel`` stages each its share of the layers, as vLLM shards them.

    Raises OSError / KeyError / ValueError when ``model_dir`` has no readable model config."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    kv_heads = max(1, kv_heads // max(1, tensor_parallel))
    layers = -(-int(cfg["num_hidden_layers"]) // max(1, pipeline_parallel))
    itemsize = 1 if dtype.startswith("fp8") else _ITEMSIZE.get(dtype, 2)
    return int(layers * 2 * kv_heads * head_dim * itemsize)


def parse_cores(spec: str) -> list[int]:
    """``"0"``, ``"2-3"``, ``"0,2,4-5"`` -> core ids, in the order given: the one reading of a CPU core
    list (an engine's ``cpu_cores``, ``feather-serve --replica-cores``).

    Raises:
        ValueError: a list that names no core this way (``"a"``, ``"1-0"``, ``"-1"``, ``"0,"``).
    """
    cores: list[int] = []
    for part in spec.split(","):
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()) or int(hi or lo) < int(lo):
            raise ValueError(f"bad CPU core list {spec!r}: cores like '1', '0-1' or '0,2'")
        cores.extend(range(int(lo), int(hi or lo) + 1))
    return cores


def online_cores() -> set[int]:
    """The machine's online CPU cores (``/sys/devices/system/cpu/online``; else ``os.cpu_count()``'s):
    the cores a process may be pinned to, whatever the mask it runs under now (a process pinned to
    one core may pin a child of its to another)."""
    try:
        return set(parse_cores(Path("/sys/devices/system/cpu/online").read_text().strip()))
    except (OSError, ValueError):
        return set(range(os.cpu_count() or 1))
