"""The package's shape: public API, one-way dependencies, protocols, one settings resolution,
caller-owned step outputs, staged exports, deprecated flags."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# folder -> import name, as pyproject.toml maps them
FOLDERS = {"pcgtts": "pcgtts", "runtime": "pcgtts.runtime", "groups": "pcgtts.groups", "export": "pcgtts.export",
           "cli": "pcgtts.cli", "tools": "pcgtts.tools", "train": "pcgtts.train", "quality": "pcgtts.quality",
           "serve": "pcgtts.serve"}


def imports_of(folder: str) -> dict[str, set[str]]:
    """{module file: pcgtts modules it imports anywhere (top level or inside functions)}."""
    out = {}
    for path in sorted((ROOT / folder).glob("**/*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
        out[str(path.relative_to(ROOT))] = {n for n in names if n == "pcgtts" or n.startswith("pcgtts.")}
    return out


PUBLIC_API = ("import sys, pcgtts; from pcgtts import Synthesizer, AudioChunk, Voice, SynthesisConfig, DecodeConfig, "
              "StreamConfig, SamplingConfig, ModelPaths, DeviceConfig; "
              "assert pcgtts.__version__ and Synthesizer.__module__ == 'pcgtts.front'; print('ok')")
ALONE = ("pcgtts.groups", "pcgtts.groups.table", "pcgtts.groups.build", "pcgtts.runtime", "pcgtts.runtime.synthesizer",
         "pcgtts.export.onnx_lm", "pcgtts.cli", "pcgtts.tools.bench")


def _alone(name: str) -> str:
    """Code that imports `name` in a fresh interpreter and prints what of the runtime, CLI or tools a
    groups package pulled in (nothing, for any other package)."""
    return (f"import sys, {name}; "
            "bad = sorted(m for m in sys.modules if m.startswith(('pcgtts.runtime', 'pcgtts.cli', 'pcgtts.tools')))"
            f"; print(','.join(bad) if '{name}'.startswith('pcgtts.groups') else '')")


def test_the_public_api_and_each_package_import_in_a_fresh_interpreter():
    """The public names import from `pcgtts` alone; no import cycle: each package imports in a fresh
    interpreter; groups never pulls in the runtime. The interpreters run side by side (an import of
    torch each: ~2.5 s apiece one after another)."""
    codes = {"public API": PUBLIC_API} | {name: _alone(name) for name in ALONE}
    running = {name: subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True) for name, code in codes.items()}
    for name, process in running.items():
        out, err = process.communicate(timeout=120)
        assert process.returncode == 0, (name, err)
        assert out.strip() == ("ok" if name == "public API" else ""), f"{name} imported {out.strip()}"


def module_file(name: str) -> Path | None:
    """The file of pcgtts module `name` (a package's __init__.py), as pyproject.toml maps folders; None if none."""
    for folder, prefix in sorted(FOLDERS.items(), key=lambda item: -len(item[1])):
        if name == prefix or name.startswith(prefix + "."):
            rel = name[len(prefix):].lstrip(".").replace(".", "/")
            for path in (ROOT / folder / f"{rel}.py", ROOT / folder / rel / "__init__.py"):
                if rel and path.is_file() or not rel and path.name == "__init__.py" and path.is_file():
                    return path
            return None
    return None


def imports_reached(path: Path) -> set[str]:
    """The pcgtts modules a file imports (top level or inside functions, parents included)."""
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names
                         if module_file(f"{node.module}.{alias.name}") is not None)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    ours = {n for n in names if n == "pcgtts" or n.startswith("pcgtts.")}
    return {".".join(n.split(".")[:i]) for n in ours for i in range(2, n.count(".") + 2)}


def test_dependencies_point_one_way():
    """tools -> runtime -> groups: groups imports nothing of pcgtts; nothing the runtime reaches,
    following imports from module to module (inside functions too), is a tool, training or export code."""
    for path, names in imports_of("groups").items():
        assert all(n.startswith("pcgtts.groups") for n in names), (path, names)
    tools = tuple(FOLDERS[f] for f in ("cli", "tools", "train", "quality", "serve", "export"))
    start = {f"pcgtts.runtime.{p.relative_to(ROOT / 'runtime').with_suffix('').as_posix().replace('/', '.')}"
             .removesuffix(".__init__") for p in (ROOT / "runtime").glob("**/*.py")}
    reached, todo, via = set(), sorted(start), {}
    while todo:
        name = todo.pop()
        if name in reached:
            continue
        reached.add(name)
        path = module_file(name)
        for found in sorted(imports_reached(path) if path is not None else ()):
            via.setdefault(found, name)
            todo.append(found)
    bad = sorted(n for n in reached if n.startswith(tools))
    assert not bad, [f"{n} (imported by {via.get(n)})" for n in bad]
    assert all(n.startswith(("pcgtts.runtime", "pcgtts.groups")) for n in reached), sorted(reached)


