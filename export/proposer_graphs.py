"""The target's own proposers as ONNX-exportable modules, beside its step graph: the EAGLE
draft's step (`eagle.onnx`) and the multi-token heads (`mtp_heads.onnx`), so the onnxruntime
backend runs the eagle-* and mtp-* policies without the torch model.

EagleGraph does everything a proposal needs:

    hidden_states                [1, T, D]  float32 target states h_j (or the draft's own f, fed back)
    restricted_ids               [1, T]     int64   the token chosen after each row, as a
                                                    restricted-vocabulary index (speech code or stop)
    position_ids                 [1, T]     int64   the draft's cache slots start..start+T-1
    past_key_values.0.key/value  [1, kv, S, D_h]    its one block's whole cache buffer
 -> last_hidden_state            [1, 1, D]  float32 f of the last row (stands in for the next h)
    head_scores                  [1, 1, W]  float32 the target head's scores of f: its logits
                                                    (W = V_r), or a digit head's 34 scores
    present.0.key / .value       [1, kv, T, D_h]    keys/values of the T new rows only

A draft that reads several target layers (`EagleDraft.feature_layers`) is exported without its
fuse map: the graph reads rows of width D (the fused state, or f fed back), and the runtime fuses a
target's wider row with the map saved beside it (`eagle_fuse.npy`, `onnxruntime.OrtEagleStep`).

Same cache contract as `lm_graph.py` (the runtime owns the buffer, rollback is O(1)). An
attention-free draft (`block="mlp"`) has neither positions nor a cache: its graph reads
hidden_states and restricted_ids and returns last_hidden_state and head_scores. The graph
carries its own copy of the target's speech-token embedding rows and head (a digit head: 34
rows; a full head: V_r rows, which doubles those two matrices' memory beside the target graph).

HeadsGraph: the k heads on one target state, through the target's head (expanded as there):

    last_hidden_state            [1, D]     float32 the target's state that predicted the next token
 -> logits                       [1, k, V_r] float32 tokens 2 .. k + 1 positions ahead
"""

from __future__ import annotations

import torch
from torch import nn

from pcgtts.export.lm_graph import block_step, rotate_half_matrix
from pcgtts.runtime.lm.eagle import EagleDraft
from pcgtts.runtime.lm.llama import Llama, rope_cos_sin


class EagleGraph(nn.Module):
    def __init__(self, draft: EagleDraft, target: Llama, restricted_token_ids: torch.Tensor):
        super().__init__()
        self.draft = draft
        self.embed = nn.Embedding.from_pretrained(target.embed_tokens.weight[restricted_token_ids].clone())
        self.head = target.head

    def inputs(self, hidden_states: torch.Tensor, restricted_ids: torch.Tensor) -> torch.Tensor:
        d = self.draft
        dtype = d.fc.weight.dtype
        return d.fc(torch.cat([hidden_states.to(dtype), self.embed(restricted_ids).to(dtype)], dim=-1))

    def outputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.draft.norm(x[:, -1:])
        return f.float(), self.head(f).float()

    def forward(self, hidden_states: torch.Tensor, restricted_ids: torch.Tensor, position_ids: torch.Tensor,
                past_k: torch.Tensor, past_v: torch.Tensor):
        d = self.draft
        cos, sin = rope_cos_sin(d.inv_freq, position_ids[0], d.fc.weight.dtype)
        x, k, v = block_step(d.block, self.inputs(hidden_states, restricted_ids), cos, sin, past_k, past_v,
                             position_ids[:, :1], rotate_half_matrix(cos.shape[-1], cos.dtype))
        return (*self.outputs(x), k, v)


class EagleMlpGraph(EagleGraph):
    """An attention-free draft's step: no cache; rows are independent, the last one's f is returned."""

    def forward(self, hidden_states: torch.Tensor, restricted_ids: torch.Tensor):
        return self.outputs(self.draft.block(self.inputs(hidden_states, restricted_ids)))


class HeadsGraph(nn.Module):
    def __init__(self, heads, target: Llama):
        super().__init__()
        self.heads, self.target = heads, target

    def forward(self, last_hidden_state: torch.Tensor) -> torch.Tensor:
        hidden = last_hidden_state.to(self.target.head.weight.dtype)
        return self.heads.logits(hidden, self.target.logits)


HEADS_INPUTS, HEADS_OUTPUTS = ["last_hidden_state"], ["logits"]
INPUTS = ["hidden_states", "restricted_ids", "position_ids", "past_key_values.0.key", "past_key_values.0.value"]
OUTPUTS = ["last_hidden_state", "head_scores", "present.0.key", "present.0.value"]
MLP_INPUTS, MLP_OUTPUTS = INPUTS[:2], OUTPUTS[:2]
