"""Every Python block of the documentation runs: docs/*.md and the README.

A page's blocks run in order in one namespace, as a reader pasting them
would run them; a block the README shares with a page runs once. The pages
whose blocks take seconds (a search, steps of training, a download) run
with the slow tests.
"""

from __future__ import annotations

import functools
import pathlib
import re

import pytest

from pipejax.schedules import FAMILIES, unregister
from tests.cases import fast_and_slow

ROOT = pathlib.Path(__file__).parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
BLOCK = re.compile(r"```python\n(.*?)\n```", re.S)
SLOW = {"planner.md", "language-models.md", "staleness.md", "data-parallel.md", "checkpoints.md",
        "sharding.md", "errors.md"}  # errors.md: each error is raised in tests/test_errors.py too


def blocks(page: pathlib.Path) -> list[str]:
    """The page's Python blocks, in order."""
    return BLOCK.findall(page.read_text())


def test_pages_have_blocks_to_run():
    assert sum(len(blocks(p)) for p in PAGES) >= 10


@pytest.mark.parametrize("page", fast_and_slow(
    [p for p in PAGES if blocks(p)], fast=[p for p in PAGES if p.name not in SLOW],
    ids=lambda p: p.name))
def test_the_blocks_of_a_page_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # files a block writes (checkpoints) land here,
    (tmp_path / "tests").symlink_to(ROOT / "tests")  # the files it reads are the repository's
    seen = {code for other in PAGES if other != page
            for code in blocks(other)} if page == ROOT / "README.md" else set()
    namespace: dict = {"__name__": f"docs.{page.stem}"}
    families = set(FAMILIES)  # a page may register a family: the other tests do not see it
    try:
        for code in blocks(page):
            if code not in seen:
                exec(compile(code, f"{page.name}", "exec"), namespace)  # noqa: S102 - the docs' own code
    finally:
        for name in set(FAMILIES) - families:
            unregister(name)


@functools.cache
def _hooks():
    """docs/hooks.py, the site's hooks, as a module (loaded once: its tables are cached)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_and_pages_quote_the_benchmark_json():
    """The figures between `<!-- from: -->` marks of the README and the pages
    are what the benchmarks render from their JSON now (`make readme` writes them)."""
    hooks = _hooks()
    assert len(hooks.README_MARK.findall((ROOT / "README.md").read_text())) >= 4
    for path in hooks.FILLED:
        text = path.read_text()
        assert hooks.fill_readme(text) == text, f"{path.name} differs from benchmarks/results: " \
                                                "make readme"


def test_every_table_mark_of_the_pages_names_a_rendered_table():
    """Each `<!-- table: SCRIPT.NAME -->` of docs/ is one that SCRIPT's
    tables() renders from its JSON (the strict site build fails otherwise too)."""
    hooks = _hooks()
    marks = [m for page in PAGES for m in hooks.TABLE_MARK.findall(page.read_text())]
    assert len(marks) >= 15
    for script, name in marks:
        assert hooks.benchmark_tables(script)[name], f"{script}.{name}"


def test_every_figure_the_pages_show_is_tracked():
    """Each `figures/NAME.png` of docs/ is benchmarks/results/NAME.png under
    git (`.gitignore` holds the PNGs back: a new one needs `git add -f`), so a
    clean checkout's strict site build finds it."""
    import subprocess

    tracked = subprocess.run(["git", "ls-files", "benchmarks/results"], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout.split()
    figure = re.compile(r"\(figures/([\w.-]+\.png)\)")
    shown = {name for page in PAGES for name in figure.findall(page.read_text())}
    assert len(shown) >= 3
    missing = sorted(f for f in shown if f"benchmarks/results/{f}" not in tracked)
    assert not missing, f"not tracked: {missing}; git add -f benchmarks/results/<name>"
