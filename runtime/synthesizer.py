"""`Synthesizer`: text (+ a voice) in, a real-time stream of `AudioChunk`s out.

    synth = Synthesizer.from_pretrained(target=..., draft=..., codec=..., groups=...)
    with open_sink(None) as sink:                    # runtime/audio/playback.py: the default device
        for chunk in synth.stream("Hello there.", ref_audio="me.wav", ref_text="What I said."):
            sink.write(chunk)

Generation runs ahead of the consumer on a worker thread, by at most `SynthesisConfig.run_ahead_s`
seconds of audio, then waits without using the CPU until the consumer reads on: the worker
splits the text into sentences, builds each prompt, runs the decode loop
(`runtime/decode/loop.py`, on the worker of `runtime/stream_worker.py`) and pushes accepted tokens through the windowed codec decoder
(`runtime/audio/streaming.py`). All sentences share one window decoder, so the audio is one
continuous stream. Closing the stream early stops the worker and frees the KV caches. With
`max_batch` > 1 (`DeviceConfig`), up to that many streams run at once over the one model copy, each in a
slot of a batch (`runtime/decode/batch.py`; `batch_streams`), and one more raises `BatchFull` at once.
Otherwise, and for settings a batch does not run, one stream at a time per Synthesizer: starting a
stream while an earlier one is held but not being read cancels the earlier one; while another thread is reading one (inside `next()`, or it read within the
last `run_ahead_s` seconds), a second is refused at once with a one-line RuntimeError.
Per-call settings (`seed=`, `temperature=`, `policy=`, ... any field of `SynthesisConfig`) are
checked by the config dataclasses, like every other argument, before any work starts.
"""


from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from pcgtts.groups.device import DeviceGroupTable
from pcgtts.runtime.audio.codec import SpeechCodec
from pcgtts.runtime.audio.codec_batch import CodecBatcher
from pcgtts.runtime.audio.presets import Presets, PresetVoice
from pcgtts.runtime.audio.transform import VoiceTransform
from pcgtts.runtime.audio.voice import Voice
from pcgtts.runtime.checks import (call_config, check_scripts, check_stream_arguments, check_voice_fits,
                                   voice_scripts)
from pcgtts.runtime.config import (DecodeConfig, DeviceConfig, ModelPaths, Settings, SynthesisConfig, check_policy,
                                   preset_folder, resolve_settings)
from pcgtts.runtime.loading import LazyTarget, load_models
from pcgtts.runtime.decode.batch import BatchDecoder, BatchFull, check_batchable
from pcgtts.runtime.decode.policy import Proposer, policy_named
from pcgtts.runtime.decode.policy import policy as policy_spec
from pcgtts.runtime.lm.batched import BatchedLM, check_batch_backend, runs_batched
from pcgtts.runtime.lm.protocol import LM
from pcgtts.runtime.planner import DraftLengthPlanner
from pcgtts.runtime.stream_worker import EmptySynthesis, StreamJob, StreamStats, SynthesisStream
from pcgtts.runtime.text.numbers import spell_numbers
from pcgtts.runtime.text.prompt import build_prompt
from pcgtts.runtime.text.script import foreign_script
from pcgtts.runtime.text.split import split_sentences

log = logging.getLogger(__name__)


def serving_policy(policy: str, *, draft: bool, heads: bool, eagle: bool) -> str:
    """`policy`, or where it proposes from the target's states and no such proposer serves the target
    at hand (`heads`, `eagle`: whether one does), the draft LM's policy with its rule when there is one
    (eagle-pcg -> pcg), else plain decoding ("ar")."""
    spec = policy_spec(policy)
    if not spec.reads_states or (eagle if spec.uses_eagle else heads):
        return policy
    if draft:
        try:
            return policy_named(Proposer.DRAFT, spec.rule).name
        except ValueError:  # a rule only the heads run (strict, topm, threshold)
            pass
    return "ar"


