"""`pcgtts groups build|info`: make a group table from a target checkpoint, or describe one."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pcgtts.cli.flags import deprecated_alias


def register(sub: argparse._SubParsersAction) -> None:
    groups = sub.add_parser("groups", help="Acoustic Similarity Group tables").add_subparsers(
        dest="groups_cmd", required=True)
    build = groups.add_parser("build", help="build a group table from the target's speech embeddings")
    build.add_argument("--target", required=True, help="target LLaSA checkpoint directory")
    build.add_argument("--theta", type=float, default=0.40, help="cosine threshold (paper: 0.38-0.45)")
    build.add_argument("--top-k", type=int, help="cap each G(t) to the k most similar tokens")
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
    start = time.perf_counter()
    table = build_groups_for_model(args.target, args.theta, args.top_k, args.compute_device)
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
