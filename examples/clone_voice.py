"""Clone a voice from a recording: encode it once into a voice file, then reuse it.

    python examples/clone_voice.py reference.wav "What the reference says." "Text to say in that voice." out.wav

The reference can be any format soundfile reads, at any sample rate and channel count.
"""

import sys
from pathlib import Path

import soundfile as sf

from pcgtts import Synthesizer, Voice

ref_audio, ref_text, text, out = sys.argv[1:5]
synth = Synthesizer.from_pretrained()  # the built-in voice's models; or your own checkpoints

voice_file = Path(out).with_suffix(".voice")
if not voice_file.exists():  # encoding loads the codec's encoder (from the decoder's folder) once
    synth.voice_from_audio(ref_audio, ref_text).save(voice_file)

audio = synth.synthesize(text, voice=Voice.load(voice_file))
sf.write(out, audio, 16000)
print(f"wrote {out} in the voice of {ref_audio}")
