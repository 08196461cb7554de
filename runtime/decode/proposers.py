"""Who proposes: a draft LM, the target's multi-token heads, or an EAGLE draft on its hidden states.

Every proposer offers the loop (runtime/decode/loop.py) the same steps:

  start(first_slot, config, prompt_ids)   a new utterance (the draft LM prefills here, or on first use)
  ready()                     whether it can propose now (a state proposer needs a verified row)
  has_room(L)                 whether L more proposals fit its cache
  propose(L, last, sampling, generator) -> (proposals [L], their rows or None for argmax proposals)
  accepted(start, L, n, tokens, hidden)   the verdict: n of L kept, the n + 1 tokens, the target's
                              states of the accepted rows (state proposers read them)
  row_digits(sampling)        the form of the rows it hands the rule (digit scores, dense, none)

`DraftModel`: a small LM of the target's vocabulary proposes autoregressively before the verify
(its cache rolled back with the target's; after steps with speculation off it catches up on the
tokens it missed). `HeadProposer` / `EagleProposer`: one target pass verifies the last proposals
and its states of the accepted rows feed the proposer for the next ("verify this step, predict the
next"): the heads read the row that predicted the new token; the EAGLE draft extends its one-block
cache with rows 0 .. n and the tokens chosen after them, then proposes from its own predicted states
(runtime/lm/eagle.py). Proposals are drawn from the proposer's distribution for the exact rules
(sd, ssd, pcg) and taken as its argmax for the inexact ones (strict, top-M, threshold), or as a
Viterbi path over the heads' candidates with code transitions (runtime/decode/viterbi.py).
"""

from __future__ import annotations

import copy
from dataclasses import replace

import torch

from pcgtts.runtime.decode.policy import Proposer
from pcgtts.runtime.decode.rows import DenseRows, DigitRows, Rows
from pcgtts.runtime.decode.sampling import logits_to_probs, rule_digits, sample, sample_by_digits
from pcgtts.runtime.decode.steps import start_sequence
from pcgtts.runtime.decode.viterbi import viterbi_propose
from pcgtts.runtime.lm.protocol import LM
from pcgtts.runtime.lm.torch_lm import TorchLM

_CATCH_UP_CHUNK = 64  # tokens per draft forward while it catches up (bounds the [T, V] logits it returns)


