"""The LM step as an ONNX-exportable module: one graph for prefill, the draft step and verify.

Inputs and outputs follow optimum's names, with one deliberate change to what `present` holds:

    input_ids                    [1, T]            int64   T dynamic: prompt, 1, or L+1 tokens
    position_ids                 [1, T]            int64   consecutive cache slots start..start+T-1
    logits_index                 [1, K]            int64   which of the T tokens need logits
    past_key_values.{i}.key      [1, kv, S, D]             the whole preallocated cache buffer
    past_key_values.{i}.value    [1, kv, S, D]             (S = its capacity, dynamic)
 -> logits                       [1, K, V_r]       float32 restricted vocabulary (speech + stop), or
    head_scores                  [1, K, 34]        float32 for a digit-factorised head (`runtime/lm/
                                                           digit_head.py`): its raw scores, which the
                                                           runtime draws from digit by digit and expands
                                                           to logits only where a whole row is needed
    last_hidden_state            [1, K, D]         float32 the final-normed states the head read (the
                                                           EAGLE draft's input, `runtime/lm/eagle.py`;
                                                           [1, K, (k + 1) D] with the model's `taps`:
                                                           a draft that reads k more layers)
    present.{i}.key / .value     [1, kv, T, D]             keys/values of the T new tokens only

Why not optimum's `present = concat(past, new)`: that copies the whole cache on every step
and ties the cache length to the step count, so rolling back means slicing (another copy).
Here the runtime owns one static buffer per layer, binds it as `past` without a copy
(IO binding), writes the T returned entries at their slots, and rolls back by just lowering
its length: O(1), the same contract as the torch backend. The graph reads slot j of the
buffer only when j < position_ids[0, 0], so stale entries left behind by a rollback are
never seen. `logits_index` lets prefill compute the 65,537-row head for its last token only
(K = 1), while draft and verify steps ask for every token (K = T). Attention is computed against the buffer and the new tokens separately (two
matmuls into one softmax), so the cache is never concatenated either; grouped-query heads
are folded into the query axis instead of repeating the keys. Queries and keys are rotated
together, RoPE's half-swap as one product with a ±1 matrix (`project`; bit-exact), and RMSNorm is
traced as a division (`export.onnx_common`): forms onnxruntime runs in fewer nodes (the built-in
voice's int8 step graph: 408 nodes -> 252).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from pcgtts.runtime.lm.llama import Llama, rope_cos_sin


def cache_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past_k: torch.Tensor,
                    past_v: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """q: [1, H, T, D]; k, v: [1, kv, T, D] (new tokens); past_k, past_v: [1, kv, S, D];
    start: [1, 1] int64 first new slot. Returns [1, T, H * D]."""
    b, heads, t, d = q.shape
    kv, slots = past_k.shape[1], past_k.shape[2]
    rep = heads // kv
    # Query head h uses kv head h // rep (Hugging Face's repeat_interleave): fold rep into rows.
    q = q.reshape(b, kv, rep * t, d) * (1.0 / math.sqrt(d))
    scores_past = q @ past_k.transpose(-1, -2)  # [1, kv, rep*T, S]
    scores_new = q @ k.transpose(-1, -2)  # [1, kv, rep*T, T]
    visible_past = (torch.arange(slots, device=q.device) < start).expand(rep * t, slots)  # [rep*T, S]
    rows = torch.arange(t, device=q.device)
    visible_new = (rows[None, :] <= rows[:, None]).repeat(rep, 1)  # [rep*T, T] causal
    visible = torch.cat((visible_past, visible_new), dim=-1)
    scores = torch.cat((scores_past, scores_new), dim=-1).float()
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = probs[..., :slots] @ past_v + probs[..., slots:] @ v  # [1, kv, rep*T, D]
    return out.reshape(b, heads, t, d).transpose(1, 2).reshape(b, t, heads * d)


def rotate_half_matrix(head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """R [D, D] with x @ R == llama.rotate_half(x) exactly (one ±1 per column, and adding zeros is exact)."""
    half = head_dim // 2
    rotation = torch.zeros(head_dim, head_dim, dtype=dtype)
    rotation[torch.arange(half) + half, torch.arange(half)] = -1.0
    rotation[torch.arange(half), torch.arange(half) + half] = 1.0
    return rotation


def project(attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotation: torch.Tensor):
    """`llama.Attention.project` as a graph wants it: queries and keys rotated together, the half-swap
    as one product with `rotation` (`rotate_half_matrix`) -> the same q [1, H, T, D], k [1, kv, T, D],
    v. Per layer 6 nodes instead of 12 (a Split, Neg, Concat, two Muls and an Add for each)."""
    b, t, _ = x.shape
    d, heads = attn.args.head_dim, attn.args.num_heads
    qk = torch.cat((attn.q_proj(x), attn.k_proj(x)), dim=-1).view(b, t, -1, d).transpose(1, 2)
    qk = qk * cos + (qk @ rotation) * sin
    v = attn.v_proj(x).view(b, t, -1, d).transpose(1, 2)
    return qk[:, :heads], qk[:, heads:], v


def block_step(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, past_k: torch.Tensor,
               past_v: torch.Tensor, start: torch.Tensor, rotation: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One `llama.Block` over x [1, T, D] against its cache buffer -> (x, new keys, new values)."""
    attn = layer.self_attn
    q, k, v = project(attn, layer.input_layernorm(x), cos, sin, rotation)
    x = x + attn.o_proj(cache_attention(q, k, v, past_k, past_v, start))
    return x + layer.mlp(layer.post_attention_layernorm(x)), k, v


class StepGraph(nn.Module):
    """Wraps a loaded `Llama` (same weights, no cache of its own) in the I/O contract above."""

    def __init__(self, model: Llama):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, logits_index: torch.Tensor,
                *past: torch.Tensor):
        m = self.model
        cos, sin = rope_cos_sin(m.inv_freq, position_ids[0], m.embed_tokens.weight.dtype)  # no table in a graph
        start = position_ids[:, :1]
        x = m.embed_tokens(input_ids)
        rotation = rotate_half_matrix(cos.shape[-1], cos.dtype)
        present, tapped = [], []
        for i, layer in enumerate(m.layers):
            x, k, v = block_step(layer, x, cos, sin, past[2 * i], past[2 * i + 1], start, rotation)
            present += [k, v]
            if i in m.taps:
                tapped.append(x)
        hidden = m.norm(x.index_select(1, logits_index[0]))
        head = m.head_scores(hidden) if m.samples_digits else m.logits(hidden)
        taps = torch.cat(tapped, -1).index_select(1, logits_index[0]) if tapped else None  # one select for all k
        return (head, m.with_taps(hidden, taps).float(), *present)


def io_names(num_layers: int, scores: bool = False) -> tuple[list[str], list[str]]:
    """Input and output names; `scores`: the model has a digit head (its first output is head_scores)."""
    inputs = ["input_ids", "position_ids", "logits_index"]
    outputs = ["head_scores" if scores else "logits", "last_hidden_state"]
    for i in range(num_layers):
        inputs += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
        outputs += [f"present.{i}.key", f"present.{i}.value"]
    return inputs, outputs
