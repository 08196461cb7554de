"""Train an EAGLE-style feature draft on a frozen target (`pcgtts train eagle`; runtime/lm/eagle.py).

Data flow, as for the multi-token heads (train/heads.py): training sentences -> prompts -> the
target samples speech itself (on-policy, cached with train/distill.py's sequence cache) -> one
target pass per sequence gives its final-normed states h_j and the codes x_{j+1} it chose.

The draft reads (h_j, x_{j+1}) and must give the target's distribution of x_{j+2}, p(. | h_{j+1})
(with `feature_layers`, h_j comes with those layers' outputs, fused by the draft: EAGLE-3's features):

    loss = KL(p_target(. | h_{j+1}) || q(. | f_j))                    pass 1: true states in
         + KL(p_target(. | h_{j+1}) || q(. | f'_j))                   pass 2: f_{j-1} replaces h_j
         + ...                                                        pass k: pass k-1's f replaces h
         + regression * SmoothL1(f_j, h_{j+1})

Pass k is what the draft meets at its k-th proposal (its own predictions in place of the
target's states). With a digit-factorised target head the KL of every row is taken in closed
form (`digit_head.digit_kl`, 34 scores a row); with any other head on a random subset of rows
(the 65,537-way distributions are the cost). `--loss tv` / `tv+group` replace the KL by what the
rules lose (train/distill.py's losses, DistillSpec's point): 1 - TV is SD's acceptance and 1 - the
group TV PCG's, at the sampling temperature, on `kl_rows` random rows a pass. The block runs over whole sequences. Reported on
held-out sequences, before and after: the SD acceptance 1 - TV(p, q) at temperature 1 and top-1
agreement, per pass. Then the draft's own temperature is fitted on the same held-out rows
(`fit_temperature_scales`): at each of a few sampling temperatures T, the factor f whose draft at
T * f is accepted most (1 - TV against the target at T, over the passes), stored with the draft
(`eagle.proposal_temperature`). `pcgtts train eagle-temperatures` fits them for a trained draft.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from pcgtts.runtime.lm.digit_head import digit_kl
from pcgtts.runtime.lm.eagle import BLOCKS, EagleDraft, checked_feature_layers
from pcgtts.train.distill import LOSSES, CoarseMasses, distill_loss
from pcgtts.train.on_policy import OnPolicyConfig, fit, frozen_target_and_pairs


STATE_BATCH = 32  # sequences a target pass when collecting states (CPU: ~1.6x faster than one at a time)
FIT_TEMPERATURES = (0.2, 0.5, 0.8, 1.0)  # sampling temperatures the draft's own temperature is fitted at
FIT_FACTORS = tuple(round(0.5 + 0.1 * i, 1) for i in range(11))  # draft temperature / sampling temperature tried
FIT_ROWS = 32  # held-out rows a sequence enters the fit with (each expanded at every temperature and factor)
STATE_DTYPES = {"float32": torch.float32, "float16": torch.float16}


@dataclass(frozen=True)
class EagleTrainConfig(OnPolicyConfig):
    sequences: int = 500  # lab-v1's draft: 2,000 sequences, 4,000 steps, 8 a batch, 3 passes
    heldout: int = 12
    steps: int = 3000
    lr: float = 1e-3
    batch_sequences: int = 8
    kl_rows: int = 192  # rows per pass whose full distributions enter the loss (heads without a digit table)
    figure_rows: int = 32  # rows per pass whose acceptance is logged while training
    passes: int = 3  # pass k trains the k-th proposal (k - 1 of the draft's own states fed back)
    regression: float = 0.1
    intermediate_size: int | None = None  # the block's MLP width (default: the target's)
    block: str = "attention"  # or "mlp": attention-free, half the ops a proposal (runtime/lm/eagle.py)
    feature_layers: tuple[int, ...] = ()  # target layers read besides the last (EAGLE-3's multi-layer features)
    state_dtype: str = "float32"  # the target's states as kept for training ("float16": half the memory)
    init_from: Path | None = None  # a trained draft to start from (same block, width and layers; trained for this
    # target or an earlier version of it, e.g. before a fine-tune)
    loss: str = "kl"  # kl: KL at temperature 1 on every row; tv, tv+group (train/distill.py): at `temperature`
    groups: Path | None = None  # the target's .pcg table, for loss tv+group

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.block not in BLOCKS:
            raise ValueError(f"block must be one of {BLOCKS}, got {self.block!r}")
        object.__setattr__(self, "feature_layers", checked_feature_layers(self.feature_layers))
        if self.init_from is not None:
            object.__setattr__(self, "init_from", Path(self.init_from))
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {self.loss!r}")
        if (self.loss == "tv+group") != (self.groups is not None):
            raise ValueError("loss tv+group needs the target's group table (--groups), and only it reads one")
        if self.groups is not None:
            object.__setattr__(self, "groups", Path(self.groups))
        if self.state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype must be one of {tuple(STATE_DTYPES)}, got {self.state_dtype!r}")
        if min(self.batch_sequences, self.kl_rows, self.figure_rows, self.passes) < 1 or self.regression < 0:
            raise ValueError("batch_sequences, kl_rows, figure_rows and passes must be >= 1, regression >= 0")


@dataclass
class StateSequences:
    """Per sequence: the target's states [n, W] (row j predicts codes[j]; W = D, or (k + 1) D with
    k tapped layers before the final-normed state) and token embeddings of codes [n, D]."""

    states: list[torch.Tensor]
    embeds: list[torch.Tensor]

    def batch(self, index: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Padded (states [B, T, D], embeds [B, T, D], valid [B, T - 1]): valid[j] = row j has a next row.
        On the device the sequences are kept on."""
        t = max(len(self.states[i]) for i in index)
        device = self.states[0].device
        states = torch.zeros(len(index), t, self.states[0].shape[1], device=device)
        embeds = torch.zeros(len(index), t, self.embeds[0].shape[1], device=device)
        valid = torch.zeros(len(index), t - 1, dtype=torch.bool, device=device)
        for b, i in enumerate(index):
            n = len(self.states[i])
            states[b, :n], embeds[b, :n], valid[b, :n - 1] = self.states[i], self.embeds[i], True
        return states, embeds, valid


