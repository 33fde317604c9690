"""Acoustic echo cancellation for `talk` on laptop speakers: WebRTC AEC3 via pywebrtc-audio.

Why pywebrtc-audio (measured, 24 kHz, espeak-ng speech): it and livekit's
`rtc.AudioProcessingModule` wrap the same AEC3 and cancel alike (synthetic 30-45 ms taps:
ERLE 44.2 vs 45.2 dB, caller -2.9 vs -3.2 dB in double talk; PulseAudio loopback: ~52 dB
once converged, both), but pywebrtc-audio is a 0.44 MB wheel needing only numpy (livekit:
11.9 MB + protobuf, aiofiles, types-protobuf), takes float32 frames of whole 10 ms blocks at
24 kHz (livekit: int16 frames of exactly 10 ms), costs 0.13 ms per 10 ms block (livekit
0.22) and imports in 2 ms (livekit 100). Both Apache-2.0. Its bare `EchoCanceller` class
refuses 24 kHz, hence `AudioProcessor` with echo cancellation only: the model should hear
the microphone as it is, less the echo (no noise suppression, no gain control).

Why a delay line of our own in front of AEC3: its delay estimator finds bulk delays up to
~450 ms only (600 ms: not cancelled at all), it takes ~5 s to follow a jump of the delay
(PulseAudio shifts output against input by a block after a late callback), and it ignores
`stream_delay_ms` for alignment. Following the caller's estimate (PortAudio's timestamps)
raised ERLE over 22 s on the loopback, one such jump included, from 17 to 43 dB.
AEC3 delays the microphone signal by ~9.3 ms (224 samples at 24 kHz).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from ..core.config import SAMPLE_RATE
from .errors import EchoCancellerMissing
from .jitter import _ring_read, _ring_write

_FAR_ACTIVE_DBFS = -50.0  # far-end frames quieter than this don't count for the estimate
MAX_DELAY_MS = 2000


def _load_library():
    # Imported here, not at module load: `talk --no-echo-cancel` and every other command must
    # work without the package, and the import is paid only when echo cancellation is used.
    try:
        import pywebrtc_audio
    except ImportError as e:
        raise EchoCancellerMissing(
            "echo cancellation needs the pywebrtc-audio package (pip install pywebrtc-audio);"
            " or pass --no-echo-cancel (e.g. with headphones)") from e
    return pywebrtc_audio


class EchoCanceller:
    """Remove the speaker's echo from the microphone, frame by frame (not thread-safe).

    `process(near, far)` takes the microphone frame and the far-end reference for the same
    sample positions (float32, same length, a whole number of 10 ms blocks: 1920 samples at
    24 kHz is 8 blocks) and returns the cleaned frame.

    `delay_ms` is the caller's estimate of the time from handing a sample to the output until
    its echo is captured (`DuplexStream.echo_delay_ms`; 0 when unknown: AEC3 then searches
    up to ~450 ms by itself). The reference is delayed by `delay_ms - margin_ms`; the margin
    keeps it ahead of the echo when the estimate is a little high (a reference that comes
    after its echo cannot cancel it). Changes of less than `follow_ms` are ignored: the
    per-callback estimate wobbles by a few ms and each shift costs the filter some accuracy.

    `echo_reduction_db` is a running display figure: input vs output energy over the last
    second's frames where the far end was active (None when it was silent); double talk
    lowers it, as it should.
    """

    def __init__(self, sample_rate: int = SAMPLE_RATE, delay_ms: float = 0.0, *,
                 margin_ms: float = 60.0, follow_ms: float = 20.0,
                 window_s: float = 1.0, frame_ms: float = 80.0):
        if sample_rate % 100:
            raise ValueError(f"the echo canceller needs a rate with whole 10 ms blocks, got {sample_rate}")
        self._lib = _load_library()
        self.sample_rate = sample_rate
        self.block = sample_rate // 100
        self.margin_ms = float(margin_ms)
        self.follow_ms = float(follow_ms)
        self._ap = self._lib.AudioProcessor(
            sample_rate=sample_rate, num_channels=1, echo_cancellation=True,
            noise_suppression=False, auto_gain_control=False)
        # Far-end history for the delay line: the longest delay plus a generous frame.
        self._far = np.zeros(int(sample_rate * (MAX_DELAY_MS + 500) / 1000), np.float32)
        self._far_pos = 0  # samples of far end seen so far
        self._delay_ms = 0.0  # the caller's latest estimate
        self._applied_ms: float | None = None  # the estimate the delay line follows
        self._shift = 0  # the delay line, in samples
        self.delay_ms = delay_ms
        # (near-in energy, near-out energy) per frame where the far end was active, or None.
        self._history: deque = deque(maxlen=max(1, int(round(window_s * 1000 / frame_ms))))
        self._far_floor = self.block * 10 ** (_FAR_ACTIVE_DBFS / 10)  # energy per 10 ms block

    @property
    def delay_ms(self) -> float:
        """The caller's echo delay estimate in ms; may be set before every frame."""
        return self._delay_ms

    @delay_ms.setter
    def delay_ms(self, value: float) -> None:
        value = float(value)
        if not 0.0 <= value <= MAX_DELAY_MS:
            raise ValueError(f"echo delay must be between 0 and {MAX_DELAY_MS} ms, got {value:.0f}")
        self._delay_ms = value
        if self._applied_ms is None or abs(value - self._applied_ms) > self.follow_ms:
            self._applied_ms = value
            self._shift = int(round(max(0.0, value - self.margin_ms) * self.sample_rate / 1000))
            # A hint only (AEC3 aligns by itself): the delay it still has to find.
            self._ap.stream_delay_ms = int(round(value - self._shift * 1000 / self.sample_rate))

    @property
    def reference_delay_ms(self) -> float:
        """How much the far-end reference is delayed before AEC3 sees it."""
        return 1000.0 * self._shift / self.sample_rate

    def process(self, near: np.ndarray, far: np.ndarray) -> np.ndarray:
        """Cleaned microphone frame (float32, same length as `near`)."""
        near = np.ascontiguousarray(near, dtype=np.float32).reshape(-1)
        far = np.ascontiguousarray(far, dtype=np.float32).reshape(-1)
        n = len(near)
        if len(far) != n:
            raise ValueError(f"near and far frames differ in length: {n} vs {len(far)}")
        if n == 0 or n % self.block:
            raise ValueError(f"frames must be whole {self.block}-sample (10 ms) blocks, got {n}")
        if n > len(self._far) - self._shift:
            raise ValueError(f"frames of {n} samples are too long for the echo canceller")
        _ring_write(self._far, self._far_pos, far)
        self._far_pos += n
        reference = np.zeros(n, np.float32)
        start = self._far_pos - n - self._shift  # positions before 0 are silence
        if start + n > 0:
            lo = max(start, 0)
            _ring_read(self._far, lo, reference[lo - start:])
        # One call per frame: the library splits it into 10 ms blocks itself (measured
        # identical to feeding the 8 blocks one by one, with 8 times fewer Python calls).
        out = self._ap.process(near, reference)
        if float(np.dot(reference, reference)) > self._far_floor * (n // self.block):
            self._history.append((float(np.dot(near, near)), float(np.dot(out, out))))
        else:
            self._history.append(None)
        return out

    @property
    def echo_reduction_db(self) -> float | None:
        """Near-in vs near-out energy over the last second's far-active frames, in dB."""
        active = [h for h in self._history if h is not None]
        if not active:
            return None
        e_in = sum(h[0] for h in active)
        e_out = sum(h[1] for h in active)
        if e_in <= 0.0:
            return None
        return 10.0 * float(np.log10(e_in / max(e_out, e_in * 1e-10)))

    def reset(self) -> None:
        """Forget the echo path, the far-end history and the estimate (keeps the delay)."""
        self._ap.reset()
        self._ap.stream_delay_ms = int(round(self._delay_ms - self.reference_delay_ms))
        self._far[:] = 0.0
        self._history.clear()
