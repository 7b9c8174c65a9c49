"""The package layers hold by import: the engine-free core imports no vLLM, Ray or HTTP server.

``scheduler_runtime`` is the core (prefix indexes, batching, policies, routers); its ``serving``
sub-package is the layer above it (the vLLM plug-in, ``feather-serve``, the cluster). Each core
module is imported in a fresh interpreter and the test looks at what came in with it, so a new
import anywhere below (direct or through another core module) fails here, whatever the file's name.
"""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import pytest

import scheduler_runtime

CORE_MODULES = sorted(
    f"scheduler_runtime.{m.name}" for m in pkgutil.iter_modules(scheduler_runtime.__path__)
    if m.name != "serving"
)
SERVING_ONLY = ("vllm", "ray", "aiohttp", "fastapi", "uvicorn", "torch", "scheduler_runtime.serving")
UPPER_PACKAGES = ("feather_env", "agents")


def test_the_core_has_the_modules_it_should() -> None:
    assert "scheduler_runtime.cht" in CORE_MODULES and "scheduler_runtime.batching" in CORE_MODULES
    assert not any(m.startswith("scheduler_runtime.serving") for m in CORE_MODULES)


@pytest.mark.parametrize("module", CORE_MODULES)
def test_core_module_imports_no_serving_stack(module: str) -> None:
    code = (
        "import sys, importlib\n"
        f"importlib.import_module({module!r})\n"
        "bad = sorted({m.split('.')[0] if not m.startswith('scheduler_runtime') else m\n"
        "              for m in sys.modules\n"
        f"              if m.split('.')[0] in {SERVING_ONLY + UPPER_PACKAGES!r}\n"
        f"              or m.startswith('scheduler_runtime.serving')}})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"{module} pulls in {out.stdout.strip()}"


def test_the_serving_layer_still_offers_the_public_names() -> None:
    # What users type: scheduler_runtime.FeatherScheduler (lazy, so `import scheduler_runtime` stays light).
    code = ("import sys, scheduler_runtime\n"
            "assert 'vllm' not in sys.modules\n"
            "from scheduler_runtime.serving import vllm_scheduler\n"
            "assert scheduler_runtime.FeatherScheduler is vllm_scheduler.FeatherScheduler\n"
            "assert scheduler_runtime.FeatherAsyncScheduler is vllm_scheduler.FeatherAsyncScheduler\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
