"""Fit the simulator's cost model to the real engine, and measure its error on fresh batches.

    python -m feather_env.calibrate --out configs/profiles/cpu-tiny-llama.json
    python -m feather_env.calibrate --validate configs/profiles/cpu-tiny-llama.json --json PATH

Calibration runs a grid of batch compositions (batch size x prefix groups x prefix
length x order in the batch) on :class:`~feather_env.backends.VLLMBackend`, records the
median decode step time and the prefill time of each, and fits
:class:`~feather_env.sim.CostModel` (see :mod:`feather_env.sim` for the model).
Validation draws *fresh* random compositions (unequal groups, per-request output
lengths, random or grouped order; another seed than the grid), runs them on the real
engine and reports the mean absolute percentage error of the predicted mean decode
step time: ``{"mape": ..., "n": ...}``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from feather_env.backends import BatchResult, VLLMBackend
from feather_env.engine import EngineConfig
from feather_env.sim import (
    PROFILE_VERSION,
    Composition,
    CostModel,
    SimBackend,
    composition_of,
    load_profile,
    step_features,
)
from feather_env.workloads.request import Request

GRID_BATCH = (1, 2, 4, 8, 16, 32, 64, 128)
GRID_GROUPS = (1, 2, 4, 8, 16)
GRID_PREFIX = (1000, 4000, 12000)
#: Percentile of a composition's decode step times taken as its step time. Load from other
#: processes on a shared machine only ever adds time (vLLM's CPU threads meet at a barrier
#: every layer, so one competing process can slow a burst of steps ~10x); a low percentile
#: estimates the uncontended step time that the simulator predicts. Calibration and
#: validation use the same estimator.
ROBUST_PERCENTILE = 20
#: Measurements during which other processes used more than this fraction of the machine
#: (after retries) are left out of fits and error figures, and counted as left out.
MAX_FOREIGN_LOAD = 0.10
CACHE_CANDIDATES = tuple(int(x) for x in np.geomspace(2048, 262144, 22)) + (10**9,)


class PrefixPool:
    """Random documents reused across compositions, so the prefix cache stays warm."""

    def __init__(self, seed: int, per_length: int = 16) -> None:
        self.rng = np.random.default_rng(seed)
        self.per_length = per_length
        self._pool: dict[int, list[np.ndarray]] = {}

    def get(self, length: int, i: int) -> np.ndarray:
        docs = self._pool.setdefault(length, [])
        while len(docs) <= i:
            docs.append(self.rng.integers(3, 8192, length, dtype=np.int32))
        return docs[i]


def build_batch(groups: Sequence[tuple[int, int]], outputs: Sequence[int], order: str,
                pool: PrefixPool, rng: np.random.Generator, tag: str) -> list[Request]:
    """``groups`` = [(prefix_len, members)]; ``order`` = ``"sorted"`` (by group) or ``"interleaved"``."""
    reqs: list[Request] = []
    k = 0
    for g, (plen, members) in enumerate(groups):
        doc = pool.get(plen, g)
        for _ in range(members):
            suffix = rng.integers(3, 8192, int(rng.integers(10, 40)), dtype=np.int32)
            reqs.append(Request(f"{tag}-{k}", np.concatenate([doc, suffix]), g, int(outputs[k])))
            k += 1
    if order == "interleaved":
        reqs = [reqs[i] for i in rng.permutation(len(reqs))]
    return reqs


def grid_specs(n_points: int, seed: int) -> list[dict[str, Any]]:
    """A seeded subset of the full grid, always including the corners that anchor the fit."""
    full = [dict(batch=b, groups=g, prefix=p, order=o)
            for b, g, p, o in itertools.product(GRID_BATCH, GRID_GROUPS, GRID_PREFIX,
                                                ("sorted", "interleaved"))
            if g <= b and not (g == 1 and o == "interleaved")]
    rng = np.random.default_rng(seed)
    anchors = [s for s in full if (s["batch"], s["groups"]) in {(1, 1), (128, 1), (128, 16), (32, 4)}]
    rest = [s for s in full if s not in anchors]
    pick = rng.choice(len(rest), size=max(0, min(n_points - len(anchors), len(rest))), replace=False)
    return anchors + [rest[i] for i in sorted(pick)]


def random_specs(n_points: int, seed: int) -> list[dict[str, Any]]:
    """Fresh compositions for validation: unequal groups, free lengths, per-request outputs."""
    rng = np.random.default_rng(seed)
    specs = []
    for _ in range(n_points):
        b = int(rng.integers(2, 129))
        g = int(rng.integers(1, min(b, 16) + 1))
        sizes = rng.multinomial(b - g, rng.dirichlet(np.ones(g))) + 1
        prefixes = [int(x) for x in rng.integers(800, 14000, g)]
        specs.append(dict(batch=b, groups=g, sizes=[int(s) for s in sizes], prefixes=prefixes,
                          order=str(rng.choice(["sorted", "interleaved"])),
                          outputs=[int(x) for x in rng.integers(12, 41, b)]))
    return specs


def _batch_from_spec(spec: dict[str, Any], pool: PrefixPool, rng: np.random.Generator,
                     tag: str, output_len: int) -> list[Request]:
    if "sizes" in spec:
        groups = list(zip(spec["prefixes"], spec["sizes"], strict=True))
        outputs = spec["outputs"]
    else:
        base, extra = divmod(spec["batch"], spec["groups"])
        groups = [(spec["prefix"], base + (1 if i < extra else 0)) for i in range(spec["groups"])]
        outputs = [output_len] * spec["batch"]
    return build_batch(groups, outputs, spec["order"], pool, rng, tag)


def measure(backend: VLLMBackend, specs: Sequence[dict[str, Any]], seed: int, output_len: int,
            label: str) -> list[tuple[dict[str, Any], list[Request], BatchResult]]:
    pool = PrefixPool(seed)
    rng = np.random.default_rng(seed + 1)
    out = []
    t0 = time.perf_counter()
    for i, spec in enumerate(specs):
        reqs = _batch_from_spec(spec, pool, rng, f"{label}{i}", output_len)
        res = backend.run_batch_quiet(reqs)
        out.append((spec, reqs, res))
        print(f"[{label} {i + 1}/{len(specs)} {time.perf_counter() - t0:6.0f}s] B={len(reqs):3d} "
              f"G={spec['groups']:2d} order={spec['order']:11s} "
              f"step={1e3 * statistics.median(res.step_times or [0]):7.2f} ms "
              f"({res.decode_tok_s:,.0f} tok/s) foreign load {res.foreign_cpu:.2f}", flush=True)
    return out


def _wls(X: np.ndarray, y: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """Least squares on relative error, with non-negative coefficients (drop-and-refit)."""
    w = (1.0 / y) * (np.sqrt(weights) if weights is not None else 1.0)
    keep = list(range(X.shape[1]))
    while True:
        coef = np.zeros(X.shape[1])
        sol, *_ = np.linalg.lstsq(X[:, keep] * w[:, None], y * w, rcond=None)
        coef[keep] = sol
        neg = [k for k in keep if coef[k] < 0]
        if not neg:
            return coef
        keep.remove(min(neg, key=lambda k: coef[k]))


def robust_step_time(times: Sequence[float]) -> float:
    return float(np.percentile(times, ROBUST_PERCENTILE))


def compare_steps(real_times: Sequence[float], real_sizes: Sequence[int],
                  pred: BatchResult) -> tuple[float, float]:
    """Mean decode step time, (real, predicted), over the real run's steps.

    Steps are grouped by running batch size (requests finish at different steps); the real
    time of each group is its robust step time, the predicted one the simulator's step time
    at that batch size.
    """
    pred_at = dict(zip(pred.step_batch_sizes, pred.step_times, strict=True))
    real_sum = pred_sum = 0.0
    count = 0
    for size in sorted(set(real_sizes)):
        if size not in pred_at:
            continue
        times = [t for t, b in zip(real_times, real_sizes, strict=True) if b == size]
        real_sum += len(times) * robust_step_time(times)
        pred_sum += len(times) * pred_at[size]
        count += len(times)
    if count == 0:
        raise ValueError("no decode step of the real run matches a simulated one")
    return real_sum / count, pred_sum / count


def raw_measurement(spec: dict[str, Any], reqs: Sequence[Request], res: BatchResult,
                    block_size: int) -> dict[str, Any]:
    """What a fit needs of one measured batch, in plain JSON (kept in the profile for --refit)."""
    comp = composition_of(reqs, block_size)
    return {"spec": spec, "prompt": comp.prompt.tolist(), "shared": comp.shared.tolist(),
            "group": comp.group.tolist(), "output": comp.output.tolist(),
            "step_times": res.step_times, "step_sizes": res.step_batch_sizes,
            "prefill_s": res.prefill_seconds, "foreign_cpu": res.foreign_cpu}


def _composition(m: dict[str, Any]) -> Composition:
    return Composition(prompt=np.array(m["prompt"]), shared=np.array(m["shared"]),
                       group=np.array(m["group"]), output=np.array(m["output"]))


def segments(m: dict[str, Any]) -> list[tuple[Composition, np.ndarray, float, float, int]]:
    """A measured batch's decode steps grouped by running batch size.

    Returns ``(composition, active mask, generated tokens, robust step time, steps)`` per
    group of at least two steps whose size matches the requests still running there.
    """
    comp = _composition(m)
    times = np.asarray(m["step_times"], dtype=float)
    sizes = np.asarray(m["step_sizes"])
    steps_needed = comp.output - 1
    out = []
    for size in sorted(set(sizes.tolist()), reverse=True):
        idx = np.flatnonzero(sizes == size)
        if idx.size < 2:
            continue
        # decode step k runs the requests that still need more than k tokens
        offset = int(steps_needed.max()) - len(times)  # decode steps before the window
        k = float(idx.mean()) + offset
        active = steps_needed > k
        if int(active.sum()) != size:
            continue
        out.append((comp, active, 1.0 + k, robust_step_time(times[idx]), int(idx.size)))
    return out


def fit(measurements: Sequence[dict[str, Any]], block_size: int,
        max_batched: int) -> tuple[CostModel, float]:
    """Fit the decode model (grid over cache size) and the prefill model; returns model and MAPE.

    Every measured batch contributes one point per running batch size (see :func:`segments`),
    weighted by its number of steps; the MAPE is over those points, weighted the same way.
    """
    segs = [seg for m in measurements
            if m["step_times"] and m.get("foreign_cpu", 0.0) <= MAX_FOREIGN_LOAD
            for seg in segments(m)]
    ys = [seg[3] for seg in segs]
    weights = np.array([seg[4] for seg in segs], dtype=float)
    y = np.array(ys)
    best = None
    for cache in CACHE_CANDIDATES:
        X = np.array([(1.0, *step_features(c, act, g, cache)) for c, act, g, _, _ in segs])
        coef = _wls(X, y, weights)
        mape = float(np.average(np.abs(X @ coef - y) / y, weights=weights))
        if best is None or mape < best[0]:
            best = (mape, cache, coef)
    mape, cache, coef = best
    rows, py = [], []
    for m in measurements:
        if m["prefill_s"] <= 0:
            continue
        comp = _composition(m)
        new = np.maximum(comp.prompt - comp.shared, 1)
        steps = max(1, int(np.ceil(new.sum() / max_batched)))
        rows.append((steps, float(new.sum()), float((new * comp.prompt).sum())))
        py.append(m["prefill_s"])
    pcoef = _wls(np.array(rows), np.array(py)) if rows else np.zeros(3)
    model = CostModel(cache_tokens=float(cache), decode=tuple(float(c) for c in coef),
                      prefill=tuple(float(c) for c in pcoef), block_size=block_size,
                      max_num_batched_tokens=max_batched)
    return model, mape


def calibrate(args: argparse.Namespace) -> dict[str, Any]:
    from feather_env.reporting import machine_info

    engine = EngineConfig(kv_cache_gib=args.kv_cache_gib, max_num_seqs=256,
                          max_model_len=16384 + 256)
    backend = VLLMBackend(engine, warm_prefixes=True)
    backend.warmup()
    specs = grid_specs(args.points, args.seed)
    points = measure(backend, specs, args.seed, args.output_len, "grid")
    if args.random_points:
        # unequal groups and per-request outputs, like the environment's batches
        points += measure(backend, random_specs(args.random_points, args.seed + 1), args.seed + 1,
                          args.output_len, "rand")
    raw = [raw_measurement(s, r, res, engine.block_size) for s, r, res in points]
    model, train_mape = fit(raw, engine.block_size, engine.max_num_batched_tokens)
    profile = {
        "version": PROFILE_VERSION,
        "model": {"cache_tokens": model.cache_tokens, "decode": list(model.decode),
                  "prefill": list(model.prefill), "block_size": model.block_size,
                  "max_num_batched_tokens": model.max_num_batched_tokens},
        "engine": engine.to_dict(),
        "kv_capacity_tokens": backend.kv_capacity_tokens,
        "fit_mape": train_mape,
        "measured_on": machine_info(),
        "measurements": raw,
        "command": "python -m feather_env.calibrate " + " ".join(sys.argv[1:]),
    }
    backend.close()
    print(f"fit: cache_tokens={model.cache_tokens:.0f} decode={model.decode} "
          f"prefill={model.prefill} training MAPE={train_mape:.3f}")
    return profile


def validate(args: argparse.Namespace) -> dict[str, Any]:
    from feather_env.reporting import machine_info

    profile = load_profile(args.validate)
    sim = SimBackend.from_profile(args.validate)
    engine = EngineConfig.from_dict(profile["engine"])
    backend = VLLMBackend(engine, warm_prefixes=True)
    backend.warmup()
    specs = random_specs(args.points, args.seed)
    points = measure(backend, specs, args.seed, args.output_len, "val")
    backend.close()
    rows = []
    excluded = 0
    for spec, reqs, res in points:
        if not res.step_times:
            continue
        if res.foreign_cpu > MAX_FOREIGN_LOAD:
            excluded += 1
            continue
        pred = sim.run_batch(reqs)
        real_mean, pred_mean = compare_steps(res.step_times, res.step_batch_sizes, pred)
        plain_mean = res.decode_seconds / len(res.step_times)
        rows.append({**raw_measurement(spec, reqs, res, sim.model.block_size),
                     "real_step_s": real_mean, "pred_step_s": pred_mean,
                     "real_plain_mean_step_s": plain_mean,
                     "plain_ape": abs(pred_mean - plain_mean) / plain_mean,
                     "real_decode_tok_s": res.decode_tok_s, "pred_decode_tok_s": pred.decode_tok_s,
                     "ape": abs(pred_mean - real_mean) / real_mean})
    apes = [r["ape"] for r in rows]
    result = {"mape": float(np.mean(apes)), "median_ape": float(np.median(apes)), "n": len(rows),
              "estimator": f"p{ROBUST_PERCENTILE} of decode step times per running batch size",
              "excluded_under_load": excluded,
              "mape_plain_mean": float(np.mean([r["plain_ape"] for r in rows])),
              "profile": str(args.validate), "seed": args.seed, "machine": machine_info(),
              "points": rows}
    print(f"validation on {len(rows)} fresh compositions: MAPE={result['mape']:.3f} "
          f"(median APE {result['median_ape']:.3f})")
    return result


def refit(path: str, out: str | None) -> dict[str, Any]:
    """Fit again from the measurements stored in a profile (no engine needed)."""
    profile = load_profile(path)
    m = profile["model"]
    model, mape = fit(profile["measurements"], m["block_size"], m["max_num_batched_tokens"])
    profile["model"].update(cache_tokens=model.cache_tokens, decode=list(model.decode),
                            prefill=list(model.prefill))
    profile["fit_mape"] = mape
    print(f"refit: cache_tokens={model.cache_tokens:.0f} decode={model.decode} "
          f"prefill={model.prefill} training MAPE={mape:.3f}")
    if out:
        Path(out).write_text(json.dumps(profile, indent=1) + "\n")
        print(f"wrote {out}")
    return profile


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Calibrate or validate the simulator on the real engine.")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--out", help="measure the grid, fit, and write a profile here")
    mode.add_argument("--validate", help="profile to validate on fresh compositions")
    mode.add_argument("--refit", help="fit again from a profile's stored measurements")
    p.add_argument("--json", help="with --validate: write {'mape', 'n', ...} here")
    p.add_argument("--points", type=int, default=None,
                   help="compositions to measure (default 48 for --out, 24 for --validate)")
    p.add_argument("--output-len", type=int, default=24, help="grid output tokens per request")
    p.add_argument("--random-points", type=int, default=24,
                   help="with --out: random compositions measured besides the grid")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--kv-cache-gib", type=float, default=4.0)
    args = p.parse_args(argv)
    if args.refit:
        refit(args.refit, args.json)
        return 0
    if args.out:
        args.points = args.points or 40
        args.seed = 0 if args.seed is None else args.seed
        profile = calibrate(args)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(profile, indent=1) + "\n")
        print(f"wrote {args.out}")
    else:
        args.points = args.points or 24
        args.seed = 7919 if args.seed is None else args.seed
        result = validate(args)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
            print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
