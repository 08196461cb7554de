"""Dynamic int8 linear layers for the LM on a CPU (fbgemm), batch-invariant.

`quantize_int8(model)` swaps every `nn.Linear` of the decoder blocks, and a full speech head (a
digit head is 34 rows: left as is), for `Int8Linear`: weights stored int8 per output channel
(4x less memory to stream per step than float32), activations quantized to int8 on each call.

fbgemm's dynamic linear quantizes its input with one range for the whole call, so a token's result
would depend on the other tokens in the pass (a 4-token verify vs a 1-token step: ~4 % apart), and
greedy speculation would no longer equal greedy decoding. `Int8Linear` scales each row to
max |x| = 1 and appends two constant columns (+1, -1, against zero weights) that pin every call's
range to [-1, 1]: each row is quantized the same way whatever else is in the pass, its integer
product is exact, and the row's scale is multiplied back after. The speculative rules stay exact
with respect to the quantized model; what quantization costs in quality is measured by the
quality harness (QUALITY.md).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from pcgtts.runtime.lm.llama import Llama


class Int8Linear(nn.Module):
    """`linear` (float weights, no bias) as a batch-invariant dynamic int8 layer: [..., in] -> [..., out] float32."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        if linear.bias is not None:
            raise ValueError("Int8Linear takes linear layers without a bias (LLaMA's)")
        from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear
        from torch.ao.quantization import per_channel_dynamic_qconfig

        self.in_features, self.out_features = linear.in_features, linear.out_features
        padded = nn.Linear(self.in_features + 2, self.out_features, bias=False)
        with torch.no_grad():
            weight = linear.weight.detach().float().cpu()
            padded.weight.copy_(torch.cat([weight, weight.new_zeros(self.out_features, 2)], dim=1))
        padded.qconfig = per_channel_dynamic_qconfig
        with warnings.catch_warnings():  # torch.ao's eager quantization warns that it moves to torchao
            warnings.simplefilter("ignore")
            self.inner = DynamicLinear.from_float(padded)
        self.register_buffer("pins", torch.tensor([1.0, -1.0]), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = x.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)
        pinned = torch.cat([x / scale, self.pins.expand(*x.shape[:-1], 2)], dim=-1)
        return self.inner(pinned) * scale


def quantize_int8(model: Llama) -> Llama:
    """Swap the decoder blocks' linear layers (and a full head) for `Int8Linear`, in place."""
    if model.embed_tokens.weight.dtype != torch.float32 or model.embed_tokens.weight.device.type != "cpu":
        raise ValueError("int8 runs on a CPU model in float32 (compute_device='cpu', dtype='float32')")
    owners = [m for block in model.layers for m in block.modules()]
    if not model.digits:
        owners.append(model)  # the full 65,537-row head: the largest matrix of a small model
    for owner in owners:
        for name, child in list(owner.named_children()):
            if isinstance(child, nn.Linear) and (owner is not model or name == "head"):
                setattr(owner, name, Int8Linear(child))
    return model


__all__ = ["Int8Linear", "quantize_int8"]
