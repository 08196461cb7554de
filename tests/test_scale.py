"""`pcgtts models scale`: a trained voice computed at a larger LLaSA shape's cost with its logits
unchanged. Checked on the tiny pair (hidden 64, head_dim 16) scaled to shapes with the same and with
twice the head size: transformers' own LlamaForCausalLM and the runtime give the source's logits
(float32, to 1e-4 of the logit scale), an EAGLE draft proposes the same, the head becomes dense,
the subset draft is the scaled target's layers where the voice's draft's stand, bad shapes are
one-line errors before any work, and a failed run leaves nothing behind. The built-in voice itself
(`shipped_voice`) is scaled by the command to hidden 512 with head_dim 64 and 128."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from pcgtts.cli import main
from pcgtts.tools import scale
from pcgtts.tools.scale import Scaler, Shape, scale_voice

SAME_HEAD = Shape(hidden=128, layers=6, heads=8, kv_heads=2, head_dim=16, ffn=256)
DOUBLE_HEAD = Shape(hidden=256, layers=5, heads=8, kv_heads=2, head_dim=32, ffn=384)


@pytest.fixture(scope="module")
def voice(tmp_path_factory, tiny_models, tiny_groups_file):
    """The tiny pair as an expanded voice folder, with an attention-free EAGLE draft reading layers 0 and 2."""
    from pcgtts.runtime.lm.eagle import EAGLE_FILE, EagleDraft
    from pcgtts.runtime.lm.torch_lm import TorchLM

    folder = tmp_path_factory.mktemp("voice")
    for name in ("target", "draft", "codec"):
        shutil.copytree(tiny_models[name], folder / name)
    shutil.copy(tiny_groups_file, folder / "groups.pcg")
    target = TorchLM.load(folder / "target")
    torch.manual_seed(0)
    draft = EagleDraft(target.model.args, target.fingerprint, 96, "mlp", (0, 2))
    with torch.no_grad():
        for norm in (draft.norm, draft.block.post_attention_layernorm):
            norm.weight.uniform_(0.5, 1.5)
    draft.save(folder / "target" / EAGLE_FILE, dtype=torch.float32)
    return folder


@pytest.fixture(scope="module", params=[SAME_HEAD, DOUBLE_HEAD], ids=["head_dim-16", "head_dim-32"])
def scaled(request, voice, tmp_path_factory):
    return scale_voice(str(voice), request.param, tmp_path_factory.mktemp("scaled") / "out", seed=1)


def hf_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids[None]).logits[0]


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return float((a - b).abs().max()) <= 1e-4 * float(a.std()) * 10 + 1e-5


def prompt_ids(folder: Path) -> torch.Tensor:
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    return torch.randint(0, vocab, (24,), generator=torch.Generator().manual_seed(3))


def test_the_scaled_targets_logits_equal_the_voices_in_transformers(voice, scaled):
    ids = prompt_ids(voice / "target")
    source, big = hf_logits(voice / "target", ids), hf_logits(scaled / "target", ids)
    assert close(source, big), float((source - big).abs().max())
    config = json.loads((scaled / "target" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False


def test_the_scaled_targets_logits_equal_the_voices_in_the_runtime(voice, scaled):
    from pcgtts.runtime.lm.torch_lm import TorchLM

    ids = prompt_ids(voice / "target")
    source, big = (TorchLM.load(f / "target").forward_hidden(ids)[0] for f in (voice, scaled))
    assert close(source, big)


def test_the_scaled_head_is_dense_not_digit_sums(scaled):
    from pcgtts.runtime.lm.torch_lm import TorchLM

    assert TorchLM.load(scaled / "target").model.digits == 0


def test_the_scaled_eagle_draft_proposes_what_the_voices_does(voice, scaled):
    from pcgtts.runtime.lm.eagle import EAGLE_FILE, EagleDraft
    from pcgtts.runtime.lm.torch_lm import TorchLM

    pair = []
    for folder in (voice, scaled):
        target = TorchLM.load(folder / "target")
        pair.append((target.model, EagleDraft.load(folder / "target" / EAGLE_FILE, target.model, target.fingerprint)))
    (small, small_draft), (big, big_draft) = pair
    meta = json.loads((scaled / "SCALED.json").read_text())
    assert big_draft.feature_layers == tuple(meta["source_layers_at"][i] for i in (0, 2))
    d, wide = small.args.hidden_size, big.args.hidden_size
    q = scale.spread(d, wide, torch.float32) * math.sqrt(wide / d)  # a normed state's factor
    gen = torch.Generator().manual_seed(5)
    states = torch.randn(6, 3 * d, generator=gen)
    tokens = torch.randint(0, small.embed_tokens.weight.shape[0], (6,), generator=gen)
    big_states = torch.cat([states[:, i * d:(i + 1) * d] @ q.T for i in range(3)], 1)
    with torch.no_grad():
        f = small_draft.train_features(states[None], small.embed_tokens.weight[tokens][None])[0]
        big_f = big_draft.train_features(big_states[None], big.embed_tokens.weight[tokens][None])[0]
        assert close(small.logits(f), big.logits(big_f))


def test_groups_carry_over_with_the_new_fingerprint(voice, scaled):
    from pcgtts.groups.table import GroupTable
    from pcgtts.runtime.lm.torch_lm import TorchLM

    table = GroupTable.load(scaled / "groups.pcg", expect_fingerprint=TorchLM.load(scaled / "target").fingerprint)
    source = GroupTable.load(voice / "groups.pcg")
    assert table.num_groups == source.num_groups and table.num_tokens == source.num_tokens


def test_the_subset_draft_is_the_scaled_targets_layers_where_the_voices_draft_layers_stand(voice, scaled, tmp_path):
    from pcgtts.train.subset_draft import make_layer_subset_draft

    began = json.loads((voice / "draft" / "config.json").read_text())["pcgtts_draft"]["layers"]
    at = json.loads((scaled / "SCALED.json").read_text())["source_layers_at"]
    config = json.loads((scaled / "draft-subset" / "config.json").read_text())
    assert config["pcgtts_draft"]["layers"] == [at[i] for i in began]
    assert config["hidden_size"] == json.loads((scaled / "target" / "config.json").read_text())["hidden_size"]
    voice_subset = make_layer_subset_draft(voice / "target", tmp_path / "subset", began)
    ids = prompt_ids(voice / "target")
    assert close(hf_logits(voice_subset, ids), hf_logits(scaled / "draft-subset", ids))


def test_the_voices_own_draft_is_carried_unchanged(voice, scaled):
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (voice / "draft" / name).read_bytes() == (scaled / "draft" / name).read_bytes()


def test_bench_lm_on_a_scaled_folder_says_what_the_models_are(scaled, monkeypatch, capsys):
    import runpy

    bench = runpy.run_path(str(Path(__file__).parents[1] / "benchmarks" / "bench_lm.py"), run_name="bench_lm")
    monkeypatch.setattr("sys.argv", ["bench_lm.py", "--target", str(scaled / "target"), "--draft", str(scaled / "draft"),
                                     "--groups", str(scaled / "groups.pcg"), "--policies", "ar", "--no-hf",
                                     "--tokens", "4", "--runs", "1"])
    assert bench["main"]() == 0
    out = capsys.readouterr().out
    assert f"out: {scale.STANDIN_NOTICE}" in out
    assert json.loads(out.strip().splitlines()[-1])["note"] == scale.STANDIN_NOTICE


@pytest.mark.slow  # expands the shipped voice on a fresh machine (about a minute)
@pytest.mark.shipped_voice
@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_builtin_voice_scaled_by_the_command_keeps_its_logits(tmp_path, capsys, head_dim):
    from pcgtts.builtin import trained_voice

    flags = ["--hidden", "512", "--layers", "8", "--heads", "8", "--kv-heads", "2", "--head-dim", str(head_dim),
             "--ffn", "2048"]
    out = tmp_path / "scaled"
    assert main(["models", "scale", "--shape", "custom", *flags, "--out", str(out)]) == 0
    assert "stand-in for released weights" in capsys.readouterr().out
    source = Path(trained_voice().target)
    ids = prompt_ids(source)
    assert close(hf_logits(source, ids), hf_logits(out / "target", ids))


@pytest.mark.parametrize("flags, message", [
    (["--shape", "llasa-2b"], "unknown shape 'llasa-2b'"),
    (["--shape", "custom", "--hidden", "128"], "--shape custom needs --layers"),
    (["--shape", "llasa-1b", "--hidden", "128"], "--hidden goes with --shape custom only"),
    (["--shape", "custom", "--hidden", "96", "--layers", "6", "--heads", "8", "--kv-heads", "2", "--head-dim", "16",
      "--ffn", "256"], "hidden 96 is not a multiple of the voice's 64"),
    (["--shape", "custom", "--hidden", "128", "--layers", "2", "--heads", "8", "--kv-heads", "2", "--head-dim", "16",
      "--ffn", "256"], "layers (2) is smaller than the voice's (4)"),
    (["--shape", "custom", "--hidden", "128", "--layers", "6", "--heads", "6", "--kv-heads", "4", "--head-dim", "16",
      "--ffn", "256"], "6 heads do not divide into 4 KV heads"),
    (["--shape", "custom", "--hidden", "128", "--layers", "6", "--heads", "6", "--kv-heads", "2", "--head-dim", "16",
      "--ffn", "256"], "hidden 128 is not a multiple of the 6 heads"),
    (["--shape", "custom", "--hidden", "128", "--layers", "6", "--heads", "6", "--kv-heads", "2", "--ffn", "256"],
     "hidden 128 is not a multiple of the 6 heads"),
])
def test_bad_shapes_are_one_line_errors_before_any_work(voice, tmp_path, capsys, flags, message):
    out = tmp_path / "out"
    assert main(["models", "scale", "--from", str(voice), *flags, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == []


def test_an_existing_out_is_refused_and_a_failed_run_leaves_nothing(voice, tmp_path, capsys, monkeypatch):
    existing = tmp_path / "existing"
    existing.mkdir()
    assert main(["models", "scale", "--from", str(voice), "--shape", "llasa-1b", "--out", str(existing)]) == 2
    assert "exists" in capsys.readouterr().err

    def fail(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(scale, "write_eagle", fail)
    with pytest.raises(RuntimeError, match="disk full"):
        scale_voice(str(voice), SAME_HEAD, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing"]


def test_scaler_maps_keep_a_normed_state_exact():
    source, shape = Shape(64, 2, 4, 2, 16, 128), SAME_HEAD
    scaler = Scaler(source, shape, torch.Generator().manual_seed(0))
    x = torch.randn(64, dtype=torch.float64)
    w = torch.randn(10, 64, dtype=torch.float64)
    normed = x / x.pow(2).mean().sqrt()
    big = scale.spread(64, shape.hidden) @ x  # Q x: the stream as the scaled model carries it
    big_normed = big / (big.pow(2).mean()).sqrt()
    assert torch.allclose(scaler.reader(w) @ big_normed, w @ normed)
    assert torch.allclose(scaler.head(w) @ big_normed, w @ normed)


def test_an_int8_target_with_a_dense_head_runs_the_eagle_policies(scaled):
    from pcgtts import Synthesizer

    synth = Synthesizer.from_pretrained(scaled / "target", codec=scaled / "codec", groups=scaled / "groups.pcg",
                                        policy="eagle-pcg", quantize="int8", seed=0, adaptive_draft=False,
                                        max_new_tokens=40)
    audio = synth.synthesize("Hello there.")
    assert len(audio) > 0


def test_a_custom_shapes_head_dim_defaults_to_hidden_over_heads():
    sizes = dict(hidden=512, layers=8, heads=8, kv_heads=2, ffn=2048)
    assert scale.shape_from_flags("custom", {**sizes, "head_dim": None}) == Shape(**sizes, head_dim=64)
    assert scale.shape_from_flags("custom", {**sizes, "head_dim": 128}) == Shape(**sizes, head_dim=128)


def test_a_missing_out_parent_is_refused_not_made(voice, tmp_path, capsys):
    out = tmp_path / "no" / "such" / "out"
    assert main(["models", "scale", "--from", str(voice), "--shape", "custom", *SIZE_FLAGS, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "does not exist" in err and len(err.splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == []


SIZE_FLAGS = ["--hidden", "128", "--layers", "6", "--heads", "8", "--kv-heads", "2", "--head-dim", "16", "--ffn", "256"]


@pytest.fixture
def voice_unread(monkeypatch):
    """Reading the voice (the first step of real work) fails the test: a refusal must come before it."""
    def read(source):
        raise AssertionError("the voice was read before the size was checked")

    monkeypatch.setattr(scale, "source_folders", read)


@pytest.mark.parametrize("dtype, memory_gb, ways", [
    ("float32", 24, "use a smaller shape (--shape llasa-3b: about 18 GB)"),
    ("float32", 30, "use --dtype bfloat16 (about 22 GB) or a smaller shape (--shape llasa-3b: about 18 GB)"),
    ("bfloat16", 24, "use a smaller shape (--shape llasa-3b: about 12 GB)"),
    ("float32", 11, "use a smaller shape (--shape llasa-1b: about 8.6 GB)"),
    ("float32", 8, "use a smaller shape (--shape llasa-1b --dtype bfloat16: about 6.3 GB)"),
    ("float32", 2, "use a smaller shape or a machine with more memory"),
])
def test_a_shape_too_large_for_the_memory_is_refused_before_any_work(voice, tmp_path, capsys, monkeypatch, voice_unread,
                                                                     dtype, memory_gb, ways):
    monkeypatch.setattr(scale, "available_memory", lambda: memory_gb * scale.GiB)
    out = tmp_path / "out"
    flags = ["--from", str(voice), "--shape", "llasa-8b", "--dtype", dtype, "--out", str(out)]
    assert main(["models", "scale", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"--shape llasa-8b in {dtype} needs about" in err and f"GB is available: {ways}" in err, err
    assert list(tmp_path.iterdir()) == []


def test_an_absurd_custom_shape_is_refused_on_this_machine(voice, tmp_path, capsys, voice_unread):
    flags = ["--hidden", "1048576", "--layers", "100000", "--heads", "8", "--kv-heads", "2", "--ffn", "4194304"]
    out = tmp_path / "out"
    assert main(["models", "scale", "--from", str(voice), "--shape", "custom", *flags, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "the custom shape (hidden 1048576" in err and "of memory" in err and len(err.splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == []


def test_an_output_too_large_for_the_disk_is_refused(voice, tmp_path, capsys, monkeypatch, voice_unread):
    monkeypatch.setattr(scale, "available_memory", lambda: 1000 * scale.GiB)
    monkeypatch.setattr(scale, "free_disk", lambda folder: scale.GiB)
    assert main(["models", "scale", "--from", str(voice), "--shape", "llasa-1b", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--shape llasa-1b in float32 writes about" in err and "1.0 GB free" in err and len(err.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_the_estimate_is_the_written_targets_size(voice, scaled):
    config = json.loads((scaled / "target" / "config.json").read_text())
    shape = scale.source_shape(config)
    written = (scaled / "target" / "model.safetensors").stat().st_size
    need = scale.estimate(shape, "float32", vocab=config["vocab_size"])
    assert need.weights <= written < need.weights + 64 * 1024  # the weights, and a small header
    assert need.memory > need.weights and need.disk > need.weights
    assert scale.estimate(shape, "bfloat16", vocab=config["vocab_size"]).weights * 2 == need.weights
    big = scale.estimate(scale.SHAPES["llasa-8b"], "float32")  # LLaMA-3.1 8B's body: about 7e9 weights
    assert 7.0e9 * 4 < big.weights < 7.6e9 * 4


def test_available_memory_without_psutil_reads_meminfo(monkeypatch):
    import sys

    meminfo = Path("/proc/meminfo")
    if not meminfo.is_file():
        pytest.skip("no /proc/meminfo here")
    monkeypatch.setitem(sys.modules, "psutil", None)  # import psutil raises ImportError
    got = scale.available_memory()
    listed = next(int(line.split()[1]) * 1024 for line in meminfo.read_text().splitlines()
                  if line.startswith("MemAvailable:"))
    assert abs(got - listed) < 512 * 2**20
