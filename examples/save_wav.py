"""Synthesise text to a WAV file (the whole waveform, by consuming the stream).

    python examples/save_wav.py "A sentence to save." out.wav
"""

import sys

import soundfile as sf

from pcgtts.tools.demo import ensure_demo
from pcgtts.runtime.synthesizer import Synthesizer

text, path = sys.argv[1], sys.argv[2]
models = {k: str(v) for k, v in ensure_demo().items()}  # or your own target/draft/codec/groups paths
synth = Synthesizer.from_pretrained(**models, policy="pcg")
audio = synth.synthesize(text)
sf.write(path, audio, 16000)
print(f"wrote {path}: {len(audio) / 16000:.2f} s")
