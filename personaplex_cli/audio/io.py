"""Reading audio from files and pipes as a stream of float32 mono blocks.

`open_audio(path)` returns an `AudioReader`; `reader.blocks(n)` yields mono
float32 arrays (channels averaged), so memory stays flat on long inputs.

Where the samples come from:

* regular files: `soundfile.SoundFile`, read block by block (any format
  libsndfile knows: WAV, FLAC, OGG/Opus, MP3, AIFF, ...);
* ``-`` (stdin) and other non-seekable inputs (FIFOs, ``/dev/stdin``,
  ``<(cmd)``): the first 12 bytes are sniffed. A RIFF/WAVE stream is parsed
  here (PCM u8/s16/s24/s32, float 32/64, also WAVE_FORMAT_EXTENSIBLE, unknown
  chunks skipped by reading) and streamed without seeking; data sizes 0,
  ``0xFFFFFFFF`` and sox's ``0x7FFFF000``-ish values mean "read to EOF".
  Anything else (FLAC/OGG/MP3 cannot be decoded from a pipe by libsndfile,
  docs/audio-io.md §1) is buffered whole in memory and handed to soundfile.

On a pipe `num_frames` is None: a streamed header's length is a guess
(ffmpeg claims 2^31-1 frames) and EOF is the only truth. A WAV whose data
ends before the length its header declares is read up to EOF, as libsndfile
does for files, and a trailing partial frame is dropped.

Every failure is an `AudioError` with a one-line message; soundfile/cffi
exceptions never escape.
"""

import io
import os
import stat
import struct
import sys
from typing import Iterator

import numpy as np
import soundfile

from ..streams import read_exact
from .errors import AudioError

STDIN = "-"
_SNIFF_BYTES = 12
_MAX_KEPT_HEADER_BYTES = 16 << 20  # header bytes kept for the soundfile fallback
_SKIP_CHUNK_BYTES = 1 << 16
# KSDATAFORMAT_SUBTYPE_* GUIDs end with these 14 bytes; the first 2 are the format tag.
_EXTENSIBLE_GUID_TAIL = b"\x00\x00\x00\x00\x10\x00\x80\x00\x00\xaa\x00\x38\x9b\x71"
_WAVE_FORMAT_PCM, _WAVE_FORMAT_FLOAT, _WAVE_FORMAT_EXTENSIBLE = 1, 3, 0xFFFE


class AudioReader:
    """A stream of audio: `sample_rate`, `channels`, `num_frames` (None = unknown), `blocks(n)`."""

    def __init__(self, source, name: str):
        self._source = source
        self.name = name
        self.sample_rate: int = source.sample_rate
        self.channels: int = source.channels
        self.num_frames: int | None = source.num_frames
        self._frames_read = 0

    @property
    def duration(self) -> float | None:
        """Length in seconds, when known."""
        return None if self.num_frames is None else self.num_frames / self.sample_rate

    def blocks(self, n: int) -> Iterator[np.ndarray]:
        """Yield mono float32 arrays of `n` samples; the last one may be shorter."""
        if n < 1:
            raise ValueError(f"block size must be >= 1, got {n}")
        while True:
            block = self._read(n)  # [m, channels], m <= n
            if len(block) == 0:
                return
            self._check_finite(block)
            self._frames_read += len(block)
            yield _mixdown(block)
            if len(block) < n:  # sources only return short blocks at EOF
                return

    def _read(self, n: int) -> np.ndarray:
        try:
            return self._source.read(n)
        except AudioError:
            raise
        except Exception as e:  # libsndfile/cffi errors mid-stream (corrupt FLAC/MP3, I/O)
            raise AudioError(f"cannot read {self.name}: {_describe(e)}") from None

    def _check_finite(self, block: np.ndarray) -> None:
        # Checked per block so a NaN an hour in is reported without buffering the file.
        finite = np.isfinite(block).all(axis=1)
        if not finite.all():
            first = self._frames_read + int(np.argmin(finite))
            raise AudioError(f"input contains NaN or infinite samples at second "
                             f"{first / self.sample_rate:.2f}: {self.name}")

    def close(self) -> None:
        self._source.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_audio(path) -> AudioReader:
    """Open a file path (str/PathLike) or ``-`` for stdin; raise AudioError if unreadable."""
    if isinstance(path, str) and path == STDIN:
        return _open_stream(sys.stdin.buffer, "stdin", owned=False)
    name = os.fspath(path)
    try:
        st = os.stat(name)
    except FileNotFoundError:
        raise AudioError(f"no such file: {name}") from None
    except OSError as e:
        raise AudioError(f"cannot open {name}: {e.strerror or e}") from None
    if stat.S_ISDIR(st.st_mode):
        raise AudioError(f"is a directory, not an audio file: {name}")
    if not stat.S_ISREG(st.st_mode):
        # FIFOs, /dev/stdin, process substitution: same handling as stdin.
        try:
            stream = open(name, "rb")
        except OSError as e:
            raise AudioError(f"cannot open {name}: {e.strerror or e}") from None
        return _open_stream(stream, name, owned=True)
    if st.st_size == 0:
        raise AudioError(f"empty file: {name}")
    return AudioReader(_SoundFileSource.open(name, name), name)


