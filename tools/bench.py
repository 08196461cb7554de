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
achieved speed-up / the speed-up the cost model (runtime/decode/cost_model.py) predicts from
the measured per-position acceptance a_i and step costs, tokens(L) * t_ar / (L t_draft + t_verify)
with tokens(L) = 1 + sum_k prod_{i<=k} a_i. Below 1 means time lost outside the forward passes
(prefill, the codec, Python); the share of wall time in draft / verify / rule / other says where.
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np
import torch

from pcgtts.runtime.audio.chunk import SAMPLE_RATE
from pcgtts.runtime.decode.policy import policy as policy_spec
from pcgtts.runtime.decode.cost_model import StepCosts, conditional_acceptance, counted_seconds, expected_tokens
from pcgtts.runtime.lm.protocol import common_prefix
from pcgtts.runtime.synthesizer import SynthesisConfig, Synthesizer
from pcgtts.runtime.text.prompt import build_prompt

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
    draft_length: int = 3  # with adaptive: the longest L the policy may choose
    theta: float | None = None  # group granularity (pcg only); None = the table given
    ssd_beta: float | None = None  # ssd only
    adaptive: bool = False  # DecodeConfig.adaptive_draft: L chosen per step by the cost model
    codec_thread: bool | None = None  # StreamConfig.codec_thread; None = as configured

    @property
    def label(self) -> str:
        parts = [self.policy]
        if policy_spec(self.policy).speculative:
            parts.append(f"L≤{self.draft_length} auto" if self.adaptive else f"L={self.draft_length}")
        if self.theta is not None:
            parts.append(f"θ={self.theta:g}")
        if self.ssd_beta is not None:
            parts.append(f"β={self.ssd_beta:g}")
        if self.codec_thread is False:
            parts.append("in-line codec")
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


def shared_prompt_length(synth: Synthesizer) -> int:
    """Prompt tokens every sentence shares for this voice (the chat template before the user's text)."""
    return common_prefix(*(build_prompt(synth.tokenizer, synth.target.vocab, text, None, None) for text in ("a", "b")))


def measure(synth: Synthesizer, text: str, config: SynthesisConfig, speed: float = 1.0) -> dict:
    """One utterance through `synth.stream`, consumed by the simulated player. The models' caches
    first keep only the prompt every sentence shares, as after other sentences of a session: cases
    run interleaved on the same text, and one must not find the prompt the one before it left."""
    shared = shared_prompt_length(synth)
    for lm in (synth.target, synth.draft):
        if lm is not None and lm.length > shared:
            lm.rollback(shared)
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
    width = max((len(sentence.length_counts) for sentence in s.sentences), default=0)
    length_counts = [sum(sentence.length_counts[i] for sentence in s.sentences if i < len(sentence.length_counts))
                     for i in range(width)]
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
        "per_position_accepted": list(total.per_position_accepted),
        "length_counts": length_counts,  # steps per draft length (index 0: AR steps of an adaptive run)
        "catchup_tokens": sum(sentence.catchup_tokens for sentence in s.sentences),
        "planned_costs": next((sentence.costs for sentence in s.sentences if sentence.costs), None),
        "starting_acceptance": synth.planner.starting_acceptance(config.decode),  # measured at load: where L starts from
        "learned_costs": next((sentence.learned_costs.as_dict() for sentence in reversed(s.sentences)
                               if sentence.learned_costs is not None), None),
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


def case_synthesizer(base: Synthesizer, case: BenchCase, groups_for: Callable[[float], object] | None = None):
    """A Synthesizer sharing `base`'s loaded models for one case: the draft only where the policy
    uses one, the target's heads for mtp-*, and the case's group table where it names a θ."""
    groups = base.groups
    if policy_spec(case.policy).needs_groups and case.theta is not None:
        if groups_for is None:
            raise ValueError("a pcg case with a θ needs a way to build its group table")
        groups = groups_for(case.theta)
    draft = base.draft if policy_spec(case.policy).needs_draft else None
    return Synthesizer(base.target, draft, base.codec, groups, base.config, heads=base.heads, eagle=base.eagle)


