"""The release gate: a new built-in voice does not replace the shipped one if it is worse.

`pcgtts train package` runs it whenever the folder it writes already holds a voice: the new voice is
written to a staging folder, both voices speak the same test sentences with the same seeds, and the
new one is moved into place only when nothing got worse beyond its interval:

- **intelligibility**, per voice: the model's own voice (`default`) and every preset both have. WER of
  each (sentence, seed) utterance, plain decoding at each voice's own temperature, new minus old with
  the paired 95 % t-interval (`stats.paired_diff`); worse = the interval's low end above 0;
- **identity**, per preset (when both voices have at least two in common): each preset's
  nearest-neighbour cases among the presets (`presets.run_presets`), passed = 1, paired the same way;
  worse = the interval's high end below 0;
- **draft acceptance**, per speculative policy (pcg, eagle-pcg): each utterance's accepted / drafted
  tokens in the default voice on the runtime's own route at its fixed draft length, paired;
  worse = the high end below 0. A policy the old voice runs and the new one cannot (no EAGLE draft)
  is worse too;
- a preset the old voice has and the new one drops, unless it is named as dropped on purpose.

A refusal names every failure in one line; `accept_worse="REASON"` lets the voice through, and the
reason is recorded with the comparison (voice.json "gate", the model card's comparison section).

    result = run_gate(old_dir, new_dir, GateConfig(sentences=6))         # loads both voices (torch)
    result = run_gate(old_dir, new_dir, cfg, open_voice=..., transcribe=..., embed=...)  # injected judges
    check_gate(result)                                                   # GateRefused when worse
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Protocol, Sequence

import numpy as np

from pcgtts.quality.stats import paired_diff
from pcgtts.runtime.audio.presets import DEFAULT_VOICE  # the model's own voice, unprompted

log = logging.getLogger(__name__)

GATE_POLICIES = ("pcg", "eagle-pcg")  # the speculative routes whose acceptance is compared
CARD_HEADING = "## Comparison with the voice it replaced"


class GateRefused(ValueError):
    """The new voice is worse than the shipped one (the message names every failure)."""


@dataclass(frozen=True)
class GateConfig:
    sentences: int = 20  # the first N of the quality test set (quality/testset_v1.json, 20 sentences)
    seeds: tuple[int, ...] = (0, 1)
    temperature: float | None = None  # None: each voice at its own (voice.json "settings"), else the runtime's
    policies: tuple[str, ...] = GATE_POLICIES
    confidence: float = 0.95
    max_tokens: int | None = None  # speech tokens per utterance; None: the runtime's cap

    def __post_init__(self) -> None:
        if not (isinstance(self.sentences, int) and self.sentences >= 2):
            raise ValueError(f"the gate needs at least 2 sentences, got {self.sentences!r}")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"the gate needs one or more distinct seeds, got {self.seeds!r}")
        if self.temperature is not None and not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        unknown = [p for p in self.policies if p not in GATE_POLICIES]
        if unknown:
            raise ValueError(f"the gate compares the acceptance of {', '.join(GATE_POLICIES)}; got {unknown}")
        if not 0 < self.confidence < 1:
            raise ValueError(f"confidence must lie in (0, 1), got {self.confidence}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


class VoiceRunner(Protocol):
    """One voice as the gate measures it."""

    presets: Sequence[str]  # its preset names

    def speak(self, text: str, voice: str, seed: int) -> np.ndarray: ...  # plain decoding, 16 kHz

    def acceptance(self, text: str, policy: str, seed: int) -> float | None: ...  # accepted / drafted; None: none

    def runs(self, policy: str) -> bool: ...  # whether it has the proposer the policy needs


class SynthesizerRunner:
    """A loaded `Synthesizer` as a `VoiceRunner`: every utterance through the public streaming API."""

    def __init__(self, synth, temperature: float | None = None, max_tokens: int | None = None):
        self.synth = synth
        self.presets = tuple(synth.presets.names)
        decode = synth.config.decode
        if temperature is not None:
            decode = replace(decode, sampling=replace(decode.sampling, temperature=temperature))
        if max_tokens is not None:
            decode = replace(decode, max_new_tokens=max_tokens)
        self.decode = decode
        self.temperature = decode.sampling.temperature

    def _run(self, text: str, voice: str, seed: int, policy: str, **decode):
        from pcgtts.quality.harness import synthesize_one

        config = replace(self.synth.config, seed=seed, decode=replace(self.decode, policy=policy, **decode))
        return synthesize_one(self.synth, text, config, voice)

    def speak(self, text: str, voice: str, seed: int) -> np.ndarray:
        return self._run(text, voice, seed, "ar")[0]

    def acceptance(self, text: str, policy: str, seed: int) -> float | None:
        # at the fixed draft length: the adaptive one follows this machine's step timings, and where
        # speculation does not pay it drafts nothing, so it would not measure the drafts
        stats = self._run(text, DEFAULT_VOICE, seed, policy, adaptive_draft=False)[1]
        return stats["accepted"] / stats["drafted"] if stats["drafted"] else None

    def runs(self, policy: str) -> bool:
        from pcgtts.runtime.decode.policy import Proposer
        from pcgtts.runtime.decode.policy import policy as policy_spec

        proposer = {Proposer.EAGLE: self.synth.eagle, Proposer.DRAFT: self.synth.draft}[policy_spec(policy).proposer]
        return proposer is not None and self.synth.groups is not None


def open_pack(pack_dir: str | Path, cache_root: str | Path | None = None, temperature: float | None = None,
               max_tokens: int | None = None) -> SynthesizerRunner:
    """A voice folder (pcgtts/voice's layout) loaded as the built-in voice is: prepared into the cache
    folder the built-in voice uses (`cache_root`, default the user's cache; `voice-<voice.json digest>`),
    played at its own settings and presets, on torch in float32 (the model its int8 graphs export)."""
    import json

    from pcgtts.runtime.config import PRESETS_FOLDER
    from pcgtts.runtime.prepared import checkpoint_paths, is_prepared
    from pcgtts.runtime.synthesizer import Synthesizer, pretrained_settings
    from pcgtts.runtime.voicepack import check_voice_settings, voice_cache_folder
    from pcgtts.tools.prepare import prepare_builtin

    pack = Path(pack_dir)
    if not (pack / "voice.json").is_file():
        raise ValueError(f"{pack}: no voice.json, not a voice folder")
    cache = voice_cache_folder(pack, cache_root)  # the built-in voice's, when it is this voice
    if not is_prepared(cache, ("expand",)):  # expanded once; an export of its graphs at work is not waited for
        prepare_builtin(cache, pack, onnx=False, progress=False, wait=True)
    own = check_voice_settings(json.loads((pack / "voice.json").read_text()).get("settings", {}), pack / "voice.json")
    presets = pack / PRESETS_FOLDER
    settings = pretrained_settings(**checkpoint_paths(cache), backend="torch", **own,
                                   presets=str(presets) if (presets / "voices.json").is_file() else None)
    synth = Synthesizer.load(settings.models, settings.device, settings.synthesis)
    return SynthesizerRunner(synth, temperature, max_tokens)


def gate_sentences(count: int) -> list[str]:
    """The first `count` sentences of the quality test set."""
    from pcgtts.quality.testset import TestSet

    return [s.text for s in TestSet.load().take(count)]


def _key(sentence: int, seed: int) -> str:
    return f"{sentence}:{seed}"


def measure(runner: VoiceRunner, names: Sequence[str], sentences: Sequence[str], seeds: Sequence[int],
            policies: Sequence[str], transcribe: Callable, embed: Callable | None,
            progress: Callable[[str], None] = lambda m: None) -> dict:
    """Per-utterance WER of each voice in `names` ("default" and presets), identity cases of the presets
    among themselves (two or more), acceptance per policy the voice runs; keyed "sentence:seed"."""
    from pcgtts.quality.metrics import error_rates
    from pcgtts.quality.presets import run_presets

    presets = [n for n in names if n != DEFAULT_VOICE]
    wer: dict[str, dict[str, float]] = {name: {} for name in names}  # in the order named: default first
    identity: dict[str, dict[str, float]] = {}
    if len(presets) >= 2:
        scored = run_presets(runner.speak, presets, sentences, seeds, embed=embed, transcribe=transcribe,
                             progress=progress)
        for r in scored["records"]:
            wer[r["voice"]][_key(r["sentence"], r["seed"])] = r["wer"]
        for c in scored["cases"]:
            identity.setdefault(c["voice"], {})[_key(c["sentence"], c["seed"])] = float(c["passed"])
    for name in [n for n in names if not wer[n]]:
        for seed in seeds:
            for i, text in enumerate(sentences):
                progress(f"{name} seed {seed} sentence {i + 1}/{len(sentences)}")
                wer[name][_key(i, seed)] = error_rates(text, transcribe(runner.speak(text, name, seed)))[0]
    acceptance: dict[str, dict[str, float | None]] = {}
    for policy in policies:
        if not runner.runs(policy):
            continue
        for seed in seeds:
            for i, text in enumerate(sentences):
                progress(f"{policy} seed {seed} sentence {i + 1}/{len(sentences)}")
                acceptance.setdefault(policy, {})[_key(i, seed)] = runner.acceptance(text, policy, seed)
    return {"wer": wer, "identity": identity, "acceptance": acceptance}


def _mean(values) -> float | None:
    finite = [v for v in values if v is not None and not math.isnan(v)]
    return float(np.mean(finite)) if finite else None


def compare(old: dict, new: dict, confidence: float = 0.95, dropped: Sequence[str] = (),
            allowed_drops: Sequence[str] = ()) -> dict:
    """Rows (what, voice, old mean, new mean, paired difference new - old) and the failures among them."""
    rows, failures = [], []
    for metric, higher_is_better in (("wer", False), ("identity", True), ("acceptance", True)):
        for name, base in old[metric].items():
            if name not in new[metric]:
                continue
            diff = paired_diff(new[metric][name], base, confidence)
            worse = diff.n >= 2 and (diff.high < 0 if higher_is_better else diff.low > 0)
            rows.append({"metric": metric, "voice": name, "old": _mean(base.values()),
                         "new": _mean(new[metric][name].values()), "diff": diff.as_dict(), "worse": worse})
            if worse:
                failures.append(f"{name} {metric} {100 * rows[-1]['old']:.1f} % -> {100 * rows[-1]['new']:.1f} % "
                                f"(paired {diff.format(100, signed=True)} points)")
    for policy in old["acceptance"]:
        if policy not in new["acceptance"]:
            failures.append(f"{policy} no longer runs (the new voice has no proposer for it)")
    for name in dropped:
        if name not in allowed_drops:
            failures.append(f"preset {name} is dropped")
    return {"rows": rows, "failures": failures}


def run_gate(old_dir: str | Path, new_dir: str | Path, config: GateConfig = GateConfig(), *,
             open_voice: Callable[[Path], VoiceRunner] | None = None, transcribe: Callable | None = None,
             embed: Callable | None = None, allowed_drops: Sequence[str] = (),
             progress: Callable[[str], None] = lambda m: None) -> dict:
    """Measure the shipped voice (`old_dir`) and the new one (`new_dir`) on the same sentences and seeds
    and compare them (`compare`). `open_voice(folder) -> VoiceRunner` (default: `open_pack` at the
    config's temperature and token cap; the new voice
    prepared into a scratch cache, removed afterwards), `transcribe(audio) -> text` and `embed(audio) -> vector`
    (default: PocketSphinx and resemblyzer) are injectable."""
    import json
    import tempfile

    from pcgtts.quality.metrics import recognizer, speaker_encoder

    started = time.monotonic()
    sentences = gate_sentences(config.sentences)
    if open_voice is None:
        with tempfile.TemporaryDirectory(prefix="pcgtts-gate-") as scratch:
            def opener(folder):
                cache = scratch if folder == Path(new_dir) else None  # the shipped voice: the user's cache
                return open_pack(folder, cache, temperature=config.temperature, max_tokens=config.max_tokens)

            return run_gate(old_dir, new_dir, config, open_voice=opener, transcribe=transcribe, embed=embed,
                            allowed_drops=allowed_drops, progress=progress)
    transcribe = transcribe or recognizer().transcribe
    sides = {}
    for side, folder in (("old", Path(old_dir)), ("new", Path(new_dir))):
        progress(f"loading the {side} voice ({folder})")
        sides[side] = (folder, open_voice(folder))
    old_presets, new_presets = list(sides["old"][1].presets), set(sides["new"][1].presets)
    common = [n for n in old_presets if n in new_presets]
    dropped = [n for n in old_presets if n not in new_presets]
    names = [DEFAULT_VOICE, *common]
    if len(common) >= 2 and embed is None:
        embed = speaker_encoder().embed
    measured = {}
    for side, (folder, runner) in sides.items():
        measured[side] = measure(runner, names, sentences, config.seeds, config.policies, transcribe, embed,
                                 progress=lambda m, side=side: progress(f"{side}: {m}"))
    result = compare(measured["old"], measured["new"], config.confidence, dropped, allowed_drops)

    def about(folder: Path) -> dict:
        meta = json.loads((folder / "voice.json").read_text())
        return {"name": meta.get("name"), "folder": str(folder),
                "temperature": (config.temperature if config.temperature is not None
                                else meta.get("settings", {}).get("temperature"))}

    result.update({"old": about(Path(old_dir)), "new": about(Path(new_dir)), "sentences": len(sentences),
                   "seeds": list(config.seeds), "confidence": config.confidence, "dropped": dropped,
                   "allowed_drops": [n for n in dropped if n in allowed_drops], "passed": not result["failures"],
                   "seconds": round(time.monotonic() - started, 1), "records": measured})
    return result


def check_gate(result: dict, accept_worse: str | None = None) -> dict:
    """The result, with "accepted_worse" set to the reason when it failed and `accept_worse` lets it through;
    GateRefused (one line naming every failure) when it failed and no reason is given."""
    result = {**result, "accepted_worse": None}
    if result["failures"]:
        if not accept_worse:
            raise GateRefused(f"the new voice {result['new']['name']!r} is worse than the shipped "
                              f"{result['old']['name']!r}: {'; '.join(result['failures'])} "
                              f"({result['sentences']} sentences x {len(result['seeds'])} seeds; "
                              "--accept-worse REASON ships it anyway, recording why)")
        log.warning("shipping a voice worse than the one it replaces (%s): %s", accept_worse,
                    "; ".join(result["failures"]))
        result["accepted_worse"] = accept_worse
    return result


def gate_voice(shipped_dir: str | Path, staging_dir: str | Path, config: GateConfig = GateConfig(),
               accept_worse: str | None = None, allowed_drops: Sequence[str] = (), report: Path | None = None,
               **inject) -> dict:
    """The gate of a new voice (complete in `staging_dir`) against the shipped one: `run_gate` (its JSON,
    per-utterance records too, written to `report` if given, refused or not), then `check_gate`
    (GateRefused when worse and no reason is given), then the comparison recorded in the new voice's
    voice.json ("gate") and model card. `inject`: `run_gate`'s open_voice / transcribe / embed / progress.
    `train.package.install_staged(staging, shipped, gate=...)` moves it into place after."""
    import json

    from pcgtts.train.package import record_gate

    result = run_gate(shipped_dir, staging_dir, config, allowed_drops=allowed_drops, **inject)
    if report is not None:
        tmp = Path(report).with_name(Path(report).name + ".tmp")
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        tmp.replace(report)
    result = check_gate(result, accept_worse)
    record_gate(staging_dir, summary(result))
    write_card_section(Path(staging_dir) / "MODEL_CARD.md", result)
    return result


def summary(result: dict) -> dict:
    """What voice.json records of a gate run: the comparison without the per-utterance records."""
    return {k: v for k, v in result.items() if k != "records"}


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def card_section(result: dict) -> str:
    """The model card's comparison section (markdown) from a gate result."""
    from pcgtts.quality.stats import Estimate

    old, new = result["old"]["name"], result["new"]["name"]
    lines = [CARD_HEADING, "",
             f"Written by `pcgtts train package`'s gate: {new} against {old}, the same {result['sentences']} "
             f"test sentences x {len(result['seeds'])} seeds (quality/testset_v1.json). WER: PocketSphinx, plain "
             "decoding at each voice's own temperature; identity: a preset's utterance is nearest its own among "
             "the presets; acceptance: accepted / drafted tokens per utterance in the default voice, at the "
             "fixed draft length. Difference: "
             f"new - old on the same (sentence, seed) with its paired {100 * result['confidence']:.0f} % interval. "
             "The LLaSA-1B stand-in (`pcgtts models scale`) keeps the voice's logits, so its pcg acceptance is "
             "this one.", "",
             f"| voice | WER: {old} → {new} | ΔWER (points) | identity: {old} → {new} | Δidentity | worse |",
             "|---|---|---|---|---|---|"]

    def cells(row: dict | None) -> tuple[str, str]:
        if row is None:
            return "", ""
        diff = Estimate(**{k: (math.nan if v is None else v) for k, v in row["diff"].items()})
        return f"{_pct(row['old'])} → {_pct(row['new'])}", diff.format(100, signed=True)

    voices = list(dict.fromkeys(row["voice"] for row in result["rows"] if row["metric"] != "acceptance"))
    for voice in voices:
        mine = {row["metric"]: row for row in result["rows"] if row["voice"] == voice}
        worse = any(row["worse"] for row in mine.values())
        lines.append(f"| {voice} | {' | '.join(cells(mine.get('wer')))} | {' | '.join(cells(mine.get('identity')))} | "
                     f"{'**yes**' if worse else 'no'} |")
    accepted = [row for row in result["rows"] if row["metric"] == "acceptance"]
    if accepted:
        lines += ["", "Acceptance in the default voice: " + "; ".join(
            f"{row['voice']} {' '.join(cells(row))}{' (**worse**)' if row['worse'] else ''}" for row in accepted) + "."]
    if result["dropped"]:
        lines += ["", f"Presets dropped: {', '.join(result['dropped'])}."]
    if result.get("accepted_worse"):
        lines += ["", f"**Shipped although worse** ({'; '.join(result['failures'])}). Reason: "
                      f"{result['accepted_worse']}"]
    else:
        lines += ["", "Nothing is worse beyond its interval."]
    return "\n".join(lines) + "\n"


def write_card_section(card: Path, result: dict) -> None:
    """Put the comparison section into the model card at `card` (replacing an earlier one; created if none)."""
    text = card.read_text() if card.is_file() else f"# Model card: {result['new']['name']}\n"
    start = text.find(CARD_HEADING)
    if start >= 0:
        end = text.find("\n## ", start + len(CARD_HEADING))
        text = text[:start] + (text[end + 1:] if end >= 0 else "")
    tmp = card.with_name(card.name + ".tmp")
    tmp.write_text(text.rstrip("\n") + "\n\n" + card_section(result))
    tmp.replace(card)


__all__ = ["GATE_POLICIES", "GateConfig", "GateRefused", "SynthesizerRunner", "VoiceRunner", "card_section",
           "check_gate", "compare", "gate_sentences", "gate_voice", "measure", "open_pack", "run_gate", "summary",
           "write_card_section"]
