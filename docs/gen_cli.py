"""Writes docs/cli.md, the command-line reference, from the `pcgtts` argparse parsers themselves.

    python docs/gen_cli.py            # write docs/cli.md
    python docs/gen_cli.py --check    # exit 1 when docs/cli.md differs from what the parsers give

It is also mkdocs.yml's hook: `mkdocs build` fails when docs/cli.md is stale, and
tests/test_docs_site.py runs the check, so the reference cannot drift from `--help`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "cli.md"
WIDTH = "100"  # argparse wraps help at $COLUMNS: fixed, so the page is the same on every terminal


def subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    """The parser's sub-commands in the order they were registered, less those its --help leaves out
    (added without help=: the former spellings kept as deprecated aliases)."""
    found = []
    for action in parser._actions:  # argparse keeps sub-parsers only here
        if isinstance(action, argparse._SubParsersAction):
            listed = {choice.dest for choice in action._choices_actions}
            found += [(name, child) for name, child in action.choices.items() if name in listed]
    return found


def sections(parser: argparse.ArgumentParser, words: tuple[str, ...], depth: int = 2) -> list[str]:
    """One section per command, its `--help` verbatim, then its sub-commands one level deeper."""
    title = " ".join(("pcgtts", *words))
    lines = [f"{'#' * depth} `{title}`", "", "```text", parser.format_help().rstrip(), "```", ""]
    for name, child in subcommands(parser):
        lines += sections(child, (*words, name), min(depth + 1, 4))
    return lines


def reference() -> str:
    """The whole page: every command's `--help` at a fixed width, whatever the terminal's."""
    from pcgtts.cli import build_parser

    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH
    try:
        body = sections(build_parser(), ())
    finally:
        if before is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = before
    head = ["# Command-line reference", "",
            "Generated from the parsers by `python docs/gen_cli.py`: every command's `--help`, as printed.", ""]
    return "\n".join(head + body).rstrip() + "\n"


def is_current() -> bool:
    return OUT.is_file() and OUT.read_text() == reference()


def on_pre_build(config, **kwargs) -> None:
    """mkdocs hook: refuse to build the site from a stale command-line reference."""
    from mkdocs.exceptions import PluginError

    if not is_current():
        raise PluginError("docs/cli.md differs from the parsers: run python docs/gen_cli.py")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python docs/gen_cli.py", description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when docs/cli.md is stale")
    args = ap.parse_args(argv)
    if args.check:
        if not is_current():
            print("docs/cli.md differs from the parsers: run python docs/gen_cli.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(reference())
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