def test_torch_backend_and_codec_satisfy_their_protocols(tiny_lm_factory, demo_codec_dir):
    from pcgtts.runtime.audio.codec import Codec, SpeechCodec
    from pcgtts.runtime.lm.loader import load_lm
    from pcgtts.runtime.lm.protocol import LM

    lm = load_lm(tiny_lm_factory(), max_length=64)
    assert isinstance(lm, LM) and lm.model_dir is not None and lm.tokenizer is not None
    codec = Codec.from_pretrained(demo_codec_dir)
    assert isinstance(codec, SpeechCodec) and codec.source_dir == Path(demo_codec_dir)
    assert codec.samples_per_token == 320 and codec.sample_rate == 16000 and not codec.can_encode
    with pytest.raises(ValueError, match="decode-only"):
        codec.encode(torch.zeros(320).numpy())


def test_step_outputs_are_owned_by_the_caller(tiny_lm_factory):
    """Two consecutive steps never share storage (the CUDA-graph path clones its static output;
    on CPU the eager path is held to the same contract)."""
    from pcgtts.runtime.lm.torch_lm import TorchLM

    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        lm = TorchLM.load(tiny_lm_factory(), device=device, max_length=64, graph_token_counts=(1, 4))
        lm.prefill(torch.tensor([1, 2, 3]))
        first = lm.forward(torch.tensor([5, 6, 7, 8]))
        kept = first.clone()
        second = lm.forward(torch.tensor([9, 10, 11, 12]))
        assert first.data_ptr() != second.data_ptr()
        assert torch.equal(first, kept), f"{device}: the second step overwrote the first step's logits"


def test_settings_precedence_explicit_over_file_over_default(tmp_path):
    from pcgtts.runtime.config import Settings, resolve_settings

    (tmp_path / "models").mkdir()
    config = tmp_path / "pcgtts.toml"
    config.write_text('[models]\ntarget = "models/t"\n[decode]\npolicy = "sd"\ndraft_length = 5\n'
                      '[sampling]\ntemperature = 0.5\n[stream]\ncodec_lookahead = 6\n[device]\ndtype = "bfloat16"\n')
    defaults = Settings()
    from_file = resolve_settings({}, config)
    assert from_file.synthesis.decode.policy == "sd" and from_file.synthesis.decode.draft_length == 5
    assert from_file.synthesis.decode.sampling.temperature == 0.5 and from_file.device.dtype == "bfloat16"
    assert from_file.synthesis.stream.codec_lookahead == 6
    assert from_file.models.target == str((tmp_path / "models" / "t").resolve())  # relative to the file
    assert from_file.synthesis.max_sentence_chars == defaults.synthesis.max_sentence_chars  # untouched: default
    both = resolve_settings({"policy": "ar", "temperature": None, "draft_length": 2}, config)
    assert both.synthesis.decode.policy == "ar" and both.synthesis.decode.draft_length == 2
    assert both.synthesis.decode.sampling.temperature == 0.5  # None = not given: the file's value stands
    assert resolve_settings({}).synthesis.decode.policy == defaults.synthesis.decode.policy == "pcg"


def test_the_built_in_voice_s_own_settings_sit_under_file_and_flags_and_leave_other_targets_alone(tmp_path):
    """voice.json's "settings" (e.g. the temperature a trained voice reads best at) are in force when
    no target is named, below a config file and the flags; a named target, in either, ignores them."""
    import json

    from pcgtts.builtin import voice_settings
    from pcgtts.runtime.config import resolve_settings

    assert voice_settings(tmp_path) == {}  # no voice shipped: nothing
    (tmp_path / "voice.json").write_text(json.dumps({"settings": {"temperature": 0.2}}))
    voice = voice_settings(tmp_path)
    temperature = lambda s: s.synthesis.decode.sampling.temperature  # noqa: E731
    assert temperature(resolve_settings({}, voice=voice)) == 0.2
    assert temperature(resolve_settings({"temperature": 0.6}, voice=voice)) == 0.6
    config = tmp_path / "pcgtts.toml"
    config.write_text("[sampling]\ntemperature = 0.5\n")
    assert temperature(resolve_settings({}, config, voice=voice)) == 0.5
    assert temperature(resolve_settings({"target": "elsewhere"}, voice=voice)) == 0.8  # another model: the default
    config.write_text('[models]\ntarget = "t"\n')
    assert temperature(resolve_settings({}, config, voice=voice)) == 0.8
    (tmp_path / "voice.json").write_text(json.dumps({"settings": {"codec": "x", "temperature": 0.2}}))
    with pytest.raises(ValueError, match="decoding and sampling settings only, not codec"):
        voice_settings(tmp_path)


