"""ONNX export and the onnxruntime backend against the torch backend (CPU execution provider);
TensorRT tests run only where TensorRT and a GPU exist and are skipped with the reason otherwise.

Tests on an exported pair run on the full demo pair, in `-m slow` (see DEMO_ONLY below)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pcgtts.runtime.config import DecodeConfig, SamplingConfig
from pcgtts.runtime.decode.loop import decode
from pcgtts.runtime.decode.steps import DecodeStats


# (layers, speech tokens) of each size's target: the demo's is the released vocabulary layout.
LAYOUT = {"tiny": (4, 1024), "demo": (12, 65536)}
# An ONNX export takes 30-90 s here even at tiny size (torch.export + the numeric check), so every
# test that exports is `slow`: the tests on an exported pair run on the demo pair, the CLI export
# on a tiny LM, and the codec decoder export; the default suite keeps the TensorRT-free checks.
DEMO_ONLY = pytest.mark.parametrize("model_size", [pytest.param("demo", id="demo", marks=pytest.mark.slow)],
                                    indirect=True)


@pytest.fixture(scope="module")
def exported_pair(lms, tmp_path_factory):
    """The target and draft exported to ONNX (each export runs its own numeric check)."""
    from pcgtts.export.onnx_lm import export_lm

    out = tmp_path_factory.mktemp("onnx")
    metas = {name: export_lm(lms[name], out / name, max_length=512) for name in ("target", "draft")}
    return out, metas


@pytest.fixture(scope="module")
def exported_codec(demo_codec_dir, tmp_path_factory):
    from pcgtts.export.codec_graph import export_codec

    out = tmp_path_factory.mktemp("onnx_codec") / "codec"
    return out, export_codec(demo_codec_dir, out)


@DEMO_ONLY
def test_export_checks_itself_and_writes_metadata(exported_pair, lms, model_size):
    out, metas = exported_pair
    meta, check = metas["target"]
    assert check.ok and check.max_abs_diff < 2e-3
    record = json.loads((out / "target" / "pcgtts-lm.json").read_text())
    assert (record["num_layers"], record["vocab"]["num_speech"]) == LAYOUT[model_size]
    assert record["extra"]["check"]["ok"] is True
    from pcgtts.runtime.lm.torch_lm import TorchLM

    assert record["fingerprint"] == TorchLM.load(lms["target"], max_length=8).fingerprint


@DEMO_ONLY
def test_onnx_logits_match_torch_after_rollback(exported_pair, lms, monkeypatch):
    """Prefill, 1-token and 4-token steps, a rollback, then a 4-token step over the stale slots; the
    onnxruntime cache starts at 4 slots here, so it grows (copying what it holds) along the way."""
    import pcgtts.runtime.lm.buffered as buffered
    from pcgtts.runtime.lm.onnxruntime import OrtLM
    from pcgtts.runtime.lm.torch_lm import TorchLM

    monkeypatch.setattr(buffered, "INITIAL_CAPACITY", 4)
    out, _ = exported_pair
    ref = TorchLM.load(lms["target"], max_length=128)
    ort = OrtLM.load(out / "target", max_length=128, tokenizer=ref.tokenizer)
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, ref.vocab.vocab_size, (20,), generator=gen)
    speech = lambda n: torch.randint(0, ref.vocab.num_speech, (n,), generator=gen) + ref.vocab.speech_offset  # noqa: E731
    torch.testing.assert_close(ort.prefill(prompt), ref.prefill(prompt), atol=2e-3, rtol=1e-4)
    for n in (1, 4, 1):
        ids = speech(n)
        torch.testing.assert_close(ort.forward(ids), ref.forward(ids), atol=2e-3, rtol=1e-4)
    ort.rollback(22)
    ref.rollback(22)
    ids = speech(4)
    torch.testing.assert_close(ort.forward(ids), ref.forward(ids), atol=2e-3, rtol=1e-4)
    assert ort.length == ref.length == 26
    assert ort.cache[0].shape[2] == 32  # 4 -> 32 at the 20-token prefill, not the 128 of max_length


def reuse_pair(exported_pair, monkeypatch, max_length: int, seed: int):
    """An onnxruntime target that reuses prefixes and one that never does, both with 4-slot initial
    buffers, and a 40-token prompt head without the template's anchor (blocks of 32 from 0)."""
    import pcgtts.runtime.lm.buffered as buffered
    from pcgtts.runtime.lm.onnxruntime import OrtLM

    monkeypatch.setattr(buffered, "INITIAL_CAPACITY", 4)
    out, _ = exported_pair
    ort = OrtLM.load(out / "target", max_length=max_length)
    fresh = OrtLM.load(out / "target", max_length=max_length, tokenizer=ort.tokenizer)
    fresh.reuse_prefix = False
    gen = torch.Generator().manual_seed(seed)
    head = torch.randint(0, ort.vocab.speech_offset, (40,), generator=gen)
    head[head == ort.vocab.text_start_id] = 0
    return ort, fresh, head, gen


