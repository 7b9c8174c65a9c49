"""The evaluation's figures, from runs of any kind (in-process, endpoint, merged by ``compare``).

- ``throughput.png``: output throughput of every run (vLLM's ``output_throughput``) and, for the
  in-process runs, the decode throughput of their decode-only engine steps;
- ``latency_cdf.png``: the distribution of end-to-end latency over the completed requests;
- ``batch_size.png``: running requests after each engine step, over the run (in-process runs only;
  not drawn when no run has engine steps).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from feather_env.records import Run

__all__ = ["write_plots"]


def write_plots(out: str | Path, runs: Sequence[Run], metrics: Mapping[str, Mapping[str, Any]],
                title: str) -> list[Path]:
    """Write the figures of the module docstring into ``out``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    paths: list[Path] = []

    def save(fig: Any, name: str, ax: Any = None) -> None:
        if ax is not None:
            ax.set_title(title, fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(out / name)
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)

    labels = [run.label for run in runs]
    panels = [("output_throughput", "output tok/s (vLLM's output_throughput)", labels)]
    in_process = [run.label for run in runs if metrics[run.label].get("decode_tok_s") is not None]
    if in_process:
        panels.append(("decode_tok_s", "decode tok/s (decode-only steps)", in_process))
    fig, axes = plt.subplots(1, len(panels), figsize=(max(7.0, 1.3 * len(labels) + 4), 3.8), squeeze=False)
    for ax, (key, ylabel, names) in zip(axes[0], panels, strict=True):
        x = np.arange(len(names))
        vals = [metrics[n].get(key) or 0.0 for n in names]
        ax.bar(x, vals, color="tab:blue")
        ax.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(ylabel)
        for xi, v in zip(x, vals, strict=True):
            ax.annotate(f"{v:.0f}", (xi, v), ha="center", va="bottom", fontsize=7)
    fig.suptitle(title, fontsize=9)
    save(fig, "throughput.png")

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for run in runs:
        lat = np.sort([t.e2el for t in run.timelines if t.completed])
        if lat.size:
            ax.step(lat, np.arange(1, lat.size + 1) / lat.size, where="post", label=run.label)
    ax.set_xlabel("end-to-end latency (s, arrival -> last token)")
    ax.set_ylabel("fraction of completed requests")
    save(fig, "latency_cdf.png", ax)

    stepped = [run for run in runs if run.steps]
    if stepped:
        fig, ax = plt.subplots(figsize=(7, 4))
        for run in stepped:
            ax.step([s.start for s in run.steps], [s.running for s in run.steps], where="post",
                    label=run.label, lw=0.9)
        ax.set_xlabel("time since the run started (s, engine clock)")
        ax.set_ylabel("running requests (after schedule())")
        save(fig, "batch_size.png", ax)
    return paths
