"""The documentation site: the command-line reference is what the parsers print, and every page the
navigation names exists (`mkdocs build --strict` in .ci/run checks links and snippets)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
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


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_cli", ROOT / "docs" / "gen_cli.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_site_build_refuses_a_stale_command_line_reference(tmp_path, monkeypatch):
    from mkdocs.exceptions import PluginError

    gen_cli = load_generator()
    stale = tmp_path / "cli.md"
    stale.write_text((ROOT / "docs" / "cli.md").read_text() + "a line the parsers never print\n")
    monkeypatch.setattr(gen_cli, "OUT", stale)
    with pytest.raises(PluginError, match="differs from the parsers"):
        gen_cli.on_pre_build(config=None)


def test_mkdocs_runs_the_reference_check_as_a_hook():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text().split("\nnav:")[0])
    assert "docs/gen_cli.py" in config["hooks"]


def test_the_readme_is_short_and_every_line_fits():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250
    assert [n for n, line in enumerate(lines, 1) if len(line) > 200] == []


def test_every_relative_link_in_the_readme_and_the_changelog_names_a_file_that_exists():
    for name in ("README.md", "CHANGELOG.md"):
        targets = re.findall(r"\]\(([^)#\s]+)", (ROOT / name).read_text())
        local = [t for t in targets if "://" not in t]
        assert [t for t in local if not (ROOT / t).exists()] == [], name
