"""Train a batching agent on the Feather environment, log it, checkpoint it, and export its policy.

    python train.py --agent {heuristic,ucb,qlearning,ppo} --config configs/<file>.yaml
                    [--backend sim|vllm] [--timesteps N] [--seed S] [--out DIR] [--n-envs N] [--resume]

Every knob of a run lives in the YAML config (sections ``env``, ``workload``, ``agent``,
``train``, ``engine``); each section is validated (an unknown key is an error that lists the
valid ones), the command-line flags override ``train.*``, and the effective config is printed,
logged to TensorBoard (text + hparams) and saved as ``OUT/config.yaml`` next to the checkpoints.

What a run writes in ``--out`` (default ``runs/<agent>-<config name>``):

- ``config.yaml``: the effective config;
- ``tb/``: TensorBoard logs (``rollout/``: episode return and length, decode throughput, batch
  size, delta; ``train/``: losses (PPO) or TD error / credit error (tabular); ``eval/``: the
  periodic evaluation on held-out seeds) and ``progress.csv`` with the same scalars;
- ``checkpoints/``: periodic checkpoints and ``latest.json`` (what ``--resume`` continues from);
- ``policy.feather``: the exported policy (:func:`scheduler_runtime.policy.load_policy`);
- ``summary.json``: final evaluation, timesteps, wall time.

Callbacks are stable-baselines3 callbacks (:class:`EpisodeStatsCallback`, :class:`EvalCallback`,
:class:`CheckpointCallback`, :class:`ProgressCallback`); PPO runs them inside SB3, the other
agents drive them from their own loop (:class:`agents.base.EpisodicAgent`).

Seeds: training episodes come from the environment's generator seeded with ``train.seed``;
evaluation episode ``i`` uses seed ``train.eval_seed + i`` (held out: a training episode draws
its seed from 2^31 values, so it repeats an evaluation seed with negligible probability).

``--n-envs N``: N environments in separate processes, each with its own backend. PPO uses
SB3's ``SubprocVecEnv``. The tabular agents run N independent workers (each its own agent copy,
environment and seed) for ``train.sync_every`` steps each, then merge their tables (UCB: pooled
means and summed counts; Q-learning: count-weighted means of Q; see ``merge`` in each agent),
send the merged table back and go on; callbacks (logging, evaluation, checkpoints) run in the
main process after each merge.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from scheduler_runtime.config import ConfigError, from_mapping, load_yaml
from scheduler_runtime.prefix_index import DEFAULT_CHUNK_SIZE

REPO_ROOT = Path(__file__).resolve().parent
SECTIONS = ("env", "workload", "agent", "train", "engine")


# -- configuration ------------------------------------------------------------------------------
@dataclass(frozen=True)
class EnvSection:
    """``FeatherEnv`` arguments (see its docstring); ``profile`` is the simulator's profile JSON."""

    waiting: int = 64
    max_batch_size: int = 64
    chunk_size: int = DEFAULT_CHUNK_SIZE
    groups_per_episode: int | None = None
    max_per_group: int | None = None
    reward: str = "makespan"
    reward_scale: float | None = None
    extended_obs: bool = False
    delta_clip: int = 64
    kv_capacity_tokens: int | None = None
    profile: str | None = None
    warm_prefixes: bool = True


