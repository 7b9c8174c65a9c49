"""The one small interface every batching agent implements, and what the agents share.

An :class:`Agent` decides ADD (1) or STOP (0) for the environment's raw observation (the batching
core's, :mod:`scheduler_runtime.decision`) and its action mask ``[STOP valid, ADD valid]``:

- ``act(obs, mask) -> int``: the deterministic decision (evaluation, export);
- ``reset()``: an episode starts (only stateful rules, like the heuristic's floor, care);
- ``learn(env, total_timesteps, callback)``: train on a :class:`FeatherEnv` (or, for PPO, a
  vectorized one); agents without parameters just play, so logging and evaluation still run;
- ``save(path)`` / ``load(path)``: a training checkpoint (resumable);
- ``to_policy()`` / ``export(path)``: the versioned, torch-free policy file that
  :func:`scheduler_runtime.policy.load_policy` reads.

Callbacks are stable-baselines3 ``BaseCallback`` objects (:mod:`agents.callbacks`). PPO hands
them to SB3; the other agents drive them with the same protocol from :meth:`EpisodicAgent.learn`
(an agent exposes ``num_timesteps``, ``logger`` and ``get_env()`` like an SB3 model), so one set
of callbacks (TensorBoard, evaluation, checkpoints, progress) serves every agent.

:class:`AgentEnv` is the wrapper every agent trains through: it optionally scales the
observation by ``env.obs_scale`` (PPO), forwards ``action_masks()``, and moves the environment's
``info["episode"]`` (the episode's serving metrics) to ``info["feather_episode"]`` with the
episode's mean delta added, because SB3's ``Monitor`` owns ``info["episode"]`` (return, length).

:func:`evaluate` plays an agent on held-out episodes and reports end-to-end figures.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

import gymnasium as gym
import numpy as np

from scheduler_runtime.decision import ADD, GROUP_OBS_NAMES, STOP, ObservationSpec
from scheduler_runtime.policy import Policy, write_policy
from scheduler_runtime.rules import GroupBins, TableBins

__all__ = [
    "ADD",
    "STOP",
    "Agent",
    "AgentEnv",
    "EpisodicAgent",
    "HELD_OUT_SEED",
    "NotExportableError",
    "evaluate",
]

#: First episode seed of the benchmarks' held-out episodes (``benchmarks/agents.py``,
#: ``benchmarks/admission_rules.py``, :mod:`agents.agreement`): episodes ``HELD_OUT_SEED + i``.
HELD_OUT_SEED = 2_000_000


@dataclass(frozen=True)
class TableBinsConfig:
    """The state bins shared by the tabular agents (UCB, Q-learning): for the request decision,
    docs/design.md's ``(min(B//batch_div, batch_max), clip(delta, -delta_clip, delta_clip),
    min(w//w_div, w_max))``; for the group decision, :class:`~scheduler_runtime.rules.GroupBins`
    with the ``group_*`` knobs."""

    batch_div: int = TableBins.batch_div  # the runtime's defaults, one source for both
    batch_max: int = TableBins.batch_max
    delta_clip: int = TableBins.delta_clip
    w_div: int = TableBins.w_div
    w_max: int = TableBins.w_max
    group_in_flight_max: int = GroupBins.in_flight_max
    group_waiting_groups_div: int = GroupBins.waiting_groups_div
    group_waiting_groups_max: int = GroupBins.waiting_groups_max
    group_kv_levels: int = GroupBins.kv_levels

    @property
    def bins(self) -> TableBins:
        return TableBins(self.batch_div, self.batch_max, self.delta_clip, self.w_div, self.w_max)

    def bins_for(self, spec: ObservationSpec | None) -> TableBins | GroupBins:
        """The bins of the decision ``spec`` observes (the paper's when it is not the group one)."""
        if spec is not None and spec.names == GROUP_OBS_NAMES:
            return GroupBins(in_flight_max=self.group_in_flight_max,
                             waiting_groups_div=self.group_waiting_groups_div,
                             waiting_groups_max=self.group_waiting_groups_max,
                             kv_levels=self.group_kv_levels)
        return self.bins

class NotExportableError(NotImplementedError):
    """The agent needs information the runtime does not have (e.g. the oracle's group ids)."""


class AgentEnv(gym.Wrapper):
    """What an agent trains on: optional observation scaling, masks, episode statistics.

    Args:
        env: a :class:`feather_env.env.FeatherEnv` (or a wrapper of one).
        scale_obs: divide observations by ``env.obs_scale`` (values in [-1, 1]; PPO).
    """

    def __init__(self, env: gym.Env, scale_obs: bool = False) -> None:
        super().__init__(env)
        self.scale_obs = scale_obs
        base = env.unwrapped
        self.obs_scale = np.asarray(base.obs_scale, dtype=np.float32)
        # Small attributes a vectorized env can fetch from its workers (the env itself, with
        # its engine, cannot be pickled): what an exported policy's observation spec needs.
        self.raw_observation_space = base.observation_space
        self.obs_names = tuple(base.obs_names)
        self.chunk_size = int(base.chunk_size)
        if scale_obs:
            space = base.observation_space
            self.observation_space = gym.spaces.Box(space.low / self.obs_scale, space.high / self.obs_scale,
                                                    dtype=np.float32)
        self._deltas: list[float] = []
        self._added: list[float] = []
        self._last_raw: np.ndarray | None = None

    def _out(self, obs: np.ndarray) -> np.ndarray:
        self._last_raw = obs
        return (obs / self.obs_scale).astype(np.float32) if self.scale_obs else obs

    def reset(self, **kwargs: Any):
        obs, info = self.env.reset(**kwargs)
        self._deltas, self._added = [], []
        return self._out(obs), info

    def step(self, action: Any):
        raw = self._last_raw
        if raw is not None:
            self._deltas.append(float(raw[1]))
            if int(action) == ADD:
                self._added.append(float(raw[1]))
        obs, reward, terminated, truncated, info = self.env.step(action)
        if "episode" in info:
            info = dict(info)
            ep = dict(info.pop("episode"))
            ep["mean_delta"] = float(np.mean(self._deltas)) if self._deltas else 0.0
            ep["mean_delta_added"] = float(np.mean(self._added)) if self._added else 0.0
            info["feather_episode"] = ep
        return self._out(obs), reward, terminated, truncated, info

    def action_masks(self) -> np.ndarray:
        return self.env.unwrapped.action_masks()


class Agent(ABC):
    """A batching policy (see the module docstring). Subclasses set ``name``."""

    name: ClassVar[str] = ""
    #: Whether ``learn`` changes the agent (the heuristic and references only play).
    trainable: ClassVar[bool] = False
    #: The file :meth:`save` writes (numpy's; PPO: SB3's ``.zip``).
    checkpoint_suffix: ClassVar[str] = ".npz"

    def __init__(self, config: Any = None, *, seed: int = 0) -> None:
        self.config = config
        self.seed = seed
        self.num_timesteps = 0
        self.obs_spec: ObservationSpec | None = None

    @abstractmethod
    def act(self, obs: np.ndarray, mask: np.ndarray) -> int:
        """Deterministic action (0 STOP, 1 ADD) for a raw observation and its mask."""

    def reset(self) -> None:  # noqa: B027 - optional hook, most agents are stateless
        """An episode starts."""

    def bind(self, env: Any) -> None:
        """Remember the environment's observation spec (needed to export)."""
        self.obs_spec = ObservationSpec.from_env(env)
        self.observation_changed()

    def observation_changed(self) -> None:  # noqa: B027 - optional hook
        """:attr:`obs_spec` was set (the tabular agents pick their bins from it)."""

    def learn(self, env: gym.Env, total_timesteps: int, callback: Any = None,
              reset_num_timesteps: bool = True) -> Agent:
        raise NotImplementedError(f"agent {self.name!r} does not learn")

    # -- how a run trains this kind of agent (agents.training.run asks, whatever the agent) -----
    @classmethod
    def training_env(cls, make_env: Callable[[], gym.Env], factories: Callable[[], list[Any]],
                     n_envs: int, seed: int) -> Any:
        """The environment a run trains this agent on: one environment (``make_env``), or ``None``
        with ``n_envs > 1`` (:meth:`train` then steps worker processes of its own)."""
        return None if n_envs > 1 else make_env()

    @classmethod
    def resume(cls, path: Path, loaded: Agent, train_env: Any) -> Agent:
        """The agent a run continues, from its checkpoint at ``path`` (``loaded``: it read and
        checked before the run started)."""
        return loaded

    def prepare(self, train_env: Any, eval_env: Any) -> None:
        """Before training: remember the observation spec (of the evaluation environment, which
        every kind of training environment shares)."""
        self.bind(eval_env)

    def train(self, train_env: Any, steps: int, callback: Any, reset_num_timesteps: bool,
              parallel: Callable[[Agent, Any], None] | None = None) -> None:
        """Train ``steps`` more (``parallel``: a run's worker processes, when ``train_env`` is None)."""
        if train_env is None:
            if parallel is None:
                raise ValueError(f"agent {self.name!r}: no training environment and no workers")
            parallel(self, callback)
        else:
            self.learn(train_env, steps, callback=callback, reset_num_timesteps=reset_num_timesteps)

    @property
    def callback_model(self) -> Any:
        """What SB3's callbacks are initialised with (the agent; PPO: its SB3 model)."""
        return self

    def save(self, path: str | Path) -> Path:
        raise NotImplementedError(f"agent {self.name!r} has no checkpoint")

    def save_checkpoint(self, directory: Path) -> Path:
        """``directory/<agent>_<steps>_steps<suffix>`` and ``latest.json`` pointing at it (what
        ``--resume`` continues from), the pointer written last: a crash mid-save leaves the previous
        one valid."""
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{self.name}_{int(self.num_timesteps)}_steps{self.checkpoint_suffix}"
        self.save(path)
        pointer = {"path": path.name, "num_timesteps": int(self.num_timesteps), "agent": self.name}
        tmp = directory / "latest.json.tmp"
        tmp.write_text(json.dumps(pointer))
        tmp.replace(directory / "latest.json")
        return path

    @classmethod
    def load(cls, path: str | Path, env: gym.Env | None = None) -> Agent:
        raise NotImplementedError(f"agent {cls.name!r} has no checkpoint")

    def to_policy(self) -> Policy:
        raise NotExportableError(f"agent {self.name!r} cannot be exported")

    def export(self, path: str | Path, meta: dict[str, Any] | None = None) -> Path:
        """Write the versioned policy file (see :mod:`scheduler_runtime.policy`)."""
        policy = self.to_policy()
        policy.meta = {**policy.meta, **(meta or {}), "num_timesteps": int(self.num_timesteps)}
        return write_policy(path, policy)

    def _require_spec(self) -> ObservationSpec:
        if self.obs_spec is None:
            raise RuntimeError(f"agent {self.name!r}: call bind(env) or learn() before exporting")
        return self.obs_spec


class _NullLogger:
    def record(self, *a: Any, **k: Any) -> None: ...
    def record_mean(self, *a: Any, **k: Any) -> None: ...
    def dump(self, *a: Any, **k: Any) -> None: ...


class EpisodicAgent(Agent):
    """An agent trained by stepping one environment in this process (tabular agents, heuristic).

    :meth:`learn` runs the environment, calls :meth:`explore` for actions and :meth:`observe`
    after each step, and drives SB3 callbacks as SB3 would (``init_callback``,
    ``on_training_start``, ``update_locals`` + ``on_step`` per step, ``on_training_end``).
    Subclasses with a table implement :meth:`state_dict`/:meth:`load_state_dict` for
    checkpoints and :meth:`merge` for parallel workers.
    """

    #: Dump the logger at the first episode end after this many steps.
    log_interval_steps: ClassVar[int] = 500

    def __init__(self, config: Any = None, *, seed: int = 0) -> None:
        super().__init__(config, seed=seed)
        self.rng = np.random.default_rng(seed)
        self.logger: Any = _NullLogger()
        self._env: gym.Env | None = None

    # SB3 callback protocol
    def get_env(self) -> gym.Env | None:
        return self._env

    def set_logger(self, logger: Any) -> None:
        self.logger = logger

    def explore(self, obs: np.ndarray, mask: np.ndarray) -> int:
        """Training-time action (exploration); defaults to :meth:`act`."""
        return self.act(obs, mask)

    def observe(self, obs: np.ndarray, action: int, reward: float, next_obs: np.ndarray,
                next_mask: np.ndarray, done: bool, info: dict[str, Any]) -> None:
        """One transition, after the environment stepped."""

    def train_metrics(self) -> dict[str, float]:
        """Scalars logged under ``train/`` (losses and such), reset on read."""
        return {}

    def learn(self, env: gym.Env, total_timesteps: int, callback: Any = None,
              reset_num_timesteps: bool = True) -> EpisodicAgent:
        """Step ``env`` until ``num_timesteps`` reaches ``total_timesteps`` (counting from 0
        when ``reset_num_timesteps``, else from the current count)."""
        if not isinstance(env, AgentEnv):
            env = AgentEnv(env, scale_obs=False)
        self._env = env
        self.bind(env)
        if reset_num_timesteps:
            self.num_timesteps = 0
        # SB3's convention: without a reset, train for total_timesteps more.
        target = self.num_timesteps + total_timesteps
        if callback is not None:
            callback.init_callback(self)
            callback.on_training_start({"total_timesteps": target}, {})
        obs, _ = env.reset(seed=self.seed + self.num_timesteps)
        self.reset()
        ep_return, ep_len, last_dump = 0.0, 0, self.num_timesteps
        while self.num_timesteps < target:
            mask = env.action_masks()
            action = self.explore(obs, mask)
            next_obs, reward, terminated, truncated, info = env.step(action)
            done = terminated or truncated
            self.num_timesteps += 1
            ep_return += reward
            ep_len += 1
            self.observe(obs, action, float(reward), next_obs, env.action_masks(), done, info)
            if done:
                info = {**info, "episode": {"r": ep_return, "l": ep_len}}
            if callback is not None:
                callback.update_locals({"infos": [info], "rewards": np.array([reward]),
                                        "dones": np.array([done]), "actions": np.array([action]),
                                        "new_obs": next_obs[None], "total_timesteps": target})
                if not callback.on_step():
                    break
            if done:
                if self.num_timesteps - last_dump >= self.log_interval_steps:
                    for key, value in self.train_metrics().items():
                        self.logger.record(f"train/{key}", value)
                    self.logger.dump(self.num_timesteps)
                    last_dump = self.num_timesteps
                obs, _ = env.reset()
                self.reset()
                ep_return, ep_len = 0.0, 0
            else:
                obs = next_obs
        for key, value in self.train_metrics().items():
            self.logger.record(f"train/{key}", value)
        self.logger.dump(self.num_timesteps)
        if callback is not None:
            callback.on_training_end()
        return self

    # checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, np.ndarray]:
        """Arrays to checkpoint (tables)."""
        return {}

    def load_state_dict(self, arrays: dict[str, np.ndarray]) -> None:
        """Inverse of :meth:`state_dict`."""

    def save(self, path: str | Path) -> Path:
        """One ``.npz``: the arrays of :meth:`state_dict` + JSON metadata (config, counters, rng)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "agent": self.name,
            "config": asdict(self.config) if self.config is not None else None,
            "seed": self.seed,
            "num_timesteps": int(self.num_timesteps),
            "rng": self.rng.bit_generator.state,
            "obs_spec": self.obs_spec.to_dict() if self.obs_spec else None,
        }
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez(tmp, __meta__=np.array(json.dumps(meta)), **self.state_dict())
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path, env: gym.Env | None = None) -> EpisodicAgent:
        path = Path(path)
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(str(data["__meta__"]))
            arrays = {k: data[k] for k in data.files if k != "__meta__"}
        if meta.get("agent") != cls.name:
            raise ValueError(f"{path}: checkpoint of agent {meta.get('agent')!r}, not {cls.name!r}")
        config_cls = getattr(cls, "config_cls", None)
        config = config_cls(**meta["config"]) if config_cls and meta["config"] is not None else None
        agent = cls(config, seed=meta["seed"])
        agent.num_timesteps = meta["num_timesteps"]
        agent.rng.bit_generator.state = meta["rng"]
        if meta.get("obs_spec"):
            agent.obs_spec = ObservationSpec.from_dict(meta["obs_spec"], path)
            agent.observation_changed()
        if env is not None:
            agent.bind(env)
        agent.load_state_dict(arrays)
        return agent

    @classmethod
    def merge(cls, base: dict[str, np.ndarray], workers: Sequence[dict[str, np.ndarray]]
              ) -> dict[str, np.ndarray]:
        """Combine the state dicts of workers that each trained from ``base`` (see subclasses)."""
        return dict(base)


def evaluate(agent: Any, env: gym.Env, seeds: Sequence[int]) -> dict[str, Any]:
    """Serve one episode per seed with ``agent``'s deterministic decisions; end-to-end figures.

    ``seeds`` are episode seeds (:meth:`feather_env.scenarios.Scenario.episode_workload`), so two
    agents evaluated on the same seeds serve the same requests. ``output_throughput`` is the
    output tokens of all episodes over their summed durations (a throughput, not a mean of
    ratios); ``mean_e2el_s`` is over all requests of all episodes. ``agent`` is anything with
    ``act(obs, mask)`` (an :class:`Agent` or a loaded policy); ``env`` a raw ``FeatherEnv`` or a
    wrapper of one (agents act on raw observations; PPO scales them itself).
    """
    from feather_env.env import play_episode

    base = env.unwrapped
    episodes = [play_episode(base, agent, episode_seed=int(seed)) for seed in seeds]
    tokens = sum(ep["total_output_tokens"] for ep in episodes)
    duration = sum(ep["duration"] for ep in episodes)
    requests = sum(ep["completed"] for ep in episodes)
    prompt = sum(ep["total_input_tokens"] for ep in episodes)
    e2el = sum(ep["mean_e2el_ms"] * ep["completed"] for ep in episodes) / 1000.0 / max(requests, 1)
    hits = sum(ep["prefix_hit_rate"] * ep["total_input_tokens"] for ep in episodes)
    return {
        "output_throughput": tokens / duration if duration else 0.0,
        "request_throughput": requests / duration if duration else 0.0,
        "mean_e2el_s": e2el,
        "prefix_hit_rate": hits / prompt if prompt else 0.0,
        "mean_return": float(np.mean([ep["return"] for ep in episodes])),
        "mean_episode_length": float(np.mean([ep["decisions"] for ep in episodes])),
        "duration_s": duration,
        "episodes": [{k: ep[k] for k in ("episode_seed", "return", "output_throughput", "duration",
                                         "mean_e2el_ms", "p99_e2el_ms", "prefix_hit_rate", "decisions",
                                         "adds", "stops", "completed")} for ep in episodes],
    }
