"""Synthesise text to a WAV file (the whole waveform, by consuming the stream).

    python examples/save_wav.py "A sentence to save." out.wav
"""

import sys

import soundfile as sf

from pcgtts import Synthesizer

if len(sys.argv) != 3:
    sys.exit('usage: python examples/save_wav.py "A sentence to save." out.wav')
text, path = sys.argv[1], sys.argv[2]
synth = Synthesizer.from_pretrained()  # the built-in voice; or target=..., draft=..., codec=..., groups=...
audio = synth.synthesize(text)
sf.write(path, audio, 16000)
print(f"wrote {path}: {len(audio) / 16000:.2f} s")
