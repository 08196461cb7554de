"""`pcgtts groups build|info`: make a group table from a target checkpoint, or describe one; and the
table-sweep options (`--theta`, `--mean-size`, `--top-k`, `--max-memory-gb`) that `bench` and `eval` share."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pcgtts.cli.flags import comma_list, deprecated_alias

DEFAULT_TOP_K = 512  # members per G(t): bounds the table (and PCG's gather width) on clustered embeddings
DEFAULT_MAX_MEMORY_GB = 4.0


def group_size_options(args) -> dict:
    """Validated (top_k, max_bytes) from --top-k / --max-memory-gb, shared with `pcgtts bench`."""
    if args.top_k is not None and args.top_k < 0:
        raise ValueError(f"--top-k must be >= 0, got {args.top_k}")
    if args.max_memory_gb <= 0:
        raise ValueError(f"--max-memory-gb must be > 0, got {args.max_memory_gb}")
    return {"top_k": args.top_k or None, "max_bytes": int(args.max_memory_gb * 2**30)}


def add_sweep_options(parser: argparse.ArgumentParser) -> None:
    """--theta / --mean-size / --top-k / --max-memory-gb for the commands that sweep group tables
    (`pcgtts bench`, `pcgtts eval`): the same table options as `groups build`, as comma lists."""
    parser.add_argument("--theta", type=comma_list(float),
                        help="comma list of group thresholds θ to sweep (pcg rules; tables built and cached)")
    parser.add_argument("--mean-size", type=comma_list(float),
                        help="comma list of target mean group sizes to sweep (pcg rules; θ chosen per size on the "
                             "target, as groups build does)")
    parser.add_argument("--top-k", type=int, default=DEFAULT_TOP_K,
                        help=f"group cap for the tables a sweep builds (default {DEFAULT_TOP_K}; 0 = none)")
    parser.add_argument("--max-memory-gb", type=float, default=DEFAULT_MAX_MEMORY_GB,
                        help="refuse a swept table whose estimated build memory exceeds this "
                             f"(default {DEFAULT_MAX_MEMORY_GB:g})")


def check_sweep_options(args) -> dict:
    """Before any model loads: the sweep's θs and sizes in range; returns group_size_options(args)."""
    sizing = group_size_options(args)
    for theta in args.theta or []:
        if not -1.0 <= theta < 1.0:
            raise ValueError(f"--theta values must lie in [-1, 1), got {theta}")
    for size in args.mean_size or []:
        if size < 1:
            raise ValueError(f"--mean-size values must be >= 1, got {size:g}")
        if sizing["top_k"] is not None and size > sizing["top_k"]:
            raise ValueError(f"--mean-size {size:g} cannot exceed the cap --top-k {sizing['top_k']}")
    return sizing


def sweep_thetas(args, target_dir: str, top_k: int | None) -> list[float] | None:
    """--theta, then the θ that gives each --mean-size on this target's speech embeddings (None: no sweep)."""
    if not args.mean_size:
        return args.theta
    from pcgtts.groups.build import theta_for_mean_size
    from pcgtts.runtime.lm.checkpoint import load_speech_embeddings

    rows = load_speech_embeddings(target_dir)[0]
    return (args.theta or []) + [theta_for_mean_size(rows, size, top_k) for size in args.mean_size]


def group_table(target_dir: str, target_lm, theta: float, top_k: int | None = None, max_bytes: int | None = None):
    """The host GroupTable for the loaded target at `theta` (capped at `top_k`), built once and cached
    beside the user's cache; refused with an estimate past `max_bytes` (groups/build.py)."""
    from pcgtts.export.group_table import build_groups_for_model
    from pcgtts.groups.table import GroupTable
    from pcgtts.runtime.files import cache_root

    fingerprint = target_lm.fingerprint
    cap = "" if top_k is None else f"-k{top_k}"
    path = cache_root() / "groups" / f"{fingerprint[:16]}-t{theta:.4f}{cap}.pcg"
    if not path.is_file():  # GroupTable.save writes atomically
        path.parent.mkdir(parents=True, exist_ok=True)
        build_groups_for_model(target_dir, theta, top_k, device=target_lm.device.type, progress=True,
                               max_bytes=max_bytes).save(path)
    return GroupTable.load(path, expect_fingerprint=fingerprint)


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

    from pcgtts.export.group_table import build_groups_for_model

    from pcgtts.runtime.config import check_compute_device
    from pcgtts.runtime.files import check_output_file
    from pcgtts.runtime.lm.checkpoint import check_weight_shapes

    if not Path(args.target).is_dir():
        raise ValueError(f"--target {args.target}: directory not found")
    check_output_file(args.out)
    check_weight_shapes(args.target)  # a damaged or misdescribed checkpoint: one line, from its headers
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
