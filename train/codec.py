"""Speech-lab codec: train a small X-codec2 in transformers' `Xcodec2Model` format.

Second step of the lab (corpus -> **codec** -> codes -> LM). Recipe "semonly" from the speech-lab
probe (the default): the acoustic encoder is kept in the file (so the format is the released one) but
zeroed (`conv2` weight/bias = 0) and frozen, so it contributes exact zeros in the stock `encode`; the
trained path is the runtime's own semantic front end (`pcgtts.runtime.audio.features.encoder_inputs`:
Kaldi fbank, 160 dims at 50 Hz) -> small w2v-bert -> adapter -> fc_encoder -> FSQ (8 x 4 levels =
65,536 codes, straight-through) -> Vocos-style decoder with the ISTFT head. The stock `encode` runs
the semantic encoder under no_grad, so training uses its own forward through the same submodules
in the same order. `CodecModelConfig(acoustic=True)` (`train codec --acoustic`) trains the acoustic
(waveform) encoder too, as the released codec does: the per-utterance normalised fbank features remove an
utterance's long-term spectrum, so a semonly codec's codes carry little of a voice's timbre, and held-out
voices come back as voices it was trained on (QUALITY.md). About 5x slower a step on a CPU.
Stage 2 (`--freeze-encoder`) fixes the codes and trains the decoder alone, on the codes the stock `encode`
gives each whole utterance, made once (an acoustic codec's waveform encoder is ~80 % of a joint step on a CPU).
HF's init (zero biases) gives a dead decoder; every Linear/Conv1d gets `reset_parameters()`. Loss: multi-resolution log-mel + log-STFT L1 plus waveform L1; AdamW with
warm-up and cosine decay. Checkpoints (model, optimizer, step, RNG) every few minutes, resumable;
`export_dir` always holds the last `save_pretrained` export that `Xcodec2Model.from_pretrained`
and the runtime's `Codec` load.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from pcgtts.runtime.audio.chunk import SAMPLE_RATE, SAMPLES_PER_TOKEN
from pcgtts.runtime.audio.features import encoder_inputs
from pcgtts.train.corpus import read_manifest
from pcgtts.train.progress import (LossLog, check_device, lr_at, resume, rng_state, save_arrays, save_checkpoint,
                                   training_device)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CodecModelConfig:
    """Sizes of the small X-codec2 (defaults: the probe's 7.6 M-parameter config)."""

    hidden_size: int = 256
    intermediate_size: int = 1024
    num_layers: int = 4
    num_heads: int = 4
    encoder_hidden_size: int = 8
    semantic_hidden: int = 128
    semantic_layers: int = 2
    semantic_heads: int = 2
    semantic_intermediate: int = 256
    acoustic: bool = False  # train the acoustic (waveform) encoder too; False: zeroed and frozen (semonly)

    def __post_init__(self) -> None:
        if self.hidden_size % 32 or self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be divisible by 32 (GroupNorm) and by num_heads")
        if self.semantic_hidden % self.semantic_heads:
            raise ValueError("semantic_hidden must be divisible by semantic_heads")
        if min(self.num_layers, self.semantic_layers, self.encoder_hidden_size) < 1:
            raise ValueError("layer counts and encoder_hidden_size must be >= 1")

    def to_hf(self):
        from transformers import Xcodec2Config

        semantic = {
            "model_type": "wav2vec2-bert", "hidden_size": self.semantic_hidden,
            "num_hidden_layers": self.semantic_layers, "num_attention_heads": self.semantic_heads,
            "intermediate_size": self.semantic_intermediate, "output_hidden_size": self.semantic_hidden,
            "conv_depthwise_kernel_size": 15, "feature_projection_input_dim": 160, "add_adapter": False,
            "apply_spec_augment": False,  # no SpecAugment masking: the codec must see every frame
        }
        return Xcodec2Config(
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_heads, head_dim=self.hidden_size // self.num_heads,
            encoder_hidden_size=self.encoder_hidden_size, downsampling_ratios=[2, 2, 4, 4, 5],
            quantization_dim=self.hidden_size + self.semantic_hidden, quantization_levels=[4] * 8,
            semantic_model_config=semantic,
        )


@dataclass(frozen=True)
class CodecTrainConfig:
    corpus: Path
    out_dir: Path
    model: CodecModelConfig = CodecModelConfig()
    steps: int = 20000
    batch_size: int = 8
    crop_frames: int = 50  # 1 s crops
    lr: float = 6e-4
    min_lr_ratio: float = 0.05
    warmup: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    checkpoint_minutes: float = 5.0
    log_every: int = 20
    seed: int = 0
    threads: int = 1
    reload_manifest_minutes: float = 10.0  # pick up utterances a corpus build added meanwhile
    # Stage 2: freeze everything up to the quantizer so the codes stop changing (the LM can train
    # on them meanwhile) and train only the decoder. Sticky: recorded in `encoder_frozen.json`.
    freeze_encoder: bool = False
    init_from: Path | None = None  # a committed voice folder (pcgtts/voice) whose codec a fresh run starts from
    device: str = "cpu"  # "cuda" on a GPU machine (float32 with TF32 matmuls: the ISTFT head stays exact)
    max_minutes: float | None = None  # stop (checkpointed, resumable) after this long: a time budget

    def __post_init__(self) -> None:
        object.__setattr__(self, "corpus", Path(self.corpus))
        object.__setattr__(self, "out_dir", Path(self.out_dir))
        if self.steps < 1 or self.batch_size < 1 or self.crop_frames < 4:
            raise ValueError("steps, batch_size must be >= 1 and crop_frames >= 4")
        if not self.lr > 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError("lr must be > 0 and min_lr_ratio in [0, 1]")
        if self.checkpoint_minutes <= 0 or self.threads < 1:
            raise ValueError("checkpoint_minutes must be > 0 and threads >= 1")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise ValueError("max_minutes must be > 0")
        check_device(self.device)


def new_codec(model_config: CodecModelConfig, seed: int = 0):
    """A fresh Xcodec2Model, PyTorch default init; the acoustic encoder zeroed and frozen unless
    `model_config.acoustic`."""
    from transformers import Xcodec2Model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Xcodec2Model(model_config.to_hf())
        for module in model.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Conv1d)):
                module.reset_parameters()  # HF init zeroes biases: a dead decoder
    if not model_config.acoustic:
        with torch.no_grad():
            model.acoustic_encoder.conv2.weight.zero_()
            model.acoustic_encoder.conv2.bias.zero_()
        model.acoustic_encoder.requires_grad_(False)
    return model


