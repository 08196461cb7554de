"""On-policy sampling throughput: B prompts sampled together (`train.distill.sample_together`).

    python benchmarks/bench_sampling.py TARGET_DIR [--batch 128] [--max-tokens 400] [--rounds 2] [--device cuda]
        [--sentences FILE]

Prompts are B sentences of the lab's sentence pool (fortunes and templates, past its held-out ones; or the
first B lines of --sentences, as `pcgtts train eagle --sentences` reads them), sampled at
T 0.8 (on a CPU, one thread), as `pcgtts train eagle --sample-batch B` samples them. Prints, per
round, the tokens the rows kept (each up to its stop token), the longest row, the seconds, kept
tokens a second and sequences a second; then one JSON line (`gpu_session.sh eagle` probes with it).
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sentences", help="a text file, one sentence a line (default: the lab's pool)")
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)
    from pcgtts.runtime.lm.torch_lm import TorchLM
    from pcgtts.runtime.text.prompt import build_prompt
    from pcgtts.train.corpus import CorpusConfig, sentence_pool
    from pcgtts.train.distill import read_sentences, sample_together

    target = TorchLM.load(args.target, device=args.device, max_length=1024)
    if args.sentences:
        texts = read_sentences(args.sentences)[:args.batch]
    else:
        texts = sentence_pool(CorpusConfig(out_dir="."))[24:24 + args.batch]
    prompts = [build_prompt(target.tokenizer, target.vocab, t) for t in texts]
    rounds = []
    for r in range(args.rounds):
        generator = torch.Generator(device=target.device).manual_seed(r)
        started = time.perf_counter()
        codes = sample_together(target, prompts, 0.8, args.max_tokens, generator)
        seconds = time.perf_counter() - started
        kept = sum(len(c) for c in codes)
        rounds.append({"round": r, "kept_tokens": kept, "longest": max(len(c) for c in codes),
                       "seconds": round(seconds, 2), "tokens_per_second": round(kept / seconds, 1),
                       "sequences_per_second": round(len(codes) / seconds, 2)})
        print(f"round {r}: {kept} tokens kept (longest row {rounds[-1]['longest']}) in {seconds:.1f} s: "
              f"{kept / seconds:.0f} tok/s, {len(codes) / seconds:.1f} sequences/s")
    print(json.dumps({"batch": args.batch, "max_tokens": args.max_tokens, "rounds": rounds}))


if __name__ == "__main__":
    main()
