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

Why a detector of our own in front of it (`EchoPathDetector`): until AEC3 has evidence of
an echo path, its suppressor assumes one as loud as the far end and removes the caller
while the assistant speaks, for about 8 s after the start, and for good with headphones
until its own transparent mode engages. Measured in-process (24 kHz, speech-like far end
at peak 0.5, caller at 0.3, no echo in the microphone): the caller came out at -21 to
-34 dB in seconds 1-4, -8 dB in 5-8, -0.4 dB in 9-12; livekit's AEC3 (the other binding,
whose module exposes no more settings than this one: no transparent mode, no suppressor
tuning) alike, -22 to -36, -9, -1.2 dB, and it takes more of the caller when there is
an echo (-6.3 and -9.6 dB in double talk, against -0.7 and -2.8 dB here, at echo gains
0.3 and 0.6). So AEC3 always runs (it converges on an echo path whenever there is one),
but the model hears its output only once the detector has found an echo of the far end
in the microphone; until then, and with headphones all along, the microphone as it is.
With an echo path AEC3 kept the caller at -1.5 to -2.2 dB in double talk (-4.2 dB in the
first seconds of a loud echo). bench/echo_paths.py measures the three side by side.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from ..core.config import SAMPLE_RATE
from ..errors import EchoCancellerMissing
from .jitter import ring_read, ring_write

_FAR_ACTIVE_DBFS = -50.0  # far-end frames quieter than this don't count for the estimate
MAX_DELAY_MS = 2000
AEC3_DELAY_S = 0.0093  # AEC3's own delay of the microphone (8-9.7 ms at 16-48 kHz)


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


