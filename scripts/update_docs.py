"""Write the generated blocks of README.md and docs/ from results/*.json and from the code's own docstrings.

Each generated block of a page sits between ``<!-- BEGIN name -->`` and ``<!-- END name -->``; the prose
around it is written by hand and holds no figure. :data:`BLOCKS` says what fills each block:

- a benchmark's figures: ``render(payload)`` of the module that writes ``results/<file>.json`` (a block
  whose JSON is missing says so);
- the environment's manual: ``FeatherEnv``'s docstring; the schedulers' and the metrics' tables: the
  docstrings of ``scheduler_runtime.schedulers`` and ``scheduler_runtime.serving.metrics`` (reST turned into
  markdown);
- the scenarios: ``configs/scenarios/*.yaml``; the output-length predictor's held-out figures:
  ``configs/predictors/output_len.json``.

So no figure in the docs is typed by hand, and each is rendered by one function. ``make bench`` runs this
script last. ``--check`` writes nothing and exits 1 when a page is not current (``tests/test_docs.py``
checks the same); ``--out DIR`` writes the pages under DIR instead of in place.

    python scripts/update_docs.py [--check] [--results results] [--out DIR]
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import inspect
import json
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from feather_env.reporting import format_table  # noqa: E402

__all__ = ["BLOCKS", "PAGES", "Block", "render_pages", "stale_pages"]

#: The pages this script writes blocks into (paths relative to the repository root).
PAGES = ("README.md", "docs/results.md", "docs/env.md", "docs/serving.md")


@dataclass(frozen=True)
class Block:
    """One generated block: the page that holds it and what renders it from the results folder."""

    page: str
    render: Callable[[Path], str]


def from_json(file: str, module: str, function: str = "render") -> Callable[[Path], str]:
    """The block of ``results/<file>``, rendered by ``module.function`` (the module that writes it)."""

    def render(results: Path) -> str:
        path = results / file
        if not path.is_file():
            return f"_Not measured yet: `make bench` writes `results/{file}`._"
        return getattr(importlib.import_module(module), function)(json.loads(path.read_text()))

    return render


# ------------------------------------------------------------------------------------ reST to markdown

_ROLE = re.compile(r":[a-z]+:`(~?)([^`]+)`")
_BORDER = re.compile(r"^( *)=+( +=+)+ *$")


def _inline(text: str) -> str:
    """Sphinx roles and ``literals`` as markdown code spans (``~a.b.C`` as ``C``)."""
    text = _ROLE.sub(lambda m: f"``{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}``", text)
    return re.sub(r"``(.+?)``", r"`\1`", text)


def _rows(lines: Sequence[str], border: str) -> list[list[str]]:
    """The rows of a simple-table segment under ``border`` (its top line): columns split at two spaces
    or more, else (a cell that overflows its column by a space) at the single space nearest the
    border's column; a line that starts with blanks continues the previous row's last cell."""
    indent = len(border) - len(border.lstrip())
    starts = [m.start() - indent for m in re.finditer(r"=+", border)]
    rows: list[list[str]] = []
    for line in lines:
        body = line[indent:].rstrip()
        if not body.strip():
            continue
        if body[0] == " " and rows:
            rows[-1][-1] += " " + body.strip()
            continue
        cells = re.split(r" {2,}", body.strip())
        if len(cells) < len(starts):
            cells, prev = [], 0
            for start in starts[1:]:
                cut = body.rfind(" ", prev, start)
                cut = cut if cut > prev else body.find(" ", start)
                if cut == -1:
                    break
                cells.append(body[prev:cut].strip())
                prev = cut
            cells.append(body[prev:].strip())
        rows.append(cells)
    return rows


def _table(header: list[list[str]], body: list[list[str]], headers: Sequence[str] | None) -> str:
    cells = [row[:] for row in body]
    names = list(headers) if headers else (header[0] if header else [""] * max(map(len, cells), default=1))
    width = len(names)
    rows = [[_inline(c).replace("|", "\\|") for c in row + [""] * (width - len(row))] for row in cells]
    return format_table([_inline(n) for n in names], rows)


def _simple_table(lines: Sequence[str], start: int) -> tuple[list[list[str]], list[list[str]], int]:
    """The reST simple table whose top border is ``lines[start]``: ``(header rows, body rows, the index
    after its bottom border)``; a table without a header row has two borders, one with it three."""
    if not _BORDER.match(lines[start]):
        raise ValueError(f"not a table border: {lines[start]!r}")
    ends = [j for j in range(start + 1, len(lines)) if _BORDER.match(lines[j])]
    if not ends:
        raise ValueError(f"a table border without its end: {lines[start]!r}")
    top, second = lines[start], ends[0]
    if len(ends) > 1 and ends[1] > second + 1 and all(lines[k].strip() for k in range(second + 1, ends[1])):
        return _rows(lines[start + 1:second], top), _rows(lines[second + 1:ends[1]], top), ends[1] + 1
    return [], _rows(lines[start + 1:second], top), second + 1


def rst_to_markdown(text: str, headers: Sequence[str] | None = None) -> str:
    """A docstring's reST as markdown: simple tables (``headers`` for a table without a header row),
    Sphinx roles and literals as code spans."""
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        if _BORDER.match(lines[i]):
            header, body, i = _simple_table(lines, i)
            out.append(_table(header, body, headers))
        else:
            out.append(_inline(lines[i]))
            i += 1
    return "\n".join(out)


def first_table(doc: str, headers: Sequence[str], where: str) -> str:
    """The first reST simple table of ``doc``, as markdown with ``headers``."""
    lines = doc.splitlines()
    start = next((i for i, line in enumerate(lines) if _BORDER.match(line)), None)
    if start is None:
        raise ValueError(f"{where}'s docstring has no table (a reST simple table) to render")
    header, body, _ = _simple_table(lines, start)
    return _table([], header + body, headers)


# ------------------------------------------------------------------------------------ blocks from code


def render_env_manual(_: Path) -> str:
    """``FeatherEnv``'s docstring, the environment's manual, with its sections one level down."""
    from feather_env.env import FeatherEnv

    doc = inspect.getdoc(FeatherEnv) or ""
    summary, _, body = doc.partition("\n")
    body = re.sub(r"^## ", "### ", body.strip(), flags=re.M)
    return f"{_inline(summary.strip())}\n\n{rst_to_markdown(body)}"


def render_schedulers(_: Path) -> str:
    """The scheduler names, from ``scheduler_runtime.schedulers``' docstring."""
    import scheduler_runtime.schedulers as module

    return first_table(module.__doc__ or "", ("name", "what it does"), module.__name__)


