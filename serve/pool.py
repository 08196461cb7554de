"""`WorkerPool`: N workers, each owning one `Synthesizer`, behind a bounded admission queue.

A request is a `SpeechJob` (text, voice, per-request `SynthesisConfig`, deadline, cancel flag,
outcome): request state lives there, never in the model objects, so a later scheduler can step
several jobs' decodes together over one model copy (`max_batch`, `runtime/decode/batch.py`)
without changing the routes. A worker has `max_batch` seats; a job holds one for its duration:

    synth = await pool.acquire(deadline)        # QueueFull (-> 429) when `queue_size` already wait
    stream = pool.open(synth, job)              # bad input raises here
    async for chunk in pool.start(synth, job, stream):  # a pump thread iterates the runtime stream
        ...                                     # job.cancel() (disconnect, time limit) stops it

The pump thread is the only thread touching the `SynthesisStream` (the runtime allows one
consumer); it checks the job's cancel flag between chunks, closes the stream (which stops the
runtime's worker thread and frees the KV caches) and hands the Synthesizer back. A cancelled job
therefore frees its worker within one chunk's generation time plus the close.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from pcgtts.front import Synthesizer as BuiltinFront  # the built-in voice when no model is named
from pcgtts.runtime.audio.chunk import AudioChunk
from pcgtts.runtime.config import SynthesisConfig
from pcgtts.runtime.synthesizer import StreamStats, Synthesizer

log = logging.getLogger(__name__)


class QueueFull(Exception):
    def __init__(self, retry_after: int):
        super().__init__(f"all workers are busy and {retry_after} s is the expected wait")
        self.retry_after = retry_after


@dataclass
class SpeechJob:
    """One request's synthesis state (kept apart from the models)."""

    text: str
    voice: object | None  # a runtime Voice or PresetVoice, or None for the built-in voice
    config: SynthesisConfig | None  # None: the worker's own settings
    deadline: float  # time.monotonic() after which the job is cut
    received_at: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)
    stats: StreamStats | None = None  # the runtime's figures once the stream is opened
    first_chunk_at: float | None = None  # perf_counter() of the first chunk handed to the route
    late_chunks: int = 0  # chunks ready after a real-time player (started at chunk 1) ran dry
    timed_out: bool = False
    freed: threading.Event = field(default_factory=threading.Event)  # set once the worker is back
    play_start: float = 0.0  # simulated player: when chunk 1 was ready, time stalled, audio played
    stalled: float = 0.0
    played: float = 0.0

    def cancel(self) -> None:
        self.cancelled.set()

    def lag(self, now: float) -> float:
        """How long a real-time player started at the first chunk has waited for audio by `now`
        (perf_counter()): the stalls so far, and the one under way."""
        if self.first_chunk_at is None:
            return 0.0
        return self.stalled + max(0.0, now - (self.play_start + self.stalled + self.played))

    @property
    def time_to_first_audio(self) -> float | None:
        """From the request's arrival (queue wait included) to its first audio chunk."""
        return None if self.first_chunk_at is None else self.first_chunk_at - self.received_at


_END = object()