class EchoPathDetector:
    """Whether the far end comes back in the microphone, judged every 160 ms on the last
    second of both (the reference given is already delayed by the caller's estimate, less
    a margin), at 8 kHz (what speech needs; a tenth of the cost).

    Two measures. The lag: the peak of the cross-correlation over 0 to `search_ms`, with
    the cross-spectrum and its magnitude averaged over evaluations before the phase
    transform, so that an echo, which keeps its phase from one second to the next, adds
    up. Then `explained`: the share of the microphone's power that the reference, aligned
    at that lag, explains linearly (magnitude-squared coherence over 64 ms segments,
    weighted by the microphone's spectrum): near 1 for an echo alone, its share of the
    power in double talk, near 0 without an echo (1/segments, about 0.05, by chance). A
    score of correlation peaks alone is not enough: on two harmonic voices it peaked at
    38 robust sigmas without any echo, whenever their harmonics met; they carry little of
    the power. Measured on speech-like signals without an echo, with the caller speaking
    over the far end: `explained` at most 0.40 (0.05-0.24 in 23 of 24 cases); with an echo
    at -20 or -30 dB of the far end, 0.99 in the median, whenever the caller pauses.

    An echo path is found on two consecutive evaluations with `explained` of at least
    FOUND at the same lag, and lost after LOST_S of far-end activity without KEEP.
    `echo_alone` says the last half second held the echo and no caller (ALONE).
    """

    FOUND = 0.6
    KEEP = 0.3
    ALONE = 0.8
    LOST_S = 5.0
    RATE = 8000
    SEGMENT = 512  # samples at RATE: 64 ms, halves overlapping
    SMOOTHING = 0.3  # weight of the newest window in the averaged cross-spectrum

    def __init__(self, sample_rate: int, window_s: float = 1.0, search_ms: float = 500.0,
                 every_s: float = 0.16):
        self.step = max(1, sample_rate // self.RATE)  # decimation by block means
        self.rate = sample_rate / self.step
        self.window = int(window_s * self.rate)
        self.search = int(search_ms * self.rate / 1000)
        self.every = max(1, int(every_s * self.rate))
        self._size = 2 * self.window + self.search  # a linear correlation; 5-smooth at 8 kHz
        self._near = np.zeros(self.window, np.float32)
        self._far = np.zeros(self.window + self.search, np.float32)
        self._filled = 0
        self._due = self.window
        self._cross = None  # averaged cross-spectrum
        self._magnitude = None  # ... and its magnitude
        hop = self.SEGMENT // 2
        count = (self.window - self.SEGMENT) // hop + 1
        self._segments = np.arange(self.SEGMENT)[None, :] + hop * np.arange(count)[:, None]
        self._taper = np.hanning(self.SEGMENT).astype(np.float32)
        self._far_floor = 10 ** (_FAR_ACTIVE_DBFS / 10)
        self._last_lag: int | None = None
        self._quiet_s = 0.0  # far-active time without KEEP, while found
        self.found = False
        self.explained = 0.0  # the latest evaluation's
        self._explained_lately = 0.0  # ... over the newer half of its window
        self.lag_ms: float | None = None  # the latest evaluation's lag behind the reference

    @property
    def echo_alone(self) -> bool:
        """The last half second held the echo and no caller (its half of the segments
        alone: the caller's onset shows sooner)."""
        return self.found and self._explained_lately >= self.ALONE

    def add(self, near: np.ndarray, reference: np.ndarray) -> None:
        """Another stretch of microphone and reference, the same positions (any length)."""
        n = len(near) // self.step * self.step
        if n == 0:
            return
        near8 = near[:n].reshape(-1, self.step).mean(1)
        far8 = reference[:n].reshape(-1, self.step).mean(1)
        k = len(near8)
        self._near = np.concatenate([self._near[k:], near8])[-self.window:]
        self._far = np.concatenate([self._far[k:], far8])[-(self.window + self.search):]
        self._filled += k
        while self._filled >= self._due:
            self._due += self.every
            self._evaluate()

    def _lag(self) -> int:
        """The averaged phase-transformed cross-correlation's peak, in samples at RATE."""
        spectrum = np.fft.rfft(self._far, self._size) * np.conj(np.fft.rfft(self._near, self._size))
        magnitude = np.abs(spectrum)
        if self._cross is None:
            self._cross, self._magnitude = spectrum, magnitude
        else:
            w = self.SMOOTHING
            self._cross = (1 - w) * self._cross + w * spectrum
            self._magnitude = (1 - w) * self._magnitude + w * magnitude
        floor = 1e-9 * float(self._magnitude.max()) + 1e-30
        # At index k the microphone at t meets the reference at t - (search - k).
        corr = np.fft.irfft(self._cross / (self._magnitude + floor), self._size)
        return self.search - int(np.argmax(np.abs(corr[:self.search + 1])))

    def _explained(self, lag: int) -> tuple[float, float]:
        """(over the whole window, over its newer half)"""
        aligned = self._far[self.search - lag:self.search - lag + self.window]
        near = np.fft.rfft(self._near[self._segments] * self._taper, axis=1)
        far = np.fft.rfft(aligned[self._segments] * self._taper, axis=1)

        def share(rows: slice) -> float:
            near_power = (np.abs(near[rows]) ** 2).sum(0)
            far_power = (np.abs(far[rows]) ** 2).sum(0)
            cross = np.abs((near[rows] * np.conj(far[rows])).sum(0)) ** 2
            coherence = cross / (near_power * far_power + 1e-30)
            return float((coherence * near_power).sum() / (near_power.sum() + 1e-30))

        return share(slice(None)), share(slice(len(near) // 2, None))

    def _evaluate(self) -> None:
        recent = self._far[self.search:]
        if float(np.dot(recent, recent)) < self._far_floor * self.window:
            return  # the far end is silent: nothing to learn
        lag = self._lag()
        self.explained, self._explained_lately = self._explained(lag)
        self.lag_ms = 1000.0 * lag / self.rate
        steady = self._last_lag is not None and abs(lag - self._last_lag) <= 0.002 * self.rate
        if self.explained >= self.FOUND and steady:
            self.found = True
        if self.found:
            self._quiet_s = 0.0 if self.explained >= self.KEEP else \
                self._quiet_s + self.every / self.rate
            if self._quiet_s > self.LOST_S:
                self.found = False
        self._last_lag = lag if self.explained >= self.FOUND else None


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

    What comes out is AEC3's output once `EchoPathDetector` has found an echo path
    (`echo_path`), and until then the microphone as it is (delayed as AEC3 delays it, so
    that the switch, a crossfade over one frame, moves nothing in time).

    `echo_reduction_db` is the echo's reduction only: microphone in vs AEC3's output over
    the last second's frames in which the assistant spoke and the caller did not (the
    detector's `echo_alone`), while an echo path is found; None otherwise.
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
        # (near-in energy, near-out energy) per echo-only frame, or None.
        self._history: deque = deque(maxlen=max(1, int(round(window_s * 1000 / frame_ms))))
        self._far_floor = self.block * 10 ** (_FAR_ACTIVE_DBFS / 10)  # energy per 10 ms block
        self.detector = EchoPathDetector(sample_rate)
        self._passing = False  # AEC3's output goes out (an echo path is found)
        self._bypass = np.zeros(int(round(AEC3_DELAY_S * sample_rate)), np.float32)

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
        ring_write(self._far, self._far_pos, far)
        self._far_pos += n
        reference = np.zeros(n, np.float32)
        start = self._far_pos - n - self._shift  # positions before 0 are silence
        if start + n > 0:
            lo = max(start, 0)
            ring_read(self._far, lo, reference[lo - start:])
        # One call per frame: the library splits it into 10 ms blocks itself (measured
        # identical to feeding the 8 blocks one by one, with 8 times fewer Python calls).
        # Always run, so that it has converged by the time an echo path is found.
        cleaned = self._ap.process(near, reference)
        self.detector.add(near, reference)
        as_is = np.concatenate([self._bypass, near])
        self._bypass, as_is = as_is[n:], as_is[:n]
        passing = self.detector.found
        out = cleaned if passing else as_is
        if passing != self._passing:
            fade = np.linspace(0.0, 1.0, n, dtype=np.float32)
            out = (cleaned * fade + as_is * (1 - fade)) if passing else \
                (as_is * fade + cleaned * (1 - fade))
            self._passing = passing
        far_active = float(np.dot(reference, reference)) > self._far_floor * (n // self.block)
        if passing and far_active and self.detector.echo_alone:
            self._history.append((float(np.dot(near, near)), float(np.dot(cleaned, cleaned))))
        else:
            self._history.append(None)
        return out

    @property
    def echo_path(self) -> bool:
        """Whether an echo path is found (AEC3's output goes out) or not (the microphone)."""
        return self._passing

    @property
    def echo_reduction_db(self) -> float | None:
        """Microphone in over AEC3's output, in dB: the median over the last second's
        echo-only frames (a frame the caller began in does not move it)."""
        ratios = [10.0 * float(np.log10(e_in / max(e_out, e_in * 1e-10)))
                  for e_in, e_out in (h for h in self._history if h is not None) if e_in > 0]
        return float(np.median(ratios)) if ratios else None

    def reset(self) -> None:
        """Forget the echo path, the far-end history and the estimate (keeps the delay)."""
        self._ap.reset()
        self._ap.stream_delay_ms = int(round(self._delay_ms - self.reference_delay_ms))
        self._far[:] = 0.0
        self._history.clear()
        self.detector = EchoPathDetector(self.sample_rate)
        self._passing = False
