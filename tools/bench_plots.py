"""PNG plots of a `pcgtts bench` report (matplotlib, from the `bench` extra).

Three panels: the timeline of one utterance (tokens produced per decode step, and each audio
chunk's ready time against the time playback needed it), and the sweep: acceptance rate and
speed-up over `ar` against theta (pcg) or the draft_length L, whichever the run varied (per
rule otherwise).
"""

from __future__ import annotations

from pathlib import Path


def _sweep_axis(summaries: list[dict]) -> tuple[str, list[dict]]:
    pcg = [s for s in summaries if s["policy"] == "pcg" and s["theta"] is not None]
    if len({s["theta"] for s in pcg}) > 1:
        return "theta", pcg
    spec = [s for s in summaries if s["policy"] not in ("ar", "draft")]
    if len({s["draft_length"] for s in spec}) > 1:
        return "draft_length", spec
    return "case", summaries


def plot_report(report: dict, path: str | Path) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("plots need matplotlib: pip install 'pcgtts[bench]'") from None
    summaries, utterances = report["summaries"], report["utterances"]
    fig, (ax_steps, ax_chunks, ax_sweep) = plt.subplots(3, 1, figsize=(9, 10))

    # The longest utterance of the first speculative case (or of ar) makes the clearest timeline.
    chosen = next((s["case"] for s in summaries if s["policy"] not in ("ar", "draft")), summaries[0]["case"])
    utt = max((u for u in utterances if u["case"] == chosen), key=lambda u: u["tokens"])
    if utt["trace"]:
        times, made = zip(*utt["trace"])
        ax_steps.vlines(times, 0, made, linewidth=1)
    ax_steps.set(title=f"{chosen}: tokens per decode step ({utt['tokens']} tokens)", xlabel="time since request (s)",
                 ylabel="tokens")

    ready = [c["ready"] for c in utt["chunks"]]
    deadline = [c["deadline"] for c in utt["chunks"]]
    ax_chunks.plot(range(len(ready)), ready, "o-", label="chunk ready")
    ax_chunks.plot(range(len(deadline)), deadline, "s--", label="playback needs it")
    ax_chunks.set(title=f"chunks: {utt['underruns']} underruns, TTFA {utt['time_to_first_audio'] * 1000:.0f} ms",
                  xlabel="chunk", ylabel="time since request (s)")
    ax_chunks.legend()

    axis, rows = _sweep_axis(summaries)
    twin = ax_sweep.twinx()
    if axis == "case":
        xs = list(range(len(rows)))
        ax_sweep.set_xticks(xs, [r["case"] for r in rows], rotation=20, fontsize=8)
    else:
        for policy in sorted({r["policy"] for r in rows}):
            part = sorted((r for r in rows if r["policy"] == policy), key=lambda r: r[axis])
            xs = [r[axis] for r in part]
            ax_sweep.plot(xs, [r["acceptance_rate"] for r in part], "o-", label=f"{policy} acceptance")
            twin.plot(xs, [r["speedup_vs_ar"] or 0 for r in part], "s--", label=f"{policy} ×ar")
        ax_sweep.legend(loc="upper left", fontsize=8)
        twin.legend(loc="upper right", fontsize=8)
    if axis == "case":
        ax_sweep.bar([x - 0.2 for x in xs], [r["acceptance_rate"] for r in rows], width=0.4, label="acceptance")
        twin.bar([x + 0.2 for x in xs], [r["speedup_vs_ar"] or 0 for r in rows], width=0.4, color="C1", label="×ar")
        ax_sweep.legend(loc="upper left", fontsize=8)
        twin.legend(loc="upper right", fontsize=8)
    ax_sweep.set(title=f"acceptance and speed-up over ar against {axis}", xlabel=axis, ylabel="acceptance rate")
    twin.set_ylabel("speed-up over ar")
    fig.suptitle("pcgtts bench" + (" — demo models (random weights, not speech)" if report.get("demo_models") else ""))
    fig.tight_layout()
    path = Path(path)
    from pcgtts.runtime.files import atomic_output

    with atomic_output(path) as tmp:
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)
    return path
