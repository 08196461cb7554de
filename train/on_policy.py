"""What the proposers trained on the frozen target's own samples share (multi-token heads, EAGLE draft).

    OnPolicyConfig    the settings every such run has (paths, sentences, sequence counts, schedule)
    frozen_target_and_pairs   the loaded, frozen target with its on-policy pairs
    on_policy_pairs   (prompt, codes) the target sampled itself, train / held-out sentences apart,
                      cached in the work folder with train/distill.py's sequence cache
    fit               AdamW with a 20-step warm-up and a cosine decay, resumable from a checkpoint
                      in the work folder, with a loss log (JSONL + PNG) and progress
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from pcgtts.train.progress import LossLog, load_checkpoint, rng_state, save_checkpoint, set_rng_state

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OnPolicyConfig:
    target: Path
    out: Path  # the trained file (default: next to the target, where the runtime finds it)
    work_dir: Path  # generated sequences, checkpoint, loss log
    sentences: tuple[str, ...]
    sequences: int = 48  # on-policy training sequences (one per sentence, cycling)
    heldout: int = 8  # further sequences for the before/after figures
    steps: int = 400
    lr: float = 2e-3
    temperature: float = 0.8  # of the on-policy sampling
    max_tokens: int = 400  # speech tokens per generated sequence at most
    seed: int = 0
    checkpoint_minutes: float = 5.0
    log_every: int = 20
    threads: int | None = None
    device: str = "cpu"  # where the target samples and the proposer trains ("cuda" on a GPU machine)
    sample_batch: int = 1  # on-policy sequences sampled at once (> 1: `distill.sample_together`)
    max_minutes: float | None = None  # training ends at `steps` or after this long, the lr's cosine following the nearer end
    end_by: float | None = None  # or by this wall-clock time (epoch seconds): a deadline, sampling counted

    def __post_init__(self) -> None:
        for name in ("target", "out", "work_dir"):
            object.__setattr__(self, name, Path(getattr(self, name)))
        if not self.sentences:
            raise ValueError("no training sentences")
        for name in ("sequences", "heldout", "steps", "max_tokens", "log_every", "sample_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0 or not self.temperature > 0 or not self.checkpoint_minutes > 0:
            raise ValueError("lr, temperature and checkpoint_minutes must be > 0")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise ValueError(f"max_minutes must be > 0, got {self.max_minutes}")
        if torch.device(self.device).type not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")


def frozen_target_and_pairs(cfg: OnPolicyConfig, progress=None):
    """(the target, frozen, on `cfg.device`; train pairs; held-out pairs) for a run of `cfg`."""
    from pcgtts.runtime.lm.torch_lm import TorchLM

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    cfg.work_dir.mkdir(parents=True, exist_ok=True)
    target = TorchLM.load(cfg.target, device=cfg.device, max_length=4096, cuda_graphs=False)
    train, heldout = on_policy_pairs(target, cfg, progress)
    target.model.requires_grad_(False)
    return target, train, heldout


def on_policy_pairs(target, cfg: OnPolicyConfig, progress=None) -> tuple[list, list]:
    """(prompt, codes) pairs of the target's own samples: (train, held-out), cached in `cfg.work_dir`
    (a resumed or repeated run reuses them)."""
    from pcgtts.runtime.text.prompt import build_prompt
    from pcgtts.train.distill import on_policy_sequences, split_sentences

    sentences = list(cfg.sentences)
    train_s, heldout_s = split_sentences(sentences, cfg.seed)
    prompts = {"train": [build_prompt(target.tokenizer, target.vocab, s) for s in train_s],
               "heldout": [build_prompt(target.tokenizer, target.vocab, s) for s in heldout_s]}
    cache = on_policy_sequences(target, prompts, {"heldout": cfg.heldout, "train": cfg.sequences}, sentences,
                                cfg.temperature, cfg.max_tokens, cfg.seed, cfg.work_dir / "sequences.npz", progress,
                                cfg.sample_batch)
    pairs = {split: [(seq.prompt, seq.generated) for seq in cache.splits[split]] for split in ("train", "heldout")}
    return pairs["train"][:cfg.sequences], pairs["heldout"][:cfg.heldout]


def fit(module: torch.nn.Module, loss_step: Callable[[random.Random], tuple[torch.Tensor, dict]], cfg: OnPolicyConfig,
        name: str, title: str, identity: dict, progress=None, clip: float | None = None) -> int:
    """Train `module` for `cfg.steps` steps of `loss_step(rng) -> (loss, extra figures to log)`, or
    for `cfg.max_minutes` if that ends first (the cosine then follows the clock: a time budget).

    Resumes from `<work_dir>/<name>checkpoint.pt` (module, optimiser, rng, step), refusing one whose
    `identity` entries (e.g. the number of heads) differ; logs to `<name>loss.jsonl`. Returns the step reached."""
    opt = torch.optim.AdamW(module.parameters(), lr=cfg.lr, weight_decay=0.0)
    rng = random.Random(cfg.seed)
    ckpt = cfg.work_dir / f"{name}checkpoint.pt"
    losses = LossLog(cfg.work_dir / f"{name}loss.jsonl")
    step, spent = 0, 0.0  # spent: seconds trained by earlier calls
    if ckpt.is_file():
        state = load_checkpoint(ckpt)
        for key, value in identity.items():
            if state.get(key) != value:
                raise ValueError(f"{ckpt} was trained with {key} = {state.get(key)}, not {value}; use another --work-dir")
        module.load_state_dict(state["module"])
        opt.load_state_dict(state["optimizer"])
        set_rng_state(state["rng"], rng)
        step, spent = state["step"], state.get("seconds", 0.0)
        losses.truncate(step)
        log.info("resumed %s at step %d", ckpt, step)
    (cfg.work_dir / f"{name}train_config.json").write_text(json.dumps(asdict(cfg), default=str, indent=2))

    t_start = time.monotonic()

    def seconds() -> float:
        return spent + time.monotonic() - t_start

    def checkpoint() -> None:
        save_checkpoint(ckpt, {"module": module.state_dict(), "optimizer": opt.state_dict(), "step": step,
                               "rng": rng_state(rng), "seconds": seconds(), **identity})

    until_end = cfg.end_by - time.time() if cfg.end_by is not None else None  # seconds this call may train

    def progress_made() -> float:  # the share of the run behind us: by steps, or by a clock if nearer its end
        by_clock = seconds() / (cfg.max_minutes * 60) if cfg.max_minutes else 0.0
        if until_end is not None:
            by_clock = max(by_clock, (time.monotonic() - t_start) / until_end if until_end > 0 else 1.0)
        return max(step / cfg.steps, by_clock)

    t_ckpt, window = time.monotonic(), []
    while (done := progress_made()) < 1.0:
        lr = cfg.lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(done * math.pi))
        for group in opt.param_groups:
            group["lr"] = lr
        loss, figures = loss_step(rng)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        opt.step()
        step += 1
        window.append(float(loss.detach()))
        if step % cfg.log_every == 0 or progress_made() >= 1.0:
            losses.append({"step": step, "loss": sum(window) / len(window), "lr": lr, **figures})
            window = []
            if progress is not None:
                progress(step, cfg.steps, losses.last("loss"))
        if time.monotonic() - t_ckpt > cfg.checkpoint_minutes * 60:
            checkpoint()
            t_ckpt = time.monotonic()
    if step < cfg.steps:
        log.info("stopped at step %d of %d after %.1f min (max_minutes / end_by)", step, cfg.steps, seconds() / 60)
    checkpoint()
    losses.plot(cfg.work_dir / f"{name}loss.png", title=title)
    return step


__all__ = ["OnPolicyConfig", "frozen_target_and_pairs", "on_policy_pairs", "fit"]
