"""Per-call settings as frozen, validated dataclasses. Override with `dataclasses.replace`."""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("ar", "draft", "sd", "ssd", "pcg")


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.8  # LLaSA's recipe; 0 means greedy (argmax) everywhere
    top_p: float = 1.0  # nucleus mass kept; LLaSA uses 1 (no truncation)

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class DecodeConfig:
    policy: str = "pcg"  # ar | draft | sd | ssd | pcg
    lookahead: int = 3  # draft tokens proposed per verify step (the paper's L_d)
    ssd_beta: float = 0.4  # SSD's tolerance added to min(1, target/draft)
    max_new_tokens: int = 2000  # speech tokens per utterance (40 s of audio)
    pcg_thinning_trials: int = 16  # residual-sampler trials drawn at once before the exact fallback
    sampling: SamplingConfig = SamplingConfig()

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if not (1 <= self.lookahead <= 16):
            raise ValueError(f"lookahead must lie in [1, 16], got {self.lookahead}")
        if self.ssd_beta < 0:
            raise ValueError(f"ssd_beta must be >= 0, got {self.ssd_beta}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.pcg_thinning_trials < 1:
            raise ValueError(f"pcg_thinning_trials must be >= 1, got {self.pcg_thinning_trials}")
