"""Checking and loading the models resolved settings name: LMs, codec, group table, proposers.

Everything is checked before anything loads (`check_models`): paths, the models and backend the
policy needs. `load_models` then loads them into one `LoadedModels`, which a `Synthesizer` is built
from. The proposers on the target's states are the heads and EAGLE files found next to the target
(or named), or on onnxruntime the graphs exported with it. A clone target (`ModelPaths.clone_target`)
is checked with the rest but loaded on first use (`LazyTarget`), with those proposers re-bound to it
when its hidden states are laid out like the target's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pcgtts.groups.device import DeviceGroupTable
from pcgtts.runtime.audio.codec import SpeechCodec
from pcgtts.runtime.config import (DecodeConfig, DeviceConfig, ModelPaths, SynthesisConfig, check_compute_device,
                                   check_policy, cpu_threads)
from pcgtts.runtime.decode.policy import policy as policy_spec
from pcgtts.runtime.lm.protocol import LM, StatesLM

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModels:
    """What a `Synthesizer` runs: the target and draft LMs, the codec, the group table on the target's
    device, the proposers on the target's states (`proposers.HeadProposer` / `EagleProposer`), the
    codec that decodes speech prompted with a reference voice (None: `codec` decodes every voice) and
    the target LM that speaks it, loaded on first use (None: `target` speaks every voice)."""

    target: LM
    draft: LM | None
    codec: SpeechCodec
    groups: DeviceGroupTable | None = None
    heads: object | None = None
    eagle: object | None = None
    clone_codec: SpeechCodec | None = None
    clone_target: "LazyTarget | None" = None


@dataclass(frozen=True)
class TargetModels:
    """A target LM and the proposers on its hidden states that serve it (None: none does)."""

    target: LM
    heads: object | None = None
    eagle: object | None = None


class LazyTarget:
    """A target LM loaded on the first `get()`, once: the first caller loads it, callers on other threads
    meanwhile wait for it; a load that fails is tried again by the next call."""

    def __init__(self, path: str, load: Callable[[], TargetModels]):
        self.path = path
        self._load = load
        self._lock = threading.Lock()
        self._models: TargetModels | None = None

    @property
    def loaded(self) -> bool:
        return self._models is not None

    def get(self) -> TargetModels:
        if self._models is None:
            with self._lock:
                if self._models is None:
                    started = time.perf_counter()
                    models = self._load()
                    log.info("loaded the clone target %s for voices with a reference in %.1f s", self.path,
                             time.perf_counter() - started)
                    self._models = models
        return self._models

    def release(self) -> None:
        """Free its KV cache if it is loaded (reallocated by its next stream)."""
        if self._models is not None:
            self._models.target.release()


def load_models(models: ModelPaths, device: DeviceConfig, config: SynthesisConfig,
                force_export: bool = False) -> LoadedModels:
    """Load resolved model paths on `device` (checked first: `check_models`)."""
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
    heads, eagle = load_heads(heads_file, transitions_file, target_lm), load_eagle(eagle_file, target_lm)
    clone_target = None
    if models.clone_target is not None and Path(models.clone_target).resolve() != Path(models.target).resolve():
        from pcgtts.runtime.lm.draft import check_draft_layout

        check_draft_layout(models.target, target_lm.tokenizer, models.clone_target, role="clone target")
        files = (heads_file, transitions_file, eagle_file)
        clone_target = LazyTarget(models.clone_target,
                                  lambda: load_clone_target(models.clone_target, common, target_lm, files))
    codec_model = load_codec(models.codec, device, config, threads, force_export)
    clone_model = None
    if models.clone_codec is not None:
        same = Path(models.clone_codec).resolve() == Path(models.codec).resolve()
        clone_model = codec_model if same else load_codec(models.clone_codec, device, config, threads, force_export,
                                                          flag="--clone-codec")
    return LoadedModels(target_lm, draft_lm, codec_model, table, heads, eagle, clone_model, clone_target)


def load_clone_target(folder: str, common: dict, target_lm: LM,
                      files: tuple[Path | None, Path | None, Path | None]) -> TargetModels:
    """The clone target (same backend and settings as the target, its tokenizer shared: the layouts were
    checked at load) with the target's heads and EAGLE draft (`files`) re-bound to it when its states
    are laid out like the target's (hidden size and depth): exact either way, since the clone target
    verifies; otherwise (or exported without them) its streams fall back from those policies."""
    from pcgtts.runtime.lm.loader import load_lm

    lm = load_lm(folder, tokenizer=target_lm.tokenizer, **common)
    target_lm.vocab.check_same_layout(lm.vocab, "target", "clone target")
    shape = state_shape(target_lm)
    if shape is None or state_shape(lm) != shape:
        if shape is not None and any(files[i] is not None for i in (0, 2)):
            log.warning("the clone target's hidden states (size, layers %s) are not the target's %s: the multi-token "
                        "heads and EAGLE draft trained on the target do not serve it", state_shape(lm), shape)
        return TargetModels(lm)
    heads_file, transitions_file, eagle_file = files
    return TargetModels(lm, load_heads(heads_file, transitions_file, lm, fingerprint=False),
                        load_eagle(eagle_file, lm, fingerprint=False))


def state_shape(lm: LM) -> tuple[int, int] | None:
    """(hidden size, layers) of a torch LM's hidden states, what proposers on them read; None for an
    LM whose states no loaded proposer reads (an export: its proposers are exported with it)."""
    args = getattr(getattr(lm, "model", None), "args", None)
    if not isinstance(lm, StatesLM) or args is None:
        return None
    return args.hidden_size, args.num_layers


def load_codec(folder: str, device: DeviceConfig, config: SynthesisConfig, threads: int | None,
               force_export: bool = False, flag: str = "--codec") -> SpeechCodec:
    """A codec's decoder: an exported decoder folder on onnxruntime, an X-codec2 checkpoint with PyTorch
    on the compute device."""
    from pcgtts.runtime.audio.codec import Codec
    from pcgtts.runtime.audio.onnx_codec import OrtCodec, is_exported_codec

    if is_exported_codec(folder):
        return OrtCodec(folder, threads=threads, force=force_export)
    codec_model = Codec.from_pretrained(folder, device=device.compute_device, decode_only=True)
    if device.compute_device == "cpu" and config.stream.codec_thread:
        log.info("the codec decodes with PyTorch beside the LM: its per-op hand-offs of Python's GIL slow "
                 "the decode loop (lab-v1: 12-23 %%); `pcgtts export codec --codec %s "
                 "--out DIR` and %s DIR avoid them", folder, flag)
    return codec_model


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
    for name in ("target", "draft", "codec", "clone_codec", "clone_target"):
        path = getattr(models, name)
        if path is not None and not Path(path).is_dir():
            raise ValueError(f"{name} model directory not found: {path}")
    for name in ("groups", "heads", "transitions", "eagle"):
        path = getattr(models, name)
        if path is not None and not Path(path).is_file():
            raise ValueError(f"{name} file not found: {path}")
    if models.clone_codec is not None:
        check_codec_kind(models.clone_codec, "clone_codec")
    if models.clone_target is not None:
        check_clone_target(models.clone_target, models.target)
    heads, transitions, eagle = check_proposers(models, policy, device.backend)
    check_policy(policy, draft=models.draft is not None, groups=models.groups is not None,
                 heads=heads is not None, transitions=transitions is not None, eagle=eagle is not None)
    check_compute_device(device.compute_device)
    check_checkpoints(models)


def check_codec_kind(folder: str, name: str) -> None:
    """A one-line ValueError unless `folder` is a codec: an exported decoder, or an X-codec2 folder
    (its config.json's model_type), read before anything loads."""
    import json

    from pcgtts.runtime.audio.onnx_codec import is_exported_codec

    if is_exported_codec(folder):
        return
    try:
        kind = json.loads((Path(folder) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        kind = None
    if kind != "xcodec2":
        raise ValueError(f"{name} {folder}: not an X-codec2 folder (config.json with model_type 'xcodec2') "
                         "nor a decoder exported by `pcgtts export codec`")


def check_clone_target(folder: str, target: str | None) -> None:
    """A one-line ValueError unless the clone target `folder` is in the target's form (a checkpoint for
    a checkpoint, an export of the same kind for an export: it runs on the target's backend)."""
    from pcgtts.runtime.lm.graph_meta import exported_kind

    if target is None:
        raise ValueError("clone_target given without a target model; give the target too")
    mine, theirs = exported_kind(target), exported_kind(folder)
    if mine != theirs:
        what = {None: "a checkpoint", "onnx": "an ONNX export", "tensorrt": "a TensorRT export"}
        raise ValueError(f"clone_target {folder}: {what.get(theirs, theirs)}, but the target {target} is "
                         f"{what.get(mine, mine)}; give both in the same form (same backend)")


def check_checkpoints(models: ModelPaths) -> None:
    """The target, draft and clone target checkpoints (not exported graphs) whole, and as their config.json describes
    them, from their safetensors headers: a damaged file or a wrong vocab_size is one line before any
    weights load (`checkpoint.check_weight_shapes`)."""
    from pcgtts.runtime.lm.checkpoint import check_weight_shapes
    from pcgtts.runtime.lm.graph_meta import exported_kind

    for path in (models.target, models.draft, models.clone_target):
        if path is not None and exported_kind(path) is None and (Path(path) / "config.json").is_file():
            check_weight_shapes(path)


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
        spec = policy_spec(policy)
        needed = "eagle" if spec.uses_eagle else "heads" if spec.reads_states else None
        if needed is not None and needed not in exported:
            what = {"eagle": "EAGLE draft", "heads": "multi-token heads"}[needed]
            raise ValueError(f"policy {policy!r} on onnxruntime needs the {what} exported with the target: "
                             f"`pcgtts export onnx --model CHECKPOINT --{needed} FILE --out {models.target}`")
    elif policy_spec(policy).reads_states and backend != "torch":
        raise ValueError(f"policy {policy!r} runs on the torch and onnxruntime backends only "
                         f"(it reads the target's hidden states)")
    return heads, transitions, eagle


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


def load_heads(heads_file: Path | None, transitions_file: Path | None, target_lm, fingerprint: bool = True):
    """The target's multi-token heads (with the transition table when there is one), or None;
    `fingerprint`: refuse heads trained for another target (off: re-bound to one on purpose)."""
    from pcgtts.runtime.decode.transitions import TransitionTable
    from pcgtts.runtime.decode.proposers import HeadProposer

    transitions = TransitionTable.load(transitions_file) if transitions_file is not None else None
    if "heads" in target_lm.exported_proposers:  # onnxruntime: the heads' graph was exported with the target
        return HeadProposer(target_lm.heads_step(), transitions) if target_lm.has_heads else None
    if heads_file is None or not isinstance(target_lm, StatesLM):
        return None
    from pcgtts.runtime.lm.heads import MTPHeads

    model = target_lm.model
    heads = MTPHeads.load(heads_file, fingerprint=target_lm.fingerprint if fingerprint else None,
                          hidden_size=model.head.in_features,
                          device=target_lm.device, dtype=model.dtype)
    return HeadProposer.from_heads(heads, target_lm, transitions)


def load_eagle(eagle_file: Path | None, target_lm, fingerprint: bool = True):
    """The target's EAGLE draft bound to it, or None; `fingerprint`: refuse a draft trained for another
    target (off: re-bound to one on purpose)."""
    from pcgtts.runtime.decode.proposers import EagleProposer

    if "eagle" in target_lm.exported_proposers:  # onnxruntime: the draft's graph was exported with the target
        return EagleProposer.for_target(target_lm) if target_lm.has_eagle else None
    if eagle_file is None or not isinstance(target_lm, StatesLM):
        return None
    if not fingerprint:
        from pcgtts.runtime.lm.eagle import EagleDraft

        return EagleProposer.from_draft(EagleDraft.load(eagle_file, target_lm.model), target_lm)
    return EagleProposer.for_target(target_lm, eagle_file)