class DraftModel:
    """A draft LM proposing L tokens autoregressively before each verify.

    Cache bookkeeping (as the target's): the cache holds every token before the newest one the
    draft is to be fed. The draft is fed `last` (plus the final proposal of the previous step when
    that step accepted everything: it "catches up"), then each proposal in turn; after the verdict
    its cache is rolled back with the target's. With an adaptive draft length a step may skip
    speculation (L = 0): the tokens the draft has not seen wait in `skipped` and are fed to it (in
    chunks) before its next proposal, and an utterance that never speculates never prefills it."""

    max_proposals = 1 << 30  # any number: the draft length alone bounds it
    reads_states = False
    counts_draft_forwards = True
    acceptance = None  # the adaptive draft length's default prior

    def __init__(self, lm: LM):
        self.lm = lm
        self.started = False  # whether its cache holds the utterance (prefilled)
        self.pending: torch.Tensor | None = None  # tokens it has not been fed, ending with `last`
        self.skipped: list[int] = []  # plain steps' tokens (restricted indices): no tensor ops while off
        self.catchup_tokens = 0

    def start(self, first_slot: int, config, prompt_ids: torch.Tensor) -> None:
        """A new utterance: the draft is prefilled with `prompt_ids` now at a fixed draft length, at its
        first speculative step with an adaptive one."""
        self.started = not config.adaptive_draft
        if self.started:
            start_sequence(self.lm, prompt_ids)
            self.pending = prompt_ids[-1:].to(self.lm.device)
        else:
            self.pending = prompt_ids.to(self.lm.device)
        self.skipped, self.catchup_tokens = [], 0

    def ready(self) -> bool:
        return True

    def has_room(self, count: int) -> bool:
        lm = self.lm
        return (lm.length if self.started else 0) + len(self.pending) + count <= lm.max_length

    def row_digits(self, sampling) -> int:
        return rule_digits(self.lm, sampling)

    def propose(self, count: int, last: torch.Tensor, sampling, generator: torch.Generator) -> tuple[torch.Tensor, Rows]:
        lm, vocab = self.lm, self.lm.vocab
        self.catchup_tokens += len(self.skipped)
        if self.skipped:
            self.pending = torch.cat([self.pending, vocab.token_ids(self.skipped, lm.device)])
            self.skipped = []
        if not self.started:  # the first speculative step: prefill what the draft missed at once
            start_sequence(lm, self.pending)
            self.pending, self.started = self.pending[-1:], True
        while len(self.pending) > _CATCH_UP_CHUNK + 1:
            lm.forward(self.pending[:_CATCH_UP_CHUNK])
            self.pending = self.pending[_CATCH_UP_CHUNK:]
        digits = rule_digits(lm, sampling)
        proposals = torch.empty(count, dtype=torch.long, device=lm.device)
        rows = []  # the distributions (or digit scores) the proposals were drawn from
        ids = self.pending
        for i in range(count):
            if digits:
                scores = lm.forward_scores(ids)[0][-1]
                proposals[i] = sample_by_digits(scores, digits, sampling.temperature, generator)
                rows.append(scores)
            else:
                probs = logits_to_probs(lm.forward(ids)[-1], sampling)
                proposals[i] = sample(probs, generator)
                rows.append(probs)
            ids = vocab.restricted_to_token_ids(proposals[i:i + 1])
        stacked = torch.stack(rows)
        return proposals, DigitRows(stacked, digits, sampling.temperature) if digits else DenseRows(stacked)

    def accepted(self, start: int, count: int, n: int, tokens: list[int], hidden) -> None:
        """Roll the draft back with the target to [.., last, x_1 .. x_n]; after a plain step it falls
        one token behind."""
        if count == 0:
            self.skipped.append(tokens[0])
            return
        lm = self.lm
        lm.rollback(min(lm.length, start + 1 + n))
        self.pending = lm.vocab.token_ids(tokens[n - 1:] if n == count else tokens[n:], lm.device)  # x_L's id and the new one


