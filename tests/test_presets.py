"""Preset voices: named voices shipped with a model (a voice prompt, an audio transform of the model's own
voice, or both), picked by name in the API, the CLI and the server.

The shipped voice's presets are read from the package (no expansion); the rest runs on the small
cloning-capable pair (the released 65,536-code vocabulary at tiny width) with presets made from its
own codec codes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pcgtts.runtime.audio.presets import Presets, UnknownVoice, write_presets
from pcgtts.runtime.audio.transform import StreamingTransform, VoiceTransform
from pcgtts.runtime.audio.voice import Voice

SHIPPED = Path(__file__).resolve().parents[1] / "pcgtts" / "voice"
OPENAI_NAMES = ("alloy", "ash", "ballad", "cedar", "coral", "echo", "fable", "marin", "nova", "onyx", "sage", "shimmer",
                "verse")
WARM = VoiceTransform(formant=0.9, pitch=0.8)


def _voice(seed: int, n: int = 60) -> Voice:
    codes = np.random.default_rng(seed).integers(0, 65536, n)
    return Voice(codes, f"Reference sentence number {seed}.")


@pytest.fixture(scope="module")
def presets_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("presets")
    write_presets(folder, {"bright": (_voice(1), "a bright voice"), "dark": (_voice(2, 80), "a dark voice"),
                           "warm": (None, "the own voice, lower")},
                  default="bright", aliases={"alloy": "bright", "onyx": "dark", "sage": "warm"}, transforms={"warm": WARM})
    return folder


def test_presets_round_trip_and_aliases_resolve(presets_dir):
    presets = Presets.load(presets_dir)
    assert presets.names == ("bright", "dark", "warm") and presets.default == "bright"
    assert presets.resolve("onyx") == "dark"
    assert np.array_equal(presets.voice("onyx").codes, _voice(2, 80).codes)
    assert presets.voice("dark") is presets.voice("onyx")  # read once
    rows = presets.listing()
    assert rows[0] == {"name": "bright", "description": "a bright voice", "default": True, "seconds": 1.2}
    assert rows[2] == {"name": "warm", "description": "the own voice, lower", "default": False,
                       "transform": {"formant": 0.9, "pitch": 0.8}}
    assert {"name": "onyx", "alias_of": "dark"} in rows
    assert presets.speaker("sage").prompt is None and presets.speaker("sage").transform == WARM
    assert presets.speaker("alloy").prompt is None and presets.speaker("onyx").transform is None


def test_an_index_of_the_first_version_is_still_read(tmp_path, presets_dir):
    index = json.loads((presets_dir / "voices.json").read_text())
    index["version"] = 1
    index["voices"] = [v for v in index["voices"] if "transform" not in v]
    index["aliases"] = {"onyx": "dark"}
    for v in index["voices"]:
        (tmp_path / v["file"]).write_bytes((presets_dir / v["file"]).read_bytes())
    (tmp_path / "voices.json").write_text(json.dumps(index))
    assert Presets.load(tmp_path).names == ("bright", "dark")


def test_a_transform_out_of_range_or_unknown_is_refused(tmp_path, presets_dir):
    index = json.loads((presets_dir / "voices.json").read_text())
    for bad, why in (({"formant": 3.0}, "formant ratio 3.0"), ({"pitch": 0.8, "tempo": 1.1}, "unknown field")):
        index["voices"][2]["transform"] = bad
        (tmp_path / "voices.json").write_text(json.dumps(index))
        for v in index["voices"][:2]:
            (tmp_path / v["file"]).write_bytes((presets_dir / v["file"]).read_bytes())
        with pytest.raises(ValueError, match=why) as err:
            Presets.load(tmp_path)
        assert "\n" not in str(err.value) and "'warm'" in str(err.value)


def test_an_unknown_name_is_one_line_that_lists_the_names(presets_dir):
    with pytest.raises(UnknownVoice) as err:
        Presets.load(presets_dir).resolve("nobody")
    message = str(err.value)
    assert "\n" not in message and "'nobody'" in message
    assert "bright, dark" in message and "alloy" in message


def test_a_damaged_index_is_refused(tmp_path, presets_dir):
    index = json.loads((presets_dir / "voices.json").read_text())
    (tmp_path / "voices.json").write_text(json.dumps(index))  # the .voice files are not there
    with pytest.raises(ValueError, match="missing file"):
        Presets.load(tmp_path)
    index["aliases"] = {"nova": "nobody"}
    with pytest.raises(ValueError, match="aliases of no preset"):
        Presets(presets_dir, Presets.load(presets_dir).voices, None, index["aliases"])
    assert Presets.load(tmp_path / "elsewhere").names == ()  # no index: no presets


# -- the shipped voice's presets -------------------------------------------------------------------

def test_the_shipped_voice_has_at_least_eight_distinct_presets_with_openai_names():
    from pcgtts.runtime.voicepack import read_voice

    if not (SHIPPED / "voices" / "voices.json").is_file():
        pytest.skip("the committed voice ships no presets")
    meta = read_voice(SHIPPED)  # every preset file's checksum is recorded in voice.json
    presets = Presets.load(SHIPPED / "voices")
    assert len(presets.names) >= 8 and presets.default in presets.names
    assert {f"voices/{p.file}" for p in presets.voices if p.file} <= set(meta["sha256"])
    assert all(presets.resolve(name) for name in OPENAI_NAMES)  # every OpenAI voice name is a preset or alias
    made = [(p.file and presets.voice(p.name).source, p.transform) for p in presets.voices]
    assert len(set(made)) == len(made)  # every preset its own recording or its own transform
    for p in presets.voices:
        if p.file:
            voice = presets.voice(p.name)
            assert 150 <= len(voice.codes) <= 250 and int(voice.codes.max()) < 65536  # a 3-5 s reference


# -- the Python API ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def prompted(cloning_models, presets_dir):
    from pcgtts import Synthesizer

    return Synthesizer.from_pretrained(target=cloning_models["target"], codec=cloning_models["codec"],
                                       presets=str(presets_dir), policy="ar", max_new_tokens=20, max_length=1024)


def test_a_preset_name_speaks_as_its_voice_file(prompted, presets_dir):
    by_name = prompted.synthesize("Pick a voice.", voice="onyx", seed=3)
    by_file = prompted.synthesize("Pick a voice.", voice=str(presets_dir / "dark.voice"), seed=3)
    other = prompted.synthesize("Pick a voice.", voice="bright", seed=3)
    assert by_name.size > 0 and np.array_equal(by_name, by_file)
    assert not np.array_equal(by_name, other)
    assert [v["name"] for v in prompted.voices()][:3] == ["bright", "dark", "warm"]


def test_a_transform_preset_is_the_own_voice_through_its_transform_chunk_by_chunk(prompted):
    with prompted.stream("Pick a voice.", seed=3) as stream:
        chunks = [c.samples for c in stream]
    reshape = StreamingTransform(WARM, 16000)
    expected = np.concatenate([reshape.process(c) for c in chunks] + [reshape.flush()])
    with prompted.stream("Pick a voice.", voice="sage", seed=3) as stream:
        heard = list(stream)
    samples = np.concatenate([c.samples for c in heard])
    assert samples.size == WARM.output_length(sum(c.size for c in chunks)) and np.array_equal(samples, expected)
    assert heard[-1].is_last and not any(c.is_last for c in heard[:-1])
    assert np.array_equal(prompted.synthesize("Pick a voice.", voice="sage", seed=3), samples)  # it repeats


def test_the_default_preset_is_the_models_own_voice_unprompted(prompted, presets_dir):
    own = prompted.synthesize("Pick a voice.", seed=3)
    assert np.array_equal(prompted.synthesize("Pick a voice.", voice="bright", seed=3), own)
    assert np.array_equal(prompted.synthesize("Pick a voice.", voice="alloy", seed=3), own)  # its alias
    assert np.array_equal(prompted.synthesize("Pick a voice.", voice="default", seed=3), own)
    prompted_by_its_file = prompted.synthesize("Pick a voice.", voice=str(presets_dir / "bright.voice"), seed=3)
    assert not np.array_equal(prompted_by_its_file, own)


def test_an_unknown_voice_name_is_refused_before_any_work(prompted):
    with pytest.raises(ValueError, match="presets: bright, dark, warm"):
        prompted.stream("Hello.", voice="nobody")
    assert not prompted.stream_lock.locked()


# -- the command line --------------------------------------------------------------------------------

def _cli(argv, capsys):
    from pcgtts.cli import main

    try:
        code = main([str(a) for a in argv])
    except SystemExit as exit:
        code = exit.code
    out = capsys.readouterr()
    return code, out.out, out.err.strip()


def test_voices_json_is_only_a_list_of_named_objects(presets_dir, capsys):
    code, out, _ = _cli(["voices", "--json", "--presets", presets_dir], capsys)
    rows = json.loads(out)
    assert code == 0 and isinstance(rows, list) and all("name" in r for r in rows)
    assert {"name": "alloy", "alias_of": "bright"} in rows
    code, out, _ = _cli(["voices", "--presets", presets_dir], capsys)
    assert code == 0 and "bright (default)" in out and "alloy" in out


def test_speak_with_an_unknown_voice_is_one_line_before_models_load(cloning_models, presets_dir, tmp_path, capsys):
    code, _, err = _cli(["speak", "Hello.", "--voice", "nobody", "--target", cloning_models["target"],
                         "--codec", cloning_models["codec"], "--presets", presets_dir, "--policy", "ar",
                         "--out", tmp_path / "x.wav"], capsys)
    assert code != 0 and err.count("\n") == 0 and "presets: bright, dark, warm" in err
    assert not (tmp_path / "x.wav").exists()


def test_speak_with_a_preset_name_writes_its_audio(cloning_models, presets_dir, tmp_path, capsys):
    code, _, _ = _cli(["speak", "Hello.", "--voice", "onyx", "--target", cloning_models["target"],
                       "--codec", cloning_models["codec"], "--presets", presets_dir, "--policy", "ar",
                       "--max-tokens", "20", "--out", tmp_path / "x.wav"], capsys)
    assert code == 0 and (tmp_path / "x.wav").stat().st_size > 44


# -- the server -----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_server_lists_presets_and_maps_openai_names(cloning_models, presets_dir, tmp_path):
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from serve_helpers import assert_openai_error, auth, start_server

    from pcgtts.runtime.config import ModelPaths

    models = ModelPaths(target=str(cloning_models["target"]), codec=str(cloning_models["codec"]),
                        presets=str(presets_dir))
    server = start_server(None, None, tmp_path, models=models, max_new_tokens=20)
    try:
        voices = httpx.get(f"{server.url}/v1/audio/voices", headers=auth()).json()["voices"]
        by_name = {v["name"]: v for v in voices}
        assert by_name["bright"]["builtin"] and by_name["dark"]["description"] == "a dark voice"
        assert by_name["onyx"]["alias_of"] == "dark" and by_name["echo"]["alias_of"] == "default"
        r = httpx.post(f"{server.url}/v1/audio/speech", headers=auth(), timeout=60,
                       json={"input": "A preset.", "voice": "onyx", "response_format": "pcm", "seed": 1})
        assert r.status_code == 200 and len(r.content) > 0
        error = assert_openai_error(httpx.post(f"{server.url}/v1/audio/speech", headers=auth(), timeout=60,
                                               json={"input": "Who?", "voice": "nobody"}), 400, "voice")
        assert "default, bright, dark, warm" in error["message"]
        r = httpx.post(f"{server.url}/v1/audio/speech", headers=auth(), timeout=60,
                       json={"input": "A preset.", "voice": "sage", "response_format": "pcm", "seed": 1})
        own = httpx.post(f"{server.url}/v1/audio/speech", headers=auth(), timeout=60,
                         json={"input": "A preset.", "voice": "alloy", "response_format": "pcm", "seed": 1})
        assert r.status_code == own.status_code == 200
        assert len(r.content) // 2 == WARM.output_length(len(own.content) // 2)  # heard through its transform
        upload = httpx.post(f"{server.url}/v1/audio/voices", headers=auth(), data={"name": "dark", "text": "Mine."},
                            files={"audio": ("r.wav", b"RIFF")})
        assert_openai_error(upload, 400, "name")
    finally:
        server.stop()


# -- the quality measure -------------------------------------------------------------------------------

def test_the_preset_measure_counts_both_directions_and_names_confusions():
    """Three presets, four sentences, one seed: 2 pairs x 2 directions = 4 cases each. "b" and "c" sound
    alike (same embedding) and tie: the tie goes to whichever comes first, so "c" is taken for "b"."""
    from pcgtts.quality.presets import run_presets

    embeddings = {"a": np.array([1.0, 0.0]), "b": np.array([0.0, 1.0]), "c": np.array([0.0, 1.0])}

    def speak(text, name, seed):
        return np.full(1600, ord(name[0]), np.float32)  # the name travels in the samples

    def embed(audio):
        return embeddings[chr(int(audio[0]))]

    def transcribe(audio):
        return "the words" if chr(int(audio[0])) == "a" else "nothing"

    result = run_presets(speak, ["a", "b", "c"], ["the words"] * 4, seeds=(0,), embed=embed, transcribe=transcribe)
    per = result["per_voice"]
    assert [per[n]["identified"]["passed"] for n in "abc"] == [4, 4, 0]
    assert per["c"]["taken_for"] == {"b": 4}
    assert per["a"]["wer"]["mean"] == 0.0 and per["b"]["wer"]["mean"] == 1.0
    assert result["identified"]["n"] == 12 and result["worst_voice_wer"] == 1.0
