"""Do two policies decide differently? Their decisions side by side on held-out episodes.

    python -m agents.agreement A.feather B.feather --scenario NAME [--episodes 8 | --seeds 0,1]
                               [--backend sim|vllm] [--json PATH]

Serves held-out episodes of the scenario (on the simulator, or on the real engine with
``--backend vllm``) answering every decision with A, and asks B at each of them too: prints how
many decisions B would have answered otherwise, then A's and B's own end-to-end output
throughput on the same episodes. What it is for: a policy retrained
or fine-tuned on the real engine (``train.py --resume --backend vllm``) that changes no decision
changes nothing a server would see, and needs no new evaluation on the engine.

Both files are read with :func:`scheduler_runtime.plugins.load_policy_spec` (a path, or a
``py:MODULE:ATTRIBUTE`` plug-in); :func:`compare` also takes loaded policies (the authors'
:class:`~scheduler_runtime.rules.HeuristicRule`, say). A policy whose observation is the paper's
three entries gets the first three of the extended observation. ``benchmarks/policy_agreement.py``
runs it for every shipped file against the heuristic.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from agents.base import HELD_OUT_SEED as EVAL_SEED
from agents.base import evaluate
from feather_env.env import FeatherEnv
from feather_env.reporting import format_table, write_json
from scheduler_runtime.config import ConfigError
from scheduler_runtime.decision import (
    BASE_OBS_NAMES,
    EXTENDED_OBS_NAMES,
    GROUP_OBS_NAMES,
    ObservationSpec,
    PolicyFormatError,
    observation_kind,
)
from scheduler_runtime.plugins import load_policy_spec


def _seed_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _ask(policy: Any, obs: Sequence[float], mask: Sequence[bool]) -> int:
    return int(policy.act(obs if observation_kind(policy) != "base" else obs[: len(BASE_OBS_NAMES)], mask))


class SideBySide:
    """Answers with ``a``, asks ``b`` too, and counts the decisions where they differ.

    Both answer the group decision when both read the group observation, else the request
    decision (on the extended observation, whose first entries are the paper's).

    Raises:
        ValueError: one policy answers the group decision and the other the request decision.
    """

    def __init__(self, a: Any, b: Any) -> None:
        kinds = {observation_kind(a) == "group", observation_kind(b) == "group"}
        if len(kinds) > 1:
            raise ValueError("one policy answers the group decision and the other the request decision: "
                             "their decisions are not the same questions")
        self.decision = "group" if kinds == {True} else "request"
        names = GROUP_OBS_NAMES if self.decision == "group" else EXTENDED_OBS_NAMES
        self.obs_spec = ObservationSpec(names=names)
        self.a, self.b = a, b
        self.decisions = 0
        self.differ = 0

    def reset(self) -> None:
        """Resets both policies (the counts run over every episode)."""
        for p in (self.a, self.b):
            if hasattr(p, "reset"):
                p.reset()

    def act(self, obs: Sequence[float], mask: Sequence[bool]) -> int:
        """A's answer; B's is compared with it."""
        action = _ask(self.a, obs, mask)
        self.decisions += 1
        self.differ += int(_ask(self.b, obs, mask) != action)
        return action


def compare(a_spec: Any, b_spec: Any, scenario: Any, episodes: int = 8,
            seeds: Sequence[int] | None = None, backend: Any = "sim") -> dict[str, Any]:
    """Decisions where B differs from A along A's episodes, and both policies' own figures.

    ``a_spec``/``b_spec``: policy specs (paths, plug-ins) or policy objects; ``seeds``: episode
    seeds (default: ``episodes`` held-out ones from :data:`agents.base.HELD_OUT_SEED`);
    ``scenario``: a name or a :class:`~feather_env.scenarios.Scenario`; ``backend``: where the
    episodes are served (``"sim"``, ``"vllm"``, or a backend object), as ``FeatherEnv`` takes it.
    """
    a = load_policy_spec(a_spec) if isinstance(a_spec, str) else a_spec
    b = load_policy_spec(b_spec) if isinstance(b_spec, str) else b_spec
    seeds = list(seeds) if seeds is not None else [EVAL_SEED + i for i in range(episodes)]
    both = SideBySide(a, b)
    group = both.decision == "group"
    env = FeatherEnv(scenario, backend, extended_obs=not group, decision=both.decision)
    try:
        ra = evaluate(both, env, seeds)
        rb = ra if both.differ == 0 else evaluate(b, env, seeds)  # identical decisions: identical episodes
    finally:
        if isinstance(backend, str):  # a backend object is the caller's to close
            env.close()
    keys = ("output_throughput", "mean_e2el_s", "prefix_hit_rate")
    return {"scenario": getattr(scenario, "name", scenario), "backend": str(backend), "seeds": seeds,
            "a": str(a_spec), "b": str(b_spec),
            "decisions": both.decisions, "differ": both.differ,
            "differ_fraction": both.differ / both.decisions if both.decisions else 0.0,
            "a_figures": {k: ra[k] for k in keys}, "b_figures": {k: rb[k] for k in keys}}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a", help="policy file (answers)")
    p.add_argument("b", help="policy file (asked)")
    p.add_argument("--scenario", required=True)
    p.add_argument("--episodes", type=int, default=8)
    p.add_argument("--seeds", type=_seed_list, default=None,
                   help="comma-separated episode seeds instead of --episodes")
    p.add_argument("--backend", choices=("sim", "vllm"), default="sim",
                   help="serve the episodes on the simulator (default) or the real engine")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.backend == "vllm":
        from feather_env.engines.vllm_engine import use_in_process_engine

        use_in_process_engine()
    try:
        res = compare(args.a, args.b, args.scenario, args.episodes, seeds=args.seeds, backend=args.backend)
    except (PolicyFormatError, ConfigError, ValueError) as exc:
        p.exit(2, f"agents.agreement: {exc}\n")
    print(f"{res['differ']} of {res['decisions']} decisions differ ({res['differ_fraction']:.1%}) on "
          f"{len(res['seeds'])} episode(s) of {args.scenario} ({args.backend})")
    rows = [[name, f["output_throughput"], f["mean_e2el_s"], f"{f['prefix_hit_rate']:.0%}"]
            for name, f in ((args.a, res["a_figures"]), (args.b, res["b_figures"]))]
    print(format_table(["policy", "e2e output tok/s", "mean E2E latency s", "prefix hit"], rows))
    if args.json:
        write_json(args.json, res)
    return res


if __name__ == "__main__":
    main()
