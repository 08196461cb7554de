"""Train an EAGLE-style feature draft on a frozen target (`pcgtts heads eagle`; runtime/lm/eagle.py).

Data flow, as for the multi-token heads (train/heads.py): training sentences -> prompts -> the
target samples speech itself (on-policy, cached with train/distill.py's sequence cache) -> one
target pass per sequence gives its final-normed states h_j and the codes x_{j+1} it chose.

The draft reads (h_j, x_{j+1}) and must give the target's distribution of x_{j+2}, p(. | h_{j+1}):

    loss = KL(p_target(. | h_{j+1}) || q(. | f_j))                    pass 1: true states in
         + KL(p_target(. | h_{j+1}) || q(. | f'_j))                   pass 2: f_{j-1} replaces h_j
         + regression * SmoothL1(f_j, h_{j+1})

Pass 2 is what the draft meets from its second proposal on (its own prediction in place of the
target's state); the KL is taken on a random subset of rows (the 65,537-way distributions are
the cost), the block runs over whole sequences. Reported on held-out sequences, before and after:
the SD acceptance 1 - TV(p, q) at temperature 1 and top-1 agreement, for pass 1 (first proposal)
and pass 2 (later proposals).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from pcgtts.runtime.lm.eagle import EagleDraft
from pcgtts.train.on_policy import OnPolicyConfig, fit, frozen_target_and_pairs


@dataclass(frozen=True)
class EagleTrainConfig(OnPolicyConfig):
    sequences: int = 120
    heldout: int = 12
    steps: int = 600
    lr: float = 1e-3
    batch_sequences: int = 4
    kl_rows: int = 192  # rows per pass whose full distributions enter the loss
    regression: float = 0.1
    intermediate_size: int | None = None  # the block's MLP width (default: the target's)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.batch_sequences < 1 or self.kl_rows < 1 or self.regression < 0:
            raise ValueError("batch_sequences and kl_rows must be >= 1, regression >= 0")


@dataclass
class StateSequences:
    """Per sequence: the target's states [n, D] (row j predicts codes[j]) and token embeddings of codes [n, D]."""

    states: list[torch.Tensor]
    embeds: list[torch.Tensor]

    def batch(self, index: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Padded (states [B, T, D], embeds [B, T, D], valid [B, T - 1]): valid[j] = row j has a next row."""
        t = max(len(self.states[i]) for i in index)
        d = self.states[0].shape[1]
        states = torch.zeros(len(index), t, d)
        embeds = torch.zeros(len(index), t, d)
        valid = torch.zeros(len(index), t - 1, dtype=torch.bool)
        for b, i in enumerate(index):
            n = len(self.states[i])
            states[b, :n], embeds[b, :n], valid[b, :n - 1] = self.states[i], self.embeds[i], True
        return states, embeds, valid


def state_sequences(target, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> StateSequences:
    from pcgtts.train.heads import hidden_rows

    rows = hidden_rows(target, pairs)
    sizes = [len(codes) for codes in rows.tokens]
    states = list(torch.split(rows.hidden, sizes))
    with torch.no_grad():
        embeds = [target.model.embed_tokens(target.vocab.restricted_to_token_ids(codes)).float().clone()
                  for codes in rows.tokens]
    return StateSequences(states, embeds)


def _kl_and_figures(p_logits: torch.Tensor, q_logits: torch.Tensor) -> tuple[torch.Tensor, float, float]:
    """KL(p || q) mean over rows, and (no grad) SD acceptance 1 - TV and top-1 agreement."""
    p = torch.softmax(p_logits, -1)
    log_q = torch.log_softmax(q_logits, -1)
    kl = torch.where(p > 0, p * (torch.log(p.clamp_min(1e-30)) - log_q), 0.0).sum(-1).mean()
    with torch.no_grad():
        q = log_q.exp()
        accept = float(1.0 - 0.5 * (p - q).abs().sum(-1).mean())
        agree = float((q.argmax(-1) == p.argmax(-1)).float().mean())
    return kl, accept, agree


def eagle_losses(draft: EagleDraft, to_logits, data: StateSequences, index: list[int], kl_rows: int,
                 regression: float, rng: random.Random) -> tuple[torch.Tensor, dict]:
    """The training loss on sequences `index`, with per-pass acceptance / agreement figures."""
    states, embeds, valid = data.batch(index)
    inputs, nexts = states[:, :-1], states[:, 1:]
    f1 = draft.train_features(inputs, embeds[:, :-1])
    # Pass 2: at j >= 1 the draft's own f_{j-1} stands in for h_j (what later proposals see).
    f2 = draft.train_features(torch.cat([inputs[:, :1], f1[:, :-1]], dim=1), embeds[:, :-1])
    rows = valid.nonzero()
    pick = rows[torch.tensor(rng.sample(range(len(rows)), min(kl_rows, len(rows))))]
    b, j = pick[:, 0], pick[:, 1]
    with torch.no_grad():
        p_logits = to_logits(nexts[b, j])
    kl1, acc1, agree1 = _kl_and_figures(p_logits, to_logits(f1[b, j]))
    kl2, acc2, agree2 = _kl_and_figures(p_logits, to_logits(f2[b, j]))
    reg = torch.nn.functional.smooth_l1_loss(f1[valid], nexts[valid])
    loss = kl1 + kl2 + regression * reg
    return loss, {"accept": [acc1, acc2], "agree": [agree1, agree2], "regression": float(reg.detach())}


def evaluate_eagle(draft: EagleDraft, to_logits, data: StateSequences, kl_rows: int = 512) -> dict:
    """Held-out acceptance (1 - TV at temperature 1) and agreement for pass 1 and pass 2, per sequence pooled."""
    sums, count = {"accept": [0.0, 0.0], "agree": [0.0, 0.0]}, 0
    rng = random.Random(0)
    with torch.no_grad():
        for i in range(len(data.states)):
            _, figures = eagle_losses(draft, to_logits, data, [i], kl_rows, 0.0, rng)
            for key in sums:
                sums[key] = [s + v for s, v in zip(sums[key], figures[key])]
            count += 1
    return {key: [round(v / count, 4) for v in vals] for key, vals in sums.items()}


def train_eagle(cfg: EagleTrainConfig, progress=None, generation_progress=None) -> dict:
    """Generate (or reuse) on-policy sequences, train the draft (resumable), write `cfg.out`."""
    target, train_pairs, heldout_pairs = frozen_target_and_pairs(cfg, generation_progress)
    data, heldout = state_sequences(target, train_pairs), state_sequences(target, heldout_pairs)
    to_logits = target.model.logits
    draft = EagleDraft(target.model.args, target.fingerprint, cfg.intermediate_size)
    with torch.no_grad():  # start from the target's last block and final norm: a sensible next-state map
        m = draft.args.intermediate_size  # (a narrower MLP keeps the first m hidden units)
        draft.block.load_state_dict({k: v[:m] if k.startswith("mlp.gate_proj") or k.startswith("mlp.up_proj")
                                     else v[:, :m] if k == "mlp.down_proj.weight" else v
                                     for k, v in target.model.layers[-1].state_dict().items()})
        draft.norm.weight.copy_(target.model.norm.weight)
        d = target.model.args.hidden_size
        draft.fc.weight.zero_()
        draft.fc.weight[:, :d] = torch.eye(d)  # e_j = h_j at first
    before = evaluate_eagle(draft, to_logits, heldout)

    def loss_step(rng: random.Random):
        index = [rng.randrange(len(data.states)) for _ in range(cfg.batch_sequences)]
        loss, figures = eagle_losses(draft, to_logits, data, index, cfg.kl_rows, cfg.regression, rng)
        return loss, {"accept1": figures["accept"][0], "accept2": figures["accept"][1]}

    step = fit(draft, loss_step, cfg, "eagle_", "EAGLE draft: KL to the target",
               {"intermediate_size": draft.args.intermediate_size}, progress, clip=1.0)
    after = evaluate_eagle(draft, to_logits, heldout)
    draft.acceptance = sum(after["accept"]) / len(after["accept"])
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    draft.save(cfg.out)
    return {"draft": str(cfg.out), "steps": step, "train_sequences": len(data.states),
            "heldout_sequences": len(heldout.states),
            "accept_before": before["accept"], "accept_after": after["accept"],
            "agree_before": before["agree"], "agree_after": after["agree"],
            "loss_png": str(cfg.work_dir / "eagle_loss.png")}


__all__ = ["EagleTrainConfig", "StateSequences", "state_sequences", "eagle_losses", "evaluate_eagle",
           "train_eagle"]
