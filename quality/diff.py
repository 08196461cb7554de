"""Two runs of `pcgtts eval --mode synth` (or `--mode codec`) compared utterance by utterance: how a
new model (or setting) differs from a baseline on the same sentences, seeds and random streams.

Within one run every rule is paired with AR (`harness.py`); across runs the pairing is by
(case, temperature, sentence, seed): the harness seeds each utterance's stream from its sentence
and seed, so two models read the same test set with the same draws. Codec runs pair by (voice,
sentence): the same source recording resynthesised by two codecs, with STOI and MCD beside. The intervals are
`stats.paired_diff`'s: read them, not the two runs' separate intervals, which include the
sentences' spread.
"""

from __future__ import annotations

from typing import Mapping

from pcgtts.quality.stats import mean_ci, paired_diff

METRICS = {"synth": ("wer", "cer", "sim"), "codec": ("wer", "cer", "sim", "stoi", "mcd")}


def _keyed(result: Mapping) -> dict[tuple, dict[tuple, dict]]:
    """{(case, temperature): {(sentence, seed): record}} of one synth run; a codec run's case is the
    voice, its temperature None."""
    mode = result.get("mode")
    if mode not in METRICS:
        raise ValueError(f"eval-diff compares synth or codec runs; this one is mode {mode!r}")
    # Newer records carry their temperature; older runs' are in their case's summary.
    case_t = {s["case"]: s.get("temperature") for s in result.get("summaries", [])}
    default_t = result.get("temperature")
    rows: dict[tuple, dict[tuple, dict]] = {}
    for rec in result["records"]:
        key = (rec["voice"], None) if mode == "codec" else (
            rec["case"], rec.get("temperature", case_t.get(rec["case"], default_t)))
        rows.setdefault(key, {})[(rec["sentence"], rec["seed"])] = rec
    return rows


def diff_runs(base: Mapping, new: Mapping) -> list[dict]:
    """Per (case, temperature) both runs have: each run's mean and the paired difference new - base
    of every metric. Cases in one run only are left out; a case on different utterances is an error
    (`paired_diff`)."""
    if base.get("mode") != new.get("mode"):
        raise ValueError(f"a {base.get('mode')} run and a {new.get('mode')} run cannot be paired")
    a, b = _keyed(base), _keyed(new)
    common = [key for key in b if key in a]
    if not common:
        raise ValueError("the two runs share no (case, temperature): nothing to pair")
    rows = []
    for case, temperature in common:
        row: dict = {"case": case, "temperature": temperature, "utterances": len(b[(case, temperature)])}
        for metric in METRICS[new["mode"]]:
            old = {k: r.get(metric) for k, r in a[(case, temperature)].items()}
            cur = {k: r.get(metric) for k, r in b[(case, temperature)].items()}
            row[metric] = {"base": mean_ci(list(old.values())).as_dict(), "new": mean_ci(list(cur.values())).as_dict(),
                           "delta": paired_diff(cur, old).as_dict()}
        rows.append(row)
    return rows


def render(rows: list[dict], base_name: str, new_name: str) -> str:
    from pcgtts.quality.harness import fmt_estimate as est
    from pcgtts.quality.stats import format_table

    pct = dict(scale=100.0, digits=1)
    codec = bool(rows) and "stoi" in rows[0]
    extra = ["STOI base", "STOI new", "ΔSTOI", "ΔMCD dB"] if codec else []
    return format_table(
        ["case", "T", "n", "WER % base", "WER % new", "ΔWER %", "CER % base", "CER % new", "ΔCER %", "ΔSim", *extra],
        [[r["case"], "-" if r["temperature"] is None else f"{r['temperature']:g}", r["utterances"],
          est(r["wer"]["base"], **pct), est(r["wer"]["new"], **pct),
          est(r["wer"]["delta"], signed=True, **pct), est(r["cer"]["base"], **pct), est(r["cer"]["new"], **pct),
          est(r["cer"]["delta"], signed=True, **pct), est(r["sim"]["delta"], digits=3, signed=True),
          *([est(r["stoi"]["base"], digits=3), est(r["stoi"]["new"], digits=3), est(r["stoi"]["delta"], digits=3, signed=True),
             est(r["mcd"]["delta"], digits=2, signed=True)] if codec else [])] for r in rows],
        title=f"pcgtts eval-diff: {new_name} vs {base_name} (paired by sentence and seed, 95 %)")
