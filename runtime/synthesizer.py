"""`Synthesizer`: text (+ a voice) in, a real-time stream of `AudioChunk`s out.

    synth = Synthesizer.from_pretrained(target=..., draft=..., codec=..., groups=...)
    with open_sink(None) as sink:                    # runtime/audio/playback.py: the default device
        for chunk in synth.stream("Hello there.", ref_audio="me.wav", ref_text="What I said."):
            sink.write(chunk)

Generation runs ahead of the consumer on a worker thread, by at most `SynthesisConfig.run_ahead_s`
seconds of audio, then waits without using the CPU until the consumer reads on: the worker
splits the text into sentences, builds each prompt, runs the decode loop
(`runtime/decode/speculative.py`) and pushes accepted tokens through the windowed codec decoder
(`runtime/audio/streaming.py`). All sentences share one window decoder, so the audio is one
continuous stream. Closing the stream early stops the worker and frees the KV caches. One
stream at a time per Synthesizer: starting a stream while an earlier one is held but not being read
cancels the earlier one; while another thread is reading one (inside `next()`, or it read within the
last `run_ahead_s` seconds), a second is refused at once with a one-line RuntimeError.
Per-call settings (`seed=`, `temperature=`, `policy=`, ... any field of `SynthesisConfig`) are
checked by the config dataclasses, like every other argument, before any work starts.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
import typing
import weakref
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from pcgtts.groups.device import DeviceGroupTable
from pcgtts.runtime.audio.chunk import SAMPLE_RATE, SAMPLES_PER_TOKEN, AudioChunk
from pcgtts.runtime.audio.codec import SpeechCodec
from pcgtts.runtime.config import (EAGLE_POLICIES, KEYS, PCG_POLICIES, STATE_POLICIES, DecodeConfig, DeviceConfig, ModelPaths, Settings, SynthesisConfig, check_compute_device, cpu_threads,
                                   resolve_settings)
from pcgtts.runtime.text.prompt import build_prompt, check_text
from pcgtts.runtime.decode.calibrate import adopt_costs, keep_costs
from pcgtts.runtime.decode.cost_model import in_loop_costs
from pcgtts.runtime.decode.speculative import DecodeStats, decode, measure_acceptance, plans_draft_length, prepare
from pcgtts.runtime.lm.protocol import LM, template_head
from pcgtts.runtime.audio.streaming import CodecThread, WindowDecoder
from pcgtts.runtime.text.numbers import spell_numbers
from pcgtts.runtime.text.script import LATIN, foreign_script
from pcgtts.runtime.text.split import split_sentences
from pcgtts.runtime.audio.voice import Voice

log = logging.getLogger(__name__)

_END = object()  # queue sentinel: the worker finished

# The sentence an adaptive draft length's starting acceptance is measured on (in the model's own
# voice, `Synthesizer.starting_acceptance`), and the most tokens that measurement decodes.
CALIBRATION_TEXT = "The birch canoe slid on the smooth planks, and the wind rose over the grey water."
CALIBRATION_TOKENS = 100  # ~30-50 steps at L = 3; ~0.7 s of the built-in voice's load on a 2-core CPU
_MAX_MEASURED = 16  # decode configurations whose measured acceptance is kept (oldest dropped first)
# The scripts the built-in voice reads (and the demo pair stands in for it): English only
# (pcgtts/voice/MODEL_CARD.md). A checkpoint the user names reads what it was trained on, which
# the runtime cannot tell (LLaSA's own read Chinese and English): no script check unless declared.
BUILTIN_VOICE_SCRIPTS = (LATIN,)


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

    def __init__(self, job: "_Job"):
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


class _SameThread:
    """`CodecThread`'s contract on the LM's own thread (`StreamConfig.codec_thread` off)."""

    def __init__(self, window: WindowDecoder, emit):
        self.window, self.emit = window, emit

    def push(self, tokens) -> bool:
        return all(self.emit(audio, False) for audio in self.window.push(tokens))

    def finish(self) -> bool:
        return self.emit(self.window.flush(), True)

    def close(self) -> None:
        pass


class _Job:
    """One stream's state, apart from the models: its queue, worker thread, lock ownership."""

    def __init__(self, synth: "Synthesizer", prompts: list, budgets: list[int], config: SynthesisConfig):
        if not synth._lock.acquire(blocking=False):
            raise RuntimeError("this Synthesizer is already streaming to a reader; finish or close that stream "
                               "first (or use one Synthesizer per concurrent stream)")
        self.synth, self.prompts, self.budgets, self.config = synth, prompts, budgets, config
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
        self._holds_lock = True
        self._guard = threading.Lock()

    def _start(self) -> None:
        self.stats.started_at = time.perf_counter()
        for lm in (self.synth.target, self.synth.draft):
            if lm is not None:
                lm.ensure_cache()
        self.worker = threading.Thread(target=self.synth._produce, args=(self,), name="pcgtts-synthesis",
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
            self.synth.release()
            self._release_lock()

    def _release_lock(self) -> None:
        with self._guard:
            if self._holds_lock:
                self._holds_lock = False
                self.synth._lock.release()

    def shutdown(self) -> None:
        """Stop the worker, free the caches unless it finished, release the lock. Idempotent."""
        with self._guard:
            if self.closed:
                return
            self.closed = True
        self.stop.set()
        with self.room:
            self.room.notify_all()
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
            self.synth.release()
        self._release_lock()


class Synthesizer:
    def __init__(self, target: LM, draft: LM | None, codec: SpeechCodec, groups: DeviceGroupTable | None = None,
                 config: SynthesisConfig = SynthesisConfig(), heads=None, eagle=None,
                 scripts: tuple[str, ...] | None = None):
        # codec: decode-only is enough unless reference audio is given (the encoder is then loaded
        # from codec.source_dir); groups on the target's device, or None (pcg then unavailable);
        # heads: the target's multi-token heads (a multi_token.HeadProposer) for the mtp-* policies;
        # eagle: its EAGLE draft (a multi_token.EagleProposer) for the eagle-* policies;
        # scripts: the writing systems the voice was trained on (("Latin",), ("Latin", "CJK"): the
        # first word of a letter's Unicode name); text mostly in another logs a warning. None: not
        # known, nothing checked.
        if draft is not None:
            target.vocab.check_same_layout(draft.vocab)
        self.target, self.draft, self.codec, self.groups, self.heads = target, draft, codec, groups, heads
        self.eagle = eagle
        self.scripts = check_scripts(scripts)
        self.tokenizer = target.tokenizer
        self.config = config
        self._lock = threading.Lock()
        self._current: weakref.ref | None = None  # the job holding the lock, if any
        self._voices: dict[tuple, Voice] = {}
        self._acceptance: dict[DecodeConfig, tuple[float, ...]] = {}  # `starting_acceptance`, per decode config
        self._loop_steps: dict[DecodeConfig, dict] = {}  # its calibration decode's step timings, until `plan` uses them
        self._full_codec = None  # the codec with its encoder, for reference audio

    @classmethod
    def from_pretrained(cls, target: str | Path | None = None, draft: str | Path | None = None,
                        codec: str | Path | None = None, groups: str | Path | None = None, *,
                        config: SynthesisConfig | None = None, config_file: str | Path | None = None,
                        force_export: bool = False, **settings) -> "Synthesizer":
        """Load models from local folders. No `target`: the built-in voice.

        Any setting of `runtime/config.py` may be given by name (`policy="sd"`, `temperature=0.6`,
        `compute_device="cuda"`, `draft_length=4`, ...); precedence is keyword > `config_file`
        (TOML) > `config` > the built-in voice's own settings (no `target`, no `config`; e.g. its
        temperature) > default. Everything is validated before a model is loaded. The built-in voice
        reads Latin script only: text mostly in another logs a warning (`scripts`).
        """
        if config is not None and config_file is not None:
            raise ValueError("give either config= or config_file=, not both")
        from pcgtts.builtin import voice_settings, with_builtin_models  # the built-in voice when no target is given

        explicit = {"target": target, "draft": draft, "codec": codec, "groups": groups, **settings}
        resolved = resolve_settings(explicit, config_file, Settings(synthesis=config or SynthesisConfig()),
                                    voice=voice_settings() if config is None else None)
        scripts = voice_scripts(resolved.models.target)
        resolved = with_builtin_models(resolved)
        return cls.load(resolved.models, resolved.device, resolved.synthesis, force_export=force_export,
                        scripts=scripts)

    @classmethod
    def load(cls, models: ModelPaths, device: DeviceConfig, config: SynthesisConfig,
             force_export: bool = False, scripts: tuple[str, ...] | None = None) -> "Synthesizer":
        """Load resolved settings (`from_pretrained` is the convenient front of this); `scripts`: what
        the voice reads (`voice_scripts` of the target named before the built-in voice filled in)."""
        check_scripts(scripts)
        from pcgtts.runtime.audio.codec import Codec
        from pcgtts.runtime.audio.onnx_codec import OrtCodec, is_exported_codec
        from pcgtts.runtime.lm.loader import load_lm, resolve_backend

        device = resolve_backend(device, models.target)
        check_models(models, config.decode, device)
        threads = cpu_threads(device, config.stream.codec_thread)
        if threads is not None and torch.get_num_threads() != threads:
            log.info("torch set to %d CPU thread(s) per stage (threads=0: half the cores beside the codec "
                     "thread; OMP_NUM_THREADS or threads=N choose)", threads)
            torch.set_num_threads(threads)
        common = dict(backend=device.backend, device=device.compute_device, dtype=device.dtype,
                      max_length=device.max_length, draft_length=config.decode.draft_length,
                      force_export=force_export, quantize=device.quantize, compiled=device.compile, threads=threads,
                      prefix_cache=device.prefix_cache)
        target_lm = load_lm(models.target, **common)
        draft_lm = None
        if models.draft is not None:
            from pcgtts.runtime.lm.draft import check_draft_layout

            check_draft_layout(models.target, target_lm.tokenizer, models.draft)  # before its weights load
            draft_lm = load_lm(models.draft, tokenizer=target_lm.tokenizer, **common)
        table = None
        if models.groups is not None:
            from pcgtts.groups.table import GroupTable

            table = GroupTable.load(models.groups, expect_vocab=target_lm.vocab,
                                    expect_fingerprint=target_lm.fingerprint)
            table = table.to_device(target_lm.device)
        heads_file, transitions_file, eagle_file = proposer_files(models)
        heads, eagle = _load_heads(heads_file, transitions_file, target_lm), _load_eagle(eagle_file, target_lm)
        if is_exported_codec(models.codec):
            codec_model = OrtCodec(models.codec, threads=threads, force=force_export)
        else:
            codec_model = Codec.from_pretrained(models.codec, device=device.compute_device, decode_only=True)
            if device.compute_device == "cpu" and config.stream.codec_thread:
                log.info("the codec decodes with PyTorch beside the LM: its per-op hand-offs of Python's GIL slow "
                         "the decode loop (lab-v1: 12-23 %%); `pcgtts export codec --codec %s "
                         "--out DIR` and --codec DIR avoid them", models.codec)
        synth = cls(target_lm, draft_lm, codec_model, table, config, heads, eagle, scripts)
        synth.plan(config)
        synth.warm_prefix()
        return synth

    def plan(self, config: SynthesisConfig | None = None):
        """Measure the step costs `config`'s adaptive draft length plans with, and the acceptance it
        starts from (`starting_acceptance`), now rather than inside the first utterance (where they
        would add to its time to first audio); once per policy and temperature class while the
        models live (`calibrate` logs a measurement; a later call returns the kept costs). The costs
        kept are the isolated timings moved to what the calibration decode's steps took inside the
        loop (`cost_model.in_loop_costs`). -> the `StepCosts`, or None (nothing to plan)."""
        decode_config = (config or self.config).decode
        costs = prepare(self.target, self.draft, decode_config, self.groups, self.proposer(decode_config.policy))
        if costs is not None:
            self.starting_acceptance(decode_config)
            # the calibration decode's in-loop timings replace the isolated ones, once per measurement
            loop_step = self._loop_steps.pop(replace(decode_config, max_new_tokens=CALIBRATION_TOKENS), None)
            if loop_step:
                planned = in_loop_costs(costs, loop_step["length"], loop_step["seconds"])
                keep_costs(self.target, costs, planned)
                costs = planned
        return costs

    def starting_acceptance(self, decode_config: DecodeConfig) -> tuple[float, ...] | None:
        """The per-position acceptance an adaptive draft length starts every utterance from: measured
        once per decode configuration by decoding `CALIBRATION_TEXT` at the fixed draft length,
        seeded (`speculative.measure_acceptance`); None when nothing is planned."""
        if not plans_draft_length(decode_config):
            return None
        key = replace(decode_config, max_new_tokens=CALIBRATION_TOKENS)
        if key not in self._acceptance:
            started = time.perf_counter()
            prompt = build_prompt(self.tokenizer, self.target.vocab, CALIBRATION_TEXT)
            loop_step: dict = {}
            rates = measure_acceptance(self.target, self.draft, prompt, key, self.groups, self.proposer(key.policy),
                                       loop_step=loop_step)
            self._loop_steps[key] = loop_step
            log.info("%s at temperature %g starts from acceptance %s (measured on a calibration sentence in %.2f s)",
                     key.policy, key.sampling.temperature, " / ".join(f"{r:.2f}" for r in rates) or "-",
                     time.perf_counter() - started)
            if len(self._acceptance) >= _MAX_MEASURED:
                oldest = next(iter(self._acceptance))
                del self._acceptance[oldest]
                self._loop_steps.pop(oldest, None)
            self._acceptance[key] = rates
        return self._acceptance[key]

    def warm_prefix(self) -> None:
        """Prefill the chat template's head, which every utterance and voice shares, into both
        models' caches now (after `plan`, whose timings overwrite the caches), so that the first
        utterance's prefill, like every later one's, runs only its own words (`protocol.py`:
        prefix reuse, bit for bit what a full prefill computes). A no-op with prefix reuse off."""
        prompt = build_prompt(self.tokenizer, self.target.vocab, "Warm.")
        head = prompt[:template_head(prompt, self.target.vocab)]
        for lm in (self.target, self.draft):
            if lm is not None and lm.reuse_prefix and len(head) < min(len(prompt) - 1, lm.max_length):
                lm.prefill(head)

    def adopt_plan(self, other: "Synthesizer") -> None:
        """Plan draft lengths with the step costs `other` (a copy of these models on this machine,
        e.g. another server worker) measured, instead of this one's own measurement: seeded
        utterances then give the same audio on both."""
        for mine, theirs in ((self.draft, other.draft), (self.eagle, other.eagle), (self.heads, other.heads)):
            if mine is not None and theirs is not None:
                adopt_costs(self.target, mine, other.target, theirs)
        self._acceptance.update(other._acceptance)

    def proposer(self, policy: str):
        """What proposes from the target's hidden states for `policy` (None for the other policies)."""
        return self.eagle if policy in EAGLE_POLICIES else self.heads

    # -- voices --------------------------------------------------------------------------

    def voice_from_audio(self, path: str | Path, text: str) -> Voice:
        """Encode a reference recording once; later calls with the same file and text reuse it."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"reference audio not found: {path}")
        key = (str(path.resolve()), path.stat().st_mtime_ns, text)
        if key not in self._voices:
            self._voices[key] = Voice.from_audio(path, text, self.reference_encoder())
        return self._voices[key]

    def reference_encoder(self):
        """The codec that encodes reference recordings into voices: the loaded one when it can encode,
        else the checkpoint with its encoder (an exported decoder: the one it was exported from),
        loaded once on first use. Raises ValueError when no encoder can be found."""
        return self.codec if self.codec.can_encode else self._encoder()

    def _encoder(self):
        """The codec with its encoder, loaded once on first use from the decoder's own folder (an
        exported decoder: the checkpoint it was exported from, if it is still there)."""
        from pcgtts.runtime.audio.codec import Codec
        from pcgtts.runtime.audio.onnx_codec import is_exported_codec

        if self._full_codec is None:
            folder = getattr(self.codec, "checkpoint_dir", None) or self.codec.source_dir
            if is_exported_codec(folder):
                self.codec.encode(np.zeros(0, np.float32))  # raises the exported codec's clear error
            self._full_codec = Codec.from_pretrained(folder, device="cpu", decode_only=False)
        return self._full_codec

    def _resolve_voice(self, voice, ref_audio, ref_text) -> Voice | None:
        if voice is not None and ref_audio is not None:
            raise ValueError("give either voice= or ref_audio=, not both")
        if isinstance(voice, (str, Path)):
            voice = Voice.load(voice)
        if ref_audio is not None:
            if not ref_text:
                raise ValueError("ref_audio needs ref_text: the transcript of the reference recording")
            voice = self.voice_from_audio(ref_audio, ref_text)
        if voice is not None:
            check_voice_fits(voice, self.target.vocab.num_speech)
        return voice

    # -- synthesis -----------------------------------------------------------------------

    def stream(self, text: str, ref_audio: str | Path | None = None, ref_text: str | None = None,
               voice: Voice | str | Path | None = None, config: SynthesisConfig | None = None,
               **settings) -> SynthesisStream:
        """Start synthesising `text`; bad input raises here, before any work starts.

        `text` must be a `str` with something to say; `ref_audio` (a recording) needs `ref_text` (its
        transcript), and `ref_text` needs `ref_audio`; `voice` (a `Voice` or a voice file) replaces
        both. `config` replaces this Synthesizer's settings for the call, and `settings` change single
        ones by name (`seed=7`, `temperature=0.6`, `policy="sd"`: any field of `SynthesisConfig`, at
        any depth; None leaves one as it is), each checked by the config dataclasses. A wrong type is
        a TypeError naming the argument, a wrong value a ValueError naming it.

        One stream at a time: a stream of this Synthesizer that is still held but not being read (its
        caller kept it and moved on) is cancelled by the next `stream()`, which logs a warning, and
        reading the cancelled one raises RuntimeError; while another thread is reading one (it read
        within the last `run_ahead_s` seconds), the new call raises RuntimeError instead. A stream
        nobody reads runs ahead by `SynthesisConfig.run_ahead_s` seconds of audio, then waits without
        using the CPU."""
        check_stream_arguments(text, ref_audio, ref_text, voice, config)
        config = call_config(config or self.config, settings)
        check_policy(config.decode.policy, draft=self.draft is not None, groups=self.groups is not None,
                     heads=self.heads is not None,
                     transitions=self.heads is not None and self.heads.transitions is not None,
                     eagle=self.eagle is not None, greedy=config.decode.sampling.greedy)
        resolved = self._resolve_voice(voice, ref_audio, ref_text)
        if config.spell_numbers:
            text = spell_numbers(text)
        self._warn_foreign_script(text)
        prompts, budgets = self._fit(split_sentences(text, config.max_sentence_chars), resolved, config)
        self._cancel_unread_stream()
        job = _Job(self, prompts, budgets, config)
        self._current = weakref.ref(job)
        return SynthesisStream(job)

    def _warn_foreign_script(self, text: str) -> None:
        """One warning when `text` is mostly in a script this voice was not trained on (`scripts`)."""
        script = foreign_script(text, self.scripts) if self.scripts is not None else None
        if script is not None:
            log.warning("the text is mostly in %s script, which this voice was not trained on (it reads %s): "
                        "expect noise, not speech", script, " and ".join(self.scripts))

    def _cancel_unread_stream(self) -> None:
        """Cancel the stream holding this Synthesizer if nobody is reading it (its caller kept it and
        moved on); one that another thread reads (`_Job.read_elsewhere`) keeps it, and the new stream
        is refused."""
        held = self._current() if self._current is not None else None
        if held is not None and held.supersede():
            log.warning("cancelled the earlier stream of this Synthesizer, which was not being read, to start "
                        "a new one")

    def _fit(self, pieces: list[str], voice: Voice | None, config: SynthesisConfig) -> tuple[list, list[int]]:
        """Prompts and token budgets, splitting any piece whose prompt + budget would overflow the
        KV cache (so a sentence is never cut by the cache for being long)."""
        models = [lm for lm in (self.target, self.draft) if lm is not None]
        capacity = min(lm.max_length for lm in models) - config.decode.draft_length - 2
        codes = torch.as_tensor(voice.codes) if voice is not None else None
        prompts, budgets = [], []
        todo = list(pieces)
        while todo:
            piece = todo.pop(0)
            prompt = build_prompt(self.tokenizer, self.target.vocab, piece, voice.text if voice else None, codes)
            budget = config.token_budget(piece)
            if len(prompt) + budget <= capacity:
                prompts.append(prompt)
                budgets.append(budget)
            elif len(piece) > 20:
                todo[:0] = split_sentences(piece, max(20, len(piece) // 2))
            else:
                raise ValueError(f"the prompt ({len(prompt)} tokens, with the reference voice's codes) leaves no "
                                 f"room in the KV cache of {capacity} tokens; use a shorter reference or raise "
                                 f"max_length")
        return prompts, budgets

    def synthesize(self, text: str, **kwargs) -> np.ndarray:
        """The whole waveform (float32, 16 kHz), by consuming `stream` (same arguments, same checks)."""
        with self.stream(text, **kwargs) as chunks:
            parts = [c.samples for c in chunks]
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)

    def release(self) -> None:
        """Free both models' KV caches (reallocated by the next stream)."""
        for lm in (self.target, self.draft):
            if lm is not None:
                lm.release()

    def _produce(self, job: _Job) -> None:
        """The worker thread: decode each sentence and push its audio through the window decoder."""
        prompts, budgets, config, stats, put = job.prompts, job.budgets, job.config, job.stats, job.put
        try:
            device = self.target.device
            generator = torch.Generator(device=device)
            # torch.seed() would reseed the global RNG; a fresh seed comes from the OS instead.
            generator.manual_seed(config.seed if config.seed is not None else secrets.randbits(63))
            # A seeded stream plans its draft lengths with the costs measured at load, unchanged (not
            # refined by its own timings), so its utterances repeat within this process.
            costs = self.plan(config) if config.seed is not None else None
            acceptance = self.starting_acceptance(config.decode)
            # A cloned voice's reference codes end every prompt: they are the first chunk's left
            # context, as in a one-shot decode of reference + speech.
            context = self.target.vocab.prompt_codes(prompts[0]).numpy() if prompts else None
            window = WindowDecoder(self.codec.decode, config.stream, context=context)
            done = 0  # samples handed out so far

            def emit(samples: np.ndarray, last: bool) -> bool:
                nonlocal done
                start = done
                done += len(samples)
                return put(AudioChunk(samples.astype(np.float32, copy=False), SAMPLE_RATE,
                                      start // SAMPLES_PER_TOKEN, done // SAMPLES_PER_TOKEN,
                                      time.perf_counter(), last, stats.truncated))

            codec = CodecThread(window, emit) if config.stream.codec_thread else _SameThread(window, emit)
            # The LM waits while the next full chunk would not fit the run-ahead, so tokens do not pile up
            # on the codec's side of it either.
            chunk_samples = config.stream.chunk_tokens * SAMPLES_PER_TOKEN
            try:
                for prompt, budget in zip(prompts, budgets):
                    sentence = DecodeStats()
                    stats.sentences.append(sentence)
                    decode_config = replace(config.decode, max_new_tokens=budget)
                    for burst in decode(self.target, self.draft, prompt, decode_config, generator, self.groups,
                                        sentence, costs=costs, proposer=self.proposer(decode_config.policy),
                                        acceptance=acceptance):
                        if not codec.push(burst) or not job.await_room(chunk_samples):  # run-ahead full: wait
                            return
                    if sentence.finish in ("max_tokens", "cache_full"):
                        stats.truncated += 1
                        why = (f"its budget of {budget} tokens" if sentence.finish == "max_tokens"
                               else "the end of the KV cache")
                        log.warning("sentence %d reached %s without the stop token; cut there",
                                    len(stats.sentences), why)
                if codec.finish():
                    put(_END)
            finally:
                codec.close()
                job.worker_exits()
        except BaseException as err:  # surfaced to the consumer's thread
            put(err)


