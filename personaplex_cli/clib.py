"""Keeping C libraries' own messages off the user's stderr.

libsndfile's MP3 decoder, PortAudio and ALSA print diagnostics straight to the C library's
`stderr` (a sound server dying mid-session makes PortAudio print "Expression ... failed"
lines). Errors the user should see are ours, one line each; theirs are muted here.
"""

import contextlib
import ctypes
import os
import sys
import threading


class CStderrMuted:
    """Context manager: C stdio's `stderr` goes to /dev/null while the block runs.

    libmpg123 (inside libsndfile), PortAudio and ALSA report with ``fprintf(stderr, ...)``, which reads the C global
    ``stderr`` (a ``FILE *``) at each call. Pointing that global at a FILE on
    /dev/null mutes the library without touching file descriptor 2, so Python
    code writing to sys.stderr in other threads (progress, logging) is never
    lost. Where the global cannot be found, fd 2 is redirected instead, only
    for the duration of the block (Python output from other threads in that
    window is lost then), so only short calls should count on it: `held()` mutes
    for a long stretch (a live session) only where the global was found.
    Re-entrant and thread-safe: the first holder mutes, the last one restores.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._depth = 0
        self._mode: str | None = None  # "stdio" or "fd", decided on first use
        self._pointer = None  # ctypes view of the C `stderr` global
        self._null_file = None  # FILE * on /dev/null
        self._saved = None

    def _setup(self) -> None:
        self._mode = "fd"
        try:
            libc = ctypes.CDLL(None)
            for symbol in ("stderr", "__stderrp"):  # glibc/musl, macOS/BSD
                try:
                    pointer = ctypes.c_void_p.in_dll(libc, symbol)
                    break
                except ValueError:
                    continue
            else:
                return
            fopen = libc.fopen
            fopen.restype, fopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_char_p]
            null_file = fopen(os.devnull.encode(), b"w")
        except (OSError, AttributeError, TypeError, ValueError):
            return
        if pointer.value and null_file:
            self._pointer, self._null_file, self._mode = pointer, null_file, "stdio"

    def __enter__(self):
        with self._lock:
            if self._mode is None:
                self._setup()
            if self._depth == 0:
                self._mute()
            self._depth += 1
        return self

    def __exit__(self, *exc):
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                self._restore()

    def _mute(self) -> None:
        if self._mode == "stdio":
            self._saved = self._pointer.value
            self._pointer.value = self._null_file
        elif self._mode == "fd":
            try:
                sys.stderr.flush()  # what Python already wrote must not be swallowed
            except (AttributeError, OSError, ValueError):
                pass
            try:
                saved = os.dup(2)
                null = os.open(os.devnull, os.O_WRONLY)
                try:
                    os.dup2(null, 2)
                finally:
                    os.close(null)
                self._saved = saved
            except OSError:
                self._saved = None

    def _restore(self) -> None:
        if self._mode == "stdio":
            self._pointer.value = self._saved
        elif self._mode == "fd" and self._saved is not None:
            os.dup2(self._saved, 2)
            os.close(self._saved)
        self._saved = None

    @contextlib.contextmanager
    def held(self):
        """Muted for as long as the block lasts, but only through the C global: file
        descriptor 2 (Python's own messages) is never taken for long."""
        with self._lock:
            if self._mode is None:
                self._setup()
        if self._mode != "stdio":
            yield
            return
        with self:
            yield


c_stderr_muted = CStderrMuted()
