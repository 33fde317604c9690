"""Reading audio from files and pipes as a stream of float32 mono blocks.

`open_audio(path)` returns an `AudioReader`; `reader.blocks(n)` yields mono
float32 arrays (channels averaged), so memory stays flat on long inputs.

Where the samples come from:

* regular files: `soundfile.SoundFile`, read block by block (any format
  libsndfile knows: WAV, FLAC, OGG/Vorbis, OGG/Opus, MP3, AIFF, ...);
* ``-`` (stdin) and other non-seekable inputs (FIFOs, ``/dev/stdin``,
  ``<(cmd)``): the first 12 bytes are sniffed. A RIFF/WAVE stream is parsed
  here (PCM u8/s16/s24/s32, float 32/64, also WAVE_FORMAT_EXTENSIBLE, unknown
  chunks skipped by reading) and streamed without seeking. Anything else
  (FLAC/OGG/MP3 cannot be decoded from a pipe by libsndfile,
  docs/audio-io.md §1) is buffered whole in memory and handed to soundfile.

Block reads give exactly the samples of a whole-file `soundfile.read()`, for
every format and block size. soundfile's own `SoundFile.read(n)` does not:
after every read it seeks back to "the current position", and for MP3 such a
seek re-synchronises libmpg123 without the bit reservoir of the previous
frames (visible as "part2_3_length ... too large" lines on stderr, and
samples that differ: by up to 0.06 on test speech, more on noise). So
blocks are read with libsndfile's `sf_readf_float` directly and the file is
never seeked while being read. The one seek is to frame 0 right after
opening, as `soundfile.read()` does: for MP3 a fresh open and a seek to 0
decode to (last-bit) different samples, and the whole-file read is the
reference.

Length (`num_frames`, None = unknown) is only ever exact: when it is not
None, `blocks()` yields exactly that many frames or raises `AudioError`.
`declared_frames` is what the input claims: the same, except for a WAV
streamed from a pipe, whose header's count nothing can check up front.

* WAV on a pipe: `num_frames` is None. `declared_frames` is the data
  chunk's size, unless it is a placeholder (0, ``0xFFFFFFFF``, or >=
  ``0x7FFFF000`` as sox writes): then None too. The stream is read up to
  the declared size (chunks may follow it), or to EOF.
* libsndfile's count, for files and buffered pipes alike, where it is exact:
  WAV/AIFF/... (from the header and the bytes present), FLAC (STREAMINFO),
  OGG Vorbis and Opus (from the last page's granule position).
* MP3: libsndfile's count is an estimate from the bitrate unless the file
  has a Xing/Info tag (e.g. 164935 claimed, 164160 decoded), so an MP3 is
  counted by decoding it once when opened, discarding the samples (about
  0.3-0.5 s per 10 minutes of 44.1 kHz stereo). A FLAC whose STREAMINFO
  lacks the count (written to a pipe) is counted the same way.

A WAV file whose data chunk is shorter than its header declares is
truncated, an `AudioError` ("truncated WAV: in.wav ends after 1.23 s of the
2.46 s its header declares"): the RIFF header is checked against the bytes
present when it is opened (libsndfile would silently read the shorter
data). On a pipe the same shortfall is no error: a writer that cannot seek
back writes an estimate there (sox converting an MP3 declares its estimated
length, and cannot correct it afterwards), so the stream is read to its end
and `open_audio`'s `warn` is told so in one line, once EOF arrives early
(for a streamed WAV) or when it is opened (a buffered one). Placeholder
sizes never count as truncation. Not a whole sample frame
missing (a file cut a byte or so short, inside its last frame) is tolerated:
that last frame reads as silence, from a file and from a pipe, so the length
stays what the header declares. For other formats an input that ends before
the length libsndfile reported is reported as truncated the same way.

libmpg123 (inside libsndfile) prints warnings and errors with C stdio on the
process's stderr. Around every libsndfile call the C library's ``stderr``
stream pointer is pointed at /dev/null (`clib.c_stderr_muted`): nothing the
library says reaches the user, while Python's own stderr (fd 2, used by the
CLI, rich and warnings in other threads) is untouched. Only where that
pointer cannot be found (e.g. Windows) file descriptor 2 itself is
redirected, for the duration of each call only.

Every failure is an `AudioError` with a one-line message; soundfile/cffi
exceptions never escape.
"""

