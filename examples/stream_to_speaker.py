"""Stream speech to a sound device as it is generated, and say how fast it came.

    python examples/stream_to_speaker.py "Hello there. This is streamed."
    python examples/stream_to_speaker.py "Hello there." --audio-device null

The first plays on the default output device. `--audio-device NAME|INDEX` picks another device, and
`null` discards the audio at the pace a device would play it (to time a machine without a sound card).
With no model given it uses the built-in voice; `--target DIR --draft DIR --codec DIR --groups FILE`
name your own.
"""

import argparse

from pcgtts import Synthesizer
from pcgtts.runtime.audio.playback import check_output_device, open_sink
from pcgtts.runtime.text.prompt import check_text

ap = argparse.ArgumentParser(prog="examples/stream_to_speaker.py")
ap.add_argument("text")
ap.add_argument("--target"), ap.add_argument("--draft"), ap.add_argument("--codec"), ap.add_argument("--groups")
ap.add_argument("--audio-device", help="playback device name or index; 'null' discards the audio")
args = ap.parse_args()
try:  # bad arguments are reported before any model loads
    check_text(args.text)
    check_output_device(args.audio_device)
    synth = Synthesizer.from_pretrained(target=args.target, draft=args.draft, codec=args.codec, groups=args.groups)
except (FileNotFoundError, ValueError) as err:
    ap.error(str(err))

with open_sink(args.audio_device) as sink, synth.stream(args.text) as chunks:
    for chunk in chunks:  # each chunk is float32 at 16 kHz, ready as soon as its tokens are
        sink.write(chunk)
print(f"time to first audio {chunks.stats.time_to_first_audio:.2f} s, "
      f"real-time factor {chunks.stats.real_time_factor:.2f}, underruns {sink.stats().underruns}")
