"""The quality harness: synthesise the test set with each configuration, score it, tabulate it.

Data flow:

    TestSet (testset.py) --render--> reference voices (cache)          mode "source": score them as they are
    reference voices --codec encode + decode-->                         mode "codec":  resynthesis vs source
    Synthesizer.stream(config per BenchCase x seed) --> audio + stats  mode "synth":  Table 1 (rules)
    -> score_audio (metrics.py) -> per-utterance records -> summaries with CIs and paired deltas
       vs the target-AR row (stats.py) -> tables + JSON (cli.py), curves (plots.py)

Table 2 (intra-group swaps) lives in `swap.py`, Table 3 (mel-similarity groups) in `melgroups.py`;
both reuse `run_synth` / `score_audio` from here. Speed figures come from the same runs as the
quality figures (`StreamStats` / `DecodeStats`), so a speed-up is never reported without its WER.
"""

from __future__ import annotations

import logging
import math
import zlib
from dataclasses import dataclass, replace
from typing import Callable, Iterable, NamedTuple, Sequence

import numpy as np

from pcgtts.quality.metrics import (cosine, error_rates, mcd, recognizer, speaker_encoder, stoi)
from pcgtts.quality.stats import mean_ci, paired_diff
from pcgtts.quality.testset import Sentence, TestSet, VoiceRecipe, load_rendered, render
from pcgtts.runtime.decode.policy import policy as policy_spec

log = logging.getLogger(__name__)

QUALITY_METRICS = ("wer", "cer", "sim")
Progress = Callable[[str], None]


def _noop(_: str) -> None:
    pass


# -- scoring -------------------------------------------------------------------------------

def score_audio(audio: np.ndarray, text: str, ref_embedding: np.ndarray | None = None,
                reference: np.ndarray | None = None) -> dict:
    """WER/CER against `text`; Sim-O to `ref_embedding` (a speaker embedding); and, when a
    reference waveform of the same content is given, STOI, MCD, Sim and WER against it."""
    hyp = recognizer().transcribe(audio)
    wer, cer = error_rates(text, hyp)
    embedding = speaker_encoder().embed(audio)
    out = {"hyp": hyp, "wer": wer, "cer": cer, "sim": cosine(embedding, ref_embedding),
           "audio_seconds": len(audio) / 16000}
    if reference is not None:
        ref_hyp = recognizer().transcribe(reference)
        out["wer_vs_reference"] = error_rates(ref_hyp, hyp)[0] if ref_hyp.strip() else None
        out["sim_vs_reference"] = cosine(embedding, speaker_encoder().embed(reference))
        n = min(len(audio), len(reference))
        out["stoi"] = stoi(reference[:n], audio[:n]) if n >= 4000 else None
        out["mcd"] = mcd(reference[:n], audio[:n], align=False) if n >= 4000 else None
    return out


def summarize(records: Sequence[dict], metrics: Iterable[str] = QUALITY_METRICS,
              baseline: Sequence[dict] | None = None, confidence: float = 0.95) -> dict:
    """{metric: Estimate dict} with a 95 % t-interval, plus {"delta_<metric>": paired Estimate}
    against `baseline` keyed by (sentence, seed)."""
    out = {}
    for m in metrics:
        out[m] = mean_ci([r.get(m) for r in records], confidence).as_dict()
        if baseline is not None:
            a = {(r["sentence"], r["seed"]): r.get(m) for r in records}
            b = {(r["sentence"], r["seed"]): r.get(m) for r in baseline}
            out[f"delta_{m}"] = paired_diff(a, b, confidence).as_dict()
    return out


# -- mode "source": the reference voices themselves ----------------------------------------

def reference_embedding(recipe: VoiceRecipe, testset: TestSet, cache_dir=None) -> np.ndarray | None:
    """The voice's embedding from its reference recording (a sentence not in the test sentences)."""
    return speaker_encoder().embed(load_rendered(recipe, testset.reference_text, cache_dir))


def run_source(testset: TestSet, voices: Sequence[VoiceRecipe], sentences: Sequence[Sentence],
               cache_dir=None, progress: Progress = _noop) -> dict:
    """Score each voice's rendering of each sentence: WER/CER vs the text, Sim to the voice's
    own reference recording (and, as a control, the time-reversed audio's WER)."""
    records, summaries = [], []
    for recipe in voices:
        ref = reference_embedding(recipe, testset, cache_dir)
        rows = []
        for s in sentences:
            progress(f"source {recipe.name} {s.id}")
            audio = load_rendered(recipe, s.text, cache_dir)
            rec = {"voice": recipe.name, "sentence": s.id, "seed": 0, **score_audio(audio, s.text, ref)}
            rec["wer_reversed"] = error_rates(s.text, recognizer().transcribe(audio[::-1].copy()))[0]
            rows.append(rec)
        records += rows
        summaries.append({"case": recipe.name, **summarize(rows, QUALITY_METRICS + ("wer_reversed",))})
    return {"mode": "source", "summaries": summaries, "records": records}


# -- mode "codec": resynthesis ------------------------------------------------------------