class HeadProposer:
    """The target's multi-token heads on its shared speech head: `heads.TorchHeads`, or the graph
    exported with an onnxruntime target (`onnxruntime.OrtHeads`)."""

    acceptance = None  # no measured acceptance recorded with the heads: the adaptive length's default prior

    reads_states = True
    counts_draft_forwards = False
    catchup_tokens = 0  # it reads every verified row as it comes: nothing to catch up on

    def __init__(self, step, transitions=None):
        self.step, self.transitions = step, transitions
        self.mode = "argmax"  # how proposals are drawn: sample | argmax | viterbi (`start`)
        self.hidden, self.last_token = None, None  # the newest observed row that predicts the next token

    @classmethod
    def from_heads(cls, heads, target, transitions=None) -> "HeadProposer":
        """Loaded `MTPHeads` on their torch target."""
        from pcgtts.runtime.lm.heads import TorchHeads

        return cls(TorchHeads(heads, _state_model(target, "multi-token heads")), transitions)

    @property
    def max_proposals(self) -> int:
        return self.step.num_heads

    def fork(self, gate=None) -> "HeadProposer":
        """A proposer for another stream: the same heads (their weights and the target's head), its own
        observed row and proposal mode (`gate`: unused, the heads read one row a stream)."""
        return HeadProposer(self.step, self.transitions)

    def start(self, first_slot: int, config=None, prompt_ids=None) -> None:
        """A new utterance: the heads keep no state but how `config`'s policy draws proposals."""
        self.hidden, self.last_token = None, None
        if config is not None:
            self.config = config
            exact = config.rule.exact  # sampled proposals; otherwise the heads' argmax
            self.mode = "sample" if exact else "viterbi" if config.proposer is Proposer.VITERBI else "argmax"

    def ready(self) -> bool:
        """Whether a row has been observed to propose from (not before the first step)."""
        return self.hidden is not None

    def has_room(self, count: int) -> bool:
        return True

    def row_digits(self, sampling) -> int | None:
        """The form of the rows proposals come with: dense probabilities (0), or None (argmax)."""
        return 0 if self.mode == "sample" else None

    def accepted(self, start: int, count: int, n: int, tokens: list[int], hidden: torch.Tensor) -> None:
        self.observe(hidden[:n + 1], tokens, start)

    def observe(self, hidden: torch.Tensor, tokens: list[int], slot: int) -> None:
        """The accepted rows' states hidden [n + 1, D] and the tokens chosen after them."""
        # the final state: a row's last D entries (a target that also returns the layers an EAGLE
        # draft reads puts them first: `Llama.with_taps`)
        self.hidden, self.last_token = hidden[-1, -self.step.hidden_size:], tokens[-1]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, count: int) -> torch.Tensor:
        """hidden [D] -> [count, V_r] logits of the tokens 2 .. count + 1 positions ahead."""
        return self.step.logits(hidden, count)

    def chains(self, sampling) -> bool:
        """Heads propose one by one (see `EagleProposer.chains`)."""
        return False

    def warm_up(self, config) -> None:
        """Nothing to compile ahead (see `EagleProposer.warm_up`)."""

    @torch.inference_mode()
    def probe(self, rows: int, sampling, generator: torch.Generator) -> None:
        """The work of one proposal, its draw included (the cost model's draft step); the heads read one
        row whatever `rows` is."""
        step = self.step
        logits = self.logits(torch.zeros(step.hidden_size, dtype=step.dtype, device=step.device), 1)[0]
        _draw_like_a_proposal(logits, sampling, generator)

    def propose(self, count: int, last: torch.Tensor, sampling, generator: torch.Generator) -> tuple[torch.Tensor, Rows | None]:
        """`count` proposals after the observed row -> (proposals [count] int64, their rows or None)."""
        head_logits = self.logits(self.hidden, count)
        if self.mode == "sample":
            probs = logits_to_probs(head_logits, sampling)
            return sample(probs, generator), DenseRows(probs)
        if self.mode == "viterbi":
            proposals = viterbi_propose(torch.log_softmax(head_logits.float(), -1), self.transitions, self.last_token,
                                        self.config.viterbi_top_k)
            return proposals.to(head_logits.device), None
        return head_logits.argmax(-1), None


