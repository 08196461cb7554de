"""Pictures on the results pages, drawn from the same tables as QUALITY.md (`benchmarks/results/quality.json`).

Pictures, each from one table (or record) when it has rows to draw:

- `docs/img/quality-frontier.png` (table `builtin-rules`): each speculative rule's WER against its
  speed-up over plain decoding, with the 95 % interval as an error bar; plain decoding is the point at
  x = 1 and its interval a horizontal band.
- `docs/img/presets.png` (table `presets`): each preset's WER and how often it is identified as itself,
  with their intervals, and the goals (WER <= 30 %, identity >= 90 %) as dashed lines.
- `docs/img/many-streams.png` (`benchmarks/results/many_streams.json`, not a table): TTFA p99 and
  aggregate audio seconds per second against concurrent streams, each server configuration a line.

What a picture shows is reduced to plain data first (`plots_for`); its hash is stored in the PNG's
`Description` text, so whether a committed picture is current is known without matplotlib
(`stale`). Drawing needs matplotlib (the `bench` or `eval` extra) and is deterministic: fixed size and
dpi, no version stamp in the file.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

IMG = Path("docs/img")
STYLE = 1  # raise when the drawing changes, so every committed picture is redrawn
SIZE_IN = (9.0, 5.5)
DPI = 100
SIZE_PX = (int(SIZE_IN[0] * DPI), int(SIZE_IN[1] * DPI))
WER_GOAL = 30.0  # each preset's WER, % at most
IDENTITY_GOAL = 90.0  # each preset identified as itself, % at least
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@dataclass(frozen=True)
class Plot:
    """One picture: the table it draws, its file (relative to the repository), its alt text, what it shows."""

    table: str
    path: Path
    alt: str
    data: str  # JSON of what is drawn (`frontier_data` / `presets_data`)

    @property
    def stamp(self) -> str:
        return "pcgtts results plot " + hashlib.sha256(f"{STYLE}\n{self.data}".encode()).hexdigest()[:16]

    def embed(self, page: Path) -> str:
        """The markdown image line for a page at `page` (relative to the repository root)."""
        return f"![{self.alt}]({Path(os.path.relpath(self.path, page.parent)).as_posix()})"


def estimate(value) -> list | None:
    """A figure as [mean, low, high] (low and high None when it has no interval), or None.

    A figure is a number, {"mean", "pm"}, or an identification text such as "19 / 20 = 95 % [76, 99]"."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return [value, None, None]
    if isinstance(value, dict) and isinstance(value.get("mean"), (int, float)):
        pm = value.get("pm")
        if isinstance(pm, (int, float)):
            return [value["mean"], round(value["mean"] - pm, 6), round(value["mean"] + pm, 6)]
        return [value["mean"], None, None]
    if isinstance(value, str):
        found = re.search(r"(\d+(?:\.\d+)?)\s*%(?:\s*\[\s*(\d+(?:\.\d+)?)\s*,\s*(\d+(?:\.\d+)?)\s*\])?", value)
        if found:
            mean, low, high = found.groups()
            return [float(mean), float(low) if low else None, float(high) if high else None]
    return None


def voice_of(table: dict) -> str:
    """The part of a table's title before " · ", which names the voice: "Built-in voice (lab-v7)"."""
    return table["title"].split(" · ")[0].strip()


def frontier_data(table: dict) -> dict | None:
    """The frontier's points: plain decoding (the row that is its own baseline) and every row with a
    speed-up and a WER; None when there is nothing to draw."""
    rows = table.get("rows") or []
    plain = next((r for r in rows if r.get("baseline") == "itself" and estimate(r["figures"].get("wer"))), None)
    points = []
    for row in rows:
        wer, speed = estimate(row["figures"].get("wer")), row["figures"].get("x_ar")
        if row is plain or wer is None or not isinstance(speed, (int, float)):
            continue
        points.append({"label": row["label"], "x": speed, "wer": wer})
    if not points and plain is None:
        return None
    return {"title": f"{voice_of(table)}: WER against speed-up over plain decoding",
            "plain": {"label": plain["label"], "wer": estimate(plain["figures"]["wer"])} if plain else None,
            "points": points}


def presets_data(table: dict) -> dict | None:
    """Each preset's WER and identity; None when no row has either."""
    bars = []
    for row in table.get("rows") or []:
        wer, identity = estimate(row["figures"].get("wer")), estimate(row["figures"].get("self_id"))
        if wer or identity:
            bars.append({"label": row["label"].split(" (")[0], "wer": wer, "identity": identity})
    if not bars:
        return None
    return {"title": table["title"], "bars": bars, "wer_goal": WER_GOAL, "identity_goal": IDENTITY_GOAL}