def state_sequences(target, pairs: list[tuple[torch.Tensor, torch.Tensor]],
                    feature_layers: tuple[int, ...] = (), dtype: torch.dtype = torch.float32) -> StateSequences:
    """The target's rows on `pairs`, with the outputs of `feature_layers` before each (`Llama.taps`),
    kept on the target's device in `dtype` (batches are float32), computed `STATE_BATCH` sequences a pass."""
    from pcgtts.train.heads import sequence_rows

    taps, target.model.taps = target.model.taps, tuple(feature_layers)
    try:  # kept per sequence: never all rows in one tensor beside them (twice the memory at the peak)
        states, tokens = sequence_rows(target, pairs, target.device, batch=STATE_BATCH)
    finally:
        target.model.taps = taps
    states = [rows.to(dtype) for rows in states]
    with torch.no_grad():
        embeds = [target.model.embed_tokens(target.vocab.restricted_to_token_ids(codes.to(target.device))).to(dtype)
                  for codes in tokens]
    return StateSequences(states, embeds)


class TargetHead:
    """The frozen target's head as the loss reads it. With a digit table (`Llama.samples_digits`)
    the KL of every row is exact and cheap (`digit_head.digit_kl`: 34 scores a row, no 65,537-way
    expansion); any other head expands rows, so only `kl_rows` random rows a batch enter the loss."""

    def __init__(self, model):
        self.model = model
        self.digits = model.digits if model.samples_digits else 0

    def kl(self, p_states: torch.Tensor, q_states: list[torch.Tensor]) -> list[torch.Tensor]:
        """KL(target(. | p_states) || target head(. | q)) per row for each q in `q_states`
        (the passes): [R, D], k x [R, D] -> k x [R]; the target's side is computed once."""
        model = self.model
        if self.digits:
            with torch.no_grad():
                p_scores = model.head_scores(p_states)
            return [digit_kl(p_scores, model.head_scores(q), self.digits).float() for q in q_states]
        with torch.no_grad():
            p = torch.softmax(model.logits(p_states), -1)
            log_p = torch.log(p.clamp_min(1e-30))
        return [torch.where(p > 0, p * (log_p - torch.log_softmax(model.logits(q), -1)), 0.0).sum(-1)
                for q in q_states]

    @torch.no_grad()
    def figures(self, p_states: torch.Tensor, q_states: list[torch.Tensor]) -> list[tuple[float, float]]:
        """(SD acceptance 1 - TV at temperature 1, top-1 agreement), mean over rows (expanded), for
        each q in `q_states`; the target's rows are expanded once."""
        p = torch.softmax(self.model.logits(p_states), -1)
        p_top = p.argmax(-1)
        out = []
        for q_states_k in q_states:
            q = torch.softmax(self.model.logits(q_states_k), -1)
            out.append((float(1.0 - 0.5 * (p - q).abs().sum(-1).mean()), float((q.argmax(-1) == p_top).float().mean())))
        return out


