"""The EAGLE draft (runtime/lm/eagle.py, train/eagle.py): its file, its cache bookkeeping inside the
decode loop, greedy equivalence, exactness in distribution, training, and the eagle-* policies'
wiring (Synthesizer, CLI)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from pcgtts.runtime.config import DecodeConfig, SamplingConfig
from pcgtts.runtime.decode.proposers import EagleProposer, HeadProposer
from pcgtts.runtime.decode.loop import decode
from pcgtts.runtime.lm.eagle import EagleDraft
from pcgtts.runtime.text.prompt import build_prompt

from helpers import assert_same_marginal, decode_codes as run, propose_after, random_draft, random_heads, third_codes

GREEDY = SamplingConfig(temperature=0.0)


@pytest.fixture(scope="module")
def target(tiny_pair):
    return tiny_pair[0]


@pytest.fixture(scope="module")
def prompt(target):
    return build_prompt(target.tokenizer, target.vocab, "An eagle draft test sentence.")


@pytest.fixture(scope="module")
def proposer(target):
    return EagleProposer.from_draft(random_draft(target), target)


@pytest.fixture(scope="module")
def mlp_proposer(target):
    """An attention-free draft (`block="mlp"`): no cache, a row reads only its own state."""
    return EagleProposer.from_draft(random_draft(target, seed=7, block="mlp"), target)


def test_eagle_file_round_trips_and_is_tied_to_its_target(target, tmp_path):
    draft = random_draft(target)
    path = draft.save(tmp_path / "e.safetensors", dtype=torch.float32)
    loaded = EagleDraft.load(path, target.model, fingerprint=target.fingerprint)
    for (name, a), (_, b) in zip(draft.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="another target"):
        EagleDraft.load(path, target.model, fingerprint="0" * 64)
    assert loaded.acceptance is None
    narrow = EagleDraft(target.model.args, target.fingerprint, intermediate_size=16)
    narrow.acceptance = 0.625
    loaded = EagleDraft.load(narrow.save(tmp_path / "n.safetensors"), target.model)
    assert loaded.block.mlp.up_proj.out_features == 16 and loaded.acceptance == 0.625
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a readable"):
        EagleDraft.load(tmp_path / "bad.safetensors", target.model)
    with pytest.raises(FileNotFoundError, match="pcgtts train eagle"):
        EagleDraft.load(tmp_path / "missing.safetensors", target.model)
    mlp = random_draft(target, seed=1, block="mlp")
    loaded = EagleDraft.load(mlp.save(tmp_path / "m.safetensors", dtype=torch.float32), target.model)
    assert not loaded.attention and not hasattr(loaded.block, "self_attn") and loaded.block_kind == "mlp"
    states, embeds = torch.randn(1, 5, target.model.args.hidden_size), torch.randn(1, 5, target.model.args.hidden_size)
    torch.testing.assert_close(loaded.train_features(states, embeds), mlp.train_features(states, embeds))
    with pytest.raises(ValueError, match="block must be one of"):
        EagleDraft(target.model.args, block="conv")


def test_a_draft_proposes_at_its_own_temperature(target, prompt, tmp_path):
    """`proposal_temperature` interpolates the fitted factors in T (ends held, greedy kept); the scales
    round-trip through the file and are refused when malformed; a proposer with them draws what a
    proposer without them draws at the interpolated temperature, and hands the rule that distribution."""
    from pcgtts.runtime.lm.eagle import parse_temperature_scales, proposal_temperature

    scales = ((0.2, 1.2), (0.8, 0.8))
    assert proposal_temperature(scales, 0.5) == pytest.approx(0.5)  # factor 1.0 halfway
    assert proposal_temperature(scales, 0.8) == pytest.approx(0.64)
    assert proposal_temperature(scales, 1.5) == pytest.approx(1.2)
    assert proposal_temperature(scales, 0.1) == pytest.approx(0.12)
    assert proposal_temperature(scales, 0.0) == 0.0 and proposal_temperature((), 0.7) == 0.7
    for bad in ("0.8", "0.8:0", "0.8:1,0.2:1", "a:b", "0.2:1,0.2:1.1", "nan:1"):
        with pytest.raises(ValueError, match="temperature scales"):
            parse_temperature_scales(bad)
    draft = random_draft(target, seed=3, block="mlp")
    draft.temperature_scales = scales
    loaded = EagleDraft.load(draft.save(tmp_path / "t.safetensors", dtype=torch.float32), target.model)
    assert loaded.temperature_scales == scales
    hidden = target.forward_hidden(prompt)[1]
    target.rollback(0)
    out = {}
    for name, d, temperature in (("scaled", loaded, 0.8), ("plain", random_draft(target, seed=3, block="mlp"), 0.64)):
        proposer = EagleProposer.from_draft(d, target)
        proposer.start(0)
        config = DecodeConfig(policy="eagle-sd", sampling=SamplingConfig(temperature=temperature))
        out[name] = propose_after(proposer, hidden, prompt[1:].tolist(), 0, 3, config,
                                     torch.Generator().manual_seed(5))
    (a, rows_a), (b, rows_b) = out["scaled"], out["plain"]
    assert torch.equal(a, b) and torch.equal(rows_a, rows_b)


def test_the_draft_s_temperature_is_fitted_where_it_is_accepted_most(monkeypatch):
    """`fit_temperature_scales` on rows whose draft logits are the target's times 0.7 (a flatter
    draft): at every temperature the factor 0.7 makes the two equal (acceptance 1), and is chosen."""
    import types

    import pcgtts.train.eagle as trainer

    logits = torch.randn(2, 9, 40, generator=torch.Generator().manual_seed(0)) * 3
    monkeypatch.setattr(trainer, "pass_features", lambda draft, data, index, passes: (
        logits[index[0]][None], [0.7 * logits[index[0]][None]] * passes, torch.ones(1, 9, dtype=torch.bool)))
    head = types.SimpleNamespace(model=types.SimpleNamespace(logits=lambda x: x))
    data = types.SimpleNamespace(states=[None, None])
    scales, report = trainer.fit_temperature_scales(None, head, data, passes=2)
    assert scales == tuple((t, 0.7) for t in trainer.FIT_TEMPERATURES)
    assert report["accept_fitted"] == pytest.approx([1.0] * 4) and max(report["accept_at_1"]) < 0.99


def test_proposer_cache_matches_a_whole_sequence_pass(target, prompt):
    """Rows fed in uneven chunks, with speculation off in between (count 0) and speculative slots
    overwritten, give the same draft distribution as one cache-free pass over the true rows:
    the slot bookkeeping of the decode loop is what makes the draft see the right history."""
    draft = random_draft(target, seed=3)
    proposer = EagleProposer.from_draft(draft, target)
    codes = torch.tensor([5, 17, 300, 2, 999, 64, 8, 8, 120, 33, 7, 500])
    target.rollback(0)
    target.prefill(prompt[:-1])
    first = target.length
    _, hidden = target.forward_hidden(torch.cat([prompt[-1:], target.vocab.restricted_to_token_ids(codes[:-1])]))
    target.rollback(0)
    with torch.no_grad():
        embeds = target.model.embed_tokens(target.vocab.restricted_to_token_ids(codes))
        reference = draft.train_features(hidden[None], embeds[None])[0]  # row j: f after (h_j, codes[j])
    sampling = DecodeConfig(policy="eagle-sd", sampling=SamplingConfig(temperature=1.0))
    proposer.start(first)
    row, gen = 0, torch.Generator().manual_seed(0)
    for chunk, count in ((1, 2), (3, 0), (1, 0), (2, 3), (4, 1), (1, 2)):
        rows = slice(row, row + chunk)
        _, probs = propose_after(proposer, hidden[rows], codes[rows].tolist(), first + row, count, sampling, gen)
        row += chunk
        if count:
            expected = torch.softmax(target.model.logits(reference[row - 1]), -1)
            torch.testing.assert_close(probs[0], expected, atol=1e-5, rtol=1e-4)


def test_attention_free_proposals_read_only_the_last_row(target, prompt):
    """An attention-free draft proposes from the last fed row alone: feeding a chunk of rows, or
    that chunk's last row by itself, gives the same distribution, and it equals a cache-free pass."""
    draft = random_draft(target, seed=9, block="mlp")
    step = EagleProposer.from_draft(draft, target).step
    states, tokens = torch.randn(4, target.model.args.hidden_size), torch.tensor([5, 17, 300, 2])
    f_all, scores_all = step.run(states, tokens, 10)
    f_last, scores_last = step.run(states[-1:], tokens[-1:], 0)
    torch.testing.assert_close(f_all, f_last)
    torch.testing.assert_close(scores_all, scores_last)
    with torch.no_grad():
        embeds = target.model.embed_tokens(target.vocab.restricted_to_token_ids(tokens))
        torch.testing.assert_close(f_all, draft.train_features(states[None], embeds[None])[0, -1])


