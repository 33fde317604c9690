"""The assistant's inner monologue as a file, written as it comes.

Forms, chosen by the file's suffix:
  .json        NVIDIA's `--output-text` format: a JSON list with one piece per 80 ms frame,
               "PAD" and "EPAD" included (a word piece keeps its leading space);
  .srt, .vtt   timed subtitles: each frame is 80 ms; a cue closes after a pause of
               PAUSE_FRAMES silent frames, or once it is CUE_CHARS long;
  other        plain text: the pieces joined, PAD and EPAD left out.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TextIO

from .core.config import FRAME_RATE

SILENT = ("PAD", "EPAD")
PAUSE_FRAMES = 10  # 0.8 s without text ends a subtitle cue
CUE_CHARS = 42  # the usual subtitle line length
FORMATS = ("txt", "json", "srt", "vtt")


def format_of(path: str) -> str:
    suffix = Path(path).suffix.lower().lstrip(".")
    return suffix if suffix in FORMATS else "txt"


def _timestamp(frame: int, separator: str) -> str:
    ms = round(frame * 1000 / FRAME_RATE)
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    seconds, ms = divmod(ms, 1000)
    return f"{hours:02d}:{minutes:02d}:{seconds:02d}{separator}{ms:03d}"


class TranscriptWriter:
    """`add(frame_index, piece)` for every frame in order, then `close()`."""

    def __init__(self, stream: TextIO, fmt: str):
        if fmt not in FORMATS:
            raise ValueError(f"unknown transcript format {fmt!r}")
        self.stream = stream
        self.fmt = fmt
        self._count = 0
        self._cue: list[str] = []
        self._cue_start = self._cue_end = 0
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
            self._subtitle(frame, piece)
        self._count += 1
        self.stream.flush()

    def _subtitle(self, frame: int, piece: str) -> None:
        if piece in SILENT:
            if self._cue and frame - self._cue_end >= PAUSE_FRAMES:
                self._flush_cue()
            return
        starts_word = piece.startswith(" ")
        if self._cue and starts_word and len("".join(self._cue)) + len(piece) > CUE_CHARS:
            self._flush_cue()
        if not self._cue:
            self._cue_start = frame
        self._cue.append(piece)
        self._cue_end = frame + 1

    def _flush_cue(self) -> None:
        text = "".join(self._cue).strip()
        self._cue = []
        if not text:
            return
        self._cues += 1
        separator = "," if self.fmt == "srt" else "."
        number = f"{self._cues}\n" if self.fmt == "srt" else ""
        self.stream.write(f"{number}{_timestamp(self._cue_start, separator)} --> "
                          f"{_timestamp(self._cue_end, separator)}\n{text}\n\n")

    def close(self) -> None:
        if self.fmt == "json":
            self.stream.write("]\n")
        elif self.fmt == "txt":
            self.stream.write("\n")
        else:
            self._flush_cue()
        self.stream.flush()
