"""What a release carries: every tracked file of each package folder reaches the wheel.

Each top-level folder installs as a sub-package (`runtime/` is `pcgtts.runtime`, ...; pyproject's
`package-dir`), and only `packages` plus `package-data` ship: a data file the patterns miss (the
preset voices under `pcgtts/voice/voices/`, `train/presets.json`) is present in a checkout and absent
from site-packages, where the built-in voice then fails to load. The fast tests read pyproject and
`git ls-files`: every folder with tracked Python is a listed package, and every other tracked file
in a package folder is matched by its package's patterns (the glob rules setuptools applies, `**`
included). The slow test builds the source distribution, a wheel from it and a wheel straight from
a copy of the tracked files, and checks that both wheels hold exactly the tracked files.
"""

from __future__ import annotations

import fnmatch
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parents[1]


def setuptools_config(pyproject: Path = ROOT / "pyproject.toml") -> dict:
    return tomllib.loads(pyproject.read_text(encoding="utf-8"))["tool"]["setuptools"]


def tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    return [name for name in out.splitlines() if (ROOT / name).is_file()]


def package_dirs(config: dict) -> dict[str, str]:
    """Each listed package's folder in the checkout, as setuptools resolves `package-dir`."""
    mapping = config.get("package-dir", {})
    dirs = {}
    for package in config["packages"]:
        parts = package.split(".")
        for cut in range(len(parts), -1, -1):
            base = ".".join(parts[:cut])
            if base in mapping:
                folder = PurePosixPath(mapping[base], *parts[cut:]) if mapping[base] else PurePosixPath(*parts[cut:])
                break
        else:
            folder = PurePosixPath(*parts)
        dirs[package] = str(folder)
    return dirs


def owning_package(path: str, dirs: dict[str, str]) -> str | None:
    """The deepest listed package whose folder holds `path`, or None."""
    parents = {str(p) for p in PurePosixPath(path).parents}
    owners = [package for package, folder in dirs.items() if folder in parents]
    return max(owners, key=lambda package: len(dirs[package]), default=None)


def _segment_matches(pattern: str, name: str) -> bool:
    if name.startswith(".") and not pattern.startswith("."):
        return False  # glob's `*` skips hidden names
    return fnmatch.fnmatchcase(name, pattern)


def glob_matches(pattern: str, path: str) -> bool:
    """`path` (relative, `/`-separated) is matched by a recursive glob `pattern`, as glob.glob sees it."""

    def match(pats: list[str], parts: list[str]) -> bool:
        if not pats:
            return not parts
        if pats[0] == "**":
            return match(pats[1:], parts) or (
                bool(parts) and not parts[0].startswith(".") and match(pats, parts[1:]))
        return bool(parts) and _segment_matches(pats[0], parts[0]) and match(pats[1:], parts[1:])

    return match(pattern.split("/"), path.split("/"))


def shipped_as_data(path: str, config: dict) -> bool:
    """A non-Python file in a package folder is matched by that package's package-data patterns."""
    dirs = package_dirs(config)
    package = owning_package(path, dirs)
    if package is None:
        return False
    data = config.get("package-data", {})
    excluded = config.get("exclude-package-data", {})
    relative = str(PurePosixPath(path).relative_to(dirs[package]))
    patterns = data.get(package, []) + data.get("*", []) + data.get("", [])
    exclusions = excluded.get(package, []) + excluded.get("*", []) + excluded.get("", [])
    return (any(glob_matches(p, relative) for p in patterns)
            and not any(glob_matches(p, relative) for p in exclusions))


def package_folder_files(config: dict) -> list[str]:
    """Tracked files inside some package's folder (bytecode aside)."""
    dirs = package_dirs(config)
    return [name for name in tracked_files()
            if owning_package(name, dirs) is not None and not name.endswith((".pyc", ".pyo"))]


def installed_path(path: str, config: dict) -> str:
    """Where a file of a package folder lands in site-packages (`runtime/lm/x.py` -> `pcgtts/runtime/lm/x.py`)."""
    dirs = package_dirs(config)
    package = owning_package(path, dirs)
    relative = PurePosixPath(path).relative_to(dirs[package])
    return str(PurePosixPath(*package.split("."), relative))


def missing_data_files(config: dict) -> list[str]:
    return [name for name in package_folder_files(config)
            if not name.endswith(".py") and not shipped_as_data(name, config)]


# --- fast: pyproject against the tracked files ---