def render_metrics(_: Path) -> str:
    """The scheduler's Prometheus metrics, from ``scheduler_runtime.serving.metrics``' docstring."""
    import scheduler_runtime.serving.metrics as module

    return first_table(module.__doc__ or "", ("metric", "meaning"), module.__name__)


def render_scenarios(_: Path) -> str:
    """Every scenario of ``configs/scenarios/`` with its description."""
    import yaml

    rows = []
    for path in sorted((REPO / "configs" / "scenarios").glob("*.yaml")):
        spec = yaml.safe_load(path.read_text()) or {}
        rows.append([f"`{path.stem}`", spec.get("description", "")])
    return format_table(["scenario", "what it is"], rows)


def render_scenario_example(_: Path) -> str:
    """``configs/scenarios/leval-kv-pressure.yaml`` without its comments."""
    text = (REPO / "configs" / "scenarios" / "leval-kv-pressure.yaml").read_text()
    keep = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    return "```yaml\n# configs/scenarios/leval-kv-pressure.yaml\n" + "\n".join(keep).strip() + "\n```"


_DATASETS = {"leval": "L-Eval", "longbench": "LongBench", "sharegpt": "ShareGPT"}


def render_predictor(_: Path) -> str:
    """The output-length predictor's held-out figures (``scripts/train_predictor.py`` records them in the
    predictor file)."""
    spec = json.loads((REPO / "configs" / "predictors" / "output_len.json").read_text())
    m = spec["metrics"]
    rows: list[list[Any]] = [[f"all ({m['heldout_requests']:,})", m["mae_tokens"],
                              m["mae_baseline_train_median"], m["mae_baseline_source_median"],
                              f"{m['classifier_accuracy']:.3f}"]]
    for name, d in (m.get("per_dataset") or {}).items():
        rows.append([f"{_DATASETS.get(name, name)} ({d['requests']:,})", d["mae_tokens"], "",
                     d["mae_baseline_source_median"], f"{d['classifier_accuracy']:.3f}"])
    return "\n".join([
        f"Held out: {m['heldout_requests']:,} requests ({m['holdout_fraction']:.0%} of the prefix groups), "
        f"trained on {m['train_requests']:,}. Short/long threshold {spec['threshold']} tokens; proxy lengths "
        f"{spec['proxy_short']:.1f} / {spec['proxy_long']:.1f} tokens.", "",
        format_table(["held-out requests", "MAE (tokens)", "baseline: training median",
                      "baseline: per-source median", "short/long accuracy"], rows), "",
        f"Short/long accuracy against the majority class {m['classifier_baseline_majority']:.3f} and the "
        f"per-source majority {m['classifier_baseline_source_majority']:.3f}. Without the request's source "
        f"(clients that do not send `feather_source`): MAE {m['mae_tokens_without_source']:.1f} tokens, "
        f"accuracy {m['classifier_accuracy_without_source']:.3f}."])


