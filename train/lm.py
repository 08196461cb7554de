"""Speech-lab target LM: a small `LlamaForCausalLM` in the LLaSA layout, trained on codec codes.

Third step of the lab (corpus -> codec -> **codes -> LM** -> draft). The tokenizer is the
LLaSA-layout builder (`pcgtts.runtime.text.tokenizer.build_demo_tokenizer`: byte-level text,
Llama-3 chat tokens, the 8 LLaSA control tokens, then `<|s_0|>`..`<|s_65535|>` at an offset read
back with `SpeechVocab.from_tokenizer`). Training examples are exactly the runtime's input: ids
from `pcgtts.runtime.text.prompt.build_prompt` (plain, or voice-prompted with another utterance of
the same speaker as reference for zero-shot cloning) + `<|s_c|>` codes + `<|SPEECH_GENERATION_END|>`,
loss on the speech and stop targets.

The 65,536-row embedding/head is factorised over the 8 FSQ digits (transformers' FSQ basis:
digit d of code c is (c // 4**d) % 4): speech row(c) = sum_d W[d, digit_d(c)], tied between input
and output, text rows one shared matrix. The loss is the exact joint softmax over the whole
vocabulary: logZ = logaddexp(sum_d logsumexp(l_d), logsumexp(text logits)). `materialise` writes
the full matrices into a plain, tied LlamaForCausalLM with identical log-probs.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import random
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch


from pcgtts.runtime.lm.digit_head import code_digits
from pcgtts.runtime.text.prompt import build_prompt
from pcgtts.runtime.text.vocab import NUM_SPEECH_TOKENS, SpeechVocab
from pcgtts.train.align import alignment_prior, relative_positions, watch
from pcgtts.train.corpus import read_manifest
from pcgtts.train.progress import (LossLog, check_device, load_checkpoint, lr_at, resume, rng_state, save_arrays,
                                   save_checkpoint, training_device)

log = logging.getLogger(__name__)

NUM_DIGITS, LEVELS = 8, 4
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class LMModelConfig:
    hidden_size: int = 384
    num_layers: int = 6
    num_heads: int = 6
    num_kv_heads: int = 2
    intermediate_size: int = 1536

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("hidden_size must divide by num_heads and num_heads by num_kv_heads")
        if min(self.num_layers, self.intermediate_size) < 1:
            raise ValueError("num_layers and intermediate_size must be >= 1")

    @classmethod
    def small(cls) -> "LMModelConfig":
        """h256 / 6 layers: 6.0 M parameters factorised (2.2x faster per step than the default on a CPU)."""
        return cls(hidden_size=256, num_layers=6, num_heads=4, num_kv_heads=2, intermediate_size=1024)

    @classmethod
    def tiny(cls) -> "LMModelConfig":
        return cls(hidden_size=64, num_layers=4, num_heads=2, num_kv_heads=1, intermediate_size=128)

    def to_hf(self, tokenizer):
        from transformers import LlamaConfig

        layout = speech_vocab(tokenizer)
        return LlamaConfig(
            vocab_size=layout.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads, head_dim=self.hidden_size // self.num_heads,
            max_position_embeddings=131072, rms_norm_eps=1e-5, rope_parameters=dict(LLAMA3_ROPE),
            tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=layout.stop_id,
        )


_LAYOUTS: dict[int, SpeechVocab] = {}


def speech_vocab(tokenizer) -> SpeechVocab:
    """SpeechVocab of a tokenizer, computed once per tokenizer object (65 k added tokens: slow)."""
    key = id(tokenizer)
    if key not in _LAYOUTS:
        _LAYOUTS[key] = SpeechVocab.from_tokenizer(tokenizer)
    return _LAYOUTS[key]


@functools.lru_cache(maxsize=1)
def lab_tokenizer():
    """The LLaSA-layout tokenizer the runtime's demo builder makes (shared, not duplicated; cached)."""
    from pcgtts.runtime.text.tokenizer import build_demo_tokenizer

    return build_demo_tokenizer(NUM_SPEECH_TOKENS)