class Route:
    """What one stream decodes with: a target LM and the planner of its draft lengths, which holds the
    proposers on that target's states (`Synthesizer.route`)."""

    def __init__(self, target: LM, planner: DraftLengthPlanner):
        self.target, self.planner = target, planner
        self._fell_back: set[str] = set()  # policies whose fallback was logged

    def serving(self, decode: DecodeConfig) -> DecodeConfig:
        """`decode` at a policy this route serves (`serving_policy`); a fallback is logged once a policy."""
        planner = self.planner
        policy = serving_policy(decode.policy, draft=planner.draft is not None, heads=planner.heads is not None,
                                eagle=planner.eagle is not None)
        if policy == decode.policy:
            return decode
        if decode.policy not in self._fell_back:
            self._fell_back.add(decode.policy)
            log.warning("policy %s proposes from the target's hidden states, which no proposer reads on the clone "
                        "target: voices with a reference decode at %s (exact either way)", decode.policy, policy)
        return replace(decode, policy=policy)


class Synthesizer:
    def __init__(self, target: LM, draft: LM | None, codec: SpeechCodec, groups: DeviceGroupTable | None = None,
                 config: SynthesisConfig = SynthesisConfig(), heads=None, eagle=None,
                 scripts: tuple[str, ...] | None = None, presets: Presets | None = None,
                 clone_codec: SpeechCodec | None = None, clone_target: LazyTarget | None = None):
        # codec: decode-only is enough unless reference audio is given (the encoder is then loaded
        # from codec.source_dir); groups on the target's device, or None (pcg then unavailable);
        # heads: the target's multi-token heads (a proposers.HeadProposer) for the mtp-* policies;
        # eagle: its EAGLE draft (a proposers.EagleProposer) for the eagle-* policies;
        # scripts: the writing systems the voice was trained on (("Latin",), ("Latin", "CJK"): the
        # first word of a letter's Unicode name); text mostly in another logs a warning. None: not
        # known, nothing checked. presets: the named voices shipped with the target (`voice="NAME"`).
        # clone_codec: the decoder of speech prompted with a reference voice (a preset, a cloned voice,
        # ref_audio); None: `codec` decodes every voice. References are encoded by `codec`'s encoder.
        # clone_target: the target LM that speaks those voices, loaded on the first (`route`); None:
        # `target` speaks every voice.
        if draft is not None:
            target.vocab.check_same_layout(draft.vocab)
        self.target, self.draft, self.codec, self.groups, self.heads = target, draft, codec, groups, heads
        self.eagle, self.clone_codec, self.clone_target = eagle, clone_codec, clone_target
        self.presets = presets if presets is not None else Presets()
        self.scripts = check_scripts(scripts)
        self.tokenizer = target.tokenizer
        self.config = config
        self.planner = DraftLengthPlanner(target, draft, groups, heads, eagle)  # draft lengths, warm caches
        self._routes: dict[bool, Route] = {False: Route(target, self.planner)}  # by reference codes or not
        self._route_lock = threading.Lock()
        self.stream_lock = threading.Lock()  # held by the one stream running (`StreamJob`)
        self.batch: BatchDecoder | None = None  # plain streams decoded together (`batch_streams`)
        self.codec_batcher: CodecBatcher | None = None  # and their codec windows (`batch_streams`)
        self._current: weakref.ref | None = None  # the job holding the lock, if any
        self._voices: dict[tuple, Voice] = {}
        self._full_codec = None  # the codec with its encoder, for reference audio

    @classmethod
    def from_pretrained(cls, target: str | Path | None = None, draft: str | Path | None = None,
                        codec: str | Path | None = None, groups: str | Path | None = None, *,
                        config: SynthesisConfig | None = None, config_file: str | Path | None = None,
                        force_export: bool = False, **settings) -> "Synthesizer":
        """Load the models named (a `target` or `prepared=` folder, here or in `config_file`) from local
        folders; `pcgtts.Synthesizer.from_pretrained()`, the package's front, is this with the built-in
        voice when none is named.

        Any setting of `runtime/config.py` may be given by name (`policy="sd"`, `temperature=0.6`,
        `compute_device="cuda"`, `draft_length=4`, ...); precedence is keyword > `config_file`
        (TOML) > `config` > default. Everything is validated before a model is loaded.
        """
        named = pretrained_settings(target, draft, codec, groups, config=config, config_file=config_file, **settings)
        if named.models.target is None:
            raise ValueError("no target model given: the runtime's Synthesizer loads the models it is given; "
                             "pcgtts.Synthesizer.from_pretrained() loads the built-in voice")
        return cls.load(named.models, named.device, named.synthesis, force_export=force_export,
                        scripts=voice_scripts(named.models.target))

    @classmethod
    def load(cls, models: ModelPaths, device: DeviceConfig, config: SynthesisConfig,
             force_export: bool = False, scripts: tuple[str, ...] | None = None) -> "Synthesizer":
        """Load resolved settings (`from_pretrained` is the convenient front of this); `scripts`: what
        the voice reads (`voice_scripts` of the target named before the built-in voice filled in).
        The adaptive draft length is planned and the shared prompt head prefilled before it returns."""
        check_scripts(scripts)
        if device.max_batch > 1:
            check_batch_backend(device.backend, models.target)
        loaded = load_models(models, device, config, force_export)
        synth = cls(loaded.target, loaded.draft, loaded.codec, loaded.groups, config, loaded.heads, loaded.eagle,
                    scripts, Presets.load(preset_folder(models)), loaded.clone_codec, loaded.clone_target)
        synth.planner.plan(config.decode)
        synth.planner.warm_prefix()
        synth.batch_streams(device.max_batch)
        return synth

    # -- voices --------------------------------------------------------------------------

    def voices(self) -> list[dict]:
        """The preset voices (name, description, whether it is the default) and their aliases (`alias_of`)."""
        return self.presets.listing()

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

    def _resolve_voice(self, voice, ref_audio, ref_text) -> tuple[Voice | None, VoiceTransform | None]:
        """The voice prompt a call speaks with (None: the model's own voice) and its audio transform."""
        if voice is not None and ref_audio is not None:
            raise ValueError("give either voice= or ref_audio=, not both")
        if isinstance(voice, (str, Path)):  # "default", a voice file, or a preset's name
            voice = self.presets.find(voice, "give the recording as ref_audio= with ref_text=, or make a voice "
                                             "of it with voice_from_audio()")
        transform = None
        if isinstance(voice, PresetVoice):
            voice, transform = voice.prompt, voice.transform
        if ref_audio is not None:
            if not ref_text:
                raise ValueError("ref_audio needs ref_text: the transcript of the reference recording")
            voice = self.voice_from_audio(ref_audio, ref_text)
        if voice is not None:
            check_voice_fits(voice, self.target.vocab.num_speech)
        return voice, transform

    # -- synthesis -----------------------------------------------------------------------

    def stream(self, text: str, ref_audio: str | Path | None = None, ref_text: str | None = None,
               voice: Voice | str | Path | None = None, config: SynthesisConfig | None = None,
               **settings) -> SynthesisStream:
        """Start synthesising `text`; bad input raises here, before any work starts.

        `text` must be a `str` with something to say; `ref_audio` (a recording) needs `ref_text` (its
        transcript), and `ref_text` needs `ref_audio`; `voice` replaces both: a `Voice`, a voice file, or
        the name of a preset (`voices()` lists them; an existing path is a file, any other string a
        name, and an unknown name is a ValueError listing the names; "default" is the target's own voice). No voice: the target's own voice. `config` replaces this Synthesizer's settings for the call, and `settings` change single
        ones by name (`seed=7`, `temperature=0.6`, `policy="sd"`: any field of `SynthesisConfig`, at
        any depth; None leaves one as it is), each checked by the config dataclasses. A wrong type is
        a TypeError naming the argument, a wrong value a ValueError naming it.

        One stream at a time: a stream of this Synthesizer that is still held but not being read (its
        caller kept it and moved on) is cancelled by the next `stream()`, which logs a warning, and
        reading the cancelled one raises RuntimeError; while another thread is reading one (it read
        within the last `run_ahead_s` seconds), the new call raises RuntimeError instead. A stream
        nobody reads runs ahead by `SynthesisConfig.run_ahead_s` seconds of audio, then waits without
        using the CPU. Iterating a stream whose text the model makes no speech for (it ends every
        sentence before its first speech token) raises `EmptySynthesis` instead of ending empty."""
        check_stream_arguments(text, ref_audio, ref_text, voice, config)
        config = call_config(config or self.config, settings)
        check_policy(config.decode.policy, draft=self.draft is not None, groups=self.groups is not None,
                     heads=self.heads is not None,
                     transitions=self.heads is not None and self.heads.transitions is not None,
                     eagle=self.eagle is not None, greedy=config.decode.sampling.greedy)
        resolved, transform = self._resolve_voice(voice, ref_audio, ref_text)
        if config.spell_numbers:
            text = spell_numbers(text)
        self._warn_foreign_script(text)
        prompts, budgets, minimums = self._fit(split_sentences(text, config.max_sentence_chars), resolved, config)
        seat = self._batch_slot(config, resolved)  # `BatchFull` at once when every slot streams
        if seat is not None:
            return SynthesisStream(StreamJob(self, prompts, budgets, config, minimums, transform=transform,
                                             seat=seat))
        self._cancel_unread_stream()
        job = StreamJob(self, prompts, budgets, config, minimums, transform=transform)
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
        moved on); one that another thread reads (`StreamJob.read_elsewhere`) keeps it, and the new stream
        is refused."""
        held = self._current() if self._current is not None else None
        if held is not None and held.supersede():
            log.warning("cancelled the earlier stream of this Synthesizer, which was not being read, to start "
                        "a new one")

    def batch_streams(self, slots: int) -> None:
        """Decode up to `slots` streams at once (`runtime/decode/batch.py`): each in a KV slot of its own
        over this target's weights (torch backend; and the draft's, when it runs on torch too), their
        forwards run together; the next one is refused at once (`BatchFull`, a RuntimeError). Every
        policy the host loop runs batches, at a fixed or an adaptive draft length (a draft LM's where
        the draft runs on torch too; the heads' and the EAGLE draft's with a fork of the proposer per
        slot); whole steps on the device (`steps_per_sync`), a draft's policy without a torch draft,
        and a voice a clone target speaks run on the Synthesizer's one lane as before. The batch's
        streams have their codec windows decoded together too (`CodecBatcher`,
        runtime/audio/codec_batch.py). 1: one stream at a time."""
        if self.batch is not None and self.batch.seated:
            raise RuntimeError("streams are decoding in the batch: close them before resizing it")
        if slots == 1:
            self.batch = self.codec_batcher = None
            return
        draft = BatchedLM(self.draft, slots) if self.draft is not None and runs_batched(self.draft) else None
        self.batch = BatchDecoder(BatchedLM(self.target, slots), draft=draft, groups=self.groups)
        self.codec_batcher = CodecBatcher()
        self.route(False).planner.warm_batch(self.batch)

    def _batch_slot(self, config: SynthesisConfig, voice: Voice | None):
        """A batch slot for a stream the batch decodes (`check_batchable`, spoken by the target), else None."""
        if self.batch is None or voice is not None and self.clone_target is not None:
            return None
        try:
            check_batchable(config.decode, draft=self.batch.draft is not None)
        except ValueError:
            return None
        return self.batch.seat()

    def _fit(self, pieces: list[str], voice: Voice | None,
             config: SynthesisConfig) -> tuple[list, list[int], list[int]]:
        """Prompts, token budgets and minimum lengths (`SynthesisConfig.token_minimum`), splitting any
        piece whose prompt + budget would overflow the KV cache (so a sentence is never cut by the
        cache for being long)."""
        models = [lm for lm in (self.target, self.draft) if lm is not None]
        capacity = min(lm.max_length for lm in models) - config.decode.draft_length - 2
        codes = torch.as_tensor(voice.codes) if voice is not None else None
        prompts, budgets, minimums = [], [], []
        todo = list(pieces)
        while todo:
            piece = todo.pop(0)
            prompt = build_prompt(self.tokenizer, self.target.vocab, piece, voice.text if voice else None, codes)
            budget = config.token_budget(piece)
            if len(prompt) + budget <= capacity:
                prompts.append(prompt)
                budgets.append(budget)
                minimums.append(config.token_minimum(piece))
            elif len(piece) > 20:
                todo[:0] = split_sentences(piece, max(20, len(piece) // 2))
            else:
                raise ValueError(f"the prompt ({len(prompt)} tokens, with the reference voice's codes) leaves no "
                                 f"room in the KV cache of {capacity} tokens; use a shorter reference or raise "
                                 f"max_length")
        return prompts, budgets, minimums

    def synthesize(self, text: str, **kwargs) -> np.ndarray:
        """The whole waveform (float32, 16 kHz), by consuming `stream` (same arguments, same checks).
        Raises `EmptySynthesis` when the model makes no speech for the text (it ends at once)."""
        with self.stream(text, **kwargs) as chunks:
            parts = [c.samples for c in chunks]
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)

    def route(self, reference: bool) -> Route:
        """What a stream decodes with: for a prompt that ends in reference codes (a preset, a cloned
        voice, a voice file, ref_audio) the clone target, where this Synthesizer has one: loaded, its
        draft lengths planned and its prompt head prefilled on the first such stream, once (its own
        caches and planner; the draft LM is shared); otherwise, and without one, the target."""
        if not reference or self.clone_target is None:
            return self._routes[False]
        with self._route_lock:
            if True not in self._routes:
                models = self.clone_target.get()
                if self.draft is not None:
                    models.target.vocab.check_same_layout(self.draft.vocab, "clone target", "draft")
                planner = DraftLengthPlanner(models.target, self.draft, self.groups, models.heads, models.eagle)
                route = Route(models.target, planner)
                planner.plan(route.serving(self.config.decode))
                planner.warm_prefix()
                self._routes[True] = route
        return self._routes[True]

    def release(self) -> None:
        """Free the models' KV caches (reallocated by the next stream)."""
        for lm in (self.target, self.draft):
            if lm is not None:
                lm.release()
        if self.batch is not None:
            self.batch.release()  # once no stream holds a slot
        if self.clone_target is not None:
            self.clone_target.release()


def pretrained_settings(target: str | Path | None = None, draft: str | Path | None = None,
                        codec: str | Path | None = None, groups: str | Path | None = None, *,
                        config: SynthesisConfig | None = None, config_file: str | Path | None = None,
                        voice: dict | None = None, **settings) -> Settings:
    """The settings `from_pretrained`'s arguments name, checked (a prepared folder resolved into its
    models; no target is filled in): keyword > `config_file` > `config` > `voice` (the settings of the
    voice used when no target or prepared folder is named) > default."""
    if config is not None and config_file is not None:
        raise ValueError("give either config= or config_file=, not both")
    explicit = {"target": target, "draft": draft, "codec": codec, "groups": groups, **settings}
    return resolve_settings(explicit, config_file, Settings(synthesis=config or SynthesisConfig()), voice=voice)


__all__ = ["BatchFull", "EmptySynthesis", "StreamStats", "SynthesisStream", "Synthesizer", "pretrained_settings"]