import io
import os
import stat
import struct
import sys
from typing import Callable, Iterator

import numpy as np
import soundfile

from ..clib import c_stderr_muted
from ..streams import read_exact
from ..errors import AudioError

STDIN = "-"
_SNIFF_BYTES = 12
_MAX_KEPT_HEADER_BYTES = 16 << 20  # header bytes kept for the soundfile fallback
_SKIP_CHUNK_BYTES = 1 << 16
_COUNT_BLOCK_FRAMES = 1 << 16  # frames per call while counting an MP3 or FLAC
_SF_COUNT_MAX = 0x7FFF_FFFF_FFFF_FFFF  # libsndfile's "length unknown"
_PLACEHOLDER_MIN = 0x7FFFF000  # WAV data sizes from here up mean "until EOF" (sox, ffmpeg)
# KSDATAFORMAT_SUBTYPE_* GUIDs end with these 14 bytes; the first 2 are the format tag.
_EXTENSIBLE_GUID_TAIL = b"\x00\x00\x00\x00\x10\x00\x80\x00\x00\xaa\x00\x38\x9b\x71"
_WAVE_FORMAT_PCM, _WAVE_FORMAT_FLOAT, _WAVE_FORMAT_EXTENSIBLE = 1, 3, 0xFFFE
# Formats whose libsndfile length may be an estimate or unknown, and cheap to decode.
_COUNTED_FORMATS = ("MP3", "FLAC")

Warn = Callable[[str], None]  # says one line to the user (the CLI's `Output.warn`)


class AudioReader:
    """A stream of audio: `sample_rate`, `channels`, `num_frames` (exact, or None =
    unknown), `declared_frames` (what the input claims), `blocks(n)`.

    `num_frames`, when known, is exact: `blocks()` yields that many frames or raises.
    """

    def __init__(self, source, name: str, warn: Warn | None = None):
        self._source = source
        self.name = name
        self.sample_rate: int = source.sample_rate
        self.channels: int = source.channels
        self.num_frames: int | None = source.num_frames
        self.declared_frames: int | None = source.declared_frames
        self._warn = warn
        self._frames_read = 0

    @property
    def duration(self) -> float | None:
        """The declared length in seconds, when there is one (for progress and messages;
        exact unless the input is a WAV on a pipe)."""
        n = self.declared_frames
        return None if n is None else n / self.sample_rate

    def blocks(self, n: int) -> Iterator[np.ndarray]:
        """Yield mono float32 arrays of `n` samples; the last one may be shorter."""
        if n < 1:
            raise ValueError(f"block size must be >= 1, got {n}")
        limit = self.declared_frames
        while True:
            want = n
            if limit is not None:
                want = min(n, limit - self._frames_read)
                if want <= 0:
                    return
            block = self._read(want)  # [m, channels], m <= want
            if len(block):
                self._check_finite(block)
                self._frames_read += len(block)
                yield _mixdown(block)
            if len(block) < want:  # sources only return short blocks at EOF
                if limit is not None:
                    self._ended_early(limit)
                return

    def _ended_early(self, declared: int) -> None:
        have, want = _durations(self._frames_read, declared, self.sample_rate)
        if self.num_frames is not None:  # an exact length: data is missing
            raise AudioError(_truncated(self._source.format_name, self.name, have, want))
        if self._warn is not None:  # a pipe's header may only estimate it: not an error
            self._warn(_estimate_was_long(self.name, have, want))

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


def open_audio(path, warn: Warn | None = None, *, count: bool = True) -> AudioReader:
    """Open a file path (str/PathLike) or ``-`` for stdin; raise AudioError if unreadable.

    `warn` hears of a stream from a pipe that ends before its WAV header says it would
    (read to its end all the same; see the module docstring). With count=False a file
    whose length only decoding would tell (an MP3, a FLAC without its count) is not
    decoded to count it: its length is unknown (None), for a reader that stops at a limit
    of its own (serve's uploads)."""
    if isinstance(path, str) and path == STDIN:
        return _open_stream(sys.stdin.buffer, "stdin", owned=False, warn=warn)
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
        return _open_stream(stream, name, owned=True, warn=warn)
    if st.st_size == 0:
        raise AudioError(f"empty file: {name}")
    return AudioReader(_SoundFileSource.open(name, name, count=count), name)