@dataclass(frozen=True)
class TrainSection:
    """How long and how to train, evaluate and checkpoint.

    Attributes:
        timesteps: environment steps in total (decisions, over all environments).
        seed: seeds the agent and the training environments.
        backend: ``"sim"`` (the calibrated simulator) or ``"vllm"`` (the real engine).
        n_envs: environments in separate processes (1: in this process).
        eval_every: evaluate every this many timesteps (0: only at the end).
        eval_episodes: episodes per evaluation, seeds ``eval_seed + i``.
        eval_seed: first held-out evaluation seed.
        checkpoint_every: checkpoint every this many timesteps (0: only at the end).
        sync_every: tabular agents with ``n_envs > 1``: steps per worker between merges.
        progress_bar: show a progress bar.
        compare_with: reference agents (e.g. ``always-add``) evaluated at the end on the same
            held-out seeds, printed next to the trained agent (``make demo``).
    """

    timesteps: int = 20_000
    seed: int = 0
    backend: str = "sim"
    n_envs: int = 1
    eval_every: int = 5_000
    eval_episodes: int = 5
    eval_seed: int = 1_000_000
    checkpoint_every: int = 10_000
    sync_every: int = 2_000
    progress_bar: bool = True
    compare_with: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.backend not in ("sim", "vllm"):
            raise ConfigError(f"train.backend must be 'sim' or 'vllm', got {self.backend!r}")
        for name in ("timesteps", "n_envs", "eval_episodes", "sync_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("eval_every", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise ConfigError(f"train.{name} must be >= 0, got {getattr(self, name)}")
        if isinstance(self.compare_with, str):
            object.__setattr__(self, "compare_with", (self.compare_with,))
        refs = ("always-add", "oracle", "random", "heuristic")
        bad = [name for name in self.compare_with if name not in refs]
        if bad:
            raise ConfigError(f"train.compare_with: {bad} are not reference agents; choose from {list(refs)}")


@dataclass(frozen=True)
class RunConfig:
    """A whole run: the validated sections (``workload``/``engine`` stay mappings, validated by
    ``WorkloadConfig``/``EngineConfig``)."""

    agent_name: str
    agent: Any
    env: EnvSection = field(default_factory=EnvSection)
    train: TrainSection = field(default_factory=TrainSection)
    workload: dict[str, Any] | None = None
    engine: dict[str, Any] = field(default_factory=dict)
    source: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The effective config as a YAML-able mapping (the format :func:`load_config` reads)."""
        agent = {"name": self.agent_name, **(asdict(self.agent) if self.agent is not None else {})}
        return _plain({"env": asdict(self.env), "workload": self.workload, "agent": agent,
                       "train": asdict(self.train), "engine": self.engine})


def _plain(obj: Any) -> Any:
    """Tuples -> lists, recursively (YAML/JSON friendly)."""
    if isinstance(obj, Mapping):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_plain(v) for v in obj]
    return obj


def parse_config(data: Mapping[str, Any], agent: str | None = None, *, where: str = "config") -> RunConfig:
    """Validate a config mapping; ``agent`` (from ``--agent``) must match ``agent.name`` if both exist."""
    from agents.registry import TRAINABLE, config_class
    from feather_env.engine import EngineConfig
    from feather_env.workloads import WorkloadConfig

    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping")
    unknown = sorted(set(data) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"{where}: unknown section(s) {unknown}; valid sections are {list(SECTIONS)}")
    agent_section = dict(data.get("agent") or {})
    name = agent_section.pop("name", None)
    if agent is not None and name is not None and agent != name:
        raise ConfigError(f"{where}: --agent {agent} but the config's agent section is for {name!r}")
    name = agent or name
    if name is None:
        raise ConfigError(f"{where}: no agent given (--agent or agent.name); choose from {list(TRAINABLE)}")
    if name not in TRAINABLE:
        raise ConfigError(f"{where}: agent {name!r} cannot be trained; choose from {list(TRAINABLE)}")
    cls = config_class(name)
    try:
        agent_cfg = from_mapping(cls, agent_section, where=f"{where}: agent ({name})")
    except ValueError as exc:  # the config dataclasses' own range checks
        raise ConfigError(str(exc)) from exc
    env = from_mapping(EnvSection, data.get("env"), where=f"{where}: env")
    train = from_mapping(TrainSection, data.get("train"), where=f"{where}: train")
    workload = data.get("workload")
    if workload is not None:
        WorkloadConfig.from_mapping(workload, where=f"{where}: workload")
        workload = dict(workload)
    engine = dict(data.get("engine") or {})
    EngineConfig.from_dict({"max_num_seqs": env.max_batch_size, **engine}, where=f"{where}: engine")
    return RunConfig(name, agent_cfg, env, train, workload, engine, source=where)


def load_config(path: str | Path, agent: str | None = None, **train_overrides: Any) -> RunConfig:
    """Read and validate a YAML config; non-``None`` ``train_overrides`` replace ``train.*``."""
    data = load_yaml(path)
    overrides = {k: v for k, v in train_overrides.items() if v is not None}
    if overrides:
        data = {**data, "train": {**(data.get("train") or {}), **overrides}}
    return parse_config(data, agent, where=str(path))


# -- environments -------------------------------------------------------------------------------
def build_workload(cfg: RunConfig) -> Any:
    """The run's workload (``None``: the environment's embedded default)."""
    if cfg.workload is None:
        return None
    from feather_env.workloads import build_workload as _build

    return _build(cfg.workload)


def make_env(cfg: RunConfig, backend: Any = None, workload: Any = None) -> Any:
    """A raw ``FeatherEnv`` for the run (``backend``: a Backend object to share, else the config's)."""
    from feather_env.env import FeatherEnv

    e = asdict(cfg.env)
    profile, warm = e.pop("profile"), e.pop("warm_prefixes")
    if backend is None:
        backend = cfg.train.backend
    engine = {"max_num_seqs": cfg.env.max_batch_size, **cfg.engine} if backend == "vllm" else None
    if workload is None:
        workload = cfg.workload
    return FeatherEnv(backend, workload, profile=profile, engine=engine, warm_prefixes=warm, **e)


class EnvFactory:
    """Picklable ``FeatherEnv`` factory for a worker process (it builds its own backend)."""

    def __init__(self, config: dict[str, Any], agent: str) -> None:
        self.config = config
        self.agent = agent

    def __call__(self) -> Any:
        return make_env(parse_config(self.config, self.agent, where="worker config"))


# -- callbacks ----------------------------------------------------------------------------------
def _callbacks_base() -> type:
    # Imported on use: SB3 pulls in torch, which config parsing and --help do not need.
    from stable_baselines3.common.callbacks import BaseCallback

    return BaseCallback


def _make_callback_classes() -> dict[str, type]:
    BaseCallback = _callbacks_base()

    class EpisodeStatsCallback(BaseCallback):
        """``rollout/`` scalars from the environment's infos: per episode and per batch."""

        def _on_step(self) -> bool:
            for info in self.locals.get("infos", []):
                ep = info.get("feather_episode")
                if ep:
                    self.logger.record_mean("rollout/decode_tok_s", ep["decode_tok_s"])
                    self.logger.record_mean("rollout/episode_batches", ep["batches"])
                    self.logger.record_mean("rollout/mean_batch_size", ep["mean_batch_size"])
                    self.logger.record_mean("rollout/mean_delta", ep["mean_delta"])
                    self.logger.record_mean("rollout/mean_delta_added", ep["mean_delta_added"])
                    self.logger.record_mean("rollout/episode_seconds", ep["total_seconds"])
                mon = info.get("episode")
                if mon:
                    self.logger.record_mean("rollout/ep_return", mon["r"])
                    self.logger.record_mean("rollout/ep_len", mon["l"])
                batch = info.get("batch")
                if batch:
                    self.logger.record_mean("rollout/batch_size", batch["batch_size"])
                    self.logger.record_mean("rollout/batch_prefix_groups", batch["prefix_groups"])
                    self.logger.record_mean("rollout/batch_decode_tok_s", batch["decode_tok_s"])
            return True

    class EvalCallback(BaseCallback):
        """Evaluate the agent's deterministic policy on held-out seeds every ``every`` timesteps."""

        def __init__(self, agent: Any, env: Any, seeds: Sequence[int], every: int,
                     history: list[dict[str, Any]]) -> None:
            super().__init__()
            self.agent, self.env, self.seeds, self.every = agent, env, list(seeds), every
            self.history = history
            self._next = every

        def _init_callback(self) -> None:
            if self.every:  # a resumed run starts past 0
                self._next = (int(self.model.num_timesteps) // self.every + 1) * self.every

        def run_eval(self) -> dict[str, Any]:
            from agents.base import evaluate

            res = evaluate(self.agent, self.env, self.seeds)
            steps = int(self.agent.num_timesteps if hasattr(self.agent, "num_timesteps") else 0)
            steps = max(steps, int(self.num_timesteps))
            for key in ("decode_tok_s", "mean_return", "mean_batch_size", "mean_batches",
                        "mean_episode_length"):
                self.logger.record(f"eval/{key}", res[key])
            self.history.append({"timesteps": steps, **{k: v for k, v in res.items() if k != "episodes"}})
            self.logger.dump(steps)  # as SB3's EvalCallback: the point lands at this step
            return res

        def _on_step(self) -> bool:
            if self.every and self.num_timesteps >= self._next:
                self.run_eval()
                self._next = (self.num_timesteps // self.every + 1) * self.every
            return True

    class CheckpointCallback(BaseCallback):
        """Save the agent every ``every`` timesteps under ``directory`` and point ``latest.json`` at it."""

        def __init__(self, agent: Any, directory: Path, every: int) -> None:
            super().__init__()
            self.agent, self.directory, self.every = agent, Path(directory), every
            self._next = every

        def _init_callback(self) -> None:
            if self.every:  # a resumed run starts past 0
                self._next = (int(self.model.num_timesteps) // self.every + 1) * self.every

        def save(self) -> Path:
            return save_checkpoint(self.agent, self.directory)

        def _on_step(self) -> bool:
            if self.every and self.num_timesteps >= self._next:
                self.agent.num_timesteps = max(int(self.agent.num_timesteps), int(self.num_timesteps))
                self.save()
                self._next = (self.num_timesteps // self.every + 1) * self.every
            return True

    class ProgressCallback(BaseCallback):
        """A tqdm progress bar over timesteps, with the last evaluation's decode throughput."""

        def __init__(self, total: int, history: list[dict[str, Any]]) -> None:
            super().__init__()
            self.total, self.history = total, history
            self.bar: Any = None
            self._shown = 0

        def _on_training_start(self) -> None:
            from tqdm import tqdm

            self._shown = int(self.num_timesteps)
            self.bar = tqdm(total=self.total, initial=self._shown, unit="step", dynamic_ncols=True,
                            file=sys.stdout)

        def _on_step(self) -> bool:
            now = min(int(self.num_timesteps), self.total)
            if now > self._shown:
                self.bar.update(now - self._shown)
                self._shown = now
                if self.history:
                    self.bar.set_postfix(eval_tok_s=f"{self.history[-1]['decode_tok_s']:.0f}", refresh=False)
            return True

        def _on_training_end(self) -> None:
            if self.bar is not None:
                self.bar.close()

    return {c.__name__: c for c in (EpisodeStatsCallback, EvalCallback, CheckpointCallback,
                                    ProgressCallback)}


def checkpoint_suffix(agent: Any) -> str:
    return ".zip" if agent.name == "ppo" else ".npz"


def save_checkpoint(agent: Any, directory: Path) -> Path:
    """``directory/<agent>_<steps>_steps<suffix>`` + ``latest.json`` (written last: a crash mid-save
    leaves the previous pointer valid)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{agent.name}_{int(agent.num_timesteps)}_steps{checkpoint_suffix(agent)}"
    agent.save(path)
    pointer = {"path": path.name, "num_timesteps": int(agent.num_timesteps), "agent": agent.name}
    tmp = directory / "latest.json.tmp"
    tmp.write_text(json.dumps(pointer))
    tmp.replace(directory / "latest.json")
    return path


# -- logging ------------------------------------------------------------------------------------
def make_logger(out: Path, cfg: RunConfig) -> Any:
    """SB3 logger writing TensorBoard + CSV to ``out/tb``; the config goes in as text and hparams."""
    from stable_baselines3.common.logger import HParam, TensorBoardOutputFormat, configure

    csv = out / "tb" / "progress.csv"
    if csv.exists():  # a resumed run: SB3 would truncate the earlier run's CSV
        csv.replace(csv.with_name(f"progress-{time.strftime('%Y%m%d-%H%M%S')}.csv"))
    logger = configure(str(out / "tb"), ["tensorboard", "csv"])
    text = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    for fmt in logger.output_formats:
        if isinstance(fmt, TensorBoardOutputFormat):
            fmt.writer.add_text("config", "```yaml\n" + text + "```", 0)
            fmt.writer.flush()
    flat = _flatten(cfg.to_dict())
    hparams = {k: v if isinstance(v, bool | int | float | str) else str(v) for k, v in flat.items()}
    logger.record("hparams", HParam(hparams, {"eval/decode_tok_s": 0.0, "eval/mean_return": 0.0}),
                  exclude=("stdout", "log", "json", "csv"))
    logger.dump(0)
    return logger


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in (d or {}).items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


# -- parallel tabular workers -------------------------------------------------------------------
def _tabular_worker(conn: Any, config: dict[str, Any], agent_name: str, rank: int) -> None:
    """Worker process: own env + agent copy; trains ``steps`` from the state it is sent, returns
    its state and the infos of the episodes it finished."""
    from agents.registry import make_agent

    cfg = parse_config(config, agent_name, where="worker config")
    env = make_env(cfg)
    agent = make_agent(agent_name, cfg.agent, seed=cfg.train.seed + 1000 * (rank + 1))
    collector = _make_collector()
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                break
            state, start, steps, exploration = msg
            agent.load_state_dict(state)
            agent.num_timesteps = start
            if exploration is not None:
                agent.exploration_timesteps = exploration
            collector.infos = []
            agent.learn(env, steps, callback=collector, reset_num_timesteps=False)
            conn.send((agent.state_dict(), collector.infos))
    finally:
        env.close()
        conn.close()


def _make_collector() -> Any:
    BaseCallback = _callbacks_base()

    class Collector(BaseCallback):
        def __init__(self) -> None:
            super().__init__()
            self.infos: list[dict[str, Any]] = []

        def _on_step(self) -> bool:
            for info in self.locals.get("infos", []):
                keep = {k: info[k] for k in ("feather_episode", "episode", "batch") if k in info}
                if keep:
                    self.infos.append(keep)
            return True

    return Collector()


def learn_parallel_tabular(agent: Any, cfg: RunConfig, total: int, callback: Any) -> None:
    """Independent workers, merged every ``sync_every`` steps each (see the module docstring)."""
    n = cfg.train.n_envs
    ctx = mp.get_context("spawn")
    conns, procs = [], []
    config = cfg.to_dict()
    for rank in range(n):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_tabular_worker, args=(child, config, cfg.agent_name, rank), daemon=True)
        p.start()
        conns.append(parent)
        procs.append(p)
    if agent.name == "qlearning" and agent.config.exploration_timesteps is None:
        agent.exploration_timesteps = max(1, int(agent.config.exploration_fraction * total))
    try:
        callback.init_callback(agent)
        callback.on_training_start({"total_timesteps": total}, {})
        while agent.num_timesteps < total:
            per_worker = min(cfg.train.sync_every, max(1, (total - agent.num_timesteps) // n))
            base = agent.state_dict()
            exploration = getattr(agent, "exploration_timesteps", None)
            for conn in conns:
                conn.send((base, agent.num_timesteps, per_worker, exploration))
            results = [conn.recv() for conn in conns]
            agent.load_state_dict(type(agent).merge(base, [state for state, _ in results]))
            agent.num_timesteps += per_worker * n
            infos = [info for _, worker_infos in results for info in worker_infos]
            callback.update_locals({"infos": infos})
            for key, value in agent.train_metrics().items():
                agent.logger.record(f"train/{key}", value)
            if not callback.on_step():
                break
            agent.logger.dump(agent.num_timesteps)
        callback.on_training_end()
    finally:
        for conn in conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()


# -- the run ------------------------------------------------------------------------------------
@dataclass
class TrainResult:
    out: Path
    policy_path: Path
    checkpoint: Path
    num_timesteps: int
    final_eval: dict[str, Any]
    eval_history: list[dict[str, Any]]
    wall_s: float


def _check_resume_config(out: Path, cfg: RunConfig) -> None:
    saved_path = out / "config.yaml"
    if not saved_path.is_file():
        raise ConfigError(f"--resume: {saved_path} not found (nothing to resume in {out})")
    saved = _flatten(yaml.safe_load(saved_path.read_text()) or {})
    now = _flatten(cfg.to_dict())
    # The run may be extended, and its bookkeeping changed; nothing that shapes learning.
    free = {"train.timesteps", "train.progress_bar", "train.eval_every", "train.checkpoint_every"}
    diff = sorted(k for k in set(saved) | set(now) if k not in free and saved.get(k) != now.get(k))
    if diff:
        details = ", ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in diff[:8])
        raise ConfigError(f"--resume: the config differs from the run's saved config in {out}: {details}")


def _resume_checkpoint(ckpt_dir: Path) -> Path:
    """The checkpoint ``ckpt_dir/latest.json`` points at, checked before anything loads it.

    The pointer names a file *in* ``ckpt_dir`` (what :func:`save_checkpoint` writes): an absolute
    path, a ``..``, or a link out of the folder is refused, since the agents' loaders unpickle
    (SB3's cloudpickle) and must only read this run's own checkpoints.
    """
    latest = ckpt_dir / "latest.json"
    if not latest.is_file():
        raise ConfigError(f"--resume: {latest} not found (no checkpoint to resume from)")
    try:
        pointer = json.loads(latest.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--resume: {latest} is not a JSON object: {exc}") from None
    if not isinstance(pointer, dict):
        raise ConfigError(f"--resume: {latest} is not a JSON object")
    name = pointer.get("path")
    where = f"--resume: {latest}: 'path' must name a checkpoint file in {ckpt_dir}"
    if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name or "\\" in name:
        raise ConfigError(f"{where}, got {name!r}")
    path = ckpt_dir / name
    if not path.exists():
        raise ConfigError(f"--resume: {latest} points at {name}, but {path} does not exist")
    if not path.is_file() or path.resolve().parent != ckpt_dir.resolve():
        raise ConfigError(f"{where}, got {name!r} (it leads to {path.resolve()})")
    return path


def run(cfg: RunConfig, out: str | Path, *, resume: bool = False, backend: Any = None,
        verbose: bool = True) -> TrainResult:
    """Train, evaluate, checkpoint and export as ``cfg`` says (what ``python train.py`` does).

    ``backend``: a Backend object to use instead of building one (e.g. a test session's engine);
    only with ``n_envs == 1``.
    """
    from stable_baselines3.common.callbacks import CallbackList

    from agents.base import evaluate
    from agents.registry import agent_class, make_agent

    t0 = time.perf_counter()
    out = Path(out)
    if backend is not None and cfg.train.n_envs > 1:
        raise ConfigError("a shared backend object needs n_envs == 1 (each worker builds its own)")
    if resume:
        _check_resume_config(out, cfg)
        checkpoint_to_resume = _resume_checkpoint(out / "checkpoints")
    out.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    (out / "config.yaml").write_text(text)
    if verbose:
        print(f"# train.py --agent {cfg.agent_name} (config {cfg.source})\n{text}", flush=True)

    workload = build_workload(cfg)
    # One backend serves the training env and the evaluation env (one engine per process).
    eval_env = make_env(cfg, backend=backend, workload=workload)
    shared = backend if backend is not None else (eval_env.backend if cfg.train.backend == "vllm" else None)
    ckpt_dir = out / "checkpoints"
    cls = agent_class(cfg.agent_name)
    ppo = cfg.agent_name == "ppo"

    if ppo:
        from agents.ppo import make_vec_env

        if cfg.train.n_envs > 1:
            factories = [EnvFactory(cfg.to_dict(), cfg.agent_name) for _ in range(cfg.train.n_envs)]
            train_env = make_vec_env(factories, subprocess=True)
        else:
            train_env = make_vec_env([lambda: make_env(cfg, backend=shared, workload=workload)])
        train_env.seed(cfg.train.seed)
    else:
        train_env = None if cfg.train.n_envs > 1 else make_env(cfg, backend=shared, workload=workload)

    if resume:
        agent = cls.load(checkpoint_to_resume, env=train_env if ppo else None)
        if ppo:
            agent.bind(train_env)
        if verbose:
            print(f"resuming from {checkpoint_to_resume} at {agent.num_timesteps} timesteps", flush=True)
    else:
        agent = make_agent(cfg.agent_name, cfg.agent, seed=cfg.train.seed)
    if not ppo:
        agent.bind(eval_env)
    logger = make_logger(out, cfg)
    agent.set_logger(logger)

    history: list[dict[str, Any]] = []
    cbs = _make_callback_classes()
    seeds = [cfg.train.eval_seed + i for i in range(cfg.train.eval_episodes)]
    eval_cb = cbs["EvalCallback"](agent, eval_env, seeds, cfg.train.eval_every, history)
    ckpt_cb = cbs["CheckpointCallback"](agent, ckpt_dir, cfg.train.checkpoint_every)
    callbacks = [cbs["EpisodeStatsCallback"](), eval_cb, ckpt_cb]
    if cfg.train.progress_bar:
        callbacks.append(cbs["ProgressCallback"](cfg.train.timesteps, history))
    callback = CallbackList(callbacks)

    remaining = cfg.train.timesteps - int(agent.num_timesteps)
    try:
        if remaining > 0:
            if not ppo and cfg.train.n_envs > 1:
                learn_parallel_tabular(agent, cfg, cfg.train.timesteps, callback)
            else:
                agent.learn(train_env, remaining, callback=callback, reset_num_timesteps=not resume)
        elif verbose:
            print(f"nothing to train: the checkpoint has {agent.num_timesteps} >= {cfg.train.timesteps} "
                  "timesteps", flush=True)
        checkpoint = save_checkpoint(agent, ckpt_dir)
        if history and history[-1]["timesteps"] == int(agent.num_timesteps):
            final = history[-1]  # the last periodic evaluation saw this very policy
        else:
            eval_cb.init_callback(agent if not ppo else agent.model)
            final = eval_cb.run_eval()
            logger.dump(int(agent.num_timesteps))
    finally:
        if train_env is not None and train_env is not eval_env:
            train_env.close()
    comparison = {cfg.agent_name: {k: v for k, v in final.items() if k != "episodes"}}
    for name in cfg.train.compare_with:
        ref = make_agent(name, seed=cfg.train.seed, env=eval_env)
        comparison[name] = {k: v for k, v in evaluate(ref, eval_env, seeds).items() if k != "episodes"}
    policy_path = agent.export(out / "policy.feather", meta={
        "config": cfg.to_dict(), "final_eval": {k: v for k, v in final.items() if k != "episodes"}})
    wall = time.perf_counter() - t0
    summary = {"agent": cfg.agent_name, "num_timesteps": int(agent.num_timesteps), "wall_s": wall,
               "checkpoint": str(checkpoint), "policy": str(policy_path),
               "final_eval": {k: v for k, v in final.items() if k != "episodes"}, "eval_history": history,
               "comparison": comparison}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=float) + "\n")
    if backend is None and cfg.train.backend == "vllm":
        eval_env.close()
    if verbose:
        print(f"{cfg.agent_name}: {agent.num_timesteps} timesteps in {wall:.1f} s; held-out evaluation "
              f"({len(seeds)} episodes): decode {final['decode_tok_s']:,.1f} tok/s, return "
              f"{final['mean_return']:.3f}, mean batch {final['mean_batch_size']:.1f}\n"
              f"policy: {policy_path}\ncheckpoint: {checkpoint}\n"
              f"TensorBoard: tensorboard --logdir {out / 'tb'}",
              flush=True)
        if len(comparison) > 1:
            print(comparison_table(comparison, cfg.agent_name), flush=True)
    return TrainResult(out, policy_path, checkpoint, int(agent.num_timesteps), final, history, wall)


def comparison_table(results: Mapping[str, Mapping[str, Any]], agent: str) -> str:
    """Held-out evaluation of the trained agent next to the reference agents (markdown)."""
    base = results.get("always-add", results[agent])["decode_tok_s"] or 1.0
    lines = ["| agent | decode tok/s | vs always-add | mean batch | episode return |",
             "|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['decode_tok_s']:,.1f} | {r['decode_tok_s'] / base:.2f}x | "
                     f"{r['mean_batch_size']:.1f} | {r['mean_return']:.3f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> TrainResult:
    from agents.registry import TRAINABLE

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agent", required=True, choices=TRAINABLE)
    p.add_argument("--config", required=True, help="YAML with env/workload/agent/train/engine sections")
    p.add_argument("--backend", choices=("sim", "vllm"), default=None, help="overrides train.backend")
    p.add_argument("--timesteps", type=int, default=None, help="overrides train.timesteps")
    p.add_argument("--seed", type=int, default=None, help="overrides train.seed")
    p.add_argument("--n-envs", type=int, default=None, help="overrides train.n_envs")
    p.add_argument("--out", default=None, help="output folder (default runs/<agent>-<config name>)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoints/latest.json")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, args.agent, backend=args.backend, timesteps=args.timesteps,
                          seed=args.seed, n_envs=args.n_envs,
                          progress_bar=False if args.no_progress else None)
    except ConfigError as exc:
        p.exit(2, f"train.py: config error: {exc}\n")
    out = Path(args.out) if args.out else REPO_ROOT / "runs" / f"{args.agent}-{Path(args.config).stem}"
    from feather_env.workloads import DataNotFoundError

    try:
        return run(cfg, out, resume=args.resume)
    except (ConfigError, DataNotFoundError) as exc:  # the data error says where to get the data
        p.exit(2, f"train.py: {exc}\n")


if __name__ == "__main__":
    main()


__all__ = ["EnvSection", "RunConfig", "TrainResult", "TrainSection", "load_config", "main", "make_env",
           "parse_config", "run"]