@DEMO_ONLY
def test_onnxruntime_prefill_reuses_the_shared_prefix(exported_pair, lms, monkeypatch):
    """The exported step graph keeps the slots of a prompt's shared head (`protocol.py`): the next
    prompt's logits equal a fresh prefill's bit for bit, across a cache that grows during the
    second prefill."""
    ort, fresh, head, gen = reuse_pair(exported_pair, monkeypatch, 128, 4)
    a = torch.cat([head, torch.tensor([1, 2, 3])])
    b = torch.cat([head, torch.randint(4, ort.vocab.speech_offset, (40,), generator=gen)])
    ort.prefill(a)
    ort.forward(torch.arange(3) + ort.vocab.speech_offset)
    assert ort.reusable_prefix(b) == 32  # whole blocks (`protocol.PREFILL_BLOCK`)
    assert torch.equal(ort.prefill(b), fresh.prefill(b))  # bit for bit
    assert ort.length == len(b) and ort.cache[0].shape[2] == 128  # grown from 64 during the second prefill


def test_a_new_prompt_shrinks_a_grown_onnxruntime_buffer(exported_pair, monkeypatch):
    """A long sequence grows the buffer; the next prompt's prefill puts it back to the size a fresh
    prefill has (the graph attends over the whole buffer: a grown one slowed the built-in voice's
    next utterance ~2x), keeping the reused prefix: its logits equal a fresh prefill's bit for bit."""
    ort, fresh, prompt, gen = reuse_pair(exported_pair, monkeypatch, 256, 5)
    ort.prefill(prompt)
    ort.forward(torch.randint(0, ort.vocab.num_speech, (150,), generator=gen) + ort.vocab.speech_offset)
    assert ort.cache[0].shape[2] == 256
    assert ort.reusable_prefix(prompt) == 32
    assert torch.equal(ort.prefill(prompt), fresh.prefill(prompt))
    assert ort.cache[0].shape[2] == fresh.cache[0].shape[2] == 64 and ort.length == 40


def test_exported_norms_fuse_in_onnxruntime_and_match_torch(tmp_path):
    """export_graph traces RMSNorm as a division, the form onnxruntime fuses into one
    SimplifiedLayerNormalization node (x * rsqrt is left as five nodes); the graph gives torch's
    output, and the module is left as it was (Hugging Face's rsqrt form)."""
    import onnxruntime as ort
    import onnx

    from pcgtts.export.onnx_common import export_graph
    from pcgtts.runtime.lm.llama import RMSNorm

    norm = RMSNorm(16, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16, generator=torch.Generator().manual_seed(0)))
    x = torch.randn(1, 3, 16, generator=torch.Generator().manual_seed(1))
    path = export_graph(norm, (x,), tmp_path / "norm.onnx", ["x"], ["y"], ({1: torch.export.Dim("t")},))
    assert not norm.traced_as_division
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    ops = {node.op_type for node in onnx.load(str(tmp_path / "optimized.onnx")).graph.node}
    assert "SimplifiedLayerNormalization" in ops and "ReduceMean" not in ops and "Reciprocal" not in ops
    longer = torch.randn(1, 5, 16, generator=torch.Generator().manual_seed(2))
    np.testing.assert_allclose(session.run(None, {"x": longer.numpy()})[0], norm(longer).detach().numpy(),
                               rtol=1e-5, atol=1e-6)