def check_stream_arguments(text, ref_audio, ref_text, voice, config) -> None:
    """`stream()`'s arguments, checked by type and pairing before any work (TypeError / ValueError
    naming the argument)."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    if ref_audio is not None and not isinstance(ref_audio, (str, Path)):
        raise TypeError(f"ref_audio must be a path (str or Path), got {type(ref_audio).__name__}")
    if ref_text is not None and not isinstance(ref_text, str):
        raise TypeError(f"ref_text must be a str, got {type(ref_text).__name__}")
    if ref_text is not None and ref_audio is None:
        raise ValueError("ref_text is the transcript of ref_audio: give ref_audio too (or a voice=)")
    if voice is not None and not isinstance(voice, (Voice, str, Path)):
        raise TypeError(f"voice must be a Voice or a voice file path, got {type(voice).__name__}")
    if config is not None and not isinstance(config, SynthesisConfig):
        raise TypeError(f"config must be a SynthesisConfig, got {type(config).__name__}")
    check_text(text)  # something to say (before a reference recording is encoded)


def call_config(base: SynthesisConfig, settings: dict) -> SynthesisConfig:
    """`base` with per-call settings given by name (`seed=7`, `temperature=0.6`; None: as in `base`),
    built through the config dataclasses, which check every value; before that, an unknown name or a
    value of the wrong type is a TypeError naming it, and a setting fixed when the models load a
    ValueError."""
    given = {name: value for name, value in settings.items() if value is not None}
    if not given:
        return base
    settings_now = Settings(synthesis=base)
    for name, value in given.items():
        path = KEYS.get(name)
        if path is None or path[0] != "synthesis":
            if path is not None:
                raise ValueError(f"{name} is fixed when the models load: give it to Synthesizer.from_pretrained")
            per_call = ", ".join(sorted(key for key, where in KEYS.items() if where[0] == "synthesis"))
            raise TypeError(f"unexpected keyword argument {name!r}; the per-call settings are {per_call}")
        check_setting_type(name, value, settings_now)
    return resolve_settings(given, base=settings_now).synthesis


def check_setting_type(name: str, value, settings: Settings) -> None:
    """TypeError naming `name` unless `value` has the type its config dataclass field declares (an
    int is a float; a bool is no number)."""
    owner = settings
    for attr in KEYS[name][:-1]:
        owner = getattr(owner, attr)
    declared = typing.get_type_hints(type(owner))[name]
    allowed = [t for t in typing.get_args(declared) or (declared,) if t is not type(None)]
    if not any(_has_type(value, t) for t in allowed):
        expected = " or ".join(t.__name__ for t in allowed)
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__}")


def _has_type(value, kind: type) -> bool:
    if kind in (int, float) and isinstance(value, bool):
        return False
    return isinstance(value, (int, float)) if kind is float else isinstance(value, kind)


def check_voice_fits(voice: Voice, num_speech: int) -> None:
    """A voice's codes must be speech tokens of the loaded model (a voice made for a model with a larger
    codebook is refused before any work)."""
    highest = int(np.asarray(voice.codes).max())
    if highest >= num_speech:
        raise ValueError(f"the voice holds codec token {highest}, beyond this model's {num_speech} speech tokens "
                         f"(it was made for another model)")


def check_scripts(scripts) -> tuple[str, ...] | None:
    """`Synthesizer`'s `scripts`: None, or a non-empty tuple of script names (TypeError otherwise)."""
    if scripts is None:
        return None
    if isinstance(scripts, str) or not isinstance(scripts, (tuple, list)) or not scripts \
            or not all(isinstance(name, str) and name for name in scripts):
        raise TypeError(f"scripts must be a tuple of script names such as ('Latin',), got {scripts!r}")
    return tuple(scripts)


