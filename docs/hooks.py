"""mkdocs hooks: the benchmark figures under figures/, and the CLI reference
rendered from pipejax's own argument parsers (so it cannot drift from them)."""

from __future__ import annotations

import argparse
import pathlib

from mkdocs.structure.files import File

FIGURES = pathlib.Path(__file__).parents[1] / "benchmarks" / "results"
CLI_MARK = "<!-- the argument parsers' help, one section a command -->"


def on_files(files, config):
    """Add benchmarks/results/*.png to the site as figures/*.png."""
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


def on_page_markdown(markdown, page, config, files):
    """Fill the CLI page's mark with the parsers' help."""
    return markdown.replace(CLI_MARK, cli_reference())
