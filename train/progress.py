"""Shared training plumbing for the speech lab: atomic checkpoints with RNG state, a JSONL loss
log that survives restarts, and the loss-curve PNG. Used by codec.py, lm.py and draft.py."""

from __future__ import annotations

import json
import math
import logging
import os
import random
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)


def save_checkpoint(path: Path, state: dict) -> Path:
    """torch.save to a temp file in the same folder, then os.replace (never a half-written file)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    return path


def save_arrays(path: Path, arrays: dict) -> Path:
    """np.savez to a temp file in the same folder, then os.replace (never a half-written file)."""
    path = Path(path)
    tmp = path.with_name(path.stem + ".tmp.npz")  # ends in .npz, or np.savez would append it
    np.savez(tmp, **arrays)
    os.replace(tmp, path)
    return path


def load_checkpoint(path: Path) -> dict:
    try:
        return torch.load(Path(path), map_location="cpu", weights_only=False)
    except Exception as err:  # a corrupt or foreign file: say which
        raise ValueError(f"cannot read checkpoint {path}: {err}") from None


def rng_state(rng: random.Random) -> dict:
    return {"python": rng.getstate(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict, rng: random.Random) -> None:
    rng.setstate(state["python"])
    torch.set_rng_state(state["torch"])


class LossLog:
    """Append-only JSONL of {"step": ..., "loss": ..., ...}; truncated to the checkpoint's step on resume."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.records: list[dict] = []
        if self.path.is_file():
            self.records = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def truncate(self, step: int) -> None:
        self.records = [r for r in self.records if r["step"] <= step]
        self._rewrite()

    def _rewrite(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in self.records))
        os.replace(tmp, self.path)

    def append(self, record: dict) -> None:
        self.records.append(record)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def last(self, key: str):
        return self.records[-1][key] if self.records else None

    def plot(self, png: Path, title: str, keys=("loss",)) -> Path | None:
        """Loss curve(s) against step, written atomically; None when there is nothing to plot."""
        if not self.records:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key in keys:
            pts = [(r["step"], r[key]) for r in self.records if r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), label=key)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        png = Path(png)
        tmp = png.with_name(png.stem + ".tmp.png")
        fig.savefig(tmp, dpi=100)
        plt.close(fig)
        os.replace(tmp, png)
        return png


def check_device(device: str) -> None:
    """A training config's device: cpu or cuda[:N] (ValueError otherwise)."""
    if device.split(":")[0] not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda[:N], got {device!r}")


def training_device(device: str) -> torch.device:
    """The torch device a training run uses; a CUDA device this machine lacks is refused in one line."""
    out = torch.device(device)
    if out.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda asked for, but torch sees no CUDA device")
    return out


def lr_at(step: int, cfg) -> float:
    """Linear warm-up over `cfg.warmup` steps, then cosine decay to `cfg.min_lr_ratio * cfg.lr` at `cfg.steps`."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def resume(ckpt_path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rng: random.Random,
           losses: "LossLog", model_config: dict) -> int:
    """Restore model, optimizer, RNG and loss log from `ckpt_path` if it exists; the step to go on
    from (0 for a fresh run). A checkpoint of another model config is refused."""
    if not ckpt_path.is_file():
        return 0
    state = load_checkpoint(ckpt_path)
    if state.get("model_config") != model_config:
        raise ValueError(f"{ckpt_path} was trained with another model config; use a new --out")
    model.load_state_dict(state["model"])
    if "optimizer" in state:
        optimizer.load_state_dict(state["optimizer"])
        set_rng_state(state["rng"], rng)
    else:  # a model-only checkpoint (`join_checkpoint`: weights brought back from another machine)
        log.warning("%s holds no optimizer state: going on from step %d with fresh AdamW moments",
                    ckpt_path, state["step"])
    losses.truncate(state["step"])
    log.info("resumed %s at step %d", ckpt_path, state["step"])
    return state["step"]


def split_checkpoint(ckpt: Path, out_dir: Path, max_bytes: int = 15 << 20,
                     dtype: torch.dtype | None = None) -> list[Path]:
    """The model-only part of a checkpoint (weights, model config, step; no optimizer) as files of at
    most `max_bytes` each, so a run's weights can be copied back from a machine that bounds a file's size.
    `dtype`: cast floating-point weights (e.g. float16 to carry them to the next machine in half the size)."""
    state = load_checkpoint(ckpt)
    if dtype is not None:
        state["model"] = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state["model"].items()}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {k: v for k, v in state.items() if k not in ("model", "optimizer", "rng")}
    parts: list[dict] = [{}]
    size = 0
    for name, tensor in state["model"].items():
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > max_bytes:
            raise ValueError(f"{name} alone is {nbytes} bytes, over the {max_bytes}-byte limit")
        if size + nbytes > max_bytes and parts[-1]:
            parts.append({})
            size = 0
        parts[-1][name] = tensor
        size += nbytes
    paths = []
    for i, part in enumerate(parts):
        paths.append(save_checkpoint(out_dir / f"model-part{i}.pt", {"model": part, **(meta if i == 0 else {})}))
    return paths


def join_checkpoint(parts_dir: Path, ckpt: Path) -> Path:
    """Reassemble `split_checkpoint`'s files into a model-only checkpoint (what `load_factorised` and
    `pack_voice` read; a run resumed from it starts a fresh optimizer)."""
    paths = sorted(Path(parts_dir).glob("model-part*.pt"), key=lambda p: int(p.stem.removeprefix("model-part")))
    if not paths:
        raise FileNotFoundError(f"no model-part*.pt in {parts_dir}")
    state = load_checkpoint(paths[0])
    for path in paths[1:]:
        state["model"].update(load_checkpoint(path)["model"])
    state["model"] = {k: v.float() if v.is_floating_point() else v for k, v in state["model"].items()}
    return save_checkpoint(Path(ckpt), state)
