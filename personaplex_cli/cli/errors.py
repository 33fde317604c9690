"""Where the app runs: every exception becomes one line on stderr and its exit status.

This is the one table from exceptions to messages and exit codes; no command handles its
own. Usage errors get one line and a hint (`Try 'personaplex encode -h'`), never a panel.
Ctrl-C (and SIGTERM) unwind the command, so atomic outputs remove their partial files; a
second Ctrl-C during that clean-up exits at once, quietly. One that comes while torch is
being imported is held until the import ends (HELD_IMPORTS).
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import traceback
from typing import Callable

import typer
from typer import _click

from .. import errors, outputs
from ..errors import PersonaplexError
from . import helptext
from .output import console


class Interrupted(BaseException):
    """Raised in the main thread by SIGINT or SIGTERM (a BaseException, like KeyboardInterrupt,
    so `except Exception` does not swallow it; unlike it, Typer does not turn it into a bare
    exit status before we can clean up and say why)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


_interrupted = False
_holding = False  # inside an import that an exception must not cross (HELD_IMPORTS)
_held: int | None = None  # the signal that came meanwhile, acted on once the import ends

# Imports whose modules call into C++ that calls back into Python: an exception raised by a
# signal handler there ends the process in std::terminate (SIGABRT, a C++ trace on stderr)
# instead of unwinding. torch's takes 1.5-2.5 s, from a command's first second on.
HELD_IMPORTS = ("torch",)


def _on_signal(signum: int, frame) -> None:
    global _interrupted, _held
    if _interrupted:
        # Second press: the first is still unwinding (or stuck). Leave now, quietly, with
        # nothing half-written behind.
        outputs.remove_partial_outputs()
        os._exit(128 + signum)
    _interrupted = True
    if _holding:
        _held = signum
        return
    raise Interrupted(signum)


class _HoldingLoader:
    """A module loader whose module runs with a signal's Interrupted held until it has run."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        global _holding
        _holding = True
        try:
            self._loader.exec_module(module)
        finally:
            _holding = False
        if _held is not None:
            # Raising here would fail the import, and torch cannot be imported twice in one
            # process. So early in a command nothing but its partial outputs needs undoing:
            # they go, the one line is said, and the process ends as an interrupt ends it.
            outputs.remove_partial_outputs()
            status = exit_status(Interrupted(_held))
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)

    def __getattr__(self, name: str):
        return getattr(self._loader, name)  # resources, source: the real loader's


class _HoldInterruptsWhileImporting:
    """A meta path finder that hands HELD_IMPORTS' top-level modules a _HoldingLoader."""

    def find_spec(self, name: str, path=None, target=None):
        if name not in HELD_IMPORTS:
            return None
        from importlib.machinery import PathFinder

        spec = PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _HoldingLoader(spec.loader)
        return spec


def install_signal_handlers() -> None:
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _on_signal)
    if not any(isinstance(finder, _HoldInterruptsWhileImporting) for finder in sys.meta_path):
        sys.meta_path.insert(0, _HoldInterruptsWhileImporting())


# The command running (set as it starts), and what a GPU running out of memory suggests in
# it: options that command has (tests/test_errors.py holds each to its --help).
COMMAND: str | None = None
OUT_OF_MEMORY_HINTS = {
    "reply": "try --quantize int8 or int4, a smaller --batch-size, or --device cpu",
    "talk": "try --quantize int8 or int4, --graphs off, or --device cpu",
    "serve": "try a smaller --max-sessions, --quantize int8 or int4, or --device cpu",
    "doctor": "try --quantize int8 or int4, a smaller --size, or --device cpu",
    "encode": "try --device cpu",
    "decode": "try --device cpu",
}


def _say(message: str) -> None:
    console.print(f"personaplex: error: {message}", markup=False, soft_wrap=True)


def _usage(error: _click.exceptions.UsageError) -> int:
    ctx = error.ctx
    if isinstance(error, helptext.NoArguments):  # `personaplex reply`: how to call it
        _say("missing arguments")  # an error's one line first, as every other one has
        console.print(ctx.get_usage(), markup=False, soft_wrap=True)
    else:
        if isinstance(error, _click.exceptions.NoSuchOption) and error.possibilities:
            error.possibilities = _likely_meant(error.option_name, error.possibilities)
        _name_the_flag(error)
        message = " ".join(error.format_message().split())
        _say(message.replace("Value error, ", ""))
    if ctx is not None and not isinstance(error, _click.exceptions.NoArgsIsHelpError):
        help_option = (ctx.help_option_names or ["--help"])[0]
        console.print(f"Try '{ctx.command_path} {help_option}' for help.", markup=False,
                      soft_wrap=True)
    return errors.EXIT_USAGE


