"""The torch backend's steps through torch.compile on a CPU (`TorchLM(compiled=True)`) against eager.

Compiling takes seconds per graph even for a tiny model, so these run in the slow suite. The
refusals (compile where it would not run) are fast and live here too."""

from __future__ import annotations

import pytest
import torch

from pcgtts.runtime.config import DecodeConfig, DeviceConfig, SamplingConfig
from pcgtts.runtime.lm.torch_lm import COMPILED_MAX_TOKENS, TorchLM
from pcgtts.runtime.text.prompt import build_prompt


def _loads(path, tokenizer=None):
    """An eager and a compiled load of one checkpoint."""
    return (TorchLM.load(path, max_length=256, tokenizer=tokenizer),
            TorchLM.load(path, max_length=256, tokenizer=tokenizer, compiled=True))


@pytest.fixture(scope="module")
def pair(tiny_lms):
    """(eager, compiled) of the tiny target, then of its draft."""
    target = _loads(tiny_lms["target"])
    return target, _loads(tiny_lms["draft"], tokenizer=target[0].tokenizer)


@pytest.mark.slow
def test_compiled_steps_match_eager_without_compiling_again(pair):
    gen = torch.Generator().manual_seed(0)
    # Every step shape the loop uses, after the one graph compiled at load: 1-token steps, verifies
    # of 2 to 5 tokens at growing cache lengths, a rollback, a cache freed (refused, since the graph
    # does not guard the model) and made again, and the longest step compiled.
    with torch._dynamo.config.patch(error_on_recompile=True):
        for eager, compiled in pair:
            ids = torch.randint(0, eager.vocab.vocab_size, (40,), generator=gen)
            for lm in (eager, compiled):
                lm.prefill(ids[:12])
            at = 12
            for n in (1, 4, 1, 2, 5, 3, 1):
                torch.testing.assert_close(compiled.forward(ids[at:at + n]), eager.forward(ids[at:at + n]),
                                           atol=1e-5, rtol=1e-5)
                at += n
            for lm in (eager, compiled):
                lm.rollback(20)
            torch.testing.assert_close(compiled.forward(ids[20:24]), eager.forward(ids[20:24]), atol=1e-5, rtol=1e-5)
            compiled.release()
            with pytest.raises(RuntimeError, match="released"):
                compiled.forward(ids[:2])
            compiled.ensure_cache()
            eager.release()
            eager.ensure_cache()
            for lm in (eager, compiled):
                lm.prefill(ids[:30])
            logits, hidden = compiled.forward_hidden(ids[30:32])
            ref_logits, ref_hidden = eager.forward_hidden(ids[30:32])
            torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(hidden, ref_hidden, atol=1e-5, rtol=1e-5)
            for lm in (eager, compiled):
                lm.rollback(12)
            longest = ids[12:12 + COMPILED_MAX_TOKENS]
            torch.testing.assert_close(compiled.forward(longest), eager.forward(longest), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_two_checkpoints_of_one_shape_compute_with_their_own_weights(tiny_lm_factory):
    # Each load compiles its own graph, and neither graph guards its model: each must read its own weights.
    (eager_a, compiled_a), (eager_b, compiled_b) = _loads(tiny_lm_factory()), _loads(tiny_lm_factory(embed_scale=1.2))
    ids = torch.arange(20) + 3
    outputs = []
    for lm in (eager_a, compiled_a, eager_b, compiled_b):
        lm.prefill(ids[:10])
        outputs.append(lm.forward(ids[10:12]))
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outputs[3], outputs[2], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(outputs[0], outputs[2], atol=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["ar", "sd", "pcg"])
def test_seeded_decoding_compiled_equals_eager(pair, policy, tiny_groups):
    # Sampled, not greedy: the tiny target's greedy output repeats one token. The two paths' logits
    # differ by ~1e-6, so a token (or an acceptance) could differ only where its uniform falls that
    # close to a boundary of its CDF (or ratio): about 1e-5 per draw, under 1e-3 for a run.
    from pcgtts.runtime.decode.loop import decode
    from pcgtts.runtime.decode.steps import DecodeStats

    (target_eager, target_compiled), (draft_eager, draft_compiled) = pair
    prompt = build_prompt(target_eager.tokenizer, target_eager.vocab, "Compiled steps decode the same tokens.")
    # a fixed draft length: an adaptive one plans with timings, which compiling changes
    config = DecodeConfig(policy=policy, draft_length=3, max_new_tokens=40, adaptive_draft=False,
                          sampling=SamplingConfig(temperature=0.8))
    groups = tiny_groups if policy == "pcg" else None
    runs = []
    for target, draft in ((target_eager, draft_eager), (target_compiled, draft_compiled)):
        stats = DecodeStats()
        tokens = [t for block in decode(target, draft if policy != "ar" else None, prompt, config,
                                        torch.Generator().manual_seed(0), groups, stats) for t in block]
        runs.append((tokens, stats.steps))
    assert runs[0] == runs[1]
    assert len(set(runs[0][0])) > 5


@pytest.mark.slow
def test_a_compiled_targets_eagle_draft_proposes_in_one_call_as_step_by_step(factorised_target, tiny_groups,
                                                                              monkeypatch):
    """On a compiled target with a digit head, an attention-free EAGLE draft makes a step's proposals
    in one compiled call (`eagle.CompiledEagleChain`): for the same generator it proposes what the
    step-by-step proposer does, with the same head scores, leaves the generator and the draft's slots
    as that one does, and seeded eagle-sd / eagle-pcg decode the same tokens. `prepare` compiles the
    chain for 1..L proposals; calibration times them. The steps are judged by the compiled rule
    (`acceptance.compiled`). (Float rounding differs between the two, so a draw could differ only
    where its uniform falls within ~1e-6 of a boundary: the seeds are fixed.)"""
    from pcgtts.runtime.decode.acceptance.compiled import CompiledRule
    from pcgtts.runtime.decode.calibrate import measure_proposer_costs
    from pcgtts.runtime.decode.proposers import EagleProposer
    from pcgtts.runtime.decode.loop import decode
    from pcgtts.runtime.decode.planning import prepare
    from pcgtts.runtime.decode.steps import DecodeStats

    from helpers import propose_after, random_draft

    target = TorchLM.load(factorised_target, max_length=256, compiled=True)
    assert target.model.samples_digits
    draft = random_draft(target, seed=3, block="mlp")
    chained = EagleProposer.from_draft(draft, target)
    assert chained.chain is not None
    assert EagleProposer.from_draft(draft, TorchLM.load(factorised_target, max_length=256)).chain is None
    steps = EagleProposer(chained.step)  # the same draft, a proposal at a time
    sampling = SamplingConfig(temperature=0.8)
    prepare(target, None, DecodeConfig(policy="eagle-sd", draft_length=2, adaptive_draft=False, sampling=sampling),
            proposer=chained)  # a fixed length plans nothing, yet compiles the chain before the first step
    assert sorted(chained.chain._graphs) == [1, 2] and chained.length == 0
    hidden = torch.randn(2, target.model.args.hidden_size, generator=torch.Generator().manual_seed(1))
    for count in (1, 3):
        outs = []
        for proposer in (chained, steps):
            proposer.start(0)
            gen = torch.Generator().manual_seed(count)
            proposals, rows = propose_after(proposer, hidden, [3, target.vocab.stop_index], 1, count,
                                               DecodeConfig(sampling=sampling), gen)
            outs.append((proposals, rows.scores, torch.rand(4, generator=gen), proposer.length))
        (p_a, s_a, next_a, len_a), (p_b, s_b, next_b, len_b) = outs
        # from slot 1: 2 rows fed, count - 1 proposals fed back
        assert torch.equal(p_a, p_b) and torch.equal(next_a, next_b) and len_a == len_b == 1 + 2 + count - 1
        torch.testing.assert_close(s_a, s_b, atol=1e-5, rtol=1e-5)

    judged = []
    rule_call = CompiledRule.__call__
    monkeypatch.setattr(CompiledRule, "__call__", lambda self, *args: judged.append(1) or rule_call(self, *args))
    prompt = build_prompt(target.tokenizer, target.vocab, "Chained proposals decode the same tokens.")
    for policy in ("eagle-sd", "eagle-pcg"):
        config = DecodeConfig(policy=policy, draft_length=3, max_new_tokens=40, adaptive_draft=False, sampling=sampling)
        runs = []
        for proposer in (chained, steps):
            stats = DecodeStats()
            tokens = [t for block in decode(target, None, prompt, config, torch.Generator().manual_seed(0), tiny_groups,
                                            stats, proposer=proposer) for t in block]
            runs.append((tokens, stats.steps, stats.accepted))
        assert runs[0] == runs[1] and runs[0][2] > 0
        assert len(judged) == 2 * (runs[0][1] - 1)  # every step but the first, sd and pcg alike
        judged.clear()

    # another temperature reuses the graphs (a tensor argument), and proposes as step by step does
    with torch._dynamo.config.patch(error_on_recompile=True):
        hot = DecodeConfig(sampling=SamplingConfig(temperature=1.3))
        draws = []
        for proposer in (chained, steps):
            proposer.start(0)
            draws.append(propose_after(proposer, hidden, [3, 5], 1, 3, hot, torch.Generator().manual_seed(9))[0])
    assert torch.equal(*draws)

    costs = measure_proposer_costs(target, chained, 3, "pcg", sampling, tiny_groups)
    assert len(costs.proposals) == 3 and all(c > 0 for c in costs.proposals)
    assert not measure_proposer_costs(target, chained, 3, "greedy", SamplingConfig(temperature=0.0)).proposals


@pytest.mark.slow
def test_the_chain_s_package_proposes_what_torch_compile_does(factorised_target, monkeypatch, tmp_path, caplog):
    """`CompiledEagleChain`'s ahead-of-time package (the weights as inputs, `runtime/aot.py`) gives the
    torch.compile graph's proposals and scores bit for bit; another draft of the same shapes runs
    through the same package without exporting again, with its own weights (the package holds none);
    where no package can be built, torch.compile runs it, with a warning."""
    import logging

    import pcgtts.runtime.aot as aot
    from pcgtts.runtime.lm.eagle import CompiledEagleChain
    from pcgtts.runtime.lm.torch_lm import compile_for_cpu

    from helpers import random_draft

    monkeypatch.setenv("PCGTTS_CACHE", str(tmp_path))
    target = TorchLM.load(factorised_target, max_length=256)
    draft = random_draft(target, seed=4, block="mlp")
    chain = CompiledEagleChain(draft, target.model, target.vocab)
    reference = compile_for_cpu(lambda *args: chain.body(*args), dynamic=False)
    gen = torch.Generator().manual_seed(2)
    state = torch.randn(target.model.args.hidden_size, generator=gen)
    temperature = torch.tensor(0.8, dtype=torch.float64)
    for count in (1, 3):
        uniforms = torch.rand(count, target.model.digits + 1, generator=gen)
        ours, theirs = chain(state, torch.tensor(5), uniforms, 0.8), reference(state, torch.tensor(5), uniforms, temperature)
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs)), count
    assert len(list((tmp_path / "eagle-chains").glob("*.pt2"))) == 2

    # another draft of the same shapes: the package built for the first runs it with its own weights
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: pytest.fail("exported again"))
    again = CompiledEagleChain(random_draft(target, seed=5, block="mlp"), target.model, target.vocab)
    uniforms = torch.rand(3, target.model.digits + 1, generator=gen)
    expected = compile_for_cpu(lambda *args: again.body(*args), dynamic=False)(state, torch.tensor(7), uniforms, temperature)
    assert all(torch.equal(a, b) for a, b in zip(again(state, torch.tensor(7), uniforms, 0.8), expected))

    def fail(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(aot, "load_or_build", fail)
    fallback = CompiledEagleChain(draft, target.model, target.vocab)
    with caplog.at_level(logging.WARNING):
        out = fallback(state, torch.tensor(7), uniforms, 0.8)
    assert "no C++ compiler" in caplog.text and "torch.compile runs it" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(out, chain(state, torch.tensor(7), uniforms, 0.8)))


