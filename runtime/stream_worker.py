"""The thread that turns a stream's prompts into `AudioChunk`s, and the stream its caller reads.

`StreamJob` is one stream's state apart from the models: its queue, its worker thread and its hold
on the Synthesizer's `stream_lock`. The worker (`produce`) decodes each sentence (runtime/decode/
loop.py) and pushes accepted tokens through the windowed codec decoder (runtime/audio/streaming.py:
on a thread of its own, or `SameThreadCodec`); all sentences share one window decoder, so the audio
is one continuous stream; a stream in a batch (`seat`) has its windows decoded beside the batch's
other streams' (runtime/audio/codec_batch.py). Generation runs ahead of the reader by at most
`run_ahead_s` seconds of audio, then waits without using the CPU. Closing the stream stops the worker and frees the caches.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
import weakref
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from pcgtts.runtime.audio.chunk import SAMPLE_RATE, SAMPLES_PER_TOKEN, AudioChunk
from pcgtts.runtime.audio.codec_batch import CodecLane
from pcgtts.runtime.audio.streaming import CodecThread, WindowDecoder
from pcgtts.runtime.audio.transform import StreamingTransform, VoiceTransform
from pcgtts.runtime.config import SynthesisConfig
from pcgtts.runtime.decode.loop import decode
from pcgtts.runtime.decode.steps import DecodeStats

log = logging.getLogger(__name__)

_END = object()  # queue sentinel: the worker finished


class EmptySynthesis(RuntimeError):
    """The model made no speech for a call's text: it ended every sentence at once, before its first
    speech token. Raised by `synthesize()` and by iterating `stream()` instead of returning no audio."""


@dataclass
class StreamStats:
    """What one `stream()` call did; complete once the stream is exhausted or closed."""

    started_at: float = 0.0  # perf_counter() when the stream was opened
    first_audio_at: float | None = None  # when the first chunk was ready
    finished_at: float | None = None
    audio_samples: int = 0
    sentences: list[DecodeStats] = field(default_factory=list)
    truncated: int = 0  # sentences cut by the token budget (runaway generation)
    cancelled: bool = False
    codec_seconds: float = 0.0  # time the codec spent on this stream's windows (its share of batched calls)

    @property
    def time_to_first_audio(self) -> float | None:
        return None if self.first_audio_at is None else self.first_audio_at - self.started_at

    @property
    def audio_seconds(self) -> float:
        return self.audio_samples / SAMPLE_RATE

    @property
    def real_time_factor(self) -> float | None:
        """Compute time / audio duration (< 1 is faster than real time)."""
        if self.finished_at is None or not self.audio_samples:
            return None
        return (self.finished_at - self.started_at) / self.audio_seconds

    def totals(self) -> DecodeStats:
        total = DecodeStats()
        for s in self.sentences:
            for name in ("steps", "target_forwards", "draft_forwards", "drafted", "accepted", "emitted",
                         "time_draft", "time_target", "time_verify"):
                setattr(total, name, getattr(total, name) + getattr(s, name))
            total.per_position_accepted = _add_lists(total.per_position_accepted, s.per_position_accepted)
            total.length_counts = _add_lists(total.length_counts, s.length_counts)
            total.catchup_tokens += s.catchup_tokens
        return total


def _add_lists(a: list[int], b: list[int]) -> list[int]:
    """Element-wise sum of two count lists of possibly different lengths."""
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(max(len(a), len(b)))]


class SynthesisStream:
    """Iterator of `AudioChunk`s for one call.

    `close()`, leaving a `with` block, or dropping the last reference stops the worker thread and
    frees the KV caches and the Synthesizer's lock. A stream that is kept but not read for
    `SynthesisConfig.abandon_after_s` while its run-ahead is full is abandoned: the worker frees both
    by itself, and reading the stream afterwards raises. Starting another stream on the same
    Synthesizer while this one is not being read (from the same thread, or nobody read it for
    `run_ahead_s` seconds) cancels this one: reading it then raises RuntimeError."""

    def __init__(self, job: "StreamJob"):
        self.stats = job.stats
        self._job = job
        self._finalizer = weakref.finalize(self, job.shutdown)

    def __iter__(self) -> "SynthesisStream":
        return self

    def __next__(self) -> AudioChunk:
        return self._job.next_chunk()

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> "SynthesisStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SameThreadCodec:
    """`CodecThread`'s contract on the LM's own thread (`StreamConfig.codec_thread` off)."""

    def __init__(self, window: WindowDecoder, emit):
        self.window, self.emit = window, emit

    def push(self, tokens) -> bool:
        return all(self.emit(audio, False) for audio in self.window.push(tokens))

    def tokens_wanted(self) -> int:
        return self.window.schedule.due - self.window.available

    def finish(self) -> bool:
        return self.emit(self.window.flush(), True)

    def close(self) -> None:
        pass


class StreamJob:
    """One stream's state, apart from the models: its queue, worker thread, lock ownership."""

    def __init__(self, synth, prompts: list, budgets: list[int], config: SynthesisConfig,
                 minimums: list[int] | None = None, transform: VoiceTransform | None = None, seat=None):
        # seat: the slot of the Synthesizer's batch (runtime/decode/batch.py) it decodes in beside other
        # streams; None: it holds the Synthesizer's one lane (`stream_lock`) alone.
        if seat is None and not synth.stream_lock.acquire(blocking=False):
            raise RuntimeError("this Synthesizer is already streaming to a reader; finish or close that stream "
                               "first (or use one Synthesizer per concurrent stream)")
        self.synth, self.prompts, self.budgets, self.config = synth, prompts, budgets, config
        self.minimums = minimums if minimums is not None else [config.decode.min_new_tokens] * len(prompts)
        self.transform = transform  # a preset's audio transform (runtime/audio/transform.py), or None
        self.stats = StreamStats()
        self.queue: queue.Queue = queue.Queue()
        self.run_ahead = max(1, round(config.run_ahead_s * SAMPLE_RATE))  # samples queued at most (and one chunk)
        self.queued = 0  # audio samples in the queue, not yet read
        self.room = threading.Condition()  # notified when the consumer takes a chunk or the stream stops
        self.reading = False  # a consumer is inside next_chunk (another stream() must not cancel it)
        self.reader: int | None = None  # the thread that last read it (None: never read)
        self.read_at = 0.0  # time.monotonic() when that read returned
        self.superseded = False  # cancelled by a later stream(): reading it raises
        self.stop = threading.Event()
        self.worker: threading.Thread | None = None
        self.finished = self.closed = self.abandoned = False
        self.seat = seat
        # A batched stream's codec windows are decoded beside the batch's other streams' (its lane into
        # the Synthesizer's `CodecBatcher`, runtime/audio/codec_batch.py); None: by its own codec.
        batcher = synth.codec_batcher if seat is not None else None
        self.codec_lane: CodecLane | None = batcher.lane() if batcher is not None else None
        self._holds_lock = seat is None
        self._guard = threading.Lock()

    def _start(self) -> None:
        self.stats.started_at = time.perf_counter()
        for lm in (self.synth.target, self.synth.draft):
            if lm is not None:
                lm.ensure_cache()
        self.worker = threading.Thread(target=produce, args=(self,), name="pcgtts-synthesis",
                                       daemon=True)
        self.worker.start()

    def next_chunk(self) -> AudioChunk:
        with self._guard:  # against `supersede` on another thread: a read either starts first or raises
            if self.superseded:
                raise RuntimeError("this stream was cancelled: another stream was started on its Synthesizer "
                                   "while this one was not being read")
            if self.closed:
                raise StopIteration
            self.reading, self.reader = True, threading.get_ident()
        try:
            return self._next_chunk()
        finally:
            self.reading, self.read_at = False, time.monotonic()

    def supersede(self) -> bool:
        """Cancel this stream for a later `stream()` on its Synthesizer, unless a consumer is reading it
        (`read_elsewhere`) or it no longer holds the Synthesizer; whether it was cancelled."""
        with self._guard:
            if self.reading or not self._holds_lock or self.read_elsewhere():
                return False
            self.superseded = True
        self.shutdown()
        return True

    def read_elsewhere(self) -> bool:
        """Whether another thread than the caller's reads this stream: it read within the last
        `run_ahead_s` seconds (a player takes a chunk at least that often). The caller's own thread
        cannot be reading it while it starts another stream."""
        return (self.reader not in (None, threading.get_ident())
                and time.monotonic() - self.read_at < self.config.run_ahead_s)

    def _next_chunk(self) -> AudioChunk:
        if self.worker is None:
            self._start()
        while True:
            try:
                item = self.queue.get(timeout=0.1)
            except queue.Empty:
                if self.closed:  # closed from another thread while this one waited
                    raise StopIteration from None
                if self.abandoned:
                    self.shutdown()
                    raise RuntimeError(f"this stream was abandoned: it was not read for "
                                       f"{self.config.abandon_after_s:g} s, so its worker stopped") from None
                continue
            if item is _END:
                self.finished = True
                self.shutdown()
                raise StopIteration
            if isinstance(item, BaseException):
                self.shutdown()
                raise item
            with self.room:
                self.queued -= len(item.samples)
                self.room.notify()
            if self.stats.first_audio_at is None:
                self.stats.first_audio_at = item.ready_time
            self.stats.audio_samples += len(item.samples)
            return item

    def put(self, item) -> bool:
        """Worker side: hand `item` to the consumer once the run-ahead has room for it (waiting without
        using the CPU); False once the stream is closed or abandoned."""
        samples = len(item.samples) if isinstance(item, AudioChunk) else 0
        with self.room:
            if not self.await_room(samples):
                return False
            self.queued += samples
            self.queue.put(item)
            return True

    def await_room(self, samples: int = 1) -> bool:
        """Worker side (the LM's thread and the codec's): wait, without using the CPU, until the
        run-ahead has room for `samples` more (always for a chunk when none is queued); False once the
        stream is closed, or abandoned after `abandon_after_s` unread."""
        waiting_since = time.monotonic()
        with self.room:
            while self.queued and self.queued + samples > self.run_ahead:
                if self.stop.is_set() or self.abandoned:
                    return False
                if time.monotonic() - waiting_since > self.config.abandon_after_s:
                    log.warning("a stream was not read for %g s: abandoning it (worker and lock freed)",
                                self.config.abandon_after_s)
                    self.abandoned = self.stats.cancelled = True  # the worker frees both as it exits
                    return False
                self.room.wait(timeout=0.1)
            return not (self.stop.is_set() or self.abandoned)

    def worker_exits(self) -> None:
        """Worker side, last: an abandoned stream's caches and lock are freed here, on the thread
        that used them (a chunk may be refused on the codec thread while the LM still runs)."""
        if self.abandoned:
            self._free_models()
            self._release_lock()

    def _free_models(self) -> None:
        """A stream stopped early frees the models' caches, unless it decoded in a batch slot (the batch's
        other streams go on; its seat is given back with the lock, `_release_lock`, which always follows)."""
        if self.seat is None:
            self.synth.release()

    def _release_lock(self) -> None:
        with self._guard:
            if self._holds_lock:
                self._holds_lock = False
                self.synth.stream_lock.release()
        if self.seat is not None:
            self.seat.close()

    def shutdown(self) -> None:
        """Stop the worker, free the caches unless it finished, release the lock. Idempotent."""
        with self._guard:
            if self.closed:
                return
            self.closed = True
        self.stop.set()
        with self.room:
            self.room.notify_all()
        if self.codec_lane is not None:  # its windows leave the codec batcher at once
            self.codec_lane.close()
        if self.worker is not None:
            while self.worker.is_alive():  # drain what it queued while it notices the stop
                try:
                    self.queue.get(timeout=0.05)
                except queue.Empty:
                    pass
            self.worker.join()
            self.stats.finished_at = time.perf_counter()
        if not self.finished and not self.abandoned:
            self.stats.cancelled = True
            self._free_models()
        self._release_lock()