def _name_the_flag(error: _click.exceptions.UsageError) -> None:
    """A bad value given on the command line is blamed on its flag alone: Typer's hint
    also names the option's environment variable, which the user did not set here."""
    param, ctx = getattr(error, "param", None), error.ctx
    if (param is None or ctx is None or getattr(error, "param_hint", None) is not None
            or not getattr(param, "envvar", None) or not getattr(param, "opts", None)):
        return
    if ctx.get_parameter_source(param.name) == _click.core.ParameterSource.COMMANDLINE:
        error.param_hint = " / ".join(f"'{option}'" for option in param.opts)


def _likely_meant(typed: str, options: list[str]) -> list[str]:
    """The options a mistyped one was likely meant as: close in spelling (Click offers any
    within 0.6 of it, `--verbose` for `--bogus`), or begun by it (`--codes`)."""
    import difflib

    bare = typed.lstrip("-")
    return [option for option in options
            if difflib.SequenceMatcher(None, bare, option.lstrip("-")).ratio() >= 0.75
            or (len(bare) >= 2 and option.lstrip("-").startswith(bare))]


def _broken_pipe() -> int:
    # Whoever read our stdout has gone (`| head`): say nothing more on it.
    try:
        sys.stdout = None  # type: ignore[assignment]
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    except OSError:
        pass
    return errors.EXIT_BROKEN_PIPE


def exit_status(error: BaseException) -> int:
    """Reports `error` on stderr (one line) and returns the exit status it ends in."""
    from .output import VERBOSITY

    if isinstance(error, PersonaplexError):
        _say(error.message)
        return error.exit_code
    if isinstance(error, _click.exceptions.NoArgsIsHelpError):
        return errors.EXIT_USAGE  # the help was printed, as asked
    if isinstance(error, _click.exceptions.UsageError):
        return _usage(error)
    if isinstance(error, typer.Exit):
        return error.exit_code
    if isinstance(error, SystemExit):
        # Typer answers a broken stdout pipe with sys.exit(1); the pipe is the real story.
        cause = error.__context__
        if isinstance(cause, OSError) and cause.errno == errno.EPIPE:
            return _broken_pipe()
        return error.code if isinstance(error.code, int) else errors.EXIT_FAILURE
    if isinstance(error, (Interrupted, KeyboardInterrupt, typer.Abort)):
        signum = getattr(error, "signum", signal.SIGINT)
        _say("interrupted" if signum == signal.SIGINT else "terminated")
        return 128 + signum
    if isinstance(error, BrokenPipeError):
        return _broken_pipe()
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        _say(f"no space left on the device{_where(error)}")
        return errors.EXIT_OUTPUT
    if type(error).__name__ == "OutOfMemoryError":  # torch.cuda's, without importing torch
        _say(f"the GPU ran out of memory; {OUT_OF_MEMORY_HINTS.get(COMMAND, 'free GPU memory')}")
        return errors.EXIT_DEVICE
    if type(error).__name__ == "CaptureError":  # core.graphs', with --graphs on
        _say(f"{error}; CUDA graphs could not be captured: try --graphs off")
        return errors.EXIT_DEVICE
    if isinstance(error, MemoryError):
        _say("out of memory")
        return errors.EXIT_FAILURE
    if isinstance(error, _click.exceptions.ClickException):
        _say(error.format_message())
        return error.exit_code
    # A bug: still one line, with what is needed to report it (-vv adds the traceback).
    if VERBOSITY >= 2:
        console.print("".join(traceback.format_exception(error)), markup=False,
                      soft_wrap=True, end="")
    _say(f"internal error: {type(error).__name__}: {error} "
         "(please report it; -vv shows the traceback)")
    return errors.EXIT_FAILURE


def _where(error: OSError) -> str:
    return f" ({error.filename})" if error.filename else ""


def run(command: Callable[[], object]) -> int:
    """Runs the Typer command (in non-standalone mode) -> the process's exit status."""
    try:
        result = command()
    except BaseException as error:  # noqa: B902 - this is the one place that maps them all
        return exit_status(error)
    return result if isinstance(result, int) else errors.EXIT_OK
