"""Train a batching agent in the serving-loop environment, log it, checkpoint it, and export its policy.

    python train.py --agent {heuristic,ucb,qlearning,ppo} --config configs/<file>.yaml
                    [--scenario NAME] [--reward NAME] [--goodput "ttft:MS tpot:MS e2el:MS"]
                    [--backend sim|vllm] [--eval-backend sim|vllm]
                    [--timesteps N] [--seed S] [--profile PROFILE.json] [--out DIR]
                    [--n-envs N] [--resume] [--verbose] [--check]

The config's sections (``scenario``, ``env``, ``agent``, ``train``), what a run writes and how
seeds are used are described in :mod:`agents.training`, which does the work; this file parses the
command line. ``--scenario`` replaces the config's scenario (``configs/scenarios/NAME.yaml``, or a
scenario file such as ``python -m feather_env.scenarios new`` writes), ``--profile`` the simulator's
calibrated profile (``python -m feather_env.calibrate``), ``--goodput`` the latency SLOs
(``env.goodput``, ``vllm bench serve --goodput``'s milliseconds) that ``--reward goodput`` counts
requests against. Every input error (the config, the scenario and its data, the checkpoint of a
``--resume``) is one line on stderr and exit status 2, before the run folder is created or changed.
``--check`` makes every one of those checks, prints the run as resolved (the effective config and
each stage's environment: backend, episode, engine, scheduler, reward) and exits, writing nothing.
vLLM's own log lines (a real engine's start) go to ``OUT/vllm.log`` unless ``--verbose``.
Fine-tuning a simulator run on the real engine: the same command with ``--resume --backend vllm
--eval-backend sim --timesteps MORE``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from scheduler_runtime.config import ConfigError

REPO_ROOT = Path(__file__).resolve().parent


def main(argv: Sequence[str] | None = None):  # -> agents.training.TrainResult
    from agents.registry import TRAINABLE
    from agents.run_config import load_config
    from agents.training import check, run
    from feather_env.env import REWARDS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agent", required=True, choices=TRAINABLE)
    p.add_argument("--config", required=True, help="YAML with scenario/env/agent/train sections")
    p.add_argument("--scenario", default=None, help="overrides scenario.name (configs/scenarios/NAME.yaml)")
    p.add_argument("--reward", choices=REWARDS, default=None, help="overrides env.reward")
    p.add_argument("--goodput", nargs="+", default=None, metavar="SLO:MS",
                   help="overrides env.goodput: SLOs as vllm bench serve, ttft:MS tpot:MS e2el:MS "
                        "(needed by --reward goodput)")
    p.add_argument("--backend", choices=("sim", "vllm"), default=None, help="overrides train.backend")
    p.add_argument("--eval-backend", choices=("sim", "vllm"), default=None,
                   help="overrides train.eval_backend (where the held-out evaluations run)")
    p.add_argument("--timesteps", type=int, default=None, help="overrides train.timesteps")
    p.add_argument("--seed", type=int, default=None, help="overrides train.seed")
    p.add_argument("--n-envs", type=int, default=None, help="overrides train.n_envs")
    p.add_argument("--profile", default=None, help="overrides env.profile (the simulator's profile JSON)")
    p.add_argument("--out", default=None, help="output folder (default runs/<agent>-<config name>)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoints/latest.json")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--verbose", action="store_true", help="vLLM's log on the terminal, not in OUT/vllm.log")
    p.add_argument("--check", action="store_true",
                   help="check every input, print the run as resolved, and exit without writing anything")
    args = p.parse_args(argv)
    from feather_env.workloads import DataNotFoundError, WorkloadError

    try:
        cfg = load_config(args.config, args.agent, scenario=args.scenario, reward=args.reward,
                          goodput=" ".join(args.goodput) if args.goodput is not None else None,
                          profile=args.profile, backend=args.backend, eval_backend=args.eval_backend,
                          timesteps=args.timesteps, seed=args.seed, n_envs=args.n_envs,
                          progress_bar=False if args.no_progress else None)
    except (ConfigError, DataNotFoundError, WorkloadError) as exc:
        p.exit(2, f"train.py: config error: {_one_line(exc)}\n")
    out = Path(args.out) if args.out else REPO_ROOT / "runs" / f"{args.agent}-{Path(args.config).stem}"
    try:
        if args.check:
            print(check(cfg, out, resume=args.resume), flush=True)
            return None
        return run(cfg, out, resume=args.resume, vllm_log=None if args.verbose else out / "vllm.log")
    except (ConfigError, DataNotFoundError, WorkloadError) as exc:  # the data error says where to get it
        p.exit(2, f"train.py: {_one_line(exc)}\n")


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


if __name__ == "__main__":
    main()
