"""Prefix reuse (`runtime/lm/protocol.py`): a prefill keeps the KV of the whole blocks it shares
with the last prompt. It must give bit for bit the logits a fresh prefill gives (so a seeded
utterance does not depend on the one before it), run only the blocks from the first new token on,
and forget what a rollback, a release or a different prompt overwrote."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pcgtts.runtime.lm.protocol import PREFILL_BLOCK
from pcgtts.runtime.lm.torch_lm import TorchLM


def _prompts(lm, shared: int, tails: tuple[int, ...], seed: int = 0, head_end: int | None = None):
    """Prompts that share their first `shared` tokens, then differ (one per tail length); text
    tokens, with <|TEXT_UNDERSTANDING_START|> (where the chat template's head ends) only at
    position `head_end` - 1 if given."""
    gen = torch.Generator().manual_seed(seed)
    text_start = lm.vocab.text_start_id

    def text(n):
        ids = torch.randint(0, lm.vocab.speech_offset - 1, (n,), generator=gen)
        return ids + (ids >= text_start).long()  # never the marker

    head = text(shared)
    if head_end is not None:
        head[head_end - 1] = text_start
    out = []
    for i, n in enumerate(tails):
        tail = text(n)
        tail[0] = head[-1] + 1 + i if head[-1] + 1 + i != text_start else head[-1] + 2 + i  # differ from here on
        out.append(torch.cat([head, tail]))
    return out


def _counting(lm):
    """Record how many tokens each `_run` feeds the model."""
    fed, run = [], lm._run

    def counted(ids, last_only):
        fed.append(len(ids))
        return run(ids, last_only)

    lm._run = counted
    return fed


def test_a_shared_prefix_is_reused_and_gives_a_fresh_prefills_logits_bit_for_bit(tiny_lms):
    assert PREFILL_BLOCK == 32  # the block arithmetic below
    lm = TorchLM.load(tiny_lms["target"], max_length=256)
    fresh = TorchLM.load(tiny_lms["target"], max_length=256, tokenizer=lm.tokenizer)
    fresh.reuse_prefix = False
    a, b = _prompts(lm, shared=70, tails=(7, 12))  # 77 and 82 tokens; the first two blocks shared
    fed = _counting(lm)
    lm.prefill(a)
    speech = torch.arange(5) + lm.vocab.speech_offset
    lm.forward(speech)  # an utterance decodes past the prompt: the prompt's slots survive it
    assert lm.reusable_prefix(b) == 64
    got = lm.prefill(b)
    assert fed == [32, 32, 13, 5, 82 - 64] and lm.length == len(b)
    # Equal, not close: a recomputed row in another batch would differ in its last bits, and a
    # sampled utterance can follow those bits (a seeded demo stream did, on CI).
    assert torch.equal(got, fresh.prefill(b))
    assert torch.equal(lm.forward(speech), fresh.forward(speech))  # ... and the sequence continues alike


def test_blocks_restart_where_the_template_head_ends_and_reuse_reaches_it(tiny_lms):
    """With <|TEXT_UNDERSTANDING_START|> at 44, blocks start at 0 and 32 and then at 45, the end of
    the head every utterance shares; what follows runs as one block. Reuse reaches 45 exactly, bit for bit."""
    lm = TorchLM.load(tiny_lms["target"], max_length=256)
    fresh = TorchLM.load(tiny_lms["target"], max_length=256, tokenizer=lm.tokenizer)
    fresh.reuse_prefix = False
    a, b = _prompts(lm, shared=70, tails=(7, 12), head_end=45)
    assert lm.block_starts(a) == [0, 32, 45] and lm.block_starts(a[:40]) == [0, 32]
    fed = _counting(lm)
    lm.prefill(a)
    assert lm.reusable_prefix(b) == 45  # shares 70, keeps the blocks it shares whole
    assert torch.equal(lm.prefill(b), fresh.prefill(b))
    assert fed == [32, 13, 77 - 45, 82 - 45]


def test_the_same_prompt_again_runs_only_its_last_block(tiny_lms):
    lm = TorchLM.load(tiny_lms["target"], max_length=256)
    (a,) = _prompts(lm, shared=60, tails=(4,))  # 64 tokens: the last one always runs, so its block does
    first = lm.prefill(a)
    fed = _counting(lm)
    assert torch.equal(lm.prefill(a), first)
    assert fed == [32]


def test_rollback_release_and_the_switch_forget_the_prefix(tiny_lms):
    lm = TorchLM.load(tiny_lms["target"], max_length=256)
    a, b = _prompts(lm, shared=70, tails=(5, 6))
    lm.prefill(a)
    lm.rollback(40)  # slots from 40 on will be overwritten: one whole block survives
    lm.forward(b[40:50])
    assert lm.reusable_prefix(a) == 32
    lm.release()
    lm.ensure_cache()
    assert lm.reusable_prefix(a) == 0
    lm.prefill(a)
    lm.reuse_prefix = False
    assert lm.reusable_prefix(b) == 0
    lm.reuse_prefix = True
    assert lm.reusable_prefix(b) == 64
    assert lm.reusable_prefix(a[:33]) == 32 and lm.reusable_prefix(a[:32]) == 0  # the last token always runs


def test_synthesizer_utterances_equal_with_and_without_prefix_reuse(tiny_models, tiny_groups_file):
    """Two utterances in a row, seeded: the same audio whether the second one's prefill reuses the
    first one's template prefix or recomputes it (greedy ar, sampled pcg)."""
    from pcgtts.runtime.synthesizer import Synthesizer

    def speak(prefix_cache: bool, policy: str, temperature: float):
        synth = Synthesizer.from_pretrained(tiny_models["target"], draft=tiny_models["draft"],
                                            codec=tiny_models["codec"], groups=tiny_groups_file,
                                            policy=policy, temperature=temperature, seed=5,
                                            prefix_cache=prefix_cache, max_new_tokens=40,
                                            adaptive_draft=False)  # two loads measure two sets of step costs
        audio = [synth.synthesize(text) for text in ("The first sentence.", "A second one, with other words.")]
        return audio, synth.target.reusable_prefix(synth.target._prompt)

    for policy, temperature in (("ar", 0.0), ("pcg", 0.8)):
        reused, kept = speak(True, policy, temperature)
        fresh, not_kept = speak(False, policy, temperature)
        assert all(np.array_equal(x, y) for x, y in zip(reused, fresh, strict=True))
        assert kept > 0 and not_kept == 0


def test_a_loaded_synthesizer_has_the_template_head_cached_for_its_first_utterance(tiny_models, tiny_groups_file):
    """`Synthesizer.load` prefills the chat template's head (`warm_prefix`), so the first utterance's
    prefill runs only its own words, as later ones do; with prefix reuse off it runs them all."""
    from pcgtts.runtime.lm.protocol import template_head
    from pcgtts.runtime.synthesizer import Synthesizer

    for prefix_cache in (True, False):
        synth = Synthesizer.from_pretrained(tiny_models["target"], draft=tiny_models["draft"],
                                            codec=tiny_models["codec"], groups=tiny_groups_file, seed=1,
                                            max_new_tokens=10, prefix_cache=prefix_cache)
        prompt = synth._fit(["First words."], None, synth.config)[0][0]
        head = template_head(prompt, synth.target.vocab)
        assert 100 < head < len(prompt) - 1
        fed = _counting(synth.target)
        synth.synthesize("First words.")
        first = len(prompt) - 1 - head if prefix_cache else 32  # the prefill's first block
        assert fed[0] == first, (prefix_cache, fed[:3])


@pytest.mark.slow
@pytest.mark.builtin_onnx
def test_builtin_voice_on_a_cpu_runs_its_int8_onnxruntime_exports(tiny_models, tiny_groups_file, tmp_path,
                                                                  monkeypatch):
    """Backend "auto" with no target: the built-in voice's target and draft are exported once (int8)
    beside its checkpoints, and its codec decoder (float32), and run on onnxruntime; a reference is
    still encoded by the codec's checkpoint; the next load reuses the exports; backend="torch" and
    --quantize int8 keep the torch checkpoints."""
    import shutil

    import soundfile as sf

    import pcgtts.export.codec_graph as codec_graph
    import pcgtts.export.onnx_lm as onnx_lm
    from pcgtts import Synthesizer, builtin
    from pcgtts.runtime.audio.onnx_codec import OrtCodec
    from pcgtts.runtime.lm.onnxruntime import OrtLM
    from pcgtts.tools import demo

    voice = {name: shutil.copytree(tiny_models[name], tmp_path / "voice" / name) for name in ("target", "draft")}
    voice.update(codec=tiny_models["codec"], groups=tiny_groups_file)
    monkeypatch.setattr(demo, "ensure_demo", lambda: voice)
    assert builtin.onnx_export_available()

    synth = Synthesizer.from_pretrained(seed=0, max_new_tokens=30)
    assert isinstance(synth.target, OrtLM) and isinstance(synth.draft, OrtLM)
    for name in ("target", "draft"):
        record = json.loads((tmp_path / "voice" / builtin.ONNX_FOLDER / name / "pcgtts-lm.json").read_text())
        assert record["extra"]["quantize"] == "int8" and record["extra"]["check"]["ok"]
    assert len(synth.synthesize("Hello there.")) > 0
    assert isinstance(synth.codec, OrtCodec) and synth.codec.checkpoint_dir == tiny_models["codec"]
    reference = tmp_path / "me.wav"
    sf.write(reference, 0.1 * np.sin(np.arange(48000) / 16000 * 2 * np.pi * 220), 16000)
    assert len(synth.voice_from_audio(reference, "A reference.").codes) in (150, 151)  # 3 s at 50 codes/s
    # Greedy speculation equals greedy decoding on these int8 graphs too. They are not bit
    # batch-invariant (a token's logits in a verify pass and in a one-token step differ by ~1e-3:
    # benchmarks/bench_prefix_reuse.py), so this holds unless a top-two gap is that small; it guards README's claim.
    greedy = dict(temperature=0.0, adaptive_draft=False, max_new_tokens=60)
    ar, sd = (Synthesizer.from_pretrained(policy=policy, **greedy).synthesize("Greedy words, twice.")
              for policy in ("ar", "sd"))
    assert np.array_equal(ar, sd)

    def no_export(*args, **kwargs):
        raise AssertionError("exported again")

    monkeypatch.setattr(onnx_lm, "export_lm", no_export)
    monkeypatch.setattr(codec_graph, "export_codec", no_export)
    assert isinstance(Synthesizer.from_pretrained(max_new_tokens=30).target, OrtLM)
    assert isinstance(Synthesizer.from_pretrained(backend="torch").target, TorchLM)
    assert isinstance(Synthesizer.from_pretrained(quantize="int8").target, TorchLM)


def test_builtin_voice_on_onnxruntime_without_the_export_tools_is_a_clear_error():
    """(conftest makes the export tools look absent here.)"""
    from pcgtts.builtin import with_builtin_models
    from pcgtts.runtime.config import resolve_settings

    with pytest.raises(ValueError, match=r"pcgtts\[onnx\]"):
        with_builtin_models(resolve_settings({"backend": "onnxruntime"}))
    with pytest.raises(ValueError, match="leave dtype at float32"):
        with_builtin_models(resolve_settings({"backend": "onnxruntime", "dtype": "bfloat16"}))
