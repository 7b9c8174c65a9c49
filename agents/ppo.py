"""PPO (beyond the paper): stable-baselines3's MaskablePPO (sb3-contrib) on the batching environment.

Why MaskablePPO: ADD is invalid whenever the batch is at ``max_batch_size``, nothing is waiting,
or the candidate's KV peak does not fit; the environment raises on an invalid action. Plain PPO
would need those actions remapped (silently turning "ADD" into "STOP", so the gradient credits
an action that did not happen) or penalized (a reward term unrelated to throughput that the
agent must first learn). Masking removes them from the action distribution: the policy only ever
chooses between actions that exist, and the exported policy applies the same mask.

Observations are divided by ``env.obs_scale`` (values in [-1, 1]) by :class:`~agents.base.AgentEnv`;
``act`` takes raw observations and scales them itself, like every other agent. The actor is a
small tanh MLP (``net_arch``, default 64x64): the exported numpy version decides in a few
microseconds. The critic (``vf_arch``) is not exported.

``gamma`` defaults to 1.0 for the time-like rewards (latency, makespan): the undiscounted return is minus the
episode's serving time (see :mod:`agents.qlearning` for why discounting biases towards large
batches); ``gae_lambda`` 0.95 keeps the advantage estimates' variance down.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

from agents.base import Agent, AgentEnv
from scheduler_runtime.decision import ObservationSpec
from scheduler_runtime.policy import MLPPolicy, Policy


@dataclass(frozen=True)
class PPOConfig:
    """MaskablePPO hyperparameters (``n_steps`` is per environment)."""

    learning_rate: float = 3e-4
    n_steps: int = 256
    batch_size: int = 64
    n_epochs: int = 10
    gamma: float = 1.0
    gae_lambda: float = 0.95
    clip_range: float = 0.2
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    net_arch: tuple[int, ...] = (64, 64)
    vf_arch: tuple[int, ...] = (64, 64)
    activation: str = "tanh"
    #: torch intra-op threads. 1: the nets are tiny, and on a small shared CPU extra threads
    #: only contend (measured: 1024 steps take 4.4 s with 1 thread, 24 s with 2 on 2 busy cores).
    torch_threads: int = 1

    def __post_init__(self) -> None:
        if self.activation not in ("tanh", "relu"):
            raise ValueError(f"ppo.activation must be 'tanh' or 'relu', got {self.activation!r}")
        if self.n_steps < 2 or self.batch_size < 2:
            raise ValueError("ppo.n_steps and ppo.batch_size must be >= 2")
        if not self.net_arch or min(self.net_arch) < 1:
            raise ValueError(f"ppo.net_arch needs at least one hidden layer, got {list(self.net_arch)}")


def make_vec_env(env_fns: list[Any], subprocess: bool = False) -> Any:
    """A VecEnv of ``Monitor(AgentEnv(env, scale_obs=True))`` from factories of raw FeatherEnvs."""
    from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv

    wrapped = [_Wrapped(fn) for fn in env_fns]
    if subprocess and len(wrapped) > 1:
        # fork would copy this process's threads (torch, tokenizers); spawn is the safe start.
        return SubprocVecEnv(wrapped, start_method="spawn")
    return DummyVecEnv(wrapped)


class _Wrapped:
    """Picklable factory: raw env factory -> Monitor(AgentEnv(scaled))."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self) -> gym.Env:
        from stable_baselines3.common.monitor import Monitor

        return Monitor(AgentEnv(self.fn(), scale_obs=True))


