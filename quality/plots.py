"""The accuracy / speed-up curves (the paper's Figures 2 and 3) from `run_synth`'s summaries.

One PNG per sweep -- over θ (pcg), β (ssd) and draft length L (sd / pcg) -- with two panels:
WER and Sim-O against the measured speed-up, 95 % intervals as error bars, each point labelled
with its setting, and the target-AR point marked. A sweep with fewer than two settings is skipped.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)

SWEEPS = {  # name -> (summary key, policies it varies for, axis label)
    "theta": ("theta", ("pcg",), "θ"),
    "beta": ("ssd_beta", ("ssd",), "β"),
    "draft_length": ("draft_length", ("sd", "ssd", "pcg"), "L"),
}


def sweep_series(summaries: list[dict], sweep: str) -> dict[str, list[dict]]:
    """{series label: summaries sorted by the swept value} for series with >= 2 distinct values."""
    key, policies, _ = SWEEPS[sweep]
    others = [k for name, (k, _, _) in SWEEPS.items() if name != sweep]
    series: dict[str, list[dict]] = {}
    for s in summaries:
        if s["policy"] not in policies or s.get(key) is None or s.get("speedup_vs_ar") is None:
            continue
        fixed = ", ".join(f"{SWEEPS[n][2]}={s[k]:g}" for n, (k, _, _) in SWEEPS.items()
                          if k in others and s.get(k) is not None and s["policy"] in SWEEPS[n][1])
        series.setdefault(f"{s['policy']}" + (f" ({fixed})" if fixed else ""), []).append(s)
    return {name: sorted(rows, key=lambda r: r[key]) for name, rows in series.items()
            if len({r[key] for r in rows}) >= 2}


def plot_curves(summaries: list[dict], out_dir: str | Path, title: str = "") -> list[Path]:
    """Write curves_<sweep>.png for each sweep present; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pcgtts.runtime.files import atomic_output

    ar = next((s for s in summaries if s["policy"] == "ar"), None)
    written = []
    for sweep, (key, _, symbol) in SWEEPS.items():
        series = sweep_series(summaries, sweep)
        if not series:
            continue
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for ax, metric, scale, name in ((axes[0], "wer", 100.0, "WER (%)"), (axes[1], "sim", 1.0, "Sim-O (cosine)")):
            for label, rows in series.items():
                x = [r["speedup_vs_ar"] for r in rows]
                y = [(r[metric]["mean"] or float("nan")) * scale for r in rows]
                err = [((r[metric]["high"] - r[metric]["low"]) / 2 * scale) if r[metric]["low"] is not None else 0.0
                       for r in rows]
                ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=label)
                for xi, yi, r in zip(x, y, rows):
                    ax.annotate(f"{symbol}={r[key]:g}", (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7)
            if ar is not None and ar[metric]["mean"] is not None:
                ax.scatter([1.0], [ar[metric]["mean"] * scale], marker="*", s=160, color="black", zorder=5,
                           label="target AR")
            ax.set_xlabel("speed-up vs target AR (tokens/s ratio)")
            ax.set_ylabel(name)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(f"{title} — sweep over {symbol}".strip(" —"))
        fig.tight_layout()
        path = Path(out_dir) / f"curves_{sweep}.png"
        with atomic_output(path) as tmp:
            fig.savefig(tmp, dpi=110, format="png")
        plt.close(fig)
        written.append(path)
    return written


__all__ = ["SWEEPS", "sweep_series", "plot_curves"]
