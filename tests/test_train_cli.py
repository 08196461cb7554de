"""`pcgtts train ...` holds every training command; the former spellings (`pcgtts lab ...`,
`pcgtts draft ...`, `pcgtts heads ...`) parse to the same handlers, warn once and stay out of --help."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest

from pcgtts.cli import INFO_BY_DEFAULT, build_parser, log_level, main, parse_args
from pcgtts.cli.train import DEPRECATED, deprecation_notice

ROOT = Path(__file__).resolve().parents[1]
# Flags some commands require, so each spelling parses without running anything.
REQUIRED = {
    "draft init": ["--target", "t", "--layers", "2", "--out", "o"],
    "draft distill": ["--target", "t", "--draft", "d", "--out", "o"],
    "heads": ["--target", "t"],
    "eagle": ["--target", "t"],
    "eagle-temperatures": ["--target", "t", "--eagle", "e"],
    "transitions": ["--codes", "c.npz", "--out", "t.pct"],
    "package": ["--name", "v"],
}
PAIRS = [((group, old), new) for group, renames in DEPRECATED.items() for old, new in renames.items()]


def _handler(args) -> tuple:
    """What runs: the command's function, and for the lab's commands the step it dispatches to."""
    return args.func, getattr(args, "lab_func", None)


@pytest.mark.parametrize(("old", "new"), PAIRS, ids=[f"{g} {o}" for (g, o), _ in PAIRS])
def test_every_former_spelling_reaches_the_new_spellings_handler_with_the_same_flags(old, new):
    flags = REQUIRED.get(new, [])
    was, now = parse_args([*old, *flags]), parse_args(["train", *new.split(), *flags])
    assert _handler(was) == _handler(now)
    same = {k: v for k, v in vars(now).items() if k not in ("command", "lab_prog", "replaced_by")
            and not k.endswith("_cmd")}
    assert {k: vars(was)[k] for k in same} == same  # every flag, with the same defaults
    assert deprecation_notice(now) is None
    assert deprecation_notice(was) == (f"`pcgtts {' '.join(old)}` is deprecated and will be removed in the next "
                                       f"release: use `pcgtts train {new}`")


def test_a_former_spelling_warns_once_naming_the_new_one(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="pcgtts"):
        with pytest.raises(SystemExit, match="pcgtts lab codec: no corpus"):
            main(["lab", "codec", "--corpus", str(tmp_path)])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["`pcgtts lab codec` is deprecated and will be removed in the next release: "
                        "use `pcgtts train codec`"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pcgtts"):
        with pytest.raises(SystemExit, match="pcgtts train codec: no corpus"):
            main(["train", "codec", "--corpus", str(tmp_path)])
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_the_new_spellings_are_in_the_help_and_the_former_ones_are_not():
    top = build_parser().format_help()
    assert "train" in top
    listed = top.split("positional arguments:")[1].split("options:")[0]
    for group in DEPRECATED:
        assert f"    {group} " not in listed and f"{{{group}," not in top and f",{group}," not in top
    train = build_parser()._subparsers._group_actions[0].choices["train"]
    for name in ("corpus", "codec", "lm", "draft", "eagle", "eagle-temperatures", "heads", "transitions", "package",
                 "all"):
        assert f"    {name} " in train.format_help(), name
    draft = train._subparsers._group_actions[0].choices["draft"].format_help()
    assert all(f"    {name} " in draft for name in ("init", "distill", "finetune"))


def test_training_commands_log_at_info_by_default_in_either_spelling():
    assert "train" in INFO_BY_DEFAULT
    for argv in (["train", "lm"], ["lab", "lm"], ["train", "transitions", "--codes", "c", "--out", "o"],
                 ["heads", "transitions", "--codes", "c", "--out", "o"]):
        assert log_level(parse_args(argv)) == logging.INFO, argv
    assert log_level(parse_args(["train", "lm", "--log-level", "warning"])) == logging.WARNING


def test_the_cli_modules_import_each_other_one_way():
    """No cycle among cli/*.py (bench and commands once imported each other)."""
    graph = {}
    for path in (ROOT / "cli").glob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "pcgtts.cli":
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pcgtts.cli."):
                names.add(node.module.split(".")[2])
        graph[path.stem] = names - {path.stem} if path.stem != "__init__" else set()

    def reaches(start: str, seen: tuple = ()) -> None:
        assert start not in seen, f"import cycle: {' -> '.join((*seen, start))}"
        for name in graph.get(start, ()):
            reaches(name, (*seen, start))

    for module in graph:
        reaches(module)
