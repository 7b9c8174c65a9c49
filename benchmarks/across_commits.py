"""One scenario served by the code of several commits, alternating, on one engine: is a slide the code,
the policy or the machine?

    python -m benchmarks.across_commits --scenario leval-high-load --repeats 7 \\
        --arm 1-dec=7255c0e --arm 3-dec=9aa05fc --arm today=HEAD \\
        --arm today+1-dec-file=HEAD:feather:@7255c0e:policies/leval-high-load.feather \\
        --schedulers fcfs,feather-heuristic,feather:policies/leval-high-load.feather \\
        --cpu-cores 1 --json results/across_commits.json

Each arm is ``LABEL=REV`` (that commit's code, ``evaluate.py`` and policy files, in a detached git
worktree) or ``LABEL=REV:SCHEDULERS`` (its own schedulers; a policy path written ``@REV2:PATH`` is that
file as it was at ``REV2``, so one commit's code can serve another's policy). Round ``r`` runs every
arm once (``evaluate.py --repeats 1``, a fresh engine per arm), in an order rotated by ``r``, so that
a drift of the machine falls on every arm alike. Per arm and scheduler: output tok/s of each round,
their median, and the scheduler's share of step time; per arm, the ratio of each scheduler to the
first one (``fcfs``) round by round and its median; the engine steps of each run and the median
time per step, which tell a run that decided otherwise (other steps) from one that only ran at
another speed. Every run must serve every request: a failed request stops the benchmark.

``--busy LABEL`` runs that arm with a busy neighbour (float32 matrix products in one thread, pinned
to ``--neighbour-cores``, by default core 0) for as long as its engine runs: arms ``quiet=HEAD`` and
``busy=HEAD`` with ``--busy busy`` measure what the other core's load does to a ratio. ``--lock``
holds a file (``flock``) during each run, so that other engine work waits and a neighbour never
loads the machine under another's run.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from feather_env.reporting import format_table, machine_info, write_json

ROOT = Path(__file__).resolve().parent.parent


def parse_arm(text: str, default_schedulers: str) -> tuple[str, str, str]:
    """``LABEL=REV[:SCHEDULERS]`` -> (label, rev, schedulers)."""
    label, sep, rest = text.partition("=")
    if not sep or not label or not rest:
        raise SystemExit(f"--arm {text!r}: expected LABEL=REV or LABEL=REV:SCHEDULERS")
    rev, _, schedulers = rest.partition(":")
    return label, rev, schedulers or default_schedulers


def checkout(rev: str, into: Path) -> Path:
    """A detached worktree of ``rev`` under ``into`` (the commit's whole tree)."""
    sha = subprocess.run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.strip()
    path = into / sha[:12]
    if not path.exists():
        subprocess.run(["git", "worktree", "add", "--detach", "-f", str(path), sha], cwd=ROOT, check=True,
                       capture_output=True)
    return path


def resolve_files(schedulers: str, into: Path) -> str:
    """Replace each ``@REV:PATH`` in a scheduler list by that file as it was at ``REV``."""
    out = []
    for name in schedulers.split(","):
        head, at, spec = name.partition("@")
        if at and ":" in spec and not spec.split(":", 1)[0].isdigit():
            rev, path = spec.split(":", 1)
            blob = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True,
                                  capture_output=True).stdout
            target = into / f"{rev.replace('/', '_')}-{Path(path).name}"
            target.write_bytes(blob)
            name = f"{head}{target}"
        out.append(name)
    return ",".join(out)


#: The busy neighbour: float32 matrix products of 16 MiB operands (half this host's L3), forever.
NEIGHBOUR = ("import numpy as np\na = np.random.default_rng(0).random((2048, 2048), dtype=np.float32)\n"
             "while True:\n    a = (a @ a) / 2048.0\n")


