"""Speech lab corpus: deterministic, cached rendering of a few sentences with one packaged voice."""

import json
import shutil

import pytest
import soundfile as sf

from pcgtts.train.corpus import DEFAULT_SPEAKERS, CorpusConfig, build_corpus, missing_tools, plan, sentence_pool

SLT = next(s for s in DEFAULT_SPEAKERS if s.name == "flite_slt")
DERIVED = next(s for s in DEFAULT_SPEAKERS if s.name == "flite_slt_p-250")

needs_flite = pytest.mark.skipif(bool(missing_tools([SLT, DERIVED])),
                                 reason="flite/sox not installed (CI: apt-get install flite sox)")


def _config(out, **kw):
    kw = {"speakers": (SLT, DERIVED), "heldout_speakers": ("flite_slt_p-250",), **kw}
    return CorpusConfig(out_dir=out, per_speaker=2, heldout_sentences=1, max_sentences=6, **kw)


def test_plan_is_deterministic_and_splits(tmp_path):
    a, b = plan(_config(tmp_path)), plan(_config(tmp_path))
    assert [(u.id, u.text, u.split) for u in a] == [(u.id, u.text, u.split) for u in b]
    splits = {u.speaker.name: set() for u in a}
    for u in a:
        splits[u.speaker.name].add(u.split)
    assert splits["flite_slt_p-250"] == {"heldout_speakers"}
    assert splits["flite_slt"] == {"train", "heldout_sentences"}
    pool = sentence_pool(_config(tmp_path))
    assert all(4 <= len(s.split()) <= 25 for s in pool)


@pytest.mark.slow  # ~15 s: builds the word chain from the fortunes (the fast suite stays under 3 minutes)
def test_markov_sentences_extend_the_pool_deterministically_and_leave_random_alone(tmp_path):
    import random

    from pcgtts.train.corpus import MIN_WORDS, MAX_WORDS, PLAIN, fortune_sentences, markov_sentences

    random.seed(123)
    before = random.random()
    random.seed(123)
    a = markov_sentences(7, 50)
    assert random.random() == before  # the generator's use of the global `random` is undone
    markov_sentences.cache_clear()
    assert markov_sentences(7, 50) == a and len(set(a)) == 50
    assert markov_sentences(8, 50) != a
    assert all(PLAIN.match(s) and MIN_WORDS <= len(s.split()) <= MAX_WORDS for s in a)
    base = sentence_pool(CorpusConfig(out_dir=tmp_path, heldout_sentences=1))
    more = sentence_pool(CorpusConfig(out_dir=tmp_path, heldout_sentences=1, markov_sentences=50))
    assert set(more) == set(base) | set(markov_sentences(0, 50)) and len(more) > len(base)
    assert len(base) >= len(fortune_sentences())


def test_bad_config_is_refused(tmp_path):
    with pytest.raises(ValueError, match="held-out speakers"):
        CorpusConfig(out_dir=tmp_path, speakers=(SLT,), heldout_speakers=("nobody",))


@needs_flite
def test_build_is_deterministic_cached_and_resumable(tmp_path):
    first = build_corpus(_config(tmp_path / "a"))
    assert first["rendered"] == first["utterances"] == 6 and first["speakers"] == 2
    records = [json.loads(line) for line in (tmp_path / "a" / "manifest.jsonl").read_text().splitlines()]
    assert {"id", "speaker", "source", "variant", "text", "split", "seconds"} <= set(records[0])
    audio, rate = sf.read(str(tmp_path / "a" / records[0]["path"]))
    assert rate == 16000 and audio.ndim == 1 and abs(audio.size / rate - records[0]["seconds"]) < 1e-3
    # cached: a second run renders nothing and writes the same manifest
    again = build_corpus(_config(tmp_path / "a"))
    assert again["rendered"] == 0 and again["hours"] == first["hours"]
    # deterministic: a fresh folder gives bit-identical audio (flite + sox are deterministic)
    shutil.rmtree(tmp_path / "a" / "audio" / "flite_slt")
    resumed = build_corpus(_config(tmp_path / "a"))
    assert resumed["rendered"] == 3
    again_audio, _ = sf.read(str(tmp_path / "a" / records[0]["path"]))
    assert (again_audio == audio).all()


