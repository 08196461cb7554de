"""Shared fixtures: tiny checkpoints in the exact released formats, made once per session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def demo_codec_dir(tmp_path_factory):
    """A tiny X-codec2 checkpoint in the HKUSTAudio/xcodec2-hf layout (random weights)."""
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
    """Loaded demo target and draft (torch backend, CPU, fp32) sharing one tokenizer."""
    from pcgtts.runtime.lm.checkpoint import load_tokenizer
    from pcgtts.runtime.lm.torch_lm import TorchLM

    tok = load_tokenizer(demo_lms["target"])
    target = TorchLM.load(demo_lms["target"], max_length=1024, tokenizer=tok)
    draft = TorchLM.load(demo_lms["draft"], max_length=1024, tokenizer=tok)
    return target, draft


def lattice_neighbourhoods(num_tokens: int = 65536):
    """Groups = each token with its Hamming-1 neighbours on the FSQ lattice: the structure the
    demo's embeddings encode, built directly (the cosine builder is tested in test_groups.py)."""
    import numpy as np

    idx = np.arange(num_tokens)
    cols = [idx]
    for d in range(8):
        digit = (idx // 4**d) % 4
        for step in (-1, 1):
            cols.append(np.where((digit + step >= 0) & (digit + step < 4), idx + step * 4**d, -1))
    members = np.sort(np.stack(cols, 1), axis=1)
    valid = members >= 0
    offsets = np.concatenate([[0], np.cumsum(valid.sum(1))])
    return offsets, members[valid]


@pytest.fixture(scope="session")
def demo_groups_file(demo_lms, tmp_path_factory):
    """A group table file for the demo target (lattice neighbourhoods), tied to its vocabulary."""
    from pcgtts.runtime.lm.checkpoint import load_speech_embeddings
    from pcgtts.groups.table import GroupTable

    _, vocab, fingerprint = load_speech_embeddings(demo_lms["target"])
    offsets, members = lattice_neighbourhoods(vocab.num_speech)
    table = GroupTable.from_groups_csr(offsets, members, vocab.num_speech, theta=0.4)
    table = table.with_model(vocab.speech_offset, vocab.vocab_size, fingerprint)
    return table.save(tmp_path_factory.mktemp("groups") / "demo.pcg")
