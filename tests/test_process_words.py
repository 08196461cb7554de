"""Tracked text speaks of the project, not of how its work was scheduled.

Comments, docstrings, `--help`, file formats, documents and the changelog are read by users, who
cannot act on a session number, a machine's lending terms or a citation of a journal section that
no longer exists. This test lists every tracked text file and fails naming `file:line: text` for
each line with such words: session or stop numbers, lease / lent, VM, `§` section numbers, issue
numbers (`issue 12`, `#12`), "this task", and the names of the development tools that lend machines.
History belongs in git; what changed for users belongs in CHANGELOG.md, in words about the project.
No file is exempt but this one, which must spell the patterns out. The patterns are whole words and
case-aware where ordinary words are near (`release`, `relentless`, `vm_rss`, a `#1f77b4` colour).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUFFIXES = {".py", ".md", ".toml", ".json", ".sh", ".yml", ".yaml", ".txt", ".cfg"}
PATTERNS = [
    r"\bsessions? \d+", r"\bstops? \d+", r"\blease[sd]?\b", r"\blent\b", r"(?-i:\bVMs?\b)", r"§\s*\d",
    r"\bissues? #?\d+", r"(?<![\w&#/])#\d+\b", r"\bthis task\b", r"\bdevice[- ]tool\b", r"\bgive_back\b",
    r"\bfiles_fetch\b", r"\bfarm-(bench|studio)\b",
]
PROCESS_WORDS = re.compile("|".join(f"(?:{p})" for p in PATTERNS), re.IGNORECASE)


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    files = [ROOT / n for n in names if Path(n).suffix in SUFFIXES or n.startswith(".ci/")]
    return [f for f in files if f.is_file() and f != Path(__file__).resolve()]


def process_lines(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return []
    hits = []
    for number, line in enumerate(text.splitlines(), 1):
        if PROCESS_WORDS.search(line):
            hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:160]}")
    return hits


def test_the_patterns_catch_process_words_and_spare_ordinary_ones():
    caught = ["measured in session 46", "a GPU lease's limit", "the machine was lent", "on this VM",
              "BENCHMARKS §54.5", "issue 12's bar", "see issue #3", "for this task", "the device tool returns",
              "stop 55 landed", "fixed in #12", "(#7)", "the device-tool carry", "give_back", "run files_fetch",
              "farm-bench", "farm-studio"]
    spared = ["release the worker", "relented", "the session cookie", "relentless",
              "issue a warning", "vm_rss", "a VMAF score", "the sessions of a server",
              "color #1f77b4", "f\"{n:#06x}\"", "&#39;", "page.html#3-results", "a device's tools", "stopped 5 workers"]
    assert all(PROCESS_WORDS.search(text) for text in caught)
    assert [text for text in spared if PROCESS_WORDS.search(text)] == []


def test_tracked_text_has_no_words_about_how_the_work_was_scheduled():
    files = tracked_text_files()
    assert len(files) > 50  # git ls-files worked
    hits = [hit for path in files for hit in process_lines(path)]
    assert not hits, f"{len(hits)} lines speak of how the work was scheduled:\n" + "\n".join(hits[:80])
