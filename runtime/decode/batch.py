"""Continuous batching: many streams' decodes stepped together over one model copy.

A `BatchDecoder` owns a `BatchedLM` (runtime/lm/batched.py: one KV slot per stream over the
target's weights) and one thread that runs the batch. A stream takes a slot for its whole life
(`seat()`, refused at once with `BatchFull` when every slot is held; a slot given back during the
step under way is free when it ends) and decodes its
sentences through it (`SlotSeat.decode`, an iterator of bursts like `loop.decode`). At each step
boundary the thread admits the decodes that arrived (prefilling each into its own slot while the
others keep their KV), then runs one forward over the last token of every decode that has room,
and draws each slot's next token with that stream's own settings and generator, the minimum length
(`sampling.forbid_stop`) and budget applied as `loop.py` applies them (`steps.draw_next`,
`steps.emitted`). Each stream's tokens reach it through its own queue; a decode whose queue holds
`ahead_tokens` unread tokens sits out the steps until its reader takes them (a stream nobody reads
stops costing compute), and one whose reader is gone (closed, cancelled, failed) leaves the batch
at the next step boundary; its slot is free again once its seat is closed.

Speculative streams (every other policy the host loop runs: a draft LM's, with a draft's
`BatchedLM` over the same slots; the heads' and the EAGLE draft's, each slot with its own fork of
the proposer: `BatchDecoder.fork`) each run `loop.decode` on their own thread over their slots'
views (`batched.SlotLM`): the proposer proposes, the target verifies, the rule judges and each slot
rolls back to its own accepted length, its draws from its own generator, while every forward meets
the other streams' at a `batched.StepGate` and runs in one pass with them (ragged acceptance: a
slot verifying 1 token and one verifying 4 share a pass, the shorter row padded), and so do an
attention-free EAGLE draft's proposals (one call for every stream's rows); a verify waits while
other streams still draft, so that one target pass carries them all. An adaptive draft
length plans with its step costs shared with the batch's measured passes
(`cost_model.SharedPassCosts`): with many streams in a pass speculation stops paying and the plan
falls to plain steps.

A decode alone in the batch draws exactly what `loop.decode` draws for it (the same forward, bit
for bit, and the same draws from its generator). In a step of several slots a slot's logits differ
from its logits alone in the last bits (`batched.py`), so a greedy or seeded stream's tokens do not
depend on its neighbours unless a draw falls within that rounding of a tie or a CDF boundary.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from pcgtts.runtime.config import DecodeConfig
from pcgtts.runtime.decode.cost_model import StepCosts, pays_in_batch, plans_draft_length, shared_pass_costs
from pcgtts.runtime.decode.loop import decode
from pcgtts.runtime.decode.sampling import digits_to_draw
from pcgtts.runtime.decode.steps import DecodeStats, draw_next, emitted
from pcgtts.runtime.lm.batched import BatchedLM, SlotLM, StepGate

log = logging.getLogger(__name__)

AHEAD_TOKENS = 64  # unread tokens a decode may queue before it sits out steps (1.3 s of audio)
OCCUPANCY_WINDOW = 100  # steps the recent occupancy is kept for
_END = object()


class BatchFull(RuntimeError):
    """Every slot of the batch is held by a stream: refused at once, nothing waits."""


def check_batchable(config: DecodeConfig, draft: bool = False) -> None:
    """A one-line ValueError unless a batch (with a draft LM's own batch: `draft`) runs `config`: every
    policy on the host loop, at a fixed or an adaptive draft length (plain streams stepped by the
    batch's thread, the others each by its own loop over its slots), a draft LM's where the batch
    holds the draft."""
    if config.steps_per_sync:
        raise ValueError("the batch decodes on the host loop, not with steps_per_sync")
    if config.policy_spec.needs_draft and not draft:
        raise ValueError(f"policy {config.policy!r} needs the draft LM, which this batch does not hold "
                         "(a draft on the torch backend)")


@dataclass(eq=False)
class BatchJob:
    """One sentence's decode in a slot: its settings, generator, counters and the queue its reader takes."""

    slot: int
    prompt: torch.Tensor
    config: DecodeConfig
    generator: torch.Generator
    stats: DecodeStats
    out: deque = field(default_factory=deque)  # bursts, then _END or an exception
    unread: int = 0  # tokens in `out`
    wake_at: int = 1  # unread tokens at which its reader is woken (the tokens it waits for: `SlotSeat.decode`)
    ready: threading.Condition | None = None  # its reader waits here (on the batch's lock)
    started: bool = False  # prefilled into its slot
    done: bool = False  # finished (the stop token, a limit or an error): no more steps
    cancelled: bool = False  # its reader is gone
    last: torch.Tensor | None = None  # the newest token id, fed by the next step


class BatchDecoder:
    """`slots` streams' plain decodes over one `BatchedLM`, stepped together by one thread; with a
    draft's `BatchedLM` (the same slots), speculative streams too, each running its own loop over its
    slots with the forwards of all of them run together (`batched.StepGate`)."""

    def __init__(self, lm: BatchedLM, ahead_tokens: int = AHEAD_TOKENS, draft: BatchedLM | None = None,
                 groups=None):
        if ahead_tokens < 1:
            raise ValueError(f"ahead_tokens must be >= 1, got {ahead_tokens}")
        if draft is not None and draft.slots != lm.slots:
            raise ValueError(f"the draft's batch has {draft.slots} slots, the target's {lm.slots}")
        self.lm, self.ahead_tokens, self.draft, self.groups = lm, ahead_tokens, draft, groups
        self.gate = StepGate(lm)
        self.stepping: set[int] = set()  # slots of the step under way on the batch's thread
        self.closing: set[int] = set()  # slots given back during it: free once it ends
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)  # the batch's thread and seat-takers wait here, readers on their job's
        self.free = list(range(lm.slots))  # slots no seat holds
        self.jobs: list[BatchJob] = []  # submitted and not yet dropped
        self.thread: threading.Thread | None = None
        self.occupancy: list[int] = []  # decodes per step, the last `OCCUPANCY_WINDOW` steps
        self.steps = 0
        self.forks: dict[tuple[int, int], tuple[object, object]] = {}  # (slot, id) -> (a proposer, its fork)

    def fork(self, slot: int, proposer):
        """`slot`'s own copy of a proposer on the target's states (`proposer.fork(gate)`: the same weights,
        its own per-utterance state, its proposals made with the other slots' where its step keeps no
        cache), made once per slot and kept for the streams that hold it."""
        with self.cond:
            key = (slot, id(proposer))
            if key not in self.forks or self.forks[key][0] is not proposer:
                self.forks[key] = (proposer, proposer.fork(self.gate))
            return self.forks[key][1]

    # -- admission ------------------------------------------------------------------------------

    @property
    def slots(self) -> int:
        return self.lm.slots

    @property
    def seated(self) -> int:
        """Slots held by streams now."""
        with self.cond:
            return self.lm.slots - len(self.free)

    @property
    def decoding(self) -> int:
        """Decodes in the batch now (started, not finished)."""
        with self.cond:
            return sum(1 for job in self.jobs if not job.done and not job.cancelled)

    def recent_passes(self) -> list[int]:
        """Streams each recent forward carried: the plain steps' and the speculative streams' passes."""
        return list(self.occupancy) + list(self.gate.sizes)

    def seat(self) -> "SlotSeat":
        """A slot for one stream's life; `BatchFull` at once when every slot is held (a slot given back
        during the step under way is waited for: it is free when that step ends)."""
        with self.cond:
            while not self.free and self.closing:
                self.cond.wait(timeout=1.0)
            if not self.free:
                raise BatchFull(f"all {self.lm.slots} batch slots are streaming; close a stream first "
                                f"(or raise max_batch)")
            slot = self.free.pop(0)
        return SlotSeat(self, slot)

    def submit(self, job: BatchJob) -> None:
        with self.cond:
            job.ready = threading.Condition(self.lock)
            self.jobs.append(job)
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="pcgtts-batch", daemon=True)
                self.thread.start()
            self.cond.notify_all()

    def vacate(self, slot: int, job: BatchJob | None) -> None:
        """A seat ends: its decode (if one runs) steps no more, and its slot is free at once, or when the
        step under way ends if that step carries it (the slot is never written by two decodes at once)."""
        with self.cond:
            if job is not None:
                job.cancelled = True
            if slot in self.stepping:
                self.closing.add(slot)
            elif slot not in self.free:
                self._free(slot)
            self.cond.notify_all()

    def _free(self, slot: int) -> None:
        self.free.append(slot)
        self.free.sort()

    def release(self) -> bool:
        """Free the slots' caches when no stream holds a slot; whether they were freed."""
        with self.cond:
            if len(self.free) < self.lm.slots:
                return False
            for lm in (self.lm, self.draft):
                if lm is not None:
                    lm.release()
            return True

    # -- the batch's thread ---------------------------------------------------------------------

    def _ready(self) -> list[BatchJob]:
        """(under the lock) Drop the decodes that ended or whose reader is gone; those that may step now."""
        self.jobs = [job for job in self.jobs if not (job.cancelled or job.done)]
        return [j for j in self.jobs if not j.done and j.unread < self.ahead_tokens]

    def _run(self) -> None:
        while True:
            with self.cond:
                ready = self._ready()
                while not ready:
                    if not self.jobs:  # nothing to wait for: the thread ends, a later submit starts one
                        self.thread = None
                        return
                    self.cond.wait(timeout=1.0)
                    ready = self._ready()
                self.stepping = {job.slot for job in ready}
            try:
                self._step(ready)
            except BaseException as err:  # every decode of the step hears it; the batch goes on
                log.exception("a batched step failed")
                self._deliver({job: err for job in ready})

    def _start(self, job: BatchJob) -> None:
        prompt = job.prompt.view(-1)
        self.lm.prefill(job.slot, prompt[:-1])  # every prompt token but the last, which the first step feeds
        job.last = prompt[-1:].to(self.lm.device)
        job.started = True

    def _step(self, ready: list[BatchJob]) -> None:
        results: dict[BatchJob, object] = {}
        stepping = []
        for job in ready:
            try:
                if not job.started:
                    self._start(job)
            except Exception as err:  # this decode's own failure (e.g. its prompt overflows the cache)
                results[job] = err
                continue
            stats, config = job.stats, job.config
            if stats.emitted >= config.max_new_tokens:
                stats.finish = "max_tokens"
            elif not self.lm.has_room(job.slot, 1):
                stats.finish = "cache_full"
            else:
                stepping.append(job)
                continue
            results[job] = _END
        if stepping:
            t0 = time.perf_counter()
            ids = torch.cat([job.last for job in stepping])[:, None]  # [n, 1]
            scores = self.lm.step_scores([job.slot for job in stepping], ids)
            t1 = time.perf_counter()
            self.gate.pass_times(self.lm).record(len(stepping), len(stepping), t1 - t0)  # what a plan reads
            draws = []
            for i, job in enumerate(stepping):
                sampling = job.config.sampling
                digits = digits_to_draw(self.lm, sampling)
                row = scores[i, -1:] if digits else self.lm.model.scores_to_logits(scores[i, -1:])
                draws.append(draw_next(row, sampling, digits, job.generator, job.stats.emitted,
                                       job.config.min_new_tokens))
            tokens = torch.stack(draws).tolist()  # the step's one host sync
            now = time.perf_counter()
            vocab = self.lm.vocab
            for job, token in zip(stepping, tokens):
                stats = job.stats
                stats.steps += 1
                stats.target_forwards += 1
                stats.time_target += t1 - t0
                stats.time_verify += now - t1
                stats.trace.append((now, 1))
                job.last = vocab.token_ids([token], self.lm.device)
                burst = emitted([token], vocab.stop_index, job.config.max_new_tokens, stats)
                results[job] = [burst, _END] if stats.finish else [burst]
            self.steps += 1
            self.occupancy.append(len(stepping))
            del self.occupancy[:-OCCUPANCY_WINDOW]
        self._deliver(results)

    def _deliver(self, results: dict) -> None:
        """Hand each decode its step's tokens (or its end, or an error); the step is over."""
        with self.cond:
            self.stepping = set()
            for slot in self.closing:
                self._free(slot)
            self.closing.clear()
            for job, result in results.items():
                items = result if isinstance(result, list) else [result]
                for item in items:
                    if isinstance(item, list):
                        if not item:
                            continue
                        job.unread += len(item)
                    else:
                        job.done = True
                    job.out.append(item)
                if job.done or job.unread >= job.wake_at:
                    job.ready.notify()
            self.cond.notify_all()