def _open_stream(stream, name: str, owned: bool) -> AudioReader:
    """Open a non-seekable byte stream: stream WAV, buffer everything else."""
    try:
        head = read_exact(stream, _SNIFF_BYTES)
        if not head:
            raise AudioError(f"empty input: {name}")
        if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
            source = _WavStreamSource.open(stream, head, name, owned)
        else:
            data = head + stream.read()
            if owned:
                stream.close()
            source = _SoundFileSource.open(io.BytesIO(data), name)
            source.num_frames = None  # came through a pipe: never trust the length
    except OSError as e:
        if owned:
            stream.close()
        raise AudioError(f"cannot read {name}: {e.strerror or e}") from None
    except BaseException:
        if owned:
            stream.close()
        raise
    return AudioReader(source, name)


def _mixdown(block: np.ndarray) -> np.ndarray:
    """[m, channels] -> [m] by averaging channels (the usual downmix; no gain change for mono)."""
    if block.shape[1] == 1:
        return np.ascontiguousarray(block[:, 0], dtype=np.float32)
    return block.mean(axis=1, dtype=np.float32)


def _describe(e: BaseException) -> str:
    """A one-line, jargon-light description of a library exception."""
    text = " ".join(str(e).split()) or type(e).__name__
    # libsndfile messages look like "Error opening 'x.wav': Format not recognised."
    return text.split(": ", 1)[-1] if text.startswith("Error opening") else text


class _SoundFileSource:
    """Blocks from soundfile (regular files, or a whole stream buffered in BytesIO)."""

    def __init__(self, sf: "soundfile.SoundFile"):
        self._sf = sf
        self.sample_rate = sf.samplerate
        self.channels = sf.channels
        self.num_frames: int | None = sf.frames

    @classmethod
    def open(cls, file, name: str) -> "_SoundFileSource":
        try:
            sf = soundfile.SoundFile(file)
        except Exception as e:
            raise _open_error(file, name, e) from None
        if sf.channels < 1 or sf.samplerate < 1:
            sf.close()
            raise AudioError(f"audio has {sf.channels} channels at {sf.samplerate} Hz: {name}")
        return cls(sf)

    def read(self, n: int) -> np.ndarray:
        return self._sf.read(n, dtype="float32", always_2d=True)

    def close(self) -> None:
        self._sf.close()


def _open_error(file, name: str, e: Exception) -> AudioError:
    """Say "corrupt WAV" when it looked like a WAV, else "not an audio file"."""
    try:
        if isinstance(file, io.BytesIO):
            head = file.getvalue()[:12]
        else:
            with open(file, "rb") as f:
                head = f.read(12)
    except OSError as oe:
        return AudioError(f"cannot open {name}: {oe.strerror or oe}")
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return AudioError(f"truncated or corrupt WAV file: {name} ({_describe(e)})")
    return AudioError(f"not an audio file or unsupported format: {name}")


class _WavStreamSource:
    """A WAV read front to back from a non-seekable stream."""

    def __init__(self, stream, fmt: dict, data_size: int | None, owned: bool):
        self._stream = stream
        self._owned = owned
        self.sample_rate = fmt["sample_rate"]
        self.channels = fmt["channels"]
        self.num_frames = None
        self._decode = fmt["decode"]
        self._block_align = fmt["block_align"]
        self._remaining = data_size  # bytes left in the data chunk, None = to EOF

    @classmethod
    def open(cls, stream, head: bytes, name: str, owned: bool):
        """Parse the header up to the data chunk; `head` = the 12 sniffed bytes."""
        # Everything consumed is kept (unless huge) to replay it to soundfile
        # if the encoding turns out to be one we don't stream.
        kept, kept_all = bytearray(head), True
        fmt = None
        while True:
            chunk_header = read_exact(stream, 8)
            kept += chunk_header
            if len(chunk_header) < 8:
                raise AudioError(f"truncated WAV header (no data chunk): {name}")
            chunk_id, size = struct.unpack("<4sI", chunk_header)
            if chunk_id == b"data":
                break
            n = size + (size & 1)  # chunks are padded to an even size
            keep = chunk_id == b"fmt " or len(kept) + n <= _MAX_KEPT_HEADER_BYTES
            body = _read_or_skip(stream, n, keep)
            if body is None:
                raise AudioError(f"truncated WAV header in chunk {_chunk_name(chunk_id)}: {name}")
            kept += body
            kept_all = kept_all and keep
            if chunk_id == b"fmt ":
                fmt = _parse_fmt(body[:size], name)
        if fmt is None:
            raise AudioError(f"corrupt WAV: data chunk before fmt chunk: {name}")
        if fmt["decode"] is None:
            # An encoding we don't stream (A-law, ADPCM, ...): let libsndfile try
            # on the whole input, buffered, header bytes replayed first.
            if not kept_all:
                raise AudioError(f"unsupported WAV encoding on a pipe: {name}")
            data = bytes(kept) + stream.read()
            source = _SoundFileSource.open(io.BytesIO(data), name)
            source.num_frames = None
            if owned:
                stream.close()
            return source
        # Streaming writers cannot know the size: 0, 0xFFFFFFFF and sox's
        # 0x7FFFF000 all mean "until EOF".
        data_size = None if size == 0 or size >= 0x7FFFF000 else size
        return cls(stream, fmt, data_size, owned)

    def read(self, n: int) -> np.ndarray:
        want = n * self._block_align
        if self._remaining is not None:
            want = min(want, self._remaining)
        data = read_exact(self._stream, want)
        if self._remaining is not None:
            self._remaining -= len(data)
            if len(data) < want:
                self._remaining = 0  # EOF before the declared end: stop there
        whole = len(data) - len(data) % self._block_align  # drop a partial frame at EOF
        return self._decode(data[:whole]).reshape(-1, self.channels)

    def close(self) -> None:
        if self._owned:
            self._stream.close()