def run_codec(codec, testset: TestSet, voices: Sequence[VoiceRecipe], sentences: Sequence[Sentence],
              cache_dir=None, progress: Progress = _noop) -> dict:
    """Encode each source rendering with the codec and decode it again: WER/CER vs the text,
    paired ΔWER vs the source audio, STOI/MCD/Sim vs the source waveform."""
    records, summaries = [], []
    for recipe in voices:
        ref = reference_embedding(recipe, testset, cache_dir)
        rows, source_rows = [], []
        for s in sentences:
            progress(f"codec {recipe.name} {s.id}")
            source = load_rendered(recipe, s.text, cache_dir)
            codes = codec.encode(source)
            audio = codec.decode(codes)
            rec = {"voice": recipe.name, "sentence": s.id, "seed": 0, "tokens": int(len(codes)),
                   "unique_codes": int(len(np.unique(codes))), **score_audio(audio, s.text, ref, reference=source)}
            rows.append(rec)
            source_rows.append({"sentence": s.id, "seed": 0, **score_audio(source, s.text, ref)})
        records += rows
        summaries.append({"case": recipe.name,
                          **summarize(rows, QUALITY_METRICS + ("wer_vs_reference", "stoi", "mcd", "sim_vs_reference")),
                          **{k: v for k, v in summarize(rows, QUALITY_METRICS, baseline=source_rows).items()
                             if k.startswith("delta_")},
                          "source_wer": mean_ci([r["wer"] for r in source_rows]).as_dict()})
    return {"mode": "codec", "summaries": summaries, "records": records}


# -- mode "synth": Table 1 and the sweeps -------------------------------------------------

@dataclass(frozen=True)
class SynthPlan:
    """What `run_synth` does for every case: sentences x seeds, one voice (cloned or only judged)."""

    sentences: tuple[Sentence, ...]
    seeds: tuple[int, ...] = (0,)
    temperature: float = 0.8  # the baseline's (and every case's, without a sweep)
    max_tokens: int | None = None  # per sentence; None = the synthesizer's own budget
    clone: bool = True  # prompt with the reference voice's recording (zero-shot cloning)
    aa_row: bool = False  # also the baseline again on other random streams (`run_synth`)
    # run_synth: every case again at each of these (rows "case T=t"), paired with the baseline
    sweep_temperatures: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not self.sentences or not self.seeds:
            raise ValueError("a plan needs sentences and seeds")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError("seeds must be distinct")
        if not all(t >= 0 for t in (self.temperature, *self.sweep_temperatures)):
            raise ValueError(f"temperatures must be >= 0, got {(self.temperature, *self.sweep_temperatures)}")
        if len({self.temperature, *self.sweep_temperatures}) != 1 + len(self.sweep_temperatures):
            raise ValueError("temperatures must be distinct")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


AA_SEED_OFFSET = 1_000_003  # the A/A row's random streams: stream_seed + this


class _Row(NamedTuple):
    """One row of a synth table while it runs."""

    name: str
    case: object  # tools/bench.py BenchCase
    synth: object  # its Synthesizer
    seed_offset: int  # added to every utterance's stream seed (the A/A row's other streams)
    temperature: float
    records: list


def stream_seed(seed: int, sentence_id: str) -> int:
    """The random stream of one utterance, one per (seed, sentence). With one stream per seed
    for every sentence, a seed's utterances shared their first draws (with no voice prompt, the
    voice the model picks), so the paired intervals took correlated utterances for independent
    ones: an A/A row on lab-v1 showed ΔSim −0.059 ± 0.045 (QUALITY.md)."""
    return zlib.crc32(f"{seed}/{sentence_id}".encode())


def synth_config(base_config, case, seed: int, plan: SynthPlan, temperature: float):
    """One utterance's settings: the case's, at `temperature` (the plan's or one of its sweep's)."""
    from pcgtts.tools.bench import case_config

    config = case_config(base_config, case, seed, plan.max_tokens)
    sampling = replace(config.decode.sampling, temperature=temperature)
    return replace(config, decode=replace(config.decode, sampling=sampling))


def synthesize_one(synth, text: str, config, voice) -> tuple[np.ndarray, dict]:
    """Audio of one utterance through the public streaming API, and its speed figures. An utterance
    the model makes no speech for is scored as the empty audio it is (every word missed), not raised."""
    from pcgtts.runtime.synthesizer import EmptySynthesis

    stream = synth.stream(text, voice=voice, config=config)
    parts = []
    with stream:
        try:
            parts = [chunk.samples for chunk in stream]
        except EmptySynthesis:
            parts = []
    stats = stream.stats
    totals = stats.totals()
    elapsed = stats.finished_at - stats.started_at
    audio = np.concatenate(parts) if parts else np.zeros(0, np.float32)
    return audio, {
        "tokens": totals.emitted, "seconds": elapsed,
        "tokens_per_second": totals.emitted / elapsed if elapsed > 0 else 0.0,
        "steps": totals.steps, "drafted": totals.drafted, "accepted": totals.accepted,
        "acceptance_rate": totals.acceptance_rate, "mean_accepted_length": totals.mean_accepted_length,
        "target_forwards": totals.target_forwards, "truncated": stats.truncated,
        "real_time_factor": stats.real_time_factor, "time_to_first_audio": stats.time_to_first_audio,
    }


