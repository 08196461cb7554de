"""A lean LLaMA forward pass with a preallocated static KV cache written at explicit positions.

This is the reference model every backend must match. It is deliberately small: the weights
come from a Hugging Face `LlamaForCausalLM` checkpoint (see `runtime/lm/checkpoint.py`), the
cache is a fixed `[B, kv_heads, max_length, head_dim]` buffer per layer, and each call writes
the new keys/values at `positions` and attends to every slot `<= position`. Rolling back is
therefore O(1): the caller just reuses positions, stale slots are masked by causality and
later overwritten. The LM head is computed only over the rows of the restricted vocabulary
(speech tokens + stop, `runtime/text/vocab.py`), about a third of LLaSA's 193,800-row head; a
head whose speech rows are FSQ digit sums is computed from its 34-row digit table
(`runtime/lm/digit_head.py`), the same logits without the 65,536-row matmul.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pcgtts.runtime.lm.digit_head import LEVELS, expand_digit_scores


@dataclass(frozen=True)
class LlamaArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # llama3 rope scaling (None = plain RoPE): factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings
    rope_scaling: tuple[float, float, float, int] | None
    tie_word_embeddings: bool
    attention_bias: bool = False
    mlp_bias: bool = False

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even for RoPE")

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "LlamaArgs":
        """From a Hugging Face config.json dict (transformers 4.x `rope_scaling` or 5.x `rope_parameters`).

        The dict is read through transformers' own `LlamaConfig`, so every field config.json
        leaves out (tie_word_embeddings, rms_norm_eps, rope_theta, head_dim, ...) takes exactly
        the default `LlamaForCausalLM` would use; nothing is restated here."""
        from transformers import LlamaConfig

        if cfg.get("model_type") != "llama":
            raise ValueError(f"not a LLaMA checkpoint: model_type={cfg.get('model_type')!r}")
        try:
            hf = LlamaConfig.from_dict(cfg)
        except (TypeError, ValueError, KeyError) as err:
            raise ValueError(f"invalid LLaMA config.json: {err}") from None
        rope = dict(hf.rope_parameters or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "llama3":
            scaling = (
                float(rope["factor"]),
                float(rope["low_freq_factor"]),
                float(rope["high_freq_factor"]),
                int(rope["original_max_position_embeddings"]),
            )
        elif rope_type in ("default", None):
            scaling = None
        else:
            raise ValueError(f"unsupported rope type {rope_type!r} (supported: default, llama3)")
        return cls(
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=hf.num_key_value_heads or hf.num_attention_heads,
            head_dim=hf.head_dim or hf.hidden_size // hf.num_attention_heads,
            rms_norm_eps=float(hf.rms_norm_eps),
            rope_theta=float(rope["rope_theta"]),
            rope_scaling=scaling,
            tie_word_embeddings=bool(hf.tie_word_embeddings),
            attention_bias=bool(hf.attention_bias),
            mlp_bias=bool(hf.mlp_bias),
        )


def rope_inv_freq(args: LlamaArgs) -> torch.Tensor:
    """Inverse RoPE frequencies, with Llama 3's wavelength-dependent scaling when configured. [head_dim/2]"""
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float64) / args.head_dim))
    if args.rope_scaling is None:
        return inv_freq.float()
    factor, low_ff, high_ff, old_len = args.rope_scaling
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = old_len / low_ff, old_len / high_ff
    # Long wavelengths are slowed down by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled).float()


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, head_dim] of `positions` [T] in Hugging Face's rotate-half layout."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, H, T, D]; cos/sin: [T, D] (Hugging Face's rotate-half layout)
    return x * cos + rotate_half(x) * sin


