"""One way to run `torch.onnx.export(dynamo=True)` for every graph we ship, and to publish it.

Every export is written into a staging folder beside its destination, checked there against
PyTorch, and only then moved into place (`staged_output`): a failed export or check leaves
nothing behind and an existing export untouched.

What the exporter's libraries log, warn or print while a graph is made is held back
(`export/noise.py`): an export reports its own lines, and `pcgtts -v` shows theirs. Weights go
to `<graph>.data` beside the graph (ONNX's external-data format), so graphs over 2 GB
(LLaSA-3B/8B) work too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from pathlib import Path

import torch

from pcgtts.export.noise import held_back
from pcgtts.runtime.files import default_mode
from pcgtts.runtime.lm.checkpoint import TOKENIZER_FILES
from pcgtts.runtime.lm.llama import RMSNorm

log = logging.getLogger(__name__)

OPSET = 18


@contextlib.contextmanager
def _fusable_norms(module: torch.nn.Module):
    """`module`'s RMSNorms traced as divisions while it is exported (`RMSNorm.traced_as_division`):
    onnxruntime fuses that form (and not x * rsqrt) into one SimplifiedLayerNormalization node, so the
    built-in voice's int8 step graph runs 330 nodes instead of 408, ~5 % faster a step."""
    norms = [m for m in module.modules() if isinstance(m, RMSNorm)]
    for norm in norms:
        norm.traced_as_division = True
    try:
        yield
    finally:
        for norm in norms:
            del norm.traced_as_division  # back to the class's default


def export_graph(module: torch.nn.Module, example: tuple, path: Path, input_names: list[str],
                 output_names: list[str], dynamic_shapes: tuple) -> Path:
    """Trace `module` on `example` and write `path` (+ `path`.data); returns `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with held_back("export"), torch.no_grad(), _fusable_norms(module):
        program = torch.onnx.export(module.eval(), example, input_names=input_names, output_names=output_names,
                                    dynamic_shapes=dynamic_shapes, opset_version=OPSET, dynamo=True,
                                    external_data=True, verbose=False)
        for stale in (path, path.with_name(path.name + ".data")):
            stale.unlink(missing_ok=True)
        program.save(str(path), external_data=True)
    log.info("exported %s in %.1f s", path, time.perf_counter() - started)
    return path


def copy_tokenizer(src: Path, dst: Path) -> None:
    """Exports carry the tokenizer, so the runtime can check the vocabulary the graph was made for."""
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


@contextlib.contextmanager
def staged_output(out_dir: str | Path):
    """Yields an empty staging folder next to `out_dir`; on a clean exit it replaces `out_dir`
    (an existing one is moved aside first and deleted after), on an exception it is deleted."""
    import tempfile

    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out must be a directory, but {out_dir} is a file")
    parent = out_dir.parent
    parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".partial", dir=parent))
    try:
        yield stage
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    old = None
    if out_dir.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".old", dir=parent))
        out_dir.rename(old / "export")
    os.chmod(stage, default_mode(directory=True))  # mkdtemp made it private
    stage.rename(out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
