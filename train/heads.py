"""Train multi-token heads on a frozen target (`pcgtts heads train`), and its code transitions.

Data flow: training sentences -> prompts -> the target itself samples speech (on-policy, plain AR
through the runtime's decode loop) -> one target pass per sequence caches the final hidden states
h_j -> head i at row j is trained towards the target's own next-token distribution at row j + i
(the distribution of token j + i + 1, which head i must predict from h_j alone):

    loss = sum_i  KL( p_target(. | h_{j+i}) || q_i(. | h_j) )       over the restricted vocabulary

Soft targets are the best a head that cannot see tokens j+1 .. j+i can aim for (their average
over what the target would sample), with lower variance than the sampled tokens. The target's
distributions are recomputed from the cached states (one matmul with its head), so nothing of
size 65,536 per position is stored. Reported per head, on held-out sequences, before and after:
top-1 agreement with the target and the SD acceptance 1 - TV(p, q) of its proposals.

`pcgtts heads transitions` estimates the code transition table (groups/transitions.py) that
mtp-viterbi searches with, from the same on-policy sequences or from code files.
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from pcgtts.runtime.lm.heads import HEADS_FILE, MTPHeads
from pcgtts.train.progress import LossLog, load_checkpoint, rng_state, save_checkpoint, set_rng_state

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeadsTrainConfig:
    target: Path
    out: Path  # the heads file (default: <target>/mtp_heads.safetensors)
    work_dir: Path  # generated sequences, checkpoint, loss log
    sentences: tuple[str, ...]
    num_heads: int = 4
    sequences: int = 48  # on-policy training sequences (one per sentence, cycling)
    heldout: int = 8  # further sequences for the before/after figures
    steps: int = 400
    batch_rows: int = 256
    lr: float = 2e-3
    temperature: float = 0.8  # of the on-policy sampling
    max_tokens: int = 400  # speech tokens per generated sequence at most
    seed: int = 0
    checkpoint_minutes: float = 5.0
    log_every: int = 20
    threads: int | None = None

    def __post_init__(self) -> None:
        for name in ("target", "out", "work_dir"):
            object.__setattr__(self, name, Path(getattr(self, name)))
        if not self.sentences:
            raise ValueError("no training sentences")
        for name in ("num_heads", "sequences", "heldout", "steps", "batch_rows", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0 or not self.temperature > 0:
            raise ValueError("lr and temperature must be > 0")


@dataclass
class HiddenRows:
    """Cached target states of generated sequences: row j predicts the sequence's next token."""

    hidden: torch.Tensor  # [N, D] final-normed states
    left: torch.Tensor  # [N] int64: rows after j in the same sequence (head i valid where i <= left)
    tokens: list[torch.Tensor] = field(default_factory=list)  # per sequence: speech codes (restricted ids)


def hidden_rows(target, sequences: list[tuple[torch.Tensor, torch.Tensor]]) -> HiddenRows:
    """One target pass per sequence; keeps the rows from the prompt's last token to the one
    before the final code (each predicts a code). Plain tensors (not inference-mode ones), so
    the heads can train on them."""
    states, left, tokens = [], [], []
    for prompt, codes in sequences:
        if len(codes) < 2:
            continue
        ids = torch.cat([prompt, target.vocab.restricted_to_token_ids(codes[:-1])])
        target.rollback(0)
        _, hidden = target.forward_hidden(ids)
        rows = hidden[len(prompt) - 1:]  # [len(codes), D]: row j predicts codes[j]
        states.append(rows.float().cpu().clone())
        left.append(torch.arange(len(rows) - 1, -1, -1))
        tokens.append(codes)
    target.rollback(0)
    if not states:
        raise ValueError("the target generated no sequence of two or more codes")
    return HiddenRows(torch.cat(states), torch.cat(left), tokens)


