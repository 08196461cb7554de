"""Writing outputs without losing anything: a file appears under its real name only when complete.

    with atomic_output("out.wav") as tmp:
        write(tmp)            # an exception here leaves out.wav as it was and no temporary file behind

and where pcgtts keeps what it makes once per machine (`cache_root`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from pathlib import Path


def check_output_file(path: str | Path, flag: str = "--out") -> Path:
    """A clear ValueError, before any work, if `path` cannot be written as a file."""
    path = Path(path)
    _check_name(path, flag)
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a directory; give a file name")
    _check_folder(path.parent, path, flag)
    # Named as `atomic_output`'s temporary file will be: a name too long for it is refused here.
    _probe(path.parent, f".{path.name}.", ".partial" + path.suffix, path, flag)
    return path


def check_output_dir(path: str | Path, flag: str = "--out") -> Path:
    """Like `check_output_file` for an output folder (made if missing; its parent must be writable,
    or it, if it exists). Errors name `path`, never the probe's own name."""
    path = Path(path)
    _check_name(path, flag)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path} is a file; give a directory")
    if path.is_dir():
        _probe(path, ".pcgtts-", ".probe", path, flag)
        return path
    _check_folder(path.parent, path, flag)
    _probe(path.parent, ".pcgtts-", ".probe", path, flag)
    return path


def _check_name(path: Path, flag: str) -> None:
    """A path component longer than the file system allows, refused in words (not as the OSError
    that even asking whether it exists raises)."""
    for part in path.parts:
        if len(os.fsencode(part)) > 255:  # NAME_MAX of every common Linux file system
            raise ValueError(f"{flag} {path}: a name in it is longer than a file system allows (255 bytes)")


def _check_folder(folder: Path, path: Path, flag: str) -> None:
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{flag} {path}: {folder} is a file, not a folder")
    if not folder.is_dir():
        raise ValueError(f"{flag} {path}: folder {folder} does not exist")


def _probe(folder: Path, prefix: str, suffix: str, path: Path, flag: str) -> None:
    """Write and remove a temporary file in `folder`; an error names the user's `path`."""
    try:  # os.access says yes to root on a read-only file system: try for real
        fd, probe = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        if err.errno == errno.ENAMETOOLONG:
            raise ValueError(f"{flag} {path}: the name is longer than this file system allows") from None
        raise ValueError(f"{flag} {path}: cannot write in {folder} ({err.strerror or err})") from None


def default_mode(directory: bool = False) -> int:
    """The permissions a plain open()/mkdir() would give under the current umask (mkstemp and
    mkdtemp use 0600/0700, which must not leak into what the user gets)."""
    umask = os.umask(0)
    os.umask(umask)
    return (0o777 if directory else 0o666) & ~umask


def publish(tmp: str | Path, path: str | Path) -> None:
    """Move a finished temporary file over `path`, keeping an existing file's permissions."""
    path = Path(path)
    mode = path.stat().st_mode & 0o7777 if path.is_file() else default_mode()
    os.chmod(tmp, mode)
    os.replace(tmp, path)


@contextlib.contextmanager
def atomic_output(path: str | Path):
    """Yields a temporary path beside `path`; renamed to `path` on success, removed on failure."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial" + path.suffix, dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    publish(tmp, path)


def read_tagged_safetensors(path: str | Path, fmt: str, version: str, what: str, how_to_make: str
                            ) -> tuple[dict, dict]:
    """(tensors, metadata) of a safetensors file whose metadata names `fmt` / `version`; a clear
    FileNotFoundError (saying `how_to_make`) or ValueError (damaged file, other format) otherwise."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no {what} at {path} ({how_to_make})")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as err:  # safetensors raises its own error types for damaged files
        raise ValueError(f"{path}: not a readable safetensors file ({err})") from None
    if meta.get("format") != fmt or meta.get("version") != version:
        raise ValueError(f"{path}: not a pcgtts {what} (format {meta.get('format')!r}, version {meta.get('version')!r})")
    return tensors, meta


def cache_root() -> Path:
    """pcgtts's cache folder: `$PCGTTS_CACHE`, default ~/.cache/pcgtts (the built-in voice's expansion and
    exports, the demo models, built group tables, compiled packages)."""
    return Path(os.environ.get("PCGTTS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pcgtts"))
