"""Our plain AR next to llama.cpp (llama-cpp-python) and Hugging Face on the same LLaMA checkpoint, CPU, one run.

llama.cpp is the packaged CPU engine a user would reach for, so it stands beside pcgtts in the peer table
when it can run our checkpoint. `write_gguf` converts the checkpoint here (llama.cpp's tensor names,
q/k rows reordered for its adjacent-pair RoPE, and RoPE frequency factors taken from our own Llama 3
scaling), and before anything is timed the logits llama.cpp computes for the prompt are checked
against ours (F32 weights get an F32 KV cache; the others llama.cpp's default F16 one). Every
engine samples at temperature 0.8 with the same number of threads; ours over
the 65,537 speech entries, llama.cpp and HF over the whole vocabulary (65,805 rows: the same
matmul within 0.4 %).

    pip install -e ".[peers]"    # gguf + llama-cpp-python, which builds llama.cpp (cmake, C++; ~15 min on 2 cores).
    # On a CPU with AMX that the virtual machine does not let ggml use, its Q8_0 kernels crash: build without them,
    # CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF"
    python benchmarks/bench_llama_cpp.py --model demo                  # the random demo target
    python benchmarks/bench_llama_cpp.py --target LAB/v1/target        # a trained one
    python benchmarks/bench_llama_cpp.py --target S/target --draft S/draft --types F16,Q8_0   # a scaled voice

With `--draft`, llama.cpp also decodes with its own speculation (llama-cpp-python's `draft_model`
hook): the draft GGUF proposes `--draft-length` tokens greedily, the target samples each position and
keeps a proposal while its sample equals it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench_lm import TEXT, make_models, run_hf, run_ours
from pcgtts.runtime.lm.checkpoint import load_tokenizer
from pcgtts.runtime.lm.llama import LlamaArgs, rope_inv_freq
from pcgtts.runtime.lm.torch_lm import TorchLM
from pcgtts.runtime.text.prompt import build_prompt

GGUF_TYPES = ("F32", "F16", "Q8_0")


def _rows_for_adjacent_rope(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k projection rows from Hugging Face's rotate-half layout (pairs (i, i + d/2) within a head)
    to llama.cpp's adjacent pairs (2i, 2i + 1). weight [heads * d, hidden]."""
    rows, cols = weight.shape
    return weight.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def write_gguf(model_dir: Path, out: Path, kind: str) -> Path:
    """`model_dir` (a LlamaForCausalLM checkpoint) -> a GGUF file llama.cpp loads; weights in `kind`."""
    import gguf
    from safetensors.torch import load_file

    args = LlamaArgs.from_hf_config(json.loads((model_dir / "config.json").read_text()))
    state = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        if shard.name.startswith("model"):
            state.update(load_file(shard))
    tokenizer = load_tokenizer(model_dir)
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_block_count(args.num_layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(args.hidden_size)
    writer.add_feed_forward_length(args.intermediate_size)
    writer.add_head_count(args.num_heads)
    writer.add_head_count_kv(args.num_kv_heads)
    writer.add_rope_dimension_count(args.head_dim)
    writer.add_rope_freq_base(args.rope_theta)
    writer.add_layer_norm_rms_eps(args.rms_norm_eps)
    writer.add_vocab_size(args.vocab_size)
    writer.add_file_type({"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
                          "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[kind])
    # A byte-level BPE vocabulary in id order (never used to tokenize here: ids go in directly).
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    if [i for _, i in vocab] != list(range(len(vocab))):
        raise ValueError("tokenizer ids are not contiguous")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([token for token, _ in vocab] + [f"[PAD{i}]" for i in range(len(vocab), args.vocab_size)])
    writer.add_token_types([gguf.TokenType.NORMAL] * args.vocab_size)
    writer.add_token_merges([f"{vocab[0][0]} {vocab[1][0]}"])  # llama.cpp wants a merge list; one is enough
    writer.add_bos_token_id(tokenizer.bos_token_id if tokenizer.bos_token_id is not None else 0)

    def put(name: str, tensor: torch.Tensor, keep_f32: bool = False) -> None:
        array = tensor.float().numpy()
        if kind == "F32" or keep_f32 or array.ndim == 1:
            writer.add_tensor(name, array)
        elif kind == "F16":
            writer.add_tensor(name, array.astype(np.float16))
        else:
            quantized = gguf.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)

    base = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float64) / args.head_dim))
    writer.add_tensor("rope_freqs.weight", (base / rope_inv_freq(args).double()).float().numpy())  # divisors of base
    put("token_embd.weight", state["model.embed_tokens.weight"])
    put("output_norm.weight", state["model.norm.weight"])
    if "lm_head.weight" in state:
        put("output.weight", state["lm_head.weight"])
    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(args.num_layers):
        for hf, ours in names.items():
            weight = state[f"model.layers.{i}.{hf}.weight"]
            if hf == "self_attn.q_proj":
                weight = _rows_for_adjacent_rope(weight, args.num_heads)
            elif hf == "self_attn.k_proj":
                weight = _rows_for_adjacent_rope(weight, args.num_kv_heads)
            put(f"blk.{i}.{ours}.weight", weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


OURS = {"torch": "f32", "torch-int8": "int8", "onnxruntime": "f32", "onnxruntime-int8": "int8"}  # backend -> weights


def ours_lm(backend: str, target_dir: Path, torch_lm: TorchLM):
    """Our LM on `backend`: the loaded torch one, torch with int8 layers, or an onnxruntime export
    (fp32 or weight-only int8, made once beside the checkpoint as `pcgtts export onnx` would)."""
    if backend == "torch":
        return torch_lm
    if backend == "torch-int8":
        return TorchLM.load(target_dir, max_length=1024, tokenizer=torch_lm.tokenizer, quantize="int8")
    from pcgtts.export.onnx_lm import export_lm
    from pcgtts.runtime.lm.onnxruntime import OrtLM

    quantize = "int8" if backend.endswith("int8") else "none"
    onnx_dir = target_dir.with_name(f"{target_dir.name}-onnx-{quantize}")
    if not (onnx_dir / "pcgtts-lm.json").exists():
        export_lm(target_dir, onnx_dir, max_length=1024, quantize=quantize)
    return OrtLM.load(onnx_dir, max_length=1024, tokenizer=torch_lm.tokenizer)


def check_logits(llm, target: TorchLM, prompt: torch.Tensor) -> float:
    """Largest |llama.cpp logit - ours| over the prompt's positions and our restricted vocabulary,
    relative to the largest |logit| (ours: torch float32)."""
    llm.reset()
    llm.eval(prompt.tolist())
    theirs = np.asarray(llm.scores[:len(prompt)])[:, target.vocab.head_rows().numpy()]
    target.rollback(0)
    ours = target.forward(prompt).numpy()
    target.rollback(0)
    return float(np.abs(theirs - ours).max() / np.abs(ours).max())


class GgufDraft:
    """llama-cpp-python's draft-model hook over a draft GGUF with its own context: `count` greedy
    proposals after the ids so far (the prefix it already holds is kept)."""

    def __init__(self, llm, count: int):
        self.llm, self.count = llm, count

    def __call__(self, input_ids: np.ndarray, **_) -> np.ndarray:
        llm, ids = self.llm, input_ids.tolist()
        held = llm.input_ids[:llm.n_tokens].tolist()
        keep = next((i for i, (a, b) in enumerate(zip(held, ids)) if a != b), min(len(held), len(ids)))
        llm.n_tokens = min(keep, len(ids) - 1)  # at least the last id is evaluated: its logits are read
        llm.eval(ids[llm.n_tokens:])
        proposals = []
        for _ in range(self.count):
            logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
            proposals.append(int(logits.argmax()))
            llm.eval(proposals[-1:])
        llm.n_tokens -= self.count  # the proposals leave its context (the next call re-evaluates kept ones)
        return np.array(proposals, dtype=np.intc)


def run_llama_cpp(llm, prompt: torch.Tensor, tokens: int, seed: int) -> tuple[int, float]:
    llm.reset()
    llm.set_seed(seed)
    start, n = time.perf_counter(), 0
    for _ in llm.generate(prompt.tolist(), temp=0.8, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
        n += 1
        if n == tokens:
            break
    return n, time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="demo", help="a bench_lm.py shape (default demo)")
    ap.add_argument("--target", help="an existing target checkpoint instead of --model's")
    ap.add_argument("--types", default="F32,F16,Q8_0", help=f"GGUF weight types, from {GGUF_TYPES}")
    ap.add_argument("--ours", default="torch,torch-int8,onnxruntime-int8", help=f"our backends, from {sorted(OURS)}")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--draft", help="a draft checkpoint: also time llama.cpp's own speculation with it (Q8_0 and F16)")
    ap.add_argument("--draft-length", type=int, default=3, help="proposals per step for --draft (default 3)")
    ap.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "pcgtts-bench-models"))
    args = ap.parse_args()
    types = args.types.split(",")
    if any(t not in GGUF_TYPES for t in types):
        ap.error(f"--types: choose from {GGUF_TYPES}")
    if any(b not in OURS for b in args.ours.split(",")) or not args.ours.startswith("torch,") and args.ours != "torch":
        ap.error(f"--ours: torch first (the reference), then any of {sorted(OURS)}")
    from llama_cpp import Llama  # optional: `pip install llama-cpp-python`

    target_dir = Path(args.target) if args.target else make_models(args.model, Path(args.cache))[0]
    name = target_dir.parent.name if args.target else args.model
    threads = torch.get_num_threads()
    target = TorchLM.load(target_dir, max_length=1024)
    prompt = build_prompt(target.tokenizer, target.vocab, TEXT)
    rows = []

    def timed(label: str, engine: str, run) -> None:
        run(20, 0)  # warm-up
        results = [run(args.tokens, seed) for seed in range(1, args.runs + 1)]
        rows.append({"impl": engine, "weights": label,
                     "tokens_per_s": sum(r[0] for r in results) / sum(r[1] for r in results)})
        print(f"  {engine:16s} {label:6s} {rows[-1]['tokens_per_s']:8.1f} tok/s", file=sys.stderr)

    for backend in args.ours.split(","):
        lm = ours_lm(backend, target_dir, target)
        timed(OURS[backend], f"ours-{backend.split('-')[0]}",
              lambda n, s: run_ours(lm, None, prompt, "ar", n, None, s, "cpu", 3)[:2])
    checks = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in types:
            path = write_gguf(target_dir, Path(tmp) / f"{name}-{kind}.gguf", kind)
            kv = {"type_k": 0, "type_v": 0} if kind == "F32" else {}  # F32 weights: an F32 KV cache too (default F16)
            llm = Llama(model_path=str(path), n_ctx=1024, n_threads=threads, n_threads_batch=threads,
                        logits_all=True, verbose=False, **kv)
            checks[kind] = check_logits(llm, target, prompt)
            print(f"  llama.cpp {kind}: logits within {checks[kind]:.1e} of ours (relative)", file=sys.stderr)
            timed(kind.lower(), "llama.cpp", lambda n, s: run_llama_cpp(llm, prompt, n, s))
            del llm
            if args.draft and kind != "F32":
                draft_path = write_gguf(Path(args.draft), Path(tmp) / f"{name}-draft-{kind}.gguf", kind)
                drafter = Llama(model_path=str(draft_path), n_ctx=1024, n_threads=threads, n_threads_batch=threads,
                                verbose=False)
                llm = Llama(model_path=str(path), n_ctx=1024, n_threads=threads, n_threads_batch=threads,
                            logits_all=True, verbose=False, draft_model=GgufDraft(drafter, args.draft_length))
                timed(kind.lower(), f"llama.cpp+draft L={args.draft_length}",
                      lambda n, s: run_llama_cpp(llm, prompt, n, s))
                del llm, drafter
    if not args.no_hf:
        from transformers import LlamaForCausalLM

        hf = LlamaForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
        timed("f32", "hf", lambda n, s: run_hf(hf, None, prompt, n, s, "cpu"))

    ours = rows[0]["tokens_per_s"]  # torch float32: the reference
    print(f"\n{name}, CPU, {threads} threads, {args.tokens} tokens x {args.runs} runs, plain AR at temperature 0.8")
    print(f"{'impl':22s} {'weights':8s} {'tok/s':>8s} {'x ours':>7s} {'logits vs ours':>15s}")
    for r in rows:
        check = checks.get(r["weights"].upper()) if r["impl"].startswith("llama.cpp") else None
        print(f"{r['impl']:22s} {r['weights']:8s} {r['tokens_per_s']:8.1f} {r['tokens_per_s'] / ours:7.2f} "
              f"{format(check, '15.1e') if check is not None else '-':>15s}")
    print(json.dumps({"model": name, "threads": threads, "tokens": args.tokens, "runs": args.runs,
                      "logit_checks": checks, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
