"""The speech lab's training commands (corpus, codec, lm, draft fine-tune, package, all), as
parsers added to a group by `add_command`: `pcgtts train ...` (cli/train.py) holds them.

Each command validates its arguments before any heavy work, resumes from its last
checkpoint in --out, shows progress, prints a readable summary and then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from pcgtts.cli.flags import comma_list

DEFAULT_ROOT = Path("/work/lab")
log = logging.getLogger(__name__)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


LAB_JOBS = ("corpus", "codec", "lm", "draft", "package", "presets", "all")


def add_command(cmds, job: str, name: str | None = None) -> argparse.ArgumentParser:
    """Add the lab command `job` (one of LAB_JOBS; "draft": the layer-subset draft fine-tuned on the
    lab's codes) to the sub-command group `cmds`, as `name` (default: `job`)."""
    p = _BUILDERS[job](cmds, name or job)
    p.set_defaults(func=run, lab_command=job, lab_prog=p.prog)
    return p


def _add_corpus(cmds, name: str) -> argparse.ArgumentParser:
    p = cmds.add_parser(name, help="render the sentence corpus with packaged TTS voices (resumable)")
    p.add_argument("--out", type=Path, default=DEFAULT_ROOT / "corpus")
    p.add_argument("--per-speaker", type=_positive_int, default=260)
    p.add_argument("--heldout-sentences", type=int, default=24)
    p.add_argument("--max-sentences", type=_positive_int, default=None)
    p.add_argument("--markov-sentences", type=int, default=0,
                   help="add this many sentences from essential-generators' Markov model to the pool (lab-v2)")
    p.add_argument("--speakers", default=None, help="comma-separated subset of speaker names (default: all 24)")
    p.add_argument("--voice-bank", action="store_true",
                   help="add 20 festival voices of other languages for the codec alone (split codec_only)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(lab_func=_cmd_corpus)
    return p


def _add_codec(cmds, name: str) -> argparse.ArgumentParser:
    p = cmds.add_parser(name, help="train the small X-codec2 (semonly recipe; resumes from --out)")
    p.add_argument("--corpus", type=Path, default=DEFAULT_ROOT / "corpus")
    p.add_argument("--out", type=Path, default=DEFAULT_ROOT / "codec")
    p.add_argument("--steps", type=_positive_int, default=20000)
    p.add_argument("--batch-size", type=_positive_int, default=8)
    p.add_argument("--lr", type=_positive_float, default=6e-4,
                   help="peak learning rate (warm-up, then cosine to 5%% of it at --steps)")
    p.add_argument("--threads", type=_positive_int, default=1)
    p.add_argument("--checkpoint-minutes", type=_positive_float, default=5.0)
    p.add_argument("--tiny", action="store_true", help="tiny model (tests, smoke runs)")
    p.add_argument("--eval", action="store_true", help="only evaluate the export on held-out speakers: STOI, PocketSphinx WER of source and resynthesis")
    p.add_argument("--init-from", type=Path, help="start a fresh run from a committed voice's codec (e.g. pcgtts/voice)")
    p.add_argument("--acoustic", action="store_true",
                   help="train the acoustic (waveform) encoder too, as the released codec does (keeps more of a voice; ~5x slower a step on a CPU)")
    p.add_argument("--freeze-encoder", action="store_true",
                   help="stage 2: fix the codes (freeze up to the quantizer) and train only the decoder, on each "
                        "utterance's codes made once (kept in decoder_codes.npz); sticky")
    p.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU machine")
    p.add_argument("--max-minutes", type=_positive_float, default=None,
                   help="stop after this many minutes, checkpointed (run again to go on): a time budget")
    p.set_defaults(lab_func=_cmd_codec)
    return p


def _add_lm(cmds, name: str) -> argparse.ArgumentParser:
    p = cmds.add_parser(name, help="train the LLaSA-format target LM on codec codes (resumes from --out)")
    p.add_argument("--corpus", type=Path, default=DEFAULT_ROOT / "corpus")
    p.add_argument("--codec", type=Path, default=DEFAULT_ROOT / "codec" / "export")
    p.add_argument("--out", type=Path, default=DEFAULT_ROOT / "lm")
    p.add_argument("--steps", type=_positive_int, default=6000)
    p.add_argument("--batch-size", type=_positive_int, default=8)
    p.add_argument("--threads", type=_positive_int, default=1)
    p.add_argument("--checkpoint-minutes", type=_positive_float, default=5.0)
    p.add_argument("--tiny", action="store_true", help="tiny model (tests, smoke runs)")
    p.add_argument("--size", choices=("base", "small"), default="base",
                   help="base: h384/6 layers (the probe's recommendation); small: h256/6 layers, 2.2x faster per step")
    p.add_argument("--init-from", type=Path, help="start a fresh run from a committed voice's target (e.g. pcgtts/voice)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU machine (bf16 autocast)")
    p.add_argument("--lr", type=_positive_float, default=1e-3)
    p.add_argument("--max-minutes", type=_positive_float, default=None,
                   help="stop after this many minutes, checkpointed (run again to go on): a time budget")
    p.add_argument("--voice-prompt-prob", type=float, default=0.5,
                   help="share of examples prompted with a same-speaker reference (voice cloning)")
    p.add_argument("--unprompted-speakers", type=comma_list(str), default=None,
                   help="comma-separated corpus speakers whose examples may go unprompted: the voice heard when "
                        "no voice is given; every other speaker is trained behind a voice prompt (default: all)")
    p.add_argument("--unprompted-share", type=float, default=0.0,
                   help="with --unprompted-speakers: at least this share of examples is theirs, unprompted (keeps "
                        "the default voice's reading strong); default 0: sampled like every other speaker")
    p.add_argument("--align-weight", type=float, default=0.0,
                   help="weight of the alignment prior (train/align.py: watched heads read the text near the "
                        "diagonal); 0 (default): off")
    p.add_argument("--align-heads", type=_positive_int, default=1, help="heads a watched layer (the middle two layers)")
    p.set_defaults(lab_func=_cmd_lm)
    return p


def _add_draft(cmds, name: str) -> argparse.ArgumentParser:
    p = cmds.add_parser(name, help="the lab's draft: a 3-layer subset of the target, briefly fine-tuned on the "
                                   "lab's training codes")
    p.add_argument("--target", type=Path, default=DEFAULT_ROOT / "lm" / "export")
    p.add_argument("--lm-dir", type=Path, default=DEFAULT_ROOT / "lm", help="the target's training folder (codes)")
    p.add_argument("--out", type=Path, default=DEFAULT_ROOT / "draft")
    p.add_argument("--layers", type=_positive_int, default=3)
    p.add_argument("--steps", type=_positive_int, default=1000)
    p.add_argument("--threads", type=_positive_int, default=1)
    p.set_defaults(lab_func=_cmd_draft)
    return p


def _add_package(cmds, name: str) -> argparse.ArgumentParser:
    p = cmds.add_parser(name, help="the compact committed form of the trained voice (fp16, factorised); "
                                   "replacing a voice, only if it is not worse (the release gate)",
                        description="Write the trained voice into --out. When --out already holds a voice (the "
                                    "shipped one), the new voice is written to a staging folder, both speak the "
                                    "quality test set's first --gate-sentences sentences with each of --gate-seeds, "
                                    "and the new one replaces the old only if neither the default voice nor any "
                                    "shared preset reads worse (paired WER, 95 % interval), no preset is told apart "
                                    "less, no shipped preset is dropped and its drafts accept no less (pcg, "
                                    "eagle-pcg); otherwise it is refused and --out is left as it was. The comparison "
                                    "goes into voice.json and the model card.")
    p.add_argument("--root", type=Path, default=DEFAULT_ROOT, help="lab folder holding lm/, draft/, codec/export")
    p.add_argument("--voice", type=Path, default=None,
                   help="a voice folder packed already (e.g. LAB/pack) to put into --out instead of the lab's folders")
    p.add_argument("--out", type=Path, default=None, help="voice folder (default: the package's pcgtts/voice)")
    p.add_argument("--name", help="version name recorded in voice.json, e.g. lab-v1 (required unless --voice)")
    p.add_argument("--presets", type=Path, help="folder of preset voices (voices.json + .voice files) to ship with "
                                                "it (default: keep those of the voice in --out)")
    gate = p.add_argument_group("release gate (when --out already holds a voice)")
    gate.add_argument("--accept-worse", metavar="REASON",
                      help="ship it even if the gate finds it worse; the reason is recorded with the comparison")
    gate.add_argument("--drop-presets", type=comma_list(str), default=[], metavar="NAMES",
                      help="shipped presets the new voice leaves out on purpose (comma list)")
    gate.add_argument("--gate-sentences", type=_positive_int, default=20,
                      help="test sentences each voice speaks (of quality/testset_v1.json's 20; default 20)")
    gate.add_argument("--gate-seeds", type=comma_list(int), default=[0, 1], help="seeds per sentence (default 0,1)")
    gate.add_argument("--gate-temperature", type=float,
                      help="one temperature for both voices (default: each voice's own, from its voice.json)")
    gate.add_argument("--gate-report", type=Path, help="write the gate's JSON (per-utterance records too) here")
    p.add_argument("--heads", type=Path, help="multi-token heads file trained for the target (optional)")
    p.add_argument("--eagle", type=Path, help="EAGLE draft file trained for the target (optional)")
    p.add_argument("--mean-group-size", type=_positive_int, default=140, help="θ of the built group table (paper: ~140)")
    p.add_argument("--figures", type=Path, help="JSON of measured figures to record (WER, STOI, similarity, ...)")
    p.add_argument("--temperature", type=float, help="the temperature the voice is played at when the user gives "
                                                     "none (recorded in voice.json; default: the runtime's)")
    p.set_defaults(lab_func=_cmd_package)
    return p


def _add_presets(cmds, name: str) -> argparse.ArgumentParser:
    p = cmds.add_parser(name, help="preset voices from the lab corpus: a typical 3-5 s utterance of each named "
                                   "training speaker, as voice files (into a voice folder, or a folder of their own)")
    p.add_argument("--corpus", type=Path, default=DEFAULT_ROOT / "corpus")
    p.add_argument("--codes", type=Path, default=DEFAULT_ROOT / "lm" / "codes.npz",
                   help="the corpus's codes (`train lm` caches them in its --out)")
    p.add_argument("--spec", type=Path, required=True,
                   help="JSON naming the presets: default, voices [{name, speaker, description}], aliases")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--voice", type=Path, help="a voice folder (pcgtts/voice) whose presets to replace")
    target.add_argument("--out", type=Path, help="a folder to write voices.json and the .voice files into")
    p.set_defaults(lab_func=_cmd_presets)
    return p


def _add_all(cmds, name: str) -> argparse.ArgumentParser:
    p = cmds.add_parser(name, help="corpus, codec, lm and the draft fine-tune in order, each resumed where it stopped")
    p.add_argument("--root", type=Path, default=DEFAULT_ROOT)
    p.add_argument("--threads", type=_positive_int, default=1)
    p.set_defaults(lab_func=_cmd_all)
    return p


_BUILDERS = {"corpus": _add_corpus, "codec": _add_codec, "lm": _add_lm, "draft": _add_draft, "package": _add_package,
             "presets": _add_presets, "all": _add_all}


def run(args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    try:
        summary = args.lab_func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        raise SystemExit(f"{args.lab_prog}: {err}") from None
    width = max(len(k) for k in summary)
    for key, value in summary.items():
        print(f"{key:<{width}}  {value}")
    print(json.dumps(summary, default=str))
    return 0


class ProgressBar:
    """Progress of the training loops' callbacks: a tqdm bar on a terminal; elsewhere (a log file, a
    background job) a plain line at most every `every_s` seconds and at the end, not a bar's redraws."""

    def __init__(self, desc: str, unit: str, every_s: float = 30.0):
        from tqdm import tqdm

        self.bar, self.desc, self.unit, self._tqdm = None, desc, unit, tqdm
        self.terminal, self.every_s, self._last = sys.stderr.isatty(), every_s, None

    def __call__(self, done, total, value=None):
        if not self.terminal:
            now = time.monotonic()
            if self._last is None or now - self._last >= self.every_s or done >= total:
                self._last = now
                extra = f" ({value:.3f})" if value is not None else ""
                print(f"{self.desc}: {done}/{total} {self.unit}{extra}", file=sys.stderr, flush=True)
            return
        if self.bar is None:
            self.bar = self._tqdm(total=total, desc=self.desc, unit=self.unit, file=sys.stderr)
            self.bar.update(done - 1)
        self.bar.update(done - self.bar.n)
        if value is not None:
            self.bar.set_postfix_str(f"{value:.3f}")


def _cmd_corpus(args) -> dict:
    from pcgtts.train.corpus import (DEFAULT_HELDOUT_SPEAKERS, DEFAULT_SPEAKERS, VOICE_BANK_SPEAKERS, CorpusConfig,
                                     build_corpus)

    if args.voice_bank and args.speakers:
        raise ValueError("--voice-bank adds the voice bank to the default speakers; with --speakers, name them")
    speakers = DEFAULT_SPEAKERS + VOICE_BANK_SPEAKERS if args.voice_bank else DEFAULT_SPEAKERS
    if args.speakers:
        names = [n.strip() for n in args.speakers.split(",") if n.strip()]
        known = {s.name: s for s in DEFAULT_SPEAKERS + VOICE_BANK_SPEAKERS}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ValueError(f"unknown speakers {unknown}; known: {', '.join(known)}")
        speakers = tuple(known[n] for n in names)
    heldout = tuple(n for n in DEFAULT_HELDOUT_SPEAKERS if n in {s.name for s in speakers})
    cfg = CorpusConfig(out_dir=args.out, per_speaker=args.per_speaker, heldout_sentences=args.heldout_sentences,
                       max_sentences=args.max_sentences, markov_sentences=args.markov_sentences, seed=args.seed, speakers=speakers,
                       heldout_speakers=heldout)
    summary = build_corpus(cfg, progress=ProgressBar("corpus", "utt"))
    summary["out"] = str(args.out)
    return summary


def _cmd_codec(args) -> dict:
    from pcgtts.quality.codec_eval import evaluate_codec
    from pcgtts.train.codec import CodecModelConfig, CodecTrainConfig, train_codec

    if not (args.corpus / "manifest.jsonl").is_file():
        raise FileNotFoundError(f"no corpus at {args.corpus} (run `pcgtts train corpus` first)")
    if args.eval:
        return evaluate_codec(args.out / "export", args.corpus)
    model = CodecModelConfig(hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2, semantic_hidden=32,
                             semantic_intermediate=64, acoustic=args.acoustic) if args.tiny else \
        CodecModelConfig(acoustic=args.acoustic)
    cfg = CodecTrainConfig(corpus=args.corpus, out_dir=args.out, model=model, steps=args.steps,
                           batch_size=args.batch_size, lr=args.lr, threads=args.threads,
                           checkpoint_minutes=args.checkpoint_minutes, freeze_encoder=args.freeze_encoder,
                           init_from=args.init_from, device=args.device, max_minutes=args.max_minutes)
    return train_codec(cfg, progress=ProgressBar("codec", "step"))


def _cmd_lm(args) -> dict:
    from pcgtts.train.lm import LMModelConfig, LMTrainConfig, train_lm

    for path, what in ((args.corpus / "manifest.jsonl", "corpus"), (args.codec / "config.json", "codec export")):
        if not path.is_file():
            raise FileNotFoundError(f"no {what} at {path.parent}")
    model = LMModelConfig.tiny() if args.tiny else LMModelConfig.small() if args.size == "small" else LMModelConfig()
    cfg = LMTrainConfig(corpus=args.corpus, codec=args.codec, out_dir=args.out, model=model, steps=args.steps,
                        batch_size=args.batch_size, threads=args.threads,
                        checkpoint_minutes=args.checkpoint_minutes, voice_prompt_prob=args.voice_prompt_prob,
                        init_from=args.init_from, device=args.device, lr=args.lr,
                        max_minutes=args.max_minutes, align_weight=args.align_weight, align_heads=args.align_heads,
                        unprompted_speakers=tuple(n.strip() for n in args.unprompted_speakers)
                        if args.unprompted_speakers else None, unprompted_share=args.unprompted_share)
    return train_lm(cfg, progress=ProgressBar("lm", "step"))


def _cmd_draft(args) -> dict:
    from pcgtts.train.draft import DraftTrainConfig, train_draft

    if not (args.target / "config.json").is_file():
        raise FileNotFoundError(f"no target LM export at {args.target} (run `pcgtts train lm` first)")
    cfg = DraftTrainConfig(target=args.target, lm_dir=args.lm_dir, out_dir=args.out, layers=args.layers,
                           steps=args.steps, threads=args.threads)
    return train_draft(cfg, progress=ProgressBar("draft", "step"))


def _cmd_presets(args) -> dict:
    import tempfile

    from pcgtts.quality.metrics import speaker_encoder
    from pcgtts.train.presets import make_presets

    for path, what in ((args.corpus / "manifest.jsonl", "corpus"), (args.codes, "codes file"), (args.spec, "spec")):
        if not path.is_file():
            raise FileNotFoundError(f"no {what} at {path}")
    if args.voice is not None:
        from pcgtts.train.package import set_presets

        with tempfile.TemporaryDirectory() as tmp:
            index = make_presets(args.corpus, args.codes, args.spec, Path(tmp) / "voices", speaker_encoder().embed,
                                 progress=log.info)
            set_presets(args.voice, index.parent)
        where = args.voice / "voices"
    else:
        where = make_presets(args.corpus, args.codes, args.spec, args.out, speaker_encoder().embed,
                             progress=log.info).parent
    from pcgtts.runtime.audio.presets import Presets

    presets = Presets.load(where)
    return {"presets": ", ".join(presets.names), "aliases": len(presets.aliases), "folder": str(where)}


def _cmd_package(args) -> dict:
    from pcgtts.builtin import VOICE_DIR
    from pcgtts.quality.gate import GateConfig
    from pcgtts.train.package import install_staged, pack_voice, read_voice, stage_voice

    out = args.out or VOICE_DIR
    if args.voice is not None:
        if not (args.voice / "voice.json").is_file():
            raise FileNotFoundError(f"{args.voice}: no voice.json, not a voice folder")
        given = [flag for flag, value in (("--name", args.name), ("--heads", args.heads), ("--eagle", args.eagle),
                                          ("--figures", args.figures), ("--temperature", args.temperature),
                                          ("--presets", args.presets)) if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: --voice puts a packed voice in place as it is")
    else:
        if not args.name:
            raise ValueError("--name is required (the version name recorded in voice.json)")
        needed = [args.root / "lm" / "checkpoint.pt", args.root / "draft" / "checkpoint.pt",
                  args.root / "codec" / "export" / "model.safetensors"]
        for path in needed + [p for p in (args.heads, args.eagle, args.figures) if p is not None]:
            if not path.is_file():
                raise FileNotFoundError(f"{path} not found")
    if args.presets is not None and not (args.presets / "voices.json").is_file():
        raise FileNotFoundError(f"{args.presets}: no voices.json (a folder of preset voices)")
    if args.accept_worse is not None and not args.accept_worse.strip():
        raise ValueError("--accept-worse needs a reason")
    if args.gate_report is not None and not args.gate_report.parent.is_dir():
        raise FileNotFoundError(f"--gate-report: folder {args.gate_report.parent} not found")
    config = GateConfig(sentences=args.gate_sentences, seeds=tuple(args.gate_seeds), temperature=args.gate_temperature)
    if config.sentences > 20:
        raise ValueError(f"--gate-sentences must lie in [2, 20] (the quality test set's sentences), got {config.sentences}")
    shipped = (out / "voice.json").is_file()
    if shipped:
        read_voice(out, files=())  # the voice it is compared with, checked before anything is made
    else:
        log.info("%s holds no voice yet: nothing to compare with, no release gate", out)
    gate, report = (_release_gate(out, config, args) if shipped else None), {}

    if args.voice is not None:
        out = install_staged(stage_voice(args.voice, out), out, gate and (lambda staging: report.update(gate(staging))))
    else:
        presets = args.presets or (out / "voices" if (out / "voices" / "voices.json").is_file() else None)
        figures = json.loads(args.figures.read_text()) if args.figures else {}
        out = pack_voice(out, args.root / "lm", args.root / "draft", args.root / "codec" / "export",
                         name=args.name, heads_file=args.heads, eagle_file=args.eagle,
                         mean_group_size=args.mean_group_size, figures=figures,
                         settings={"temperature": args.temperature} if args.temperature is not None else None,
                         presets=presets, gate=gate and (lambda staging: report.update(gate(staging))))
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    summary = {"voice": str(out), "megabytes": round(size / 2**20, 1), "name": read_voice(out, files=())["name"]}
    if report:
        summary.update({"gate": "accepted worse: " + report["accepted_worse"] if report["accepted_worse"] else "passed",
                        "gate_seconds": report["seconds"]})
    return summary


def _release_gate(shipped: Path, config, args):
    """The package command's gate: the staged voice against the one in `shipped`."""
    from pcgtts.quality.gate import gate_voice

    def gate(staging: Path) -> dict:
        return gate_voice(shipped, staging, config, args.accept_worse, args.drop_presets, report=args.gate_report,
                          progress=log.info)

    return gate


def _cmd_all(args) -> dict:
    """Each step parsed from its own command line, so every option has the value its command defaults to."""
    parser = argparse.ArgumentParser(prog="pcgtts train")
    cmds = parser.add_subparsers(dest="train_cmd", required=True)
    for job in ("corpus", "codec", "lm", "draft"):
        add_command(cmds, job)
    root, threads = args.root, ["--threads", str(args.threads)]

    def step(*argv):
        return parser.parse_args(list(map(str, argv)))

    out = {}
    out["corpus"] = _cmd_corpus(step("corpus", "--out", root / "corpus"))["hours"]
    out["codec"] = _cmd_codec(step("codec", "--corpus", root / "corpus", "--out", root / "codec", *threads))["export"]
    out["lm"] = _cmd_lm(step("lm", "--corpus", root / "corpus", "--codec", root / "codec" / "export",
                             "--out", root / "lm", *threads))["export"]
    out["draft"] = _cmd_draft(step("draft", "--target", root / "lm" / "export", "--lm-dir", root / "lm",
                                   "--out", root / "draft", *threads))["export"]
    return out