def check_readable(path) -> None:
    """Read a regular file through once (decoded, nothing kept): AudioError unless it is
    audio throughout, every sample finite, and holds at least one sample. For a check
    before the model loads; a pipe or FIFO cannot be read twice and is not checked here."""
    with open_audio(path) as reader:
        samples = sum(len(block) for block in reader.blocks(1 << 16))
    if samples == 0:
        raise AudioError(f"{os.fspath(path)} holds no audio samples")


def _open_stream(stream, name: str, owned: bool, warn: Warn | None) -> AudioReader:
    """Open a non-seekable byte stream: stream WAV, buffer everything else."""
    try:
        head = read_exact(stream, _SNIFF_BYTES)
        if not head:
            raise AudioError(f"empty input: {name}")
        if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
            source = _WavStreamSource.open(stream, head, name, owned, warn)
        else:
            data = head + stream.read()
            if owned:
                stream.close()
            source = _SoundFileSource.open(data, name)
    except OSError as e:
        if owned:
            stream.close()
        raise AudioError(f"cannot read {name}: {e.strerror or e}") from None
    except BaseException:
        if owned:
            stream.close()
        raise
    return AudioReader(source, name, warn)


def _mixdown(block: np.ndarray) -> np.ndarray:
    """[m, channels] -> [m] by averaging channels (the usual downmix; no gain change for mono)."""
    if block.shape[1] == 1:
        return np.ascontiguousarray(block[:, 0], dtype=np.float32)
    return block.mean(axis=1, dtype=np.float32)


def _describe(e: BaseException) -> str:
    """A one-line, jargon-light description of a library exception."""
    text = " ".join(str(e).split()) or type(e).__name__
    # libsndfile messages look like "Error opening 'x.wav': Format not recognised."
    # or "Error : flac decoder lost sync."
    if text.startswith("Error opening"):
        return text.split(": ", 1)[-1]
    return text[len("Error : "):] if text.startswith("Error : ") else text


def _durations(got: int, declared: int, sample_rate: int) -> tuple[str, str]:
    """('1.23 s', '2.46 s'), or counts of samples where the seconds would look equal."""
    have, want = f"{got / sample_rate:.2f} s", f"{declared / sample_rate:.2f} s"
    if have == want:
        have, want = f"{got} samples", f"{declared} samples"
    return have, want


def _truncated(kind: str, name: str, have: str, want: str) -> str:
    """'truncated WAV: x.wav ends after 1.23 s of the 2.46 s its header declares'."""
    return f"truncated {kind}: {name} ends after {have} of the {want} its header declares"


def _estimate_was_long(name: str, have: str, want: str) -> str:
    return (f"{name} ends after {have} of the {want} its WAV header declares, a length "
            f"that writers on a pipe can only estimate; using the {have} it holds")


_quiet = c_stderr_muted  # libmpg123 reports its recoverable decoding errors there


# --- soundfile (regular files, buffered pipes) ----------------------------------------


class _SoundFileSource:
    """Blocks from libsndfile: a regular file, or a whole stream buffered in memory."""

    def __init__(self, sf: "soundfile.SoundFile", num_frames: int | None, pad_frames: int = 0):
        self._sf = sf
        self.sample_rate = sf.samplerate
        self.channels = sf.channels
        self.num_frames = self.declared_frames = num_frames
        self.format_name = "WAV" if sf.format in ("WAV", "WAVEX") else sf.format
        self._pad_frames = pad_frames  # zero frames owed at EOF (a WAV cut inside its last frame)

    @classmethod
    def open(cls, file, name: str, pipe_warn: Warn | None = None, *,
             count: bool = True) -> "_SoundFileSource":
        """`file`: a path, or the bytes of a whole buffered input. `pipe_warn`, for a WAV
        buffered from a pipe: told when the data is shorter than its header declares."""
        sf = _open_soundfile(file, name)
        try:
            if sf.channels < 1 or sf.samplerate < 1:
                raise AudioError(f"audio has {sf.channels} channels at {sf.samplerate} Hz: "
                                 f"{name}")
            with _quiet:
                if sf.seekable():
                    sf.seek(0)  # as soundfile.read() does (see the module docstring)
            num_frames, pad = _exact_length(sf, file, name, pipe_warn, count)
            return cls(sf, num_frames, pad)
        except BaseException:
            _close_soundfile(sf)
            raise

    def read(self, n: int) -> np.ndarray:
        out = _read_frames(self._sf, n)
        if len(out) < n and self._pad_frames:
            pad = min(self._pad_frames, n - len(out))
            self._pad_frames -= pad
            out = np.concatenate([out, np.zeros((pad, self.channels), np.float32)])
        return out

    def close(self) -> None:
        _close_soundfile(self._sf)


