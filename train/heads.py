"""Train multi-token heads on a frozen target (`pcgtts train heads`), and its code transitions.

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

`pcgtts train transitions` estimates the code transition table (runtime/decode/transitions.py) that
mtp-viterbi searches with, from the same on-policy sequences or from code files.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from pcgtts.runtime.lm.heads import MTPHeads
from pcgtts.train.on_policy import OnPolicyConfig, fit, frozen_target_and_pairs


@dataclass(frozen=True)
class HeadsTrainConfig(OnPolicyConfig):
    num_heads: int = 4
    batch_rows: int = 256

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_heads < 1 or self.batch_rows < 1:
            raise ValueError(f"num_heads and batch_rows must be >= 1, got {self.num_heads}, {self.batch_rows}")


@dataclass
class HiddenRows:
    """Cached target states of generated sequences: row j predicts the sequence's next token."""

    hidden: torch.Tensor  # [N, D] final-normed states
    left: torch.Tensor  # [N] int64: rows after j in the same sequence (head i valid where i <= left)
    tokens: list[torch.Tensor] = field(default_factory=list)  # per sequence: speech codes (restricted ids)


def sequence_rows(target, sequences: list[tuple[torch.Tensor, torch.Tensor]], device: str | torch.device = "cpu",
                  batch: int = 1) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(per sequence: the target's rows [len(codes), D] from the prompt's last token to the one
    before the final code, each predicting a code, on `device`; per sequence: its codes), in the
    order given; sequences of fewer than two codes are skipped. `batch` sequences a target pass
    (similar lengths together, padded on the left as `distill.left_padded` pads prompts; the same
    rows to rounding; one a pass gives the runtime's rows bit for bit): on a GPU, thousands of
    sequences in seconds rather than minutes. Plain tensors (not inference-mode ones), so heads can
    train on them."""
    from pcgtts.train.distill import left_padded

    kept = [(prompt, codes) for prompt, codes in sequences if len(codes) >= 2]
    if not kept:
        raise ValueError("the target generated no sequence of two or more codes")
    ids = [torch.cat([prompt, target.vocab.restricted_to_token_ids(codes[:-1])]) for prompt, codes in kept]
    states: list[torch.Tensor | None] = [None] * len(kept)
    model, order = target.model, sorted(range(len(kept)), key=lambda i: len(ids[i]))
    with torch.no_grad():
        for first in range(0, len(order), batch):
            chunk = order[first:first + batch]
            padded, filled = (x.to(target.device) for x in left_padded([ids[i] for i in chunk], 0))
            t = padded.shape[1]
            model.setup_cache(t, batch_size=len(chunk))
            hidden = model.hidden(padded, torch.arange(t, device=target.device), end=t, filled=filled)
            for row, i in enumerate(chunk):  # a row's sequence ends the padded row: its last len(codes) states
                states[i] = hidden[row, t - len(kept[i][1]):].float().to(device).clone()  # row j predicts codes[j]
    target.release()  # the cache was sized for the passes
    target.ensure_cache()
    return states, [codes for _, codes in kept]


def hidden_rows(target, sequences: list[tuple[torch.Tensor, torch.Tensor]], device: str | torch.device = "cpu") -> HiddenRows:
    """`sequence_rows` joined: every row of every sequence, with the rows left after each."""
    states, tokens = sequence_rows(target, sequences, device)
    left = [torch.arange(len(rows) - 1, -1, -1) for rows in states]
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


def train_heads(cfg: HeadsTrainConfig, progress=None, generation_progress=None) -> dict:
    """Generate (or reuse) on-policy sequences, train the heads (resumable), write `cfg.out`."""
    target, train_seqs, heldout_seqs = frozen_target_and_pairs(cfg, generation_progress)
    rows, heldout = hidden_rows(target, train_seqs), hidden_rows(target, heldout_seqs)
    to_logits = target.model.logits  # the target's own head: the targets and the heads' shared unembedding
    heads = MTPHeads(cfg.num_heads, target.model.head.in_features, target.fingerprint)
    before = evaluate_heads(heads, to_logits, heldout)
    n_rows = len(rows.hidden)

    def loss_step(rng: random.Random):
        index = torch.tensor([rng.randrange(n_rows) for _ in range(cfg.batch_rows)])
        return head_losses(heads, to_logits, rows, index)[0], {}

    step = fit(heads, loss_step, cfg, "", "multi-token heads: KL to the target", {"num_heads": cfg.num_heads}, progress)
    after = evaluate_heads(heads, to_logits, heldout)
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    heads.save(cfg.out)
    return {"heads": str(cfg.out), "num_heads": cfg.num_heads, "steps": step, "train_rows": n_rows,
            "heldout_rows": len(heldout.hidden), "agree_before": before["agree"], "agree_after": after["agree"],
            "accept_before": before["accept"], "accept_after": after["accept"],
            "loss_png": str(cfg.work_dir / "loss.png")}


__all__ = ["HeadsTrainConfig", "HiddenRows", "sequence_rows", "hidden_rows", "head_losses", "evaluate_heads",
           "train_heads"]
