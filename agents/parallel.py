"""Tabular agents trained by several worker processes, their tables merged (``train.n_envs > 1``).

Each worker builds its own environment and a copy of the agent, trains ``train.sync_every``
steps from the state it is sent, and sends back its state and the episodes it finished; the run
merges the states exactly (each agent's ``merge``) and drives the callbacks as SB3 would.
"""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

from agents.envs import RunEnvs

__all__ = ["learn_parallel_tabular"]


def _tabular_worker(conn: Any, envs: RunEnvs, name: str, config: Any, seed: int) -> None:
    """Worker process: own env + agent copy (agent ``name`` of ``config``, seeded with ``seed``);
    trains ``steps`` from the state it is sent, returns its state and the infos of the episodes it
    finished."""
    from agents.callbacks import InfoCollector
    from agents.registry import make_agent

    env = envs.build()
    agent = make_agent(name, config, seed=seed)
    collector = InfoCollector()
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


def learn_parallel_tabular(agent: Any, envs: RunEnvs, total: int, callback: Any, *, n_envs: int,
                           sync_every: int, seed: int) -> None:
    """``n_envs`` independent workers on ``envs``, merged every ``sync_every`` steps each (see the
    module docstring); worker ``rank``'s agent is seeded with ``seed + 1000 * (rank + 1)``."""
    n = n_envs
    ctx = mp.get_context("spawn")
    conns, procs = [], []
    for rank in range(n):
        parent, child = ctx.Pipe()
        worker_seed = seed + 1000 * (rank + 1)
        p = ctx.Process(target=_tabular_worker, args=(child, envs, agent.name, agent.config, worker_seed),
                        daemon=True)
        p.start()
        conns.append(parent)
        procs.append(p)
    if agent.name == "qlearning" and agent.config.exploration_timesteps is None:
        agent.exploration_timesteps = max(1, int(agent.config.exploration_fraction * total))
    try:
        callback.init_callback(agent)
        callback.on_training_start({"total_timesteps": total}, {})
        while agent.num_timesteps < total:
            per_worker = min(sync_every, max(1, (total - agent.num_timesteps) // n))
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
