"""Every setting as a frozen, validated dataclass, and the one function that resolves them.

    Settings
      models     ModelPaths       target, draft, codec, clone_codec, clone_target, groups, heads,
                                  transitions, eagle, presets, prepared
      device     DeviceConfig     compute_device, dtype, backend, max_length, quantize, compile, threads,
                                  prefix_cache
      synthesis  SynthesisConfig  seed, max_sentence_chars, spell_numbers, tokens_per_char, min_tokens,
                                  min_tokens_per_char, min_speech_tokens, run_ahead_s, abandon_after_s
        decode   DecodeConfig     policy, draft_length, adaptive_draft, ssd_beta, max_new_tokens, min_new_tokens,
                                  pcg_thinning_trials, mtp_top_m, mtp_threshold, viterbi_top_k, steps_per_sync,
                                  compile_steps
          sampling SamplingConfig temperature, top_p
        stream   StreamConfig     first_chunk_tokens, chunk_tokens, left_context_tokens, codec_lookahead,
                                  first_chunk_lookahead, crossfade_samples, min_speed

`resolve_settings(explicit, config_file)` is where a value is decided, with one precedence order:
an explicit argument (a `from_pretrained` keyword or a CLI flag that was given) > the config file
> the built-in voice's own settings (when no target is named) > the default. Field names are unique across the sections, so a key names one setting wherever it
is written: a TOML config file may use the section tables above (`[decode] policy = "sd"`) or flat
keys. Change a resolved setting with `dataclasses.replace`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from pcgtts.runtime import prepared
from pcgtts.runtime.audio.chunk import SAMPLES_PER_TOKEN
from pcgtts.runtime.decode.cost_model import plans_draft_length
from pcgtts.runtime.decode.policy import POLICY_NAMES, Policy, Proposer, Rule
from pcgtts.runtime.decode.policy import policy as policy_spec
from pcgtts.runtime.decode.policy import names as policy_names

# A decode policy is two typed settings: who proposes and which rule verifies (`decode/policy.py`:
# `Proposer`, `Rule`, `Policy`, the table `POLICIES` of the names). The names, and the names of the
# policies a setting or a model applies to, as the command line, config files and HTTP list them:
POLICIES = POLICY_NAMES
MTP_POLICIES = policy_names(lambda p: p.uses_heads)  # they need the target's multi-token heads
EAGLE_POLICIES = policy_names(lambda p: p.uses_eagle)  # they need an EAGLE draft
PCG_POLICIES = policy_names(lambda p: p.needs_groups)  # they need a group table
DRAFT_LENGTH_POLICIES = policy_names(lambda p: p.speculative)  # they propose: a draft length applies
DEVICE_STEP_POLICIES = policy_names(lambda p: p.runs_on_device_steps)  # what whole steps on the device run
MAX_DRAFT_LENGTH = 16  # the longest draft_length (the device loop sizes its per-position counts by it)
# The ranges every edge (Python API, CLI, HTTP) checks before any work, through these dataclasses.
MAX_SEED = 2**63 - 1  # a torch generator's seed is a signed 64-bit integer
MAX_TEMPERATURE = 10.0  # past this the speech-token distribution is flat noise
MAX_NEW_TOKENS = 60_000  # speech tokens per utterance: 20 minutes of audio
MAX_BATCH = 256  # streams one model copy decodes together at most (`DeviceConfig.max_batch`)


def check_policy(name: str, *, draft: bool, groups: bool, heads: bool, transitions: bool, eagle: bool = False,
                 greedy: bool = False) -> None:
    """The models policy `name` needs, given which are there (greedy decoding never consults a group table):
    the one check of the command line, the loading, `Synthesizer.stream` and the decode loop."""
    spec = policy_spec(name)
    if spec.uses_eagle:
        if not eagle:
            raise ValueError(f"policy {name!r} needs the target's EAGLE draft "
                             f"(train it with `pcgtts train eagle`, or give --eagle)")
    elif spec.uses_heads:
        if not heads:
            raise ValueError(f"policy {name!r} needs the target's multi-token heads "
                             f"(train them with `pcgtts train heads`, or give --heads)")
        if spec.proposer is Proposer.VITERBI and not transitions:
            raise ValueError(f"policy {name!r} needs a code transition table (`pcgtts train transitions`)")
    elif spec.speculative or spec.draft_alone:
        if not draft:
            raise ValueError(f"policy {name!r} needs a draft model (or use policy='ar')")
    if spec.needs_groups and not groups and not greedy:
        raise ValueError(f"policy {name!r} needs a group table (build one with `pcgtts groups build`)")


# auto: the backend an export folder was made for (onnxruntime / tensorrt), torch for a checkpoint;
# the built-in voice on a CPU runs on onnxruntime, exported once on first use (pcgtts/builtin.py)
BACKENDS = ("auto", "torch", "onnxruntime", "tensorrt")
DTYPES = ("float32", "bfloat16", "float16")
QUANTIZE = ("none", "int8")  # int8: the torch backend's int8 linear layers on a CPU (runtime/lm/int8.py);
# for onnxruntime, `pcgtts export onnx --quantize int8` writes an int8 graph (export/onnx_lm.py)


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.8  # LLaSA's recipe; 0 means greedy (argmax) everywhere
    top_p: float = 1.0  # nucleus mass kept; LLaSA uses 1 (no truncation)

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise ValueError(f"temperature must be a number, got {self.temperature!r}")
        if not (0.0 <= self.temperature <= MAX_TEMPERATURE):
            raise ValueError(f"temperature must lie in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)):
            raise ValueError(f"top_p must be a number, got {self.top_p!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def plain(self) -> bool:
        """Sampling at a temperature with no truncation (what a digit-by-digit draw reproduces exactly)."""
        return not self.greedy and self.top_p == 1.0


@dataclass(frozen=True)
class DecodeConfig:
    policy: str = "pcg"  # a name of `POLICIES`: ar | draft | sd | ssd | pcg | mtp-* | eagle-* (`policy_spec` resolves it)
    draft_length: int = 3  # draft tokens proposed per verify step (the paper's L_d); with adaptive_draft, the most
    # adaptive_draft: choose L in 0..draft_length every step from the cost model (runtime/decode/cost_model.py):
    # measured step costs + running per-position acceptance; 0 = a plain target step when speculation cannot win.
    # The costs are measured when the models load. A seeded run repeats within a process; across processes
    # its draft lengths follow that machine's timings, so bit-for-bit repeatable output needs it off.
    adaptive_draft: bool = True
    ssd_beta: float = 0.4  # SSD's tolerance added to min(1, target/draft)
    max_new_tokens: int = 2000  # speech tokens per utterance (40 s of audio)
    # no stop token before this many speech tokens (its probability 0, the rest renormalised, in every
    # policy's target distributions alike); the synthesizer raises it per sentence (min_tokens_per_char)
    min_new_tokens: int = 0
    pcg_thinning_trials: int = 16  # residual-sampler trials drawn at once before the exact fallback
    mtp_top_m: int = 2  # mtp-topm / mtp-viterbi: a proposal passes when among the target's M best (Speech-LLaMA: 2)
    mtp_threshold: float = 0.1  # mtp-threshold: a proposal passes when the target gives it at least this probability
    viterbi_top_k: int = 4  # mtp-viterbi: candidates per head entering the Viterbi search
    # steps_per_sync > 0: whole steps on the device (runtime/decode/device_loop.py; CUDA graphs on a GPU),
    # this many queued between host reads; policies ar/sd/ssd/pcg on the torch backend, a fixed draft length.
    # 0: the host loop (every step's count read back), which every policy and backend runs.
    steps_per_sync: int = 0
    compile_steps: bool = False  # with steps_per_sync: the forwards through torch.compile before capture (GPU)
    sampling: SamplingConfig = SamplingConfig()

    @property
    def policy_spec(self) -> Policy:
        """The policy the name stands for (`decode/policy.py`): its proposer, its rule, what it needs."""
        return policy_spec(self.policy)

    @property
    def proposer(self) -> Proposer:
        """Who proposes: the policy's first half."""
        return self.policy_spec.proposer

    @property
    def rule(self) -> Rule:
        """The rule the proposals are verified by; at temperature 0 every rule that samples verifies
        greedily (`Rule.GREEDY`), so speculative output equals plain greedy decoding."""
        rule = self.policy_spec.rule
        if self.sampling.greedy and rule.becomes_greedy:
            return Rule.GREEDY
        return rule

    @property
    def decodes_with_draft(self) -> bool:
        """The draft-only policy: the draft LM decodes alone."""
        return self.policy_spec.draft_alone

    def __post_init__(self) -> None:
        spec = policy_spec(self.policy)  # an unknown name: the one-line error listing the names
        for name in ("draft_length", "max_new_tokens", "min_new_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if not (1 <= self.draft_length <= MAX_DRAFT_LENGTH):
            raise ValueError(f"draft_length must lie in [1, {MAX_DRAFT_LENGTH}], got {self.draft_length}")
        if not isinstance(self.adaptive_draft, bool):
            raise ValueError(f"adaptive_draft must be true or false, got {self.adaptive_draft!r}")
        if self.ssd_beta < 0:
            raise ValueError(f"ssd_beta must be >= 0, got {self.ssd_beta}")
        if not (1 <= self.max_new_tokens <= MAX_NEW_TOKENS):
            raise ValueError(f"max_new_tokens must lie in [1, {MAX_NEW_TOKENS}], got {self.max_new_tokens}")
        if not (0 <= self.min_new_tokens <= MAX_NEW_TOKENS):
            raise ValueError(f"min_new_tokens must lie in [0, {MAX_NEW_TOKENS}], got {self.min_new_tokens}")
        if self.pcg_thinning_trials < 1:
            raise ValueError(f"pcg_thinning_trials must be >= 1, got {self.pcg_thinning_trials}")
        if self.mtp_top_m < 1 or self.viterbi_top_k < 1:
            raise ValueError(f"mtp_top_m and viterbi_top_k must be >= 1, got {self.mtp_top_m}, {self.viterbi_top_k}")
        if not 0.0 < self.mtp_threshold <= 1.0:
            raise ValueError(f"mtp_threshold must lie in (0, 1], got {self.mtp_threshold}")
        if self.steps_per_sync < 0:
            raise ValueError(f"steps_per_sync must be >= 0, got {self.steps_per_sync}")
        if self.steps_per_sync and not spec.runs_on_device_steps:
            raise ValueError(f"steps_per_sync (whole steps on the device) runs policies {', '.join(DEVICE_STEP_POLICIES)}, "
                             f"not {self.policy!r}")
        if not isinstance(self.compile_steps, bool):
            raise ValueError(f"compile_steps must be true or false, got {self.compile_steps!r}")
        if self.compile_steps and not self.steps_per_sync:
            raise ValueError("compile_steps compiles whole steps on the device: it needs steps_per_sync > 0")
        if self.steps_per_sync and plans_draft_length(self):
            raise ValueError("steps_per_sync (whole steps on the device) needs a fixed draft length: "
                             "set adaptive_draft false")


# A batched stream's chunks are sized for this speed (x real time): 8 streams sharing a 2-core CPU
# run at ~1.9x each on average, slower at a stream's start while the others' prompts are prefilled;
# at 1.5 a third of 8 such streams still ran dry once early on, at 1.25 none (`StreamConfig.min_speed`).
BATCH_MIN_SPEED = 1.25


@dataclass(frozen=True)
class StreamConfig:
    """How accepted tokens become audio chunks (`runtime/audio/streaming.py`)."""

    # The first chunk is small for time to first audio; each later chunk doubles the one before up
    # to chunk_tokens, as far as `min_speed` allows (5, 6, 8, 11, 15, 21, 25, ... tokens at 1.5).
    first_chunk_tokens: int = 5  # 100 ms of audio
    chunk_tokens: int = 25  # 500 ms per chunk once grown
    left_context_tokens: int = 50  # 1 s of already-emitted tokens decoded again as context
    codec_lookahead: int = 8  # tokens past the chunk that must exist before it is decoded
    # The first audio waits for first_chunk_tokens + first_chunk_lookahead tokens. Its short
    # lookahead (it must still cover the cross-fade) costs little: on the trained codec the first
    # chunk's error stays 41 dB below the speech level (48 dB with 8), and it saves 6 LM steps of
    # time to first audio (measured by benchmarks/bench_streaming.py).
    first_chunk_lookahead: int = 2
    crossfade_samples: int = 640  # 40 ms raised-cosine blend with the previous window
    codec_thread: bool = True  # decode codec windows on a thread of their own, beside the LM's
    # The slowest generation (times real time) at which every chunk is ready before a player that
    # started at the first chunk runs dry: early chunks and their lookaheads are sized for it
    # (`ChunkSchedule`). 0: chunks double regardless (enough for a stream faster than ~3.2x real
    # time). None: `BATCH_MIN_SPEED` for a stream decoded in a batch (streams sharing a batch run at
    # ~2x real time each on a 2-core CPU), else 0 (`for_stream`).
    min_speed: float | None = None

    def __post_init__(self) -> None:
        for name in ("first_chunk_tokens", "chunk_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("left_context_tokens", "codec_lookahead", "first_chunk_lookahead", "crossfade_samples"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("codec_lookahead", "first_chunk_lookahead"):
            tokens = getattr(self, name)
            if self.crossfade_samples > tokens * SAMPLES_PER_TOKEN:
                raise ValueError(f"crossfade_samples cannot exceed the {name} audio "
                                 f"({tokens} tokens = {tokens * SAMPLES_PER_TOKEN} samples)")
        if self.crossfade_samples > min(self.first_chunk_tokens, self.chunk_tokens) * SAMPLES_PER_TOKEN:
            raise ValueError("crossfade_samples cannot exceed a chunk")
        if self.min_speed is not None and (isinstance(self.min_speed, bool) or not isinstance(
                self.min_speed, (int, float)) or not (self.min_speed == 0 or 1 < self.min_speed <= 100)):
            raise ValueError(f"min_speed must be 0 (no bound), lie in (1, 100] (times real time) or be None "
                             f"(chosen by the route), got {self.min_speed!r}")

    def for_stream(self, batched: bool) -> "StreamConfig":
        """These settings for one stream, `min_speed` chosen when None: `BATCH_MIN_SPEED` for a stream
        decoded in a batch, 0 for one alone (its chunks then double as they always did)."""
        if self.min_speed is not None:
            return self
        return dataclasses.replace(self, min_speed=BATCH_MIN_SPEED if batched else 0)


@dataclass(frozen=True)
class SynthesisConfig:
    """Per-call settings of `Synthesizer.stream`."""

    decode: DecodeConfig = DecodeConfig()
    stream: StreamConfig = StreamConfig()
    seed: int | None = None  # None: a fresh random seed per call
    max_sentence_chars: int = 300  # long text is split into pieces of at most this many characters
    spell_numbers: bool = True  # numbers read as words before tokenising (runtime/text/numbers.py)
    # LLaSA speaks ~15 characters/s (~3.5 tokens per character); generation past
    # `min_tokens + tokens_per_char * chars` is a runaway (a known LLaSA failure) and is cut.
    tokens_per_char: float = 12.0
    min_tokens: int = 50
    # A sentence is not allowed to end before `min_tokens_per_char` speech tokens per letter or digit
    # (DecodeConfig.min_new_tokens): on a short text ("Yes.") the model may otherwise draw the stop token
    # at once and say nothing. Ordinary speech takes 4-6 tokens per letter. The minimum is at least
    # `min_speech_tokens` (0.3 s: "Yes." needs it); both 0 turn it off.
    min_tokens_per_char: float = 2.0
    min_speech_tokens: int = 15
    # How far generation may run ahead of the consumer, in seconds of audio: enough for smooth playback
    # (a chunk is at most 0.5 s), little enough that a stream nobody reads stops costing CPU at once.
    run_ahead_s: float = 4.0
    abandon_after_s: float = 60.0  # a stream not read for this long (run-ahead full) stops and frees its worker

    def __post_init__(self) -> None:
        if self.seed is not None:
            if isinstance(self.seed, bool) or not isinstance(self.seed, int):
                raise ValueError(f"seed must be an integer, got {self.seed!r}")
            if not (0 <= self.seed <= MAX_SEED):
                raise ValueError(f"seed must lie in [0, 2**63 - 1], got {self.seed}")
        if self.tokens_per_char <= 0 or self.min_tokens < 1:
            raise ValueError("tokens_per_char must be > 0 and min_tokens >= 1")
        if isinstance(self.min_speech_tokens, bool) or not isinstance(self.min_speech_tokens, int) \
                or self.min_speech_tokens < 0:
            raise ValueError(f"min_speech_tokens must be an integer >= 0, got {self.min_speech_tokens!r}")
        if isinstance(self.min_tokens_per_char, bool) or not isinstance(self.min_tokens_per_char, (int, float)) \
                or not self.min_tokens_per_char >= 0:
            raise ValueError(f"min_tokens_per_char must be a number >= 0, got {self.min_tokens_per_char!r}")
        if not self.run_ahead_s > 0:
            raise ValueError(f"run_ahead_s must be > 0, got {self.run_ahead_s}")
        if self.abandon_after_s <= 0:
            raise ValueError(f"abandon_after_s must be > 0, got {self.abandon_after_s}")
        if self.max_sentence_chars < 20:
            raise ValueError(f"max_sentence_chars must be >= 20, got {self.max_sentence_chars}")

    def token_budget(self, text: str) -> int:
        return min(self.decode.max_new_tokens, int(self.min_tokens + self.tokens_per_char * len(text)))

    def token_minimum(self, text: str) -> int:
        """The speech tokens `text` gets before its stop token may be drawn: `min_tokens_per_char` per
        letter or digit, at least `min_speech_tokens` and `decode.min_new_tokens`, at most the budget."""
        letters = sum(char.isalnum() for char in text)
        per_char = int(self.min_tokens_per_char * letters)
        return min(self.token_budget(text), max(self.decode.min_new_tokens, self.min_speech_tokens, per_char))


@dataclass(frozen=True)
class ModelPaths:
    """Local model locations; None where a model is not used (or: the built-in voice's)."""

    target: str | None = None  # LLaSA-format checkpoint directory (or an ONNX / TensorRT export of it)
    draft: str | None = None  # draft checkpoint (same speech-token layout as the target)
    codec: str | None = None  # X-codec2 directory, Hugging Face format (or its ONNX export)
    # The codec whose decoder renders speech prompted with a reference voice (a preset, a cloned voice,
    # ref_audio); None: `codec` renders every voice. Its encoder must be `codec`'s (same codes).
    clone_codec: str | None = None
    # The target LM that speaks voices with a reference (a multi-speaker model that follows voice
    # prompts), loaded on the first such stream; None: `target` speaks every voice. Same tokenizer.
    clone_target: str | None = None
    groups: str | None = None  # .pcg group table of the target, for policy pcg
    heads: str | None = None  # multi-token heads (mtp-* policies); default <target>/mtp_heads.safetensors
    transitions: str | None = None  # .pct code transitions (mtp-viterbi); default <target>/transitions.pct
    eagle: str | None = None  # EAGLE draft (eagle-* policies); default <target>/eagle_draft.safetensors
    presets: str | None = None  # preset voices (voices.json + .voice files); default <target>/voices
    # A folder `pcgtts prepare` made: resolved into the paths above (`runtime/prepared.py`), never with them
    prepared: str | None = None


PRESETS_FOLDER = "voices"  # a target's preset voices, beside its weights


def preset_folder(models: ModelPaths) -> str | None:
    """The folder of preset voices `models` name: `presets`, else `<target>/voices` when it has an index."""
    if models.presets is not None:
        return models.presets
    if models.target is not None and (Path(models.target) / PRESETS_FOLDER / "voices.json").is_file():
        return str(Path(models.target) / PRESETS_FOLDER)
    return None


@dataclass(frozen=True)
class DeviceConfig:
    compute_device: str = "cpu"  # cpu | cuda | cuda:N
    dtype: str = "float32"
    backend: str = "auto"  # see BACKENDS; made concrete by `runtime/lm/loader.py: resolve_backend`
    max_length: int = 4096  # KV-cache slots per sequence (prompt + reference codes + speech)
    quantize: str = "none"  # "int8": int8 linear layers (torch backend, CPU, float32)
    # The torch backend's steps through torch.compile on a CPU (float32, no int8; needs a C++
    # compiler): about a minute per model at load the first time, less from the cache; `runtime/lm/torch_lm.py`.
    compile: bool = False
    threads: int = 0  # CPU threads per stage (the LM's, the codec's); 0 = auto (`cpu_threads`)
    # A prompt's prefill reuses the KV of the leading tokens it shares with the last one (the chat
    # template before the text, a voice's transcript): `runtime/lm/protocol.py`.
    prefix_cache: bool = True
    # Streams one model copy decodes at once (`runtime/decode/batch.py`): plain (`ar`) streams share
    # one forward a step, each in a KV slot of its own (torch backend). 1: one stream at a time.
    max_batch: int = 1

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not (self.compute_device == "cpu" or self.compute_device.split(":")[0] == "cuda"):
            raise ValueError(f"compute_device must be cpu, cuda or cuda:N, got {self.compute_device!r}")
        if self.max_length < 64:
            raise ValueError(f"max_length must be >= 64, got {self.max_length}")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0 (0 = auto), got {self.threads}")
        if not isinstance(self.prefix_cache, bool):
            raise ValueError(f"prefix_cache must be true or false, got {self.prefix_cache!r}")
        if isinstance(self.max_batch, bool) or not isinstance(self.max_batch, int) \
                or not 1 <= self.max_batch <= MAX_BATCH:
            raise ValueError(f"max_batch must be an integer in [1, {MAX_BATCH}], got {self.max_batch!r}")
        if self.max_batch > 1 and self.backend in ("onnxruntime", "tensorrt"):
            raise ValueError(f"max_batch > 1 decodes streams together on the torch backend, not "
                             f"backend={self.backend!r} (an export steps one sequence)")
        if self.quantize not in QUANTIZE:
            raise ValueError(f"quantize must be one of {QUANTIZE}, got {self.quantize!r}")
        if self.quantize == "int8" and (self.backend not in ("auto", "torch") or self.compute_device != "cpu"
                                        or self.dtype != "float32"):
            raise ValueError("quantize='int8' runs on the torch backend on a CPU in float32 "
                             "(for onnxruntime, export an int8 graph: `pcgtts export onnx --quantize int8`)")
        if not isinstance(self.compile, bool):
            raise ValueError(f"compile must be true or false, got {self.compile!r}")
        if self.compile and (self.backend not in ("auto", "torch") or self.compute_device != "cpu"
                             or self.dtype != "float32" or self.quantize != "none"):
            raise ValueError(f"compile runs the torch backend's steps through torch.compile on a CPU in float32 "
                             f"without quantize, not backend={self.backend!r} compute_device={self.compute_device!r} "
                             f"dtype={self.dtype!r} quantize={self.quantize!r} (an export runs on its own backend; "
                             "on a GPU the torch backend replays CUDA graphs)")


def cpu_threads(device: DeviceConfig, codec_thread: bool, environ=os.environ, cores: int | None = None) -> int | None:
    """Threads per stage on a CPU: `device.threads` if given; else None (leave torch's setting)
    when OMP_NUM_THREADS is set or the device is a GPU; else half the cores when the codec runs on
    its own thread beside the LM (one stage per core on a 2-core machine: two threads per stage
    measured 13 % slower for AR and 31 % for eagle-pcg), all of them otherwise."""
    if device.compute_device != "cpu":
        return None
    if device.threads:
        return device.threads
    if "OMP_NUM_THREADS" in environ:
        return None
    cores = cores or os.cpu_count() or 1
    return max(1, cores // 2) if codec_thread else cores


@dataclass(frozen=True)
class Settings:
    models: ModelPaths = ModelPaths()
    device: DeviceConfig = DeviceConfig()
    synthesis: SynthesisConfig = SynthesisConfig()


# Where each flat key lives: a path of attribute names from Settings.
def _key_paths() -> dict[str, tuple[str, ...]]:
    paths: dict[str, tuple[str, ...]] = {}

    def walk(cls, prefix: tuple[str, ...]) -> None:
        for f in dataclasses.fields(cls):
            sub = f.default if dataclasses.is_dataclass(f.default) else None
            if sub is not None:
                walk(type(sub), prefix + (f.name,))
            else:
                assert f.name not in paths, f"setting name {f.name!r} is used twice"
                paths[f.name] = prefix + (f.name,)

    walk(Settings, ())
    return paths


KEYS = _key_paths()
SECTIONS = ("models", "device", "synthesis", "decode", "sampling", "stream")


def _apply(config: Any, updates: Mapping[tuple[str, ...], Any]) -> Any:
    """`config` with each (field path -> value) of `updates` set, every dataclass rebuilt once: its
    checks see the final combination (`steps_per_sync` with `adaptive_draft` false, in either order)."""
    fields: dict[str, Any] = {}
    nested: dict[str, dict[tuple[str, ...], Any]] = {}
    for (head, *rest), value in updates.items():
        if rest:
            nested.setdefault(head, {})[tuple(rest)] = value
        else:
            fields[head] = value
    fields.update({head: _apply(getattr(config, head), inner) for head, inner in nested.items()})
    return dataclasses.replace(config, **fields) if fields else config


# What a setting's type annotation asks of a value in a TOML file (annotations of other types: not checked here).
_TOML_TYPES = {"bool": ((bool,), "true or false"), "int": ((int,), "an integer"),
               "float": ((int, float), "a number"), "str": ((str,), "a string")}


def _annotation(path: tuple[str, ...]) -> str:
    """The type annotation (as written) of the setting at `path` from Settings."""
    cls = Settings
    for name in path:
        field = next(f for f in dataclasses.fields(cls) if f.name == name)
        cls = type(field.default)
    return str(field.type)


def _where(name: str) -> str:
    """A setting as a config file places it: `[decode] draft_length`."""
    section = KEYS[name][-2] if len(KEYS[name]) > 1 else None
    return f"[{section}] {name}" if section in SECTIONS else name


def _check_file_type(path: Path, name: str, value: Any) -> None:
    """A ValueError naming the file and the setting for a value of the wrong TOML type."""
    kinds = set(re.findall(r"\w+", _annotation(KEYS[name]))) - {"None"}
    if not kinds or not kinds <= set(_TOML_TYPES):
        return
    for kind in kinds:
        types, _ = _TOML_TYPES[kind]
        if isinstance(value, types) and (kind == "bool" or not isinstance(value, bool)):
            return
    expected = " or ".join(_TOML_TYPES[k][1] for k in sorted(kinds, key=list(_TOML_TYPES).index))
    raise ValueError(f"{path}: {_where(name)}: expected {expected}, got {value!r}")


def _in_file(err: ValueError, path: str | Path, file_layer: Mapping[str, Any], explicit: Mapping[str, Any],
             base: Settings | None) -> ValueError:
    """`err` (a value refused by the settings' checks) naming the config file and the setting in it
    that caused it, when one value of the file alone is refused; else `err` as it was."""
    for name, value in file_layer.items():
        if explicit.get(name) is not None:  # a flag or keyword overrides it
            continue
        try:
            _apply(base or Settings(), {KEYS[name]: value})
        except ValueError as alone:
            message = str(alone)  # "draft_length must lie in ...": placed in its section
            where = _where(name)
            if message.startswith(f"{name} "):
                return ValueError(f"{path}: {where[:-len(name)]}{message}")
            return ValueError(f"{path}: {where}: {message}")
    return err


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Flat {key: value} from a TOML file; model paths are taken relative to the file's folder."""
    import tomllib

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file not found: {path}")
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not a valid TOML config file ({err})") from None
    flat: dict[str, Any] = {}
    for key, value in data.items():
        items = value.items() if key in SECTIONS and isinstance(value, dict) else [(key, value)]
        for name, v in items:
            if name not in KEYS:
                raise ValueError(f"{path}: unknown setting {name!r} (known: {', '.join(sorted(KEYS))})")
            if key in SECTIONS and KEYS[name][-2] != key:
                raise ValueError(f"{path}: setting {name!r} belongs in [{KEYS[name][-2]}], not [{key}]")
            _check_file_type(path, name, v)
            if KEYS[name][0] == "models" and v is not None:
                v = str((path.parent / v).resolve()) if not Path(v).is_absolute() else v
            flat[name] = v
    return flat


def resolve_settings(explicit: Mapping[str, Any] | None = None, config_file: str | Path | None = None,
                     base: Settings | None = None, voice: Mapping[str, Any] | None = None) -> Settings:
    """The settings in force: `explicit` (None values count as not given) > `config_file` > `voice`
    > `base` (the defaults when None). `voice`: the built-in voice's own settings (its voice.json,
    e.g. the temperature it reads best at), in force only when neither layer above names a target
    or a prepared folder. A prepared folder's own voice settings (`prepared.voice_settings`) are in
    force in their place when it is named (and `base` holds the default synthesis settings). A
    prepared folder comes back as the model paths it holds.
    Unknown keys and invalid values raise ValueError."""
    layers = [read_config_file(config_file) if config_file is not None else {},
              {k: v for k, v in (explicit or {}).items() if v is not None}]
    file_layer, given = layers
    if voice and not any(layer.get(name) is not None for layer in layers for name in ("target", "prepared")):
        layers.insert(0, dict(voice))
    folder = next((layer["prepared"] for layer in reversed(layers) if layer.get("prepared") is not None), None)
    if folder is not None and (base is None or base.synthesis == SynthesisConfig()):
        own = prepared.voice_settings(folder)
        check_voice_keys(own, Path(folder) / prepared.SETTINGS)
        layers.insert(0, own)
    updates: dict[tuple[str, ...], Any] = {}
    for layer in layers:  # later layers win
        for key, value in layer.items():
            if key not in KEYS:
                raise ValueError(f"unknown setting {key!r}")
            path = KEYS[key]
            updates[path] = str(value) if path[0] == "models" and value is not None else value
    try:
        settings = _apply(base or Settings(), updates)
    except ValueError as err:
        if not file_layer:
            raise
        raise _in_file(err, config_file, file_layer, given, base) from None
    if settings.models.prepared is None:
        return settings
    return prepared_settings(settings)


def check_voice_keys(settings: Mapping[str, Any], where: Path | str) -> None:
    """A ValueError naming `where` unless `settings` holds only what a voice may set: decoding and sampling."""
    wrong = [key for key in settings if key not in KEYS or KEYS[key][:2] != ("synthesis", "decode")]
    if wrong:
        raise ValueError(f"{where}: a voice may set decoding and sampling settings only, not {', '.join(wrong)}")


def runs_int8_graphs(device: DeviceConfig) -> bool:
    """Whether `device` is where the int8 onnxruntime graphs are the fastest route: a CPU, float32,
    no torch int8 layers, no torch.compile, one stream at a time (BENCHMARKS.md; a batch of streams
    runs on torch)."""
    return (device.compute_device == "cpu" and device.dtype == "float32" and device.quantize == "none"
            and not device.compile and device.max_batch == 1)


def codec_graph_beside_a_batch(device: DeviceConfig) -> bool:
    """Whether a batch of streams (`max_batch` > 1, its LM on torch) on a CPU, backend left at "auto",
    decodes its codec windows with the exported decoder graph where one is made: the graph runs a window
    without holding Python's GIL, which the batch's thread needs for every op it dispatches (8 streams on
    2 cores: 1.2-1.4x the audio per second of the torch decoder beside it, and no early chunk late)."""
    return device.compute_device == "cpu" and device.backend == "auto" and device.max_batch > 1


def prepared_settings(settings: Settings) -> Settings:
    """`settings` with `models.prepared` (a folder `pcgtts prepare` made) turned into its model paths:
    on a CPU with the backend at "auto" (or "onnxruntime") its onnxruntime exports when it has them,
    else its checkpoints (a batch of streams: its checkpoints with the exported codec graphs,
    `codec_graph_beside_a_batch`). A ValueError, before anything loads, for a folder that is not complete or
    a prepared folder given together with model paths."""
    models = settings.models
    if models.prepared is None:
        return settings
    given = [name for name in ("target", "draft", "codec", "clone_codec", "clone_target", "groups", "heads",
                              "transitions", "eagle")
             if getattr(models, name) is not None]
    if given:
        raise ValueError(f"a prepared folder names its own models: give either prepared or "
                         f"{', '.join(given)}, not both")
    folder = Path(models.prepared)
    if not folder.is_dir():
        raise ValueError(f"prepared folder not found: {folder}")
    manifest = prepared.read_manifest(folder)
    if manifest is None:
        raise ValueError(f"{folder} is not a prepared folder (no {prepared.MANIFEST}); make one with `pcgtts prepare`")
    missing = [name for name in manifest.get("plan", []) if not prepared.stage_done(folder, manifest, name)]
    if missing:
        raise ValueError(f"{folder} is not fully prepared (stages not done: {', '.join(missing)}); "
                         "run `pcgtts prepare` again to finish it")
    paths, device = prepared.checkpoint_paths(folder), settings.device
    presets = models.presets or preset_folder(ModelPaths(target=paths.get("target")))
    if presets is not None:  # the checkpoint's presets serve its exports too
        paths["presets"] = presets
    exported = prepared.stage_done(folder, manifest, prepared.ONNX_STAGE)
    if device.backend == "onnxruntime":
        if not exported:
            raise ValueError(f"{folder} has no onnxruntime exports (prepared with --no-onnx); "
                             "leave the backend at auto or torch")
        paths = prepared.onnx_paths(folder, paths)
    elif (device.backend == "auto" and exported and runs_int8_graphs(device)
          and importlib.util.find_spec("onnxruntime") is not None):
        paths, device = prepared.onnx_paths(folder, paths), dataclasses.replace(device, backend="onnxruntime")
    elif exported and codec_graph_beside_a_batch(device) and importlib.util.find_spec("onnxruntime") is not None:
        onnx = prepared.onnx_paths(folder, paths)  # the batch's LMs stay on torch
        paths = {**paths, **{name: onnx[name] for name in ("codec", "clone_codec") if name in paths}}
    return dataclasses.replace(settings, models=ModelPaths(**paths), device=device)


def check_compute_device(name: str) -> None:
    """A clear error for a compute device this torch cannot use (e.g. cuda with a CPU-only build)."""
    DeviceConfig(compute_device=name)  # the spelling
    if name.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"compute device {name!r} asked for, but this torch ({torch.__version__}) has no "
                             "usable CUDA; use --compute-device cpu")
        index = int(name.split(":")[1]) if ":" in name else 0
        if index >= torch.cuda.device_count():
            raise ValueError(f"compute device {name!r}: this machine has {torch.cuda.device_count()} CUDA devices")


def settings_dict(settings: Settings) -> dict[str, Any]:
    """Flat {key: value} of every setting (what a config file could say)."""
    out: dict[str, Any] = {}
    for key, path in KEYS.items():
        value: Any = settings
        for name in path:
            value = getattr(value, name)
        out[key] = value
    return out


__all__ = ["POLICIES", "Policy", "Proposer", "Rule", "check_policy", "MTP_POLICIES", "EAGLE_POLICIES", "PCG_POLICIES", "BACKENDS", "SamplingConfig", "DecodeConfig", "StreamConfig", "SynthesisConfig",
           "ModelPaths", "DeviceConfig", "Settings", "resolve_settings", "read_config_file", "settings_dict", "prepared_settings", "runs_int8_graphs",
           "PRESETS_FOLDER", "preset_folder", "check_voice_keys"]
