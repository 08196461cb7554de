"""Whole decode steps on the device: a plain or speculative step as one fixed-shape tensor program
that reads and writes only device tensors, so a CUDA graph captures all of it and the host reads
the results once per `steps_per_sync` steps.

The host loop (`loop.py`) reads every step's accepted count to decide what to feed next;
on a GPU each read is a synchronisation that leaves the device idle while Python runs. Here the
state the host loop keeps in Python lives in device tensors (`DeviceState`):

  position  the cache slot of `last`; both caches hold valid entries for every slot before it
            (the draft's possibly all but the last: see below)
  last      the newest token (full-vocabulary id), fed at `position` by the next step
  prev      the token at `position - 1`
  out       the restricted indices emitted so far, `count` of them (later slots: scratch)
  minimum   the minimum length: target rows deciding token number count + i < minimum give the
            stop token probability 0 (`sampling.forbid_stop`), in the plain and the verify step

A speculative step of draft length L (static: one graph per L):
  1. the draft is fed [prev, last] at [position - 1, position], then each proposal in turn, and
     draws L proposals. Feeding `prev` again rewrites a slot with the token it already held,
     except after a step that accepted everything, where it is the proposal the draft never saw:
     the host loop's "catch-up" without a branch;
  2. the target is fed [last, x_1 .. x_L] at [position .. position + L] in one pass;
  3. `acceptance.verify(..., sync_free=True)` gives n accepted and the n + 1 tokens, every branch
     a `torch.where`;
  4. all L + 1 output slots are written at `count` (those past n are overwritten by the next
     step), count += n + 1, and position += n + 1 is the rollback (stale slots past it are masked
     by causality and rewritten later).
A plain step (policy `ar`) is one target forward and one draw.

Steps keep running after the stop token (the host trims at it), so the host bounds how many it
queues by the cache room and the token budget it knew at its last read. On a CPU the same step
runs eagerly (`tests/test_device_loop.py` holds it to the host loop; the sync-free rules'
exactness is tested in `tests/test_adaptive.py`); on CUDA it is captured once per `StepSpec` and
replayed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import torch

from pcgtts.groups.device import DeviceGroupTable
from pcgtts.runtime.config import MAX_DRAFT_LENGTH, DecodeConfig, SamplingConfig
from pcgtts.runtime.decode.acceptance.tensor import draw_uniforms, verify
from pcgtts.runtime.decode.policy import Rule
from pcgtts.runtime.decode.sampling import forbid_stop, logits_to_probs, sample
from pcgtts.runtime.decode.steps import emitted, start_sequence
from pcgtts.runtime.lm.llama import Llama
from pcgtts.runtime.lm.torch_lm import TorchLM
from pcgtts.runtime.text.vocab import SpeechVocab


@dataclass
class DeviceState:
    """The decode loop's state as device tensors (shapes fixed for a sequence)."""

    position: torch.Tensor  # int64 [1]
    last: torch.Tensor  # int64 [1]
    prev: torch.Tensor  # int64 [1]
    out: torch.Tensor  # int64 [capacity]
    count: torch.Tensor  # int64 [1]
    accepted: torch.Tensor  # int64 [MAX_DRAFT_LENGTH]: proposals accepted at draft position i (the first L used), summed
    minimum: torch.Tensor  # int64 [1]: no stop token before this many speech tokens (`DecodeConfig.min_new_tokens`)

    @classmethod
    def zeros(cls, capacity: int, device) -> "DeviceState":
        """A state to capture steps on; `DeviceLoop.reset` points it at a prompt."""
        def zero(size: int) -> torch.Tensor:
            return torch.zeros(size, dtype=torch.long, device=device)

        return cls(position=zero(1), last=zero(1), prev=zero(1), out=zero(capacity), count=zero(1),
                   accepted=zero(MAX_DRAFT_LENGTH), minimum=zero(1))

    def counters(self) -> tuple[torch.Tensor, ...]:
        """Every tensor a step advances but the output buffer (what a warm-up run must restore)."""
        return self.position, self.last, self.prev, self.count, self.accepted


@dataclass(frozen=True)
class StepSpec:
    """What one captured step does: a plain step (draft_length 0) or a speculative one with `rule`."""

    draft_length: int
    rule: str  # "ar" for a plain step; greedy | sd | ssd | pcg otherwise
    sampling: SamplingConfig
    ssd_beta: float = 0.0
    thinning_trials: int = 16
    compile: bool = False  # the models' forwards through torch.compile (fused kernels) before capture


def plain_step(target: Llama, vocab: SpeechVocab, state: DeviceState, spec: StepSpec,
               generator: torch.Generator) -> None:
    """One target forward at `position` and one draw, written into `state` in place."""
    logits = forbid_stop(target(state.last.view(1, 1), state.position)[0, -1:], state.count, state.minimum)  # [1, V_r]
    token = sample(logits_to_probs(logits[0], spec.sampling), generator).view(1)
    state.out.index_copy_(0, state.count, token)
    state.count.add_(1)
    state.position.add_(1)
    state.last.copy_(vocab.restricted_to_token_ids(token))


