"""The built-in voice's committed form, and its expansion into the released layouts on first use.

Last step of the lab (corpus -> codec -> LM -> draft -> **package**). The trained models are
committed compactly (the one generated thing that is): fp16 safetensors, the target and draft
*factorised* as the lab trains them (text rows + 8 x 4 FSQ digit rows + the LLaMA body: a code's
row is the sum of its digits' rows), so a 65,536-row embedding costs 32 rows. Folder layout:

    voice.json          format, name, the model configs, measured figures, sha256 of each file
    target.safetensors  factorised target (fp16)
    draft.safetensors   factorised draft (fp16), a layer subset of the target, fine-tuned
    codec.safetensors   the Xcodec2Model state dict (fp16); its config is in voice.json
    clone_codec.safetensors optional: the decoder side (everything after the quantizer) of a second
                        Xcodec2Model, fp16, that decodes speech in voices with a reference (presets,
                        cloned voices: `ModelPaths.clone_codec`); its encoder is codec.safetensors'
                        (left out of the file), its config in voice.json "clone_codec" (`add_clone_codec`)
    clone_target.safetensors optional: a second factorised target (fp16), a multi-speaker model that
                        follows voice prompts, which speaks voices with a reference (`ModelPaths.clone_target`);
                        the target's speech-vocabulary layout, expanded with its tokenizer; its config in
                        voice.json "clone_target" (`add_clone_target`)
    mtp_heads.safetensors   optional multi-token heads
    eagle_draft.safetensors optional EAGLE draft (runtime/lm/eagle.py)
    draft_head_codes.npy    optional: the codes the draft's head covers (used-codes head)
    groups.pcg.xz       optional: the target's group table as expansion builds it, xz-compressed
                        (`ship_group_table`; voice.json "groups" names it), copied instead of built
    MODEL_CARD.md       data, recipe command, training time and hardware, measured figures

`expand_voice` writes, once, a plain tied `LlamaForCausalLM` + LLaSA tokenizer for target and
draft (exact: the digit sums are materialised), the codec as `Xcodec2Model.save_pretrained`
would, the heads and EAGLE draft re-keyed to the expanded target, and the target's group table (θ chosen for
the recorded mean group size; the shipped one when the folder has it and it fits the target). `pack_voice` makes the folder from the lab's training folders;
`replace_codec` and `replace_lm` swap a committed voice's decoder, or its target and draft.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Callable

import torch

from pcgtts.runtime.lm.checkpoint import HEAD_CODES_FILE
from pcgtts.runtime.lm.eagle import EAGLE_FILE
from pcgtts.runtime.lm.heads import HEADS_FILE
from pcgtts.runtime.voicepack import FORMAT, VERSION, file_sha256, read_voice

log = logging.getLogger(__name__)

def _save_half(state: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().to(torch.float16).contiguous() for k, v in state.items()}, str(path))
    path.chmod(0o644)


def pack_voice(out_dir: str | Path, lm_dir: str | Path, draft_dir: str | Path, codec_dir: str | Path, *,
               name: str, heads_file: str | Path | None = None, eagle_file: str | Path | None = None,
               mean_group_size: int = 140,
               group_cap: int = 512, figures: dict | None = None, settings: dict | None = None,
               presets: str | Path | None = None, gate: Callable[[Path], object] | None = None) -> Path:
    """Write the compact voice folder from the lab's `lm`, `draft` and `codec/export` folders.
    `settings`: what the voice is played at when the user names none (`builtin.voice_settings`);
    `presets`: a folder of preset voices to ship with it (`set_presets`); `gate(staging)`: run on the
    complete voice in its staging folder before it replaces `out_dir` (`install_staged`)."""
    from pcgtts.runtime.voicepack import check_voice_settings

    out = Path(out_dir)
    check_voice_settings(dict(settings or {}), out / "voice.json")  # refused before anything is written
    groups = _group_spec(mean_group_size, group_cap)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    meta = {"format": FORMAT, "version": VERSION, "name": name, "created": time.strftime("%Y-%m-%d"),
            "groups": groups, "figures": figures or {}}
    if settings:
        meta["settings"] = dict(settings)
    for role, folder in (("target", lm_dir), ("draft", draft_dir)):
        meta[role] = _write_lm(role, Path(folder), tmp / f"{role}.safetensors")
    meta["codec"] = _write_codec(Path(codec_dir), tmp / "codec.safetensors")
    for src, name in ((heads_file, HEADS_FILE), (eagle_file, EAGLE_FILE)):
        if src is not None:
            shutil.copyfile(src, tmp / name)
    head_codes = _draft_head_codes(Path(draft_dir))
    if head_codes is not None:
        shutil.copyfile(head_codes, tmp / f"draft_{HEAD_CODES_FILE}")
    meta["sha256"] = {p.name: file_sha256(p) for p in sorted([*tmp.glob("*.safetensors"), *tmp.glob("*.npy")])}
    (tmp / "voice.json").write_text(json.dumps(meta, indent=2) + "\n")
    if (out / "MODEL_CARD.md").is_file():
        shutil.copyfile(out / "MODEL_CARD.md", tmp / "MODEL_CARD.md")
    if presets is not None:
        set_presets(tmp, presets)
    return install_staged(tmp, out, gate)


def stage_voice(src_dir: str | Path, out_dir: str | Path) -> Path:
    """A copy of the voice folder `src_dir` (checked: every file with its recorded checksum) in the staging
    folder beside `out_dir`, for `install_staged`: a voice packed elsewhere (e.g. LAB/pack) put in place."""
    src, out = Path(src_dir), Path(out_dir)
    read_voice(src)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    return tmp


def install_staged(staging: str | Path, out_dir: str | Path, gate: Callable[[Path], object] | None = None) -> Path:
    """Move the complete voice in `staging` into `out_dir`, replacing what is there, once `gate(staging)`
    (if given) returns; when it raises, the staging folder is removed and `out_dir` is left untouched."""
    tmp, out = Path(staging), Path(out_dir)
    if gate is not None:
        try:
            gate(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def record_gate(pack_dir: str | Path, entry: dict) -> None:
    """Record the release gate's comparison with the voice this one replaces in voice.json ("gate")."""
    pack = Path(pack_dir)
    meta = read_voice(pack, files=())
    meta["gate"] = entry
    _write_meta(pack, meta)


