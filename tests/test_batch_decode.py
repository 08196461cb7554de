"""The batched decode (runtime/decode/batch.py over runtime/lm/batched.py): several streams' plain
decodes stepped together over one model copy give each stream what it gets alone."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from pcgtts.runtime.config import DecodeConfig, SamplingConfig
from pcgtts.runtime.decode.batch import BatchDecoder, BatchFull
from pcgtts.runtime.decode.loop import decode
from pcgtts.runtime.decode.steps import DecodeStats
from pcgtts.runtime.lm.batched import BatchedLM
from pcgtts.runtime.lm.torch_lm import TorchLM


def prompts(target, lengths=(150, 90, 120, 60, 75)):
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, target.vocab.speech_offset, (n,), generator=gen) for n in lengths]


def config(temperature, tokens=40, minimum=10):
    return DecodeConfig(policy="ar", max_new_tokens=tokens, min_new_tokens=minimum,
                        sampling=SamplingConfig(temperature=temperature))


def alone(target, prompt, cfg, seed):
    return [t for burst in decode(target, None, prompt, cfg, torch.Generator().manual_seed(seed)) for t in burst]


def together(batch, prompts_, cfg, seeds, hold=None, **plan):
    """Each prompt decoded on a thread of its own through one batch (`cfg`: one config, or one per
    prompt; `plan`: `SlotSeat.decode`'s costs, proposer, acceptance); `hold` = (index, event): that
    stream stops reading after its first burst until the event is set."""
    seats = [batch.seat() for _ in prompts_]
    outs = [None] * len(prompts_)
    configs = cfg if isinstance(cfg, list) else [cfg] * len(prompts_)

    def run(i):
        codes = []
        for burst in seats[i].decode(prompts_[i], configs[i], torch.Generator().manual_seed(seeds[i]), **plan):
            codes += burst
            if hold is not None and hold[0] == i:
                hold[1].wait()
        outs[i] = codes

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts_))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    for seat in seats:
        seat.close()
    return outs


@pytest.fixture(scope="module")
def target(tiny_pair):
    return tiny_pair[0]


@pytest.fixture(scope="module")
def digit_target(factorised_target):
    lm = TorchLM.load(factorised_target, max_length=512)
    assert lm.drawable_digits  # draws digit by digit, as the loop does
    return lm


def test_one_slot_computes_what_the_single_sequence_lm_computes(target):
    """Alone in the batch, a slot's prefill and steps give the TorchLM's logits bit for bit; beside
    another slot, within float rounding."""
    batched = BatchedLM(target, 3)
    a, b = prompts(target)[:2]
    target.prefill(a[:-1])
    batched.prefill(2, a[:-1])
    batched.prefill(0, b[:-1])
    assert torch.equal(batched.step([2], a[-1:].view(1, 1))[0], target.forward(a[-1:]))
    next_id = torch.tensor([target.vocab.speech_offset + 5])
    both = batched.step([0, 2], torch.stack([b[-1:], next_id]))
    assert torch.allclose(both[1], target.forward(next_id), atol=1e-4)
    assert batched.lengths == [len(b), 0, len(a) + 1]


def test_a_new_slot_copies_the_prefix_another_slot_holds_bit_for_bit(target, monkeypatch):
    """A prompt sharing its leading blocks with a prompt another slot holds copies those rows and
    computes only the rest, and its logits are a fresh single-sequence prefill's, bit for bit."""
    head = prompts(target, (100,))[0]
    a = torch.cat([head, prompts(target, (30,))[0]])
    b = torch.cat([head, prompts(target, (50,))[0] + 1])
    batched = BatchedLM(target, 3)
    with torch.inference_mode():  # caches made as a stream's first step makes them (inference tensors)
        batched.ensure_cache()
    batched.prefill(0, a[:-1])
    computed = []
    forward = batched.hidden
    monkeypatch.setattr(batched, "hidden", lambda slots, ids: computed.append(ids.shape[1]) or forward(slots, ids))
    batched.prefill(2, b[:-1])
    blocks = target.block_starts(b[:-1])
    copied = max(start for start in blocks if start <= len(head))  # the blocks the two prompts share
    assert copied >= 64 and sum(computed) == len(b) - 1 - copied
    target.prefill(b[:-1])
    assert torch.equal(batched.step([2], b[-1:].view(1, 1))[0], target.forward(b[-1:]))
    assert batched.donor(1, b[:-1], blocks) == (0, copied)  # the first slot holding the most


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_each_stream_of_a_batch_decodes_as_it_does_alone(target, temperature):
    """Greedy and seeded: five streams decoded together (one of them pausing its reads, so it
    steps in some batches and sits out others) give each the codes `loop.decode` gives it alone.
    (Rows of a multi-slot step are summed in another order than alone, so this holds unless a
    draw lands within float rounding of a tie: for these seeds it never does.)"""
    cfg = config(temperature)
    ps = prompts(target)
    seeds = [11, 12, 13, 14, 15]
    expected = [alone(target, p, cfg, s) for p, s in zip(ps, seeds)]
    batch = BatchDecoder(BatchedLM(target, 5), ahead_tokens=4)
    release = threading.Event()
    threading.Timer(0.3, release.set).start()
    got = together(batch, ps, cfg, seeds, hold=(1, release))
    assert got == expected
    assert max(batch.occupancy) == 5 and min(batch.occupancy) < 5  # batched, and the paused stream sat out


def test_a_digit_head_draws_digit_by_digit_in_the_batch(digit_target):
    cfg = config(0.8)
    ps = prompts(digit_target)[:3]
    expected = [alone(digit_target, p, cfg, i) for i, p in enumerate(ps)]
    assert together(BatchDecoder(BatchedLM(digit_target, 3)), ps, cfg, [0, 1, 2]) == expected


def test_a_cancelled_stream_frees_its_slot_and_the_others_are_undisturbed(target):
    cfg = config(0.8, tokens=60)
    ps = prompts(target)[:3]
    expected = [alone(target, p, cfg, i) for i, p in enumerate(ps)]
    batch = BatchDecoder(BatchedLM(target, 3), ahead_tokens=2)
    seats = [batch.seat() for _ in ps]
    with pytest.raises(BatchFull):
        batch.seat()  # every slot held: refused at once
    streams = [seat.decode(p, cfg, torch.Generator().manual_seed(i)) for i, (seat, p) in enumerate(zip(seats, ps))]
    got = [[], [], []]
    for _ in range(5):
        for codes, stream in zip(got, streams):
            codes += next(stream)
    streams[1].close()  # its reader is gone: it leaves the batch at the next step
    seats[1].close()
    deadline = time.monotonic() + 10
    while batch.seated == 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    again = batch.seat()  # its slot is free again
    assert again.slot == 1
    for i in (0, 2):
        got[i] += [t for burst in streams[i] for t in burst]
        assert got[i] == expected[i]
    assert got[1] == expected[1][:len(got[1])]


def test_a_stream_nobody_reads_stops_stepping(target):
    batch = BatchDecoder(BatchedLM(target, 1), ahead_tokens=3)
    seat = batch.seat()
    stats = DecodeStats()
    stream = seat.decode(prompts(target)[0], config(0.8, tokens=200), torch.Generator().manual_seed(0), stats)
    first = next(stream)  # one burst: what had queued when the reader woke (1 to `ahead_tokens` tokens)
    time.sleep(0.3)
    assert stats.steps <= len(first) + 3  # the burst read, then at most `ahead_tokens` unread
    assert len(first) + len([t for burst in stream for t in burst]) == 200 and stats.finish == "max_tokens"
    seat.close()


def test_a_failing_decode_does_not_stop_the_batch(target):
    """A prompt the slot cannot hold fails its own reader; the stream beside it finishes as alone."""
    batch = BatchDecoder(BatchedLM(target, 2, max_length=200))
    cfg = config(0.0, tokens=30)
    good, bad = prompts(target)[1], torch.zeros(300, dtype=torch.long)
    expected = alone(target, good, cfg, 0)
    first, second = batch.seat(), batch.seat()
    with pytest.raises(ValueError, match="exceeds the KV cache"):
        list(second.decode(bad, cfg, torch.Generator()))
    assert [t for burst in first.decode(good, cfg, torch.Generator().manual_seed(0)) for t in burst] == expected


def test_a_batch_without_a_draft_refuses_the_draft_policies(target):
    seat = BatchDecoder(BatchedLM(target, 1)).seat()
    with pytest.raises(ValueError, match="policy 'sd' needs the draft LM"):
        seat.decode(prompts(target)[0], DecodeConfig(policy="sd"), torch.Generator())
    with pytest.raises(ValueError, match="not with steps_per_sync"):
        seat.decode(prompts(target)[0], DecodeConfig(policy="ar", steps_per_sync=4), torch.Generator())


@pytest.mark.parametrize("policy, temperature", [("sd", 0.8), ("pcg", 0.8), ("pcg", 0.0), ("draft", 0.8)])
def test_speculative_streams_in_a_batch_decode_as_alone(tiny_pair, tiny_groups, policy, temperature):
    """Draft-LM policies: each stream runs its own loop over its slots (ragged acceptance: every slot
    rolls back to its own length), the forwards of all of them run together at the gate; each gives
    the codes `loop.decode` gives it alone on the loaded models."""
    target, draft = tiny_pair
    cfg = DecodeConfig(policy=policy, max_new_tokens=40, min_new_tokens=10, adaptive_draft=False, draft_length=3,
                       sampling=SamplingConfig(temperature=temperature))
    ps = prompts(target)[:4]
    expected = [[t for burst in decode(target, draft, p, cfg, torch.Generator().manual_seed(i), tiny_groups)
                 for t in burst] for i, p in enumerate(ps)]
    batch = BatchDecoder(BatchedLM(target, 4), draft=BatchedLM(draft, 4), groups=tiny_groups)
    assert together(batch, ps, cfg, [0, 1, 2, 3]) == expected
    assert max(batch.gate.sizes) > 1  # the streams' forwards did run together
    assert batch.seated == 0


def test_a_batch_needs_a_proposer_and_given_costs_to_plan_with(tiny_pair):
    """A policy on the target's states needs its proposer; an adaptive draft length its costs (never
    measured through the batch, where the other streams' work would be timed too)."""
    target, draft = tiny_pair
    seat = BatchDecoder(BatchedLM(target, 1), draft=BatchedLM(draft, 1)).seat()
    with pytest.raises(ValueError, match="given step costs"):
        seat.decode(prompts(target)[0], DecodeConfig(policy="sd", adaptive_draft=True), torch.Generator())
    with pytest.raises(ValueError, match="give its proposer"):
        seat.decode(prompts(target)[0], DecodeConfig(policy="mtp-sd", adaptive_draft=False), torch.Generator())


def test_the_batch_frees_its_caches_only_when_no_stream_holds_a_slot(tiny_pair):
    target, draft = tiny_pair
    batch = BatchDecoder(BatchedLM(target, 2), draft=BatchedLM(draft, 2))
    seat = batch.seat()
    cfg = DecodeConfig(policy="sd", max_new_tokens=5, adaptive_draft=False)
    codes = [t for burst in seat.decode(prompts(target)[0], cfg, torch.Generator().manual_seed(0)) for t in burst]
    assert len(codes) == 5
    assert batch.lm.allocated and batch.draft.allocated
    assert not batch.release()  # a stream holds a slot
    seat.close()
    assert batch.release() and not batch.lm.allocated and not batch.draft.allocated


def test_a_reader_is_woken_with_the_tokens_it_waits_for_not_every_step(target):
    """`wanted` tokens: the reader's bursts hold at least that many (the last may hold fewer), the
    same codes as when it takes every token."""
    cfg, prompt = config(0.0, tokens=40, minimum=40), prompts(target)[0]
    batch = BatchDecoder(BatchedLM(target, 2))
    seat = batch.seat()
    bursts = list(seat.decode(prompt, cfg, torch.Generator().manual_seed(0), wanted=lambda: 10))
    seat.close()
    assert all(len(b) >= 10 for b in bursts[:-1]) and len(bursts) <= 5
    assert [t for b in bursts for t in b] == alone(target, prompt, cfg, 0)
