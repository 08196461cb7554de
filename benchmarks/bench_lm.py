"""Speech-token generation speed: our decode loop per policy vs Hugging Face on the same models.

Side by side in one run (this machine is noisy: compare the ratios):
  * ours `ar` / `draft` / `sd` / `ssd` / `pcg`           (runtime/decode/loop.py, static KV cache)    
  * HF `model.generate` (sampling, same length, same dtype)           -> baseline for `ar`
  * HF assisted generation (`assistant_model=` the same draft, sampling) -> baseline for `sd`/`pcg`
Reports tokens/s, target forwards per token, acceptance, mean accepted length, and on the
speculative rules the time per verify step and the share of a step spent outside the two
models' forward passes.

    python benchmarks/bench_lm.py --model demo [--adaptive]     # CPU, built-in demo pair (+ adaptive L rows)
    python benchmarks/bench_lm.py --model wide                  # CPU, hidden 1024 x 8 layers
    python benchmarks/bench_lm.py --model llasa1b --device cuda --dtype bfloat16   # GPU
    python benchmarks/bench_lm.py --model llasa1b --device cuda --dtype bfloat16 --steps-per-sync 0,8  # + whole steps graphed
    python benchmarks/bench_lm.py --model demo --backends torch,onnxruntime --no-hf  # ORT vs torch
    python benchmarks/bench_lm.py --model demo --backends torch,torch-compiled     # + steps through torch.compile
    python benchmarks/bench_lm.py --target LAB/v0/target --draft LAB/v0/draft --groups LAB/v0/groups.pcg \
        --backends torch,torch-full-head       # a trained pair; its digit head vs the same head row by row
    python benchmarks/bench_lm.py --target S/target --draft S/draft --groups S/groups.pcg \
        --eagle S/target/eagle_draft.safetensors --policies ar,sd,pcg,eagle-pcg  # S from `pcgtts models scale`
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from pcgtts.groups.build import build_groups, theta_for_mean_size
from pcgtts.runtime.lm.checkpoint import load_speech_embeddings
from pcgtts.runtime.config import DEVICE_STEP_POLICIES, DecodeConfig, SamplingConfig
from pcgtts.tools.demo import DemoLMConfig, build_demo_tokenizer, confuse_draft_head, write_demo_lm
from pcgtts.train.subset_draft import make_layer_subset_draft
from pcgtts.runtime.lm.torch_lm import TorchLM
from pcgtts.runtime.text.prompt import build_prompt
from pcgtts.runtime.decode.loop import decode
from pcgtts.runtime.decode.steps import DecodeStats

SHAPES = {
    "demo": (DemoLMConfig(), 2),
    "wide": (DemoLMConfig(hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=4, intermediate_size=4096), 2),
    # LLaSA-1B: hidden 2048, 16 layers, 32/8 heads, 8192 MLP, 193,800-token vocabulary, 3-layer draft
    "llasa1b": (DemoLMConfig(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, intermediate_size=8192,
                             vocab_size=193800, save_dtype="bfloat16"), 3),
}
TEXT = "The quick brown fox jumps over the lazy dog, and then it runs far away."


def make_models(name: str, root: Path) -> tuple[Path, Path]:
    cfg, draft_layers = SHAPES[name]
    target = root / name / "target"
    if not (target / "config.json").exists():
        write_demo_lm(target, cfg, tokenizer=build_demo_tokenizer())
        draft = make_layer_subset_draft(target, root / name / "draft", draft_layers)
        confuse_draft_head(draft, cfg.draft_confusion, cfg.num_speech, seed=0)  # as in the demo pair
    return target, root / name / "draft"


def load_onnx_pair(target_dir: Path, draft_dir: Path, device: str, eagle: str | None = None):
    """The pair on onnxruntime, exported (and numerically checked) once beside the checkpoints;
    `eagle`: the target's EAGLE draft, exported with it."""
    from pcgtts.export.onnx_lm import export_lm
    from pcgtts.runtime.lm.onnxruntime import OrtLM

    lms = []
    for model_dir, draft_file in ((target_dir, eagle), (draft_dir, None)):
        onnx_dir = model_dir.with_name(model_dir.name + "-onnx")
        meta = onnx_dir / "pcgtts-lm.json"
        if not meta.exists() or (draft_file and '"eagle"' not in meta.read_text()):
            export_lm(model_dir, onnx_dir, max_length=1024, eagle=draft_file)
        lms.append(OrtLM.load(onnx_dir, device=device, max_length=1024, tokenizer=lms[0].tokenizer if lms else None))
    return lms


