"""Graphs compiled ahead of time by AOTInductor, kept as packages in the cache folder.

A package is built once per machine and key (~15-20 s on 2 cores) and loaded from
`$PCGTTS_CACHE` (default ~/.cache/pcgtts) after; its name hashes the source files whose code it
runs and the torch version, so a change to either builds it again. Called through the package's
loader, a graph costs ~40 µs a call on cold caches against ~170 µs for a torch.compile graph's
Python wrappers (benchmarks/bench_policy_overhead.py). Users: the compiled acceptance rule
(`runtime/decode/acceptance/compiled.py`) and an EAGLE draft's proposal chain (`runtime/lm/eagle.py`);
neither package holds model weights (they are inputs), so one serves every model of its shapes.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path
from typing import Callable

import torch

log = logging.getLogger(__name__)


def cache_dir(kind: str) -> Path:
    """The folder packages of `kind` are kept in."""
    from pcgtts.runtime.files import cache_root

    return cache_root() / kind


@functools.lru_cache(maxsize=8)  # bounded: a server's per-request temperatures leave few behind
def f64_scalar(value: float) -> torch.Tensor:
    """`value` as a graph's float64 scalar input (a temperature), made once per value: a float argument
    would make torch.compile build a graph per value, and a package takes only tensors."""
    return torch.tensor(value, dtype=torch.float64)


def package_name(prefix: str, sources: tuple[Path, ...], key: str) -> str:
    """`prefix`-<hash of the sources' bytes, the torch version and `key`>.pt2."""
    digest = hashlib.sha256(torch.__version__.encode() + key.encode())
    for source in sources:
        digest.update(Path(source).read_bytes())
    return f"{prefix}-{digest.hexdigest()[:16]}.pt2"


def load_or_build(path: Path, export: Callable[[], object], options: dict | None = None,
                  what: str = "a graph") -> Callable[..., list[torch.Tensor]]:
    """The package at `path`, built first from `export()` (a torch.export program) if absent, written
    atomically (a failed build leaves nothing behind) -> run(*inputs) -> its outputs."""
    import torch._inductor

    if not path.exists():
        log.info("compiling %s ahead of time (~15-20 s on 2 cores, once per machine) into %s", what, path.parent)
        path.parent.mkdir(parents=True, exist_ok=True)
        program = export()
        tmp = path.with_suffix(f".{os.getpid()}.tmp.pt2")
        try:
            torch._inductor.aoti_compile_and_package(program, package_path=str(tmp), inductor_configs=options or {})
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    loader = torch._inductor.aoti_load_package(str(path)).loader
    return lambda *inputs: loader.run(list(inputs))
