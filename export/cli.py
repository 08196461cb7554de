"""`pcgtts export ...` (ONNX / TensorRT): registered here, implemented in this package."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    sub.add_parser("export", help="export models to ONNX / TensorRT")