def case_config(base: SynthesisConfig, case: BenchCase, seed: int, max_tokens: int | None) -> SynthesisConfig:
    decode = replace(base.decode, policy=case.policy, draft_length=case.draft_length, adaptive_draft=case.adaptive)
    if case.ssd_beta is not None:
        decode = replace(decode, ssd_beta=case.ssd_beta)
    if max_tokens:
        decode = replace(decode, max_new_tokens=max_tokens)
    stream = base.stream if case.codec_thread is None else replace(base.stream, codec_thread=case.codec_thread)
    return replace(base, decode=decode, stream=stream, seed=seed)


def _percentiles(values) -> dict:
    if not len(values):
        return {"p50": None, "p90": None, "p99": None}
    p = np.percentile(np.asarray(values, dtype=np.float64), [50, 90, 99])
    return {"p50": float(p[0]), "p90": float(p[1]), "p99": float(p[2])}


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
    accepted_at = [sum(r["per_position_accepted"][i] for r in records if i < len(r["per_position_accepted"]))
                   for i in range(width)]
    lwidth = max((len(r["length_counts"]) for r in records), default=0)
    length_counts = [sum(r["length_counts"][i] for r in records if i < len(r["length_counts"])) for i in range(lwidth)]
    speculative_steps = steps - (length_counts[0] if length_counts else 0)
    seconds_in = {k: sum(r[k] for r in records) for k in ("time_draft", "time_target", "time_verify")}
    return {
        "case": case.label,
        "policy": case.policy,
        "draft_length": case.draft_length,
        "theta": case.theta,
        "ssd_beta": case.ssd_beta,
        "codec_thread": case.codec_thread,
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
        "conditional_acceptance": conditional_acceptance(accepted_at, speculative_steps),
        "length_counts": length_counts,
        "catchup_tokens": sum(r["catchup_tokens"] for r in records),
        "planned_costs": next((r["planned_costs"] for r in records if r.get("planned_costs")), None),
        "starting_acceptance": next((r["starting_acceptance"] for r in records if r.get("starting_acceptance")), None),
        "learned_costs": _mean_costs([r["learned_costs"] for r in records if r.get("learned_costs")]),
        # Share of wall time per phase: draft forwards, target forwards (verify passes or AR steps),
        # the rule (acceptance + sampling), other (prefill, the codec, the loop's Python, the player).
        "time_share": {name: seconds_in[key] / seconds if seconds else 0.0 for name, key in
                       (("draft", "time_draft"), ("verify", "time_target"), ("rule", "time_verify"))}
        | {"other": 1 - sum(seconds_in.values()) / seconds if seconds else 0.0},
        "underruns": sum(r["underruns"] for r in records),
        "underrun_seconds": sum(r["underrun_seconds"] for r in records),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in records),
        "peak_gpu_mb": max((r.get("peak_gpu_mb", 0.0) for r in records), default=0.0) or None,
        # Per-forward costs (seconds): verify includes the acceptance rule after the target pass.
        "t_target_step": sum(r["time_target"] + r["time_verify"] for r in records) / max(steps, 1),
        # per draft-model forward; None for policies without one (mtp-*, eagle-*: see t_propose_step)
        "t_draft_step": sum(r["time_draft"] for r in records) / draft_fw if draft_fw else None,
        # mtp-*, eagle-*: the proposer's work per step (heads or the EAGLE block; no draft-model forwards)
        "t_propose_step": sum(r["time_draft"] for r in records) / max(steps, 1),
        "harness_us_per_step": float(np.mean([r["harness_us_per_step"] for r in records])),
    }


def _mean_costs(costs: list[dict]) -> dict | None:
    """Element-wise mean of `StepCosts.as_dict()`s (the utterances' learned costs)."""
    if not costs:
        return None
    return {k: (np.mean([c[k] for c in costs], axis=0).tolist() if isinstance(costs[0][k], list)
                else float(np.mean([c[k] for c in costs]))) for k in costs[0]}