def codec_forward(model, features: torch.Tensor, waves: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Training forward with gradients: features [B, T, 160] (+ waves [B, 320 T] for an acoustic
    codec) -> (audio [B, 320 T], codes [B, T]).

    The same submodules, in the same order, as the stock `encode` + `decode`; without `waves` the zeroed
    acoustic encoder's output (exact zeros) is passed as zeros instead of being computed.
    """
    latents, codes = _quantize(model, features, waves)
    audio = model.acoustic_decoder(latents)
    return audio[:, 0], codes[..., 0]


def _quantize(model, features: torch.Tensor, waves: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """features [B, T, 160] (+ waves [B, 320 T]) -> (FSQ latents, codes [B, T, 1]): the encoder side of
    the stock model; without waves the zeroed acoustic encoder's output (exact zeros) is passed as zeros."""
    sem = model.semantic_encoder(features).last_hidden_state.transpose(1, 2)
    sem = model.semantic_adapter(sem)
    if waves is None:
        acoustic = sem.new_zeros(sem.shape[0], model.config.hidden_size, sem.shape[2])
    else:
        acoustic = model.acoustic_encoder(waves[:, None])
    return model.quantizer(model.fc_encoder(torch.cat([sem, acoustic], dim=1).transpose(1, 2)))


def utterance_codes(model, acoustic: bool):
    """(features [T, 160], waveform [320 T]) -> int64 codes [T] of a whole utterance through the stock
    encoder (eval mode, no gradients): the decoder stage's codes. The semonly path skips the zeroed
    acoustic encoder (exact zeros), as `semantic_codes` does."""
    @torch.inference_mode()
    def encode(features: torch.Tensor, wave: torch.Tensor) -> np.ndarray:
        device = next(model.parameters()).device
        _, codes = _quantize(model, features[None].to(device), wave[None].to(device) if acoustic else None)
        return codes[0, :, 0].long().cpu().numpy()

    return encode


def decode_codes(model, codes: torch.Tensor) -> torch.Tensor:
    """codes [B, T] -> audio [B, 320 T], with gradients: the stock `decode` (FSQ codebook, project_out, decoder)."""
    return model.acoustic_decoder(model.quantizer.from_codes(codes[..., None]))[:, 0]


@torch.inference_mode()
def semantic_codes(model, samples: np.ndarray) -> np.ndarray:
    """The stock `encode`'s codes without running the zeroed acoustic encoder (its output is exact
    zeros): float32 [N] -> int64 [N // 320 + 1], ~20x faster on a CPU. `encode_corpus` checks it
    against the stock path before relying on it."""
    _, codes = _quantize(model, encoder_inputs(samples)["input_features"])
    return codes[0, :, 0].long().numpy()


def mel_filters(n_fft: int, n_mels: int, sample_rate: int = SAMPLE_RATE) -> torch.Tensor:
    """HTK-scale triangular mel filters [n_mels, n_fft // 2 + 1]."""
    def mel(f):
        return 2595.0 * np.log10(1.0 + f / 700.0)

    freqs = np.linspace(0, sample_rate / 2, n_fft // 2 + 1)
    pts = 700.0 * (10 ** (np.linspace(mel(0.0), mel(sample_rate / 2), n_mels + 2) / 2595.0) - 1.0)
    fb = np.zeros((n_mels, freqs.size))
    for i in range(n_mels):
        lo, ce, hi = pts[i], pts[i + 1], pts[i + 2]
        fb[i] = np.maximum(0, np.minimum((freqs - lo) / (ce - lo), (hi - freqs) / (hi - ce)))
    return torch.tensor(fb, dtype=torch.float32)


RESOLUTIONS = ((512, 128, 64), (1024, 256, 80), (2048, 512, 128))  # n_fft, hop, mels


class ReconstructionLoss(torch.nn.Module):
    """Sum over resolutions of L1 log-mel + 0.5 L1 log-STFT magnitude, plus waveform L1."""

    def __init__(self, resolutions=RESOLUTIONS):
        super().__init__()
        self.resolutions = resolutions
        for i, (n_fft, _, n_mels) in enumerate(resolutions):
            self.register_buffer(f"mel{i}", mel_filters(n_fft, n_mels), persistent=False)
            self.register_buffer(f"win{i}", torch.hann_window(n_fft), persistent=False)

    def forward(self, pred: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        spec = pred.new_zeros(())
        for i, (n_fft, hop, _) in enumerate(self.resolutions):
            win, fb = getattr(self, f"win{i}"), getattr(self, f"mel{i}")
            p = torch.stft(pred, n_fft, hop, window=win, return_complex=True).abs()
            t = torch.stft(target, n_fft, hop, window=win, return_complex=True).abs()
            spec = spec + F.l1_loss(torch.log(fb @ p + 1e-5), torch.log(fb @ t + 1e-5))
            spec = spec + 0.5 * F.l1_loss(torch.log(p + 1e-5), torch.log(t + 1e-5))
        wave = F.l1_loss(pred, target)
        return {"loss": spec + wave, "spec": spec.detach(), "wave": wave.detach()}


class CropSampler:
    """Random fixed-length crops of training utterances with their runtime encoder features.

    The codec reads the corpus's training speakers and its voice bank (`codec_only`: voices whose
    transcripts are not what they say, which the codec never needs). After `use_codes` (the decoder
    stage: a frozen encoder), a crop carries the codes the stock `encode` gives the whole utterance in place of
    its features: the encoder runs once an utterance, not once a crop a step, and the decoder learns from
    the codes it will be given at runtime. The codes are saved with each checkpoint (`CODES_FILE`)."""

    def __init__(self, corpus: Path, crop_frames: int, splits: tuple[str, ...] = ("train", "codec_only")):
        self.corpus, self.crop_frames, self.splits = Path(corpus), crop_frames, splits
        self._cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (features or codes, waveform)
        self.encode, self.codes = None, {}  # the decoder stage's encoder and its codes: id -> int32 [T]
        self.reload()

    def use_codes(self, encode, codes: dict[str, np.ndarray] | None = None) -> None:
        """Switch to the decoder stage: crops carry `encode`'s codes of the whole utterance (see the class)."""
        self.encode, self.codes = encode, dict(codes or {})
        self._cache.clear()

    def reload(self) -> None:
        records = [r for r in read_manifest(self.corpus) if r["split"] in self.splits]
        need = (self.crop_frames + 1) * SAMPLES_PER_TOKEN / SAMPLE_RATE
        self.records = [r for r in records if r["seconds"] >= need]
        if not self.records:
            raise ValueError(f"{self.corpus}: no {' or '.join(self.splits)} utterances of at least {need:.2f} s")
        self.hours = sum(r["seconds"] for r in self.records) / 3600

    def _inputs(self, rec: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(features [T, 160] or codes [T], waveform [320 T]) of a whole utterance: features normalised over
        the whole utterance, as at runtime, so a crop's features do not depend on where it was cut."""
        inputs = self._cache.get(rec["id"])
        if inputs is None:
            import soundfile as sf

            audio, _ = sf.read(str(self.corpus / rec["path"]), dtype="int16")
            full = encoder_inputs(audio.astype(np.float32) / 32768.0)
            features, wave = full["input_features"][0], full["input_values"][0, 0]
            if self.encode is not None:
                if rec["id"] not in self.codes:
                    self.codes[rec["id"]] = self.encode(features, wave).astype(np.int32)
                features = torch.from_numpy(self.codes[rec["id"]]).long()
            inputs = self._cache[rec["id"]] = (features, wave)
        return inputs

    def batch(self, size: int, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
        """(features [B, crop, 160] or codes [B, crop], waveforms [B, 320 crop])."""
        feats, waves = [], []
        for _ in range(size):
            features, wave = self._inputs(self.records[rng.randrange(len(self.records))])
            t0 = rng.randrange(0, features.shape[0] - self.crop_frames + 1)
            feats.append(features[t0:t0 + self.crop_frames])
            waves.append(wave[t0 * SAMPLES_PER_TOKEN:(t0 + self.crop_frames) * SAMPLES_PER_TOKEN])
        return torch.stack(feats), torch.stack(waves)


def export_codec(model, export_dir: Path) -> Path:
    """`save_pretrained` into export_dir atomically (a temp folder renamed over the old one)."""
    export_dir = Path(export_dir)
    tmp = export_dir.with_name(export_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    old = export_dir.with_name(export_dir.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if export_dir.exists():
        export_dir.rename(old)
    tmp.rename(export_dir)
    shutil.rmtree(old, ignore_errors=True)
    return export_dir


ENCODER_PARTS = ("semantic_encoder", "semantic_adapter", "acoustic_encoder", "fc_encoder", "quantizer")  # audio -> codes
FROZEN_MARKER = "encoder_frozen.json"
CODES_FILE = "decoder_codes.npz"  # the frozen encoder's codes of each utterance the decoder stage has read


def _set_train_mode(model, frozen: bool, acoustic: bool = False) -> None:
    """Train mode for what trains; a zeroed acoustic encoder (and a frozen encoder) stay in eval."""
    model.train()
    if not acoustic:
        model.acoustic_encoder.eval()
    for name in ENCODER_PARTS if frozen else ():
        getattr(model, name).eval()


def _freeze_encoder(model, out: Path, step: int) -> None:
    """Stop the codes from changing: no gradients (so AdamW leaves them alone, weight decay
    included) for the encoder side. Recorded once, honoured by every later run in `out`."""
    marker = out / FROZEN_MARKER
    if not marker.is_file():
        marker.write_text(json.dumps({"frozen_at_step": step, "parts": list(ENCODER_PARTS)}) + "\n")
        log.info("encoder frozen at step %d: codes are fixed from here on (%s)", step, marker)
    for name in ENCODER_PARTS:
        getattr(model, name).requires_grad_(False)


def train_codec(cfg: CodecTrainConfig, progress=None, stop_after: int | None = None) -> dict:
    """Train (or resume) until cfg.steps; returns a summary. stop_after: stop after that many steps
    in this call (tests, time-boxed runs) after writing a checkpoint."""
    device = training_device(cfg.device)
    torch.set_num_threads(cfg.threads)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    out = cfg.out_dir
    out.mkdir(parents=True, exist_ok=True)
    sampler = CropSampler(cfg.corpus, cfg.crop_frames)
    model = new_codec(cfg.model, cfg.seed)
    if cfg.init_from is not None and not (out / "checkpoint.pt").is_file():
        from pcgtts.runtime.voicepack import init_weights

        frozen = init_weights(model, cfg.init_from, "codec")["codec"].get("encoder_frozen")
        if frozen and cfg.model.acoustic:  # training the waveform encoder changes the codes by design
            log.info("%s's codec has a frozen encoder; an --acoustic run trains it anyway (its codes change, "
                     "so an LM must be trained on the new ones)", cfg.init_from)
        elif frozen and not (out / FROZEN_MARKER).is_file():  # the shipped LM was trained on these codes
            (out / FROZEN_MARKER).write_text(json.dumps({**frozen, "inherited_from": str(cfg.init_from)}) + "\n")
    model.to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.8, 0.99), weight_decay=cfg.weight_decay)
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    ckpt_path = out / "checkpoint.pt"
    losses = LossLog(out / "loss.jsonl")
    step = resume(ckpt_path, model, opt, rng, losses, asdict(cfg.model))
    (out / "train_config.json").write_text(json.dumps(asdict(cfg), default=str, indent=2))
    loss_fn = ReconstructionLoss().to(device)
    frozen = cfg.freeze_encoder or (out / FROZEN_MARKER).is_file()
    if frozen:
        _freeze_encoder(model, out, step)
    _set_train_mode(model, frozen, cfg.model.acoustic)
    codes_path, codes_saved = out / CODES_FILE, 0
    if frozen:  # the codes are fixed: made once an utterance (kept across resumes), and only the decoder runs a step
        sampler.use_codes(utterance_codes(model, cfg.model.acoustic),
                          dict(np.load(codes_path)) if codes_path.is_file() else None)
        codes_saved = len(sampler.codes)
    t_start = t_ckpt = t_reload = time.monotonic()
    first = step
    window: list[float] = []

    def checkpoint() -> None:
        nonlocal codes_saved
        if len(sampler.codes) > codes_saved:
            save_arrays(codes_path, sampler.codes)
            codes_saved = len(sampler.codes)
        save_checkpoint(ckpt_path, {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
                                    "rng": rng_state(rng), "model_config": asdict(cfg.model)})
        model.eval()
        export_codec(model, out / "export")
        _set_train_mode(model, frozen, cfg.model.acoustic)
        losses.plot(out / "loss.png", title="codec reconstruction loss")
        log.info("checkpoint at step %d -> %s (export %s)", step, ckpt_path, out / "export")

    while step < cfg.steps:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        inputs, target = (t.to(device, non_blocking=True) for t in sampler.batch(cfg.batch_size, rng))
        if frozen:
            codes, pred = inputs, decode_codes(model, inputs)
        else:
            pred, codes = codec_forward(model, inputs, target if cfg.model.acoustic else None)
        terms = loss_fn(pred, target)
        opt.zero_grad(set_to_none=True)
        terms["loss"].backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        step += 1
        window.append(float(terms["loss"].detach()))
        if step % cfg.log_every == 0 or step == cfg.steps:
            rec = {"step": step, "loss": sum(window) / len(window), "spec": float(terms["spec"]),
                   "wave": float(terms["wave"]), "lr": opt.param_groups[0]["lr"],
                   "unique_codes": int(codes.unique().numel()), "corpus_hours": round(sampler.hours, 3)}
            losses.append(rec)
            window = []
            log.info("step %d loss %.4f unique codes %d", step, rec["loss"], rec["unique_codes"])
            if progress is not None:
                progress(step, cfg.steps, rec["loss"])
        now = time.monotonic()
        if now - t_reload > cfg.reload_manifest_minutes * 60:
            sampler.reload()
            t_reload = now
        if now - t_ckpt > cfg.checkpoint_minutes * 60:
            checkpoint()
            t_ckpt = time.monotonic()
        if stop_after is not None and step - first >= stop_after:
            break
        if cfg.max_minutes is not None and now - t_start > cfg.max_minutes * 60:
            log.info("stopping at step %d after %.1f min (max_minutes); run again to go on", step, cfg.max_minutes)
            break
    checkpoint()
    return {"step": step, "steps": cfg.steps, "checkpoint": str(ckpt_path), "export": str(out / "export"),
            "loss_png": str(out / "loss.png"), "last_loss": losses.last("loss"), "corpus_hours": sampler.hours,
            "encoder_frozen": bool(frozen)}


__all__ = ["CodecModelConfig", "CodecTrainConfig", "new_codec", "codec_forward", "semantic_codes", "ReconstructionLoss",
           "train_codec", "export_codec", "CropSampler", "utterance_codes", "decode_codes"]
