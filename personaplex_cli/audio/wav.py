"""Streaming WAV and raw PCM writers that also work on pipes.

Why our own writer: soundfile refuses to write WAV to a pipe, `sf.write` to
stdout produces a corrupt stream, and Python's `wave` raises on close when it
cannot seek back (see docs/audio-io.md §1). A WAV header is small enough to
write by hand.

Header layouts (all little-endian):

* ``s16`` (PCM, format tag 1), the canonical 44-byte header::

    0  "RIFF"  4  riff_size = 36 + data_size  8  "WAVE"
    12 "fmt "  16 16  20 tag=1  22 channels  24 sample_rate  28 byte_rate
    32 block_align  34 bits=16
    36 "data"  40 data_size  44 samples...

* ``f32`` (IEEE float, format tag 3), a 58-byte header: the RIFF spec asks
  non-PCM formats for an 18-byte ``fmt `` chunk (with ``cbSize`` = 0) and a
  ``fact`` chunk holding the frame count; libsndfile, sox and ffmpeg read it::

    0  "RIFF"  4  riff_size = 50 + data_size  8  "WAVE"
    12 "fmt "  16 18  20 tag=3 ... 34 bits=32  36 cbSize=0
    38 "fact"  42 4   46 frame_count
    50 "data"  54 data_size  58 samples...

On a file the header is written at once; on a pipe it goes out with the first samples, in
one write: a reader that takes whatever one read brings as the header (sox: "RIFF header
not found") would otherwise see 44 bytes alone while the model loads.

Length handling:

* ``num_frames`` known up front: every size is exact from the first byte, so
  the stream is a valid WAV even on a pipe.
* unknown: the RIFF, data (and fact) sizes are ``0xFFFFFFFF`` placeholders
  (ffmpeg's convention; readers then read to EOF) and are patched on close
  when the file object can seek back.
* fewer frames than declared: a seekable file gets its header patched to the
  real count; a pipe cannot be patched, so the stream is padded with silence
  up to the declared count, which keeps it a valid WAV whose header is true,
  when it is at most ``PAD_LIMIT_SECONDS`` short (the estimates sox writes on a
  pipe are off by tens of ms); further short, the header lied (a stream that
  claimed an hour and held seconds) and the stream is left to end early, as a
  reader of an unknown length expects, not padded with an hour of zeros.
  (Not done when the `with` block exits with an exception: the output is
  broken anyway and padding could mean writing minutes of zeros.)

Sample conversion: ``s16`` clips to [-1, 1], scales by 32767 and rounds to
nearest (``np.round``, ties to even), so +1.0 -> 32767 and -1.0 -> -32767 (the
value -32768 is never produced); NaN becomes 0. ``f32`` writes the values
unchanged, without clipping.

Writers never close the file object they were given: the caller owns it
(it is often ``sys.stdout.buffer``).
"""

import struct

import numpy as np

SAMPLE_FORMATS = ("s16", "f32")
_UNKNOWN_SIZE = 0xFFFFFFFF  # "size unknown, read to EOF" in a 32-bit WAV size field
PAD_LIMIT_SECONDS = 1.0  # the most silence a pipe's stream is padded with to match its header
_PAD_CHUNK_BYTES = 1 << 16  # keep memory flat while padding a long stream


def _sample_width(sample_format: str) -> int:
    if sample_format not in SAMPLE_FORMATS:
        raise ValueError(f"sample_format must be one of {SAMPLE_FORMATS}, got {sample_format!r}")
    return 2 if sample_format == "s16" else 4


