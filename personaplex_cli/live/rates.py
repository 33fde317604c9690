"""Device rate <-> model rate, for devices that refuse 24 kHz (`choose_samplerate`).

The stream, the jitter buffer, the input queue and the echo canceller all run at the
device's rate (so the far-end reference and the microphone stay sample-aligned); only the
cleaned microphone frames and the model's output cross rates here, with the project's soxr
`StreamResampler` and `Reframer` (docs/audio-io.md §4: soxr HQ emits variable-size chunks,
so the model side is re-framed to exactly 1920 samples).
"""

from __future__ import annotations

import numpy as np

from ..core.config import FRAME_SIZE, SAMPLE_RATE


class RateAdapter:
    """`to_model(block)` -> list of 1920-sample 24 kHz frames (possibly none);
    `to_device(frame)` -> the model's audio at the device rate (any length).

    At 24 kHz both directions are exact pass-throughs (and `to_model` still re-frames).
    """

    def __init__(self, device_rate: int, model_rate: int = SAMPLE_RATE, frame_size: int = FRAME_SIZE):
        # soxr loads only when a live session starts, not when the CLI imports this module.
        from ..audio.resample import Reframer, StreamResampler

        self.device_rate = device_rate
        self.model_rate = model_rate
        self.passthrough = device_rate == model_rate
        self._up = StreamResampler(device_rate, model_rate)
        self._down = StreamResampler(model_rate, device_rate)
        self._frames = Reframer(frame_size)

    def to_model(self, block: np.ndarray) -> list[np.ndarray]:
        self._frames.push(self._up.process(block))
        return self._frames.pop_frames()

    def to_device(self, frame: np.ndarray) -> np.ndarray:
        return self._down.process(frame)