def plots_for(doc: dict) -> list[Plot]:
    """The pictures a results document gives, in its tables' order."""
    plots = []
    for table in doc.get("tables", []):
        if table.get("id") not in KINDS or table["id"] == MANY_STREAMS:
            continue
        name, alt, data_of, _ = KINDS[table["id"]]
        data = data_of(table)
        if data is not None:
            plots.append(Plot(table["id"], IMG / name, alt, json.dumps(data, sort_keys=True, ensure_ascii=False)))
    return plots


def many_streams_data(record: dict) -> dict | None:
    """Each server configuration's TTFA p99 and aggregate audio seconds per second against the number of
    concurrent streams, from `benchmarks/bench_many_streams.py --json`; None when no level has figures."""
    series = []
    for config in record.get("configurations") or []:
        levels = [r for r in config.get("levels") or [] if r.get("completed")]
        if levels:
            series.append({"name": config["name"], "about": config.get("about", ""),
                           "clients": [r["clients"] for r in levels],
                           "ttfa_p99_ms": [r.get("ttfa_p99_ms") for r in levels],
                           "audio_s_per_s": [r.get("audio_s_per_s") for r in levels]})
    if not series:
        return None
    return {"title": "Many streams at once, a line per server configuration", "series": series}


def many_streams_plot(record: dict | None) -> Plot | None:
    """The picture of `benchmarks/results/many_streams.json` (None without a record or figures)."""
    data = many_streams_data(record) if record else None
    if data is None:
        return None
    name, alt, _, _ = KINDS[MANY_STREAMS]
    return Plot(MANY_STREAMS, IMG / name, alt, json.dumps(data, sort_keys=True, ensure_ascii=False))


