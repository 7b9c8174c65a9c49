"""A training run's environments, built from its configuration: the one place a run makes a
``FeatherEnv`` (or a :class:`~feather_env.env.ScenarioMix`), in this process or in a worker's.

:mod:`agents.training` (the run) and :mod:`agents.parallel` (its worker processes) both build
their environments here.
"""

from __future__ import annotations

from typing import Any

from agents.run_config import RunConfig

__all__ = ["EnvFactory", "make_env"]


def make_env(cfg: RunConfig, backend: Any = None, *, scheduler: str | None = None) -> Any:
    """A raw ``FeatherEnv`` (or a ``ScenarioMix``) for the run, built from its resolved environments
    (:attr:`RunConfig.envs`): on ``train.backend``, on another one (``"sim"``, ``"vllm"``), or on a
    backend object to share; ``scheduler``: a reference agent's own scheduler (its own decision)."""
    from feather_env.env import FeatherEnv, ScenarioMix

    envs = cfg.envs
    if scheduler is not None:
        envs = tuple(e.with_scheduler(scheduler) for e in envs)
    if isinstance(backend, str):
        envs = tuple(e.on(backend) for e in envs)
        backend = None
    if cfg.is_mix:  # one environment per scenario, one drawn per episode
        return ScenarioMix.from_resolved(envs, backend, names=cfg.scenario["name"])
    return FeatherEnv.from_resolved(envs[0], backend)


class EnvFactory:
    """Picklable ``FeatherEnv`` factory for a worker process (it builds its own backend from the run's
    resolved environments: no scenario is read again)."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg

    def __call__(self) -> Any:
        return make_env(self.cfg)