def pass_features(draft: EagleDraft, data: StateSequences, index: list[int],
                  passes: int) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """(the target's next states h [B, T - 1, D], the draft's predictions of them per pass, k x [B, T - 1, D],
    valid [B, T - 1]) on sequences `index`. Pass 1 reads the target's states; pass k + 1 reads pass k's
    predictions where the target's states were."""
    states, embeds, valid = data.batch(index)
    d = embeds.shape[-1]
    inputs, nexts = draft.fused(states[:, :-1]), states[:, 1:, -d:]  # the draft's input; the target's h
    features, fed = [], inputs
    for _ in range(passes):
        features.append(draft.train_features(fed, embeds[:, :-1]))
        fed = torch.cat([inputs[:, :1], features[-1][:, :-1]], dim=1)
    return nexts, features, valid


def eagle_losses(draft: EagleDraft, head: TargetHead, data: StateSequences, index: list[int], kl_rows: int,
                 regression: float, rng: random.Random, passes: int = 2,
                 figure_rows: int | None = None, loss: str = "kl", temperature: float = 1.0,
                 masses: CoarseMasses | None = None) -> tuple[torch.Tensor, dict]:
    """The training loss on sequences `index`, with per-pass acceptance / agreement figures
    (on `figure_rows` random rows, default `kl_rows`). `loss` "tv" / "tv+group" (`masses`: the
    target's groups) are taken at `temperature` on `kl_rows` rows a batch."""
    nexts, features, valid = pass_features(draft, data, index, passes)
    rows = valid.nonzero()

    def pick(count: int) -> tuple[torch.Tensor, torch.Tensor]:
        chosen = rows[torch.tensor(rng.sample(range(len(rows)), min(count, len(rows))), device=rows.device)]
        return chosen[:, 0], chosen[:, 1]

    if loss == "kl":
        b, j = (rows[:, 0], rows[:, 1]) if head.digits else pick(kl_rows)
        total = sum(kl.mean() for kl in head.kl(nexts[b, j], [f[b, j] for f in features]))
    else:
        b, j = pick(kl_rows)
        with torch.no_grad():
            p_logits = head.model.logits(nexts[b, j])
        total = sum(distill_loss(loss, p_logits, head.model.logits(f[b, j]), temperature, masses)[0].mean()
                    for f in features)
    reg = torch.nn.functional.smooth_l1_loss(features[0][valid], nexts[valid])
    fb, fj = pick(figure_rows or kl_rows)
    accept, agree = zip(*head.figures(nexts[fb, fj], [f[fb, fj] for f in features]))
    return total + regression * reg, {"accept": list(accept), "agree": list(agree), "regression": float(reg.detach())}


def evaluate_eagle(draft: EagleDraft, head: TargetHead, data: StateSequences, kl_rows: int = 512,
                   passes: int = 2) -> dict:
    """Held-out acceptance (1 - TV at temperature 1) and agreement per pass (pass 1: the first
    proposal, pass k: the k-th), per sequence pooled."""
    sums, count = {"accept": [0.0] * passes, "agree": [0.0] * passes}, 0
    rng = random.Random(0)
    with torch.no_grad():
        for i in range(len(data.states)):
            _, figures = eagle_losses(draft, head, data, [i], kl_rows, 0.0, rng, passes)
            for key in sums:
                sums[key] = [s + v for s, v in zip(sums[key], figures[key])]
            count += 1
    return {key: [round(v / count, 4) for v in vals] for key, vals in sums.items()}