class EagleProposer:
    """An EAGLE draft step (`runtime/lm/eagle.py`: torch, or the onnxruntime graph) in the hidden-state loop.

    Its slot s holds the target's row at target slot `first_slot + s` (the prompt's last token is
    slot 0). Rows whose proposals were not asked for (speculation off) wait in `pending` and are
    fed with the next proposal's forward. With a `chain` (`eagle.CompiledEagleChain`, a compiled
    CPU target's), proposals drawn digit by digit are made together in one call. Proposals are
    drawn at the draft's own temperature (`eagle.proposal_temperature`), and the rows handed to the
    rule are that distribution."""

    max_proposals = 1 << 30  # any number: the draft length alone bounds it
    reads_states = True
    counts_draft_forwards = False
    catchup_tokens = 0  # it reads every verified row as it comes: nothing to catch up on

    def __init__(self, step, chain=None):
        self.step, self.chain, self.max_length = step, chain, step.max_length
        self.acceptance = step.acceptance  # the adaptive draft length's starting estimate (None: its default)
        self.temperature_scales = step.temperature_scales  # the draft's own temperature (`proposal_sampling`)
        self.first_slot, self.length = 0, 0
        self.pending_states, self.pending_tokens = [], []
        self._warmed: set[int] = set()  # proposal counts whose chain has run once (`warm_up`)

    @classmethod
    def for_target(cls, target, eagle_file=None) -> "EagleProposer":
        """The target's EAGLE draft: `eagle_file` on a torch target, the graph exported with an
        onnxruntime target (`pcgtts export onnx`, which finds the draft next to the checkpoint)."""
        if "eagle" in target.exported_proposers:
            if eagle_file is not None:
                raise ValueError("the onnxruntime backend runs the EAGLE draft exported with the target "
                                 "(`pcgtts export onnx --eagle FILE`), not a safetensors file")
            return cls(target.eagle_step())
        from pcgtts.runtime.lm.eagle import EagleDraft

        if eagle_file is None:
            raise ValueError("an EAGLE draft file is needed (`pcgtts train eagle`)")
        model = _state_model(target, "an EAGLE draft")
        return cls.from_draft(EagleDraft.load(eagle_file, model, fingerprint=target.fingerprint), target)

    @classmethod
    def from_draft(cls, draft, target) -> "EagleProposer":
        """A loaded `EagleDraft` on its torch target (an attention-free float32 draft on a CPU steps in
        NumPy: `eagle.HostEagleStep`, half the cost of a proposal; on a compiled target with a digit
        head its proposals are chained in one compiled call: `eagle.CompiledEagleChain`). A large
        dense head is read through its cheap stand-in (`proposal_head.ProposalHead`). On an int8
        target the draft's large linear layers (a 1B target's `fc` and `fuse`) are made int8 too, in place."""
        from pcgtts.runtime.lm.eagle import CompiledEagleChain, HostEagleStep, TorchEagleStep
        from pcgtts.runtime.lm.int8 import ONEDNN_MIN_WEIGHTS, is_quantized, quantize_linears

        model = _state_model(target, "an EAGLE draft")
        if is_quantized(model) and not is_quantized(draft):  # its large maps then stream int8 weights too
            quantize_linears(draft, ONEDNN_MIN_WEIGHTS)
        if draft.feature_layers:
            target.tap_layers(draft.feature_layers)
        if not HostEagleStep.suits(draft, model):
            return cls(TorchEagleStep(draft, model, target.vocab, target.max_length))
        chained = target.compiled and model.samples_digits
        chain = CompiledEagleChain(draft, model, target.vocab) if chained else None
        return cls(HostEagleStep(draft, model, target.vocab, target.max_length), chain)

    def fork(self, gate=None) -> "EagleProposer":
        """A proposer for another stream (a batch's slot): the same draft weights, head and compiled
        chain, its own utterance state (pending rows, slots) and, for a draft with an attention block,
        its own cache (`TorchEagleStep`'s lives on the draft's attention module: the fork's module
        shares every parameter and holds cache tensors of its own). An attention-free step
        (`HostEagleStep`, or a torch MLP block) keeps no state of its own: it is shared, and with a
        batch's `gate` (`batched.StepGate`) the streams' proposals are made together (`GatedStep`)."""
        from pcgtts.runtime.lm.batched import GatedStep
        from pcgtts.runtime.lm.eagle import HostEagleStep, TorchEagleStep

        step = self.step
        if isinstance(step, TorchEagleStep) and step.draft.attention:
            step = TorchEagleStep(_with_own_cache(step.draft), step.model, step.vocab, step.max_length)
        elif gate is not None and isinstance(step, (TorchEagleStep, HostEagleStep)) and self.chain is None:
            step = GatedStep(step, gate)
        elif not isinstance(step, (TorchEagleStep, HostEagleStep)):
            raise ValueError(f"an EAGLE draft on {type(step).__name__} steps one stream (its cache is the "
                             "exported graph's): batching its streams needs the torch backend")
        twin = EagleProposer(step, self.chain)
        twin._warmed = self._warmed  # the chain's graphs are shared, and so is what has compiled them
        return twin

    def start(self, first_slot: int, config=None, prompt_ids=None) -> None:
        """A new utterance whose prompt's last token is at target slot `first_slot`."""
        self.first_slot, self.length = first_slot, 0
        self.pending_states, self.pending_tokens = [], []
        self.latest_slot, self.latest_rows = first_slot, 0

    def ready(self) -> bool:
        """Whether rows wait to be proposed from (not before the first step)."""
        return bool(self.pending_states)

    def has_room(self, count: int) -> bool:
        return True  # its own cache's room is checked as slots are taken (`_take`)

    def row_digits(self, sampling) -> int | None:
        """The form of the rows proposals come with: digit scores of `step.digits` digits, dense
        probabilities (0), or None (greedy: argmax proposals)."""
        if sampling.greedy:
            return None
        by_digits = bool(self.step.digits) and sampling.plain
        return self.step.digits if by_digits and (self.chains(sampling) or self.step.device.type == "cpu") else 0

    def accepted(self, start: int, count: int, n: int, tokens: list[int], hidden: torch.Tensor) -> None:
        self.observe(hidden[:n + 1], tokens, start)

    def observe(self, hidden: torch.Tensor, tokens: list[int], slot: int) -> None:
        """The accepted rows' states hidden [n + 1, D] (target slots from `slot`) and the tokens chosen
        after them: fed to the draft with its next proposals."""
        self.pending_states.append(hidden.to(self.step.dtype))
        self.pending_tokens.extend(tokens)
        self.latest_slot, self.latest_rows = slot, len(hidden)

    def _run(self, states: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed rows states [k, D] with the tokens chosen after them [k] at the next free slots ->
        (f of the last row [D], its head scores)."""
        start = self._take(len(tokens))
        return self.step.run(states, tokens, start)

    def _take(self, slots: int) -> int:
        """The first of the next `slots` free slots, now taken."""
        if self.length + slots > self.max_length:
            raise ValueError("the EAGLE draft's cache is full")
        self.length += slots
        return self.length - slots

    def chains(self, sampling) -> bool:
        """Whether proposals at `sampling` are made together in one call."""
        return self.chain is not None and sampling.plain

    def proposal_sampling(self, sampling):
        """`sampling` at the temperature this draft proposes at (`eagle.proposal_temperature`)."""
        from pcgtts.runtime.lm.eagle import proposal_temperature

        temperature = proposal_temperature(self.temperature_scales, sampling.temperature)
        return sampling if temperature == sampling.temperature else replace(sampling, temperature=temperature)

    def _chained(self, states: torch.Tensor, tokens: torch.Tensor, count: int, temperature: float,
                 generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """`count` proposals after rows states [k, D] (an attention-free draft reads only the last)
        in one call -> (proposals [count], their head scores [count, W])."""
        self._take(len(tokens) + count - 1)  # the slots a step-by-step proposer would use
        uniforms = torch.rand(count, self.step.digits + 1, generator=generator, device=states.device)
        return self.chain(states[-1], tokens[-1], uniforms, temperature)

    def warm_up(self, config) -> None:
        """Compile a chain's graphs for 1..config.draft_length proposals now, not in an utterance's
        first steps (a few seconds each the first time). Once per count: a seeded stream calls it
        before every utterance (`DraftLengthPlanner.plan`), where running the chains again cost ~9.5 ms."""
        if self.chains(config.sampling):
            generator = torch.Generator(device=self.step.device).manual_seed(0)
            for count in range(1, config.draft_length + 1):
                if count not in self._warmed:
                    self.probe(1, config.sampling, generator, proposals=count)
                    self._warmed.add(count)

    @torch.inference_mode()
    def probe(self, rows: int, sampling, generator: torch.Generator, proposals: int = 1) -> None:
        """The work of `proposals` proposals after `rows` rows are fed, their draws included as
        `propose` draws them (one: the cost model's draft forward of `rows` tokens; several: its
        `proposals` entry, for a chain): a digit head's scores are drawn digit by digit, never
        expanded (expanding them and a dense draw had doubled a proposal's planned cost on
        onnxruntime: 0.55-0.67 ms against 0.30 in the loop)."""
        self.start(0)
        step = self.step
        states = torch.zeros(rows, step.hidden_size, dtype=step.dtype, device=step.device)
        tokens = torch.zeros(rows, dtype=torch.long, device=step.device)
        if proposals != 1 or self.chains(sampling):
            self.observe(states, tokens.tolist(), 0)
            self._draw(proposals, sampling, generator)
            self.start(0)
            return
        scores = self._run(states, tokens)[1]
        if step.digits and (sampling.plain or sampling.greedy):
            sample_by_digits(scores, step.digits, sampling.temperature, generator)
        else:
            _draw_like_a_proposal(step.scores_to_logits(scores), sampling, generator)
        self.start(0)

    @torch.inference_mode()
    def propose(self, count: int, last: torch.Tensor, sampling, generator: torch.Generator):
        """`count` proposals after the observed rows -> (proposals [count] int64, their rows or None)."""
        proposals, rows = self._draw(count, sampling, generator)
        return proposals, (DenseRows(rows) if isinstance(rows, torch.Tensor) else rows)

    def _draw(self, count: int, sampling, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | Rows | None]:
        step = self.step
        sampling = self.proposal_sampling(sampling)
        states = torch.cat(self.pending_states)
        self.length = self.latest_slot - self.first_slot - (len(states) - self.latest_rows)  # the pending rows' first slot
        chosen = torch.tensor(self.pending_tokens, device=states.device)
        self.pending_states, self.pending_tokens = [], []
        if self.chains(sampling):
            proposals, rows = self._chained(states, chosen, count, sampling.temperature, generator)
            return proposals, DigitRows(rows, self.step.digits, sampling.temperature)
        f, scores = self._run(states, chosen)
        # A digit head at plain temperature is sampled digit by digit (greedy: its argmax, digit by
        # digit); the rules' rows are then expanded once for all proposals, after the loop.
        by_digits = bool(step.digits) and (sampling.plain or sampling.greedy)
        proposals = torch.empty(count, dtype=torch.long, device=states.device)
        rows = []  # head scores (by_digits) or distributions, one per proposal
        for i in range(count):
            if i:
                f, scores = self._run(f[None], proposals[i - 1:i])
            if by_digits:
                rows.append(scores)
                proposals[i] = sample_by_digits(scores, step.digits, sampling.temperature, generator)
            elif sampling.greedy:
                proposals[i] = step.scores_to_logits(scores).argmax(-1)
            else:
                rows.append(logits_to_probs(step.scores_to_logits(scores), sampling))
                proposals[i] = sample(rows[-1], generator)
        if not rows or sampling.greedy:  # argmax proposals: the greedy rule reads no draft rows
            return proposals, None
        rows = torch.stack(rows)
        if not by_digits:
            return proposals, rows
        if rows.device.type == "cpu":  # the rules read the scores as they are (`rows.DigitRows`)
            return proposals, DigitRows(rows, step.digits, sampling.temperature)
        return proposals, logits_to_probs(step.scores_to_logits(rows), sampling)


def _draw_like_a_proposal(logits: torch.Tensor, sampling, generator: torch.Generator) -> None:
    """A proposal's draw from dense logits [V_r] (the calibration's stand-in for `propose`'s)."""
    if sampling.greedy:
        logits.argmax(-1)
    else:
        sample(logits_to_probs(logits, sampling), generator)


def _with_own_cache(draft):
    """A shallow copy of an attention `EagleDraft` whose attention module is its own (so its cache
    tensors are), every parameter and buffer shared with `draft` (no weight is copied)."""
    def copied(module):
        twin = copy.copy(module)
        twin._modules = dict(module._modules)  # a copy's children may be replaced without touching the original's
        return twin

    twin, block = copied(draft), copied(draft.block)
    twin._modules["block"] = block
    block._modules["self_attn"] = copied(draft.block.self_attn)
    return twin


def _state_model(target, what: str):
    """The target's torch `Llama` (its hidden states, embedding and head), or a clear error."""
    if not isinstance(target, TorchLM):
        raise ValueError(f"{what} need the torch backend (the target's hidden states); "
                         f"this target is a {type(target).__name__}")
    return target.model
