"""The training run's callbacks (stable-baselines3 ``BaseCallback``s): logging, evaluation,
checkpoints, progress. PPO runs them inside SB3; the other agents drive them from
:meth:`agents.base.EpisodicAgent.learn` with the same protocol (SB3's ``common/callbacks.py``
pattern: cross-cutting concerns outside the training loop)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from stable_baselines3.common.callbacks import BaseCallback

__all__ = ["CheckpointCallback", "EpisodeStatsCallback", "EvalCallback", "InfoCollector", "ProgressCallback"]

#: Per-episode figures logged under ``rollout/`` (from the environment's ``info["episode"]``).
_ROLLOUT_KEYS = ("output_throughput", "mean_e2el_ms", "prefix_hit_rate", "duration", "decisions",
                 "stops", "preemptions", "mean_delta", "mean_delta_added")
#: Evaluation figures logged under ``eval/``.
EVAL_KEYS = ("output_throughput", "request_throughput", "mean_e2el_s", "prefix_hit_rate", "mean_return",
             "mean_episode_length")


class EpisodeStatsCallback(BaseCallback):
    """``rollout/`` scalars from every finished episode's serving metrics."""

    def _on_step(self) -> bool:
        for info in self.locals.get("infos", []):
            ep = info.get("feather_episode")
            if ep:
                for key in _ROLLOUT_KEYS:
                    if key in ep:
                        self.logger.record_mean(f"rollout/{key}", ep[key])
            mon = info.get("episode")
            if mon:
                self.logger.record_mean("rollout/ep_return", mon["r"])
                self.logger.record_mean("rollout/ep_len", mon["l"])
        return True


class EvalCallback(BaseCallback):
    """Evaluate the agent's deterministic policy on held-out episode seeds every ``every`` timesteps.

    ``evaluate``: ``(agent, env, seeds) -> figures`` (:func:`agents.base.evaluate`).
    """

    def __init__(self, agent: Any, env: Any, seeds: Sequence[int], every: int,
                 history: list[dict[str, Any]], evaluate: Callable[..., dict[str, Any]]) -> None:
        super().__init__()
        self.agent, self.env, self.seeds, self.every = agent, env, list(seeds), every
        self.history = history
        self.evaluate = evaluate
        self._next = every

    def _init_callback(self) -> None:
        if self.every:  # a resumed run starts past 0
            self._next = (int(self.model.num_timesteps) // self.every + 1) * self.every

    def run_eval(self) -> dict[str, Any]:
        res = self.evaluate(self.agent, self.env, self.seeds)
        steps = int(self.agent.num_timesteps if hasattr(self.agent, "num_timesteps") else 0)
        steps = max(steps, int(self.num_timesteps))
        for key in EVAL_KEYS:
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
        return self.agent.save_checkpoint(self.directory)

    def _on_step(self) -> bool:
        if self.every and self.num_timesteps >= self._next:
            self.agent.num_timesteps = max(int(self.agent.num_timesteps), int(self.num_timesteps))
            self.save()
            self._next = (self.num_timesteps // self.every + 1) * self.every
        return True


class ProgressCallback(BaseCallback):
    """A tqdm progress bar over timesteps, with the last evaluation's output throughput."""

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
                self.bar.set_postfix(eval_tok_s=f"{self.history[-1]['output_throughput']:.1f}",
                                     refresh=False)
        return True

    def _on_training_end(self) -> None:
        if self.bar is not None:
            self.bar.close()


class InfoCollector(BaseCallback):
    """Keeps the episode infos of the steps it sees (a parallel worker sends them to the main
    process, whose callbacks log them)."""

    def __init__(self) -> None:
        super().__init__()
        self.infos: list[dict[str, Any]] = []

    def _on_step(self) -> bool:
        for info in self.locals.get("infos", []):
            keep = {k: info[k] for k in ("feather_episode", "episode") if k in info}
            if keep:
                self.infos.append(keep)
        return True