def voice_scripts(target: str | Path | None) -> tuple[str, ...] | None:
    """The scripts the voice of `target` reads, as settings name it before the built-in voice fills in:
    the built-in voice's (no target), else None (a named checkpoint's training is not known here)."""
    return BUILTIN_VOICE_SCRIPTS if target is None else None


def check_models(models: ModelPaths, decode: DecodeConfig, device: DeviceConfig) -> None:
    """Fail fast, before anything loads: paths exist, and the policy has the models (and backend) it needs."""
    policy = decode.policy
    if device.compile:
        if decode.steps_per_sync:
            raise ValueError("compile compiles the host loop's steps, which steps_per_sync replaces by whole steps "
                             "on the device: compile those with compile_steps, or set steps_per_sync = 0")
        from pcgtts.runtime.lm.torch_lm import check_compiler

        check_compiler()
    if decode.steps_per_sync and device.backend != "torch":
        raise ValueError(f"steps_per_sync (whole steps on the device) runs on the torch backend, not "
                         f"{device.backend!r}: set backend = \"torch\" or steps_per_sync = 0")
    if models.codec is None:
        raise ValueError("a codec directory (X-codec2, Hugging Face format) is required")
    for name in ("target", "draft", "codec"):
        path = getattr(models, name)
        if path is not None and not Path(path).is_dir():
            raise ValueError(f"{name} model directory not found: {path}")
    for name in ("groups", "heads", "transitions", "eagle"):
        path = getattr(models, name)
        if path is not None and not Path(path).is_file():
            raise ValueError(f"{name} file not found: {path}")
    heads, transitions, eagle = check_proposers(models, policy, device.backend)
    check_policy(policy, draft=models.draft is not None, groups=models.groups is not None,
                 heads=heads is not None, transitions=transitions is not None, eagle=eagle is not None)
    check_compute_device(device.compute_device)


