"""Latency harness: run utterances through the real streaming path and measure what a listener gets.

Each utterance is consumed by a simulated real-time player: playback starts when the first
chunk is ready and then needs chunk i at `start + (audio before i) / (16 kHz * speed)`; a chunk
ready after that stalls playback (an underrun, counted with its duration) and shifts every later
deadline. Nothing sleeps, so the harness costs only its own bookkeeping, which is measured
and reported per step. Figures per utterance: time to first audio, real-time factor, tokens/s,
forward passes per token, acceptance, mean accepted length (bonus included), per-position
acceptance, chunk sizes, chunk lateness (ready - deadline; > 0 is an underrun), underruns, peak memory.

`summarize` adds per configuration: p50/p90/p99 of time to first audio and chunk lateness, means
of the rest, the speed-up over `ar` measured in the same run, and an efficiency figure:
achieved speed-up / the speed-up predicted from the measured acceptance rate alpha and step
costs, E(alpha, L) * t_ar / (L t_draft + t_verify) with E = (1 - alpha^(L+1)) / (1 - alpha)
(Leviathan et al.'s i.i.d. model). Below 1 means time lost outside the forward passes
(prefill, the codec, Python) or acceptance that is not i.i.d. across positions.
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from pcgtts.runtime.audio.chunk import SAMPLE_RATE
from pcgtts.runtime.synthesizer import SynthesisConfig, Synthesizer

# Written for this project: plain English of varied length, numbers and punctuation included.
DEFAULT_TEXTS = (
    "Good morning.",
    "The train to the coast leaves at half past nine.",
    "Please keep your receipt; you will need it if anything goes wrong with the order.",
    "When the wind dropped in the evening, the lake turned so still that every boat along the pier "
    "seemed to float above its own reflection.",
    "Is it really three hundred kilometres?",
    "She read the letter twice, folded it carefully, and put it back in the drawer without a word.",
)


@dataclass(frozen=True)
class BenchCase:
    """One configuration of the sweep."""

    policy: str
    draft_length: int = 3
    theta: float | None = None  # group granularity (pcg only); None = the table given
    ssd_beta: float | None = None  # ssd only

    @property
    def label(self) -> str:
        parts = [self.policy]
        if self.policy not in ("ar", "draft"):
            parts.append(f"L={self.draft_length}")
        if self.theta is not None:
            parts.append(f"θ={self.theta:g}")
        if self.ssd_beta is not None:
            parts.append(f"β={self.ssd_beta:g}")
        return " ".join(parts)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def play(chunks, speed: float = 1.0) -> tuple[dict, list]:
    """Consume a stream as a real-time player would; returns (playback figures, chunk records)."""
    started = time.perf_counter()
    overhead = 0.0
    play_start = None
    stall = 0.0
    played = 0  # samples before the current chunk
    records = []
    underruns, underrun_s = 0, 0.0
    for chunk in chunks:
        t0 = time.perf_counter()
        if play_start is None:
            play_start = chunk.ready_time
        deadline = play_start + stall + played / (SAMPLE_RATE * speed)
        late = chunk.ready_time - deadline  # > 0: playback had to wait (an underrun)
        if late > 0:
            underruns += 1
            underrun_s += late
            stall += late
        records.append({"ready": chunk.ready_time - started, "deadline": deadline - started,
                        "late": late, "tokens": chunk.token_end - chunk.token_start})
        played += len(chunk.samples)
        overhead += time.perf_counter() - t0
    return {"underruns": underruns, "underrun_seconds": underrun_s, "harness_seconds": overhead}, records


def measure(synth: Synthesizer, text: str, config: SynthesisConfig, speed: float = 1.0) -> dict:
    """One utterance through `synth.stream`, consumed by the simulated player."""
    cuda = synth.target.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(synth.target.device)
    stream = synth.stream(text, config=config)
    with stream:
        playback, chunks = play(stream, speed)
    s = stream.stats
    total = s.totals()
    elapsed = s.finished_at - s.started_at
    steps = max(total.steps, 1)
    trace = [(t - s.started_at, n) for sentence in s.sentences for t, n in sentence.trace]
    record = {
        "text": text,
        "chars": len(text),
        "tokens": total.emitted,
        "audio_seconds": s.audio_seconds,
        "time_to_first_audio": s.time_to_first_audio,
        "total_seconds": elapsed,
        "real_time_factor": s.real_time_factor,
        "tokens_per_second": total.emitted / elapsed if elapsed > 0 else 0.0,
        "steps": total.steps,
        "target_forwards": total.target_forwards,
        "draft_forwards": total.draft_forwards,
        "drafted": total.drafted,
        "accepted": total.accepted,
        "target_forwards_per_token": total.target_forwards / max(total.emitted, 1),
        "draft_forwards_per_token": total.draft_forwards / max(total.emitted, 1),
        "acceptance_rate": total.acceptance_rate,
        "mean_accepted_length": total.mean_accepted_length,
        "per_position_acceptance": [a / steps for a in total.per_position_accepted],
        "time_draft": total.time_draft,
        "time_target": total.time_target,
        "time_verify": total.time_verify,
        "finish": [sentence.finish for sentence in s.sentences],
        "sentences": len(s.sentences),
        "chunk_tokens": [c["tokens"] for c in chunks],
        "chunks": chunks,
        "trace": trace,
        **playback,
        "harness_us_per_step": 1e6 * playback["harness_seconds"] / steps,
        "peak_rss_mb": peak_rss_mb(),
    }
    if cuda:
        record["peak_gpu_mb"] = torch.cuda.max_memory_allocated(synth.target.device) / 2**20
    return record


def case_config(base: SynthesisConfig, case: BenchCase, seed: int, max_tokens: int | None) -> SynthesisConfig:
    decode = replace(base.decode, policy=case.policy, draft_length=case.draft_length)
    if case.ssd_beta is not None:
        decode = replace(decode, ssd_beta=case.ssd_beta)
    if max_tokens:
        decode = replace(decode, max_new_tokens=max_tokens)
    return replace(base, decode=decode, seed=seed)


def _percentiles(values) -> dict:
    if not len(values):
        return {"p50": None, "p90": None, "p99": None}
    p = np.percentile(np.asarray(values, dtype=np.float64), [50, 90, 99])
    return {"p50": float(p[0]), "p90": float(p[1]), "p99": float(p[2])}


def expected_tokens_per_step(alpha: float, draft_length: int) -> float:
    if alpha >= 1.0:
        return draft_length + 1.0
    return (1 - alpha ** (draft_length + 1)) / (1 - alpha)


def summarize(case: BenchCase, records: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in records)
    seconds = sum(r["total_seconds"] for r in records)
    steps = sum(r["steps"] for r in records)
    drafted = sum(r["drafted"] for r in records)
    accepted = sum(r["accepted"] for r in records)
    target_fw = sum(r["target_forwards"] for r in records)
    draft_fw = sum(r["draft_forwards"] for r in records)
    mean = lambda key: float(np.mean([r[key] for r in records]))  # noqa: E731
    width = max((len(r["per_position_acceptance"]) for r in records), default=0)
    per_position = [sum(r["per_position_acceptance"][i] * r["steps"] for r in records
                        if i < len(r["per_position_acceptance"])) / max(steps, 1) for i in range(width)]
    return {
        "case": case.label,
        "policy": case.policy,
        "draft_length": case.draft_length,
        "theta": case.theta,
        "ssd_beta": case.ssd_beta,
        "utterances": len(records),
        "tokens": tokens,
        "tokens_per_second": tokens / seconds if seconds else 0.0,
        "time_to_first_audio": _percentiles([r["time_to_first_audio"] for r in records]),
        "chunk_lateness": _percentiles([c["late"] for r in records for c in r["chunks"]]),
        "real_time_factor": mean("real_time_factor"),
        "target_forwards_per_token": target_fw / max(tokens, 1),
        "draft_forwards_per_token": draft_fw / max(tokens, 1),
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accepted_length": (accepted + steps) / steps if steps else 0.0,
        "per_position_acceptance": per_position,
        "underruns": sum(r["underruns"] for r in records),
        "underrun_seconds": sum(r["underrun_seconds"] for r in records),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in records),
        "peak_gpu_mb": max((r.get("peak_gpu_mb", 0.0) for r in records), default=0.0) or None,
        # Per-forward costs (seconds): verify includes the acceptance rule after the target pass.
        "t_target_step": sum(r["time_target"] + r["time_verify"] for r in records) / max(steps, 1),
        "t_draft_step": sum(r["time_draft"] for r in records) / max(draft_fw, 1),
        "harness_us_per_step": float(np.mean([r["harness_us_per_step"] for r in records])),
    }


def add_speedups(summaries: list[dict]) -> None:
    """Speed-up over the `ar` case of this run, and efficiency against the i.i.d. prediction."""
    base = next((s for s in summaries if s["policy"] == "ar"), None)
    for s in summaries:
        s["speedup_vs_ar"] = s["tokens_per_second"] / base["tokens_per_second"] if base and base["tokens_per_second"] else None
        s["predicted_speedup"] = s["efficiency"] = None
        if base is None or s["policy"] in ("ar", "draft") or not s["t_target_step"]:
            continue
        step = s["draft_length"] * s["t_draft_step"] + s["t_target_step"]
        predicted = expected_tokens_per_step(s["acceptance_rate"], s["draft_length"]) * base["t_target_step"] / step
        s["predicted_speedup"] = predicted
        s["efficiency"] = s["speedup_vs_ar"] / predicted if s["speedup_vs_ar"] else None