class RMSNorm(nn.Module):
    # x / sqrt(mean(x^2) + eps) instead of x * rsqrt(...) (the same up to rounding) while traced for
    # ONNX (`export.onnx_common.export_graph` sets it): the form onnxruntime fuses into one node.
    traced_as_division = False

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 like the reference implementation, then cast back.
        xf = x.float()
        mean_square = xf.pow(2).mean(-1, keepdim=True) + self.eps
        xf = xf / torch.sqrt(mean_square) if self.traced_as_division else xf * torch.rsqrt(mean_square)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.args = args
        h, d = args.hidden_size, args.head_dim
        self.q_proj = nn.Linear(h, args.num_heads * d, bias=args.attention_bias)
        self.k_proj = nn.Linear(h, args.num_kv_heads * d, bias=args.attention_bias)
        self.v_proj = nn.Linear(h, args.num_kv_heads * d, bias=args.attention_bias)
        self.o_proj = nn.Linear(args.num_heads * d, h, bias=args.attention_bias)
        self.k_cache: torch.Tensor | None = None  # [B, kv_heads, max_length, head_dim]
        self.v_cache: torch.Tensor | None = None

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Queries, keys and values of the new tokens, RoPE applied. x: [B, T, H]"""
        b, t, _ = x.shape
        d = self.args.head_dim
        q = self.q_proj(x).view(b, t, -1, d).transpose(1, 2)  # [B, heads, T, D]
        k = self.k_proj(x).view(b, t, -1, d).transpose(1, 2)  # [B, kv_heads, T, D]
        v = self.v_proj(x).view(b, t, -1, d).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q: [B, heads, T, D]; k, v: [B, kv_heads, S, D]; mask: [T, S] bool (True = visible)."""
        # Query head h reads kv head h // (heads / kv_heads), without copying the cache per head.
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                             enable_gqa=self.args.num_heads != self.args.num_kv_heads)
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def forward(self, x, cos, sin, positions, mask, end: int | None):
        # positions: [T] int64 cache slots of the new tokens; end: attend to slots [0, end)
        # (None = the whole buffer, the fixed-shape form CUDA graphs need). positions None: no
        # cache, the T tokens attend among themselves (a whole sequence; mask [T, T]).
        q, k, v = self.project(x, cos, sin)
        if positions is None:
            return self.attend(q, k, v, mask)
        self.k_cache.index_copy_(2, positions, k.to(self.k_cache.dtype))
        self.v_cache.index_copy_(2, positions, v.to(self.v_cache.dtype))
        keys, values = (self.k_cache, self.v_cache) if end is None else (self.k_cache[:, :, :end], self.v_cache[:, :, :end])
        return self.attend(q, keys, values, mask)


