"""`BatchedLM`: several sequences' static KV caches over one loaded torch model's weights.

A `TorchLM` owns one sequence's cache; a `BatchedLM` holds `slots` more beside it, one per stream,
each with its own length, over the same `Llama` modules (no second copy of the weights). A step
carries the new token(s) of any set of slots in one forward: the projections and the MLP read the
weights once for all of them (what batching wins), while each slot attends over its own cache
rows. A prefill fills one slot in the blocks a `TorchLM` prefill uses (`SequenceMixin.block_starts`)
while the other slots keep their KV; a slot keeps the leading blocks it shares with its previous
prompt (the chat template's head), as a `TorchLM` prefill does, or copies them from another slot that
holds more of them (`donor`: a new stream's first prompt computes only its own words). Rolling a slot back is O(1): its
length is a number, later writes overwrite the rest, which causality hides.

One slot alone computes what the `TorchLM` computes, bit for bit (the same kernels on the same
shapes). In a step of several slots each row of the matrix products is summed in another order
than a 1-row product sums it (BLAS picks its kernel by the row count), so a slot's logits then
differ from its logits alone in the last bits (about 1e-6 relative): greedy and seeded draws
agree unless a draw falls within that rounding of a tie or of a boundary of its CDF.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from pcgtts.runtime.config import MAX_BATCH
from pcgtts.runtime.decode.cost_model import PassTimes
from pcgtts.runtime.lm.llama import rope_cos_sin
from pcgtts.runtime.lm.loader import concrete_backend
from pcgtts.runtime.lm.protocol import check_fits, prefill_spans, reusable_length
from pcgtts.runtime.lm.torch_lm import TorchLM

log = logging.getLogger(__name__)


def runs_batched(lm) -> bool:
    """Whether a loaded LM can hold a batch's slots (`BatchedLM`): the torch backend's."""
    return isinstance(lm, TorchLM)


def check_batch_backend(backend: str, target) -> None:
    """A one-line ValueError, before any model loads, unless the target named runs on the torch backend
    (`backend` "auto" made concrete for it), where streams can be batched."""
    concrete = concrete_backend(backend, target)
    if concrete != "torch":
        raise ValueError(f"max_batch > 1 decodes streams together on the torch backend, but the target loads on "
                         f"{concrete} (an export steps one sequence): give its checkpoint, or max_batch 1")


class BatchedLM:
    """`slots` sequences' KV caches of `max_length` tokens over `lm`'s weights (eager steps)."""

    def __init__(self, lm: TorchLM, slots: int, max_length: int | None = None):
        if not isinstance(lm, TorchLM):
            raise ValueError(f"batched decoding runs on the torch backend, not {type(lm).__name__}")
        if not 1 <= slots <= MAX_BATCH:
            raise ValueError(f"slots must lie in [1, {MAX_BATCH}], got {slots}")
        self.lm, self.model, self.vocab, self.device = lm, lm.model, lm.vocab, lm.device
        self.slots = slots
        self.max_length = max_length or lm.max_length
        self.lengths = [0] * slots  # tokens in each slot's cache
        self.prompts: list[torch.Tensor | None] = [None] * slots  # the last prompt prefilled into each slot
        self.kept = [0] * slots  # of it, how many leading tokens the slot still holds
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.rope_table: tuple[torch.Tensor, torch.Tensor] | None = None
        self.allocation = threading.Lock()  # slots of several threads may start at once
        self.prefilling = threading.Lock()  # one prefill at a time (it may copy another slot's rows)

    @property
    def reuse_prefix(self) -> bool:
        """Whether a prefill keeps the leading blocks a slot holds already (the `TorchLM`'s setting)."""
        return self.lm.reuse_prefix

    @property
    def drawable_digits(self) -> int:
        """n > 0 when a step's token can be drawn digit by digit from `step_scores` (a digit head)."""
        return self.model.digits if self.model.samples_digits else 0

    @property
    def allocated(self) -> bool:
        return bool(self.keys)

    def ensure_cache(self) -> None:
        """Allocate the slots' caches (a [slots, kv_heads, max_length, head_dim] buffer per layer)."""
        with self.allocation:
            if not self.keys:
                self._allocate()

    def _allocate(self) -> None:
        args, p = self.model.args, self.model.embed_tokens.weight
        shape = (self.slots, args.num_kv_heads, self.max_length, args.head_dim)
        for _ in self.model.layers:
            self.keys.append(torch.zeros(shape, dtype=p.dtype, device=p.device))
            self.values.append(torch.zeros(shape, dtype=p.dtype, device=p.device))
        self.rope_table = rope_cos_sin(self.model.inv_freq, torch.arange(self.max_length, device=p.device), p.dtype)

    def release(self) -> None:
        """Free every slot's cache (the weights stay loaded)."""
        self.keys, self.values, self.rope_table = [], [], None
        self.lengths = [0] * self.slots
        self.prompts = [None] * self.slots
        self.kept = [0] * self.slots

    # -- sequences --------------------------------------------------------------------------

    def prefill(self, slot: int, ids: torch.Tensor) -> torch.Tensor | None:
        """Start a new sequence of prompt ids [T] in `slot`, keeping the leading blocks it shares with
        the slot's last prompt; the other slots keep their KV. -> the last token's final-normed state
        [D] (None for no ids)."""
        ids = ids.view(-1)
        if ids.numel() == 0:
            self.lengths[slot], self.prompts[slot], self.kept[slot] = 0, None, 0
            return None
        check_fits(0, len(ids), self.max_length)
        self.ensure_cache()
        blocks = self.lm.block_starts(ids)
        with self.prefilling:  # a slot read as a donor is not rewritten meanwhile
            kept = self.reusable_prefix(slot, ids, blocks)
            donor, shared = self.donor(slot, ids, blocks)
            with torch.inference_mode():
                if shared > kept:  # another slot holds more of this prompt (the chat template's head): copy it
                    for keys, values in zip(self.keys, self.values):
                        keys[slot, :, :shared] = keys[donor, :, :shared]
                        values[slot, :, :shared] = values[donor, :, :shared]
                    kept = shared
                self.lengths[slot] = kept
                for start, end in prefill_spans(kept, blocks, len(ids)):
                    states = self.hidden([slot], ids[start:end].view(1, -1))
            self.prompts[slot], self.kept[slot] = ids.to("cpu", copy=True), len(ids)
        return states[0, -1]

    def donor(self, slot: int, ids: torch.Tensor, blocks: Sequence[int]) -> tuple[int, int]:
        """(the other slot holding the most leading tokens of `ids` as a fresh prefill leaves them, how
        many): the rows a new prompt may copy instead of computing (every slot computes a shared prefix
        with the same blocks, so the copy is bit for bit what its own prefill would write)."""
        best = (slot, 0)
        for other in range(self.slots):
            shared = self.reusable_prefix(other, ids, blocks) if other != slot else 0
            if shared > best[1]:
                best = (other, shared)
        return best

    def reusable_prefix(self, slot: int, ids: torch.Tensor, blocks: Sequence[int]) -> int:
        """Leading tokens of `ids` the slot holds as a fresh prefill would leave them: the prefix shared
        with its last prompt cut back to a block start, short of the last token (protocol.py's rule)."""
        return reusable_length(self.prompts[slot], self.kept[slot], ids, blocks, self.reuse_prefix)

    def rollback(self, slot: int, length: int) -> None:
        """O(1): keep the first `length` tokens of `slot`."""
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"cannot roll slot {slot} back to {length}: it holds {self.lengths[slot]} tokens")
        self.lengths[slot] = length
        self.kept[slot] = min(self.kept[slot], length)

    def has_room(self, slot: int, needed: int) -> bool:
        return self.lengths[slot] + needed <= self.max_length

    # -- steps ------------------------------------------------------------------------------

    def outputs(self, states: torch.Tensor, kind: str, scores: torch.Tensor | None = None):
        """What a forward returns for final-normed states [..., D], as a `TorchLM` returns it: "logits"
        (restricted-vocabulary logits), "scores" ((the head's scores, the states)) or "hidden" ((the
        logits, the states)). `scores`: the head's scores of `states`, when the caller has them."""
        scores = self.model.head_scores(states) if scores is None else scores
        if kind == "logits":
            return self.model.scores_to_logits(scores)
        if kind == "scores":
            return scores, states
        return self.model.scores_to_logits(scores), states

    @torch.inference_mode()
    def step_scores(self, slots: Sequence[int], ids: torch.Tensor) -> torch.Tensor:
        """Append ids [n, T] (T new tokens for each of `slots`, n of them) -> the head's float32 scores
        [n, T, W]: the restricted-vocabulary logits, or a digit table's scores (`drawable_digits`)."""
        return self.model.head_scores(self.hidden(slots, ids))

    @torch.inference_mode()
    def step(self, slots: Sequence[int], ids: torch.Tensor) -> torch.Tensor:
        """Append ids [n, T] to `slots` -> restricted-vocabulary logits [n, T, V_r]."""
        return self.model.logits(self.hidden(slots, ids))

    def hidden(self, slots: Sequence[int], ids: torch.Tensor, counts: Sequence[int] | None = None) -> torch.Tensor:
        """Forward ids [n, T] appended to each of `slots` (distinct) -> final-normed states [n, T, D]
        (preceded by the tapped layers' outputs with `Llama.taps`: [n, T, (k + 1) D], as a `TorchLM`).
        `counts`: a ragged step, row i holding counts[i] tokens padded to T with any token; each slot's
        length advances by its own count, so the padding's KV, written past it, is overwritten by its
        next tokens before any reads it (causality hides it meanwhile); its rows' states are to be
        dropped. The padded T must fit every slot's cache."""
        if not self.keys:
            raise RuntimeError("the batch's KV caches are not allocated: call ensure_cache() first")
        ids = ids.to(self.device)
        n, t = ids.shape
        if n != len(slots) or len(set(slots)) != n:
            raise ValueError(f"one row of ids per distinct slot: {n} rows for slots {list(slots)}")
        starts = [self.lengths[s] for s in slots]
        for start in starts:
            check_fits(start, t, self.max_length)
        span = torch.arange(t, device=self.device)
        positions = [start + span for start in starts]  # [T] each
        cos_table, sin_table = self.rope_table
        order = torch.stack(positions)  # [n, T]
        cos, sin = cos_table[order][:, None], sin_table[order][:, None]  # [n, 1, T, head_dim]
        lo, hi = min(slots), max(slots) + 1
        attend = self._attend_per_slot(slots, starts, positions) if n == 1 or hi - lo > 2 * n \
            else self._attend_span(slots, starts, order, lo, hi)
        model = self.model
        x = model.embed_tokens(ids)
        tapped = []  # the layers an EAGLE draft reads (`Llama.taps`), as `Llama.hidden` returns them
        for i, (layer, keys, values) in enumerate(zip(model.layers, self.keys, self.values)):
            attn = layer.self_attn
            q, k, v = attn.project(layer.input_layernorm(x), cos, sin)  # [n, heads, T, hd], [n, kv, T, hd]
            x = x + attn.o_proj(attend(q, k, v, keys, values).transpose(1, 2).reshape(n, t, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if i in model.taps:
                tapped.append(x)
        for slot, count in zip(slots, counts if counts is not None else [t] * n):
            self.lengths[slot] += count
        return model.with_taps(model.norm(x), torch.cat(tapped, -1) if tapped else None)

    def _attend_per_slot(self, slots, starts, positions):
        """Attention slot by slot over each one's own cache rows: one slot alone computes what the
        model computes for one sequence, bit for bit (its mask as `Llama.causal`'s, a [T, end] boolean,
        so that SDPA picks the same kernel)."""
        t = len(positions[0])
        masks = [torch.arange(start + t, device=self.device)[None, :] <= p[:, None]
                 for start, p in zip(starts, positions)]
        gqa = self.model.args.num_heads != self.model.args.num_kv_heads

        def attend(q, k, v, keys, values):
            out = []
            for i, (slot, start) in enumerate(zip(slots, starts)):
                keys[slot, :, start:start + t] = k[i]
                values[slot, :, start:start + t] = v[i]
                out.append(F.scaled_dot_product_attention(q[i:i + 1], keys[slot:slot + 1, :, :start + t],
                                                          values[slot:slot + 1, :, :start + t],
                                                          attn_mask=masks[i], enable_gqa=gqa))
            return torch.cat(out) if len(out) > 1 else out[0]

        return attend

    def _attend_span(self, slots, starts, order, lo: int, hi: int):
        """Attention of several slots in one call over the cache rows [lo, hi) they lie in (a view, no
        copy), each row masked to its own length; a row of the span no slot of the step holds attends
        to its slot 0 only, and its output is dropped. Its sums run in another order than a slot's
        alone (as the batched matrix products' do)."""
        n, t = order.shape
        end = max(starts) + t
        rows = torch.tensor([slot - lo for slot in slots], device=self.device)
        slot_index = torch.tensor(slots, device=self.device)[:, None]  # [n, 1]
        mask = torch.zeros(hi - lo, t, end, dtype=torch.bool, device=self.device)
        mask[:, :, 0] = True
        mask[rows] = torch.arange(end, device=self.device)[None, None, :] <= order[:, :, None]
        mask = mask[:, None]  # [span, 1, T, end]
        heads, gqa = self.model.args.num_heads, self.model.args.num_heads != self.model.args.num_kv_heads

        def attend(q, k, v, keys, values):
            keys[slot_index, :, order] = k.transpose(1, 2)  # [n, T, kv, hd] into each slot's positions
            values[slot_index, :, order] = v.transpose(1, 2)
            queries = q.new_zeros(hi - lo, heads, t, q.shape[-1])
            queries[rows] = q
            out = F.scaled_dot_product_attention(queries, keys[lo:hi, :, :end], values[lo:hi, :, :end],
                                                 attn_mask=mask, enable_gqa=gqa)
            return out[rows]

        return attend


# -- one stream's view of a slot, its forwards run together with the other streams' ----------------


@dataclass(eq=False)
class StepRequest:
    """A forward a stream asked of the gate: ids [T] appended to `slot` of `lm`."""

    lm: BatchedLM
    slot: int
    ids: torch.Tensor
    kind: str  # "logits" | "scores" | "hidden": what the stream gets back
    result: object = None
    error: BaseException | None = None
    done: bool = False


@dataclass(eq=False)
class ProposalRequest:
    """Proposals a stream asked of the gate: a stateless EAGLE step (`eagle.TorchEagleStep` or
    `HostEagleStep` of an attention-free draft) run after `states` [k, ·] with `tokens` [k]."""

    lm: object  # the step: requests of one step run together (`run_rows`)
    states: torch.Tensor
    tokens: torch.Tensor
    result: object = None
    error: BaseException | None = None
    done: bool = False


RAGGED_WASTE = 4  # a ragged pass computes at most this many times the tokens its rows hold


class StepGate:
    """Where several streams' decode loops meet for their forwards. Each stream runs its own loop (any
    host policy, on its own thread) over `SlotLM` views; a view's forward waits at the gate until every
    stream inside its loop (`enter` .. `leave`) waits there too, and then the gate runs them all in one
    forward per model: the slots' rows side by side, as a batched step carries them, a row with fewer
    tokens than the longest padded (ragged acceptance: one stream verifies 1 token where another
    verifies 4; `BatchedLM.hidden`'s `counts`), or one forward per token count where padding would
    write past a slot's cache end. The forwards run on the gate's own thread (started by the first
    request, ended when no stream is inside and nothing waits), never on a stream's: one thread
    keeps one pool of compute threads busy and warm, where the streams' threads taking turns had
    each woken its own (a batch's proposal calls cost ~10 % less). A stream outside its loop
    (handing out a burst, waiting for its reader) holds nobody up. Proposals of an attention-free
    EAGLE draft meet there too (`propose`, through `GatedStep`): every stream's in one call. The
    `target`'s pass waits while requests of another model (proposals, a draft LM's forwards) are
    pending: those run first, and the streams that made them reach the verify, so that one target
    pass carries every stream's verify instead of a stream with a shorter draft verifying alone.
    Each pass's time is kept per model (`times`: `cost_model.PassTimes`), which a stream's adaptive
    draft length plans with."""

    def __init__(self, target: BatchedLM | None = None):
        self.target = target
        lock = threading.RLock()
        self.cond = threading.Condition(lock)  # streams wait here for their requests
        self.work = threading.Condition(lock)  # the gate's thread waits here for requests to run
        self.thread: threading.Thread | None = None
        self.inside = 0  # streams inside their decode loop
        self.pending: list[StepRequest] = []
        self.runs = 0  # forwards run
        self.sizes: list[int] = []  # requests per run, the recent ones
        self.times: dict[BatchedLM, PassTimes] = {}

    def pass_times(self, lm: BatchedLM) -> PassTimes:
        """The measured passes of `lm` (what a batched stream's plan reads; empty before the first)."""
        with self.cond:
            return self.times.setdefault(lm, PassTimes())

    def proposal_times(self, proposer) -> PassTimes | None:
        """The measured calls of `proposer`'s shared proposals (a batch's fork whose step is a
        `GatedStep`), or None where its proposals are its stream's own."""
        step = getattr(proposer, "step", None)
        return self.pass_times(step.step) if isinstance(step, GatedStep) else None

    def time_proposals(self, step, streams: int) -> None:
        """Record what one call of a stateless EAGLE `step` for `streams` streams' rows costs (its
        second call: the first may initialise kernels), so that a stream's first plan in the batch
        prices its proposals' share before any call has been measured."""
        rows = [(torch.zeros(1, step.hidden_size, dtype=step.dtype, device=step.device),
                 torch.zeros(1, dtype=torch.long, device=step.device))] * streams
        for _ in range(2):
            started = time.perf_counter()
            step.run_rows(rows)
        self.pass_times(step).record(streams, streams, time.perf_counter() - started)

    def enter(self) -> None:
        with self.cond:
            self.inside += 1

    def leave(self) -> None:
        with self.cond:
            self.inside -= 1
            self.work.notify()

    def forward(self, lm: BatchedLM, slot: int, ids: torch.Tensor, kind: str):
        return self._wait(StepRequest(lm, slot, ids.view(-1), kind))

    def propose(self, step, states: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A stateless EAGLE step's `run` (f [D], head scores [W]), made with the other streams'."""
        return self._wait(ProposalRequest(step, states, tokens))

    def _wait(self, request):
        with self.cond:
            self.pending.append(request)
            if self.thread is None:
                self.thread = threading.Thread(target=self._serve, name="pcgtts-gate", daemon=True)
                self.thread.start()
            self.work.notify()
            while not request.done:
                self.cond.wait()
        if request.error is not None:
            raise request.error
        return request.result

    def _serve(self) -> None:
        """The gate's thread: run the waiting requests whenever every stream inside waits; end when no
        stream is inside and nothing waits (the next request starts another)."""
        with self.cond:
            try:
                while self.pending or self.inside:
                    if self.pending and len(self.pending) >= self.inside:
                        self._run_pending()
                    else:
                        self.work.wait()
            except BaseException as err:  # never leave a stream waiting for a thread that is gone
                log.exception("the batch's gate failed outside a forward")
                for request in self.pending:
                    request.error, request.done = err, True
                self.pending = []
                self.cond.notify_all()
            finally:
                self.thread = None

    def _run_pending(self) -> None:
        """(under the lock) Run every request waiting, the target's held while others wait (`StepGate`):
        one pass per model (`_passes`; proposals: `_run_proposals`)."""
        requests, self.pending = self.pending, []
        held = [r for r in requests if r.lm is self.target]
        if held and len(held) < len(requests):  # the others first: their streams then verify with these
            self.pending, requests = held, [r for r in requests if r.lm is not self.target]
        models: dict[int, list] = {}
        for request in requests:
            models.setdefault(id(request.lm), []).append(request)
        for group in models.values():
            if isinstance(group[0], ProposalRequest):
                self._run_proposals(group)
                continue
            for run in self._passes(group):
                self._run(run)
        for request in requests:
            request.done = True
        self.cond.notify_all()

    @staticmethod
    def _passes(group: list[StepRequest]) -> list[list[StepRequest]]:
        """One model's requests -> the forwards that run them: one, its rows padded to the longest,
        unless the padding would not fit a slot's cache or would multiply the pass's tokens more than
        `RAGGED_WASTE` times (a draft catching up on 64 tokens beside one-token steps); then one per
        token count."""
        counts = [len(r.ids) for r in group]
        longest = max(counts)
        if len(group) * longest <= RAGGED_WASTE * sum(counts) and all(r.lm.has_room(r.slot, longest) for r in group):
            return [group]
        by_count: dict[int, list[StepRequest]] = {}
        for request in group:
            by_count.setdefault(len(request.ids), []).append(request)
        return list(by_count.values())

    def _run(self, run: list[StepRequest]) -> None:
        lm = run[0].lm
        counts = [len(r.ids) for r in run]
        longest = max(counts)
        try:
            started = time.perf_counter()
            with torch.inference_mode():
                ids = torch.stack([torch.cat([r.ids, r.ids[-1:].expand(longest - len(r.ids))]) for r in run])
                states = lm.hidden([r.slot for r in run], ids, counts if min(counts) < longest else None)
                rows = [states[i, :count] for i, count in enumerate(counts)]  # the padding's rows dropped
                scores = lm.model.head_scores(torch.cat(rows)).split(counts)  # one read of the head for them all
                for request, row, score in zip(run, rows, scores):
                    request.result = lm.outputs(row, request.kind, score)
            self.pass_times(lm).record(len(run), len(run) * longest, time.perf_counter() - started)
        except BaseException as err:  # each stream of the run hears it
            for request in run:
                request.error = err
        self.runs += 1
        self.sizes.append(len(run))
        del self.sizes[:-100]

    def _run_proposals(self, run: list[ProposalRequest]) -> None:
        """One call for every stream's proposal (one stream's: its own step's `run`, as alone)."""
        step = run[0].lm
        try:
            started = time.perf_counter()
            with torch.inference_mode():
                if len(run) == 1:
                    run[0].result = step.run(run[0].states, run[0].tokens, 0)
                else:
                    f, scores = step.run_rows([(r.states, r.tokens) for r in run])
                    for i, request in enumerate(run):
                        request.result = f[i], scores[i]
            self.pass_times(step).record(len(run), len(run), time.perf_counter() - started)
        except BaseException as err:  # each stream of the run hears it
            for request in run:
                request.error = err


class GatedStep:
    """A stateless EAGLE step (`stateless`: an attention-free draft's) as one stream of a batch sees
    it: its `run` meets the other streams' proposals at the gate (`StepGate.propose`), one call for
    all of them; everything else is the shared step's."""

    def __init__(self, step, gate: StepGate):
        if not getattr(step, "stateless", False):
            raise ValueError(f"{type(step).__name__} keeps a cache of its own: its proposals are made per stream")
        self.step, self.gate = step, gate

    def run(self, states: torch.Tensor, tokens: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate.propose(self.step, states, tokens)

    def __getattr__(self, name: str):
        return getattr(self.step, name)


class SlotLM:
    """The `LM` protocol over one slot of a `BatchedLM`, its forwards run through a `StepGate` with the
    other streams' (one stream's view: its decode loop, proposers and rollbacks use it as an LM)."""

    compiled = False
    exported_proposers: frozenset[str] = frozenset()

    def __init__(self, lm: BatchedLM, slot: int, gate: StepGate):
        self.batched, self.slot, self.gate = lm, slot, gate
        self.vocab, self.device, self.max_length = lm.vocab, lm.device, lm.max_length
        self.tokenizer, self.model_dir = lm.lm.tokenizer, lm.lm.model_dir

    @property
    def length(self) -> int:
        return self.batched.lengths[self.slot]

    @property
    def fingerprint(self) -> str:
        return self.batched.lm.fingerprint

    @property
    def drawable_digits(self) -> int:
        return self.batched.drawable_digits

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.numel() == 0:
            raise ValueError("empty prompt")
        with torch.inference_mode():
            return self.batched.outputs(self.batched.prefill(self.slot, ids), "logits")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.gate.forward(self.batched, self.slot, ids, "logits")

    def forward_scores(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate.forward(self.batched, self.slot, ids, "scores")

    def forward_hidden(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate.forward(self.batched, self.slot, ids, "hidden")

    def rollback(self, length: int) -> None:
        self.batched.rollback(self.slot, length)

    def ensure_cache(self) -> None:
        self.batched.ensure_cache()

    def release(self) -> None:
        """The slot's cache belongs to the batch: nothing to free here."""
