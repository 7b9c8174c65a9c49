"""One training run: its config, its environments, the training loop's wiring, evaluation and export.

What ``python train.py`` does, as a library (benchmarks and tests call :func:`run`):

Every knob of a run lives in one YAML config (sections ``scenario``, ``env``, ``agent``,
``train``); each section is validated (an unknown key is an error that lists the valid ones), the
command-line flags override ``train.*`` and ``scenario.name``, and the effective config is
printed, logged to TensorBoard (text + hparams) and saved as ``OUT/config.yaml`` next to the
checkpoints::

    scenario:            # configs/scenarios/NAME.yaml, with optional per-section overrides
      name: leval-kv-pressure
      episode: {groups: 8}
    env:                 # FeatherEnv arguments (EnvSection)
      reward: latency
    agent:               # the agent's config dataclass (agents/<name>.py), plus its name
      name: ucb
    train:               # TrainSection
      timesteps: 20000

What a run writes in ``OUT``: ``config.yaml``; ``tb/`` (TensorBoard: ``rollout/`` episode return,
output throughput, E2E latency, prefix hit rate; ``train/`` losses or TD/credit errors;
``eval/`` the periodic held-out evaluation) and ``tb/progress.csv``; ``checkpoints/`` with
``latest.json`` (what ``--resume`` continues from); ``policy.feather`` (the exported policy,
:func:`scheduler_runtime.policy.load_policy`); ``summary.json`` (final evaluation, the reference
agents', timesteps, wall time).

Seeds: training episodes come from the environment's generator seeded with ``train.seed``;
evaluation episode ``i`` is episode seed ``train.eval_seed + i`` of the scenario (held out: a
training episode draws its seed from 2^31 values). The reference agents of ``train.compare_with``
serve the same evaluation episodes.

Resuming (``--resume``) continues ``OUT``'s latest checkpoint with the saved config; only
bookkeeping (``timesteps``, ``eval_every``, ``checkpoint_every``, the progress bar) and the
backends may change. Fine-tuning on the real engine is such a resume: a run trained on the
simulator continued with ``--backend vllm`` (and ``--eval-backend sim`` to keep its held-out
evaluations cheap); ``summary.json`` and the exported policy's ``meta`` record ``resumed_from``
(the backend and timesteps it started from).

``train.n_envs > 1``: PPO steps N environments in separate processes (SB3's ``SubprocVecEnv``);
the tabular agents run N independent workers for ``train.sync_every`` steps each, then merge
their tables (see ``merge`` in each agent).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from agents.envs import RunEnvs, RunStages, make_env
from agents.parallel import learn_parallel_tabular
from agents.run_config import ORDERING_REFERENCES, REFERENCES, RunConfig, TrainSection
from feather_env.reporting import check_output_dir, format_table
from scheduler_runtime.config import ConfigError, load_mapping, load_yaml

__all__ = ["TrainResult", "check", "comparison_table", "make_env", "reference_policy", "run"]

# -- environments -------------------------------------------------------------------------------
def reference_policy(name: str, env: Any, seed: int = 0) -> Any:
    """The decision-answering object of reference ``name`` (see :data:`REFERENCES`) for ``env``."""
    from agents.registry import make_agent

    if name in ORDERING_REFERENCES or name == "always-add":
        return make_agent("always-add", seed=seed, env=env)
    if name not in REFERENCES:  # a Feather scheduler: its own rule
        from feather_env.env import scheduler_policy

        return scheduler_policy(env.unwrapped)
    return make_agent(name, seed=seed, env=env)


# -- logging ------------------------------------------------------------------------------------
def make_logger(out: Path, config: Mapping[str, Any]) -> Any:
    """SB3 logger writing TensorBoard + CSV to ``out/tb``; the run's config (as saved) goes in as text
    and hparams."""
    from stable_baselines3.common.logger import HParam, TensorBoardOutputFormat, configure

    csv = out / "tb" / "progress.csv"
    if csv.exists():  # a resumed run: SB3 would truncate the earlier run's CSV
        csv.replace(csv.with_name(f"progress-{time.strftime('%Y%m%d-%H%M%S')}.csv"))
    logger = configure(str(out / "tb"), ["tensorboard", "csv"])
    text = yaml.safe_dump(config, sort_keys=False)
    for fmt in logger.output_formats:
        if isinstance(fmt, TensorBoardOutputFormat):
            fmt.writer.add_text("config", "```yaml\n" + text + "```", 0)
            fmt.writer.flush()
    flat = _flatten(config)
    hparams = {k: v if isinstance(v, bool | int | float | str) else str(v) for k, v in flat.items()}
    logger.record("hparams", HParam(hparams, {"eval/output_throughput": 0.0, "eval/mean_return": 0.0}),
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


# -- the run ------------------------------------------------------------------------------------
@dataclass
class TrainResult:
    out: Path
    policy_path: Path
    checkpoint: Path
    num_timesteps: int
    final_eval: dict[str, Any]
    eval_history: list[dict[str, Any]]
    comparison: dict[str, dict[str, Any]]
    wall_s: float


def _check_resume_config(out: Path, config: Mapping[str, Any]) -> str:
    """Refuse a resume whose config (``config``, as saved) differs from the run's saved one in
    anything but bookkeeping and the backends; returns the backend the run was trained on so far."""
    saved_path = out / "config.yaml"
    if not saved_path.is_file():
        raise ConfigError(f"--resume: {saved_path} not found (nothing to resume in {out})")
    saved = _flatten(load_yaml(saved_path))
    now = _flatten(config)
    # The run may be extended, and its bookkeeping changed; nothing that shapes learning but where
    # its episodes are served: a simulator run resumed with ``backend: vllm`` is fine-tuned on
    # the real engine (module docstring).
    free = {"train.timesteps", "train.progress_bar", "train.eval_every", "train.checkpoint_every",
            "train.backend", "train.eval_backend"}
    diff = sorted(k for k in set(saved) | set(now) if k not in free and saved.get(k) != now.get(k))
    if diff:
        details = ", ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in diff[:8])
        raise ConfigError(f"--resume: the config differs from the run's saved config in {out}: {details}")
    return str(saved.get("train.backend", "sim"))


def _resume_checkpoint(ckpt_dir: Path) -> Path:
    """The checkpoint ``ckpt_dir/latest.json`` points at, checked before anything loads it.

    The pointer names a file *in* ``ckpt_dir`` (what :meth:`agents.base.Agent.save_checkpoint`
    writes): an absolute path, a ``..``, or a link out of the folder is refused, since the agents'
    loaders unpickle (SB3's cloudpickle) and must only read this run's own checkpoints.
    """
    latest = ckpt_dir / "latest.json"
    if not latest.is_file():
        raise ConfigError(f"--resume: {latest} not found (no checkpoint to resume from)")
    try:
        pointer = load_mapping(latest)
    except ConfigError as exc:
        raise ConfigError(f"--resume: {exc}") from None
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


def _load_checkpoint(cls: Any, path: Path) -> Any:
    """The agent of checkpoint ``path`` (not bound to an environment), or a :class:`ConfigError`
    naming it and the latest earlier checkpoint of the run that loads."""
    try:
        return cls.load(path)
    except Exception as exc:  # a corrupt file fails anywhere in numpy's, zipfile's or SB3's loader
        why = f"{type(exc).__name__}: {exc}"
    pattern = re.compile(rf"{re.escape(cls.name)}_(\d+)_steps{re.escape(path.suffix)}")
    own = pattern.fullmatch(path.name)
    limit = int(own.group(1)) if own else None
    found = [(int(m.group(1)), p) for p in path.parent.iterdir() if (m := pattern.fullmatch(p.name))]
    earlier = sorted(((n, p) for n, p in found if p != path and (limit is None or n < limit)), reverse=True)
    for steps, candidate in earlier:
        try:
            cls.load(candidate)
        except Exception:  # this one is corrupt too: try the one before
            continue
        pointer = json.dumps({"path": candidate.name, "num_timesteps": steps, "agent": cls.name})
        raise ConfigError(f"--resume: checkpoint {path} does not load ({why}); the latest earlier checkpoint "
                          f"that loads is {candidate} ({steps} timesteps): to resume from it, write "
                          f"{pointer} to {path.parent / 'latest.json'}")
    raise ConfigError(f"--resume: checkpoint {path} does not load ({why}), and no earlier checkpoint of this "
                      f"run does: start afresh without --resume (in another --out)")


def _check_decisions(envs: RunEnvs, seed: int) -> None:
    """Raise a :class:`ConfigError` when the scenario's episodes never ask a decision (every request
    released as it arrives: nothing to learn); every scenario of a mix is tried, on ``envs`` built
    for the check (and closed)."""
    with envs.build() as env:  # closed however the check ends
        for name in envs.names or [None]:
            one = env.envs[name] if name is not None else env
            if one.engine_config.max_num_seqs == 1 or one.scenario.max_episode_requests == 1:
                why = ("engine.max_num_seqs is 1: a request is released, without asking, when the batch is "
                       "empty" if one.engine_config.max_num_seqs == 1
                       else "its episodes hold a single request, released without asking")
                raise ConfigError(f"scenario {one.scenario.name!r} never asks a decision ({why}): there is "
                                  "nothing to train; serve more requests at once")
            env.reset(seed=seed, options={"scenario": name} if name is not None else None)


def _check_inputs(out: Path, cls: Any, saved: Mapping[str, Any], stages: RunStages, train: TrainSection, *,
                  resume: bool, shared: Any) -> tuple[Path, Any, str] | None:
    """Every input of a run checked before anything is written: the output folder, the saved config
    and the checkpoint of a resume (loaded), and that the environment asks decisions (``stages.probe``,
    on the simulator); the stages themselves were checked when they were made (:class:`RunStages`).
    Returns the checkpoint to resume, the agent loaded from it and the backend it was trained on
    (``None``: a fresh run)."""
    if shared is not None and train.n_envs > 1:
        raise ConfigError("a shared backend object needs n_envs == 1 (each worker builds its own)")
    try:
        check_output_dir(out, "the run folder")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    start = None
    if resume:
        trained_on = _check_resume_config(out, saved)
        checkpoint = _resume_checkpoint(out / "checkpoints")
        start = checkpoint, _load_checkpoint(cls, checkpoint), trained_on
    _check_decisions(stages.probe, train.seed)
    return start


def check(cfg: RunConfig, out: str | Path, *, resume: bool = False) -> str:
    """Check every input of run ``cfg`` as :func:`run` does before it writes anything (the output
    folder ``out``; with ``resume``, the saved config and the checkpoint, loaded; that the episodes
    ask decisions, on the simulator), and return the run as resolved: the effective config, as
    ``OUT/config.yaml`` would hold it, and every stage's environment (:meth:`agents.envs.RunStages.table`).
    Writes nothing and starts no engine (``train.py --check``); raises :class:`ConfigError` as
    :func:`run` would."""
    stages = cfg.stages
    _check_inputs(Path(out), cfg.agent_cls, cfg.saved, stages, cfg.train, resume=resume, shared=None)
    return (f"{_title(cfg)}: checked, nothing written\n{yaml.safe_dump(cfg.saved, sort_keys=False)}\n"
            f"{stages.table()}")


def _title(cfg: RunConfig) -> str:
    """The line a run (and its check) opens with: the agent, the scenario and the config file."""
    return f"# train.py --agent {cfg.agent_name} --scenario {cfg.scenario_name} (config {cfg.source})"


def run(cfg: RunConfig, out: str | Path, *, resume: bool = False, backend: Any = None,
        verbose: bool = True, vllm_log: str | Path | None = None) -> TrainResult:
    """Train, evaluate, checkpoint and export as ``cfg`` says (what ``python train.py`` does).

    ``backend``: a serving backend object to use instead of building one (e.g. a test session's
    engine); only with ``n_envs == 1``. ``vllm_log``: vLLM's log lines go to this file.

    Every input is checked before anything is written: the output folder, the environment (built
    on the simulator: the scenario, its pool, the environment's arguments, and that its episodes
    ask decisions at all) and, with ``resume``, the saved config and the checkpoint (loaded). Only
    then is ``OUT`` created, ``OUT/config.yaml`` written and an engine started. With ``vllm_log``,
    vLLM's own logging configuration is put back when the run ends, however it ends.
    """
    try:
        return _run(cfg, out, resume=resume, backend=backend, verbose=verbose, vllm_log=vllm_log)
    finally:
        if vllm_log is not None:
            from feather_env.engines.vllm_engine import send_vllm_logs_to

            send_vllm_logs_to(None)


def _run(cfg: RunConfig, out: str | Path, *, resume: bool, backend: Any, verbose: bool,
         vllm_log: str | Path | None) -> TrainResult:
    """The run, its configuration taken apart once, here: every stage below receives the pieces it
    needs (the saved config, the train section, the resolved environments), never ``cfg``."""
    from agents.registry import make_agent

    t0 = time.perf_counter()
    out = Path(out)
    name, agent_config, train, saved, cls = cfg.agent_name, cfg.agent, cfg.train, cfg.saved, cfg.agent_cls
    scenario, title = cfg.scenario_name, _title(cfg)
    stages = cfg.stages  # every environment of the run, from the ones parse_config resolved
    start = _check_inputs(out, cls, saved, stages, train, resume=resume, shared=backend)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    if vllm_log is not None:
        from feather_env.engines.vllm_engine import send_vllm_logs_to

        send_vllm_logs_to(vllm_log)
    if verbose:
        print(title, flush=True)
    from stable_baselines3.common.callbacks import CallbackList  # after the checks: seconds to import

    from agents.base import evaluate
    from agents.callbacks import (
        CheckpointCallback,
        EpisodeStatsCallback,
        EvalCallback,
        ProgressCallback,
    )

    # One backend per kind serves the training env, the evaluation env and the references.
    envs, eval_kind = stages.train, stages.evaluation.kind
    train_probe = envs.build(backend)
    # The real engine is one per process, shared by every env (an evaluation then interrupts the
    # training episode, which truncates); each simulated env gets a simulator of its own.
    shared = train_probe.backend if backend is not None or envs.kind != "sim" else None
    eval_env = train_probe if eval_kind == envs.kind else stages.evaluation.build()
    ckpt_dir = out / "checkpoints"

    train_env = cls.training_env(lambda: envs.build(shared), lambda: [envs] * train.n_envs,
                                 train.n_envs, train.seed)
    resumed_from: dict[str, Any] | None = None
    if start is not None:
        checkpoint_to_resume, loaded, trained_on = start
        agent = cls.resume(checkpoint_to_resume, loaded, train_env)
        resumed_from = {"backend": trained_on, "timesteps": int(agent.num_timesteps)}
        if verbose:
            where = ("" if trained_on == train.backend else
                     f", trained on {trained_on}, continued on {train.backend}")
            print(f"resuming from {checkpoint_to_resume} at {agent.num_timesteps} timesteps{where}",
                  flush=True)
    else:
        agent = make_agent(name, agent_config, seed=train.seed)
    agent.prepare(train_env, eval_env)
    logger = make_logger(out, saved)
    agent.set_logger(logger)

    history: list[dict[str, Any]] = []
    seeds = [train.eval_seed + i for i in range(train.eval_episodes)]
    eval_cb = EvalCallback(agent, eval_env, seeds, train.eval_every, history, evaluate)
    ckpt_cb = CheckpointCallback(agent, ckpt_dir, train.checkpoint_every)
    callbacks = [EpisodeStatsCallback(), eval_cb, ckpt_cb]
    if train.progress_bar:
        callbacks.append(ProgressCallback(train.timesteps, history))
    callback = CallbackList(callbacks)

    remaining = train.timesteps - int(agent.num_timesteps)
    try:
        if remaining > 0:
            agent.train(train_env, remaining, callback, not resume,
                        parallel=lambda a, cb: learn_parallel_tabular(
                            a, envs, train.timesteps, cb, n_envs=train.n_envs, sync_every=train.sync_every,
                            seed=train.seed))
        elif verbose:
            print(f"nothing to train: the checkpoint has {agent.num_timesteps} >= {train.timesteps} "
                  "timesteps", flush=True)
        checkpoint = agent.save_checkpoint(ckpt_dir)
        if history and history[-1]["timesteps"] == int(agent.num_timesteps):
            final = history[-1]  # the last periodic evaluation saw this very policy
        else:
            eval_cb.init_callback(agent.callback_model)
            final = eval_cb.run_eval()
            logger.dump(int(agent.num_timesteps))
    finally:
        skipped = _skipped_episodes(train_env)
        if train_env is not None and train_env is not eval_env:
            train_env.close()
    final_eval = _without_episodes(final)
    # the trained policy is exported as soon as it is evaluated: the comparisons below only report
    policy_path = agent.export(out / "policy.feather", meta={
        "config": saved, "final_eval": final_eval, "resumed_from": resumed_from})
    comparison = {name: final_eval, **_compare(stages.references, eval_env, eval_kind, seeds, train.seed)}
    confirmed: dict[str, dict[str, Any]] = {}
    if stages.real is not None:  # the simulator's evaluation confirmed on the real engine
        real_env = stages.real.build()
        try:
            real_seeds = seeds[: train.confirm_episodes]
            confirmed[name] = _without_episodes(evaluate(agent, real_env, real_seeds))
            confirmed.update(_compare(stages.references, real_env, stages.real.kind, real_seeds, train.seed))
        finally:
            real_env.close()
    wall = time.perf_counter() - t0
    summary = {"agent": name, "scenario": scenario,
               "num_timesteps": int(agent.num_timesteps), "wall_s": wall, "checkpoint": str(checkpoint),
               "policy": str(policy_path), "final_eval": final_eval, "eval_history": history,
               "comparison": comparison, "eval_backend": eval_kind, "confirmed_on_real_engine": confirmed,
               "backend": train.backend, "resumed_from": resumed_from,
               "skipped_episodes": skipped}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=float) + "\n")
    if backend is None:
        train_probe.close()
        if eval_env is not train_probe:
            eval_env.close()
    if verbose:
        print(f"{name}: {agent.num_timesteps} timesteps in {wall:.1f} s; held-out evaluation "
              f"({len(seeds)} episodes of {scenario}, {eval_kind}): output "
              f"{final['output_throughput']:,.1f} tok/s, mean E2E latency {final['mean_e2el_s']:.2f} s\n"
              f"policy: {policy_path}\ncheckpoint: {checkpoint}\n"
              f"TensorBoard: tensorboard --logdir {out / 'tb'}",
              flush=True)
        if skipped:
            print(f"{skipped} training episodes needed no decision (every request went "
                  "straight in) and were skipped", flush=True)
        if len(comparison) > 1:
            print(comparison_table(comparison, name), flush=True)
        if confirmed:
            print(f"on the real engine, {train.confirm_episodes} held-out episode(s):\n"
                  + comparison_table(confirmed, name), flush=True)
    return TrainResult(out, policy_path, checkpoint, int(agent.num_timesteps), final, history, comparison,
                       wall)


def _skipped_episodes(env: Any) -> int | None:
    """Training episodes the environment skipped for needing no decision (``None``: not known, e.g.
    environments in worker processes)."""
    if env is None:
        return None
    try:
        if hasattr(env, "get_attr"):  # an SB3 vector of environments
            return int(sum(env.get_attr("skipped_episodes")))
        inner = getattr(env, "envs", None)  # a scenario mix
        envs = inner.values() if isinstance(inner, Mapping) else [env.unwrapped]
        return int(sum(e.skipped_episodes for e in envs))
    except Exception:  # a worker process that is gone: not known
        return None


def _without_episodes(result: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in result.items() if k != "episodes"}


def _compare(references: Mapping[str, RunEnvs | None], env: Any, kind: str, seeds: Sequence[int],
             seed: int) -> dict[str, dict[str, Any]]:
    """The reference agents on ``env``'s backend (of ``kind``), the same episodes: each on its own
    environment (``references[name]``), or on ``env`` (``None``)."""
    from agents.base import evaluate

    out = {}
    # a single environment's engine is shared; a scenario mix builds its own per scenario
    backend = getattr(env, "backend", None)
    for name, own in references.items():
        ref_env = env if own is None else own.build(backend) if backend is not None else own.on(kind).build()
        policy = reference_policy(name, ref_env, seed=seed)
        out[name] = _without_episodes(evaluate(policy, ref_env, seeds))
    return out


def comparison_table(results: Mapping[str, Mapping[str, Any]], agent: str) -> str:
    """Held-out evaluation of the trained agent next to the reference agents (markdown)."""
    def ratio(name: str, r: Mapping[str, Any]) -> str:
        base = results.get(name)
        if not base or not base["output_throughput"]:
            return "-"
        return f"{r['output_throughput'] / base['output_throughput']:.2f}x"

    rows = [[name, f"{r['output_throughput']:,.1f}", ratio("always-add", r), ratio("fcfs", r),
             f"{r['mean_e2el_s']:.2f}", f"{r['prefix_hit_rate']:.0%}"] for name, r in results.items()]
    return format_table(["agent", "e2e output tok/s", "vs always-add", "vs fcfs", "mean E2E latency s",
                         "prefix hit"], rows)
