"""Stream speech to the default sound device as it is generated.

    python examples/stream_to_speaker.py "Hello there. This is streamed."  [--target DIR --draft DIR --codec DIR --groups FILE]

With no model given it uses the built-in demo models (random weights: the audio is not speech).
"""

import argparse

from pcgtts.tools.demo import ensure_demo
from pcgtts.runtime.audio.playback import open_sink
from pcgtts.runtime.synthesizer import Synthesizer

ap = argparse.ArgumentParser()
ap.add_argument("text")
ap.add_argument("--target"), ap.add_argument("--draft"), ap.add_argument("--codec"), ap.add_argument("--groups")
ap.add_argument("--device", help="playback device; 'null' for none")
args = ap.parse_args()
models = {"target": args.target, "draft": args.draft, "codec": args.codec, "groups": args.groups}
if not args.target:
    models = {k: str(v) for k, v in ensure_demo().items()}

synth = Synthesizer.from_pretrained(**models, policy="pcg")
with open_sink(args.device) as sink, synth.stream(args.text) as chunks:
    for chunk in chunks:  # each chunk is float32 at 16 kHz, ready as soon as its tokens are
        sink.write(chunk)
print(f"time to first audio {chunks.stats.time_to_first_audio:.2f} s, "
      f"real-time factor {chunks.stats.real_time_factor:.2f}, underruns {sink.stats().underruns}")
