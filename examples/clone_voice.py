"""Condition speech on a reference recording: encode it once into a voice file, then reuse it.

    python examples/clone_voice.py speaker.wav "The quick brown fox jumps over the lazy dog." "Now this." out.wav

The arguments: the reference recording (any format soundfile reads, any sample rate and channel count,
0.5-30 s), its transcript, the text to say, and the output file (.wav, .flac, .ogg or .mp3). The
encoded voice is kept beside the output as `<out>.<key>.voice`, the key a hash of the reference's
audio bytes and transcript: a second run with the same reference skips the encoding, and a run with
another reference never reuses the first one's voice. The built-in voice is one speaker and keeps
its voice whatever the reference; a LLaSA checkpoint given as target speaks in the reference's voice.
"""

import hashlib
import sys
from pathlib import Path

import soundfile as sf

from pcgtts import Synthesizer, Voice
from pcgtts.runtime.audio.io import load_audio, output_format
from pcgtts.runtime.files import atomic_output, check_output_file
from pcgtts.runtime.text.prompt import check_text


def voice_file_for(ref_audio: str, ref_text: str, out: str) -> Path:
    """Where the voice of this reference is kept: beside `out`, keyed by the recording and its transcript."""
    key = hashlib.sha256(Path(ref_audio).read_bytes() + b"\0" + ref_text.encode()).hexdigest()[:16]
    return Path(out).with_suffix(f".{key}.voice")


if len(sys.argv) != 5:
    sys.exit('usage: python examples/clone_voice.py reference.wav "What the reference says." '
             '"Text to say after it." out.wav')
ref_audio, ref_text, text, out = sys.argv[1:5]
try:  # bad arguments are reported before any model loads
    load_audio(ref_audio)  # readable, 0.5-30 s, not silent
    check_text(ref_text)
    check_text(text)
    container, encoding = output_format(check_output_file(out, "output"))
except (FileNotFoundError, ValueError) as err:
    sys.exit(f"error: {err}")

voice_file = voice_file_for(ref_audio, ref_text, out)
synth = Synthesizer.from_pretrained()  # the built-in voice's models; or your own checkpoints
if not voice_file.exists():  # encoding loads the codec's encoder (from the decoder's folder) once
    synth.voice_from_audio(ref_audio, ref_text).save(voice_file)

audio = synth.synthesize(text, voice=Voice.load(voice_file))
with atomic_output(out) as tmp:
    sf.write(tmp, audio, 16000, format=container, subtype=encoding)
print(f"wrote {out}, conditioned on {ref_audio} (its voice kept as {voice_file})")
