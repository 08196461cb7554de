"""Other libraries' output while pcgtts prepares models, held back and reported once.

An export runs torch.onnx, onnxscript, onnx_ir and onnxruntime's quantizer, which between them log
warnings (torchvision ops they skip, attribute types they default), raise Python warnings and may
print; expanding the built-in voice runs transformers, which draws its own progress bars. None of
that is about the models pcgtts writes, so `held_back(what)` collects it for the length of the work:

- every held line is logged again at INFO afterwards (`pcgtts -v` shows them all);
- when INFO is not shown, one WARNING line counts those not known to be harmless (`HARMLESS`), so
  a new warning from a newer library is never lost silently;
- work inside other work that already holds output back joins it (one count for a whole
  preparation, not one per graph).

The libraries' loggers get their handlers back unchanged, and their INFO chatter (the exporter logs
every rewrite) is not recorded at all.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import warnings
from collections import Counter
from collections.abc import Iterator

log = logging.getLogger(__name__)

# Loggers (and every logger below each) whose records are held back.
LIBRARIES = ("torch", "onnx", "onnx_ir", "onnxscript", "onnxruntime", "transformers", "huggingface_hub")
# Lines known to say nothing about what pcgtts exports, each with why:
HARMLESS = (
    re.compile(r"torchvision is not installed\. Skipping"),  # the exporter's registry of torchvision ops: none used
    re.compile(r"Attribute type is ambiguous because it is an empty sequence"),  # onnx_ir types [] as INTS, as needed
    # one dynamic dimension (token count, cache size) shared by several inputs, on purpose
    re.compile(r"The axis name: \w+ will not be used, since it shares the same shape constraints"),
    re.compile(r"isinstance\(treespec, LeafSpec\)` is deprecated"),  # torch's exporter calling its own old API
)

_holding: list[list[str]] = []  # the lines of the outermost `held_back` in force, if any


class _Collect(logging.Handler):
    def __init__(self, lines: list[str]):
        super().__init__(logging.WARNING)
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.name}: {record.getMessage()}")


def _library_loggers() -> list[logging.Logger]:
    """Each library's logger and those below it that do not simply pass records up (torch gives many of
    its loggers their own stderr handler)."""
    found = {name: logging.getLogger(name) for name in LIBRARIES}
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if (isinstance(logger, logging.Logger) and name.startswith(tuple(f"{lib}." for lib in LIBRARIES))
                and (logger.handlers or not logger.propagate)):
            found[name] = logger
    return list(found.values())


@contextlib.contextmanager
def _loggers_into(lines: list[str]) -> Iterator[None]:
    """The libraries' WARNING and ERROR records go to `lines` instead of their handlers."""
    collect = _Collect(lines)
    saved = [(logger, logger.handlers, logger.propagate, logger.level) for logger in _library_loggers()]
    for logger, _, _, level in saved:
        logger.handlers, logger.propagate = [collect], False
        if level < logging.WARNING:
            logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, handlers, propagate, level in saved:
            logger.handlers, logger.propagate = handlers, propagate
            logger.setLevel(level)


@contextlib.contextmanager
def _transformers_bars_off() -> Iterator[None]:
    """transformers' own progress bars (e.g. "Writing model shards") off, if transformers is installed."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        yield
        return
    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def _warning_lines(caught: list[warnings.WarningMessage]) -> list[str]:
    return [f"{w.category.__name__} ({w.filename}:{w.lineno}): {w.message}" for w in caught]


def _printed_lines(name: str, stream: io.StringIO) -> list[str]:
    return [f"{name}: {line}" for line in stream.getvalue().splitlines() if line.strip()]


def harmless(line: str) -> bool:
    return any(pattern.search(line) for pattern in HARMLESS)


def report(what: str, lines: list[str]) -> None:
    """Each held line at INFO (once, with how often it came); when INFO is not shown, one WARNING counting
    those that may matter."""
    for line, count in Counter(lines).items():
        log.info("%s, from another library: %s%s", what, line, f" ({count} times)" if count > 1 else "")
    unknown = [line for line in lines if not harmless(line)]
    if unknown and not log.isEnabledFor(logging.INFO):
        log.warning("%s: %d warning%s from other libraries hidden (shown at log level INFO: pcgtts -v)", what,
                    len(unknown), "" if len(unknown) == 1 else "s")


@contextlib.contextmanager
def held_back(what: str, streams: bool = True) -> Iterator[None]:
    """Hold back other libraries' log records, Python warnings, transformers' progress bars and, with
    `streams`, whatever is printed to sys.stdout / sys.stderr, until the block ends; then `report` them
    under `what` (e.g. "export"). Leave `streams` off around work that draws pcgtts's own progress bars."""
    if _holding:  # inside other held-back work: its report covers this too
        yield
        return
    lines: list[str] = []
    _holding.append(lines)
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_loggers_into(lines))
            caught = stack.enter_context(warnings.catch_warnings(record=True))
            warnings.simplefilter("default")  # each warning once per place it is raised from
            stack.enter_context(_transformers_bars_off())
            if streams:
                stack.enter_context(contextlib.redirect_stdout(out))
                stack.enter_context(contextlib.redirect_stderr(err))
            try:
                yield
            finally:
                lines += _warning_lines(caught)
    finally:
        _holding.pop()
        report(what, lines + _printed_lines("stdout", out) + _printed_lines("stderr", err))
