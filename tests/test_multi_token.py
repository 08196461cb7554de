"""Multi-token heads: the heads file, the top-M / threshold rules, and the mtp-* decode
loop — greedy equivalence, exactness of mtp-sd in distribution, statistics, policy checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pcgtts.runtime.config import DecodeConfig, SamplingConfig
from pcgtts.runtime.decode.acceptance import verify_threshold, verify_top_m
from pcgtts.runtime.decode.proposers import HeadProposer
from pcgtts.runtime.decode.loop import decode
from pcgtts.runtime.lm.heads import MTPHeads
from pcgtts.runtime.text.prompt import build_prompt

from helpers import assert_same_marginal, decode_codes as run, random_heads, third_codes

GREEDY = SamplingConfig(temperature=0.0)


@pytest.fixture(scope="module")
def target(tiny_pair):
    return tiny_pair[0]


@pytest.fixture(scope="module")
def prompt(target):
    return build_prompt(target.tokenizer, target.vocab, "Multi token heads test sentence.")


@pytest.fixture(scope="module")
def proposer(target):
    return HeadProposer.from_heads(random_heads(target), target)


# --- the heads file ---------------------------------------------------------------------------

def test_heads_file_round_trips_and_is_tied_to_its_target(target, tmp_path):
    heads = random_heads(target)
    path = heads.save(tmp_path / "h.safetensors", dtype=torch.float32)
    loaded = MTPHeads.load(path, fingerprint=target.fingerprint, hidden_size=target.model.head.in_features)
    assert loaded.num_heads == 3
    for (name, a), (_, b) in zip(heads.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="another target"):
        MTPHeads.load(path, fingerprint="0" * 64)
    with pytest.raises(ValueError, match="hidden size"):
        MTPHeads.load(path, hidden_size=999)
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a readable"):
        MTPHeads.load(tmp_path / "bad.safetensors")
    with pytest.raises(FileNotFoundError, match="pcgtts train heads"):
        MTPHeads.load(tmp_path / "missing.safetensors")


def test_fresh_heads_predict_like_the_target_head(target):
    """U_i = 0 at init: every head's logits are the target head's own on the same state."""
    heads = MTPHeads(2, target.model.head.in_features)
    hidden = torch.randn(5, target.model.head.in_features)
    logits = heads.logits(hidden, target.model.logits)  # [5, 2, V]
    expected = target.model.head(hidden).float()
    assert torch.allclose(logits[:, 0], expected, atol=1e-5) and torch.allclose(logits[:, 1], expected, atol=1e-5)


# --- the rules --------------------------------------------------------------------------------

def test_top_m_and_threshold_rules():
    # One sequence, 3 proposals over 5 tokens. Target rows (probabilities at the sampling temperature):
    probs = torch.tensor([[[0.5, 0.3, 0.1, 0.05, 0.05],
                           [0.1, 0.2, 0.6, 0.05, 0.05],
                           [0.0, 0.0, 0.0, 0.0, 1.0],
                           [0.0, 1.0, 0.0, 0.0, 0.0]]])
    logits = probs.clamp_min(1e-6).log()
    drafts = torch.tensor([[1, 2, 3]])
    gen = torch.Generator().manual_seed(0)
    strict = verify_top_m(drafts, logits, probs, 1, gen)  # 1 is not the argmax of row 0
    assert strict.num_accepted.tolist() == [0] and strict.tokens[0, 0].item() in (0, 1, 2, 3, 4)
    top2 = verify_top_m(drafts, logits, probs, 2, gen)  # 1 in top-2 of row 0, 2 is row 1's argmax, 3 not in row 2's top-2
    assert top2.num_accepted.tolist() == [2] and top2.tokens[0, 2].item() == 4  # row 2 is one-hot on 4
    thresh = verify_threshold(drafts, probs, 0.25, gen)  # 0.3, 0.6 pass; 0.0 fails
    assert thresh.num_accepted.tolist() == [2] and thresh.tokens[0, :3].tolist() == [1, 2, 4]
    everything = verify_threshold(torch.tensor([[0, 2, 4]]), probs, 0.25, gen)
    assert everything.num_accepted.tolist() == [3] and everything.tokens[0, 3].item() == 1  # bonus from row 3


# --- the decode loop --------------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["mtp-sd", "mtp-pcg", "mtp-strict"])
def test_greedy_multi_token_equals_plain_greedy(target, proposer, prompt, tiny_groups, policy):
    reference, _ = run(target, proposer, prompt, "ar", GREEDY)
    output, stats = run(target, proposer, prompt, policy, GREEDY, groups=tiny_groups)
    assert output == reference
    assert stats.target_forwards == stats.steps and stats.draft_forwards == 0


def test_multi_token_statistics_are_consistent(target, proposer, prompt, tiny_groups):
    for policy in ("mtp-sd", "mtp-pcg", "mtp-topm", "mtp-threshold", "mtp-strict"):
        out, stats = run(target, proposer, prompt, policy, SamplingConfig(), tokens=80, groups=tiny_groups)
        assert stats.emitted == len(out) == 80, policy
        assert all(0 <= t < target.vocab.num_speech for t in out)
        assert stats.target_forwards == stats.steps and stats.draft_forwards == 0
        assert stats.accepted + stats.steps >= stats.emitted > stats.accepted + stats.steps - 4
        assert sum(stats.per_position_accepted) == stats.accepted
        assert stats.drafted == 3 * (stats.steps - 1)  # the first step has no proposals
        a, _ = run(target, proposer, prompt, policy, SamplingConfig(), tokens=30, seed=5, groups=tiny_groups)
        b, _ = run(target, proposer, prompt, policy, SamplingConfig(), tokens=30, seed=5, groups=tiny_groups)
        assert a == b, policy


def test_adaptive_heads_with_useless_heads_stay_within_five_percent_of_ar(target, proposer, viterbi_proposer, prompt,
                                                                           tiny_groups):
    """Counted in the cost model's time (given costs: cheap heads, a verify of 4 costing 2.5 steps),
    not wall time. The random heads are useless, so the policy must settle on plain target steps;
    the same heads at a fixed 3 proposals cost far more (the check has power). Greedy output is
    unchanged by the choice of head count."""
    from pcgtts.runtime.decode.cost_model import StepCosts, counted_seconds

    costs = StepCosts(target_forward=(1.0, 1.5, 2.0, 2.5), draft_forward=(0.1, 0.1), rule=0.03, sample=0.02)

    def per_token(stats):
        return counted_seconds(costs, stats.length_counts, 0) / stats.emitted

    for policy in ("mtp-sd", "mtp-pcg", "mtp-viterbi"):
        extra = {"groups": tiny_groups} if policy == "mtp-pcg" else {}
        proposing = viterbi_proposer if policy == "mtp-viterbi" else proposer
        out, stats = run(target, proposing, prompt, policy, SamplingConfig(), tokens=120, costs=costs,
                         adaptive_draft=True, **extra)
        assert len(out) == 120 and stats.target_forwards <= stats.emitted, policy
        assert per_token(stats) <= 1.05 * costs.ar_step, (policy, stats.length_counts)
        _, fixed = run(target, proposing, prompt, policy, SamplingConfig(), tokens=120, costs=costs, **extra)
        assert per_token(fixed) > 1.05 * costs.ar_step, policy
    reference, _ = run(target, proposer, prompt, "ar", GREEDY)
    adaptive, _ = run(target, proposer, prompt, "mtp-sd", GREEDY, costs=costs, adaptive_draft=True)
    assert adaptive == reference


@pytest.mark.slow  # 3,000 decodes: minutes on a loaded 2-core machine
def test_mtp_sd_is_exact_in_distribution(target, proposer, prompt):
    """The marginal of the 3rd generated code (the first one a head proposes and the target
    verifies, at draft position 2) under mtp-sd equals plain AR sampling's.

    Two-sample chi-square test over the 8 most frequent codes (temperature 0.5) + the rest pooled, 1,500 runs
    each (runs that stopped early dropped), at significance 1e-3: the false-alarm rate of this test is 0.1 % (seeds fixed, so it
    is deterministic). The heads are random, so proposals are often rejected and both the
    accept and the residual branch are exercised."""
    short = prompt[-6:]  # a short prompt keeps 3,000 decodes cheap; the claim does not depend on it
    assert_same_marginal(third_codes(target, proposer, short, "ar", 11), third_codes(target, proposer, short, "mtp-sd", 12))


def test_policies_need_their_parts(target, prompt, proposer):
    with pytest.raises(ValueError, match="multi-token heads"):
        decode(target, None, prompt, DecodeConfig(policy="mtp-sd"), torch.Generator())
    with pytest.raises(ValueError, match="group table"):
        list(decode(target, None, prompt, DecodeConfig(policy="mtp-pcg"), torch.Generator(), proposer=proposer))
    with pytest.raises(ValueError, match="transition table"):
        list(decode(target, None, prompt, DecodeConfig(policy="mtp-viterbi"), torch.Generator(), proposer=proposer))
    with pytest.raises(ValueError, match="mtp_top_m"):
        DecodeConfig(policy="mtp-topm", mtp_top_m=0)
    with pytest.raises(ValueError, match="mtp_threshold"):
        DecodeConfig(policy="mtp-threshold", mtp_threshold=0.0)


def test_synthesizer_finds_heads_next_to_the_target(tiny_models, tmp_path, target):
    """A heads file saved in the target folder is picked up; the mtp-* policies stream audio;
    without it they are refused before anything loads."""
    import shutil

    from pcgtts import Synthesizer

    folder = tmp_path / "target"
    shutil.copytree(tiny_models["target"], folder)
    kwargs = dict(codec=tiny_models["codec"], policy="mtp-sd", seed=1, max_new_tokens=30, max_length=1024)
    with pytest.raises(ValueError, match="multi-token heads"):
        Synthesizer.from_pretrained(str(folder), **kwargs)
    random_heads(target).save(folder / "mtp_heads.safetensors")
    synth = Synthesizer.from_pretrained(str(folder), **kwargs)
    audio = synth.synthesize("Hello there.")
    assert audio.size > 0 and synth.heads is not None
    with pytest.raises(ValueError, match="draft"):
        synth.stream("Hello.", config=__import__("dataclasses").replace(
            synth.config, decode=DecodeConfig(policy="sd")))


@pytest.fixture(scope="module")
def viterbi_proposer(target, proposer, prompt, tmp_path_factory):
    """The random heads with a transition table built from the target's own codes (through
    `pcgtts train transitions`'s file format)."""
    from pcgtts.runtime.decode.transitions import TransitionTable

    sequences = [np.array(run(target, proposer, prompt, "ar", SamplingConfig(), tokens=60, seed=s)[0]) for s in range(6)]
    table = TransitionTable.build(sequences, vocab_size=target.vocab.restricted_size, top_k=16)
    path = table.save(tmp_path_factory.mktemp("viterbi") / "t.pct")
    return HeadProposer(proposer.step, TransitionTable.load(path))


