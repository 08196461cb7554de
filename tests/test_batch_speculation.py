"""Every speculative policy in a batch (runtime/decode/batch.py): the EAGLE draft's and the heads'
with a fork of the proposer per slot, the adaptive draft length planned with the batch's shared
passes (cost_model.SharedPassCosts), and ragged passes at the gate (runtime/lm/batched.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pcgtts.runtime.config import DecodeConfig, SamplingConfig
from pcgtts.runtime.decode.batch import BatchDecoder
from pcgtts.runtime.decode.cost_model import PassTimes, StepCosts, best_length, pays_in_batch, shared_pass_costs
from pcgtts.runtime.decode.loop import decode
from pcgtts.runtime.decode.proposers import EagleProposer, HeadProposer
from pcgtts.runtime.lm.batched import BatchedLM, GatedStep, SlotLM, StepGate
from pcgtts.runtime.lm.torch_lm import TorchLM

from helpers import random_draft, random_heads
from test_batch_decode import prompts, together

# one stream's costs: a forward of k tokens costs little more than one of 1 (a CPU reading the weights)
COSTS = StepCosts(target_forward=(1e-3, 1.05e-3, 1.1e-3, 1.15e-3, 1.2e-3), draft_forward=(1e-4, 1.1e-4), rule=5e-5,
                  sample=2e-5)


def config(policy, temperature=0.0, adaptive=False, tokens=40):
    return DecodeConfig(policy=policy, max_new_tokens=tokens, min_new_tokens=10, adaptive_draft=adaptive,
                        draft_length=3, sampling=SamplingConfig(temperature=temperature))


def alone(target, draft, prompt, cfg, seed, groups=None, **plan):
    generator = torch.Generator().manual_seed(seed)
    return [t for burst in decode(target, draft, prompt, cfg, generator, groups, **plan) for t in burst]


@pytest.fixture(scope="module")
def target(tiny_pair):
    return tiny_pair[0]


@pytest.fixture(scope="module")
def eagle(target):
    return EagleProposer.from_draft(random_draft(target), target)  # an attention block: a cache of its own


@pytest.fixture(scope="module")
def heads(target):
    return HeadProposer.from_heads(random_heads(target), target)


def test_a_fork_shares_the_weights_and_not_the_state(target, eagle, heads):
    twin = eagle.fork()
    mine, theirs = eagle.step.draft, twin.step.draft
    for (name, a), (_, b) in zip(mine.named_parameters(), theirs.named_parameters()):
        assert a.data_ptr() == b.data_ptr(), name  # the same storage: no weight copied
    attn, twin_attn = mine.block.self_attn, theirs.block.self_attn
    assert twin_attn is not attn and twin_attn.k_cache.data_ptr() != attn.k_cache.data_ptr()
    eagle.start(5)
    eagle.observe(torch.zeros(2, eagle.step.hidden_size), [1, 2], 5)
    assert eagle.ready() and not twin.ready()  # its pending rows are its own
    twin.start(0)
    assert eagle.pending_tokens == [1, 2]
    eagle.start(0)
    mlp = EagleProposer.from_draft(random_draft(target, block="mlp"), target)
    assert mlp.fork().step is mlp.step  # an attention-free step keeps no state: shared
    gated = mlp.fork(StepGate()).step  # in a batch: its proposals meet the other streams' at the gate
    assert isinstance(gated, GatedStep) and gated.step is mlp.step and gated.digits == mlp.step.digits
    with pytest.raises(ValueError, match="keeps a cache of its own"):
        GatedStep(eagle.step, StepGate())
    heads_twin = heads.fork()
    assert heads_twin.step is heads.step
    heads.observe(torch.zeros(1, heads.step.hidden_size), [3], 0)
    assert heads.ready() and not heads_twin.ready()
    heads.start(0)


@pytest.mark.parametrize("policy", ["eagle-pcg", "mtp-sd", "pcg"])
def test_speculative_streams_of_every_proposer_decode_greedily_as_alone(tiny_pair, tiny_groups, eagle, heads, policy):
    """Four streams at temperature 0, the adaptive draft length (pcg) planned with the batch's shared
    passes: each gives its codes decoded alone, which are plain greedy decoding's."""
    target, draft = tiny_pair
    adaptive = policy == "pcg"
    cfg = config(policy, adaptive=adaptive)
    proposer = {"eagle-pcg": eagle, "mtp-sd": heads, "pcg": None}[policy]
    plan = dict(costs=COSTS if adaptive else None, proposer=proposer)
    ps = prompts(target)[:4]
    greedy = [alone(target, None, p, config("ar"), 0) for p in ps]
    assert [alone(target, draft, p, cfg, i, tiny_groups, **plan) for i, p in enumerate(ps)] == greedy
    batch = BatchDecoder(BatchedLM(target, 4), draft=BatchedLM(draft, 4), groups=tiny_groups)
    assert together(batch, ps, cfg, [0, 1, 2, 3], **plan) == greedy
    assert max(batch.recent_passes()) > 1 and batch.seated == 0  # (pcg's plan at 4 streams: the batch's steps)


