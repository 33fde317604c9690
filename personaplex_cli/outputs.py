"""Input and output paths as every command treats them.

`-` is stdin or stdout. A regular output file is written beside its target and renamed into
place at the end, so it appears whole or not at all; a failed or interrupted run removes its
partial file. An output named by a URL (`s3://bucket/a.wav`, `file:///srv/a.wav`) goes
through fsspec, with whichever of its filesystems is installed for that scheme: it is
written to a local temporary file, copied beside its target and moved into place, so it too
appears whole or not at all. Anything that is not a regular file (a device such as /dev/null, a FIFO,
/dev/stdout, a process substitution) is written directly and never replaced, and needs no
--force. Binary data never goes to a terminal, and an input is never overwritten.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import stat
import sys
import tempfile
from pathlib import Path
from typing import BinaryIO, Iterator

from .errors import InputError, OutputError, PersonaplexError

STDIO = "-"
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
# Temp files of outputs not yet renamed into place: a second Ctrl-C removes them on its way out.
_partial: set[str] = set()
# Every file the running command reads (inputs, voices, prompt files, the manifest, the
# model's files): none of them is ever one of its outputs, whatever --force says.
_read: set[str] = set()


def reads(*paths: str | os.PathLike | None) -> None:
    """Notes files this run reads, so that no output of it replaces them."""
    for path in paths:
        if path is not None and str(path) not in ("", STDIO) and not is_url(str(path)):
            _read.add(str(path))


def reads_model(spec: str | None) -> None:
    """Notes the files of the model `spec` names (its voices/ too) as read by this run;
    a model that cannot be found is reported later, when it opens."""
    from .model.files import resolve_model

    try:
        folder = resolve_model(spec).path
    except PersonaplexError:
        return
    with contextlib.suppress(OSError):
        for found in folder.iterdir():
            if found.is_dir():
                with contextlib.suppress(OSError):
                    reads(*(voice for voice in found.iterdir() if voice.is_file()))
            else:
                reads(found)


def forget_reads() -> None:
    """A new command starts (in-process callers such as tests run several)."""
    _read.clear()


def remove_partial_outputs() -> None:
    for path in list(_partial):
        with contextlib.suppress(OSError):
            os.unlink(path)


def shown(path: str) -> str:
    """A path as a message names it: without its `x/..` and `./` (`man/../in/a.wav` is
    `in/a.wav`); a URL or `-` as given."""
    if path == STDIO or is_url(path):
        return path
    return os.path.normpath(path) + ("/" if path.endswith("/") else "")


def check_input(path: str) -> None:
    if path == STDIO:
        if sys.stdin is None or sys.stdin.isatty():
            raise InputError("no input: stdin is a terminal (pipe data in, or name a file)")
        return
    if not os.path.exists(path):
        raise InputError(f"{shown(path)}: no such file")
    if os.path.isdir(path):
        raise InputError(f"{shown(path)} is a directory")
    reads(path)


def is_url(path: str) -> bool:
    """A `scheme://...` name: an fsspec location, not a path of this machine."""
    return _URL.match(path) is not None


def with_suffix(input_path: str, suffix: str) -> str:
    """IN with another suffix (`talk.wav`, `.mimi` -> `talk.mimi`); stdout when IN is stdin."""
    if input_path == STDIO:
        return STDIO
    if is_url(input_path):  # a Path would fold its `//`
        return os.path.splitext(input_path)[0] + suffix
    return str(Path(input_path).with_suffix(suffix))


def output_exists(path: str) -> bool:
    """Whether the output file is there (a regular file, or an object at a URL)."""
    if is_url(path):
        fs, where = _url_filesystem(path)
        return fs.isfile(where)
    return path != STDIO and os.path.isfile(path)


def _same_file(a: str, b: Path) -> bool:
    with contextlib.suppress(OSError):
        return os.path.samefile(a, b)
    return False


_STDOUT = (STDIO, "/dev/stdout", "/dev/fd/1", "/proc/self/fd/1")  # written as stdout


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _special(path: str) -> bool:
    """True for outputs that must be written in place: devices, FIFOs, sockets, /dev, /proc."""
    if os.path.abspath(path).startswith(("/dev/", "/proc/")):
        return True
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False  # does not exist yet: a regular file will be created
    return not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)


def _check_stdout(binary: bool) -> None:
    if sys.stdout is None or (binary and sys.stdout.isatty()):
        raise OutputError("refusing to write binary data to a terminal; use -o FILE "
                          "or redirect stdout")


@contextlib.contextmanager
def _stdout(binary: bool) -> Iterator[BinaryIO]:
    _check_stdout(binary)
    stdout = sys.stdout
    yield stdout.buffer
    stdout.buffer.flush()


@contextlib.contextmanager
def _direct(path: str, binary: bool) -> Iterator[BinaryIO]:
    try:
        # No O_CREAT: what is not there (a mistyped /dev name) is not made a regular file.
        handle = os.fdopen(os.open(path, os.O_WRONLY), "wb")
    except OSError as error:
        raise OutputError(f"cannot write {path}: {error.strerror or error}") from None
    with handle:
        if binary and handle.isatty():
            raise OutputError(f"refusing to write binary data to the terminal {path}")
        yield handle


def _refuse_a_read_file(path: str, inputs: tuple[str, ...]) -> None:
    """An output that is a file this run reads (by another name too: a symbolic or a hard
    link, `./x`) is refused, even with --force: the run would destroy its own input."""
    for name in (*inputs, *sorted(_read)):
        if name != STDIO and _same_file(name, Path(path)):
            which = ("the input" if name in inputs else "read by this run"
                     if os.path.abspath(name) == os.path.abspath(path)
                     else f"read by this run (as {name})")
            raise OutputError(f"{path} is also {which}; refusing to overwrite it")


def _regular_target(path: str, *, force: bool, inputs: tuple[str, ...]) -> Path | None:
    """Refuses what no command writes to; -> the regular file to write (through a symbolic
    link, the file it points to), or None for stdout, a device or a FIFO (written as is)."""
    if path in _STDOUT:
        return None
    _refuse_a_read_file(path, inputs)
    if path.endswith("/") and not os.path.isdir(path):
        # `-o new/` names a folder that is not there: never a file called `new`.
        raise OutputError(f"cannot write {shown(path)}: no such directory")
    if _special(path):
        return None
    target = Path(os.path.realpath(path)) if os.path.islink(path) else Path(path)
    if target.is_dir():
        raise OutputError(f"{shown(path)} is a directory")
    if target.exists() and not force:
        raise OutputError(f"{shown(path)} exists; use --force to overwrite it")
    return target


def remove_stale_parts(path: str) -> int:
    """Removes what a writer of `path` killed outright (SIGKILL, a lost machine) left
    beside it: its temporary `.NAME.*.part` files -> how many. Only for a run that owns
    the output, once no writer of it is left."""
    if path in _STDOUT:
        return 0
    if is_url(path):
        import posixpath

        fs, where = _url_filesystem(path)
        parent, name = posixpath.split(where)
        stale = fs.glob(f"{parent}/.{glob.escape(name)}.*.part")
        for found in stale:
            with contextlib.suppress(OSError):
                fs.rm(found)
        return len(stale)
    target = Path(os.path.realpath(path))
    count = 0
    for found in target.parent.glob(f".{glob.escape(target.name)}.*.part"):
        with contextlib.suppress(OSError):
            found.unlink()
            count += 1
    return count


def check_output(path: str, *, force: bool, inputs: tuple[str, ...] = (),
                 binary: bool = False) -> None:
    """Refuses, before any work starts (reply and talk load the model first), what
    `open_output` would refuse (with `binary`, a terminal as stdout too), and a new file
    in a folder it could not write into."""
    if path in _STDOUT:
        _check_stdout(binary)
        return
    if is_url(path):
        _url_target(path, force=force)
        return
    target = _regular_target(path, force=force, inputs=inputs)
    if target is None or target.exists():
        return
    folder = target.parent if str(target.parent) else Path(".")
    if not folder.is_dir():
        raise OutputError(f"cannot write {shown(path)}: no such directory "
                          f"{shown(str(folder))}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write {shown(path)}: permission denied")


@contextlib.contextmanager
def open_output(path: str, *, force: bool, inputs: tuple[str, ...] = (),
                binary: bool = True) -> Iterator[BinaryIO]:
    """A byte stream to write: stdout for `-`, a device or FIFO as is, a regular file
    atomically. Only text (`binary=False`) may go to a terminal."""
    if path in _STDOUT:
        with _stdout(binary) as sink:
            yield sink
        return
    if is_url(path):
        with _url_output(path, force=force) as sink:
            yield sink
        return
    # Through a symbolic link, the file it points to is replaced, not the link.
    target = _regular_target(path, force=force, inputs=inputs)
    if target is None:
        with _direct(path, binary) as sink:
            yield sink
        return
    try:
        fd, temp = tempfile.mkstemp(dir=target.parent if str(target.parent) else ".",
                                    prefix=f".{target.name}.", suffix=".part")
    except OSError as error:
        raise OutputError(f"cannot write {path}: {error.strerror or error}") from None
    _partial.add(temp)
    handle = os.fdopen(fd, "w+b")
    try:
        yield handle
        handle.flush()
        os.fchmod(handle.fileno(), 0o666 & ~_umask())
        handle.close()
        os.replace(temp, target)
    except BaseException as error:
        handle.close()
        with contextlib.suppress(OSError):
            os.unlink(temp)
        if isinstance(error, OSError) and not isinstance(error, BrokenPipeError):
            raise OutputError(f"cannot write {path}: {error.strerror or error}") from None
        raise
    finally:
        _partial.discard(temp)


# -- outputs at fsspec URLs ------------------------------------------------------------------

def _url_filesystem(url: str):
    """(fsspec filesystem, path in it) of a URL; OutputError when no installed package
    knows its scheme."""
    try:
        from fsspec.core import url_to_fs
    except ImportError:
        raise OutputError(f"cannot write {url}: outputs at URLs need the fsspec package "
                          "(pip install fsspec)") from None
    try:
        return url_to_fs(url)
    except (ImportError, ValueError) as error:  # the scheme's package is not installed
        raise OutputError(f"cannot write {url}: {error}") from None


def _url_target(url: str, *, force: bool):
    fs, where = _url_filesystem(url)
    try:
        if fs.isdir(where):
            raise OutputError(f"{url} is a directory")
        if fs.exists(where) and not force:
            raise OutputError(f"{url} exists; use --force to overwrite it")
    except OSError as error:
        raise OutputError(f"cannot write {url}: {error.strerror or error}") from None
    return fs, where


@contextlib.contextmanager
def _url_output(url: str, *, force: bool) -> Iterator[BinaryIO]:
    """Written locally first (writers seek back to patch headers), then copied beside the
    target under a hidden name and moved into place: a move within one store is a rename
    (file, memory) or a whole-object copy (S3, GCS), so nobody sees a part of it."""
    import posixpath
    import uuid

    fs, where = _url_target(url, force=force)
    parent, name = posixpath.split(where)
    with tempfile.TemporaryFile(prefix=".personaplex-", suffix=".part") as handle:
        yield handle
        handle.flush()
        handle.seek(0)
        staged = f"{parent}/.{name}.{uuid.uuid4().hex[:8]}.part"
        try:
            fs.makedirs(parent, exist_ok=True)
            with fs.open(staged, "wb") as remote:
                while chunk := handle.read(1 << 20):
                    remote.write(chunk)
            fs.mv(staged, where)
        except BaseException as error:
            with contextlib.suppress(Exception):
                fs.rm(staged)
            if isinstance(error, OSError):
                raise OutputError(f"cannot write {url}: {error.strerror or error}") from None
            raise
