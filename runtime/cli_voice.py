"""`pcgtts voice add`: encode a reference recording once into a small voice file."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    sub.add_parser("voice", help="voices for cloning")
