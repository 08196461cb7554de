"""Speech lab LM + draft: a tiny factorised LLaSA-format LM trains, exports a plain Llama with the
same log-probs, loads with transformers and the runtime, resumes; a 3-layer draft fine-tunes."""

import json

import numpy as np
import pytest
import torch

from pcgtts.train.draft import DraftTrainConfig, train_draft
from pcgtts.train.lm import LMModelConfig, LMTrainConfig, build_model, lab_tokenizer, train_lm

TEXTS = ["The cat sat on the mat.", "A bird sings in the tree.", "We walk to the old mill.", "Rain fell all day."]


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory):
    """A manifest (real format) and structured codes: each utterance repeats a short code pattern."""
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    records, codes = [], {}
    for spk in ("a", "b"):
        for i, text in enumerate(TEXTS):
            uid = f"{spk}-{i:05d}"
            split = "heldout_sentences" if i == 3 else "train"
            records.append({"id": uid, "speaker": spk, "source": "test", "variant": "original", "text": text,
                            "split": split, "seconds": 0.4, "path": f"audio/{uid}.flac"})
            base = rng.integers(0, 65536, size=5)
            codes[uid] = np.tile(base, 4).astype(np.int32)
    (root / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return root, codes


def _cfg(corpus, out, steps):
    return LMTrainConfig(corpus=corpus, codec=corpus, out_dir=out, model=LMModelConfig.tiny(), steps=steps,
                         batch_size=4, lr=3e-3, warmup=2, log_every=1, checkpoint_minutes=60)


def test_factorised_equals_materialised():
    tok = lab_tokenizer()
    model = build_model(LMModelConfig.tiny(), tok, 0).eval()
    off = model.speech_offset
    ids = torch.tensor([[5, 17, off + 3, off + 65535, off + 4096, 266]])
    with torch.no_grad():
        fact = model.full_log_probs(model.hidden(ids)).double()
        full = torch.log_softmax(model.materialise()(ids).logits.double(), -1)
    assert (fact - full).abs().max() < 1e-4


@pytest.mark.slow  # ~40 s: two tokenizer loads with 65 k added tokens, 24 training steps
def test_train_export_resume_and_runtime_load(tiny_corpus, tmp_path):
    from transformers import LlamaForCausalLM

    from pcgtts.runtime.lm.torch_lm import TorchLM
    from pcgtts.runtime.text.prompt import build_prompt

    corpus, codes = tiny_corpus
    out = tmp_path / "lm"
    first = train_lm(_cfg(corpus, out, 20), codes=codes, stop_after=12)
    assert first["step"] == 12
    losses = [json.loads(line)["loss"] for line in (out / "loss.jsonl").read_text().splitlines()]
    assert np.mean(losses[-3:]) < np.mean(losses[:3])
    second = train_lm(_cfg(corpus, out, 20), codes=codes)
    assert second["step"] == 20
    steps = [json.loads(line)["step"] for line in (out / "loss.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 21))
    assert (out / "loss.png").is_file()

    hf = LlamaForCausalLM.from_pretrained(str(out / "export")).eval()
    assert hf.config.vocab_size == 65805 and hf.config.tie_word_embeddings
    lm = TorchLM.load(out / "export", tokenizer=lab_tokenizer())
    ids = build_prompt(lm.tokenizer, lm.vocab, TEXTS[0])
    restricted = torch.log_softmax(lm.prefill(ids).double(), -1)
    with torch.no_grad():
        full = torch.log_softmax(hf(ids[None]).logits[0, -1].double(), -1)[lm.vocab.head_rows()]
    assert (restricted - torch.log_softmax(full, -1)).abs().max() < 1e-3

    draft = train_draft(DraftTrainConfig(target=out / "export", lm_dir=out, out_dir=tmp_path / "draft", layers=3,
                                         steps=4, batch_size=2, log_every=1))
    assert draft["layers"] == [0, 2, 3] and draft["step"] == 4
    d = LlamaForCausalLM.from_pretrained(str(tmp_path / "draft" / "export"))
    assert d.config.num_hidden_layers == 3
    TorchLM.load(tmp_path / "draft" / "export", tokenizer=lab_tokenizer())


def test_split_checkpoint_round_trips_and_a_model_only_checkpoint_resumes(tiny_corpus, tmp_path):
    """Weights brought back from a GPU machine in size-capped parts: joined, they equal the original and
    a run goes on from them (fresh optimizer moments) at the saved step."""
    from pcgtts.train.progress import join_checkpoint, load_checkpoint, split_checkpoint

    corpus, codes = tiny_corpus
    out = tmp_path / "lm"
    train_lm(_cfg(corpus, out, 6), codes=codes, stop_after=3)
    parts = split_checkpoint(out / "checkpoint.pt", tmp_path / "parts", max_bytes=200_000)
    assert len(parts) > 1 and all(p.stat().st_size < 300_000 for p in parts)  # capped (plus pickle overhead)
    with pytest.raises(ValueError, match="over the"):
        split_checkpoint(out / "checkpoint.pt", tmp_path / "too-small", max_bytes=1000)
    moved = tmp_path / "moved"
    moved.mkdir()
    join_checkpoint(tmp_path / "parts", moved / "checkpoint.pt")
    a, b = load_checkpoint(out / "checkpoint.pt"), load_checkpoint(moved / "checkpoint.pt")
    assert set(a["model"]) == set(b["model"]) and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert "optimizer" not in b and b["step"] == 3 and b["model_config"] == a["model_config"]
    split_checkpoint(out / "checkpoint.pt", tmp_path / "half", dtype=torch.float16)  # carried in half the size
    half = load_checkpoint(join_checkpoint(tmp_path / "half", tmp_path / "half.pt"))["model"]
    assert all(half[k].dtype == torch.float32 and torch.allclose(half[k], a["model"][k], rtol=1e-3, atol=1e-4)
               for k in a["model"])
    (moved / "codes.npz").write_bytes((out / "codes.npz").read_bytes())
    resumed = train_lm(_cfg(corpus, moved, 6), codes=codes)
    assert resumed["step"] == 6


def test_prefetched_batches_equal_batches_built_in_line(tiny_corpus):
    import random

    from pcgtts.train.corpus import read_manifest
    from pcgtts.train.lm import ExampleBuilder, _prefetched

    corpus, codes = tiny_corpus
    builder = ExampleBuilder(lab_tokenizer(), read_manifest(corpus), codes, _cfg(corpus, corpus, 1))
    inline_rng, thread_rng = random.Random(5), random.Random(5)
    inline = [builder.batch(3, inline_rng) for _ in range(4)]
    threaded = list(_prefetched(builder, 3, thread_rng, 4))
    assert len(threaded) == 4
    for x, y in zip(inline, threaded):
        assert all(torch.equal(a, b) for a, b in zip(x, y))


def test_device_is_validated(tiny_corpus, tmp_path):
    corpus, _ = tiny_corpus
    with pytest.raises(ValueError, match="device"):
        LMTrainConfig(corpus=corpus, codec=corpus, out_dir=tmp_path, device="tpu")


def test_text_conditioning_compares_own_and_other_transcripts(tiny_corpus):
    """Same transcript everywhere: the two NLLs are the same computation (gain exactly 0); distinct
    transcripts change an untrained model's NLL (the text is read); fewer than 2 utterances: refused."""
    from pcgtts.train.corpus import read_manifest
    from pcgtts.train.lm import ExampleBuilder, text_conditioning

    corpus, codes = tiny_corpus
    records = read_manifest(corpus)
    tok = lab_tokenizer()
    model = build_model(LMModelConfig.tiny(), tok, 0)
    cfg = _cfg(corpus, corpus, 1)
    same = ExampleBuilder(tok, [dict(r, text=TEXTS[0]) for r in records], codes, cfg)
    flat = text_conditioning(model, same, count=6)
    assert flat["utterances"] == 6 and flat["gain"] == 0.0 and flat["nll_own_text"] > 0
    varied = text_conditioning(model, ExampleBuilder(tok, records, codes, cfg), count=6)
    assert varied["gain"] != 0.0
    with pytest.raises(ValueError, match="at least 2"):
        text_conditioning(model, ExampleBuilder(tok, records[:1], codes, cfg))


def test_prefetched_batches_raise_the_threads_error_instead_of_hanging(tiny_corpus):
    import random

    from pcgtts.train.corpus import read_manifest
    from pcgtts.train.lm import ExampleBuilder, _prefetched

    corpus, codes = tiny_corpus
    builder = ExampleBuilder(lab_tokenizer(), read_manifest(corpus), codes, _cfg(corpus, corpus, 1))

    def broken(size, rng):
        raise OSError("disk gone")

    builder.batch = broken
    with pytest.raises(RuntimeError, match="training batch") as info:
        next(_prefetched(builder, 3, random.Random(0), 2))
    assert isinstance(info.value.__cause__, OSError)


def test_alignment_places_mark_the_text_bytes_and_the_speech_tokens(tiny_corpus):
    """In a built example (plain and voice-prompted) the prior's places cover exactly the spoken text's
    bytes and the speech tokens (reference + target), each rising evenly in (0, 1)."""
    from pcgtts.runtime.text.prompt import tokenize_plain
    from pcgtts.train.align import relative_positions
    from pcgtts.train.corpus import read_manifest
    from pcgtts.train.lm import ExampleBuilder

    corpus, codes = tiny_corpus
    tok = lab_tokenizer()
    records = read_manifest(corpus)
    builder = ExampleBuilder(tok, records, codes, _cfg(corpus, corpus, 1))
    v = builder.vocab
    for ref in (None, records[1]):
        rec = records[0]
        ids, _ = builder.example(rec, ref)
        rel = relative_positions(ids, v.text_start_id, v.text_end_id, v.speech_offset)
        spoken = rec["text"] if ref is None else f"{ref['text']} {rec['text']}"
        n_speech = len(codes[rec["id"]]) + (0 if ref is None else len(codes[ref["id"]]))
        assert int((rel[1] >= 0).sum()) == len(tokenize_plain(tok, spoken))
        assert int((rel[0] >= 0).sum()) == n_speech
        for row in rel:
            places = row[row >= 0]
            assert 0 < places.min() < places.max() < 1 and bool((places.diff() > 0).all())
    with pytest.raises(ValueError, match="text span"):
        relative_positions(torch.tensor([1, 2, 3]), v.text_start_id, v.text_end_id, v.speech_offset)


def test_alignment_prior_is_low_on_the_diagonal_and_one_off_the_text():
    """Hand-made attention: every speech query on the text byte at its own place -> prior near 0; all
    on a non-text key -> exactly 1; on the text's far end -> high. Non-speech queries do not count."""
    from types import SimpleNamespace

    from pcgtts.train.align import alignment_prior

    n_text, n_speech = 10, 20
    T = 2 + n_text + n_speech
    rel = torch.full((1, 2, T), -1.0)
    text_pos, speech_pos = torch.arange(1, 1 + n_text), torch.arange(2 + n_text, T)
    rel[0, 1, text_pos] = (torch.arange(n_text) + 0.5) / n_text
    rel[0, 0, speech_pos] = (torch.arange(n_speech) + 0.5) / n_speech

    def prior(weights):
        attn = SimpleNamespace(align_weights=weights)
        body = SimpleNamespace(layers=[SimpleNamespace(self_attn=attn)])
        return float(alignment_prior(body, rel, width=0.2))

    diag = torch.zeros(1, 1, T, T)
    for i, q in enumerate(speech_pos):
        diag[0, 0, q, text_pos[int(i * n_text / n_speech)]] = 1.0
    diag[0, 0, 0, 5] = 1.0  # a non-speech query: ignored
    off_text = torch.zeros(1, 1, T, T)
    off_text[0, 0, speech_pos, 0] = 1.0
    far = torch.zeros(1, 1, T, T)
    far[0, 0, speech_pos, text_pos[-1]] = 1.0
    assert prior(diag) < 0.05
    assert prior(off_text) == pytest.approx(1.0)
    assert 0.3 < prior(far) < 1.0


def test_training_with_the_alignment_prior_lowers_it(tiny_corpus, tmp_path):
    """The prior is wired into the loss: with a large weight a tiny model's watched head moves towards
    the diagonal within a few steps (logged as "align"), and the NLL is logged apart from it."""
    corpus, codes = tiny_corpus
    cfg = LMTrainConfig(corpus=corpus, codec=corpus, out_dir=tmp_path / "lm", model=LMModelConfig.tiny(), steps=30,
                        batch_size=4, lr=1e-2, warmup=1, log_every=5, checkpoint_minutes=60, align_weight=20.0)
    assert cfg.watched_layers == (1, 2)
    train_lm(cfg, codes=codes)
    logged = [json.loads(line) for line in (tmp_path / "lm" / "loss.jsonl").read_text().splitlines()]
    aligns = [r["align"] for r in logged]
    assert len(aligns) == 6 and aligns[-1] < aligns[0] - 0.1
    assert all(r["loss"] > 0 for r in logged)
    with pytest.raises(ValueError, match="align"):
        LMTrainConfig(corpus=corpus, codec=corpus, out_dir=tmp_path, align_weight=-1.0)


def test_watching_attention_changes_nothing_and_stays_causal():
    """The watched model computes what plain SDPA computes (padding included), a later input never
    reaches an earlier position (a custom attention gets no mask unless one is registered: its
    eager path once saw the future, and the NLL fell to 2.4 nats in 180 steps), and the kept weights
    are causal rows of the watched heads."""
    from transformers import LlamaConfig, LlamaModel

    from pcgtts.train.align import watch

    cfg = LlamaConfig(vocab_size=10, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    plain = LlamaModel(cfg).eval()
    watched = LlamaModel(cfg)
    watched.load_state_dict(plain.state_dict())
    watch(watched, (1,), 1)
    watched.train()
    x = torch.randn(2, 7, 64)
    attn = torch.ones(2, 7, dtype=torch.long)
    attn[1, 5:] = 0
    want = plain(inputs_embeds=x, attention_mask=attn).last_hidden_state
    got = watched(inputs_embeds=x, attention_mask=attn).last_hidden_state
    assert (want[0] - got[0]).abs().max() < 1e-5 and (want[1, :5] - got[1, :5]).abs().max() < 1e-5
    weights = watched.layers[1].self_attn.align_weights
    assert weights.shape == (2, 1, 7, 7) and float(weights.triu(1).abs().max()) == 0.0
    later = x.clone()
    later[:, 6] += 1.0
    moved = watched(inputs_embeds=later, attention_mask=attn).last_hidden_state
    assert float((moved - got)[:, :6].abs().max()) == 0.0


def test_packed_codes_rebuild_what_lab_lm_reads(tiny_corpus, tmp_path):
    """An LM run's inputs carried to a GPU machine in one file: unpacked, the manifest rows, every
    utterance's codes and the codec's config are what they were; codes past uint16 are refused."""
    from pcgtts.train.corpus import read_manifest
    from pcgtts.train.lm import pack_codes, unpack_codes

    corpus, codes = tiny_corpus
    (tmp_path / "codec").mkdir()
    (tmp_path / "codec" / "config.json").write_text('{"model_type": "xcodec2"}')
    np.savez(tmp_path / "codes.npz", **codes)
    packed = pack_codes(corpus, tmp_path / "codec", tmp_path / "codes.npz", tmp_path / "lab.npz")
    paths = unpack_codes(packed, tmp_path / "device")
    assert read_manifest(paths["corpus"]) == read_manifest(corpus)
    back = dict(np.load(paths["codes"]))
    assert set(back) == set(codes) and all(np.array_equal(back[k], codes[k]) and back[k].dtype == np.int32
                                           for k in codes)
    assert (paths["codec"] / "config.json").read_text() == '{"model_type": "xcodec2"}'
    np.savez(tmp_path / "bad.npz", **{k: v + 65536 for k, v in codes.items()})
    with pytest.raises(ValueError, match="uint16"):
        pack_codes(corpus, tmp_path / "codec", tmp_path / "bad.npz", tmp_path / "bad-pack.npz")


def test_packed_codes_join_more_text_without_leaking_heldout(tiny_corpus, tmp_path):
    """A second corpus (more sentences, same codec) joins the pack: its new-text train utterances under
    prefixed ids with their codes; a sentence the first corpus has (held out there or not) stays out."""
    from pcgtts.train.corpus import read_manifest
    from pcgtts.train.lm import pack_codes, unpack_codes

    corpus, codes = tiny_corpus
    (tmp_path / "codec").mkdir()
    (tmp_path / "codec" / "config.json").write_text("{}")
    np.savez(tmp_path / "codes.npz", **codes)
    more = tmp_path / "more"
    more.mkdir()
    rows = [{"id": f"a-{i:05d}", "speaker": "a", "source": "test", "variant": "original", "text": text,
             "split": "train", "seconds": 0.4, "path": f"audio/a-{i:05d}.flac"}
            for i, text in enumerate([TEXTS[3], "A sentence the first corpus never had.", TEXTS[0]])]
    (more / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    more_codes = {r["id"]: np.full(7, i, np.int32) for i, r in enumerate(rows)}
    np.savez(tmp_path / "more.npz", **more_codes)
    packed = pack_codes(corpus, tmp_path / "codec", tmp_path / "codes.npz", tmp_path / "lab.npz",
                        extra=[(more, tmp_path / "more.npz")])
    paths = unpack_codes(packed, tmp_path / "device")
    got = read_manifest(paths["corpus"])
    assert got[:len(read_manifest(corpus))] == read_manifest(corpus)
    added = got[len(read_manifest(corpus)):]
    assert [(r["id"], r["text"], r["split"]) for r in added] == [("more/a-00001", rows[1]["text"], "train")]
    assert np.array_equal(np.load(paths["codes"])["more/a-00001"], more_codes["a-00001"])


def test_only_the_named_speakers_go_unprompted(tiny_corpus):
    """`unprompted_speakers`: the voice heard without a voice prompt is theirs; every other speaker's
    examples carry a same-speaker reference, whatever voice_prompt_prob says."""
    import dataclasses
    import random

    from pcgtts.train.corpus import read_manifest
    from pcgtts.train.lm import ExampleBuilder

    corpus, codes = tiny_corpus
    tok = lab_tokenizer()
    records = [r for r in read_manifest(corpus) if r["split"] == "train"]
    cfg = dataclasses.replace(_cfg(corpus, corpus, 1), voice_prompt_prob=0.0, unprompted_speakers=("a",))
    builder = ExampleBuilder(tok, records, codes, cfg)
    start = builder.vocab.speech_offset
    rng = random.Random(0)
    seen = {"a": set(), "b": set()}
    for _ in range(40):
        ids, mask = builder.sample(rng)
        prompt = ids[~mask]
        speaker = "a" if any(ids[mask][:5].tolist() == (torch.as_tensor(codes[r["id"]][:5]) + start).tolist()
                             for r in records if r["speaker"] == "a") else "b"
        seen[speaker].add(bool((prompt >= start).any()))  # speech tokens before the target: a voice prompt
    assert seen == {"a": {False}, "b": {True}}
    shared = ExampleBuilder(tok, records, codes, dataclasses.replace(cfg, voice_prompt_prob=1.0, unprompted_share=0.5))
    free = sum(not bool((ids[~mask] >= start).any()) for ids, mask in (shared.sample(rng) for _ in range(200)))
    assert 70 <= free <= 130  # half the examples unprompted (binomial, 200 draws: ~0.5 % outside)
    with pytest.raises(ValueError, match="no training speaker c"):
        train_lm(dataclasses.replace(cfg, unprompted_speakers=("c",)), codes=codes)
