"""Several streams' codec windows decoded together (streams that share an LM batch, `max_batch` > 1).

A `CodecBatcher` is one thread shared by the streams of a batch. Each stream decodes its windows
through a `CodecLane` of its own (`lane.decoder(codec)` is the `decode(codes)` its `WindowDecoder`
calls, on its codec thread or, for the last window, on its LM thread): the lane hands the window to
the batcher and waits. The batcher takes every window that is due, groups those of one codec and one
length (most grown windows are left context + chunk + lookahead tokens long), decodes each group in
one call (`decode_batch`: codes [B, T] -> samples [B, 320 T]), the shortest windows first (a stream's
first chunks: the audio a listener waits for), and hands each stream its samples; the only open lane
decodes its windows itself, with no hand-off. A
stream's chunks, their boundaries and their order are those of its `WindowDecoder`, unchanged; only
where its windows are decoded moves, and a window decoded in a batch differs from the same window
decoded alone in the last float bits. Windows that arrive while a group decodes wait for the next
round (no added wait when a window is alone). A group whose batched decode fails is decoded window by
window, so a bad window fails its own stream only; a closed lane leaves at once (its waiting decode
raises `LaneClosed`, its queued windows are dropped, its window in a running decode is discarded).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable

import numpy as np

from pcgtts.runtime.audio.codec import SpeechCodec

log = logging.getLogger(__name__)

IDLE_S = 5.0  # the batcher's thread exits after this long with nothing to decode (restarted on demand)


class LaneClosed(RuntimeError):
    """The stream left the codec batcher (closed or cancelled) while a window of it was waiting."""


def decode_batch(codec, codes: np.ndarray) -> np.ndarray:
    """codes [B, T] -> float32 samples [B, 320 T]: the codec's `decode_batch` where it has one, else
    the protocol's (its `decode` window by window)."""
    batched = getattr(codec, "decode_batch", None)
    return batched(codes) if batched is not None else SpeechCodec.decode_batch(codec, codes)


class _Window:
    __slots__ = ("codec", "codes", "done", "audio", "error", "seconds", "_lock")

    def __init__(self, codec, codes: np.ndarray):
        self.codec, self.codes = codec, codes
        self.done = threading.Event()
        self.audio: np.ndarray | None = None
        self.error: BaseException | None = None
        self.seconds = 0.0  # its share of the decode call's time (the call's time / the windows in it)
        self._lock = threading.Lock()

    def settle(self, audio: np.ndarray | None = None, error: BaseException | None = None) -> None:
        """Its audio or its error, once: the first to settle it wins (a closed lane's window is settled
        already; the batcher's late result is dropped)."""
        with self._lock:
            if not self.done.is_set():
                self.audio, self.error = audio, error
                self.done.set()


class CodecBatcher:
    """The thread that decodes the windows due from every lane, equal lengths together."""

    def __init__(self):
        self._pending: list[_Window] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self.batch_sizes: deque[int] = deque(maxlen=100)  # windows per decode call, most recent last
        self.lanes = 0  # lanes open (streams that may send windows)

    def lane(self) -> "CodecLane":
        with self._cond:
            self.lanes += 1
        return CodecLane(self)

    def _lane_closed(self) -> None:
        with self._cond:
            self.lanes -= 1

    def _submit(self, window: _Window) -> None:
        with self._cond:
            self._pending.append(window)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="pcgtts-codec-batch", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _leave(self, windows: list[_Window]) -> None:
        """Settle a closing lane's windows at once and drop those not taken yet."""
        for window in windows:
            window.settle(error=LaneClosed("the stream left the codec batcher"))
        with self._cond:
            self._pending = [w for w in self._pending if not w.done.is_set()]

    def _take(self) -> list[_Window]:
        """The windows due now (waiting for some); [] once idle for `IDLE_S` (the thread then exits)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._pending, timeout=IDLE_S):
                self._thread = None
                return []
            due, self._pending = self._pending, []
            return due

    def _run(self) -> None:
        while True:
            due = self._take()
            if not due:
                return
            groups: dict[tuple[int, int], list[_Window]] = {}
            for window in due:
                groups.setdefault((id(window.codec), len(window.codes)), []).append(window)
            for group in sorted(groups.values(), key=lambda g: len(g[0].codes)):  # short (first) windows first
                try:
                    self._decode(group)
                except BaseException as err:  # the thread goes on for the other streams
                    for window in group:
                        window.settle(error=err)

    def _decode(self, group: list[_Window]) -> None:
        group = [w for w in group if not w.done.is_set()]  # a lane closed since it was taken
        if not group:
            return
        codec = group[0].codec
        self.batch_sizes.append(len(group))
        if len(group) > 1:
            started = time.perf_counter()
            try:
                audio = decode_batch(codec, np.stack([w.codes for w in group]))
                if audio.shape[0] != len(group):
                    raise ValueError(f"decode_batch returned {audio.shape[0]} rows for {len(group)} windows")
            except Exception:  # one bad window: decode them one by one, so only its stream fails
                log.debug("a batched codec decode failed; decoding its windows one by one", exc_info=True)
            else:
                share = (time.perf_counter() - started) / len(group)
                for window, samples in zip(group, audio):
                    window.seconds = share
                    window.settle(samples)
                return
        for window in group:
            started = time.perf_counter()
            try:
                audio = codec.decode(window.codes)
            except BaseException as err:  # raised again on the stream's own thread
                window.settle(error=err)
            else:
                window.seconds = time.perf_counter() - started
                window.settle(audio)


class CodecLane:
    """One stream's way into a `CodecBatcher`: `decoder(codec)` decodes a window there (waiting for
    it); `close()` leaves the batcher at once (idempotent)."""

    def __init__(self, batcher: CodecBatcher):
        self.batcher = batcher
        self.closed = False
        self.seconds = 0.0  # codec time spent on its windows (its share of each batched call)
        self._waiting: set[_Window] = set()  # its windows not decoded yet (one a thread)
        self._lock = threading.Lock()

    def decoder(self, codec) -> Callable[[np.ndarray], np.ndarray]:
        return lambda codes: self.decode(codec, codes)

    def decode(self, codec, codes) -> np.ndarray:
        """codes [T] -> float32 samples [320 T], decoded by the batcher beside other streams' windows."""
        codes = np.asarray(codes, dtype=np.int64).reshape(-1)
        if self.closed:
            raise LaneClosed("the stream left the codec batcher")
        if not len(codes):
            return codec.decode(codes)
        if self.batcher.lanes <= 1:  # no other stream to share a call with: decode here, no hand-off
            started = time.perf_counter()
            audio = codec.decode(codes)
            with self._lock:
                self.seconds += time.perf_counter() - started
            return audio
        window = _Window(codec, codes)
        with self._lock:
            if self.closed:
                raise LaneClosed("the stream left the codec batcher")
            self._waiting.add(window)
        try:
            self.batcher._submit(window)
            window.done.wait()
        finally:
            with self._lock:
                self._waiting.discard(window)
        if window.error is not None:
            raise window.error
        with self._lock:
            self.seconds += window.seconds
        return window.audio

    def close(self) -> None:
        with self._lock:
            was_open, self.closed = not self.closed, True
            waiting, self._waiting = list(self._waiting), set()
        self.batcher._leave(waiting)
        if was_open:
            self.batcher._lane_closed()
