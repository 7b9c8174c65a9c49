"""Does an engine step cost more when more requests wait? The step model's residual against the backlog.

    python -m feather_env.calibrate --out /tmp/p.json --scenario configs/scenarios/mooncake-synthetic.yaml \
        --schedulers group-cap-8@256 --episodes 1 --steps-out STEPS.json
    python -m benchmarks.step_backlog --steps STEPS.json \
        --profile configs/profiles/cpu-tiny-llama-epyc-avx512.json \
        --json results/advise/windows/step_backlog.json

The step model (:mod:`feather_env.step_model`) prices what a step computes: its requests, tokens,
KV reads and prefill attention. It has no term for the requests waiting in the scheduler's queue,
yet the measured time is the engine's whole ``step()``: scheduling included. This reads a
``--steps-out`` file (each step with the requests waiting as it started), predicts every step with
the profile, and reports the residual (measured - predicted) by backlog and by the step's batch
size, with least-squares lines ``residual = a + b * waiting`` and ``a' + b' * scheduled``: ``b``
is what each waiting request adds to a step, ``b'`` what each scheduled one adds beyond the model.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from feather_env.calibrate import load_steps
from feather_env.reporting import format_table, machine_info, write_json
from feather_env.step_model import StepCostModel, load_profile, step_features

#: Backlog bins (requests waiting as the step started): [low, high).
BINS = ((0, 1), (1, 50), (50, 200), (200, 500), (500, 10**9))
#: Batch-size bins (requests the step scheduled).
SCHEDULED_BINS = ((1, 2), (2, 16), (16, 32), (32, 48), (48, 10**9))


def analyse(steps_path: str | Path, profile_path: str | Path) -> dict[str, Any]:
    """The residual of ``profile_path``'s model on the steps of ``steps_path``, by backlog."""
    steps, episodes = load_steps(steps_path)
    waiting = np.array([s.get("waiting", 0) for s in json.loads(Path(steps_path).read_text())["steps"]],
                       dtype=np.float64)
    model = StepCostModel.from_dict(load_profile(profile_path)["step_model"])
    coef = np.array(model.coef)
    measured = np.array([t for _, t in steps])
    predicted = np.array([float(step_features(b, model.cache_tokens) @ coef) for b, _ in steps])
    residual = measured - predicted
    running = np.array([len(b) for b, _ in steps], dtype=np.float64)
    slope, intercept = np.polyfit(waiting, residual, 1)
    per_request, at_none = np.polyfit(running, residual, 1)

    def binned(values: np.ndarray, bins: Sequence[tuple[int, int]], key: str) -> list[dict[str, Any]]:
        rows = []
        for lo, hi in bins:
            sel = (values >= lo) & (values < hi)
            if sel.any():
                rows.append({key: [lo, hi], "steps": int(sel.sum()),
                             "mean_measured_ms": float(measured[sel].mean() * 1e3),
                             "mean_predicted_ms": float(predicted[sel].mean() * 1e3),
                             "mean_residual_ms": float(residual[sel].mean() * 1e3),
                             "residual_share": float(residual[sel].sum() / measured[sel].sum())})
        return rows

    return {"steps": len(steps), "episodes": episodes, "profile": str(profile_path),
            "total_measured_s": float(measured.sum()), "total_predicted_s": float(predicted.sum()),
            "residual_per_waiting_request_us": float(slope * 1e6),
            "residual_at_no_backlog_ms": float(intercept * 1e3),
            "correlation": float(np.corrcoef(waiting, residual)[0, 1]) if waiting.std() > 0 else None,
            "residual_per_scheduled_request_us": float(per_request * 1e6),
            "residual_at_empty_batch_ms": float(at_none * 1e3),
            "correlation_scheduled": (float(np.corrcoef(running, residual)[0, 1]) if running.std() > 0
                                      else None),
            "by_backlog": binned(waiting, BINS, "waiting"),
            "by_scheduled": binned(running, SCHEDULED_BINS, "scheduled")}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", required=True, help="a calibrate --steps-out file")
    p.add_argument("--profile", required=True)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    out = {"benchmark": "step_backlog", "machine": machine_info(), "steps_file": args.steps,
           **analyse(args.steps, args.profile)}
    out["wall_s"] = time.perf_counter() - t0
    print(f"{out['steps']} steps: measured {out['total_measured_s']:.1f} s, the profile predicts "
          f"{out['total_predicted_s']:.1f} s; residual = {out['residual_at_no_backlog_ms']:.2f} ms + "
          f"{out['residual_per_waiting_request_us']:.2f} us x waiting "
          f"(correlation {out['correlation']:.2f})\n")
    print(f"by the batch: residual = {out['residual_at_empty_batch_ms']:.2f} ms + "
          f"{out['residual_per_scheduled_request_us']:.2f} us x scheduled requests "
          f"(correlation {out['correlation_scheduled']:.2f})\n")
    for key, name in (("by_backlog", "waiting"), ("by_scheduled", "scheduled")):
        rows = [[f"{lo}-{hi - 1 if hi < 10**9 else ''}", r["steps"], f"{r['mean_measured_ms']:.2f}",
                 f"{r['mean_predicted_ms']:.2f}", f"{r['mean_residual_ms']:.2f}",
                 f"{r['residual_share']:.1%}"] for r in out[key] for lo, hi in [r[name]]]
        print(format_table([name, "steps", "mean measured ms", "mean predicted ms", "mean residual ms",
                            "residual share"], rows) + "\n")
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