class MLP(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        h, i = args.hidden_size, args.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=args.mlp_bias)
        self.up_proj = nn.Linear(h, i, bias=args.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(self, x, cos, sin, positions, mask, end):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, positions, mask, end)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """LLaMA decoder whose head covers only `head_rows` (the restricted speech vocabulary).

    `digits` > 0: the head holds a digit table (`runtime/lm/digit_head.py`, 1 + digits * LEVELS + 1
    rows) instead of one row per restricted token."""

    def __init__(self, args: LlamaArgs, head_rows: torch.Tensor, digits: int = 0):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        # [V_restricted or table rows, hidden]: filled from lm_head (or the tied embedding) at load time.
        self.digits = digits
        head_size = 1 + digits * LEVELS + 1 if digits else len(head_rows)
        self.head = nn.Linear(args.hidden_size, head_size, bias=False)
        self.register_buffer("head_rows", head_rows.clone(), persistent=False)
        # A draft's used-codes head: rows for a subset of the restricted vocabulary only
        # (`head_index`, positions in it); every other entry gets logit -inf (probability 0).
        self.register_buffer("head_index", None, persistent=False)
        self.register_buffer("head_excluded", None, persistent=False)
        self.restricted_size = len(head_rows)
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)
        self.register_buffer("causal", torch.zeros(0, dtype=torch.bool), persistent=False)
        self.rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin [max_length, head_dim]
        self.max_length = 0
        # Layers whose outputs `hidden` also returns (an EAGLE draft that reads several layers:
        # runtime/lm/eagle.py); set once, before any step is compiled (`TorchLM.tap_layers`).
        self.taps: tuple[int, ...] = ()

    def setup_cache(self, max_length: int, batch_size: int = 1) -> None:
        """Allocate the static KV cache once; its size bounds prompt + generated tokens."""
        p = self.embed_tokens.weight
        shape = (batch_size, self.args.num_kv_heads, max_length, self.args.head_dim)
        for layer in self.layers:
            layer.self_attn.k_cache = torch.zeros(shape, dtype=p.dtype, device=p.device)
            layer.self_attn.v_cache = torch.zeros(shape, dtype=p.dtype, device=p.device)
        slots = torch.arange(max_length, device=p.device)
        self.causal = slots[None, :] <= slots[:, None]  # [S, S]: row = query position
        self.rope_table = rope_cos_sin(self.inv_freq, slots, p.dtype)  # a step indexes it: 2 ops, not 7
        self.max_length = max_length

    def select_cache_rows(self, rows: torch.Tensor) -> None:
        """Keep batch rows `rows` [B'] of the KV cache, in that order (a batch whose other rows are done)."""
        for layer in self.layers:
            attn = layer.self_attn
            attn.k_cache, attn.v_cache = attn.k_cache[rows], attn.v_cache[rows]

    def free_cache(self) -> None:
        for layer in self.layers:
            layer.self_attn.k_cache = layer.self_attn.v_cache = None
        self.causal = torch.zeros(0, dtype=torch.bool, device=self.causal.device)
        self.rope_table = None
        self.max_length = 0

    @property
    def dtype(self) -> torch.dtype:
        """The float dtype of the model's states (its weights may be int8: `runtime/lm/int8.py`)."""
        return self.embed_tokens.weight.dtype

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, head_dim] of cache slots `positions` [T]: rows of the table `setup_cache` made."""
        if self.rope_table is None:
            return rope_cos_sin(self.inv_freq, positions, self.embed_tokens.weight.dtype)
        cos, sin = self.rope_table
        return cos[positions], sin[positions]

    def hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, end: int | None = None,
               last_only: bool = False, filled: torch.Tensor | None = None) -> torch.Tensor:
        """The final-normed hidden states the head reads: [B, T, D] (or [B, 1, D] with `last_only`).
        With `taps` (k layers), each row is preceded by those layers' outputs, RMS-normalised
        without a weight: [B, T, (k + 1) D], the head reading the last D (`head_scores`).

        input_ids: [B, T]; positions: [T] int64 consecutive cache slots. `end` (python int,
        = positions[-1] + 1) lets eager mode attend to the used prefix only. `filled` [B, S] bool:
        which slots of each row hold a token (rows padded on the left, as a batch of prompts of
        several lengths is); a padding slot is seen by no token but itself (RoPE is relative, so a
        row shifted right is computed as if it started at slot 0).
        """
        cos, sin = self.rope(positions)
        mask = self.causal[positions] if end is None else self.causal[positions, :end]  # [T, S]
        if filled is not None:
            seen = filled[:, :mask.shape[1]]  # [B, S]
            itself = positions[:, None] == torch.arange(mask.shape[1], device=mask.device)  # [T, S]
            mask = (mask & (seen[:, None, :] | itself))[:, None]  # [B, 1, T, S]
        x = self.embed_tokens(input_ids)
        tapped = []
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, positions, mask, end)
            if i in self.taps:
                tapped.append(x)
        taps = torch.cat(tapped, -1) if tapped else None  # [B, T, k D]
        if last_only:
            x, taps = x[:, -1:], None if taps is None else taps[:, -1:]
        return self.with_taps(self.norm(x), taps)

    def with_taps(self, hidden: torch.Tensor, taps: torch.Tensor | None) -> torch.Tensor:
        """Final-normed states [..., D] preceded by the tapped layers' outputs `taps` [..., k D] (side by
        side), each RMS-normalised without a weight: [..., (k + 1) D] (`hidden` itself when None). The k
        outputs are normalised as one [..., k, D] tensor: a few nodes in an exported step, not k times as many."""
        if taps is None:
            return hidden
        d = hidden.shape[-1]
        per_layer = taps.unflatten(-1, (-1, d))  # [..., k, D]
        normed = per_layer * torch.rsqrt(per_layer.pow(2).mean(-1, keepdim=True) + self.args.rms_norm_eps)
        return torch.cat([normed.flatten(-2), hidden], -1)

    def use_head_subset(self, index: torch.Tensor, restricted_size: int) -> None:
        """Keep head rows for restricted indices `index` only (the rest: probability 0)."""
        self.head_index, self.restricted_size = index.to(self.embed_tokens.weight.device), restricted_size
        keep = torch.zeros(restricted_size, dtype=torch.bool, device=self.head_index.device)
        self.head_excluded = (~keep.index_fill_(0, self.head_index, True)).nonzero().view(-1)

    @property
    def samples_digits(self) -> bool:
        """Whether the head's scores can be sampled digit by digit (`digit_head.sample_digit_codes`)."""
        return bool(self.digits) and self.head_index is None

    def head_scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., D] -> the head's float32 scores: the logits, or a digit table's 34 scores per row
        (of the last D of wider rows: `hidden` with `taps`)."""
        d = self.args.hidden_size
        return self.head(hidden if hidden.shape[-1] == d else hidden[..., -d:]).float()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., D] -> float32 restricted-vocabulary logits [..., V_r]."""
        return self.scores_to_logits(self.head_scores(hidden))

    def scores_to_logits(self, scores: torch.Tensor) -> torch.Tensor:
        """`head_scores` -> restricted-vocabulary logits [..., V_r]."""
        if self.digits:
            logits = expand_digit_scores(scores, self.digits)
            if self.head_index is not None:  # a used-codes subset of a digit head: mask the rest
                logits = logits.index_fill(-1, self.head_excluded, float("-inf"))
            return logits
        if self.head_index is None:
            return scores
        full = scores.new_full((*scores.shape[:-1], self.restricted_size), float("-inf"))
        return full.index_copy_(-1, self.head_index, scores)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, end: int | None = None,
                last_only: bool = False) -> torch.Tensor:
        """Restricted-vocabulary logits [B, T, V_r] (float32), or [B, 1, V_r] with `last_only`."""
        return self.logits(self.hidden(input_ids, positions, end, last_only))