@pytest.mark.parametrize("block", ["attention", "mlp"])
@pytest.mark.parametrize("policy", ["eagle-sd", "eagle-pcg"])
def test_greedy_eagle_equals_plain_greedy(target, proposer, mlp_proposer, prompt, tiny_groups, policy, block):
    proposer = proposer if block == "attention" else mlp_proposer
    reference, _ = run(target, proposer, prompt, "ar", GREEDY)
    output, stats = run(target, proposer, prompt, policy, GREEDY, groups=tiny_groups)
    assert output == reference
    assert stats.target_forwards == stats.steps and stats.drafted == 3 * (stats.steps - 1)


def test_eagle_statistics_and_seeding(target, proposer, prompt, tiny_groups):
    for policy in ("eagle-sd", "eagle-pcg"):
        out, stats = run(target, proposer, prompt, policy, SamplingConfig(), tokens=80, groups=tiny_groups)
        assert stats.emitted == len(out) and (len(out) == 80 or stats.finish == "stop"), policy
        assert all(0 <= t < target.vocab.num_speech for t in out)
        assert sum(stats.per_position_accepted) == stats.accepted
        assert stats.accepted + stats.steps >= stats.emitted >= stats.accepted + stats.steps - 4
        a, _ = run(target, proposer, prompt, policy, SamplingConfig(), tokens=30, seed=5, groups=tiny_groups)
        b, _ = run(target, proposer, prompt, policy, SamplingConfig(), tokens=30, seed=5, groups=tiny_groups)
        assert a == b, policy


