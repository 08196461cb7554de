"""Flag helpers shared by the sub-commands: deprecated aliases that still work, with a warning, and
argparse types that refuse out-of-range numbers in one line before any work starts."""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
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


def setting(kind, key: str):
    """argparse type: a number of `kind` that the setting `key` of runtime/config.py accepts (its range
    is checked there, by the settings' own dataclasses), with their one-line message otherwise."""
    def parse(text: str):
        value = kind(text)  # a ValueError: argparse's "invalid <kind> value"
        from pcgtts.runtime.config import resolve_settings

        try:
            resolve_settings({key: value})
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        return value
    parse.__name__ = getattr(kind, "__name__", "number")
    return parse


# The synthesis settings a command line sets, each checked against its range in runtime/config.py.
seed = setting(int, "seed")
temperature = setting(float, "temperature")
top_p = setting(float, "top_p")
draft_length = setting(int, "draft_length")
max_tokens = setting(int, "max_new_tokens")


def cpu_threads(minimum: int = 0):
    """argparse type: a CPU thread count from `minimum` (0: automatic) up to this machine's cores; past
    them threads only wait on each other, and far past them the thread pools crash the process."""
    def parse(text: str) -> int:
        value = int(text)
        cores = os.cpu_count() or 1
        if not minimum <= value <= cores:
            raise argparse.ArgumentTypeError(f"must lie in [{minimum}, {cores}] (this machine has {cores} CPU "
                                             f"cores{'; 0 = automatic' if minimum == 0 else ''}), got {text}")
        return value
    parse.__name__ = "int"
    return parse


def comma_list(kind):
    """argparse type: a non-empty comma list of `kind` ("0.3,0.4"), with a one-line message otherwise."""
    def parse(text: str):
        try:
            values = [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma list of {kind.__name__}, got {text!r}") from None
        if not values:
            raise argparse.ArgumentTypeError("empty list")
        return values
    parse.__name__ = f"{kind.__name__} list"
    return parse


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


@contextlib.contextmanager
def quieted(logger_name: str, level: int = logging.ERROR):
    """Hold one logger at `level` for a command's duration (a harness that reports cuts in its own
    output), restoring it after, so in-process callers and tests keep their logging."""
    logger = logging.getLogger(logger_name)
    before = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(before)


def quiet_logger(logger_name: str, level: int = logging.ERROR):
    """Decorator form of `quieted` for a command handler."""
    def wrap(handler):
        @functools.wraps(handler)
        def run(*args, **kwargs):
            with quieted(logger_name, level):
                return handler(*args, **kwargs)
        return run
    return wrap
