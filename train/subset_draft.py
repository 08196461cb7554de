"""A draft made from a subset of the target's layers.

The PCG paper's draft is a 3-layer subset of the target initialised from its weights (then
fine-tuned). `make_layer_subset_draft` writes such a checkpoint in the same Hugging Face
format as the target, keeping embeddings, final norm, LM head and tokenizer, so every loader
and export path treats it like any other LLaSA model.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch

from pcgtts.runtime.lm.checkpoint import TOKENIZER_FILES, read_config, read_state_dict

log = logging.getLogger(__name__)


def spread_layers(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Evenly spaced layer indices including the first and the last."""
    if not 1 <= num_draft_layers <= num_target_layers:
        raise ValueError(f"draft layers must lie in [1, {num_target_layers}], got {num_draft_layers}")
    if num_draft_layers == 1:
        return [0]
    step = (num_target_layers - 1) / (num_draft_layers - 1)
    return sorted({round(i * step) for i in range(num_draft_layers)})


def make_layer_subset_draft(target_dir: str | Path, out_dir: str | Path, layers: list[int] | int) -> Path:
    """Write a draft checkpoint keeping `layers` (indices, or a count spread over the depth)."""
    from safetensors.torch import save_file

    target_dir, out_dir = Path(target_dir), Path(out_dir)
    cfg = read_config(target_dir)
    n = cfg["num_hidden_layers"]
    keep = spread_layers(n, layers) if isinstance(layers, int) else sorted(set(layers))
    if not keep or min(keep) < 0 or max(keep) >= n:
        raise ValueError(f"layer indices must lie in [0, {n}), got {keep}")
    state = read_state_dict(target_dir)
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key.startswith("model.layers."):
            idx = int(key.split(".")[2])
            if idx not in keep:
                continue
            key = key.replace(f"model.layers.{idx}.", f"model.layers.{keep.index(idx)}.", 1)
        out[key] = value.contiguous()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(out, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = dict(cfg, num_hidden_layers=len(keep))
    cfg["pcgtts_draft"] = {"source": str(target_dir), "layers": keep}
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in TOKENIZER_FILES + ("generation_config.json",):
        if (target_dir / name).is_file():
            shutil.copy(target_dir / name, out_dir / name)
    log.info("draft with layers %s of %d written to %s", keep, n, out_dir)
    return out_dir
