"""Stream speech to the default sound device as it is generated.

    python examples/stream_to_speaker.py "Hello there. This is streamed."  [--target DIR --draft DIR --codec DIR --groups FILE]

With no model given it uses the built-in voice.
"""

import argparse

from pcgtts import Synthesizer
from pcgtts.runtime.audio.playback import open_sink

ap = argparse.ArgumentParser()
ap.add_argument("text")
ap.add_argument("--target"), ap.add_argument("--draft"), ap.add_argument("--codec"), ap.add_argument("--groups")
ap.add_argument("--audio-device", help="playback device; 'null' for none")
args = ap.parse_args()

synth = Synthesizer.from_pretrained(target=args.target, draft=args.draft, codec=args.codec, groups=args.groups)
with open_sink(args.audio_device) as sink, synth.stream(args.text) as chunks:
    for chunk in chunks:  # each chunk is float32 at 16 kHz, ready as soon as its tokens are
        sink.write(chunk)
print(f"time to first audio {chunks.stats.time_to_first_audio:.2f} s, "
      f"real-time factor {chunks.stats.real_time_factor:.2f}, underruns {sink.stats().underruns}")
