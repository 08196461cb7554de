"""Batched plain decoding: aggregate tokens/s of `BatchedLM` at batch sizes B over one model folder.

B sequences share one copy of the weights (runtime/lm/batched.py); each step appends one token to every
slot (greedy, the step's own argmax fed back), so a step reads the weights once for all B. Per B it
reports the median step time, the aggregate and per-stream tokens/s, and, given the memory bandwidth
(`--bandwidth-gbs`), the weight-read floor: the bytes of weights a step reads (every layer and the
speech head; the embedding table's B rows are left out) / the bandwidth, the shortest a step can take
while decoding is bound by memory, and the share of it achieved (floor / measured step time). Prefill
is not timed. Progress on stderr, a table, then one JSON line (`--json PATH` writes it too).

    pcgtts models scale --shape llasa-1b --dtype bfloat16 --out /tmp/s1b
    python benchmarks/bench_batch_lm.py --target /tmp/s1b/target --device cuda --dtype bfloat16 \\
        --batch 1,2,4,8,16,32,64 --bandwidth-gbs 4800       # H200 HBM3e; H100 SXM: 3350
    python benchmarks/bench_batch_lm.py --target /tmp/s1b/target --quantize int8 --batch 1,2,4,8   # CPU
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT_TOKENS = 16  # per slot: the text-start token then speech tokens, as a short prompt would give


def batch_sizes(text: str) -> list[int]:
    """"1,2,4" -> [1, 2, 4]; each in [1, MAX_BATCH], no repeats."""
    from pcgtts.runtime.config import MAX_BATCH

    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not sizes or not all(1 <= b <= MAX_BATCH for b in sizes) or len(set(sizes)) != len(sizes):
        raise argparse.ArgumentTypeError(f"distinct batch sizes in [1, {MAX_BATCH}], got {text!r}")
    return sizes


def weight_bytes(model) -> int:
    """Bytes of the weights one decode step reads: every parameter and weight buffer but the
    embedding table (a step reads only its rows of the new tokens), index tables and the rotary / mask
    tables; an int8 layer's codes count a byte each."""
    import torch

    total = 0
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if name.startswith("embed_tokens") or any(part in name for part in ("inv_freq", "causal", "rope")) \
                or tensor.dtype in (torch.int64, torch.int32, torch.bool):  # index tables, masks
            continue
        total += tensor.numel() * tensor.element_size()
    from pcgtts.runtime.lm.int8 import Int8Linear

    # int8 layers hold their codes packed for their kernel, outside the module's tensors: a byte each
    total += sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, Int8Linear))
    return total


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """One-line errors before any model loads."""
    if not (Path(args.target) / "config.json").is_file():
        parser.error(f"--target {args.target}: not a model folder (no config.json)")
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            parser.error(f"--device {args.device}: this torch sees no CUDA device")
        if args.quantize != "none":
            parser.error("--quantize int8 runs on a CPU (the torch backend's int8 layers)")
    elif args.device != "cpu":
        parser.error(f"--device {args.device}: cpu, cuda or cuda:N")
    if args.quantize != "none" and args.dtype != "float32":
        parser.error("--quantize int8 takes float32 weights (--dtype float32)")
    if not (1 <= args.tokens <= 4096 and 1 <= args.runs <= 100 and 0 <= args.warmup <= 100):
        parser.error("--tokens must lie in [1, 4096], --runs in [1, 100], --warmup in [0, 100]")
    if args.bandwidth_gbs is not None and not args.bandwidth_gbs > 0:
        parser.error("--bandwidth-gbs must be positive")
    if args.json is not None and (args.json.is_dir() or any(p.exists() and not p.is_dir() for p in args.json.parents)):
        parser.error(f"--json {args.json}: not a file that can be written (a folder, or under a file)")


def measure(batched, vocab, size: int, tokens: int, runs: int, warmup: int, sync) -> dict:
    """Median over `runs` of `tokens` steps of all `size` slots (after `warmup` untimed steps)."""
    import torch

    slots = list(range(size))
    prompt = torch.tensor([vocab.text_start_id] + [vocab.speech_offset + i % vocab.num_speech
                                                   for i in range(PROMPT_TOKENS - 1)])
    for slot in slots:
        batched.prefill(slot, prompt)
    first = torch.full((size, 1), vocab.speech_offset, dtype=torch.long)
    times = []
    for count in ([warmup] if warmup else []) + [tokens] * runs:  # the warm-up run first, untimed
        for slot in slots:
            batched.rollback(slot, PROMPT_TOKENS)
        ids = first.to(batched.device)
        sync()
        started = time.perf_counter()
        for _ in range(count):
            logits = batched.step(slots, ids)  # [B, 1, V_r]
            ids = vocab.restricted_to_token_ids(logits[:, -1].argmax(-1)).view(size, 1)
        sync()
        times.append((time.perf_counter() - started) / count)
    times = times[1:] if warmup else times
    step = statistics.median(times)
    return {"batch": size, "step_ms": step * 1000, "tok_s": size / step, "tok_s_per_stream": 1 / step,
            "step_ms_runs": [t * 1000 for t in times]}


