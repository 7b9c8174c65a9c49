"""Batching agents for the Feather environment: one small interface, one module per agent.

- :mod:`agents.base`: :class:`Agent` (``act(obs, mask)``, ``learn``, ``save``/``load``,
  ``export``), the training wrapper :class:`AgentEnv`, :func:`evaluate`;
- :mod:`agents.heuristic`: the authors' static rule;
- :mod:`agents.ucb`: the authors' contextual UCB bandit;
- :mod:`agents.qlearning`: tabular Q-learning over the same bins;
- :mod:`agents.ppo`: MaskablePPO (stable-baselines3 / sb3-contrib);
- :mod:`agents.reference`: ``always-add``, ``oracle``, ``random``;
- :mod:`agents.registry`: name -> class.

Exported policies are read by :func:`scheduler_runtime.policy.load_policy` without torch.
"""

from agents.base import ADD, STOP, Agent, AgentEnv, NotExportableError, evaluate
from agents.registry import AGENTS, TRAINABLE, agent_class, config_class, make_agent

__all__ = [
    "ADD",
    "AGENTS",
    "STOP",
    "TRAINABLE",
    "Agent",
    "AgentEnv",
    "NotExportableError",
    "agent_class",
    "config_class",
    "evaluate",
    "make_agent",
]