class FactorisedLM(torch.nn.Module):
    """Llama body + text rows + 8 x 4 digit rows; speech row(c) = sum_d digit_rows[d, digit_d(c)]."""

    def __init__(self, hf_config, speech_offset: int, num_speech: int = NUM_SPEECH_TOKENS):
        super().__init__()
        from transformers import LlamaModel

        if speech_offset + num_speech != hf_config.vocab_size:
            raise ValueError("speech tokens must be the last rows of the vocabulary")
        if num_speech != LEVELS ** NUM_DIGITS:
            raise ValueError(f"the factorised head needs {LEVELS ** NUM_DIGITS} speech tokens")
        self.hf_config = hf_config
        body_cfg = hf_config.__class__(**{**hf_config.to_dict(), "vocab_size": 1, "bos_token_id": None,
                                             "eos_token_id": None, "pad_token_id": None})
        self.body = LlamaModel(body_cfg)
        self.body.embed_tokens = None  # inputs are embedded here
        h = hf_config.hidden_size
        std = hf_config.initializer_range
        self.speech_offset, self.num_speech = speech_offset, num_speech
        self.text = torch.nn.Parameter(torch.randn(speech_offset, h) * std)
        # Each digit row is scaled so a speech row (sum of 8) has the text rows' scale.
        self.digits = torch.nn.Parameter(torch.randn(NUM_DIGITS, LEVELS, h) * std / math.sqrt(NUM_DIGITS))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        # Gradients of indexed rows are scatter-adds: tens of thousands of positions onto 32 digit rows
        # (or one clamped text row) serialise on a GPU. F.embedding's backward sorts instead, and the
        # digit sum is a multi-hot [.., 32] @ [32, h] product (float32: rows are not rounded to bf16).
        is_speech = ids >= self.speech_offset
        text = torch.nn.functional.embedding(ids.clamp(max=self.speech_offset - 1), self.text)
        digits = code_digits((ids - self.speech_offset).clamp(min=0), NUM_DIGITS)  # [B, T, 8]
        slots = digits + LEVELS * torch.arange(NUM_DIGITS, device=ids.device)  # column of digit d: 4d + level
        multi_hot = torch.zeros(*ids.shape, NUM_DIGITS * LEVELS, device=ids.device).scatter_(-1, slots, 1.0)
        with torch.autocast(ids.device.type, enabled=False):
            speech = multi_hot @ self.digits.reshape(NUM_DIGITS * LEVELS, -1)
        return torch.where(is_speech.unsqueeze(-1), speech, text.to(speech.dtype))

    def hidden(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.body(inputs_embeds=self.embed(ids), attention_mask=attention_mask).last_hidden_state

    def head(self, hidden: torch.Tensor):
        """(text logits [.., n_text], digit logits [.., 8, 4], logZ [..]) of the exact joint softmax."""
        text = hidden @ self.text.T
        digit = torch.einsum("...h,dlh->...dl", hidden, self.digits)
        log_z = torch.logaddexp(torch.logsumexp(digit, -1).sum(-1), torch.logsumexp(text, -1))
        return text, digit, log_z

    def target_logprob(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """log p(target) for every position (text or speech targets). [...]"""
        text, digit, log_z = self.head(hidden)
        is_speech = targets >= self.speech_offset
        d = code_digits((targets - self.speech_offset).clamp(min=0), NUM_DIGITS)
        speech_logit = digit.gather(-1, d.unsqueeze(-1)).squeeze(-1).sum(-1)
        text_logit = text.gather(-1, targets.clamp(max=self.speech_offset - 1).unsqueeze(-1)).squeeze(-1)
        return torch.where(is_speech, speech_logit, text_logit) - log_z

    def full_log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """log p over the whole vocabulary (tests, small inputs only). [..., V]"""
        text, digit, log_z = self.head(hidden)
        codes = torch.arange(self.num_speech, device=hidden.device)
        d = code_digits(codes, NUM_DIGITS)  # [N, 8]
        speech = digit[..., torch.arange(NUM_DIGITS), d].sum(-1)  # [..., N, 8] -> [..., N]
        return torch.cat([text, speech], -1) - log_z.unsqueeze(-1)

    def speech_rows(self) -> torch.Tensor:
        d = code_digits(torch.arange(self.num_speech, device=self.digits.device), NUM_DIGITS)
        return self.digits[torch.arange(NUM_DIGITS, device=self.digits.device), d].sum(1)

    @torch.no_grad()
    def materialise(self):
        """A plain, tied LlamaForCausalLM with identical log-probs."""
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM(self.hf_config)
        body = {k: v for k, v in self.body.state_dict().items()}
        missing, _ = model.model.load_state_dict(body, strict=False)
        if set(missing) != {"embed_tokens.weight"}:
            raise RuntimeError(f"body weights did not map onto LlamaModel: missing {missing}")
        model.model.embed_tokens.weight.copy_(torch.cat([self.text, self.speech_rows()]))
        model.tie_weights()
        return model.eval()


def save_lm(model: FactorisedLM, tokenizer, export_dir: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Materialise and `save_pretrained` (+ tokenizer) into export_dir atomically."""
    export_dir = Path(export_dir)
    tmp = export_dir.with_name(export_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.materialise().to(dtype).save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    old = export_dir.with_name(export_dir.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if export_dir.exists():
        export_dir.rename(old)
    tmp.rename(export_dir)
    shutil.rmtree(old, ignore_errors=True)
    return export_dir


# ---------------------------------------------------------------- codes

def encode_corpus(corpus: Path, codec_dir: Path, codes_path: Path, progress=None, save_every: int = 200) -> dict:
    """Codec codes of every corpus utterance (cached in codes_path, resumable). {id: int32 array}"""
    codes: dict[str, np.ndarray] = {}
    if codes_path.is_file():
        codes = dict(np.load(codes_path))
    records = [r for r in read_manifest(corpus) if r["split"] != "codec_only"]  # the LM never reads the voice bank
    todo = [r for r in records if r["id"] not in codes]
    if todo:  # audio I/O and the codec only where codes are missing (a GPU machine gets them made)
        import soundfile as sf

        from pcgtts.runtime.audio.codec import Codec
        from pcgtts.train.codec import semantic_codes

        codec = Codec.from_pretrained(codec_dir, decode_only=False)
        encode = codec.encode
        first, _ = sf.read(str(Path(corpus) / todo[0]["path"]), dtype="float32")
        if np.array_equal(semantic_codes(codec.full, first), codec.encode(first)):  # a semonly codec: the fast path
            encode = functools.partial(semantic_codes, codec.full)
        for n, rec in enumerate(todo):
            audio, _ = sf.read(str(Path(corpus) / rec["path"]), dtype="float32")
            codes[rec["id"]] = encode(audio).astype(np.int32)
            if progress is not None:
                progress(n + 1, len(todo))
            if (n + 1) % save_every == 0 or n + 1 == len(todo):
                save_arrays(codes_path, codes)
    return codes


def pack_codes(corpus: Path, codec_dir: Path, codes_path: Path, out: Path,
               extra: Sequence[tuple[Path, Path]] = ()) -> Path:
    """An LM run's inputs as one compact file, for a machine with neither the audio nor the codec (small
    enough to copy with the repository): the manifest rows with codes, each utterance's codes as uint16 (half
    of codes.npz's int32) and the codec's config.json. `unpack_codes` rebuilds what `train lm` reads.

    `extra`: further (corpus, codes) pairs encoded with the same codec, e.g. another `train corpus --seed`
    rendered for more distinct text. Their train utterances join under ids prefixed "<corpus dir name>/";
    one whose text an earlier corpus already has is left out, so the first corpus's held-out sentences
    stay held out (and no sentence is counted twice)."""
    import gzip

    codes = dict(np.load(codes_path))
    rows = read_manifest(corpus)
    records = [r for r in rows if r["id"] in codes]
    if not records:
        raise ValueError(f"no utterance of {corpus} has codes in {codes_path}")
    texts = {r["text"] for r in rows}
    for more_corpus, more_codes_path in extra:
        more_codes, prefix = dict(np.load(more_codes_path)), Path(more_corpus).name + "/"
        for r in read_manifest(more_corpus):
            if r["split"] == "train" and r["id"] in more_codes and r["text"] not in texts:
                texts.add(r["text"])
                records.append({**r, "id": prefix + r["id"]})
                codes[prefix + r["id"]] = more_codes[r["id"]]
    flat = np.concatenate([codes[r["id"]] for r in records])
    if flat.min() < 0 or flat.max() >= NUM_SPEECH_TOKENS:
        raise ValueError("codes outside 0..65535 cannot be packed as uint16")
    manifest = gzip.compress("".join(json.dumps(r) + "\n" for r in records).encode())
    return save_arrays(out, {"codes": flat.astype(np.uint16),
                             "lengths": np.array([len(codes[r["id"]]) for r in records]),
                             "manifest": np.frombuffer(manifest, np.uint8),
                             "codec_config": np.frombuffer((Path(codec_dir) / "config.json").read_bytes(), np.uint8)})


def unpack_codes(packed: Path, root: Path) -> dict[str, Path]:
    """`pack_codes`'s file as `root`/corpus/manifest.jsonl, `root`/codec/config.json and `root`/codes.npz:
    `train lm --corpus root/corpus --codec root/codec` then trains without encoding (link codes.npz into --out)."""
    import gzip

    with np.load(packed) as npz:
        data = {name: npz[name] for name in npz.files}
    root = Path(root)
    paths = {"corpus": root / "corpus", "codec": root / "codec", "codes": root / "codes.npz"}
    paths["corpus"].mkdir(parents=True, exist_ok=True)
    paths["codec"].mkdir(exist_ok=True)
    manifest = gzip.decompress(data["manifest"].tobytes()).decode()
    (paths["corpus"] / "manifest.jsonl").write_text(manifest)
    (paths["codec"] / "config.json").write_bytes(data["codec_config"].tobytes())
    ids = [json.loads(line)["id"] for line in manifest.splitlines()]
    ends = np.cumsum(data["lengths"])
    flat = data["codes"].astype(np.int32)
    np.savez(paths["codes"], **{i: flat[e - n:e] for i, e, n in zip(ids, ends, data["lengths"])})
    return paths


# ---------------------------------------------------------------- examples

@dataclass(frozen=True)
class LMTrainConfig:
    corpus: Path
    codec: Path
    out_dir: Path
    model: LMModelConfig = LMModelConfig()
    steps: int = 6000
    batch_size: int = 8
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    voice_prompt_prob: float = 0.5  # share of examples prompted with a same-speaker reference
    # Speakers whose examples may go unprompted (None: all). A multi-speaker voice keeps one default speaker
    # for text without a voice: the others are only ever trained behind a voice prompt.
    unprompted_speakers: tuple[str, ...] | None = None
    # With unprompted_speakers: at least this share of examples is theirs, unprompted (the default voice's
    # reading kept strong while the others are learnt behind prompts); 0: sampled like any other speaker.
    unprompted_share: float = 0.0
    max_ref_seconds: float = 5.0
    max_tokens: int = 1024
    checkpoint_minutes: float = 5.0
    log_every: int = 20
    seed: int = 0
    threads: int = 1
    init_from: Path | None = None  # a committed voice folder (pcgtts/voice) whose target a fresh run starts from
    device: str = "cpu"  # "cuda": bf16 autocast on a GPU machine (weights and optimizer stay float32)
    max_minutes: float | None = None  # stop (checkpointed, resumable) after this long: a time budget
    # Alignment prior (train/align.py): weight (0: off), watched layers (None: the middle two), heads a layer, width g.
    align_weight: float = 0.0
    align_layers: tuple[int, ...] | None = None
    align_heads: int = 1
    align_width: float = 0.2

    def __post_init__(self) -> None:
        for name in ("corpus", "codec", "out_dir"):
            object.__setattr__(self, name, Path(getattr(self, name)))
        if self.steps < 1 or self.batch_size < 1 or self.max_tokens < 64:
            raise ValueError("steps and batch_size must be >= 1, max_tokens >= 64")
        if not 0 <= self.voice_prompt_prob <= 1 or not self.lr > 0:
            raise ValueError("voice_prompt_prob must lie in [0, 1] and lr be > 0")
        if not 0 <= self.unprompted_share < 1 or (self.unprompted_share and self.unprompted_speakers is None):
            raise ValueError("unprompted_share must lie in [0, 1) and needs unprompted_speakers")
        if self.checkpoint_minutes <= 0 or self.threads < 1:
            raise ValueError("checkpoint_minutes must be > 0 and threads >= 1")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise ValueError("max_minutes must be > 0")
        check_device(self.device)
        if self.align_weight < 0 or not self.align_width > 0 or self.align_heads < 1:
            raise ValueError("align_weight must be >= 0, align_width > 0 and align_heads >= 1")

    @property
    def watched_layers(self) -> tuple[int, ...]:
        if self.align_layers is not None:
            return tuple(self.align_layers)
        mid = self.model.num_layers // 2
        return tuple(sorted({max(mid - 1, 0), mid}))


class ExampleBuilder:
    """(ids, loss mask) of training examples in the runtime's prompt format."""

    def __init__(self, tokenizer, records: list[dict], codes: dict, cfg: LMTrainConfig):
        self.tok, self.cfg = tokenizer, cfg
        self.vocab = speech_vocab(tokenizer)
        self.records = [r for r in records if r["id"] in codes]
        if not self.records:
            raise ValueError("no utterances with codes to train on")
        self.codes = codes
        free = cfg.unprompted_speakers
        self.free_records = [r for r in self.records if free is not None and r["speaker"] in free]
        self.by_speaker: dict[str, list[dict]] = {}
        for r in self.records:
            if r["seconds"] <= cfg.max_ref_seconds:
                self.by_speaker.setdefault(r["speaker"], []).append(r)

    def example(self, rec: dict, ref: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
        codes = torch.as_tensor(self.codes[rec["id"]], dtype=torch.long)
        if ref is None:
            prompt = build_prompt(self.tok, self.vocab, rec["text"])
        else:
            prompt = build_prompt(self.tok, self.vocab, rec["text"], ref_text=ref["text"],
                                  ref_codes=torch.as_tensor(self.codes[ref["id"]], dtype=torch.long))
        target = torch.cat([self.vocab.codes_to_token_ids(codes), torch.tensor([self.vocab.stop_id])])
        ids = torch.cat([prompt, target])
        mask = torch.zeros(ids.numel(), dtype=torch.bool)
        mask[prompt.numel():] = True  # predict every target speech token and the stop token
        return ids, mask

    def sample(self, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
        free = self.cfg.unprompted_speakers
        for _ in range(100):
            if free is not None and self.free_records and rng.random() < self.cfg.unprompted_share:
                ids, mask = self.example(self.free_records[rng.randrange(len(self.free_records))], None)
                if ids.numel() <= self.cfg.max_tokens:
                    return ids, mask
                continue
            rec = self.records[rng.randrange(len(self.records))]
            ref = None
            if rng.random() < self.cfg.voice_prompt_prob or (free is not None and rec["speaker"] not in free):
                pool = [r for r in self.by_speaker.get(rec["speaker"], []) if r["id"] != rec["id"]]
                ref = pool[rng.randrange(len(pool))] if pool else None
            ids, mask = self.example(rec, ref)
            if ids.numel() <= self.cfg.max_tokens:
                return ids, mask
        raise ValueError(f"no example fits max_tokens={self.cfg.max_tokens}")

    def batch(self, size: int, rng: random.Random):
        """(ids, loss mask, attention mask), padded; + the alignment prior's places [B, 2, T] when it is on."""
        items = [self.sample(rng) for _ in range(size)]
        n = max(ids.numel() for ids, _ in items)
        pad = self.tok.pad_token_id
        ids = torch.full((size, n), pad, dtype=torch.long)
        mask = torch.zeros(size, n, dtype=torch.bool)
        attn = torch.zeros(size, n, dtype=torch.long)
        for i, (x, m) in enumerate(items):
            ids[i, :x.numel()], mask[i, :x.numel()], attn[i, :x.numel()] = x, m, 1
        if not getattr(self.cfg, "align_weight", 0):
            return ids, mask, attn
        v = self.vocab
        rel = torch.full((size, 2, n), -1.0)
        for i, (x, _) in enumerate(items):
            rel[i, :, :x.numel()] = relative_positions(x, v.text_start_id, v.text_end_id, v.speech_offset)
        return ids, mask, attn, rel


def lm_loss(model: FactorisedLM, ids: torch.Tensor, mask: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """Mean NLL (nats/token) of the masked targets; position t predicts ids[t + 1]."""
    hidden = model.hidden(ids[:, :-1], attention_mask=attn[:, :-1])
    sel = mask[:, 1:]
    return -model.target_logprob(hidden[sel], ids[:, 1:][sel]).mean()


def split_records(corpus: Path) -> tuple[list[dict], list[dict]]:
    records = read_manifest(corpus)
    return ([r for r in records if r["split"] == "train"],
            [r for r in records if r["split"] not in ("train", "codec_only")])


def train_loop(model: FactorisedLM, tokenizer, builder: ExampleBuilder, heldout: ExampleBuilder | None, cfg,
               out: Path, extra_state: dict, progress=None, stop_after: int | None = None, title: str = "LM") -> dict:
    """Shared by lm.py and draft.py: AdamW + cosine, checkpoint/resume, loss log + PNG, export."""
    torch.set_num_threads(cfg.threads)
    out.mkdir(parents=True, exist_ok=True)
    device = training_device(getattr(cfg, "device", "cpu"))
    model.to(device)

    def on_device(batch):
        return tuple(t.to(device, non_blocking=True) for t in batch)

    def autocast():  # bf16 matmuls on a GPU; float32 on a CPU (bf16 is no faster there)
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr, betas=(0.9, 0.95),
                            weight_decay=cfg.weight_decay)
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    ckpt = out / "checkpoint.pt"
    losses = LossLog(out / "loss.jsonl")
    step = resume(ckpt, model, opt, rng, losses, extra_state.get("model_config"))
    held_batch = on_device(heldout.batch(min(8, len(heldout.records)), random.Random(1))) if heldout else None

    def checkpoint() -> None:
        save_checkpoint(ckpt, {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
                               "rng": rng_state(rng), **extra_state})
        save_lm(model, tokenizer, out / "export")
        losses.plot(out / "loss.png", title=title, keys=("loss", "heldout"))
        log.info("checkpoint at step %d -> %s (export %s)", step, ckpt, out / "export")

    align = getattr(cfg, "align_weight", 0.0)
    if align:
        watch(model.body, cfg.watched_layers, cfg.align_heads)
    model.train()
    first, window, priors, t_ckpt = step, [], [], time.monotonic()
    t_start = t_ckpt
    batches = _prefetched(builder, cfg.batch_size, rng, cfg.steps - step) if device.type == "cuda" else None
    while step < cfg.steps:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        batch = next(batches) if batches is not None else builder.batch(cfg.batch_size, rng)
        batch = on_device(batch)
        with autocast():
            loss = lm_loss(model, *batch[:3])
            total = loss
            if align:  # the input is ids[:, :-1]: its places are rel[..., :-1]
                prior = alignment_prior(model.body, batch[3][..., :-1], cfg.align_width)
                total = loss + align * prior
                priors.append(float(prior.detach()))
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        window.append(float(loss.detach()))
        if step % cfg.log_every == 0 or step == cfg.steps:
            rec = {"step": step, "loss": sum(window) / len(window), "lr": opt.param_groups[0]["lr"]}
            if priors:
                rec["align"] = sum(priors) / len(priors)
            if held_batch is not None and step % (cfg.log_every * 5) == 0:
                model.eval()
                with torch.no_grad(), autocast():
                    rec["heldout"] = float(lm_loss(model, *held_batch[:3]))
                model.train()
            losses.append(rec)
            window, priors = [], []
            log.info("step %d loss %.4f%s%s", step, rec["loss"],
                     f" heldout {rec['heldout']:.4f}" if "heldout" in rec else "",
                     f" align {rec['align']:.4f}" if "align" in rec else "")
            if progress is not None:
                progress(step, cfg.steps, rec["loss"])
        if time.monotonic() - t_ckpt > cfg.checkpoint_minutes * 60:
            checkpoint()
            t_ckpt = time.monotonic()
        if stop_after is not None and step - first >= stop_after:
            break
        if getattr(cfg, "max_minutes", None) and time.monotonic() - t_start > cfg.max_minutes * 60:
            log.info("stopping at step %d after %.1f min (max_minutes); run again to go on", step, cfg.max_minutes)
            break
    checkpoint()
    return {"step": step, "steps": cfg.steps, "checkpoint": str(ckpt), "export": str(out / "export"),
            "loss_png": str(out / "loss.png"), "last_loss": losses.last("loss")}


def _prefetched(builder: ExampleBuilder, size: int, rng: random.Random, count: int, depth: int = 8):
    """`count` batches built on a background thread (a GPU step is shorter than building its batch on
    the host). The thread alone draws from `rng`, so the batch sequence is the same as in line; a run
    resumed from a checkpoint skips the batches that were queued when it was written. Batches are
    pinned when CUDA is there; an error on the thread is raised here, never left as a silent hang."""
    import queue
    import threading

    q: queue.Queue = queue.Queue(maxsize=depth)
    pin = torch.cuda.is_available()

    def work() -> None:
        try:
            for _ in range(count):
                batch = builder.batch(size, rng)
                q.put(tuple(t.pin_memory() for t in batch) if pin else batch)
        except BaseException as exc:  # handed to the consumer, which raises it
            q.put(exc)

    threading.Thread(target=work, daemon=True, name="lm-batches").start()
    for _ in range(count):
        item = q.get()
        if isinstance(item, BaseException):
            raise RuntimeError("building a training batch failed") from item
        yield item


def build_model(model_cfg: LMModelConfig, tokenizer, seed: int) -> FactorisedLM:
    vocab = speech_vocab(tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return FactorisedLM(model_cfg.to_hf(tokenizer), vocab.speech_offset, vocab.num_speech)


def train_lm(cfg: LMTrainConfig, progress=None, stop_after: int | None = None, codes: dict | None = None) -> dict:
    """Encode the corpus (cached), then train (or resume) the factorised target; exports a plain Llama."""
    out = cfg.out_dir
    train, held = split_records(cfg.corpus)
    unknown = set(cfg.unprompted_speakers or ()) - {r["speaker"] for r in train}
    if unknown:
        raise ValueError(f"--unprompted-speakers: no training speaker {', '.join(sorted(unknown))} in {cfg.corpus}")
    out.mkdir(parents=True, exist_ok=True)
    if codes is None:
        codes = encode_corpus(cfg.corpus, cfg.codec, out / "codes.npz")
    elif not (out / "codes.npz").is_file():  # given codes (tests, GPU-made): cache them for draft.py
        np.savez(out / "codes.npz", **codes)
    tokenizer = lab_tokenizer()
    builder = ExampleBuilder(tokenizer, train, codes, cfg)
    held_recs = [r for r in held if r["id"] in codes]
    heldout = ExampleBuilder(tokenizer, held_recs, codes, cfg) if held_recs else None
    model = build_model(cfg.model, tokenizer, cfg.seed)
    if cfg.init_from is not None and not (out / "checkpoint.pt").is_file():
        from pcgtts.runtime.voicepack import init_weights

        init_weights(model, cfg.init_from, "target", asdict(cfg.model))
    (out / "train_config.json").write_text(json.dumps(asdict(cfg), default=str, indent=2))
    summary = train_loop(model, tokenizer, builder, heldout, cfg, out,
                         {"model_config": asdict(cfg.model), "kind": "factorised-llasa"}, progress, stop_after,
                         title="target LM NLL (nats/token)")
    summary["train_utterances"] = len(builder.records)
    if heldout is not None and len(heldout.records) >= 2:
        summary["text_conditioning"] = text_conditioning(model, heldout)
        log.info("text conditioning on held-out utterances: %.3f nats/token", summary["text_conditioning"]["gain"])
    return summary


@torch.no_grad()
def text_conditioning(model: FactorisedLM, builder: ExampleBuilder, count: int = 64, seed: int = 0) -> dict:
    """How much the target uses the text: mean NLL (nats per speech token, no voice prompt) of `count`
    utterances' codes given their own transcript and given another utterance's (a random derangement,
    seeded). `gain` near 0 means the model ignores the text: it has learnt acoustics, not alignment."""
    rng = random.Random(seed)
    recs = rng.sample(builder.records, min(count, len(builder.records)))
    if len(recs) < 2:
        raise ValueError("text_conditioning needs at least 2 utterances")
    shift = rng.randrange(1, len(recs))
    device = next(model.parameters()).device
    model.eval()
    totals = {"own": [0.0, 0], "other": [0.0, 0]}
    for i, rec in enumerate(recs):
        other = dict(rec, text=recs[(i + shift) % len(recs)]["text"])
        for key, r in (("own", rec), ("other", other)):
            ids, mask = (t.to(device) for t in builder.example(r, None))
            hidden = model.hidden(ids[None, :-1])[0]
            sel = mask[1:]
            totals[key][0] -= float(model.target_logprob(hidden[sel], ids[1:][sel]).sum())
            totals[key][1] += int(sel.sum())
    own, other = (totals[k][0] / totals[k][1] for k in ("own", "other"))
    return {"utterances": len(recs), "nll_own_text": own, "nll_other_text": other, "gain": other - own}


def load_factorised(lm_dir: Path) -> tuple[FactorisedLM, object, dict]:
    """The factorised model saved in an lm training folder's checkpoint (draft.py starts from it)."""
    state = load_checkpoint(Path(lm_dir) / "checkpoint.pt")
    tokenizer = lab_tokenizer()
    model = build_model(LMModelConfig(**state["model_config"]), tokenizer, 0)
    model.load_state_dict(state["model"])
    return model, tokenizer, state


__all__ = ["LMModelConfig", "LMTrainConfig", "FactorisedLM", "ExampleBuilder", "lab_tokenizer",
           "encode_corpus", "pack_codes", "unpack_codes", "train_lm", "train_loop", "save_lm", "lm_loss", "build_model",
           "load_factorised", "text_conditioning"]

