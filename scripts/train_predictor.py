"""Train the output-length predictor shipped in ``configs/predictors/output_len.json``.

Usage::

    python scripts/train_predictor.py [--out configs/predictors/output_len.json] [--data-dir DIR]

Data: every L-Eval question (prompt capped at 16K tokens, output at 512, as the evaluation
runs them), every LongBench item (synthetic prompt content of the item's length, output
capped at the task's max new tokens) and ``--sharegpt-rows`` rows of the ShareGPT trace
(prompt/decode lengths; synthetic content). Each request's source (``leval/TASK``,
``longbench/TASK``, ``trace/...``) is a feature.

Split: ``--holdout`` (20%) of the prefix groups of each dataset (L-Eval: whole documents, so
no question of a held-out document was seen in training) are held out; the penalties (of the length and source
weights, and of the hashed-token weights) are chosen on a validation part of the training
groups. The held-out numbers written into the
file's ``metrics`` (and printed): MAE in tokens overall and per dataset, next to two
baselines (the training median, and the training median of the request's source), and the
short/long classifier's accuracy next to the majority class (overall and per source); also
both without the request's source (what a server sees when clients do not send it).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from feather_env.workloads import load_leval, load_longbench, load_trace, resolve_data_dir  # noqa: E402
from feather_env.workloads.traces import TRACE_FILES  # noqa: E402
from scheduler_runtime.predictor import DEFAULT_PREDICTOR_PATH, OutputLengthPredictor  # noqa: E402


def load_requests(data_dir: str | None, sharegpt_rows: int, seed: int):
    """Prompt lengths, prompt tails, sources, output lengths, group keys, dataset names."""
    leval = load_leval(data_dir)
    longbench = load_longbench(data_dir)
    trace = load_trace(resolve_data_dir(data_dir, "traces") / TRACE_FILES["sharegpt"], seed=seed)
    trace = trace.sample(min(sharegpt_rows, len(trace)), seed)
    lens, tails, sources, outputs, groups, datasets = [], [], [], [], [], []
    for name, workload in (("leval", leval), ("longbench", longbench), ("sharegpt", trace)):
        for r in workload:
            lens.append(r.prompt_len)
            tails.append(r.prompt_token_ids[-256:])  # the features read only the length and tail
            sources.append(r.source)
            outputs.append(r.output_len)
            groups.append(f"{name}/{r.prefix_group}")
            datasets.append(name)
    return (np.array(lens), tails, sources, np.array(outputs, dtype=np.int64), np.array(groups),
            np.array(datasets))


def split_groups(groups: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """Boolean mask of the rows whose group is held out (``fraction`` of each dataset's groups)."""
    rng = np.random.default_rng(seed)
    unique = np.unique(groups)
    held = set(unique[rng.random(unique.size) < fraction].tolist())
    return np.array([g in held for g in groups.tolist()])


def evaluate(model: OutputLengthPredictor, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    lengths, is_long = model.predict_matrix(x)
    mae = float(np.abs(lengths - y).mean())
    acc = float((is_long == (y > model.threshold)).mean())
    return mae, acc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(DEFAULT_PREDICTOR_PATH))
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--sharegpt-rows", type=int, default=4000)
    parser.add_argument("--holdout", type=float, default=0.2)
    parser.add_argument("--threshold", type=int, default=64, help="short/long boundary (tokens)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    lens, tails, sources, y, groups, datasets = load_requests(args.data_dir, args.sharegpt_rows, args.seed)
    test = split_groups(groups, args.holdout, args.seed)
    train_idx, test_idx = np.flatnonzero(~test), np.flatnonzero(test)
    val = split_groups(groups[train_idx], 0.2, args.seed + 1)
    fit_idx, val_idx = train_idx[~val], train_idx[val]

    def fit(idx: np.ndarray, ridge: float, hash_ridge: float) -> OutputLengthPredictor:
        return OutputLengthPredictor.fit(lens[idx], [tails[i] for i in idx], [sources[i] for i in idx],
                                         y[idx], threshold=args.threshold, ridge=ridge,
                                         hash_ridge=hash_ridge)

    best = None
    for ridge, hash_ridge in ((0.01, 1.0), (0.01, 100.0), (1.0, 100.0), (0.01, 1e4)):
        m = fit(fit_idx, ridge, hash_ridge)
        x_val = m.features_batch(lens[val_idx], [tails[i] for i in val_idx], [sources[i] for i in val_idx])
        mae, _ = evaluate(m, x_val, y[val_idx])
        print(f"ridge={ridge:<5} hash_ridge={hash_ridge:<7} validation MAE {mae:.2f} tokens")
        if best is None or mae < best[0]:
            best = (mae, ridge, hash_ridge)
    assert best is not None
    model = fit(train_idx, best[1], best[2])

    x_test = model.features_batch(lens[test_idx], [tails[i] for i in test_idx],
                                  [sources[i] for i in test_idx])
    y_test = y[test_idx]
    lengths, is_long = model.predict_matrix(x_test)
    train_median = float(np.median(y[train_idx]))
    src_median = {s: float(np.median(y[train_idx][np.array(sources)[train_idx] == s]))
                  for s in set(np.array(sources)[train_idx].tolist())}
    per_source = np.array([src_median.get(sources[i], train_median) for i in test_idx])
    majority_long = bool((y[train_idx] > args.threshold).mean() > 0.5)
    train_sources = np.array(sources)[train_idx]
    src_long = {s: bool((y[train_idx][train_sources == s] > args.threshold).mean() > 0.5)
                for s in set(train_sources.tolist())}
    per_source_long = np.array([src_long.get(sources[i], majority_long) for i in test_idx])
    metrics = {
        "heldout_requests": int(test_idx.size),
        "train_requests": int(train_idx.size),
        "ridge": best[1],
        "hash_ridge": best[2],
        "mae_tokens": float(np.abs(lengths - y_test).mean()),
        "mae_baseline_train_median": float(np.abs(train_median - y_test).mean()),
        "mae_baseline_source_median": float(np.abs(per_source - y_test).mean()),
        "classifier_accuracy": float((is_long == (y_test > args.threshold)).mean()),
        "classifier_baseline_majority": float(((y_test > args.threshold) == majority_long).mean()),
        "classifier_baseline_source_majority": float(((y_test > args.threshold) == per_source_long).mean()),
        "per_dataset": {},
        "seed": args.seed,
        "holdout_fraction": args.holdout,
    }
    # What a server sees when clients do not send the request's source (vllm_xargs).
    x_anon = model.features_batch(lens[test_idx], [tails[i] for i in test_idx], [""] * test_idx.size)
    anon_lengths, anon_long = model.predict_matrix(x_anon)
    metrics["mae_tokens_without_source"] = float(np.abs(anon_lengths - y_test).mean())
    metrics["classifier_accuracy_without_source"] = float((anon_long == (y_test > args.threshold)).mean())
    test_sets = datasets[test_idx]
    for name in ("leval", "longbench", "sharegpt"):
        sel = test_sets == name
        if sel.any():
            metrics["per_dataset"][name] = {
                "requests": int(sel.sum()),
                "mae_tokens": float(np.abs(lengths[sel] - y_test[sel]).mean()),
                "mae_baseline_source_median": float(np.abs(per_source[sel] - y_test[sel]).mean()),
                "classifier_accuracy": float((is_long[sel] == (y_test[sel] > args.threshold)).mean()),
                "mean_output": float(y_test[sel].mean()),
            }
    model.metrics = metrics
    model.save(args.out)
    print(f"held-out: {metrics['heldout_requests']} requests; MAE {metrics['mae_tokens']:.1f} tokens "
          f"(train median {metrics['mae_baseline_train_median']:.1f}, per-source median "
          f"{metrics['mae_baseline_source_median']:.1f}); short/long accuracy "
          f"{metrics['classifier_accuracy']:.3f} (majority {metrics['classifier_baseline_majority']:.3f}, "
          f"per-source majority {metrics['classifier_baseline_source_majority']:.3f}); "
          f"threshold {model.threshold}, proxies {model.proxy_short:.1f}/{model.proxy_long:.1f}")
    print(f"  without a source: MAE {metrics['mae_tokens_without_source']:.1f}, accuracy "
          f"{metrics['classifier_accuracy_without_source']:.3f}")
    for name, m in metrics["per_dataset"].items():
        print(f"  {name:<10} n={m['requests']:<5} MAE {m['mae_tokens']:.1f} (per-source median "
              f"{m['mae_baseline_source_median']:.1f}), accuracy {m['classifier_accuracy']:.3f}")
    print(f"wrote {args.out} in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
