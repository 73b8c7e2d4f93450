"""Atomic file writes: every file vramplan writes is written to a temporary file in the same
directory, flushed to disk, then renamed over the target, so an interrupted command leaves the old
file or the new one, never a truncated mix.

Temporary names carry the writer's process id (``.NAME.vramplan-PID-XXXX.tmp``): a file or
directory left by a process that was killed before its rename (``kill -9``, a power cut) is
removed by the next write into the same directory, while one of a live writer is left alone.
A set of files (``vramplan emit``) is staged in one temporary directory and moved into place as
a whole (:func:`write_files`), so a killed run leaves all of them or none.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import tempfile
from pathlib import Path

from .errors import SpecError

_STALE = re.compile(r"^\..+\.vramplan-(\d+)-[^/]*\.tmp$")


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def clean_stale(directory: str | os.PathLike) -> list[Path]:
    """Remove the temporary files and staging directories that dead vramplan processes left in
    ``directory``; return what was removed."""
    removed = []
    try:
        entries = list(Path(directory).iterdir())
    except OSError:
        return removed
    for entry in entries:
        m = _STALE.match(entry.name)
        if not m or _alive(int(m.group(1))):
            continue
        try:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
            removed.append(entry)
        except OSError:
            pass
    return removed


def _temp_prefix(name: str) -> str:
    return f".{name}.vramplan-{os.getpid()}-"


def refuse_existing(path: str | os.PathLike, force: bool, flag: str) -> None:
    """A SpecError when ``path`` exists and ``force`` is not given (``flag`` names the option)."""
    p = Path(path)
    if p.is_dir():
        raise SpecError(f"{flag} {path}: is a directory")
    if p.exists() and not force:
        raise SpecError(f"{flag} {path} exists; pass --force to overwrite it")


def atomic_write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` atomically (temp file + fsync + rename); return the path."""
    return atomic_write_bytes(path, text.encode(encoding))


def _new_mode(target: Path) -> int:
    if target.exists():
        return target.stat().st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _write_fsync(fd: int, data: bytes) -> None:
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    target = Path(path)
    directory = target.parent if str(target.parent) else Path(".")
    directory.mkdir(parents=True, exist_ok=True)
    clean_stale(directory)
    fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(target.name), suffix=".tmp", dir=directory)
    try:
        _write_fsync(fd, data)
        os.chmod(tmp, _new_mode(target))
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return target


# ----------------------------------------------------------------------------------------------
# A set of files, moved into place as a whole

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    rc = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    return rc == 0


def write_files(out_dir: str | os.PathLike, files: dict[str, bytes], executable: frozenset[str] = frozenset()
                ) -> list[Path]:
    """Write ``files`` (name -> bytes) into ``out_dir`` as one step: they are staged in a
    temporary directory next to it and moved into place together, so an interrupted write leaves
    ``out_dir`` as it was or with every file. Other files already in ``out_dir`` stay (the caller
    decides whether a non-empty directory may be written: ``--force``)."""
    out = Path(out_dir)
    parent = out.parent if str(out.parent) else Path(".")
    parent.mkdir(parents=True, exist_ok=True)
    clean_stale(parent)
    stage = Path(tempfile.mkdtemp(prefix=_temp_prefix(out.name), suffix=".tmp", dir=parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        for name, data in files.items():
            path = stage / name
            _write_fsync(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), data)
            os.chmod(path, (0o777 if name in executable else 0o666) & ~umask)
        os.chmod(stage, 0o777 & ~umask)
        if not out.exists():
            os.rename(stage, out)
        elif out.is_dir() and not any(out.iterdir()):
            os.rename(stage, out)  # POSIX: replaces an empty directory
        else:
            _merge_into(stage, out, files)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return [out / name for name in files]


def _merge_into(stage: Path, out: Path, files: dict[str, bytes]) -> None:
    """Into a non-empty ``out``: the other plain files are hard-linked into the stage and the two
    directories swapped atomically; where that is impossible (subdirectories, another file system,
    no renameat2) the files are replaced one by one, each atomically."""
    others = [e for e in out.iterdir() if e.name not in files]
    if all(e.is_file() and not e.is_symlink() for e in others):
        try:
            for e in others:
                os.link(e, stage / e.name)
            os.chmod(stage, out.stat().st_mode & 0o7777)
            if _exchange(stage, out):
                shutil.rmtree(stage, ignore_errors=True)  # now the old directory
                return
        except OSError:
            pass
        for e in others:  # undo the links, then fall back
            try:
                (stage / e.name).unlink()
            except FileNotFoundError:
                pass
    for name in files:
        os.replace(stage / name, out / name)
    shutil.rmtree(stage, ignore_errors=True)


# ----------------------------------------------------------------------------------------------
# Temporary directories of measurement runs

_STALE_TEMP_DIR = re.compile(r"^vramplan-[a-z]+-(\d+)-")


def make_temp_dir(kind: str) -> Path:
    """A new ``$TMPDIR/vramplan-KIND-PID-XXXX`` directory; the ones dead processes left (a
    ``kill -9`` skips every cleanup) are removed first."""
    root = Path(tempfile.gettempdir())
    try:
        for entry in root.iterdir():
            m = _STALE_TEMP_DIR.match(entry.name)
            if m and entry.is_dir() and not entry.is_symlink() and not _alive(int(m.group(1))):
                shutil.rmtree(entry, ignore_errors=True)
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix=f"vramplan-{kind}-{os.getpid()}-"))


class TempDir:
    """``with TempDir("scaled") as path:`` a :func:`make_temp_dir` directory removed on exit."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.path: Path | None = None

    def __enter__(self) -> str:
        self.path = make_temp_dir(self.kind)
        return str(self.path)

    def __exit__(self, *exc) -> None:
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