def png_info(path: Path) -> tuple[int, int, dict[str, str]]:
    """(width, height, {key: text}) of a PNG file; a ValueError when it is not one."""
    blob = Path(path).read_bytes()
    if not blob.startswith(PNG_SIGNATURE):
        raise ValueError(f"{path}: not a PNG file")
    pos, size, texts = len(PNG_SIGNATURE), None, {}
    while pos + 8 <= len(blob):
        length, kind = struct.unpack(">I4s", blob[pos:pos + 8])
        body = blob[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            size = struct.unpack(">II", body[:8])
        elif kind == b"tEXt" and b"\0" in body:
            key, text = body.split(b"\0", 1)
            texts[key.decode("latin-1")] = text.decode("latin-1")
        elif kind == b"zTXt" and b"\0" in body:
            key, rest = body.split(b"\0", 1)
            texts[key.decode("latin-1")] = zlib.decompress(rest[1:]).decode("latin-1")
        elif kind == b"IEND":
            break
        pos += 12 + length
    if size is None:
        raise ValueError(f"{path}: a PNG file without its header")
    return size[0], size[1], texts


def stale(root: Path, plots: list[Plot]) -> list[Path]:
    """The pictures under `root` that are missing or were drawn from other figures."""
    found = []
    for plot in plots:
        path = root / plot.path
        try:
            current = png_info(path)[2].get("Description") == plot.stamp
        except (OSError, ValueError):
            current = False
        if not current:
            found.append(path)
    return found


def render(plot: Plot) -> bytes:
    """The picture's PNG bytes (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with matplotlib.rc_context({"font.size": 9}):
        fig = plt.figure(figsize=SIZE_IN, dpi=DPI)
        try:
            KINDS[plot.table][3](fig, json.loads(plot.data))
            out = io.BytesIO()
            fig.savefig(out, format="png", dpi=DPI, metadata={"Software": None, "Description": plot.stamp})
        finally:
            plt.close(fig)
    return out.getvalue()


def write(root: Path, plots: list[Plot]) -> list[Path]:
    """Draws the pictures that are missing or out of date; returns those written. Without matplotlib it
    logs and draws nothing (the pages do not need it)."""
    todo = stale(root, plots)
    if not todo:
        return []
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        log.warning("matplotlib is not installed (pip install 'pcgtts[bench]'): not drawing %s",
                    ", ".join(str(p) for p in todo))
        return []
    from pcgtts.runtime.files import atomic_output

    written = []
    for plot in plots:
        path = root / plot.path
        if path not in todo:
            continue
        blob = render(plot)
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_output(path) as tmp:
            tmp.write_bytes(blob)
        written.append(path)
    return written


def _interval(value: list | None) -> tuple[float, float] | None:
    """(below, above) the mean, for an error bar; None without an interval."""
    if value is None or value[1] is None or value[2] is None:
        return None
    return max(value[0] - value[1], 0.0), max(value[2] - value[0], 0.0)


def _draw_frontier(fig, data: dict) -> None:
    ax = fig.add_subplot()
    plain = data["plain"]
    if plain is not None:
        mean, low, high = plain["wer"]
        if low is not None and high is not None:
            ax.axhspan(low, high, color="0.85", zorder=0, label=f"{plain['label']}: 95 % interval")
        ax.axhline(mean, color="0.5", linewidth=0.8, zorder=1)
        err = _interval(plain["wer"])
        ax.errorbar([1.0], [mean], yerr=[[err[0]], [err[1]]] if err else None, fmt="s", color="0.3",
                    capsize=4, zorder=3, label=f"{plain['label']} (plain decoding)")
        ax.annotate(plain["label"], (1.0, mean), xytext=(7, -12), textcoords="offset points", fontsize=8)
    for i, point in enumerate(sorted(data["points"], key=lambda p: (p["x"], p["wer"][0], p["label"]))):
        err = _interval(point["wer"])
        ax.errorbar([point["x"]], [point["wer"][0]], yerr=[[err[0]], [err[1]]] if err else None, fmt="o",
                    color=f"C{i % 10}", capsize=4, zorder=4)
        ax.annotate(point["label"], (point["x"], point["wer"][0]), xytext=(7, 6 if i % 2 == 0 else -13),
                    textcoords="offset points", fontsize=8, color=f"C{i % 10}")
    xs = [1.0] + [p["x"] for p in data["points"]]
    span = max(max(xs) - min(xs), 0.2)
    ax.set_xlim(min(xs) - 0.15 * span, max(xs) + 0.6 * span)
    ax.axvline(1.0, color="0.6", linestyle=":", linewidth=0.8)
    ax.set_xlabel("speed-up over plain decoding (×)")
    ax.set_ylabel("WER % (95 % interval)")
    ax.set_title(data["title"])
    if plain is not None:
        ax.legend(loc="best", fontsize=8)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()


def _draw_presets(fig, data: dict) -> None:
    ax_wer, ax_id = fig.subplots(1, 2, sharey=True)
    bars = data["bars"]
    ys = list(range(len(bars)))
    for ax, key, goal, color, name in ((ax_wer, "wer", data["wer_goal"], "C0", "WER %"),
                                       (ax_id, "identity", data["identity_goal"], "C2",
                                        "identified as itself %")):
        means = [b[key][0] if b[key] else 0.0 for b in bars]
        errs = [_interval(b[key]) or (0.0, 0.0) for b in bars]
        ax.barh(ys, means, color=color, alpha=0.8, height=0.6,
                xerr=[[e[0] for e in errs], [e[1] for e in errs]], capsize=3, error_kw={"elinewidth": 1})
        ax.axvline(goal, color="0.2", linestyle="--", linewidth=1)
        top = max([100.0, goal] + [b[key][2] or b[key][0] for b in bars if b[key]])
        ax.set_xlim(0, top * 1.05)
        ax.set_xlabel(f"{name}; dashed: the goal, {'at most' if key == 'wer' else 'at least'} {goal:g} %")
        ax.grid(True, axis="x", alpha=0.3)
    ax_wer.set_yticks(ys, [b["label"] for b in bars])
    ax_wer.invert_yaxis()
    fig.suptitle(data["title"])
    fig.tight_layout()


def _draw_many_streams(fig, data: dict) -> None:
    ax_ttfa, ax_audio = fig.subplots(1, 2)
    for i, series in enumerate(data["series"]):
        label = f"{series['name']}: {series['about']}" if series["about"] else series["name"]
        for ax, key in ((ax_ttfa, "ttfa_p99_ms"), (ax_audio, "audio_s_per_s")):
            points = [(c, v) for c, v in zip(series["clients"], series[key]) if v is not None]
            if points:
                ax.plot(*zip(*points), marker="o", color=f"C{i % 10}", label=label)
    clients = sorted({c for series in data["series"] for c in series["clients"]})
    for ax, name in ((ax_ttfa, "time to first audio, p99 (ms)"), (ax_audio, "aggregate audio seconds per second")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(clients, [str(c) for c in clients])
        ax.minorticks_off()
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(name)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    ax_audio.axhline(1.0, color="0.5", linestyle=":", linewidth=0.8)
    handles, labels = ax_ttfa.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=1, fontsize=8, frameon=False)
    fig.suptitle(data["title"])
    fig.tight_layout(rect=(0, 0.04 + 0.035 * len(labels), 1, 1))


# table id -> (file name, alt text, what it draws, how it is drawn)
KINDS = {
    "builtin-rules": ("quality-frontier.png", "WER against speed-up over plain decoding, one point per speculative "
                      "rule with its 95 % interval; plain decoding's interval is the grey band",
                      frontier_data, _draw_frontier),
    "presets": ("presets.png", "Each preset voice's WER and how often it is identified as itself, with 95 % "
                "intervals; dashed lines at the goals (WER at most 30 %, identity at least 90 %)",
                presets_data, _draw_presets),
    # not a table of a results document: benchmarks/results/many_streams.json, drawn by `many_streams_plot`
    "many-streams": ("many-streams.png", "Time to first audio (p99) and aggregate audio seconds per second against "
                     "concurrent streams, a line per server configuration", many_streams_data,
                     _draw_many_streams),
}
MANY_STREAMS = "many-streams"