def test_the_graphs_rope_is_the_models_bit_for_bit():
    """The step graph rotates queries and keys together, the half-swap as a product with a ±1 matrix:
    the same numbers as `llama.apply_rope` on each, to the bit (every output column has one nonzero
    term, and adding zeros is exact)."""
    from pcgtts.export.lm_graph import project, rotate_half_matrix
    from pcgtts.runtime.lm.llama import Attention, LlamaArgs, rope_cos_sin, rope_inv_freq

    args = LlamaArgs(vocab_size=10, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
                     num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                     tie_word_embeddings=False)
    torch.manual_seed(0)
    attn = Attention(args)
    x = torch.randn(1, 5, 64) * 3
    cos, sin = rope_cos_sin(rope_inv_freq(args), torch.arange(100, 105), torch.float32)
    rotation = rotate_half_matrix(args.head_dim, torch.float32)
    for got, expected in zip(project(attn, x, cos, sin, rotation), attn.project(x, cos, sin)):
        assert got.shape == expected.shape and torch.equal(got, expected)


def test_grow_cache_doubles_up_to_max_length_and_keeps_the_prefix():
    from pcgtts.runtime.lm.buffered import grow_cache

    cache = [torch.arange(2 * 4 * 3, dtype=torch.float32).view(1, 2, 4, 3) for _ in range(2)]
    assert grow_cache(cache, 4, 4, 100) is cache  # fits: untouched
    grown = grow_cache(cache, 3, 9, 100)
    assert [g.shape[2] for g in grown] == [16, 16]
    assert torch.equal(grown[0][:, :, :3], cache[0][:, :, :3]) and not grown[0][:, :, 3:].any()
    assert grow_cache(cache, 4, 70, 100)[0].shape[2] == 100  # capped at max_length


def _run(target, draft, groups, policy, temperature, seed):
    config = DecodeConfig(policy=policy, draft_length=3, max_new_tokens=40, adaptive_draft=False,  # per-backend
                          sampling=SamplingConfig(temperature=temperature))  # timings would choose other lengths
    prompt = torch.tensor([5, 9, 17, 33, 2, 7])
    gen = torch.Generator().manual_seed(seed)
    stats = DecodeStats()
    tokens = [t for burst in decode(target, draft, prompt, config, gen, groups=groups, stats=stats) for t in burst]
    return tokens, stats


@DEMO_ONLY
def test_onnxruntime_backend_equals_torch_greedy_and_seeded(exported_pair, lms, groups_file):
    """Greedy: identical tokens for every rule. Sampled: both backends give the same probability
    rows along the torch run's own tokens (teacher-forced, both models), and the onnxruntime run
    completes. Sampled token streams are not compared for equality: the backends' float32 rows
    differ by ~1e-6 per entry, so their 65,537-entry CDFs differ by up to ~1e-4 and a draw lands
    between them with probability ~1e-4 (a 40-token pcg run makes ~700 draws): with a fixed seed
    the streams can part at any draw, as one seed did here."""
    from pcgtts.groups.table import GroupTable
    from pcgtts.runtime.decode.sampling import logits_to_probs
    from pcgtts.runtime.lm.onnxruntime import OrtLM
    from pcgtts.runtime.lm.torch_lm import TorchLM

    out, _ = exported_pair
    torch_pair = [TorchLM.load(lms[n], max_length=256) for n in ("target", "draft")]
    ort_pair = [OrtLM.load(out / n, max_length=256, tokenizer=torch_pair[0].tokenizer) for n in ("target", "draft")]
    groups = GroupTable.load(groups_file).to_device("cpu")
    for policy in ("ar", "sd", "pcg"):
        a, _ = _run(*torch_pair, groups, policy, 0.0, 0)
        b, _ = _run(*ort_pair, groups, policy, 0.0, 0)
        assert a == b, policy
    a, _ = _run(*torch_pair, groups, "pcg", 1.0, 7)
    b, sb = _run(*ort_pair, groups, "pcg", 1.0, 7)
    assert len(a) == len(b) == 40 and sb.drafted > 0
    sequence = torch.cat([torch.tensor([5, 9, 17, 33, 2, 7]), torch_pair[0].vocab.restricted_to_token_ids(torch.tensor(a))])
    sampling = SamplingConfig(temperature=1.0)
    for mine, theirs in zip(torch_pair, ort_pair):
        for lm in (mine, theirs):
            lm.rollback(0)
        expected, got = (logits_to_probs(lm.forward(sequence), sampling) for lm in (mine, theirs))  # [46, V]
        assert expected.shape == (len(sequence), mine.vocab.num_speech + 1)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-3)


