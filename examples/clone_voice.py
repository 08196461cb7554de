"""Clone a voice from a recording: encode it once into a voice file, then reuse it.

    python examples/clone_voice.py reference.wav "What the reference says." "Text to say in that voice." out.wav

The reference can be any format soundfile reads, at any sample rate and channel count.
"""

import sys
from pathlib import Path

import soundfile as sf

from pcgtts.runtime.audio.codec import Codec
from pcgtts.tools.demo import ensure_demo
from pcgtts.runtime.synthesizer import Synthesizer
from pcgtts.runtime.audio.voice import Voice

ref_audio, ref_text, text, out = sys.argv[1:5]
models = {k: str(v) for k, v in ensure_demo().items()}  # or your own checkpoints

voice_file = Path(out).with_suffix(".voice")
if not voice_file.exists():  # encoding needs the full codec (semantic encoder included), once
    Voice.from_audio(ref_audio, ref_text, Codec.from_pretrained(models["codec"], decode_only=False)).save(voice_file)

synth = Synthesizer.from_pretrained(**models, policy="pcg")
audio = synth.synthesize(text, voice=Voice.load(voice_file))
sf.write(out, audio, 16000)
print(f"wrote {out} in the voice of {ref_audio}")
