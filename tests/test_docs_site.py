"""The documentation site: the command-line reference is what the parsers print, and every page the
navigation names exists (`mkdocs build --strict` in .ci/run checks links and snippets)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_the_command_line_reference_is_what_the_parsers_print():
    run = subprocess.run([sys.executable, "docs/gen_cli.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_every_page_in_the_navigation_exists_and_every_page_is_in_it():
    text = (ROOT / "mkdocs.yml").read_text()
    nav = yaml.safe_load(text[text.index("nav:"):])["nav"]
    named = {next(iter(entry.values())) for entry in nav}
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert named == pages
