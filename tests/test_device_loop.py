"""Whole steps on the device (`runtime/decode/device_loop.py`), run eagerly on the CPU: the same
tensor programs a GPU captures as CUDA graphs.

Greedy output equals the host loop's plain greedy decoding for every rule and draft length; a
draft equal to the target has every proposal accepted (the draft's cache bookkeeping, catch-up
included, is right); how many steps are queued per host read changes nothing; and no step reads
device data on the host (a dispatch mode watches every aten op: the property a CUDA graph needs).
The rules' exactness on this sync-free path is tested in tests/test_adaptive.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pcgtts.runtime.config import DecodeConfig, SamplingConfig
from pcgtts.runtime.decode import device_loop
from pcgtts.runtime.decode.loop import decode
from pcgtts.runtime.decode.steps import DecodeStats
from pcgtts.runtime.lm.torch_lm import TorchLM
from pcgtts.runtime.text.prompt import build_prompt

GREEDY = SamplingConfig(temperature=0.0)


@pytest.fixture(scope="module")
def prompt(tiny_pair):
    target, _ = tiny_pair
    return build_prompt(target.tokenizer, target.vocab, "Whole steps on the device.")


def run(target, draft, prompt, policy, sampling, *, tokens=40, seed=0, groups=None, draft_length=3, per_sync=4):
    config = DecodeConfig(policy=policy, max_new_tokens=tokens, draft_length=draft_length, sampling=sampling,
                          adaptive_draft=False, steps_per_sync=per_sync)
    stats = DecodeStats()
    generator = torch.Generator(getattr(target, "device", "cpu")).manual_seed(seed)
    return [t for burst in decode(target, draft, prompt, config, generator, groups, stats) for t in burst], stats


def host_greedy(target, prompt, tokens=40, draft=None, policy="ar", groups=None, draft_length=3):
    config = DecodeConfig(policy=policy, max_new_tokens=tokens, sampling=GREEDY, draft_length=draft_length,
                          adaptive_draft=False)
    stats = DecodeStats()
    generator = torch.Generator(target.device)
    return [t for b in decode(target, draft, prompt, config, generator, groups, stats) for t in b], stats


@pytest.mark.parametrize("policy", ["ar", "sd", "ssd", "pcg"])
@pytest.mark.parametrize("draft_length", [1, 3])
def test_greedy_whole_steps_equal_the_host_loop(tiny_pair, prompt, tiny_groups, policy, draft_length):
    """The tokens equal plain greedy decoding's, and (one step per read) every step accepts what the
    host loop's accepts: greedy proposals depend only on the draft's context, so a draft cache out
    of step after a rollback or a catch-up would show here."""
    target, draft = tiny_pair
    reference, _ = host_greedy(target, prompt)
    output, stats = run(target, draft, prompt, policy, GREEDY, groups=tiny_groups, draft_length=draft_length,
                        per_sync=1)
    assert output == reference and stats.finish == "max_tokens"
    if policy != "ar":
        _, host = host_greedy(target, prompt, draft=draft, policy=policy, groups=tiny_groups, draft_length=draft_length)
        assert 0 < stats.accepted < stats.drafted  # the mixed case: some steps roll back, some catch up
        assert (stats.steps, stats.accepted, stats.per_position_accepted) == \
            (host.steps, host.accepted, host.per_position_accepted)


def test_draft_equal_to_target_accepts_everything(tiny_pair, prompt):
    target, _ = tiny_pair
    twin = TorchLM.load(target.model_dir, max_length=target.max_length, tokenizer=target.tokenizer)
    _, stats = run(target, twin, prompt, "sd", SamplingConfig(), tokens=60, per_sync=3)
    assert stats.acceptance_rate == 1.0 and stats.per_position_accepted == [stats.steps] * 3


def test_steps_per_read_change_nothing_and_the_state_resets(tiny_pair, prompt, tiny_groups):
    target, draft = tiny_pair
    one, s1 = run(target, draft, prompt, "pcg", SamplingConfig(), seed=5, groups=tiny_groups, per_sync=1)
    many, s8 = run(target, draft, prompt, "pcg", SamplingConfig(), seed=5, groups=tiny_groups, per_sync=8)
    other, _ = run(target, draft, prompt, "pcg", SamplingConfig(), seed=6, groups=tiny_groups, per_sync=8)
    assert one == many and one != other  # (the stats differ: a batch runs whole, past the token budget)
    assert s8.steps >= s1.steps and s1.accepted + s1.steps >= 40
    assert len(one) == 40 and all(0 <= t < target.vocab.num_speech for t in one)


def test_stop_and_cache_full(tiny_pair, prompt):
    target, draft = tiny_pair
    reference, _ = host_greedy(target, prompt, tokens=10)
    head = target.model.head.weight
    saved = head[-1].clone()
    try:
        with torch.no_grad():
            head[-1] = head[reference[4]] * 3  # the stop token becomes the argmax after the 5th token
        out, stats = run(target, draft, prompt, "sd", GREEDY, tokens=10)
    finally:
        with torch.no_grad():
            head[-1] = saved
    assert stats.finish == "stop" and out == reference[:len(out)] and len(out) < 10
    short = [TorchLM.load(lm.model_dir, max_length=len(prompt) + 30, tokenizer=lm.tokenizer) for lm in tiny_pair]
    out, stats = run(*short, prompt, "sd", SamplingConfig(), tokens=1000)
    assert stats.finish == "cache_full" and 0 < len(out) <= 30


class HostReads(TorchDispatchMode):
    """Records aten ops whose result the host must read from the device (each a sync on a GPU)."""

    READS = ("_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "equal", "unique", "item")

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in self.READS or (name == "index" and any(t is not None and t.dtype == torch.bool
                                                           for t in args[1] if isinstance(t, torch.Tensor))):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("policy", ["ar", "sd", "pcg"])
def test_a_step_never_reads_device_data_on_the_host(tiny_pair, prompt, tiny_groups, policy):
    target, draft = tiny_pair
    config = DecodeConfig(policy=policy, sampling=SamplingConfig(), adaptive_draft=False, steps_per_sync=1)
    for lm in tiny_pair:
        lm.prefill(prompt[:-1])
    loop = device_loop.device_loop(target, draft if policy != "ar" else None, tiny_groups)
    loop.reset(prompt, torch.Generator().manual_seed(0))
    step = loop.step(device_loop.step_spec(config))
    with HostReads() as watch:
        for _ in range(6):  # accepts and rejects both happen within a few steps
            step.run()
    assert watch.seen == []
    with HostReads() as watch:  # the watch sees a host read when there is one: the host loop's CPU rule has them
        decode(target, draft, prompt, replace(config, steps_per_sync=0, max_new_tokens=6), torch.Generator(),
               tiny_groups).__next__()
    assert watch.seen


def test_refusals(tiny_pair, prompt):
    with pytest.raises(ValueError, match="fixed draft length"):
        DecodeConfig(policy="pcg", steps_per_sync=4)
    with pytest.raises(ValueError, match="runs policies"):
        DecodeConfig(policy="eagle-sd", adaptive_draft=False, steps_per_sync=4)
    with pytest.raises(ValueError, match=">= 0"):
        DecodeConfig(steps_per_sync=-1)
    target, _ = tiny_pair
    with pytest.raises(ValueError, match="needs a draft"):
        run(target, None, prompt, "sd", GREEDY)
    with pytest.raises(ValueError, match="torch backend"):
        run(object(), None, prompt, "ar", GREEDY)
    short_draft = TorchLM.load(tiny_pair[1].model_dir, max_length=256, tokenizer=target.tokenizer)
    with pytest.raises(ValueError, match="as long as the target"):
        run(target, short_draft, prompt, "sd", GREEDY)


@pytest.mark.requires_cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("policy", ["ar", "sd", "pcg"])
def test_captured_steps_on_cuda(tiny_lms, tiny_groups, policy):
    """The CUDA graphs of whole steps: greedy tokens equal the eager host loop's on the same GPU,
    a twin draft accepts everything, and a seeded run repeats (the generator is reseeded after capture)."""
    from pcgtts.runtime.lm.checkpoint import load_tokenizer

    tok = load_tokenizer(tiny_lms["target"])
    target, draft, twin = (TorchLM.load(tiny_lms[name], device="cuda", max_length=512, tokenizer=tok, cuda_graphs=False)
                           for name in ("target", "draft", "target"))
    groups = tiny_groups.to("cuda")
    prompt = build_prompt(tok, target.vocab, "Whole steps on the device.")
    reference, _ = host_greedy(target, prompt)
    output, _ = run(target, draft, prompt, policy, GREEDY, groups=groups)
    assert output == reference
    if policy == "sd":
        _, stats = run(target, twin, prompt, "sd", SamplingConfig(), tokens=60)
        assert stats.acceptance_rate == 1.0
    config = DecodeConfig(policy=policy, sampling=SamplingConfig(), adaptive_draft=False, steps_per_sync=8,
                          max_new_tokens=40)
    a, b = ([t for burst in decode(target, draft, prompt, config, torch.Generator("cuda").manual_seed(9), groups)
             for t in burst] for _ in range(2))
    assert a == b and len(a) == 40


def test_the_synthesizer_streams_whole_steps(tiny_models, tiny_groups_file):
    """`steps_per_sync` reaches the decode loop from a setting (a keyword here; a TOML key alike): the
    streamed greedy audio equals the host loop's, sample for sample."""
    import numpy as np

    from pcgtts.runtime.synthesizer import Synthesizer

    audio = []
    for per_sync in (0, 4):
        synth = Synthesizer.from_pretrained(tiny_models["target"], tiny_models["draft"], tiny_models["codec"],
                                            tiny_groups_file, max_length=512, policy="sd", temperature=0.0,
                                            adaptive_draft=False, steps_per_sync=per_sync, max_new_tokens=30)
        audio.append(np.concatenate([chunk.samples for chunk in synth.stream("Hello whole steps.")]))
    assert len(audio[0]) > 0 and np.array_equal(audio[0], audio[1])
    with pytest.raises(ValueError, match="torch backend"):  # refused before a model loads
        Synthesizer.from_pretrained(tiny_models["target"], tiny_models["draft"], tiny_models["codec"],
                                    backend="onnxruntime", policy="sd", adaptive_draft=False, steps_per_sync=4)


@pytest.mark.parametrize("policy", ["ar", "sd"])
def test_compiled_forwards_trace_whole_and_decode_alike(tiny_pair, prompt, policy, monkeypatch):
    """`compile_steps`: the models' forwards pass through dynamo with `fullgraph=True` (a graph break
    would raise) and greedy tokens are unchanged. Traced with the "eager" backend here (no code
    generation: seconds, not minutes); inductor's kernels are the GPU's business."""
    monkeypatch.setattr(device_loop, "COMPILE_BACKEND", "eager")
    target, draft = tiny_pair
    reference, _ = host_greedy(target, prompt, tokens=12)
    config = DecodeConfig(policy=policy, max_new_tokens=12, sampling=GREEDY, adaptive_draft=False,
                          steps_per_sync=4, compile_steps=True)
    target._device_loop = None  # a loop of its own: its steps are built compiled
    try:
        out = [t for b in decode(target, draft, prompt, config, torch.Generator()) for t in b]
    finally:
        target._device_loop = None
    assert out == reference
    with pytest.raises(ValueError, match="steps_per_sync"):
        DecodeConfig(compile_steps=True)