def _write_lm(role: str, folder: Path, dst: Path) -> dict:
    """A lab `lm` or `draft` folder's checkpoint as the voice's fp16 `<role>.safetensors`; its voice.json entry."""
    from pcgtts.train.progress import load_checkpoint

    state = load_checkpoint(folder / "checkpoint.pt")
    _save_half(state["model"], dst)
    entry = {"model_config": state["model_config"], "step": state["step"]}
    if role == "draft":
        entry["layers"] = state.get("layers")
    return entry


def _draft_head_codes(draft_dir: Path) -> Path | None:
    """The codes the draft's used-codes head covers, if it has one."""
    path = draft_dir / "export" / HEAD_CODES_FILE
    return path if path.is_file() else None


def replace_lm(pack_dir: str | Path, lm_dir: str | Path, draft_dir: str | Path) -> list[str]:
    """Put a retrained target and its draft (the lab's `lm` and `draft` folders) into a committed voice,
    keeping its codec, settings and group size. The target must have been trained on this codec's codes
    (`pcgtts train lm --init-from VOICE` on codes its encoder made). The files trained on the old target's
    hidden states (EAGLE draft, multi-token heads) no longer fit it and are removed: train them again and
    `add_to_voice`. Everything is written beside the voice before anything in it is replaced. Returns the
    names removed."""
    pack, draft_dir = Path(pack_dir), Path(draft_dir)
    meta = read_voice(pack, files=())
    written: dict[str, Path] = {}
    try:
        for role, folder in (("target", lm_dir), ("draft", draft_dir)):
            written[f"{role}.safetensors"] = pack / f"{role}.safetensors.tmp"
            meta[role] = _write_lm(role, Path(folder), written[f"{role}.safetensors"])
        head_codes = _draft_head_codes(draft_dir)
        if head_codes is not None:
            written[f"draft_{HEAD_CODES_FILE}"] = pack / f"draft_{HEAD_CODES_FILE}.tmp"
            shutil.copyfile(head_codes, written[f"draft_{HEAD_CODES_FILE}"])
    except BaseException:
        for tmp in written.values():
            tmp.unlink(missing_ok=True)
        raise
    stale = [name for name in (EAGLE_FILE, HEADS_FILE, f"draft_{HEAD_CODES_FILE}")
             if name in meta["sha256"] and name not in written]
    for name in stale:
        (pack / name).unlink(missing_ok=True)
        del meta["sha256"][name]
    for name, tmp in written.items():
        tmp.replace(pack / name)
        meta["sha256"][name] = file_sha256(pack / name)
    _write_meta(pack, meta)
    log.info("%s: new target (step %d) and draft; removed %s", pack, meta["target"]["step"], stale or "nothing")
    return stale


