"""`pcgtts groups build|info`: make a group table from a target checkpoint, or describe one."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pcgtts.cli.flags import deprecated_alias

DEFAULT_TOP_K = 512  # members per G(t): bounds the table (and PCG's gather width) on clustered embeddings
DEFAULT_MAX_MEMORY_GB = 4.0


def group_size_options(args) -> dict:
    """Validated (top_k, max_bytes) from --top-k / --max-memory-gb, shared with `pcgtts bench`."""
    if args.top_k is not None and args.top_k < 0:
        raise ValueError(f"--top-k must be >= 0, got {args.top_k}")
    if args.max_memory_gb <= 0:
        raise ValueError(f"--max-memory-gb must be > 0, got {args.max_memory_gb}")
    return {"top_k": args.top_k or None, "max_bytes": int(args.max_memory_gb * 2**30)}


def register(sub: argparse._SubParsersAction) -> None:
    groups = sub.add_parser("groups", help="Acoustic Similarity Group tables").add_subparsers(
        dest="groups_cmd", required=True)
    build = groups.add_parser("build", help="build a group table from the target's speech embeddings")
    build.add_argument("--target", required=True, help="target LLaSA checkpoint directory")
    how = build.add_mutually_exclusive_group()
    how.add_argument("--theta", type=float, help="cosine threshold (paper: 0.38-0.45; default 0.40)")
    how.add_argument("--mean-size", type=float, help="choose theta so groups average this many members (paper ~140)")
    build.add_argument("--top-k", type=int, default=DEFAULT_TOP_K,
                       help=f"cap each G(t) to the k most similar tokens (default {DEFAULT_TOP_K}; 0 = no cap)")
    build.add_argument("--max-memory-gb", type=float, default=DEFAULT_MAX_MEMORY_GB,
                       help="refuse, with the estimate, a table whose build needs more memory than this "
                            f"(default {DEFAULT_MAX_MEMORY_GB:g})")
    build.add_argument("--compute-device", default="cpu", help="cpu or cuda")
    deprecated_alias(build, "--device", "compute_device", "--compute-device")
    build.add_argument("--out", required=True, help="output file (.pcg)")
    build.set_defaults(func=_build)
    info = groups.add_parser("info", help="print a table's metadata and statistics as JSON")
    info.add_argument("file")
    info.set_defaults(func=_info)


def _build(args) -> int:
    import time

    from pcgtts.tools.model_groups import build_groups_for_model

    from pcgtts.runtime.config import check_compute_device
    from pcgtts.runtime.files import check_output_file

    if not Path(args.target).is_dir():
        raise ValueError(f"--target {args.target}: directory not found")
    check_output_file(args.out)
    check_compute_device(args.compute_device)
    sizing = group_size_options(args)
    if args.mean_size is not None and args.mean_size < 1:
        raise ValueError(f"--mean-size must be >= 1, got {args.mean_size}")
    theta = args.theta if args.theta is not None or args.mean_size is not None else 0.40
    start = time.perf_counter()
    table = build_groups_for_model(args.target, theta, sizing["top_k"], args.compute_device,
                                   mean_size=args.mean_size, max_bytes=sizing["max_bytes"])
    table.save(args.out)
    stats = dict(table.stats, theta=table.theta, top_k=table.top_k, seconds=round(time.perf_counter() - start, 2),
                 out=str(args.out))
    print(f"{stats['num_groups']} groups over {stats['num_tokens']} tokens, mean size "
          f"{stats['mean_group_size']:.1f} (max {stats['max_group_size']}), "
          f"{stats['bytes'] / 1e6:.2f} MB -> {args.out}")
    print(json.dumps(stats))
    return 0


def _info(args) -> int:
    from pcgtts.groups.table import GroupTable

    print(json.dumps(GroupTable.load(args.file).header(), indent=2))
    return 0