def _read_or_skip(stream, n: int, keep: bool) -> bytes | None:
    """Read n bytes (keep=True) or discard them in small pieces; None on EOF."""
    if keep:
        data = read_exact(stream, n)
        return data if len(data) == n else None
    left = n
    while left > 0:
        got = len(read_exact(stream, min(left, _SKIP_CHUNK_BYTES)))
        if got == 0:
            return None
        left -= got
    return b""


def _chunk_name(chunk_id: bytes) -> str:
    return repr(chunk_id.decode("latin-1"))


def _parse_fmt(body: bytes, name: str) -> dict:
    """Decode a fmt chunk into rate, channels, block size and a bytes->float32 decoder.

    `decode` is None for valid but unsupported encodings (handed to soundfile).
    """
    if len(body) < 16:
        raise AudioError(f"corrupt WAV: fmt chunk too short: {name}")
    tag, channels, sample_rate, _, block_align, _ = struct.unpack("<HHIIHH", body[:16])
    if tag == _WAVE_FORMAT_EXTENSIBLE:
        if len(body) < 40:
            raise AudioError(f"corrupt WAV: extensible fmt chunk too short: {name}")
        guid = body[24:40]
        tag = struct.unpack("<H", guid[:2])[0] if guid[2:] == _EXTENSIBLE_GUID_TAIL else None
    if channels == 0:
        raise AudioError(f"WAV declares zero channels: {name}")
    if sample_rate == 0:
        raise AudioError(f"WAV declares a sample rate of 0 Hz: {name}")
    # The container width comes from block_align: with EXTENSIBLE, `bits` may be
    # the valid bits (e.g. 20 in 24-bit containers).
    width = block_align // channels
    decode = None
    if width * channels == block_align and tag in (_WAVE_FORMAT_PCM, _WAVE_FORMAT_FLOAT):
        decode = _DECODERS.get((tag, width))
    return {"sample_rate": sample_rate, "channels": channels,
            "block_align": block_align, "decode": decode}


def _decode_u8(data: bytes) -> np.ndarray:
    return (np.frombuffer(data, np.uint8).astype(np.float32) - 128.0) / 128.0


def _decode_s16(data: bytes) -> np.ndarray:
    return np.frombuffer(data, "<i2").astype(np.float32) / 32768.0


def _decode_s24(data: bytes) -> np.ndarray:
    # Put the 3 bytes in the top of an int32 (low byte 0): sign extension for free.
    b = np.frombuffer(data, np.uint8).reshape(-1, 3)
    wide = np.zeros((len(b), 4), np.uint8)
    wide[:, 1:] = b
    return (wide.view("<i4")[:, 0] / 2147483648.0).astype(np.float32)


def _decode_s32(data: bytes) -> np.ndarray:
    return (np.frombuffer(data, "<i4") / 2147483648.0).astype(np.float32)


def _decode_f32(data: bytes) -> np.ndarray:
    return np.frombuffer(data, "<f4").astype(np.float32)


def _decode_f64(data: bytes) -> np.ndarray:
    return np.frombuffer(data, "<f8").astype(np.float32)


# Integer scaling matches libsndfile (divide by 2^(bits-1)), so a WAV reads the
# same from a file and from a pipe.
_DECODERS = {
    (_WAVE_FORMAT_PCM, 1): _decode_u8,
    (_WAVE_FORMAT_PCM, 2): _decode_s16,
    (_WAVE_FORMAT_PCM, 3): _decode_s24,
    (_WAVE_FORMAT_PCM, 4): _decode_s32,
    (_WAVE_FORMAT_FLOAT, 4): _decode_f32,
    (_WAVE_FORMAT_FLOAT, 8): _decode_f64,
}
