"""Plain helpers shared by test modules (fixtures live in conftest.py)."""

from __future__ import annotations

import time

import numpy as np
import torch

from pcgtts.runtime.config import DecodeConfig, SamplingConfig
from pcgtts.runtime.decode.loop import decode
from pcgtts.runtime.decode.steps import DecodeStats


def decode_codes(target, proposer, prompt, policy, sampling, tokens=40, seed=0, groups=None, draft_length=3,
                 costs=None, draft=None, **extra):
    """Decode `prompt` with `policy` (a hidden-state proposer, or None; a `draft` LM for the draft
    policies) -> (codes, DecodeStats); a fixed draft length unless `adaptive_draft=True` is passed (the
    loop's mechanics are tested per L). Other keywords are `DecodeConfig` fields."""
    extra.setdefault("adaptive_draft", False)
    config = DecodeConfig(policy=policy, max_new_tokens=tokens, draft_length=draft_length, sampling=sampling, **extra)
    stats = DecodeStats()
    out = [t for burst in decode(target, draft, prompt, config, torch.Generator().manual_seed(seed), groups, stats,
                                 proposer=proposer, costs=costs) for t in burst]
    return out, stats


def random_heads(target, k=3, seed=0, scale=0.5):
    """Heads with random (not identity) maps, so proposals differ from a repeat of the last row."""
    from pcgtts.runtime.lm.heads import MTPHeads

    heads = MTPHeads(k, target.model.head.in_features, target.fingerprint)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * scale / p.shape[1] ** 0.5)
    return heads.eval()


def random_draft(target, seed=0, scale=1.0, block="attention", feature_layers=()):
    """A random `EagleDraft` for a loaded torch target (its matrices scaled like an initialisation)."""
    from pcgtts.runtime.lm.eagle import EagleDraft

    draft = EagleDraft(target.model.args, target.fingerprint, block=block, feature_layers=feature_layers)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * scale / p.shape[1] ** 0.5)
    return draft.eval().requires_grad_(False)


def propose_after(proposer, hidden, tokens, slot, count, config, generator):
    """Feed a state proposer the rows hidden [k, D] (target slots from `slot`) and the tokens chosen
    after them, then take `count` proposals at `config`'s sampling -> (proposals, their rows as the
    rule reads them: probabilities [count, V] or `DigitRows`); (None, None) when count is 0."""
    from pcgtts.runtime.decode.rows import DenseRows

    proposer.observe(hidden, tokens, slot)
    if not count:
        return None, None
    proposals, rows = proposer.propose(count, None, config.sampling, generator)
    return proposals, rows.probs if isinstance(rows, DenseRows) else rows


def third_codes(target, proposer, prompt, policy, seed, runs=1500, temperature=0.5):
    """The 3rd generated code of `runs` decodes of `prompt` with `policy` (one generator seeded `seed`),
    the first one a proposer proposes after a proposal of its own; runs that sampled the stop token
    early are left out (on both sides of a comparison alike)."""
    gen = torch.Generator().manual_seed(seed)
    config = DecodeConfig(policy=policy, max_new_tokens=3, draft_length=3, adaptive_draft=False,
                          sampling=SamplingConfig(temperature=temperature))
    out = []
    for _ in range(runs):
        codes = [t for b in decode(target, None, prompt, config, gen, proposer=proposer) for t in b]
        if len(codes) == 3:
            out.append(codes[2])
    return np.array(out)


def assert_same_marginal(a, b, top=8, significance=1e-3):
    """Two-sample chi-square test of two samples of codes over their `top` most frequent codes + the rest
    pooled, at `significance` (its false-alarm rate; the callers' seeds are fixed, so it is deterministic)."""
    from scipy.stats import chi2_contingency

    values, counts = np.unique(np.concatenate([a, b]), return_counts=True)
    frequent = values[np.argsort(-counts, kind="stable")[:top]]
    table = np.array([[np.sum(x == c) for c in frequent] + [np.sum(~np.isin(x, frequent))] for x in (a, b)])
    assert table.min() >= 5  # the chi-square approximation holds
    _, p_value, _, _ = chi2_contingency(table)
    assert p_value > significance, (p_value, table)


def wait_until(condition, seconds: float = 5.0) -> bool:
    """Whether `condition()` holds within `seconds` (polled every 20 ms)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def assert_a_model_path_setting(tmp_path, name: str, value: str) -> None:
    """The model path `name` ("clone_codec", "clone_target") is read from a config file's [models]
    (relative to the file), from settings and from its `--flag` of `speak`."""
    from pcgtts.cli import build_parser
    from pcgtts.cli.commands import resolve_settings_from_flags
    from pcgtts.runtime.config import read_config_file, resolve_settings

    (tmp_path / "settings.toml").write_text(f'[models]\ntarget = "t"\ncodec = "c"\n{name} = "{value}"\n')
    assert read_config_file(tmp_path / "settings.toml")[name] == str(tmp_path / value)
    assert getattr(resolve_settings({name: "x"}).models, name) == "x"
    args = build_parser().parse_args(["speak", "hi", "--target", "t", "--codec", "c", f"--{name.replace('_', '-')}",
                                      value, "--out", str(tmp_path / "o.wav")])
    assert getattr(resolve_settings_from_flags(args).models, name) == value


def benchmark_script(name: str, monkeypatch=None):
    """benchmarks/`name`.py loaded as a module (a folder of scripts, not a package); with `monkeypatch`,
    registered in sys.modules under `name` for the test (a dataclass there looks its module up)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    if monkeypatch is not None:
        monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module
