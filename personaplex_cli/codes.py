"""The `.mimi` file format for Mimi codec tokens, plus `.npy` interchange.

A `.mimi` file streams both ways: `encode` can emit each 80 ms frame as Mimi
produces it, and `decode` can start after the header, even on a pipe.

Byte layout (all integers little-endian)::

    offset  size  field
    0       4     magic b"MIMI"
    4       1     version, u8 = 1 (the major version; readers reject others)
    5       1     flags, u8: bit 0 = the num_frames field is valid,
                  bit 1 = the stream ends with a trailer (below)
    6       2     reserved = 0
    8       4     json_len, u32
    12      8     num_frames, u64 (0xFFFFFFFFFFFFFFFF = unknown; patched on
                  close when the file is seekable)
    20      N     JSON header, UTF-8, json_len bytes (may end in spaces)
    20+N    ...   frames until EOF (or until the trailer): num_codebooks x
                  uint16 per frame, frame-major (all codebooks of frame 0,
                  then frame 1, ...)

Trailer (only with flag bit 1), the last 21 bytes of the stream::

    0       4     magic b"MEND"
    4       8     num_frames, u64: the frames before the trailer
    12      8     num_samples, u64: as the JSON key (0xFFFFFFFFFFFFFFFF =
                  unknown)
    20      1     reserved = 0

A writer that cannot seek back (a pipe) and does not know num_samples when
it starts sets bit 1 and appends the trailer at `close()`, so the length
still reaches the reader, at the end. The format version stays 1: files
without bit 1 are exactly as before. The trailer's size is odd on purpose:
frames are 2 x num_codebooks bytes, so a reader that ignores bit 1 is left
with a partial frame at EOF and fails with a truncated-frame error (or
earlier, with an invalid-code error: b"ME" read as a code is 0x454D, above
the cardinality) instead of decoding the trailer as codes. A seekable file
never needs a trailer: num_frames and num_samples are patched into the
header instead.

JSON header keys::

    codec           "mimi"
    version         1 (format version)
    sample_rate     24000
    frame_rate      12.5
    frame_size      1920 (samples per frame at sample_rate)
    num_codebooks   1..32
    cardinality     2048 (codes are 0 <= c < cardinality)
    num_samples     original sample count at sample_rate, to trim the last
                    frame's padding on decode; null = unknown
    weights_sha256  hex digest identifying the Mimi weights, or null
    weights         optional "<hf repo>/<file>" of those weights, or null
    window          the attention window rule of the Mimi transformers that
                    made the codes: "nvidia" for `reply --codes-out` (the
                    conversation's decoder speaks them under NVIDIA's rule),
                    "kyutai" for `encode`; `decode` follows it, so that it
                    gives back the maker's audio exactly (the two rules part
                    once Mimi's window fills, about 20 frames in). Absent in
                    files from before the key: "kyutai", as decoded then.
    dtype           "uint16"
    layout          "frame-major"
    tool            "personaplex X.Y.Z"

Readers ignore unknown keys (kept in `CodeHeader.extra`).

The writer pads the JSON with trailing spaces to at least 512 bytes (JSON
parsers ignore trailing whitespace). A JSON header cannot grow once frames
follow it, so `num_samples` must be known up front or left null; the padding
lets `close(num_samples=N)` rewrite the JSON in place on a seekable file.
On a pipe neither num_frames nor num_samples can be patched: the trailer
carries them.

A reader stops at EOF on a frame boundary (or after num_frames frames when
that is valid); a partial trailing frame is an error, as is any code
>= cardinality. With bit 1 the reader holds back the last 21 bytes it has
read (it still streams: never more than the trailer plus one read), and at
EOF checks them: the magic, and that num_frames equals the frames read; a
stream that ends without a valid trailer is truncated. The reader's
`num_samples` (and `num_frames`) become known once `frames()` is exhausted.
Every error names the input ("x.mimi: truncated frame ...").

`.npy` (`save_npy`/`load_npy`): a uint16 array [num_codebooks, frames]; the
whole array is in memory, and pickled (object) arrays are never loaded.
"""

import io
import json
import os
import numbers
import struct
from dataclasses import dataclass, field, replace
from typing import Iterator

import numpy as np

from . import __version__
from .core.config import (CARDINALITY, CODEC_WINDOW, FRAME_RATE, FRAME_SIZE, SAMPLE_RATE,
                          WINDOWS)
from .errors import InputError
from .streams import read_exact

