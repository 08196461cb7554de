"""Speech-lab draft: a 3-layer draft initialised from the target's layers, briefly fine-tuned.

Last training step of the lab (corpus -> codec -> LM -> **draft**). The paper's recipe: the
`subset_draft.make_layer_subset_draft` writes the layer-subset checkpoint (`<out>/init`, a plain
LlamaForCausalLM, what `pcgtts train draft init` makes); the fine-tune then starts from the target's
factorised weights (text rows + FSQ digit rows, from the target's training checkpoint) with the
body replaced by those layers, trains on the same examples (codes cached by lm.py) and exports
a materialised LlamaForCausalLM to `<out>/export`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from pcgtts.runtime.lm.checkpoint import read_state_dict
from pcgtts.train.subset_draft import make_layer_subset_draft
from pcgtts.train.lm import (ExampleBuilder, FactorisedLM, LMModelConfig, LMTrainConfig, split_records,
                             load_factorised, train_loop)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftTrainConfig:
    target: Path  # the target's export (plain LlamaForCausalLM)
    lm_dir: Path  # the target's training folder: checkpoint.pt (factorised weights) + codes.npz
    out_dir: Path
    layers: int = 3
    steps: int = 1000
    batch_size: int = 8
    lr: float = 5e-4
    checkpoint_minutes: float = 5.0
    log_every: int = 20
    seed: int = 1
    threads: int = 1
    used_codes_head: bool = True  # the export's head covers only codes that occur in the corpus (+ stop)

    def __post_init__(self) -> None:
        for name in ("target", "lm_dir", "out_dir"):
            object.__setattr__(self, name, Path(getattr(self, name)))
        if self.layers < 1 or self.steps < 1 or self.batch_size < 1:
            raise ValueError("layers, steps and batch_size must be >= 1")


def init_draft(cfg: DraftTrainConfig) -> tuple[FactorisedLM, object, list[int], dict]:
    """Write `<out>/init` with the runtime's layer-subset builder; return the factorised draft."""
    init_dir = make_layer_subset_draft(cfg.target, cfg.out_dir / "init", cfg.layers)
    layers = json.loads((init_dir / "config.json").read_text())["pcgtts_draft"]["layers"]
    target, tokenizer, state = load_factorised(cfg.lm_dir)
    mc = LMModelConfig(**{**state["model_config"], "num_layers": len(layers)})
    from pcgtts.train.lm import build_model

    draft = build_model(mc, tokenizer, cfg.seed)
    body = {k[len("model."):]: v for k, v in read_state_dict(init_dir).items()
            if k.startswith("model.") and k != "model.embed_tokens.weight"}
    missing, unexpected = draft.body.load_state_dict(body, strict=False)
    if missing or unexpected:
        raise ValueError(f"draft init does not match the body: missing {missing[:3]}, unexpected {unexpected[:3]}")
    draft.text.data.copy_(target.text.data)
    draft.digits.data.copy_(target.digits.data)
    return draft, tokenizer, layers, asdict(mc)


def train_draft(cfg: DraftTrainConfig, progress=None, stop_after: int | None = None) -> dict:
    codes_path = cfg.lm_dir / "codes.npz"
    if not codes_path.is_file():
        raise FileNotFoundError(f"no cached codes at {codes_path} (run `pcgtts train lm` first)")
    lm_cfg = json.loads((cfg.lm_dir / "train_config.json").read_text())
    draft, tokenizer, layers, model_config = init_draft(cfg)
    codes = dict(np.load(codes_path))
    train_cfg = LMTrainConfig(corpus=lm_cfg["corpus"], codec=lm_cfg["codec"], out_dir=cfg.out_dir,
                              steps=cfg.steps, batch_size=cfg.batch_size, lr=cfg.lr, warmup=min(50, cfg.steps),
                              checkpoint_minutes=cfg.checkpoint_minutes, log_every=cfg.log_every, seed=cfg.seed,
                              threads=cfg.threads, max_tokens=lm_cfg["max_tokens"],
                              voice_prompt_prob=lm_cfg["voice_prompt_prob"],
                              unprompted_speakers=_speakers(lm_cfg.get("unprompted_speakers")))
    train, held = split_records(Path(lm_cfg["corpus"]))
    builder = ExampleBuilder(tokenizer, train, codes, train_cfg)
    held = [r for r in held if r["id"] in codes]
    heldout = ExampleBuilder(tokenizer, held, codes, train_cfg) if held else None
    summary = train_loop(draft, tokenizer, builder, heldout, train_cfg, cfg.out_dir,
                         {"model_config": model_config, "kind": "factorised-llasa-draft", "layers": layers},
                         progress, stop_after, title=f"draft ({len(layers)} layers of the target) NLL")
    # Record the provenance the runtime's draft builder writes, in the exported config too.
    cfg_path = cfg.out_dir / "export" / "config.json"
    exported = json.loads(cfg_path.read_text())
    exported["pcgtts_draft"] = {"source": str(cfg.target), "layers": layers, "fine_tuned_steps": summary["step"]}
    cfg_path.write_text(json.dumps(exported, indent=2))
    if cfg.used_codes_head:  # a head over the codes the corpus uses: a fraction of the 65,536 rows
        from pcgtts.runtime.lm.checkpoint import write_head_codes

        used = np.concatenate([np.asarray(c).reshape(-1) for c in codes.values()])
        summary["head_rows"] = int(np.load(write_head_codes(cfg.out_dir / "export", used, draft.num_speech)).size)
    summary["layers"] = layers
    return summary


def _speakers(names) -> tuple[str, ...] | None:
    return tuple(names) if names is not None else None


__all__ = ["DraftTrainConfig", "init_draft", "train_draft"]
