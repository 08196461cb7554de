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