def speculative_step(target: Llama, draft: Llama, vocab: SpeechVocab, state: DeviceState, spec: StepSpec,
                     generator: torch.Generator, groups: DeviceGroupTable | None) -> None:
    """L draft steps, one verify pass, the rule and the rollback, written into `state` in place."""
    length, device = spec.draft_length, state.position.device
    steps = torch.arange(length + 1, device=device)
    ids, positions = torch.cat([state.prev, state.last]), state.position + steps[:2] - 1  # re-feed prev: see module
    proposals, rows = [], []
    for i in range(length):
        probs = logits_to_probs(draft(ids.view(1, -1), positions)[0, -1], spec.sampling)  # [V_r]
        token = sample(probs, generator).view(1)
        proposals.append(token)
        rows.append(probs)
        ids, positions = vocab.restricted_to_token_ids(token), state.position + i + 1
    draft_tokens = torch.cat(proposals)  # [L]
    fed = torch.cat([state.last, vocab.restricted_to_token_ids(draft_tokens)])  # [L + 1]
    target_logits = forbid_stop(target(fed.view(1, -1), state.position + steps)[0], state.count, state.minimum)
    target_probs = logits_to_probs(target_logits, spec.sampling)  # [L + 1, V_r]
    verdict = verify(spec.rule, draft_tokens[None], torch.stack(rows)[None], target_probs[None],
                     draw_uniforms(1, length, generator, device), generator, groups=groups,
                     ssd_beta=spec.ssd_beta, thinning_trials=spec.thinning_trials, sync_free=True)
    n = verdict.num_accepted  # [1]
    emitted = verdict.tokens[0]  # [L + 1]: n accepted, the next token, then placeholders
    state.out.index_copy_(0, state.count + steps, emitted)
    state.count.add_(n + 1)
    state.accepted[:length].add_((steps[:length] < n).long())
    state.prev.copy_(fed.gather(0, n))
    state.last.copy_(vocab.restricted_to_token_ids(emitted.gather(0, n)))
    state.position.add_(n + 1)


