"""Shared fixtures: checkpoints in the exact released formats, made once per session.

Two sizes of the same thing:
- tiny (the default suite): a 1,024-speech-token pair, hidden 64, 4 layers, its 2-layer draft,
  group table and the tiny codec; every stage of the real pipeline runs on it in seconds.
- the built-in demo (65,536 speech tokens, 12 layers; `slow` tests only): the released vocabulary
  layout, used where a test's claim is about that layout or about the full-size demo end to end.

`models` / `pair` / `groups_file` give one or the other, chosen by the test module's
`model_size` fixture (tests/test_speculative.py, test_synthesizer.py, test_bench.py and
test_export.py run on both sizes: tiny in the default suite, demo in `-m slow`).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The built-in voice's first use exports its onnxruntime graphs before loading, as a background process
# would: no test (nor a command it runs in a subprocess) leaves one behind. tests/test_prepare.py
# starts the background export explicitly, with a short stand-in.
os.environ["PCGTTS_BACKGROUND_EXPORT"] = "0"

# The tiny pair's speech vocabulary: 4**5 tokens, i.e. the first five digits of the FSQ lattice
# (the demo's 65,536 = 4**8 are all eight), so lattice neighbourhoods stay closed.
TINY_NUM_SPEECH = 1024


def tiny_pair_config():
    """The demo's construction (structured lattice embeddings, layer-subset draft) at tiny size.

    draft_confusion=0: `tools.demo.confuse_draft_head` picks neighbours on all 8 lattice digits,
    which fall outside a vocabulary smaller than 4**8. embed_scale=0.8 (demo: 1.6, tuned for
    hidden 256 and 65,536 tokens) keeps the tiny target's distributions spread (greedy-free
    sampling visits ~75 distinct tokens in 150) and lets its 2-of-4-layer draft disagree on exact
    tokens more than on lattice groups (seeded: SD accepts ~0.94, PCG ~0.99).
    """
    from pcgtts.tools.demo import DemoLMConfig

    return DemoLMConfig(hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=128,
                        num_speech=TINY_NUM_SPEECH, draft_layers=2, draft_confusion=0.0, embed_scale=0.8)


@pytest.fixture(scope="session")
def demo_codec_dir(tmp_path_factory):
    """A tiny X-codec2 checkpoint in the HKUSTAudio/xcodec2-hf layout (random weights).

    The codec is tiny at any size: X-codec2's 65,536-code FSQ codebook is fixed by the format
    (it has no embedding table), so this one serves the tiny and the demo pair alike."""
    from pcgtts.tools.demo_codec import write_demo_codec

    return write_demo_codec(tmp_path_factory.mktemp("codec") / "codec", seed=0)


@pytest.fixture(scope="session")
def tiny_lm_factory(tmp_path_factory):
    """Write small LLaSA-format checkpoints (512 speech tokens) with features switched on/off."""
    from pcgtts.tools.demo import DemoLMConfig, build_demo_tokenizer, write_demo_lm

    tokenizer = build_demo_tokenizer(num_speech=512)
    made = {}

    def make(**overrides):
        key = tuple(sorted(overrides.items()))
        if key not in made:
            cfg = DemoLMConfig(**{"hidden_size": 64, "num_layers": 3, "num_heads": 4, "num_kv_heads": 2,
                                  "intermediate_size": 128, "num_speech": 512, **overrides})
            made[key] = write_demo_lm(tmp_path_factory.mktemp("tiny_lm") / "target", cfg, tokenizer=tokenizer)
        return made[key]

    return make


def lattice_neighbourhoods(num_tokens: int = 65536):
    """Groups = each token with its Hamming-1 neighbours on the FSQ lattice: the structure the
    demo's embeddings encode, built directly (the cosine builder is tested in test_groups.py).
    Neighbours outside a vocabulary smaller than 4**8 are left out."""
    import numpy as np

    idx = np.arange(num_tokens)
    cols = [idx]
    for d in range(8):
        digit = (idx // 4**d) % 4
        for step in (-1, 1):
            neighbour = idx + step * 4**d
            cols.append(np.where((digit + step >= 0) & (digit + step < 4) & (neighbour < num_tokens), neighbour, -1))
    members = np.sort(np.stack(cols, 1), axis=1)
    valid = members >= 0
    offsets = np.concatenate([[0], np.cumsum(valid.sum(1))])
    return offsets, members[valid]


def write_lattice_groups(model_dir, path):
    """A group table file for a demo-built model (lattice neighbourhoods), tied to its vocabulary."""
    from pcgtts.groups.table import GroupTable
    from pcgtts.runtime.lm.checkpoint import load_speech_embeddings

    _, vocab, fingerprint = load_speech_embeddings(model_dir)
    offsets, members = lattice_neighbourhoods(vocab.num_speech)
    table = GroupTable.from_groups_csr(offsets, members, vocab.num_speech, theta=0.4)
    table = table.with_model(vocab.speech_offset, vocab.vocab_size, fingerprint)
    return table.save(path)


def load_pair(paths, max_length: int = 1024):
    """Loaded target and draft (torch backend, CPU, fp32) sharing one tokenizer."""
    from pcgtts.runtime.lm.checkpoint import load_tokenizer
    from pcgtts.runtime.lm.torch_lm import TorchLM

    tok = load_tokenizer(paths["target"])
    target = TorchLM.load(paths["target"], max_length=max_length, tokenizer=tok)
    draft = TorchLM.load(paths["draft"], max_length=max_length, tokenizer=tok)
    return target, draft


@pytest.fixture(autouse=True)
def builtin_is_the_demo(monkeypatch, request):
    """Tests that exercise the built-in voice's plumbing see the demo pair (patched per test), not
    the shipped trained voice, whose expansion takes minutes; tests marked `shipped_voice` see it.
    They run it on torch; tests marked `builtin_onnx` see its onnxruntime exports made on first use."""
    if "shipped_voice" not in request.keywords:
        monkeypatch.setattr("pcgtts.builtin.VOICE_DIR", Path("/nonexistent/pcgtts-voice"))
    if "builtin_onnx" not in request.keywords:  # an ONNX export takes 20-90 s: only where it is the point
        monkeypatch.setattr("pcgtts.builtin.onnx_export_available", lambda: False)


# --- tiny: the default suite -------------------------------------------------------------------

@pytest.fixture(scope="session")
def tiny_lms(tmp_path_factory):
    """A tiny target and its layer-subset draft, built like the demo (1,024 speech tokens)."""
    from pcgtts.tools.demo import write_demo

    return write_demo(tmp_path_factory.mktemp("tiny_pair"), seed=0, config=tiny_pair_config(), with_codec=False)


@pytest.fixture(scope="session")
def tiny_models(tiny_lms, demo_codec_dir):
    """Tiny target and draft with the tiny codec."""
    return {**tiny_lms, "codec": demo_codec_dir}


@pytest.fixture(scope="session")
def tiny_pair(tiny_lms):
    return load_pair(tiny_lms)


@pytest.fixture(scope="session")
def tiny_groups_file(tiny_lms, tmp_path_factory):
    return write_lattice_groups(tiny_lms["target"], tmp_path_factory.mktemp("groups") / "tiny.pcg")


@pytest.fixture(scope="session")
def tiny_groups(tiny_groups_file):
    """The tiny target's group table, loaded on the CPU."""
    from pcgtts.groups.table import GroupTable

    return GroupTable.load(tiny_groups_file).to_device("cpu")