def _open_soundfile(file, name: str) -> "soundfile.SoundFile":
    # A path goes as bytes: soundfile encodes a str path strictly, so a name that is not
    # UTF-8 (its bytes kept as surrogates) would fail as if the file were corrupt.
    try:
        with _quiet:
            return soundfile.SoundFile(io.BytesIO(file) if isinstance(file, bytes)
                                       else os.fsencode(file))
    except Exception as e:
        raise _open_error(file, name, e) from None


def _close_soundfile(sf: "soundfile.SoundFile") -> None:
    with _quiet:
        sf.close()


def _read_frames(sf: "soundfile.SoundFile", n: int) -> np.ndarray:
    """Up to n frames [m, channels] float32 from the current position, m < n only at EOF.

    Calls libsndfile directly: soundfile's `read()` seeks after every read,
    which changes what libmpg123 decodes (module docstring).
    """
    out = np.empty((n, sf.channels), np.float32)
    got = 0
    handle = sf._file  # soundfile's SNDFILE *
    with _quiet:
        while got < n:
            ptr = soundfile._ffi.cast("float *", out[got:].ctypes.data)
            k = soundfile._snd.sf_readf_float(handle, ptr, n - got)
            err = soundfile._snd.sf_error(handle)
            if err:
                soundfile._error_check(err)  # raises soundfile's error with libsndfile's text
            if k <= 0:
                break
            got += k
    return out[:got]


def _exact_length(sf: "soundfile.SoundFile", file, name: str,
                  pipe_warn: Warn | None, count: bool = True) -> tuple[int | None, int]:
    """(exact frame count or None, zero frames to append at EOF) for an opened input."""
    frames = sf.frames
    if sf.format in ("WAV", "WAVEX"):
        declared = _check_wav_data(file, name, sf.samplerate, pipe_warn)
        if declared is not None and 0 <= declared - frames <= 1:
            return declared, declared - frames
    if sf.format == "MP3" or not 0 <= frames < _SF_COUNT_MAX:
        # An MP3's count is an estimate unless a Xing/Info tag holds it; a FLAC written
        # to a pipe leaves it out. Both decode fast: count them.
        counted = count and sf.format in _COUNTED_FORMATS
        return (_count_frames(file, name), 0) if counted else (None, 0)
    return frames, 0


def _count_frames(file, name: str) -> int:
    """Decode the whole input once, discarding the samples, exactly as `read()` will."""
    sf = _open_soundfile(file, name)
    try:
        with _quiet:
            if sf.seekable():
                sf.seek(0)
        total = 0
        while True:
            got = len(_read_frames(sf, _COUNT_BLOCK_FRAMES))
            total += got
            if got < _COUNT_BLOCK_FRAMES:
                return total
    except AudioError:
        raise
    except Exception as e:
        raise AudioError(f"cannot read {name}: {_describe(e)}") from None
    finally:
        _close_soundfile(sf)


def _check_wav_data(file, name: str, sample_rate: int, pipe_warn: Warn | None) -> int | None:
    """Compare a RIFF/WAVE header's data size with the bytes present: a truncated file is an
    AudioError; of bytes buffered from a pipe, `pipe_warn` is told instead.

    Returns the frame count the header declares for PCM/float data (None if
    the size is a placeholder, the encoding is compressed, the header
    cannot be walked, or it declares more than a pipe brought; libsndfile's
    count of the frames present is used then).
    """
    try:
        if isinstance(file, bytes):
            info = _walk_riff(io.BytesIO(file), len(file))
        else:
            with open(file, "rb") as f:
                info = _walk_riff(f, os.fstat(f.fileno()).st_size)
    except OSError:
        return None
    if info is None:
        return None
    data_size, present, block_align, byte_rate, linear = info
    if data_size == 0 or data_size >= _PLACEHOLDER_MIN or block_align == 0:
        return None
    if data_size - present >= block_align:  # at least one whole sample frame missing
        if linear:
            have, want = _durations(present // block_align, data_size // block_align,
                                    sample_rate)
        else:
            rate = byte_rate or block_align * sample_rate
            have, want = f"{present / rate:.2f} s", f"{data_size / rate:.2f} s"
        if isinstance(file, bytes):  # buffered from a pipe: the header may be an estimate
            if pipe_warn is not None:
                pipe_warn(_estimate_was_long(name, have, want))
            return None
        raise AudioError(_truncated("WAV", name, have, want))
    return data_size // block_align if linear else None