@pytest.mark.parametrize("policy, adaptive", [("eagle-pcg", False), ("pcg", True)])
def test_a_seeded_speculative_stream_alone_in_the_batch_draws_what_it_draws_alone(tiny_pair, tiny_groups, eagle,
                                                                                   policy, adaptive):
    target, draft = tiny_pair
    cfg = config(policy, temperature=0.8, adaptive=adaptive)
    plan = dict(costs=COSTS if adaptive else None, proposer=eagle, acceptance=(0.6, 0.5))
    prompt = prompts(target)[1]
    expected = alone(target, draft, prompt, cfg, 7, tiny_groups, **plan)
    batch = BatchDecoder(BatchedLM(target, 2), draft=BatchedLM(draft, 2), groups=tiny_groups)
    assert together(batch, [prompt], cfg, [7], **plan) == [expected]


@pytest.fixture(scope="module")
def mlp_eagle(target):
    return EagleProposer.from_draft(random_draft(target, seed=2, block="mlp"), target)  # attention-free


def test_an_attention_free_draft_proposes_for_every_stream_in_one_call(target, mlp_eagle):
    """Streams of an attention-free EAGLE draft make their proposals together (one call over all their
    rows: `GatedStep`, `StepGate.propose`), and each stream's codes are still its greedy codes alone."""
    step = mlp_eagle.step
    f, scores = step.run_rows([(torch.randn(2, step.hidden_size), torch.tensor([3, 4])),
                               (torch.randn(1, step.hidden_size), torch.tensor([7]))])
    assert f.shape[0] == 2 and scores.shape[0] == 2
    cfg = config("eagle-pcg")
    ps = prompts(target)[:4]
    greedy = [alone(target, None, p, config("ar"), 0) for p in ps]
    batch = BatchDecoder(BatchedLM(target, 4))
    assert together(batch, ps, cfg, [0, 1, 2, 3], proposer=mlp_eagle) == greedy
    calls = batch.gate.pass_times(step)
    assert calls.passes > 0 and max(calls.seconds) > 1  # calls that carried several streams' proposals


def test_streams_with_different_draft_lengths_verify_in_one_pass(tiny_pair, tiny_groups, mlp_eagle):
    """A stream drafting 1 token reaches the verify while the others still draft 3: its verify waits
    for theirs (the draft's work at the gate runs first: EAGLE proposals, a draft LM's forwards), so
    the target's passes carry every stream."""
    target, draft = tiny_pair
    ps = prompts(target)[:4]
    for policy, proposer in (("eagle-pcg", mlp_eagle), ("pcg", None)):
        cfgs = [replace(config(policy, tokens=60), draft_length=k) for k in (1, 3, 3, 2)]
        batch = BatchDecoder(BatchedLM(target, 4), draft=BatchedLM(draft, 4), groups=tiny_groups)
        verifies, record, rows = batch.gate.pass_times(batch.lm), [], []
        record, verifies.record = verifies.record, lambda n, tokens, seconds: rows.append(n) or record(n, tokens, seconds)
        out = together(batch, ps, cfgs, [0, 1, 2, 3], proposer=proposer)
        assert all(len(codes) >= 10 for codes in out)
        # every pass carries every stream still decoding: 4 until the first finishes, then fewer
        assert rows[0] == 4 and rows == sorted(rows, reverse=True), (policy, rows)


