"""onnxruntime's KV buffer: grown with the sequence (the runtime's way) vs sized for max_length up front.

Same process, same exported pair, cases interleaved; LM only (no codec).

    python benchmarks/bench_cache_growth.py --target LAB/onnx/target --draft LAB/onnx/draft \
        --groups LAB/v1/groups.pcg --max-length 4096
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from pcgtts.groups.table import GroupTable
from pcgtts.runtime.config import DecodeConfig, SamplingConfig
from pcgtts.runtime.decode.proposers import EagleProposer
from pcgtts.runtime.decode.loop import decode
from pcgtts.runtime.decode.steps import DecodeStats
from pcgtts.runtime.lm.onnxruntime import OrtLM
from pcgtts.runtime.text.prompt import build_prompt

TEXT = "The quick brown fox jumps over the lazy dog, and then it runs far away."


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="an onnxruntime export (with its EAGLE graph for eagle-pcg)")
    ap.add_argument("--draft", required=True)
    ap.add_argument("--groups", required=True)
    ap.add_argument("--max-length", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    groups = GroupTable.load(args.groups).to_device("cpu")
    cases = {}
    for grows in (False, True):
        OrtLM.growable = grows  # class attribute read when the buffer is allocated
        target = OrtLM.load(args.target, max_length=args.max_length, threads=1)
        draft = OrtLM.load(args.draft, max_length=args.max_length, threads=1, tokenizer=target.tokenizer)
        proposer = EagleProposer.for_target(target, None) if target.has_eagle else None
        cases["grows" if grows else f"fixed {args.max_length}"] = (target, draft, proposer)
    OrtLM.growable = True
    prompt = build_prompt(target.tokenizer, target.vocab, TEXT)
    policies = ["ar"] + (["eagle-pcg"] if proposer is not None else [])
    rates: dict[tuple[str, str], list[float]] = {}
    for rnd in range(args.rounds + 1):  # round 0 warms up
        for name, (target, draft, proposer) in cases.items():
            for policy in policies:
                config = DecodeConfig(policy=policy, draft_length=3, max_new_tokens=args.tokens, adaptive_draft=False,
                                      sampling=SamplingConfig(temperature=0.8))
                t0 = time.perf_counter()
                n = sum(len(b) for b in decode(target, draft, prompt, config, torch.Generator().manual_seed(rnd),
                                               groups, DecodeStats(), proposer=proposer))
                if rnd:
                    rates.setdefault((name, policy), []).append(n / (time.perf_counter() - t0))
    rows = [{"cache": name, "policy": policy, "tokens_per_s": sum(v) / len(v)} for (name, policy), v in rates.items()]
    for r in rows:
        print(f"{r['cache']:>12}  {r['policy']:<10} {r['tokens_per_s']:7.1f} tok/s")
    print(json.dumps({"max_length": args.max_length, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