def sync_fn(device: str):
    return torch.cuda.synchronize if device.startswith("cuda") else None


def run_ours(target, draft, prompt, policy, tokens, groups, seed, device, draft_length, proposer=None,
             adaptive=False, steps_per_sync=0, compile_steps=False):
    """One decode; a fixed draft length unless `adaptive` (then L <= draft_length per step, the
    runtime's default; HF's assisted generation also adapts its number of proposals).
    steps_per_sync > 0: whole steps on the device (runtime/decode/device_loop.py), their forwards
    compiled first with `compile_steps`."""
    config = DecodeConfig(policy=policy, draft_length=draft_length, max_new_tokens=tokens, adaptive_draft=adaptive,
                          sampling=SamplingConfig(temperature=0.8), steps_per_sync=steps_per_sync,
                          compile_steps=compile_steps)
    gen = torch.Generator(device=device).manual_seed(seed)
    stats = DecodeStats()
    sync = sync_fn(device)
    if sync:
        sync()
    t0 = time.perf_counter()
    n = sum(len(b) for b in decode(target, draft, prompt, config, gen, groups, stats, proposer=proposer))
    if sync:
        sync()
    return n, time.perf_counter() - t0, stats


def run_hf(hf_target, hf_draft, prompt, tokens, seed, device):
    ids = prompt[None].to(device)
    kwargs = dict(do_sample=True, temperature=0.8, top_p=1.0, max_new_tokens=tokens, min_new_tokens=tokens,
                  pad_token_id=0)
    if hf_draft is not None:
        kwargs["assistant_model"] = hf_draft
    torch.manual_seed(seed)
    sync = sync_fn(device)
    if sync:
        sync()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = hf_target.generate(ids, **kwargs)
    if sync:
        sync()
    return out.shape[1] - ids.shape[1], time.perf_counter() - t0


