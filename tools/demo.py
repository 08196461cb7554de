"""The built-in demo: a small LLaSA-format target, a layer-subset draft and a tiny X-codec2.

RANDOM WEIGHTS: the demo exercises every stage with real file formats and reports real
latencies, but its audio is not speech. Every command that falls back to it says so.

The target is a genuine `LlamaForCausalLM` checkpoint (config.json + model.safetensors) with
a tokenizer holding a small byte-level text vocabulary, the Llama-3 chat tokens, every LLaSA
control token and `<|s_0|>` ... `<|s_65535|>`. Its speech-token embeddings are given the
structure real ones have: X-codec2 tokens are points of an 8-dimensional, 4-level FSQ lattice,
so each token is embedded from its lattice coordinates (random Fourier features of a Gaussian
kernel, i.e. cos-similarity falls off with lattice distance). With the tied LM head this makes
the models' next-token distributions spread over lattice neighbourhoods, so acoustic
similarity groups are non-trivial and a draft disagrees more on exact tokens than on groups.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from pcgtts.runtime.text.tokenizer import build_demo_tokenizer
from pcgtts.runtime.text.vocab import NUM_SPEECH_TOKENS, SPEECH_GENERATION_END, speech_token

log = logging.getLogger(__name__)

NOT_SPEECH_NOTICE = "demo models have random weights: the audio is not speech"

@dataclass(frozen=True)
class DemoLMConfig:
    hidden_size: int = 256
    num_layers: int = 12
    num_heads: int = 4
    num_kv_heads: int = 2  # GQA, like every released LLaSA
    intermediate_size: int = 1536
    num_speech: int = NUM_SPEECH_TOKENS
    draft_layers: int = 2
    # Share of the draft's LM-head rows taken from a lattice neighbour: an imperfect draft that
    # knows the acoustic neighbourhood but not always the exact token (PCG's premise).
    draft_confusion: float = 0.3
    kernel_length: float = 0.9  # lattice distance scale of embedding similarity
    embed_scale: float = 1.6  # sets how peaked the distributions are: 1.6 gives ~4-5 nats of entropy
    tie_word_embeddings: bool = True
    llama3_rope: bool = True
    vocab_size: int | None = None  # pad the embedding table to this size (193,800 = LLaSA's), None = tokenizer size
    save_dtype: str = "float32"  # dtype of the written weights (LLaSA ships bfloat16)


def fsq_coordinates(num_tokens: int) -> torch.Tensor:
    """Lattice coordinates of X-codec2 token indices: digit d of i in base 4, d = 0..7. [N, 8]"""
    idx = torch.arange(num_tokens)[:, None]
    return ((idx // 4 ** torch.arange(8)[None, :]) % 4).float()


def structured_speech_embeddings(num_tokens: int, hidden: int, kernel_length: float, scale: float,
                                 generator: torch.Generator) -> torch.Tensor:
    """Random Fourier features of the FSQ coordinates: E[i]·E[j] ≈ scale² exp(-|c_i - c_j|² / 2ℓ²). [N, H]"""
    coords = fsq_coordinates(num_tokens)
    omega = torch.randn(8, hidden, generator=generator) / kernel_length
    phase = torch.rand(hidden, generator=generator) * 2 * math.pi
    feats = torch.cos(coords @ omega + phase) * math.sqrt(2.0 / hidden)
    return feats * scale


def write_demo_lm(out_dir: str | Path, config: DemoLMConfig = DemoLMConfig(), seed: int = 0,
                  tokenizer=None) -> Path:
    """Write a LLaSA-format target checkpoint (random, structured weights) to `out_dir`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    tok = tokenizer or build_demo_tokenizer(config.num_speech)
    vocab = tok.get_vocab()
    rope = {"rope_type": "default", "rope_theta": 500000.0}
    if config.llama3_rope:
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    if config.vocab_size is not None and config.vocab_size < len(tok):
        raise ValueError(f"vocab_size {config.vocab_size} is smaller than the tokenizer ({len(tok)})")
    hf_config = LlamaConfig(
        vocab_size=config.vocab_size or len(tok), hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.hidden_size // config.num_heads,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_parameters=rope,
        tie_word_embeddings=config.tie_word_embeddings, bos_token_id=vocab["<|begin_of_text|>"],
        eos_token_id=vocab[SPEECH_GENERATION_END],
    )
    with torch.random.fork_rng(devices=[]):  # seeded init without touching the caller's RNG
        torch.manual_seed(seed)
        model = LlamaForCausalLM(hf_config).eval()
    gen = torch.Generator().manual_seed(seed)
    offset = vocab[speech_token(0)]
    emb = model.model.embed_tokens.weight.data
    emb[offset:offset + config.num_speech] = structured_speech_embeddings(
        config.num_speech, config.hidden_size, config.kernel_length, config.embed_scale, gen)
    # Random weights give the stop token no reason to be likely: demo utterances end at the
    # synthesizer's per-sentence token budget (see SynthesisConfig.token_budget).
    if not config.tie_word_embeddings:
        model.lm_head.weight.data.copy_(emb + 0.01 * torch.randn(emb.shape, generator=gen))
    out_dir.mkdir(parents=True, exist_ok=True)
    model.to(getattr(torch, config.save_dtype)).save_pretrained(str(out_dir))
    tok.save_pretrained(str(out_dir))
    return out_dir


