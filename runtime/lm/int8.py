"""Dynamic int8 linear layers for the LM on a CPU, batch-invariant.

`quantize_int8(model)` swaps every `nn.Linear` of the decoder blocks, and a full speech head (a
digit head is 34 rows: left as is), for `Int8Linear`: weights stored int8 per output channel
(4x less memory to stream per step than float32), activations quantized to int8 on each call.

Each input row is scaled to max |x| = 1 and quantized on its own fixed grid (127 steps a side), so
a row's integer product is exact and does not depend on the other rows of the pass: a 4-token
verify computes each token as a 1-token step would, and greedy speculation equals greedy decoding.
The row's scale is multiplied back after. Two kernels compute the product:

- oneDNN's static int8 matmul (`torch.ops.onednn.qlinear_pointwise`), for large layers where this
  build of torch has it: on a CPU with AMX or AVX-512 VNNI a 4- or 8-row pass costs about what one
  row costs, which makes a speculative verify pass nearly free at the sizes where the weights
  dominate a step (a 1B target's);
- fbgemm's dynamic linear otherwise (cheaper to call: the built-in voice's small layers). It
  quantizes a call with one range for all its rows, so the layer appends two constant columns (+1,
  -1, against zero weights) that pin every call's range to [-1, 1]; a pass of several rows costs
  more than one row (1.3x for 4 rows at 2,048 wide).

Layers that read the same input (q/k/v, gate/up) share one int8 call (`_SharedInput`): fewer,
larger calls, one normalisation. The speculative rules stay exact with respect to the quantized
model; what quantization costs in quality is measured by the quality harness (QUALITY.md).
"""

from __future__ import annotations

import functools
import logging
import warnings

import torch
from torch import nn

from pcgtts.runtime.lm.llama import Llama

log = logging.getLogger(__name__)

LEVELS = 127  # int8 steps on each side of zero for a row scaled to max |x| = 1 (oneDNN kernel)
# oneDNN from this many weights: its call costs ~20 µs more than fbgemm's, which a small layer (the
# built-in voice's, 256 wide) feels in every step, while a large one gains a verify pass almost free
ONEDNN_MIN_WEIGHTS = 1 << 22


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [n, k] float -> (int8 codes [n, k], scales [n]): each row on its own 127-step grid,
    weight ~ codes * scales."""
    scales = weight.abs().amax(1).clamp_min(torch.finfo(torch.float32).tiny) / LEVELS
    return torch.round(weight / scales[:, None]).clamp(-LEVELS, LEVELS).to(torch.int8), scales


def row_maxima(x: torch.Tensor) -> torch.Tensor:
    """max |x| of each row of x [..., k] (never 0): [..., 1]."""
    return x.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)


def on_grid(x: torch.Tensor, maxima: torch.Tensor) -> torch.Tensor:
    """x [..., k] with its `row_maxima` on the 127-step grid: rounded values in [-127, 127] (float)."""
    return torch.round(x * (LEVELS / maxima))


@functools.cache
def onednn_int8() -> bool:
    """Whether oneDNN's static int8 matmul runs here (torch built with it, on an x86 CPU)."""
    try:
        weight = torch.ones(8, 8, dtype=torch.int8)
        packed = torch.ops.onednn.qlinear_prepack(weight, None)
        x = torch.full((1, 8), LEVELS + 1, dtype=torch.uint8)
        out = torch.ops.onednn.qlinear_pointwise(x, 1.0, LEVELS + 1, packed, torch.ones(8), torch.zeros(8, dtype=torch.int32),
                                                 None, 1.0, 0, torch.float32, "none", [], "")
        return bool((out == 0).all())
    except (AttributeError, RuntimeError, NotImplementedError) as err:
        log.info("oneDNN int8 matmul unavailable (%s): int8 layers run on fbgemm", err)
        return False


