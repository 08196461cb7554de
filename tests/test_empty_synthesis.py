"""Text the model makes no speech for (it ends every sentence before its first speech token) is never
a silent empty result: the Python API raises `EmptySynthesis`, `pcgtts speak` fails in one line and
writes nothing, and the server answers an error before the first byte.

The model is made to end at once by handing out no token of any step and marking the sentence
stopped: what a decode that draws the stop token first does."""

from __future__ import annotations

import json
import logging

import pytest

from pcgtts.cli import main


def end_at_once(monkeypatch, sentences: int | None = None) -> None:
    """Every sentence (or the first `sentences` of a call) ends at its first step, with no speech."""
    from pcgtts.runtime.decode import loop

    original, ended = loop.emitted, []

    def emitted(tokens, stop_index, max_new_tokens, stats):
        if any(s is stats for s in ended) or sentences is None or len(ended) < sentences:
            if not any(s is stats for s in ended):
                ended.append(stats)
            stats.finish = "stop"
            return []
        return original(tokens, stop_index, max_new_tokens, stats)

    monkeypatch.setattr(loop, "emitted", emitted)


# -- the Python API ------------------------------------------------------------------------------

def test_empty_synthesis_is_a_runtime_error_the_public_api_exports():
    import pcgtts
    from pcgtts.runtime.synthesizer import EmptySynthesis

    assert pcgtts.EmptySynthesis is EmptySynthesis and issubclass(EmptySynthesis, RuntimeError)


def test_synthesize_raises_when_the_model_makes_no_speech(tiny_synth, monkeypatch):
    from pcgtts import EmptySynthesis

    end_at_once(monkeypatch)
    with pytest.raises(EmptySynthesis, match="no speech"):
        tiny_synth.synthesize("Yes.")
    assert not tiny_synth.stream_lock.locked()


def test_iterating_a_stream_raises_before_any_chunk_when_the_model_makes_no_speech(tiny_synth, monkeypatch):
    from pcgtts import EmptySynthesis

    end_at_once(monkeypatch)
    chunks = []
    with pytest.raises(EmptySynthesis):
        with tiny_synth.stream("Yes. No.") as stream:
            chunks.extend(stream)
    assert chunks == []


def test_one_silent_sentence_among_others_is_a_warning_and_the_rest_is_spoken(tiny_synth, monkeypatch, caplog):
    end_at_once(monkeypatch, sentences=1)
    with caplog.at_level(logging.WARNING, logger="pcgtts"):
        audio = tiny_synth.synthesize("Yes. And then a second sentence.", max_new_tokens=20, max_sentence_chars=20)
    assert len(audio) > 0
    assert [r.getMessage()[:21] for r in caplog.records if "ended at once" in r.getMessage()] == ["sentence 1 of 3 ended"]


# -- the command line ----------------------------------------------------------------------------

def test_speak_fails_in_one_line_and_writes_nothing_when_the_model_makes_no_speech(tiny_models, tmp_path, capsys,
                                                                                  monkeypatch):
    end_at_once(monkeypatch)
    out = tmp_path / "yes.wav"
    code = main(["speak", "Yes.", "--target", str(tiny_models["target"]), "--codec", str(tiny_models["codec"]),
                 "--policy", "ar", "--out", str(out)])
    captured = capsys.readouterr()
    assert code != 0
    lines = [line for line in captured.err.strip().splitlines() if line.startswith("pcgtts:")]
    assert len(lines) == 1 and "no speech" in lines[0], captured.err
    assert "Traceback" not in captured.err and "time_to_first_audio" not in captured.err + captured.out
    assert list(tmp_path.iterdir()) == []  # no output file, no partial, no temporary


# -- the server ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tiny_lm_factory, demo_codec_dir, tmp_path_factory):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from serve_helpers import start_server

    running = start_server(tiny_lm_factory(), demo_codec_dir, tmp_path_factory.mktemp("voices"))
    yield running
    running.stop()


@pytest.mark.parametrize("extra", [{"response_format": "wav"}, {"response_format": "pcm"},
                                   {"response_format": "pcm", "stream_format": "sse"}])
def test_the_server_answers_an_error_before_any_byte_when_the_model_makes_no_speech(server, monkeypatch, extra):
    httpx = pytest.importorskip("httpx")
    from serve_helpers import assert_openai_error, auth

    end_at_once(monkeypatch)
    with httpx.stream("POST", f"{server.url}/v1/audio/speech", headers=auth(), timeout=60,
                      json={"input": "Yes.", **extra}) as response:
        response.read()
    error = assert_openai_error(response, 422)
    assert error["code"] == "empty_synthesis" and "no speech" in error["message"]
    assert response.headers["content-type"] == "application/json"


def test_a_websocket_sentence_the_model_makes_no_speech_for_is_an_error_and_the_session_goes_on(server, monkeypatch):
    pytest.importorskip("websockets")
    from serve_helpers import websocket_session

    end_at_once(monkeypatch, sentences=1)
    messages, audio = websocket_session(server, [{"type": "text", "text": "Yes. Then a sentence that is spoken. "}])
    errors = [m for m in messages if m["type"] == "error"]
    assert len(errors) == 1 and errors[0]["error"]["code"] == "empty_synthesis", messages
    assert [m["index"] for m in messages if m["type"] == "sentence.end"] == [1] and audio > 0, messages
