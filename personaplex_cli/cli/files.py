"""Input and output paths as every command treats them.

`-` is stdin or stdout. A regular output file is written beside its target and renamed into
place at the end, so it appears whole or not at all; a failed or interrupted run removes its
partial file. Anything that is not a regular file (a device such as /dev/null, a FIFO,
/dev/stdout, a process substitution) is written directly and never replaced, and needs no
--force. Binary data never goes to a terminal, and an input is never overwritten.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import tempfile
from pathlib import Path
from typing import BinaryIO, Iterator

from ..errors import InputError, OutputError

STDIO = "-"
# Temp files of outputs not yet renamed into place: a second Ctrl-C removes them on its way out.
_partial: set[str] = set()


def remove_partial_outputs() -> None:
    for path in list(_partial):
        with contextlib.suppress(OSError):
            os.unlink(path)


def check_input(path: str) -> None:
    if path == STDIO:
        if sys.stdin is None or sys.stdin.isatty():
            raise InputError("no input: stdin is a terminal (pipe data in, or name a file)")
        return
    if not os.path.exists(path):
        raise InputError(f"{path}: no such file")
    if os.path.isdir(path):
        raise InputError(f"{path} is a directory")


def with_suffix(input_path: str, suffix: str) -> str:
    """IN with another suffix (`talk.wav`, `.mimi` -> `talk.mimi`); stdout when IN is stdin."""
    if input_path == STDIO:
        return STDIO
    return str(Path(input_path).with_suffix(suffix))


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


def _regular_target(path: str, *, force: bool, inputs: tuple[str, ...]) -> Path | None:
    """Refuses what no command writes to; -> the regular file to write (through a symbolic
    link, the file it points to), or None for stdout, a device or a FIFO (written as is)."""
    if path in _STDOUT:
        return None
    if any(name != STDIO and _same_file(name, Path(path)) for name in inputs):
        raise OutputError(f"{path} is also the input; refusing to overwrite it")
    if path.endswith("/") and not os.path.isdir(path):
        # `-o new/` names a folder that is not there: never a file called `new`.
        raise OutputError(f"cannot write {path}: no such directory")
    if _special(path):
        return None
    target = Path(os.path.realpath(path)) if os.path.islink(path) else Path(path)
    if target.is_dir():
        raise OutputError(f"{path} is a directory")
    if target.exists() and not force:
        raise OutputError(f"{path} exists; use --force to overwrite it")
    return target


def check_output(path: str, *, force: bool, inputs: tuple[str, ...] = (),
                 binary: bool = False) -> None:
    """Refuses, before any work starts (reply and talk load the model first), what
    `open_output` would refuse (with `binary`, a terminal as stdout too), and a new file
    in a folder it could not write into."""
    if path in _STDOUT:
        _check_stdout(binary)
        return
    target = _regular_target(path, force=force, inputs=inputs)
    if target is None or target.exists():
        return
    folder = target.parent if str(target.parent) else Path(".")
    if not folder.is_dir():
        raise OutputError(f"cannot write {path}: no such directory {folder}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write {path}: permission denied")


@contextlib.contextmanager
def open_output(path: str, *, force: bool, inputs: tuple[str, ...] = (),
                binary: bool = True) -> Iterator[BinaryIO]:
    """A byte stream to write: stdout for `-`, a device or FIFO as is, a regular file
    atomically. Only text (`binary=False`) may go to a terminal."""
    if path in _STDOUT:
        with _stdout(binary) as sink:
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
