"""Real-time playback: sinks that consume `AudioChunk`s.

* `SoundDeviceSink`: a PortAudio output stream (sounddevice) whose callback drains a buffer,
  paced by the device's clock.
* `NullSink`: discards audio; with `realtime=True` it drains the buffer on a simulated 16 kHz
  clock instead, for machines with no sound card (and for the latency harness).
* `FileSink`: writes an audio file (WAV, FLAC, OGG Vorbis or MP3, by its suffix) as chunks arrive;
  it replaces the named file only when complete, and an interrupted stream keeps what was made
  beside it as a valid shorter file (`F.partial.wav`).

Playback starts once a pre-buffer is filled (or the stream ends). When the buffer runs dry
mid-stream the device plays silence: that is an *underrun*, counted with its duration, never
an error. Leaving a sink's `with` block on an exception stops at once, without playing what is
still buffered. `sounddevice` is imported lazily: without PortAudio the error says to use --out.
"""

from __future__ import annotations

import collections
import logging
import os
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pcgtts.runtime.audio.chunk import SAMPLE_RATE, AudioChunk
from pcgtts.runtime.audio.io import output_format
from pcgtts.runtime.files import check_output_file, publish

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlaybackStats:
    samples_written: int = 0
    samples_played: int = 0  # stream samples handed to the device (silence padding excluded)
    underruns: int = 0  # device blocks that found the buffer dry mid-stream
    underrun_seconds: float = 0.0  # silence played because of underruns
    prebuffer_seconds: float = 0.0
    first_audio_at: float | None = None  # perf_counter() when the first stream sample was played


class _Player:
    """The buffer between producer and clock, with underrun accounting (shared by the sinks)."""

    def __init__(self, prebuffer_seconds: float, rate: int):
        self.rate = rate
        self.prebuffer = int(prebuffer_seconds * rate)
        self.prebuffer_seconds = prebuffer_seconds
        self.lock = threading.Lock()
        self.queue: collections.deque[np.ndarray] = collections.deque()
        self.buffered = 0
        self.ended = False
        self.playing = False
        self.written = self.played = self.underruns = self.underrun_samples = 0
        self.first_audio_at: float | None = None
        self.drained = threading.Event()

    def push(self, samples: np.ndarray) -> None:
        with self.lock:
            self.queue.append(samples)
            self.buffered += len(samples)
            self.written += len(samples)

    def end(self) -> None:
        with self.lock:
            self.ended = True
            if self.buffered == 0:
                self.drained.set()

    def pull(self, out: np.ndarray) -> None:
        """Fill `out` (float32 [frames]) with the next samples, or silence."""
        frames = len(out)
        with self.lock:
            if not self.playing:
                if self.buffered >= max(self.prebuffer, 1) or (self.ended and self.buffered):
                    self.playing = True
                else:
                    out.fill(0)
                    if self.ended:
                        self.drained.set()
                    return
            got = 0
            while got < frames and self.queue:
                head = self.queue[0]
                take = min(frames - got, len(head))
                out[got:got + take] = head[:take]
                got += take
                if take == len(head):
                    self.queue.popleft()
                else:
                    self.queue[0] = head[take:]
            self.buffered -= got
            self.played += got
            if got and self.first_audio_at is None:
                self.first_audio_at = time.perf_counter()
            if got < frames:
                out[got:] = 0
                if not self.ended:
                    self.underruns += 1
                    self.underrun_samples += frames - got
            if self.ended and self.buffered == 0:
                self.drained.set()

    def stats(self) -> PlaybackStats:
        with self.lock:
            return PlaybackStats(self.written, self.played, self.underruns, self.underrun_samples / self.rate,
                                 self.prebuffer_seconds, self.first_audio_at)


class _Sink:
    def __enter__(self):
        self.start()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(finished=exc_type is None)

    def start(self) -> None: ...

    def write(self, chunk: AudioChunk) -> None: ...

    def close(self, finished: bool = True) -> None:
        """End the output; `finished=False` (the producer failed or was interrupted): at once."""

    def stats(self) -> PlaybackStats: ...


def _import_sounddevice():
    try:
        import sounddevice
    except OSError as err:  # the PortAudio shared library is missing
        raise RuntimeError(f"audio playback needs the PortAudio library ({err}); install it "
                           "(apt install libportaudio2), or write a file with --out FILE.wav, "
                           "or discard the audio with --audio-device null") from None
    except ImportError:
        raise RuntimeError("audio playback needs the 'sounddevice' package (pip install 'pcgtts[audio]'); "
                           "or write a file with --out FILE.wav, or discard the audio with "
                           "--audio-device null") from None
    return sounddevice


def list_output_devices() -> list[dict]:
    sd = _import_sounddevice()
    return [dict(d, index=i) for i, d in enumerate(sd.query_devices()) if d["max_output_channels"] > 0]


