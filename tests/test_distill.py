"""Distilled draft (train/distill.py, `pcgtts train draft distill`): on the tiny demo pair a short, seeded
distillation run lowers the held-out TV between draft and target (measured through the runtime on
the draft as given and on the export), a rerun resumes from the checkpoint without generating again,
the export is a draft the runtime loads, and bad arguments are one line before any model loads."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pcgtts.train.distill import DistillConfig, coarse, distill_loss, divergences, train_distill

STEPS, STOP_AT = 30, 12  # the first run stops at STOP_AT; the second resumes there and finishes
RUN = dict(steps=STEPS, sequences=6, heldout=2, max_tokens=40, lr=1e-3, batch_size=2, seed=0, threads=1,
           log_every=3, eval_every=6)
# Measured (one thread): held-out TV 0.049 -> 0.021 (ratio 0.42; seeds 1-3 give 0.35-0.46).
# The claim tested: at least 40% lower (ratio <= 0.6).
MARGIN = 0.6


@pytest.fixture(scope="module")
def distilled(tiny_lms, tmp_path_factory):
    """One distillation run on the tiny pair, stopped at STOP_AT and resumed to STEPS."""
    cfg = DistillConfig(target=tiny_lms["target"], draft=tiny_lms["draft"],
                        out_dir=tmp_path_factory.mktemp("distill") / "run", **RUN)
    first = train_distill(cfg, stop_after=STOP_AT)
    log_after_first = (cfg.out_dir / "loss.jsonl").read_text()
    import pcgtts.runtime.decode.loop as speculative

    def refuse(*args, **kwargs):
        raise AssertionError("the resumed run generated sequences again")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(speculative, "decode", refuse)
        second = train_distill(cfg)
    return cfg, first, second, log_after_first


def test_distillation_lowers_the_heldout_tv(distilled):
    _, first, second, _ = distilled
    assert second["tv_before"] == pytest.approx(first["tv_before"], abs=1e-6)  # same held-out set, same draft
    assert second["tv_after"] <= MARGIN * second["tv_before"], second
    assert second["acceptance_after"] == pytest.approx(1 - second["tv_after"])
    assert second["heldout_tokens"] == 2 * 40 and second["train_tokens"] == 6 * 40


def test_a_rerun_resumes_from_the_checkpoint_and_reuses_the_sequences(distilled):
    cfg, first, second, log_after_first = distilled
    assert (first["step"], first["resumed_from"], first["generated_now"]) == (STOP_AT, 0, 8)
    assert (second["step"], second["resumed_from"], second["generated_now"]) == (STEPS, STOP_AT, 0)
    steps = [json.loads(line)["step"] for line in (cfg.out_dir / "loss.jsonl").read_text().splitlines()]
    assert steps == list(range(3, STEPS + 1, 3))  # continued, nothing logged twice
    assert (cfg.out_dir / "loss.jsonl").read_text().startswith(log_after_first)
    ckpt = torch.load(cfg.out_dir / "checkpoint.pt", weights_only=False)
    assert ckpt["step"] == STEPS


def test_resuming_gives_the_weights_of_an_uninterrupted_run(distilled, tmp_path):
    import shutil
    from dataclasses import replace

    from safetensors.torch import load_file

    cfg, _, second, _ = distilled
    straight = replace(cfg, out_dir=tmp_path / "straight")
    straight.out_dir.mkdir()
    shutil.copy(cfg.out_dir / "sequences.npz", straight.out_dir)  # the same samples, not generated again
    summary = train_distill(straight)
    assert (summary["generated_now"], summary["resumed_from"], summary["step"]) == (0, 0, STEPS)
    resumed, whole = (load_file(str(c.out_dir / "export" / "model.safetensors")) for c in (cfg, straight))
    assert all(torch.equal(resumed[k], whole[k]) for k in whole)
    assert summary["tv_after"] == second["tv_after"]


def test_the_export_is_a_draft_the_runtime_loads(distilled, tiny_lms):
    from safetensors import safe_open

    from pcgtts.runtime.lm.checkpoint import load_tokenizer
    from pcgtts.runtime.lm.draft import check_draft_layout
    from pcgtts.runtime.lm.torch_lm import TorchLM

    cfg, _, second, _ = distilled
    export = cfg.out_dir / "export"
    tokenizer = load_tokenizer(tiny_lms["target"])
    check_draft_layout(tiny_lms["target"], tokenizer, export)
    draft = TorchLM.load(export, max_length=64, tokenizer=tokenizer)
    given = json.loads((tiny_lms["draft"] / "config.json").read_text())
    config = json.loads((export / "config.json").read_text())
    assert config["pcgtts_draft"]["layers"] == given["pcgtts_draft"]["layers"]
    assert config["pcgtts_draft"]["distilled"]["steps"] == STEPS
    assert {k: v for k, v in config.items() if k != "pcgtts_draft"} == {k: v for k, v in given.items()
                                                                        if k != "pcgtts_draft"}
    assert sorted(p.name for p in export.iterdir()) == sorted(p.name for p in tiny_lms["draft"].iterdir())
    from pcgtts.runtime.files import default_mode

    assert (export / "model.safetensors").stat().st_mode & 0o777 == default_mode()  # not safetensors' 0600
    with safe_open(str(export / "model.safetensors"), "pt") as new, \
            safe_open(str(tiny_lms["draft"] / "model.safetensors"), "pt") as old:
        assert sorted(new.keys()) == sorted(old.keys())
        assert all(new.get_slice(k).get_dtype() == old.get_slice(k).get_dtype() for k in old.keys())
        changed = [k for k in old.keys() if not torch.equal(new.get_tensor(k), old.get_tensor(k))]
    assert "model.layers.0.mlp.up_proj.weight" in changed
    ids = torch.arange(10) + 300
    assert torch.isfinite(draft.prefill(ids)).all()


def test_the_cli_prints_a_table_then_one_json_line(distilled, tiny_lms, capsys):
    """`pcgtts train draft distill` on the finished run: resumes at its last step, reuses everything, reports."""
    from pcgtts.cli import main

    cfg, _, second, _ = distilled
    argv = ["train", "draft", "distill", "--target", str(tiny_lms["target"]), "--draft", str(tiny_lms["draft"]),
            "--out", str(cfg.out_dir), "--steps", str(STEPS), "--sequences", "6", "--heldout", "2",
            "--max-tokens", "40", "--threads", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(out[-1])
    assert (summary["step"], summary["resumed_from"], summary["generated_now"]) == (STEPS, STEPS, 0)
    assert summary["tv_after"] == pytest.approx(second["tv_after"], abs=1e-6)
    assert out[1].startswith("expected SD acceptance (1 - TV)")
    before, after = (float(x) for x in out[1].split()[-2:])
    assert after > before


@pytest.fixture
def no_models(monkeypatch):
    """Fail the test if the command gets as far as loading a model or starting the run."""
    import pcgtts.train.distill
    from pcgtts.runtime.lm.torch_lm import TorchLM

    def refuse(*args, **kwargs):
        raise AssertionError("models were loaded before the bad input was reported")

    monkeypatch.setattr(pcgtts.train.distill, "train_distill", refuse)
    monkeypatch.setattr(TorchLM, "load", classmethod(refuse))


@pytest.mark.parametrize("extra, message", [
    (["--target", "{tmp}/missing"], "--target {tmp}/missing: directory not found"),
    (["--draft", "{tmp}"], "is not a checkpoint directory: no config.json"),
    (["--steps", "0"], "must be > 0"),
    (["--sequences", "-3"], "must be > 0"),
    (["--max-tokens", "0"], "max_new_tokens must lie in [1, "),
    (["--temperature", "0"], "must be > 0"),
    (["--lr", "nan"], "must be > 0"),
    (["--loss", "js"], "invalid choice"),
    (["--loss", "tv+group"], "--loss tv+group needs the target's group table"),
    (["--groups", "{tmp}/none.pcg"], "group table not found"),
    (["--out", "/proc/pcgtts-distill"], "cannot write"),
    (["--out", "{tmp}/file.txt"], "is a file"),
    (["--sentences", "{tmp}/none.txt"], "sentences file not found"),
    (["--sentences", "{tmp}/bad.txt"], "bad.txt:2: text has no pronounceable characters"),
])
def test_bad_arguments_are_one_line_before_models_load(extra, message, tiny_lms, tmp_path, capsys, no_models):
    from pcgtts.cli import main

    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "bad.txt").write_text("A fine sentence.\n  ...  \n")
    argv = ["train", "draft", "distill", "--target", str(tiny_lms["target"]), "--draft", str(tiny_lms["draft"]),
            "--out", str(tmp_path / "out")] + [a.replace("{tmp}", str(tmp_path)) for a in extra]
    try:
        code = main(argv)
    except SystemExit as exit:  # argparse's own errors
        code = exit.code
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert message.replace("{tmp}", str(tmp_path)) in err and "Traceback" not in err, err
    assert len([line for line in err.splitlines() if "error" in line]) == 1, err
    assert not (tmp_path / "out").exists()


def test_config_checks_the_loss_needs_groups(tmp_path):
    with pytest.raises(ValueError, match="tv\\+group needs"):
        DistillConfig(target=tmp_path, draft=tmp_path, out_dir=tmp_path, loss="tv+group")
    with pytest.raises(ValueError, match="loss must be one of"):
        DistillConfig(target=tmp_path, draft=tmp_path, out_dir=tmp_path, loss="js")


def small_view():
    """Groups {0, 1}, {1, 2}, {3} over 4 speech tokens (+ stop): token 1 is in two groups."""
    from pcgtts.groups.device import DeviceGroupTable
    from pcgtts.runtime.decode.acceptance.coarse import coarse_view as _coarse_view

    table = DeviceGroupTable.from_csr(np.array([0, 2, 4, 5]), np.array([0, 1, 1, 2, 3]), 4)
    return _coarse_view(table, 5)


def test_losses_are_the_acceptance_rules_distances():
    gen = torch.Generator().manual_seed(0)
    target_logits, draft_logits = torch.randn(6, 5, generator=gen), torch.randn(6, 5, generator=gen)
    draft_logits.requires_grad_(True)
    p, q = torch.softmax(target_logits / 0.7, -1), torch.softmax(draft_logits.detach() / 0.7, -1)
    loss, tv = distill_loss("tv", target_logits, draft_logits, 0.7)
    # SD accepts a proposal with probability sum_t min(p, q) = 1 - TV
    torch.testing.assert_close(tv, 1 - torch.minimum(p, q).sum(-1))
    torch.testing.assert_close(loss.detach(), tv)
    view = small_view()
    # the pcg equal split: token 1 gives half its mass to each of its groups; the stop token its own
    expected = torch.stack([p[:, 0] + p[:, 1] / 2, p[:, 1] / 2 + p[:, 2], p[:, 3], p[:, 4]], -1)
    torch.testing.assert_close(coarse(p, view), expected)
    # the sparse product training reads is the rule's own float64 masses
    torch.testing.assert_close(coarse(p, view), view.all_masses(p).float())
    group_loss, _ = distill_loss("tv+group", target_logits, draft_logits, 0.7, view)
    torch.testing.assert_close(group_loss.detach() - tv, divergences(p, q, view)["group_tv"])
    group_loss.sum().backward()
    assert draft_logits.grad is not None and draft_logits.grad.abs().sum() > 0
    kl, _ = distill_loss("kl", target_logits, target_logits, 0.7)
    assert kl.abs().max() < 1e-6
    kl, _ = distill_loss("kl", target_logits, draft_logits.detach(), 0.7)
    torch.testing.assert_close(kl, (p * (p.log() - q.log())).sum(-1))


def test_prompts_sampled_together_get_what_each_gets_alone(tiny_lms, tmp_path):
    """Greedily (temperature 0: each row's argmax), sampling prompts of mixed lengths three at a time
    (`generate_sequences(batch=3)`: shorter prompts padded on the left, results kept in index order)
    gives every sequence what the runtime's decode loop gives it alone, so a batch's rows see their
    own tokens only, at positions as if unpadded; the target's own cache is usable again afterwards."""
    from pcgtts.runtime.lm.torch_lm import TorchLM
    from pcgtts.runtime.text.prompt import build_prompt
    from pcgtts.train.distill import SequenceCache, generate_sequences

    target = TorchLM.load(tiny_lms["target"], max_length=256)
    sentences = ["One two three.", "Four five six.", "A longer sentence than the others here.", "Seven."]
    prompts = [build_prompt(target.tokenizer, target.vocab, s) for s in sentences]
    assert len({len(p) for p in prompts}) > 2  # batches of three mix lengths
    made = {}
    for batch in (3, 1):  # together first: the decode loop after it runs on the restored cache
        cache = SequenceCache(tmp_path / f"b{batch}.npz", {})
        assert generate_sequences(target, cache, "train", prompts, 6, 0.0, 24, seed=0, batch=batch) == 6
        made[batch] = cache.splits["train"]
    assert [s.sentence for s in made[3]] == [i % 4 for i in range(6)]
    for together, alone in zip(made[3], made[1]):
        assert torch.equal(together.prompt, alone.prompt)
        assert together.generated.tolist() == alone.generated.tolist()
    assert max(len(s.generated) for s in made[1]) > 8  # not a comparison of empty sequences


def test_rows_that_leave_a_batch_leave_the_others_as_they_were(tiny_lms):
    """A batch of left-padded prompts fed the same tokens as each prompt alone gives each row the
    states it gets alone, before and after the KV cache keeps only some rows (`select_cache_rows`,
    the sampler dropping rows that stopped)."""
    from pcgtts.runtime.lm.torch_lm import TorchLM
    from pcgtts.runtime.text.prompt import build_prompt
    from pcgtts.train.distill import left_padded

    lm = TorchLM.load(tiny_lms["target"], max_length=256)
    model, vocab, tokenizer = lm.model, lm.vocab, lm.tokenizer
    prompts = [build_prompt(tokenizer, vocab, s) for s in ("One two.", "A longer sentence than that.", "Three.")]
    fed = torch.randint(0, vocab.num_speech, (3, 6), generator=torch.Generator().manual_seed(0))
    ids = vocab.restricted_to_token_ids(fed.flatten()).view(3, 6)

    def run(rows: list[int], drop_after: int | None = None, keep: list[int] | None = None) -> dict[int, torch.Tensor]:
        batch, filled = left_padded([prompts[r] for r in rows], 6)
        p = batch.shape[1]
        model.setup_cache(p + 6, batch_size=len(rows))
        states = {r: [] for r in rows}
        with torch.no_grad():
            model.hidden(batch, torch.arange(p), end=p, last_only=True, filled=filled)
            for t in range(6):
                if t == drop_after:
                    index = torch.tensor([rows.index(r) for r in keep])
                    model.select_cache_rows(index)
                    rows, filled = keep, filled[index]
                out = model.hidden(ids[rows, t:t + 1], torch.tensor([p + t]), end=p + t + 1, filled=filled)
                for i, r in enumerate(rows):
                    states[r].append(out[i, 0])
        return {r: torch.stack(s) for r, s in states.items()}

    alone = {r: run([r])[r] for r in range(3)}
    together = run([0, 1, 2], drop_after=3, keep=[2, 0])  # row 1 stops; the others change places
    assert len(together[1]) == 3 and len(together[0]) == len(together[2]) == 6
    for r in range(3):
        torch.testing.assert_close(together[r], alone[r][:len(together[r])], atol=2e-5, rtol=1e-4)


def test_the_sampler_drops_the_rows_that_stopped_and_keeps_each_rows_tokens(tiny_lms, monkeypatch):
    """At its 16-step checks the batched sampler drops the rows that have stopped; each prompt's
    tokens stay its own. A scripted draw (per prompt: its index + 1 until its stop step) tracks which
    prompts are still in the batch as the sampler must, and fails on a batch of the wrong size."""
    import pcgtts.runtime.decode.sampling as sampling
    from pcgtts.runtime.lm.torch_lm import TorchLM
    from pcgtts.runtime.text.prompt import build_prompt
    from pcgtts.train.distill import sample_together

    target = TorchLM.load(tiny_lms["target"], max_length=256)
    stop, stops_at = target.vocab.stop_index, {0: 3, 1: 40, 2: 20}  # step of each prompt's stop token
    running, step = [0, 1, 2], [0]

    def scripted(probs, generator):
        t = step[0]
        if t % 16 == 0 and t:  # after a check: the prompts that had stopped are gone
            running[:] = [r for r in running if stops_at[r] >= t]
        assert len(probs) == len(running)
        step[0] += 1
        return torch.tensor([stop if t >= stops_at[r] else r + 1 for r in running])

    monkeypatch.setattr(sampling, "sample", scripted)
    prompts = [build_prompt(target.tokenizer, target.vocab, s) for s in ("One.", "Two three four.", "Five six.")]
    out = sample_together(target, prompts, 1.0, 48, torch.Generator().manual_seed(0))
    for r, codes in enumerate(out):
        assert codes.tolist() == [r + 1] * stops_at[r] + [stop]
    assert step[0] == 48 and running == [1]  # prompt 2 left at the check after step 31


def test_a_time_budget_ends_training_with_the_learning_rate_run_down(tmp_path, monkeypatch):
    """`max_minutes` (a time budget): on a clock that moves 1 s a reading, a 30 s budget stops a
    1,000-step run early, the cosine follows the clock (the last logged lr is near 0, and it falls
    step by step), the checkpoint keeps the seconds spent, and a rerun trains no further."""
    import pcgtts.train.on_policy as on_policy
    from pcgtts.train.on_policy import OnPolicyConfig, fit

    now = iter(range(10**6))
    monkeypatch.setattr(on_policy.time, "monotonic", lambda: float(next(now)))
    cfg = OnPolicyConfig(target=tmp_path, out=tmp_path / "o", work_dir=tmp_path, sentences=("a",), steps=1000,
                         lr=1e-2, log_every=1, max_minutes=0.5)
    module = torch.nn.Linear(2, 1)
    loss = lambda rng: ((module.weight ** 2).sum(), {})  # noqa: E731
    step = fit(module, loss, cfg, "t_", "test", {})
    assert 5 < step < 30
    lrs = [json.loads(line)["lr"] for line in (tmp_path / "t_loss.jsonl").read_text().splitlines()]
    assert len(lrs) == step and lrs[-1] < 0.1 * max(lrs) and lrs[-5:] == sorted(lrs[-5:], reverse=True)
    assert torch.load(tmp_path / "t_checkpoint.pt", weights_only=False)["seconds"] >= 30
    assert fit(module, loss, cfg, "t_", "test", {}) == step  # the budget is spent: resumed, nothing more


def test_a_deadline_ends_training_by_the_wall_clock(tmp_path, monkeypatch):
    """`end_by` (a deadline, sampling counted against it): 30 s before it, on a clock that
    moves 1 s a reading, a 1,000-step run stops early with its lr run down; past it, no step is taken."""
    import pcgtts.train.on_policy as on_policy
    from pcgtts.train.on_policy import OnPolicyConfig, fit

    now = iter(range(10**6))
    monkeypatch.setattr(on_policy.time, "monotonic", lambda: float(next(now)))
    monkeypatch.setattr(on_policy.time, "time", lambda: 5000.0)
    module = torch.nn.Linear(2, 1)
    loss = lambda rng: ((module.weight ** 2).sum(), {})  # noqa: E731
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    cfg = OnPolicyConfig(target=tmp_path, out=tmp_path / "o", work_dir=tmp_path / "a", sentences=("a",), steps=1000,
                         lr=1e-2, log_every=1, end_by=5030.0)
    step = fit(module, loss, cfg, "t_", "test", {})
    assert 5 < step < 30
    lrs = [json.loads(line)["lr"] for line in (tmp_path / "a" / "t_loss.jsonl").read_text().splitlines()]
    assert lrs[-1] < 0.1 * max(lrs) and lrs[-5:] == sorted(lrs[-5:], reverse=True)
    late = OnPolicyConfig(target=tmp_path, out=tmp_path / "o", work_dir=tmp_path / "b", sentences=("a",), steps=1000,
                          end_by=4000.0)
    assert fit(module, loss, late, "t_", "test", {}) == 0
