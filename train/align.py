"""Alignment prior for the lab's target LM: chosen attention heads read the text near the diagonal.

A decoder-only TTS LM has to discover which text bytes each speech token says. lab-v1 did not: it
learnt the codec's acoustics and nearly ignores its transcript (`lm.text_conditioning` gain 0.03
nats/token). Guided attention (DC-TTS's diagonal prior, here for the LLaSA layout, where text and
speech share one causal sequence) penalises, on the first `heads` heads of each of `layers`, the
attention that speech query n (of N speech tokens) pays to anything but the text bytes near its
place in the text:

    W[n, k] = 1 - exp(-(n/N - t_k/T)^2 / (2 g^2))   for text byte k (t_k of T bytes)
    W[n, k] = 1                                       for any other key
    prior   = mean over speech queries and heads of sum_k A[n, k] W[n, k]       (in [0, 1])

With a voice prompt the spoken text is "ref_text text" and the speech is ref codes then target
codes: one monotone alignment over both. Training only: the exported model is a plain
LlamaForCausalLM with the usual attention; the prior only shapes its weights.
"""

from __future__ import annotations

import torch

ATTENTION = "pcgtts_align"  # transformers attention interface: SDPA, eager where weights are watched


def relative_positions(ids: torch.Tensor, text_start_id: int, text_end_id: int, speech_offset: int) -> torch.Tensor:
    """[2, T]: row 0 the place n/N of each speech token among the speech tokens (centre of its slot),
    row 1 the place of each text byte between the text markers; -1 elsewhere."""
    rel = torch.full((2, ids.numel()), -1.0)
    speech = (ids >= speech_offset).nonzero().view(-1)
    starts, ends = (ids == text_start_id).nonzero().view(-1), (ids == text_end_id).nonzero().view(-1)
    if starts.numel() != 1 or ends.numel() != 1 or ends[0] <= starts[0] + 1:
        raise ValueError("an example needs exactly one non-empty text span between the text markers")
    text = torch.arange(int(starts[0]) + 1, int(ends[0]))
    for row, pos in ((0, speech), (1, text)):
        rel[row, pos] = (torch.arange(pos.numel()) + 0.5) / max(pos.numel(), 1)
    return rel


def _attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.llama.modeling_llama import eager_attention_forward

    keep = getattr(module, "align_heads", 0)
    if not keep or not torch.is_grad_enabled():
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    out, weights = eager_attention_forward(module, query, key, value, attention_mask, **kwargs)
    module.align_weights = weights[:, :keep]  # [B, heads, T, T]
    return out, weights


def watch(body, layers: tuple[int, ...], heads: int) -> None:
    """Route `body` (a transformers LlamaModel) through the watching attention; keep the weights of
    the first `heads` heads of `layers` on each training forward."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    n = len(body.layers)
    if not layers or any(not 0 <= i < n for i in layers):
        raise ValueError(f"align layers must be indices of the {n} layers, got {layers}")
    if not 1 <= heads <= body.config.num_attention_heads:
        raise ValueError(f"align heads must lie in [1, {body.config.num_attention_heads}], got {heads}")
    AttentionInterface.register(ATTENTION, _attention)
    # A custom attention gets no mask unless one is registered with it: eager's (a full float causal +
    # padding mask, never skipped) serves both paths; without it the eager path would see the future.
    AttentionMaskInterface.register(ATTENTION, eager_mask)
    body.set_attn_implementation(ATTENTION)
    for i in layers:
        body.layers[i].self_attn.align_heads = heads


def alignment_prior(body, rel: torch.Tensor, width: float) -> torch.Tensor:
    """The prior (module docstring) over the weights the last forward kept; rel [B, 2, T] from
    `relative_positions` (padded with -1), aligned with the forward's input positions."""
    kept = [m.align_weights for m in (layer.self_attn for layer in body.layers) if hasattr(m, "align_weights")]
    if not kept:
        raise RuntimeError("no attention weights kept: call watch() and run a training forward first")
    for layer in body.layers:
        layer.self_attn.__dict__.pop("align_weights", None)
    n, t = rel[:, 0], rel[:, 1]  # [B, T]
    dist = n[:, :, None] - t[:, None, :]  # [B, Tq, Tk]
    cost = torch.where(t[:, None, :] >= 0, 1 - torch.exp(-dist.square() / (2 * width ** 2)), 1.0)
    queries = (n >= 0).to(cost.dtype)  # [B, Tq]
    total = sum((w * cost[:, None]).sum(-1) for w in kept)  # [B, heads, Tq]
    per_query = total.mean(1) / len(kept)
    return (per_query * queries).sum() / queries.sum().clamp(min=1)


__all__ = ["ATTENTION", "relative_positions", "watch", "alignment_prior"]
