"""A training run's environments, built from what its configuration resolved to: the one place a
run makes a ``FeatherEnv`` (or a :class:`~feather_env.env.ScenarioMix`), in this process or in a
worker's.

:class:`RunEnvs` is the run's environment resolved (one :class:`~feather_env.resolved.ResolvedEnv`
per scenario, :attr:`agents.run_config.RunConfig.environments`); the run derives from it the
environments of each of its stages (the probe, training, evaluation, the references, the real
engine) and builds them, without its configuration: no scenario is read again.
:mod:`agents.training` (the run) and :mod:`agents.parallel` (its worker processes) both build their
environments here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from feather_env.reporting import format_table
from feather_env.resolved import ResolvedEnv

if TYPE_CHECKING:
    from feather_env.engines.vllm_engine import EngineConfig

__all__ = ["RunEnvs", "RunStages", "make_env"]


@dataclass(frozen=True)
class RunEnvs:
    """A run's environment, resolved: one :class:`ResolvedEnv` per scenario, and for a mix the names
    its scenarios were given (``None``: a single scenario).

    An instance is also a picklable factory (``envs()``): what a worker process builds its own
    environment (and backend) with.
    """

    resolved: tuple[ResolvedEnv, ...]
    names: tuple[str, ...] | None = None

    def on(self, backend: str) -> RunEnvs:
        """The same environments on another backend (``"sim"``, ``"vllm"``)."""
        return RunEnvs(tuple(e.on(backend) for e in self.resolved), self.names)

    def with_scheduler(self, name: str) -> RunEnvs:
        """The same environments serving scheduler ``name`` (a reference agent's own decision)."""
        return RunEnvs(tuple(e.with_scheduler(name) for e in self.resolved), self.names)

    @property
    def kind(self) -> str:
        """The backend they are served on (``"sim"`` or ``"vllm"``)."""
        return self.resolved[0].backend.kind

    def build(self, backend: Any = None) -> Any:
        """A raw ``FeatherEnv`` (a ``ScenarioMix`` for a mix) on its backend, or on ``backend`` (an
        object to share)."""
        from feather_env.env import FeatherEnv, ScenarioMix

        if self.names is not None:  # one environment per scenario, one drawn per episode
            return ScenarioMix.from_resolved(self.resolved, backend, names=self.names)
        return FeatherEnv.from_resolved(self.resolved[0], backend)

    def __call__(self) -> Any:
        return self.build()


@dataclass(frozen=True)
class RunStages:
    """The environment of every stage of a run, derived before the run starts from its resolved
    environment (:attr:`agents.run_config.RunConfig.stages`): a stage builds its own, and reads no
    configuration.

    Attributes:
        probe: on the simulator: the check, before anything is written, that episodes ask decisions.
        train: on ``train.backend``: training (and the evaluation, when it is served there too).
        evaluation: on ``train.eval_backend``: the held-out evaluation.
        references: each reference agent of ``train.compare_with``: its own environment (its own
            scheduler, any backend), or ``None`` (it answers the evaluation environment's decisions).
        real: on the real engine: the confirmation of a simulator evaluation (``None``: none).

    Raises:
        ConfigError: a stage on the real engine whose engine could not start on this machine
            (:meth:`~feather_env.engines.vllm_engine.EngineConfig.check_startable`).
    """

    probe: RunEnvs
    train: RunEnvs
    evaluation: RunEnvs
    references: Mapping[str, RunEnvs | None]
    real: RunEnvs | None

    def __post_init__(self) -> None:
        for engine in self.real_engines():  # the engine each stage on it will start, startable here
            engine.check_startable()

    def real_engines(self) -> list[EngineConfig]:
        """The engine configs of every stage served on the real engine (each scenario's, in order)."""
        stages = [self.train, self.evaluation, *(e for e in self.references.values() if e is not None)]
        if self.real is not None:
            stages.append(self.real)
        return [r.engine for envs in stages if envs.kind == "vllm" for r in envs.resolved]

    def table(self) -> str:
        """Every stage's environment as resolved, a row per stage and scenario (markdown): the backend,
        the episode, the engine (KV cache tokens, batch size, step token budget, model length fitted
        to the pool), the scheduler and its decision, the reward and the observation."""
        stages: list[tuple[str, RunEnvs]] = [("probe", self.probe), ("training", self.train),
                                             ("evaluation", self.evaluation)]
        stages += [(f"reference {name}", own if own is not None else self.evaluation)
                   for name, own in self.references.items()]
        if self.real is not None:
            stages.append(("confirmation", self.real))
        rows = []
        for stage, envs in stages:
            for r in envs.resolved:
                episode = " ".join(f"{k}={v}" for k, v in dataclasses.asdict(r.episode).items()
                                   if v is not None and not (k == "rate_scale" and v == 1.0))
                e = r.engine
                rows.append([stage, r.backend.kind, r.scenario.name, episode,
                             f"{e.kv_cache_tokens:,} / {e.max_num_seqs} / {e.max_num_batched_tokens:,} / "
                             f"{e.max_model_len:,}", f"{r.scheduler.name} ({r.scheduler.decision})",
                             r.reward.kind, r.obs_kind])
        return format_table(["stage", "backend", "scenario", "episode",
                             "KV tokens / max seqs / step tokens / max len", "scheduler (decision)", "reward",
                             "observation"], rows)


class _Run(Protocol):
    """What :func:`make_env` reads of a run's config (:class:`agents.run_config.RunConfig`)."""

    @property
    def environments(self) -> RunEnvs: ...


def make_env(cfg: _Run, backend: Any = None, *, scheduler: str | None = None) -> Any:
    """A raw ``FeatherEnv`` (or a ``ScenarioMix``) for run ``cfg`` (its ``environments``):
    on ``train.backend``, on another one (``"sim"``, ``"vllm"``), or on a backend object to share;
    ``scheduler``: a reference agent's own scheduler (its own decision)."""
    envs = cfg.environments
    if scheduler is not None:
        envs = envs.with_scheduler(scheduler)
    if isinstance(backend, str):
        return envs.on(backend).build()
    return envs.build(backend)
