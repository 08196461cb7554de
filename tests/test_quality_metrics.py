"""The judges of `pcgtts eval`: text normalisation, WER/CER, ASR on real TTS speech, speaker
similarity, STOI and MCD. Reference audio is rendered into a per-session temporary cache."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from pcgtts.quality.metrics import error_rates, mcd, normalize_text, recognizer, speaker_encoder, stoi
from pcgtts.runtime.text.numbers import spell_number, spell_numbers, spell_ordinal
from pcgtts.quality.testset import TestSet, VoiceRecipe, load_rendered

pytest.importorskip("pocketsphinx")
pytest.importorskip("resemblyzer")


@pytest.mark.parametrize("n, words", [
    (0, "zero"), (7, "seven"), (13, "thirteen"), (20, "twenty"), (42, "forty two"), (100, "one hundred"),
    (365, "three hundred sixty five"), (1000, "one thousand"), (1250, "one thousand two hundred fifty"),
    (2_000_017, "two million seventeen"), (-3, "minus three"),
])
def test_spell_number(n, words):
    assert spell_number(n) == words


def test_spell_ordinal_and_bad_input():
    assert [spell_ordinal(n) for n in (1, 2, 3, 5, 12, 20, 21, 100)] == [
        "first", "second", "third", "fifth", "twelfth", "twentieth", "twenty first", "one hundredth"]
    with pytest.raises(TypeError):
        spell_number(1.5)
    with pytest.raises(ValueError):
        spell_number(10**15)


def test_spell_numbers_keeps_everything_else():
    assert spell_numbers("We counted 42 birds, at 9:05!") == "We counted forty two birds, at nine oh five!"
    assert spell_numbers("In 1998 the 3rd team paid $20.50.") == \
        "In nineteen ninety eight the third team paid twenty dollars fifty cents."
    assert spell_numbers("About 15% of 1,200 seats.") == "About fifteen percent of one thousand two hundred seats."
    assert spell_numbers("No numbers here, none.") == "No numbers here, none."
    assert spell_numbers("Card 4111111111111111, 99999999999999999%.") == (  # past spell_number: digit by digit
        "Card four " + "one " * 14 + "one, " + "nine " * 17 + "percent.")


def test_normalize_text():
    assert normalize_text("We counted 42 birds, at 9:05!") == "we counted forty two birds at nine oh five"
    assert normalize_text("It costs $20.50 -- about 15% more.") == \
        "it costs twenty dollars fifty cents about fifteen percent more"
    assert normalize_text("Built in 1998; the 3rd one isn't \"new\".") == \
        "built in nineteen ninety eight the third one isn't new"
    assert normalize_text("1,250 people and 3.14") == "one thousand two hundred fifty people and three point one four"


def test_error_rates():
    assert error_rates("The 3 cats sat.", "the three cats sat") == (0.0, 0.0)
    wer, cer = error_rates("the three cats sat", "the three dogs sat")
    assert wer == pytest.approx(0.25) and 0 < cer < wer
    assert error_rates("hello there", "") == (1.0, 1.0)
    with pytest.raises(ValueError):
        error_rates("?!", "anything")


@pytest.fixture(scope="module")
def hibari_voice():
    pytest.importorskip("hibari")
    return VoiceRecipe("hibari-heart", "hibari", "heart", 1.0, 0)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("eval-cache")


@pytest.mark.slow  # real TTS speech through the ASR judge, ~5 s (the fast suite stays under 3 minutes)
def test_source_speech_scores_low_wer_and_reversed_speech_high(hibari_voice, cache):
    testset = TestSet.load()
    wers, reversed_wers = [], []
    for s in testset.sentences[:2]:
        audio = load_rendered(hibari_voice, s.text, cache)
        wers.append(error_rates(s.text, recognizer().transcribe(audio))[0])
        reversed_wers.append(error_rates(s.text, recognizer().transcribe(audio[::-1].copy()))[0])
    assert np.mean(wers) < 0.3, wers
    assert np.mean(reversed_wers) > 0.7, reversed_wers


def test_silence_transcribes_to_nothing():
    assert recognizer().transcribe(np.zeros(16000, np.float32)) == ""
    assert speaker_encoder().embed(np.zeros(16000, np.float32)) is None


def test_same_voice_is_more_similar_than_another_voice(hibari_voice, cache):
    if shutil.which("flite") is None:
        pytest.skip("flite is not installed (apt-get install flite)")
    flite = VoiceRecipe("flite-awb", "flite", "awb")
    enc = speaker_encoder()
    a = enc.embed(load_rendered(hibari_voice, "The soup needs more salt, but the bread is perfect.", cache))
    b = enc.embed(load_rendered(hibari_voice, "Could you call me back after lunch, please?", cache))
    c = enc.embed(load_rendered(flite, "Could you call me back after lunch, please?", cache))
    same, other = float(a @ b), float(a @ c)
    assert same > other + 0.1, (same, other)


def test_stoi_and_mcd_track_degradation():
    rng = np.random.default_rng(0)
    t = np.arange(16000 * 2) / 16000
    # a voiced-like signal: harmonics under a slow syllabic envelope
    clean = (np.sin(2 * np.pi * 3 * t) ** 2 * sum(np.sin(2 * np.pi * 140 * k * t) / k for k in range(1, 8)))
    clean = (clean / np.abs(clean).max() * 0.5).astype(np.float32)
    noisy = (clean + 0.3 * rng.standard_normal(clean.size)).astype(np.float32)
    assert stoi(clean, clean) == pytest.approx(1.0, abs=1e-6)
    assert stoi(clean, noisy) < 0.9
    assert mcd(clean, clean, align=False) == pytest.approx(0.0, abs=1e-6)
    assert mcd(clean, noisy, align=False) > mcd(clean, 0.99 * clean + 0.003 * noisy, align=False) + 1.0
    with pytest.raises(ValueError):
        stoi(clean[:100], clean[:100])


def test_mcd_is_in_log_amplitude_cepstral_units():
    """A gain moves c0 only (MCD 0); a spectral ripple of known depth gives the MCD the formula says.

    Multiplying the mel amplitude spectrum by exp(r cos(pi n (k + 1/2) / N)) adds r / 2 to c_n (the
    cepstrum's 1/N normalisation), so MCD = (10 / ln 10) sqrt(2) r / 2; checked through a filter
    applied in the STFT domain, to 5 % (mel bands are not exactly the filter's sampling points)."""
    import librosa

    from pcgtts.quality.metrics import MEL_BANDS, mel_cepstrum

    rng = np.random.default_rng(1)
    noise = (0.1 * rng.standard_normal(16000 * 2)).astype(np.float32)
    assert mcd(noise, 0.25 * noise, align=False) == pytest.approx(0.0, abs=1e-3)
    # A ripple on the mel axis: the gain of each FFT bin follows its HTK-mel position.
    freqs = np.fft.rfftfreq(512, 1 / 16000)
    mel_pos = librosa.hz_to_mel(freqs, htk=True) / librosa.hz_to_mel(8000, htk=True) * MEL_BANDS  # 0..N
    ripple, n = 0.4, 3
    gain = np.exp(ripple * np.cos(np.pi * n * mel_pos / MEL_BANDS))
    spec = librosa.stft(noise, n_fft=512, hop_length=160, win_length=400)
    shaped = librosa.istft(spec * gain[:, None], hop_length=160, win_length=400, length=noise.size)
    delta = (mel_cepstrum(shaped) - mel_cepstrum(noise))[5:-5].mean(0)
    assert delta[n - 1] == pytest.approx(ripple / 2, rel=0.05)
    expected = 10 / np.log(10) * np.sqrt(2) * ripple / 2
    assert mcd(noise, shaped, align=False) == pytest.approx(expected, rel=0.1)


@pytest.mark.slow  # end to end: real TTS speech under noise through pocketsphinx, ~20 s of the fast suite's 3 min
def test_a_transcript_does_not_depend_on_what_was_transcribed_before(hibari_voice, cache):
    """pocketsphinx carries its feature state (noise estimate, cepstral means) from one utterance
    to the next; on hard audio (speech under noise at ~2 dB SNR, as an unintelligible model's output
    is hard) the same samples then read differently after other audio. The judge resets it per
    utterance: one recognizer gives the same words for the same audio whatever came before."""
    from pcgtts.quality.metrics import Recognizer

    rng = np.random.default_rng(0)
    texts = [s.text for s in TestSet.load().sentences[:3]]
    noisy = []
    for text in texts:
        audio = load_rendered(hibari_voice, text, cache)
        noisy.append((audio + rng.normal(0, 0.8 * audio.std(), audio.shape)).astype(np.float32))
    judge = Recognizer()
    first = [judge.transcribe(a) for a in noisy]
    again = [judge.transcribe(a) for a in noisy[::-1]][::-1]
    assert first == again
    assert any(first) and len(set(first)) == 3