@torch.no_grad()
def fit_temperature_scales(draft: EagleDraft, head: TargetHead, data: StateSequences, passes: int,
                           temperatures=FIT_TEMPERATURES, factors=FIT_FACTORS,
                           rows: int = FIT_ROWS) -> tuple[tuple[tuple[float, float], ...], dict]:
    """The draft's own temperature, fitted on held-out sequences: for each sampling temperature T, the
    factor f (of `factors`) maximising the SD acceptance sum_x min(p_T(x), q_{T f}(x)) averaged over
    `rows` random rows a sequence and the passes -> (((T, f), ...), {"temperatures", "accept_at_1",
    "accept_fitted"}: the mean acceptance at f = 1 and at the fitted f, per T)."""
    rng = random.Random(0)
    sums = torch.zeros(len(temperatures), len(factors), dtype=torch.float64)
    count = 0
    for i in range(len(data.states)):
        nexts, features, valid = pass_features(draft, data, [i], passes)
        valid_rows = valid[0].nonzero()[:, 0].tolist()
        pick = rng.sample(valid_rows, min(rows, len(valid_rows)))
        if not pick:
            continue
        p_logits = head.model.logits(nexts[0, pick])
        q_logits = [head.model.logits(f[0, pick]) for f in features]
        for a, t in enumerate(temperatures):
            p = torch.softmax(p_logits / t, -1)
            for b, factor in enumerate(factors):
                sums[a, b] += sum(float(torch.minimum(p, torch.softmax(q / (t * factor), -1)).sum()) for q in q_logits)
        count += len(pick) * len(q_logits)
    if not count:
        raise ValueError("no held-out rows to fit the draft's temperature on")
    accept = sums / count
    best = accept.argmax(1).tolist()
    scales = tuple((float(t), float(factors[b])) for t, b in zip(temperatures, best))
    at_one = factors.index(1.0) if 1.0 in factors else None
    return scales, {"temperatures": list(temperatures), "factors": [f for _, f in scales],
                    "accept_at_1": None if at_one is None else [round(float(x), 4) for x in accept[:, at_one]],
                    "accept_fitted": [round(float(x), 4) for x in accept.max(1).values]}


def check_init_draft(path: Path, block: str, width: int, layers: tuple[int, ...]) -> None:
    """Refuse a draft to start from whose (block, MLP width, target layers read) are not the run's."""
    stored_block, stored_width, stored_layers = EagleDraft.stored_shape(path)
    shape, wanted = (stored_block, stored_width or width, tuple(stored_layers)), (block, width, tuple(layers))
    if shape != wanted:
        raise ValueError(f"{path}: a draft of (block, MLP width, layers read) {shape}, not this run's {wanted}; "
                         "give --block, --mlp-size and --feature-layers as it was trained")