def predicted_speedup(summary: dict, ar: dict, at_load: bool = False, overhead: float = 0.0) -> float | None:
    """Speed-up over `ar` the cost model predicts from this case's measured acceptance (per position)
    and step costs: tokens(L) t_ar / (L t_draft + t_verify). For an adaptive case: the tokens its
    steps emitted over the seconds the cost model charges for those steps (`counted_seconds`: the
    mix of draft lengths it ran and the draft's catch-up), with the costs it planned with: as the
    loop's timings had moved them by the end of each utterance (`learned_costs`), or as measured at
    load (`at_load`). Not tokens(L) from rates pooled over the mix: the adaptive length runs long
    steps where acceptance is high and short ones where it is low, and pooled rates mix the two
    regimes (and under-count later positions, `conditional_acceptance`), off in either direction;
    counted tokens leave the cost model's timing as the one thing the prediction can get wrong.

    `overhead`: seconds a token costs outside any step (`per_token_overhead`), added to both sides:
    (t_ar + o) / (t_spec + o) per token. It leaves the best draft length where it was and pulls the
    ratio toward 1."""
    per_token = _per_token_seconds(summary, ar, at_load)
    if per_token is None:
        return None
    t_ar, t_spec = per_token
    return (t_ar + overhead) / (t_spec + overhead)


def _per_token_seconds(summary: dict, ar: dict, at_load: bool) -> tuple[float, float] | None:
    """(an AR token's model seconds, a token's model seconds in this case), as `predicted_speedup` reads them."""
    rates = summary["conditional_acceptance"]
    planned = summary.get("planned_costs") if at_load else summary.get("learned_costs") or summary.get("planned_costs")
    if planned:
        costs = StepCosts(**planned)
        seconds = counted_seconds(costs, summary["length_counts"], summary["catchup_tokens"])
        return (costs.ar_step, seconds / summary["tokens"]) if seconds and summary["tokens"] else None
    if policy_spec(summary["policy"]).reads_states:  # one target pass and one proposer call per step
        step = summary["t_propose_step"] + summary["t_target_step"]
    else:
        step = summary["draft_length"] * summary["t_draft_step"] + summary["t_target_step"]
    tokens = expected_tokens(rates, summary["draft_length"])
    return (ar["t_target_step"], step / tokens) if step else None


def per_token_overhead(ar: dict) -> float:
    """Seconds of the AR case's wall time per token outside its forward and sampling: the codec's
    windows on the LM's thread, the queue, the loop's per-token work. No step model charges it;
    It is nearly the same per token for every policy (~0.3 ms on the 2-core CPU)."""
    if not ar.get("tokens_per_second"):
        return 0.0
    return max(1.0 / ar["tokens_per_second"] - ar["t_target_step"], 0.0)


def add_speedups(summaries: list[dict]) -> None:
    """Speed-up over the `ar` case of this run (with the same codec threading), the cost model's
    prediction, and achieved / predicted."""
    for s in summaries:
        base = next((b for b in summaries if policy_spec(b["policy"]).plain and b.get("codec_thread") == s.get("codec_thread")),
                    None)
        s["speedup_vs_ar"] = s["tokens_per_second"] / base["tokens_per_second"] if base and base["tokens_per_second"] else None
        s["predicted_speedup"] = s["efficiency"] = None
        if base is None or not policy_spec(s["policy"]).speculative or not s["t_target_step"]:
            continue
        if s.get("planned_costs"):
            s["predicted_speedup_at_load"] = predicted_speedup(s, base, at_load=True)
        # The step model's prediction, and the same with AR's per-token cost outside the steps on both sides.
        s["per_token_overhead"] = per_token_overhead(base)
        for suffix, overhead in (("", 0.0), ("_with_overhead", s["per_token_overhead"])):
            predicted = predicted_speedup(s, base, overhead=overhead)
            s["predicted_speedup" + suffix] = predicted
            s["efficiency" + suffix] = s["speedup_vs_ar"] / predicted if s["speedup_vs_ar"] and predicted else None
