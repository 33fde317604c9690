"""Loudness as every command reports it: RMS in dB relative to full scale (a full-scale
square wave is 0 dBFS), floored at one silence level so that digital zero prints a number."""

from __future__ import annotations

import math

SILENCE_DBFS = -120.0  # below 24-bit quantisation noise (-144 dBFS would never show)
# Louder than this counts as speaking: talk's level view, and serve's voice-activity measure
# on OpenAI's route (a caller's turns, and the stretches the model speaks).
SPEAKING_DBFS = -45.0


def dbfs(sum_squares: float, samples: int) -> float:
    """The level of `samples` samples whose squares add up to `sum_squares`."""
    if samples <= 0 or sum_squares <= 0:
        return SILENCE_DBFS
    return max(SILENCE_DBFS, 10.0 * math.log10(sum_squares / samples))
