"""Shared fixtures: tiny checkpoints in the exact released formats, made once per session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def demo_codec_dir(tmp_path_factory):
    """A tiny X-codec2 checkpoint in the HKUSTAudio/xcodec2-hf layout (random weights)."""
    from pcgtts.runtime.demo_codec import write_demo_codec

    return write_demo_codec(tmp_path_factory.mktemp("codec") / "codec", seed=0)


@pytest.fixture(scope="session")
def tiny_lm_factory(tmp_path_factory):
    """Write small LLaSA-format checkpoints (512 speech tokens) with features switched on/off."""
    from pcgtts.runtime.demo import DemoLMConfig, build_demo_tokenizer, write_demo_lm

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
def demo_models(tmp_path_factory):
    """The full built-in demo (target, draft with all 65,536 speech tokens; codec), made once."""
    from pcgtts.runtime.demo import write_demo

    return write_demo(tmp_path_factory.mktemp("demo"), seed=0)


@pytest.fixture(scope="session")
def demo_pair(demo_models):
    """Loaded demo target and draft (torch backend, CPU, fp32) sharing one tokenizer."""
    from pcgtts.runtime.checkpoint import load_tokenizer
    from pcgtts.runtime.lm import TorchLM

    tok = load_tokenizer(demo_models["target"])
    target = TorchLM.load(demo_models["target"], max_length=1024, tokenizer=tok)
    draft = TorchLM.load(demo_models["draft"], max_length=1024, tokenizer=tok)
    return target, draft