MAGIC = b"MIMI"
CODE_FORMATS = ("mimi", "npy")  # the code files written: this format, and plain NumPy


def code_suffix_problem(path: str) -> str | None:
    """Why `path` cannot be a code file's name: a suffix that names no code format (`.wav`,
    `.pt`); None when it names one or none (`-`, no suffix: .mimi)."""
    suffix = os.path.splitext(path)[1] if path != "-" else ""
    if suffix and suffix.lower().lstrip(".") not in CODE_FORMATS:
        return (f"cannot write codes to {path}: personaplex writes code files as .mimi or "
                ".npy (no suffix: .mimi)")
    return None
NPY_MAGIC = b"\x93NUMPY"
FORMAT_VERSION = 1
FLAG_NUM_FRAMES_VALID = 0x01
FLAG_TRAILER = 0x02
UNKNOWN_NUM_FRAMES = 0xFFFF_FFFF_FFFF_FFFF
UNKNOWN_NUM_SAMPLES = 0xFFFF_FFFF_FFFF_FFFF
TRAILER_MAGIC = b"MEND"
MAX_CODEBOOKS = 32
MIN_JSON_LEN = 512
MAX_JSON_LEN = 1 << 20  # refuse absurd headers instead of allocating them
SNIFF_BYTES = 8

_PREAMBLE = struct.Struct("<4sBBHIQ")  # magic, version, flags, reserved, json_len, num_frames
PREAMBLE_SIZE = _PREAMBLE.size  # 20
_TRAILER = struct.Struct("<4sQQB")  # magic, num_frames, num_samples, reserved
TRAILER_SIZE = _TRAILER.size  # 21: odd, see the module docstring
_REQUIRED_KEYS = ("codec", "sample_rate", "frame_rate", "frame_size", "num_codebooks",
                  "cardinality")
_KNOWN_KEYS = set(_REQUIRED_KEYS) | {"version", "num_samples", "weights_sha256", "weights",
                                     "window", "dtype", "layout", "tool"}
WINDOW_BEFORE_THE_KEY = CODEC_WINDOW  # what files without a "window" key were decoded with


class CodeFileError(InputError):
    """A malformed or unsupported code file, with a one-line human message."""


def _tool_string() -> str:
    return f"personaplex {__version__}"


@dataclass
class CodeHeader:
    """The JSON header of a `.mimi` file (see the module docstring for each key)."""

    num_codebooks: int
    num_samples: int | None = None
    weights_sha256: str | None = None
    weights: str | None = None
    window: str = WINDOW_BEFORE_THE_KEY
    sample_rate: int = SAMPLE_RATE
    frame_rate: float = FRAME_RATE
    frame_size: int = FRAME_SIZE
    cardinality: int = CARDINALITY
    codec: str = "mimi"
    tool: str = field(default_factory=_tool_string)
    extra: dict = field(default_factory=dict)  # unknown keys, preserved but unused

    def to_dict(self) -> dict:
        known = {
            "codec": self.codec, "version": FORMAT_VERSION,
            "sample_rate": int(self.sample_rate), "frame_rate": float(self.frame_rate),
            "frame_size": int(self.frame_size), "num_codebooks": int(self.num_codebooks),
            "cardinality": int(self.cardinality), "num_samples": _int_or_none(self.num_samples),
            "weights_sha256": self.weights_sha256, "weights": self.weights,
            "window": self.window, "dtype": "uint16", "layout": "frame-major",
            "tool": self.tool,
        }
        return {**self.extra, **known}

    @classmethod
    def from_dict(cls, d: dict) -> "CodeHeader":
        """Build and validate a header from parsed JSON; CodeFileError if invalid."""
        if not isinstance(d, dict):
            raise CodeFileError("code file header is not a JSON object")
        missing = [k for k in _REQUIRED_KEYS if k not in d]
        if missing:
            raise CodeFileError(f"code file header lacks required keys: {', '.join(missing)}")
        header = cls(
            num_codebooks=d["num_codebooks"], num_samples=d.get("num_samples"),
            weights_sha256=d.get("weights_sha256"), weights=d.get("weights"),
            window=d.get("window", WINDOW_BEFORE_THE_KEY), sample_rate=d["sample_rate"],
            frame_rate=d["frame_rate"], frame_size=d["frame_size"],
            cardinality=d["cardinality"], codec=d["codec"], tool=d.get("tool", ""),
            extra={k: v for k, v in d.items() if k not in _KNOWN_KEYS})
        if d.get("dtype", "uint16") != "uint16":
            raise CodeFileError(f"unsupported code dtype {d['dtype']!r} (expected 'uint16')")
        if d.get("layout", "frame-major") != "frame-major":
            raise CodeFileError(f"unsupported code layout {d['layout']!r} "
                                "(expected 'frame-major')")
        header.validate()
        return header

    def validate(self) -> None:
        """Raise CodeFileError if a field has a value this version cannot handle."""
        if self.codec != "mimi":
            raise CodeFileError(f"unsupported codec {self.codec!r} (expected 'mimi')")
        if not _is_int(self.num_codebooks) or not 1 <= self.num_codebooks <= MAX_CODEBOOKS:
            raise CodeFileError(f"num_codebooks must be 1..{MAX_CODEBOOKS}, "
                                f"got {self.num_codebooks!r}")
        if self.cardinality != CARDINALITY or not _is_int(self.cardinality):
            raise CodeFileError(f"cardinality must be {CARDINALITY}, got {self.cardinality!r}")
        for key in ("sample_rate", "frame_size"):
            value = getattr(self, key)
            if not _is_int(value) or value <= 0:
                raise CodeFileError(f"{key} must be a positive integer, got {value!r}")
        rate = self.frame_rate
        if not isinstance(rate, numbers.Real) or isinstance(rate, bool) or not rate > 0:
            raise CodeFileError(f"frame_rate must be a positive number, got {self.frame_rate!r}")
        ns = self.num_samples
        if ns is not None and (not _is_int(ns) or ns < 0):
            raise CodeFileError(f"num_samples must be a non-negative integer or null, "
                                f"got {self.num_samples!r}")
        for key in ("weights_sha256", "weights"):
            value = getattr(self, key)
            if value is not None and not isinstance(value, str):
                raise CodeFileError(f"{key} must be a string or null, got {value!r}")
        if self.window not in WINDOWS:
            raise CodeFileError(f"window must be one of {', '.join(map(repr, WINDOWS))}, "
                                f"got {self.window!r}")