@contextlib.contextmanager
def held(lock: Path | None) -> Iterator[None]:
    """Hold ``lock`` (``flock``, exclusive) inside the block; nothing when ``None``."""
    if lock is None:
        yield
        return
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def neighbour(cores: str | None, python: str) -> Iterator[None]:
    """A busy process (:data:`NEIGHBOUR`) pinned to ``cores`` inside the block; nothing when ``None``."""
    if not cores:
        yield
        return
    proc = subprocess.Popen(["taskset", "-c", cores, python, "-c", NEIGHBOUR], env=dict(
        os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1"))
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


def run_arm(tree: Path, scenario: str, schedulers: str, cpu_cores: str | None, out: Path,
            python: str, lock: Path | None = None,
            busy_cores: str | None = None) -> dict[str, dict[str, float]]:
    """One ``evaluate.py`` run of the tree's code; per scheduler its output tok/s, scheduler share, and
    what shows whether it decided the same (engine steps, preemptions, prefix hits) or only ran at
    another speed (ms per step). ``lock``: a file held (``flock``) for the run, so that other engine
    work on the machine waits; ``busy_cores``: run :func:`neighbour` there meanwhile."""
    cmd = [python, "evaluate.py", "--scenario", scenario, "--schedulers", schedulers, "--repeats", "1",
           "--out", str(out), "--no-plots", "--no-progress"]
    if cpu_cores:
        cmd += ["--cpu-cores", cpu_cores]
    env = dict(os.environ, PYTHONPATH=str(tree))
    with held(lock), neighbour(busy_cores, python):
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{tree}: evaluate.py failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return read_runs(out)


def read_runs(out: Path) -> dict[str, dict[str, float]]:
    """What :func:`run_arm` reports of a finished run's folder."""
    runs = json.loads((out / "results.json").read_text())["runs"]
    res = {}
    for name, run in runs.items():
        if run["completed"] != run["submitted"]:
            raise SystemExit(f"{out}: {name} served {run['completed']} of {run['submitted']} requests")
        res[name] = {"output_throughput": run["output_throughput"],
                     "scheduler_overhead_frac": run.get("scheduler_overhead_frac"),
                     "engine_steps": run["engine_steps"], "preemptions": run["preemptions"],
                     "prefix_hit_rate": run["prefix_hit_rate"],
                     "ms_per_step": 1000.0 * run["step_seconds"] / max(1, run["engine_steps"])}
    return res


def summarize(rounds: list[dict[str, dict[str, dict[str, float]]]]) -> dict[str, Any]:
    """Per arm: per scheduler the tok/s of each round and the median; the ratio to the first scheduler."""
    out: dict[str, Any] = {}
    for arm in rounds[0]:
        names = list(rounds[0][arm])
        base = names[0]
        per: dict[str, Any] = {}
        for name in names:
            tput = [r[arm][name]["output_throughput"] for r in rounds]
            share = [r[arm][name]["scheduler_overhead_frac"] for r in rounds
                     if r[arm][name]["scheduler_overhead_frac"] is not None]
            ratio = [r[arm][name]["output_throughput"] / r[arm][base]["output_throughput"] for r in rounds]
            steps = [r[arm][name].get("engine_steps") for r in rounds]
            ms = [r[arm][name]["ms_per_step"] for r in rounds if "ms_per_step" in r[arm][name]]
            per[name] = {"output_throughput": tput, "median_output_throughput": statistics.median(tput),
                         "engine_steps": steps, "median_ms_per_step": statistics.median(ms) if ms else None,
                         f"ratio_to_{base}": ratio, f"median_ratio_to_{base}": statistics.median(ratio),
                         "median_scheduler_share": statistics.median(share) if share else None}
        out[arm] = per
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", required=True)
    p.add_argument("--schedulers", default="fcfs,feather-heuristic")
    p.add_argument("--arm", action="append", required=True, help="LABEL=REV[:SCHEDULERS] (repeatable)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--cpu-cores", default=None)
    p.add_argument("--json", type=Path, default=None, help="written after every round")
    p.add_argument("--lock", type=Path, default=None, help="hold this file (flock) during each run")
    p.add_argument("--busy", action="append", default=[], metavar="LABEL",
                   help="run this arm with a busy neighbour on --neighbour-cores (repeatable)")
    p.add_argument("--neighbour-cores", default="0", help="where --busy's neighbour runs (default 0)")
    p.add_argument("--resume", action="store_true",
                   help="read the runs already in --work (r<round>-<label>/) instead of serving them again")
    p.add_argument("--work", type=Path, default=None,
                   help="where the worktrees and runs go (default: a temp dir)")
    args = p.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="across-commits-"))
    work.mkdir(parents=True, exist_ok=True)
    arms = []
    for text in args.arm:
        label, rev, schedulers = parse_arm(text, args.schedulers)
        arms.append((label, rev, checkout(rev, work / "trees"), resolve_files(schedulers, work)))
    rounds: list[dict[str, Any]] = []
    for r in range(args.repeats):
        order = arms[r % len(arms):] + arms[: r % len(arms)]
        got = {}
        for label, _rev, tree, schedulers in order:
            busy = args.neighbour_cores if label in args.busy else None
            out = work / f"r{r}-{label}"
            if args.resume and (out / "results.json").is_file():
                got[label] = read_runs(out)
            else:
                got[label] = run_arm(tree, args.scenario, schedulers, args.cpu_cores, out, sys.executable,
                                     args.lock, busy)
            print(f"round {r + 1}/{args.repeats} {label}: " + ", ".join(
                f"{n} {v['output_throughput']:.1f}" for n, v in got[label].items()), flush=True)
        rounds.append({label: got[label] for label, *_ in arms})
        summary = summarize(rounds)
        if args.json:
            write_json(args.json, {"benchmark": "across_commits", "scenario": args.scenario,
                                   "repeats": args.repeats, "rounds_done": len(rounds),
                                   "cpu_cores": args.cpu_cores,
                                   "arms": [{"label": a[0], "rev": a[1], "schedulers": a[3]} for a in arms],
                                   "rounds": rounds, "summary": summary, "machine": machine_info()},
                       quiet=True)
    rows = []
    for label, rev, _tree, _s in arms:
        for name, v in summary[label].items():
            ratio = next(val for key, val in v.items() if key.startswith("median_ratio_to_"))
            share = v["median_scheduler_share"]
            rows.append([label, rev, name, f"{v['median_output_throughput']:.1f}", f"{ratio:.3f}",
                         "n/a" if share is None else f"{100 * share:.2f}%"])
    print(format_table(["arm", "rev", "scheduler", "median tok/s", "median ratio to first", "sched share"],
                       rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
