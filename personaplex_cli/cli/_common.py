"""What every command shares: options, the stderr console, errors -> exit codes, outputs.

Imports only typer, rich and the standard library: `--help` and shell completion run
through here and must stay fast.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Annotated, BinaryIO, Callable, Iterator

import typer
from rich.console import Console

from .. import errors
from ..errors import DeviceError, InputError, OutputError, PersonaplexError
from ..model.files import DEFAULT_MODEL  # noqa: F401  (stdlib-only module; shared by the commands)

console = Console(stderr=True, highlight=False)


_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def _check_device(value: str) -> str:
    if not _DEVICE_RE.match(value):
        raise typer.BadParameter("expected auto, cpu, cuda or cuda:N")
    return value


ModelOpt = Annotated[str, typer.Option(
    "--model", "-m", envvar="PERSONAPLEX_MODEL", metavar="REPO|DIR",
    help="Hugging Face repo id (from the local cache) or a model directory.")]
DeviceOpt = Annotated[str, typer.Option(
    "--device", envvar="PERSONAPLEX_DEVICE", metavar="auto|cpu|cuda[:N]",
    callback=_check_device, autocompletion=lambda: ["auto", "cpu", "cuda"],
    help="Compute device; auto picks CUDA when available.")]
OutputOpt = Annotated[str | None, typer.Option(
    "--output", "-o", metavar="OUT",
    help="Output file, or - for stdout (default: IN with the other suffix; stdout when IN "
    "is -).")]
ForceOpt = Annotated[bool, typer.Option("--force", "-f", help="Overwrite an existing output.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="Print errors only.")]
VerboseOpt = Annotated[int, typer.Option(
    "--verbose", "-v", count=True, help="Say more on stderr (repeatable).")]


class Reporter:
    """Status on stderr; progress bars only on an interactive stderr."""

    def __init__(self, quiet: bool, verbose: int):
        self.quiet = quiet
        self.verbose = verbose

    def info(self, message: str) -> None:
        if self.verbose and not self.quiet:
            console.print(message, markup=False)

    @contextlib.contextmanager
    def progress(self, description: str, total: float | None) -> Iterator[Callable[[float], None]]:
        if self.quiet or not console.is_terminal:
            yield lambda advance: None
            return
        from rich.progress import Progress

        with Progress(console=console, transient=True) as bar:
            task = bar.add_task(description, total=total)
            yield lambda advance: bar.advance(task, advance)


def handle_errors(command: Callable) -> Callable:
    """Turns user errors into one line on stderr and their exit code; never a traceback."""

    @functools.wraps(command)
    def run(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except PersonaplexError as error:
            _fail(error.message, error.exit_code)
        except BrokenPipeError:
            # Whoever read our stdout has gone (`| head`); say nothing more on it.
            with contextlib.suppress(OSError):
                sys.stdout = None  # type: ignore[assignment]
                os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
            raise typer.Exit(errors.EXIT_BROKEN_PIPE)
        except KeyboardInterrupt:
            _fail("interrupted", errors.EXIT_INTERRUPTED)
        except MemoryError:
            _fail("out of memory", errors.EXIT_FAILURE)
        except (typer.Exit, typer.Abort, typer.BadParameter, SystemExit):
            raise
        except Exception as error:  # a bug: still one line, with what is needed to report it
            _fail(f"internal error: {type(error).__name__}: {error}", errors.EXIT_FAILURE)

    return run


def _fail(message: str, code: int) -> None:
    console.print(f"personaplex: error: {message}", markup=False, soft_wrap=True)
    raise typer.Exit(code)


def default_output(input_path: str, suffix: str) -> str:
    """IN with another suffix; stdout when IN is stdin."""
    if input_path == "-":
        return "-"
    return str(Path(input_path).with_suffix(suffix))


def check_input(path: str) -> None:
    if path == "-":
        if sys.stdin is None or sys.stdin.isatty():
            raise InputError("no input: stdin is a terminal (pipe data in, or name a file)")
        return
    if not os.path.exists(path):
        raise InputError(f"{path}: no such file")
    if os.path.isdir(path):
        raise InputError(f"{path} is a directory")


def _same_file(a: str, b: Path) -> bool:
    with contextlib.suppress(OSError):
        return os.path.samefile(a, b)
    return False


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def open_output(path: str, *, force: bool, inputs: tuple[str, ...] = ()) -> Iterator[BinaryIO]:
    """Binary output, written atomically: a file appears whole or not at all.

    A regular file is written beside its target and renamed into place on success; on any
    failure the partial file is removed. `-` is stdout, refused when it is a terminal.
    """
    if path == "-":
        stdout = sys.stdout
        if stdout is None or stdout.isatty():
            raise OutputError("refusing to write binary data to a terminal; use -o FILE "
                              "or redirect stdout")
        yield stdout.buffer
        stdout.buffer.flush()
        return
    target = Path(path)
    if any(name != "-" and _same_file(name, target) for name in inputs):
        raise OutputError(f"{path} is also the input; refusing to overwrite it")
    if target.is_dir():
        raise OutputError(f"{path} is a directory")
    if target.exists() and not force:
        raise OutputError(f"{path} exists; use --force to overwrite it")
    try:
        fd, temp = tempfile.mkstemp(dir=target.parent if str(target.parent) else ".",
                                    prefix=f".{target.name}.", suffix=".part")
    except OSError as error:
        raise OutputError(f"cannot write {path}: {error.strerror or error}") from None
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


def resolve_device(name: str):
    """`auto|cpu|cuda[:N]` -> torch.device, or DeviceError when it is not there."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"{name} was requested but CUDA is not available here")
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise DeviceError(f"{name} was requested but there are only "
                              f"{torch.cuda.device_count()} CUDA devices")
    return device


def load_mimi(model: str, device_name: str, report: Reporter):
    """Resolves the model and loads its Mimi -> (mimi, weights sha256)."""
    from ..model.files import resolve_model
    from ..model.load import load_mimi as load

    device = resolve_device(device_name)
    model_dir = resolve_model(model)
    report.info(f"model: {model_dir.path}")
    report.info(f"device: {device}")
    return load(model_dir, device)
