"""`pcgtts serve` flags -> ServerConfig (validated before any model loads), and ServerConfig checks."""

from __future__ import annotations

import argparse

import pytest

from pcgtts.runtime.config import ModelPaths
from pcgtts.serve.config import ServerConfig


def serve_parser() -> argparse.ArgumentParser:
    from pcgtts.cli import serve as cli

    subparsers = argparse.ArgumentParser().add_subparsers(dest="command")
    cli.register(subparsers)
    return subparsers.choices["serve"]


def parse(*argv):
    return serve_parser().parse_args(argv)


def test_defaults_bind_loopback_and_use_the_builtin_voice(monkeypatch, tmp_path):
    from pcgtts.cli import serve as cli

    made = {"target": tmp_path / "t", "draft": tmp_path / "d", "codec": tmp_path / "c", "groups": tmp_path / "g.pcg"}
    monkeypatch.setattr("pcgtts.tools.demo.ensure_demo", lambda *a, **k: made)  # no 1-minute demo build here
    monkeypatch.delenv("PCGTTS_API_KEY", raising=False)
    args = parse()
    assert args.func is cli._serve
    config = cli.config_from_args(args)
    assert config.host == "127.0.0.1" and config.port == 8000 and config.api_key is None
    assert config.models == ModelPaths(**{k: str(v) for k, v in made.items()})  # resolved as `speak` does
    assert config.compute_device == "cpu" and config.policy == "pcg"


def test_flags_reach_the_config(tmp_path, monkeypatch):
    from pcgtts.cli import serve as cli

    monkeypatch.setenv("PCGTTS_API_KEY", "from-the-environment")
    target = tmp_path / "target"
    target.mkdir()
    args = parse("--port", "9001", "--workers", "3", "--queue-size", "0", "--request-timeout", "12.5",
                 "--target", str(target), "--policy", "ar", "--max-tokens", "77", "--sample-rate", "16000")
    config = cli.config_from_args(args)
    assert (config.port, config.workers, config.queue_size, config.request_timeout_s) == (9001, 3, 0, 12.5)
    assert config.models.target == str(target) and config.policy == "ar" and config.max_new_tokens == 77
    assert config.api_key == "from-the-environment" and config.sample_rate == 16000


def test_every_runtime_flag_reaches_the_workers(tmp_path):
    """Each model and device flag `serve` accepts is handed to the workers' Synthesizers (`--compile`,
    `--threads`, `--quantize` and `--eagle` / `--heads` / `--transitions` were once accepted and dropped)."""
    from pcgtts.cli import serve as cli

    (tmp_path / "target").mkdir()
    paths = {name: str(tmp_path / name) for name in ("draft", "codec", "clone_codec", "clone_target", "groups", "heads",
                                                      "transitions", "eagle", "presets")}
    flags = [f"--{name.replace('_', '-')}={path}" for name, path in paths.items()]
    settings = cli.config_from_args(parse("--target", str(tmp_path / "target"), *flags, "--backend", "torch",
                                          "--compile", "--threads", "1", "--max-length", "512")).runtime_settings()
    assert {k: settings[k] for k in paths} == paths
    assert (settings["compile"], settings["threads"], settings["backend"], settings["max_length"]) == (True, 1, "torch", 512)
    settings = cli.config_from_args(parse("--target", str(tmp_path / "target"), "--backend", "torch",
                                          "--quantize", "int8")).runtime_settings()
    assert settings["quantize"] == "int8" and settings["compile"] is False
    # --prepared resolves into the model paths above (tests/test_prepare.py: flags resolve to its models)
    runtime_flags = {"target", "prepared", "draft", "codec", "clone_codec", "clone_target", "groups", "heads", "transitions", "eagle", "presets", "policy",
                     "backend", "compute_device", "dtype", "quantize", "compile", "threads", "max_tokens", "max_length"}
    server_flags = {"host", "port", "workers", "max_batch", "queue_size", "request_timeout", "max_input_chars", "max_upload_bytes",
                    "max_upload_seconds", "api_key", "voices_dir", "sample_rate"}
    # a flag added to `serve` must be added to one of these sets, and the runtime ones checked above
    assert {a.dest for a in serve_parser()._actions} - {"help", "config"} == runtime_flags | server_flags



@pytest.mark.parametrize("argv, message", [
    (("--port", "70000"), "port"),
    (("--api-key", "short"), "api_key"),
    (("--sample-rate", "100"), "sample_rate"),
    (("--draft", "/x"), "without a target"),
])
def test_bad_flags_fail_before_models_load(argv, message, monkeypatch):
    from pcgtts.cli import serve as cli

    monkeypatch.setattr("pcgtts.tools.demo.ensure_demo", lambda *a, **k: pytest.fail("models were resolved"))
    with pytest.raises(ValueError, match=message):
        cli.config_from_args(parse(*argv))


def test_bad_numbers_are_argparse_errors():
    with pytest.raises(SystemExit):
        parse("--workers", "0")


@pytest.mark.parametrize("field, value", [("workers", 0), ("queue_size", -1), ("request_timeout_s", 0),
                                          ("max_input_chars", 0), ("max_upload_seconds", 31), ("policy", "fast"),
                                          ("host", "")])
def test_server_config_validates(field, value):
    with pytest.raises(ValueError, match=field.split("_s")[0] if field != "host" else "host"):
        ServerConfig(**{field: value})


def test_voice_names():
    from pcgtts.serve.voices import check_name

    for good in ("anna", "Bob_2", "x-y"):
        assert check_name(good) == good
    for bad in ("", "../a", "a/b", ".a", "a" * 65, "a b", "é"):
        with pytest.raises(ValueError):
            check_name(bad)
