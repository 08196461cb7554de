"""Multi-token prediction heads on a frozen target (Speech-LLaMA's latent-space expansion).

Head i (i = 1..k) reads the target's final-normed hidden state h_t (the state whose own head
predicts token t+1) and predicts token t+1+i:

    z_i = h + U_i SiLU(D_i h)            D_i, U_i: [D, D]; U_i starts at zero, so z_i = h
    logits_i = W z_i                      W: the target's own (restricted) speech head, shared

so the heads add 2 k D^2 parameters, independent of the 65,536-row vocabulary, and a fresh head
predicts like the target's head ("the next code repeats"), a sensible start for speech codes.

File format: `mtp_heads.safetensors` next to the target checkpoint (or any path), tensors
`heads.{i}.down.weight` and `heads.{i}.up.weight` (i = 0..k-1, float16/bfloat16/float32) and
safetensors metadata {"format": "pcgtts-mtp-heads", "version": "1", "num_heads": k,
"hidden_size": D, "target_fingerprint": <fingerprint of the target's speech embedding rows>}.
Loading checks the fingerprint, so heads trained for one target are refused for another.
At run time `TorchHeads` binds them to the torch target's head; `pcgtts export onnx` exports them
with the target (`export/proposer_graphs.py`) for the onnxruntime backend (`onnxruntime.OrtHeads`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from torch import nn

from pcgtts.runtime.files import atomic_output, read_tagged_safetensors

HEADS_FILE = "mtp_heads.safetensors"
TRANSITIONS_FILE = "transitions.pct"  # the code transition table (runtime/decode/transitions.py) for mtp-viterbi
FORMAT = "pcgtts-mtp-heads"
VERSION = "1"


class MTPHeads(nn.Module):
    def __init__(self, num_heads: int, hidden_size: int, target_fingerprint: str = ""):
        super().__init__()
        if num_heads < 1 or hidden_size < 1:
            raise ValueError(f"need num_heads >= 1 and hidden_size >= 1, got {num_heads}, {hidden_size}")
        self.heads = nn.ModuleList(_Head(hidden_size) for _ in range(num_heads))
        self.target_fingerprint = target_fingerprint

    @property
    def num_heads(self) -> int:
        return len(self.heads)

    @property
    def hidden_size(self) -> int:
        return self.heads[0].down.in_features

    def latents(self, hidden: torch.Tensor, count: int | None = None) -> torch.Tensor:
        """hidden [..., D] -> [..., k', D]: the first `count` heads' inputs to the shared head."""
        return torch.stack([head(hidden) for head in self.heads[:count]], dim=-2)

    def logits(self, hidden: torch.Tensor, to_logits: Callable[[torch.Tensor], torch.Tensor],
               count: int | None = None) -> torch.Tensor:
        """hidden [..., D] -> float32 logits [..., k', V_r] through the target's own head,
        `to_logits` (its `Llama.logits`, so a head over part of the vocabulary expands as there)."""
        return to_logits(self.latents(hidden, count))

    def save(self, path: str | Path, dtype: torch.dtype = torch.float16) -> Path:
        """Write the heads atomically (temporary file, then rename)."""
        from safetensors.torch import save_file

        path = Path(path)
        tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in self.state_dict().items()}
        meta = {"format": FORMAT, "version": VERSION, "num_heads": str(self.num_heads),
                "hidden_size": str(self.hidden_size), "target_fingerprint": self.target_fingerprint}
        with atomic_output(path) as tmp:
            save_file(tensors, str(tmp), metadata=meta)
        return path

    @classmethod
    def load(cls, path: str | Path, *, fingerprint: str | None = None, hidden_size: int | None = None,
             device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> "MTPHeads":
        """Load a heads file; `fingerprint`/`hidden_size` (the target's) are checked when given."""
        tensors, meta = read_tagged_safetensors(path, FORMAT, VERSION, "multi-token heads file",
                                                "train them with `pcgtts train heads`")
        k, d = int(meta["num_heads"]), int(meta["hidden_size"])
        if hidden_size is not None and d != hidden_size:
            raise ValueError(f"{path}: heads of hidden size {d} do not fit a target of hidden size {hidden_size}")
        stored = meta.get("target_fingerprint", "")
        if fingerprint is not None and stored and stored != fingerprint:
            raise ValueError(f"{path}: these heads were trained for another target "
                             f"(speech embeddings {stored[:12]}..., this target {fingerprint[:12]}...)")
        heads = cls(k, d, stored)
        try:
            heads.load_state_dict(tensors)
        except RuntimeError as err:
            raise ValueError(f"{path}: tensors do not match {k} heads of size {d} ({err})") from None
        return heads.to(device=device, dtype=dtype).eval().requires_grad_(False)


class _Head(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.down = nn.Linear(hidden_size, hidden_size, bias=False)
        self.up = nn.Linear(hidden_size, hidden_size, bias=False)
        nn.init.zeros_(self.up.weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.up(nn.functional.silu(self.down(h)))


__all__ = ["MTPHeads", "HEADS_FILE", "TRANSITIONS_FILE"]


class TorchHeads:
    """`MTPHeads` on the torch target's own head: logits(hidden [D], count) -> [count, V_r] float32."""

    def __init__(self, heads: MTPHeads, target):
        if heads.hidden_size != target.head.in_features:
            raise ValueError(f"heads of hidden size {heads.hidden_size} do not fit this target "
                             f"(hidden size {target.head.in_features})")
        self.heads, self.model = heads, target
        self.num_heads, self.hidden_size = heads.num_heads, heads.hidden_size
        self.dtype, self.device = target.dtype, target.embed_tokens.weight.device

    def logits(self, hidden: torch.Tensor, count: int) -> torch.Tensor:
        return self.heads.logits(hidden.to(self.dtype), self.model.logits, count)

