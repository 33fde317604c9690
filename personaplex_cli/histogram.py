"""Percentiles of a run of any length in constant memory: step times for the runtime's
statistics, echo reduction in decibels for talk's canceller.

Only numpy and the standard library: talk's loop and view read it without loading torch.
"""

from __future__ import annotations

import math

import numpy as np


class Histogram:
    """Counts in fixed bins: the percentiles of a session of any length in constant memory
    (a list of every frame's figure would grow for as long as the session lasts)."""

    def __init__(self, edges: np.ndarray):
        self.edges = edges
        self.counts = np.zeros(len(edges) + 1, np.int64)
        self.total = 0

    @classmethod
    def durations_ms(cls) -> Histogram:
        """1 %-wide bins from 10 us to 1000 s."""
        return cls(np.geomspace(0.01, 1e6, int(math.log(1e8) / math.log(1.01)) + 1))

    @classmethod
    def decibels(cls) -> Histogram:
        """0.5 dB bins from -30 to +100 dB."""
        return cls(np.arange(-30.0, 100.25, 0.5))

    def add(self, value: float) -> None:
        self.counts[int(np.searchsorted(self.edges, value))] += 1
        self.total += 1

    def percentile(self, q: float) -> float | None:
        if not self.total:
            return None
        i = int(np.searchsorted(np.cumsum(self.counts), q / 100.0 * self.total))
        return float(self.edges[min(i, len(self.edges) - 1)])