def confuse_draft_head(draft_dir: Path, share: float, num_speech: int, seed: int) -> None:
    """Untie the draft's LM head and give `share` of its speech rows a random lattice neighbour's row."""
    import json

    from safetensors.torch import load_file, save_file

    if share <= 0:
        return
    weights = load_file(str(draft_dir / "model.safetensors"))
    config = json.loads((draft_dir / "config.json").read_text())
    offset = json.loads((draft_dir / "tokenizer.json").read_text())["added_tokens"]
    offset = next(t["id"] for t in offset if t["content"] == speech_token(0))
    head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"]).clone()
    gen = torch.Generator().manual_seed(seed + 1)
    idx = torch.arange(num_speech)
    dim = torch.randint(0, 8, (num_speech,), generator=gen)
    step = torch.randint(0, 2, (num_speech,), generator=gen) * 2 - 1
    digit = (idx // 4**dim) % 4
    step = torch.where((digit + step < 0) | (digit + step > 3), -step, step)  # stay on the lattice
    neighbour = idx + step * 4**dim
    flipped, flipped_ok = idx - step * 4**dim, (digit - step >= 0) & (digit - step <= 3)
    neighbour = torch.where(neighbour < num_speech, neighbour,  # ... and in a vocabulary smaller than 4**8
                            torch.where(flipped_ok & (flipped < num_speech), flipped, idx))
    source = torch.where(torch.rand(num_speech, generator=gen) < share, neighbour, idx)
    head[offset:offset + num_speech] = head[offset + source]
    weights["lm_head.weight"] = head.contiguous()
    save_file(weights, str(draft_dir / "model.safetensors"), metadata={"format": "pt"})
    config["tie_word_embeddings"] = False
    (draft_dir / "config.json").write_text(json.dumps(config, indent=2))


def write_demo(out_dir: str | Path, seed: int = 0, config: DemoLMConfig = DemoLMConfig(),
               with_codec: bool = True) -> dict[str, Path]:
    """Write `out_dir/target`, `out_dir/draft` (layer subset of the target) and `out_dir/codec`."""
    from pcgtts.train.subset_draft import make_layer_subset_draft

    out_dir = Path(out_dir)
    paths = {"target": write_demo_lm(out_dir / "target", config, seed)}
    paths["draft"] = make_layer_subset_draft(paths["target"], out_dir / "draft", config.draft_layers)
    confuse_draft_head(paths["draft"], config.draft_confusion, config.num_speech, seed)
    if with_codec:
        from pcgtts.tools.demo_codec import write_demo_codec

        paths["codec"] = write_demo_codec(out_dir / "codec", seed=seed)
    return paths


DEMO_THETA = 0.25  # groups ~ lattice balls of radius sqrt(2) on the demo's embeddings (measured in BENCHMARKS.md)


def default_cache_dir() -> Path:
    from pcgtts.runtime.files import cache_root

    return cache_root() / "demo-v1"


def ensure_demo(cache_dir: str | Path | None = None, seed: int = 0) -> dict[str, Path]:
    """The demo models and their group table, made on first use in a cache folder."""
    import shutil

    from pcgtts.export.group_table import build_groups_for_model

    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    paths = {name: cache / name for name in ("target", "draft", "codec")}
    paths["groups"] = cache / f"groups-t{DEMO_THETA:.2f}.pcg"
    if all(p.exists() for p in paths.values()):
        return paths
    log.warning("making the built-in demo models in %s: once, about a minute on a 2-core CPU", cache)
    tmp = cache.with_name(cache.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    made = write_demo(tmp, seed=seed)
    log.warning("building their group table (65,536 tokens; the progress bar counts blocks)")
    build_groups_for_model(made["target"], DEMO_THETA, progress=True).save(tmp / paths["groups"].name)
    shutil.rmtree(cache, ignore_errors=True)
    tmp.rename(cache)  # atomic: a half-made cache is never picked up
    return paths