def check_output_device(device: str | None) -> None:
    """A clear error, before any work, for a playback device that does not exist."""
    if device is None or str(device).lower() == "null":
        if device is None and not list_output_devices():
            raise ValueError("no audio output device found; write a file with --out FILE.wav, "
                             "or discard the audio with --audio-device null")
        return
    devices = list_output_devices()
    if str(device).isdigit():
        if any(d["index"] == int(device) for d in devices):
            return
    elif any(str(device).lower() in d["name"].lower() for d in devices):
        return
    names = ", ".join(f"{d['index']}: {d['name']}" for d in devices) or "none"
    raise ValueError(f"no audio output device {device!r}; output devices here: {names}")


class SoundDeviceSink(_Sink):
    """Plays through PortAudio; resamples to the device's rate when it is not 16 kHz."""

    def __init__(self, device: str | int | None = None, prebuffer_seconds: float = 0.2, blocksize: int = 1024,
                 drain_timeout: float = 5.0):
        self.device, self.blocksize, self.drain_timeout = device, blocksize, drain_timeout
        self.prebuffer_seconds = prebuffer_seconds
        self._stream = None
        self._player: _Player | None = None
        self._resampler = None
        self.tap: list[np.ndarray] | None = None  # set to a list to capture what the device was given

    def start(self) -> None:
        sd = _import_sounddevice()
        try:
            info = sd.query_devices(self.device, "output")
        except (ValueError, sd.PortAudioError) as err:
            raise RuntimeError(f"no playback device {self.device!r} ({err}); see `python -m sounddevice` "
                               "for the list, or use --out FILE.wav / --audio-device null") from None
        self.rate = int(info["default_samplerate"])
        if self.rate != SAMPLE_RATE:
            import soxr

            self._resampler = soxr.ResampleStream(SAMPLE_RATE, self.rate, 1, dtype="float32")
        self._player = _Player(self.prebuffer_seconds, self.rate)
        self._stream = sd.OutputStream(samplerate=self.rate, channels=1, dtype="float32", device=info["index"],
                                       blocksize=self.blocksize, callback=self._callback)
        self._stream.start()

    def _callback(self, outdata, frames, time_info, status) -> None:
        self._player.pull(outdata[:, 0])
        if self.tap is not None:
            self.tap.append(outdata[:, 0].copy())

    def write(self, chunk: AudioChunk) -> None:
        samples = chunk.samples
        if self._resampler is not None:
            samples = self._resampler.resample_chunk(samples)  # flushed in close()
        self._player.push(np.asarray(samples, dtype=np.float32))

    def close(self, finished: bool = True) -> None:
        """Play out what is buffered (`finished`), or stop at once."""
        if self._stream is None:
            return
        if self._resampler is not None:
            self._player.push(self._resampler.resample_chunk(np.zeros(0, np.float32), last=True))
            self._resampler = None
        self._player.end()
        pending = self._player.buffered / self.rate
        if finished and not self._player.drained.wait(pending + self.drain_timeout):
            log.warning("playback did not drain within %.1f s", pending + self.drain_timeout)
        self._stream.stop()
        self._stream.close()
        self._stream = None

    def stats(self) -> PlaybackStats:
        return self._player.stats() if self._player else PlaybackStats()


class NullSink(_Sink):
    """Discards audio. With `realtime`, a thread consumes it at 16 kHz like a sound card would."""

    def __init__(self, realtime: bool = False, prebuffer_seconds: float = 0.2, block: int = 320):
        self.realtime, self.block = realtime, block
        self._player = _Player(prebuffer_seconds if realtime else 0.0, SAMPLE_RATE)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> None:
        if self.realtime and self._thread is None:
            self._thread = threading.Thread(target=self._clock, name="pcgtts-null-clock", daemon=True)
            self._thread.start()

    def _clock(self) -> None:
        buf = np.zeros(self.block, np.float32)
        period = self.block / SAMPLE_RATE
        next_tick = time.perf_counter()
        while not self._stop.is_set():
            self._player.pull(buf)
            if self._player.drained.is_set():
                return
            next_tick += period
            time.sleep(max(0.0, next_tick - time.perf_counter()))

    def write(self, chunk: AudioChunk) -> None:
        if self.realtime:
            self._player.push(chunk.samples)
        else:
            with self._player.lock:
                self._player.written += len(chunk.samples)
                self._player.played += len(chunk.samples)

    def close(self, finished: bool = True) -> None:
        self._player.end()
        if self._thread is not None:
            if finished:
                self._player.drained.wait(self._player.buffered / SAMPLE_RATE + 5.0)
            self._stop.set()
            self._thread.join()
            self._thread = None

    def stats(self) -> PlaybackStats:
        return self._player.stats()