def test_adaptive_eagle_with_a_useless_draft_stays_within_five_percent_of_ar(target, proposer, prompt):
    """Counted in the cost model's time (given costs), not wall time, as for the heads."""
    from pcgtts.runtime.decode.cost_model import StepCosts, counted_seconds

    costs = StepCosts(target_forward=(1.0, 1.5, 2.0, 2.5), draft_forward=(0.2, 0.25, 0.3, 0.35), rule=0.03,
                      sample=0.02)
    out, stats = run(target, proposer, prompt, "eagle-sd", SamplingConfig(), tokens=120, costs=costs,
                     adaptive_draft=True)
    assert len(out) == 120
    assert counted_seconds(costs, stats.length_counts, 0) / stats.emitted <= 1.05 * costs.ar_step, stats.length_counts
    _, fixed = run(target, proposer, prompt, "eagle-sd", SamplingConfig(), tokens=120, costs=costs)
    assert counted_seconds(costs, fixed.length_counts, 0) / fixed.emitted > 1.05 * costs.ar_step


@pytest.mark.slow  # 3,000 decodes per case
@pytest.mark.parametrize("head", ["rows", "digits", "mlp", "cooler"])
def test_eagle_sd_is_exact_in_distribution(head, target, proposer, mlp_proposer, prompt, factorised_target):
    """The marginal of the 3rd generated code (proposed at draft position 2 after a proposal at
    position 1, both by the draft from its own state) under eagle-sd equals plain AR sampling's.
    Two-sample chi-square over the 8 most frequent codes + the rest pooled, 1,500 runs each, at
    significance 1e-3: false-alarm rate 0.1 % per case (seeds fixed: deterministic). "digits": a
    digit-factorised target, whose proposals are sampled digit by digit; "mlp": an attention-free draft;
    "cooler": a digit-head draft that proposes at its own temperature (0.3 where the target samples at 0.5)."""
    from pcgtts.runtime.lm.torch_lm import TorchLM

    if head in ("digits", "cooler"):
        target = TorchLM.load(factorised_target, max_length=256)
        assert target.model.samples_digits
        draft = random_draft(target)
        if head == "cooler":
            draft.temperature_scales = ((0.5, 0.6),)
        proposer = EagleProposer.from_draft(draft, target)
        prompt = build_prompt(target.tokenizer, target.vocab, "An eagle draft test sentence.")
    if head == "mlp":
        proposer = mlp_proposer
    short = prompt[-6:]
    assert_same_marginal(third_codes(target, proposer, short, "ar", 21), third_codes(target, proposer, short, "eagle-sd", 22))


def test_state_sequences_keep_each_sequence_s_rows(target, prompt):
    """The EAGLE trainer's per-sequence states (several sequences a pass, padded on the left; kept
    apart, with no all-rows tensor beside them) are the heads trainer's rows, computed one sequence at
    a time, sequence by sequence and in the order given; a one-code sequence is skipped by both."""
    from pcgtts.train.eagle import state_sequences
    from pcgtts.train.heads import hidden_rows

    pairs = [(prompt, torch.tensor(run(target, None, prompt, "ar", SamplingConfig(), tokens=n, seed=n)[0]))
             for n in (20, 1, 12, 16)]
    data, rows = state_sequences(target, pairs), hidden_rows(target, pairs)
    lengths = [len(pairs[i][1]) for i in (0, 2, 3)]
    assert [len(s) for s in data.states] == [len(c) for c in rows.tokens] == lengths and len(set(lengths)) == 3
    torch.testing.assert_close(torch.cat(data.states), rows.hidden, atol=1e-4, rtol=1e-4)
    assert rows.left.tolist() == [j for n in lengths for j in range(n - 1, -1, -1)]
    assert target.model.max_length and target.length == 0  # the runtime's cache is back
    half = state_sequences(target, pairs, dtype=torch.float16)  # `--state-dtype float16`: half the memory
    assert half.states[0].dtype == half.embeds[0].dtype == torch.float16
    torch.testing.assert_close(torch.cat(half.states).float(), rows.hidden, atol=2e-2, rtol=2e-3)
    assert half.batch([0, 2])[0].dtype == torch.float32  # the loss reads float32 batches
    from pcgtts.train.eagle import EagleTrainConfig

    with pytest.raises(ValueError, match="state_dtype must be one of"):
        EagleTrainConfig(target=".", out="o", work_dir=".", sentences=("a",), state_dtype="int8")
    with pytest.raises(ValueError, match="tv\\+group needs the target's group table"):
        EagleTrainConfig(target=".", out="o", work_dir=".", sentences=("a",), loss="tv+group")
    with pytest.raises(ValueError, match="loss must be one of"):
        EagleTrainConfig(target=".", out="o", work_dir=".", sentences=("a",), loss="js")


@pytest.mark.parametrize("head", ["rows", "digits", "digits-mlp", "digits-mlp-layers", "digits-mlp-tv",
                                  "digits-mlp-tv+group"])