def _walk_riff(f, file_size: int):
    """-> (data_size, data bytes present, block_align, byte_rate, linear PCM/float) or None."""
    head = f.read(12)
    if len(head) < 12 or head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        return None
    pos, fmt = 12, None
    while pos + 8 <= file_size:
        f.seek(pos)
        chunk_id, size = struct.unpack("<4sI", f.read(8))
        if chunk_id == b"data":
            if fmt is None:
                return None
            present = max(0, min(size, file_size - (pos + 8)))
            return (size, present) + fmt
        if chunk_id == b"fmt ":
            body = f.read(min(size, 40))
            if len(body) < 16:
                return None
            tag, channels, _, byte_rate, block_align, _ = struct.unpack("<HHIIHH", body[:16])
            if tag == _WAVE_FORMAT_EXTENSIBLE and len(body) >= 40 \
                    and body[26:40] == _EXTENSIBLE_GUID_TAIL:
                tag = struct.unpack("<H", body[24:26])[0]
            linear = tag in (_WAVE_FORMAT_PCM, _WAVE_FORMAT_FLOAT) and channels > 0 \
                and block_align % channels == 0
            fmt = (block_align, byte_rate, linear)
        pos += 8 + size + (size & 1)  # chunks are padded to an even size
    return None


def _open_error(file, name: str, e: Exception) -> AudioError:
    """Say "corrupt WAV" when it looked like a WAV, else "not an audio file"."""
    try:
        if isinstance(file, bytes):
            head = file[:12]
        else:
            with open(file, "rb") as f:
                head = f.read(12)
    except OSError as oe:
        return AudioError(f"cannot open {name}: {oe.strerror or oe}")
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return AudioError(f"truncated or corrupt WAV file: {name} ({_describe(e)})")
    return AudioError(f"not an audio file or unsupported format: {name}")


# --- WAV streamed from a pipe -----------------------------------------------------------


class _WavStreamSource:
    """A WAV read front to back from a non-seekable stream."""

    format_name = "WAV"

    num_frames = None  # a header on a pipe may only estimate the length (module docstring)

    def __init__(self, stream, fmt: dict, data_size: int | None, owned: bool):
        self._stream = stream
        self._owned = owned
        self.sample_rate = fmt["sample_rate"]
        self.channels = fmt["channels"]
        self._decode = fmt["decode"]
        self._block_align = fmt["block_align"]
        self._data_size = data_size  # the declared data chunk size, None = until EOF
        self._bytes_read = 0
        self.declared_frames = None if data_size is None else data_size // self._block_align
        self._frames_out = 0

    @classmethod
    def open(cls, stream, head: bytes, name: str, owned: bool, warn: Warn | None):
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
            if owned:
                stream.close()
            return _SoundFileSource.open(data, name, pipe_warn=warn)
        # Streaming writers cannot know the size: 0, 0xFFFFFFFF and sox's
        # 0x7FFFF000 all mean "until EOF".
        data_size = None if size == 0 or size >= _PLACEHOLDER_MIN else size
        return cls(stream, fmt, data_size, owned)

    def read(self, n: int) -> np.ndarray:
        ba = self._block_align
        if self.declared_frames is not None:
            n = min(n, self.declared_frames - self._frames_out)
        want = n * ba
        data = read_exact(self._stream, want)
        self._bytes_read += len(data)
        whole = len(data) - len(data) % ba  # a partial frame at EOF is dropped...
        frames = self._decode(data[:whole]).reshape(-1, self.channels)
        if len(data) < want and self._data_size is not None \
                and self._data_size - self._bytes_read < ba:
            # ...unless less than a frame of the declared data is missing: then the
            # header's last frame reads as silence, as from a file (module docstring).
            missing = n - len(frames)
            frames = np.concatenate([frames, np.zeros((missing, self.channels), np.float32)])
        self._frames_out += len(frames)
        return frames

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
