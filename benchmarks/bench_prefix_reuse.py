"""Time to first audio with prefix reuse off, in whole blocks (the runtime's), and token by token.

Utterances of one sentence template with new words each, from their first word on (the prompt's
chat-template head is shared), modes interleaved utterance by utterance after a warm-up. "tokens" emulates the reuse
the earlier scheme: the longest shared prefix, the rest in one batch; but a recomputed row sums
in another order than a fresh prefill's, so a seeded utterance depended on the one before it
. The runtime ("blocks") reuses whole blocks of `protocol.block_starts`, bit-exact.

    python benchmarks/bench_prefix_reuse.py [--utterances 60] [--target D --draft D --codec D --groups F]

With no --target: the built-in voice (on a CPU, its int8 onnxruntime exports).
"""

from __future__ import annotations

import argparse
import json
import statistics

from pcgtts.runtime.lm.protocol import SequenceMixin, common_prefix
from pcgtts.runtime.synthesizer import Synthesizer

BLOCKS = SequenceMixin.reusable_prefix, SequenceMixin.block_starts
# Utterances differ from their first word, as real ones do (a shared opening would favour reuse
# token by token, which can also reuse the shared words).
OPENINGS = ("Report", "Yesterday", "Number", "Every", "Maybe", "Somebody", "Quietly", "Seven", "Below", "Then", "All")


def token_granular(self, ids):
    n = min(self._kept, len(ids) - 1) if self.reuse_prefix and self._prompt is not None else 0
    return common_prefix(self._prompt[:n], ids[:n].cpu()) if n > 0 else 0


def one_block(self, ids):
    return [0]


def use(synth: Synthesizer, mode: str) -> None:
    lms = [lm for lm in (synth.target, synth.draft) if lm is not None]
    for lm in lms:
        lm.reuse_prefix = mode != "off"
    tokens = (token_granular, one_block)
    SequenceMixin.reusable_prefix, SequenceMixin.block_starts = tokens if mode == "tokens" else BLOCKS


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--utterances", type=int, default=60)
    for name in ("target", "draft", "codec", "groups"):
        ap.add_argument(f"--{name}")
    args = ap.parse_args()
    models = {k: getattr(args, k) for k in ("target", "draft", "codec", "groups") if getattr(args, k)}
    synth = Synthesizer.from_pretrained(**models, seed=0, max_new_tokens=40)
    synth.synthesize("Warm up.")
    modes = ("off", "blocks", "tokens")
    ttfa = {m: [] for m in modes}
    for i in range(args.utterances):
        mode = modes[i % len(modes)]
        use(synth, mode)
        stream = synth.stream(f"{OPENINGS[i % len(OPENINGS)]} {i} says something new about the weather.")
        list(stream)
        ttfa[mode].append(1000 * stream.stats.time_to_first_audio)
    use(synth, "blocks")
    rows = []
    print(f"{'prefix reuse':14s} {'TTFA p50 ms':>12s} {'p90 ms':>8s} {'n':>4s}")
    for mode, values in ttfa.items():
        values = sorted(values)
        row = {"mode": mode, "p50_ms": statistics.median(values), "p90_ms": values[max(0, int(0.9 * len(values)) - 1)],
               "n": len(values)}
        rows.append(row)
        print(f"{mode:14s} {row['p50_ms']:12.1f} {row['p90_ms']:8.1f} {row['n']:4d}")
    print(json.dumps({"rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