class Int8Linear(nn.Module):
    """`linear` (float weights, no bias) as a batch-invariant dynamic int8 layer: [..., in] -> [..., out] float32
    (one row [in] -> [out] too). `kernel`: "onednn" or "fbgemm" (default: oneDNN where it runs, for a
    layer of at least `ONEDNN_MIN_WEIGHTS` weights).
    `keep_rows`: also keep the int8 codes and per-row scales as `rows`, `row_scales` (a speech head's,
    which a draft's cheap proposal head reads: `proposal_head.ProposalHead`)."""

    def __init__(self, linear: nn.Linear, kernel: str | None = None, keep_rows: bool = False):
        super().__init__()
        if linear.bias is not None:
            raise ValueError("Int8Linear takes linear layers without a bias (LLaMA's)")
        large = linear.in_features * linear.out_features >= ONEDNN_MIN_WEIGHTS
        kernel = kernel or ("onednn" if large and onednn_int8() else "fbgemm")
        if kernel not in ("onednn", "fbgemm"):
            raise ValueError(f"kernel must be 'onednn' or 'fbgemm', got {kernel!r}")
        self.kernel = kernel
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float().cpu()
        codes, scales = quantize_rows(weight)
        self.rows, self.row_scales = (codes, scales) if keep_rows else (None, None)
        if kernel == "onednn":
            self.packed = torch.ops.onednn.qlinear_prepack(codes, None)  # oneDNN's blocked layout
            # the kernel returns the integer products as they are (unit scales): its own rescaling
            # rounds differently for one row and for several, the elementwise product below never does
            self.register_buffer("weight_scales", scales / LEVELS, persistent=False)
            self.register_buffer("unit_scales", torch.ones(self.out_features), persistent=False)
            self.register_buffer("zero_points", torch.zeros(self.out_features, dtype=torch.int32), persistent=False)
            return
        from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear
        from torch.ao.quantization import per_channel_dynamic_qconfig

        padded = nn.Linear(self.in_features + 2, self.out_features, bias=False)
        with torch.no_grad():
            padded.weight.copy_(torch.cat([weight, weight.new_zeros(self.out_features, 2)], dim=1))
        padded.qconfig = per_channel_dynamic_qconfig
        with warnings.catch_warnings():  # torch.ao's eager quantization warns that it moves to torchao
            warnings.simplefilter("ignore")
            self.inner = DynamicLinear.from_float(padded)
        self.register_buffer("pins", torch.tensor([1.0, -1.0]), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 1:  # one row (an EAGLE proposal's state): the kernels want a batch
            return self.forward(x[None])[0]
        scale = row_maxima(x)
        if self.kernel == "fbgemm":
            pinned = torch.cat([x / scale, self.pins.expand(*x.shape[:-1], 2)], dim=-1)
            return self.inner(pinned) * scale
        codes = on_grid(x, scale).add_(LEVELS + 1).to(torch.uint8)  # zero point 128
        products = torch.ops.onednn.qlinear_pointwise(codes.reshape(-1, self.in_features), 1.0, LEVELS + 1,
                                                      self.packed, self.unit_scales, self.zero_points, None, 1.0, 0,
                                                      torch.float32, "none", [], "")
        return products.view(*x.shape[:-1], self.out_features) * self.weight_scales * scale


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


def is_quantized(module: nn.Module) -> bool:
    """Whether `module` holds int8 layers (`quantize_int8`, `quantize_linears`)."""
    return any(isinstance(m, (Int8Linear, _Part)) for m in module.modules())


SHARED_INPUTS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # LLaMA's layers that read one input


def quantize_int8(model: Llama) -> Llama:
    """Swap the decoder blocks' linear layers (and a full head) for int8 ones, in place."""
    if model.embed_tokens.weight.dtype != torch.float32 or model.embed_tokens.weight.device.type != "cpu":
        raise ValueError("int8 runs on a CPU model in float32 (compute_device='cpu', dtype='float32')")
    quantize_linears(model.layers)
    if not model.digits:  # the full 65,537-row head: the largest matrix of a small model
        model.head = Int8Linear(model.head, keep_rows=True)
    return model


def quantize_linears(module: nn.Module, min_weights: int = 0) -> nn.Module:
    """Swap every bias-free `nn.Linear` inside `module` of at least `min_weights` weights for an
    `Int8Linear`, in place (the decoder blocks; an EAGLE draft on an int8 target, whose large maps then
    stream int8 weights too). Layers that read one input share one call: an attention's q, k, v; an
    MLP's gate and up."""
    def plain(lin) -> bool:
        return isinstance(lin, nn.Linear) and lin.bias is None

    for owner in list(module.modules()):
        for names in SHARED_INPUTS:
            linears = [getattr(owner, n, None) for n in names]
            if all(map(plain, linears)) and linears[0].in_features * sum(lin.out_features for lin in linears) >= min_weights:
                for name, part in zip(names, _SharedInput(linears).parts):
                    setattr(owner, name, part)
        for name, child in list(owner.named_children()):
            if plain(child) and child.in_features * child.out_features >= min_weights:
                setattr(owner, name, Int8Linear(child))
    return module


__all__ = ["LEVELS", "Int8Linear", "onednn_int8", "on_grid", "quantize_rows", "row_maxima", "is_quantized", "quantize_int8", "quantize_linears"]
