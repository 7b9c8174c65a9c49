"""A training run's environments, built from its configuration: the one place a run makes a
``FeatherEnv`` (or a :class:`~feather_env.env.ScenarioMix`), in this process or in a worker's.

:mod:`agents.training` (the run) and :mod:`agents.parallel` (its worker processes) both build
their environments here.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from agents.run_config import RunConfig, parse_config

__all__ = ["EnvFactory", "make_env"]


def make_env(cfg: RunConfig, backend: Any = None, *, scheduler: str | None = None) -> Any:
    """A raw ``FeatherEnv`` for the run (``backend``: a backend object to share, else the config's;
    ``scheduler``: another ordering than the config's, for a reference agent)."""
    from feather_env.env import FeatherEnv, ScenarioMix

    e = asdict(cfg.env)
    profile = e.pop("profile")
    if scheduler is not None:  # a reference: its own decision
        e["scheduler"], e["decision"], e["extended_obs"] = scheduler, None, False
    backend = backend if backend is not None else cfg.train.backend
    name = cfg.scenario["name"]
    if isinstance(name, list | tuple):  # a mix: one environment per scenario, one drawn per episode
        return ScenarioMix(list(name), backend, scenario_overrides=cfg.scenario_overrides, profile=profile,
                           **e)
    return FeatherEnv(name, backend, scenario_overrides=cfg.scenario_overrides, profile=profile, **e)


class EnvFactory:
    """Picklable ``FeatherEnv`` factory for a worker process (it builds its own backend)."""

    def __init__(self, config: dict[str, Any], agent: str) -> None:
        self.config = config
        self.agent = agent

    def __call__(self) -> Any:
        return make_env(parse_config(self.config, self.agent, where="worker config"))
