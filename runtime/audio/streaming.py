"""Windowed streaming decode of X-codec2 tokens with left context, lookahead and a cross-fade.

X-codec2's decoder attends over its whole input and its convolutions reach about ±11 tokens,
so audio for tokens [a, b) decoded alone differs from the same span in a one-shot decode. A
chunk for [a, b) is therefore emitted only once b + lookahead tokens exist, by decoding the
window [a - left_context, b + lookahead) and keeping the samples of [a, b); the first
`crossfade` samples are blended with the previous window's decode of the same stretch (which
that window produced as lookahead), so seams are continuous. The first chunk may use a shorter
lookahead (`first_chunk_lookahead`): its audio is the one a listener waits for. Every sample is emitted exactly
once: the stream holds 320 samples per token, no gaps, no duplicates.

The first chunk is small (low time to first audio); each later chunk doubles the previous one up
to `chunk_tokens` (fewer decodes), as far as a stream generating at `min_speed` times real time still
has each chunk ready before the audio already out runs dry (`ChunkSchedule`). Defaults come from
`benchmarks/bench_streaming.py` (table in BENCHMARKS.md).

`CodecThread` runs a `WindowDecoder` on a thread of its own, so the codec decodes a window on one
core while the LM decodes the next tokens on another (the same chunks, in the same order). The LM's
thread holds tokens back until a chunk is due: waking the codec's thread for every token cost the
LM's thread 0.1-0.15 ms a token on a 2-core CPU (AR 484-490 → 511-529 tok/s). At the
end of a stream the LM's thread, idle from then on, decodes the last window itself while the codec's
thread may still be decoding the chunk before it (the two decodes are independent; only the
cross-fade joins them, on the codec's thread), so the stream ends one window decode sooner.
"""

from __future__ import annotations

import math
import queue
import threading
from typing import Callable

import numpy as np

from pcgtts.runtime.audio.chunk import SAMPLES_PER_TOKEN
from pcgtts.runtime.config import StreamConfig


