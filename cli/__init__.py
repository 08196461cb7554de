"""`pcgtts` command line: one entry point, each area registers its own sub-commands.

Heavy imports (torch, transformers) happen inside the command handlers, so `pcgtts --help`
is instant.
"""

from __future__ import annotations

import argparse
import logging
import sys


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pcgtts", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="verbose logging")
    sub = parser.add_subparsers(dest="command", required=True)
    # Each module exposes register(sub) and sets `func` on its parsers.
    from pcgtts.cli import commands, export, groups, heads
    from pcgtts.quality import cli as quality_cli
    from pcgtts.serve import cli as serve_cli
    from pcgtts.train import cli as lab_cli

    commands.register(sub)
    groups.register(sub)
    export.register(sub)
    heads.register(sub)  # pcgtts heads train | transitions
    quality_cli.register(sub)  # pcgtts eval
    serve_cli.register(sub)  # pcgtts serve
    lab_cli.register(sub)  # pcgtts lab
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError, RuntimeError) as err:
        # Library errors are written to be read by a person: show them without a traceback.
        if args.debug:
            raise
        print(f"pcgtts: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