def _is_int(x) -> bool:
    # Integral also admits numpy integers; JSON true/false parse as bool, an int
    # subclass, but are not a count.
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _int_or_none(x):
    # json.dumps cannot serialise numpy integers.
    return None if x is None else int(x)


def sniff_format(first_bytes: bytes) -> str | None:
    """"mimi", "npy" or None, from the first bytes of a file (`SNIFF_BYTES` suffice)."""
    if first_bytes.startswith(MAGIC):
        return "mimi"
    if first_bytes.startswith(NPY_MAGIC):
        return "npy"
    return None


# --- writing -------------------------------------------------------------------------


class CodeWriter:
    """Stream codes into a `.mimi` file; the header is written at construction.

    `write(codes)` takes integers shaped [num_codebooks, n] and flushes, so the
    file is readable while it is being written. `close()` patches num_frames
    (and `num_samples` if passed) when the file object can seek back; on one
    that cannot (a pipe) and without `header.num_samples`, flag bit 1 is set
    and `close()` appends the trailer instead (module docstring; `has_trailer`).
    The file object itself is left open (the caller owns it).
    """

    def __init__(self, fileobj, header: CodeHeader, num_frames: int | None = None):
        header.validate()
        if num_frames is not None and num_frames < 0:
            raise ValueError(f"num_frames must be >= 0, got {num_frames}")
        self.fileobj = fileobj
        self.header = replace(header, extra=dict(header.extra))  # close() may update our copy
        self.num_frames = num_frames
        self.frames_written = 0
        self.closed = False
        self._start = _tell_if_seekable(fileobj)
        self.has_trailer = self._start is None and header.num_samples is None
        body = _json_bytes(header)
        # Room to grow: "null" -> a 20-digit num_samples fits in the padding.
        self._json_len = max(MIN_JSON_LEN, len(body) + 64)
        fileobj.write(self._preamble(num_frames) + body.ljust(self._json_len, b" "))
        fileobj.flush()

    def _preamble(self, num_frames: int | None) -> bytes:
        flags = 0 if num_frames is None else FLAG_NUM_FRAMES_VALID
        if self.has_trailer:
            flags |= FLAG_TRAILER
        value = UNKNOWN_NUM_FRAMES if num_frames is None else num_frames
        return _PREAMBLE.pack(MAGIC, FORMAT_VERSION, flags, 0, self._json_len, value)

    def write(self, codes: np.ndarray) -> None:
        """Append frames: an integer array [num_codebooks, n]."""
        if self.closed:
            raise ValueError("write to a closed CodeWriter")
        codes = np.asarray(codes)
        k = self.header.num_codebooks
        if codes.ndim != 2 or codes.shape[0] != k:
            raise ValueError(f"expected codes shaped [{k}, n], got {list(codes.shape)}")
        if codes.dtype.kind not in "iu":
            raise ValueError(f"codes must be integers, got dtype {codes.dtype}")
        n = codes.shape[1]
        if n and (codes.min() < 0 or codes.max() >= self.header.cardinality):
            raise ValueError(f"codes must be in [0, {self.header.cardinality}), "
                             f"got range [{codes.min()}, {codes.max()}]")
        if self.num_frames is not None and self.frames_written + n > self.num_frames:
            raise ValueError(f"writing {n} frames would exceed the declared {self.num_frames} "
                             f"({self.frames_written} already written)")
        # [K, n] -> frame-major bytes: all codebooks of frame 0, then frame 1, ...
        self.fileobj.write(np.ascontiguousarray(codes.T).astype("<u2").tobytes())
        self.fileobj.flush()
        self.frames_written += n

    def close(self, num_samples: int | None = None) -> None:
        """Finish the file: patch the header (seekable) or append the trailer (`has_trailer`).

        On a pipe with `header.num_samples` known up front nothing can be
        patched: a `num_samples` given here is then ignored, and a declared
        num_frames larger than what was written leaves a file that readers
        report as truncated.
        """
        self._finish(num_samples, complete=True)

    def _finish(self, num_samples: int | None, complete: bool) -> None:
        if self.closed:
            return
        self.closed = True
        if num_samples is not None:
            self.header.num_samples = num_samples
            self.header.validate()
        if self._start is not None:
            self._patch(num_samples is not None)
        elif self.has_trailer and complete:
            samples = UNKNOWN_NUM_SAMPLES if num_samples is None else int(num_samples)
            self.fileobj.write(_TRAILER.pack(TRAILER_MAGIC, self.frames_written, samples, 0))
        self.fileobj.flush()

    def _patch(self, rewrite_json: bool) -> None:
        body = _json_bytes(self.header) if rewrite_json else b""
        if len(body) > self._json_len:  # cannot happen with the reserved padding
            raise ValueError("JSON header no longer fits in its reserved space")
        try:
            self.fileobj.flush()
            end = self.fileobj.tell()
            self.fileobj.seek(self._start)
            self.fileobj.write(self._preamble(self.frames_written))
            if rewrite_json:
                self.fileobj.write(body.ljust(self._json_len, b" "))
            self.fileobj.seek(end)
        except (OSError, ValueError):
            pass  # seekable() lied (some special files): the header stays as written

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        # After an error the stream gets no trailer: readers then report it as
        # truncated rather than taking a partial encode for a whole one.
        self._finish(None, complete=exc_type is None)


