"""The assistant's inner monologue as a file, written as it comes.

Forms, chosen by the file's suffix:
  .json        NVIDIA's `--output-text` format: a JSON list with one piece per 80 ms frame,
               "PAD" and "EPAD" included (a word piece keeps its leading space);
  .srt, .vtt   timed subtitles: each frame is 80 ms; a cue is one of `Lines`' lines,
               CUE_CHARS long at most;
  other        plain text: the pieces joined, PAD and EPAD left out.

`Lines` is the one rule that cuts the monologue into lines, for subtitles here and for
the live monologue `talk` prints (and any other live view of it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from .core.config import FRAME_RATE

SILENT = ("PAD", "EPAD")
PAUSE_FRAMES = 10  # 0.8 s without text ends a line (a subtitle cue)
CUE_CHARS = 42  # the usual subtitle line length
FORMATS = ("txt", "json", "srt", "vtt")


def spoken(pieces) -> str:
    """What the monologue says: its pieces joined, PAD and EPAD left out, ends trimmed."""
    return "".join(piece for piece in pieces if piece not in SILENT).strip()


def format_of(path: str) -> str:
    suffix = Path(path).suffix.lower().lstrip(".")
    return suffix if suffix in FORMATS else "txt"


def _timestamp(frame: int, separator: str) -> str:
    ms = round(frame * 1000 / FRAME_RATE)
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    seconds, ms = divmod(ms, 1000)
    return f"{hours:02d}:{minutes:02d}:{seconds:02d}{separator}{ms:03d}"


@dataclass(frozen=True)
class Line:
    text: str
    start: int  # the frame of its first piece
    end: int  # one past the frame of its last piece


class Lines:
    """Text pieces, one per frame, cut into lines: a line ends after PAUSE_FRAMES frames
    without text (dropped frames count as time too), or before a word (a piece starting
    with a space) that would make it longer than `max_chars`. `add()` returns the line
    that ended, if one did; `text` is the line so far."""

    def __init__(self, max_chars: int):
        self.max_chars = max_chars
        self.text = ""
        self._start = self._end = 0

    def add(self, frame: int, piece: str) -> Line | None:
        if piece in SILENT:
            return self.flush() if self.text and frame - self._end >= PAUSE_FRAMES else None
        ended = None
        if self.text and piece.startswith(" ") and len(self.text) + len(piece) > self.max_chars:
            ended = self.flush()
        text = piece if self.text else piece.lstrip()
        if text:
            if not self.text:
                self._start = frame
            self.text += text
            self._end = frame + 1
        return ended

    def flush(self) -> Line | None:
        """The line so far, ended (None when there is none)."""
        line = Line(self.text.rstrip(), self._start, self._end) if self.text.strip() else None
        self.text = ""
        return line


class TranscriptWriter:
    """`add(frame_index, piece)` for every frame in order, then `close()`."""

    def __init__(self, stream: TextIO, fmt: str):
        if fmt not in FORMATS:
            raise ValueError(f"unknown transcript format {fmt!r}")
        self.stream = stream
        self.fmt = fmt
        self._count = 0
        self._lines = Lines(CUE_CHARS)
        self._cues = 0
        self._text_started = False
        if fmt == "json":
            stream.write("[")
        elif fmt == "vtt":
            stream.write("WEBVTT\n\n")

    def add(self, frame: int, piece: str) -> None:
        if self.fmt == "json":
            self.stream.write(("," if self._count else "") + json.dumps(piece))
        elif self.fmt == "txt":
            if piece not in SILENT:
                text = piece.lstrip() if not self._text_started else piece
                self._text_started = self._text_started or bool(text)
                self.stream.write(text)
        else:
            self._cue(self._lines.add(frame, piece))
        self._count += 1
        self.stream.flush()

    def _cue(self, line: Line | None) -> None:
        if line is None:
            return
        self._cues += 1
        separator = "," if self.fmt == "srt" else "."
        number = f"{self._cues}\n" if self.fmt == "srt" else ""
        self.stream.write(f"{number}{_timestamp(line.start, separator)} --> "
                          f"{_timestamp(line.end, separator)}\n{line.text}\n\n")

    def close(self) -> None:
        if self.fmt == "json":
            self.stream.write("]\n")
        elif self.fmt == "txt":
            self.stream.write("\n")
        else:
            self._cue(self._lines.flush())
        self.stream.flush()