@pytest.fixture(scope="session")
def cloning_models(demo_codec_dir, tmp_path_factory):
    """Small models that can be prompted with a reference recording, in seconds: a pair with the released
    speech vocabulary (all 65,536 X-codec2 codes, which a reference may encode into; the tiny pair holds
    1,024) at tiny width (hidden 64, 2 layers, a 1-layer draft), the tiny codec and a lattice group
    table. {"target", "draft", "codec", "groups"}."""
    from pcgtts.tools.demo import DemoLMConfig, write_demo

    config = DemoLMConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                          draft_layers=1, embed_scale=0.8)
    out = tmp_path_factory.mktemp("cloning_pair")
    lms = write_demo(out, seed=0, config=config, with_codec=False)
    return {**lms, "codec": demo_codec_dir, "groups": write_lattice_groups(lms["target"], out / "groups.pcg")}


# --- the built-in demo: `slow` tests only --------------------------------------------------------

@pytest.fixture(scope="session")
def demo_lms(tmp_path_factory):
    """The built-in demo target and draft (all 65,536 speech tokens), made once."""
    from pcgtts.tools.demo import write_demo

    return write_demo(tmp_path_factory.mktemp("demo"), seed=0, with_codec=False)


@pytest.fixture(scope="session")
def demo_models(demo_lms, demo_codec_dir):
    """The full built-in demo: target, draft and codec."""
    return {**demo_lms, "codec": demo_codec_dir}