def _write_codec(codec_dir: Path, dst: Path) -> dict:
    """The lab's `codec/export` folder as the voice's fp16 `codec.safetensors`; its voice.json entry."""
    from safetensors.torch import load_file

    _save_half(load_file(str(codec_dir / "model.safetensors")), dst)
    frozen = codec_dir.parent / "encoder_frozen.json"  # the lab's stage-2 marker: codes fixed since then
    return {"config": json.loads((codec_dir / "config.json").read_text()),
            "encoder_frozen": json.loads(frozen.read_text()) if frozen.is_file() else None}


def replace_codec(pack_dir: str | Path, codec_dir: str | Path) -> None:
    """Put a retrained codec (a lab `codec/export` folder) into a committed voice, keeping its target.

    Only a codec whose encoder side (everything up to and including the quantizer) is bit-identical
    to the voice's is accepted: the target was trained on that encoder's codes, so a decoder
    fine-tuned with the encoder frozen (`pcgtts train codec --init-from VOICE --freeze-encoder`)
    fits, and anything else is refused before the voice is touched."""
    from safetensors.torch import load_file

    pack = Path(pack_dir)
    meta = read_voice(pack, files=("codec.safetensors",))
    tmp = pack / "codec.safetensors.tmp"
    entry = _write_codec(Path(codec_dir), tmp)
    try:
        check_same_encoder(load_file(str(pack / "codec.safetensors")), load_file(str(tmp)), codec_dir,
                           "its codes are not the ones the target was trained on")
    except BaseException:
        tmp.unlink()
        raise
    tmp.replace(pack / "codec.safetensors")
    meta["codec"] = {**entry, "encoder_frozen": entry["encoder_frozen"] or meta["codec"].get("encoder_frozen")}
    meta["sha256"]["codec.safetensors"] = file_sha256(pack / "codec.safetensors")
    _write_meta(pack, meta)


CLONE_CODEC_FILE = "clone_codec.safetensors"


def check_same_encoder(own: dict[str, torch.Tensor], new: dict[str, torch.Tensor], codec_dir: Path | str,
                       consequence: str) -> None:
    """A ValueError naming `codec_dir` unless the codec state `new` has the voice codec `own`'s tensors
    and, bit for bit, its encoder side (everything up to and including the quantizer); `consequence`
    says what a different encoder would break."""
    if own.keys() != new.keys():
        raise ValueError(f"{codec_dir}: another codec layout than the voice's (different tensors)")
    changed = sorted(k for k in own if not _decoder_side(k) and not torch.equal(own[k], new[k]))
    if changed:
        raise ValueError(f"{codec_dir}: its encoder differs from the voice's ({changed[0]}, ...), so {consequence}; "
                         "fine-tune with --freeze-encoder")


def _decoder_side(key: str) -> bool:
    """Whether a codec tensor belongs to its decoder side (the codes' embedding and the decoder), not
    to the encoder that makes the codes."""
    from pcgtts.train.codec import ENCODER_PARTS

    return key.split(".")[0] not in ENCODER_PARTS


def add_clone_codec(pack_dir: str | Path, codec_dir: str | Path) -> None:
    """Put a second codec (an X-codec2 folder, Hugging Face format: a lab `codec/export`) into a committed
    voice, as the decoder of speech in voices with a reference (`ModelPaths.clone_codec`); the voice's
    own codec keeps decoding its own voice. Its encoder must be the voice's, to fp16 (same codes), and
    its tensors the voice codec's; only its decoder side is stored. Refused before the voice is touched."""
    from safetensors.torch import load_file, save_file

    pack, codec_dir = Path(pack_dir), Path(codec_dir)
    meta = read_voice(pack, files=("codec.safetensors",))
    if not (codec_dir / "model.safetensors").is_file() or not (codec_dir / "config.json").is_file():
        raise ValueError(f"{codec_dir}: not an X-codec2 folder (no model.safetensors and config.json)")
    new = {k: v.to(torch.float16) for k, v in load_file(str(codec_dir / "model.safetensors")).items()}
    check_same_encoder(load_file(str(pack / "codec.safetensors")), new, codec_dir,
                       "it would not decode the codes the voice's encoder makes")
    tmp = pack / f"{CLONE_CODEC_FILE}.tmp"
    save_file({k: v.contiguous() for k, v in new.items() if _decoder_side(k)}, str(tmp))
    tmp.chmod(0o644)
    tmp.replace(pack / CLONE_CODEC_FILE)
    meta["clone_codec"] = {"config": json.loads((codec_dir / "config.json").read_text()), "encoder": "codec"}
    meta["sha256"][CLONE_CODEC_FILE] = file_sha256(pack / CLONE_CODEC_FILE)
    _write_meta(pack, meta)