def window_codec(synth, context: np.ndarray | None):
    """The codec that decodes a stream: the clone codec when its prompt ends in reference codes (a
    preset or cloned voice) and the synthesizer has one, else the codec."""
    clone = synth.clone_codec
    return clone if clone is not None and context is not None and len(context) else synth.codec


def timed(decode, stats: StreamStats):
    """`decode` (codes -> samples) adding the time of each call to `stats.codec_seconds` (calls may come
    from the codec's thread and the LM's at once)."""
    lock = threading.Lock()

    def run(codes):
        started = time.perf_counter()
        try:
            return decode(codes)
        finally:
            with lock:
                stats.codec_seconds += time.perf_counter() - started

    return run


def produce(job: StreamJob) -> None:
    """The worker thread: decode each sentence and push its audio through the window decoder."""
    synth = job.synth
    prompts, budgets, config, stats, put = job.prompts, job.budgets, job.config, job.stats, job.put
    try:
        # A cloned voice's reference codes end every prompt: they are the first chunk's left
        # context, as in a one-shot decode of reference + speech, and choose the target that speaks
        # (the clone target, loaded on first use, where the Synthesizer has one).
        context = synth.target.vocab.prompt_codes(prompts[0]).numpy() if prompts else None
        route = synth.route(context is not None and len(context) > 0)
        target, planner = route.target, route.planner
        config = replace(config, decode=route.serving(config.decode))
        target.ensure_cache()
        device = target.device
        generator = torch.Generator(device=device)
        # torch.seed() would reseed the global RNG; a fresh seed comes from the OS instead.
        generator.manual_seed(config.seed if config.seed is not None else secrets.randbits(63))
        plan = planner.loop_arguments(config.decode, seeded=config.seed is not None, batched=job.seat is not None)
        speech_codec = window_codec(synth, context)
        lane = job.codec_lane
        window = WindowDecoder(timed(speech_codec.decode, stats) if lane is None else lane.decoder(speech_codec),
                               config.stream.for_stream(batched=job.seat is not None), context=context)
        done = 0  # samples of speech decoded and handed out so far (before a preset's transform)
        # A preset's transform: its chunks come out LOOKAHEAD_S later and `rate` times as long.
        reshape = StreamingTransform(job.transform, SAMPLE_RATE) if job.transform is not None else None

        def emit(samples: np.ndarray, last: bool) -> bool:
            nonlocal done
            start = done
            if reshape is None:
                done += len(samples)
            else:
                samples = reshape.process(samples)
                if last:
                    samples = np.concatenate([samples, reshape.flush()])
                elif not len(samples):
                    return True
                done = reshape.consumed
            return put(AudioChunk(samples.astype(np.float32, copy=False), SAMPLE_RATE,
                                  start // SAMPLES_PER_TOKEN, done // SAMPLES_PER_TOKEN,
                                  time.perf_counter(), last, stats.truncated))

        codec = CodecThread(window, emit) if config.stream.codec_thread else SameThreadCodec(window, emit)
        # The LM waits while the next full chunk would not fit the run-ahead, so tokens do not pile up
        # on the codec's side of it either.
        chunk_samples = config.stream.chunk_tokens * SAMPLES_PER_TOKEN
        try:
            for prompt, budget, minimum in zip(prompts, budgets, job.minimums):
                sentence = DecodeStats()
                stats.sentences.append(sentence)
                decode_config = replace(config.decode, max_new_tokens=budget, min_new_tokens=minimum)
                bursts = (job.seat.decode(prompt, decode_config, generator, sentence, **plan,
                                          wanted=codec.tokens_wanted) if job.seat is not None
                          else decode(target, synth.draft, prompt, decode_config, generator, synth.groups, sentence,
                                      **plan))
                for burst in bursts:
                    if not codec.push(burst) or not job.await_room(chunk_samples):  # run-ahead full: wait
                        return
                if not sentence.emitted and len(prompts) > 1:
                    log.warning("sentence %d of %d ended at once: the model made no speech for it",
                                len(stats.sentences), len(prompts))
                if sentence.finish in ("max_tokens", "cache_full"):
                    stats.truncated += 1
                    why = (f"its budget of {budget} tokens" if sentence.finish == "max_tokens"
                           else "the end of the KV cache")
                    log.warning("sentence %d reached %s without the stop token; cut there",
                                len(stats.sentences), why)
            if not any(sentence.emitted for sentence in stats.sentences):
                raise EmptySynthesis("the model made no speech for this text: it ended before its first speech "
                                     "token (try another voice, seed or wording)")
            finished = codec.finish()
            if lane is not None:
                stats.codec_seconds = lane.seconds
            if finished:
                put(_END)
        finally:
            if job.codec_lane is not None:
                job.codec_lane.close()
            codec.close()
            job.worker_exits()
    except BaseException as err:  # surfaced to the consumer's thread
        put(err)
