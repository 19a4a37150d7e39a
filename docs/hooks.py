"""mkdocs hooks: the benchmark figures under figures/, the tables a
benchmark renders from its JSON, the schedule families and the CLI
reference rendered from pipejax's own registry and argument parsers: what
the pages show cannot drift from them.

The README, which GitHub shows as it is on disk, holds its figures between
`<!-- from: SCRIPT.NAME -->` and `<!-- end -->`, as do the pages where a
figure sits inside a sentence (an empty `<!-- table: -->` there would leave
a gap on GitHub); `python docs/hooks.py` (`make readme`) writes them from
the JSON, and a test fails when a file differs from what that writes."""

from __future__ import annotations

import argparse
import functools
import importlib
import pathlib
import re
import sys
import textwrap

BENCHMARKS = pathlib.Path(__file__).parents[1] / "benchmarks"
FIGURES = BENCHMARKS / "results"
CLI_MARK = "<!-- the argument parsers' help, one section a command -->"
FAMILIES_MARK = "<!-- the schedule families -->"
TABLE_MARK = re.compile(r"<!-- table: (\w+)\.(\w+) -->")  # benchmarks/<script>.py's tables()[name]
README = BENCHMARKS.parent / "README.md"
FILLED = [README, *sorted(pathlib.Path(__file__).parent.glob("*.md"))]  # may hold from-marks
README_MARK = re.compile(r"<!-- from: (\w+)\.(\w+) -->(\s*)(.*?)(\s*)<!-- end -->", re.S)


def on_files(files, config):
    """Add benchmarks/results/*.png to the site as figures/*.png."""
    from mkdocs.structure.files import File

    for png in sorted(FIGURES.glob("*.png")):
        files.append(File.generated(config, f"figures/{png.name}", abs_src_path=str(png)))
    return files


def cli_reference() -> str:
    """`pipejax --help` and each command's help as markdown sections."""
    from pipejax import bench
    from pipejax.cli import _parser

    top = _parser()
    commands = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction)).choices
    parts = ["```text", top.format_help().rstrip(), "```"]
    for name, command in commands.items():
        helped = bench.parser() if name == "bench" else command  # bench parses its own arguments
        parts += ["", f"## `pipejax {name}`", "", "```text", helped.format_help().rstrip(), "```"]
    return "\n".join(parts)


def families_table() -> str:
    """`pj.schedules.FAMILIES` as a markdown table, a row a family."""
    from pipejax.schedules import FAMILIES

    rows = ["| family | placement | virtual (default) | asynchronous | searched (v) | bubble |",
            "| --- | --- | --- | --- | --- | --- |"]
    for name, f in FAMILIES.items():
        allowed = "any" if f.virtuals is None else ", ".join(map(str, f.virtuals))
        bubble = "–" if f.bubble is None else f"`{f.bubble(2, 4, 1, f.search_virtual)[1]}`"
        rows.append(f"| `{name}` | {f.placement} | {allowed} ({f.virtual}) | "
                    f"{'yes' if f.asynchronous else 'no'} | "
                    f"{f'yes ({f.search_virtual})' if f.searched else 'by name'} | {bubble} |")
    return "\n".join(rows)


@functools.cache
def benchmark_tables(script: str) -> dict[str, str]:
    """`tables()` of benchmarks/<script>.py: its markdown tables, read from its JSON."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(script).tables()
    finally:
        sys.path.remove(str(BENCHMARKS))


def on_page_markdown(markdown, page, config, files):
    """Fill the marks: the CLI page's with the parsers' help, a table's with
    the benchmark's table."""
    markdown = TABLE_MARK.sub(lambda m: benchmark_tables(m[1])[m[2]], markdown)
    markdown = markdown.replace(FAMILIES_MARK, families_table()) if FAMILIES_MARK in markdown \
        else markdown
    return markdown.replace(CLI_MARK, cli_reference()) if CLI_MARK in markdown else markdown


def fill_readme(text: str) -> str:
    """The README with each marked figure written from its benchmark's JSON:
    inline where the text follows the mark on its line, else wrapped from
    the next line at that line's indentation (a mark ending a line stays
    inline HTML of its paragraph, as GitHub renders it)."""
    def fill(m: re.Match) -> str:
        value = benchmark_tables(m[1])[m[2]]
        if "\n" in m[3]:
            indent = m[3].split("\n")[-1]
            value = textwrap.fill(value, 76, initial_indent=indent, subsequent_indent=indent,
                                  break_on_hyphens=False)[len(indent):]
        return f"<!-- from: {m[1]}.{m[2]} -->{m[3]}{value}{m[5]}<!-- end -->"
    return README_MARK.sub(fill, text)


if __name__ == "__main__":
    for path in FILLED:
        text = path.read_text()
        if README_MARK.search(text):
            path.write_text(fill_readme(text))