class SlotSeat:
    """One stream's hold on a batch slot: its sentences decode through it one after another."""

    def __init__(self, batch: BatchDecoder, slot: int):
        self.batch, self.slot = batch, slot
        self.job: BatchJob | None = None
        self.closed = False
        self.target = SlotLM(batch.lm, slot, batch.gate)  # the slot as an LM, for a loop of its own
        self.draft = SlotLM(batch.draft, slot, batch.gate) if batch.draft is not None else None

    def decode(self, prompt_ids: torch.Tensor, config: DecodeConfig, generator: torch.Generator,
               stats: DecodeStats | None = None, costs: StepCosts | None = None, proposer=None,
               acceptance=None, wanted: Callable[[], int] | None = None) -> Iterator[list[int]]:
        """Bursts of speech codes for `prompt_ids` [T] from this slot, as `loop.decode` yields them:
        plain decoding stepped by the batch's thread, any other policy by `loop.decode` over this slot's
        views (its forwards run together with the other streams' at the gate). `costs`, `proposer` and
        `acceptance` are `loop.decode`'s (`DraftLengthPlanner.loop_arguments`): the proposer on the
        target's states is this slot's fork of it, and an adaptive draft length plans with `costs`
        shared with the batch's passes (`cost_model.SharedPassCosts`). `wanted()`: how many more tokens
        the reader needs before it has work (its next audio chunk's), so that the batch's steps wake it
        then, not for every token (None: every token)."""
        check_batchable(config, draft=self.draft is not None)
        spec = config.policy_spec
        if spec.reads_states and proposer is None:
            raise ValueError(f"policy {config.policy!r} proposes from the target's states: give its proposer")
        if plans_draft_length(config) and costs is None:
            raise ValueError("an adaptive draft length in a batch plans with given step costs "
                             "(`DraftLengthPlanner.plan`), not ones measured through the batch")
        if self.closed:
            raise RuntimeError("this batch slot was given back")
        if self.job is not None and not (self.job.done or self.job.cancelled):
            raise RuntimeError("this slot is still decoding its last sentence")
        stats = stats if stats is not None else DecodeStats()
        batch, adaptive = self.batch, plans_draft_length(config)
        proposer = batch.fork(self.slot, proposer) if spec.reads_states else None
        passes, proposals = batch.gate.pass_times(batch.lm), batch.gate.proposal_times(proposer)
        if spec.plain or adaptive and not pays_in_batch(costs, acceptance, config.draft_length, passes, batch.seated,
                                                        proposal_passes=proposals):
            # plain decoding, or an adaptive length whose plan at this batch's size is plain: the batch's
            # own steps carry it (as `loop.decode` would with L = 0, minus a loop of its own)
            return self._read(BatchJob(self.slot, prompt_ids, config, generator, stats), wanted)
        self.job = None
        if adaptive:
            costs = shared_pass_costs(costs, passes,
                                      batch.gate.pass_times(batch.draft) if batch.draft is not None else None,
                                      proposals)
        return self._speculate(decode(self.target, self.draft, prompt_ids, config, generator, self.batch.groups,
                                      stats, costs=costs, proposer=proposer, acceptance=acceptance))

    def _speculate(self, bursts: Iterator[list[int]]) -> Iterator[list[int]]:
        """`loop.decode`'s bursts, run inside the gate while it computes (not while its reader holds a
        burst)."""
        gate = self.batch.gate
        try:
            while True:
                gate.enter()
                try:
                    burst = next(bursts)
                except StopIteration:
                    return
                finally:
                    gate.leave()
                yield burst
        finally:
            bursts.close()

    def _read(self, job: BatchJob, wanted: Callable[[], int] | None = None) -> Iterator[list[int]]:
        """The job's tokens as they come, in bursts of what has queued: its reader is woken once the
        tokens it waits for (`wanted()`, at most `ahead_tokens`) are there, or the decode ended, not
        for every step (a wake per token had cost the batch's thread ~5 % of its pace, one stream alone)."""
        batch = self.batch
        self.job = job
        batch.submit(job)
        try:
            while True:
                with batch.cond:
                    job.wake_at = min(max(1, wanted() if wanted is not None else 1), batch.ahead_tokens)
                    while not (job.out and (job.done or job.unread >= job.wake_at)):
                        if batch.thread is None and not job.done:  # its thread is gone without a word
                            raise RuntimeError("the batch's decoding thread stopped")
                        job.ready.wait(timeout=0.5)
                    burst, end = [], None
                    while job.out and end is None:
                        item = job.out.popleft()
                        if isinstance(item, list):
                            burst += item
                        else:
                            end = item
                    if job.unread >= batch.ahead_tokens:
                        batch.cond.notify_all()  # it sat out: it may step again
                    job.unread -= len(burst)
                if burst:
                    yield burst
                if end is _END:
                    return
                if end is not None:
                    raise end
        finally:
            with batch.cond:
                job.cancelled = True  # it leaves the batch at the next step boundary (no-op once done)
                batch.cond.notify_all()

    def close(self) -> None:
        """Give the slot back (its decode, if one runs, leaves the batch at the next step). Idempotent."""
        if self.closed:
            return
        self.closed = True
        job = self.job if self.job is not None and not self.job.done else None
        self.batch.vacate(self.slot, job)