# ------------------------------------------------------------------------------------ the blocks

def _result(name: str, module: str | None = None) -> Block:
    """A benchmark's block in docs/results.md: ``results/<name>.json`` rendered by ``benchmarks.<module>``
    (default: the module of the same name)."""
    return Block("docs/results.md", from_json(f"{name}.json", f"benchmarks.{module or name}"))


#: Block name -> where it goes and what renders it.
BLOCKS: dict[str, Block] = {
    "headline": Block("README.md", from_json("evaluation.json", "benchmarks.evaluation", "render_headline")),
    "comparisons": Block("README.md", from_json("evaluation.json", "benchmarks.evaluation",
                                                "render_comparisons")),
    **{name: _result(name) for name in (
        "prefix_homogeneity", "env_orderings", "sim_validation", "env_speed", "rewards", "agents",
        "admission_rules", "group_admission", "rollout_gain", "hindsight_regimes", "cht_overhead",
        "scheduler_overhead")},
    **{name: _result(name, "sim_validation") for name in (
        "sim_validation_poisson_cap", "sim_validation_poisson_cap_xeon", "sim_validation_high_load_cap",
        "sim_validation_high_load_cap_xeon", "sim_validation_xeon")},
    "scheduler_overhead_group": _result("scheduler_overhead_group", "scheduler_overhead"),
    "scheduler_overhead_retain": _result("scheduler_overhead_retain", "scheduler_overhead"),
    **{name: _result(name) for name in ("endpoint_agreement", "evaluation", "load_matched",
                                        "policy_agreement", "router_peers")},
    **{name: _result(name) for name in ("admission_burst", "admission_headroom", "admission_agents",
                                        "unequal_replicas")},
    **{name: _result(name, "admission_burst") for name in ("admission_burst_replicas2_quiet",
                                                           "admission_burst_slo0.8_quiet",
                                                           "admission_burst_pace",
                                                           "admission_burst_replicas2_reroute",
                                                           "admission_burst_replicas2_no_reroute")},
    **{name: _result(name, "fleet_admission")
       for name in (*(f"fleet_admission_{f}_draws12{m}" for f in ("speed", "kv") for m in ("", "_noreroute")),
                    *(f"fleet_admission_{w}{f}_draws12_noreroute{t}" for f in ("speed", "kv")
                      for w, t in (("zipf_", ""), ("mooncake_", ""), ("", "_tpot"))))},
    "shed_reroute_loopback": _result("shed_reroute_loopback"),
    "tpot_term": _result("tpot_term"),
    **{name: _result(name, "fleet_admission")
       for name in (f"fleet_admission_{v}_{f}_draws6_noreroute"
                    for v in ("16", "tight", "16_mooncake", "16_zipf") for f in ("speed", "kv"))},
    **{name: _result(name, "unequal_replicas") for name in (
        "unequal_router", "unequal_replicas_mooncake", "unequal_replicas_mooncake16",
        "unequal_replicas_seeds12", "unequal_replicas_zipf_seeds12", "unequal_replicas_mooncake_seeds12",
        "unequal_replicas_mooncake16_seeds12", "unequal_router_cost",
        *(f"unequal_replicas_{w}seeds12_service" for w in ("", "zipf_", "mooncake_", "mooncake16_")),
        *(f"unequal_replicas_{w}seeds12_clock" for w in ("", "zipf_", "mooncake_", "mooncake16_")),
        "unequal_router_cost_clock",
        *(f"unequal_replicas_{w}seeds12_room" for w in ("", "zipf_", "mooncake_", "mooncake16_")),
        "unequal_router_cost_room", "unequal_replicas_draws12", "unequal_replicas_zipf_draws12",
        *(f"unequal_replicas_{r}_variants_{f}" for r in ("draws12", "seeds12") for f in ("speed", "kv")))},
    **{name: _result(name) for name in ("routing_headroom", "routing_agents", "unequal_loopback",
                                        "drift_loopback")},
    **{name: _result(name, "frontend_overhead") for name in (
        "frontend_overhead_learned", "frontend_overhead_learned_clock",
        "frontend_overhead_learned_clock_no_usage", "frontend_overhead_learned_room",
        "frontend_overhead_learned_room_no_usage")},
    "equal_learned": _result("equal_learned"),
    **{name: _result(name, "equal_learned") for name in (
        "equal_learned_cache125", "equal_learned_band10", "equal_learned_fleet_z",
        "equal_learned_queue_time", "equal_learned_queue_service",
        "equal_learned_queue_fleet_z_homogeneous", "equal_learned_cache_clock", "equal_learned_peers",
        "equal_learned_room", "equal_learned_seeds10", "equal_learned_draws10")},
    **{name: _result(name, "routing_headroom") for name in (
        "routing_headroom_load1", "routing_headroom_kv",
        *(f"routing_headroom{c}_{v}" for c in ("", "_load1", "_kv") for v in ("clock", "room")))},
    **{name: _result(name, "routing_agents") for name in (
        "routing_agents_clock", "routing_agents_room", "routing_agents_room_train8")},
    "drift_loopback_fresh": _result("drift_loopback_fresh", "drift_loopback"),
    **{name: _result(name, "unequal_loopback") for name in (
        "unequal_loopback_seed1", "unequal_loopback_seed2",
        *(f"unequal_loopback_worklru_seed{s}" for s in range(4)),
        *(f"unequal_loopback_service_seed{s}" for s in range(4)),
        *(f"unequal_loopback_clock_seed{s}" for s in range(4)),
        *(f"unequal_loopback_room_seed{s}" for s in range(12)))},
    **{name: Block("docs/results.md", from_json(f"{name}.json", "benchmarks.unequal_replicas",
                                                "render_drift_share"))
       for name in ("unequal_drift_share", "unequal_drift_share_seeds24",
                    "unequal_drift_share_seeds24_clock", "unequal_drift_share_seeds24_room")},
    "load_matched_headline": Block("README.md", from_json("load_matched.json", "benchmarks.load_matched",
                                                          "render_headline")),
    "env_manual": Block("docs/env.md", render_env_manual),
    "scenarios": Block("docs/env.md", render_scenarios),
    "scenario_example": Block("docs/env.md", render_scenario_example),
    "schedulers": Block("docs/serving.md", render_schedulers),
    "metrics": Block("docs/serving.md", render_metrics),
    "predictor": Block("docs/serving.md", render_predictor),
}


