"""Clone a voice from a recording: encode it once into a voice file, then reuse it.

    python examples/clone_voice.py reference.wav "What the reference says." "Text to say in that voice." out.wav

The reference can be any format soundfile reads, at any sample rate and channel count. The encoded
voice is kept beside the output as `<out>.<hash>.voice`, keyed by the reference's audio and transcript,
so a second run with the same reference skips the encoding and a run with another reference never
reuses the first one's voice.
"""

import hashlib
import sys
from pathlib import Path

import soundfile as sf

from pcgtts import Synthesizer, Voice

if len(sys.argv) != 5:
    sys.exit(__doc__.strip().splitlines()[2].strip().replace("python ", "usage: python ", 1))
ref_audio, ref_text, text, out = sys.argv[1:5]
if not Path(ref_audio).is_file():
    sys.exit(f"error: no such reference recording: {ref_audio}")

key = hashlib.sha256(Path(ref_audio).read_bytes() + b"\0" + ref_text.encode()).hexdigest()[:16]
voice_file = Path(out).with_suffix(f".{key}.voice")
synth = Synthesizer.from_pretrained()  # the built-in voice's models; or your own checkpoints
if not voice_file.exists():  # encoding loads the codec's encoder (from the decoder's folder) once
    synth.voice_from_audio(ref_audio, ref_text).save(voice_file)

audio = synth.synthesize(text, voice=Voice.load(voice_file))
sf.write(out, audio, 16000)
print(f"wrote {out} in the voice of {ref_audio}")
