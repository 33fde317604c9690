"""Audio as the model hears and speaks it: 24 kHz mono, 1920-sample (80 ms) frames.

`InputFrames` turns any readable input into model frames: read in blocks, mix to mono,
resample with soxr, cut into frames, zero-pad the last. `OutputPcm` takes the model's 24 kHz
PCM to the output rate, block by block. Every command that reads or writes audio (encode,
decode, reply, talk) goes through these two, so all of them treat audio alike.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

import numpy as np

from ..core.config import FRAME_SIZE, SAMPLE_RATE
from .io import AudioReader
from .resample import Reframer, StreamResampler, resampled_length

BLOCK_SECONDS = 0.2  # how much of the input is read per call


class InputFrames:
    """Model frames of one input. `expected_samples` (at 24 kHz, before padding) is known up
    front whenever the input's exact length is; `declared_samples` is what the input claims
    (the same, or a WAV header's count on a pipe, which may be more than arrives);
    `samples` counts what was actually read. An output may declare `declared_samples` only
    where a shortfall is mended (a WAV writer patches its header, or pads a pipe); a count
    that must hold (a .mimi header) is `expected_samples`."""

    def __init__(self, reader: AudioReader, *, progress: Callable[[float], None] | None = None):
        self.reader = reader
        self.progress = progress
        self.samples = 0
        self.expected_samples = self._at_model_rate(reader.num_frames)
        self.declared_samples = self._at_model_rate(reader.declared_frames)

    def _at_model_rate(self, frames: int | None) -> int | None:
        if frames is None:
            return None
        return resampled_length(frames, self.reader.sample_rate, SAMPLE_RATE)

    @property
    def expected_frames(self) -> int | None:
        n = self.expected_samples
        return None if n is None else -(-n // FRAME_SIZE)

    def _resampled(self) -> Iterator[np.ndarray]:
        resampler = StreamResampler(self.reader.sample_rate, SAMPLE_RATE)
        block = max(1, int(self.reader.sample_rate * BLOCK_SECONDS))
        for samples in self.reader.blocks(block):
            yield resampler.process(samples)
            if self.progress is not None:
                self.progress(len(samples) / self.reader.sample_rate)
        yield resampler.flush()

    def chunks(self, max_frames: int) -> Iterator[np.ndarray]:
        """Arrays of 1..max_frames whole frames ([n * 1920] float32); the last frame is
        zero-padded. Nothing for an input without samples."""
        framer = Reframer(FRAME_SIZE)
        pending: list[np.ndarray] = []
        for samples in self._resampled():
            self.samples += len(samples)
            framer.push(samples)
            pending += framer.pop_frames()
            while len(pending) >= max_frames:
                yield np.concatenate(pending[:max_frames])
                pending = pending[max_frames:]
        last, _ = framer.flush_padded()
        if last is not None:
            pending.append(last)
        if pending:
            yield np.concatenate(pending)

    def __iter__(self) -> Iterator[np.ndarray]:
        """One frame [1920] at a time."""
        yield from self.chunks(1)


def frames_with_tail(frames: Iterable[np.ndarray], tail_samples: int = 0
                     ) -> Iterator[tuple[np.ndarray, int]]:
    """(frame, how many samples of the answer to it to keep): the input's frames, then
    silence for `tail_samples` more. The answer is as long as the input plus the tail: the
    input's `samples` (InputFrames counts them), else its whole frames. `reply` and `talk
    --input` trim through this one rule, which keeps their outputs equal."""
    emitted = 0
    held = None
    for frame in frames:
        if held is not None:
            yield held, FRAME_SIZE
            emitted += FRAME_SIZE
        held = frame
    total = getattr(frames, "samples", None)
    if total is None:
        total = emitted + (FRAME_SIZE if held is not None else 0)
    total += tail_samples
    silence = np.zeros(FRAME_SIZE, np.float32)
    while emitted < total:
        frame, held = (held, None) if held is not None else (silence, None)
        keep = min(FRAME_SIZE, total - emitted)
        yield frame, keep
        emitted += keep


class OutputPcm:
    """Model PCM (24 kHz) -> `write` at `rate`, resampled with soxr on the way."""

    def __init__(self, write: Callable[[np.ndarray], None], rate: int = SAMPLE_RATE):
        self._write = write
        self._resampler = StreamResampler(SAMPLE_RATE, rate)

    @staticmethod
    def length(model_samples: int, rate: int) -> int:
        """How many samples `model_samples` at 24 kHz become at `rate`."""
        return resampled_length(model_samples, SAMPLE_RATE, rate)

    def write(self, pcm: np.ndarray) -> None:
        self._write(self._resampler.process(pcm))

    def close(self) -> None:
        self._write(self._resampler.flush())
