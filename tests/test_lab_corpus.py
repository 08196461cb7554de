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
    return CorpusConfig(out_dir=out, per_speaker=2, heldout_sentences=1, max_sentences=6,
                        speakers=(SLT, DERIVED), heldout_speakers=("flite_slt_p-250",), **kw)


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