def written_into(path: str | Path) -> bool:
    """Whether `path` is written into rather than replaced: an existing device, FIFO or socket, or
    anything under /dev (`/dev/null`, `/dev/stdout`, which may lead to a terminal, a pipe or a file)."""
    path = Path(path)
    if path.absolute().parts[1:2] == ("dev",) and path.exists():
        return True
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def check_output(path: str | Path, flag: str = "--out") -> tuple[Path, tuple[str, str]]:
    """(path, (container, encoding)) for an audio output, with one-line errors before any work: a
    device, FIFO or stream must be writable (it is written into, WAV unless its suffix names a format);
    anything else is a file whose suffix names a format this machine writes."""
    path = Path(path)
    if written_into(path):
        if not os.access(path, os.W_OK):
            raise ValueError(f"{flag} {path}: not writable")
        return path, output_format(path) if path.suffix else ("WAV", "PCM_16")
    return check_output_file(path, flag), output_format(path)


def partial_path(path: str | Path) -> Path:
    """Where an interrupted write keeps its audio: `F.partial.wav` beside `F.wav` (same format)."""
    path = Path(path)
    return path.with_name(f"{path.stem}.partial{path.suffix}")


class FileSink(_Sink):
    """Writes an audio file in the format its suffix names (`io.OUTPUT_FORMATS`: WAV, FLAC, OGG
    Vorbis, MP3) into a temporary file beside `path`, which replaces `path` only when the stream
    ends. A failure leaves an existing file untouched and nothing else behind; an interruption
    (Ctrl-C: a KeyboardInterrupt of any kind) also leaves `path` as it was and keeps what was made,
    a valid shorter file, as `partial_path(path)`. `kept` says where the audio went, once closed.
    A device, FIFO or stream (`/dev/null`, a named pipe, `/dev/stdout`) is never replaced: the file is
    made in the temporary folder and written into it once complete (an interruption keeps nothing)."""

    def __init__(self, path: str | Path):
        self.path, (self.container, self.encoding) = check_output(path)
        self.into = written_into(self.path)
        self.kept: Path | None = None
        self._file = None
        self._tmp: Path | None = None
        self._written = 0

    def start(self) -> None:
        import tempfile

        import soundfile as sf

        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp",
                                   dir=None if self.into else self.path.parent)
        os.close(fd)
        self._tmp = Path(tmp)
        try:
            self._file = sf.SoundFile(tmp, "w", samplerate=SAMPLE_RATE, channels=1, format=self.container,
                                      subtype=self.encoding)
        except BaseException:
            self._tmp.unlink(missing_ok=True)
            raise

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        elif issubclass(exc_type, KeyboardInterrupt):
            self.keep_partial()
        else:
            self.discard()

    def write(self, chunk: AudioChunk) -> None:
        self._file.write(np.clip(chunk.samples, -1.0, 1.0))
        self._written += len(chunk.samples)

    def close(self, finished: bool = True) -> None:
        """Move the finished file into place (`finished`), or remove it."""
        if not finished:
            self.discard()
        elif self._finish_file():
            if self.into:
                self._write_into()
            else:
                publish(self._tmp, self.path)
            self.kept = self.path

    def _write_into(self) -> None:
        """Copy the finished file into the device, FIFO or stream at `path`, then remove it."""
        import shutil

        try:
            with open(self._tmp, "rb") as src, open(self.path, "wb") as dst:
                shutil.copyfileobj(src, dst)
        finally:
            self._tmp.unlink(missing_ok=True)

    def keep_partial(self) -> None:
        """Keep what was written as `partial_path(path)`, or nothing if no audio was written."""
        if self._finish_file():
            if self._written and not self.into:
                publish(self._tmp, partial_path(self.path))
                self.kept = partial_path(self.path)
            else:
                self._tmp.unlink(missing_ok=True)

    def discard(self) -> None:
        if self._finish_file():
            self._tmp.unlink(missing_ok=True)

    def _finish_file(self) -> bool:
        """Close the file being written; False if there was none (never started, or closed)."""
        if self._file is None:
            return False
        file, self._file = self._file, None
        try:
            file.close()
        except BaseException:
            self._tmp.unlink(missing_ok=True)
            raise
        return True

    def stats(self) -> PlaybackStats:
        return PlaybackStats(self._written, self._written)


def open_sink(device: str | None = None, out_path: str | Path | None = None,
              prebuffer_seconds: float = 0.2) -> _Sink:
    """--out FILE -> FileSink; --audio-device null -> real-time NullSink; else a sound device (None = default)."""
    if out_path is not None:
        return FileSink(out_path)
    if device is not None and str(device).lower() == "null":
        return NullSink(realtime=True, prebuffer_seconds=prebuffer_seconds)
    if device is not None and str(device).isdigit():
        device = int(device)
    return SoundDeviceSink(device, prebuffer_seconds)