def check_proposers(models: ModelPaths, policy: str, backend: str) -> tuple:
    """The heads, transitions and EAGLE draft (files, or graphs exported with the target) `policy`
    would use on `backend`, or a clear error; before any model loads. onnxruntime runs the mtp-* and
    eagle-* policies with the proposers exported beside the target (`pcgtts export onnx`)."""
    heads, transitions, eagle = proposer_files(models)
    if backend == "onnxruntime" and models.target is not None:
        for given, flag in ((models.eagle, "--eagle"), (models.heads, "--heads")):
            if given is not None:
                raise ValueError(f"the onnxruntime backend runs the proposers exported with the target; export "
                                 f"them with `pcgtts export onnx --model CHECKPOINT {flag} FILE` instead of {flag}")
        exported = exported_proposers(models.target)
        heads, eagle = exported.get("heads"), exported.get("eagle")
        needed = "eagle" if policy in EAGLE_POLICIES else "heads" if policy in STATE_POLICIES else None
        if needed is not None and needed not in exported:
            what = {"eagle": "EAGLE draft", "heads": "multi-token heads"}[needed]
            raise ValueError(f"policy {policy!r} on onnxruntime needs the {what} exported with the target: "
                             f"`pcgtts export onnx --model CHECKPOINT --{needed} FILE --out {models.target}`")
    elif policy in STATE_POLICIES and backend != "torch":
        raise ValueError(f"policy {policy!r} runs on the torch and onnxruntime backends only "
                         f"(it reads the target's hidden states)")
    return heads, transitions, eagle