class DeviceStep:
    """One step program bound to its models and state; on CUDA a captured graph, replayed by `run`."""

    def __init__(self, target: Llama, draft: Llama | None, vocab: SpeechVocab, state: DeviceState, spec: StepSpec,
                 generator: torch.Generator, groups: DeviceGroupTable | None, warm_position: int = 1):
        if spec.compile:
            target, draft = (_compiled(model) if model is not None else None for model in (target, draft))
        if spec.draft_length:
            self._body = lambda: speculative_step(target, draft, vocab, state, spec, generator, groups)
        else:
            self._body = lambda: plain_step(target, vocab, state, spec, generator)
        self.graph = None
        if state.position.device.type == "cuda":
            self.graph = _capture(self._body, state, generator, warm_position)

    @torch.inference_mode()
    def run(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self._body()


COMPILE_BACKEND = "inductor"  # tests trace with "eager" (dynamo alone: no graph break allowed, no codegen)


def _compiled(model: Llama):
    """`model`'s forward compiled for fixed shapes (one graph per token count it sees; the warm-up
    before capture compiles them all) with no graph break, so a CUDA graph captures its kernels."""
    return torch.compile(model, backend=COMPILE_BACKEND, dynamic=False, fullgraph=True)


def _capture(body, state: DeviceState, generator: torch.Generator, warm_position: int):
    """Warm `body` up on a side stream, then capture it. The warm-up runs at cache slot
    `warm_position` (the buffer's end: slots no live sequence holds yet) and the state it advanced
    is restored; the caller reseeds the generator afterwards."""
    saved = [t.clone() for t in state.counters()]
    state.position.fill_(warm_position)
    state.count.zero_()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.inference_mode():
        for _ in range(2):
            body()
            state.position.fill_(warm_position)
            state.count.zero_()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    if generator not in torch.cuda.default_generators:  # see `_loop_generator`
        graph.register_generator_state(generator)
    with torch.cuda.graph(graph), torch.inference_mode():  # a private memory pool: graphs replay in any order
        body()  # recorded, not run
    for live, kept in zip(state.counters(), saved):
        live.copy_(kept)
    return graph


def step_spec(config: DecodeConfig) -> StepSpec:
    """The step `config` asks for (`DecodeConfig` has checked that the device loop runs it)."""
    if config.policy_spec.plain:
        return StepSpec(0, "ar", config.sampling, compile=config.compile_steps)
    rule = config.rule
    return StepSpec(config.draft_length, rule, config.sampling, config.ssd_beta if rule is Rule.SSD else 0.0,
                    config.pcg_thinning_trials, config.compile_steps)


class DeviceLoop:
    """A (target, draft) pair's device state and captured steps, reused across utterances while
    both models keep their KV buffers (the graphs read them by address)."""

    def __init__(self, target, draft, groups: DeviceGroupTable | None):
        self.target, self.draft, self.groups = target, draft, groups
        self.generator = _loop_generator(target.device)  # bound into the graphs; seeded per sequence
        self.state = DeviceState.zeros(target.max_length, target.device)
        self.steps: dict[StepSpec, DeviceStep] = {}
        self.key = _loop_key(target, draft, groups)

    def step(self, spec: StepSpec) -> DeviceStep:
        if spec not in self.steps:
            draft = self.draft.model if self.draft is not None else None
            warm = self.target.max_length - spec.draft_length - 2  # see `_capture`
            self.steps[spec] = DeviceStep(self.target.model, draft, self.target.vocab, self.state, spec,
                                          self.generator, self.groups, warm)
        return self.steps[spec]

    def reset(self, prompt_ids: torch.Tensor, generator: torch.Generator, min_tokens: int = 0) -> None:
        """Point the state at a prompt whose every token but the last both caches already hold, with
        no stop token before `min_tokens` speech tokens, and seed the loop's generator from
        `generator` (a seeded caller gets the same tokens every run)."""
        seed = torch.randint(0, 2 ** 62, (1,), generator=generator, device=generator.device)
        self.generator.manual_seed(int(seed))
        ids = prompt_ids.to(self.target.device).view(-1)
        s = self.state
        s.position.fill_(len(ids) - 1)
        s.last.copy_(ids[-1:])
        s.prev.copy_(ids[-2:-1])
        s.count.zero_()
        s.accepted.zero_()
        s.minimum.fill_(min_tokens)


def _loop_generator(device: torch.device) -> torch.Generator:
    """A generator of the loop's own, or on CUDA without `register_generator_state` (older torch)
    the device's default one, the only generator such a torch lets a graph capture."""
    if device.type == "cuda" and not hasattr(torch.cuda.CUDAGraph, "register_generator_state"):
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.Generator(device)


def _loop_key(target, draft, groups) -> tuple:
    """What a loop's graphs are bound to: the models' KV buffers (by address) and the group table."""
    def cache(lm):
        return lm.model.layers[0].self_attn.k_cache.data_ptr() if lm is not None else 0

    return cache(target), id(draft), cache(draft), id(groups)


def device_loop(target, draft, groups: DeviceGroupTable | None) -> DeviceLoop:
    """The pair's loop, made on first use and again whenever a cache was reallocated."""
    loop = getattr(target, "_device_loop", None)
    if loop is None or loop.key != _loop_key(target, draft, groups):
        loop = DeviceLoop(target, draft, groups)
        target._device_loop = loop
    return loop


def decode_on_device(target, draft, prompt_ids: torch.Tensor, config: DecodeConfig, generator: torch.Generator,
                     groups: DeviceGroupTable | None, stats) -> Iterator[list[int]]:
    """`loop.decode` with whole steps on the device: up to `config.steps_per_sync` steps are
    queued, then one host read brings their tokens back. Torch-backend LMs (their `Llama` runs the
    step); `stats` counts the steps run, past a stop token within the last batch included. `decode`
    has checked that the policy has its draft and group table."""
    spec = step_spec(config)
    for lm in (target, draft if spec.draft_length else None):
        if lm is not None and not isinstance(lm, TorchLM):
            raise ValueError("whole steps on the device need the torch backend")
    if len(prompt_ids) < 2:
        raise ValueError("whole steps on the device need a prompt of at least 2 tokens")
    if spec.draft_length and draft.max_length < target.max_length:  # the loop bounds positions by the target's
        raise ValueError(f"whole steps on the device need a draft cache as long as the target's "
                         f"({draft.max_length} < {target.max_length} tokens)")
    models = (target, draft) if spec.draft_length else (target,)
    for lm in models:
        start_sequence(lm, prompt_ids)
    loop = device_loop(target, draft if spec.draft_length else None, groups)
    step = loop.step(spec)  # captured (on CUDA) before `reset` seeds the generator the warm-up drew from
    loop.reset(prompt_ids, generator, config.min_new_tokens)
    width, read = spec.draft_length + 1, 0
    position = len(prompt_ids) - 1
    if spec.draft_length:
        stats.per_position_accepted = [0] * spec.draft_length
        stats.length_counts = [0] * width
    while True:
        left = config.max_new_tokens - stats.emitted
        batch = min(config.steps_per_sync, left, (target.max_length - 1 - position) // width)
        if batch < 1:
            stats.finish = "max_tokens" if left < 1 else "cache_full"
            break
        for _ in range(batch):
            step.run()
        head = torch.cat([loop.state.count, loop.state.position, loop.state.out[read:read + batch * width]])
        count, position, *tokens = head.tolist()  # the batch's one host read
        tokens = tokens[:count - read]
        read = count
        stats.steps += batch
        stats.target_forwards += batch
        stats.draft_forwards += batch * spec.draft_length
        stats.trace.append((time.perf_counter(), len(tokens)))
        tokens = emitted(tokens, target.vocab.stop_index, config.max_new_tokens, stats)
        if tokens:
            yield tokens
        if stats.finish:
            break
    for lm in models:  # the host's view of the caches: everything before the newest token
        lm.length = min(position, lm.max_length)
    if spec.draft_length:
        stats.drafted = stats.steps * spec.draft_length
        stats.per_position_accepted = loop.state.accepted[:spec.draft_length].tolist()
        stats.accepted = sum(stats.per_position_accepted)
        stats.length_counts[spec.draft_length] = stats.steps