def _json_bytes(header: CodeHeader) -> bytes:
    return json.dumps(header.to_dict(), separators=(",", ":")).encode("utf-8")


def _tell_if_seekable(fileobj) -> int | None:
    try:
        return fileobj.tell() if fileobj.seekable() else None
    except (AttributeError, OSError, ValueError):
        return None


def _stream_name(fileobj) -> str:
    """A name for messages: the file's path, "stdin", else "input"."""
    name = getattr(fileobj, "name", None)
    if isinstance(name, str) and name:
        return "stdin" if name == "<stdin>" else name
    return "input"


# --- reading -------------------------------------------------------------------------


class CodeReader:
    """Read a `.mimi` file incrementally; works on pipes and on growing files.

    `prefix` = bytes already consumed from `fileobj` (e.g. by format sniffing
    on stdin); they are read first. `name` names the input in every error
    message (default: the file object's path, "stdin", or "input").

    Attributes: `header`; `num_frames` (None = unknown until the end);
    `num_samples` (the original length at `header.sample_rate`: the JSON
    value, or with a trailer (`has_trailer`) None until `frames()` is
    exhausted, then the trailer's value, which may itself be None);
    `frames_read`.
    """

    def __init__(self, fileobj, prefix: bytes = b"", name: str | None = None):
        self.name = _stream_name(fileobj) if name is None else name
        self._stream = _PrefixedStream(fileobj, prefix)
        try:
            self._read_header()
        except CodeFileError as e:
            raise self._error(e.message) from None

    def _error(self, message: str) -> CodeFileError:
        return CodeFileError(f"{self.name}: {message}")

    def _read_header(self) -> None:
        pre = self._stream.read_exact(PREAMBLE_SIZE)
        if len(pre) == 0:
            raise CodeFileError("not a .mimi code file (empty input)")
        if pre[:len(MAGIC)] != MAGIC[:len(pre)]:
            raise CodeFileError("not a .mimi code file")
        if len(pre) < PREAMBLE_SIZE:
            raise CodeFileError(f"truncated .mimi preamble ({len(pre)} of {PREAMBLE_SIZE} bytes)")
        magic, version, flags, _, json_len, num_frames = _PREAMBLE.unpack(pre)
        if version != FORMAT_VERSION:
            raise CodeFileError(f"unsupported .mimi format version {version} "
                                f"(this tool reads version {FORMAT_VERSION})")
        if json_len > MAX_JSON_LEN:
            raise CodeFileError(f"corrupt .mimi header: JSON length {json_len} is implausible")
        raw = self._stream.read_exact(json_len)
        if len(raw) < json_len:
            raise CodeFileError(f"truncated .mimi header ({len(raw)} of {json_len} JSON bytes)")
        try:
            parsed = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise CodeFileError(f"corrupt .mimi header: invalid JSON ({e})") from None
        self.header = CodeHeader.from_dict(parsed)
        valid = flags & FLAG_NUM_FRAMES_VALID and num_frames != UNKNOWN_NUM_FRAMES
        self.num_frames: int | None = num_frames if valid else None
        self._declared_frames = self.num_frames
        self.has_trailer = bool(flags & FLAG_TRAILER)
        self.num_samples: int | None = self.header.num_samples
        self.frames_read = 0
        self._frame_bytes = 2 * self.header.num_codebooks
        self._lookahead = b""  # trailer mode: bytes read but not yet known to be frames
        self._ended = False  # trailer mode: the trailer was read and checked

    def frames(self, max_frames: int = 1) -> Iterator[np.ndarray]:
        """Yield int64 arrays [num_codebooks, n], 1 <= n <= max_frames, until EOF.

        Each yield waits for `max_frames` whole frames (or EOF), so keep it
        small for low latency on a live pipe. Calling `frames()` again after
        EOF resumes where the last call stopped (for files still being written).
        """
        if max_frames < 1:
            raise ValueError(f"max_frames must be >= 1, got {max_frames}")
        if self.has_trailer:
            yield from self._frames_before_trailer(max_frames)
            return
        while True:
            want = max_frames
            if self.num_frames is not None:
                want = min(want, self.num_frames - self.frames_read)
                if want == 0:
                    return
            data = self._stream.read_exact(want * self._frame_bytes)
            whole = len(data) // self._frame_bytes
            if len(data) % self._frame_bytes:
                # Keep the partial bytes: a writer may still complete the frame.
                self._stream.unread(data[whole * self._frame_bytes:])
                if whole:
                    yield self._decode(data[:whole * self._frame_bytes], whole)
                raise self._error(
                    f"truncated frame at the end of the file (frame {self.frames_read}: "
                    f"{len(data) % self._frame_bytes} of {self._frame_bytes} bytes)")
            if whole:
                yield self._decode(data, whole)
            if whole < want:  # EOF
                if self.num_frames is not None:
                    raise self._error(f"truncated .mimi file: header declares "
                                      f"{self.num_frames} frames, found {self.frames_read}")
                return

    def _frames_before_trailer(self, max_frames: int) -> Iterator[np.ndarray]:
        """Frames of a stream that ends with a trailer: the last TRAILER_SIZE bytes
        read are held back until more bytes (or EOF) show whether they are frames."""
        fb = self._frame_bytes
        while not self._ended:
            need = max_frames * fb + TRAILER_SIZE
            self._lookahead += self._stream.read_exact(need - len(self._lookahead))
            if len(self._lookahead) >= need:
                data = self._lookahead[:max_frames * fb]
                self._lookahead = self._lookahead[max_frames * fb:]
                yield self._decode(data, max_frames)
                continue
            # EOF: what is left is the last frames and then the trailer.
            body_len = len(self._lookahead) - TRAILER_SIZE
            whole = max(body_len, 0) // fb
            trailer = self._lookahead[-TRAILER_SIZE:] if body_len >= 0 else b""
            if body_len < 0 or body_len % fb or trailer[:4] != TRAILER_MAGIC:
                raise self._error(f"truncated .mimi stream: it ends without its trailer "
                                  f"(after {self.frames_read + whole} whole frames)")
            _, num_frames, num_samples, _ = _TRAILER.unpack(trailer)
            if num_frames != self.frames_read + whole:
                raise self._error(f"corrupt .mimi trailer: it counts {num_frames} frames, "
                                  f"the stream holds {self.frames_read + whole}")
            if self._declared_frames is not None and num_frames != self._declared_frames:
                raise self._error(f"truncated .mimi file: header declares "
                                  f"{self._declared_frames} frames, found {num_frames}")
            if whole:
                yield self._decode(self._lookahead[:body_len], whole)
            self._lookahead = b""
            self._ended = True
            self.num_frames = num_frames
            if num_samples != UNKNOWN_NUM_SAMPLES:
                self.num_samples = num_samples

    def read_all(self) -> np.ndarray:
        """All remaining frames as one int64 array [num_codebooks, frames]."""
        parts = list(self.frames(max_frames=256))
        if not parts:
            return np.zeros((self.header.num_codebooks, 0), np.int64)
        return np.concatenate(parts, axis=1)

    def _decode(self, data: bytes, n: int) -> np.ndarray:
        codes = np.frombuffer(data, "<u2").reshape(n, self.header.num_codebooks)
        bad = codes >= self.header.cardinality
        if bad.any():
            t, k = np.argwhere(bad)[0]
            raise self._error(f"invalid code {codes[t, k]} >= cardinality "
                              f"{self.header.cardinality} in frame {self.frames_read + t} "
                              f"(codebook {k})")
        self.frames_read += n
        return codes.T.astype(np.int64)  # [K, n], a fresh contiguous copy