def head_losses(heads: MTPHeads, to_logits, rows: HiddenRows, index: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Mean over heads of KL(target at j+i || head i at j) for rows `index` [B]; also per-head
    top-1 agreement and SD acceptance 1 - TV (no gradient)."""
    hidden = rows.hidden
    latents = heads.latents(hidden[index])  # [B, k, D]
    total, figures = hidden.new_zeros(()), {"agree": [], "accept": []}
    for i in range(heads.num_heads):
        valid = rows.left[index] >= i + 1
        if not valid.any():
            figures["agree"].append(float("nan"))
            figures["accept"].append(float("nan"))
            continue
        rows_i = index[valid]
        with torch.no_grad():
            p = torch.softmax(to_logits(hidden[rows_i + i + 1]), -1)  # the target at row j + i + 1
        log_q = torch.log_softmax(to_logits(latents[valid, i]), -1)
        # 0 where p is 0 (codes a used-codes head leaves out have log q = -inf there too)
        kl = torch.where(p > 0, p * (torch.log(p.clamp_min(1e-30)) - log_q), 0.0).sum(-1).mean()
        total = total + kl
        with torch.no_grad():
            q = log_q.exp()
            figures["agree"].append(float((q.argmax(-1) == p.argmax(-1)).float().mean()))
            figures["accept"].append(float(1.0 - 0.5 * (p - q).abs().sum(-1).mean()))
    return total / heads.num_heads, figures


def evaluate_heads(heads: MTPHeads, to_logits, rows: HiddenRows, batch: int = 512) -> dict:
    """Per-head top-1 agreement with the target and SD acceptance, over every row."""
    sums = {"agree": [0.0] * heads.num_heads, "accept": [0.0] * heads.num_heads}
    counts = [0] * heads.num_heads
    with torch.no_grad():
        for start in range(0, len(rows.hidden), batch):
            index = torch.arange(start, min(start + batch, len(rows.hidden)))
            _, figures = head_losses(heads, to_logits, rows, index)
            for i in range(heads.num_heads):
                n = int((rows.left[index] >= i + 1).sum())
                if n:
                    counts[i] += n
                    for key in sums:
                        sums[key][i] += figures[key][i] * n
    return {key: [round(v / c, 4) if c else None for v, c in zip(vals, counts)] for key, vals in sums.items()}


def on_policy_pairs(target, sentences: tuple[str, ...], sequences: int, heldout: int, temperature: float,
                    max_tokens: int, seed: int, work_dir: Path, progress=None) -> tuple[list, list]:
    """(prompt, codes) pairs of the target's own samples, train / held-out sentences kept apart,
    cached in `work_dir` with train/distill.py's sequence cache (a resumed run reuses them).
    Shared by the multi-token heads and the EAGLE draft (train/eagle.py)."""
    from pcgtts.runtime.text.prompt import build_prompt
    from pcgtts.train.distill import on_policy_sequences, split_sentences

    sentences = list(sentences)
    train_s, heldout_s = split_sentences(sentences, seed)
    prompts = {"train": [build_prompt(target.tokenizer, target.vocab, s) for s in train_s],
               "heldout": [build_prompt(target.tokenizer, target.vocab, s) for s in heldout_s]}
    cache = on_policy_sequences(target, prompts, {"heldout": heldout, "train": sequences}, sentences,
                                temperature, max_tokens, seed, Path(work_dir) / "sequences.npz", progress)
    pairs = {split: [(seq.prompt, seq.generated) for seq in cache.splits[split]] for split in ("train", "heldout")}
    return pairs["train"][:sequences], pairs["heldout"][:heldout]


def train_heads(cfg: HeadsTrainConfig, progress=None, generation_progress=None) -> dict:
    """Generate (or reuse) on-policy sequences, train the heads (resumable), write `cfg.out`."""
    from pcgtts.runtime.lm.torch_lm import TorchLM

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    cfg.work_dir.mkdir(parents=True, exist_ok=True)
    target = TorchLM.load(cfg.target, max_length=4096)
    train_seqs, heldout_seqs = on_policy_pairs(target, cfg.sentences, cfg.sequences, cfg.heldout, cfg.temperature,
                                                cfg.max_tokens, cfg.seed, cfg.work_dir, generation_progress)
    rows, heldout = hidden_rows(target, train_seqs), hidden_rows(target, heldout_seqs)
    target.model.requires_grad_(False)
    to_logits = target.model.logits  # the target's own head: the targets and the heads' shared unembedding
    heads = MTPHeads(cfg.num_heads, target.model.head.in_features, target.fingerprint)
    before = evaluate_heads(heads, to_logits, heldout)
    opt = torch.optim.AdamW(heads.parameters(), lr=cfg.lr, weight_decay=0.0)
    rng = random.Random(cfg.seed)
    ckpt = cfg.work_dir / "checkpoint.pt"
    losses = LossLog(cfg.work_dir / "loss.jsonl")
    step = 0
    if ckpt.is_file():
        state = load_checkpoint(ckpt)
        if state["num_heads"] != cfg.num_heads:
            raise ValueError(f"{ckpt} holds {state['num_heads']} heads, not {cfg.num_heads}; use another --work-dir")
        heads.load_state_dict(state["heads"])
        opt.load_state_dict(state["optimizer"])
        set_rng_state(state["rng"], rng)
        step = state["step"]
        losses.truncate(step)
        log.info("resumed %s at step %d", ckpt, step)
    (cfg.work_dir / "train_config.json").write_text(json.dumps(asdict(cfg), default=str, indent=2))

    def checkpoint() -> None:
        save_checkpoint(ckpt, {"heads": heads.state_dict(), "optimizer": opt.state_dict(), "step": step,
                               "rng": rng_state(rng), "num_heads": cfg.num_heads})

    t_ckpt, window = time.monotonic(), []
    n_rows = len(rows.hidden)
    while step < cfg.steps:
        lr = cfg.lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + torch.cos(torch.tensor(step / cfg.steps * torch.pi)).item())
        for group in opt.param_groups:
            group["lr"] = lr
        index = torch.tensor([rng.randrange(n_rows) for _ in range(cfg.batch_rows)])
        loss, _ = head_losses(heads, to_logits, rows, index)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        window.append(float(loss.detach()))
        if step % cfg.log_every == 0 or step == cfg.steps:
            losses.append({"step": step, "loss": sum(window) / len(window), "lr": lr})
            window = []
            if progress is not None:
                progress(step, cfg.steps, losses.last("loss"))
        if time.monotonic() - t_ckpt > cfg.checkpoint_minutes * 60:
            checkpoint()
            t_ckpt = time.monotonic()
    checkpoint()
    after = evaluate_heads(heads, to_logits, heldout)
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    heads.save(cfg.out)
    losses.plot(cfg.work_dir / "loss.png", title="multi-token heads: KL to the target")
    return {"heads": str(cfg.out), "num_heads": cfg.num_heads, "steps": step, "train_rows": n_rows,
            "heldout_rows": len(heldout.hidden), "agree_before": before["agree"], "agree_after": after["agree"],
            "accept_before": before["accept"], "accept_after": after["accept"],
            "loss_png": str(cfg.work_dir / "loss.png")}


def default_out(target: Path) -> Path:
    return Path(target) / HEADS_FILE


__all__ = ["HeadsTrainConfig", "HiddenRows", "hidden_rows", "on_policy_pairs", "head_losses", "evaluate_heads",
           "train_heads", "default_out"]