@pytest.mark.slow
def test_a_compiled_target_tapped_for_a_multi_layer_draft_steps_as_eager(factorised_target, tiny_groups):
    """Attaching a draft that reads several layers (`EagleDraft.feature_layers`) compiles the target's
    step again with those layers' outputs (its graph does not guard the model, so without that it
    would return the old width): a compiled step's states equal an eager one's, and the chain that
    fuses a target row proposes what the step-by-step proposer does; seeded eagle-pcg decodes alike
    with either."""
    from pcgtts.runtime.decode.proposers import EagleProposer
    from pcgtts.runtime.decode.loop import decode
    from pcgtts.runtime.decode.steps import DecodeStats

    from helpers import propose_after, random_draft

    eager = TorchLM.load(factorised_target, max_length=256)
    compiled = TorchLM.load(factorised_target, max_length=256, compiled=True)
    draft = random_draft(compiled, seed=4, block="mlp", feature_layers=(0, 2))
    chained = EagleProposer.from_draft(draft, compiled)
    steps = EagleProposer(chained.step)  # the same draft, a proposal at a time
    eager.tap_layers((0, 2))
    assert chained.chain is not None and compiled.model.taps == eager.model.taps == (0, 2)
    ids = torch.randint(0, eager.vocab.vocab_size, (20,), generator=torch.Generator().manual_seed(0))
    for lm in (eager, compiled):
        lm.prefill(ids[:12])
    (_, h_eager), (_, h_compiled) = eager.forward_hidden(ids[12:16]), compiled.forward_hidden(ids[12:16])
    assert h_compiled.shape == (4, 3 * compiled.model.args.hidden_size)
    torch.testing.assert_close(h_compiled, h_eager, atol=1e-5, rtol=1e-5)
    sampling = SamplingConfig(temperature=0.8)
    outs = []
    for proposer in (chained, steps):
        proposer.start(0)
        proposals, rows = propose_after(proposer, h_eager[-2:], [3, 5], 1, 3, DecodeConfig(sampling=sampling),
                                           torch.Generator().manual_seed(2))
        outs.append((proposals, rows.scores))
    assert torch.equal(outs[0][0], outs[1][0])
    torch.testing.assert_close(outs[0][1], outs[1][1], atol=1e-5, rtol=1e-5)
    prompt = build_prompt(compiled.tokenizer, compiled.vocab, "Tapped layers decode the same tokens.")
    config = DecodeConfig(policy="eagle-pcg", draft_length=3, max_new_tokens=40, adaptive_draft=False, sampling=sampling)
    runs = []
    for lm, proposer in ((compiled, chained), (compiled, steps)):
        stats = DecodeStats()
        runs.append(([t for block in decode(lm, None, prompt, config, torch.Generator().manual_seed(0), tiny_groups,
                                            stats, proposer=proposer) for t in block], stats.accepted))
    assert runs[0] == runs[1] and runs[0][1] > 0


