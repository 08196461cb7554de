"""Plain helpers shared by test modules (fixtures live in conftest.py)."""

from __future__ import annotations

import torch

from pcgtts.runtime.config import DecodeConfig
from pcgtts.runtime.decode.speculative import DecodeStats, decode


def decode_codes(target, proposer, prompt, policy, sampling, tokens=40, seed=0, groups=None, draft_length=3,
                 costs=None, **extra):
    """Decode `prompt` with `policy` (a hidden-state proposer, or None) -> (codes, DecodeStats)."""
    config = DecodeConfig(policy=policy, max_new_tokens=tokens, draft_length=draft_length, sampling=sampling, **extra)
    stats = DecodeStats()
    out = [t for burst in decode(target, None, prompt, config, torch.Generator().manual_seed(seed), groups, stats,
                                 proposer=proposer, costs=costs) for t in burst]
    return out, stats