def test_training_brings_the_draft_closer_to_the_target(head, target, prompt, factorised_target, tiny_groups):
    """A few optimiser steps on the target's own states lower the loss and raise the acceptance
    estimate on the training rows (the trainer's loss, on a tiny model), for three passes. "rows":
    KL over sampled expanded rows; "digits": a digit-factorised target, every row's KL in closed
    form; "digits-mlp": the same with an attention-free draft; "-layers": one that also reads layer 1;
    "-tv" / "-tv+group": the losses that are what SD / PCG lose, at temperature 0.8."""
    from pcgtts.runtime.decode.acceptance.coarse import coarse_view as _coarse_view
    from pcgtts.runtime.lm.torch_lm import TorchLM
    from pcgtts.train.distill import CoarseMasses
    from pcgtts.train.eagle import TargetHead, eagle_losses, state_sequences

    if head.startswith("digits"):
        target = TorchLM.load(factorised_target, max_length=256)
        prompt = build_prompt(target.tokenizer, target.vocab, "An eagle draft test sentence.")
    loss_head = TargetHead(target.model)
    assert bool(loss_head.digits) == head.startswith("digits")
    pairs = []
    for seed in range(4):
        codes, _ = run(target, None, prompt, "ar", SamplingConfig(), tokens=40, seed=seed)
        pairs.append((prompt, torch.tensor(codes)))
    layers = (1,) if head.endswith("layers") else ()
    data = state_sequences(target, pairs, layers)
    assert data.states[0].shape[1] == (len(layers) + 1) * target.model.args.hidden_size and not target.model.taps
    draft = EagleDraft(target.model.args, target.fingerprint, block="mlp" if "mlp" in head else "attention",
                       feature_layers=layers)
    draft.requires_grad_(True)
    opt = torch.optim.AdamW(draft.parameters(), lr=3e-3)
    rng = random.Random(0)

    kind = head.rsplit("-", 1)[1] if "tv" in head else "kl"
    masses = CoarseMasses(_coarse_view(tiny_groups, target.vocab.restricted_size)) if kind == "tv+group" else None

    def losses(rng):
        return eagle_losses(draft, loss_head, data, [0, 1, 2, 3], 64, 0.1, rng, passes=3, loss=kind,
                            temperature=1.0 if kind == "kl" else 0.8, masses=masses)

    with torch.no_grad():
        first = losses(random.Random(0))
    if kind == "tv+group":  # the group term is in the loss: it is TV plus the group TV, both under 1
        assert 0 < float(first[0]) - 0.1 * first[1]["regression"] < 2 * 3
    for _ in range(40):
        loss, _ = losses(rng)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        last = losses(random.Random(0))
    assert len(last[1]["accept"]) == 3
    assert float(last[0]) < 0.7 * float(first[0])
    assert all(after > before for after, before in zip(last[1]["accept"], first[1]["accept"]))


def test_eagle_policies_need_their_draft(tiny_models, tmp_path, target, prompt):
    """Without the draft the eagle-* policies are refused before anything loads; a draft saved
    next to the target is found and streams audio."""
    import shutil

    from pcgtts import Synthesizer

    with pytest.raises(ValueError, match="EAGLE draft"):
        decode(target, None, prompt, DecodeConfig(policy="eagle-sd"), torch.Generator())
    folder = tmp_path / "target"
    shutil.copytree(tiny_models["target"], folder)
    kwargs = dict(codec=tiny_models["codec"], policy="eagle-sd", seed=1, max_new_tokens=30, max_length=1024)
    with pytest.raises(ValueError, match="EAGLE draft"):
        Synthesizer.from_pretrained(str(folder), **kwargs)
    random_draft(target).save(folder / "eagle_draft.safetensors")
    synth = Synthesizer.from_pretrained(str(folder), **kwargs)
    assert synth.synthesize("Hello there.").size > 0 and synth.eagle is not None
    with pytest.raises(ValueError, match="group table"):
        synth.stream("Hello.", config=dataclasses.replace(synth.config, decode=DecodeConfig(policy="eagle-pcg")))