class WorkerPool:
    def __init__(self, synthesizers: list[Synthesizer], queue_size: int, max_batch: int = 1):
        if not synthesizers:
            raise ValueError("a worker pool needs at least one Synthesizer")
        self.synthesizers = list(synthesizers)
        self.queue_size, self.max_batch = queue_size, max_batch
        # a seat per stream a worker serves at once: its batch's slots, taken in turn across workers
        self._idle: deque[Synthesizer] = deque(s for _ in range(max_batch) for s in self.synthesizers)
        self.active: dict[int, SpeechJob] = {}  # jobs streaming now, by id (their lag is a metric)
        self._waiters: deque[asyncio.Future] = deque()
        self._durations: deque[float] = deque(maxlen=32)  # recent job durations, for Retry-After

    @classmethod
    def from_config(cls, config) -> "WorkerPool":
        """Load `config.workers` Synthesizers (one per worker; the runtime refuses concurrent streams
        on one), all planning draft lengths with the first one's step costs. Settings are validated
        by the runtime before any model loads."""
        settings = {k: v for k, v in config.runtime_settings().items() if v is not None}
        synths = []
        for i in range(config.workers):
            log.info("loading worker %d/%d", i + 1, config.workers)
            synths.append(BuiltinFront.from_pretrained(config_file=config.config_file, **settings))
            if i:  # one set of step costs for all: a seeded request gives the same audio on any worker
                synths[i].planner.adopt(synths[0].planner)
        return cls(synths, config.queue_size, config.max_batch)

    # -- admission ----------------------------------------------------------------------------

    @property
    def size(self) -> int:
        return len(self.synthesizers)

    @property
    def seats(self) -> int:
        """Streams the pool serves at once: `max_batch` per worker."""
        return self.size * self.max_batch

    @property
    def busy(self) -> int:
        return self.seats - len(self._idle)

    def batch_occupancy(self) -> float:
        """Of the workers' batch slots, the share a batched pass carried, over each batch's recent passes
        (0 with no batch or no pass yet)."""
        steps = [n / s.batch.slots for s in self.synthesizers if s.batch is not None for n in s.batch.recent_passes()]
        return sum(steps) / len(steps) if steps else 0.0

    def max_lag(self) -> float:
        """The longest a real-time player of a stream now streaming has waited for its audio, in seconds."""
        now = time.perf_counter()
        return max((job.lag(now) for job in list(self.active.values())), default=0.0)

    @property
    def waiting(self) -> int:
        return sum(1 for w in self._waiters if not w.done())

    def retry_after(self) -> int:
        """Seconds a refused client should wait: the queue ahead of it at the recent job duration."""
        mean = sum(self._durations) / len(self._durations) if self._durations else 5.0
        return max(1, math.ceil(mean * (self.waiting + 1) / self.seats))

    async def acquire(self, deadline: float) -> Synthesizer:
        """A free Synthesizer; waits in the queue until `deadline` (time.monotonic()).
        Raises QueueFull when `queue_size` requests already wait, TimeoutError past the deadline."""
        if self._idle and not self.waiting:
            return self._idle.popleft()
        if self.waiting >= self.queue_size:
            raise QueueFull(self.retry_after())
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            return await asyncio.wait_for(waiter, timeout=max(0.0, deadline - time.monotonic()))
        except BaseException:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self.release(waiter.result())  # handed over just as we gave up: pass it on
            raise
        finally:
            try:
                self._waiters.remove(waiter)
            except ValueError:
                pass

    def release(self, synth: Synthesizer) -> None:
        """Give a worker back (event-loop thread only): to the longest waiter, else to the idle set."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(synth)
                return
        self._idle.append(synth)

    # -- running a job ------------------------------------------------------------------------

    def open(self, synth: Synthesizer, job: SpeechJob):
        """The runtime stream for `job` (bad input raises ValueError here, before any work)."""
        stream = synth.stream(job.text, voice=job.voice, config=job.config)
        job.stats = stream.stats
        return stream

    def start(self, synth: Synthesizer, job: SpeechJob, stream, on_done=None):
        """Start generating `job` now (on a pump thread) and return an async iterator of its
        AudioChunks. The worker is handed back when the stream ends, fails, is cancelled or passes
        the job's deadline, even if the iterator is never read; then `on_done(job)` is called."""
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue = asyncio.Queue()
        started = time.perf_counter()
        self.active[id(job)] = job

        def hand_back() -> None:
            self.active.pop(id(job), None)
            self._durations.append(time.perf_counter() - started)
            self.release(synth)
            job.freed.set()
            if on_done is not None:
                on_done(job)

        def pump() -> None:
            item = _END
            try:
                for chunk in stream:
                    loop.call_soon_threadsafe(chunks.put_nowait, chunk)
                    if job.cancelled.is_set():
                        break
                    if time.monotonic() > job.deadline:
                        job.timed_out = True
                        break
            except BaseException as err:  # handed to the route, which logs it
                item = err
            finally:
                stream.close()  # stops the runtime's worker thread, frees caches and the lock
                try:
                    loop.call_soon_threadsafe(chunks.put_nowait, item)
                    loop.call_soon_threadsafe(hand_back)
                except RuntimeError:  # the event loop is gone (server shutdown)
                    job.freed.set()

        threading.Thread(target=pump, name="pcgtts-serve-pump", daemon=True).start()
        return self._drain(chunks, job)

    async def _drain(self, chunks: asyncio.Queue, job: SpeechJob):
        try:
            while True:
                item = await chunks.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                self._note_chunk(job, item)
                yield item
        finally:
            job.cancel()  # stops the pump if the reader left early; a no-op once it has ended

    @staticmethod
    def _note_chunk(job: SpeechJob, chunk: AudioChunk) -> None:
        """Lateness as a real-time player would see it (same rule as tools/bench.py's `play`)."""
        if job.first_chunk_at is None:
            job.first_chunk_at = time.perf_counter()
            job.play_start = chunk.ready_time
        late = chunk.ready_time - (job.play_start + job.stalled + job.played)
        if late > 0:
            job.late_chunks += 1
            job.stalled += late
        job.played += chunk.duration