class _PrefixedStream:
    """A read-only byte stream that serves `prefix` (and unread bytes) before `fileobj`."""

    def __init__(self, fileobj, prefix: bytes = b""):
        self._fileobj = fileobj
        self._buf = bytes(prefix)

    def unread(self, data: bytes) -> None:
        self._buf = data + self._buf

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            data, self._buf = self._buf + self._fileobj.read(), b""
            return data
        if self._buf:
            data, self._buf = self._buf[:n], self._buf[n:]
            return data
        return self._fileobj.read(n)

    def read_exact(self, n: int) -> bytes:
        return read_exact(self, n)


# --- .npy interchange ---------------------------------------------------------------


def _validate_code_array(codes: np.ndarray, what: str) -> None:
    if codes.dtype.kind not in "iu":
        raise CodeFileError(f"{what}: codes must be integers, got dtype {codes.dtype}")
    if codes.ndim != 2:
        raise CodeFileError(f"{what}: expected a 2-D array [num_codebooks, frames], "
                            f"got shape {list(codes.shape)}")
    if not 1 <= codes.shape[0] <= MAX_CODEBOOKS:
        raise CodeFileError(f"{what}: first dimension (num_codebooks) must be 1..{MAX_CODEBOOKS}, "
                            f"got {codes.shape[0]}")
    if codes.size and (codes.min() < 0 or codes.max() >= CARDINALITY):
        raise CodeFileError(f"{what}: codes must be in [0, {CARDINALITY}), "
                            f"got range [{codes.min()}, {codes.max()}]")