@pytest.mark.slow
def test_eagle_cli_end_to_end(tiny_models, tiny_groups_file, tmp_path):
    """`pcgtts train eagle` writes the draft next to the target (here attention-free, two passes);
    `pcgtts speak --policy eagle-sd` uses it. The resumed run trains on PCG's loss (tv+group)."""
    import json
    import shutil
    import subprocess
    import sys

    import soundfile as sf

    folder = tmp_path / "target"
    shutil.copytree(tiny_models["target"], folder)
    cli = [sys.executable, "-c", "import sys; from pcgtts.cli import main; sys.exit(main())"]
    run_cli = lambda *a: subprocess.run(cli + list(a), capture_output=True, text=True, timeout=600)  # noqa: E731
    bad = run_cli("train", "eagle", "--target", str(tmp_path / "nope"))
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "no target checkpoint" in bad.stderr
    done = run_cli("train", "eagle", "--target", str(folder), "--sequences", "4", "--heldout", "2", "--steps", "20",
                   "--max-tokens", "60", "--block", "mlp", "--passes", "2")
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(summary["accept_after"]) == 2 and (folder / "eagle_draft.safetensors").is_file()
    from safetensors import safe_open

    with safe_open(str(folder / "eagle_draft.safetensors"), "pt") as f:
        assert f.metadata()["block"] == "mlp" and f.metadata()["temperature_scales"]  # fitted after training
    assert summary["temperature_fit"]["temperatures"] == [0.2, 0.5, 0.8, 1.0]
    # a trained draft's temperatures fitted again on sequences sampled for it; its weights are kept
    refit = ["train", "eagle-temperatures", "--target", str(folder), "--heldout", "2", "--max-tokens", "60"]
    missing = run_cli(*refit, "--eagle", str(tmp_path / "none.safetensors"))
    assert missing.returncode == 2 and "no draft file" in missing.stderr and missing.stderr.strip().count("\n") == 0
    refitted = run_cli(*refit, "--eagle", str(folder / "eagle_draft.safetensors"), "--out", str(tmp_path / "t.st"))
    assert refitted.returncode == 0, refitted.stderr[-2000:]
    assert len(json.loads(refitted.stdout.strip().splitlines()[-1])["temperature_fit"]["factors"]) == 4
    with safe_open(str(folder / "eagle_draft.safetensors"), "pt") as a, safe_open(str(tmp_path / "t.st"), "pt") as b:
        assert all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys()) and b.metadata()["temperature_scales"]
    # --init-from: a second run starts where the first ended (its held-out figures before training are the
    # first's after, to float16's rounding of the saved draft); a draft of another shape is refused
    again = ["train", "eagle", "--target", str(folder), "--sequences", "4", "--heldout", "2", "--max-tokens", "60",
             "--passes", "2", "--init-from", str(folder / "eagle_draft.safetensors"), "--out", str(tmp_path / "2.st")]
    assert "no draft file" in run_cli(*again[:-3], str(tmp_path / "none"), *again[-2:]).stderr
    wrong = run_cli(*again, "--steps", "1", "--block", "attention")
    assert wrong.returncode == 2 and "not this run's" in wrong.stderr and wrong.stderr.strip().count("\n") == 0
    no_table = run_cli(*again, "--steps", "1", "--block", "mlp", "--loss", "tv+group")
    assert no_table.returncode == 2 and "needs the target's group table" in no_table.stderr and no_table.stderr.strip().count("\n") == 0
    resumed = run_cli(*again, "--steps", "5", "--block", "mlp", "--loss", "tv+group", "--groups", str(tiny_groups_file),
                      "--lr", "1e-4")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    before = json.loads(resumed.stdout.strip().splitlines()[-1])["accept_before"]
    assert before == pytest.approx(summary["accept_after"], abs=5e-3) and before != summary["accept_before"]
    wav = tmp_path / "eagle.wav"
    done = run_cli("speak", "Hello there.", "--target", str(folder), "--codec", str(tiny_models["codec"]),
                   "--policy", "eagle-sd", "--max-tokens", "40", "--seed", "1", "--out", str(wav))
    assert done.returncode == 0, done.stderr[-2000:]
    assert sf.info(str(wav)).frames > 0


def test_calibration_times_the_eagle_proposer(target, proposer):
    """`calibrated_costs` measures an EAGLE proposer like a draft model: a target forward and a
    proposal cost for 1..L+1 rows (timed after a target step), all positive and finite."""
    from pcgtts.runtime.decode.calibrate import measure_proposer_costs

    costs = measure_proposer_costs(target, proposer, 3, "sd", SamplingConfig())
    assert len(costs.target_forward) == 4 and len(costs.draft_forward) == 4
    assert all(c > 0 for c in costs.target_forward) and all(c > 0 for c in costs.draft_forward)
    assert costs.sample > 0 and costs.rule > 0
    assert proposer.length == 0  # the probes leave the draft's cache empty


