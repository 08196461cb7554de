"""Synthesise text to an audio file (the whole waveform at once).

    python examples/save_wav.py "A sentence to save." out.wav

The format follows the suffix: .wav, .flac, .ogg, and .mp3 where this machine's libsndfile writes it.
An existing file is replaced only by a complete result.
"""

import sys

import soundfile as sf

from pcgtts import Synthesizer
from pcgtts.runtime.audio.io import output_format
from pcgtts.runtime.files import atomic_output, check_output_file
from pcgtts.runtime.text.prompt import check_text

if len(sys.argv) != 3:
    sys.exit('usage: python examples/save_wav.py "A sentence to save." out.wav')
text, path = sys.argv[1:3]
try:  # bad arguments are reported before any model loads
    check_text(text)
    container, encoding = output_format(check_output_file(path, "output"))
except ValueError as err:
    sys.exit(f"error: {err}")

synth = Synthesizer.from_pretrained()  # the built-in voice; or target=..., draft=..., codec=..., groups=...
audio = synth.synthesize(text)
with atomic_output(path) as tmp:
    sf.write(tmp, audio, 16000, format=container, subtype=encoding)
print(f"wrote {path}: {len(audio) / 16000:.2f} s")
