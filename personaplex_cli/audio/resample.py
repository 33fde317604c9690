"""Streaming resampling to the model rate and re-framing into fixed-size frames.

Mimi consumes exactly 1920 samples (80 ms at 24 kHz) per step, but a reader
yields arbitrary blocks and soxr's streaming resampler emits variable-size
chunks (e.g. 1660 then 2490 samples per 3840 in), so the pipeline is::

    reader.blocks(n) -> StreamResampler.process -> Reframer.push/pop_frames

soxr "HQ" was chosen over sphn/scipy/torchaudio for its tiny footprint and
-140 dB aliasing at 0.1-0.2 ms per second of audio (docs/audio-io.md §4).

Output length: `resampled_length(n, in_rate, out_rate)` is exactly how many
samples a `StreamResampler` emits in all (every `process()` plus `flush()`)
for n samples in, so a length can be written into a header before the audio
is resampled. The rule is libsoxr's own: at the end of input it completes
the output to ``(int64)((double)n / io_ratio + .5)`` samples, with
``io_ratio = (double)in_rate / out_rate`` (libsoxr's ``_soxr_flush``), i.e.
n * out_rate / in_rate rounded to nearest, ties decided by that double
arithmetic (24000 -> 44100 Hz: 1000 samples -> 1837, not 1838; 8000 ->
44100 Hz: 1000 -> 5513). Measured with soxr 1.1.0 for every quality, many
rates (1 kHz to 384 kHz, also 7919 and 23999 Hz), lengths and block
sizes: the total never depends on how the input is cut into blocks, only
the split between `process()` and `flush()` does. `flush()` still enforces
the rule (trimming or zero-padding its last output), so the count holds
even for a soxr that behaved otherwise.
"""

from typing import Iterator

import numpy as np
import soxr


def resampled_length(num_samples: int, in_rate: int, out_rate: int) -> int:
    """Exactly how many samples `StreamResampler(in_rate, out_rate)` emits for `num_samples`.

    n * out_rate / in_rate rounded to nearest the way libsoxr computes it (see
    the module docstring); `num_samples` itself when the rates are equal.
    """
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
    if in_rate <= 0 or out_rate <= 0:
        raise ValueError(f"sample rates must be positive, got {in_rate} -> {out_rate}")
    if in_rate == out_rate:
        return int(num_samples)
    io_ratio = float(in_rate) / float(out_rate)
    return int(float(num_samples) / io_ratio + 0.5)


class StreamResampler:
    """Resample a mono float32 stream block by block (soxr HQ).

    `process(block)` may return fewer or more samples than a proportional
    share: soxr holds back a filter delay that `flush()` releases at the end.
    When `in_rate == out_rate` both are exact pass-throughs: `process` returns
    its input unchanged (bit-exact, no filtering delay). In all, the outputs
    hold exactly `resampled_length(samples_in, in_rate, out_rate)` samples,
    however the input was cut into blocks.
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
        self.samples_in = 0  # fed so far
        self.samples_out = 0  # returned so far

    def process(self, block: np.ndarray) -> np.ndarray:
        """Feed a [n] float32 block; return the resampled samples available so far."""
        if self._flushed:
            raise ValueError("StreamResampler.process() called after flush()")
        block = np.asarray(block, dtype=np.float32)
        if block.ndim != 1:
            raise ValueError(f"expected a mono block shaped [n], got {list(block.shape)}")
        self.samples_in += len(block)
        out = block if self.passthrough else self._stream.resample_chunk(
            np.ascontiguousarray(block))
        self.samples_out += len(out)
        return out

    def flush(self) -> np.ndarray:
        """Signal the end of input; return the samples still held by the filter."""
        if self._flushed:
            return np.zeros(0, np.float32)
        self._flushed = True
        if self.passthrough:
            return np.zeros(0, np.float32)
        out = self._stream.resample_chunk(np.zeros(0, np.float32), last=True)
        # soxr already ends on the rule (module docstring); this only guards the count.
        owed = resampled_length(self.samples_in, self.in_rate, self.out_rate) - self.samples_out
        if owed < 0:  # process() returned more than the total: cannot be taken back
            raise RuntimeError(f"resampler emitted {-owed} samples more than its total")
        if len(out) > owed:
            out = out[:owed]
        elif len(out) < owed:
            out = np.concatenate([out, np.zeros(owed - len(out), np.float32)])
        self.samples_out += len(out)
        return out


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