def _expand_clone_codec(pack: Path, meta: dict, out: Path) -> Path:
    """The voice's clone codec as a Hugging Face X-codec2 folder: its decoder side with the codec's encoder."""
    from safetensors.torch import load_file, save_file

    state = {k: v for k, v in load_file(str(pack / "codec.safetensors")).items() if not _decoder_side(k)}
    state.update(load_file(str(pack / CLONE_CODEC_FILE)))
    out.mkdir()
    (out / "config.json").write_text(json.dumps(meta["clone_codec"]["config"], indent=2))
    save_file({k: v.float() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


CLONE_TARGET_FILE = "clone_target.safetensors"


def add_clone_target(pack_dir: str | Path, target_dir: str | Path) -> None:
    """Put a second target LM (a lab `lm` folder, or the target of another voice folder: a multi-speaker
    model that follows voice prompts) into a
    committed voice, as the LM that speaks voices with a reference (`ModelPaths.clone_target`); the voice's
    own target keeps speaking its own voice. Its speech-vocabulary layout must be the target's (it is
    expanded with the target's tokenizer); its size may differ. Refused before the voice is touched."""
    pack, folder = Path(pack_dir), Path(target_dir)
    meta = read_voice(pack, files=("target.safetensors",))
    from_voice = (folder / "voice.json").is_file()  # another committed voice: its target, as it is
    if not from_voice and not (folder / "checkpoint.pt").is_file():
        raise ValueError(f"{folder}: neither a lab LM folder (checkpoint.pt; `pcgtts train lm` makes one) nor a "
                         "voice folder (voice.json)")
    tmp = pack / f"{CLONE_TARGET_FILE}.tmp"
    try:
        if from_voice:
            entry = read_voice(folder, files=("target.safetensors",))["target"]
            shutil.copyfile(folder / "target.safetensors", tmp)
        else:
            entry = _write_lm("target", folder, tmp)
        _speech_layout(pack / "target.safetensors").check_same_layout(
            _speech_layout(tmp, folder), "voice's target", f"clone target ({folder})")
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(pack / CLONE_TARGET_FILE)
    meta["clone_target"] = entry
    meta["sha256"][CLONE_TARGET_FILE] = file_sha256(pack / CLONE_TARGET_FILE)
    _write_meta(pack, meta)


def _speech_layout(path: Path, source: Path | None = None):
    """The speech-vocabulary layout (`SpeechVocab`) a factorised LM file expands to: the lab tokenizer's
    control tokens, its text rows, then levels ** digits speech tokens (read from the header)."""
    import dataclasses

    from safetensors import safe_open

    from pcgtts.train.lm import lab_tokenizer, speech_vocab

    with safe_open(str(path), framework="pt") as f:
        if not {"text", "digits"} <= set(f.keys()):
            raise ValueError(f"{source or path}: not a factorised lab LM (no text and digit rows)")
        text, digits = f.get_slice("text").get_shape(), f.get_slice("digits").get_shape()
    num = digits[1] ** digits[0]
    return dataclasses.replace(speech_vocab(lab_tokenizer()), speech_offset=text[0], num_speech=num,
                               vocab_size=text[0] + num)


def set_presets(pack_dir: str | Path, folder: str | Path) -> None:
    """Replace a committed voice's preset voices (its `voices/` folder) with those in `folder`
    (voices.json + .voice files, checked first), recording each file's sha256 in voice.json."""
    from pcgtts.runtime.audio.presets import INDEX, Presets

    pack, folder = Path(pack_dir), Path(folder)
    meta = read_voice(pack, files=())
    presets = Presets.load(folder)
    if not presets.voices:
        raise ValueError(f"{folder}: no preset voices (no {INDEX})")
    files = [INDEX] + [p.file for p in presets.voices if p.file is not None]  # transform presets have none
    staging = pack / "voices.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    for name in files:
        shutil.copyfile(folder / name, staging / name)
    shutil.rmtree(pack / "voices", ignore_errors=True)
    staging.rename(pack / "voices")
    meta["sha256"] = {k: v for k, v in meta["sha256"].items() if not k.startswith("voices/")}
    meta["sha256"].update({f"voices/{name}": file_sha256(pack / "voices" / name) for name in files})
    _write_meta(pack, meta)


def set_settings(pack_dir: str | Path, settings: dict) -> None:
    """Record what a committed voice is played at when the user names none (voice.json "settings",
    read by `builtin.voice_settings`), checked first; {} removes them."""
    from pcgtts.runtime.voicepack import check_voice_settings

    pack = Path(pack_dir)
    meta = read_voice(pack, files=())
    meta.pop("settings", None)
    if check_voice_settings(dict(settings), pack / "voice.json"):
        meta["settings"] = dict(settings)
    _write_meta(pack, meta)


def set_group_size(pack_dir: str | Path, mean_size: int, cap: int | None = None) -> None:
    """Set the mean size (and cap) of the group table a committed voice builds when it is expanded
    (voice.json "groups"); θ is chosen for the size on the target then. A changed voice.json is
    expanded afresh (`builtin.trained_voice` keys its cache by the file's digest)."""
    pack = Path(pack_dir)
    meta = read_voice(pack, files=())
    meta["groups"] = _group_spec(mean_size, meta["groups"]["cap"] if cap is None else cap)
    _write_meta(pack, meta)


SHIPPED_TABLE = "groups.pcg.xz"  # the target's group table, as expansion builds it, compressed


def ship_group_table(pack_dir: str | Path, table: str | Path) -> None:
    """Ship `table` (the group table `expand_voice` built for this voice) in the voice folder, xz-compressed
    and checksummed: later expansions copy it instead of building it (a minute and more on a 2-core CPU).
    A changed group size (`set_group_size`) or target (`replace_lm`) no longer uses it."""
    import lzma

    pack = Path(pack_dir)
    meta = read_voice(pack, files=())
    tmp = pack / f"{SHIPPED_TABLE}.tmp"
    tmp.write_bytes(lzma.compress(Path(table).read_bytes(), preset=9))
    tmp.replace(pack / SHIPPED_TABLE)
    meta["sha256"][SHIPPED_TABLE] = file_sha256(pack / SHIPPED_TABLE)
    meta["groups"] = {**meta["groups"], "table": SHIPPED_TABLE}
    _write_meta(pack, meta)


def _shipped_table(pack: Path, meta: dict, fingerprint: str, dst: Path) -> bool:
    """Write the voice's shipped group table to `dst` when voice.json names it and it was built for this
    target at this cap (its checksum was checked by `read_voice`); False (nothing written) otherwise."""
    import lzma

    from pcgtts.groups.table import GroupTable

    name = meta["groups"].get("table")
    if name is None:
        return False
    dst.write_bytes(lzma.decompress((pack / name).read_bytes()))
    table = GroupTable.load(dst)
    if table.fingerprint == fingerprint and table.top_k == meta["groups"]["cap"]:
        return True
    log.warning("%s: the shipped group table was built for another target or cap; building it again", pack)
    dst.unlink()
    return False


def _group_spec(mean_size: int, cap: int) -> dict:
    if not (isinstance(cap, int) and cap >= 1):
        raise ValueError(f"group cap must be a positive integer, got {cap!r}")
    if not 1 <= mean_size <= cap:
        raise ValueError(f"mean group size must lie in [1, cap={cap}], got {mean_size!r}")
    return {"mean_size": mean_size, "cap": cap}


def _write_meta(pack: Path, meta: dict) -> None:
    tmp = pack / "voice.json.tmp"
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    tmp.replace(pack / "voice.json")


def _rekeyed_copy(src: Path, dst: Path, fingerprint: str) -> None:
    """Copy a heads / EAGLE draft file, its `target_fingerprint` metadata set to `fingerprint`."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src), framework="pt") as f:
        meta = dict(f.metadata() or {})
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors, str(dst), metadata={**meta, "target_fingerprint": fingerprint})


def add_to_voice(pack_dir: str | Path, src: str | Path, name: str) -> None:
    """Add (or replace) an optional file of a voice folder (heads, EAGLE draft) trained for its
    target, and record its sha256: for a committed voice whose lab folders are gone."""
    pack = Path(pack_dir)
    meta = read_voice(pack)
    shutil.copyfile(src, pack / name)
    meta["sha256"][name] = file_sha256(pack / name)
    _write_meta(pack, meta)


def _expand_lm(pack: Path, role: str, meta: dict, out: Path) -> Path:
    """A voice folder's LM `role` ("target", "draft", "clone_target": `<role>.safetensors`, its voice.json
    entry) as a plain tied LlamaForCausalLM with the lab tokenizer, in `out`."""
    from safetensors.torch import load_file

    from pcgtts.train.lm import LMModelConfig, build_model, lab_tokenizer, save_lm

    from transformers.initialization import no_init_weights

    tokenizer = lab_tokenizer()
    with no_init_weights():  # every weight is loaded or materialised below: a random draw first is wasted time
        model = build_model(LMModelConfig(**meta[role]["model_config"]), tokenizer, 0)
        model.load_state_dict({k: v.float() for k, v in load_file(str(pack / f"{role}.safetensors")).items()})
        save_lm(model, tokenizer, out)
    if role == "draft":
        cfg = json.loads((out / "config.json").read_text())
        cfg["pcgtts_draft"] = {"source": "built-in voice target", "layers": meta["draft"]["layers"]}
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def expand_lm(pack_dir: str | Path, role: str, out_dir: str | Path) -> Path:
    """One of a voice folder's LMs ("target" or "draft") expanded into the released layout at `out_dir`
    (no group table, codec or exports: what a training machine needs)."""
    if role not in ("target", "draft"):
        raise ValueError(f"role must be target or draft, got {role!r}")
    pack = Path(pack_dir)
    return _expand_lm(pack, role, read_voice(pack), Path(out_dir))


def expand_voice(pack_dir: str | Path, out_dir: str | Path, progress: bool = True) -> dict[str, Path]:
    """Expand a voice folder into {target, draft, codec, groups} (and clone_codec, clone_target when it
    has them) in `out_dir` (atomically)."""
    from safetensors.torch import load_file, save_file

    from pcgtts.groups.build import theta_for_mean_size
    from pcgtts.runtime.lm.checkpoint import load_speech_embeddings
    from pcgtts.export.group_table import build_groups_for_model

    pack, out = Path(pack_dir), Path(out_dir)
    meta = read_voice(pack)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    paths = {"target": _expand_lm(pack, "target", meta, tmp / "target"),
             "draft": _expand_lm(pack, "draft", meta, tmp / "draft")}
    if (pack / f"draft_{HEAD_CODES_FILE}").is_file():
        shutil.copyfile(pack / f"draft_{HEAD_CODES_FILE}", paths["draft"] / HEAD_CODES_FILE)
    codec = tmp / "codec"
    codec.mkdir()
    (codec / "config.json").write_text(json.dumps(meta["codec"]["config"], indent=2))
    save_file({k: v.float() for k, v in load_file(str(pack / "codec.safetensors")).items()},
              str(codec / "model.safetensors"), metadata={"format": "pt"})
    paths["codec"] = codec
    if "clone_codec" in meta:  # the second decoder, for voices with a reference
        paths["clone_codec"] = _expand_clone_codec(pack, meta, tmp / "clone_codec")
    if "clone_target" in meta:  # the second target, for voices with a reference (the target's tokenizer)
        paths["clone_target"] = _expand_lm(pack, "clone_target", meta, tmp / "clone_target")
    rows, _, fingerprint = load_speech_embeddings(paths["target"])
    for name in (HEADS_FILE, EAGLE_FILE):  # re-keyed to the expanded (fp32) target they were trained with
        if (pack / name).is_file():
            _rekeyed_copy(pack / name, paths["target"] / name, fingerprint)
    groups = meta["groups"]
    table_path = tmp / "groups.pcg"
    if not _shipped_table(pack, meta, fingerprint, table_path):
        theta = theta_for_mean_size(rows, groups["mean_size"], groups["cap"])
        log.warning("building the built-in voice's group table (θ %.3f for mean size %d; once)", theta,
                    groups["mean_size"])
        build_groups_for_model(paths["target"], theta, groups["cap"], progress=progress).save(table_path)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return {name: out / path.relative_to(tmp) for name, path in {**paths, "groups": table_path}.items()}


__all__ = ["pack_voice", "stage_voice", "install_staged", "record_gate", "add_to_voice", "replace_codec", "set_presets", "set_settings", "set_group_size", "read_voice", "expand_lm", "expand_voice", "add_clone_codec", "CLONE_CODEC_FILE", "add_clone_target", "CLONE_TARGET_FILE", "FORMAT", "VERSION"]
