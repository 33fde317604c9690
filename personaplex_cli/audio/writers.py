"""Audio outputs by format: WAV and raw PCM through our own writers (they stream to pipes with
true headers), FLAC and Ogg through libsndfile.

The format follows the output's suffix unless one is asked for; `-` and a name without a
suffix are WAV. A suffix of any other format (`.mp3`, `.m4a`, `.aiff`...) is refused by the
commands (`unwritable_suffix`), never silently written as WAV.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import AudioError
from .wav import RawWriter, WavWriter

# suffix -> format
SUFFIXES = {".wav": "wav", ".wave": "wav", ".flac": "flac", ".ogg": "ogg", ".oga": "ogg",
            ".opus": "opus", ".raw": "raw", ".pcm": "raw"}
FORMATS = ("wav", "flac", "ogg", "opus", "raw")
# What each format stores the samples as: WAV/raw either; FLAC integers; Ogg its own codec.
SAMPLE_FORMATS = {"wav": ("s16", "f32"), "raw": ("s16", "f32"), "flac": ("s16",),
                  "ogg": (), "opus": ()}
_LIBSNDFILE = {"flac": ("FLAC", "PCM_16"), "ogg": ("OGG", "VORBIS"), "opus": ("OGG", "OPUS")}
# Opus encodes only these rates.
OPUS_RATES = (8000, 12000, 16000, 24000, 48000)
# libvorbis crashes the process (SIGSEGV) above 200 kHz; 192 kHz is its documented top.
VORBIS_MAX_RATE = 192000


def format_of(path: str) -> str | None:
    """The format an output's suffix names, None when it names none (or for `-`)."""
    return SUFFIXES.get(Path(path).suffix.lower()) if path != "-" else None


def unwritable_suffix(path: str) -> str | None:
    """The suffix of `path` when it names no format written here (`.mp3`), else None."""
    suffix = Path(path).suffix if path != "-" else ""
    return suffix if suffix and suffix.lower() not in SUFFIXES else None


def written_suffixes() -> str:
    """'.wav, .flac, .ogg, .opus or .raw': one suffix per format, for messages."""
    first = {fmt: suffix for suffix, fmt in reversed(SUFFIXES.items())}
    names = [first[fmt] for fmt in FORMATS]
    return ", ".join(names[:-1]) + " or " + names[-1]


class SoundFileWriter:
    """FLAC or Ogg through libsndfile, on a file object or (for pipes) a file descriptor."""

    def __init__(self, fileobj, sample_rate: int, channels: int, fmt: str):
        import soundfile

        container, subtype = _LIBSNDFILE[fmt]
        target = fileobj
        try:
            seekable = fileobj.seekable()
        except (AttributeError, OSError, ValueError):
            seekable = False
        if not seekable:  # libsndfile's virtual IO needs seeking; a pipe goes by its fd
            fileobj.flush()
            target = fileobj.fileno()
        try:
            self._sf = soundfile.SoundFile(target, "w", sample_rate, channels, subtype,
                                           format=container, closefd=False)
        except (RuntimeError, ValueError, soundfile.LibsndfileError) as error:
            raise AudioError(f"cannot write {fmt} at {sample_rate} Hz: {error}") from None
        self.frames_written = 0

    def write(self, samples: np.ndarray) -> None:
        if len(samples):
            self._sf.write(np.asarray(samples, dtype=np.float32))
            self.frames_written += len(samples)

    def close(self) -> None:
        if not self._sf.closed:
            self._sf.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_writer(fileobj, fmt: str, sample_rate: int, channels: int = 1,
                sample_format: str = "s16", num_frames: int | None = None):
    """A writer with `write(samples [n] or [n, channels])` and `close()` (also a context)."""
    if fmt == "wav":
        return WavWriter(fileobj, sample_rate, channels, sample_format, num_frames=num_frames)
    if fmt == "raw":
        return RawWriter(fileobj, sample_rate, channels, sample_format, num_frames=num_frames)
    problem = rate_problem(fmt, sample_rate)
    if problem:
        raise AudioError(problem)
    return SoundFileWriter(fileobj, sample_rate, channels, fmt)


def rate_problem(fmt: str, sample_rate: int) -> str | None:
    """Why format `fmt` cannot store `sample_rate` Hz, or None when it can."""
    if fmt == "opus" and sample_rate not in OPUS_RATES:
        return f"Opus cannot store {sample_rate} Hz; use --rate 24000 or 48000"
    if fmt == "ogg" and sample_rate > VORBIS_MAX_RATE:
        return (f"Ogg Vorbis cannot store {sample_rate} Hz; use a --rate of at most "
                f"{VORBIS_MAX_RATE}")
    return None
