"""The docs are current: every generated block of README.md and docs/ is what ``scripts/update_docs.py``
renders from the committed results/*.json and the code, and the README stays a front door.

No engine: the blocks render from JSON files and docstrings in about a second. The README's environment
example runs on the simulator.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parent.parent
README_MAX_LINES = 250


@pytest.fixture(scope="module")
def update_docs() -> ModuleType:
    spec = importlib.util.spec_from_file_location("update_docs", REPO / "scripts" / "update_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["update_docs"] = module
    spec.loader.exec_module(module)
    return module


def test_generated_blocks_are_current(update_docs: ModuleType, tmp_path: Path) -> None:
    """Render every page into a temporary folder and compare it with the committed page."""
    assert update_docs.main(["--out", str(tmp_path)]) == 0
    stale = [page for page in update_docs.PAGES if (tmp_path / page).read_text() != (REPO / page).read_text()]
    diffs = update_docs.stale_pages(REPO) if stale else {}
    assert not stale, ("not current, run `python scripts/update_docs.py`:\n"
                       + "\n".join(diffs.get(page, "")[:3000] for page in stale))


def test_every_block_is_on_its_page(update_docs: ModuleType) -> None:
    for name, block in update_docs.BLOCKS.items():
        text = (REPO / block.page).read_text()
        assert text.count(f"<!-- BEGIN {name} -->") == 1 and text.count(f"<!-- END {name} -->") == 1, (
            f"{block.page} must hold the block {name!r} once")


def test_readme_is_a_front_door() -> None:
    text = (REPO / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"
    for marker in ("<!-- BEGIN own_workload -->", "<!-- END own_workload -->", "<!-- BEGIN headline -->",
                   "<!-- END headline -->"):
        assert marker in text, f"README.md lost its marker {marker}"
    for doc in ("docs/results.md", "docs/env.md", "docs/serving.md", "docs/workloads.md", "docs/cluster.md"):
        assert f"({doc})" in text, f"README.md does not link {doc}"


def test_no_issue_numbers_in_the_docs() -> None:
    """The docs describe the toolkit as it is, not the history of its issues."""
    for page in ("README.md", "docs/results.md", "docs/env.md", "docs/serving.md"):
        hits = re.findall(r"\b[Ii]ssues? #?\d+", (REPO / page).read_text())
        assert not hits, f"{page} cites issue numbers: {hits}"


def test_local_links_resolve() -> None:
    """Every relative link of the pages this script writes, of the design and of every dated
    study points at a file that exists."""
    notes = sorted(str(p.relative_to(REPO)) for p in (REPO / "docs" / "notes").glob("*.md"))
    for page in ("README.md", "docs/results.md", "docs/env.md", "docs/serving.md", "docs/design.md", *notes):
        base = (REPO / page).parent
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", (REPO / page).read_text()):
            if "://" in target:
                continue
            assert (base / target).exists(), f"{page} links {target}, which does not exist"


def test_readme_env_example_runs(data_dir: Path) -> None:
    """The README's ten-line example, as written, on the simulator."""
    text = (REPO / "README.md").read_text()
    code = re.search(r"## The environment\n\n```python\n(.*?)```", text, re.S)
    assert code is not None, "README.md has no python example under 'The environment'"
    assert len(code.group(1).splitlines()) <= 10
    exec(compile(code.group(1), "README.md", "exec"), {"__name__": "readme_example"})