def scaled_note(target_dir: Path) -> str | None:
    """What a `pcgtts models scale` folder's models are (its SCALED.json), so the table says so."""
    record = target_dir.parent / "SCALED.json"
    return json.loads(record.read_text())["what"] if record.is_file() else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(SHAPES), default="demo")
    ap.add_argument("--target", help="an existing target checkpoint instead of --model's synthetic shape")
    ap.add_argument("--draft", help="its draft (with --target)")
    ap.add_argument("--groups", help="its group table (.pcg; default: built at --theta from the embeddings)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", type=int, default=200, help="speech tokens generated per run")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--draft-length", type=int, default=3)
    ap.add_argument("--theta", type=float,
                    help="group threshold when no --groups is given (default: 0.25 on the synthetic shapes, ~ radius-sqrt(2) "
                         "lattice balls; with --target the theta whose groups average 140 members, the paper's size)")
    ap.add_argument("--policies", default="ar,draft,sd,ssd,pcg")
    ap.add_argument("--eagle", help="an EAGLE draft for the target (eagle-* policies; exported with it for onnxruntime)")
    ap.add_argument("--no-hf", action="store_true", help="skip the Hugging Face baselines")
    ap.add_argument("--adaptive", action="store_true",
                    help="also run each speculative policy with the adaptive draft length (the runtime's default)")
    ap.add_argument("--cuda-graphs", choices=("on", "off", "both"), default="on")
    ap.add_argument("--steps-per-sync", default="0",
                    help="comma list; K > 0 adds rows of whole steps on the device (ar/sd/ssd/pcg, torch backend, "
                         "CUDA graphs of the whole step on a GPU), K queued per host read")
    ap.add_argument("--compile-steps", action="store_true",
                    help="also run each whole-step row with its forwards through torch.compile (inductor) first")
    ap.add_argument("--backends", default="torch",
                    help="comma list: torch, torch-full-head (a digit-factorised head computed row by row), "
                         "torch-int8 (int8 linear layers, CPU), torch-compiled (steps through torch.compile, "
                         "CPU), onnxruntime (exported once, cached)")
    ap.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "pcgtts-bench-models"))
    args = ap.parse_args()

    dtype = getattr(torch, args.dtype)
    if (args.target is None) != (args.draft is None):
        ap.error("--target and --draft go together")
    if args.target:
        target_dir, draft_dir, args.model = Path(args.target), Path(args.draft), Path(args.target).parent.name
    else:
        target_dir, draft_dir = make_models(args.model, Path(args.cache))
    note = scaled_note(target_dir)
    tok = None
    t0 = time.perf_counter()
    if args.groups:
        from pcgtts.groups.table import GroupTable

        groups = GroupTable.load(args.groups)
    else:
        emb, vocab, _ = load_speech_embeddings(target_dir)
        theta = args.theta if args.theta is not None else theta_for_mean_size(emb, 140) if args.target else 0.25
        groups = build_groups(emb, theta, device=args.device, progress=False, max_bytes=2 << 30)
        del emb
    group_build_s = time.perf_counter() - t0
    device_groups = groups.to_device(args.device)

    graph_modes = {"on": [True], "off": [False], "both": [False, True]}[args.cuda_graphs]
    if not args.device.startswith("cuda"):
        graph_modes = [False]
    chosen = args.backends.split(",")
    variants = [("torch", g) for g in graph_modes] if "torch" in chosen else []
    variants += [(backend, False) for backend in ("torch-full-head", "torch-int8", "torch-compiled", "onnxruntime")
                 if backend in chosen]
    rows, failed = [], []
    for backend, graphs in variants:
        if backend.startswith("torch"):
            common = dict(device=args.device, dtype=dtype, max_length=1024, cuda_graphs=graphs,
                          graph_token_counts=(1, args.draft_length + 1), digit_head=backend != "torch-full-head",
                          quantize="int8" if backend == "torch-int8" else "none", compiled=backend == "torch-compiled")
            target = TorchLM.load(target_dir, tokenizer=tok, **common)
            draft = TorchLM.load(draft_dir, tokenizer=target.tokenizer, **common)
        else:
            target, draft = load_onnx_pair(target_dir, draft_dir, args.device, args.eagle)
        prompt = build_prompt(target.tokenizer, target.vocab, TEXT)
        proposer = None
        if args.eagle:
            from pcgtts.runtime.decode.proposers import EagleProposer

            # onnxruntime: the draft was exported with the target (load_onnx_pair passes it on)
            proposer = EagleProposer.for_target(target, None if backend == "onnxruntime" else args.eagle)
        policies = args.policies.split(",")
        per_sync = [int(k) for k in args.steps_per_sync.split(",")]
        cases = [(policy, False, k, False) for k in per_sync for policy in policies
                 if not k or (policy in DEVICE_STEP_POLICIES and backend.startswith("torch")
                              and graphs == args.device.startswith("cuda"))]  # whole steps: graphed on CUDA anyway
        if args.compile_steps:
            cases += [(policy, False, k, True) for policy, _, k, _ in cases if k]
        if args.adaptive:
            cases += [(policy, True, 0, False) for policy in policies if policy not in ("ar", "draft")]
        for policy, adaptive, k, compiled in cases:
            if policy.startswith("eagle") and proposer is None:
                continue  # the EAGLE draft reads the torch target's hidden states
            label = f"{policy} auto" if adaptive else f"{policy} k{k}{'c' if compiled else ''}" if k else policy
            try:
                run_ours(target, draft, prompt, policy, 20, device_groups, 0, args.device, args.draft_length,
                         proposer, adaptive, k, compiled)  # warm-up (an adaptive case measures its step costs here)
                results = [run_ours(target, draft, prompt, policy, args.tokens, device_groups, seed, args.device,
                                    args.draft_length, proposer, adaptive, k, compiled)
                           for seed in range(1, args.runs + 1)]
            except Exception as err:  # noqa: BLE001 - whole steps on a GPU are new: one failing row must not cost the run
                if not k:
                    raise
                print(f"  {label}: failed: {type(err).__name__}: {err}", file=sys.stderr)
                failed.append({"policy": label, "error": f"{type(err).__name__}: {err}"})
                continue
            policy = label
            n = sum(r[0] for r in results)
            secs = sum(r[1] for r in results)
            st = [r[2] for r in results]
            steps = sum(s.steps for s in st)
            fwd_time = sum(s.time_draft + s.time_target for s in st)
            rows.append({
                "impl": "ours" + ("+graphs" if graphs else "") + {"onnxruntime": "-ort", "torch-full-head": "-fullhead", "torch-int8": "-int8",
                                                                      "torch-compiled": "-compiled"}.get(backend, ""),
                "policy": policy,
                "tokens_per_s": n / secs,
                "target_forwards_per_token": sum(s.target_forwards for s in st) / n,
                "acceptance": (sum(s.accepted for s in st) / max(sum(s.drafted for s in st), 1)),
                "mean_accepted_length": (sum(s.accepted for s in st) + steps) / max(steps, 1),
                "ms_per_step": 1000 * secs / max(steps, 1),
                "outside_forward_share": max(0.0, 1 - fwd_time / secs),
            })
            if k:  # whole steps on the device are not timed part by part
                del rows[-1]["outside_forward_share"]
            print(f"  {rows[-1]['impl']:12s} {policy:6s} {rows[-1]['tokens_per_s']:8.1f} tok/s", file=sys.stderr)
        target.release()
        draft.release()
        del target, draft

    if not args.no_hf:
        from transformers import LlamaForCausalLM

        hf_t = LlamaForCausalLM.from_pretrained(str(target_dir), dtype=dtype).to(args.device).eval()
        hf_d = LlamaForCausalLM.from_pretrained(str(draft_dir), dtype=dtype).to(args.device).eval()
        for name, draft_model in (("hf generate", None), ("hf assisted", hf_d)):
            run_hf(hf_t, draft_model, prompt, 20, 0, args.device)
            res = [run_hf(hf_t, draft_model, prompt, args.tokens, s, args.device) for s in range(1, args.runs + 1)]
            rows.append({"impl": name, "policy": "ar" if draft_model is None else "assisted",
                         "tokens_per_s": sum(r[0] for r in res) / sum(r[1] for r in res)})
            print(f"  {name:12s} {rows[-1]['tokens_per_s']:8.1f} tok/s", file=sys.stderr)

    base = {r["policy"]: r["tokens_per_s"] for r in rows if r["impl"].startswith("hf")}
    ar = next((r["tokens_per_s"] for r in rows if r["policy"] == "ar" and r["impl"].startswith("ours")), float("nan"))
    print(f"\n{args.model} on {args.device} ({args.dtype}), {args.tokens} tokens x {args.runs} runs, "
          f"L={args.draft_length}, theta={groups.theta}: {groups.num_groups} groups, "
          f"mean size {groups.stats['mean_group_size']:.1f}")
    if note:
        print(f"{args.model}: {note}")
    print(f"{'impl':13s} {'policy':8s} {'tok/s':>8s} {'x ours-ar':>9s} {'x hf-gen':>8s} {'x hf-asst':>9s} "
          f"{'tgt fwd/tok':>11s} {'accept':>7s} {'mean len':>8s} {'ms/step':>8s} {'outside':>8s}")
    for r in rows:
        def fmt(key, spec):
            return format(r[key], spec) if key in r else "-"
        print(f"{r['impl']:13s} {r['policy']:8s} {r['tokens_per_s']:8.1f} {r['tokens_per_s'] / ar:9.2f} "
              f"{r['tokens_per_s'] / base['ar'] if 'ar' in base else float('nan'):8.2f} "
              f"{r['tokens_per_s'] / base['assisted'] if 'assisted' in base else float('nan'):9.2f} "
              f"{fmt('target_forwards_per_token', '11.3f')} {fmt('acceptance', '7.3f')} "
              f"{fmt('mean_accepted_length', '8.2f')} {fmt('ms_per_step', '8.2f')} {fmt('outside_forward_share', '8.1%')}")
    for f in failed:
        print(f"{'ours':13s} {f['policy']:8s} failed: {f['error']}")
    print(json.dumps({"model": args.model, "note": note, "device": args.device, "dtype": args.dtype, "tokens": args.tokens,
                      "runs": args.runs, "draft_length": args.draft_length, "theta": groups.theta,
                      "group_build_s": group_build_s, "rows": rows, "failed": failed}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
