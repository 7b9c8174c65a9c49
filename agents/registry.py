"""Agent names -> classes (and their config dataclasses), what ``train.py`` and the benchmarks use."""

from __future__ import annotations

from typing import Any

from agents.base import Agent
from agents.heuristic import HeuristicAgent, HeuristicConfig
from agents.qlearning import QLearningAgent, QLearningConfig
from agents.reference import AlwaysAddAgent, OracleAgent, RandomAgent
from agents.ucb import UCBAgent, UCBConfig

#: Every agent by name. PPO is imported lazily (it pulls in torch and stable-baselines3).
AGENTS: dict[str, type[Agent] | str] = {
    "always-add": AlwaysAddAgent,
    "oracle": OracleAgent,
    "random": RandomAgent,
    "heuristic": HeuristicAgent,
    "ucb": UCBAgent,
    "qlearning": QLearningAgent,
    "ppo": "agents.ppo:PPOAgent",
}
#: What ``train.py --agent`` accepts.
TRAINABLE = ("heuristic", "ucb", "qlearning", "ppo")
CONFIGS: dict[str, type | str | None] = {
    "heuristic": HeuristicConfig,
    "ucb": UCBConfig,
    "qlearning": QLearningConfig,
    "ppo": "agents.ppo:PPOConfig",
    "always-add": None,
    "oracle": None,
    "random": None,
}


def _resolve(obj: Any) -> Any:
    if isinstance(obj, str):
        import importlib

        module, _, attr = obj.partition(":")
        return getattr(importlib.import_module(module), attr)
    return obj


def agent_class(name: str) -> type[Agent]:
    """The class registered as ``name``; unknown names list the known ones."""
    if name not in AGENTS:
        raise KeyError(f"unknown agent {name!r}; known agents: {sorted(AGENTS)}")
    return _resolve(AGENTS[name])


def config_class(name: str) -> type | None:
    """The config dataclass of agent ``name`` (``None`` for agents without knobs)."""
    if name not in CONFIGS:
        raise KeyError(f"unknown agent {name!r}; known agents: {sorted(CONFIGS)}")
    return _resolve(CONFIGS[name])


def make_agent(name: str, config: Any = None, *, seed: int = 0, env: Any = None) -> Agent:
    """Build agent ``name`` (``env`` binds its observation spec; the oracle reads it)."""
    cls = agent_class(name)
    agent = cls(config, seed=seed) if config is not None else cls(seed=seed)
    if env is not None:
        agent.bind(env)
    return agent
