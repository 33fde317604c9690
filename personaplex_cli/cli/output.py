"""The output policy of every command: results on stdout, everything else on stderr.

Results are data (audio or code bytes, a path, JSON). Status, warnings, progress and errors
go to stderr, through one rich console: progress only on an interactive stderr and never
with --quiet; nothing is ever wrapped when stderr is a file or a pipe. Levels: -q errors
only; default warnings; -v what the command is doing; -vv details for a bug report.

Imports only rich and the standard library: `--help` and shell completion pass through here.
"""

from __future__ import annotations

import contextlib
import json
import sys
from typing import Any, Callable, Iterator

from rich.console import Console


def _stderr_console() -> Console:
    console = Console(stderr=True, highlight=False)
    if not console.is_terminal:
        # A log file or a pipe gets each message on one line, however long its paths.
        console.soft_wrap = True
    return console


console = _stderr_console()
VERBOSITY = 0  # of the command now running; the error report shows a traceback from 2 on


class Output:
    """One command's stdout results and stderr messages, by verbosity."""

    def __init__(self, quiet: bool = False, verbose: int = 0):
        global VERBOSITY
        self.quiet = quiet
        self.verbose = VERBOSITY = 0 if quiet else verbose

    # -- stderr ------------------------------------------------------------------------------

    def error(self, message: str) -> None:
        """One error among several (the error that ends the run is printed by cli.errors)."""
        console.print(f"personaplex: error: {message}", markup=False, soft_wrap=True)

    def warn(self, message: str) -> None:
        if not self.quiet:
            console.print(f"personaplex: warning: {message}", markup=False)

    def note(self, message: str) -> None:
        """What a user should see once (a hint, a reminder); silenced by --quiet."""
        if not self.quiet:
            console.print(message, markup=False)

    def info(self, message: str) -> None:
        """-v: what the command is doing (model, device, formats)."""
        if self.verbose >= 1:
            console.print(message, markup=False)

    def debug(self, message: str) -> None:
        """-vv: details for a bug report (timings, sizes, hashes)."""
        if self.verbose >= 2:
            console.print(message, markup=False)

    @property
    def interactive(self) -> bool:
        """Whether live status (bars, views) may be drawn on stderr."""
        return not self.quiet and console.is_terminal

    @contextlib.contextmanager
    def progress(self, description: str, total: float | None,
                 unit: str = "s") -> Iterator[Callable[[float], None]]:
        """A transient bar on an interactive stderr; elsewhere a no-op. Yields `advance(n)`."""
        if not self.interactive:
            yield lambda amount, rate="": None
            return
        from rich.progress import (BarColumn, Progress, TaskProgressColumn, TextColumn,
                                   TimeRemainingColumn)

        count = ".1f" if unit == "s" else ".0f"  # seconds in tenths; frames, bytes whole
        columns = [TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
                   TextColumn(f"{{task.completed:{count}}}/{{task.total:{count}}} {unit}"
                              if total else f"{{task.completed:{count}}} {unit}"),
                   TextColumn("{task.fields[rate]}"), TimeRemainingColumn()]
        with Progress(*columns, console=console, transient=True) as bar:
            task = bar.add_task(description, total=total, rate="")

            def advance(amount: float, rate: str = "") -> None:
                bar.update(task, advance=amount, rate=rate)

            yield advance

    # -- stdout ------------------------------------------------------------------------------

    def result(self, text: str) -> None:
        """One line of result on stdout (a path, a name); kept even with --quiet."""
        sys.stdout.write(text + "\n")
        sys.stdout.flush()

    def result_json(self, value: Any) -> None:
        """One line of JSON (for jq and scripts)."""
        sys.stdout.write(json.dumps(value) + "\n")
        sys.stdout.flush()