def test_a_full_corpus_refuses_to_start_without_the_fortune_files(tmp_path, monkeypatch):
    """Without Debian's fortune files the pool would silently shrink to the 160 template sentences
    (a 20x smaller corpus): a full build refuses with the install line before rendering anything."""
    import pcgtts.train.corpus as corpus

    monkeypatch.setattr(corpus, "fortune_sentences", lambda: [])
    monkeypatch.setattr(corpus, "missing_tools", lambda speakers: [])
    cfg = CorpusConfig(out_dir=tmp_path / "c", speakers=(SLT,), heldout_speakers=())
    with pytest.raises(RuntimeError, match="fortunes-min"):
        build_corpus(cfg)
    assert not (tmp_path / "c").exists()


def test_voice_bank_speakers_are_codec_only_and_never_held_out(tmp_path, monkeypatch):
    """The voice bank's utterances form the codec_only split, with no held-out sentences of their own;
    a missing festival voice is named by its Debian package before anything renders."""
    from pcgtts.train import corpus
    from pcgtts.train.corpus import VOICE_BANK_SPEAKERS

    bank = VOICE_BANK_SPEAKERS[:2]
    assert all(s.codec_only for s in VOICE_BANK_SPEAKERS) and len({s.name for s in VOICE_BANK_SPEAKERS}) == 20
    cfg = _config(tmp_path, speakers=(SLT, DERIVED, *bank))
    utts = plan(cfg)
    by = {}
    for u in utts:
        by.setdefault(u.speaker.name, []).append(u)
    for s in bank:
        assert {u.split for u in by[s.name]} == {"codec_only"} and len(by[s.name]) == cfg.per_speaker
    assert [(u.id, u.split) for u in by["flite_slt"]] == [(u.id, u.split) for u in plan(_config(tmp_path))
                                                          if u.speaker.name == "flite_slt"]
    with pytest.raises(ValueError, match="codec_only"):
        _config(tmp_path, speakers=(SLT, DERIVED, *bank), heldout_speakers=(bank[0].name,))
    with pytest.raises(ValueError, match="unknown festival voice"):
        corpus.Speaker("x", "festival", "nobody")
    monkeypatch.setattr(corpus, "FESTIVAL_VOICE_DIR", tmp_path / "none")
    monkeypatch.setattr(corpus.shutil, "which", lambda tool: "/usr/bin/" + tool)
    assert missing_tools(bank) == [f"apt-get install {corpus.FESTIVAL_VOICES[bank[0].voice][1]}"]


def test_the_voice_bank_feeds_the_codec_and_nothing_else(tmp_path):
    """CropSampler reads train + codec_only; the LM's splits and the cloning pool leave codec_only out."""
    import numpy as np

    from pcgtts.quality.cloning import cloning_plan
    from pcgtts.train.codec import CropSampler
    from pcgtts.train.corpus import write_manifest
    from pcgtts.train.lm import split_records

    rows = []
    for n, (speaker, split) in enumerate((("a", "train"), ("a", "heldout_sentences"), ("b", "train"),
                                          ("c", "heldout_speakers"), ("bank", "codec_only"))):
        for k in range(2):
            rel = f"audio/{speaker}/{speaker}-{n}{k}.flac"
            (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
            sf.write(str(tmp_path / rel), np.zeros(16000 * 4, np.int16), 16000, format="FLAC")
            rows.append({"id": f"{speaker}-{n}{k}", "speaker": speaker, "source": speaker, "text": "t", "split": split,
                         "seconds": 4.0, "path": rel})
    write_manifest(tmp_path, rows)
    assert {r["speaker"] for r in CropSampler(tmp_path, crop_frames=10).records} == {"a", "b", "bank"}
    train, held = split_records(tmp_path)
    assert {r["split"] for r in train} == {"train"} and "codec_only" not in {r["split"] for r in held}
    assert "bank" not in cloning_plan(rows, refs=1, per_speaker=1).centroid_rows