@pytest.mark.slow  # one ONNX export of the tiny target with its EAGLE draft and heads (~1 min)
def test_proposers_on_onnxruntime_equal_torch(tiny_lms, target, prompt, tiny_groups, tmp_path, monkeypatch):
    """The EAGLE draft and the multi-token heads exported with the target (`pcgtts export onnx
    --eagle --heads`) check themselves, the check catches a draft other than the exported one, and
    on onnxruntime they give the torch backend's tokens: greedy eagle-pcg / mtp-pcg equal greedy
    AR, and seeded runs give the same tokens and statistics (the logits agree to ~1e-5, far below
    any uniform draw's chance of landing between them). The buffers start at 4 slots, so they grow
    within each sequence, and the attention draft's goes back to a fresh size when the next starts.
    A draft that reads several target layers runs there too (the step graph returns them)."""
    import pcgtts.runtime.lm.buffered as buffered
    from pcgtts.export.onnx_lm import check_eagle, export_lm
    from pcgtts.runtime.lm.onnxruntime import OrtLM
    from pcgtts.runtime.lm.torch_lm import TorchLM

    draft, heads = random_draft(target, seed=4), random_heads(target, seed=2)
    path = draft.save(tmp_path / "e.safetensors", dtype=torch.float32)
    meta, _ = export_lm(tiny_lms["target"], tmp_path / "onnx", max_length=256, eagle=path,
                        heads=heads.save(tmp_path / "h.safetensors", dtype=torch.float32))
    for kind in ("eagle", "heads"):
        check = meta.extra[kind]["check"]
        assert check["ok"] and check["max_abs_diff"] < 2e-3, kind
    other = random_draft(target, seed=5).save(tmp_path / "other.safetensors", dtype=torch.float32)
    assert not check_eagle(tiny_lms["target"], other, tmp_path / "onnx").ok

    monkeypatch.setattr(buffered, "INITIAL_CAPACITY", 4)
    ort = OrtLM.load(tmp_path / "onnx", max_length=256, tokenizer=target.tokenizer)
    assert ort.exposes_hidden and ort.has_eagle and ort.has_heads
    mlp = random_draft(target, seed=6, block="mlp")
    mlp.temperature_scales = ((0.5, 0.7), (1.0, 0.9))  # the export carries them: the seeded runs below draw at 0.64
    meta, _ = export_lm(tiny_lms["target"], tmp_path / "onnx-mlp", max_length=256,
                        eagle=mlp.save(tmp_path / "m.safetensors", dtype=torch.float32))
    assert meta.extra["eagle"]["check"]["ok"] and meta.extra["eagle"]["block"] == "mlp"
    ort_mlp = OrtLM.load(tmp_path / "onnx-mlp", max_length=256, tokenizer=target.tokenizer)
    assert EagleProposer.for_target(ort_mlp).temperature_scales == mlp.temperature_scales
    # a draft that reads two more layers: the step graph returns them, the runtime fuses a target row
    fused = random_draft(target, seed=8, block="mlp", feature_layers=(0, 2))
    meta, _ = export_lm(tiny_lms["target"], tmp_path / "onnx-fused", max_length=256,
                        eagle=fused.save(tmp_path / "f.safetensors", dtype=torch.float32))
    d = target.model.args.hidden_size
    assert meta.extra["eagle"]["check"]["ok"] and meta.extra["check"]["ok"]
    assert meta.extra["taps"] == [0, 2] and meta.extra["state_size"] == meta.extra["eagle"]["state_size"] == 3 * d
    ort_fused = OrtLM.load(tmp_path / "onnx-fused", max_length=256, tokenizer=target.tokenizer)
    # plain decoding steps through the export's graph without the taps; the draft switches to the tapped one
    assert meta.extra["plain_graph"] == "model_plain.onnx" and meta.extra["check"]["ok"]
    assert not ort_fused.tapped and ort_fused.forward_hidden(prompt)[1].shape == (len(prompt), d)
    ort_fused.rollback(0)
    import shutil

    from pcgtts.export.onnx_lm import quantize_int8

    shutil.copytree(tmp_path / "onnx-fused", tmp_path / "onnx-fused-int8")
    q = quantize_int8(tmp_path / "onnx-fused-int8")  # both step graphs, each replaced by its int8 form
    assert (q.graph, q.extra["plain_graph"]) == ("model.int8.onnx", "model_plain.int8.onnx")
    assert sorted(p.name for p in (tmp_path / "onnx-fused-int8").glob("model*")) == [q.graph, q.extra["plain_graph"]]
    int8 = OrtLM.load(tmp_path / "onnx-fused-int8", max_length=256, tokenizer=target.tokenizer)
    assert not int8.tapped and int8.forward_hidden(prompt)[1].shape == (len(prompt), d)
    int8.use_taps()  # mid-sequence: the cache goes on
    assert int8.tapped and int8.forward_hidden(prompt[:2])[1].shape == (2, 3 * d)
    tapped = TorchLM.load(tiny_lms["target"], max_length=256)  # its own copy: tapping is for the LM's life
    cases = [("eagle", ort, EagleProposer.for_target(ort), target, EagleProposer.from_draft(draft, target)),
             ("eagle", ort_mlp, EagleProposer.for_target(ort_mlp), target, EagleProposer.from_draft(mlp, target)),
             ("eagle", ort_fused, EagleProposer.for_target(ort_fused), tapped, EagleProposer.from_draft(fused, tapped)),
             ("mtp", ort, HeadProposer(ort.heads_step()), target, HeadProposer.from_heads(heads, target))]
    assert ort_fused.tapped and ort_fused.forward_hidden(prompt)[1].shape == (len(prompt), 3 * d)
    reference, _ = run(target, None, prompt, "ar", GREEDY)
    for kind, lm, on_ort, torch_lm, on_torch in cases:
        assert run(lm, on_ort, prompt, f"{kind}-pcg", GREEDY, groups=tiny_groups)[0] == reference, kind
        for policy in (f"{kind}-sd", f"{kind}-pcg"):
            a, sa = run(torch_lm, on_torch, prompt, policy, SamplingConfig(), tokens=60, seed=3, groups=tiny_groups)
            b, sb = run(lm, on_ort, prompt, policy, SamplingConfig(), tokens=60, seed=3, groups=tiny_groups)
            assert a == b and (sa.drafted, sa.accepted, sa.steps) == (sb.drafted, sb.accepted, sb.steps), policy
            assert sa.accepted > 0, policy  # the comparison covered accepted proposals
    attention_step = cases[0][2].step
    grown = attention_step.cache[0].shape[2]
    short, _ = run(ort, cases[0][2], prompt, "eagle-sd", GREEDY, tokens=2)
    assert short == reference[:2] and attention_step.cache[0].shape[2] < grown


