"""The simulator's error against the real engine, on fresh episodes: the rendering of
``results/sim_validation.json``, which the calibration writes (``make bench``)::

    python -m feather_env.calibrate --validate PROFILE --json results/sim_validation.json

with ``PROFILE`` the shipped ``configs/profiles/cpu-tiny-llama.json``, and of the other validations
of ``results/sim_validation_*.json`` (another profile, or one scenario served by the schedulers named
with ``--scenario S --schedulers a,b``: the JSON's ``plan`` and ``command`` say which;
:func:`feather_env.calibrate.validate`: the same episodes and policies served on the real engine and on
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
    plan = res.get("plan")
    what = ("other seeds than the calibration; with and without KV pressure, burst and Poisson arrivals, "
            "several orderings" if not plan else
            f"of `{plan['scenario']}`, served by {', '.join(f'`{s}`' for s in plan['schedulers'])}")
    command = res.get("command", f"python -m feather_env.calibrate --validate {res['profile']} "
                                 "--json results/sim_validation.json")
    return "\n".join([
        f"Simulator (profile `{res['profile']}`) against the real engine on **{res['n']} fresh episodes** "
        f"({what}; {measured(res)}; `{command}`): **makespan MAPE {res['makespan_mape']:.3f}**, "
        f"**hit-rate error {res['hit_rate_abs_err']:.4f}** (absolute), median per-request E2E latency "
        f"error {num(res['latency_median_ape'], '{:.3f}')}; {res.get('excluded_under_load', 0)} episodes "
        "left out under foreign load.", "",
        format_table(["episode", "seed", "requests", "real makespan s", "sim makespan s", "error",
                      "real hit", "sim hit", "median latency error"], rows)])
