"""Recordings a live session writes as it goes, readable even if the process is killed.

`IncrementalWav` is a float32 WAV written frame by frame whose header is patched every
`header_every_s` of audio: a session ended by SIGKILL or a power cut leaves a valid file
up to the last patch (the data after it is still there; readers stop at the declared size).
A file that cannot seek (a FIFO) keeps the "size unknown" header and is read to its end.

`talk --record` is a stereo `IncrementalWav`: left, the caller as the model heard it (after
echo cancellation); right, the assistant. Both channels of frame t come from the same model
step, so the file replays exactly what the model was given and what it answered.
"""

from __future__ import annotations

import numpy as np

from ..audio.wav import WavWriter
from ..core.config import SAMPLE_RATE


class IncrementalWav:
    """float32 WAV of `channels` at `sample_rate` over an open binary file (the caller
    owns and closes the file); `write()` frames as they come, `close()` at the end."""

    def __init__(self, fileobj, channels: int = 2, sample_rate: int = SAMPLE_RATE,
                 header_every_s: float = 1.0):
        self._wav = WavWriter(fileobj, sample_rate, channels, "f32")
        self.channels = channels
        self.sample_rate = sample_rate
        self._patch_every = max(1, round(header_every_s * sample_rate))
        self._patched_at = 0
        self.frames = 0  # sample frames written

    def write(self, samples: np.ndarray) -> None:
        """[n] for mono, [n, channels] otherwise."""
        self._wav.write(samples)  # it flushes: the data is the kernel's, whatever happens next
        self.frames = self._wav.frames_written
        if self.frames - self._patched_at >= self._patch_every:
            self._wav.patch_header()
            self._patched_at = self.frames

    def write_stereo(self, left: np.ndarray, right: np.ndarray) -> None:
        self.write(np.stack([np.asarray(left, np.float32), np.asarray(right, np.float32)], 1))

    def close(self) -> None:
        """The header says the final length (when the file can seek)."""
        self._wav.close()

    @property
    def seconds(self) -> float:
        return self.frames / self.sample_rate
