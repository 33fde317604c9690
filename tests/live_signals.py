"""Test signals for the live-audio tests (24 kHz mono float32)."""

from __future__ import annotations

import numpy as np

SR = 24000


def voice(seconds: float, f0: float, syllables_hz: float, seed: int, peak: float) -> np.ndarray:
    """Speech-like: gliding harmonics in syllables of random length and loudness, with
    pauses and noisy 'fricatives'; random enough that no stretch repeats another (a
    periodic test signal would let a misaligned echo reference look right)."""
    rng = np.random.default_rng(seed)
    n = int(seconds * SR)
    t = np.arange(n) / SR
    glide = np.cumsum(rng.standard_normal(n // 2400 + 2))
    pitch = f0 * (1 + 0.1 * np.interp(t, np.arange(len(glide)) * 0.1, glide / (1 + np.abs(glide).max())))
    phase = 2 * np.pi * np.cumsum(pitch) / SR
    tones = sum(a * np.sin(k * phase) for k, a in ((1, .5), (2, .3), (3, .2), (4, .1), (6, .06), (9, .03)))
    envelope = np.zeros(n)
    hiss = np.zeros(n)
    i = 0
    while i < n:
        length = int(SR * rng.uniform(0.4, 1.6) / (2 * syllables_hz))
        seg = np.sin(np.linspace(0, np.pi, length)) ** 0.7 * rng.uniform(0.3, 1.0)
        if rng.random() < 0.15:
            seg[:] = 0  # a pause
        envelope[i:i + length] = seg[:n - i]
        if rng.random() < 0.3:
            hiss[i:i + length] = 0.3 * rng.standard_normal(min(length, n - i))
        i += length
    x = (tones + hiss) * envelope
    return (peak * x / np.abs(x).max()).astype(np.float32)


def chirp(seconds: float = 1.0, f0: float = 200.0, f1: float = 4000.0, peak: float = 0.5) -> np.ndarray:
    """A faded linear sweep: its autocorrelation has one sharp peak, good for alignment."""
    t = np.arange(int(seconds * SR)) / SR
    x = np.sin(2 * np.pi * (f0 * t + (f1 - f0) * t ** 2 / (2 * seconds)))
    fade = np.minimum(1, np.minimum(t, seconds - t) / 0.02)
    return (peak * x * fade).astype(np.float32)


def find(haystack: np.ndarray, needle: np.ndarray) -> tuple[int, float]:
    """(offset, normalised correlation) of the best match of `needle` in `haystack` (FFT)."""
    n = len(haystack) + len(needle)
    size = 1 << (n - 1).bit_length()
    corr = np.fft.irfft(np.fft.rfft(haystack, size) * np.conj(np.fft.rfft(needle, size)), size)
    corr = corr[:len(haystack) - len(needle) + 1]
    off = int(np.argmax(np.abs(corr)))
    seg = haystack[off:off + len(needle)].astype(np.float64)
    denom = np.sqrt(np.dot(seg, seg) * np.dot(needle.astype(np.float64), needle))
    return off, float(corr[off] / denom) if denom else 0.0
