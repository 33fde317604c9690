"""The live view of a session on a terminal: who speaks, the monologue, the figures.

The one module below cli/ that uses rich (imported when a view is drawn, not at module
load). `render_view` turns one `engine.LiveStats` into a renderable; `LiveView` keeps it
on screen, redrawn by whoever calls `tick()`; `Terminal` is the one thread that writes a
session's output, the view's and stdout's.

Why a thread of its own: a terminal that takes no output blocks its writer. Ctrl-S
(XOFF) does that, so does a tmux pane or a pipe nobody reads. When talk's main thread
wrote the monologue (and, under the view, waited for rich's refresh thread, which draws
holding the lock every stdout line needs), the whole session's bookkeeping stopped with
it: measured with the old code, in tmux and on a pseudo-terminal, not one more --stats
line after Ctrl-S, though the engine went on. A terminal that stays blocked also blocks
the shutdown's next write, so that only a second Ctrl-C's quiet exit was left. Now only
this thread waits; the stats, --duration, the watchdog and Ctrl-C go on, and the end waits
for the terminal a moment only.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

from ..audio.level import SPEAKING_DBFS

VIEW_HZ = 8
BAR = 24  # level bars, in characters, for -60..0 dBFS


def _bar(level: float):
    from rich.text import Text

    filled = round(BAR * min(1.0, max(0.0, (level + 60.0) / 60.0)))
    active = level > SPEAKING_DBFS
    text = Text("━" * filled, style="green" if active else "dim")
    text.append("─" * (BAR - filled), style="dim")
    text.append(f" {level:4.0f} dBFS" if level > -99 else "    silent")
    if active:
        text.append("  speaking", style="bold")
    return text


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def echo_text(s, session: bool = False) -> str:
    """The echo canceller's state in words, from one LiveStats: now (the view), or over
    the whole session (the summary)."""
    reduction = s.session_echo_reduction_db if session else s.echo_reduction_db
    if reduction is not None:
        figure = f"reduced by {reduction:.0f} dB"
        figure += " (median over the seconds the assistant spoke alone)" if session else \
            " while the assistant spoke alone"
    else:
        figure = "reduction not measured yet (the assistant has not spoken alone)"
    if s.echo_path:
        return f"an echo path is found: {figure}"
    if session and s.session_echo_reduction_db is not None:
        return f"the echo path was lost again: {figure}"
    return "no echo path found: the model hears the microphone as it is"


def render_view(s, lines: list[str], title: str, width: int):
    """The view as a rich renderable, from one `LiveStats` and the monologue's last lines.
    Every line stays 3 columns short of the terminal: the terminal's echo of ^C after a
    full-width line pushes the view down a line, and rich's erase then leaves its first
    line behind."""
    from rich.constrain import Constrain
    from rich.table import Table
    from rich.text import Text

    grid = Table.grid(padding=(0, 1))
    grid.add_column(style="bold", no_wrap=True, min_width=9)
    grid.add_column(no_wrap=True, overflow="ellipsis", ratio=1)
    minutes, seconds = divmod(int(s.elapsed_s), 60)
    grid.add_row("talk", Text(f"{minutes:02d}:{seconds:02d} · {title} · Ctrl-C ends",
                              style="dim"))
    grid.add_row("caller", _bar(s.caller_dbfs))
    grid.add_row("assistant", _bar(s.assistant_dbfs))
    room = max(20, width - 3 - 11)
    shown = [line if len(line) <= room else "…" + line[-room + 1:] for line in lines]
    grid.add_row("monologue", Text("\n".join(shown) if shown else "…", style="italic"))
    rtf = "-" if s.rtf is None else f"{s.rtf:.2f}"
    grid.add_row("compute", f"{_ms(s.compute_p50_ms)} p50 · {_ms(s.compute_p99_ms)} p99 "
                            f"per 80 ms frame · real-time factor {rtf}")
    if s.buffer_ms is not None:
        grid.add_row("speaker", f"buffer {s.buffer_ms:.0f} ms · underruns {s.underruns} · "
                                f"overruns {s.overruns}")
    grid.add_row("caller in", f"dropped {s.dropped} · waiting {s.pending} · "
                              f"delay {_ms(s.delay_ms)}")
    if s.echo_delay_ms is not None:
        grid.add_row("echo", f"{echo_text(s)} · delay {_ms(s.echo_delay_ms)}")
    return Constrain(grid, max(20, width - 3))


class LiveView:
    """`render_view` kept on `console` (transient: erased at the end) while the block runs;
    `tick()` redraws it at most VIEW_HZ times a second. With `redirect_stdout`, what is
    printed on stdout meanwhile appears above the view."""

    def __init__(self, console, stats: Callable[[], object], lines: Callable[[], list[str]],
                 title: str, redirect_stdout: bool):
        from rich.live import Live

        self.console = console
        self._stats = stats
        self._lines = lines
        self.title = title
        self._next = 0.0
        self._live = Live("", console=console, auto_refresh=False,
                          transient=True, redirect_stdout=redirect_stdout,
                          redirect_stderr=False)

    def _render(self):
        return render_view(self._stats(), self._lines(), self.title, self.console.width)

    def tick(self) -> None:
        now = time.monotonic()
        if now >= self._next:
            self._next = now + 1.0 / VIEW_HZ
            self._live.update(self._render(), refresh=True)

    def __enter__(self) -> LiveView:
        self._live.__enter__()
        self.tick()
        return self

    def __exit__(self, *exc) -> None:
        self._live.__exit__(*exc)


class Terminal:
    """Writes `put()` text with `write` (stdout, flushed) and keeps `view` (a LiveView,
    or None) drawn, from a thread of its own; the session's threads only queue. What
    does not fit in the queue (a terminal stalled for long) is dropped and counted: the
    --transcript file has every piece. A failing write (a reader gone) is kept in
    `error`, and nothing more is written."""

    _STOP = object()

    def __init__(self, write: Callable[[str], None], view: LiveView | None = None,
                 capacity: int = 4096):
        self._write = write
        self.view = view
        self._queue: queue.Queue = queue.Queue(capacity)
        self.error: OSError | None = None
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="personaplex-terminal",
                                        daemon=True)

    def start(self) -> Terminal:
        self._thread.start()
        return self

    def put(self, text: str) -> None:
        try:
            self._queue.put_nowait(text)
        except queue.Full:
            self.dropped += 1

    def _run(self) -> None:
        with self.view or _nothing():
            while True:
                try:
                    item = self._queue.get(timeout=1.0 / VIEW_HZ)
                except queue.Empty:
                    item = None
                if item is self._STOP:
                    return
                if item is not None and self.error is None:
                    try:
                        self._write(item)
                    except OSError as error:  # BrokenPipeError: the caller reports it
                        self.error = error
                if self.view is not None:
                    self.view.tick()

    def close(self, timeout: float) -> bool:
        """Writes what is queued, takes the view down; False if the terminal did not let
        that happen within `timeout` seconds (the thread is left waiting)."""
        if not self._thread.is_alive():
            return True
        try:
            self._queue.put(self._STOP, timeout=timeout)
        except queue.Full:
            return False
        self._thread.join(timeout)
        return not self._thread.is_alive()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None