def commit() -> str | None:
    try:
        return subprocess.run(["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "--short", "HEAD"],
                              check=True, capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--target", required=True,
                        help="a LLaSA-format model folder (e.g. `pcgtts models scale`'s target/)")
    parser.add_argument("--batch", type=batch_sizes, default=batch_sizes("1,2,4,8,16"),
                        help="batch sizes, one after another (default 1,2,4,8,16)")
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--quantize", choices=("none", "int8"), default="none", help="int8 linear layers (CPU)")
    parser.add_argument("--tokens", type=int, default=64, help="timed steps per run (default 64)")
    parser.add_argument("--runs", type=int, default=3, help="timed runs per batch size; the median is reported")
    parser.add_argument("--warmup", type=int, default=8, help="untimed steps before the runs of each batch size")
    parser.add_argument("--bandwidth-gbs", type=float,
                        help="memory bandwidth, GB/s (1e9 bytes), for the weight-read floor (H200 4800, H100 SXM 3350)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--json", type=Path, help="also write the JSON report here")
    args = parser.parse_args(argv)
    check_args(parser, args)

    import torch

    from pcgtts.runtime.lm.batched import BatchedLM
    from pcgtts.runtime.lm.torch_lm import TorchLM

    if args.threads:
        torch.set_num_threads(args.threads)
    max_length = PROMPT_TOKENS + max(args.tokens, args.warmup) + 8
    print(f"loading {args.target} on {args.device} ({args.dtype}, quantize {args.quantize})", file=sys.stderr)
    lm = TorchLM.load(args.target, device=args.device, dtype=args.dtype, max_length=max_length, cuda_graphs=False,
                      quantize=args.quantize)
    read = weight_bytes(lm.model)
    floor_s = read / (args.bandwidth_gbs * 1e9) if args.bandwidth_gbs else None
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    rows = []
    for size in args.batch:
        batched = BatchedLM(lm, size, max_length=max_length)
        row = measure(batched, lm.vocab, size, args.tokens, args.runs, args.warmup, sync)
        batched.release()
        if floor_s is not None:
            row["floor_step_ms"] = floor_s * 1000
            row["floor_tok_s"] = size / floor_s
            row["floor_share"] = floor_s / (row["step_ms"] / 1000)
        rows.append(row)
        print(f"  B={size}: {row['step_ms']:.2f} ms a step, {row['tok_s']:.1f} tok/s", file=sys.stderr)
    base = rows[0]["tok_s"] / rows[0]["batch"]
    for row in rows:
        row["x_batch1"] = row["tok_s"] / base if args.batch[0] == 1 else None
    device = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu"
    report = {"benchmark": "bench_batch_lm", "target": str(args.target), "device": device, "dtype": args.dtype,
              "quantize": args.quantize, "weight_bytes": read, "bandwidth_gbs": args.bandwidth_gbs,
              "tokens": args.tokens, "runs": args.runs, "date": datetime.date.today().isoformat(), "commit": commit(),
              "command": " ".join(["python benchmarks/bench_batch_lm.py",
                                   *(argv if argv is not None else sys.argv[1:])]),
              "rows": rows}
    print(f"{'B':>4} {'ms/step':>9} {'tok/s':>10} {'tok/s/stream':>13} {'x B=1':>7} {'floor %':>8}")
    for row in rows:
        share = f"{100 * row['floor_share']:.0f}" if "floor_share" in row else "-"
        ratio = f"{row['x_batch1']:.2f}" if row["x_batch1"] is not None else "-"
        print(f"{row['batch']:>4} {row['step_ms']:>9.2f} {row['tok_s']:>10.1f} {row['tok_s_per_stream']:>13.1f} "
              f"{ratio:>7} {share:>8}")
    print(f"weights read a step: {read / 2**20:.1f} MiB" + (f"; floor {floor_s * 1000:.3f} ms a step at "
                                                            f"{args.bandwidth_gbs:g} GB/s" if floor_s else ""))
    line = json.dumps(report)
    print(line)
    if args.json:
        from pcgtts.runtime.files import atomic_output

        args.json.parent.mkdir(parents=True, exist_ok=True)
        with atomic_output(args.json) as tmp:
            tmp.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