def test_viterbi_heads_verified_strictly_equal_greedy(target, viterbi_proposer, prompt):
    """mtp-viterbi: the heads' top-k lattice searched with the transition table; verified with
    top-M at M = 1 and temperature 0 it is greedy decoding, and at M = 2 it accepts at least as much."""
    viterbi = viterbi_proposer
    reference, _ = run(target, viterbi, prompt, "ar", GREEDY)
    strict, s1 = run(target, viterbi, prompt, "mtp-viterbi", GREEDY, mtp_top_m=1)
    assert strict == reference
    loose, s2 = run(target, viterbi, prompt, "mtp-viterbi", GREEDY, mtp_top_m=2)
    assert s2.accepted >= 0 and len(loose) == 40 and all(0 <= t < target.vocab.num_speech for t in loose)
    assert s1.drafted == 3 * (s1.steps - 1)


@pytest.mark.slow
def test_heads_cli_end_to_end(tiny_models, tmp_path):
    """`pcgtts train heads` writes heads next to the target, `train transitions` the .pct, and
    `pcgtts speak` then decodes with mtp-sd and mtp-viterbi into WAV files."""
    import json
    import shutil
    import subprocess
    import sys

    import soundfile as sf

    folder = tmp_path / "target"
    shutil.copytree(tiny_models["target"], folder)
    cli = [sys.executable, "-c", "import sys; from pcgtts.cli import main; sys.exit(main())"]
    run_cli = lambda *a: subprocess.run(cli + list(a), capture_output=True, text=True, timeout=600)  # noqa: E731
    bad = run_cli("train", "heads", "--target", str(tmp_path / "nope"))
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "no target checkpoint" in bad.stderr
    done = run_cli("train", "heads", "--target", str(folder), "--num-heads", "2", "--sequences", "4", "--heldout", "2",
                   "--steps", "30", "--max-tokens", "60")
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(summary["accept_after"]) == 2 and (folder / "mtp_heads.safetensors").is_file()
    seqs = np.load(folder / "mtp_heads.safetensors.work" / "sequences.npz")
    np.savez(tmp_path / "codes.npz", a=seqs["train_generated"])
    done = run_cli("train", "transitions", "--codes", str(tmp_path / "codes.npz"), "--num-speech", "1024",
                   "--out", str(folder / "transitions.pct"))
    assert done.returncode == 0, done.stderr[-2000:]
    for policy in ("mtp-sd", "mtp-viterbi"):
        wav = tmp_path / f"{policy}.wav"
        done = run_cli("speak", "Hello there.", "--target", str(folder), "--codec", str(tiny_models["codec"]),
                       "--policy", policy, "--max-tokens", "40", "--seed", "1", "--out", str(wav))
        assert done.returncode == 0, done.stderr[-2000:]
        assert sf.info(str(wav)).frames > 0
