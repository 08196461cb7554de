"""`pcgtts` command line: one entry point, each area registers its own sub-commands.

Heavy imports (torch, transformers) happen inside the command handlers, so `pcgtts --help`
is instant. Logging is configured here and nowhere else: the library only logs.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
# Long-running commands whose INFO lines are their progress (the address served, training steps, checkpoints):
# they log at INFO unless told otherwise; every other command at WARNING.
INFO_BY_DEFAULT = ("serve", "train", "lab", "draft", "heads")  # lab, draft, heads: the former spellings of train
LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"


def _add_logging_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="more log lines: -v INFO (what loads, calibration, other libraries' warnings), -vv DEBUG")
    parser.add_argument("--log-level", type=str.upper, choices=LEVELS,
                        help="log level (default WARNING; INFO for serve and train)")
    parser.add_argument("--debug", action="store_true", help="DEBUG logging, and a traceback with each error")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pcgtts", description=__doc__.splitlines()[0],
                                     epilog="-v, --log-level and --debug may also follow the command's own flags")
    _add_logging_flags(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    # Each module exposes register(sub) and sets `func` on its parsers.
    from pcgtts.cli import bench, commands, export, groups, prepare, train, voice
    from pcgtts.cli import evaluate as quality_cli
    from pcgtts.cli import serve as serve_cli

    commands.register(sub)  # pcgtts models | speak
    voice.register(sub)  # pcgtts voice add
    bench.register(sub)  # pcgtts bench
    groups.register(sub)
    export.register(sub)
    prepare.register(sub)  # pcgtts prepare
    quality_cli.register(sub)  # pcgtts eval
    serve_cli.register(sub)  # pcgtts serve
    train.register(sub)  # pcgtts train, and the former lab | draft | heads (hidden)
    shown = [name for name in sub.choices if name not in train.DEPRECATED]
    sub.metavar = "{" + ",".join(shown) + "}"
    return parser


def log_level(args: argparse.Namespace) -> int:
    """The level the flags ask for: --debug, --log-level or -v / -vv; else the command's default."""
    if args.debug or args.verbose >= 2:
        return logging.DEBUG
    if args.log_level is not None:
        return logging.getLevelName(args.log_level)
    if args.verbose == 1:
        return logging.INFO
    return logging.INFO if args.command in INFO_BY_DEFAULT else logging.WARNING


class _OtherLibrariesFrom(logging.Filter):
    """Passes pcgtts's records from the handler's level up and other libraries' from `floor` up: -v shows
    what pcgtts does without every library's INFO chatter (-vv shows theirs too)."""

    def __init__(self, floor: int):
        super().__init__()
        self.floor = floor

    def filter(self, record: logging.LogRecord) -> bool:
        return record.name.partition(".")[0] == "pcgtts" or record.levelno >= self.floor


class _ConsoleHandler(logging.StreamHandler):
    """Writes each record through tqdm, so a log line lands above a progress bar instead of through it."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=self.stream)
            self.flush()
        except Exception:
            self.handleError(record)


def configure_logging(level: int) -> None:
    """Log to stderr from `level` up (other libraries from WARNING up unless `level` is DEBUG). A program
    that set up logging already (one that embeds the CLI, a test runner) keeps its own, as basicConfig does."""
    root = logging.getLogger()
    if root.handlers:
        return
    handler = _ConsoleHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    handler.addFilter(_OtherLibrariesFrom(logging.DEBUG if level <= logging.DEBUG else logging.WARNING))
    root.addHandler(handler)
    root.setLevel(level)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with the logging flags taken before the command or after its own flags."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest:
        after = argparse.ArgumentParser(add_help=False)
        _add_logging_flags(after)
        _, unknown = after.parse_known_args(rest, namespace=args)
        if unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    given = [flag for flag, value in (("-v", args.verbose), ("--log-level", args.log_level), ("--debug", args.debug))
             if value]
    if len(given) > 1:
        parser.error(f"give one of {', '.join(given)}: each sets the log level")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)  # imports each area's parsers: a Ctrl-C can land here too
    except KeyboardInterrupt:
        print("pcgtts: interrupted", file=sys.stderr)
        return 130
    configure_logging(log_level(args))
    from pcgtts.cli.train import deprecation_notice

    notice = deprecation_notice(args)
    if notice:
        logging.getLogger("pcgtts.cli").warning(notice)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("pcgtts: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # Whoever read our standard output stopped reading (`pcgtts speak ... | head -1`): the work is
        # done; say nothing more, and keep the interpreter's final flush from failing again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except (ValueError, OSError, RuntimeError) as err:
        # Library errors are written to be read by a person: show them without a traceback.
        if args.debug:
            raise
        print(f"pcgtts: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