def _pattern(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- BEGIN {re.escape(name)} -->\n).*?(<!-- END {re.escape(name)} -->)", re.S)


def render_pages(root: Path = REPO, results: Path | None = None) -> dict[str, str]:
    """Every page of :data:`PAGES` under ``root`` with its blocks rendered (``results``: the JSON folder,
    default ``root/results``). A block missing from its page, or there twice, is an error."""
    results = results or root / "results"
    pages = {page: (root / page).read_text() for page in PAGES}
    for name, block in BLOCKS.items():
        text = pages[block.page]
        found = len(_pattern(name).findall(text))
        if found != 1:
            raise ValueError(f"{block.page} must hold the block {name!r} once (<!-- BEGIN {name} --> ... "
                             f"<!-- END {name} -->), found {found}")
        body = block.render(results).rstrip("\n") + "\n"
        pages[block.page] = _pattern(name).sub(lambda m, body=body: m.group(1) + body + m.group(2), text)
    return pages


def stale_pages(root: Path = REPO, results: Path | None = None) -> dict[str, str]:
    """Page -> a unified diff of what it holds against what it should, for every page not current."""
    out = {}
    for page, text in render_pages(root, results).items():
        current = (root / page).read_text()
        if current != text:
            out[page] = "".join(difflib.unified_diff(current.splitlines(True), text.splitlines(True),
                                                     f"{page} (now)", f"{page} (rendered)", n=1))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--results", default=None, help="the benchmarks' JSON folder (default: results/)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page is not current")
    p.add_argument("--out", default=None, help="write the pages under this folder instead of in place")
    args = p.parse_args(argv)
    results = Path(args.results) if args.results else None
    if args.check:
        stale = stale_pages(REPO, results)
        for diff in stale.values():
            print(diff)
        if stale:
            print(f"not current: {', '.join(stale)}; run python scripts/update_docs.py", file=sys.stderr)
        return 1 if stale else 0
    root = Path(args.out) if args.out else REPO
    changed = []
    for page, text in render_pages(REPO, results).items():
        path = root / page
        if not path.is_file() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            changed.append(page)
    print(f"updated: {', '.join(changed) or 'nothing (every page is current)'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