@pytest.mark.parametrize("bad", [dict(backend="onnxruntime"), dict(compute_device="cuda"), dict(quantize="int8"),
                                 dict(dtype="bfloat16"), dict(compile="yes")])
def test_compile_is_refused_where_it_would_not_run(bad):
    with pytest.raises(ValueError, match="compile"):
        DeviceConfig(**{"compile": True, **bad})


def test_compile_with_an_exported_target_is_refused_before_loading(tmp_path):
    # "auto" made concrete for an export folder is onnxruntime, which compile does not run on.
    from pcgtts.runtime.lm.loader import resolve_backend

    (tmp_path / "pcgtts-lm.json").write_text('{"kind": "onnx"}')
    with pytest.raises(ValueError, match="compile runs the torch backend.*backend='onnxruntime'"):
        resolve_backend(DeviceConfig(compile=True), tmp_path)


def test_compile_with_whole_steps_on_the_device_is_refused(tmp_path):
    # The device loop steps the model itself: the host loop's compiled graphs would go unused.
    from pcgtts.runtime.config import ModelPaths
    from pcgtts.runtime.loading import check_models

    with pytest.raises(ValueError, match="compile_steps"):
        check_models(ModelPaths(target=str(tmp_path), codec=str(tmp_path)),
                     DecodeConfig(policy="ar", steps_per_sync=4, adaptive_draft=False),
                     DeviceConfig(compile=True, backend="torch"))


def test_compile_without_a_cpp_compiler_is_a_clear_error_before_loading(monkeypatch, tmp_path):
    import torch._inductor.cpp_builder as cpp_builder
    from torch._inductor.exc import InvalidCxxCompiler

    from pcgtts.runtime.config import ModelPaths
    from pcgtts.runtime.loading import check_models

    def no_compiler():
        raise InvalidCxxCompiler

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", no_compiler)
    with pytest.raises(ValueError, match="needs a C\\+\\+ compiler"):
        check_models(ModelPaths(target=str(tmp_path), codec=str(tmp_path)), DecodeConfig(policy="ar"),
                     DeviceConfig(compile=True, backend="torch"))
    with pytest.raises(ValueError, match="needs a C\\+\\+ compiler"):
        TorchLM.load(tmp_path / "not-even-read", compiled=True)
