"""Unpacking `voices.tgz` into `voices/` beside it, safely, atomically and once.

NVIDIA's code runs `tarfile.extractall(voices_tgz.parent)` and expects a `voices/` folder
to appear there. This module produces the same `voices/`, but:

- the whole member list is checked before anything is written: only regular files and
  folders are accepted; absolute names, `..` components, symbolic and hard links, device
  files and FIFOs are refused with `UnsafeArchiveError`, and every destination must stay
  inside the target (tarfile's `data` filter is applied as well, as a second line);
- members are extracted into a hidden temporary folder beside the target
  (`.voices.tmp-<pid>-…`), which is renamed to `voices/` only when complete, so an
  interrupted or refused extraction never leaves a partial `voices/`;
- a stamp inside the result records the archive (size, mtime, sha256) and the files
  written, so a second call with the same archive does nothing.

An archive whose members sit under a top-level `voices/` folder (NVIDIA's layout) gives
that folder; other top-level entries are checked but not extracted. An archive without a
`voices/` folder is taken to hold the voice files at its top level.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tarfile
import tempfile
import zlib
from pathlib import Path, PurePosixPath
from typing import Callable

from ..errors import DiskFullError, ModelInvalidError, OutputError, UnsafeArchiveError
from .digest import sha256_file

STAMP_NAME = ".personaplex-extracted.json"
_ROOT = "voices"


def extract_voices(archive: str | os.PathLike, target: str | os.PathLike | None = None, *,
                   report: Callable[[str], None] | None = None) -> Path:
    """Unpacks `archive` into `target` (default: `voices/` beside the archive) -> target.

    Does nothing when `target` already holds this archive's files (same stamp). A target
    extracted from another archive, or without a stamp, is replaced as a whole.
    """
    archive = Path(archive)
    target = Path(target) if target is not None else archive.parent / _ROOT
    say = report or (lambda message: None)
    try:
        info = archive.stat()
    except FileNotFoundError:
        raise ModelInvalidError(f"{archive} does not exist") from None
    if _is_current(target, archive, info):
        return target
    parent = target.parent
    remove_stale_temporaries(parent, target.name)
    try:
        tar = tarfile.open(archive, "r:*")
    except (tarfile.TarError, EOFError, zlib.error, OSError):
        # tarfile's text lists each method it tried with Python exception names: no help.
        raise ModelInvalidError(f"{archive.name} is not a readable tar archive (damaged, or "
                                "not a .tgz); download it again") from None
    tmp: Path | None = None
    try:
        with tar:
            try:
                members = tar.getmembers()
            except (tarfile.TarError, EOFError, zlib.error, OSError) as error:
                raise ModelInvalidError(
                    f"{archive.name} is damaged or truncated ({error})") from None
            chosen, root = _plan(members, archive.name)
            needed = sum(m.size for m in chosen if m.isreg())
            # The target may be in a cache that does not exist yet (a fresh machine).
            parent.mkdir(parents=True, exist_ok=True)
            _check_space(parent, needed, archive.name)
            tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{os.getpid()}-", dir=parent))
            payload = tmp / "x"
            payload.mkdir()
            digest = sha256_file(archive)
            try:
                tar.extractall(payload, members=chosen, filter="data")
            except tarfile.FilterError as error:
                raise UnsafeArchiveError(f"{archive.name} is refused: {error}") from None
            except (tarfile.TarError, EOFError, zlib.error) as error:
                raise ModelInvalidError(
                    f"{archive.name} is damaged or truncated ({error})") from None
        result = payload / root if root else payload
        files = sorted(
            (str(p.relative_to(result)), p.stat().st_size)
            for p in result.rglob("*") if p.is_file())
        stamp = {"archive": archive.name, "size": info.st_size, "mtime_ns": info.st_mtime_ns,
                 "sha256": digest, "files": files}
        (result / STAMP_NAME).write_text(json.dumps(stamp, indent=1) + "\n")
        if target.exists() or target.is_symlink():
            os.rename(target, tmp / "old")
        os.rename(result, target)
    except OSError as error:
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFullError(
                f"no space left on the disk of {parent} while unpacking {archive.name}; "
                "free some space and run the command again") from None
        raise OutputError(f"cannot unpack {archive.name} into {parent}: "
                          f"{error.strerror or error}") from None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    say(f"{archive.name}: unpacked {len(files)} files into {target}")
    return target


# -- checking members --------------------------------------------------------------------------

_KINDS = (
    (tarfile.TarInfo.issym, "a symbolic link"),
    (tarfile.TarInfo.islnk, "a hard link"),
    (tarfile.TarInfo.ischr, "a character device"),
    (tarfile.TarInfo.isblk, "a block device"),
    (tarfile.TarInfo.isfifo, "a FIFO"),
)


def _plan(members: list[tarfile.TarInfo], label: str) -> tuple[list[tarfile.TarInfo], str]:
    """Checks every member; -> (the members to extract, the root folder inside the archive)."""
    base = os.path.realpath(os.path.join(os.sep, "archive-root"))
    entries = []
    for member in members:
        name = member.name
        if not member.isreg() and not member.isdir():
            kind = next((text for test, text in _KINDS if test(member)), "not a regular file")
            raise UnsafeArchiveError(f"{label} is refused: member {name!r} is {kind}")
        if not name or "\x00" in name or "\\" in name:
            raise UnsafeArchiveError(f"{label} is refused: member name {name!r} is not allowed")
        if name.startswith("/") or PurePosixPath(name).is_absolute():
            raise UnsafeArchiveError(f"{label} is refused: member {name!r} has an absolute path")
        parts = [p for p in name.split("/") if p not in ("", ".")]
        if ".." in parts:
            raise UnsafeArchiveError(f"{label} is refused: member {name!r} contains '..'")
        if not parts:
            if member.isdir():
                continue  # "./" itself
            raise UnsafeArchiveError(f"{label} is refused: member name {name!r} is not allowed")
        landing = os.path.realpath(os.path.join(base, *parts))
        if os.path.commonpath([base, landing]) != base or landing == base:
            raise UnsafeArchiveError(f"{label} is refused: member {name!r} would land outside "
                                     "the voices folder")
        entries.append((member, parts))
    has_root = any(parts[0] == _ROOT and (len(parts) > 1 or member.isdir())
                   for member, parts in entries)
    if any(parts == [_ROOT] and not member.isdir() for member, parts in entries):
        raise ModelInvalidError(f"{label}: its 'voices' entry is not a folder")
    chosen = [member for member, parts in entries if not has_root or parts[0] == _ROOT]
    if not any(member.isreg() for member in chosen):
        raise ModelInvalidError(f"{label} holds no voice files")
    return chosen, (_ROOT if has_root else "")


# -- state -------------------------------------------------------------------------------------

def _read_stamp(target: Path) -> dict | None:
    try:
        stamp = json.loads((target / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return None
    return stamp if isinstance(stamp, dict) else None


def is_extracted(archive: str | os.PathLike, target: str | os.PathLike) -> bool:
    """Whether `target` holds a complete extraction of `archive`, one that `extract_voices`
    would leave as it is."""
    archive = Path(archive)
    try:
        info = archive.stat()
    except OSError:
        return False
    return _is_current(Path(target), archive, info)


def _is_current(target: Path, archive: Path, info: os.stat_result) -> bool:
    """Whether `target` holds a complete extraction of this archive (same size and mtime, or
    same sha256 when only the mtime changed) with all its files in place."""
    if target.is_symlink() or not target.is_dir():
        return False
    stamp = _read_stamp(target)
    if stamp is None or stamp.get("size") != info.st_size:
        return False
    try:
        for name, size in stamp.get("files", []):
            if (target / name).stat().st_size != size:
                return False
    except (OSError, TypeError, ValueError):
        return False
    if not stamp.get("files"):
        return False
    if stamp.get("mtime_ns") == info.st_mtime_ns:
        return True
    return stamp.get("sha256") == sha256_file(archive)


def _check_space(folder: Path, needed: int, label: str) -> None:
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return
    if needed > free:
        raise DiskFullError(
            f"not enough space on the disk of {folder} to unpack {label}: it needs "
            f"{format_size(needed)}, {format_size(free)} is free")


def remove_stale_temporaries(parent: Path, name: str) -> None:
    """Removes `.NAME.tmp-PID-*` folders left by extractions whose process is gone."""
    prefix = f".{name}.tmp-"
    try:
        leftovers = [p for p in parent.iterdir() if p.name.startswith(prefix)]
    except OSError:
        return
    for path in leftovers:
        pid_text = path.name[len(prefix):].split("-", 1)[0]
        if not pid_text.isdigit() or _alive(int(pid_text)):
            continue
        shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def format_size(n: int) -> str:
    """1234567 -> '1.2 MB' (decimal units, as huggingface_hub's progress bars)."""
    value = float(n)
    for unit in ("B", "kB", "MB", "GB"):
        if value < 1000:
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} TB"