def encode_samples(samples: np.ndarray, channels: int, sample_format: str) -> bytes:
    """Convert float samples [n] or [n, channels] to interleaved little-endian bytes."""
    x = np.asarray(samples, dtype=np.float32)
    if x.ndim == 1:
        # A 1-D array is a mono signal; for multi-channel output it would be ambiguous.
        if channels != 1:
            raise ValueError(f"expected samples shaped [n, {channels}], got a 1-D array")
    elif x.ndim != 2 or x.shape[1] != channels:
        raise ValueError(f"expected samples shaped [n] or [n, {channels}], got {list(x.shape)}")
    if sample_format == "f32":
        return x.astype("<f4", copy=False).tobytes()
    _sample_width(sample_format)
    x = np.nan_to_num(x, nan=0.0)  # NaN has no integer value; silence is the least harmful
    return np.round(np.clip(x, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


class RawWriter:
    """Headerless interleaved little-endian PCM (s16) or float (f32) writer.

    Same interface as `WavWriter`. `num_frames`, when given, is only an upper
    bound (writing more raises ValueError); a raw stream declares no length,
    so nothing is padded or patched on close.
    """

    def __init__(self, fileobj, sample_rate: int, channels: int = 1,
                 sample_format: str = "s16", num_frames: int | None = None):
        if int(sample_rate) <= 0:
            raise ValueError(f"sample_rate must be positive, got {sample_rate}")
        if not 1 <= int(channels) <= 0xFFFF:
            raise ValueError(f"channels must be in 1..65535, got {channels}")
        if num_frames is not None and int(num_frames) < 0:
            raise ValueError(f"num_frames must be >= 0, got {num_frames}")
        self.fileobj = fileobj
        self.sample_rate = int(sample_rate)
        self.channels = int(channels)
        self.sample_format = sample_format
        self.sample_width = _sample_width(sample_format)
        self.block_align = self.channels * self.sample_width
        self.num_frames = None if num_frames is None else int(num_frames)
        self.frames_written = 0
        self.closed = False

    def write(self, samples: np.ndarray) -> None:
        """Append float32 samples shaped [n] (mono) or [n, channels]."""
        if self.closed:
            raise ValueError("write to a closed writer")
        data = encode_samples(samples, self.channels, self.sample_format)
        n = len(data) // self.block_align
        if self.num_frames is not None and self.frames_written + n > self.num_frames:
            raise ValueError(
                f"writing {n} frames would exceed the declared {self.num_frames} "
                f"({self.frames_written} already written)")
        if data:
            self._emit(data)
            # Flush so a downstream player/pipe sees audio as soon as it is produced.
            self.fileobj.flush()
        self.frames_written += n

    def _emit(self, data: bytes) -> None:
        self.fileobj.write(data)

    def close(self) -> None:
        """Finish the stream (flushes; the file object itself stays open)."""
        self._finish(pad=True)

    def _finish(self, pad: bool) -> None:
        if self.closed:
            return
        self.closed = True
        self.fileobj.flush()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self._finish(pad=exc_type is None)


class WavWriter(RawWriter):
    """Streaming WAV writer (s16 PCM or f32 IEEE float) over a binary file object.

    Usage::

        with WavWriter(sys.stdout.buffer, 24000) as w:
            for block in blocks:
                w.write(block)

    The header is written immediately to a file, with the first samples to a pipe. See
    the module docstring for how the sizes are filled in, patched or padded.
    """

    def __init__(self, fileobj, sample_rate: int, channels: int = 1,
                 sample_format: str = "s16", num_frames: int | None = None):
        super().__init__(fileobj, sample_rate, channels, sample_format, num_frames)
        self.header_size = 44 if sample_format == "s16" else 58
        # Where the header starts, for patching; None if we cannot seek back.
        self._header_offset = _tell_if_seekable(fileobj)
        self._unsent = self._header(self.num_frames)  # on a pipe: until the first samples
        if self._header_offset is not None:
            self._emit(b"")
            self.fileobj.flush()

    def _emit(self, data: bytes) -> None:
        head, self._unsent = self._unsent, b""
        self.fileobj.write(head + data)

    def _header(self, num_frames: int | None) -> bytes:
        data_size = self._data_size(num_frames)
        unknown = data_size == _UNKNOWN_SIZE
        riff_size = _UNKNOWN_SIZE if unknown else data_size + self.header_size - 8
        fact = _UNKNOWN_SIZE if unknown else num_frames
        byte_rate = self.sample_rate * self.block_align
        bits = 8 * self.sample_width
        if self.sample_format == "s16":
            fmt = struct.pack("<4sIHHIIHH", b"fmt ", 16, 1, self.channels, self.sample_rate,
                              byte_rate, self.block_align, bits)
            extra = b""
        else:
            fmt = struct.pack("<4sIHHIIHHH", b"fmt ", 18, 3, self.channels, self.sample_rate,
                              byte_rate, self.block_align, bits, 0)
            extra = struct.pack("<4sII", b"fact", 4, fact)
        return (struct.pack("<4sI4s", b"RIFF", riff_size, b"WAVE") + fmt + extra
                + struct.pack("<4sI", b"data", data_size))

    def _data_size(self, num_frames: int | None) -> int:
        """Data chunk size, or the placeholder when unknown or too big for 32 bits."""
        if num_frames is None:
            return _UNKNOWN_SIZE
        size = num_frames * self.block_align
        # Over 4 GiB a plain WAV cannot hold the size; readers treat the
        # placeholder as "read to EOF", which is the best we can do.
        if size + self.header_size - 8 >= _UNKNOWN_SIZE:
            return _UNKNOWN_SIZE
        return size

    def _finish(self, pad: bool) -> None:
        if self.closed:
            return
        if self._unsent:  # no samples came: the header alone
            self._emit(b"")
        # Nothing to fix when the header already tells the truth (exact, or both over 4 GiB).
        header_is_true = (self.num_frames == self.frames_written or
                          self._data_size(self.frames_written) == self._data_size(self.num_frames))
        if not header_is_true and not self._patch_header():
            short = None if self.num_frames is None else self.num_frames - self.frames_written
            if pad and short is not None and 0 < short <= PAD_LIMIT_SECONDS * self.sample_rate:
                self._pad_to_declared()
        super()._finish(pad)

    def patch_header(self) -> bool:
        """Make the header tell the frames written so far, mid-stream, so a file cut off
        here (a crash, SIGKILL) still reads as a valid WAV up to this point. Later writes
        are not covered until the next patch or close. False when the file cannot seek."""
        if self.closed:
            raise ValueError("patch_header on a closed writer")
        return self._patch_header()

    def _patch_header(self) -> bool:
        """Rewrite the header with the real frame count; False if the file cannot seek."""
        if self._header_offset is None:
            return False
        try:
            self.fileobj.flush()
            end = self.fileobj.tell()
            self.fileobj.seek(self._header_offset)
            self.fileobj.write(self._header(self.frames_written))
            self.fileobj.flush()
            self.fileobj.seek(end)
            return True
        except (OSError, ValueError):
            return False

    def _pad_to_declared(self) -> None:
        remaining = (self.num_frames - self.frames_written) * self.block_align
        zeros = bytes(min(remaining, _PAD_CHUNK_BYTES))
        while remaining > 0:
            n = min(remaining, len(zeros))
            self.fileobj.write(zeros[:n])
            remaining -= n
        self.frames_written = self.num_frames


def _tell_if_seekable(fileobj) -> int | None:
    """Current offset of a seekable file object, else None (pipes, sockets, ...)."""
    try:
        if not fileobj.seekable():
            return None
        return fileobj.tell()
    except (AttributeError, OSError, ValueError):
        return None
