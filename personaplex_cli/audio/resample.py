"""Streaming resampling to the model rate and re-framing into fixed-size frames.

Mimi consumes exactly 1920 samples (80 ms at 24 kHz) per step, but a reader
yields arbitrary blocks and soxr's streaming resampler emits variable-size
chunks (e.g. 1660 then 2490 samples per 3840 in), so the pipeline is::

    reader.blocks(n) -> StreamResampler.process -> Reframer.push/pop_frames

soxr "HQ" was chosen over sphn/scipy/torchaudio for its tiny footprint and
-140 dB aliasing at 0.1-0.2 ms per second of audio (docs/audio-io.md §4).
"""

from typing import Iterator

import numpy as np
import soxr


class StreamResampler:
    """Resample a mono float32 stream block by block (soxr HQ).

    `process(block)` may return fewer or more samples than a proportional
    share: soxr holds back a filter delay that `flush()` releases at the end.
    When `in_rate == out_rate` both are exact pass-throughs: `process` returns
    its input unchanged (bit-exact, no filtering delay).
    """

    def __init__(self, in_rate: int, out_rate: int, quality: str = "HQ"):
        if in_rate <= 0 or out_rate <= 0:
            raise ValueError(f"sample rates must be positive, got {in_rate} -> {out_rate}")
        self.in_rate = in_rate
        self.out_rate = out_rate
        self.passthrough = in_rate == out_rate
        self._stream = None if self.passthrough else soxr.ResampleStream(
            in_rate, out_rate, 1, dtype="float32", quality=quality)
        self._flushed = False

    def process(self, block: np.ndarray) -> np.ndarray:
        """Feed a [n] float32 block; return the resampled samples available so far."""
        if self._flushed:
            raise ValueError("StreamResampler.process() called after flush()")
        block = np.asarray(block, dtype=np.float32)
        if block.ndim != 1:
            raise ValueError(f"expected a mono block shaped [n], got {list(block.shape)}")
        if self.passthrough:
            return block
        return self._stream.resample_chunk(np.ascontiguousarray(block))

    def flush(self) -> np.ndarray:
        """Signal the end of input; return the samples still held by the filter."""
        if self._flushed:
            return np.zeros(0, np.float32)
        self._flushed = True
        if self.passthrough:
            return np.zeros(0, np.float32)
        return self._stream.resample_chunk(np.zeros(0, np.float32), last=True)


class Reframer:
    """FIFO that turns arrays of any length into frames of exactly `frame_size` samples.

    `push(x)` as data arrives, `pop_frames()` to take every complete frame,
    and at the end `flush_padded()` for the zero-padded remainder.
    """

    def __init__(self, frame_size: int, dtype=np.float32):
        if frame_size < 1:
            raise ValueError(f"frame_size must be >= 1, got {frame_size}")
        self.frame_size = frame_size
        self.dtype = np.dtype(dtype)
        self._chunks: list[np.ndarray] = []
        self._pending = 0

    @property
    def pending(self) -> int:
        """Samples buffered and not yet returned."""
        return self._pending

    def push(self, x: np.ndarray) -> None:
        x = np.asarray(x, dtype=self.dtype)
        if x.ndim != 1:
            raise ValueError(f"expected a 1-D array, got {list(x.shape)}")
        if len(x):
            # Copy: the caller may reuse its buffer (e.g. a sounddevice callback).
            self._chunks.append(x.copy())
            self._pending += len(x)

    def pop_frames(self) -> list[np.ndarray]:
        """Return every complete frame buffered so far (possibly none)."""
        n_frames = self._pending // self.frame_size
        if n_frames == 0:
            return []
        buf = self._take_all()
        used = n_frames * self.frame_size
        frames = list(buf[:used].reshape(n_frames, self.frame_size))
        if used < len(buf):
            # Copy the remainder so the big concatenated buffer can be freed.
            self._chunks = [buf[used:].copy()]
            self._pending = len(buf) - used
        return frames

    def iter_frames(self) -> Iterator[np.ndarray]:
        """Like `pop_frames`, as an iterator."""
        yield from self.pop_frames()

    def flush_padded(self) -> tuple[np.ndarray | None, int]:
        """Return (last partial frame zero-padded to frame_size, real sample count).

        Returns (None, 0) when nothing is buffered. Call `pop_frames()` first:
        complete frames are never returned here.
        """
        if self._pending >= self.frame_size:
            raise ValueError("complete frames are still buffered: call pop_frames() first")
        if self._pending == 0:
            return None, 0
        buf = self._take_all()
        frame = np.zeros(self.frame_size, self.dtype)
        frame[:len(buf)] = buf
        return frame, len(buf)

    def _take_all(self) -> np.ndarray:
        buf = self._chunks[0] if len(self._chunks) == 1 else np.concatenate(self._chunks)
        self._chunks, self._pending = [], 0
        return buf
