"""Ctrl-C (SIGINT) and SIGTERM during a command: one clean stop, then quiet until the process exits.

Python's own Ctrl-C handling raises KeyboardInterrupt wherever the main thread is, every time the
signal comes: a second Ctrl-C while a command cleans up, or while the interpreter shuts down,
lands in a `finally` block or a weakref callback and prints a traceback or "Exception ignored
in ...", and SIGTERM kills the process with its temporary files left behind. Under
`stop_on_signals` the first of either signal raises `Interrupted` in the main thread, so
`with` blocks clean up as they do for Ctrl-C, and every later one is ignored.
"""

from __future__ import annotations

import contextlib
import signal
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """The first SIGINT or SIGTERM; `exit_code` is the shell's 128 + the signal's number."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _ignore_from_now_on() -> None:
    for signum in SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def _raise_once(signum: int, frame) -> None:
    _ignore_from_now_on()
    raise Interrupted(signum)


@contextlib.contextmanager
def stop_on_signals():
    """Inside the block, the first SIGINT or SIGTERM raises `Interrupted`; later ones are ignored.

    A block that ends without a signal puts the previous handlers back. After a signal they stay
    ignored: the process is on its way out, and a second signal must not cut its cleanup or exit
    short. A signal ignored when the block starts stays ignored (a shell starts background jobs
    with SIGINT ignored). Outside the main thread, where Python cannot set handlers, it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {signum: signal.getsignal(signum) for signum in SIGNALS}
    for signum, handler in before.items():
        if handler is not signal.SIG_IGN:
            signal.signal(signum, _raise_once)
    interrupted = False
    try:
        yield
    except KeyboardInterrupt:
        interrupted = True
        _ignore_from_now_on()
        raise
    finally:
        if not interrupted:
            for signum, handler in before.items():
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