def test_checks_across_fields_see_the_resolved_combination(tmp_path):
    """A dataclass is rebuilt once with every key that reaches it, whichever layer or order they come
    in: `steps_per_sync` needs `adaptive_draft` false, written before it in the file or given apart."""
    from pcgtts.runtime.config import resolve_settings

    config = tmp_path / "pcgtts.toml"
    config.write_text("[decode]\nsteps_per_sync = 8\nadaptive_draft = false\npolicy = \"sd\"\n")
    decode = resolve_settings({}, config).synthesis.decode
    assert (decode.steps_per_sync, decode.adaptive_draft, decode.policy) == (8, False, "sd")
    config.write_text("[decode]\nsteps_per_sync = 8\n")
    assert resolve_settings({"adaptive_draft": False}, config).synthesis.decode.steps_per_sync == 8
    with pytest.raises(ValueError, match="fixed draft length"):  # the final combination is still checked
        resolve_settings({"policy": "sd"}, config)


@pytest.mark.parametrize("text, message", [('polic = "sd"\n', "unknown setting 'polic'"),
                                           ('[stream]\npolicy = "sd"\n', r"belongs in \[decode\]"),
                                           ('[decode]\npolicy = "fast"\n', "policy must be one of"),
                                           ("policy = \n", "not a valid TOML")])
def test_bad_config_files_are_clear_errors(tmp_path, text, message):
    from pcgtts.runtime.config import resolve_settings

    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        resolve_settings({}, path)


def test_from_pretrained_takes_the_policy_from_the_config_file_and_validates_first(tmp_path, tiny_lm_factory,
                                                                                     demo_codec_dir):
    """Once a default overrode the file's policy; now the file's `sd` stands, and its missing draft
    is reported before anything loads."""
    from pcgtts import Synthesizer

    config = tmp_path / "c.toml"
    config.write_text(f'[models]\ntarget = "{tiny_lm_factory()}"\ncodec = "{demo_codec_dir}"\n[decode]\npolicy = "sd"\n')
    with pytest.raises(ValueError, match="policy 'sd' needs a draft"):
        Synthesizer.from_pretrained(config_file=config)
    synth = Synthesizer.from_pretrained(config_file=config, policy="ar", max_length=128)
    assert synth.config.decode.policy == "ar" and synth.draft is None and synth.target.max_length == 128
    with pytest.raises(ValueError, match="unknown setting 'lookahead'"):
        Synthesizer.from_pretrained(config_file=config, lookahead=3)


def test_cli_flags_resolve_through_the_same_function(tmp_path):
    from pcgtts.cli import build_parser
    from pcgtts.cli.commands import resolve_cli_settings

    config = tmp_path / "c.toml"
    config.write_text(f'target = "{tmp_path}"\npolicy = "sd"\ntemperature = 0.3\n')
    args = build_parser().parse_args(["speak", "hi", "--config", str(config), "--temperature", "0.9"])
    settings = resolve_cli_settings(args)
    assert settings.synthesis.decode.policy == "sd"  # from the file: no default overrides it
    assert settings.synthesis.decode.sampling.temperature == 0.9  # the flag wins


def test_deprecated_flags_still_work_and_warn(capsys):
    from pcgtts.cli import build_parser

    args = build_parser().parse_args(["groups", "build", "--target", "t", "--out", "o.pcg", "--device", "cuda"])
    assert args.compute_device == "cuda" and "--device is deprecated" in capsys.readouterr().err
    args = build_parser().parse_args(["speak", "hi", "--device", "null"])
    assert args.audio_device == "null" and "use --audio-device" in capsys.readouterr().err
    args = build_parser().parse_args(["bench", "--lookahead", "1,2"])
    assert args.draft_length == [1, 2]


def test_failed_or_interrupted_export_leaves_nothing_and_keeps_the_old_one(tmp_path):
    from pcgtts.export.onnx_common import staged_output

    out = tmp_path / "export"
    with staged_output(out) as stage:
        (stage / "graph.onnx").write_text("v1")
    assert (out / "graph.onnx").read_text() == "v1"
    with pytest.raises(RuntimeError):
        with staged_output(out) as stage:
            (stage / "graph.onnx").write_text("v2")
            raise RuntimeError("check failed")
    assert (out / "graph.onnx").read_text() == "v1" and sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_runtime_refuses_an_export_whose_check_failed(tmp_path, caplog):
    from pcgtts.runtime.lm.graph_meta import check_recorded

    failed = {"max_abs_diff": 0.5, "tolerance": 0.002, "ok": False}
    with pytest.raises(ValueError, match="failed its numeric check"):
        check_recorded(failed, tmp_path, force=False)
    check_recorded(failed, tmp_path, force=True)
    check_recorded({"ok": True}, tmp_path, force=False)
    check_recorded(None, tmp_path, force=False)
    assert "without a numeric check" in caplog.text
