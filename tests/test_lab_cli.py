"""The speech lab's `pcgtts train` commands: they parse, bad values and missing inputs fail clearly."""

import pytest

from pcgtts.cli import build_parser

# lab job -> its spelling under `pcgtts train`
SPELLING = {"corpus": ["corpus"], "codec": ["codec"], "lm": ["lm"], "draft": ["draft", "finetune"], "all": ["all"]}


def _parser():
    return build_parser()


def test_subcommands_parse():
    p = _parser()
    for cmd, words in SPELLING.items():
        args = p.parse_args(["train", *words])
        assert args.lab_command == cmd and callable(args.lab_func)


def test_bad_values_rejected():
    for argv in (["--steps", "0"], ["--lr", "0"], ["--lr", "-1e-4"]):
        with pytest.raises(SystemExit):
            _parser().parse_args(["train", "codec", *argv])
    assert _parser().parse_args(["train", "codec", "--lr", "3e-4"]).lr == 3e-4


def test_missing_inputs_fail_before_work(tmp_path, capsys):
    p = _parser()
    for argv, needle in ((["train", "codec", "--corpus", str(tmp_path)], "pcgtts train codec: no corpus"),
                         (["train", "draft", "finetune", "--target", str(tmp_path)], "no target LM"),
                         (["train", "corpus", "--out", str(tmp_path), "--speakers", "nobody"], "unknown speakers")):
        args = p.parse_args(argv)
        with pytest.raises(SystemExit, match=needle):
            args.func(args)


def test_all_runs_each_step_with_its_commands_defaults(tmp_path, monkeypatch):
    """`train all` hands every step a namespace its own command would parse (no missing option)."""
    from pcgtts.cli import lab as cli

    seen = {}

    def fake(name, result):
        def run(args):
            seen[name] = args
            return result
        return run

    p = _parser()
    monkeypatch.setattr(cli, "_cmd_corpus", fake("corpus", {"hours": 1.0}))
    monkeypatch.setattr(cli, "_cmd_codec", fake("codec", {"export": "c"}))
    monkeypatch.setattr(cli, "_cmd_lm", fake("lm", {"export": "l"}))
    monkeypatch.setattr(cli, "_cmd_draft", fake("draft", {"export": "d"}))
    args = p.parse_args(["train", "all", "--root", str(tmp_path), "--threads", "2"])
    assert cli._cmd_all(args) == {"corpus": 1.0, "codec": "c", "lm": "l", "draft": "d"}
    for name, got in seen.items():
        want = vars(p.parse_args(["train", *SPELLING[name]]))
        own = {k for k in want if k not in ("command", "verbose", "log_level", "debug") and not k.endswith("_cmd")}
        assert own <= set(vars(got)), name  # every option its command has
        assert got.lab_command == name
    assert seen["codec"].threads == 2 and seen["lm"].codec == tmp_path / "codec" / "export"
    assert seen["corpus"].markov_sentences == 0 and seen["codec"].acoustic is False


def test_training_progress_off_a_terminal_is_plain_lines_not_a_bar(capsys):
    from pcgtts.cli.lab import ProgressBar

    bar = ProgressBar("lm", "step", every_s=3600.0)  # pytest's captured stderr is not a terminal
    for step in range(1, 101):
        bar(step, 100, 0.5)
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["lm: 1/100 step (0.500)", "lm: 100/100 step (0.500)"]
