"""Flag helpers shared by the sub-commands: deprecated aliases that still work, with a warning."""

from __future__ import annotations

import argparse
import sys


class _DeprecatedAlias(argparse.Action):
    def __init__(self, option_strings, dest, new_flag: str = "", **kwargs):
        self.new_flag = new_flag
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"pcgtts: warning: {option_string} is deprecated and will be removed in the next release; "
              f"use {self.new_flag}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def deprecated_alias(parser: argparse.ArgumentParser, old_flag: str, dest: str, new_flag: str, **kwargs) -> None:
    """`old_flag` sets `dest` like `new_flag` does (pass its `type=`), warns, and is hidden from --help."""
    parser.add_argument(old_flag, dest=dest, action=_DeprecatedAlias, new_flag=new_flag, help=argparse.SUPPRESS,
                        default=argparse.SUPPRESS, **kwargs)


def positive(kind):
    """argparse type: a number of `kind` that is > 0, with a one-line message otherwise."""
    def parse(text: str):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    parse.__name__ = f"positive {kind.__name__}"
    return parse


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value