@pytest.fixture(scope="session")
def demo_pair(demo_lms):
    return load_pair(demo_lms)


@pytest.fixture(scope="session")
def demo_groups_file(demo_lms, tmp_path_factory):
    return write_lattice_groups(demo_lms["target"], tmp_path_factory.mktemp("groups") / "demo.pcg")


# --- either size, chosen by the module's `model_size` -------------------------------------------

SIZES = [pytest.param("tiny", id="tiny"), pytest.param("demo", id="demo", marks=pytest.mark.slow)]


@pytest.fixture(scope="module", params=SIZES)
def model_size(request):
    """Run a module on the tiny pair (default suite) and on the full demo (`slow`). A module opts
    in by using `models`, `pair`, `lms` or `groups_file`. A test that needs the demo's layout runs
    on the demo alone with `@pytest.mark.parametrize("model_size", [pytest.param("demo",
    marks=pytest.mark.slow)], indirect=True)` (that replaces these params for it)."""
    return request.param


@pytest.fixture(scope="module")
def lms(model_size, request):
    return request.getfixturevalue(f"{model_size}_lms")


@pytest.fixture(scope="module")
def models(model_size, request):
    return request.getfixturevalue(f"{model_size}_models")


@pytest.fixture(scope="module")
def pair(model_size, request):
    return request.getfixturevalue(f"{model_size}_pair")


@pytest.fixture(scope="module")
def groups_file(model_size, request):
    return request.getfixturevalue(f"{model_size}_groups_file")


@pytest.fixture(scope="session")
def factorised_target(tiny_lms, tmp_path_factory):
    """The tiny target with its (tied) speech rows replaced by digit sums: what a lab export looks like."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from pcgtts.runtime.lm.checkpoint import load_tokenizer
    from pcgtts.runtime.lm.digit_head import code_digits, digit_count
    from pcgtts.runtime.text.vocab import SpeechVocab

    out = tmp_path_factory.mktemp("digit") / "target"
    shutil.copytree(tiny_lms["target"], out)
    vocab = SpeechVocab.from_tokenizer(load_tokenizer(out))
    n = digit_count(vocab.num_speech)
    state = load_file(str(out / "model.safetensors"))
    emb = state["model.embed_tokens.weight"]
    gen = torch.Generator().manual_seed(2)
    digit_rows = torch.randn(n, 4, emb.shape[1], generator=gen) * float(emb.std()) / n ** 0.5
    codes = torch.arange(vocab.num_speech)
    emb[vocab.speech_offset:vocab.speech_offset + vocab.num_speech] = digit_rows[torch.arange(n), code_digits(codes, n)].sum(-2)
    assert "lm_head.weight" not in state  # tied: the head is these rows
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


# --- shared by the tests of edges: a synthesizer that never stops, and a guard against loading -------

@pytest.fixture(scope="module")
def tiny_synth(tiny_lm_factory, demo_codec_dir):
    """A tiny target (512 speech tokens) + the tiny codec, plain AR, never stopping on its own."""
    from pcgtts import Synthesizer
    from pcgtts.runtime.config import SynthesisConfig

    config = SynthesisConfig(seed=0, min_tokens=30, tokens_per_char=1.0)
    return Synthesizer.from_pretrained(tiny_lm_factory(), codec=demo_codec_dir, policy="ar", max_length=256,
                                       config=config)


@pytest.fixture
def no_models(monkeypatch):
    """Fail the test if a command gets as far as loading or making models."""
    import pcgtts.builtin
    from pcgtts.runtime import synthesizer

    def refuse(*args, **kwargs):
        raise AssertionError("models were loaded before the bad input was reported")

    monkeypatch.setattr(pcgtts.builtin, "builtin_models", refuse)
    monkeypatch.setattr(synthesizer.Synthesizer, "load", classmethod(refuse))
    monkeypatch.setattr("pcgtts.tools.demo.write_demo", refuse)