def save_npy(fileobj, codes: np.ndarray) -> None:
    """Write codes [num_codebooks, frames] as a uint16 .npy (works on pipes)."""
    codes = np.asarray(codes)
    _validate_code_array(codes, "cannot save codes")
    # Serialise into memory first: numpy's direct file path seeks/dups the fd,
    # which fails on pipes; codes are small (1 h x 8 codebooks = 720 kB).
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.ascontiguousarray(codes, dtype="<u2"), allow_pickle=False)
    fileobj.write(buf.getvalue())
    fileobj.flush()


def load_npy(fileobj, prefix: bytes = b"", name: str | None = None) -> np.ndarray:
    """Read and validate a .npy of codes; return int64 [num_codebooks, frames].

    `prefix` = bytes already consumed from `fileobj` by sniffing; `name` names
    the input in error messages (default as for `CodeReader`).
    """
    name = _stream_name(fileobj) if name is None else name
    stream = _PrefixedStream(fileobj, prefix)
    try:
        # Not allow_pickle: an object array in a .npy can run arbitrary code.
        codes = np.lib.format.read_array(stream, allow_pickle=False)
    except (ValueError, OSError, EOFError, SyntaxError, TypeError) as e:
        raise CodeFileError(f"{name}: not a valid .npy code file: "
                            f"{' '.join(str(e).split())}") from None
    _validate_code_array(codes, f"{name}: invalid .npy codes")
    return codes.astype(np.int64)