def check_policy(policy: str, *, draft: bool, groups: bool, heads: bool, transitions: bool, eagle: bool = False,
                 greedy: bool = False) -> None:
    """The models a policy needs (greedy decoding never consults a group table)."""
    if policy in EAGLE_POLICIES:
        if not eagle:
            raise ValueError(f"policy {policy!r} needs the target's EAGLE draft "
                             f"(train it with `pcgtts train eagle`, or give --eagle)")
    elif policy in STATE_POLICIES:
        if not heads:
            raise ValueError(f"policy {policy!r} needs the target's multi-token heads "
                             f"(train them with `pcgtts train heads`, or give --heads)")
        if policy == "mtp-viterbi" and not transitions:
            raise ValueError("policy 'mtp-viterbi' needs a code transition table (`pcgtts train transitions`)")
    elif policy != "ar" and not draft:
        raise ValueError(f"policy {policy!r} needs a draft model (or use policy='ar')")
    if policy in PCG_POLICIES and not groups and not greedy:
        raise ValueError(f"policy {policy!r} needs a group table (build one with `pcgtts groups build`)")


def exported_proposers(target_dir: str | Path) -> dict[str, str]:
    """The proposer graphs ("eagle", "heads") exported with an onnxruntime target, from its
    pcgtts-lm.json, read before any model loads."""
    from pcgtts.runtime.lm.graph_meta import peek_record

    extra = (peek_record(target_dir) or {}).get("extra", {})  # a corrupt file: the loader reports it
    return {kind: extra[kind]["graph"] for kind in ("eagle", "heads") if kind in extra}