def test_an_eagle_draft_reading_several_layers_gets_them_from_the_batch(tiny_lms, tiny_groups):
    """The batch's forwards return the tapped layers a fused EAGLE draft reads, as a `TorchLM`'s do."""
    tapped = TorchLM.load(tiny_lms["target"], max_length=512)
    proposer = EagleProposer.from_draft(random_draft(tapped, seed=3, feature_layers=(1,)), tapped)
    cfg = config("eagle-sd")
    ps = prompts(tapped)[:3]
    expected = [alone(tapped, None, p, cfg, 0, proposer=proposer) for p in ps]
    assert expected == [alone(tapped, None, p, config("ar"), 0) for p in ps]
    assert together(BatchDecoder(BatchedLM(tapped, 3)), ps, cfg, [0, 1, 2], proposer=proposer) == expected
    # seeded, alone in the batch: the draft's draws read the same rows, so the stream draws as alone
    sampled = config("eagle-sd", temperature=0.8)
    expected = alone(tapped, None, ps[0], sampled, 5, proposer=proposer)
    assert together(BatchDecoder(BatchedLM(tapped, 1)), ps[:1], sampled, [5], proposer=proposer) == [expected]


def test_a_ragged_pass_gives_each_slot_its_logits_alone_in_one_forward(target):
    """Two slots verifying 1 and 4 tokens run in one forward (the shorter row padded) and get the
    logits each gets alone; each slot's length advances by its own count."""
    a, b = prompts(target)[:2]
    fresh = torch.tensor([target.vocab.speech_offset + i for i in (3, 9, 4, 1)])
    expected = []
    for prompt, ids in ((a, fresh[:1]), (b, fresh)):
        target.prefill(prompt)
        expected.append(target.forward(ids))
    batched, gate = BatchedLM(target, 2), StepGate()
    batched.prefill(0, a)
    batched.prefill(1, b)
    views = [SlotLM(batched, 0, gate), SlotLM(batched, 1, gate)]
    results = [None, None]
    for view in views:
        gate.enter()

    def verify(i, ids):
        results[i] = views[i].forward(ids)
        gate.leave()

    import threading

    threads = [threading.Thread(target=verify, args=(i, ids)) for i, ids in enumerate((fresh[:1], fresh))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert gate.runs == 1 and gate.sizes == [2]  # one forward, not one per token count
    for got, want in zip(results, expected):
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-4)
    assert batched.lengths == [len(a) + 1, len(b) + 4]
    assert gate.times[batched].seconds.keys() == {8}  # its pass carried 2 rows of 4 tokens
    # padding that would write past a slot's cache end: one forward per token count instead
    assert len(StepGate._passes([_request(batched, 0, 1), _request(batched, 1, 4)])) == 1
    mostly_padding = [_request(batched, 0, 1)] * 4 + [_request(batched, 1, 64)]  # 320 tokens for 68
    assert [len(run) for run in StepGate._passes(mostly_padding)] == [4, 1]
    batched.lengths[0] = batched.max_length - 2
    assert len(StepGate._passes([_request(batched, 0, 1), _request(batched, 1, 4)])) == 2


def test_the_gate_runs_every_forward_on_its_own_thread_and_ends_it_when_idle(target, monkeypatch):
    """Streams' forwards run on the gate's one thread (never on a stream's), which ends when no stream
    is inside and nothing waits; a failure there reaches every stream that waited for it."""
    import threading

    batched, gate = BatchedLM(target, 2), StepGate()
    for slot, prompt in enumerate(prompts(target)[:2]):
        batched.prefill(slot, prompt)
    views = [SlotLM(batched, 0, gate), SlotLM(batched, 1, gate)]
    ran_on, errors = set(), []
    hidden = batched.hidden

    def recording(*args, **kwargs):
        ran_on.add(threading.get_ident())
        return hidden(*args, **kwargs)

    monkeypatch.setattr(batched, "hidden", recording)

    def stream(view, steps):  # entered before any stream starts: every pass carries both
        try:
            for _ in range(steps):
                view.forward(torch.tensor([target.vocab.speech_offset + 5]))
        except RuntimeError as err:
            errors.append(err)
        finally:
            gate.leave()

    def run_streams(steps):
        threads = [threading.Thread(target=stream, args=(view, steps)) for view in views]
        for thread in threads:
            gate.enter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        return [thread.ident for thread in threads]

    streams = run_streams(3)
    assert gate.sizes == [2, 2, 2] and len(ran_on) == 1 and not ran_on & set(streams)
    for _ in range(100):  # it ends once the streams have left
        if gate.thread is None:
            break
        threading.Event().wait(0.01)
    assert gate.thread is None and not errors

    def failing(*args, **kwargs):
        raise RuntimeError("the pass failed")

    monkeypatch.setattr(batched, "hidden", failing)
    run_streams(1)
    assert [str(err) for err in errors] == ["the pass failed"] * 2