@pytest.mark.slow
def test_codec_decoder_onnx_matches_torch(demo_codec_dir, exported_codec):
    from pcgtts.runtime.audio.onnx_codec import OrtCodec
    from pcgtts.runtime.audio.codec import Codec

    path, meta = exported_codec
    assert meta["check"]["ok"]
    ref, ort = Codec.from_pretrained(demo_codec_dir), OrtCodec(path)
    codes = np.random.default_rng(1).integers(0, 65536, 33)  # a streaming window's size
    np.testing.assert_allclose(ort.decode(codes), ref.decode(codes), atol=1e-4)
    assert ort.decode(codes[:1]).shape == (320,)
    windows = np.stack([codes, codes[::-1]])  # the graph's batch axis is 1: decode_batch goes window by window
    assert np.array_equal(ort.decode_batch(windows), np.stack([ort.decode(codes), ort.decode(codes[::-1])]))


@DEMO_ONLY
def test_bad_inputs_give_clear_errors(exported_pair, tmp_path, lms):
    from pcgtts.export.onnx_lm import export_lm
    from pcgtts.runtime.lm.onnxruntime import OrtLM

    with pytest.raises(ValueError, match="no config.json|not a LLaMA|no tokenizer"):
        export_lm(tmp_path, tmp_path / "x")
    with pytest.raises(ValueError, match="not an exported pcgtts model"):
        OrtLM.load(lms["target"])
    out, _ = exported_pair
    # A graph beside another model's tokenizer: the vocabulary check names the mismatch.
    from pcgtts.tools.demo import build_demo_tokenizer

    with pytest.raises(ValueError, match="exported for vocabulary"):
        OrtLM.load(out / "target", tokenizer=build_demo_tokenizer(num_speech=512))
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    for f in (out / "target").iterdir():
        (corrupt / f.name).write_bytes(f.read_bytes()[:100] if f.name == "model.onnx" else f.read_bytes())
    with pytest.raises(ValueError, match="cannot load this graph"):
        OrtLM.load(corrupt)


def test_tensorrt_missing_is_explained_and_profiles_cover_every_step():
    from pcgtts.runtime.lm.tensorrt import PROFILES, choose_profile

    assert PROFILES[choose_profile(1, 1, 5)] == "draft"
    assert PROFILES[choose_profile(4, 4, 5)] == "step"
    assert PROFILES[choose_profile(2, 2, 5)] == "step"
    assert PROFILES[choose_profile(300, 1, 5)] == "prefill"
    with pytest.raises(ValueError, match="no TensorRT profile"):
        choose_profile(9, 9, 5)
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        from pcgtts.runtime.lm.tensorrt import import_tensorrt

        with pytest.raises(RuntimeError, match="NVIDIA"):
            import_tensorrt()


def _has_tensorrt() -> bool:
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@DEMO_ONLY
@pytest.mark.requires_tensorrt
@pytest.mark.skipif(not _has_tensorrt(), reason="needs TensorRT and an NVIDIA GPU")
def test_tensorrt_engine_matches_onnx_and_greedy_tokens(exported_pair, tmp_path):
    from pcgtts.export.tensorrt import build_engine, check_engine_against_onnx
    from pcgtts.runtime.lm.onnxruntime import OrtLM
    from pcgtts.runtime.lm.tensorrt import TrtLM

    out, _ = exported_pair
    for name in ("target", "draft"):
        build_engine(out / name, tmp_path / name, precision="fp32", max_length=256)
    assert check_engine_against_onnx(out / "target", tmp_path / "target", tolerance=1e-2) < 1e-2
    trt_pair = [TrtLM.load(tmp_path / n) for n in ("target", "draft")]
    ort_pair = [OrtLM.load(out / n, max_length=256) for n in ("target", "draft")]
    a, _ = _run(*ort_pair, None, "sd", 0.0, 0)
    b, _ = _run(*trt_pair, None, "sd", 0.0, 0)
    assert a == b