class ChunkSchedule:
    """Where a stream's chunks end, and how many tokens past each one its window decodes (its
    lookahead); a chunk is due once those tokens exist. The first chunk is `first_chunk_tokens` long
    with `first_chunk_lookahead`. Each later one doubles the one before (up to `chunk_tokens`: fewer,
    larger codec windows) and decodes `codec_lookahead` tokens past it, within one bound: a stream
    generating at `min_speed` times real time has every chunk due before a player that started at the
    first chunk has played the audio already out,

        due_k - due_1 <= min_speed * done_k     (tokens; done_k: tokens emitted before chunk k)

    so an early chunk is shorter, and its lookahead grows from the first chunk's with what the bound
    allows (what a doubled chunk leaves of it, or a third of it: 3, 4, 5, 7, 8 tokens at 1.5x) rather
    than jumping to `codec_lookahead` at once (that jump alone, 6 tokens after a 5-token first chunk,
    needed a stream faster than 3x real time). The schedule depends on the
    settings only, never on timing: a stream's chunk boundaries are the same alone and under load.
    `min_speed` 0: no bound. The window decoder and the thread feeding it keep one each."""

    def __init__(self, config: StreamConfig):
        self.config = config
        self.done = 0  # stream tokens already emitted
        self.size = config.first_chunk_tokens  # tokens in the next chunk
        self.lookahead = config.first_chunk_lookahead  # tokens past the next chunk its window decodes
        self.first_due = self.size + self.lookahead

    @property
    def due(self) -> int:
        """Stream tokens that must exist before the next chunk is emitted."""
        return self.done + self.size + self.lookahead

    def emitted(self, end: int) -> None:
        """The stream's audio now runs to token `end`: size the next chunk and its lookahead."""
        cfg = self.config
        self.done = end
        want = min(2 * self.size, cfg.chunk_tokens)
        if not cfg.min_speed:  # 0, or None: a route that did not choose (`StreamConfig.for_stream`)
            self.size, self.lookahead = want, cfg.codec_lookahead
            return
        budget = math.floor(self.first_due + cfg.min_speed * end + 1e-9) - end  # size + lookahead allowed
        share = max(cfg.first_chunk_lookahead, budget - want, budget // 3)
        self.lookahead = min(cfg.codec_lookahead, share)
        self.size = max(1, min(want, budget - self.lookahead))


def window_span(config: StreamConfig, offset: int, start: int, end: int, right: int) -> tuple[int, int]:
    """[first, last): where in a stream's token list (its `offset` context tokens first) the window lies
    that decodes the chunk of stream tokens [start, end) with `right` tokens of lookahead."""
    return max(0, offset + start - config.left_context_tokens), offset + end + right


class WindowDecoder:
    """Feed tokens with `push`, get audio chunks back; `flush` at the end of the stream."""

    def __init__(self, decode: Callable[[np.ndarray], np.ndarray], config: StreamConfig = StreamConfig(),
                 context: np.ndarray | None = None):
        # decode: codes [T] -> samples [320 T]. context: tokens that precede the stream (e.g. the
        # voice prompt's codes) used as left context for the first chunk, never emitted.
        self.decode = decode
        self.config = config
        ctx = np.zeros(0, np.int64) if context is None else np.asarray(context, np.int64)[-config.left_context_tokens:]
        self.offset = len(ctx) if config.left_context_tokens else 0  # tokens before the stream's first
        self.tokens = list(ctx[-self.offset:]) if self.offset else []
        self.schedule = ChunkSchedule(config)
        self.tail: np.ndarray | None = None  # previous window's audio just past its chunk
        fade = np.arange(config.crossfade_samples, dtype=np.float32) + 0.5
        self.fade_in = (0.5 - 0.5 * np.cos(np.pi * fade / max(config.crossfade_samples, 1))).astype(np.float32)

    @property
    def available(self) -> int:
        return len(self.tokens) - self.offset

    @property
    def done(self) -> int:
        """Stream tokens already emitted."""
        return self.schedule.done

    def push(self, tokens) -> list[np.ndarray]:
        self.tokens.extend(int(t) for t in tokens)
        out = []
        while self.available >= self.schedule.due:
            out.append(self._emit(self.schedule.done + self.schedule.size, self.schedule.lookahead))
        return out

    def flush(self, decoded: np.ndarray | None = None) -> np.ndarray:
        """Audio for every token not emitted yet (possibly empty). `decoded`: the last window's audio,
        already decoded from the same codes elsewhere (`CodecThread.finish`)."""
        if self.done >= self.available:
            return np.zeros(0, np.float32)
        return self._emit(self.available, 0, decoded)

    def _emit(self, end: int, right: int, decoded: np.ndarray | None = None) -> np.ndarray:
        cfg, hop = self.config, SAMPLES_PER_TOKEN
        start = self.done
        first, last = window_span(cfg, self.offset, start, end, right)  # window bounds, in self.tokens
        if decoded is None:
            audio = self.decode(np.asarray(self.tokens[first:last], dtype=np.int64))
        elif len(decoded) == (last - first) * hop:
            audio = decoded
        else:
            raise ValueError(f"a window of {last - first} tokens decodes to {(last - first) * hop} samples, "
                             f"got {len(decoded)}")
        lead = (self.offset + start - first) * hop
        chunk = audio[lead:lead + (end - start) * hop].copy()
        if self.tail is not None and len(self.tail):
            n = min(len(self.tail), len(chunk), len(self.fade_in))
            chunk[:n] = self.tail[:n] * (1 - self.fade_in[:n]) + chunk[:n] * self.fade_in[:n]
        self.tail = audio[lead + (end - start) * hop:lead + (end - start) * hop + cfg.crossfade_samples]
        self.schedule.emitted(end)
        return chunk


_FLUSH, _CLOSE = object(), object()


class CodecThread:
    """A `WindowDecoder` on its own thread, fed by the LM's thread.

    push(tokens) keeps tokens and returns at once, handing the codec's thread what it holds once the
    window's next chunk is due (a `ChunkSchedule` of its own; False once `emit` has refused a chunk: the
    consumer is gone, stop producing); finish() hands over the rest, decodes the last window on the
    calling thread (the codec's may still be busy with the chunk before it), has the codec's thread
    emit it, waits and returns whether the last chunk was taken; close() stops the thread
    (idempotent; after finish it only joins). `emit(samples, last) -> bool` runs on the codec
    thread. An error there is raised again on the LM's thread by its next push / finish."""

    def __init__(self, window: WindowDecoder, emit: Callable[[np.ndarray, bool], bool]):
        self.window, self.emit = window, emit
        self._codes = list(window.tokens)  # the window's context, then every token pushed (the last window's codes)
        self._handed = 0  # stream tokens handed over so far; the rest of `_codes` is held back
        self._schedule = ChunkSchedule(window.config)  # the window's, followed on this thread
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._refused = threading.Event()
        self._error: BaseException | None = None
        self._last_taken = False
        self._thread = threading.Thread(target=self._run, name="pcgtts-codec", daemon=True)
        self._thread.start()

    def push(self, tokens) -> bool:
        self._raise()
        if self._refused.is_set():
            return False
        self._codes.extend(int(t) for t in tokens)
        count = len(self._codes) - self.window.offset
        if count < self._schedule.due:
            return True
        while count >= self._schedule.due:  # the chunks the window will emit from these tokens
            self._schedule.emitted(self._schedule.done + self._schedule.size)
        self._hand_over()
        return True

    def tokens_wanted(self) -> int:
        """Tokens still to push before the next chunk is due (what the LM's side may wait for)."""
        return self._schedule.due - (len(self._codes) - self.window.offset)

    def _hand_over(self) -> None:
        held = self._codes[self.window.offset + self._handed:]
        if held:
            self._queue.put(held)
            self._handed += len(held)

    def finish(self) -> bool:
        self._hand_over()
        self._queue.put((_FLUSH, self._last_window()))
        self._thread.join()
        self._raise()
        return self._last_taken

    def close(self) -> None:
        self._refused.set()
        self._queue.put(_CLOSE)
        self._thread.join()

    def _last_window(self) -> np.ndarray | None:
        """The audio of the window `flush` will emit, decoded on this thread (None: nothing left)."""
        start, end = self._schedule.done, self._handed  # the chunks due before it are the codec thread's
        if start >= end:
            return None
        first, last = window_span(self.window.config, self.window.offset, start, end, 0)
        return self.window.decode(np.asarray(self._codes[first:last], dtype=np.int64))

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _run(self) -> None:
        try:
            while True:
                item = self._queue.get()
                if item is _CLOSE or self._refused.is_set():
                    return
                if isinstance(item, tuple) and item[0] is _FLUSH:  # with the last window's audio (or None)
                    self._last_taken = self.emit(self.window.flush(item[1]), True)
                    return
                for audio in self.window.push(item):
                    if not self.emit(audio, False):
                        self._refused.set()
                        return
        except BaseException as err:  # handed to the LM's thread
            self._error = err
            self._refused.set()