def _request(lm, slot, count):
    from pcgtts.runtime.lm.batched import StepRequest

    return StepRequest(lm, slot, torch.zeros(count, dtype=torch.long), "logits")


def test_the_plan_falls_to_plain_decoding_when_shared_passes_make_speculation_not_pay():
    """Alone, a verify of 4 tokens costs about a plain step and speculation wins; in a pass of 8
    streams whose time grows with every token it carries, a verify token costs the pass's marginal
    time, and the same acceptance plans plain decoding (L = 0)."""
    acceptance = [0.6, 0.5, 0.4]
    assert best_length(COSTS, acceptance, 3) > 0
    passes = PassTimes()
    shared = shared_pass_costs(COSTS, passes)
    assert best_length(shared, acceptance, 3) == best_length(COSTS, acceptance, 3)
    assert shared.target(4) == COSTS.target(4)  # alone: unchanged
    for tokens in (8, 16, 24, 32):  # 8 streams a pass: 1 ms to read the weights, 0.2 ms a token
        for _ in range(50):
            passes.record(8, tokens, 1e-3 + 2e-4 * tokens)
    assert passes.streams == 8
    assert shared.target(1) == pytest.approx((1e-3 + 2e-4 * 8) / 8)  # the pass's share: the read split 8 ways
    assert shared.target(5) == pytest.approx(COSTS.target(40) * passes._level(COSTS.target_forward) / 8)
    assert best_length(shared, acceptance, 3) == 0
    # a sentence starting beside the others asks the same question before it starts its own loop
    assert pays_in_batch(COSTS, acceptance, 3, PassTimes(), streams=1)
    assert not pays_in_batch(COSTS, acceptance, 3, passes, streams=8)


def test_shared_proposals_cost_a_stream_its_share_of_a_call():
    """An attention-free EAGLE draft's proposals run B streams' rows a call: a stream's proposal costs
    the call's time over B (before any call was measured: its own cost alone, as if unshared), and a
    plan that does not pay with proposals made one stream at a time can pay with them shared."""
    eagle_costs = StepCosts(target_forward=(1e-3, 1.1e-3, 1.2e-3, 1.3e-3), draft_forward=(3e-4, 3e-4), rule=5e-5)
    passes, calls = PassTimes(), PassTimes()
    for tokens in (4, 8, 12, 16):  # 4 streams a pass: 0.9 ms to read the weights, 0.01 ms a token
        for _ in range(50):
            passes.record(4, tokens, 0.9e-3 + 1e-5 * tokens)
    acceptance = [0.7, 0.6, 0.5]
    shared = shared_pass_costs(eagle_costs, passes, proposal_passes=calls)
    assert shared.propose(2) == pytest.approx(2 * 3e-4)  # nothing measured: one stream's own cost
    calls.record(4, 4, 2e-4)  # one call for 4 streams' rows: less than one row's one at a time
    assert shared.propose(2) == pytest.approx(2 * 2e-4 / 4)
    assert not pays_in_batch(eagle_costs, acceptance, 3, passes, streams=4)
    assert pays_in_batch(eagle_costs, acceptance, 3, passes, streams=4, proposal_passes=calls)
    alone = shared_pass_costs(eagle_costs, PassTimes(), proposal_passes=calls)
    assert alone.propose(3) == eagle_costs.propose(3)  # alone: unchanged


def test_a_sentence_whose_plan_is_plain_at_the_batch_size_decodes_on_the_batch_steps(tiny_pair, tiny_groups):
    """An adaptive pcg stream starting in a full batch whose passes make speculation not pay runs no loop
    of its own: the batch's plain steps carry it (greedy: still greedy decoding's codes)."""
    target, draft = tiny_pair
    batch = BatchDecoder(BatchedLM(target, 8), draft=BatchedLM(draft, 8), groups=tiny_groups)
    times = batch.gate.pass_times(batch.lm)
    for tokens in (8, 16, 24, 32):
        for _ in range(50):
            times.record(8, tokens, 1e-3 + 2e-4 * tokens)
    seats = [batch.seat() for _ in range(8)]
    prompt = prompts(target)[0]
    got = [t for burst in seats[0].decode(prompt, config("pcg", adaptive=True), torch.Generator().manual_seed(0),
                                          costs=COSTS, acceptance=(0.6, 0.5, 0.4)) for t in burst]
    assert got == alone(target, None, prompt, config("ar"), 0)
    assert batch.steps > 0 and not batch.gate.sizes  # the batch's own steps, no pass at the gate
    for seat in seats:
        seat.close()
