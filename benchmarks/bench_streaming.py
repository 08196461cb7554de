"""Streaming-decode settings: streamed audio against a one-shot decode of the same tokens.

For each StreamConfig setting, decodes the same token sequences (a) in one pass and (b) through
`WindowDecoder` as a stream would, and reports the SNR of (b) against (a), a log-mel distance,
the number of codec calls and the decode work per emitted token (window tokens decoded / tokens),
the first chunk's own SNR and how many tokens the first audio waits for. Defaults in `runtime/audio/streaming.py` come from this table.

    python benchmarks/bench_streaming.py [--codec DIR [--codes NPZ]] [--tokens 400] [--seqs 4]

With no --codec it uses the demo codec (random weights: attention spreads over the whole
window, so context matters more than in the trained decoder; the figures are pessimistic).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict

import numpy as np
import torch

from pcgtts.runtime.audio.chunk import SAMPLES_PER_TOKEN
from pcgtts.runtime.audio.streaming import WindowDecoder
from pcgtts.runtime.config import StreamConfig

SETTINGS = {  # "la": lookahead, later chunks / the first; "xf": cross-fade samples
    "no context, no fade": StreamConfig(left_context_tokens=0, codec_lookahead=0, first_chunk_lookahead=0,
                                        crossfade_samples=0),
    "left 25, la 4/4, xf 320": StreamConfig(left_context_tokens=25, codec_lookahead=4, first_chunk_lookahead=4,
                                            crossfade_samples=320),
    "left 50, la 8/8, xf 640": StreamConfig(first_chunk_lookahead=8),
    "left 100, la 12/12, xf 960": StreamConfig(left_context_tokens=100, codec_lookahead=12, first_chunk_lookahead=12,
                                               crossfade_samples=960),
    "left 50, la 8/8, chunk 50": StreamConfig(first_chunk_lookahead=8, chunk_tokens=50),
    "left 50, la 8/8, first chunk 10": StreamConfig(first_chunk_lookahead=8, first_chunk_tokens=10),
    "left 50, la 8/4, xf 640": StreamConfig(first_chunk_lookahead=4),
    "default (left 50, la 8/2, xf 640)": StreamConfig(),
}


def mel(x: np.ndarray) -> np.ndarray:
    """Log-mel spectrogram (80 triangular bands to 8 kHz, 25 ms windows, 10 ms hop)."""
    spec = torch.stft(torch.from_numpy(x), 400, 160, window=torch.hann_window(400), return_complex=True).abs() ** 2
    freqs = torch.linspace(0, 8000, spec.shape[0])
    edges = 700 * (10 ** (torch.linspace(0, 2595 * np.log10(1 + 8000 / 700), 82) / 2595) - 1)
    lo, mid, hi = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    bank = torch.clamp(torch.minimum((freqs - lo) / (mid - lo), (hi - freqs) / (hi - mid)), min=0)  # [80, F]
    return torch.log(bank @ spec + 1e-6).numpy()


def snr_db(ref: np.ndarray, out: np.ndarray) -> float:
    return float(10 * np.log10((ref ** 2).sum() / max(((out - ref) ** 2).sum(), 1e-20)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--codec", help="X-codec2 directory (default: the demo codec)")
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--seqs", type=int, default=4)
    ap.add_argument("--codes", help="an .npz of real code sequences (e.g. a lab corpus's codes.npz): the first "
                                    "--seqs arrays of at least --tokens codes are used instead of random codes")
    args = ap.parse_args()
    from pcgtts.runtime.audio.codec import Codec

    if args.codec is None:
        from pcgtts.tools.demo import ensure_demo

        args.codec = str(ensure_demo()["codec"])
    codec = Codec.from_pretrained(args.codec)
    if args.codes:
        with np.load(args.codes) as npz:
            long_enough = (npz[k] for k in sorted(npz.files) if npz[k].size >= args.tokens)
            seqs = [np.asarray(a, np.int64).reshape(-1)[:args.tokens] for _, a in zip(range(args.seqs), long_enough)]
        if len(seqs) < args.seqs:
            raise SystemExit(f"{args.codes}: fewer than {args.seqs} sequences of {args.tokens} codes")
    else:
        rng = np.random.default_rng(0)
        seqs = [rng.integers(0, 65536, args.tokens) for _ in range(args.seqs)]
    refs = [codec.decode(s) for s in seqs]
    rows = []
    for name, cfg in SETTINGS.items():
        calls, window_tokens, snrs, first_snrs, first_levels, mels, secs = 0, 0, [], [], [], [], 0.0
        first = cfg.first_chunk_tokens * SAMPLES_PER_TOKEN

        def counted(codes):
            nonlocal calls, window_tokens
            calls += 1
            window_tokens += len(codes)
            return codec.decode(codes)

        for seq, ref in zip(seqs, refs):
            dec = WindowDecoder(counted, cfg)
            t0 = time.perf_counter()
            parts = []
            for i in range(0, len(seq), 3):  # bursts as the speculative loop yields them
                parts += dec.push(seq[i:i + 3])
            parts.append(dec.flush())
            secs += time.perf_counter() - t0
            out = np.concatenate(parts)
            assert len(out) == len(ref)
            snrs.append(snr_db(ref, out))
            # The first chunk's error against the whole utterance's level: an utterance often
            # starts near silence, where its own SNR says little about what is heard.
            first_snrs.append(snr_db(ref[:first], out[:first]))
            first_levels.append(float(10 * np.log10((ref ** 2).mean() / max(((out - ref)[:first] ** 2).mean(), 1e-20))))
            mels.append(float(np.abs(mel(ref) - mel(out)).mean()))
        rows.append({"setting": name, **asdict(cfg), "snr_db": float(np.mean(snrs)),
                     "first_chunk_snr_db": float(np.mean(first_snrs)),
                     "first_chunk_error_below_speech_db": float(np.mean(first_levels)),
                     "first_audio_after_tokens": cfg.first_chunk_tokens + cfg.first_chunk_lookahead, "log_mel_l1": float(np.mean(mels)),
                     "decode_calls_per_100_tokens": 100 * calls / (args.tokens * args.seqs),
                     "decoded_tokens_per_token": window_tokens / (args.tokens * args.seqs),
                     "ms_per_token": 1000 * secs / (args.tokens * args.seqs)})
        r = rows[-1]
        print(f"{name:34s} SNR {r['snr_db']:6.2f} dB  first chunk {r['first_chunk_snr_db']:6.2f} dB "
              f"(error {r['first_chunk_error_below_speech_db']:5.1f} dB below speech)  "
              f"first audio after {r['first_audio_after_tokens']:2d} tokens  log-mel L1 {r['log_mel_l1']:.3f}  "
              f"calls/100 tok {r['decode_calls_per_100_tokens']:5.1f}  work x{r['decoded_tokens_per_token']:.2f}  "
              f"{r['ms_per_token']:.2f} ms/token", file=sys.stderr)
    print(json.dumps({"codec": args.codec, "tokens": args.tokens, "seqs": args.seqs, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