def run_synth(base, cases: Sequence, plan: SynthPlan, recipe: VoiceRecipe, testset: TestSet, cache_dir=None,
              groups_for: Callable[[float], object] | None = None, progress: Progress = _noop,
              label: Callable[[object], str] | None = None) -> dict:
    """Table 1: every case (BenchCase from tools/bench.py) on the same sentences and seeds, at the
    plan's temperature and then at each of its `sweep_temperatures`. The first case must be `ar`:
    speed-ups and paired deltas are measured against it at the row's own temperature (a rule's cost
    is against plain decoding at the same T), except for AR's own rows at the swept temperatures,
    which are measured against AR at the plan's temperature (what the temperature itself does)."""
    if not cases or not policy_spec(cases[0].policy).plain:
        raise ValueError("the first case must be the target-AR baseline (policy 'ar')")
    from pcgtts.tools.bench import case_synthesizer

    label = label or (lambda c: c.label)
    ref_path = render(recipe, testset.reference_text, cache_dir)
    ref_emb = reference_embedding(recipe, testset, cache_dir)
    voice = base.voice_from_audio(ref_path, testset.reference_text) if plan.clone else None
    synths = [case_synthesizer(base, case, groups_for) for case in cases]
    temperatures = (plan.temperature, *plan.sweep_temperatures)
    named = (lambda case, t: f"{label(case)} T={t:g}") if plan.sweep_temperatures else (lambda case, t: label(case))
    runs = [_Row(named(case, t), case, synth, 0, t, []) for t in temperatures for case, synth in zip(cases, synths)]
    if plan.aa_row:
        # The baseline once more on other random streams, paired with it like every row: its deltas
        # are what two runs of one distribution show, the table's own noise floor.
        baseline = runs[0]
        runs.insert(1, _Row(f"{baseline.name} A/A", baseline.case, baseline.synth, AA_SEED_OFFSET,
                            baseline.temperature, []))
    # Interleaved (every case on one utterance before the next utterance) so that a change in the
    # machine's load during the run shifts all cases alike instead of biasing the speed-ups.
    for seed in plan.seeds:
        for s in plan.sentences:
            for name, case, synth, offset, temperature, rows in runs:
                progress(f"{name} seed {seed} {s.id}")
                config = synth_config(base.config, case, stream_seed(seed, s.id) + offset, plan, temperature)
                audio, speed = synthesize_one(synth, s.text, config, voice)
                rows.append({"case": name, "temperature": temperature, "sentence": s.id, "seed": seed, **speed,
                             **score_audio(audio, s.text, ref_emb)})
    ar_at = {row.temperature: row for row in runs if row.case is cases[0] and row.seed_offset == 0}
    summaries, records = [], []
    for name, case, _, _, temperature, rows in runs:
        baseline = runs[0] if case is cases[0] else ar_at[temperature]  # AR (and A/A) against the plan's T
        base_rows, base_tps = baseline.records, _tokens_per_second(baseline.records)
        tps = _tokens_per_second(rows)
        drafted = sum(r["drafted"] for r in rows)
        steps = sum(r["steps"] for r in rows)
        summaries.append({
            "case": name, "policy": case.policy, "draft_length": case.draft_length, "theta": case.theta,
            "ssd_beta": case.ssd_beta, "temperature": temperature, "baseline": baseline.name, "utterances": len(rows),
            "tokens_per_second": tps, "speedup_vs_ar": tps / base_tps if base_tps > 0 else None,
            "acceptance_rate": sum(r["accepted"] for r in rows) / drafted if drafted else None,
            "mean_accepted_length": (sum(r["accepted"] for r in rows) + steps) / steps if steps and drafted else None,
            "truncated": sum(r["truncated"] for r in rows),
            **summarize(rows, QUALITY_METRICS, baseline=base_rows),
        })
        records += rows
    return {"mode": "synth", "voice": recipe.name, "cloned": plan.clone, "seeds": list(plan.seeds),
            "temperature": plan.temperature, "temperatures": list(temperatures), "summaries": summaries,
            "records": records}


def _tokens_per_second(rows: Sequence[dict]) -> float:
    seconds = sum(r["seconds"] for r in rows)
    return sum(r["tokens"] for r in rows) / seconds if seconds > 0 else 0.0


def fmt_estimate(est: dict | None, scale: float = 1.0, digits: int = 1, signed: bool = False) -> str:
    """An Estimate dict (as stored in summaries) as "12.3 ± 1.4"."""
    from pcgtts.quality.stats import Estimate

    if not est or est.get("mean") is None:
        return "-"
    nan = float("nan")
    return Estimate(est["mean"], nan if est["low"] is None else est["low"],
                    nan if est["high"] is None else est["high"], est["n"]).format(scale, digits, signed)


def fmt_number(value, spec: str = ".2f") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


__all__ = ["QUALITY_METRICS", "score_audio", "summarize", "reference_embedding", "run_source", "run_codec",
           "SynthPlan", "synth_config", "synthesize_one", "run_synth", "fmt_estimate",
           "fmt_number"]