def test_eagle_on_onnxruntime_is_refused_cleanly(tiny_models, tmp_path):
    """Before any model loads: the onnxruntime backend reads the proposers from its export, not
    --eagle / --heads; an export without them says how to make them; tensorrt runs neither."""
    from pcgtts.runtime.synthesizer import Synthesizer

    (tmp_path / "e.safetensors").write_bytes(b"x")
    common = dict(draft=tiny_models["draft"], codec=tiny_models["codec"], backend="onnxruntime")
    with pytest.raises(ValueError, match="exported with the target"):
        Synthesizer.from_pretrained(tiny_models["target"], policy="eagle-sd", eagle=str(tmp_path / "e.safetensors"),
                                    **common)
    with pytest.raises(ValueError, match="EAGLE draft"):
        Synthesizer.from_pretrained(tiny_models["target"], policy="eagle-sd", **common)
    with pytest.raises(ValueError, match="instead of --heads"):
        Synthesizer.from_pretrained(tiny_models["target"], policy="mtp-sd", heads=str(tmp_path / "e.safetensors"),
                                    **common)
    with pytest.raises(ValueError, match="multi-token heads exported with the target"):
        Synthesizer.from_pretrained(tiny_models["target"], policy="mtp-viterbi", **common)
    with pytest.raises(ValueError, match="torch and onnxruntime backends only"):
        Synthesizer.from_pretrained(tiny_models["target"], policy="eagle-pcg",
                                    **{**common, "backend": "tensorrt", "compute_device": "cuda"})


def test_bench_checks_state_policies_on_the_backend_in_force(tiny_lms, target, tmp_path):
    """`pcgtts bench` checks the eagle-* / mtp-* policies before loading models, on the backend the
    flags or defaults give (no --backend: torch), not only when --backend is spelled out."""
    from pcgtts.cli import build_parser
    from pcgtts.cli.bench import check_state_policies

    eagle = random_draft(target).save(tmp_path / "e.safetensors")
    parse = lambda *extra: build_parser().parse_args(["bench", "--target", str(tiny_lms["target"]), *extra])  # noqa: E731
    check_state_policies(["eagle-pcg"], parse("--eagle", str(eagle)))  # torch by default: accepted
    with pytest.raises(ValueError, match="needs the target's EAGLE draft"):
        check_state_policies(["eagle-pcg"], parse())
    with pytest.raises(ValueError, match="exported with the target"):
        check_state_policies(["eagle-pcg"], parse("--backend", "onnxruntime"))
    # No --target: the built-in voice, whose own EAGLE draft is checked as it loads (the shipped voice has one).
    check_state_policies(["eagle-pcg"], build_parser().parse_args(["bench"]))


def test_the_built_in_voice_is_the_demo_only_where_no_trained_voice_ships(tmp_path, monkeypatch):
    """bench and eval flag their reports as the random demo's (and cap its sentences at 150 tokens)
    only for no target where no trained voice ships: a shipped voice's figures are its own."""
    from pcgtts import builtin

    assert builtin.runs_demo_models(None)  # conftest hides the shipped voice from other tests
    assert not builtin.runs_demo_models("some/target")
    (tmp_path / "voice.json").write_text("{}")
    monkeypatch.setattr(builtin, "VOICE_DIR", tmp_path)
    assert not builtin.runs_demo_models(None)


def test_heads_eagle_help_states_the_trainers_defaults():
    """The CLI leaves unset options to EagleTrainConfig (no torch at parse time); its help text
    repeats those defaults, and must say what the trainer does."""
    from pcgtts.cli import build_parser
    from pcgtts.train.eagle import EagleTrainConfig

    heads = next(a for a in build_parser()._subparsers._group_actions[0].choices["heads"]._subparsers._group_actions
                 if a.choices).choices["eagle"]
    helps = {a.dest: a.help for a in heads._actions}
    for name in ("sequences", "heldout", "steps", "passes", "batch_sequences"):
        assert f"(default {getattr(EagleTrainConfig, name):,})" in helps[name], name
    assert heads.parse_args(["--target", "T"]).steps is None