def test_the_glob_rules_match_as_setuptools_globs_do():
    assert glob_matches("voice/*", "voice/target.safetensors")
    assert not glob_matches("voice/*", "voice/voices/heart.voice")  # `*` stops at a folder
    assert glob_matches("voice/**/*", "voice/voices/heart.voice")
    assert glob_matches("voice/**/*", "voice/MODEL_CARD.md")  # `**` matches no folder too
    assert glob_matches("*.json", "presets.json") and not glob_matches("*.json", "sub/presets.json")
    assert not glob_matches("voice/*", "voice/.hidden")


def test_every_folder_with_tracked_python_is_a_listed_package():
    config = setuptools_config()
    dirs = package_dirs(config)
    listed = set(dirs.values())
    for package, folder in dirs.items():
        assert (ROOT / folder / "__init__.py").is_file(), f"{package}: {folder}/__init__.py is missing"
    python_folders = {str(PurePosixPath(name).parent) for name in package_folder_files(config) if name.endswith(".py")}
    assert python_folders, "no tracked Python found in the package folders"
    left_out = sorted(python_folders - listed)
    assert not left_out, f"folders with Python that no listed package installs (add them to `packages`): {left_out}"


def test_package_data_patterns_carry_every_tracked_data_file():
    config = setuptools_config()
    files = package_folder_files(config)
    assert "pcgtts/voice/voices/voices.json" in files and "train/presets.json" in files  # git ls-files worked
    missing = missing_data_files(config)
    assert not missing, ("tracked files a wheel would leave out (add a pattern to "
                         f"[tool.setuptools.package-data] in pyproject.toml): {missing}")


def test_the_patterns_carry_data_files_yet_to_come_and_nothing_outside_packages():
    config = setuptools_config()
    for path in ("pcgtts/voice/groups.pcg", "pcgtts/voice/voices/new-voice.voice", "pcgtts/voice/voices/voices.json",
                 "pcgtts/voice/MODEL_CARD.md", "train/presets.json", "quality/testset_v1.json"):
        assert shipped_as_data(path, config), path
    assert not shipped_as_data("tests/data.json", config)  # not a package folder
    assert not shipped_as_data("runtime/notes.txt", config)  # a folder without patterns


def test_the_old_patterns_are_caught_leaving_the_preset_voices_out():
    old = dict(setuptools_config())
    old["package-data"] = {"pcgtts.quality": ["*.json"], "pcgtts": ["voice/*"]}
    missing = missing_data_files(old)
    assert "pcgtts/voice/voices/voices.json" in missing and "train/presets.json" in missing
    assert "pcgtts/voice/target.safetensors" not in missing


def test_the_base_install_speaks_on_a_cpu_and_dev_holds_the_test_tools():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]

    def names(requirements: list[str]) -> set[str]:
        return {req.split(";")[0].split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip().lower()
                for req in requirements}

    base = names(project["dependencies"])
    assert {"torch", "transformers", "safetensors", "tokenizers", "numpy", "soundfile", "sounddevice", "soxr",
            "onnx", "onnxruntime", "onnxscript"} <= base
    extras = project["optional-dependencies"]
    assert {"onnx", "audio", "serve", "eval", "lab", "gpu", "tensorrt", "docs", "bench", "ray", "dev"} <= set(extras)
    dev = extras["dev"]
    assert {"build", "pytest"} <= names(dev)
    included = {extra for req in dev if req.startswith("pcgtts[") for extra in req[7:req.index("]")].split(",")}
    assert {"serve", "eval", "lab", "docs", "bench", "ray"} <= included


# --- slow: build the distributions and read what they hold ---


def _build(args: list[str], cwd: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "build", "--no-isolation", *args], cwd=cwd,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def _wheel_files(folder: Path) -> set[str]:
    (wheel,) = folder.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        return {name for name in archive.namelist() if ".dist-info/" not in name}


@pytest.mark.slow
def test_the_wheels_built_directly_and_from_the_sdist_hold_exactly_the_tracked_files(tmp_path):
    pytest.importorskip("build")
    config = setuptools_config()
    src = tmp_path / "src"  # the tracked files only: what a release is built from
    for name in tracked_files():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    _build(["--outdir", str(tmp_path / "dist")], src)  # sdist, then a wheel from the sdist
    _build(["--wheel", "--outdir", str(tmp_path / "direct")], src)
    from_sdist, direct = _wheel_files(tmp_path / "dist"), _wheel_files(tmp_path / "direct")
    expected = {installed_path(name, config) for name in package_folder_files(config)}
    assert direct == expected, (f"left out: {sorted(expected - direct)}; "
                                f"not tracked: {sorted(direct - expected)}")
    assert from_sdist == direct, (f"only from the sdist: {sorted(from_sdist - direct)}; "
                                  f"only direct: {sorted(direct - from_sdist)}")
