"""The simulator fitted to this machine: ``evaluate.py advise``'s short probe on the real engine.

A few settings are served on the engine on one short episode (a trace's window, shortened, or one
whole episode of a scenario without windows): vLLM's fcfs at the engine's budget and at 512 tokens
(one prefill at once; prefill chunks interleaved with decode steps), and a document cap at 256
tokens (many running requests and few tokens a step: a step's per-request cost). Every shipped
profile (``configs/profiles/``) serves the same episodes in the simulator and is scored by its worst
error (makespan, mean TTFT, mean TPOT); the best is kept, or, above :data:`MAX_PROFILE_ERROR`, the
probe's own steps are fitted into a new profile. A setting served while other processes used more
than ``calibrate``'s foreign-load limit of the engine's cores is served again.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from feather_env.engines.vllm_engine import REPO_ROOT
from feather_env.scenarios import Scenario
from feather_env.serving_metrics import serving_metrics

__all__ = ["MAX_PROFILE_ERROR", "PROFILE_DIR", "check_profile", "probe_names", "probe_overrides"]

PROFILE_DIR = REPO_ROOT / "configs" / "profiles"
#: A profile whose worst probe error (makespan, mean TTFT, mean TPOT) is above this is refitted.
MAX_PROFILE_ERROR = 0.10
#: The document cap's budget in the probe: the smallest the search tries.
SMALL_BUDGET = 256


def _errors(real: Mapping[str, Any], sim: Mapping[str, Any]) -> dict[str, float]:
    """Relative errors of the simulator's makespan, mean TTFT and mean TPOT against the engine's."""
    out = {}
    for key, metric in (
        ("makespan", "duration"),
        ("mean_ttft", "mean_ttft_ms"),
        ("mean_tpot", "mean_tpot_ms"),
    ):
        r, s = real.get(metric), sim.get(metric)
        out[key] = abs(s - r) / r if r and s is not None and math.isfinite(s) else math.inf
    return out


def probe_names(scenario: Scenario) -> tuple[str, ...]:
    """The probe's settings: vLLM's fcfs at the engine's budget and at 512 tokens (the two ends the
    search moves between: one prefill at once, prefill chunks interleaved with decode steps), and a
    document cap at the smallest budget searched (256: many running requests and few tokens a step,
    which pins down the per-request cost of a step that the two fcfs runs leave open)."""
    engine_budget = scenario.engine.max_num_batched_tokens
    small = [n for n, b in (("fcfs@512", 512), (f"group-cap-8@{SMALL_BUDGET}", SMALL_BUDGET))
             if engine_budget > b]
    return ("fcfs", *small)


def probe_overrides(scenario: Scenario, window_s: float) -> dict[str, Any]:
    """The probe's episode: the trace's window shortened to ``window_s``; a scenario of whole
    episodes (no window) is probed on one episode as it is."""
    window = scenario.episode.window_s
    return {"episode": {"window_s": min(window_s, window)}} if window is not None else {}


def check_profile(
    scenario: Scenario,
    out_dir: Path,
    *,
    seed: int,
    window_s: float,
    backend: Any = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Serve the probe (module docstring) on the real engine, episode ``seed``, a trace's window cut
    to ``window_s``; score every profile of ``configs/profiles`` on it, and pick the best, or refit
    on the probe's steps (into ``out_dir/profile.json``) when even the best is over
    :data:`MAX_PROFILE_ERROR`. Returns ``{"profile", "error", "errors", "candidates", "refitted", ...}``.
    """
    from feather_env.calibrate import (
        MAX_FOREIGN_LOAD,
        EpisodeSpec,
        _Engines,
        _serve,
        _serve_quiet,
        fit_profile,
    )
    from feather_env.engines.sim_backend import SimBackend

    overrides = probe_overrides(scenario, window_s)
    specs = [EpisodeSpec(scenario, name, seed, overrides, f"probe-{name}") for name in probe_names(scenario)]
    engines = _Engines(backend)
    real: dict[str, dict[str, Any]] = {}
    steps: list[tuple[Any, float]] = []
    t0 = time.perf_counter()
    try:
        for spec in specs:
            engine = engines.get(spec)
            _, env, foreign = _serve_quiet(spec, engine, MAX_FOREIGN_LOAD, record=True, log=log)
            real[spec.scheduler] = {**serving_metrics(env.backend.timelines()), "foreign_cpu": foreign}
            steps += [(m.batch, m.seconds) for m in engine.measured_steps]
            engine.record_steps = False
            log(
                f"  probe {spec.scheduler} on the engine: {real[spec.scheduler]['completed']} requests in "
                f"{real[spec.scheduler]['duration']:.1f} s ({time.perf_counter() - t0:.0f} s so far)"
            )
    finally:
        engines.close()

    def score(profile: str | Path) -> dict[str, Any]:
        per = {}
        for spec in specs:
            _, env, _ = _serve(spec, SimBackend(spec.load().engine_config(), profile), record=False)
            per[spec.scheduler] = _errors(real[spec.scheduler], serving_metrics(env.backend.timelines()))
        worst = max(max(e.values()) for e in per.values())
        return {"profile": str(profile), "error": worst, "errors": per}

    candidates = [score(p) for p in sorted(PROFILE_DIR.glob("*.json"))]
    for c in candidates:
        log(f"  profile {Path(c['profile']).name}: worst probe error {c['error']:.1%}")
    best = min(candidates, key=lambda c: c["error"])
    refitted = False
    if best["error"] > MAX_PROFILE_ERROR:
        out_dir.mkdir(parents=True, exist_ok=True)
        fitted = out_dir / "profile.json"
        profile = fit_profile(
            steps, [{"label": s.label, "seed": s.seed, "scheduler": s.scheduler} for s in specs]
        )
        fitted.write_text(json.dumps(profile, indent=1))
        mine = score(fitted)
        mine["in_sample"] = True
        log(f"  refitted on the probe's {len(steps)} steps: {fitted} (in-sample error {mine['error']:.1%})")
        candidates.append(mine)
        if mine["error"] < best["error"]:
            best, refitted = mine, True
    return {
        **best,
        "refitted": refitted,
        "candidates": candidates,
        "probe": {
            "seed": seed,
            "window_s": overrides["episode"]["window_s"] if overrides else None,
            "schedulers": [s.scheduler for s in specs],
            "real": {
                k: {
                    m: v.get(m)
                    for m in ("completed", "duration", "mean_ttft_ms", "mean_tpot_ms", "foreign_cpu")
                }
                for k, v in real.items()
            },
            "steps": len(steps),
            "wall_s": time.perf_counter() - t0,
        },
    }