def train_eagle(cfg: EagleTrainConfig, progress=None, generation_progress=None) -> dict:
    """Generate (or reuse) on-policy sequences, train the draft (resumable), write `cfg.out`."""
    target, train_pairs, heldout_pairs = frozen_target_and_pairs(cfg, generation_progress)
    data, heldout = (state_sequences(target, pairs, cfg.feature_layers, STATE_DTYPES[cfg.state_dtype])
                     for pairs in (train_pairs, heldout_pairs))
    head = TargetHead(target.model)
    masses = CoarseMasses.load(cfg.groups, target.vocab, target.fingerprint, target.device) if cfg.groups is not None else None
    draft = EagleDraft(target.model.args, target.fingerprint, cfg.intermediate_size, cfg.block,
                       cfg.feature_layers).to(target.device)
    with torch.no_grad():  # start from the target's last block and final norm: a sensible next-state map
        m = draft.args.intermediate_size  # (a narrower MLP keeps the first m hidden units)
        wanted = draft.block.state_dict().keys()  # (an attention-free block: its MLP half)
        draft.block.load_state_dict({k: v[:m] if k.startswith("mlp.gate_proj") or k.startswith("mlp.up_proj")
                                     else v[:, :m] if k == "mlp.down_proj.weight" else v
                                     for k, v in target.model.layers[-1].state_dict().items() if k in wanted})
        draft.norm.weight.copy_(target.model.norm.weight)
        d = target.model.args.hidden_size
        draft.fc.weight.zero_()
        draft.fc.weight[:, :d] = torch.eye(d, device=target.device)  # e_j = h_j at first
        if draft.fuse is not None:  # the fused state is h_j at first
            draft.fuse.weight.zero_()
            draft.fuse.weight[:, -d:] = torch.eye(d, device=target.device)
    if cfg.init_from is not None:
        check_init_draft(cfg.init_from, draft.block_kind, draft.args.intermediate_size, draft.feature_layers)
        # a start point: a draft trained for an earlier version of this target (a fine-tune) is welcome here
        draft.load_state_dict(EagleDraft.load(cfg.init_from, target.model).state_dict())
    before = evaluate_eagle(draft, head, heldout, passes=cfg.passes)

    def loss_step(rng: random.Random):
        index = [rng.randrange(len(data.states)) for _ in range(cfg.batch_sequences)]
        loss, figures = eagle_losses(draft, head, data, index, cfg.kl_rows, cfg.regression, rng, cfg.passes,
                                     cfg.figure_rows, cfg.loss, cfg.temperature, masses)
        return loss, {f"accept{k + 1}": accept for k, accept in enumerate(figures["accept"])}

    identity = {"loss": cfg.loss} if cfg.loss != "kl" else {}  # (a KL run resumes checkpoints made before losses)
    step = fit(draft, loss_step, cfg, "eagle_", f"EAGLE draft: {cfg.loss} to the target",
               {**identity, "intermediate_size": draft.args.intermediate_size, "block": cfg.block,
                **({"feature_layers": list(cfg.feature_layers)} if cfg.feature_layers else {})}, progress, clip=1.0)
    after = evaluate_eagle(draft, head, heldout, passes=cfg.passes)
    draft.acceptance = sum(after["accept"]) / len(after["accept"])
    draft.temperature_scales, fitted = fit_temperature_scales(draft, head, heldout, cfg.passes)
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    draft.cpu().save(cfg.out)
    return {"draft": str(cfg.out), "steps": step, "train_sequences": len(data.states),
            "heldout_sequences": len(heldout.states),
            "accept_before": before["accept"], "accept_after": after["accept"],
            "agree_before": before["agree"], "agree_after": after["agree"],
            "temperature_fit": fitted, "loss_png": str(cfg.work_dir / "eagle_loss.png")}


def fit_draft_temperatures(cfg: EagleTrainConfig, eagle: Path, progress=None) -> dict:
    """Fit a trained draft's own temperature (`fit_temperature_scales`) on `cfg.heldout` sequences
    the target samples for `cfg`'s held-out sentences, and write the draft with them to `cfg.out`
    (atomically; `cfg.out` may be `eagle` itself). The draft's weights are unchanged."""
    target, _, heldout_pairs = frozen_target_and_pairs(cfg, progress)
    draft = EagleDraft.load(eagle, target.model, target.fingerprint).float()
    heldout = state_sequences(target, heldout_pairs, draft.feature_layers)
    before = draft.temperature_scales
    draft.temperature_scales, fitted = fit_temperature_scales(draft, TargetHead(target.model), heldout, cfg.passes)
    draft.cpu().save(cfg.out)  # float16, as the trainer writes drafts
    return {"draft": str(cfg.out), "heldout_sequences": len(heldout.states),
            "temperature_scales_before": [list(pair) for pair in before], "temperature_fit": fitted}


__all__ = ["EagleTrainConfig", "StateSequences", "TargetHead", "state_sequences", "eagle_losses", "evaluate_eagle",
           "fit_temperature_scales", "fit_draft_temperatures", "pass_features", "train_eagle"]
