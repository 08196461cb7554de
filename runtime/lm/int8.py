"""Dynamic int8 linear layers for the LM on a CPU (fbgemm), batch-invariant.

`quantize_int8(model)` swaps every `nn.Linear` of the decoder blocks, and a full speech head (a
digit head is 34 rows: left as is), for `Int8Linear`: weights stored int8 per output channel
(4x less memory to stream per step than float32), activations quantized to int8 on each call.

fbgemm's dynamic linear quantizes its input with one range for the whole call, so a token's result
would depend on the other tokens in the pass (a 4-token verify vs a 1-token step: ~4 % apart), and
greedy speculation would no longer equal greedy decoding. `Int8Linear` scales each row to
max |x| = 1 and appends two constant columns (+1, -1, against zero weights) that pin every call's
range to [-1, 1]: each row is quantized the same way whatever else is in the pass, its integer
product is exact, and the row's scale is multiplied back after. Layers that read the same input
(q/k/v, gate/up) share one int8 call (`_SharedInput`): fewer, larger calls, one normalisation.
The speculative rules stay exact
with respect to the quantized model; what quantization costs in quality is measured by the
quality harness (QUALITY.md).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from pcgtts.runtime.lm.llama import Llama


class Int8Linear(nn.Module):
    """`linear` (float weights, no bias) as a batch-invariant dynamic int8 layer: [..., in] -> [..., out] float32
    (one row [in] -> [out] too)."""

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
        if x.dim() == 1:  # one row (an EAGLE proposal's state): the quantized kernel wants a batch
            return self.forward(x[None])[0]
        scale = x.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)
        pinned = torch.cat([x / scale, self.pins.expand(*x.shape[:-1], 2)], dim=-1)
        return self.inner(pinned) * scale


class _SharedInput:
    """Linear layers that always read the same input tensor, as one `Int8Linear` over their stacked
    weights: the first layer called with an input computes every output, the others slice it, and
    the last layer's call drops it (a layer called out of that order only recomputes)."""

    def __init__(self, linears: list[nn.Linear]):
        fused = nn.Linear(linears[0].in_features, sum(lin.out_features for lin in linears), bias=False)
        with torch.no_grad():
            fused.weight.copy_(torch.cat([lin.weight.detach().float().cpu() for lin in linears]))
        self.layer = Int8Linear(fused)
        ends = torch.tensor([lin.out_features for lin in linears]).cumsum(0).tolist()
        self.last = ends[-1]
        self.parts = [_Part(self, lo, hi, lin.in_features) for lo, hi, lin in zip([0] + ends[:-1], ends, linears)]
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None

    def output(self, x: torch.Tensor, last: bool) -> torch.Tensor:
        out = self._output if x is self._input else self.layer(x)
        self._input, self._output = (None, None) if last else (x, out)
        return out


class _Part(nn.Module):
    """One layer's columns of a `_SharedInput` (acts as that nn.Linear)."""

    def __init__(self, shared: _SharedInput, lo: int, hi: int, in_features: int):
        super().__init__()
        self.lo, self.hi, self.in_features, self.out_features = lo, hi, in_features, hi - lo
        object.__setattr__(self, "shared", shared)  # not a submodule: the parts share it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared.output(x, self.hi == self.shared.last)[..., self.lo:self.hi]


def quantize_int8(model: Llama) -> Llama:
    """Swap the decoder blocks' linear layers (and a full head) for int8 ones, in place."""
    if model.embed_tokens.weight.dtype != torch.float32 or model.embed_tokens.weight.device.type != "cpu":
        raise ValueError("int8 runs on a CPU model in float32 (compute_device='cpu', dtype='float32')")
    for block in model.layers:
        attn, mlp = block.self_attn, block.mlp
        for owner, names in ((attn, ("q_proj", "k_proj", "v_proj")), (mlp, ("gate_proj", "up_proj"))):
            shared = _SharedInput([getattr(owner, name) for name in names])
            for name, part in zip(names, shared.parts):
                setattr(owner, name, part)
        attn.o_proj, mlp.down_proj = Int8Linear(attn.o_proj), Int8Linear(mlp.down_proj)
    if not model.digits:  # the full 65,537-row head: the largest matrix of a small model
        model.head = Int8Linear(model.head)
    return model


__all__ = ["Int8Linear", "quantize_int8"]