class PPOAgent(Agent):
    """MaskablePPO over the scaled observation (see the module docstring)."""

    name = "ppo"
    trainable = True
    checkpoint_suffix = ".zip"
    config_cls = PPOConfig

    def __init__(self, config: PPOConfig | None = None, *, seed: int = 0) -> None:
        super().__init__(config or PPOConfig(), seed=seed)
        self.model: Any = None
        self._logger: Any = None
        self._scale: np.ndarray | None = None

    def bind(self, env: Any) -> None:
        super().bind(env)
        self._scale = np.asarray(self.obs_spec.scale, dtype=np.float32)

    def set_logger(self, logger: Any) -> None:
        self._logger = logger
        if self.model is not None:
            self.model.set_logger(logger)

    @property
    def logger(self) -> Any:
        return self.model.logger if self.model is not None else self._logger

    def _as_vec_env(self, env: Any) -> Any:
        if hasattr(env, "num_envs"):
            return env
        base = env
        return make_vec_env([lambda: base])

    def build(self, env: Any) -> None:
        """Create the MaskablePPO model for ``env`` (a VecEnv or one environment)."""
        import torch
        from sb3_contrib import MaskablePPO

        vec = self._as_vec_env(env)
        c = self.config
        torch.set_num_threads(c.torch_threads)
        self.model = MaskablePPO(
            "MlpPolicy", vec, learning_rate=c.learning_rate, n_steps=c.n_steps, batch_size=c.batch_size,
            n_epochs=c.n_epochs, gamma=c.gamma, gae_lambda=c.gae_lambda, clip_range=c.clip_range,
            ent_coef=c.ent_coef, vf_coef=c.vf_coef, max_grad_norm=c.max_grad_norm, seed=self.seed,
            device="cpu", verbose=0,
            policy_kwargs={"net_arch": {"pi": list(c.net_arch), "vf": list(c.vf_arch)},
                           "activation_fn": torch.nn.Tanh if c.activation == "tanh" else torch.nn.ReLU},
        )
        if self._logger is not None:
            self.model.set_logger(self._logger)
        self.bind(vec)

    @classmethod
    def training_env(cls, make_env: Any, factories: Any, n_envs: int, seed: int) -> Any:
        """A vector of environments: in worker processes with ``n_envs > 1``, else this process's."""
        vec = make_vec_env(factories(), subprocess=True) if n_envs > 1 else make_vec_env([make_env])
        vec.seed(seed)
        return vec

    @classmethod
    def resume(cls, path: Path, loaded: Any, train_env: Any) -> PPOAgent:
        """Loaded again with the training environment (SB3 binds its model to it)."""
        agent = cls.load(path, env=train_env)
        agent.bind(train_env)
        return agent

    def prepare(self, train_env: Any, eval_env: Any) -> None:
        """Nothing: the model binds to the training environment when it is built."""

    @property
    def callback_model(self) -> Any:
        return self.model

    def learn(self, env: Any, total_timesteps: int, callback: Any = None,
              reset_num_timesteps: bool = True) -> PPOAgent:
        vec = self._as_vec_env(env)
        if self.model is None:
            self.build(vec)
        else:
            self.model.set_env(vec)
            self.bind(vec)
        self.model.learn(total_timesteps, callback=callback, reset_num_timesteps=reset_num_timesteps)
        self.num_timesteps = int(self.model.num_timesteps)
        return self

    def act(self, obs: np.ndarray, mask: np.ndarray) -> int:
        if self.model is None or self._scale is None:
            raise RuntimeError("PPO agent has no model: learn() or load() first")
        scaled = (np.asarray(obs, dtype=np.float32) / self._scale).astype(np.float32)
        action, _ = self.model.predict(scaled, action_masks=np.array(mask, dtype=bool), deterministic=True)
        return int(action)

    def predict_batch(self, obs: np.ndarray, masks: np.ndarray) -> np.ndarray:
        """Deterministic actions for many raw observations at once (SB3's own forward pass)."""
        scaled = (np.asarray(obs, dtype=np.float32) / self._scale).astype(np.float32)
        actions, _ = self.model.predict(scaled, action_masks=np.array(masks, dtype=bool),
                                        deterministic=True)
        return np.asarray(actions, dtype=np.int64)

    def to_policy(self) -> Policy:
        """The actor MLP's weights (features extractor is a flatten: nothing to export)."""
        import torch

        if self.model is None:
            raise RuntimeError("PPO agent has no model to export")
        policy = self.model.policy
        layers = []
        for module in policy.mlp_extractor.policy_net:
            if isinstance(module, torch.nn.Linear):
                layers.append((module.weight.detach().cpu().numpy().astype(np.float64),
                               module.bias.detach().cpu().numpy().astype(np.float64)))
        head = policy.action_net
        layers.append((head.weight.detach().cpu().numpy().astype(np.float64),
                       head.bias.detach().cpu().numpy().astype(np.float64)))
        return MLPPolicy(self._require_spec(), layers, self.config.activation, agent=self.name,
                         meta={"algorithm": "MaskablePPO (sb3-contrib)"})

    # -- checkpoints -----------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """SB3's zip (weights, optimizer, counters) + a JSON sidecar (our config, obs spec)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.model.save(path)
        sidecar = {"agent": self.name, "config": asdict(self.config), "seed": self.seed,
                   "obs_spec": self.obs_spec.to_dict() if self.obs_spec else None}
        _sidecar(path).write_text(json.dumps(sidecar, indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path, env: Any = None) -> PPOAgent:
        from sb3_contrib import MaskablePPO

        path = Path(path)
        meta = json.loads(_sidecar(path).read_text())
        config = PPOConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in meta["config"].items()})
        agent = cls(config, seed=meta["seed"])
        import torch

        torch.set_num_threads(config.torch_threads)
        vec = agent._as_vec_env(env) if env is not None else None
        agent.model = MaskablePPO.load(path, env=vec, device="cpu")
        agent.num_timesteps = int(agent.model.num_timesteps)
        if vec is not None:
            agent.bind(vec)
        elif meta.get("obs_spec"):
            agent.obs_spec = ObservationSpec.from_dict(meta["obs_spec"], path)
            agent._scale = np.asarray(agent.obs_spec.scale, dtype=np.float32)
        return agent


def _sidecar(path: Path) -> Path:
    zip_path = path if path.suffix == ".zip" else path.with_name(path.name + ".zip")
    return zip_path.with_suffix(".json")


__all__ = ["PPOAgent", "PPOConfig", "make_vec_env"]
