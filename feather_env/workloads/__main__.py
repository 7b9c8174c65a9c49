"""Command line of the workloads package: export a scenario's episode for vLLM's own benchmark tool.

    python -m feather_env.workloads export --scenario NAME [--seed S] --out FILE.jsonl

writes the episode's requests as ``{"prompt": TEXT, "output_tokens": N, ...}`` lines
(:mod:`feather_env.workloads.export`), which ``vllm bench serve`` replays::

    vllm bench serve --backend vllm --model tiny-llama --tokenizer configs/models/tiny-llama \\
        --dataset-name custom --dataset-path FILE.jsonl --skip-chat-template --disable-shuffle \\
        --num-prompts N --ignore-eos --request-rate inf
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m feather_env.workloads", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="a scenario's episode as vllm bench serve's custom dataset (JSONL)")
    ex.add_argument("--scenario", required=True, help="a scenario name (configs/scenarios) or YAML path")
    ex.add_argument("--seed", type=int, default=0, help="episode seed (as evaluate.py --seed)")
    ex.add_argument("--out", required=True, help="the .jsonl file to write")
    args = p.parse_args(argv)

    from feather_env.reporting import check_output_file
    from feather_env.scenarios import load_scenario
    from feather_env.workloads.datadir import DataNotFoundError
    from feather_env.workloads.export import export_jsonl
    from feather_env.workloads.workload import WorkloadError
    from scheduler_runtime.config import ConfigError

    try:  # the output first: nothing is built for a file that cannot be written
        if not args.out.endswith(".jsonl"):
            raise ValueError("--out must name a .jsonl file (vLLM's CustomDataset reads only JSON lines)")
        check_output_file(args.out, "--out", "a .jsonl file")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        scenario = load_scenario(args.scenario)
        episode = scenario.episode_workload(args.seed)
    except (ConfigError, DataNotFoundError, WorkloadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    s = export_jsonl(episode, args.out)
    print(f"wrote {s.path}: {s.requests} requests of scenario {scenario.name} (episode {args.seed}), "
          f"{s.prompt_tokens} prompt tokens ({s.reencoded_prompt_tokens} once re-encoded from the text; "
          f"{s.exact_prompts} prompts exact, at most {s.max_length_drift} tokens apart), "
          f"{s.output_tokens} output tokens")
    print(f"replay: vllm bench serve --dataset-name custom --dataset-path {s.path} --skip-chat-template "
          f"--disable-shuffle --num-prompts {s.requests} --ignore-eos --tokenizer configs/models/tiny-llama "
          "...")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
