"""The simulator's error against the real engine, on fresh episodes: the rendering of
``results/sim_validation.json``, which the calibration writes (``make bench``)::

    python -m feather_env.calibrate --validate PROFILE --json results/sim_validation.json

with ``PROFILE`` the shipped ``configs/profiles/cpu-tiny-llama.json``
(:func:`feather_env.calibrate.validate`: the same episodes and policies served on the real engine and on
the simulator with the profile; the figures are defined in :mod:`feather_env.calibrate`).
"""

from __future__ import annotations

from typing import Any

from benchmarks import measured, num
from feather_env.reporting import format_table

__all__ = ["render"]


def render(res: dict[str, Any]) -> str:
    """The validation in markdown: the error figures, then every episode, real against simulated."""
    rows = [[e["label"], e["seed"], e["requests"], e["real_duration_s"], e["sim_duration_s"],
             f"{e['makespan_ape']:.1%}", f"{e['real_hit_rate']:.1%}", f"{e['sim_hit_rate']:.1%}",
             num(e["latency_median_ape"], "{:.1%}")] for e in res["episodes"]]
    return "\n".join([
        f"Simulator against the real engine on **{res['n']} fresh episodes** (other seeds than the "
        f"calibration; with and without KV pressure, burst and Poisson arrivals, several orderings; "
        f"{measured(res)}; `python -m feather_env.calibrate --validate {res['profile']} "
        f"--json results/sim_validation.json`): **makespan MAPE {res['makespan_mape']:.3f}**, "
        f"**hit-rate error {res['hit_rate_abs_err']:.4f}** (absolute), median per-request E2E latency "
        f"error {num(res['latency_median_ape'], '{:.3f}')}; {res.get('excluded_under_load', 0)} episodes "
        "left out under foreign load.", "",
        format_table(["episode", "seed", "requests", "real makespan s", "sim makespan s", "error",
                      "real hit", "sim hit", "median latency error"], rows)])
