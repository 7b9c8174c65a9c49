"""Shared fixtures: the real vLLM engine is started once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from feather_env.engines.vllm_engine import use_in_process_engine

use_in_process_engine()

REPO = Path(__file__).resolve().parent.parent
DATA_DIR = Path(os.environ.get("FEATHER_DATA_DIR", REPO.parent / "shared" / "data"))

# The engine every engine test shares: small KV cache, eager mode (~7 s to start).
TEST_ENGINE = dict(kv_cache_gib=2.0, max_num_seqs=128, max_model_len=20480,
                   max_num_batched_tokens=8192)


@pytest.fixture(scope="session")
def data_dir() -> Path:
    if not DATA_DIR.is_dir():
        pytest.fail(f"workload data not found at {DATA_DIR}; set FEATHER_DATA_DIR")
    return DATA_DIR


@pytest.fixture(scope="session")
def engine_config():
    from feather_env.engines.vllm_engine import EngineConfig

    return EngineConfig(**TEST_ENGINE)


@pytest.fixture(scope="session")
def llm(engine_config):
    """One in-process vLLM engine for the whole session."""
    from feather_env.engines.vllm_engine import build_llm

    engine = build_llm(engine_config)
    yield engine


@pytest.fixture(scope="session")
def env_backend():
    """The environment's real engine for the whole session: leval-kv-pressure's (0.25 GiB of KV),
    with FeatherScheduler in its loop."""
    from feather_env.engines.vllm_backend import VLLMBackend
    from feather_env.scenarios import load_scenario

    return VLLMBackend(load_scenario("leval-kv-pressure").engine_config())


@pytest.fixture(scope="session")
def isolated_runner(llm, engine_config):
    from benchmarks.isolated import IsolatedBatchRunner

    return IsolatedBatchRunner(engine_config, llm=llm)


@pytest.fixture(scope="session")
def exported_policies(tmp_path_factory) -> dict[str, Path]:
    """Policies exported by ``train.py`` (its command line, on the simulator): a Q-learning
    table and a PPO MLP, ``{"table": path, "mlp": path}``."""
    import yaml

    import train

    root = tmp_path_factory.mktemp("policies")
    # a small leval-kv-pressure episode on the simulator: milliseconds each
    scenario = {"name": "leval-kv-pressure", "episode": {"groups": 4, "max_per_group": 3},
                "workload": {"max_prompt_tokens": 2048}, "engine": {"kv_cache_gib": 0.03}}
    out = {}
    for kind, agent, extra in (("table", "qlearning", {}),
                               ("mlp", "ppo", {"n_steps": 64, "batch_size": 32, "n_epochs": 2})):
        config = root / f"{agent}.yaml"
        config.write_text(yaml.safe_dump({
            "scenario": scenario, "agent": {"name": agent, **extra},
            "train": {"timesteps": 256, "eval_every": 0, "eval_episodes": 1, "checkpoint_every": 0,
                      "progress_bar": False}}))
        result = train.main(["--agent", agent, "--config", str(config), "--out", str(root / agent)])
        out[kind] = result.policy_path
    return out


# Modules that start engines of their own. Shutting an in-process vLLM engine down tears
# down process-wide state (its parallel groups) that the session engine also uses, so these
# run after every test that uses the session engine.
OWN_ENGINE_MODULES = ("test_vllm_scheduler.py", "test_evaluate.py")


#: The fixtures that start (or hold) a real vLLM engine: a test that uses one is an engine test.
ENGINE_FIXTURES = {"llm", "env_backend", "isolated_runner"}


def pytest_collection_modifyitems(config, items):
    def own_engine(item) -> bool:
        return item.path.name in OWN_ENGINE_MODULES

    # `pytest -m "not engine"` (make test-fast) leaves out every test that needs the engine
    for item in items:
        if own_engine(item) or ENGINE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.engine)
    items[:] = [i for i in items if not own_engine(i)] + [i for i in items if own_engine(i)]