@pytest.mark.slow
def test_export_cli_prints_the_check(tiny_lm_factory, tmp_path, capsys):
    from pcgtts.cli import main

    model = tiny_lm_factory(tie_word_embeddings=False)
    assert main(["export", "onnx", "--model", str(model), "--out", str(tmp_path / "o")]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["check"]["ok"] and record["check"]["max_abs_diff"] < 2e-3
    assert main(["export", "onnx", "--model", str(tmp_path), "--out", str(tmp_path / "p")]) == 2
    assert "error" in capsys.readouterr().err


@DEMO_ONLY
def test_every_backend_satisfies_the_protocols(exported_pair, exported_codec):
    """OrtLM and OrtCodec are checked on live objects; TrtLM (no GPU here) on its class."""
    from pcgtts.runtime.audio.codec import SpeechCodec
    from pcgtts.runtime.audio.onnx_codec import OrtCodec
    from pcgtts.runtime.lm.onnxruntime import OrtLM
    from pcgtts.runtime.lm.protocol import LM
    from pcgtts.runtime.lm.tensorrt import TrtLM

    out, _ = exported_pair
    assert isinstance(OrtLM.load(out / "target", max_length=64), LM)
    path, _ = exported_codec
    codec = OrtCodec(path)
    assert isinstance(codec, SpeechCodec) and codec.source_dir == path and not codec.can_encode
    with pytest.raises(ValueError, match="cannot encode"):
        codec.encode(np.zeros(320, np.float32))
    methods = [name for name in dir(LM) if not name.startswith("_") and callable(getattr(LM, name))]
    assert {"prefill", "forward", "rollback", "ensure_cache", "release"} <= set(methods)
    assert all(callable(getattr(TrtLM, name, None)) for name in methods)


@DEMO_ONLY
def test_int8_export_is_weight_only_and_stays_close_to_torch(exported_pair, lms, tmp_path):
    """`export onnx --quantize int8` (`quantize_int8` on a copy of the checked export): only the int8
    graph is left, well under the float graph's size, the metadata records it and its logit
    difference, and every next-token distribution stays within total variation 0.05 of PyTorch's
    (weight-only int8 measured 0.011-0.017 here; onnxruntime's dynamic quantization, which also
    rounds activations, measured 0.07-0.34 and would fail). Quantizing twice is refused."""
    import shutil

    from pcgtts.export.onnx_lm import INT8_GRAPH_FILE, quantize_int8
    from pcgtts.runtime.lm.onnxruntime import OrtLM
    from pcgtts.runtime.lm.torch_lm import TorchLM

    out, _ = exported_pair
    folder = tmp_path / "int8"
    shutil.copytree(out / "target", folder)
    float_bytes = sum(f.stat().st_size for f in folder.glob("model.onnx*"))
    meta = quantize_int8(folder, lms["target"])
    assert meta.graph == INT8_GRAPH_FILE and not list(folder.glob("model.onnx*"))
    assert (folder / INT8_GRAPH_FILE).stat().st_size < 0.6 * float_bytes
    record = json.loads((folder / "pcgtts-lm.json").read_text())
    assert record["extra"]["quantize"] == "int8" and record["extra"]["int8"]["max_abs_diff"] > 0

    reference = TorchLM.load(lms["target"], max_length=64)
    quantized = OrtLM.load(folder, max_length=64, tokenizer=reference.tokenizer)
    gen = torch.Generator().manual_seed(0)
    vocab = reference.vocab
    prompt = torch.randint(0, vocab.vocab_size, (11,), generator=gen)
    pairs = [(reference.prefill(prompt), quantized.prefill(prompt))]
    for n in (1, 4, 1, 4):
        ids = torch.randint(0, vocab.num_speech, (n,), generator=gen) + vocab.speech_offset
        pairs.append((reference.forward(ids), quantized.forward(ids)))
    tv = max((0.5 * (torch.softmax(a.float(), -1) - torch.softmax(b.float(), -1)).abs().sum(-1)).max().item()
             for a, b in pairs)
    assert tv < 0.05, tv
    with pytest.raises(ValueError, match="only a float32, unquantized graph"):
        quantize_int8(folder)


def test_int8_export_refuses_a_float16_graph_before_any_work(tmp_path, capsys):
    from pcgtts.cli import main

    assert main(["export", "onnx", "--model", str(tmp_path), "--out", str(tmp_path / "o"),
                 "--quantize", "int8", "--dtype", "float16"]) == 2
    assert "leave --dtype at float32" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
