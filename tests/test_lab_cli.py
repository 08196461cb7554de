"""`pcgtts lab` argument handling: sub-commands parse, bad values and missing inputs fail clearly."""

import argparse

import pytest

from pcgtts.train.cli import register


def _parser():
    parser = argparse.ArgumentParser(prog="pcgtts")
    register(parser.add_subparsers(dest="command", required=True))
    return parser


def test_subcommands_parse():
    p = _parser()
    for cmd in ("corpus", "codec", "lm", "draft", "all"):
        args = p.parse_args(["lab", cmd])
        assert args.lab_command == cmd and callable(args.lab_func)


def test_bad_values_rejected():
    for argv in (["--steps", "0"], ["--lr", "0"], ["--lr", "-1e-4"]):
        with pytest.raises(SystemExit):
            _parser().parse_args(["lab", "codec", *argv])
    assert _parser().parse_args(["lab", "codec", "--lr", "3e-4"]).lr == 3e-4


def test_missing_inputs_fail_before_work(tmp_path, capsys):
    p = _parser()
    for argv, needle in ((["lab", "codec", "--corpus", str(tmp_path)], "no corpus"),
                         (["lab", "draft", "--target", str(tmp_path)], "no target LM"),
                         (["lab", "corpus", "--out", str(tmp_path), "--speakers", "nobody"], "unknown speakers")):
        args = p.parse_args(argv)
        with pytest.raises(SystemExit, match=needle):
            args.func(args)