def test_an_attention_free_draft_steps_on_the_host_as_torch_does(target):
    """On a CPU an attention-free float32 draft runs as NumPy (`HostEagleStep`): its features and
    the target head's scores equal `TorchEagleStep`'s to float32 rounding, for target states and for
    its own fed-back features, stop token included; an attention draft keeps the torch step."""
    from pcgtts.runtime.lm.eagle import HostEagleStep, TorchEagleStep

    draft = random_draft(target, seed=11, block="mlp")
    host = EagleProposer.from_draft(draft, target).step
    assert isinstance(host, HostEagleStep)
    assert isinstance(EagleProposer.from_draft(random_draft(target), target).step, TorchEagleStep)
    ref = TorchEagleStep(draft, target.model, target.vocab, target.max_length)
    gen = torch.Generator().manual_seed(3)
    states = torch.randn(3, target.model.args.hidden_size, generator=gen)
    for tokens in (torch.tensor([5, 17, 300]), torch.tensor([2, 9, target.vocab.stop_index])):
        (f_ref, s_ref), (f, s) = ref.run(states, tokens, 0), host.run(states, tokens, 0)
        torch.testing.assert_close(f, f_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(s, s_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(host.run(f[None], tokens[:1], 0)[1], ref.run(f_ref[None], tokens[:1], 0)[1],
                                   rtol=1e-5, atol=1e-5)
    assert host.scores_to_logits(s).shape == (target.vocab.restricted_size,)


def test_a_draft_reading_several_target_layers(tiny_lms, tiny_groups, tmp_path):
    """EAGLE-3's features (`feature_layers`): the file keeps them; attaching the draft makes the target
    return those layers' RMS-normalised outputs before its final state, and nothing else changes
    (the same logits; multi-token heads on it propose as before); the host step fuses a target row as
    the torch step does and takes fed-back rows as they are; greedy decoding with it is plain greedy;
    what cannot work is refused."""
    from pcgtts.runtime.lm.eagle import HostEagleStep, TorchEagleStep
    from pcgtts.runtime.lm.torch_lm import TorchLM

    target = TorchLM.load(tiny_lms["target"], max_length=256)
    d = target.model.args.hidden_size
    prompt = build_prompt(target.tokenizer, target.vocab, "An eagle draft test sentence.")
    reference, _ = run(target, None, prompt, "ar", GREEDY, tokens=24)
    heads = HeadProposer.from_heads(random_heads(target, seed=2), target)
    with_heads, _ = run(target, heads, prompt, "mtp-sd", SamplingConfig(), tokens=24, seed=3)
    target.rollback(0)
    plain_logits, plain_hidden = target.forward_hidden(prompt)
    outputs = {}
    hooks = [target.model.layers[i].register_forward_hook((lambda i: lambda m, a, out: outputs.__setitem__(i, out))(i))
             for i in (0, 2)]
    draft = random_draft(target, seed=5, block="mlp", feature_layers=(0, 2))
    loaded = EagleDraft.load(draft.save(tmp_path / "f.safetensors", dtype=torch.float32), target.model)
    assert loaded.feature_layers == (0, 2) and loaded.state_size == 3 * d
    assert torch.equal(loaded.fuse.weight, draft.fuse.weight)
    proposer = EagleProposer.from_draft(loaded, target)
    assert target.model.taps == (0, 2) and isinstance(proposer.step, HostEagleStep)
    target.rollback(0)
    logits, states = target.forward_hidden(prompt)
    for h in hooks:
        h.remove()
    assert states.shape == (len(prompt), 3 * d)
    torch.testing.assert_close(logits, plain_logits)
    torch.testing.assert_close(states[:, -d:], plain_hidden)
    layer0 = outputs[0][0]
    torch.testing.assert_close(states[:, :d], layer0 * torch.rsqrt(layer0.pow(2).mean(-1, keepdim=True)
                                                                    + target.model.args.rms_norm_eps))
    ref = TorchEagleStep(loaded, target.model, target.vocab, target.max_length)
    tokens = torch.tensor([5, 17, 300])
    (f_ref, s_ref), (f, s) = ref.run(states[-3:], tokens, 0), proposer.step.run(states[-3:], tokens, 0)
    torch.testing.assert_close(f, f_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, s_ref, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        embed = target.model.embed_tokens(target.vocab.restricted_to_token_ids(tokens[-1:]))
        torch.testing.assert_close(f_ref, loaded.train_features(loaded.fuse(states[-1:])[None], embed[None])[0, -1])
    torch.testing.assert_close(proposer.step.run(f[None], tokens[:1], 0)[1], ref.run(f_ref[None], tokens[:1], 0)[1],
                               rtol=1e-5, atol=1e-5)
    for policy in ("eagle-sd", "eagle-pcg"):
        output, stats = run(target, proposer, prompt, policy, GREEDY, groups=tiny_groups, tokens=24)
        assert output == reference and stats.drafted > 0
    # multi-token heads on the same target read each row's final state (its last D entries): as before the taps
    assert run(target, heads, prompt, "mtp-sd", SamplingConfig(), tokens=24, seed=3)[0] == with_heads
    with pytest.raises(ValueError, match="already returns layers"):
        EagleProposer.from_draft(random_draft(target, block="mlp", feature_layers=(1,)), target)
    with pytest.raises(ValueError, match="feature_layers must be"):
        EagleDraft(target.model.args, feature_layers=(3,))  # the last layer is the final state itself
    with pytest.raises(ValueError, match="feature_layers must be"):
        EagleDraft(target.model.args, feature_layers=(2, 0))


def test_a_chain_is_warmed_up_once_per_proposal_count(target):
    """`warm_up` runs before every seeded utterance (`DraftLengthPlanner.plan`): each count's chain runs
    the first time only (running all of them again had cost every such utterance ~9.5 ms)."""
    step = EagleProposer.from_draft(random_draft(target, seed=7, block="mlp"), target).step
    calls = []

    def chain(state, token, uniforms, temperature):
        calls.append(len(uniforms))
        return torch.zeros(len(uniforms), dtype=torch.long), torch.zeros(len(uniforms), 2 + 4 * step.digits)

    proposer = EagleProposer(step, chain)
    config = DecodeConfig(policy="eagle-pcg", draft_length=3, sampling=SamplingConfig(temperature=0.8))
    proposer.warm_up(config)
    assert calls == [1, 2, 3]
    proposer.warm_up(config)
    assert calls == [1, 2, 3]
    proposer.warm_up(dataclasses.replace(config, draft_length=4))
    assert calls == [1, 2, 3, 4]