def proposer_files(models: ModelPaths) -> tuple[Path | None, Path | None, Path | None]:
    """The heads, transition and EAGLE draft files in use: explicit paths, else found next to the target."""
    from pcgtts.runtime.lm.eagle import EAGLE_FILE
    from pcgtts.runtime.lm.heads import HEADS_FILE, TRANSITIONS_FILE

    found = []
    for explicit, name in ((models.heads, HEADS_FILE), (models.transitions, TRANSITIONS_FILE), (models.eagle, EAGLE_FILE)):
        default = Path(models.target) / name if models.target is not None else None
        found.append(Path(explicit) if explicit is not None else default if default and default.is_file() else None)
    return found[0], found[1], found[2]


def _load_heads(heads_file: Path | None, transitions_file: Path | None, target_lm):
    """The target's multi-token heads (with the transition table when there is one), or None."""
    from pcgtts.runtime.decode.transitions import TransitionTable
    from pcgtts.runtime.decode.multi_token import HeadProposer

    transitions = TransitionTable.load(transitions_file) if transitions_file is not None else None
    if hasattr(target_lm, "heads_step"):  # onnxruntime: the heads' graph was exported with the target
        return HeadProposer(target_lm.heads_step(), transitions) if target_lm.has_heads else None
    if heads_file is None or not hasattr(target_lm, "forward_hidden"):
        return None
    from pcgtts.runtime.lm.heads import MTPHeads

    model = target_lm.model
    heads = MTPHeads.load(heads_file, fingerprint=target_lm.fingerprint, hidden_size=model.head.in_features,
                          device=target_lm.device, dtype=model.dtype)
    return HeadProposer.from_heads(heads, target_lm, transitions)


def _load_eagle(eagle_file: Path | None, target_lm):
    """The target's EAGLE draft bound to it, or None."""
    from pcgtts.runtime.decode.multi_token import EagleProposer

    if hasattr(target_lm, "eagle_step"):  # onnxruntime: the draft's graph was exported with the target
        return EagleProposer.for_target(target_lm) if target_lm.has_eagle else None
    if eagle_file is None or not hasattr(target_lm, "forward_hidden"):
        return None
    return EagleProposer.for_target(target_lm, eagle_file)
